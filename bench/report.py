"""What every bench writes: the model shapes, the card's name, the results header, and a run's rows as
<card>-<name>.json, .md (a table) and .png under --out."""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import math
import re
import shlex
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import torch

import generation  # noqa: F401  (registers paged_attention)
import kernels  # noqa: F401  (registers flash_attn_3/4, flex_attention and auto's table: the header names them)
from kernels.report import attention_report

DEFAULT_OUT = Path(__file__).resolve().parent / "results"
_VENDOR_WORDS = {"nvidia", "geforce", "tesla", "quadro", "amd", "radeon"}

# The models the benches run: GPT-2 124M's shape (its vocabulary padded to 50304) and the tiny model of every
# --quick run, seconds on a CPU. Each bench adds what else it sets (vocabulary, bias, block size).
GPT2_124M = {"n_layer": 12, "n_head": 12, "n_embd": 768}
GPT2_VOCAB = 50304
TINY = {"n_layer": 2, "n_head": 2, "n_embd": 64}


def model_shape(quick: bool) -> dict:
    """A copy of TINY (quick) or of GPT2_124M."""
    return dict(TINY if quick else GPT2_124M)


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
# Writing results: JSON, markdown table, plot


def cell(value) -> str:
    """A markdown cell: '–' for none, large numbers with thousands separators, small ones to 3 digits."""
    if value is None:
        return "–"
    if isinstance(value, float) and math.isfinite(value):
        return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"
    return str(value).replace("|", "/")


def markdown_table(rows: Iterable[dict], columns: Sequence[str]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return "\n".join(lines + ["| " + " | ".join(cell(row.get(c)) for c in columns) + " |" for row in rows])


def write_results(out_dir, name: str, header: dict, rows: list[dict], columns: Sequence[str], plot=None) -> list[Path]:
    """<card>-<name>.json, .md and (when `plot` is given) .png under out_dir; returns the paths written."""
    stem = Path(out_dir) / f"{header['card']}-{name}"
    stem.parent.mkdir(parents=True, exist_ok=True)
    json_path, md_path = stem.parent / f"{stem.name}.json", stem.parent / f"{stem.name}.md"  # names may hold dots
    json_path.write_text(json.dumps({"header": header, "rows": rows}, indent=1, default=str) + "\n")
    title = f"# {name}: {header['device_name']}, torch {header['torch']}, {header['date']}\n\n"
    notes = "".join(f"- {k}: {v}\n" for k, v in header.get("notes", {}).items())
    table = markdown_table(rows, columns)
    md_path.write_text(title + (notes + "\n" if notes else "") + table + f"\n\n`{header['command']}`\n")
    if plot is None:
        return [json_path, md_path]
    plot(rows, stem.parent / f"{stem.name}.png")
    return [json_path, md_path, stem.parent / f"{stem.name}.png"]


def save_results(out_dir, name: str, device: torch.device, rows: list[dict], columns, plot=None, **fields) -> dict:
    """The results writer of every bench: results_header(name, device, **fields) and the rows written by
    write_results, each path printed. Returns the header."""
    header = results_header(name, device, **fields)
    for path in write_results(out_dir, name, header, rows, columns, plot):
        print(f"wrote {path}")
    return header


def write_markdown(path: Path, text: str) -> int:
    """A report that is text only (the profiles): written, printed, and its path said. Returns 0 (a tool's exit)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    print(text)
    print(f"wrote {path}")
    return 0


def pyplot():
    """matplotlib.pyplot drawing into files: no display on the bench machines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


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
    plt = pyplot()
    panels = sorted({r[panel] for r in rows})
    names = list(dict.fromkeys(series(r) for r in rows))
    colors = {n: plt.cm.tab20(i % 20) for i, n in enumerate(names)}
    fig, axes = plt.subplots(1, len(panels) + 1, figsize=(5.5 * (len(panels) + 1), 4.5), squeeze=False)
    axes = axes[0]

    def points(value, name, key):  # (xs, ys) of one series in one panel, where key has a positive number
        mine = [r for r in rows if r[panel] == value and series(r) == name]
        pts = sorted((r[x], r[key]) for r in mine if isinstance(r.get(key), (int, float)) and r[key] > 0)
        return [p[0] for p in pts], [p[1] for p in pts]

    for ax, value in zip(axes, panels):
        for name in names:
            xs, ys = points(value, name, y)
            if xs:
                ax.plot(xs, ys, "--" if dashed(name) else "-", marker="o", color=colors[name], label=name)
        ax.set(title=f"{panel} = {value}", xlabel=x, ylabel=y_label)
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
    for style, value in zip(["-", "--", ":", "-."] * len(panels), panels):
        for name in names:
            xs, ys = points(value, name, memory)
            if xs:
                axes[-1].plot(xs, ys, style, marker=".", color=colors[name], label=f"{name} ({panel}={value})")
    _memory_axes(axes[-1], x)
    _save_figure(plt, fig, axes[0], title, path)


def plot_series(rows: list[dict], path: Path, *, x: str, panels, series: Callable[[dict], str], marker="o", ratio=""):
    """One panel per (y key, y label, title) of `panels`: y against x, one line per series (rows in x order);
    a y of None leaves a gap. The panel of the `ratio` key gets a line at 1.0 (perfect scaling)."""
    plt = pyplot()
    figure, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels) + 1, 4.5), squeeze=False)
    names = list(dict.fromkeys(series(r) for r in rows))
    for axis, (y, y_label, title) in zip(axes[0], panels):
        for name in names:
            mine = sorted((r for r in rows if series(r) == name), key=lambda r: r[x])
            axis.plot([r[x] for r in mine], [r.get(y) for r in mine], marker=marker, label=name, linewidth=1.2)
        if y == ratio:
            axis.axhline(1.0, color="gray", linewidth=0.8)
        axis.set(xlabel=x, ylabel=y_label, title=title)
        axis.grid(alpha=0.3)
        if names:
            axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def plot_bars(
    rows: list[dict], path: Path, *, label: str, value: str, x_label: str, title: str, group=None, inner=None
):
    """Horizontal bars of row[value] per row[label], side by side per row[group]; `inner`: a second value drawn
    hatched inside each bar (the host's share of a wall time)."""
    plt = pyplot()
    groups = list(dict.fromkeys(row.get(group) for row in rows))
    figure, axis = plt.subplots(figsize=(9, 1 + 0.5 * len(rows)))
    height = 0.8 / len(groups)
    for index, name in enumerate(groups):
        mine = [row for row in rows if row.get(group) == name]
        positions = [i + index * height for i in range(len(mine))]
        axis.barh(positions, [row[value] for row in mine], height=height, label=f"{name or ''} {value}".strip())
        if inner:
            hatched = dict(fill=False, hatch="//", label=inner if index == 0 else None)  # one legend entry
            axis.barh(positions, [row[inner] for row in mine], height=height, **hatched)
        axis.set_yticks([i + (len(groups) - 1) * height / 2 for i in range(len(mine))], [row[label] for row in mine])
    axis.invert_yaxis()
    axis.set(xlabel=x_label, title=title)
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _save_figure(plt, fig, legend_from, title: str, path: Path):
    """The figure with legend_from's legend below its panels, saved to path."""
    handles, labels = legend_from.get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="lower center", ncol=min(6, len(labels)), fontsize=8)
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _memory_axes(ax, x: str):
    ax.set(title="peak memory", xlabel=x, ylabel="MiB (log)")
    ax.set_xscale("log", base=2)
    if ax.lines:
        ax.set_yscale("log")
    else:
        ax.text(0.5, 0.5, "no device memory figures\n(CPU run)", ha="center", va="center", transform=ax.transAxes)
    ax.grid(alpha=0.3)
