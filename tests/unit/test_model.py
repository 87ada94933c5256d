"""The GPT-2 model of model.py: structure, init, forward/loss, helpers for training, generation,
documents in packed rows, `python -m kernels` and the GPU smoke tests."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import generation  # noqa: F401  (registers paged_attention, the paged KV cache's name)
import kernels  # noqa: F401  (registers flash_attn_3/4 and flex_attention)
import model
from generation.loop import generation_attention
from helpers import tiny_config
from kernels.report import attention_report
from model import GPT, AttentionUse, GPTConfig

REPO = Path(__file__).resolve().parents[2]

ALL_NAMES = ("auto", *model.BACKENDS) + tuple(model.aliases())
MODEL_BACKENDS = ("flash_attn_2", "sdpa", "manual")  # model.py's own; kernels/ and generation/ add the others


def tiny_model(seed=0, **overrides) -> GPT:
    torch.manual_seed(seed)
    return GPT(tiny_config(**overrides))


def tokens(B, T, vocab=64, seed=1, device="cpu"):
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed)).to(device)


def hand_param_count(c: GPTConfig) -> tuple[int, int]:
    """(all, without wpe), counted from GPT-2's layout; the tied lm_head adds nothing."""
    C = c.n_embd
    per_layer = 2 * C + (3 * C * C + 3 * C) + (C * C + C) + 2 * C + (4 * C * C + 4 * C) + (4 * C * C + C)
    total = c.vocab_size * C + c.block_size * C + c.n_layer * per_layer + 2 * C
    return total, total - c.block_size * C


# ---- config validation -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(n_embd=30, n_head=4), r"n_embd \(30\) must be divisible by n_head \(4\)"),
        (dict(n_embd=6, n_head=2), "head dim n_embd/n_head = 3 must be even"),
        (dict(n_layer=0), "n_layer must be a positive integer, got 0"),
        (dict(n_head=-2), "n_head must be a positive integer, got -2"),
        (dict(n_embd=0), "n_embd must be a positive integer, got 0"),
        (dict(block_size=0), "block_size must be a positive integer, got 0"),
        (dict(vocab_size=-1), "vocab_size must be a positive integer, got -1"),
        (dict(n_layer=2.0), "n_layer must be a positive integer, got 2.0"),
        (dict(n_layer=True), "n_layer must be a positive integer, got True"),
        (dict(dropout=-0.1), r"dropout must be in \[0, 1\), got -0.1"),
        (dict(dropout=1.0), r"dropout must be in \[0, 1\), got 1.0"),
        (dict(sdpa_kernel="fast"), "unknown sdpa_kernel 'fast'; choose one of auto, flash, cudnn, efficient, math"),
    ],
)
def test_config_validation(overrides, message):
    with pytest.raises(ValueError, match=message):
        tiny_config(**overrides)


def test_valid_config_keeps_values():
    c = tiny_config(dropout=0.5, sdpa_kernel="math", attention_backend="Eager")
    assert (c.dropout, c.sdpa_kernel, c.attention_backend, c.head_dim) == (0.5, "math", "manual", 16)


# ---- backend names, aliases, deprecation -------------------------------------------------------


@pytest.mark.parametrize("alias, canonical", sorted(model.aliases().items()))
def test_aliases_map_to_canonical_names(alias, canonical):
    assert tiny_config(attention_backend=alias).attention_backend == canonical
    assert tiny_config(attention_backend=alias.upper()).attention_backend == canonical
    assert model.canonical_backend(alias) == canonical


def test_canonical_names_map_to_themselves():
    for name in ("auto", *model.BACKENDS):
        assert model.canonical_backend(name) == name


@pytest.mark.parametrize("value, backend", [(True, "flash_attn_2"), (False, "manual")])
def test_use_flash_attention_is_deprecated(value, backend):
    with pytest.warns(DeprecationWarning, match="use_flash_attention is deprecated"):
        config = tiny_config(use_flash_attention=value)
    assert config.attention_backend == backend and config.use_flash_attention is None


def test_unknown_backend_name_lists_every_choice():
    for make in (
        lambda: tiny_config(attention_backend="flash"),
        lambda: model.resolve("flash", AttentionUse("cpu", torch.float32)),
    ):
        with pytest.raises(ValueError, match="unknown attention_backend 'flash'") as info:
            make()
        for name in ALL_NAMES:
            assert name in str(info.value)


# ---- structure and init ----------------------------------------------------------------------


def test_gpt2_parameter_names_and_shapes():
    gpt = tiny_model(n_layer=2)
    shapes = {name: tuple(p.shape) for name, p in gpt.named_parameters()}
    C, V, T = 32, 64, 32
    expected = {
        "transformer.wte.weight": (V, C),
        "transformer.wpe.weight": (T, C),
        "transformer.h.0.ln_1.weight": (C,),
        "transformer.h.0.ln_1.bias": (C,),
        "transformer.h.0.attn.c_attn.weight": (3 * C, C),
        "transformer.h.0.attn.c_attn.bias": (3 * C,),
        "transformer.h.0.attn.c_proj.weight": (C, C),
        "transformer.h.0.attn.c_proj.bias": (C,),
        "transformer.h.0.ln_2.weight": (C,),
        "transformer.h.0.ln_2.bias": (C,),
        "transformer.h.0.mlp.c_fc.weight": (4 * C, C),
        "transformer.h.0.mlp.c_fc.bias": (4 * C,),
        "transformer.h.0.mlp.c_proj.weight": (C, 4 * C),
        "transformer.h.0.mlp.c_proj.bias": (C,),
        "transformer.h.1.attn.c_attn.weight": (3 * C, C),
        "transformer.ln_f.weight": (C,),
        "transformer.ln_f.bias": (C,),
    }
    for name, shape in expected.items():
        assert shapes.get(name) == shape, name
    assert len(shapes) == 2 + 12 * 2 + 2  # wte, wpe, 12 tensors per block, ln_f (lm_head is tied)
    assert "lm_head.weight" in gpt.state_dict()


def test_no_bias_config_has_no_biases():
    gpt = tiny_model(bias=False)
    assert not [n for n, _ in gpt.named_parameters() if n.endswith(".bias")]
    assert torch.isfinite(gpt(tokens(2, 8), tokens(2, 8, seed=2))[1])


def test_lm_head_is_tied_to_wte():
    gpt = tiny_model()
    assert gpt.lm_head.weight is gpt.transformer.wte.weight
    assert gpt.lm_head.weight.data_ptr() == gpt.transformer.wte.weight.data_ptr()
    with torch.no_grad():
        gpt.transformer.wte.weight[3, 5] = 7.0
    assert gpt.lm_head.weight[3, 5].item() == 7.0


def test_init_std_and_scaled_residual_projections():
    torch.manual_seed(0)
    n_layer = 4
    gpt = GPT(GPTConfig(block_size=256, vocab_size=1024, n_layer=n_layer, n_head=4, n_embd=256))
    residual_std = 0.02 / math.sqrt(2 * n_layer)
    for name, p in gpt.named_parameters():
        if name.endswith("c_proj.weight"):
            assert p.std().item() == pytest.approx(residual_std, rel=0.03), name
        elif p.dim() == 2:
            assert p.std().item() == pytest.approx(0.02, rel=0.03), name
        if p.dim() == 2:
            assert abs(p.mean().item()) < 1e-3, name
        elif name.endswith("bias"):
            assert torch.count_nonzero(p) == 0, name
        else:
            assert torch.equal(p, torch.ones_like(p)), name  # LayerNorm gains


def test_mlp_uses_tanh_gelu():
    gpt = tiny_model().double()
    mlp = gpt.transformer.h[0].mlp
    x = torch.randn(4, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(3)) * 40
    h = mlp.c_fc(x)
    tanh_gelu = 0.5 * h * (1 + torch.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h**3)))
    torch.testing.assert_close(mlp(x), mlp.c_proj(tanh_gelu), rtol=1e-12, atol=1e-12)
    erf = mlp.c_proj(F.gelu(h))
    assert (mlp(x) - erf).abs().max() > 1e-6, "indistinguishable from erf GELU: the test lost its power"


# ---- forward and loss ------------------------------------------------------------------------


def test_forward_without_targets_returns_last_position_only():
    gpt = tiny_model(cross_entropy="plain").eval()
    idx = tokens(3, 10)
    logits, loss = gpt(idx)
    assert loss is None and logits.shape == (3, 1, 64)
    full, loss = gpt(idx, tokens(3, 10, seed=2))
    assert full.shape == (3, 10, 64) and loss.dim() == 0
    torch.testing.assert_close(logits[:, 0], full[:, -1])


def test_loss_is_cross_entropy_with_ignore_index():
    gpt = tiny_model(cross_entropy="plain").eval()
    idx, targets = tokens(2, 12), tokens(2, 12, seed=2)
    logits, loss = gpt(idx, targets)
    torch.testing.assert_close(loss, F.cross_entropy(logits.reshape(-1, 64), targets.reshape(-1)))
    masked = targets.clone()
    masked[:, :5] = -1
    _, loss_masked = gpt(idx, masked)
    torch.testing.assert_close(loss_masked, F.cross_entropy(logits[:, 5:].reshape(-1, 64), targets[:, 5:].reshape(-1)))


def test_loss_at_init_is_about_log_vocab():
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(block_size=64, vocab_size=512, n_layer=2, n_head=2, n_embd=64))
    _, loss = gpt(tokens(4, 64, vocab=512), tokens(4, 64, vocab=512, seed=2))
    assert abs(loss.item() - math.log(512)) < 0.3


def test_sequence_longer_than_block_size_is_an_error():
    gpt = tiny_model(block_size=8)
    gpt(tokens(1, 8))
    with pytest.raises(ValueError, match="sequence of length 9 is longer than block_size 8"):
        gpt(tokens(1, 9))


# ---- helpers for training --------------------------------------------------------------------


def test_num_params_counts_by_hand():
    gpt = tiny_model()
    total, non_embedding = hand_param_count(gpt.config)
    assert gpt.get_num_params(non_embedding=False) == total
    assert gpt.get_num_params() == non_embedding
    assert total - non_embedding == gpt.config.block_size * gpt.config.n_embd  # wpe only
    assert gpt.config.parameter_count() == total


def test_untied_embeddings_have_their_own_output_layer():
    gpt = GPT(tiny_config(tie_embeddings=False))
    assert gpt.lm_head.weight is not gpt.transformer.wte.weight
    assert gpt.config.parameter_count() == sum(p.numel() for p in gpt.parameters())
    assert "lm_head.weight" in gpt.state_dict() and "transformer.wte.weight" in gpt.state_dict()


def test_estimate_mfu_is_against_the_cards_peak_and_none_where_it_is_unknown(monkeypatch):
    gpt = tiny_model()
    assert gpt.estimate_mfu(4, 0.5) is None  # a CPU: no peak, and no A100 figure in its place
    monkeypatch.setattr(model, "peak_flops", lambda device: 312e12)
    expected = gpt.flops_per_token() * gpt.config.block_size * 4 / 0.5 / 312e12  # nanoGPT's formula
    assert gpt.estimate_mfu(fwdbwd_per_iter=4, dt=0.5) == pytest.approx(expected)


@pytest.mark.parametrize("name, flops", [("NVIDIA H100 80GB HBM3", 989.5e12), ("NVIDIA A100-SXM4-40GB", 312e12)])
def test_peak_flops_by_card_name(monkeypatch, name, flops):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert model.peak_flops("cuda") == flops
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Some Future GPU")
    assert model.peak_flops("cuda") is None and model.peak_flops("cpu") is None


@pytest.mark.parametrize("norm_bias", [True, False])
def test_layernorm_keeps_the_state_dict_names_checkpoints_hold(norm_bias):
    """nn.LayerNorm(bias=...) in place of the old LayerNorm class: the same keys, so every checkpoint loads."""
    keys = GPT(tiny_config(n_layer=1, bias=norm_bias)).state_dict().keys()
    norms = sorted(k for k in keys if ".ln_" in k or k.startswith("transformer.ln_f"))
    expected = [f"transformer.{n}.{p}" for n in ("h.0.ln_1", "h.0.ln_2", "ln_f") for p in ("weight", "bias")]
    assert norms == sorted(e for e in expected if norm_bias or e.endswith("weight"))


def test_flops_per_token_by_hand():
    gpt = tiny_model()  # L=2, H=2, Q=16, block 32
    _, N = hand_param_count(gpt.config)
    assert gpt.flops_per_token() == 6 * N + 12 * 2 * 2 * 16 * 32
    assert gpt.flops_per_token(seq_len=8) == 6 * N + 12 * 2 * 2 * 16 * 8


def test_configure_optimizers_decays_matrices_only():
    gpt = tiny_model()
    opt = gpt.configure_optimizers(weight_decay=0.1, learning_rate=3e-4, betas=(0.9, 0.95), device_type="cpu")
    assert isinstance(opt, torch.optim.AdamW) and len(opt.param_groups) == 2
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(g["lr"] == 3e-4 and g["betas"] == (0.9, 0.95) for g in opt.param_groups)
    names = {id(p): n for n, p in gpt.named_parameters()}
    decayed = [names[id(p)] for p in decay["params"]]
    not_decayed = [names[id(p)] for p in no_decay["params"]]
    assert sorted(decayed + not_decayed) == sorted(names.values())  # every parameter once
    assert len(set(decayed + not_decayed)) == len(decayed) + len(not_decayed)
    assert all(dict(gpt.named_parameters())[n].dim() >= 2 for n in decayed)
    assert "transformer.wte.weight" in decayed and "transformer.h.1.mlp.c_fc.weight" in decayed
    assert all(n.endswith(".bias") or ".ln_" in n for n in not_decayed)
    assert "transformer.ln_f.weight" in not_decayed and "transformer.h.0.attn.c_attn.bias" in not_decayed


def test_crop_block_size():
    gpt = tiny_model(block_size=32)
    old = gpt.transformer.wpe.weight.detach().clone()
    gpt.crop_block_size(16)
    assert gpt.config.block_size == 16
    assert torch.equal(gpt.transformer.wpe.weight, old[:16])
    assert gpt.transformer.wpe.weight.is_leaf and gpt.transformer.wpe.weight.requires_grad
    _, loss = gpt(tokens(2, 16), tokens(2, 16, seed=2))
    loss.backward()
    assert gpt.transformer.wpe.weight.grad.shape == (16, 32)
    assert gpt.get_num_params(non_embedding=False) - gpt.get_num_params() == 16 * 32
    with pytest.raises(ValueError, match="longer than block_size 16"):
        gpt(tokens(2, 17))
    for bad in (0, 17):
        with pytest.raises(ValueError, match="block_size must be in 1..16"):
            gpt.crop_block_size(bad)


# ---- generation ------------------------------------------------------------------------------


def test_generate_appends_tokens_and_keeps_the_prompt():
    gpt = tiny_model(block_size=8).eval()
    prompt = tokens(2, 5)
    out = gpt.generate(prompt, max_new_tokens=6, temperature=0.8)  # runs past block_size: context is cropped
    assert out.shape == (2, 11) and out.dtype == prompt.dtype
    assert torch.equal(out[:, :5], prompt)
    assert ((out >= 0) & (out < 64)).all()


def test_generate_top_k_1_is_greedy_and_deterministic():
    gpt = tiny_model().eval()
    prompt = tokens(2, 4)
    torch.manual_seed(1)
    first = gpt.generate(prompt, max_new_tokens=5, top_k=1)
    torch.manual_seed(2)
    second = gpt.generate(prompt, max_new_tokens=5, top_k=1)
    assert torch.equal(first, second)
    greedy = prompt
    with torch.no_grad():
        for _ in range(5):
            greedy = torch.cat([greedy, gpt(greedy)[0][:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(first, greedy)


# ---- every backend name trains on CPU --------------------------------------------------------


@pytest.mark.filterwarnings("error:flex_attention called without torch.compile")
@pytest.mark.parametrize("name", ALL_NAMES)
@pytest.mark.usefixtures("allow_flex_recompiles")  # the final no-grad loss may run flex on CPU
def test_every_backend_name_trains_on_cpu(monkeypatch, name):
    gpt = tiny_model(attention_backend=name)
    opt = gpt.configure_optimizers(weight_decay=0.1, learning_rate=1e-2, betas=(0.9, 0.95), device_type="cpu")
    idx, targets = tokens(4, 16), tokens(4, 16, seed=2)
    losses = []
    for _ in range(3):
        _, loss = gpt(idx, targets)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    with torch.no_grad():
        losses.append(gpt(idx, targets)[1].item())
    assert all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0] - 0.05, losses


# ---- documents in a packed row ---------------------------------------------------------------


@pytest.mark.parametrize("name", ["manual", "sdpa"])
def test_documents_do_not_see_each_other(name):
    gpt = tiny_model(attention_backend=name, cross_entropy="plain").eval()  # plain: the logits come back too
    T, split = 24, 10
    doc_ids = torch.tensor([[4] * split + [2] * (T - split), [9] * T])
    idx = tokens(2, T)
    changed_doc2, changed_doc1 = idx.clone(), idx.clone()
    changed_doc2[0, split:] = (idx[0, split:] + 1) % 64
    changed_doc1[0, :split] = (idx[0, :split] + 1) % 64
    targets = tokens(2, T, seed=3)
    with torch.no_grad():
        base = gpt(idx, targets, doc_ids=doc_ids)[0]
        after_doc2 = gpt(changed_doc2, targets, doc_ids=doc_ids)[0]
        after_doc1 = gpt(changed_doc1, targets, doc_ids=doc_ids)[0]
        without_docs = gpt(changed_doc1, targets)[0]
        base_without_docs = gpt(idx, targets)[0]
    # document 1 (the first run) is unaffected by document 2's tokens
    torch.testing.assert_close(after_doc2[0, :split], base[0, :split], rtol=0, atol=1e-6)
    # document 2 is unaffected by document 1's tokens (positions stay absolute in the packed row)
    torch.testing.assert_close(after_doc1[0, split:], base[0, split:], rtol=0, atol=1e-6)
    # ... which only holds because of the mask: without doc_ids document 2 sees document 1
    assert (without_docs[0, split:] - base_without_docs[0, split:]).abs().max() > 1e-3
    # a row that is one document is plain causal attention
    torch.testing.assert_close(base[1], base_without_docs[1], rtol=1e-5, atol=1e-5)


# ---- python -m kernels and attention_report ------------------------------------------------------


def test_python_m_kernels_reports_every_registered_backend():
    """model.py alone knows its three kernels; `python -m kernels` reports the ones kernels/ registers too."""
    result = subprocess.run([sys.executable, "-m", "kernels"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    for name in (*MODEL_BACKENDS, "flash_attn_4", "flash_attn_3", "flex_attention"):
        assert f"  {name} " in result.stdout, name
    assert "auto picks at T=32768" in result.stdout


def test_attention_report_keys():
    report = attention_report("cpu")
    assert set(report) == {
        "torch",
        "cuda",
        "cudnn",
        "device",
        "gpu",
        "capability",
        "dtype",
        "backends",
        "auto",
        "auto_long",
    }
    assert report["device"] == "cpu" and report["dtype"] == "float32" and report["torch"] == torch.__version__
    assert set(report["backends"]) == set(model.BACKENDS)
    for name, row in report["backends"].items():
        assert set(row) == {"available", "version", "why"}, name
        assert row["available"] == (row["why"] == ""), name
    assert report["backends"]["manual"]["available"] and report["backends"]["sdpa"]["available"]
    for name in ("flash_attn_2", "flash_attn_3", "flash_attn_4"):
        assert not report["backends"][name]["available"], name  # CUDA only
    for key in ("auto", "auto_long"):
        assert set(report[key]) == {"bfloat16", "float16", "float32"}
        assert set(report[key].values()) == {"sdpa"}


# ---- GPU (run on the device) -----------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.filterwarnings("error:flex_attention called without torch.compile")
@pytest.mark.parametrize("name", ALL_NAMES)
@pytest.mark.usefixtures("allow_flex_recompiles")
def test_tiny_gpt_trains_on_cuda_under_bf16_autocast(monkeypatch, name):
    gpt = tiny_model(attention_backend=name, block_size=64, n_head=2, n_embd=128).cuda()
    opt = gpt.configure_optimizers(weight_decay=0.1, learning_rate=1e-2, betas=(0.9, 0.95), device_type="cuda")
    idx, targets = tokens(4, 64, device="cuda"), tokens(4, 64, seed=2, device="cuda")
    losses = []
    for _ in range(5):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            _, loss = gpt(idx, targets)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0] - 0.05, losses
    need = gpt.attention.use  # set up lazily by the first forward, for autocast's dtype
    assert need.device.type == "cuda" and need.dtype == torch.bfloat16 and need.training


@pytest.mark.gpu
def test_cpu_built_model_resolves_for_cuda_bf16():
    gpt = tiny_model(attention_backend="auto")
    gpt(tokens(2, 8))  # resolved once on CPU
    gpt = gpt.cuda()
    device = torch.device("cuda", torch.cuda.current_device())
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits, _ = gpt(tokens(2, 8, device="cuda"))
    assert logits.device.type == "cuda" and torch.isfinite(logits).all()
    assert gpt.attention.use.device == device and "cuda/bfloat16" in gpt.attention.resolution.reason


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["flash_attn_2", "flash_attn_4"])
def test_flash_backends_compile_without_breaks_per_layer(name):
    """torch.compile keeps the flash kernels in the graph: as many graphs as with sdpa. (A traced package
    lookup once broke flash-attn 2's graph at every layer; flash-attn-4 needs its custom ops for this.)"""
    device = torch.device("cuda", torch.cuda.current_device())
    problem = model.BACKENDS[name].why_not(AttentionUse(device, torch.bfloat16, 64))
    if problem:
        pytest.skip(problem)
    idx = tokens(2, 64, device="cuda")

    def graph_count(backend):
        torch._dynamo.reset()
        gpt = tiny_model(attention_backend=backend, block_size=64, n_head=2, n_embd=128).cuda()
        gpt.setup_attention(device, torch.bfloat16)  # as train.py does, before compiling
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return torch._dynamo.explain(gpt)(idx, idx).graph_count

    assert graph_count(name) == graph_count("sdpa")


def test_mps_keeps_sdpa_away_from_explicit_masks(caplog):
    """No MPS here: resolving only names the device. Decoding from a KV cache and packed documents pass SDPA an
    explicit mask; plain causal training does not."""
    mps = torch.device("mps")
    for requested in ("auto", "sdpa"):
        gpt = tiny_model(attention_backend=requested)
        decoding = gpt.attention_use(mps, torch.float32, training=False, kv_cache="contiguous")
        with caplog.at_level("WARNING", logger="model"):
            caplog.clear()
            generation_attention(gpt, decoding)
            attention, _ = generation_attention(gpt, decoding)
        assert attention.resolution.used == "manual"
        assert len(caplog.records) == 1 and "pytorch#107616" in caplog.records[0].getMessage(), requested
        assert gpt.setup_attention(mps, torch.float32, training=True).used == "sdpa"  # no explicit mask
        assert gpt.setup_attention(mps, torch.float32, training=True, documents=True).used == "manual"
    gpt = tiny_model(disable_mps_fix=True)
    with caplog.at_level("WARNING", logger="model"):
        caplog.clear()
        decoding = gpt.attention_use(mps, torch.float32, training=False, kv_cache="contiguous")
        assert generation_attention(gpt, decoding)[0].resolution.used == "sdpa"
        assert gpt.setup_attention(mps, torch.float32, training=False, documents=True).used == "sdpa"
    assert not caplog.records
