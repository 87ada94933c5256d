"""
flex_attention (PyTorch) as a backend of model.py's registry: causal, or restricted to packed documents through
a BlockMask that skips fully masked tiles.
"""

from __future__ import annotations

import functools

import torch

from model import HALF, AttentionBackend, AttentionMask, AttentionUse, dtype_name, register


def block_mask(mask: AttentionMask, heads: int):
    """flex_attention's BlockMask of a forward pass's mask (made once per forward, shared by the layers).

    Packed documents give one mask per row, and each row gets its `heads` too: with a broadcast head dim (H=1)
    inductor may give the size-1 dim of the BlockMask's tensors, built inside a compiled graph, a stride that
    flex's kernels then take for the batch stride, and they read past those tensors (an illegal memory access
    on CUDA, or a silently wrong loss; torch 2.11, bench/NOTES.md). One head is that case itself: its mask is
    built outside the graph instead."""
    if mask.segments is None:
        return _create(mask, None, None)
    if heads == 1:
        return _create_eagerly(mask)
    return _create(mask, mask.segments.size(0), heads)


def _create(mask: AttentionMask, batch: int | None, heads: int | None, **options):
    from torch.nn.attention.flex_attention import create_block_mask

    segments = mask.segments
    if segments is None:

        def mask_mod(b, h, q, kv):
            return q >= kv

    else:

        def mask_mod(b, h, q, kv):
            return (q >= kv) & (segments[b, q] == segments[b, kv])

    return create_block_mask(mask_mod, batch, heads, mask.seq_len, mask.seq_len, device=mask.device, **options)


@torch.compiler.disable
def _create_eagerly(mask: AttentionMask):
    return _create(mask, mask.segments.size(0), None, _compile=True)


def flex_attention(q, k, v, mask: AttentionMask, dropout_p: float = 0.0):
    """flex_attention with a BlockMask that skips fully masked tiles. Always compiled: run eagerly it
    materialises the (T, T) scores."""
    from torch.nn.attention.flex_attention import flex_attention as flex

    run = flex if torch.compiler.is_compiling() else compiled_flex_attention()
    mask_blocks = mask.form("flex", lambda m: block_mask(m, q.size(1)))
    return run(q, k, v, block_mask=mask_blocks, enable_gqa=k.size(1) != q.size(1))


@functools.cache
def compiled_flex_attention():
    from torch.nn.attention.flex_attention import flex_attention as flex

    return torch.compile(flex, dynamic=False)


def torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)


def why_not_flex(use: AttentionUse) -> str:
    if torch_version() < (2, 5):
        return f"flex_attention needs torch >= 2.5 (this is {torch.__version__})"
    if use.device.type not in ("cuda", "cpu"):
        return f"flex_attention runs on CUDA and CPU only (device is {use.device.type})"
    if use.device.type == "cpu" and use.training:
        return "flex_attention has no backward pass on CPU; it can only run inference there"
    if use.device.type == "cpu" and use.dtype not in (torch.float32, *HALF):
        return f"flex_attention on CPU needs float32, float16 or bfloat16 (this run is {dtype_name(use.dtype)})"
    if use.dropout:
        return "flex_attention has no attention dropout (set dropout=0)"
    if use.head_dim < 16:
        return f"flex_attention needs a head dim >= 16 (got {use.head_dim})"
    return ""


register(AttentionBackend("flex_attention", flex_attention, why_not_flex, "sdpa", ("flex",)))
