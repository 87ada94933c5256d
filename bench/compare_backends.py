"""train.py itself, once per attention backend, and a table of each run's last log line.

    bench/compare_backends.sh config/train_gpt2.py --batch_size=16        # arguments go to every train.py run
    BACKENDS="auto sdpa flex_attention" bench/compare_backends.sh ...     # choose the backends
    python -m bench.compare_backends --backends sdpa manual -- config/train_gpt2.py --batch_size=16

Each run: python train.py --max_iters=100 --log_interval=25 (no evaluation until the end, checkpoints in a
temporary folder that is removed), then your arguments (so they win, e.g. --max_iters=200), then
--attention_backend=X. The last log line covers the last 25 steps, so compile time is left out. Prints a
markdown table and writes <out>/<card>-compare_backends.{md,json}; the logs stay in a temporary folder named at
the end. --keep-rows keeps the rows of other backends from that card's earlier file (to re-run one backend, or
to split the backends over several runs on the same card).
"""

from __future__ import annotations

from errors import as_command

if __name__ == "__main__":  # before torch's seconds of importing: see as_command
    as_command()

import argparse
import json
import re
import shlex
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from bench import launch
from bench.report import DEFAULT_OUT, Column, bench_device, results_header, results_stem, write_results
from data.common import OneLineParser

BACKENDS = ("auto", "sdpa", "flash_attn_2", "flex_attention", "manual")
SETTINGS = [  # before the caller's arguments, so theirs win
    "--max_iters=100",
    "--log_interval=25",
    "--eval_interval=1000000",
    "--eval_on_start=false",
    "--eval_iters=1",
]
COLUMNS = [
    Column("backend", "backend"),
    Column("runs", "runs"),
    Column("iter", "iter"),
    Column("loss", "loss", "{:.4f}"),
    Column("ms_per_iter", "ms/iter", "{:.1f}"),
    Column("tokens_per_sec", "tok/s", "{:,.0f}"),
    Column("mfu", "MFU", "{:.1%}"),
    Column("mem_gib", "mem GiB", "{:.1f}"),
    Column("status", "status"),
]


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


def tabulate_compare_logs(logs: Path, out: Path, backends: Sequence[str], command: str, keep_rows: bool) -> list[Path]:
    """The table from <logs>/<backend>.log and .rc: <card>-compare_backends.{json,md} under out. keep_rows: keep
    the rows of other backends from that card's earlier file (to re-run one backend)."""
    logs, out = Path(logs), Path(out)
    rows = [
        compare_row(b, (logs / f"{b}.log").read_text(errors="replace"), int((logs / f"{b}.rc").read_text()))
        for b in backends
    ]
    header = results_header(
        "compare_backends",
        bench_device(),
        command=command,
        logs=str(logs),
        notes={"source": "last log line of `python train.py ... --attention_backend=X` per backend"},
    )
    earlier_path = results_stem(out, "compare_backends", header["card"]).with_suffix(".json")
    if keep_rows and earlier_path.exists():
        earlier = json.loads(earlier_path.read_text())
        if earlier["header"]["device_name"] == header["device_name"]:
            rows = [r for r in earlier["rows"] if r["backend"] not in backends] + rows
            header["kept_rows_from"] = {key: earlier["header"][key] for key in ("command", "date", "torch")}
    return write_results(out, "compare_backends", header, rows, COLUMNS)


def run_backends(backends: Sequence[str], train_args: Sequence[str], logs: Path) -> None:
    """train.py once per backend: <logs>/<backend>.log (stdout and stderr) and .rc (its exit code)."""
    for backend in backends:
        print(f"== {backend}", file=sys.stderr, flush=True)
        out_dir = logs / f"out-{backend}"
        settings = [*SETTINGS, f"--out_dir={out_dir}", *train_args, f"--attention_backend={backend}"]
        run = launch.run(launch.train_command(settings))
        (logs / f"{backend}.log").write_text(run.output)
        (logs / f"{backend}.rc").write_text(f"{run.code}\n")
        shutil.rmtree(out_dir, ignore_errors=True)  # the checkpoint of a 100-step run is not worth keeping
        print((run.output.splitlines() or [""])[-1], file=sys.stderr, flush=True)


def parse_args(argv=None) -> argparse.Namespace:
    parser = OneLineParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backends", nargs="+", default=list(BACKENDS), help=f"default {' '.join(BACKENDS)}")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results folder (default bench/results)")
    parser.add_argument("--keep-rows", action="store_true", help="keep other backends' rows of the earlier file")
    parser.add_argument("--command", default=None, help="the command named in the results (default this one)")
    parser.add_argument("train_args", nargs="*", help="train.py's config file and --key=value settings (after --)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    command = args.command or shlex.join([Path(sys.executable).name, "-m", "bench.compare_backends", *sys.argv[1:]])
    logs = Path(tempfile.mkdtemp(prefix="compare_backends."))
    run_backends(args.backends, args.train_args, logs)
    paths = tabulate_compare_logs(logs, args.out, args.backends, command, args.keep_rows)
    print(paths[1].read_text())
    print("wrote " + ", ".join(map(str, paths)) + f"; logs in {logs}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
