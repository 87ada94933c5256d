"""
A GPT-2 language model in one file, with a choice of attention kernels.

Read top-down: the config, the attention backends (one signature, one registry), the resolver that
turns a requested backend into the one that can run here, the model, and `python model.py`, which
prints what this machine can run.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.metadata
import inspect
import logging
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import NamedTuple

import torch
import torch.nn as nn
from torch.nn import functional as F

log = logging.getLogger("model")

BACKENDS = ("auto", "flash_attn_4", "flash_attn_3", "flash_attn_2", "flex_attention", "sdpa", "manual")
ALIASES = {
    "eager": "manual",
    "flash_attention_2": "flash_attn_2",
    "flash_attention_3": "flash_attn_3",
    "flash_attention_4": "flash_attn_4",
    "flex": "flex_attention",
}
SDPA_KERNELS = ("auto", "flash", "cudnn", "efficient", "math")


def canonical_backend(name: str) -> str:
    """Map a backend name or alias to its canonical name; ValueError lists what is allowed."""
    key = ALIASES.get(str(name).strip().lower(), str(name).strip().lower())
    if key not in BACKENDS:
        aliases = ", ".join(f"{a} (= {b})" for a, b in ALIASES.items())
        raise ValueError(f"unknown attention_backend {name!r}; choose one of {', '.join(BACKENDS)}; aliases: {aliases}")
    return key


# ----------------------------------------------------------------------------------------------
# Config


@dataclass
class GPTConfig:
    block_size: int = 1024
    vocab_size: int = 50304  # GPT-2's 50257 padded up to a multiple of 64 for faster matmuls
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True  # biases in Linear and LayerNorm, as GPT-2 has them
    attention_backend: str = "auto"  # one of BACKENDS or an alias; see resolve_attention_backend
    sdpa_kernel: str = "auto"  # restrict the sdpa backend to one PyTorch kernel: auto|flash|cudnn|efficient|math
    use_flash_attention: bool | None = None  # deprecated: True means attention_backend="flash_attn_2"

    def __post_init__(self):
        if self.use_flash_attention is not None:
            new = "flash_attn_2" if self.use_flash_attention else "manual"
            warnings.warn(
                f"use_flash_attention is deprecated; use attention_backend={new!r}", DeprecationWarning, stacklevel=3
            )
            self.attention_backend, self.use_flash_attention = new, None
        for name in ("block_size", "vocab_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if self.head_dim % 2:
            raise ValueError(f"head dim n_embd/n_head = {self.head_dim} must be even")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        self.attention_backend = canonical_backend(self.attention_backend)
        if self.sdpa_kernel not in SDPA_KERNELS:
            raise ValueError(f"unknown sdpa_kernel {self.sdpa_kernel!r}; choose one of {', '.join(SDPA_KERNELS)}")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


# ----------------------------------------------------------------------------------------------
# Attention masks: causal, optionally restricted to documents of a packed sequence


class AttentionMask:
    """The causal (and same-document) mask of one forward pass.

    Built once per forward and shared by all layers; each backend asks for the form it needs
    (a dense boolean mask, cu_seqlens for varlen kernels, a flex BlockMask), made on first use.
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
                same_doc = self.segments[:, :, None] == self.segments[:, None, :]  # (B, T, T)
                mask = mask & same_doc
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

                batch = None
            else:

                def mask_mod(b, h, q, kv):
                    return (q >= kv) & (segments[b, q] == segments[b, kv])

                batch = segments.size(0)
            T = self.seq_len
            self._block_mask = create_block_mask(mask_mod, batch, None, T, T, device=self.device)
        return self._block_mask


def _run_ids(doc_ids: torch.Tensor) -> torch.Tensor:
    """Number the runs of equal ids in each row 0, 1, 2, ... (documents are contiguous runs)."""
    change = torch.zeros_like(doc_ids, dtype=torch.int32)
    change[:, 1:] = (doc_ids[:, 1:] != doc_ids[:, :-1]).to(torch.int32)
    return change.cumsum(dim=1)


# ----------------------------------------------------------------------------------------------
# Attention backends. One signature: (q, k, v, mask, dropout_p) -> y, all (B, H, T, D), always causal.


def manual_attention(q, k, v, mask: AttentionMask, dropout_p: float = 0.0):
    """The reference: explicit scores, mask and a float32 (or wider) softmax. O(T^2) memory."""
    scores = q @ k.transpose(-2, -1) * (1.0 / math.sqrt(q.size(-1)))  # (B, H, T, T)
    scores = scores.to(torch.promote_types(scores.dtype, torch.float32))
    scores = scores.masked_fill(~mask.dense(), float("-inf"))
    weights = F.dropout(F.softmax(scores, dim=-1), p=dropout_p).to(v.dtype)
    return weights @ v


_SDPA_BACKENDS = {
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

        context = sdpa_kernel(getattr(SDPBackend, _SDPA_BACKENDS[kernel]))
    with context:
        if mask.has_documents:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.dense(), dropout_p=dropout_p)
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)


def _flash_call(package, q, k, v, mask: AttentionMask, **kwargs):
    """Shared by the flash-attn packages: they take (B, T, H, D), or (tokens, H, D) for documents."""
    B, H, T, D = q.shape
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))  # (B, T, H, D)
    if mask.has_documents:
        cu_seqlens, max_len = mask.varlen()
        q, k, v = (x.reshape(B * T, H, D) for x in (q, k, v))
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


# `package` is bound when the model resolves its backend (attention_function), so torch.compile never
# traces the cached import lookup; called directly, the function looks the package up itself.
def flash_attn_2_attention(q, k, v, mask: AttentionMask, dropout_p: float = 0.0, package=None):
    return _flash_call(package or _flash_module("flash_attn_2"), q, k, v, mask, dropout_p=dropout_p)


def flash_attn_3_attention(q, k, v, mask: AttentionMask, dropout_p: float = 0.0, package=None):
    return _flash_call(package or _flash_module("flash_attn_3"), q, k, v, mask)  # no dropout in FA3


def flash_attn_4_attention(q, k, v, mask: AttentionMask, dropout_p: float = 0.0, package=None):
    return _flash_call(package or _flash_module("flash_attn_4"), q, k, v, mask)  # no dropout in FA4


def _flash_module(backend: str):
    """What a flash backend calls: the package's module; for flash-attn-4, its kernels as custom ops, which
    torch.compile can keep in the graph."""
    module = _flash_package(backend).module
    return _flash_attn_4_ops(module.interface) if backend == "flash_attn_4" else module


@functools.cache
def _flash_attn_4_ops(interface, namespace: str = "gpt_flash_attn_4"):
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
        # strides, and nothing is copied (a .contiguous() here slowed the H100 bench's backward)
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


def flex_attention_fn(q, k, v, mask: AttentionMask, dropout_p: float = 0.0):
    """flex_attention with a BlockMask that skips fully masked tiles. Always compiled: run eagerly it
    materialises the (T, T) scores."""
    from torch.nn.attention.flex_attention import flex_attention

    flex = flex_attention if torch.compiler.is_compiling() else _compiled_flex_attention()
    return flex(q, k, v, block_mask=mask.block_mask())


@functools.cache
def _compiled_flex_attention():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


ATTENTION_FUNCTIONS: dict[str, Callable] = {
    "manual": manual_attention,
    "sdpa": sdpa_attention,
    "flash_attn_2": flash_attn_2_attention,
    "flash_attn_3": flash_attn_3_attention,
    "flash_attn_4": flash_attn_4_attention,
    "flex_attention": flex_attention_fn,
}


def attention_function(name: str) -> Callable:
    """ATTENTION_FUNCTIONS[name], with a flash backend's package bound now rather than looked up per call."""
    if not name.startswith("flash_attn_"):
        return ATTENTION_FUNCTIONS[name]
    return functools.partial(ATTENTION_FUNCTIONS[name], package=_flash_module(name))


# ----------------------------------------------------------------------------------------------
# Resolution: which backend can run for this device, dtype and use, and why


class Package(NamedTuple):
    module: object  # None when it cannot be imported
    version: str
    problem: str  # why it cannot be used ('' when it can)


# Import name -> (name in messages, distribution whose version is reported)
_PACKAGE_NAMES = {
    "flash_attn": ("flash-attn", "flash-attn"),
    "flash_attn_interface": ("flash-attn 3 (flash_attn_interface)", "flash-attn-3"),
    "flash_attn_3": ("flash-attn 3", "flash-attn-3"),
    "flash_attn.cute": ("flash-attn-4 (flash_attn.cute)", "flash-attn-4"),
}
# The modules that may hold each flash backend, tried in order. FA3 is built from the hopper/ folder of
# flash-attention (older builds name it flash_attn_interface); FA4 is PyPI's flash-attn-4 (CuTe DSL).
_FLASH_MODULES = {
    "flash_attn_2": ("flash_attn",),
    "flash_attn_3": ("flash_attn_interface", "flash_attn_3"),
    "flash_attn_4": ("flash_attn.cute",),
}


@functools.cache
def _load_package(name: str) -> Package:
    pretty, distribution = _PACKAGE_NAMES.get(name, (name, name))
    if name == "flash_attn.cute" and not _dist_version(distribution):  # flash-attn 2.8 ships an early draft there
        return Package(None, "", f"{pretty} is not installed")
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
    return Package(module, _dist_version(distribution) or getattr(module, "__version__", ""), "")


def _dist_version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return ""


def _flash_package(backend: str) -> Package:
    """The first importable module of a flash backend, or the first one's problem."""
    packages = [_load_package(name) for name in _FLASH_MODULES[backend]]
    found = next((p for p in packages if p.module is not None), packages[0])
    if backend != "flash_attn_4" or found.module is None:
        return found
    interface = getattr(found.module, "interface", None)
    if not all(hasattr(interface, f) for f in ("_flash_attn_fwd", "_flash_attn_bwd")):
        return Package(
            None,
            found.version,
            f"flash-attn-4 {found.version} has no interface._flash_attn_fwd/"
            "_flash_attn_bwd, which this repo calls (written against 4.0.0b36)",
        )
    return found


def _cuda_capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def _torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)


_HALF = (torch.float16, torch.bfloat16)


def backend_problem(
    name: str,
    device: torch.device,
    dtype: torch.dtype,
    *,
    doc_mask: bool = False,
    dropout: bool = False,
    backward: bool = False,
    head_dim: int = 64,
) -> str:
    """Why backend `name` cannot run here ('' when it can). Checked in this order: package, device
    type, compute capability, dtype, torch version, then limits of the kernel itself."""
    device = torch.device(device)
    if name == "manual":
        return ""
    if name == "sdpa":
        if device.type == "mps" and doc_mask:
            return "SDPA on MPS returns NaN for masked rows with an explicit mask (pytorch#107616)"
        return ""
    if name.startswith("flash_attn_"):
        package = _flash_package(name)
        if package.problem:
            return package.problem
        if device.type != "cuda":
            return f"flash-attn runs on CUDA GPUs only (device is {device.type})"
        capability = _cuda_capability(device)
        sm = f"sm{capability[0]}{capability[1]}"
        if name == "flash_attn_2" and capability < (8, 0):
            return f"flash-attn 2 needs compute capability >= 8.0 (this GPU is {sm})"
        if name == "flash_attn_3" and capability[0] != 9:
            return f"FlashAttention-3 needs a Hopper GPU (sm90; this GPU is {sm})"
        if name == "flash_attn_4" and capability[0] not in (9, 10, 11):
            return f"flash-attn-4 trains on Hopper and Blackwell GPUs only (sm90, sm100, sm110; this GPU is {sm})"
        if dtype not in _HALF:
            return f"flash-attn needs float16 or bfloat16 (this run is {_dtype_name(dtype)})"
        if head_dim % 8 or head_dim > 256:
            return f"flash-attn needs a head dim that is a multiple of 8 and <= 256 (got {head_dim})"
        if name == "flash_attn_4" and capability[0] != 9 and 128 < head_dim < 256:
            return f"flash-attn-4 on {sm} needs a head dim <= 128 or 256 (got {head_dim})"
        if name != "flash_attn_2" and dropout:
            return f"{name} has no attention dropout (set dropout=0)"
        return ""
    if name == "flex_attention":
        if _torch_version() < (2, 5):
            return f"flex_attention needs torch >= 2.5 (this is {torch.__version__})"
        if device.type not in ("cuda", "cpu"):
            return f"flex_attention runs on CUDA and CPU only (device is {device.type})"
        if device.type == "cpu" and backward:
            return "flex_attention has no backward pass on CPU; it can only run inference there"
        if device.type == "cpu" and dtype not in (torch.float32, *_HALF):
            return f"flex_attention on CPU needs float32, float16 or bfloat16 (this run is {_dtype_name(dtype)})"
        if dropout:
            return "flex_attention has no attention dropout (set dropout=0)"
        if head_dim < 16:
            return f"flex_attention needs a head dim >= 16 (got {head_dim})"
        return ""
    raise ValueError(f"no availability rule for backend {name!r}")


# Explicit requests fall back along these chains.
FALLBACKS = {
    "flash_attn_4": ("flash_attn_4", "flash_attn_3", "flash_attn_2", "sdpa", "manual"),
    "flash_attn_3": ("flash_attn_3", "flash_attn_2", "sdpa", "manual"),
    "flash_attn_2": ("flash_attn_2", "sdpa", "manual"),
    "flex_attention": ("flex_attention", "sdpa", "manual"),
    "sdpa": ("sdpa", "manual"),
    "manual": ("manual",),
}

# What `auto` tries, fastest first. Measured with bench/bench_attention.py on an H100 (torch 2.11, bf16,
# B*T = 16k tokens per call, CUDA-graph replays, so host launch work is left out as in a training step whose
# host runs ahead), fwd+bwd time against what runs without flash-attn-4:
# - causal (bench/results/h100-attention.json): flash-attn-4 is fastest at every T from 512 to 32k, at
#   0.84-0.93x cuDNN-SDPA's time (D=64) and 0.84-0.95x from T=1024 (D=128; 1.00x at T=512). flash-attn 2
#   takes 1.18-1.62x and flex_attention 1.11-1.46x SDPA's time.
# - documents (bench/results/h100-attention-docs.json): SDPA needs a dense mask (1.7-6.2x flex's time);
#   flex_attention's BlockMask is fastest at T=1024 and at D=128 T=4096, flash-attn-4's varlen kernel
#   elsewhere (0.55-0.90x flex's time).
# So on sm90 flash-attn-4, when installed, goes first from the lengths in SM90_FLASH_ATTN_4_FROM, which
# bench/fit_auto.py fits from a results file. Timed eagerly, flash-attn-4's Python launcher makes a fwd+bwd
# take 0.7-1.3 ms at any T up to 2048 (bench/results/h100-attention-eager.json); in a compiled GPT-2 step
# that work overlaps the GPU's (bench/results/h100-train.json: T=1024, 35.2 ms against SDPA's 35.6).
# Not measured here: older GPUs, FA3 and Blackwell, where the order follows the kernels' published speeds
# (flash-attn-4 was written for Blackwell and reports beating cuDNN there).
AUTO_PREFERENCE = {
    ("cuda", "sm100+", "causal"): ("flash_attn_4", "sdpa", "flash_attn_2", "flex_attention", "manual"),
    ("cuda", "sm100+", "documents"): ("flash_attn_4", "flex_attention", "flash_attn_2", "sdpa", "manual"),
    ("cuda", "sm90", "causal"): ("sdpa", "flash_attn_4", "flash_attn_3", "flash_attn_2", "flex_attention", "manual"),
    ("cuda", "sm90", "documents"): ("flex_attention", "flash_attn_4", "flash_attn_3", "flash_attn_2", "sdpa", "manual"),
    ("cuda", "older", "causal"): ("flash_attn_2", "sdpa", "manual"),
    ("cuda", "older", "documents"): ("flash_attn_2", "flex_attention", "sdpa", "manual"),
    ("other", "", "causal"): ("sdpa", "manual"),
    ("other", "", "documents"): ("sdpa", "manual"),
}
# (masking, largest head dim it covers) -> shortest sequence from which flash-attn-4 goes first on sm90.
# Causal: fitted by bench/fit_auto.py from bench/results/h100-attention-scan.json. Documents: set by hand
# from the eager runs (the docs scan's --budget ran out after T=1024); h100-attention-docs.json bears them out.
SM90_FLASH_ATTN_4_FROM = {("causal", 64): 512, ("causal", 256): 1024, ("documents", 64): 4096, ("documents", 256): 8192}


def auto_candidates(device: torch.device, doc_mask: bool, seq_len: int = 0, head_dim: int = 64) -> tuple[str, ...]:
    """The order auto tries for this use; seq_len 0 (unknown) counts as short."""
    device = torch.device(device)
    masking = "documents" if doc_mask else "causal"
    if device.type != "cuda":
        return AUTO_PREFERENCE[("other", "", masking)]
    capability = _cuda_capability(device)
    generation = "sm100+" if capability >= (10, 0) else "sm90" if capability >= (9, 0) else "older"
    order = AUTO_PREFERENCE[("cuda", generation, masking)]
    if generation == "sm90":
        start = next(t for (m, d), t in SM90_FLASH_ATTN_4_FROM.items() if m == masking and head_dim <= d)
        if seq_len >= start:
            order = ("flash_attn_4", *(name for name in order if name != "flash_attn_4"))
    return order


class Resolution(NamedTuple):
    used: str  # the backend that will run
    reason: str  # why it differs from the request, or how auto chose ('' when the request runs as is)


def resolve_attention_backend(requested: str, device, dtype: torch.dtype, seq_len: int = 0, **use) -> Resolution:
    """Turn a requested backend into the one that runs on `device` with `dtype`, and say why.

    `use` refines the check: doc_mask, dropout, backward (gradients needed), head_dim; `seq_len` (0:
    unknown) matters to auto's order only.
    """
    requested = canonical_backend(requested)
    if requested == "auto":
        chain = auto_candidates(device, use.get("doc_mask", False), seq_len, use.get("head_dim", 64))
    else:
        chain = FALLBACKS[requested]
    skipped = []
    for name in chain:
        problem = backend_problem(name, device, dtype, **use)
        if not problem:
            break
        skipped.append((name, problem))
    if requested == "auto":
        why = "; ".join(f"{n}: {p}" for n, p in skipped)
        first = f"auto: first that runs on {torch.device(device).type}/{_dtype_name(dtype)} of {' > '.join(chain)}"
        return Resolution(name, first + (f"; skipped {why}" if why else ""))
    if not skipped:
        return Resolution(name, "")
    why = skipped[0][1] + "".join(f"; then {n}: {p}" for n, p in skipped[1:])
    return Resolution(name, why)


def resolve_sdpa_kernel(kernel: str, device, dtype: torch.dtype, doc_mask: bool = False) -> Resolution:
    """Which PyTorch SDPA kernel to pin ('auto' lets PyTorch choose)."""
    device = torch.device(device)
    problem = ""
    if kernel in ("cudnn", "efficient") and device.type != "cuda":
        problem = f"SDPA's {kernel} kernel runs on CUDA only (device is {device.type})"
    elif kernel == "flash" and device.type == "cuda" and dtype not in _HALF:
        problem = f"SDPA's flash kernel needs float16 or bfloat16 on CUDA (this run is {_dtype_name(dtype)})"
    elif kernel == "cudnn" and dtype not in _HALF:
        problem = f"SDPA's cudnn kernel needs float16 or bfloat16 (this run is {_dtype_name(dtype)})"
    elif kernel in ("flash", "cudnn") and doc_mask:
        problem = f"SDPA's {kernel} kernel takes no document mask"
    elif kernel in ("flash", "cudnn") and device.type == "cuda" and _cuda_capability(device) < (8, 0):
        problem = f"SDPA's {kernel} kernel needs compute capability >= 8.0"
    return Resolution("auto", problem) if problem else Resolution(kernel, "")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ----------------------------------------------------------------------------------------------
# The model (GPT-2: learned positions, pre-LayerNorm, tanh GELU, tied embeddings)


class LayerNorm(nn.Module):
    """LayerNorm with an optional bias (PyTorch's has no bias=False before 2.1)."""

    def __init__(self, ndim: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, x):
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_head, self.dropout = config.n_head, config.dropout
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x, attend: Callable, mask: AttentionMask):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).view(B, T, 3, self.n_head, C // self.n_head).unbind(2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        y = attend(q, k, v, mask, self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).reshape(B, T, C)  # re-assemble all head outputs side by side
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x, attend: Callable, mask: AttentionMask):
        x = x + self.attn(self.ln_1(x), attend, mask)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                ln_f=LayerNorm(config.n_embd, bias=config.bias),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # tied, as in GPT-2
        self.apply(self._init_weights)
        for name, param in self.named_parameters():
            if name.endswith("c_proj.weight"):  # GPT-2 scales residual projections by depth
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))
        self._resolutions: dict[tuple, tuple[Callable, Resolution]] = {}
        self._logged: set[str] = set()  # say each fallback and backend line once, not per layer or step

    @staticmethod
    def _init_weights(module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    # -- attention backend, resolved for the device and dtype the model really runs with --

    @torch.compiler.disable
    def attention_for(
        self, device: torch.device, doc_mask: bool = False, seq_len: int | None = None
    ) -> tuple[Callable, Resolution]:
        """The attention function for this call (seq_len: default block_size), resolved once per (device,
        dtype, use, seq_len) and logged once."""
        if torch.is_autocast_enabled(device.type):
            dtype = torch.get_autocast_dtype(device.type)
        else:
            dtype = self.lm_head.weight.dtype
        dropout = self.training and self.config.dropout > 0
        backward = torch.is_grad_enabled()
        seq_len = seq_len or self.config.block_size
        key = (device, dtype, doc_mask, dropout, backward, seq_len)
        if key not in self._resolutions:
            self._resolutions[key] = self._resolve(
                device, dtype, doc_mask=doc_mask, dropout=dropout, backward=backward, seq_len=seq_len
            )
        return self._resolutions[key]

    def _resolve(self, device, dtype, **use) -> tuple[Callable, Resolution]:
        requested = self.config.attention_backend
        resolution = resolve_attention_backend(requested, device, dtype, head_dim=self.config.head_dim, **use)
        if requested != "auto" and resolution.used != requested:
            self._log_once(
                logging.WARNING, f"{requested} requested but {resolution.reason}; falling back to {resolution.used}"
            )
        attend, detail = attention_function(resolution.used), ""
        if resolution.used == "sdpa" and self.config.sdpa_kernel != "auto":
            kernel = resolve_sdpa_kernel(self.config.sdpa_kernel, device, dtype, use["doc_mask"])
            if kernel.reason:
                self._log_once(
                    logging.WARNING,
                    f"sdpa_kernel={self.config.sdpa_kernel} requested but {kernel.reason}; letting PyTorch choose",
                )
            attend = functools.partial(sdpa_attention, kernel=kernel.used)
            detail = f", kernel {kernel.used}"
        if requested == "auto":
            note = f" ({resolution.reason})"
        elif resolution.reason:
            note = f" (requested {requested}: {resolution.reason})"
        else:
            note = ""
        self._log_once(logging.INFO, f"attention backend: {resolution.used}{detail}{note}")
        return attend, resolution

    def _log_once(self, level: int, message: str):
        if message not in self._logged:
            self._logged.add(message)
            log.log(level, message)

    def setup_attention(
        self,
        device,
        dtype: torch.dtype,
        *,
        training: bool = True,
        seq_len: Optional[int] = None,
        documents: bool = False,
    ):
        """Resolve (and log) the attention backend for this device, compute dtype and use."""
        dropout = training and self.config.dropout > 0
        seq_len = seq_len or self.config.block_size
        key = (torch.device(device), dtype, documents, dropout, training, seq_len)
        self._resolutions[key] = self._resolve(
            key[0], dtype, doc_mask=documents, dropout=dropout, backward=training, seq_len=seq_len
        )
        return self._resolutions[key][1]

    # -- forward, loss and generation --

    def forward(self, idx, targets=None, doc_ids=None):
        attend, _ = self.attention_for(idx.device, doc_ids is not None, idx.size(1))
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(f"sequence of length {T} is longer than block_size {self.config.block_size}")
        mask = AttentionMask(T, idx.device, doc_ids)
        pos = torch.arange(T, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))  # (B, T, C)
        for block in self.transformer.h:
            x = block(x, attend, mask)
        x = self.transformer.ln_f(x)
        if targets is None:
            return self.lm_head(x[:, [-1], :]), None  # only the last position is needed to sample
        logits = self.lm_head(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.reshape(-1), ignore_index=-1)
        return logits, loss

    @torch.no_grad()
    def generate(self, idx, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None):
        """Sample `max_new_tokens` tokens after idx (B, T); the context is cropped to block_size."""
        for _ in range(max_new_tokens):
            context = idx if idx.size(1) <= self.config.block_size else idx[:, -self.config.block_size :]
            logits, _ = self(context)
            logits = logits[:, -1, :] / max(temperature, 1e-6)
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
                logits[logits < kth] = -float("inf")
            next_token = torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)
            idx = torch.cat((idx, next_token), dim=1)
        return idx

    # -- helpers for training --

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameter count. Position embeddings are left out by default; token embeddings stay in,
        because they are tied to the output layer and so do real work."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.transformer.wpe.weight.numel() if non_embedding else n

    def flops_per_token(self, seq_len: int | None = None) -> float:
        """Training FLOPs per token (forward + backward), PaLM appendix B as nanoGPT uses it:
        6N for the weight matmuls plus 12·L·H·Q·T for attention (full, not halved for causality)."""
        c = self.config
        T = seq_len or c.block_size
        return 6 * self.num_params() + 12 * c.n_layer * c.n_head * c.head_dim * T

    def configure_optimizers(self, weight_decay: float, learning_rate: float, betas, device_type: str):
        """AdamW; weight decay on matrices and embeddings (>= 2-D) only, fused kernel on CUDA."""
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        fused = device_type == "cuda" and "fused" in inspect.signature(torch.optim.AdamW).parameters
        return torch.optim.AdamW(groups, lr=learning_rate, betas=tuple(betas), **({"fused": True} if fused else {}))

    def crop_block_size(self, block_size: int):
        """Shrink the context (e.g. to fine-tune a 1024-token model on shorter blocks)."""
        if not 0 < block_size <= self.config.block_size:
            raise ValueError(f"block_size must be in 1..{self.config.block_size}, got {block_size}")
        self.config.block_size = block_size
        self.transformer.wpe.weight = nn.Parameter(self.transformer.wpe.weight[:block_size])


# ----------------------------------------------------------------------------------------------
# What this machine can run: `python model.py`


def attention_report(device=None) -> dict:
    """Versions, GPU, and for each backend whether it runs here and why not; what auto picks per dtype, for
    T=1024 (auto) and T=32768 (auto_long)."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
    device = torch.device(device)
    train_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    report = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "device": device.type,
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "capability": "sm{}{}".format(*_cuda_capability(device)) if device.type == "cuda" else None,
        "dtype": _dtype_name(train_dtype),
        "backends": {},
        "auto": {},
        "auto_long": {},
    }
    for name in BACKENDS[1:]:
        problem = backend_problem(name, device, train_dtype, backward=True)
        version = _flash_package(name).version if name.startswith("flash_attn_") else torch.__version__
        report["backends"][name] = {"available": not problem, "version": version, "why": problem}
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for key, seq_len in (("auto", 1024), ("auto_long", 32768)):
            report[key][_dtype_name(dtype)] = resolve_attention_backend(
                "auto", device, dtype, seq_len, backward=True
            ).used
    return report


def main():
    report = attention_report()
    gpu = f"{report['gpu']} ({report['capability']})" if report["gpu"] else "none"
    print(f"torch {report['torch']} | CUDA {report['cuda']} | cuDNN {report['cudnn']} | GPU {gpu}")
    print(f"device {report['device']}, training dtype {report['dtype']}:")
    for name, row in report["backends"].items():
        status = "available" if row["available"] else "unavailable"
        version = f" {row['version']}" if row["version"] else ""
        print(f"  {name:<15} {status:<12}{version:<14} {row['why']}")
    for key, length in (("auto", "1024"), ("auto_long", "32768")):
        picks = ", ".join(f"{dtype} -> {used}" for dtype, used in report[key].items())
        print(f"  auto picks at T={length}: {picks}")


if __name__ == "__main__":
    main()
