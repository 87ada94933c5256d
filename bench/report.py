"""Pieces every bench shares: the card's name, the results header, timing, and writing JSON, markdown and a plot.

Each bench writes three files under its --out folder, named after the card so results from several GPUs
can sit side by side:  <card>-<name>.json (header + rows), <card>-<name>.md (a table), <card>-<name>.png.
"""

from __future__ import annotations

import datetime
import gc
import importlib.metadata
import json
import math
import re
import shlex
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # the benches run as scripts; model.py and train.py live one folder up
    sys.path.insert(0, str(REPO_ROOT))

from model import attention_report  # noqa: E402

DEFAULT_OUT = REPO_ROOT / "bench" / "results"
_VENDOR_WORDS = {"nvidia", "geforce", "tesla", "quadro", "amd", "radeon"}


# ----------------------------------------------------------------------------------------------
# Device and environment


def bench_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def card_slug(device_name: str | None = None) -> str:
    """Short file-name form of the GPU's name: 'NVIDIA H100 80GB HBM3' -> 'h100', 'NVIDIA A100-SXM4-80GB' ->
    'a100', 'NVIDIA GeForce RTX 4090' -> 'rtx-4090'; 'cpu' without a GPU."""
    if device_name is None:
        if not torch.cuda.is_available():
            return "cpu"
        device_name = torch.cuda.get_device_name()
    words = [w for w in re.split(r"[\s\-_/]+", device_name.lower()) if w and w not in _VENDOR_WORDS]
    if not words:
        return "unknown"
    # A model number has a digit in it ('h100', 'a100'); a leading family word ('rtx') needs the next word too.
    taken = words[:1] if re.search(r"\d", words[0]) else words[:2]
    return re.sub(r"[^a-z0-9]+", "-", "-".join(taken)).strip("-")


def _package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def results_header(name: str, device: torch.device, **extra) -> dict:
    """What a reader needs to trust or reproduce the numbers: card, versions, date, command line."""
    report = attention_report(device)
    on_gpu = device.type == "cuda"
    header = {
        "bench": name,
        "card": card_slug(torch.cuda.get_device_name(device)) if on_gpu else "cpu",
        "device_name": torch.cuda.get_device_name(device) if on_gpu else "cpu",
        "capability": report["capability"],
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": report["cudnn"],
        "triton": _package_version("triton"),
        "flash_attn": report["backends"]["flash_attn_2"]["version"] or None,
        "flash_attn_3": report["backends"]["flash_attn_3"]["version"] or None,
        "flash_attn_4": report["backends"]["flash_attn_4"]["version"] or None,
        "backend_problems": {n: b["why"] for n, b in report["backends"].items() if b["why"]},
        "auto_picks": report["auto"],
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join([Path(sys.executable).name, *sys.argv]),
    }
    header.update(extra)
    return header


# ----------------------------------------------------------------------------------------------
# Failures: one line per cell, never a silent gap


def is_oom(error: BaseException) -> bool:
    # Compiled code and some kernels raise a plain RuntimeError for an allocation failure.
    return isinstance(error, torch.cuda.OutOfMemoryError) or "out of memory" in str(error).lower()


def failure_reason(error: BaseException) -> str:
    """'OOM', or the exception's type and first line, short enough for a table cell."""
    if is_oom(error):
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


class Budget:
    """Wall-clock allowance for a whole bench; cells after it runs out are recorded as skipped."""

    def __init__(self, seconds: float):
        self.seconds, self.start = seconds, time.perf_counter()

    def exhausted(self) -> bool:
        return self.seconds > 0 and time.perf_counter() - self.start > self.seconds

    def reason(self) -> str:
        return f"skipped: --budget {self.seconds:g} s used up"

    def elapsed(self) -> float:
        return time.perf_counter() - self.start


# ----------------------------------------------------------------------------------------------
# Timing


def median_ms(
    fn: Callable[[], object],
    device: torch.device,
    grad_to_none: Sequence[torch.Tensor] = (),
    warmup_ms: float = 25,
    rep_ms: float = 100,
) -> float:
    """Median time of fn() in ms. On CUDA: triton.testing.do_bench (CUDA events per run, and the L2 cache
    flushed before each run, so a small input cannot be served from cache). Elsewhere: host clock."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, grad_to_none=list(grad_to_none), return_mode="median"))
    times = []
    deadline = time.perf_counter() + (warmup_ms + rep_ms) / 1000
    for i in range(1000):
        for t in grad_to_none:
            t.grad = None
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
        if i >= 2 and time.perf_counter() > deadline:
            break
    times = times[1:] if len(times) > 2 else times  # the first run is the warm-up
    return 1000 * sorted(times)[len(times) // 2]


def cuda_graph(fn: Callable[[], object], grads: Sequence[torch.Tensor], device: torch.device) -> torch.cuda.CUDAGraph:
    """fn captured in a CUDA graph, after warm-up runs on a side stream (as torch.cuda.graph asks). grads:
    leaves whose .grad fn accumulates into; cleared first, so the captured backward writes them afresh."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(3):
            for t in grads:
                t.grad = None
            fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    for t in grads:
        t.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


# ----------------------------------------------------------------------------------------------
# Writing results: JSON, markdown table, plot


class Column:
    """One markdown column: the row key, its title and how to print a value."""

    def __init__(self, key: str, title: str, fmt: str = "{}"):
        self.key, self.title, self.fmt = key, title, fmt

    def cell(self, row: dict) -> str:
        value = row.get(self.key)
        if value is None:
            return "–"
        if isinstance(value, float) and not math.isfinite(value):
            return str(value)
        return self.fmt.format(value)


def markdown_table(rows: Iterable[dict], columns: Sequence[Column]) -> str:
    lines = ["| " + " | ".join(c.title for c in columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(c.cell(row).replace("|", "/") for c in columns) + " |")
    return "\n".join(lines)


def results_stem(out_dir: Path, name: str, card: str | None = None) -> Path:
    return Path(out_dir) / f"{card or card_slug()}-{name}"


def write_results(
    out_dir,
    name: str,
    header: dict,
    rows: list[dict],
    columns: Sequence[Column],
    plot: Callable[[list[dict], Path], None] | None = None,
) -> list[Path]:
    """<card>-<name>.json, .md and (when `plot` is given) .png under out_dir; returns the paths written."""
    stem = results_stem(out_dir, name, header.get("card"))
    stem.parent.mkdir(parents=True, exist_ok=True)
    json_path, md_path = stem.with_suffix(".json"), stem.with_suffix(".md")
    json_path.write_text(json.dumps({"header": header, "rows": rows}, indent=1, default=str) + "\n")
    title = f"# {name}: {header['device_name']}, torch {header['torch']}, {header['date']}\n\n"
    notes = "".join(f"- {k}: {v}\n" for k, v in header.get("notes", {}).items())
    md_path.write_text(
        title + (notes + "\n" if notes else "") + markdown_table(rows, columns) + f"\n\n`{header['command']}`\n"
    )
    paths = [json_path, md_path]
    if plot is not None:
        png_path = stem.with_suffix(".png")
        plot(rows, png_path)
        paths.append(png_path)
    return paths


def plot_lines(
    rows: list[dict],
    path: Path,
    *,
    x: str,
    y: str,
    y_label: str,
    panel: str,
    series: Callable[[dict], str],
    memory: str = "peak_mem_mib",
    title: str = "",
    dashed: Callable[[str], bool] = lambda name: False,
):
    """Left: one panel per value of `panel` with y against x, one line per series. Right: memory against x
    on a log scale, all panels together (line style tells the panels apart)."""
    import matplotlib

    matplotlib.use("Agg")  # no display on the bench machines
    import matplotlib.pyplot as plt

    panels = sorted({r[panel] for r in rows})
    names = list(dict.fromkeys(series(r) for r in rows))
    colors = {n: plt.cm.tab20(i % 20) for i, n in enumerate(names)}
    styles = ["-", "--", ":", "-."]
    fig, axes = plt.subplots(1, len(panels) + 1, figsize=(5.5 * (len(panels) + 1), 4.5), squeeze=False)
    axes = axes[0]

    def points(rows_, key):
        pts = sorted((r[x], r[key]) for r in rows_ if isinstance(r.get(key), (int, float)) and r[key] > 0)
        return [p[0] for p in pts], [p[1] for p in pts]

    for ax, value in zip(axes, panels):
        for name in names:
            xs, ys = points([r for r in rows if r[panel] == value and series(r) == name], y)
            if xs:
                ax.plot(xs, ys, "--" if dashed(name) else "-", marker="o", color=colors[name], label=name)
        ax.set(title=f"{panel} = {value}", xlabel=x, ylabel=y_label)
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
    memory_ax = axes[-1]
    for style, value in zip(styles * len(panels), panels):
        for name in names:
            xs, ys = points([r for r in rows if r[panel] == value and series(r) == name], memory)
            if xs:
                memory_ax.plot(xs, ys, style, marker=".", color=colors[name], label=f"{name} ({panel}={value})")
    memory_ax.set(title="peak memory", xlabel=x, ylabel="MiB (log)")
    memory_ax.set_xscale("log", base=2)
    if memory_ax.lines:
        memory_ax.set_yscale("log")
    else:
        memory_ax.text(
            0.5, 0.5, "no device memory figures\n(CPU run)", ha="center", va="center", transform=memory_ax.transAxes
        )
    memory_ax.grid(alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="lower center", ncol=min(6, len(labels)), fontsize=8)
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------------------------
# train.py log lines (compare_backends.sh)

LOG_LINE = re.compile(
    r"iter (?P<iter>\d+) \| loss (?P<loss>\S+) \| lr (?P<lr>\S+) \| (?P<ms>[\d.]+) ms \| (?P<tok_s>[\d,]+) tok/s \| "
    r"MFU (?P<mfu>[\d.]+%|n/a) \| mem (?P<mem>[\d.]+) GiB"
)


def parse_log_line(line: str) -> dict | None:
    """The fields of one train.py log line (format_log_line), or None if the line is not one."""
    match = LOG_LINE.search(line)
    if match is None:
        return None
    mfu = match["mfu"]
    return {
        "iter": int(match["iter"]),
        "loss": float(match["loss"]),
        "lr": float(match["lr"]),
        "ms_per_iter": float(match["ms"]),
        "tokens_per_sec": float(match["tok_s"].replace(",", "")),
        "mfu": None if mfu == "n/a" else float(mfu.rstrip("%")) / 100,
        "mem_gib": float(match["mem"]),
    }


COMPARE_COLUMNS = [
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
    """One row of compare_backends.sh: the last log line of `train.py --attention_backend=backend`."""
    parsed = [p for p in map(parse_log_line, log_text.splitlines()) if p]
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
    """compare_backends.sh's table from <logs>/<backend>.log and .rc: <card>-compare_backends.{json,md} under
    out. keep_rows: keep the rows of other backends from that card's earlier file (to re-run one backend)."""
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
    return write_results(out, "compare_backends", header, rows, COMPARE_COLUMNS)
