"""
flex_attention (PyTorch) as a backend of model.py's registry: causal, or restricted to packed documents through
a BlockMask that skips fully masked tiles.
"""

from __future__ import annotations

import functools

import torch

from model import HALF, AttentionBackend, AttentionMask, Need, dtype_name, register, torch_version


def block_mask(mask: AttentionMask):
    """flex_attention's BlockMask of a forward pass's mask (made once per forward, shared by the layers)."""
    from torch.nn.attention.flex_attention import create_block_mask

    segments = mask.segments
    if segments is None:

        def mask_mod(b, h, q, kv):
            return q >= kv

    else:

        def mask_mod(b, h, q, kv):
            return (q >= kv) & (segments[b, q] == segments[b, kv])

    batch = None if segments is None else segments.size(0)
    return create_block_mask(mask_mod, batch, None, mask.seq_len, mask.seq_len, device=mask.device)


def flex_attention(q, k, v, mask: AttentionMask, dropout_p: float = 0.0):
    """flex_attention with a BlockMask that skips fully masked tiles. Always compiled: run eagerly it
    materialises the (T, T) scores."""
    from torch.nn.attention.flex_attention import flex_attention as flex

    run = flex if torch.compiler.is_compiling() else compiled_flex_attention()
    return run(q, k, v, block_mask=mask.form("flex", block_mask), enable_gqa=k.size(1) != q.size(1))


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


register(AttentionBackend("flex_attention", flex_attention, flex_problem, "sdpa", ("flex",)))
