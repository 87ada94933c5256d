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


def model_settings(quick: bool, **changes) -> dict:
    """GPT-2 124M (or the tiny --quick model) as the step and generation grids run it: no bias, no dropout, GPT-2's
    padded vocabulary (512 --quick); `changes` over it."""
    shape = TINY if quick else GPT2_124M
    return {**shape, "vocab_size": 512 if quick else GPT2_VOCAB, "bias": False, "dropout": 0.0, **changes}


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


def results_header(name: str, device: torch.device, **extra) -> dict:
    """What a reader needs to trust or reproduce the numbers: card, versions, date, command line."""
    report = attention_report(device)
    on_gpu = device.type == "cuda"
    return {
        "bench": name,
        "card": card_slug(torch.cuda.get_device_name(device)) if on_gpu else "cpu",
        "device_name": torch.cuda.get_device_name(device) if on_gpu else "cpu",
        "capability": report["capability"],
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": report["cudnn"],
        "triton": next((d.version for d in importlib.metadata.distributions(name="triton")), None),
        "flash_attn": report["backends"]["flash_attn_2"]["version"] or None,
        "flash_attn_3": report["backends"]["flash_attn_3"]["version"] or None,
        "flash_attn_4": report["backends"]["flash_attn_4"]["version"] or None,
        "backend_problems": {n: b["why"] for n, b in report["backends"].items() if b["why"]},
        "auto_picks": report["auto"],
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join([Path(sys.executable).name, *sys.argv]),
        **extra,
    }


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


def save_results(out_dir, name: str, device: torch.device, rows: list[dict], columns, plot=None, **fields) -> dict:
    """The results writer of every bench: results_header(name, device, **fields) and the rows as <card>-<name>.json,
    .md and (when `plot` is given) .png under out_dir, each path printed. Returns the header."""
    header = results_header(name, device, **fields)
    stem = f"{Path(out_dir) / header['card']}-{name}"  # a name may hold dots: suffixes go after it
    write(f"{stem}.json", json.dumps({"header": header, "rows": rows}, indent=1, default=str) + "\n")
    title = f"# {name}: {header['device_name']}, torch {header['torch']}, {header['date']}\n\n"
    notes = "".join(f"- {k}: {v}\n" for k, v in header.get("notes", {}).items())
    table = markdown_table(rows, columns)
    write(f"{stem}.md", title + (notes + "\n" if notes else "") + table + f"\n\n`{header['command']}`\n")
    if plot is not None:
        plot(rows, Path(f"{stem}.png"))
        print(f"wrote {stem}.png")
    return header


def write(path, text: str) -> None:
    """text into the file at path (its folder made), and the path said."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(text)
    print(f"wrote {path}")


def write_markdown(out_dir: Path, name: str, device: torch.device, title: str, sections: list[str]) -> int:
    """A report that is text only (the profiles): <card>-<name>.md under out_dir, headed `# name on card (torch
    version)title`, written, printed, and its path said. Returns 0 (a tool's exit)."""
    card = card_slug() if device.type == "cuda" else "cpu"
    text = f"# {name} on {card} (torch {torch.__version__}){title}\n\n" + "\n".join(sections)
    print(text)
    write(out_dir / f"{card}-{name}.md", text)
    return 0


def plot(rows: list[dict], path: Path, *, x: str, panels, series: Callable[[dict], str], title="", log_x=False):
    """One panel per (title, y key, its rows) of `panels`: y against x, one line per series(row); a row without a
    positive y leaves a gap. A `scaling` panel gets a line at 1.0 (perfect scaling)."""
    from matplotlib.figure import Figure  # here: importing this module stays cheap; no pyplot, no display

    figure = Figure(figsize=(5.5 * len(panels) + 1, 4.5))
    axes = figure.subplots(1, len(panels), squeeze=False)
    for axis, (name, y, shown) in zip(axes[0], panels):
        for label in dict.fromkeys(series(r) for r in shown):
            mine = [r for r in shown if series(r) == label and isinstance(r.get(y), (int, float)) and r[y] > 0]
            points = sorted((r[x], r[y]) for r in mine)
            if points:
                axis.plot(*zip(*points), marker="o" if len(points) < 40 else None, label=label)
        if y == "scaling":
            axis.axhline(1.0, color="gray", linewidth=0.8)
        axis.set(title=name, xlabel=x, ylabel=y, xscale="log" if log_x else "linear")
        axis.grid(alpha=0.3)
        if axis.get_legend_handles_labels()[0]:  # a panel of only the 1.0 line has no series to name
            axis.legend(fontsize=7)
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def panels_by(rows: list[dict], key: str, y: str) -> list:
    """plot()'s panels: y for each value of rows' `key`, then the peak memory at its largest value."""
    values = sorted({r[key] for r in rows})
    panels = [(f"{key} = {v}", y, [r for r in rows if r[key] == v]) for v in values]
    return panels + [(f"peak memory, {key} = {values[-1]}", "peak_mem_mib", panels[-1][2])]


def plot_bars(label: str, value: str, title: str) -> Callable[[list[dict], Path], None]:
    """save_results' plot: horizontal bars of row[value], one per row, labelled label.format(**row)."""

    def draw(rows: list[dict], path: Path):
        from matplotlib.figure import Figure

        figure = Figure(figsize=(9, 1 + 0.4 * len(rows)))
        axis = figure.subplots()
        axis.barh([label.format(**row) for row in rows], [row[value] or 0 for row in rows])
        axis.invert_yaxis()
        axis.set(xlabel=value, title=title)
        figure.tight_layout()
        figure.savefig(path, dpi=110)

    return draw
