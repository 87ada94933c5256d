"""Where one optimizer step's time goes under DDP and under FSDP: train.py's own model, optimizer and GradScaler
(train.build_train_state), GPT-2 124M at T=1024, micro-batch 16, one micro-step per rank; each phase timed
on every rank with a barrier before it and a sync after (host ms: launching it; wall ms: until the GPU is done;
rank 0's, and the slowest rank's step by step: the one a gradient reduction waits for). Forward+backward runs
twice, with the gradient reduction and without it (no_sync), to tell the reduction from the compute.
The last row is train.py's own train_step, the whole step without syncs between its phases.

    torchrun --standalone --nproc_per_node=4 bench/step_phases.py ddp fsdp
    python bench/step_phases.py --name step-phases-1gpu ddp                  # one GPU, no DDP: the reference
    torchrun --standalone --nproc_per_node=2 bench/step_phases.py --quick ddp fsdp    # CPU, gloo, a tiny model

Results: bench/results/<card>-step-phases.{json,md,png}. Run with NCCL_NVLS_ENABLE=0 on multi-GPU hosts.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.report import DEFAULT_OUT, Column, results_header, write_results  # noqa: E402

COLUMNS = [
    Column("parallelism", "parallelism"),
    Column("ranks", "ranks"),
    Column("phase", "phase"),
    Column("host_ms", "host ms", "{:.2f}"),
    Column("wall_ms", "wall ms", "{:.2f}"),
    Column("slowest_ms", "slowest rank's wall ms", "{:.2f}"),
    Column("rank_wall_ms", "wall ms by rank"),
]
GPT2 = dict(n_layer=12, n_head=12, n_embd=768, block_size=1024)  # with vocab_size 50304: GPT-2 124M
QUICK = dict(n_layer=2, n_head=2, n_embd=64, block_size=64)
PHASES = (
    "forward+backward (with its gradient reduction)",
    "forward+backward without reduction (no_sync)",
    "train.clip_and_step: clip, optimizer step",
    "zero_grad",
    "train.train_step: the whole step as train.py runs it",
)


def build(parallelism: str, runtime, quick: bool):
    import train
    from model import GPT

    shape = QUICK if quick else GPT2
    cfg = train.TrainConfig(
        **shape,
        vocab_size=256 if quick else 50304,
        batch_size=16,
        parallelism=parallelism,
        dropout=0.0,
        compile=not quick,
    )
    cfg.gradient_accumulation_steps = runtime.world_size
    torch.manual_seed(0)
    model = GPT(cfg.model_config())

    def next_batch():
        x = torch.randint(0, cfg.vocab_size, (cfg.batch_size, cfg.block_size), device=runtime.device)
        return x, torch.roll(x, -1, 1)

    return train.build_train_state(cfg, runtime, model, next_batch), next_batch


def measure(parallelism: str, runtime, steps: int, quick: bool) -> list[dict]:
    import train
    from parallel import gradient_sync

    state, next_batch = build(parallelism, runtime, quick)
    sync = torch.cuda.synchronize if runtime.device.type == "cuda" else lambda: None
    barrier = dist.barrier if runtime.ddp else lambda: None  # one rank: the reference without DDP

    def forward_backward(batch, reduce: bool):
        with gradient_sync(state.model, state.train_model, enabled=reduce):
            with runtime.autocast():
                _, loss = state.train_model(*batch)
            state.scaler.scale(loss).backward()

    def clip_and_step():
        train.clip_and_step(state.optimizer, state.scaler, state.model, 1.0, runtime.dtype)

    times: dict[str, list[tuple[float, float]]] = {}

    def timed(name, work):
        sync()
        barrier()
        start = time.perf_counter()
        work()
        launched = time.perf_counter()
        sync()
        times.setdefault(name, []).append(((launched - start) * 1e3, (time.perf_counter() - start) * 1e3))

    batch = next_batch()  # one batch throughout: the timings do not depend on its tokens
    works = (
        lambda: forward_backward(batch, reduce=True),
        lambda: forward_backward(batch, reduce=False),
        clip_and_step,
        lambda: state.optimizer.zero_grad(set_to_none=True),
        lambda: train.train_step(state),
    )
    for _ in range(steps):
        for name, work in zip(PHASES, works):
            timed(name, work)
    kept = {name: pairs[steps // 4 :] for name, pairs in times.items()}
    walls = {name: [wall for _, wall in pairs] for name, pairs in kept.items()}
    every_rank = [walls]
    if runtime.ddp:  # every rank timed every phase: the slowest rank is the one the others wait for
        every_rank = [None] * runtime.world_size
        dist.all_gather_object(every_rank, walls)
    return [
        {
            "parallelism": parallelism,
            "ranks": runtime.world_size,
            "phase": name,
            "host_ms": statistics.median(host for host, _ in pairs),
            "wall_ms": statistics.median(walls[name]),
            "slowest_ms": statistics.median(max(step) for step in zip(*(rank[name] for rank in every_rank))),
            "rank_wall_ms": " / ".join(f"{statistics.median(rank[name]):.2f}" for rank in every_rank),
        }
        for name, pairs in kept.items()
    ]


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parallelisms = list(dict.fromkeys(row["parallelism"] for row in rows))
    figure, axis = plt.subplots(figsize=(9, 4))
    for index, parallelism in enumerate(parallelisms):
        mine = [row for row in rows if row["parallelism"] == parallelism]
        positions = [i + index * 0.4 for i in range(len(mine))]
        axis.barh(positions, [row["wall_ms"] for row in mine], height=0.4, label=f"{parallelism} wall")
        axis.barh(positions, [row["host_ms"] for row in mine], height=0.4, fill=False, hatch="//", label="host")
        axis.set_yticks([i + 0.2 for i in range(len(mine))], [row["phase"] for row in mine], fontsize=7)
    axis.invert_yaxis()
    axis.set(xlabel="ms (rank 0, median)", title="one optimizer step, phase by phase")
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("parallelism", nargs="+", choices=("ddp", "fsdp"))
    parser.add_argument("--steps", type=int, default=20, help="steps per parallelism; the first quarter is left out")
    parser.add_argument("--quick", action="store_true", help="CPU, gloo, a tiny model: checks the script")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results folder (default bench/results)")
    parser.add_argument("--name", default=None, help="results name (default step-phases; --quick step-phases-quick)")
    args = parser.parse_args(argv)
    from runtime import setup_runtime

    quick = args.quick
    ranks = int(os.environ.get("WORLD_SIZE", "1"))  # one micro-step per rank
    runtime = setup_runtime(
        "cpu" if quick else "auto", "float32" if quick else "auto", "gloo" if quick else "nccl", ranks
    )
    rows = [row for parallelism in args.parallelism for row in measure(parallelism, runtime, args.steps, quick)]
    if runtime.master:
        name = args.name or ("step-phases-quick" if args.quick else "step-phases")
        notes = {
            "model": ", ".join(f"{key} {value}" for key, value in (QUICK if quick else GPT2).items())
            + ", micro-batch 16, one micro-step per rank",
            "phases": "each rank, a barrier before and a sync after each; medians over steps (host, wall: rank 0's; "
            "slowest: of the slowest rank's wall time, step by step)",
            "environment": "NCCL_NVLS_ENABLE=0",
        }
        header = results_header(name, runtime.device, notes=notes)
        for row in rows:
            print(
                f"{row['parallelism']:5} {row['phase']:52} host {row['host_ms']:8.2f}  wall {row['wall_ms']:8.2f}  "
                f"slowest rank {row['slowest_ms']:8.2f}  by rank {row['rank_wall_ms']}"
            )
        for path in write_results(args.out, name, header, rows, COLUMNS, plot):
            print(f"wrote {path}")
    if runtime.ddp:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
