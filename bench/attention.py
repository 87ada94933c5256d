"""`python -m bench.attention`: every attention backend of model.py on the same inputs (forward, forward+backward,
memory, error), and `fit`: auto's flash-attn-4 lengths from such a file. bench/README.md says how to run it."""

from __future__ import annotations

from errors import as_command

if __name__ == "__main__":  # before torch's seconds of importing: see as_command
    as_command()

import sys
from pathlib import Path

import torch

from bench.attention_measure import Cell, measure_cell, skipped_cell
from bench.grid import BenchParser, Grid, dispatch, run_grid
from bench.report import panels_by, plot

SDPA_VARIANTS = ("sdpa:auto", "sdpa:flash", "sdpa:cudnn", "sdpa:efficient", "sdpa:math")
ALL_BACKENDS = ("manual", *SDPA_VARIANTS, "flex_attention", "flash_attn_2", "flash_attn_3", "flash_attn_4", "auto")
QUICK_BACKENDS = ("manual", *SDPA_VARIANTS, "flex_attention", "auto")
# Seq lens in the order they are measured: the README's columns first, so a --budget cut loses the others.
DEFAULT_SEQ_LENS = (1024, 4096, 16384, 512, 2048, 8192, 32768)
FLOP_CONVENTION = (
    "causal attention FLOPs: fwd = 4*B*H*T^2*D / 2 (two matmuls, half the score matrix); "
    "fwd+bwd = 3.5 * fwd (backward = 2.5 * forward, FlashAttention's convention). Document-masked "
    "cells use the same causal count, so their TF/s compare time at equal nominal work."
)

# ----------------------------------------------------------------------------------------------
# The grid


def cells_in_order(args) -> list[Cell]:
    """Causal cells before document cells; within each, seq lens in the order given (most wanted first)."""
    dtype = getattr(torch, args.dtype)
    shapes = [(docs, t, d) for docs in mask_kinds(args) for t in args.seq_lens for d in args.head_dims]
    return [Cell(d, t, docs, dtype, seed=1000 + index) for index, (docs, t, d) in enumerate(shapes)]


def mask_kinds(args) -> tuple[bool, ...]:
    """The values of `docs` to run: causal only, documents only, or both (causal first)."""
    return (True,) if args.docs_only else (False, True) if args.docs else (False,)


COLUMNS = (
    "backend resolved head_dim seq_len batch_size docs dtype fwd_ms fwd_bwd_ms fwd_tflops fwd_bwd_tflops "
    "peak_mem_mib max_err status"
).split()


def plot_cells(rows: list[dict], path: Path):
    y = "fwd_bwd_tflops" if any(r["fwd_bwd_tflops"] for r in rows) else "fwd_tflops"
    panels, title = panels_by(rows, "head_dim", y), f"attention, {rows[0]['dtype']}: {y}"
    plot(rows, path, x="seq_len", panels=panels, series=backend_and_mask, title=title, log_x=True)


def backend_and_mask(row: dict) -> str:
    return row["backend"] + (" +docs" if row["docs"] else "")


# ----------------------------------------------------------------------------------------------


def parse_args(argv=None):
    parser = BenchParser(
        "attention",
        __doc__,
        quick_help="tiny CPU run: T 64/128, D 64, float32, manual/sdpa/flex/auto (flex in one cell), with documents",
        modes=("fit",),
        device=("cuda" if torch.cuda.is_available() else "cpu", "cpu"),
        dtype=("bfloat16", "float32"),
        dtypes=("bfloat16", "float16", "float32"),
        budget=(240, 0),
        name=(None, "attention-quick"),  # None: attention[-docs][-<dtype>]
    )
    parser.option("--head-dims", [64, 128], [64], type=int, nargs="+", help="head dims D")
    parser.option("--seq-lens", list(DEFAULT_SEQ_LENS), [64, 128], type=int, nargs="+", help="T, in this order")
    parser.option("--tokens", 16384, 256, type=int, help="B*T per call (B >= 1)")
    parser.option("--heads", 16, 16, type=int, help="attention heads H, for every head dim")
    parser.option(
        "--backends", list(ALL_BACKENDS), list(QUICK_BACKENDS), nargs="+", choices=ALL_BACKENDS, help="in order"
    )
    parser.option("--warmup-ms", 25, 5, type=float, help="do_bench warm-up per timing")
    parser.option("--rep-ms", 100, 20, type=float, help="do_bench repetition time per timing")
    parser.option("--rounds", 3, 1, type=int, help="timings per backend, interleaved over a cell's; median kept")
    parser.add_argument("--docs", action="store_true", help="also every cell with document masks (~4 a row)")
    parser.add_argument("--docs-only", action="store_true", help="only document-masked cells (name attention-docs)")
    parser.add_argument("--timing", default="graph", choices=("graph", "eager"), help="CUDA: graph replays or eager")
    args = parser.parse_args(argv)
    args.docs = args.docs or args.quick  # cheap on CPU, and it exercises the document path
    if args.name is None:
        dtype = "" if args.dtype == "bfloat16" else f"-{args.dtype}"
        args.name = "attention" + ("-docs" if args.docs_only else "") + dtype
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    args.flex_cell = (args.head_dims[0], args.seq_lens[0], False)
    return args


def results_notes(args, device: torch.device) -> dict:
    graphs = args.timing == "graph" and device.type == "cuda"
    return {
        "shapes": f"B = max(1, {args.tokens} // T), H = {args.heads} for every D; {args.dtype} inputs (B, H, T, D)",
        "timing": f"median over {args.rounds} interleaved rounds of triton.testing.do_bench's median; "
        + ("CUDA graph replays (fwd_timing/fwd_bwd_timing: where eager)" if graphs else "eager calls"),
        "memory": "peak_mem_mib: max_memory_allocated in one fwd+bwd (mem_pass) minus what was allocated before",
        "error": "max_err = max |out - ref|, rel_err = ||out - ref|| / ||ref||; ref: float32 on upcast inputs, no TF32",
    }


def grid(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    from torch._dynamo import config as dynamo_config  # here: importing this module stays cheap for tests

    # flex_attention is compiled with static shapes: one recompile per cell, more than dynamo's default 8.
    limit = "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"
    setattr(dynamo_config, limit, max(getattr(dynamo_config, limit), 256))
    cell_grid = Grid(
        measure=lambda cell: measure_cell(cell, args, device),
        skipped=lambda cell, reason: skipped_cell(cell, reason, args),
        progress="head_dim seq_len docs backend fwd_ms fwd_bwd_ms fwd_bwd_tflops peak_mem_mib max_err status".split(),
        columns=COLUMNS,
        plot=plot_cells,
    )
    settings = {key: getattr(args, key) for key in ("backends", "head_dims", "seq_lens", "dtype", "heads")}
    settings.update(docs=list(mask_kinds(args)), tokens_per_call=args.tokens)
    header = {"grid": settings, "flop_convention": FLOP_CONVENTION, "notes": results_notes(args, device)}
    header, rows = run_grid(cell_grid, cells_in_order(args), args, device, header)
    from bench.readme_table import backend_table

    print(backend_table({"header": header, "rows": rows}))
    return 0


def main(argv=None) -> int:
    from bench import attention_fit

    return dispatch(argv, grid, fit=attention_fit.main)


if __name__ == "__main__":
    sys.exit(main())
