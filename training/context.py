"""Context parallelism: each sequence split over the ranks of a group, for contexts one GPU cannot hold.

A sequence of T tokens is cut into 2N equal chunks for a group of N ranks; rank r holds chunks r and 2N-1-r, so
every rank has the same share of causal attention's work. Each layer's attention all-gathers the group's keys and
values (the all-gather form of context parallelism that Llama 3 was trained with), and each local chunk of queries
attends the keys up to its own positions. The backward of the all-gather sums each rank's key and value gradients
back to their owner, so averaging gradients over all ranks (DDP or FSDP, as without context parallelism) gives the
gradient of the whole sequences' mean loss. Everything else in a step (embeddings, MLPs, the loss) is per token and
runs on this rank's tokens alone.

A chunk's causal mask is aligned to the lower right (its L queries are the last L positions of the keys it sees),
which SDPA serves on CUDA only with its slow memory-efficient kernel. So the chunk's keys are split in two: the
prefix, which every query sees in full (no mask), and the square diagonal block (plain causal); a kernel that also
returns each query's log-sum-exp computes both, and the two are merged exactly (as ring attention merges its steps).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.distributed import _functional_collectives as funcol
from torch.nn.attention.bias import causal_lower_right

from model import HALF, AttentionMask, repeat_kv

# differentiable all-gather (its backward a reduce-scatter) that torch.compile traces; renamed in torch 2.9
_all_gather = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd
aten = torch.ops.aten


# ---------------------------------------------------------------------------------------------------------------
# Attention kernels that return each query row's log-sum-exp. All take (B, H, L, D) q and (B, H, S, D) k, v with as
# many heads, the default scale 1/sqrt(D) (the model's) and no dropout. forward(q, k, v, causal) -> (out, lse), lse
# (B, H, L) in float32 (float64 for float64 on CPU); backward(grad, q, k, v, out, lse, causal) -> (dq, dk, dv).
# Without dropout the CUDA kernels' random state is never read: their backward gets placeholders (cuDNN's checks
# that they are on the inputs' device).
def no_dropout(device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty((), dtype=torch.long, device=device), torch.empty((), dtype=torch.long, device=device)


def cpu_flash_forward(q, k, v, causal: bool):
    return aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)


def cpu_flash_backward(grad, q, k, v, out, lse, causal: bool):
    return aten._scaled_dot_product_flash_attention_for_cpu_backward(grad, q, k, v, out, lse, 0.0, causal)


def cudnn_forward(q, k, v, causal: bool):
    out, lse = aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal)[:2]
    return out, lse.reshape(q.shape[:3])  # cuDNN's is (B, H, L, 1)


def cudnn_backward(grad, q, k, v, out, lse, causal: bool):
    # no bias; no cumulative lengths (not varlen): the maximum lengths are the lengths
    seed, offset = no_dropout(q.device)
    return aten._scaled_dot_product_cudnn_attention_backward(
        grad, q, k, v, out, lse.unsqueeze(-1), seed, offset, None, None, None, q.size(2), k.size(2), 0.0, causal
    )


def flash_forward(q, k, v, causal: bool):
    return aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal)[:2]


def flash_backward(grad, q, k, v, out, lse, causal: bool):
    return aten._scaled_dot_product_flash_attention_backward(
        grad, q, k, v, out, lse, None, None, q.size(2), k.size(2), 0.0, causal, *no_dropout()
    )


class LseKernel(NamedTuple):
    forward: Callable
    backward: Callable
    device: str  # the device type it runs on
    dtypes: tuple[torch.dtype, ...]
    head_dims: range | None  # the head dims it takes; None: any


LSE_KERNELS = {
    "cudnn": LseKernel(cudnn_forward, cudnn_backward, "cuda", HALF, range(8, 129, 8)),
    "flash": LseKernel(flash_forward, flash_backward, "cuda", HALF, range(8, 257, 8)),
    "cpu_flash": LseKernel(cpu_flash_forward, cpu_flash_backward, "cpu", (*HALF, torch.float32, torch.float64), None),
}
AUTO = {"cuda": "cudnn", "cpu": "cpu_flash"}  # what kernel="auto" asks for, per device type
REFERENCE = "sdpa_lower_right"  # SDPA with a lower-right causal mask: any device, dtype and dropout
CHUNK_KERNELS = ("auto", REFERENCE, *LSE_KERNELS)


def resolve_chunk_kernel(requested: str, device_type: str, dtype: torch.dtype, head_dim: int, dropout_p: float) -> str:
    """The kernel a chunk's attention runs: `requested` ("auto": cuDNN on CUDA, flash on CPU) where it serves the
    device, dtype and head dim and there is no dropout (no LSE kernel here has it), else the reference: SDPA with a
    lower-right causal mask."""
    name = AUTO.get(device_type, REFERENCE) if requested == "auto" else requested
    kernel = LSE_KERNELS.get(name)
    if kernel is None or dropout_p > 0 or device_type != kernel.device:
        return REFERENCE
    serves = dtype in kernel.dtypes and (kernel.head_dims is None or head_dim in kernel.head_dims)
    return name if serves else REFERENCE


def merge(out_a, lse_a, out_b, lse_b):
    """Attention over the keys of both parts from each part's output and log-sum-exp: exact, in float32 or wider.
    The output comes back in its dtype, the log-sum-exp wide."""
    wide = torch.promote_types(out_a.dtype, torch.float32)
    lse = torch.logaddexp(lse_a.to(wide), lse_b.to(wide))
    weight_a, weight_b = ((part.to(wide) - lse).unsqueeze(-1).exp() for part in (lse_a, lse_b))
    return (weight_a * out_a.to(wide) + weight_b * out_b.to(wide)).to(out_a.dtype), lse


def like(tensor: torch.Tensor, layout: torch.Tensor) -> torch.Tensor:
    """`tensor` with the strides of `layout`: cuDNN's backward wants the output and its gradient laid out alike."""
    return tensor if tensor.stride() == layout.stride() else torch.empty_like(layout).copy_(tensor)


def prefix_and_diagonal(q, k, v, kernel: str):
    """Causal attention of L queries that are the last L positions of the S keys they see: the first S-L keys (the
    prefix) unmasked, the last L (the diagonal block) causal, each by `kernel` (in LSE_KERNELS), merged. Returns
    the output and each query's log-sum-exp (B, H, L), in float32 or wider."""
    ops, prefix = LSE_KERNELS[kernel], k.size(2) - q.size(2)
    out, lse = ops.forward(q, k[:, :, prefix:], v[:, :, prefix:], True)
    if prefix:
        prefix_out, prefix_lse = ops.forward(q, k[:, :, :prefix], v[:, :, :prefix], False)
        merged, lse = merge(out, lse, prefix_out, prefix_lse)
        out = like(merged, out)
    return out, lse.to(torch.promote_types(q.dtype, torch.float32))


def prefix_and_diagonal_backward(grad, q, k, v, out, lse, kernel: str):
    """Gradients of prefix_and_diagonal as ring attention takes them: each part's kernel backward, given the merged
    output and log-sum-exp, gives that part's gradients."""
    ops, prefix = LSE_KERNELS[kernel], k.size(2) - q.size(2)
    out, lse = out.contiguous(), lse.contiguous()  # slices of the op's outputs: each kernel's own layout
    grad = like(grad, out)
    dq, dk, dv = ops.backward(grad, q, k[:, :, prefix:], v[:, :, prefix:], out, lse, True)
    if prefix:
        dq_prefix, dk_prefix, dv_prefix = ops.backward(grad, q, k[:, :, :prefix], v[:, :, :prefix], out, lse, False)
        dq, dk, dv = dq + dq_prefix, torch.cat([dk_prefix, dk], 2), torch.cat([dv_prefix, dv], 2)
    return dq, dk, dv


def chunk_spans(queries: int, chunks) -> list[tuple[slice, int]]:
    """For `queries` rows holding the sequence chunks `chunks` side by side: each chunk's rows, and the end of the
    keys it sees (its own last position + 1)."""
    length = queries // len(chunks)
    return [(slice(i * length, (i + 1) * length), (chunk + 1) * length) for i, chunk in enumerate(chunks)]


# Why one opaque op for a rank's chunks: which chunks a rank holds decides how many keys each sees, so traced
# kernel by kernel, every rank's compiled graph has other shapes (rank 0's first chunk has no prefix at all), and
# the compiler's choices (what backward recomputes, the order it issues things in) may differ between ranks. Then
# the ranks' all-gathers and reduce-scatters stop pairing up, and they wait on each other forever. As one op of
# the same shapes on every rank, with the chunks an argument, the graphs are the same.
@torch.library.custom_op("gpt_context::attention", mutates_args=())
def chunk_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunks: list[int], kernel: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of this rank's chunks of queries q (B, H, nL, D), the i-th being chunk chunks[i] of the
    sequence, on the sequence's keys and values k, v (B, H, S, D), S a multiple of L: each chunk sees the keys up
    to its own last position. Returns the output (B, H, nL, D) and each query's log-sum-exp (B, H, nL)."""
    parts = [
        prefix_and_diagonal(q[:, :, rows], k[:, :, :end], v[:, :, :end], kernel)
        for rows, end in chunk_spans(q.size(2), chunks)
    ]
    return torch.cat([out for out, _ in parts], 2), torch.cat([lse for _, lse in parts], 2)


@chunk_attention.register_fake
def _(q, k, v, chunks, kernel):
    return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=torch.promote_types(q.dtype, torch.float32))


@torch.library.custom_op("gpt_context::attention_backward", mutates_args=())
def chunk_attention_backward(
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    chunks: list[int],
    kernel: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dq, dk, dv = q.new_empty(q.shape), k.new_zeros(k.shape), v.new_zeros(v.shape)
    for rows, end in chunk_spans(q.size(2), chunks):
        dq[:, :, rows], dk_seen, dv_seen = prefix_and_diagonal_backward(
            grad[:, :, rows], q[:, :, rows], k[:, :, :end], v[:, :, :end], out[:, :, rows], lse[:, :, rows], kernel
        )
        dk[:, :, :end] += dk_seen
        dv[:, :, :end] += dv_seen
    return dq, dk, dv


@chunk_attention_backward.register_fake
def _(grad, q, k, v, out, lse, chunks, kernel):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _save_for_backward(ctx, inputs, output):
    q, k, v, ctx.chunks, ctx.kernel = inputs
    ctx.save_for_backward(q, k, v, *output)


def _chunk_attention_gradients(ctx, grad, grad_lse):  # the log-sum-exp is for backward only: no gradient
    q, k, v, out, lse = ctx.saved_tensors
    return (*chunk_attention_backward(grad, q, k, v, out, lse, ctx.chunks, ctx.kernel), None, None)


chunk_attention.register_autograd(_chunk_attention_gradients, setup_context=_save_for_backward)


def attend_chunk(q, k, v, kernel: str = "auto", dropout_p: float = 0.0) -> torch.Tensor:
    """Causal attention of a chunk of queries q (B, H, L, D) on the keys up to its own last position, k and v
    (B, H, S, D) with S a multiple of L: the queries are the last L of those positions (causal aligned to the lower
    right)."""
    used = resolve_chunk_kernel(kernel, q.device.type, q.dtype, q.size(-1), dropout_p)
    if used != REFERENCE:
        return chunk_attention(q, k, v, [k.size(2) // q.size(2) - 1], used)[0]
    causal = causal_lower_right(q.size(2), k.size(2))
    if q.is_cuda and q.dtype in HALF:  # the only CUDA kernel for this mask was 1.39 off in bf16 at T=32768 (bench/
        wide = (x.float() for x in (q, k, v))  # results/h100-context-kernels-probe.json), right in float32
        return F.scaled_dot_product_attention(*wide, attn_mask=causal, dropout_p=dropout_p).to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal, dropout_p=dropout_p)


# ---------------------------------------------------------------------------------------------------------------
class ContextShard:
    """Rank `rank`'s part of every sequence in a context-parallel group of `size` ranks (`group`); `kernel` is
    the chunks' attention (one of CHUNK_KERNELS; see resolve_chunk_kernel)."""

    def __init__(self, group, rank: int, size: int, kernel: str = "auto"):
        if kernel not in CHUNK_KERNELS:
            raise ValueError(f"context-parallel attention kernel {kernel!r}: choose one of {', '.join(CHUNK_KERNELS)}")
        self.group, self.rank, self.size, self.kernel = group, rank, size, kernel
        self.local_chunks = (rank, 2 * size - 1 - rank)
        gathered = [chunk for r in range(size) for chunk in (r, 2 * size - 1 - r)]  # the all-gather's order
        self.slot_of_chunk = [gathered.index(chunk) for chunk in range(2 * size)]
        self.positions: dict[tuple[int, torch.device], torch.Tensor] = {}  # this rank's, per length: made once

    def split(self, tensor: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's two chunks of `tensor` along `dim` (the sequence), side by side."""
        chunks = tensor.chunk(2 * self.size, dim)
        return torch.cat([chunks[c] for c in self.local_chunks], dim)

    def batch(self, batch: tuple[torch.Tensor, ...]) -> tuple:
        """The model's arguments for this rank from whole sequences (x, y): its tokens, their targets, no
        documents, and their positions in the sequence."""
        x, y = batch
        key = (x.size(1), x.device)
        if key not in self.positions:
            self.positions[key] = self.split(torch.arange(x.size(1), device=x.device), dim=0)
        return self.split(x), self.split(y), None, self.positions[key]

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """(B, H, 2L, D) chunks of every rank in the group -> (B, H, 2NL, D) in sequence order."""
        gathered = _all_gather(tensor.contiguous(), 2, self.group)
        if isinstance(gathered, funcol.AsyncCollectiveTensor):
            gathered = gathered.wait()
        chunks = gathered.chunk(2 * self.size, dim=2)
        return torch.cat([chunks[slot] for slot in self.slot_of_chunk], dim=2)

    def attend(self, q, k, v, mask: AttentionMask, dropout_p: float = 0.0) -> torch.Tensor:
        """The model's attention kernel under context parallelism: q, k, v hold this rank's two chunks (B, H, 2L, D);
        each chunk of queries attends the whole sequence's keys up to its own last position: by chunk_attention,
        the same op on every rank, or where no LSE kernel serves (dropout; float32 on CUDA) by SDPA per chunk,
        which torch.compile traces with this rank's shapes."""
        k, v = repeat_kv(q, self.gather(k), self.gather(v))  # the gathered keys: autograd sums the repeats
        used = resolve_chunk_kernel(self.kernel, q.device.type, q.dtype, q.size(-1), dropout_p)
        if used != REFERENCE:
            return chunk_attention(q, k, v, list(self.local_chunks), used)[0]
        spans = chunk_spans(q.size(2), self.local_chunks)
        parts = [attend_chunk(q[:, :, rows], k[:, :, :end], v[:, :, :end], used, dropout_p) for rows, end in spans]
        return torch.cat(parts, dim=2)


def context_shard(runtime, kernel: str = "auto") -> ContextShard | None:
    """This rank's ContextShard under runtime's context parallelism (groups of consecutive ranks); None without."""
    if runtime.context_parallel == 1:
        return None
    rank, size = runtime.rank % runtime.context_parallel, runtime.context_parallel
    return ContextShard(runtime.context_group, rank, size, kernel)


def chunk_kernel_of(sdpa_kernel: str, device_type: str) -> str:
    """The chunk kernel (CHUNK_KERNELS) that a pinned sdpa_kernel asks for: SDPA's flash (on CPU its CPU flash)
    or cuDNN, each with its log-sum-exp; for efficient and math the reference, SDPA under a lower-right mask."""
    if sdpa_kernel in ("efficient", "math"):
        return REFERENCE
    return "cpu_flash" if sdpa_kernel == "flash" and device_type == "cpu" else sdpa_kernel


def use_context_parallel_attention(model, runtime, requested: str, log) -> None:
    """Under context parallelism, give the model the context-parallel kernel in place of the one it resolved, and
    say so (a WARNING where the user asked for a kernel it replaces); without it, nothing. The model's
    sdpa_kernel, where pinned, picks the chunks' kernel (chunk_kernel_of)."""
    shard = context_shard(runtime, chunk_kernel_of(model.config.sdpa_kernel, runtime.device.type))
    if shard is None:
        return
    replaced = model.attention.resolution.used
    if requested not in ("auto", "sdpa"):
        log.warning(
            f"context_parallel={shard.size}: attention runs SDPA over the gathered keys and values; "
            f"attention_backend={requested} applies without context parallelism"
        )
    model.attention = model.attention._replace(kernel=shard.attend)
    config = model.config
    used = resolve_chunk_kernel(shard.kernel, runtime.device.type, runtime.dtype, config.head_dim, config.dropout)
    log.info(
        f"context parallel: each sequence split over {shard.size} ranks; attention: SDPA over the gathered keys "
        f"and values, {used} per chunk (in place of {replaced})"
    )
