"""
The language-model loss without the full logits: lm_head and cross-entropy fused, a chunk of rows at a time.

GPT-2's vocabulary makes the logits the largest tensor of a training step: 50,304 floats per token, 3.3 GB in
float32 for a batch of 16 x 1024. `chunked_cross_entropy` computes, for a chunk of rows at a time, the logits,
the loss and both gradients (of the hidden states and of the output weight) in the forward pass, then drops
the chunk; backward only scales the stored gradients. The matmuls are the same three as the plain path's
(logits, grad of input, grad of weight), the logits are never written whole, and nothing is recomputed
(the approach of Liger-Kernel's fused linear cross-entropy, in plain PyTorch so torch.compile fuses the
per-chunk softmax).
"""

from __future__ import annotations

import math

import torch

IGNORE_INDEX = -1  # targets equal to this add nothing to the loss (as F.cross_entropy's ignore_index)
CHUNK_ELEMENTS = 2**28  # most logits per chunk: 5,336 rows of GPT-2's 50,304 (0.5 GiB in bf16, 1 GiB in fp32)


def chunk_rows(vocab_size: int, rows: int) -> int:
    """Rows per chunk: equal chunks of at most CHUNK_ELEMENTS logits (a short last chunk would make a slow matmul)."""
    chunks = math.ceil(rows * vocab_size / CHUNK_ELEMENTS)
    return max(1, math.ceil(rows / chunks))


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # x (N, C) and weight (V, C) in the compute dtype; targets (N,)
        n, step = x.size(0), chunk_rows(weight.size(0), x.size(0))
        needs_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        wide = torch.promote_types(x.dtype, torch.float32)  # softmax and sums: float32, or float64 for float64
        count = (targets != IGNORE_INDEX).sum().clamp(min=1).to(wide)
        loss = torch.zeros((), dtype=wide, device=x.device)
        grad_x = torch.empty_like(x) if needs_grad else None
        grad_weight = torch.zeros(weight.shape, dtype=wide, device=x.device) if needs_grad else None
        for start in range(0, n, step):
            rows, target = x[start : start + step], targets[start : start + step]
            logits = (rows @ weight.t()).to(wide)  # (rows, V): the plain path's logits, upcast as it does
            keep = target != IGNORE_INDEX
            safe_target = torch.where(keep, target, 0).unsqueeze(1)
            log_norm = torch.logsumexp(logits, dim=1, keepdim=True)
            loss += ((log_norm - logits.gather(1, safe_target)).squeeze(1) * keep).sum()
            if needs_grad:  # d loss / d logits = softmax - one_hot, zero on ignored rows
                grad_logits = torch.exp(logits - log_norm)
                grad_logits.scatter_add_(1, safe_target, torch.full_like(log_norm, -1.0))
                grad_logits = (grad_logits * keep.unsqueeze(1)).to(x.dtype)
                grad_x[start : start + step] = grad_logits @ weight
                grad_weight += (grad_logits.t() @ rows).to(wide)
        if needs_grad:
            ctx.save_for_backward(grad_x, grad_weight.to(weight.dtype), count)
        return loss / count

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        grad_x, grad_weight, count = ctx.saved_tensors
        scale = grad_loss / count
        return grad_x * scale.to(grad_x.dtype), grad_weight * scale.to(grad_weight.dtype), None


def chunked_cross_entropy(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of softmax(x @ weight.T) against targets (IGNORE_INDEX skipped), as
    F.cross_entropy(F.linear(x, weight).float(), targets, ignore_index=-1) gives it, without holding the
    (N, V) logits. x (..., C); weight (V, C); targets (...). Under autocast both are cast to its dtype,
    as F.linear would cast them."""
    dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else weight.dtype
    with torch.autocast(x.device.type, enabled=False):
        return _ChunkedLinearCrossEntropy.apply(
            x.reshape(-1, x.size(-1)).to(dtype), weight.to(dtype), targets.reshape(-1)
        )
