"""`python -m bench.train_step compare` and `curves`: train.py itself run as a user runs it, its log lines read
(bench/README.md)."""

from __future__ import annotations

import re
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from bench import launch
from bench.grid import mode_parser
from bench.report import (
    DEFAULT_OUT,
    TINY,
    bench_device,
    plot,
    results_header,
    save_results,
    write_results,
)


def train_log(settings: Sequence[str]) -> launch.Run:
    """train.py run to its end with these settings after the evaluation and logging the runs have in common."""
    quiet = ["--eval_iters=1", "--eval_on_start=false", "--overwrite_out_dir=true"]
    return launch.run(launch.train_command([*quiet, *settings]))


# ----------------------------------------------------------------------------------------------
# compare: the last log line per backend

BACKENDS = ("auto", "sdpa", "flash_attn_2", "flex_attention", "manual")
COMPARE_SETTINGS = ["--max_iters=100", "--log_interval=25", "--eval_interval=1000000"]  # the caller's win
COMPARE_COLUMNS = "backend runs iter loss ms_per_iter tokens_per_sec mfu mem_gib status".split()


def compare_row(backend: str, log_text: str, exit_code: int) -> dict:
    """One row: the last log line of `train.py --attention_backend=backend`."""
    parsed = launch.log_lines(log_text)
    # The first such line is the training resolution (train.py logs it before the loop; evaluation runs
    # without gradients and may resolve to another backend later).
    runs = re.findall(r"attention backend: ([\w:]+)", log_text)
    row = {"backend": backend, "runs": runs[0] if runs else None, **(parsed[-1] if parsed else {})}
    if exit_code == 0 and parsed:
        row["status"] = "ok"
    else:
        last = [line for line in log_text.splitlines() if line.strip()][-1:] or ["(no output)"]
        row["status"] = f"exit {exit_code}: {last[0][:160]}"
    return row


def compare(argv=None) -> int:
    parser = mode_parser("train_step", "compare", "train.py once per attention backend: its last log line each")
    parser.add_argument("--backends", nargs="+", default=list(BACKENDS), help=f"default {' '.join(BACKENDS)}")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results folder (default bench/results)")
    parser.add_argument("train_args", nargs="*", help="train.py's config file and --key=value settings (after --)")
    args = parser.parse_args(argv)
    logs, rows = Path(tempfile.mkdtemp(prefix="compare_backends.")), []
    for backend in args.backends:  # <logs>/<backend>.log: stdout and stderr
        print(f"== {backend}", file=sys.stderr, flush=True)
        out_dir = logs / f"out-{backend}"
        run = train_log([*COMPARE_SETTINGS, f"--out_dir={out_dir}", *args.train_args, f"--attention_backend={backend}"])
        (logs / f"{backend}.log").write_text(run.output)
        shutil.rmtree(out_dir, ignore_errors=True)  # the checkpoint of a 100-step run is not worth keeping
        rows.append(compare_row(backend, run.output, run.code))
        print((run.output.splitlines() or [""])[-1], file=sys.stderr, flush=True)
    notes = {"source": "last log line of `python train.py ... --attention_backend=X` per backend"}
    header = results_header("compare_backends", bench_device(), logs=str(logs), notes=notes)
    paths = write_results(args.out, "compare_backends", header, rows, COMPARE_COLUMNS)
    print(paths[1].read_text())
    print("wrote " + ", ".join(map(str, paths)) + f"; logs in {logs}", file=sys.stderr)
    return 0


# ----------------------------------------------------------------------------------------------
# curves: the loss curves of plain and default

PLAIN = ["--attention_backend=sdpa", "--cross_entropy=plain"]
RUNS = {"plain": (1337, PLAIN), "default": (1337, []), "plain, seed 2": (2, PLAIN)}  # name: (seed, switches)
GPT2_SHAKESPEARE = [
    "--dataset=shakespeare",
    *launch.flags({"n_layer": 12, "n_head": 12, "n_embd": 768, "block_size": 1024, "batch_size": 16}),
    *launch.flags({"learning_rate": 6e-4, "min_lr": 6e-5, "warmup_iters": 30, "beta2": 0.95}),
]
TINY_CHAR = ["--dataset=shakespeare_char", *launch.flags(TINY), "--block_size=32", "--batch_size=8", "--warmup_iters=3"]
CURVE_COLUMNS = "run seed switches first_loss tail_loss gap_vs_plain log_tokens_per_sec log_mfu".split()


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


def smoothed(values: list[float], width: int = 20) -> list[float]:
    return [statistics.fmean(values[max(0, i - width + 1) : i + 1]) for i in range(len(values))]


def plot_curves(rows: list[dict], path: Path) -> None:
    points = [
        {"run": r["run"], "iteration": i, "loss": loss} for r in rows for i, loss in enumerate(smoothed(r["losses"]))
    ]
    panels = [("train loss (mean of the last 20)", "loss", points)]
    plot(points, path, x="iteration", panels=panels, series=lambda r: r["run"], title="same model, same data")


def curves(argv=None) -> int:
    parser = mode_parser("train_step", "curves", "the loss curves of plain, default and plain from another seed")
    parser.add_argument("--quick", action="store_true", help="tiny char model on CPU, 30 iterations")
    parser.add_argument("--iters", type=int, default=None, help="iterations per run (default 300; --quick 30)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results folder (default bench/results)")
    parser.add_argument("--work", type=Path, default=Path("out-loss-curves"), help="folder for the runs' out_dirs")
    args = parser.parse_args(argv)
    iters = args.iters or (30 if args.quick else 300)
    settings = [*TINY_CHAR, "--device=cpu"] if args.quick else GPT2_SHAKESPEARE
    steps = [f"--max_iters={iters}", f"--lr_decay_iters={iters}", "--log_interval=1", f"--eval_interval={iters}"]
    start, rows, tail = time.perf_counter(), [], max(1, iters // 3)  # the last third, where the curves have settled
    for index, (run, (seed, switches)) in enumerate(RUNS.items()):
        out_dir = f"--out_dir={args.work / f'run{index}'}"
        result = train_log([*settings, *switches, f"--seed={seed}", *steps, "--eval_iters=5", out_dir])
        if result.code != 0 or len(result.lines) != iters:
            lines = f"{len(result.lines)} of {iters} iter lines"
            raise SystemExit(f"{run}: exit {result.code}, {lines}\n{result.output[-4000:]}")
        rows.append(curve_row(run, seed, switches, result.lines, tail))
        print(f"{run}: first {rows[-1]['first_loss']:.4f}, mean of the last {tail} {rows[-1]['tail_loss']:.4f}")
    for row in rows:
        pairs = zip(row["losses"][-tail:], rows[0]["losses"][-tail:])
        row["gap_vs_plain"] = statistics.fmean(abs(a - b) for a, b in pairs)
    notes = {
        "settings": " ".join(settings) + f" --max_iters={iters}",
        "gap": f"mean |loss - plain's loss| per iteration over the last {tail} iterations; "
        "'plain, seed 2' against 'plain' is the run-to-run noise",
    }
    device, name = torch.device("cpu" if args.quick else "cuda"), "loss-curves-quick" if args.quick else "loss-curves"
    wall_s = round(time.perf_counter() - start, 1)
    save_results(args.out, name, device, rows, CURVE_COLUMNS, plot_curves, wall_s=wall_s, notes=notes)
    return 0
