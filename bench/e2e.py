"""
Every path a user takes, end to end on this machine's GPU(s), with small models on real text (this repo's own
sources): train.py per backend x {plain, packed documents} x {compiled, eager}; a resume after a stop;
sample.py per KV cache x {eager, compiled} x {inside block_size, sliding past it} x {1 prompt, 4 of mixed
lengths}; LoRA train -> sample -> merge in bf16; a Hugging Face GPT-2 folder in -> sample, and export ->
transformers loads it; under torchrun where there are 2 GPUs, DDP (also with each block compiled apart), FSDP,
DDP with the optimizer step sharded (and profiled), and context parallelism (also with block recomputation).

    python -m bench.e2e                        # all cells; bench/results/<card>-e2e.json and .md
    python -m bench.e2e --only train --jobs 4  # cells whose path starts with "train"
    python -m bench.e2e --only speed           # sample.py's decode speed (always one cell at a time)

Each cell is a subprocess; a row says its path, settings, status (ok, skipped: why, or the error's last line),
the figure it measured and its seconds. Cells run `--jobs` at a time (small models share the GPU): figures are
a sanity check of each path, not benchmarks. A train cell passes when its loss is finite, falls, and ends within
0.15 nats of sdpa's run with the same seed and settings.
"""

from __future__ import annotations

from errors import as_command

if __name__ == "__main__":  # before torch's seconds of importing: see as_command
    as_command()

import json
import math
import os
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from bench import launch
from data.common import OneLineParser

REPO = Path(__file__).resolve().parent.parent
TRAIN_BACKENDS = ("sdpa", "manual", "flex_attention", "flash_attn_2", "flash_attn_3", "flash_attn_4")
MODEL = ["--n_layer=4", "--n_head=4", "--n_embd=128", "--block_size=256", "--batch_size=16", "--dropout=0.0"]
TRAIN = ["--max_iters=40", "--eval_interval=40", "--eval_iters=8", "--log_interval=10", "--seed=1337"]
LOSS_NOISE = 0.15  # nats: same seed, different kernels (bf16 rounding differs from step one)


@dataclass
class Cell:
    path: str  # e.g. "train sdpa packed compiled"
    command: list[str]
    settings: dict
    parse: str = "train"  # how to read the figure: train | sample | done
    needs: list[str] = field(default_factory=list)  # paths of cells that must pass first
    gpus: int = 1


@dataclass
class Row:
    path: str
    settings: dict
    status: str
    figure: float | None
    unit: str
    seconds: float
    log_tail: str = ""  # a failed cell's last lines of output (the JSON keeps them; the table shows the status)


LOG_TAIL_LINES = 40


def read_train(log: str) -> tuple[str, float | None, str]:
    """(status, final val loss) from train.py's eval lines: finite and falling."""
    vals = [float(v) for v in re.findall(r"^eval \d+ \| train \S+ \| val (\S+)", log, re.M)]
    if len(vals) < 2:
        return "no eval lines", None, "val loss"
    if not all(math.isfinite(v) for v in vals) or vals[-1] >= vals[0]:
        return f"loss did not fall: {vals}", vals[-1], "val loss"
    return "ok", vals[-1], "val loss"


def read_sample(log: str) -> tuple[str, float | None, str]:
    found = re.search(r"^decode: \d+ tokens in \S+ s \((\S+) tokens/s\)", log, re.M)
    if not found:
        return "no decode line", None, "tok/s"
    warmup = re.search(r"^warm-up: the first decode step took (\S+) s", log, re.M)
    unit = "decode tok/s" + (f", warm-up {warmup.group(1)} s" if warmup else "")
    return "ok", float(found.group(1).replace(",", "")), unit


def measure(cell: Cell, env: dict) -> Row:
    done = launch.run(cell.command, env, timeout=600)  # stdout and stderr together; 124 past the timeout
    output, seconds = done.output, done.seconds
    tail = "\n".join(output.splitlines()[-LOG_TAIL_LINES:])  # kept for a cell that fails
    if done.code != 0:
        return Row(cell.path, cell.settings, done.failure(), None, "", seconds, tail)
    fallback = re.search(r"WARNING: (\S+) requested but (.*); falling back to", output)
    if fallback and cell.settings.get("backend") == fallback.group(1):
        return Row(cell.path, cell.settings, f"skipped: {fallback.group(2)[:200]}", None, "", seconds)
    status, figure, unit = {"train": read_train, "sample": read_sample}.get(cell.parse, lambda _: ("ok", None, ""))(
        output
    )
    return Row(cell.path, cell.settings, status, figure, unit, seconds, "" if status == "ok" else tail)


# ----------------------------------------------------------------------------------------------
# The cells


def train_cells(data: Path, work: Path) -> list[Cell]:
    cells = []
    for backend in TRAIN_BACKENDS:
        for packed in (False, True):
            for compiled in (True, False):
                name = f"train {backend} {'packed' if packed else 'plain'} {'compiled' if compiled else 'eager'}"
                out = work / name.replace(" ", "-")
                command = [sys.executable, "train.py", f"--data_dir={data}", f"--out_dir={out}", *MODEL, *TRAIN]
                command += [f"--attention_backend={backend}", f"--compile={str(compiled).lower()}", "--dtype=bfloat16"]
                if packed:
                    newline = json.loads((data / "meta.json").read_text())["itos"].index("\n")
                    command += ["--packed_documents=true", f"--document_separator={newline}"]  # a line a document
                settings = {"backend": backend, "packed": packed, "compile": compiled}
                cells.append(Cell(name, command, settings))
    return cells


def base_cells(data: Path, work: Path) -> list[Cell]:
    """The checkpoint the sampling cells read, and a stop-and-resume."""
    base = [sys.executable, "train.py", f"--data_dir={data}", *MODEL, "--eval_iters=4", "--dtype=bfloat16"]
    model = Cell("base model", [*base, f"--out_dir={work / 'base'}", "--max_iters=60", "--eval_interval=30"], {})
    first = [*base, f"--out_dir={work / 'resume'}", "--max_iters=20", "--eval_interval=20"]
    resume = [*base, f"--out_dir={work / 'resume'}", "--max_iters=40", "--eval_interval=20", "--init_from=resume"]
    stop = Cell("resume: first run", first, {"max_iters": 20})
    again = Cell("resume after a stop", resume, {"max_iters": 40}, needs=["resume: first run"])
    return [model, stop, again]


def sample_cells(work: Path) -> list[Cell]:
    prompts = work / "prompts.txt"
    prompts.write_text("ROMEO:\nWhat light through yonder window breaks? It is the east\nA\nThe quick brown fox\n")
    cells = []
    for cache in ("none", "contiguous", "paged"):
        for compiled in (False, True):
            if compiled and cache == "none":
                continue  # compile captures the decode step over a cache
            for window, new in (("inside", 150), ("sliding", 600)):  # block_size 256
                for batch in (1, 4):
                    start = ["--start=ROMEO:"] if batch == 1 else [f"--start=FILE:{prompts}", "--batch_size=4"]
                    name = f"sample {cache} {'compiled' if compiled else 'eager'} {window} batch{batch}"
                    command = [sys.executable, "sample.py", f"--out_dir={work / 'base'}", f"--max_new_tokens={new}"]
                    command += [f"--kv_cache={cache}", f"--compile={str(compiled).lower()}", "--num_samples=1", *start]
                    settings = {"kv_cache": cache, "compile": compiled, "window": window, "batch": batch}
                    cells.append(Cell(name, command, settings, parse="sample", needs=["base model"]))
    return cells


def weights_cells(data: Path, work: Path) -> list[Cell]:
    lora = work / "lora"
    train = [sys.executable, "train.py", f"--data_dir={data}", f"--out_dir={lora}", f"--init_from={work / 'base'}"]
    train += ["--lora_rank=8", "--max_iters=20", "--eval_interval=20", "--eval_iters=4", "--dtype=bfloat16"]
    hf_in, hf_out = work / "hf-gpt2", work / "hf-export"
    make_hf = (
        "import transformers as t; t.GPT2LMHeadModel(t.GPT2Config(n_layer=2, n_head=2, n_embd=64)).save_pretrained"
    )
    return [
        Cell("lora train", [*train, "--batch_size=16"], {"dtype": "bfloat16"}, needs=["base model"]),
        Cell(
            "lora sample",
            [sys.executable, "sample.py", f"--out_dir={lora}", "--max_new_tokens=50", "--dtype=bfloat16"],
            {},
            parse="sample",
            needs=["lora train"],
        ),
        Cell(
            "lora merge",
            [sys.executable, "-m", "weights", "merge", str(lora / "ckpt.pt"), str(work / "merged.pt")],
            {},
            parse="done",
            needs=["lora train"],
        ),
        Cell("hf folder made", [sys.executable, "-c", f"{make_hf}({str(hf_in)!r})"], {}, parse="done"),
        Cell(
            "hf folder in -> sample",
            [sys.executable, "sample.py", f"--init_from={hf_in}", "--max_new_tokens=50", "--start=Hello"],
            {},
            parse="sample",
            needs=["hf folder made"],
        ),
        Cell(
            "export -> transformers loads it",
            [sys.executable, "-m", "weights", "hf", str(work / "base" / "ckpt.pt"), str(hf_out)],
            {},
            parse="done",
            needs=["base model"],
        ),
        Cell(
            "transformers loads the export",
            [sys.executable, "-c", f"import transformers as t; t.GPT2LMHeadModel.from_pretrained({str(hf_out)!r})"],
            {},
            parse="done",
            needs=["export -> transformers loads it"],
        ),
    ]


def speed_cells(work: Path) -> list[Cell]:
    """sample.py's decode speed as a user sees it, one cell at a time (--only speed --jobs 1): GPT-2 124M (random
    weights, a Hugging Face folder) at batch 1 by each way of decoding, and sliding past block_size (1024) with
    each slide; the char model (block_size 256) likewise."""
    gpt2 = work / "hf-gpt2-124M"
    make = f"import transformers as t; t.GPT2LMHeadModel(t.GPT2Config()).save_pretrained({str(gpt2)!r})"
    cells = [Cell("speed: GPT-2 124M folder", [sys.executable, "-c", make], {}, parse="done")]
    sample = [sys.executable, "sample.py", "--num_samples=1", "--start=Hello", "--temperature=0.8"]
    for name, extra in (
        ("default (CUDA graph)", []),
        ("eager", ["--cuda_graph=false"]),
        ("compiled", ["--compile=true"]),
    ):
        command = [*sample, f"--init_from={gpt2}", "--max_new_tokens=500", *extra]
        cells.append(Cell(f"speed gpt2 {name}", command, {"decode": name}, "sample", ["speed: GPT-2 124M folder"]))
    for slide in ("half", "exact"):
        command = [*sample, f"--init_from={gpt2}", "--max_new_tokens=2000", f"--slide={slide}"]
        settings = {"slide": slide, "new_tokens": 2000, "block_size": 1024}
        cells.append(Cell(f"speed gpt2 sliding {slide}", command, settings, "sample", ["speed: GPT-2 124M folder"]))
    for slide, new in (("inside", 200), ("half", 1000), ("exact", 1000)):
        command = [*sample, f"--out_dir={work / 'base'}", f"--max_new_tokens={new}"]
        command += [] if slide == "inside" else [f"--slide={slide}"]
        settings = {"slide": slide, "new_tokens": new, "block_size": 256}
        cells.append(Cell(f"speed char {slide}", command, settings, "sample", ["base model"]))
    return cells


PARALLEL = {  # torchrun cell: its settings (DDP the default)
    "ddp": [],
    "ddp compile_blocks": ["--compile_blocks=true"],
    "fsdp": ["--parallelism=fsdp"],
    "ddp shard_optimizer, profiled": ["--shard_optimizer=true", "--profile_steps=2"],
    "context_parallel": ["--context_parallel=2"],
    "context_parallel, block recomputation": ["--context_parallel=2", "--activation_checkpointing=block"],
}


def parallel_cells(data: Path, work: Path) -> list[Cell]:
    cells = []
    for name, settings in PARALLEL.items():
        out_dir = work / re.sub(r"\W+", "-", name)
        command = ["torchrun", "--standalone", "--nproc_per_node=2", "train.py", f"--data_dir={data}", *MODEL, *TRAIN]
        command += [f"--out_dir={out_dir}", "--dtype=bfloat16", *settings]
        command += ["--gradient_accumulation_steps=2"]  # counts micro-steps of all ranks together, as in nanoGPT
        cells.append(Cell(f"torchrun 2 GPUs {name}", command, {"settings": " ".join(settings) or "-"}, gpus=2))
    return cells


# ----------------------------------------------------------------------------------------------
# Running them


def run_cells(cells: list[Cell], jobs: int, gpus: int, env: dict, rows: dict[str, Row]) -> list[Row]:
    """Run every cell once the cells it needs (here or in `rows`, those run before) have passed, `jobs` at a time."""
    pending = list(cells)
    with ThreadPoolExecutor(jobs) as pool:
        while pending:
            ready = [c for c in pending if all(n in rows for n in c.needs)]
            for cell in ready:
                pending.remove(cell)
                failed = [n for n in cell.needs if rows[n].status != "ok"]
                if failed or cell.gpus > max(gpus, 1):
                    why = f"needs {failed[0]}" if failed else f"needs {cell.gpus} GPUs (this machine has {gpus})"
                    rows[cell.path] = Row(cell.path, cell.settings, f"skipped: {why}", None, "", 0.0)
            runnable = [c for c in ready if c.path not in rows]
            for cell, row in zip(runnable, pool.map(lambda c: measure(c, env), runnable)):
                rows[cell.path] = row
                print(f"{row.status[:60]:<60} {row.seconds:6.1f} s  {cell.path}", flush=True)
    return [rows[c.path] for c in cells]


def compare_with_sdpa(rows: list[Row]) -> None:
    """A train cell's final loss must be within LOSS_NOISE of sdpa's with the same settings."""
    reference = {
        (r.settings["packed"], r.settings["compile"]): r.figure for r in rows if r.path.startswith("train sdpa")
    }
    for row in rows:
        key = (row.settings.get("packed"), row.settings.get("compile"))
        if row.path.startswith("train ") and row.status == "ok" and reference.get(key) is not None:
            if abs(row.figure - reference[key]) > LOSS_NOISE:
                row.status = f"loss {row.figure:.3f} vs sdpa's {reference[key]:.3f}: more than {LOSS_NOISE} apart"


def write(rows: list[Row], out: Path, card: str, started: float) -> Path:
    import torch

    slug = re.sub(r"[^a-z0-9]+", "-", card.lower()).strip("-") or "cpu"
    slug = "h100" if "h100" in slug else "h200" if "h200" in slug else slug
    summary = {
        "card": card,
        "torch": torch.__version__,
        "gpus": torch.cuda.device_count(),
        "seconds": round(time.perf_counter() - started, 1),
        "ok": sum(r.status == "ok" for r in rows),
        "failed": sum(not (r.status == "ok" or r.status.startswith("skipped")) for r in rows),
        "rows": [vars(r) for r in rows],
    }
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{slug}-e2e{os.environ.get('E2E_SUFFIX', '')}.json"
    path.write_text(json.dumps(summary, indent=1) + "\n")
    lines = [f"# End-to-end matrix on {card} (torch {summary['torch']}, {summary['gpus']} GPU(s))", ""]
    lines += [f"{summary['ok']} ok, {summary['failed']} failed, {summary['seconds']} s. `python -m bench.e2e`", ""]
    lines += ["| path | status | figure | seconds |", "|---|---|---:|---:|"]
    for r in rows:
        figure = (
            "" if r.figure is None else f"{r.figure:,.3f} {r.unit}" if r.figure < 100 else f"{r.figure:,.0f} {r.unit}"
        )
        lines.append(f"| {r.path} | {r.status.replace('|', '/')} | {figure} | {r.seconds:.0f} |")
    path.with_suffix(".md").write_text("\n".join(lines) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(REPO / "bench" / "results"))
    parser.add_argument("--work", default="/tmp/e2e", help="scratch folder for data and checkpoints")
    parser.add_argument("--jobs", type=int, default=4, help="cells at a time")
    parser.add_argument("--only", default="", help="run only cells whose path starts with one of these (a,b,...)")
    args = parser.parse_args(argv)
    import torch

    started, work = time.perf_counter(), Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    data = launch.corpus(work / "data")
    cells = base_cells(data, work) + train_cells(data, work) + sample_cells(work) + weights_cells(data, work)
    cells += parallel_cells(data, work) + speed_cells(work)
    if args.only:
        wanted = [c for c in cells if c.path.startswith(tuple(args.only.split(",")))]
        needed = {n for c in wanted for n in c.needs}
        cells = [c for c in cells if c in wanted or c.path in needed]
    gpus = torch.cuda.device_count()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
    done: dict[str, Row] = {}
    rows = run_cells([c for c in cells if not c.path.startswith("speed")], args.jobs, gpus, env, done)
    rows += run_cells([c for c in cells if c.path.startswith("speed")], 1, gpus, env, done)  # timed alone
    compare_with_sdpa(rows)
    card = torch.cuda.get_device_name() if gpus else "cpu"
    path = write(rows, Path(args.out), card, started)
    print(path.with_suffix(".md").read_text())
    return 0 if all(r.status == "ok" or r.status.startswith("skipped") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
