"""
flash-attn 3 and 4 as backends of model.py's registry, called and checked as model.py's flash-attn 2 kernel is
(flash_attention, why_not_flash). FlashAttention finds a package under the first of several module names that
imports; FlashAttention-3 (built from flash-attention's hopper/ folder) and flash-attn-4 (CuTe DSL) add their own
GPU rules, and flash-attn-4's kernels are wrapped as PyTorch custom ops so a compiled training step keeps one graph.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
from types import SimpleNamespace

import torch

from model import (
    AttentionBackend,
    AttentionMask,
    AttentionUse,
    flash_attention,
    import_flash_package,
    register,
    why_not_flash,
)


def dist_version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return ""


class FlashAttention:
    """A flash-attn package beyond flash-attn 2 as a kernel, found under the first of `modules` ((import name,
    pretty name, distribution), tried in order) that imports; imported once by the first check, as model.py's
    FlashAttn2 is, and called through model.py's flash_attention (no dropout in these packages)."""

    module, version, why_missing = None, "", None  # set by load(); why_missing is None until it ran

    def __init__(self, label: str, modules: tuple[tuple[str, str, str], ...]):
        self.label, self.modules = label, modules

    def load(self) -> str:
        """Import the package (once); why it cannot be used ('' when it can)."""
        if self.why_missing is None:
            found = [self.import_module(*module) for module in self.modules]
            self.module, self.version, self.why_missing = next((p for p in found if p[0] is not None), found[0])
        return self.why_missing

    def import_module(self, name: str, pretty: str, distribution: str) -> tuple[object, str, str]:
        """(module, version, '') or (None, '', why not)."""
        module, version, why = import_flash_package(name, pretty)
        return module, (dist_version(distribution) or version) if module else "", why

    def why_not_gpu(self, capability: tuple[int, int], sm: str, use: AttentionUse) -> str:
        """The package's own rule for a GPU ('' where it runs `use`)."""
        return ""

    def why_not(self, use: AttentionUse) -> str:
        return self.load() or why_not_flash(use, self.module, self.label, self.why_not_gpu, has_dropout=False)

    def __call__(self, q, k, v, mask: AttentionMask, dropout_p: float = 0.0):
        self.load()  # imported already where a check ran; a bench may call a kernel without one
        return flash_attention(self.module, q, k, v, mask)


class FlashAttention3(FlashAttention):
    def why_not_gpu(self, capability, sm, use):
        return "" if capability[0] == 9 else f"FlashAttention-3 needs a Hopper GPU (sm90; this GPU is {sm})"


class FlashAttention4(FlashAttention):
    """flash-attn-4 (CuTe DSL), called through custom ops (flash_attn_4_ops) that torch.compile can keep."""

    def import_module(self, name, pretty, distribution):
        if not dist_version(distribution):  # flash-attn 2.8 ships an early draft under flash_attn.cute
            return None, "", f"{pretty} is not installed"
        module, version, why = super().import_module(name, pretty, distribution)
        if module is None:
            return module, version, why
        interface = getattr(module, "interface", None)
        if not all(hasattr(interface, f) for f in ("_flash_attn_fwd", "_flash_attn_bwd")):
            return (
                None,
                version,
                f"flash-attn-4 {version} has no interface._flash_attn_fwd/"
                "_flash_attn_bwd, which this repo calls (written against 4.0.0b36)",
            )
        return flash_attn_4_ops(interface), version, ""

    def why_not_gpu(self, capability, sm, use):
        if capability[0] not in (9, 10, 11):
            return f"flash-attn-4 trains on Hopper and Blackwell GPUs only (sm90, sm100, sm110; this GPU is {sm})"
        if capability[0] != 9 and 128 < use.head_dim < 256:
            return f"flash-attn-4 on {sm} needs a head dim <= 128 or 256 (got {use.head_dim})"
        return ""


# FA3 is built from the hopper/ folder of flash-attention; older builds name the module flash_attn_interface
FA3_MODULES = (
    ("flash_attn_interface", "flash-attn 3 (flash_attn_interface)", "flash-attn-3"),
    ("flash_attn_3", "flash-attn 3", "flash-attn-3"),
)
FA4_MODULES = (("flash_attn.cute", "flash-attn-4 (flash_attn.cute)", "flash-attn-4"),)


def flash_attn_3_backend() -> AttentionBackend:
    """flash_attn_3's record over a kernel of its own (a fresh one imports the package anew)."""
    kernel = FlashAttention3("flash_attn_3", FA3_MODULES)
    return AttentionBackend("flash_attn_3", kernel, kernel.why_not, "flash_attn_2", ("flash_attention_3",))


def flash_attn_4_backend() -> AttentionBackend:
    """flash_attn_4's record over a kernel of its own (a fresh one imports the package anew)."""
    kernel = FlashAttention4("flash_attn_4", FA4_MODULES)
    return AttentionBackend("flash_attn_4", kernel, kernel.why_not, "flash_attn_3", ("flash_attention_4",))


# Longer than a function should be, for a reason: the two custom ops, their fake (shape) versions and the
# autograd formula that joins them are one definition; split apart, none of them reads on its own.
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


FLASH_ATTN_4 = register(flash_attn_4_backend()).kernel
FLASH_ATTN_3 = register(flash_attn_3_backend()).kernel
