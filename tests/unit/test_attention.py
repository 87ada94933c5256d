"""Attention backends, masks, the resolver and its logging (model.py; kernels/ registers flash-attn 3 and 4,
flex_attention and auto's per-card table; generation/ resolves its own attention for decoding).

Numerics follow the project METHOD: every backend is compared with `manual` on fresh random inputs,
float64 to ~1e-10 and float32 to ~1e-5 relative (‖out − ref‖ / ‖ref‖), forward and q/k/v gradients;
`manual` itself is checked against an independent per-document loop written here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import json
import logging
import math
import subprocess
import sys
import warnings
import zlib
from types import ModuleType, SimpleNamespace

import pytest
import torch

import kernels
import model
from generation import kv_cache
from generation.loop import generate, generation_attention
from helpers import REPO, subprocess_env, tiny_config
from model import GPT, AttentionMask, AttentionUse, Resolution

CPU = torch.device("cpu")
CUDA = torch.device("cuda")  # an object only: the resolver tests never touch a real GPU
MPS = torch.device("mps")

RTOL = {torch.float64: 1e-10, torch.float32: 1e-5}


# ---- helpers ----------------------------------------------------------------------------------


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm()).item()


def generator_for(*case) -> torch.Generator:
    """A seed per test case: reproducible, yet different inputs for every case."""
    return torch.Generator().manual_seed(zlib.crc32(repr(case).encode()))


def random_qkv(shape, dtype, gen, device=CPU):
    tensors = [torch.randn(shape, generator=gen, dtype=torch.float64) for _ in range(4)]  # q, k, v, dy
    return [t.to(device=device, dtype=dtype) for t in tensors]


def doc_ids_for(B: int, T: int, device=CPU) -> torch.Tensor:
    """Rows cycle through: one document; several of uneven length (one of length 1); unsorted ids
    whose first id comes back after other documents (so only *runs* of equal ids are documents)."""
    patterns = [
        [5] * T,
        [0] * 1 + [1] * (T // 5) + [2] * (T // 2) + [3] * (T - 1 - T // 5 - T // 2),
        [3] * (T // 6) + [1] * (T // 3) + [7] * (T // 4) + [3] * (T - T // 6 - T // 3 - T // 4),
    ]
    assert all(len(p) == T for p in patterns)
    return torch.tensor([patterns[b % 3] for b in range(B)], device=device)


def runs(row: list[int]) -> list[tuple[int, int]]:
    """(start, end) of each run of equal values, by a plain loop."""
    bounds, start = [], 0
    for i in range(1, len(row) + 1):
        if i == len(row) or row[i] != row[i - 1]:
            bounds.append((start, i))
            start = i
    return bounds


def reference_attention(q, k, v, doc_ids=None):
    """Independent float64 reference: per batch row, per document, a plain causal softmax."""
    q, k, v = (t.double() for t in (q, k, v))
    B, H, T, D = q.shape
    rows = []
    for b in range(B):
        bounds = [(0, T)] if doc_ids is None else runs(doc_ids[b].tolist())
        pieces = []
        for s, e in bounds:
            scores = q[b, :, s:e] @ k[b, :, s:e].transpose(-1, -2) / math.sqrt(D)  # (H, n, n)
            future = torch.ones(e - s, e - s, dtype=torch.bool).triu(1)
            pieces.append(torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1) @ v[b, :, s:e])
        rows.append(torch.cat(pieces, dim=1))  # (H, T, D)
    return torch.stack(rows)


def forward_backward(fn, q, k, v, dy, *args):
    """Output and q/k/v gradients of fn for upstream gradient dy (inputs are not modified)."""
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out = fn(q, k, v, *args)
    grads = torch.autograd.grad(out, (q, k, v), dy.to(out.dtype))
    return out.detach(), grads


def assert_matches(out, grads, ref_out, ref_grads, rtol, what=""):
    assert torch.isfinite(out).all(), f"{what}: output has NaN/inf (not fully written?)"
    err = rel_err(out, ref_out)
    assert err < rtol, f"{what}: forward relative error {err:.3g} >= {rtol:g}"
    for name, g, rg in zip("qkv", grads, ref_grads):
        assert torch.isfinite(g).all(), f"{what}: d{name} has NaN/inf"
        err = rel_err(g, rg)
        assert err < rtol, f"{what}: d{name} relative error {err:.3g} >= {rtol:g}"


def assert_docs_masked(out_docs, out_causal, doc_ids, same=1e-4):
    """Rows holding one document must equal plain causal attention (within `same`), rows with several
    must not (by far more than `same`): the mask is really applied, and only where it should be."""
    for b in range(doc_ids.size(0)):
        n_docs = len(runs(doc_ids[b].tolist()))
        diff = rel_err(out_docs[b], out_causal[b])
        if n_docs == 1:
            assert diff < same, f"row {b} is one document yet differs from causal ({diff:.3g})"
        else:
            assert diff > 0.1, f"row {b} has {n_docs} documents yet equals causal ({diff:.3g}): mask not applied"


def stand_in_flash(monkeypatch, module):
    """A fresh flash kernel that imports `module` as a package named stand_in_flash, as a real one is imported."""
    monkeypatch.setitem(sys.modules, "stand_in_flash", module)
    return kernels.flash.FlashAttention("stand-in", (("stand_in_flash", "stand-in flash", "stand-in-flash"),))


def installed(monkeypatch, **modules):
    """Simulate the packages: a module object is installed under its name, None is missing."""
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name.replace("__", "."), module)


def fresh_flash_backends(monkeypatch):
    """Registry records of flash-attn 2, 3 and 4 over fresh kernels: they import (the simulated) packages anew."""
    flash_attn_2 = model.FlashAttn2()
    for record in (
        model.BACKENDS["flash_attn_2"]._replace(kernel=flash_attn_2, why_not=flash_attn_2.why_not),
        kernels.flash.flash_attn_3_backend(),
        kernels.flash.flash_attn_4_backend(),
    ):
        monkeypatch.setitem(model.BACKENDS, record.name, record)


# ---- masks ------------------------------------------------------------------------------------


def test_dense_mask_uses_runs_of_ids_not_sorted_ids():
    ids = torch.tensor([[3, 3, 1, 1, 1, 7], [4, 4, 4, 4, 4, 4], [2, 9, 9, 2, 2, 2]])
    dense = AttentionMask(6, CPU, ids).dense()
    assert dense.shape == (3, 1, 6, 6) and dense.dtype == torch.bool
    for b in range(3):
        expected = torch.zeros(6, 6, dtype=torch.bool)
        for s, e in runs(ids[b].tolist()):
            expected[s:e, s:e] = torch.ones(e - s, e - s, dtype=torch.bool).tril()
        assert torch.equal(dense[b, 0], expected), f"row {b}"


def test_dense_mask_without_documents_is_causal():
    dense = AttentionMask(5, CPU).dense()
    assert not AttentionMask(5, CPU).has_documents
    assert torch.equal(dense.reshape(5, 5), torch.ones(5, 5, dtype=torch.bool).tril())


def test_varlen_cu_seqlens_over_flattened_rows():
    ids = torch.tensor([[3, 3, 1, 1, 1, 7], [0, 0, 0, 0, 0, 0], [1, 2, 1, 1, 2, 2]])
    cu_seqlens, max_len = AttentionMask(6, CPU, ids).varlen()
    assert cu_seqlens.dtype == torch.int32
    assert cu_seqlens.tolist() == [0, 2, 5, 6, 12, 13, 14, 16, 18]
    assert max_len == 6


# ---- manual vs an independent reference (so the reference of the other tests cannot be wrong) -----

SHAPES = [(3, 2, 77, 64), (3, 4, 130, 128)]  # (B, H, T, D): T not a multiple of 128, B > 1, H > 1


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("docs", [False, True], ids=["causal", "docs"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_manual_matches_independent_reference(shape, docs, dtype):
    q, k, v, dy = random_qkv(shape, dtype, generator_for("manual", shape, docs, dtype))
    doc_ids = doc_ids_for(shape[0], shape[2]) if docs else None
    out, grads = forward_backward(model.manual_attention, q, k, v, dy, AttentionMask(shape[2], CPU, doc_ids))
    assert out.dtype == dtype
    ref_out, ref_grads = forward_backward(reference_attention, q.double(), k.double(), v.double(), dy.double(), doc_ids)
    assert_matches(out, grads, ref_out, ref_grads, RTOL[dtype], f"manual {dtype}")
    if docs:
        assert_docs_masked(out, reference_attention(q, k, v), doc_ids)


def test_reference_is_not_trivially_causal():
    """Poison check of the reference itself: documents must change its answer."""
    q, k, v, _ = random_qkv((3, 1, 12, 8), torch.float64, generator_for("poison"))
    doc_ids = doc_ids_for(3, 12)
    assert_docs_masked(reference_attention(q, k, v, doc_ids), reference_attention(q, k, v), doc_ids)


# ---- every CPU backend vs manual, float64 and float32, forward and gradients ---------------------


def sdpa_with(kernel):
    return functools.partial(model.sdpa_attention, kernel=kernel)


CPU_BACKENDS = {"sdpa-auto": sdpa_with("auto"), "sdpa-math": sdpa_with("math"), "sdpa-flash": sdpa_with("flash")}


@functools.cache
def cpu_why_not_sdpa_kernel(kernel: str, dtype: torch.dtype, with_mask: bool) -> str:
    """'' when PyTorch's CPU build runs this SDPA kernel for this dtype and mask form, else why not."""
    x = torch.randn(1, 1, 8, 8, dtype=dtype)
    mask = AttentionMask(8, CPU, torch.tensor([[0] * 4 + [1] * 4]) if with_mask else None)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            sdpa_with(kernel)(x, x, x, mask)
    except RuntimeError as error:
        return f"PyTorch {torch.__version__} CPU has no SDPA {kernel} kernel for {dtype}: {error}".splitlines()[0]
    return ""


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("docs", [False, True], ids=["causal", "docs"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("backend", sorted(CPU_BACKENDS))
def test_cpu_backend_matches_manual(backend, dtype, docs, shape):
    kernel = backend.split("-")[1]
    problem = cpu_why_not_sdpa_kernel(kernel, dtype, docs)
    if problem:
        pytest.skip(problem)
    q, k, v, dy = random_qkv(shape, dtype, generator_for(backend, shape, docs, dtype))
    B, _, T, _ = shape
    doc_ids = doc_ids_for(B, T) if docs else None
    mask = AttentionMask(T, CPU, doc_ids)
    out, grads = forward_backward(CPU_BACKENDS[backend], q, k, v, dy, mask)
    assert out.dtype == dtype and out.shape == q.shape
    ref_out, ref_grads = forward_backward(
        model.manual_attention, q.double(), k.double(), v.double(), dy.double(), AttentionMask(T, CPU, doc_ids)
    )
    assert_matches(out, grads, ref_out, ref_grads, RTOL[dtype], f"{backend} {dtype}")
    if docs:
        causal, _ = forward_backward(CPU_BACKENDS[backend], q, k, v, dy, AttentionMask(T, CPU))
        assert_docs_masked(out, causal, doc_ids)


@contextlib.contextmanager
def no_eager_flex():
    """Fail, rather than pass slowly, if flex_attention silently ran uncompiled (e.g. past dynamo's
    recompile limit, where torch.compile falls back to eager)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="flex_attention called without torch.compile")
        yield


@pytest.mark.parametrize(
    "docs, shape", [(False, (2, 3, 130, 64)), (True, (3, 2, 77, 64))], ids=["causal-2x3x130x64", "docs-3x2x77x64"]
)
def test_flex_attention_cpu_forward_matches_manual(docs, shape):
    """flex_attention on CPU: compiled, forward only, float32. One shape each (a compile is ~10 s)."""
    problem = kernels.flex.why_not_flex(AttentionUse(CPU, torch.float32, shape[-1], docs, training=False))
    if problem:
        pytest.skip(problem)
    q, k, v, _ = random_qkv(shape, torch.float32, generator_for("flex", shape, docs))
    B, _, T, _ = shape
    doc_ids = doc_ids_for(B, T) if docs else None
    with torch.no_grad(), no_eager_flex():
        out = kernels.flex.flex_attention(q, k, v, AttentionMask(T, CPU, doc_ids))
        ref = model.manual_attention(q.double(), k.double(), v.double(), AttentionMask(T, CPU, doc_ids))
    assert out.shape == q.shape and out.dtype == torch.float32
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < RTOL[torch.float32]
    if docs:
        assert_docs_masked(out, model.manual_attention(q, k, v, AttentionMask(T, CPU)), doc_ids)


# ---- the flash-attn call path (layout, varlen, tuple outputs), with stand-in kernels on CPU -------


def fake_flash_module(returns_tuple: bool, calls: list):
    """A stand-in flash-attn module: same (B, T, H, D) / varlen (tokens, H, D) API, computed by the reference."""

    def flash_attn_func(q, k, v, causal, **kwargs):
        calls.append(("dense", kwargs))
        assert causal is True and q.dim() == 4
        y = reference_attention(*(t.transpose(1, 2) for t in (q, k, v))).transpose(1, 2).to(q.dtype)
        return (y, None) if returns_tuple else y

    def flash_attn_varlen_func(
        q, k, v, qv=None, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, **kwargs
    ):  # keywords only: FA4's 4th positional argument is qv
        calls.append(("varlen", kwargs))
        assert causal is True and q.dim() == 3 and qv is None
        assert torch.equal(cu_seqlens_q, cu_seqlens_k) and max_seqlen_q == max_seqlen_k
        bounds = cu_seqlens_q.tolist()
        pieces = []
        for s, e in zip(bounds[:-1], bounds[1:]):
            assert e - s <= max_seqlen_q
            seg = (t[s:e].transpose(0, 1)[None] for t in (q, k, v))  # (1, H, n, D)
            pieces.append(reference_attention(*seg)[0].transpose(0, 1))
        y = torch.cat(pieces).to(q.dtype)
        return (y, None) if returns_tuple else y

    return SimpleNamespace(
        flash_attn_func=flash_attn_func, flash_attn_varlen_func=flash_attn_varlen_func, __version__="0.0-fake"
    )


@pytest.mark.parametrize("docs", [False, True], ids=["causal", "docs"])
@pytest.mark.parametrize("name", ["flash_attn_2", "flash_attn_3"])  # flash_attn_4: its custom ops, below
def test_flash_call_path_with_stand_in_kernels(monkeypatch, name, docs):
    calls = []
    fake = fake_flash_module(returns_tuple=name == "flash_attn_3", calls=calls)
    module_name = "flash_attn" if name == "flash_attn_2" else "flash_attn_interface"
    installed(monkeypatch, **{module_name: fake})
    fresh_flash_backends(monkeypatch)
    q, k, v, _ = random_qkv((3, 2, 30, 16), torch.float64, generator_for("fakeflash", name, docs))
    doc_ids = doc_ids_for(3, 30) if docs else None
    out = model.BACKENDS[name].kernel(q, k, v, AttentionMask(30, CPU, doc_ids), 0.0)
    assert [c[0] for c in calls] == ["varlen" if docs else "dense"]
    assert out.shape == q.shape
    assert rel_err(out, model.manual_attention(q, k, v, AttentionMask(30, CPU, doc_ids))) < 1e-12


def fake_flash_attn_4_interface(calls: list):
    """flash-attn-4's private forward/backward (what its own autograd Function calls), as explicit float64
    formulas on CPU: (B, T, H, D) or varlen (N, H, D) in, (out, lse, ...) / (dq, dk, dv) out. The backward
    is written out (dS = P * (dP - rowsum(dP * P))) because custom ops run below autograd."""

    def probabilities(q, k, cu_seqlens):  # -> (B, H, T, T) softmax of the masked, scaled scores
        T = q.size(1)
        allowed = torch.ones(T, T, dtype=torch.bool).tril()
        if cu_seqlens is not None:
            segment = torch.zeros(T, dtype=torch.long)
            segment[cu_seqlens[1:-1].long()] = 1
            segment = segment.cumsum(0)
            allowed &= segment[:, None] == segment[None, :]
        scores = torch.einsum("bthd,bshd->bhts", q, k) / math.sqrt(q.size(-1))
        return torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)

    def batched(*tensors, cu_seqlens):  # varlen (N, H, D) -> (1, N, H, D)
        return [t.unsqueeze(0) if cu_seqlens is not None else t for t in tensors]

    def _flash_attn_fwd(q, k, v, causal, return_lse, cu_seqlens_q=None, **varlen):
        calls.append("fwd")
        assert causal and return_lse
        q4, k4, v4 = batched(q, k, v, cu_seqlens=cu_seqlens_q)
        out = torch.einsum("bhts,bshd->bthd", probabilities(q4, k4, cu_seqlens_q), v4)
        lse_shape = (q.size(0), q.size(2), q.size(1)) if cu_seqlens_q is None else (q.size(1), q.size(0))
        return out.reshape(q.shape), torch.zeros(lse_shape, dtype=torch.float32), None, None, None

    def _flash_attn_bwd(q, k, v, out, dout, lse, causal, dq, dk, dv, cu_seqlens_q=None, **varlen):
        calls.append("bwd")
        gradients = dq, dk, dv  # filled in place, as the real kernel does
        q4, k4, v4, do4 = batched(q, k, v, dout, cu_seqlens=cu_seqlens_q)
        p = probabilities(q4, k4, cu_seqlens_q)
        dv = torch.einsum("bhts,bthd->bshd", p, do4)
        dp = torch.einsum("bthd,bshd->bhts", do4, v4)
        ds = p * (dp - (dp * p).sum(-1, keepdim=True)) / math.sqrt(q.size(-1))
        dq = torch.einsum("bhts,bshd->bthd", ds, k4)
        dk = torch.einsum("bhts,bthd->bshd", ds, q4)
        for gradient, value in zip(gradients, (dq, dk, dv)):
            gradient.copy_(value.reshape(gradient.shape))
        return gradients

    interface = ModuleType("fake_flash_attn_4_interface")  # hashable, like the real module
    interface._flash_attn_fwd, interface._flash_attn_bwd = _flash_attn_fwd, _flash_attn_bwd
    return interface


@pytest.mark.parametrize("docs", [False, True], ids=["causal", "docs"])
def test_flash_attn_4_custom_ops_give_manual_gradients_and_compile_in_one_graph(monkeypatch, docs):
    """The custom-op wrapper of flash-attn-4: the autograd formula matches manual attention in float64, and
    torch.compile traces it whole (fullgraph, fake tensors of the right shapes through aot_eager)."""
    calls = []
    ops = kernels.flash.flash_attn_4_ops(fake_flash_attn_4_interface(calls), f"test_fa4_{'docs' if docs else 'causal'}")
    attend = stand_in_flash(monkeypatch, ops)
    q, k, v, dy = random_qkv((2, 3, 24, 16), torch.float64, generator_for("fa4ops", docs))
    mask = AttentionMask(24, CPU, doc_ids_for(2, 24) if docs else None)
    ref_out, ref_grads = forward_backward(model.manual_attention, q, k, v, dy, mask)
    out, grads = forward_backward(attend, q, k, v, dy, mask)
    assert_matches(out, grads, ref_out, ref_grads, 1e-12, "flash_attn_4 ops")
    assert calls == ["fwd", "bwd"]
    compiled = torch.compile(attend, backend="aot_eager", fullgraph=True)
    out, grads = forward_backward(compiled, q, k, v, dy, mask)
    assert_matches(out, grads, ref_out, ref_grads, 1e-12, "compiled flash_attn_4 ops")
    # PyTorch's own check of a custom op: schema, autograd registration, fake outputs (shapes and
    # strides) equal to real ones, here for (B, T, H, D) views of (B, H, T, D) tensors, as the model passes
    op = getattr(torch.ops, f"test_fa4_{'docs' if docs else 'causal'}").forward
    layout = (t.detach().transpose(1, 2).requires_grad_(True) for t in (q, k, v))
    cu_seqlens, max_seqlen = mask.varlen() if docs else (None, 0)
    if docs:
        layout = (t.reshape(-1, *t.shape[2:]).detach().requires_grad_(True) for t in layout)
    layout = list(layout)
    torch.library.opcheck(op, (*layout, cu_seqlens, max_seqlen))
    out, lse = op(*layout, cu_seqlens, max_seqlen)
    backward = getattr(torch.ops, f"test_fa4_{'docs' if docs else 'causal'}").backward
    torch.library.opcheck(
        backward, (torch.randn_like(out), *(t.detach() for t in (*layout, out, lse)), cu_seqlens, max_seqlen)
    )


def test_flash_attn_4_without_the_private_functions_is_unavailable(monkeypatch):
    module = SimpleNamespace(interface=None, flash_attn_func=None)
    installed(monkeypatch, flash_attn__cute=module)
    monkeypatch.setattr(kernels.flash, "dist_version", lambda distribution: "4.9")
    kernel = kernels.flash.flash_attn_4_backend().kernel
    assert "has no interface._flash_attn_fwd" in kernel.why_not(AttentionUse(CUDA, torch.bfloat16))
    assert kernel.module is None


def test_flash_kernel_imports_its_package_once(monkeypatch):
    """The package is imported by the first why_not check; calls read it from an attribute, so a compiled
    forward never traces an import lookup."""
    calls, lookups = [], []
    fake = fake_flash_module(returns_tuple=False, calls=calls)
    real_import = importlib.import_module
    monkeypatch.setattr(
        importlib,
        "import_module",
        lambda name: lookups.append(name) or fake if name == "flash_attn" else real_import(name),
    )
    kernel = model.FlashAttn2()  # a fresh kernel: it imports the package anew
    assert kernel.why_not(AttentionUse(CPU, torch.bfloat16)) == "flash-attn runs on CUDA GPUs only (device is cpu)"
    kernel.why_not(AttentionUse(CPU, torch.bfloat16))
    q, k, v, _ = random_qkv((2, 2, 8, 16), torch.float64, generator_for("bound"))
    kernel(q, k, v, AttentionMask(8, CPU), 0.0)
    assert lookups == ["flash_attn"] and len(calls) == 1


def test_flash_attn_4_alone_is_not_taken_for_flash_attn_2(monkeypatch):
    """flash-attn-4 installs flash_attn.cute; without flash-attn 2, `flash_attn` is a bare namespace."""
    installed(monkeypatch, flash_attn=SimpleNamespace(__name__="flash_attn"))
    kernel = model.FlashAttn2()  # a fresh kernel: it imports the package anew
    assert "flash-attn is not installed" in kernel.why_not(AttentionUse(CUDA, torch.bfloat16))
    assert kernel.module is None


def test_flash_attn_2_draft_of_flash_attn_cute_is_not_flash_attn_4(monkeypatch):
    """flash-attn 2.8 ships an early flash_attn.cute; only the flash-attn-4 distribution counts as FA4."""
    interface = SimpleNamespace(_flash_attn_fwd=None, _flash_attn_bwd=None)
    installed(monkeypatch, flash_attn__cute=SimpleNamespace(flash_attn_func=None, interface=interface))
    monkeypatch.setattr(kernels.flash, "flash_attn_4_ops", lambda interface: "ops")  # no op registered for a fake
    monkeypatch.setattr(kernels.flash, "dist_version", lambda distribution: "")
    use = AttentionUse(CUDA, torch.bfloat16)
    assert kernels.flash.flash_attn_4_backend().kernel.why_not(use) == "flash-attn-4 (flash_attn.cute) is not installed"
    monkeypatch.setattr(kernels.flash, "dist_version", lambda distribution: "4.0.0b36")
    kernel = kernels.flash.flash_attn_4_backend().kernel
    assert kernel.load() == "" and (kernel.module, kernel.version) == ("ops", "4.0.0b36")


# ---- resolution: the fallback chain, with availability simulated ----------------------------------


@pytest.fixture
def fake_env(monkeypatch):
    """Simulate installed packages, the GPU's compute capability and the torch version."""

    def guard(*args, **kwargs):
        raise AssertionError("a resolver test touched real CUDA")

    monkeypatch.setattr(torch.cuda, "get_device_name", guard)

    def configure(installed=(), capability=(9, 0), torch_version=(2, 11)):
        for name in ("flash_attn", "flash_attn_interface", "flash_attn_3", "flash_attn.cute"):
            module = SimpleNamespace(
                __name__=name,
                flash_attn_func=None,
                flash_attn_varlen_func=None,
                interface=SimpleNamespace(_flash_attn_fwd=None, _flash_attn_bwd=None),
            )
            monkeypatch.setitem(sys.modules, name, module if name in installed else None)  # None: not installed
        fresh_flash_backends(monkeypatch)  # kernels that import the simulated packages
        monkeypatch.setattr(kernels.flash, "dist_version", lambda d: "9.9" if "flash_attn.cute" in installed else "")
        monkeypatch.setattr(kernels.flash, "flash_attn_4_ops", lambda interface: interface)  # no op registered
        # every module asks torch for the capability of the (never touched) GPU
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        monkeypatch.setattr(kernels.flex, "torch_version", lambda: torch_version)

    return configure


def resolve(name, device, dtype=torch.bfloat16, doc_mask=False, backward=False, dropout=False, head_dim=64, seq_len=0):
    return model.resolve(name, AttentionUse(device, dtype, head_dim, doc_mask, dropout, backward, seq_len))


def test_flash_attn_missing_on_cuda_falls_back_to_sdpa(fake_env):
    fake_env(installed=())
    assert resolve("flash_attn_2", CUDA) == Resolution("sdpa", "flash-attn is not installed")


def test_flash_attn_on_sm75_falls_back_with_capability_reason(fake_env):
    fake_env(installed=("flash_attn",), capability=(7, 5))
    used, reason = resolve("flash_attn_2", CUDA)
    assert used == "sdpa" and "sm75" in reason


def test_flash_attn_3_on_sm80_falls_back_to_flash_attn_2(fake_env):
    fake_env(installed=("flash_attn", "flash_attn_interface"), capability=(8, 0))
    used, reason = resolve("flash_attn_3", CUDA)
    assert used == "flash_attn_2"
    assert "Hopper" in reason and "sm90" in reason and "sm80" in reason


def test_flash_attn_3_not_installed_falls_back_to_flash_attn_2(fake_env):
    fake_env(installed=("flash_attn",), capability=(9, 0))
    used, reason = resolve("flash_attn_3", CUDA)
    assert used == "flash_attn_2" and "not installed" in reason


def test_flash_attn_3_module_under_its_new_name_is_used(fake_env):
    fake_env(installed=("flash_attn_3",), capability=(9, 0))
    assert resolve("flash_attn_3", CUDA) == Resolution("flash_attn_3", "")


def test_flash_attn_4_falls_back_along_its_chain(fake_env):
    fake_env(installed=("flash_attn", "flash_attn.cute"), capability=(9, 0))
    assert resolve("flash_attn_4", CUDA) == Resolution("flash_attn_4", "")
    assert resolve("flash_attention_4", CUDA, torch.float16, head_dim=256).used == "flash_attn_4"
    used, reason = resolve("flash_attn_4", CUDA, dropout=True)
    assert used == "flash_attn_2" and "flash_attn_4 has no attention dropout" in reason
    used, reason = resolve("flash_attn_4", CUDA, torch.float32)
    assert used == "sdpa" and "float32" in reason
    fake_env(installed=("flash_attn", "flash_attn.cute"), capability=(8, 0))
    used, reason = resolve("flash_attn_4", CUDA)
    assert used == "flash_attn_2" and "sm80" in reason and "Hopper and Blackwell" in reason
    fake_env(installed=("flash_attn",), capability=(9, 0))
    used, reason = resolve("flash_attn_4", CUDA)
    assert used == "flash_attn_2" and "flash_attn.cute) is not installed" in reason


def test_flash_attn_4_head_dims_on_blackwell(fake_env):
    fake_env(installed=("flash_attn.cute",), capability=(10, 0))
    assert resolve("flash_attn_4", CUDA, head_dim=128).used == "flash_attn_4"
    assert resolve("flash_attn_4", CUDA, head_dim=256).used == "flash_attn_4"
    used, reason = resolve("flash_attn_4", CUDA, head_dim=192)
    assert used == "sdpa" and "sm100" in reason and "192" in reason


def test_auto_on_blackwell_prefers_flash_attn_4(fake_env):
    fake_env(installed=("flash_attn", "flash_attn.cute"), capability=(10, 0))
    assert resolve("auto", CUDA, backward=True).used == "flash_attn_4"
    assert resolve("auto", CUDA, doc_mask=True, backward=True).used == "flash_attn_4"
    fake_env(installed=("flash_attn", "flash_attn.cute"), capability=(9, 0))
    assert resolve("auto", CUDA, backward=True).used == "sdpa"
    fake_env(installed=("flash_attn",), capability=(10, 0))
    used, reason = resolve("auto", CUDA, backward=True)
    assert used == "sdpa" and "flash_attn_4: flash-attn-4 (flash_attn.cute) is not installed" in reason


def test_mps_uses_sdpa_and_manual_for_documents(fake_env):
    fake_env(installed=("flash_attn",))
    used, reason = resolve("flash_attn_2", MPS, torch.float16)
    assert used == "sdpa" and "mps" in reason
    assert resolve("sdpa", MPS, torch.float32) == Resolution("sdpa", "")
    used, reason = resolve("sdpa", MPS, torch.float32, doc_mask=True)
    assert used == "manual" and "MPS" in reason
    assert resolve("flash_attn_2", MPS, torch.float16, doc_mask=True).used == "manual"


def test_float32_on_cuda_with_flash_attn_falls_back_to_sdpa(fake_env):
    fake_env(installed=("flash_attn",), capability=(9, 0))
    used, reason = resolve("flash_attn_2", CUDA, torch.float32)
    assert used == "sdpa" and "float32" in reason
    assert resolve("flash_attn_2", CUDA, torch.bfloat16) == Resolution("flash_attn_2", "")
    assert resolve("flash_attn_2", CUDA, torch.float16) == Resolution("flash_attn_2", "")


def test_flash_attn_head_dim_limits(fake_env):
    fake_env(installed=("flash_attn",), capability=(9, 0))
    assert resolve("flash_attn_2", CUDA, head_dim=128).used == "flash_attn_2"
    assert resolve("flash_attn_2", CUDA, head_dim=12).used == "sdpa"
    assert resolve("flash_attn_2", CUDA, head_dim=264).used == "sdpa"


def test_old_torch_has_no_flex_attention(fake_env):
    fake_env(torch_version=(2, 4))
    used, reason = resolve("flex_attention", CUDA)
    assert used == "sdpa" and "torch >= 2.5" in reason
    fake_env(torch_version=(2, 5))
    assert resolve("flex_attention", CUDA) == Resolution("flex_attention", "")


def test_flex_on_cpu_is_inference_only(fake_env):
    fake_env()
    used, reason = resolve("flex_attention", CPU, torch.float32, backward=True)
    assert used == "sdpa" and "CPU" in reason
    assert resolve("flex_attention", CPU, torch.float32, backward=False) == Resolution("flex_attention", "")
    assert resolve("flex_attention", CPU, torch.float64, backward=False).used == "sdpa"


def test_flex_with_dropout_falls_back(fake_env):
    fake_env()
    used, reason = resolve("flex_attention", CUDA, dropout=True, backward=True)
    assert used == "sdpa" and "dropout" in reason
    assert resolve("flex", CUDA, dropout=False, backward=True) == Resolution("flex_attention", "")


def test_flash_attn_3_has_no_dropout(fake_env):
    fake_env(installed=("flash_attn", "flash_attn_interface"), capability=(9, 0))
    assert resolve("flash_attn_3", CUDA) == Resolution("flash_attn_3", "")
    used, reason = resolve("flash_attn_3", CUDA, dropout=True)
    assert used == "flash_attn_2" and "dropout" in reason


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("doc_mask", [False, True])
def test_auto_on_cpu_picks_sdpa(fake_env, dtype, doc_mask):
    fake_env(installed=("flash_attn", "flash_attn_interface"))
    used, reason = resolve("auto", CPU, dtype, doc_mask=doc_mask, backward=True)
    assert used == "sdpa"
    assert reason.startswith(f"auto: first that runs on cpu/{str(dtype)[6:]}")


@pytest.mark.parametrize(
    "doc_mask, head_dim, short, long",
    [(False, 64, 256, 512), (False, 128, 512, 1024), (True, 64, 2048, 4096), (True, 128, 4096, 8192)],
)
def test_auto_on_sm90_takes_flash_attn_4_from_the_measured_lengths(fake_env, doc_mask, head_dim, short, long):
    fake_env(installed=("flash_attn", "flash_attn.cute"), capability=(9, 0))
    below = "flex_attention" if doc_mask else "sdpa"
    use = dict(doc_mask=doc_mask, head_dim=head_dim, backward=True)
    assert resolve("auto", CUDA, seq_len=short, **use).used == below
    assert resolve("auto", CUDA, seq_len=long, **use).used == "flash_attn_4"
    assert resolve("auto", CUDA, seq_len=0, **use).used == below  # unknown length counts as short
    fake_env(installed=("flash_attn",), capability=(9, 0))  # without flash-attn-4: the order below
    assert resolve("auto", CUDA, seq_len=long, **use).used == below


def test_model_resolves_auto_for_the_length_it_is_set_up_for(fake_env):
    """Training resolves at block_size (or the given length), from the card's table."""
    fake_env(installed=("flash_attn.cute",), capability=(9, 0))
    gpt = GPT(tiny_config(block_size=4096, n_embd=128, n_head=2))
    assert gpt.setup_attention(CUDA, torch.bfloat16).used == "flash_attn_4"
    start = dict(kernels.auto.read_auto_table()["sm90"]["causal"])[64]  # head dim 128 / 2 = 64
    assert gpt.setup_attention(CUDA, torch.bfloat16, seq_len=start - 1).used == "sdpa"
    assert gpt.setup_attention(CUDA, torch.bfloat16, seq_len=start).used == "flash_attn_4"
    assert gpt.attention.kernel is model.BACKENDS["flash_attn_4"].kernel


def test_auto_on_sm90_without_flash_attn_picks_sdpa(fake_env):
    fake_env(installed=(), capability=(9, 0))
    assert resolve("auto", CUDA, backward=True).used == "sdpa"
    used, reason = resolve("auto", CUDA, doc_mask=True, backward=True)
    assert used == "flex_attention" and "skipped" not in reason


def test_auto_with_documents_on_sm90_prefers_flex_then_flash_attn_2(fake_env):
    fake_env(installed=("flash_attn",), capability=(9, 0))
    assert resolve("auto", CUDA, torch.bfloat16, doc_mask=True, backward=True).used == "flex_attention"
    assert resolve("auto", CUDA, torch.bfloat16, doc_mask=False, backward=True).used == "sdpa"
    fake_env(installed=("flash_attn",), capability=(9, 0), torch_version=(2, 4))  # no flex: varlen flash is next
    used, reason = resolve("auto", CUDA, torch.bfloat16, doc_mask=True, backward=True)
    assert used == "flash_attn_2"
    assert "flex_attention: flex_attention needs torch >= 2.5" in reason and "flash_attn_3" in reason


def test_auto_on_older_gpu_prefers_flash_attn_2(fake_env):
    fake_env(installed=("flash_attn",), capability=(8, 0))
    assert resolve("auto", CUDA, torch.bfloat16, backward=True).used == "flash_attn_2"
    assert resolve("auto", CUDA, torch.float32, backward=True).used == "sdpa"


def test_every_fallback_chain_ends_in_manual_and_every_auto_order_names_backends():
    for name in model.BACKENDS:
        chain = [name]
        while model.BACKENDS[chain[-1]].fallback:
            chain.append(model.BACKENDS[chain[-1]].fallback)
            assert len(chain) <= len(model.BACKENDS), f"{name}: the fallback chain loops: {chain}"
        assert chain[-1] == "manual"
    default = [model.default_auto_order(AttentionUse(CPU, torch.float32, documents=docs))[0] for docs in (False, True)]
    for order in [*kernels.auto.AUTO_ORDER.values(), *default]:
        assert order[-1] == "manual" and set(order) <= set(model.BACKENDS)
    # generation decodes with every backend that has a kernel (paged_attention names a cache layout)
    assert set(kv_cache.DECODE_KERNELS) == {name for name, b in model.BACKENDS.items() if b.kernel is not None}
    for order in kv_cache.DECODE_ORDER.values():
        assert "manual" in order and set(order) <= set(kv_cache.DECODE_KERNELS)


def test_why_not_sdpa_kernels():
    assert model.why_not_sdpa_kernel("math", AttentionUse(CPU, torch.float32)) == ""
    assert model.why_not_sdpa_kernel("flash", AttentionUse(CPU, torch.float32)) == ""
    assert "CUDA only" in model.why_not_sdpa_kernel("cudnn", AttentionUse(CPU, torch.bfloat16))
    assert "document mask" in model.why_not_sdpa_kernel("flash", AttentionUse(CPU, torch.float32, documents=True))


# ---- the model logs its choice once, and resolves for the device/dtype it runs with ---------------


def model_records(caplog):
    return [r for r in caplog.records if r.name == "model"]


def train_and_eval(gpt, steps=3, T=16):
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(0, gpt.config.vocab_size, (2, T), generator=gen)
    gpt.train()
    for _ in range(steps):
        gpt.zero_grad()
        _, loss = gpt(idx, idx)
        loss.backward()
    gpt.eval()
    with torch.no_grad():
        gpt(idx)


def test_fallback_is_logged_once_per_model(monkeypatch, caplog):
    installed(monkeypatch, flash_attn=None)
    fresh_flash_backends(monkeypatch)
    caplog.set_level(logging.DEBUG, logger="model")
    torch.manual_seed(0)
    train_and_eval(GPT(tiny_config(n_layer=3, attention_backend="flash_attn_2")))
    records = model_records(caplog)
    warnings_ = [r.getMessage() for r in records if r.levelno == logging.WARNING]
    infos = [r.getMessage() for r in records if r.levelno == logging.INFO]
    assert warnings_ == ["flash_attn_2 requested but flash-attn is not installed; falling back to sdpa"]
    assert infos == ["attention backend: sdpa (requested flash_attn_2: flash-attn is not installed)"]
    caplog.clear()
    train_and_eval(GPT(tiny_config(n_layer=3, attention_backend="flash_attn_2")), steps=1)
    assert len(model_records(caplog)) == 2, "a new model logs its own choice once"


def test_auto_logs_one_info_line_and_no_warning(caplog):
    caplog.set_level(logging.DEBUG, logger="model")
    torch.manual_seed(0)
    train_and_eval(GPT(tiny_config(attention_backend="auto")))
    records = model_records(caplog)
    assert [r.levelno for r in records] == [logging.INFO]
    assert records[0].getMessage().startswith("attention backend: sdpa (auto: first that runs on cpu/float32")


def test_unusable_sdpa_kernel_warns_once(caplog):
    caplog.set_level(logging.DEBUG, logger="model")
    torch.manual_seed(0)
    train_and_eval(GPT(tiny_config(attention_backend="sdpa", sdpa_kernel="cudnn")))
    warnings_ = [r.getMessage() for r in model_records(caplog) if r.levelno == logging.WARNING]
    assert warnings_ == [
        "sdpa_kernel=cudnn requested but SDPA's cudnn kernel runs on CUDA only (device is cpu); letting PyTorch choose"
    ]


def test_a_model_not_set_up_resolves_at_its_first_forward_for_the_autocast_dtype():
    torch.manual_seed(0)
    idx = torch.randint(0, 64, (2, 8))
    gpt = GPT(tiny_config(attention_backend="auto"))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, loss = gpt(idx, idx)
    assert torch.isfinite(loss)
    assert "cpu/bfloat16" in gpt.attention.resolution.reason
    assert gpt.attention.use.dtype == torch.bfloat16 and not gpt.attention.use.documents
    gpt(idx, idx)  # set up already: forward only reads the attribute
    assert "cpu/bfloat16" in gpt.attention.resolution.reason
    assert "cpu/float32" in gpt.setup_attention(CPU, torch.float32).reason
    assert "cpu/float64" in gpt.double().setup_attention(CPU, torch.float64).reason


def test_training_and_inference_resolve_apart_for_flex_on_cpu():
    """Training on CPU cannot use flex (no backward there); inference may."""
    gpt = GPT(tiny_config(attention_backend="flex_attention"))
    assert gpt.setup_attention(CPU, torch.float32, training=True).used == "sdpa"
    assert gpt.setup_attention(CPU, torch.float32, training=False).used == "flex_attention"


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_the_first_forward_resolves_for_the_mode_the_model_is_in(caplog, monkeypatch):
    """A model in eval mode under no_grad runs inference: flex_attention on CPU, without a fallback; a later
    forward that trains resolves again (flex has no backward on CPU), and an eval forward then keeps that.
    Resolution is what is tested: flex runs eagerly here (compiling it on the CPU takes up to a minute cold; the
    flex tests above check the compiled kernel)."""
    from torch.nn.attention.flex_attention import flex_attention as eager_flex

    monkeypatch.setattr(kernels.flex, "compiled_flex_attention", lambda: eager_flex)
    caplog.set_level(logging.INFO, logger="model")
    gpt = GPT(tiny_config(attention_backend="flex_attention", n_embd=32, n_head=2)).eval()
    idx = torch.randint(0, 64, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        gpt(idx)
    assert gpt.attention.resolution == Resolution("flex_attention", "") and not gpt.attention.use.training
    assert "WARNING" not in [r.levelname for r in caplog.records]
    gpt.train()
    _, loss = gpt(idx, idx)
    loss.backward()
    assert gpt.attention.resolution.used == "sdpa" and gpt.attention.use.training
    assert "no backward pass on CPU" in caplog.text
    held = gpt.attention
    with torch.no_grad():
        gpt.eval()(idx)
    assert gpt.attention is held  # resolved for training: it serves inference as it is


def test_generation_resolves_for_inference_once_and_keeps_the_training_choice(monkeypatch):
    gpt = GPT(tiny_config()).eval()
    gpt.setup_attention(CPU, torch.float32)
    training_choice = gpt.attention
    resolved = []
    original = model.resolve
    monkeypatch.setattr(model, "resolve", lambda *args: resolved.append(args[1]) or original(*args))
    generate(gpt, torch.zeros(1, 1, dtype=torch.long), 5, top_k=1)
    assert [(need.training, need.kv_cache) for need in resolved] == [(False, "contiguous")], "once, not per token"
    assert gpt.attention is training_choice
    resolved.clear()
    gpt.generate(torch.zeros(1, 1, dtype=torch.long), 5, top_k=1)  # the plain loop runs the model's own choice
    assert resolved == [] and gpt.attention is training_choice


# ---- adding a backend: one record + its kernel -------------------------------------------------


def test_a_registered_toy_backend_runs_and_falls_back(monkeypatch, caplog):
    monkeypatch.setattr(model, "BACKENDS", dict(model.BACKENDS))  # the registry as it was, after this test
    calls = []

    def toy_attention(q, k, v, mask, dropout_p=0.0):
        calls.append(q.shape)
        return model.manual_attention(q, k, v, mask, dropout_p)

    def toy_problem(need):
        return "" if need.dtype == torch.float32 else f"toy needs float32 (this run is {model.dtype_name(need.dtype)})"

    model.register(model.AttentionBackend("toy", toy_attention, toy_problem, fallback="manual", aliases=("plaything",)))
    assert model.canonical_backend("plaything") == "toy"
    gpt = GPT(tiny_config(attention_backend="plaything"))
    caplog.set_level(logging.INFO, logger="model")
    assert gpt.setup_attention(CPU, torch.float32) == Resolution("toy", "")
    idx = torch.randint(0, 64, (2, 8))
    _, loss = gpt(idx, idx)
    assert len(calls) == gpt.config.n_layer and torch.isfinite(loss)
    assert gpt.double().setup_attention(CPU, torch.float64).used == "manual"
    assert "toy requested but toy needs float32 (this run is float64); falling back to manual" in caplog.text


def test_model_alone_registers_its_own_three_kernels_and_kernels_adds_the_rest():
    """A script that imports model.py alone gets manual, sdpa and flash_attn_2 and the default auto order;
    `import kernels` registers flash-attn 3 and 4, flex_attention and auto's per-card order into the same
    registry."""
    script = (
        "import json, sys, torch, model\n"
        "need = model.AttentionUse('cpu', torch.float32)\n"
        "alone = (sorted(model.BACKENDS), model.resolve('auto', need).reason, 'kernels' in sys.modules)\n"
        "import kernels\n"
        "print(json.dumps([alone, sorted(model.BACKENDS), model.resolve('auto', need).reason]))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    (names, reason, imported), with_kernels, reason_with_kernels = json.loads(result.stdout)
    assert names == ["flash_attn_2", "manual", "sdpa"] and not imported
    assert reason.startswith("auto: first that runs on cpu/float32 of sdpa > flash_attn_2 > manual")
    assert set(with_kernels) == {"flash_attn_2", "flash_attn_3", "flash_attn_4", "flex_attention", "manual", "sdpa"}
    assert reason_with_kernels.startswith("auto: first that runs on cpu/float32 of sdpa > manual")


# ---- auto: the per-card table, and timing on a card the table does not know -------------------


def test_decode_order_depends_on_how_the_step_runs(fake_env):
    """Eager decoding pays per launch (flash-attn's one kernel first, then SDPA); a CUDA graph or a compiled step
    pays for the kernels' own time (manual first without flash-attn under a graph: no compile; flex first when
    compiled). Off CUDA a graphed or compiled step runs eagerly, so its order is the eager one."""
    fake_env(installed=(), capability=(9, 0))  # no flash-attn
    gpt = GPT(tiny_config(n_embd=128, n_head=2))  # head dim 64
    need = gpt.attention_use(CUDA, torch.bfloat16, training=False, seq_len=384, kv_cache="contiguous")
    assert kv_cache.decode_order(need) == (kv_cache.DECODE_ORDER[("cuda", "contiguous", "eager")], "decode order")
    attention, decode = generation_attention(gpt, need)
    assert attention.resolution.used == "sdpa" and decode == kv_cache.DECODE_KERNELS["sdpa"]
    assert "decode order" in attention.resolution.reason and attention.use == need
    for step, first in (("graph", "manual"), ("compiled", "flex_attention")):
        static = dataclasses.replace(need, decode_step=step)
        assert kv_cache.decode_order(static)[1] == f"{step} decode order"
        attention, decode = generation_attention(gpt, static)
        assert attention.resolution.used == first and decode == kv_cache.DECODE_KERNELS[first]
        reads_prompts = model.resolve("auto", dataclasses.replace(need, kv_cache="none")).used  # a forward's pick
        assert reads_prompts != first and attention.kernel is model.BACKENDS[reads_prompts].kernel
        assert generation_attention(gpt, dataclasses.replace(static, kv_cache="paged"))[0].resolution.used == first
        on_cpu = dataclasses.replace(static, device=CPU, dtype=torch.float32)
        assert kv_cache.decode_order(on_cpu) == (("sdpa", "manual"), "decode order")
    assert gpt.attention is None, "generation's choice is its own: the model is not set up by it"


def test_auto_table_file_is_data_the_resolver_reads(fake_env, tmp_path):
    fake_env(installed=("flash_attn.cute",), capability=(9, 0))
    table = {"sm90": {"first": "flash_attn_4", "causal": [[64, 100], [256, 200]]}}
    long_need = AttentionUse(CUDA, torch.bfloat16, 64, seq_len=100)
    assert kernels.auto.table_order(long_need, table)[0][0] == "flash_attn_4"
    assert kernels.auto.table_order(AttentionUse(CUDA, torch.bfloat16, 128, seq_len=100), table)[0][0] == "sdpa"
    documents = AttentionUse(CUDA, torch.bfloat16, 64, documents=True, seq_len=10**6)
    assert kernels.auto.table_order(documents, table)[0][0] != "flash_attn_4"  # no documents entry: the default order
    path = tmp_path / "auto.json"
    path.write_text(json.dumps({"cards": table}))
    assert kernels.auto.read_auto_table(path) == table
    path.write_text("not json")
    assert kernels.auto.read_auto_table(path) == {}


def test_auto_times_the_candidates_once_and_caches_the_choice(monkeypatch, tmp_path):
    cache = tmp_path / "auto.json"
    need = AttentionUse(CPU, torch.float32, 16, seq_len=32)
    slow = functools.partial(model.manual_attention)
    order, how = kernels.auto.measured_order({"sdpa": model.sdpa_attention, "slow": slow}, need, 2, cache, 64)
    assert set(order) == {"sdpa", "slow"} and how.startswith("measured on this card: ")
    cached = json.loads(cache.read_text())
    key = kernels.auto.measure_key(need, 2)
    assert list(cached) == [key] and set(cached[key]) == set(order)
    monkeypatch.setattr(kernels.auto, "time_kernel", lambda *a, **k: pytest.fail("timed again"))
    again, how = kernels.auto.measured_order({"sdpa": model.sdpa_attention, "slow": slow}, need, 2, cache, 64)
    assert again == order and how.startswith("measured on this card earlier: ")


def test_model_on_an_unknown_card_measures_only_when_set_up_to_and_says_so(fake_env, monkeypatch, caplog):
    fake_env(installed=("flash_attn",), capability=(8, 9))  # an L4/4090: not in the table
    timed = []

    def measured(runs, need, n_head):
        timed.append(sorted(runs))
        return ("sdpa", "flash_attn_2"), "measured on this card: x"

    monkeypatch.setattr(kernels.auto, "measured_order", measured)
    caplog.set_level(logging.INFO, logger="model")
    gpt = GPT(tiny_config())
    assert gpt.setup_attention(CUDA, torch.bfloat16).used == "flash_attn_2" and not timed  # default: the order
    used, reason = gpt.setup_attention(CUDA, torch.bfloat16, measure=True)
    assert used == "sdpa" and "measured on this card" in reason and "measured on this card" in caplog.text
    assert timed == [["flash_attn_2", "sdpa"]]  # the candidates that run here; manual is never timed
    assert GPT(tiny_config(auto_measure=False)).setup_attention(CUDA, torch.bfloat16, measure=True).used == (
        "flash_attn_2"
    )
    fake_env(installed=("flash_attn",), capability=(9, 0))  # a card the table knows: its table, no timing
    assert GPT(tiny_config()).setup_attention(CUDA, torch.bfloat16, measure=True).used == "sdpa"
    assert len(timed) == 1


# ---- GPU: every backend there vs a float32 manual reference (run on the device) -------------------

GPU_SHAPES = [(77, 64), (77, 128), (1000, 64), (1000, 128), (2048, 64), (2048, 128)]  # (T, D)
FLEX_GPU_SHAPES = [(77, 128), (2048, 64)]  # each (shape, dtype, docs) compiles flex fwd+bwd: keep them few
GPU_BACKENDS = [
    "sdpa-flash",
    "sdpa-cudnn",
    "sdpa-efficient",
    "sdpa-math",
    "flex_attention",
    "flash_attn_2",
    "flash_attn_3",
    "flash_attn_4",
]
GPU_CASES = [(b, T, D) for b in GPU_BACKENDS for T, D in (FLEX_GPU_SHAPES if b == "flex_attention" else GPU_SHAPES)]


def gpu_attention(backend, dtype, docs, head_dim):
    """The function under test, or pytest.skip with the resolver's reason when it cannot run here."""
    device = torch.device("cuda", torch.cuda.current_device())
    if backend.startswith("sdpa-"):
        kernel = backend.split("-")[1]
        problem = model.why_not_sdpa_kernel(kernel, AttentionUse(device, dtype, head_dim, docs))
        if problem:
            pytest.skip(problem)
        return sdpa_with(kernel)
    problem = model.BACKENDS[backend].why_not(AttentionUse(device, dtype, head_dim, docs))
    if problem:
        pytest.skip(problem)
    return model.BACKENDS[backend].kernel


@pytest.mark.gpu
@pytest.mark.parametrize("backend, T, D", GPU_CASES, ids=[f"{b}-T{T}-D{D}" for b, T, D in GPU_CASES])
@pytest.mark.parametrize("docs", [False, True], ids=["causal", "docs"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])  # -k fp16 selects one
@pytest.mark.usefixtures("allow_flex_recompiles")
def test_gpu_backend_matches_float32_manual(monkeypatch, backend, dtype, docs, T, D):
    attend = gpu_attention(backend, dtype, docs, D)
    B, H = 3, 4
    q, k, v, dy = random_qkv((B, H, T, D), dtype, generator_for("gpu", backend, dtype, docs, T, D), device="cuda")
    doc_ids = doc_ids_for(B, T, device="cuda") if docs else None
    with no_eager_flex():
        out, grads = forward_backward(attend, q, k, v, dy, AttentionMask(T, q.device, doc_ids))
    assert out.dtype == dtype and out.shape == q.shape
    ref_out, ref_grads = forward_backward(
        model.manual_attention, q.float(), k.float(), v.float(), dy.float(), AttentionMask(T, q.device, doc_ids)
    )
    assert_matches(out, grads, ref_out, ref_grads, 2e-2, f"{backend} {dtype} T={T} D={D}")
    if docs:
        causal = model.manual_attention(q.float(), k.float(), v.float(), AttentionMask(T, q.device))
        assert_docs_masked(out.cpu(), causal.cpu(), doc_ids.cpu(), same=2e-2)
