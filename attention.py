"""
The attention kernels behind model.py's backends, and what `auto` knows about them.

Every kernel has one signature, (q, k, v, mask, dropout_p) -> y on (B, H, T, D) tensors, always causal,
and a `problem(need)` that says why it cannot run for a use ('' when it can). k and v may have fewer heads than
q, each shared by a group of query heads (GQA; MQA with one): every kernel takes that, natively where it can.
model.py holds one record per backend (name, aliases, kernel, problem, fallback); this file holds the kernels
themselves: the explicit reference, PyTorch's SDPA and flex_attention, and adapters for the flash-attn packages
(flash-attn-4's kernels wrapped as PyTorch custom ops so torch.compile keeps one graph). Last, auto's per-card table
(config/attention_auto.json) and, for a card the table does not know, a one-time timing of the candidates.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.metadata
import json
import logging
import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import NamedTuple

import torch
from torch.nn import functional as F

from data.atomic import atomic_path

log = logging.getLogger("model")

HALF = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class Need:
    """What a use of attention requires of a kernel."""

    device: torch.device
    dtype: torch.dtype  # the compute dtype (autocast's, else the weights')
    head_dim: int = 64
    documents: bool = False  # attention restricted to documents of a packed row
    dropout: bool = False  # attention dropout during training
    training: bool = True  # gradients are needed
    seq_len: int = 0  # the longest sequence this use runs (0: unknown); only auto's order depends on it
    kv_cache: str = "none"  # generation: the KV cache decode steps read (none | contiguous | paged, kv_cache.py)
    compiled: bool = False  # generation: the decode step runs under torch.compile (CUDA graphs)
    mps_fix: bool = True  # keep SDPA away from explicit masks on MPS (sdpa_problem); GPTConfig.disable_mps_fix

    def __post_init__(self):
        object.__setattr__(self, "device", torch.device(self.device))

    @property
    def where(self) -> str:
        return f"{self.device.type}/{dtype_name(self.dtype)}"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def cuda_capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)


# ----------------------------------------------------------------------------------------------
# Masks: causal, optionally restricted to documents of a packed sequence


class AttentionMask:
    """The causal (and same-document) mask of one forward pass.

    Built once per forward and shared by all layers; each kernel asks for the form it needs (a dense
    boolean mask, cu_seqlens for varlen kernels, a flex BlockMask), made on first use.
    `doc_ids` (B, T): documents are the runs of equal ids, so ids need not be sorted.
    """

    def __init__(self, seq_len: int, device: torch.device, doc_ids: torch.Tensor | None = None):
        self.seq_len, self.device = seq_len, device
        self.segments = None if doc_ids is None else _run_ids(doc_ids)
        self._dense = self._varlen = self._block_mask = None

    @property
    def has_documents(self) -> bool:
        return self.segments is not None

    def dense(self) -> torch.Tensor:
        """(B or 1, 1, T, T) bool, True where attention is allowed."""
        if self._dense is None:
            T = self.seq_len
            mask = torch.ones(T, T, dtype=torch.bool, device=self.device).tril()
            if self.segments is not None:
                mask = mask & (self.segments[:, :, None] == self.segments[:, None, :])  # (B, T, T)
            self._dense = mask.view(-1, 1, T, T)
        return self._dense

    def varlen(self) -> tuple[torch.Tensor, int]:
        """cu_seqlens (int32, one entry per document start plus the end) over the flattened (B*T) tokens."""
        if self._varlen is None:
            starts = torch.ones_like(self.segments, dtype=torch.bool)
            starts[:, 1:] = self.segments[:, 1:] != self.segments[:, :-1]
            first = starts.flatten().nonzero().flatten()  # one host sync per forward, not per layer
            cu_seqlens = torch.cat([first, first.new_tensor([self.segments.numel()])]).to(torch.int32)
            self._varlen = (cu_seqlens, self.seq_len)  # T bounds every document's length
        return self._varlen

    def block_mask(self):
        if self._block_mask is None:
            from torch.nn.attention.flex_attention import create_block_mask

            segments = self.segments
            if segments is None:

                def mask_mod(b, h, q, kv):
                    return q >= kv

            else:

                def mask_mod(b, h, q, kv):
                    return (q >= kv) & (segments[b, q] == segments[b, kv])

            batch = None if segments is None else segments.size(0)
            self._block_mask = create_block_mask(mask_mod, batch, None, self.seq_len, self.seq_len, device=self.device)
        return self._block_mask


def _run_ids(doc_ids: torch.Tensor) -> torch.Tensor:
    """Number the runs of equal ids in each row 0, 1, 2, ... (documents are contiguous runs)."""
    change = torch.zeros_like(doc_ids, dtype=torch.int32)
    change[:, 1:] = (doc_ids[:, 1:] != doc_ids[:, :-1]).to(torch.int32)
    return change.cumsum(dim=1)


# ----------------------------------------------------------------------------------------------
# The reference, SDPA and flex_attention


def repeat_kv(q, k, v):
    """k and v (B, n_kv, S, D) with each head repeated for the n_head/n_kv query heads that share it (GQA/MQA):
    for kernels that take no fewer key/value heads than query heads."""
    group = q.size(1) // k.size(1)
    if group == 1:
        return k, v
    return k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # (B, nh, S, D)


def manual_attention(q, k, v, mask: AttentionMask, dropout_p: float = 0.0):
    """The reference: explicit scores, mask and a float32 (or wider) softmax. O(T^2) memory."""
    k, v = repeat_kv(q, k, v)
    scores = q @ k.transpose(-2, -1) * (1.0 / math.sqrt(q.size(-1)))  # (B, H, T, T)
    scores = scores.to(torch.promote_types(scores.dtype, torch.float32))
    scores = scores.masked_fill(~mask.dense(), float("-inf"))
    weights = F.dropout(F.softmax(scores, dim=-1), p=dropout_p).to(v.dtype)
    return weights @ v


def manual_problem(need: Need) -> str:
    return ""


SDPA_KERNELS = {
    "auto": None,
    "flash": "FLASH_ATTENTION",
    "cudnn": "CUDNN_ATTENTION",
    "efficient": "EFFICIENT_ATTENTION",
    "math": "MATH",
}


def sdpa_attention(q, k, v, mask: AttentionMask, dropout_p: float = 0.0, kernel: str = "auto"):
    """torch.nn.functional.scaled_dot_product_attention; `kernel` pins one of PyTorch's kernels."""
    if kernel == "auto":
        context = contextlib.nullcontext()
    else:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        context = sdpa_kernel(getattr(SDPBackend, SDPA_KERNELS[kernel]))
    attn_mask = mask.dense() if mask.has_documents else None
    k, v, gqa = sdpa_kv(q, k, v, attn_mask, kernel)
    with context:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=attn_mask is None, **gqa
        )


def sdpa_kv(q, k, v, attn_mask, kernel: str = "auto"):
    """(k, v, keywords) for SDPA when k and v may have fewer heads than q. enable_gqa where the kernel that
    will run reads grouped heads itself: PyTorch's flash kernel on CUDA (half precision, no mask; a GPU older
    than sm80 has none and runs the math kernel instead) and the math kernel. Elsewhere k and v are repeated to
    q's heads: the efficient kernel and the CPU kernels take no grouped heads, so enable_gqa with a mask
    (documents, decode steps) could leave only the math kernel."""
    if k.size(1) == q.size(1):
        return k, v, {}
    if kernel == "math" or (q.is_cuda and q.dtype in HALF and attn_mask is None and kernel in ("auto", "flash")):
        return k, v, {"enable_gqa": True}
    return *repeat_kv(q, k, v), {}


MPS_MASK_PROBLEM = "SDPA on MPS can return NaN for masked rows with an explicit mask (pytorch#107616)"


def sdpa_problem(need: Need) -> str:
    # document masks and KV-cache decode steps pass SDPA an explicit mask; plain causal attention does not
    if need.device.type == "mps" and need.mps_fix and (need.documents or need.kv_cache != "none"):
        return MPS_MASK_PROBLEM + "; disable_mps_fix=true keeps SDPA"
    return ""


def sdpa_kernel_problem(kernel: str, need: Need) -> str:
    """Why PyTorch's SDPA kernel `kernel` cannot be pinned for this use ('' when it can)."""
    device, dtype = need.device, need.dtype
    if kernel in ("cudnn", "efficient") and device.type != "cuda":
        return f"SDPA's {kernel} kernel runs on CUDA only (device is {device.type})"
    if kernel == "flash" and device.type == "cuda" and dtype not in HALF:
        return f"SDPA's flash kernel needs float16 or bfloat16 on CUDA (this run is {dtype_name(dtype)})"
    if kernel == "cudnn" and dtype not in HALF:
        return f"SDPA's cudnn kernel needs float16 or bfloat16 (this run is {dtype_name(dtype)})"
    if kernel in ("flash", "cudnn") and need.documents:
        return f"SDPA's {kernel} kernel takes no document mask"
    if kernel in ("flash", "cudnn") and device.type == "cuda" and cuda_capability(device) < (8, 0):
        return f"SDPA's {kernel} kernel needs compute capability >= 8.0"
    return ""


def flex_attention(q, k, v, mask: AttentionMask, dropout_p: float = 0.0):
    """flex_attention with a BlockMask that skips fully masked tiles. Always compiled: run eagerly it
    materialises the (T, T) scores."""
    from torch.nn.attention.flex_attention import flex_attention as flex

    run = flex if torch.compiler.is_compiling() else compiled_flex_attention()
    return run(q, k, v, block_mask=mask.block_mask(), enable_gqa=k.size(1) != q.size(1))


@functools.cache
def compiled_flex_attention():
    from torch.nn.attention.flex_attention import flex_attention as flex

    return torch.compile(flex, dynamic=False)


def flex_problem(need: Need) -> str:
    if torch_version() < (2, 5):
        return f"flex_attention needs torch >= 2.5 (this is {torch.__version__})"
    if need.device.type not in ("cuda", "cpu"):
        return f"flex_attention runs on CUDA and CPU only (device is {need.device.type})"
    if need.device.type == "cpu" and need.training:
        return "flex_attention has no backward pass on CPU; it can only run inference there"
    if need.device.type == "cpu" and need.dtype not in (torch.float32, *HALF):
        return f"flex_attention on CPU needs float32, float16 or bfloat16 (this run is {dtype_name(need.dtype)})"
    if need.dropout:
        return "flex_attention has no attention dropout (set dropout=0)"
    if need.head_dim < 16:
        return f"flex_attention needs a head dim >= 16 (got {need.head_dim})"
    return ""


# ----------------------------------------------------------------------------------------------
# flash-attn packages: FA2 (flash-attn), FA3 (built from flash-attention's hopper/), FA4 (flash-attn-4)


class Package(NamedTuple):
    module: object  # None when it cannot be imported
    version: str
    problem: str  # why it cannot be used ('' when it can)


def import_package(name: str, pretty: str, distribution: str) -> Package:
    """Import module `name` of a flash-attn package; a Package saying why not when it cannot."""
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as error:
        if name == error.name or name.startswith(f"{error.name}."):
            return Package(None, "", f"{pretty} is not installed")
        return Package(None, "", f"{pretty} failed to import: {error}")
    except (ImportError, OSError) as error:  # typically a wheel built for another torch/CUDA
        return Package(None, "", f"{pretty} failed to import: {str(error).splitlines()[0]}")
    if not hasattr(module, "flash_attn_func"):  # flash-attn-4 alone leaves a bare flash_attn namespace
        return Package(None, "", f"{pretty} is not installed (module {name} has no flash_attn_func)")
    return Package(module, dist_version(distribution) or getattr(module, "__version__", ""), "")


def dist_version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return ""


class FlashAttention:
    """One flash-attn package as an attention kernel. The package is imported once, by the first
    `problem` check (which the model runs when it resolves its backend); a call then reads the module
    from an attribute, so torch.compile never traces an import."""

    def __init__(
        self,
        label: str,
        modules: tuple[tuple[str, str, str], ...],
        min_sm: tuple[int, int],
        sm_rule: str,
        dropout: bool = False,
    ):
        self.label = label  # the name in messages: "flash-attn 2"
        self.modules = modules  # (import name, pretty name, distribution), tried in order
        self.min_sm, self.sm_rule, self.dropout = min_sm, sm_rule, dropout
        self._package: Package | None = None

    def package(self) -> Package:
        if self._package is None:
            found = [self.load(*module) for module in self.modules]
            self._package = next((p for p in found if p.module is not None), found[0])
        return self._package

    def load(self, name: str, pretty: str, distribution: str) -> Package:
        return import_package(name, pretty, distribution)

    def forget(self):
        """Drop the cached import (tests simulate installs; a long session may pip-install)."""
        self._package = None

    def capability_problem(self, capability: tuple[int, int], sm: str) -> str:
        return "" if capability >= self.min_sm else f"{self.label} needs {self.sm_rule} (this GPU is {sm})"

    def problem(self, need: Need) -> str:
        package = self.package()
        if package.problem:
            return package.problem
        if need.device.type != "cuda":
            return f"flash-attn runs on CUDA GPUs only (device is {need.device.type})"
        capability = cuda_capability(need.device)
        problem = self.capability_problem(capability, "sm{}{}".format(*capability))
        if problem:
            return problem
        if need.dtype not in HALF:
            return f"flash-attn needs float16 or bfloat16 (this run is {dtype_name(need.dtype)})"
        if need.head_dim % 8 or need.head_dim > 256:
            return f"flash-attn needs a head dim that is a multiple of 8 and <= 256 (got {need.head_dim})"
        if need.dropout and not self.dropout:
            return f"{self.label} has no attention dropout (set dropout=0)"
        if need.kv_cache != "none" and not hasattr(package.module, "flash_attn_with_kvcache"):
            return f"{self.label} has no flash_attn_with_kvcache, which decoding from a KV cache calls"
        return ""

    def __call__(self, q, k, v, mask: AttentionMask, dropout_p: float = 0.0):
        package = self._package.module if self._package is not None else self.package().module
        kwargs = {"dropout_p": dropout_p} if self.dropout else {}
        B, H, T, D = q.shape
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))  # (B, T, H, D); k, v may have fewer heads (GQA)
        if mask.has_documents:
            cu_seqlens, max_len = mask.varlen()
            q, k, v = (x.reshape(B * T, x.size(2), D) for x in (q, k, v))
            y = package.flash_attn_varlen_func(
                q,
                k,
                v,
                cu_seqlens_q=cu_seqlens,
                cu_seqlens_k=cu_seqlens,
                max_seqlen_q=max_len,
                max_seqlen_k=max_len,
                causal=True,
                **kwargs,
            )
        else:
            y = package.flash_attn_func(q, k, v, causal=True, **kwargs)
        y = y[0] if isinstance(y, tuple) else y  # FA3 builds and FA4 also return the log-sum-exp
        return y.reshape(B, T, H, D).transpose(1, 2)


class FlashAttention3(FlashAttention):
    def capability_problem(self, capability, sm):
        return "" if capability[0] == 9 else f"FlashAttention-3 needs a Hopper GPU (sm90; this GPU is {sm})"


class FlashAttention4(FlashAttention):
    """flash-attn-4 (CuTe DSL), called through custom ops (flash_attn_4_ops) that torch.compile can keep."""

    def load(self, name, pretty, distribution):
        if not dist_version(distribution):  # flash-attn 2.8 ships an early draft under flash_attn.cute
            return Package(None, "", f"{pretty} is not installed")
        package = import_package(name, pretty, distribution)
        if package.module is None:
            return package
        interface = getattr(package.module, "interface", None)
        if not all(hasattr(interface, f) for f in ("_flash_attn_fwd", "_flash_attn_bwd")):
            return Package(
                None,
                package.version,
                f"flash-attn-4 {package.version} has no interface._flash_attn_fwd/"
                "_flash_attn_bwd, which this repo calls (written against 4.0.0b36)",
            )
        return package._replace(module=flash_attn_4_ops(interface))

    def capability_problem(self, capability, sm):
        if capability[0] not in (9, 10, 11):
            return f"flash-attn-4 trains on Hopper and Blackwell GPUs only (sm90, sm100, sm110; this GPU is {sm})"
        return ""

    def problem(self, need):
        problem = super().problem(need)
        if problem or need.device.type != "cuda":
            return problem
        capability = cuda_capability(need.device)
        if capability[0] != 9 and 128 < need.head_dim < 256:
            return (
                f"flash-attn-4 on sm{capability[0]}{capability[1]} needs a head dim <= 128 or 256 (got {need.head_dim})"
            )
        return ""


FLASH_ATTN_2 = FlashAttention(
    "flash-attn 2", (("flash_attn", "flash-attn", "flash-attn"),), (8, 0), "compute capability >= 8.0", dropout=True
)
# FA3 is built from the hopper/ folder of flash-attention; older builds name the module flash_attn_interface
FLASH_ATTN_3 = FlashAttention3(
    "flash_attn_3",
    (
        ("flash_attn_interface", "flash-attn 3 (flash_attn_interface)", "flash-attn-3"),
        ("flash_attn_3", "flash-attn 3", "flash-attn-3"),
    ),
    (9, 0),
    "sm90",
)
FLASH_ATTN_4 = FlashAttention4(
    "flash_attn_4", (("flash_attn.cute", "flash-attn-4 (flash_attn.cute)", "flash-attn-4"),), (9, 0), "sm90+"
)
FLASH_KERNELS = (FLASH_ATTN_2, FLASH_ATTN_3, FLASH_ATTN_4)


@functools.cache
def flash_attn_4_ops(interface, namespace: str = "gpt_flash_attn_4"):
    """flash-attn-4 as two PyTorch custom ops with an autograd formula, in the shape of a flash-attn module.

    torch.compile cannot trace the package's own autograd Function (CuTe DSL compiles its kernels at the
    first call); as custom ops the kernels stay opaque and a compiled training step keeps one graph. They
    call the package's _flash_attn_fwd/_flash_attn_bwd, as that Function does (written against 4.0.0b36).
    Forward outputs are contiguous and gradients take their inputs' layout, as the fake versions say.
    """

    def varlen(cu_seqlens, max_seqlen):
        if cu_seqlens is None:
            return {}
        return dict(cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens, max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen)

    @torch.library.custom_op(f"{namespace}::forward", mutates_args=())
    def forward(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor | None, max_seqlen: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out, lse = interface._flash_attn_fwd(q, k, v, causal=True, return_lse=True, **varlen(cu_seqlens, max_seqlen))[
            :2
        ]
        return out.contiguous(), lse.contiguous()

    @forward.register_fake
    def _(q, k, v, cu_seqlens, max_seqlen):  # q: (B, T, H, D) -> lse (B, H, T); varlen (N, H, D) -> (H, N)
        lse_shape = (q.size(0), q.size(2), q.size(1)) if cu_seqlens is None else (q.size(1), q.size(0))
        return q.new_empty(q.shape), q.new_empty(lse_shape, dtype=torch.float32)

    @torch.library.custom_op(f"{namespace}::backward", mutates_args=())
    def backward(
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        cu_seqlens: torch.Tensor | None,
        max_seqlen: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # Gradients in their inputs' layout, written in place by the kernel: the fake below can say their
        # strides, and nothing is copied
        dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
        interface._flash_attn_bwd(
            q, k, v, out, dout, lse, causal=True, dq=dq, dk=dk, dv=dv, **varlen(cu_seqlens, max_seqlen)
        )
        return dq, dk, dv

    @backward.register_fake
    def _(dout, q, k, v, out, lse, cu_seqlens, max_seqlen):
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    def setup_context(ctx, inputs, output):
        q, k, v, cu_seqlens, ctx.max_seqlen = inputs
        ctx.save_for_backward(q, k, v, *output, cu_seqlens)

    def gradients(ctx, dout, dlse):
        q, k, v, out, lse, cu_seqlens = ctx.saved_tensors
        return (*backward(dout, q, k, v, out, lse, cu_seqlens, ctx.max_seqlen), None, None)

    forward.register_autograd(gradients, setup_context=setup_context)

    def flash_attn_func(q, k, v, causal):
        return forward(q, k, v, None, 0)

    def flash_attn_varlen_func(q, k, v, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal):
        return forward(q, k, v, cu_seqlens_q, max_seqlen_q)

    return SimpleNamespace(flash_attn_func=flash_attn_func, flash_attn_varlen_func=flash_attn_varlen_func)


# ----------------------------------------------------------------------------------------------
# auto: the order to try, from a per-card table of measured lengths, or timed once on an unknown card

AUTO_TABLE = Path(__file__).resolve().parent / "config" / "attention_auto.json"
# Orders before any table: what the kernels' published speeds suggest, fastest first
AUTO_ORDER = {
    ("cuda", "sm100+", False): ("flash_attn_4", "sdpa", "flash_attn_2", "flex_attention", "manual"),
    ("cuda", "sm100+", True): ("flash_attn_4", "flex_attention", "flash_attn_2", "sdpa", "manual"),
    ("cuda", "sm90", False): ("sdpa", "flash_attn_4", "flash_attn_3", "flash_attn_2", "flex_attention", "manual"),
    ("cuda", "sm90", True): ("flex_attention", "flash_attn_4", "flash_attn_3", "flash_attn_2", "sdpa", "manual"),
    ("cuda", "older", False): ("flash_attn_2", "sdpa", "manual"),
    ("cuda", "older", True): ("flash_attn_2", "flex_attention", "sdpa", "manual"),
    ("other", "", False): ("sdpa", "manual"),
    ("other", "", True): ("sdpa", "manual"),
}
# Decoding from a KV cache (kv_cache.py). Eager: the fewest launches per step first (flash-attn's
# flash_attn_with_kvcache reads the cache, pages included, in place), SDPA before flex, whose eager calls cost
# more host time. Compiled (CUDA graphs, no launch cost): flex_attention skips the cache's empty key blocks and
# manual's one-query scores fuse into Triton kernels, both ahead of flash-attn's and SDPA's kernels made for
# many queries (bench/results/h100-generate-compiled.md).
DECODE_ORDER = {
    ("cuda", "contiguous", False): ("flash_attn_3", "flash_attn_2", "sdpa", "flex_attention", "manual"),
    ("cuda", "paged", False): ("flash_attn_3", "flash_attn_2", "flex_attention", "sdpa", "manual"),
    ("cuda", "contiguous", True): ("flex_attention", "manual", "flash_attn_3", "flash_attn_2", "sdpa"),
    ("cuda", "paged", True): ("flex_attention", "flash_attn_3", "flash_attn_2", "manual", "sdpa"),
    ("other", "contiguous", False): ("sdpa", "manual"),
    ("other", "paged", False): ("sdpa", "manual"),
}


def card_key(device: torch.device) -> str:
    """The table's key for a GPU: its compute capability, e.g. 'sm90' (cards of one generation rank the
    kernels alike); '' for a CPU or MPS device."""
    if device.type != "cuda":
        return ""
    return "sm{}{}".format(*cuda_capability(device))


def _generation(device: torch.device) -> tuple[str, str]:
    if device.type != "cuda":
        return "other", ""
    capability = cuda_capability(device)
    return "cuda", "sm100+" if capability >= (10, 0) else "sm90" if capability >= (9, 0) else "older"


def read_auto_table(path: Path = AUTO_TABLE) -> dict:
    """{card: {"causal"|"documents": [[largest head dim, shortest T], ...]}}: from which length the card's
    `first` backend goes ahead of the default order. A missing or unreadable file is an empty table."""
    try:
        return json.loads(Path(path).read_text())["cards"]
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def auto_order(need: Need, table: dict | None = None) -> tuple[tuple[str, ...], str]:
    """(the order auto tries, how it was chosen). On a card in the table, its `first` backend goes first
    from the measured length on; elsewhere the default order for the GPU generation. Decoding from a KV cache
    has its own order (DECODE_ORDER)."""
    if need.kv_cache != "none":
        generation = _generation(need.device)[0]
        compiled = need.compiled and generation == "cuda"  # elsewhere the compiled step runs eagerly
        return DECODE_ORDER[(generation, need.kv_cache, compiled)], f"{'compiled ' if compiled else ''}decode order"
    order = AUTO_ORDER[(*_generation(need.device), need.documents)]
    key = card_key(need.device)
    entry = (read_auto_table() if table is None else table).get(key)
    if not entry:
        return order, "default order"
    masking = "documents" if need.documents else "causal"
    start = next((t for d, t in entry.get(masking, []) if need.head_dim <= d), None)
    if start is None or need.seq_len < start:
        return order, f"table for {key}: T={need.seq_len} < {start}"
    first = entry["first"]
    return (first, *(name for name in order if name != first)), f"table for {key}: {first} from T={start}"


def auto_cache_path() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "gpt-attention" / "auto.json"


def measure_key(need: Need, n_head: int) -> str:
    device = torch.cuda.get_device_name(need.device) if need.device.type == "cuda" else need.device.type
    use = "documents" if need.documents else "causal"
    return (
        f"{device}|torch {torch.__version__}|{dtype_name(need.dtype)}|H{n_head} D{need.head_dim} "
        f"T{need.seq_len}|{use}|{'train' if need.training else 'infer'}"
    )


def measured_order(
    candidates: dict[str, Callable], need: Need, n_head: int, cache_path: Path | None = None, tokens: int = 16384
) -> tuple[tuple[str, ...], str]:
    """The candidates fastest first, timed once for this card, torch, dtype and shape and cached on disk.

    Each runs (B, H, T, D) = (~16k tokens / T, n_head, seq_len, head_dim) forward (+ backward when
    training) on random inputs: a few milliseconds each, after its warm-up (flex compiles there).
    """
    cache_path = cache_path or auto_cache_path()
    key = measure_key(need, n_head)
    cache = _read_cache(cache_path)
    cached = cache.get(key)
    if isinstance(cached, dict) and set(cached) == set(candidates):
        return tuple(sorted(cached, key=cached.get)), "measured on this card earlier: " + _timings(cached)
    timings = {name: time_kernel(kernel, need, n_head, tokens) for name, kernel in candidates.items()}
    _write_cache(cache_path, {**cache, key: timings})
    return tuple(sorted(timings, key=timings.get)), "measured on this card: " + _timings(timings)


def _timings(timings: dict[str, float]) -> str:
    return ", ".join(f"{name} {ms:.3g} ms" for name, ms in sorted(timings.items(), key=lambda item: item[1]))


def _read_cache(path: Path) -> dict:
    try:
        cache = json.loads(path.read_text())
    except (OSError, ValueError):  # none yet, or unreadable: measure again
        return {}
    return cache if isinstance(cache, dict) else {}


def _write_cache(path: Path, cache: dict) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(path) as tmp:
            tmp.write_text(json.dumps(cache, indent=1))
    except OSError as error:  # a read-only home still gets the measured choice, just not cached
        log.debug(f"could not cache auto's timings in {path}: {error}")


def time_kernel(kernel: Callable, need: Need, n_head: int, tokens: int = 16384, reps: int = 5) -> float:
    """Median milliseconds of one call (forward, + backward when training); inf if it fails (e.g. OOM)."""
    T = max(1, need.seq_len)
    shape = (max(1, tokens // T), n_head, T, need.head_dim)
    q, k, v = (torch.randn(shape, device=need.device, dtype=need.dtype, requires_grad=need.training) for _ in "qkv")
    doc_ids = torch.arange(T, device=need.device).div(max(1, T // 4), rounding_mode="floor").expand(shape[0], T)
    mask = AttentionMask(T, need.device, doc_ids if need.documents else None)
    cuda = need.device.type == "cuda"

    def run():
        y = kernel(q, k, v, mask, 0.0)
        if need.training:
            y.sum().backward()

    try:
        with torch.no_grad() if not need.training else contextlib.nullcontext():
            run()  # warm-up (and compile, for flex)
            times = []
            for _ in range(reps):
                if cuda:
                    torch.cuda.synchronize(need.device)
                started = time.perf_counter()
                run()
                if cuda:
                    torch.cuda.synchronize(need.device)
                times.append((time.perf_counter() - started) * 1e3)
    except (RuntimeError, torch.cuda.OutOfMemoryError) as error:
        log.debug(f"auto: timing failed ({str(error).splitlines()[0]})")
        return math.inf
    return statistics.median(times)
