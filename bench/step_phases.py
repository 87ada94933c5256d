"""Where one optimizer step's time goes under DDP and under FSDP: train.py's own model, optimizer and GradScaler
(train.build_train_state), GPT-2 124M at T=1024, micro-batch 16, one micro-step per rank; each phase timed
on every rank with a barrier before it and a sync after (host ms: launching it; wall ms: until the GPU is done;
rank 0's, and the slowest rank's step by step: the one a gradient reduction waits for). Forward+backward runs
twice, with the gradient reduction and without it (no_sync), to tell the reduction from the compute.
The last row is train.py's own train_step, the whole step without syncs between its phases.

    torchrun --standalone --nproc_per_node=4 -m bench.step_phases ddp fsdp
    python -m bench.step_phases --name step-phases-1gpu ddp                  # one GPU, no DDP: the reference
    torchrun --standalone --nproc_per_node=2 -m bench.step_phases --quick ddp fsdp    # CPU, gloo, a tiny model

Results: bench/results/<card>-step-phases.{json,md,png}. Run with NCCL_NVLS_ENABLE=0 on multi-GPU hosts.
"""

from __future__ import annotations

from errors import as_command

if __name__ == "__main__":  # before torch's seconds of importing: see as_command
    as_command()

import os
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from bench.report import DEFAULT_OUT, GPT2_VOCAB, Column, model_shape, pyplot, save_results
from data.common import OneLineParser
from kernels.timing import timed

COLUMNS = [
    Column("parallelism", "parallelism"),
    Column("ranks", "ranks"),
    Column("phase", "phase"),
    Column("host_ms", "host ms", "{:.2f}"),
    Column("wall_ms", "wall ms", "{:.2f}"),
    Column("slowest_ms", "slowest rank's wall ms", "{:.2f}"),
    Column("rank_wall_ms", "wall ms by rank"),
]
PHASES = (
    "forward+backward (with its gradient reduction)",
    "forward+backward without reduction (no_sync)",
    "train.clip_and_step: clip, optimizer step",
    "zero_grad",
    "train.train_step: the whole step as train.py runs it",
)


def model_settings(quick: bool) -> dict:
    """GPT-2 124M at T=1024 (with vocab_size 50304), or the tiny --quick model at T=64."""
    return {**model_shape(quick), "block_size": 64 if quick else 1024}


def build(parallelism: str, runtime, quick: bool):
    import train
    from model import GPT

    cfg = train.TrainConfig(
        **model_settings(quick),
        vocab_size=256 if quick else GPT2_VOCAB,
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


def phase_works(state, runtime, batch) -> tuple:
    """What each of PHASES runs, in order, on one batch throughout (the timings do not depend on its tokens)."""
    import train
    from training.parallel import gradient_sync

    def forward_backward(reduce: bool):
        with gradient_sync(state.model, state.train_model, enabled=reduce):
            with runtime.autocast():
                _, loss = state.train_model(*batch)
            state.scaler.scale(loss).backward()

    def clip_and_step():
        train.clip_and_step(state.optimizer, state.scaler, state.model, 1.0, runtime.dtype)

    return (
        lambda: forward_backward(reduce=True),
        lambda: forward_backward(reduce=False),
        clip_and_step,
        lambda: state.optimizer.zero_grad(set_to_none=True),
        lambda: train.train_step(state),
    )


def time_phases(works, runtime, steps: int) -> dict[str, list[tuple[float, float]]]:
    """{phase: [(host ms, wall ms) per step]}: each phase between a barrier and a sync, on every rank."""
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in PHASES}
    for _ in range(steps):
        for name, work in zip(PHASES, works):
            if runtime.ddp:  # one rank: the reference without DDP
                dist.barrier()
            _, launch_ms, wall_ms = timed(work, runtime.device)
            times[name].append((launch_ms, wall_ms))
    return times


def measure(parallelism: str, runtime, steps: int, quick: bool) -> list[dict]:
    state, next_batch = build(parallelism, runtime, quick)
    times = time_phases(phase_works(state, runtime, next_batch()), runtime, steps)
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
    plt = pyplot()
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


def write(args, runtime, rows: list[dict]) -> None:
    name = args.name or ("step-phases-quick" if args.quick else "step-phases")
    notes = {
        "model": ", ".join(f"{key} {value}" for key, value in model_settings(args.quick).items())
        + ", micro-batch 16, one micro-step per rank",
        "phases": "each rank, a barrier before and a sync after each; medians over steps (host, wall: rank 0's; "
        "slowest: of the slowest rank's wall time, step by step)",
        "environment": "NCCL_NVLS_ENABLE=0",
    }
    for row in rows:
        print(
            f"{row['parallelism']:5} {row['phase']:52} host {row['host_ms']:8.2f}  wall {row['wall_ms']:8.2f}  "
            f"slowest rank {row['slowest_ms']:8.2f}  by rank {row['rank_wall_ms']}"
        )
    save_results(args.out, name, runtime.device, rows, COLUMNS, plot, notes=notes)


def main(argv=None) -> int:
    parser = OneLineParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("parallelism", nargs="+", choices=("ddp", "fsdp"))
    parser.add_argument("--steps", type=int, default=20, help="steps per parallelism; the first quarter is left out")
    parser.add_argument("--quick", action="store_true", help="CPU, gloo, a tiny model: checks the script")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results folder (default bench/results)")
    parser.add_argument("--name", default=None, help="results name (default step-phases; --quick step-phases-quick)")
    args = parser.parse_args(argv)
    from training.runtime import setup_runtime

    quick = args.quick
    ranks = int(os.environ.get("WORLD_SIZE", "1"))  # one micro-step per rank
    runtime = setup_runtime(
        "cpu" if quick else "auto", "float32" if quick else "auto", "gloo" if quick else "nccl", ranks
    )
    rows = [row for parallelism in args.parallelism for row in measure(parallelism, runtime, args.steps, quick)]
    if runtime.master:
        write(args, runtime, rows)
    if runtime.ddp:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
