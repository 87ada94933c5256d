"""Context parallelism: each sequence split over the ranks of a group, for contexts one GPU cannot hold.

A sequence of T tokens is cut into 2N equal chunks for a group of N ranks; rank r holds chunks r and 2N-1-r, so
every rank has the same share of causal attention's work. Each layer's attention all-gathers the group's keys and
values (the all-gather form of context parallelism that Llama 3 was trained with), and each local chunk of queries
attends the keys up to its own positions. The backward of the all-gather sums each rank's key and value gradients
back to their owner, so averaging gradients over all ranks (DDP or FSDP, as without context parallelism) gives the
gradient of the whole sequences' mean loss. Everything else in a step (embeddings, MLPs, the loss) is per token and
runs on this rank's tokens alone.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed import _functional_collectives as funcol
from torch.nn.attention.bias import causal_lower_right

from model import AttentionMask, repeat_kv

# differentiable all-gather (its backward a reduce-scatter) that torch.compile traces; renamed in torch 2.9
_all_gather = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd


class ContextShard:
    """Rank `rank`'s part of every sequence in a context-parallel group of `size` ranks (`group`)."""

    def __init__(self, group, rank: int, size: int):
        self.group, self.rank, self.size = group, rank, size
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
        each chunk of queries attends the whole sequence's keys up to its own last position (causal, aligned to
        the lower right: the chunk's queries are the last L of those keys' positions). SDPA picks its kernel."""
        length = q.size(2) // 2
        k, v = self.gather(k), self.gather(v)
        outputs = []
        for which, chunk in enumerate(self.local_chunks):
            end = (chunk + 1) * length
            q_chunk = q[:, :, which * length : (which + 1) * length]
            k_seen, v_seen = repeat_kv(q_chunk, k[:, :, :end], v[:, :, :end])
            causal = causal_lower_right(length, end)
            outputs.append(
                F.scaled_dot_product_attention(q_chunk, k_seen, v_seen, attn_mask=causal, dropout_p=dropout_p)
            )
        return torch.cat(outputs, dim=2)


def context_shard(runtime) -> ContextShard | None:
    """This rank's ContextShard under runtime's context parallelism (groups of consecutive ranks); None without."""
    if runtime.context_parallel == 1:
        return None
    return ContextShard(runtime.context_group, runtime.rank % runtime.context_parallel, runtime.context_parallel)


def use_context_parallel_attention(model, runtime, requested: str, log) -> None:
    """Under context parallelism, give the model the context-parallel kernel in place of the one it resolved, and
    say so (a WARNING where the user asked for a kernel it replaces); without it, nothing."""
    shard = context_shard(runtime)
    if shard is None:
        return
    replaced = model.attention.resolution.used
    if requested not in ("auto", "sdpa"):
        log.warning(
            f"context_parallel={shard.size}: attention runs SDPA over the gathered keys and values; "
            f"attention_backend={requested} applies without context parallelism"
        )
    model.attention = model.attention._replace(kernel=shard.attend)
    log.info(
        f"context parallel: each sequence split over {shard.size} ranks; attention: SDPA over the gathered keys "
        f"and values (in place of {replaced})"
    )
