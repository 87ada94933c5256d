"""The grid runner of the attention, train and generate benches: their shared command line, cases run in order
under a wall-clock budget, failures recorded as a row's status, and the results written (bench.report)."""

from __future__ import annotations

import contextlib
import gc
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import torch

from bench.report import DEFAULT_OUT, cell, save_results
from data.common import OneLineParser
from kernels.timing import timed

# ----------------------------------------------------------------------------------------------
# The command line


class BenchParser(OneLineParser):
    """The command line of `python -m bench.TOOL [MODE]`: --out, --quick where quick_help says what it runs, --name
    where `name` gives its defaults, a grid's --device, --dtype and --budget (grid_options()), then options that
    each have a full-run default and a --quick one (option())."""

    def __init__(self, tool: str, doc: str, quick_help="", modes: Sequence[str] = (), name: tuple | None = None):
        epilog = f"modes: python -m bench.{tool} {' | '.join(modes)} (each with its own --help)" if modes else None
        super().__init__(prog=f"python -m bench.{tool}", description=doc, epilog=epilog)
        self.defaults: dict[str, tuple] = {}
        if quick_help:
            self.add_argument("--quick", action="store_true", help=quick_help)
        self.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results folder (default bench/results)")
        if name:
            self.option("--name", *name, help="results name")

    def grid_options(self, device: tuple, dtype: tuple, dtypes: Sequence[str], budget: tuple):
        self.option("--device", *device, help="where it runs")
        self.option("--dtype", *dtype, choices=dtypes, help="compute dtype")
        self.option("--budget", *budget, type=float, help="seconds for all cases, the rest skipped")

    def option(self, flag: str, full, quick, help: str, **kwargs):
        """--flag: `full` when left unset, `quick` with --quick."""
        shown = [" ".join(map(str, v)) if isinstance(v, list) else v for v in (full, quick)]
        said = f"default {shown[0]}" + (f"; --quick: {shown[1]}" if quick != full else "")
        self.defaults[self.add_argument(flag, help=f"{help} ({said})", **kwargs).dest] = (full, quick)

    def parse_args(self, args=None, namespace=None):
        parsed = super().parse_args(args, namespace)
        for key, (full, quick) in self.defaults.items():
            if getattr(parsed, key) is None:
                setattr(parsed, key, quick if getattr(parsed, "quick", False) else full)
        return parsed


def dispatch(argv, default: Callable[[list[str]], int], **modes: Callable[[list[str]], int]) -> int:
    """A tool's modes: `python -m bench.X MODE ...` runs modes[MODE] on the rest, anything else the default."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in modes:
        return modes[argv[0]](argv[1:])
    return default(argv)


# ----------------------------------------------------------------------------------------------
# The runner and the writer


def run_grid(cases: Iterable, args, device: torch.device, header: dict, **grid) -> tuple[dict, list[dict]]:
    """grid's measure(case) rows for the cases in order, those after --budget its skipped(case, reason) rows, a
    progress line a row (its `progress` keys); then its finish(rows) if any (ratios between rows), and
    <card>-<args.name>.{json,md,png} under args.out: the header (results_header's fields, wall_s and those of
    `header`), the rows in its `columns`, its plot(rows, path) if any. Returns (header, rows)."""
    if args.quick:
        torch.set_num_threads(1)  # a tiny model gains nothing from threads, and a shared CPU makes them crawl
    start, rows = time.perf_counter(), []
    for case in cases:
        if 0 < args.budget < time.perf_counter() - start:
            measured = grid["skipped"](case, f"skipped: --budget {args.budget:g} s used up")
        else:
            measured = grid["measure"](case)
        for row in measured:
            rows.append(row)
            stamp = f"[{time.perf_counter() - start:6.1f}s]"
            print(stamp, *(f"{key} {cell(row.get(key))}" for key in grid["progress"]), flush=True)
    if grid.get("finish"):
        grid["finish"](rows)
    wall_s = round(time.perf_counter() - start, 1)
    header = save_results(args.out, args.name, device, rows, grid["columns"], grid.get("plot"), wall_s=wall_s, **header)
    return header, rows


# ----------------------------------------------------------------------------------------------
# Failures: one line per cell, never a silent gap


def failure_reason(error: BaseException) -> str:
    """'OOM', or the exception's type and first line, short enough for a table cell."""
    # Compiled code and some kernels raise a plain RuntimeError for an allocation failure.
    if isinstance(error, torch.cuda.OutOfMemoryError) or "out of memory" in str(error).lower():
        return "OOM"
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    text = f"{type(error).__name__}: {lines[0] if lines else ''}"
    return text if len(text) <= 200 else text[:197] + "..."


def free_device_memory():
    """Drop what the last cell left behind on the GPU, so one cell's OOM does not poison the next. Only on
    CUDA: a CPU's tensors go by reference counting, and a full gc pass costs ~0.2 s once dynamo is loaded."""
    if torch.cuda.is_available():
        gc.collect()  # tensors held in reference cycles (a failed call's traceback) until collected
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


@contextlib.contextmanager
def fresh_row(row: dict):
    """A row that compiles afresh, as a new process would: dynamo reset before and after, any failure (OOM, a
    kernel's refusal, a compile error) recorded as row['status'] instead of raised, the GPU freed after. Keep
    what the row builds (model, state) inside a function called in the block, so it is gone when freed."""
    import torch._dynamo  # here: importing this module stays cheap

    torch._dynamo.reset()
    try:
        yield
    except Exception as error:  # noqa: BLE001 - recorded, never swallowed
        row["status"] = failure_reason(error)
    finally:
        torch._dynamo.reset()
        free_device_memory()


def profiled(device: torch.device, steps: int, step: Callable[[], object]) -> tuple[object, float]:
    """torch.profiler over `steps` calls of step() (CPU ops, and CUDA kernels on a GPU), and their wall ms each."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        wall_ms = timed(lambda: [step() for _ in range(steps)], device).wall_ms / steps
    return prof, wall_ms
