"""
flash-attn 3 and 4 as backends of model.py's registry. The package family's adapter (FlashAttention) is
model.py's, which runs flash-attn 2; FlashAttention-3 (built from flash-attention's hopper/ folder) and
flash-attn-4 (CuTe DSL) add their own checks, and flash-attn-4's kernels are wrapped as PyTorch custom ops so a
compiled training step keeps one graph.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch

from model import AttentionBackend, FlashAttention, Package, cuda_capability, dist_version, import_package, register


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


register(AttentionBackend("flash_attn_4", FLASH_ATTN_4, FLASH_ATTN_4.problem, "flash_attn_3", ("flash_attention_4",)))
register(AttentionBackend("flash_attn_3", FLASH_ATTN_3, FLASH_ATTN_3.problem, "flash_attn_2", ("flash_attention_3",)))
