"""One rank of test_context.py (python -m tests.e2e.context_worker, with RANK, WORLD_SIZE, MASTER_ADDR/PORT): the
same float64 model and sequences on every rank; the whole sequences' loss and gradients on this rank alone, then
this rank's shard under context parallelism, with each chunk kernel in KERNELS. Prints one JSON line: the largest
relative differences and the kernel each check ran."""

from __future__ import annotations

import json

import torch
import torch.distributed as dist

from model import GPT, GPTConfig
from training.context import ContextShard, resolve_chunk_kernel

BLOCKS = {
    "gpt2": {},
    "modern": dict(rope=True, norm="rmsnorm", mlp="swiglu", n_kv_head=1, qk_norm=True, bias=False),
}
KERNELS = ("auto", "sdpa_lower_right")  # auto is the CPU flash kernel on the prefix and diagonal, merged


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def compare(block: str, seed: int, shard: ContextShard) -> dict:
    torch.manual_seed(seed)  # the same weights and sequences on every rank
    config = GPTConfig(n_layer=2, n_head=4, n_embd=32, block_size=48, vocab_size=64, attention_backend="manual")
    config = GPTConfig(**{**vars(config), **BLOCKS[block]})
    model = GPT(config).double()
    x, y = torch.randint(64, (3, 48)), torch.randint(64, (3, 48))
    _, loss = model(x, y)
    loss.backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()

    model.attention = model.attention._replace(kernel=shard.attend)  # as train.py sets it up
    _, part = model(*shard.batch((x, y)))
    part.backward()
    total = part.detach().clone()
    dist.all_reduce(total)  # each rank's mean over as many tokens: the mean of means is the whole mean
    grads = [p.grad for p in model.parameters()]
    for grad in grads:
        dist.all_reduce(grad)  # DDP averages over ranks
    return {
        "loss": abs(total.item() / shard.size - loss.item()) / abs(loss.item()),
        "grads": max(relative(g / shard.size, e) for g, e in zip(grads, expected)),
        "used": resolve_chunk_kernel(shard.kernel, "cpu", torch.float64, config.head_dim, config.dropout),
    }


def main() -> None:
    dist.init_process_group("gloo")
    shards = {
        kernel: ContextShard(dist.group.WORLD, dist.get_rank(), dist.get_world_size(), kernel) for kernel in KERNELS
    }
    worst = {f"{block}, {kernel}": compare(block, 1, shard) for kernel, shard in shards.items() for block in BLOCKS}
    print(json.dumps({"rank": dist.get_rank(), "worst": worst}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
