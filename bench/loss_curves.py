"""Train the same model from the same seed with different switches and compare the loss curves.

    python bench/loss_curves.py                       # GPT-2 124M on Shakespeare (GPT-2 BPE), 300 iterations
    python bench/loss_curves.py --quick               # tiny char model on CPU: seconds

Each run is train.py itself (a subprocess, --log_interval=1), so the curves are what a user would see. The runs:
the plain path (nanoGPT's step: SDPA, full logits), the default (every speed switch on), and the plain path
again from another seed: the gap between the two seeds is the run-to-run noise the default's gap is read against.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.report import DEFAULT_OUT, Column, parse_log_line, results_header, write_results  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
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
TINY_CHAR = [
    "--dataset=shakespeare_char",
    "--n_layer=2",
    "--n_embd=64",
    "--block_size=32",
    "--batch_size=8",
    "--warmup_iters=3",
]
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
    """train.py's iter lines, parsed (bench.report.parse_log_line), one per iteration."""
    command = [
        sys.executable,
        "train.py",
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
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    lines = [parsed for line in result.stdout.splitlines() if (parsed := parse_log_line(line))]
    if result.returncode != 0 or len(lines) != iters:
        raise SystemExit(
            f"{' '.join(command)}: exit {result.returncode}, {len(lines)} of {iters} iter lines\n"
            f"{result.stdout[-2000:]}{result.stderr[-2000:]}"
        )
    return lines


def smoothed(values: list[float], width: int = 20) -> list[float]:
    return [statistics.fmean(values[max(0, i - width + 1) : i + 1]) for i in range(len(values))]


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(8, 5))
    for row in rows:
        axis.plot(range(1, len(row["losses"]) + 1), smoothed(row["losses"]), label=row["run"], linewidth=1.2)
    axis.set(xlabel="iteration", ylabel="train loss (mean of the last 20)", title="same model, same data")
    axis.legend()
    figure.savefig(path, dpi=120, bbox_inches="tight")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
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
        losses = [line["loss"] for line in log]
        steady = log[min(10, iters - 1) :]  # the log's own figures, past the first iterations
        mfus = [line["mfu"] for line in steady if line["mfu"] is not None]
        rows.append(
            {
                "run": run,
                "seed": seed,
                "switches": " ".join(switches) or "(defaults)",
                "first_loss": losses[0],
                "tail_loss": statistics.fmean(losses[-tail:]),
                "log_tokens_per_sec": statistics.median(line["tokens_per_sec"] for line in steady),
                "log_mfu": statistics.median(mfus) if mfus else None,
                "losses": losses,
            }
        )
        print(f"{run}: first {losses[0]:.4f}, mean of the last {tail} {rows[-1]['tail_loss']:.4f}", flush=True)
    plain = rows[0]["losses"]
    for row in rows:
        row["gap_vs_plain"] = statistics.fmean(abs(a - b) for a, b in zip(row["losses"][-tail:], plain[-tail:]))
    device = torch.device("cpu" if args.quick else "cuda")
    header = results_header(
        "loss-curves-quick" if args.quick else "loss-curves",
        device,
        wall_s=round(time.perf_counter() - start, 1),
        notes={
            "settings": " ".join(settings) + f" --max_iters={iters}",
            "gap": f"mean |loss - plain's loss| per iteration over the last {tail} iterations; "
            "'plain, seed 2' against 'plain' is the run-to-run noise",
        },
    )
    for path in write_results(args.out, header["bench"], header, rows, COLUMNS, plot):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
