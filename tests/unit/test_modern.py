"""The modern block (GPTConfig's rope, norm, mlp, n_kv_head, qk_norm; model.py): each switch alone and all
together against the manual reference on every CPU backend (forward and backward in float64), RoPE against a
complex-number reference, generation from every cache, parameter names and counts, bad values as one error
line, and checkpoints that keep the switches (old ones load as GPT-2)."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import re
import warnings

import pytest
import torch

import kernels
import model
import sample
import train
from data.common import read_meta
from errors import UsageError
from generation import generate, kv_cache
from generation.loop import forward_cached, generation_attention, make_cache
from helpers import stand_in_flash, stand_in_flash_module, tiny_args, tiny_config
from model import GPT, AttentionUse, GPTConfig, Rotary, apply_rotary, mlp_hidden_size
from training import preflight
from weights.load import load_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")

ALL = dict(rope=True, norm="rmsnorm", mlp="swiglu", n_kv_head=2, qk_norm=True)
SWITCHES = {
    "rope": dict(rope=True),
    "rmsnorm": dict(norm="rmsnorm"),
    "swiglu": dict(mlp="swiglu"),
    "gqa": dict(n_kv_head=2),
    "mqa": dict(n_kv_head=1),
    "qk_norm": dict(qk_norm=True),
    "all": ALL,
    "all_mqa": {**ALL, "n_kv_head": 1},
}


def modern_model(seed=0, **overrides) -> GPT:
    """1 layer, 4 heads of 16 (flex_attention takes no smaller head), context 16."""
    torch.manual_seed(seed)
    return GPT(tiny_config(n_layer=1, n_head=4, n_embd=64, block_size=16, **overrides))


def with_backend(gpt: GPT, name: str, **overrides) -> GPT:
    """The same weights under another attention backend."""
    other = GPT(dataclasses.replace(gpt.config, attention_backend=name, **overrides)).to(gpt.lm_head.weight.dtype)
    other.load_state_dict(gpt.state_dict())
    return other.train(gpt.training)


def tokens(*shape, seed=1):
    return torch.randint(0, 64, shape, generator=torch.Generator().manual_seed(seed))


def documents(B, T):
    """doc_ids with documents of different lengths per row."""
    return torch.stack([torch.arange(T) // (3 + b) for b in range(B)])


def rel_err(out, ref) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def forward_backward(gpt: GPT, idx, doc_ids):
    """Logits and every parameter's gradient of a random projection of them (all logits, not only the loss)."""
    gpt.zero_grad()
    logits, _ = gpt(idx, idx, doc_ids)
    # drawn in float32 whatever the logits' dtype: a bfloat16 draw is another sequence, not a rounding of this one
    weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(3))
    weights = weights.to(logits.device, logits.dtype)
    (logits * weights).sum().backward()
    return logits.detach(), {name: p.grad.clone() for name, p in gpt.named_parameters()}


# ---- every switch against the manual reference ---------------------------------------------------


def assert_same(logits, grads, ref_logits, ref_grads, tolerance=1e-10):
    """Logits to `tolerance` relative; gradients relative to their overall size (some are exactly zero: a bias
    of k_norm shifts every score of a query alike, which softmax ignores)."""
    assert rel_err(logits, ref_logits) < tolerance
    scale = torch.cat([g.flatten() for g in ref_grads.values()]).norm()
    for name, grad in grads.items():
        assert (grad - ref_grads[name]).norm() < tolerance * scale, name


SDPA_CASES = [(name, "sdpa") for name in SWITCHES] + [(name, "sdpa_math") for name in ("gqa", "mqa", "all")]


@pytest.mark.parametrize("docs", [False, True], ids=["causal", "documents"])
@pytest.mark.parametrize("switches, backend", SDPA_CASES, ids=[f"{name}-{b}" for name, b in SDPA_CASES])
def test_sdpa_matches_manual_forward_and_backward_in_float64(switches, backend, docs):
    """sdpa repeats grouped k/v heads on a CPU; its pinned math kernel takes them natively (enable_gqa)."""
    reference = modern_model(attention_backend="manual", **SWITCHES[switches]).double()
    pinned = dict(sdpa_kernel="math") if backend == "sdpa_math" else {}
    gpt = with_backend(reference, "sdpa", **pinned)
    idx, doc_ids = tokens(2, 16), documents(2, 16) if docs else None
    assert_same(*forward_backward(gpt, idx, doc_ids), *forward_backward(reference, idx, doc_ids))
    assert gpt.attention.resolution.used == "sdpa" and gpt.attention.use.documents == docs


@pytest.fixture
def eager_flex(monkeypatch):
    """flex_attention uncompiled (a CPU compile takes seconds per shape): the same masks, read by its eager
    reference."""
    from torch.nn.attention.flex_attention import flex_attention

    monkeypatch.setattr(kernels.flex, "compiled_flex_attention", lambda: flex_attention)  # training and prefill
    monkeypatch.setattr(kv_cache, "compiled_flex_attention", lambda: flex_attention)  # decode steps
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        yield


def test_flash_attn_takes_grouped_heads_natively_in_training_and_decoding(monkeypatch):
    """The flash-attn adapter hands k and v over with their own head count (B, T, H_kv, D), for flash_attn_func,
    the varlen kernel of packed documents and the KV cache decode kernel (a stand-in module on a CPU)."""
    calls, heads = [], set()
    module = stand_in_flash_module(calls)

    def spy(function):
        def call(q, k, v, *args, **kwargs):
            heads.add((q.size(-2), k.size(-2), v.size(-2)))
            return function(q, k, v, *args, **kwargs)

        return call

    for name in ("flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache"):
        setattr(module, name, spy(getattr(module, name)))
    stand_in_flash(monkeypatch, module)
    reference = modern_model(attention_backend="manual", **ALL).double()
    gpt = with_backend(reference, "flash_attn_2")
    for m in (gpt, reference):
        m.setup_attention("cpu", torch.float64, documents=True)  # a model set up for documents runs without too
    assert gpt.attention.resolution.used == "flash_attn_2"  # the stand-in
    idx = tokens(2, 16)
    for doc_ids in (None, documents(2, 16)):
        assert_same(*forward_backward(gpt, idx, doc_ids), *forward_backward(reference, idx, doc_ids))
    assert calls == ["prefill", "varlen"]
    gpt, reference = gpt.float().eval(), reference.float().eval()
    prompts = [tokens(n, seed=n) for n in (3, 9)]
    expected = generate(reference, prompts, 10, temperature=0, kv_cache="none")  # 9 + 10 > 16: slides
    for cache in ("contiguous", "paged"):
        out = generate(gpt, prompts, 10, temperature=0, kv_cache=cache, page_size=4)
        assert all(torch.equal(a, b) for a, b in zip(out, expected)), cache
        assert cache in calls
    assert heads == {(4, 2, 2)}  # 4 query heads, 2 key/value heads: never repeated before the kernel


# ---- RoPE ---------------------------------------------------------------------------------------


def test_rope_turns_each_pair_by_its_angle_for_positions_of_shape_t_or_b_t():
    """Against complex numbers: the pair (x_i, x_{i+D/2}) times exp(i·pos·theta^(-2i/D)). Positions of shape
    (B, T) give each row its own; (T,) gives all rows the same."""
    D, theta = 16, 500.0
    rotary = Rotary(D, 32, theta)
    x = torch.randn(2, 3, 5, D, dtype=torch.float64)
    pos = torch.tensor([[0, 1, 2, 3, 4], [20, 21, 22, 23, 31]])
    angles = pos[:, None, :, None].double() * theta ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    turned = torch.complex(x[..., : D // 2], x[..., D // 2 :]) * torch.polar(torch.ones_like(angles), angles)
    expected = torch.cat((turned.real, turned.imag), dim=-1)
    out = apply_rotary(x, rotary(pos))
    assert out.dtype == torch.float64 and rel_err(out, expected) < 1e-6  # the tables are float32
    for b in range(2):
        assert torch.equal(apply_rotary(x[b : b + 1], rotary(pos[b])), out[b : b + 1])


def test_rope_attention_depends_only_on_relative_positions():
    """A KV cache continues every row at its own positions (B, T): rows shifted by an offset attend alike."""
    gpt = modern_model(rope=True, n_kv_head=2).eval()
    gpt.setup_attention("cpu", torch.float32, training=False)
    idx = tokens(1, 6).expand(2, 6)
    q_pos = torch.arange(6) + torch.tensor([[0], [7]])  # (B, T): row 1 seven positions further on
    shifted = kv_cache.CacheMask(q_pos, q_pos[:, -1] + 1, 13, fresh=True)
    kernel = gpt.attention.kernel
    attends = [lambda q, k, v, s, p: kernel(q, k, v, s.chunk_mask, p)] * gpt.config.n_layer
    with torch.no_grad():
        logits = forward_cached(gpt, idx, shifted, attends)
    assert rel_err(logits[1], logits[0]) < 1e-5
    assert not torch.equal(gpt.rotary(shifted.q_pos)[0][0], gpt.rotary(shifted.q_pos)[0][1])


# ---- generation with every cache ------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["sdpa", "manual", "flex_attention"])
def test_greedy_generation_from_every_cache_equals_no_cache_with_all_switches(backend, eager_flex):
    """Prompts of different lengths (each row at its own positions), past block_size (the cache slides), eager
    and static decode steps, contiguous and paged caches; the caches hold n_kv_head heads. flex_attention runs
    inference only on a CPU: its prefill and its decode kernels over grouped heads are checked here."""
    gpt = with_backend(modern_model(**ALL), backend).eval()
    prompts = [tokens(n, seed=n) for n in (2, 7, 12)]
    expected = generate(gpt, prompts, 8, temperature=0, kv_cache="none")
    for cache in ("contiguous", "paged"):
        for static in (False, True) if backend != "flex_attention" else (False,):  # eager flex is slow: once
            out = generate(gpt, prompts, 8, temperature=0, kv_cache=cache, compile=static, page_size=4)
            assert all(torch.equal(a, b) for a, b in zip(out, expected)), (cache, static)
    decode = kv_cache.DECODE_KERNELS[backend]
    for cache in ("contiguous", "paged"):
        store = make_cache(gpt.config, prompts, 8, cache, decode, "cpu", torch.float32)
        assert store.k[0].shape[1 if cache == "contiguous" else 2] == 2  # n_kv_head, not n_head (4)


# ---- structure, counts, config --------------------------------------------------------------------


def gpt2_shapes(L, C, V, T) -> dict[str, tuple]:
    """GPT-2's state_dict: names and shapes (lm_head is tied to wte)."""
    block = {
        "ln_1.weight": (C,),
        "ln_1.bias": (C,),
        "attn.c_attn.weight": (3 * C, C),
        "attn.c_attn.bias": (3 * C,),
        "attn.c_proj.weight": (C, C),
        "attn.c_proj.bias": (C,),
        "ln_2.weight": (C,),
        "ln_2.bias": (C,),
        "mlp.c_fc.weight": (4 * C, C),
        "mlp.c_fc.bias": (4 * C,),
        "mlp.c_proj.weight": (C, 4 * C),
        "mlp.c_proj.bias": (C,),
    }
    shapes = {"transformer.wte.weight": (V, C), "transformer.wpe.weight": (T, C)}
    shapes |= {f"transformer.h.{i}.{name}": shape for i in range(L) for name, shape in block.items()}
    return shapes | {"transformer.ln_f.weight": (C,), "transformer.ln_f.bias": (C,), "lm_head.weight": (V, C)}


def test_the_default_is_gpt2_and_the_switches_rename_only_what_they_add():
    gpt = GPT(tiny_config())
    assert {name: tuple(t.shape) for name, t in gpt.state_dict().items()} == gpt2_shapes(2, 32, 64, 32)
    modern = GPT(tiny_config(n_head=4, **ALL))  # head dim 8; 2 key/value heads; SwiGLU hidden 128
    expected = {name: shape for name, shape in gpt2_shapes(2, 32, 64, 32).items() if "wpe" not in name}
    expected = {name: shape for name, shape in expected.items() if not re.search(r"(ln_.|ln_f)\.bias", name)}
    for i in range(2):
        h = f"transformer.h.{i}"
        expected |= {f"{h}.attn.c_attn.weight": ((4 + 2 * 2) * 8, 32), f"{h}.attn.c_attn.bias": (64,)}
        expected |= {f"{h}.attn.q_norm.weight": (8,), f"{h}.attn.k_norm.weight": (8,)}
        expected |= {f"{h}.mlp.c_gate.weight": (128, 32), f"{h}.mlp.c_gate.bias": (128,)}
        expected |= {f"{h}.mlp.c_fc.weight": (128, 32), f"{h}.mlp.c_fc.bias": (128,)}
        expected |= {f"{h}.mlp.c_proj.weight": (32, 128)}
    assert {name: tuple(t.shape) for name, t in modern.state_dict().items()} == expected  # no rotary tables
    assert (
        modern.get_num_params()
        == modern.get_num_params(non_embedding=False)
        == sum(p.numel() for p in modern.parameters())
    )
    c = modern.config
    assert modern.flops_per_token(16) == 6 * modern.get_num_params() + 12 * c.n_layer * c.n_head * c.head_dim * 16


@pytest.mark.parametrize("switches", SWITCHES.values(), ids=SWITCHES)
def test_parameter_count_from_the_config_matches_the_model(switches):
    for config in (tiny_config(n_head=4, **switches), tiny_config(n_head=4, bias=False, mlp_hidden=40, **switches)):
        assert preflight.parameter_count(config) == sum(p.numel() for p in GPT(config).parameters())


def test_swiglu_hidden_width_is_8_3_of_the_width_rounded_up_to_64():
    assert [mlp_hidden_size("swiglu", n) for n in (32, 768, 4096)] == [128, 2048, 10944]
    assert mlp_hidden_size("gelu", 768) == 3072


BAD = [
    (("--n_kv_head=3",), "n_kv_head must be a positive integer that divides n_head (2), or None (= n_head); got 3"),
    (("--n_kv_head=0",), "n_kv_head must be a positive integer that divides n_head (2), or None (= n_head); got 0"),
    (("--norm=batchnorm",), "unknown norm 'batchnorm'; choose one of layernorm, rmsnorm"),
    (("--mlp=relu",), "unknown mlp 'relu'; choose one of gelu, swiglu"),
    (("--mlp_hidden=0",), "mlp_hidden must be a positive integer or None (its default); got 0"),
    (("--rope_theta=0",), "rope_theta must be a finite number > 0, got 0.0"),
    (("--rope_theta=-5",), "rope_theta must be a finite number > 0, got -5.0"),
    (("--rope=true", "--n_embd=34"), "head dim n_embd/n_head = 17 must be even"),
]


@pytest.mark.parametrize("args, message", BAD, ids=[" ".join(args) for args, _ in BAD])
def test_a_bad_switch_is_one_error_line_and_exit_2(tmp_path, capsys, args, message):
    assert train.main(tiny_args(tmp_path, tmp_path / "out", *args)) == 2
    err = capsys.readouterr().err
    assert err == f"error: {message}\n"
    assert not (tmp_path / "out").exists()


# ---- training and checkpoints ---------------------------------------------------------------------


def run(argv) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = train.main(argv)
    return code, out.getvalue(), err.getvalue()


def test_training_with_all_switches_lowers_the_loss_and_its_checkpoint_keeps_them(char_data, tmp_path):
    switches = ("--rope=true", "--norm=rmsnorm", "--mlp=swiglu", "--n_head=4", "--n_kv_head=2", "--qk_norm=true")
    out = tmp_path / "out"
    args = tiny_args(char_data, out, *switches, "--learning_rate=1e-2", "--warmup_iters=0", "--decay_lr=false")
    code, stdout, err = run([*args, "--max_iters=24", "--eval_interval=24", "--eval_on_start=false"])
    assert code == 0, err
    losses = [float(x) for x in re.findall(r"^iter \d+ \| loss (\d+\.\d+)", stdout, re.MULTILINE)]
    assert len(losses) == 24 and sum(losses[-4:]) < sum(losses[:4]) - 4 * 0.3, losses
    state = load_checkpoint(out / "ckpt.pt")
    assert {k: state["model_config"][k] for k in ALL} == ALL
    gpt, *_ = sample.load_model(sample.SampleConfig(checkpoint=str(out / "ckpt.pt")), torch.device("cpu"))
    assert gpt.config.rope and gpt.rotary is not None and "wpe" not in gpt.transformer
    # Resuming takes the checkpoint's model: a switch set against it is one line naming both values
    resume = [*tiny_args(char_data, out, "--init_from=resume", "--eval_interval=1"), "--n_head=4"]
    code, _, err = run([*resume, "--max_iters=25", "--rope=false", "--n_kv_head=4"])
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith("error: --rope=False conflicts with the checkpoint's rope=True, --n_kv_head=4 with its "), err
    code, _, err = run([*resume, "--max_iters=25"])  # the switches left out: the checkpoint's
    assert code == 0, err
    code, _, err = run([*args, "--init_from=resume", "--max_iters=26", "--eval_interval=26"])
    assert code == 0, err


def test_an_old_checkpoint_without_the_switches_loads_as_gpt2(char_data, tmp_path):
    gpt = GPT(tiny_config())
    config = {k: v for k, v in dataclasses.asdict(gpt.config).items() if k not in (*ALL, "rope_theta", "mlp_hidden")}
    state = {"model": gpt.state_dict(), "model_config": config, "meta": read_meta(char_data)}
    torch.save(state, tmp_path / "old.pt")
    loaded, *_ = sample.load_model(sample.SampleConfig(checkpoint=str(tmp_path / "old.pt")), torch.device("cpu"))
    assert loaded.config == dataclasses.replace(gpt.config, attention_backend="auto")
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), gpt.state_dict().values()))
    preflight.check_checkpoint_shape(gpt.config, config)  # the defaults are GPT-2's: the same model
    with pytest.raises(UsageError, match=r"rope=False \(config says True\)"):
        preflight.check_checkpoint_shape(GPTConfig(**{**config, "rope": True}), config)


# ---- GPU: every backend's native grouped heads ----------------------------------------------------

GPU_BACKENDS = ["sdpa", "sdpa_flash", "sdpa_efficient", "sdpa_cudnn", "flex_attention"]
GPU_BACKENDS += ["flash_attn_2", "flash_attn_3", "flash_attn_4", "manual"]


def gpu_model(backend: str, reference: GPT, need: AttentionUse) -> GPT:
    """reference's weights under `backend` (sdpa_KERNEL pins one SDPA kernel); skip where it cannot run."""
    name, _, kernel = backend.partition("_") if backend.startswith("sdpa_") else (backend, "", "")
    problem = model.BACKENDS[name].why_not(need)
    if problem:
        pytest.skip(problem)
    return with_backend(reference, name, **({"sdpa_kernel": kernel} if kernel else {}))


@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.usefixtures("allow_flex_recompiles")
def test_gpu_training_with_grouped_heads_matches_float32_manual(backend):
    """bf16 autocast, all switches, 8 query heads on 2 k/v heads of 64, with and without documents: logits and
    gradients against the float32 manual reference."""
    device = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    switches = {**ALL, "n_kv_head": 2}
    reference = GPT(tiny_config(n_head=8, n_embd=512, block_size=128, attention_backend="manual", **switches))
    reference = reference.to(device)
    need = AttentionUse(device, torch.bfloat16, 64, documents=True, training=True, seq_len=128)
    gpt = gpu_model(backend, reference, need).to(device)
    reference.setup_attention(device, torch.float32, documents=True)  # each runs with and without doc_ids
    gpt.setup_attention(device, torch.bfloat16, documents=True)  # autocast's dtype
    idx = tokens(2, 128).to(device)
    for doc_ids in (None, documents(2, 128).to(device)):
        ref_logits, ref_grads = forward_backward(reference, idx, doc_ids)
        with torch.autocast("cuda", torch.bfloat16):
            logits, grads = forward_backward(gpt, idx, doc_ids)
        assert_same(logits, grads, ref_logits, ref_grads, tolerance=3e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("cache", ["contiguous", "paged"])
@pytest.mark.parametrize("backend", ["sdpa", "flex_attention", "flash_attn_2", "flash_attn_3", "manual"])
@pytest.mark.usefixtures("allow_flex_recompiles")
def test_gpu_decoding_with_grouped_heads_matches_a_float32_full_forward(backend, cache):
    """bf16, all switches (MQA and GQA): prefill, a chunk, then single tokens from a cache of n_kv_head heads,
    each row at its own positions, against the float32 uncached forward."""
    device = torch.device("cuda", torch.cuda.current_device())
    for n_kv_head in (1, 2):
        torch.manual_seed(0)
        switches = {**ALL, "n_kv_head": n_kv_head}
        reference = GPT(tiny_config(n_head=4, n_embd=256, block_size=64, attention_backend="manual", **switches))
        reference = reference.to(device).eval()
        need = AttentionUse(device, torch.bfloat16, 64, training=False, kv_cache=cache)
        gpt = gpu_model(backend, reference, need).to(device, torch.bfloat16).eval()
        prompts = [tokens(n, seed=n).to(device) for n in (5, 30, 17)]
        need = gpt.attention_use(device, torch.bfloat16, training=False, kv_cache=cache)
        attention, decode = generation_attention(gpt, need)
        assert attention.resolution.used == backend
        store = make_cache(gpt.config, prompts, 40, cache, decode, device, torch.bfloat16)
        assert store.k[0].shape[1 if cache == "contiguous" else 2] == n_kv_head
        attends = store.attends(attention.kernel, decode.run)
        idx = torch.stack([torch.cat((p, tokens(64 - len(p), seed=9).to(device))) for p in prompts])  # (3, 64)
        with torch.no_grad():
            full = torch.stack([reference(idx[b : b + 1], idx[b : b + 1])[0][0] for b in range(3)])  # (3, 64, V)
            lengths = [len(p) for p in prompts]
            logits = forward_cached(gpt, idx[:, :30], store.prefill(lengths, 30), attends)
            rows = torch.arange(3)
            assert rel_err(logits.float(), full[rows, torch.tensor(lengths) - 1]) < 2e-2
            for t in range(20):  # each row continues from its own length
                step = store.extend(1)
                logits = forward_cached(gpt, idx[rows, step.q_pos[:, 0].cpu()][:, None], step, attends)
                assert rel_err(logits.float(), full[rows, step.q_pos[:, 0].cpu()]) < 2e-2, (n_kv_head, t)


@pytest.mark.gpu
def test_gpu_compiled_training_with_all_switches(char_data, tmp_path):
    """train.py on CUDA with torch.compile, bf16 and every switch: the compiled graph takes RoPE's tables, the
    norms, SwiGLU and grouped heads, and the loss goes down."""
    switches = ("--rope=true", "--norm=rmsnorm", "--mlp=swiglu", "--n_head=4", "--n_kv_head=1", "--qk_norm=true")
    args = [*tiny_args(char_data, tmp_path / "out", *switches), "--device=cuda", "--compile=true"]
    code, stdout, err = run([*args, "--max_iters=30", "--eval_interval=30", "--learning_rate=1e-2"])
    assert code == 0, err
    losses = [float(x) for x in re.findall(r"^iter \d+ \| loss (\d+\.\d+)", stdout, re.MULTILINE)]
    assert sum(losses[-4:]) < sum(losses[:4]), losses
