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
from bench.grid import BenchParser, Grid, dispatch, number, run_grid
from bench.report import plot_lines

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


def progress_line(row: dict) -> str:
    return (
        f"D={row['head_dim']:<3} T={row['seq_len']:<5} docs={int(row['docs'])} {row['backend']:<15} "
        f"fwd {number(row, 'fwd_ms', '{:.3f}'):>8} ms  fwd+bwd {number(row, 'fwd_bwd_ms', '{:.3f}'):>8} ms "
        f"{number(row, 'fwd_bwd_tflops', '{:.0f}'):>4} TF/s  mem {number(row, 'peak_mem_mib', '{:.0f}'):>6} MiB  "
        f"err {number(row, 'max_err', '{:.1e}')}  {row['status'] if row['status'] != 'ok' else ''}"
    )


COLUMNS = (
    "backend resolved head_dim seq_len batch_size docs dtype fwd_ms fwd_bwd_ms fwd_tflops fwd_bwd_tflops "
    "peak_mem_mib max_err status"
).split()


def plot(rows: list[dict], path: Path):
    def series(row):
        return row["backend"] + (" +docs" if row["docs"] else "")

    y = "fwd_bwd_tflops" if any(r["fwd_bwd_tflops"] for r in rows) else "fwd_tflops"
    masks = "causal, dashed: + document masks" if any(r["docs"] for r in rows) else "causal"
    plot_lines(
        rows,
        path,
        x="seq_len",
        y=y,
        y_label=y.replace("_tflops", "").replace("_", "+") + " TF/s",
        panel="head_dim",
        series=series,
        title=f"attention, {rows[0]['dtype']}, {masks}",
        dashed=lambda name: name.endswith("+docs"),
    )


# ----------------------------------------------------------------------------------------------


QUICK = dict(
    device="cpu",
    dtype="float32",
    head_dims=[64],
    seq_lens=[64, 128],
    tokens=256,
    backends=list(QUICK_BACKENDS),
    budget=0,
    name="attention-quick",
    warmup_ms=5,
    rep_ms=20,
    rounds=1,
)
FULL = dict(  # and device: cuda if there is one
    dtype="bfloat16",
    head_dims=[64, 128],
    seq_lens=list(DEFAULT_SEQ_LENS),
    tokens=16384,
    backends=list(ALL_BACKENDS),
    budget=240,
    name=None,  # attention[-docs][-<dtype>], from the grid
    warmup_ms=25,
    rep_ms=100,
    rounds=3,
)


def parse_args(argv=None):
    full = {**FULL, "device": "cuda" if torch.cuda.is_available() else "cpu"}
    parser = BenchParser(
        __doc__,
        QUICK,
        full,
        quick_help="tiny CPU run: T 64/128, D 64, float32, manual/sdpa/flex/auto (flex in one cell), with documents",
        dtypes=("bfloat16", "float16", "float32"),
        tool="attention",
        modes=("fit",),
    )
    add_grid_options(parser)
    args = parser.parse_args(argv)
    if args.quick:
        args.docs = True  # cheap on CPU, and it exercises the document path
    if args.name is None:
        args.name = (
            "attention" + ("-docs" if args.docs_only else "") + ("" if args.dtype == "bfloat16" else f"-{args.dtype}")
        )
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    args.flex_cell = (args.head_dims[0], args.seq_lens[0], False)
    return args


def add_grid_options(parser: BenchParser):
    parser.add_argument("--head-dims", type=int, nargs="+", help="default 64 128")
    parser.add_argument(
        "--seq-lens", type=int, nargs="+", help="default 1024 4096 16384 512 2048 8192 32768 (in order)"
    )
    parser.add_argument("--tokens", type=int, help="B*T per call (default 16384; B >= 1)")
    parser.add_argument("--heads", type=int, default=16, help="attention heads H, for every head dim (default 16)")
    parser.add_argument(
        "--docs", action="store_true", help="also every cell with document masks (~4 a row), after the causal ones"
    )
    parser.add_argument(
        "--docs-only", action="store_true", help="only the document-masked cells (default name attention-docs)"
    )
    parser.add_argument("--backends", nargs="+", choices=ALL_BACKENDS, help="default: all")
    parser.add_argument("--warmup-ms", type=float, help="do_bench warm-up per timing (default 25 ms)")
    parser.add_argument("--rep-ms", type=float, help="do_bench repetition time per timing (default 100 ms)")
    parser.add_argument(
        "--rounds",
        type=int,
        help="timings per backend, interleaved across the cell's backends; the median counts (default 3; --quick: 1)",
    )
    parser.add_argument(
        "--timing",
        default="graph",
        choices=("graph", "eager"),
        help="on CUDA, time replays of a CUDA graph of each call (default) or eager calls",
    )


def results_notes(args, device: torch.device) -> dict:
    graphs = args.timing == "graph" and device.type == "cuda"
    return {
        "shapes": f"B = max(1, {args.tokens} // T), H = {args.heads} for every D; {args.dtype} inputs (B, H, T, D)",
        "timing": f"median over {args.rounds} rounds (every backend of a cell timed in turn, each round) "
        "of the median of triton.testing.do_bench (CUDA events, L2 flushed before each run; host clock on CPU); "
        + (
            "each call captured in a CUDA graph and its replays timed, so host launch work is left out "
            "(fwd_timing/fwd_bwd_timing say where capture failed and eager calls were timed); "
            if graphs
            else "eager calls; "
        )
        + "forward timed with autograd on, as in training; mask forms (dense, BlockMask, cu_seqlens) built before "
        "timing, as the model builds them once per forward for all layers",
        "flops": FLOP_CONVENTION,
        "memory": "peak_mem_mib = max_memory_allocated during one fwd+bwd (mem_pass) minus what was "
        "allocated before (inputs, grad_out, mask, reference)",
        "error": "max_err = max |out - ref|, rel_err = ||out - ref|| / ||ref||; ref = float32 attention "
        "on upcast inputs, computed in query-row chunks, no TF32",
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
        progress=progress_line,
        columns=COLUMNS,
        plot=plot,
    )
    settings = {
        "backends": args.backends,
        "head_dims": args.head_dims,
        "seq_lens": args.seq_lens,
        "docs": list(mask_kinds(args)),
        "dtype": args.dtype,
        "tokens_per_call": args.tokens,
        "heads": args.heads,
    }
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
