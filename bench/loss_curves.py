"""Train the same model from the same seed with different switches and compare the loss curves.

    python -m bench.loss_curves                       # GPT-2 124M on Shakespeare (GPT-2 BPE), 300 iterations
    python -m bench.loss_curves --quick               # tiny char model on CPU: seconds

Each run is train.py itself (a subprocess, --log_interval=1), so the curves are what a user would see. The runs:
the plain path (nanoGPT's step: SDPA, full logits), the default (every speed switch on), and the plain path
again from another seed: the gap between the two seeds is the run-to-run noise the default's gap is read against.
"""

from __future__ import annotations

from errors import as_command

if __name__ == "__main__":  # before torch's seconds of importing: see as_command
    as_command()

import statistics
import sys
import time
from pathlib import Path

import torch

from bench import launch
from bench.report import DEFAULT_OUT, TINY, Column, pyplot, save_results
from data.common import OneLineParser

PLAIN = ["--attention_backend=sdpa", "--cross_entropy=plain"]
RUNS = {"plain": (1337, PLAIN), "default": (1337, []), "plain, seed 2": (2, PLAIN)}  # name: (seed, switches)
GPT2_SHAKESPEARE = [
    "--dataset=shakespeare",
    "--n_layer=12",
    "--n_head=12",
    "--n_embd=768",
    "--block_size=1024",
    "--batch_size=16",
    "--learning_rate=6e-4",
    "--min_lr=6e-5",
    "--warmup_iters=30",
    "--beta2=0.95",
]
TINY_CHAR = ["--dataset=shakespeare_char", *launch.flags(TINY), "--block_size=32", "--batch_size=8", "--warmup_iters=3"]
COLUMNS = [
    Column("run", "run"),
    Column("seed", "seed"),
    Column("switches", "switches"),
    Column("first_loss", "first loss", "{:.4f}"),
    Column("tail_loss", "mean loss, last third", "{:.4f}"),
    Column("gap_vs_plain", "mean abs gap to plain, last third", "{:.4f}"),
    Column("log_tokens_per_sec", "log tok/s (median)", "{:,.0f}"),
    Column("log_mfu", "log MFU (median)", "{:.1%}"),
]


def train_log(settings: list[str], seed: int, iters: int, out_dir: Path) -> list[dict]:
    """train.py's iter lines, parsed (bench.launch.parse_log_line), one per iteration."""
    settings = [
        *settings,
        f"--seed={seed}",
        f"--max_iters={iters}",
        f"--lr_decay_iters={iters}",
        "--log_interval=1",
        f"--eval_interval={iters}",
        "--eval_iters=5",
        "--eval_on_start=false",
        f"--out_dir={out_dir}",
        "--overwrite_out_dir=true",
    ]
    command = launch.train_command(settings)
    result = launch.run(command)
    lines = result.lines
    if result.code != 0 or len(lines) != iters:
        raise SystemExit(
            f"{' '.join(command)}: exit {result.code}, {len(lines)} of {iters} iter lines\n{result.output[-4000:]}"
        )
    return lines


def smoothed(values: list[float], width: int = 20) -> list[float]:
    return [statistics.fmean(values[max(0, i - width + 1) : i + 1]) for i in range(len(values))]


def plot(rows: list[dict], path: Path) -> None:
    plt = pyplot()
    figure, axis = plt.subplots(figsize=(8, 5))
    for row in rows:
        axis.plot(range(1, len(row["losses"]) + 1), smoothed(row["losses"]), label=row["run"], linewidth=1.2)
    axis.set(xlabel="iteration", ylabel="train loss (mean of the last 20)", title="same model, same data")
    axis.legend()
    figure.savefig(path, dpi=120, bbox_inches="tight")


def curve_row(run: str, seed: int, switches: list[str], log: list[dict], tail: int) -> dict:
    losses = [line["loss"] for line in log]
    steady = log[min(10, len(log) - 1) :]  # the log's own figures, past the first iterations
    mfus = [line["mfu"] for line in steady if line["mfu"] is not None]
    return {
        "run": run,
        "seed": seed,
        "switches": " ".join(switches) or "(defaults)",
        "first_loss": losses[0],
        "tail_loss": statistics.fmean(losses[-tail:]),
        "log_tokens_per_sec": statistics.median(line["tokens_per_sec"] for line in steady),
        "log_mfu": statistics.median(mfus) if mfus else None,
        "losses": losses,
    }


def main(argv=None) -> int:
    parser = OneLineParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny char model on CPU, 30 iterations")
    parser.add_argument("--iters", type=int, default=None, help="iterations per run (default 300; --quick 30)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results folder (default bench/results)")
    parser.add_argument("--work", type=Path, default=Path("out-loss-curves"), help="folder for the runs' out_dirs")
    args = parser.parse_args(argv)
    iters = args.iters or (30 if args.quick else 300)
    settings = [*TINY_CHAR, "--device=cpu"] if args.quick else GPT2_SHAKESPEARE
    start, rows = time.perf_counter(), []
    tail = max(1, iters // 3)  # the last third, where the curves have settled
    for index, (run, (seed, switches)) in enumerate(RUNS.items()):
        log = train_log(settings + switches, seed, iters, args.work / f"run{index}")
        rows.append(curve_row(run, seed, switches, log, tail))
        row = rows[-1]
        print(f"{run}: first {row['first_loss']:.4f}, mean of the last {tail} {row['tail_loss']:.4f}", flush=True)
    plain = rows[0]["losses"]
    for row in rows:
        row["gap_vs_plain"] = statistics.fmean(abs(a - b) for a, b in zip(row["losses"][-tail:], plain[-tail:]))
    device = torch.device("cpu" if args.quick else "cuda")
    name = "loss-curves-quick" if args.quick else "loss-curves"
    notes = {
        "settings": " ".join(settings) + f" --max_iters={iters}",
        "gap": f"mean |loss - plain's loss| per iteration over the last {tail} iterations; "
        "'plain, seed 2' against 'plain' is the run-to-run noise",
    }
    wall_s = round(time.perf_counter() - start, 1)
    save_results(args.out, name, device, rows, COLUMNS, plot, wall_s=wall_s, notes=notes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
