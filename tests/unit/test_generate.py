"""Generation with a KV cache (generation/: kv_cache.py, loop.py; generation.generate): cached and uncached
decoding (kv_cache="none", and GPT.generate, nanoGPT's plain loop) agree token for token and in their logits, per
backend that runs on CPU (flex eagerly, flash-attn through a stand-in module); batches of prompts of different
lengths; the paged cache's pages; the fallbacks; bench.generation --quick and sample.py's generation options."""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import re
import sys
import warnings

import pytest
import torch

import model
from errors import NonFiniteLogits
from generation import generate, kv_cache, loop
from generation.kv_cache import CacheMask, ContiguousKVCache, PagedKVCache
from generation.loop import forward_cached, generation_attention
from helpers import stand_in_flash, stand_in_flash_module, tiny_config, tree_digest
from kernels import flash, flex
from model import GPT, AttentionUse

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is faster, and the CPU is shared

CACHES = ("none", "contiguous", "paged")


def tiny_model(seed=0, **overrides) -> GPT:
    torch.manual_seed(seed)
    return GPT(tiny_config(**overrides)).eval()


def tokens(*shape, seed=1):
    return torch.randint(0, 64, shape, generator=torch.Generator().manual_seed(seed))


def rel_err(out, ref) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def reference_tokens(gpt, prompts, n):
    """Greedy tokens of each prompt alone, by the uncached full forward (GPT.forward)."""
    out = []
    for prompt in prompts:
        idx = prompt[None]
        with torch.no_grad():
            for _ in range(n):
                logits, _ = gpt(idx[:, -gpt.config.block_size :])
                idx = torch.cat((idx, logits[:, -1].argmax(-1, keepdim=True)), dim=1)
        out.append(idx[0])
    return out


def with_backend(gpt, name) -> GPT:
    """The same weights under another attention backend."""
    other = GPT(dataclasses.replace(gpt.config, attention_backend=name)).eval()
    other.load_state_dict(gpt.state_dict())
    return other


@pytest.fixture
def eager_flex(monkeypatch):
    """flex_attention uncompiled (a CPU compile takes ~10 s per shape): the same masks and BlockMasks, read by
    its eager reference. Eager flex ignores a BlockMask's block lists, which test_flex_block_masks checks."""
    from torch.nn.attention.flex_attention import flex_attention

    monkeypatch.setattr(flex, "compiled_flex_attention", lambda: flex_attention)
    monkeypatch.setattr(kv_cache, "compiled_flex_attention", lambda: flex_attention)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        yield


# ---- the same tokens whatever the cache -----------------------------------------------------------


@pytest.mark.parametrize("backend", ["sdpa", "manual"])
def test_greedy_tokens_are_the_same_for_every_cache_and_past_block_size(backend):
    gpt = tiny_model(block_size=8, attention_backend=backend)
    prompt = tokens(2, 5)
    expected = torch.stack(reference_tokens(gpt, list(prompt), 8))  # 13 tokens: slides past block_size 8
    assert torch.equal(gpt.generate(prompt, 8, top_k=1), expected)  # nanoGPT's loop, no cache
    for cache in CACHES:
        for compile in (False, True) if cache != "none" else (False,):
            out = generate(gpt, prompt, 8, top_k=1, kv_cache=cache, compile=compile, page_size=4)
            assert torch.equal(out, expected), (cache, compile)


@pytest.mark.parametrize("cache", ["contiguous", "paged"])
@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
@pytest.mark.parametrize("backend", ["sdpa", "manual"])
def test_cached_logits_match_the_full_forward(backend, cache, static):
    """Prefill 6, a chunk of 3 more (bottom-right causal over the cache), then single tokens: at each step the
    newest token's logits equal GPT.forward's at that position (float32, relative error <= 1e-5)."""
    gpt = tiny_model(attention_backend=backend)
    idx = tokens(3, 14)
    with torch.no_grad():
        full, _ = gpt(idx, idx)  # (B, T, V)
    need = gpt.attention_use("cpu", torch.float32, training=False, kv_cache=cache)
    attention, decode = generation_attention(gpt, need)
    assert attention.resolution.used == backend and decode is kv_cache.DECODE_KERNELS[backend]
    shape = (2, 3, 16, 2, 16, torch.float32, "cpu")
    if cache == "contiguous":
        store = ContiguousKVCache(*shape, static=static)
    else:
        store = PagedKVCache(*shape, page_size=4, num_pages=12, static=static)
    attends = store.attends(attention.kernel, decode.run)
    with torch.no_grad():
        checks = [(forward_cached(gpt, idx[:, :6], store.prefill([6, 6, 6], 6), attends), 5)]
        checks.append((forward_cached(gpt, idx[:, 6:9], store.extend(3), attends), 8))
        for t in range(9, 14):
            if static:
                step = CacheMask.decoding(store.lengths.clone(), store.capacity)
                store.reserve([t + 1] * 3)
                store.advance(1)
            else:
                step = store.extend(1)
            checks.append((forward_cached(gpt, idx[:, t : t + 1], step, attends), t))
    for logits, t in checks:
        assert rel_err(logits, full[:, t]) <= 1e-5, t
    assert store.host_lengths == [14, 14, 14] and store.lengths.tolist() == [14, 14, 14]


@pytest.mark.parametrize("cache", CACHES)
def test_prompts_of_different_lengths_give_each_prompt_its_own_tokens(cache):
    gpt = tiny_model(block_size=16)
    prompts = [tokens(n, seed=n) for n in (3, 11, 1)]
    expected = reference_tokens(gpt, prompts, 9)  # the 11-token prompt slides past block_size
    for compile in (False, True) if cache != "none" else (False,):
        out = generate(gpt, prompts, 9, temperature=0, kv_cache=cache, compile=compile, page_size=4)
        assert all(torch.equal(a, b) for a, b in zip(out, expected)), compile


def test_sampling_follows_the_seed_and_keeps_the_prompt():
    gpt = tiny_model(block_size=8)
    prompt = tokens(2, 5)
    torch.manual_seed(3)
    first = generate(gpt, prompt, 6, temperature=0.9, top_k=5)  # a contiguous cache
    torch.manual_seed(3)
    again = generate(gpt, prompt, 6, temperature=0.9, top_k=5, kv_cache="paged")
    assert torch.equal(first, again) and torch.equal(first[:, :5], prompt)
    torch.manual_seed(3)
    assert torch.equal(first, generate(gpt, prompt, 6, temperature=0.9, top_k=5, kv_cache="none"))
    torch.manual_seed(3)
    assert torch.equal(first, gpt.generate(prompt, 6, temperature=0.9, top_k=5))  # nanoGPT's loop draws alike
    torch.manual_seed(4)
    assert not torch.equal(first, generate(gpt, prompt, 6, temperature=0.9, top_k=5))  # the seed matters


def test_decoding_without_a_cache_keeps_sdpa_off_cudnn(monkeypatch):
    """Every no-cache step has a new length, and cuDNN's SDPA kernel builds a plan per length (tens of ms a
    step on a GPU); the steps run with PyTorch's other SDPA kernels, as cached decode steps do."""
    gpt = tiny_model(block_size=8, attention_backend="sdpa")
    sdpa, cudnn_allowed = torch.nn.functional.scaled_dot_product_attention, []

    def watched(*args, **kwargs):
        cudnn_allowed.append(torch.backends.cuda.cudnn_sdp_enabled())
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", watched)
    generate(gpt, tokens(1, 5), 4, temperature=0, kv_cache="none")
    assert cudnn_allowed and not any(cudnn_allowed)
    assert torch.backends.cuda.cudnn_sdp_enabled()  # and only there


def test_vocab_size_is_never_exceeded():
    gpt = tiny_model()
    with torch.no_grad():
        gpt.lm_head.weight[40:] *= 0  # ids 40+ would otherwise be as likely as any
        gpt.lm_head.weight[50] = gpt.lm_head.weight[:40].abs().sum(0) * 10  # and id 50 the likeliest
    torch.manual_seed(0)
    assert generate(gpt, tokens(4, 3), 12, temperature=2.0)[:, 3:].max() >= 40  # drawn when allowed
    torch.manual_seed(0)
    out = generate(gpt, tokens(4, 3), 12, temperature=2.0, vocab_size=40)
    assert out[:, 3:].max() < 40


# ---- flex_attention (eager on CPU) and flash-attn (a stand-in module) ----------------------------


@pytest.mark.usefixtures("eager_flex")
def test_flex_decoding_gives_the_reference_tokens(caplog):
    caplog.set_level(logging.INFO, logger="model")
    gpt = tiny_model(attention_backend="flex")
    prompts = [tokens(n, seed=n) for n in (2, 5)]
    expected = reference_tokens(with_backend(gpt, "sdpa"), prompts, 3)
    for cache in ("contiguous", "paged"):
        out = generate(gpt, prompts, 3, temperature=0, kv_cache=cache, compile=cache == "paged", page_size=2)
        assert all(torch.equal(a, b) for a, b in zip(out, expected)), cache
        assert f"attention backend: flex_attention, {cache}" in caplog.text  # flex ran, no fallback


def test_flex_block_masks_list_each_rows_own_blocks_up_to_its_length():
    """The BlockMasks' block lists, which compiled flex reads and eager flex ignores."""
    paged = PagedKVCache(1, 2, 12, 1, 16, torch.float32, "cpu", page_size=4, num_pages=6)
    paged.prefill([3, 9], 9)  # row 0 takes a page, row 1 three, from the free list
    paged.reserve([5, 9])  # row 0 grows into a second page
    step = CacheMask(torch.tensor([[4], [9]]), torch.tensor([5, 10]), 12)
    mask = paged.flex_block_mask(step, heads=3).to_dense()  # (B, heads, q blocks, pages)
    assert mask.shape[1] == 3 and torch.equal(mask, mask[:, :1].expand_as(mask))  # every head the same
    blocks = mask[:, 0, 0]
    assert blocks[0].nonzero().flatten().tolist() == sorted(paged.pages[0])
    assert blocks[1].nonzero().flatten().tolist() == sorted(paged.pages[1])
    assert not set(paged.pages[0]) & set(paged.pages[1])
    contiguous = ContiguousKVCache(1, 2, 300, 1, 16, torch.float32, "cpu")
    step = CacheMask(torch.tensor([[99], [200]]), torch.tensor([100, 201]), 300)
    blocks = contiguous.flex_block_mask(step, heads=2).to_dense()[:, 1, 0]
    assert blocks.tolist() == [[1, 0, 0], [1, 1, 0]]  # 128-token blocks up to each length


def test_flash_decoding_through_a_stand_in_module(monkeypatch):
    calls = []
    stand_in_flash(monkeypatch, stand_in_flash_module(calls))
    gpt = tiny_model(block_size=8, attention_backend="flash_attn_2")
    prompts = [tokens(n, seed=n) for n in (2, 6)]
    expected = reference_tokens(with_backend(gpt, "sdpa"), prompts, 4)  # the 6-token prompt slides
    for cache in ("contiguous", "paged"):
        calls.clear()
        out = generate(gpt, prompts, 4, temperature=0, kv_cache=cache, compile=cache == "paged", page_size=2)
        assert all(torch.equal(a, b) for a, b in zip(out, expected)), cache
        assert set(calls) == {"prefill", cache}


def test_flash_attn_3_takes_its_page_table_as_page_table(monkeypatch):
    calls = []
    kernel = stand_in_flash(monkeypatch, stand_in_flash_module(calls, "page_table"))
    cache = PagedKVCache(1, 2, 8, 2, 16, torch.float32, "cpu", page_size=2, num_pages=8)
    for seed, pool in enumerate((*cache.k, *cache.v)):
        pool.normal_(generator=torch.Generator().manual_seed(seed))
    cache.prefill([3, 5], 5)
    step = cache.extend(1)
    q = torch.randn(2, 2, 1, 16)
    out = kv_cache.flash_decode(kernel).run(q, cache, 0, step)
    assert calls == ["paged"] and out.shape == q.shape
    dense = kv_cache.sdpa_decode(q, cache, 0, step)
    assert rel_err(out, dense) < 1e-6


def test_the_static_decode_step_compiles_as_one_graph(monkeypatch):
    """What CUDA graphs need: no graph break in the step (fullgraph), traced by dynamo on CPU (backend eager),
    through both caches, with the stand-in flash kernel behind its custom op (sdpa's path traces the same)."""
    stand_in_flash(monkeypatch, stand_in_flash_module([]))
    compiled = []

    def compile_step(step, device):
        compiled.append(torch.compile(step, backend="eager", fullgraph=True, dynamic=False))
        return compiled[-1]

    monkeypatch.setattr(loop, "compile_step", compile_step)
    gpt = tiny_model(block_size=16, attention_backend="flash_attn_2")
    prompts = [tokens(n, seed=n) for n in (2, 5)]
    expected = reference_tokens(with_backend(gpt, "sdpa"), prompts, 4)
    for cache in ("contiguous", "paged"):
        out = generate(gpt, prompts, 4, temperature=0, kv_cache=cache, compile=True, page_size=4)
        assert all(torch.equal(a, b) for a, b in zip(out, expected)), cache
    assert len(compiled) == 2


def test_a_flash_package_without_flash_attn_with_kvcache_falls_back_for_decoding(monkeypatch):
    module = type("NoKVCache", (), {"flash_attn_func": None})
    monkeypatch.setitem(sys.modules, "flash_attn_interface", module)  # installed, as a stand-in
    kernel = flash.flash_attn_3_backend().kernel  # a fresh kernel: it imports the stand-in
    monkeypatch.setattr(model, "cuda_capability", lambda device: (9, 0))  # every flash package's checks read it
    need = AttentionUse(torch.device("cuda"), torch.bfloat16, 64, training=False, kv_cache="paged")
    assert "flash_attn_3 has no flash_attn_with_kvcache" in kernel.why_not(need)
    assert kernel.why_not(dataclasses.replace(need, kv_cache="none")) == ""


# ---- the paged cache ------------------------------------------------------------------------------


def test_pages_are_allocated_on_demand_and_freed_by_a_new_prefill():
    cache = PagedKVCache(1, 2, 10, 1, 8, torch.float32, "cpu", page_size=4, num_pages=5)
    cache.prefill([1, 6], 6)
    assert [len(p) for p in cache.pages] == [1, 2] and cache.in_use() == 3
    for _ in range(3):
        cache.extend(1)  # row 0 fills its page; row 1 grows to 9 tokens: a third page
    assert [len(p) for p in cache.pages] == [1, 3] and cache.host_lengths == [4, 9]
    assert cache.block_table[1, :3].tolist() == cache.pages[1]
    assert (cache.page_owner >= 0).sum() == 4
    cache.extend(1)
    with pytest.raises(RuntimeError, match="out of pages: all 5 pages of 4 tokens are in use"):
        cache.reserve([9, 10])  # row 0 grows past its page, row 1 is at capacity: 6 pages
    cache.prefill([2, 2], 2)
    assert cache.in_use() == 2 and cache.host_lengths == [2, 2]
    with pytest.raises(ValueError, match="a sequence of 11 tokens does not fit this cache of 10"):
        cache.prefill([11, 1], 11)


def test_a_paged_batch_holds_only_the_pages_its_rows_need(monkeypatch):
    made = []
    original = loop.make_cache
    monkeypatch.setattr(loop, "make_cache", lambda *a, **k: made.append(original(*a, **k)) or made[-1])
    gpt = tiny_model(block_size=32)
    generate(gpt, [tokens(2), tokens(20)], 3, kv_cache="paged", page_size=4)
    assert made[0].num_pages == 2 + 6  # ceil(5 / 4) + ceil(23 / 4) for 2 + 3 and 20 + 3 tokens, not 2 x 6
    assert made[0].in_use() == 1 + 6  # on demand: the last token drawn is never fed, so row 0 holds 4


# ---- paged_attention, fallbacks and bad input -------------------------------------------------------


def test_paged_attention_cannot_train_and_falls_back_with_a_warning(caplog):
    caplog.set_level(logging.INFO, logger="model")
    gpt = tiny_model(attention_backend="paged")
    assert gpt.setup_attention("cpu", torch.float32).used == "sdpa"
    assert "paged_attention requested but paged_attention is a paged KV cache for generation; it cannot train" in (
        caplog.text
    )
    _, loss = gpt(tokens(2, 8), tokens(2, 8, seed=2))
    assert torch.isfinite(loss)


def test_paged_attention_generates_from_a_paged_cache_and_says_how(caplog):
    caplog.set_level(logging.INFO, logger="model")
    gpt = tiny_model(block_size=16, attention_backend="paged_attention")
    prompts = [tokens(3), tokens(7)]
    expected = reference_tokens(with_backend(gpt, "sdpa"), prompts, 5)
    out = generate(gpt, prompts, 5, temperature=0)  # the backend means a paged cache
    assert all(torch.equal(a, b) for a, b in zip(out, expected))
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert infos[-1].startswith(
        "attention backend: paged_attention over sdpa (auto's pick for a paged cache), paged KV cache: gathers the "
        "pages into a contiguous copy each step (SDPA reads no block table)"
    )
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_contiguous_cache_is_named_in_the_info_line(caplog):
    caplog.set_level(logging.INFO, logger="model")
    generate(tiny_model(attention_backend="manual"), tokens(1, 3), 2)
    assert "attention backend: manual, contiguous KV cache" in caplog.text


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(top_k=0), "top_k must be >= 1 or None, got 0"),
        (dict(temperature=-0.5), r"temperature must be >= 0 \(0 is greedy\), got -0.5"),
        (dict(temperature=float("nan")), "temperature must be >= 0"),
        (dict(kv_cache="ring"), "unknown kv_cache 'ring'; choose one of none, contiguous, paged"),
        (dict(kv_cache="none", compile=True), "compile compiles the decode step over a KV cache"),
        (dict(max_new_tokens=-1), "max_new_tokens must be an integer >= 0, got -1"),
    ],
)
def test_bad_settings_are_value_errors(kwargs, message):
    gpt = tiny_model()
    kwargs = {"max_new_tokens": 3, **kwargs}
    with pytest.raises(ValueError, match=message):
        generate(gpt, tokens(1, 3), **kwargs)
    with pytest.raises(ValueError, match="every prompt must be a non-empty 1-D tensor"):
        generate(gpt, [tokens(3), tokens(0)], 2)


# ---- python -m bench.generation --quick and profile --quick -----------------------------------------


def test_bench_generation_quick(tmp_path):
    from bench import generation

    assert generation.main(["--quick", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "cpu-generate-quick.json").read_text())
    rows = result["rows"]
    assert {r["cache"] for r in rows} == set(CACHES)
    assert all(r["status"] == "ok" for r in rows), [r["status"] for r in rows]
    assert all(r["prefill_tok_s"] > 0 and r["decode_tok_s"] > 0 for r in rows)
    assert {"prefill_tok_s", "decode_tok_s", "peak_mem_mib", "batch_size", "prompt_len", "new_tokens"} <= set(rows[0])
    assert (tmp_path / "cpu-generate-quick.md").is_file() and (tmp_path / "cpu-generate-quick.png").is_file()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the probe runs on a GPU there")
def test_bench_generation_probe_says_in_one_line_that_it_needs_a_gpu(tmp_path, capsys):
    from bench import generation

    assert generation.main(["probe", "--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err.startswith("error: the sampling probe times CUDA graphs on a CUDA GPU")
    assert not list(tmp_path.iterdir())


def test_bench_generation_profile_quick_writes_the_decode_steps_kernels_by_kind(tmp_path, capsys):
    from bench import generation

    assert generation.main(["profile", "--quick", "--out", str(tmp_path)]) == 0
    text = (tmp_path / "cpu-profile-generate-quick.md").read_text()
    assert text.startswith("# profile-generate-quick on cpu") and "## eager, contiguous cache" in text
    assert "host ops (self CPU)" in text and "wrote " in capsys.readouterr().out


# ---- sample.py: --kv_cache, --batch_size with a file of prompts, --compile, the log lines ----------------


def sample_main(capsys, *argv: str) -> tuple[int, str, str]:
    import sample

    code = sample.main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_sample_cli_batches_a_file_of_prompts_through_a_kv_cache(trained_out, tmp_path, capsys):
    prompts = ["ROMEO:", "JULIET: the", "the king and the queen speak"]  # the last is longer than block_size
    path = tmp_path / "prompts.txt"
    path.write_text("\n".join([prompts[0], "", *prompts[1:]]) + "\n")  # blank lines are no prompts
    common = [f"--out_dir={trained_out}", f"--start=FILE:{path}", "--batch_size=2", "--num_samples=1"]
    common += ["--max_new_tokens=6", "--temperature=0", "--device=cpu"]
    code, out, err = sample_main(capsys, *common, "--kv_cache=paged", "--compile")
    assert code == 0, err
    texts = out.split("\n---------------\n")[:-1]
    assert [text[: len(prompt)] for text, prompt in zip(texts, prompts)] == prompts and len(texts) == 3
    lines = err.splitlines()
    assert any(line.startswith("INFO: attention backend: sdpa, paged KV cache: gathers the pages") for line in lines)
    assert "INFO: compile: CUDA graphs need a CUDA device; the static decode step runs eagerly on cpu" in lines
    note = "note: 1 of the 3 prompts are longer than block_size 16; the model sees only the last 16 tokens of each"
    assert note in lines
    assert re.search(r"^prefill: \d+ tokens in \d+\.\d\d s \([\d,-]+ tokens/s\)$", err, re.M), err
    assert re.search(r"^warm-up: the first decode step took \d+\.\d\d s$", err, re.M), err
    assert re.search(r"^decode: 12 tokens in \d+\.\d\d s \([\d,-]+ tokens/s\)$", err, re.M), err  # 3 x (6 - 2)
    assert re.search(r"^18 tokens in \d+\.\d s", err, re.M), err
    code, uncached, err = sample_main(capsys, *common, "--kv_cache=none")  # greedy: the same text
    assert code == 0 and uncached == out, err


@pytest.mark.parametrize(
    "args, expect",
    [
        (["--kv_cache=ring"], "unknown kv_cache 'ring'; choose one of none, contiguous, paged"),
        (["--batch_size=0"], "batch_size must be >= 1, got 0"),
        (["--kv_cache=none", "--compile"], "compile compiles the decode step over a KV cache"),
        (["--batch_size=2", "--start=FILE:{tmp}/blank.txt"], "blank.txt has no non-empty line"),
        (["--batch_size=2", "--start=FILE:{tmp}/euro.txt"], "--start prompt 2: char '€' (U+20AC)"),
    ],
    ids=["kv_cache", "batch_size", "compile-without-cache", "no-prompt-lines", "bad-char-in-line-2"],
)
def test_sample_bad_generation_settings_are_one_error_line(trained_out, tmp_path, capsys, args, expect):
    (tmp_path / "blank.txt").write_text("\n  \n")
    (tmp_path / "euro.txt").write_text("ROMEO:\nthe €\n")
    argv = [f"--out_dir={trained_out}", "--max_new_tokens=3", "--device=cpu", *(a.format(tmp=tmp_path) for a in args)]
    before = tree_digest(trained_out, tmp_path)
    code, out, err = sample_main(capsys, *argv)
    assert code == 2 and out == ""
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and expect in err, err
    assert tree_digest(trained_out, tmp_path) == before  # nothing written


# ---- GPU (run on the device) ----------------------------------------------------------------------


def gpu_or_skip(backend: str, cache: str, dtype=torch.bfloat16) -> torch.device:
    device = torch.device("cuda", torch.cuda.current_device())
    problem = model.BACKENDS[backend].why_not(AttentionUse(device, dtype, 64, training=False, kv_cache=cache))
    if problem:
        pytest.skip(problem)
    return device


@pytest.mark.gpu
@pytest.mark.parametrize("cache", ["contiguous", "paged"])
@pytest.mark.parametrize("backend", ["sdpa", "flex_attention", "flash_attn_2", "flash_attn_3", "manual"])
@pytest.mark.usefixtures("allow_flex_recompiles")
def test_gpu_cached_logits_match_a_float32_full_forward(backend, cache):
    """bf16 on CUDA: prefill, a chunk, then single tokens, each against the float32 uncached forward."""
    device = gpu_or_skip(backend, cache)
    reference = tiny_model(block_size=64, n_embd=128, attention_backend="manual").to(device)
    gpt = with_backend(reference, backend).to(device, torch.bfloat16)
    idx = tokens(3, 40).to(device)
    with torch.no_grad():
        full, _ = reference(idx, idx)
    need = gpt.attention_use(device, torch.bfloat16, training=False, kv_cache=cache)
    attention, decode = generation_attention(gpt, need)
    assert attention.resolution.used == backend
    shape = (2, 3, 64, 2, 64, torch.bfloat16, device)
    pages = dict(page_size=decode.page_size, num_pages=3 * -(-64 // decode.page_size))
    store = ContiguousKVCache(*shape) if cache == "contiguous" else PagedKVCache(*shape, **pages)
    attends = store.attends(attention.kernel, decode.run)
    with torch.no_grad():
        checks = [(forward_cached(gpt, idx[:, :24], store.prefill([24] * 3, 24), attends), 23)]
        checks.append((forward_cached(gpt, idx[:, 24:30], store.extend(6), attends), 29))
        for t in range(30, 40):
            checks.append((forward_cached(gpt, idx[:, t : t + 1], store.extend(1), attends), t))
    for logits, t in checks:
        assert rel_err(logits.float(), full[:, t]) < 2e-2, t


@pytest.mark.gpu
@pytest.mark.parametrize("cache", ["contiguous", "paged"])
def test_gpu_compiled_decode_gives_the_eager_tokens(cache):
    """torch.compile(mode="reduce-overhead") of the static decode step (CUDA graphs), float32: the tokens of the
    same static step run eagerly, for prompts of different lengths, twice (a new cache re-records its graphs)."""
    device = gpu_or_skip("sdpa", cache, torch.float32)
    gpt = tiny_model(block_size=64, n_embd=128).to(device)
    prompts = [tokens(n, seed=n).to(device) for n in (5, 17, 9)]
    eager = generate(gpt, prompts, 20, temperature=0, kv_cache=cache, compile=False, cuda_graph=False)
    for _ in range(2):
        compiled = generate(gpt, prompts, 20, temperature=0, kv_cache=cache, compile=True)
        assert all(torch.equal(a, b) for a, b in zip(compiled, eager))


@pytest.mark.gpu
@pytest.mark.parametrize("cache", ["contiguous", "paged"])
@pytest.mark.parametrize("backend", ["flex_attention", "manual", "sdpa"])
@pytest.mark.usefixtures("allow_flex_recompiles")
def test_gpu_cuda_graph_decoding_draws_as_eager_decoding_does(backend, cache):
    """The default CUDA decode (the static step and the draw captured as one CUDA graph), float32, prompts of
    different lengths, per decode kernel: greedy, and top_k=1 sampling (topk, mask, softmax and the exponential
    draw, all inside the graph), give the eager tokens; the graph's draws are fresh each replay (uniform logits
    give many ids, not one repeated); NaN logits raise NonFiniteLogits after the tokens."""
    device = gpu_or_skip(backend, cache, torch.float32)
    gpt = tiny_model(block_size=64, n_embd=128, attention_backend=backend).to(device)
    prompts = [tokens(n, seed=n).to(device) for n in (5, 17, 9)]
    eager = generate(gpt, prompts, 20, temperature=0, kv_cache=cache, cuda_graph=False)
    for temperature, top_k in ((0, None), (1.0, 1)):
        graphed = generate(gpt, prompts, 20, temperature=temperature, top_k=top_k, kv_cache=cache, cuda_graph=True)
        assert all(torch.equal(a, b) for a, b in zip(graphed, eager)), (temperature, top_k)
    with torch.no_grad():
        gpt.lm_head.weight.zero_()  # tied to wte: every logit 0, every id equally likely
    drawn = generate(gpt, prompts[:1], 60, temperature=1.0, kv_cache=cache, cuda_graph=True)[0][5:]
    assert len(set(drawn.tolist())) > 30  # 64 ids: a replay that repeated its numbers would draw one id
    with torch.no_grad():
        gpt.transformer.ln_f.weight.fill_(float("nan"))
    with pytest.raises(NonFiniteLogits):
        generate(gpt, prompts, 5, kv_cache=cache, cuda_graph=True)


def test_a_capture_block_collects_garbage_first_then_none_until_it_ends():
    """loop.no_collection, around every CUDA-graph capture: the garbage there is (a dead cycle) is freed before the
    block, no collection can start inside it, and the collector's state comes back after it, also on an error."""
    freed = []

    class Cycle:
        def __init__(self):
            self.me = self

        def __del__(self):
            freed.append(True)

    Cycle()  # unreachable at once, freed only by a collection
    assert gc.isenabled()
    with loop.no_collection():
        assert freed == [True] and not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError), loop.no_collection():
        raise RuntimeError("a failed capture")
    assert gc.isenabled()
    gc.disable()
    try:
        with loop.no_collection():
            pass
        assert not gc.isenabled()  # a caller's disabled collector stays disabled
    finally:
        gc.enable()


@pytest.mark.gpu
def test_gpu_no_garbage_collection_runs_inside_a_decode_graph_capture():
    """Each generate() captures its own decode graph and leaves it in a reference cycle. A garbage collection
    during the next capture frees that graph there, which invalidates the capture (sample.py's third sample from
    a Hugging Face folder failed so on an H100). With collections as frequent as they go (threshold 1 in every
    generation), none runs while a stream is capturing, and graphed generations in a row give the eager tokens."""
    device = gpu_or_skip("sdpa", "contiguous", torch.float32)
    gpt = tiny_model(block_size=64, n_embd=128).to(device)
    prompts = [tokens(n, seed=n).to(device) for n in (5, 9)]
    eager = generate(gpt, prompts, 12, temperature=0, cuda_graph=False)
    during_capture = []

    def record(phase, info):
        if phase == "start" and torch.cuda.is_current_stream_capturing():
            during_capture.append(info["generation"])

    threshold = gc.get_threshold()
    gc.set_threshold(1, 1, 1)
    gc.callbacks.append(record)
    try:
        for _ in range(3):
            graphed = generate(gpt, prompts, 12, temperature=0, cuda_graph=True)
            assert all(torch.equal(a, b) for a, b in zip(graphed, eager))
    finally:
        gc.callbacks.remove(record)
        gc.set_threshold(*threshold)
    assert during_capture == []


def test_logits_that_are_not_finite_raise_once_the_tokens_are_out():
    """The draw never waits for the GPU: a NaN in the logits is flagged on the device and read once, at the end
    of generation (NonFiniteLogits), on every path: no cache, a cache, and the static step."""
    gpt = tiny_model()
    with torch.no_grad():
        gpt.transformer.ln_f.bias.fill_(float("inf"))
    for options in (dict(kv_cache="none"), dict(kv_cache="contiguous"), dict(kv_cache="paged", compile=True)):
        with pytest.raises(NonFiniteLogits):
            generate(gpt, tokens(2, 5), 4, top_k=5, **options)


def test_a_backend_registered_without_a_decode_kernel_decodes_with_sdpas(caplog):
    """register() is all a new backend needs: generation from a KV cache then reads the cache with sdpa's decode
    kernel and says so, and gives the tokens manual's kernel gives."""
    import model

    model.register(model.AttentionBackend("toy_decode", model.manual_attention, lambda use: "", "sdpa"))
    try:
        gpt = tiny_model(attention_backend="toy_decode")
        prompt = tokens(1, 5)
        with caplog.at_level(logging.INFO, logger="model"):
            out = generate(gpt, prompt, 6, temperature=0, kv_cache="contiguous")
        assert "decoding from the cache with sdpa's kernel" in caplog.text
        reference = tiny_model(attention_backend="manual")
        reference.load_state_dict(gpt.state_dict())
        assert torch.equal(out, reference.generate(prompt, 6, temperature=0))
    finally:
        model.BACKENDS.pop("toy_decode")


# ---- memory that does not grow with max_new_tokens ----------------------------------------------------


@pytest.mark.parametrize("cache", CACHES)
def test_tokens_far_past_block_size_are_the_reference_tokens(cache):
    """The token buffer holds the prompts and at most 2*block_size new tokens, then keeps each row's last window:
    rows of different lengths still get nanoGPT's tokens, many windows on."""
    gpt = tiny_model(block_size=8)
    prompts = [tokens(n, seed=n) for n in (3, 11, 1)]
    expected = reference_tokens(gpt, prompts, 40)
    out = generate(gpt, prompts, 40, temperature=0, kv_cache=cache, page_size=4)
    assert all(torch.equal(a, b) for a, b in zip(out, expected))


def test_a_huge_max_new_tokens_allocates_nothing_up_front():
    """10**12 tokens would be 8 TB of token ids allocated before the first step: the first tokens come at once."""
    gpt = tiny_model(block_size=8)
    steps = loop.stream(gpt, [tokens(5)], 10**12, temperature=0)
    first = [next(steps) for _ in range(20)]
    assert len(first) == 20 and all(t.shape == (1,) for t in first)
