"""Time every attention backend of model.py on the same inputs: forward, forward+backward, memory, error.

    python -m bench.bench_attention                     # H100 grid: D 64/128, T 512..32768, bf16, causal
    python -m bench.bench_attention --docs              # also document-masked cells (~4 documents per row)
    python -m bench.bench_attention --docs-only         # only those (-> <card>-attention-docs.json)
    python -m bench.bench_attention --dtype float16 --budget 0
    python -m bench.bench_attention --quick             # tiny CPU run (seconds), what tests/e2e/test_bench.py runs

Every cell (head dim, sequence length, documents or not) gets fresh random inputs with the same number of
tokens per call (batch = tokens // T, at least 1) and H = 16 heads for both head dims (so H*D is 1024 or
2048), so the work per call, B*T^2 = tokens*T, grows linearly in T. Each backend runs through the very
function the model calls (model.BACKENDS[name].kernel / sdpa_attention(kernel=...)); `auto` is what
model.resolve picks for training here, from the card's table (config/attention_auto.json; not timed at
setup). A backend that cannot run a cell records why ('OOM', the resolver's reason, or the exception's
first line) in `status`; cells the --budget leaves no time for say so too.
"""

from __future__ import annotations

from errors import as_command

if __name__ == "__main__":  # before torch's seconds of importing: see as_command
    as_command()

import contextlib
import functools
import math
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

import kernels  # noqa: F401  (registers flash_attn_3/4, flex_attention and auto's table into model.BACKENDS)
from bench.grid import (
    BenchParser,
    Grid,
    cuda_graph,
    failure_reason,
    free_device_memory,
    number,
    run_grid,
)
from bench.report import Column, plot_lines
from kernels.timing import median_ms
from model import BACKENDS, AttentionMask, AttentionUse, resolve, sdpa_attention, why_not_sdpa_kernel
from training.runtime import synchronize

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
GRAPH_MEMORY_SHARE = 0.25  # of the card's memory, for the CUDA graphs of one cell (see capture_graphs)
REFERENCE_SCORES_BYTES = 2**30  # float32 scores per chunk of the reference: ~1 GiB, whatever T is


@dataclass(frozen=True)
class Cell:
    head_dim: int
    seq_len: int
    docs: bool
    dtype: torch.dtype
    seed: int = 0  # of the cell's random inputs


# ----------------------------------------------------------------------------------------------
# Inputs and the float32 reference


def document_ids(batch: int, seq_len: int, generator: torch.Generator, n_docs: int = 4) -> torch.Tensor:
    """(batch, T) ids: each row cut at n_docs-1 random distinct points into documents of random lengths."""
    rows = []
    for _ in range(batch):
        cuts = torch.randperm(seq_len - 1, generator=generator)[: n_docs - 1] + 1
        starts = torch.zeros(seq_len, dtype=torch.int32)
        starts[cuts] = 1
        rows.append(starts.cumsum(0))
    return torch.stack(rows)


def make_inputs(cell: Cell, heads: int, tokens: int, device: torch.device):
    """Fresh random q, k, v (requiring grad), an upstream gradient and the mask: never zeros, which can hide
    unwritten outputs and run faster than real data."""
    batch = max(1, tokens // cell.seq_len)
    on_device = torch.Generator(device=device).manual_seed(cell.seed)  # drawing 4 x 32M values on the host is slow
    shape = (batch, heads, cell.seq_len, cell.head_dim)  # (B, H, T, D)
    q, k, v, grad_out = (torch.randn(shape, generator=on_device, device=device, dtype=cell.dtype) for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_(True)
    on_host = torch.Generator().manual_seed(cell.seed)
    doc_ids = document_ids(batch, cell.seq_len, on_host).to(device) if cell.docs else None
    return q, k, v, grad_out, AttentionMask(cell.seq_len, device, doc_ids)


@contextlib.contextmanager
def full_float32_matmuls():
    """The reference must not use TF32 (~1e-3 relative error), whatever the process set before."""
    saved = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(saved[0])
        torch.backends.cudnn.allow_tf32 = saved[1]


@torch.no_grad()
def reference_attention(q, k, v, mask: AttentionMask) -> torch.Tensor:
    """Causal (and same-document) attention in float32 on upcast inputs, one batch element and one chunk of
    query rows at a time, so the reference exists at every T (T=32k scores alone would be 64 GiB)."""
    B, H, T, D = q.shape
    out = torch.empty(B, H, T, D, dtype=torch.float32, device=q.device)
    rows = max(1, min(T, REFERENCE_SCORES_BYTES // (4 * H * T)))
    positions = torch.arange(T, device=q.device)
    with full_float32_matmuls():
        for b in range(B):
            qb, kb, vb = (x[b].float() for x in (q, k, v))  # (H, T, D)
            for start in range(0, T, rows):
                end = min(T, start + rows)  # causal: these queries see keys [0, end) only
                scores = qb[:, start:end] @ kb[:, :end].transpose(-2, -1) / math.sqrt(D)  # (H, rows, end)
                allowed = positions[start:end, None] >= positions[None, :end]
                if mask.has_documents:
                    segments = mask.segments[b]
                    allowed &= segments[start:end, None] == segments[None, :end]
                scores.masked_fill_(~allowed, float("-inf"))
                out[b, :, start:end] = torch.softmax(scores, dim=-1) @ vb[:, :end]
    return out


# ----------------------------------------------------------------------------------------------
# Backends: the function to call, and why it cannot run (checked before running, for forward and backward)


@dataclass
class Plan:
    fn: object
    resolved: str  # what actually runs: the backend itself, or what auto picked
    forward_problem: str
    backward_problem: str


def plan_backend(backend: str, cell: Cell, device: torch.device) -> Plan:
    def need(training: bool) -> AttentionUse:
        return AttentionUse(device, cell.dtype, cell.head_dim, cell.docs, training=training, seq_len=cell.seq_len)

    if backend == "auto":  # resolved for training, as the model resolves it
        used = resolve("auto", need(True)).used
        return Plan(BACKENDS[used].kernel, used, "", "")
    if backend.startswith("sdpa:"):
        kernel = backend.split(":", 1)[1]
        # pinned: never let PyTorch pick another
        problem = BACKENDS["sdpa"].why_not(need(False)) or why_not_sdpa_kernel(kernel, need(False))
        return Plan(functools.partial(sdpa_attention, kernel=kernel), backend, problem, problem)
    record = BACKENDS[backend]
    return Plan(record.kernel, backend, record.why_not(need(False)), record.why_not(need(True)))


def attention_flops(batch: int, heads: int, seq_len: int, head_dim: int) -> tuple[float, float]:
    forward = 4 * batch * heads * seq_len**2 * head_dim / 2
    return forward, 3.5 * forward


def memory_mib(run, device: torch.device, grads) -> float | None:
    """Peak memory of one run() beyond what was allocated before it (inputs, mask, reference): the
    attention's own memory, gradients of q, k, v included."""
    if device.type != "cuda":
        return None
    for t in grads:
        t.grad = None
    synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    run()
    synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    for t in grads:
        t.grad = None
    return (peak - base) / 2**20


@dataclass
class Measurement:
    """One backend in one cell: its row, and the runs still to be timed ('fwd', 'fwd_bwd' -> fn, grads)."""

    row: dict
    runs: dict
    status: dict
    times: dict


def prepare_backend(backend: str, cell: Cell, inputs, reference, args, device) -> Measurement:
    """Everything but the timing: first call (compiles flex, builds the mask form), error, memory."""
    q, k, v, grad_out, mask = inputs
    plan = plan_backend(backend, cell, device)
    row = {**empty_row(backend, cell, q.size(0)), "resolved": plan.resolved}
    m = Measurement(row, {}, {}, {"fwd": [], "fwd_bwd": []})
    skip = plan.forward_problem or quick_skip_reason(backend, cell, args)
    if skip:
        m.status = {"fwd": skip, "fwd_bwd": skip}
        return m
    if plan.backward_problem:  # forward-only (flex on CPU): autograd inputs would make it refuse to run
        q, k, v = (t.detach() for t in (q, k, v))

    def forward():
        return plan.fn(q, k, v, mask, 0.0)

    def forward_backward():
        plan.fn(q, k, v, mask, 0.0).backward(grad_out)

    m.status["fwd"] = first_forward(m, forward, reference, device)
    if m.status["fwd"] != "ok" or plan.backward_problem:
        if m.status["fwd"] == "ok" and device.type == "cuda":
            row["peak_mem_mib"], row["mem_pass"] = memory_mib(forward, device, ()), "fwd"
        m.status["fwd_bwd"] = plan.backward_problem or m.status["fwd"]
        return m
    m.status["fwd_bwd"] = first_backward(m, forward_backward, (q, k, v), device)
    return m


def first_forward(m: Measurement, forward, reference, device) -> str:
    """The first call (compiles flex and flash-attn-4, builds the mask form the backend needs) and its error
    against the reference: 'ok', or why it failed; any exception a kernel raises (RuntimeError, a Triton
    compile error, OOM) is the reason."""
    row = m.row
    try:
        start = time.perf_counter()
        out = forward()
        synchronize(device)
        row["first_call_s"] = time.perf_counter() - start
        error = out.detach().float() - reference
        row["max_err"] = error.abs().max().item()
        row["rel_err"] = (error.norm() / reference.norm()).item()
        del out, error
        if not math.isfinite(row["max_err"]):  # a NaN-producing kernel's time means nothing
            raise FloatingPointError(f"non-finite output (max error {row['max_err']})")
    except Exception as error:  # noqa: BLE001 - recorded, never swallowed
        return failure_reason(error)
    m.runs["fwd"] = (forward, ())
    return "ok"


def first_backward(m: Measurement, forward_backward, grads, device) -> str:
    """The first fwd+bwd (compiles the backward of flex and flash-attn-4) and its memory: 'ok' or why not."""
    try:
        forward_backward()  # before memory is measured: compiling takes memory of its own
        if device.type == "cuda":
            m.row["peak_mem_mib"], m.row["mem_pass"] = memory_mib(forward_backward, device, grads), "fwd_bwd"
        m.runs["fwd_bwd"] = (forward_backward, grads)
        status = "ok"
    except Exception as error:  # noqa: BLE001 - recorded, never swallowed
        status = failure_reason(error)
    for t in grads:
        t.grad = None
    return status


def capture_graphs(measurements: list[Measurement], device: torch.device):
    """Time graph replays instead of eager calls: a call made of many small launches is otherwise timed by
    the host that launches it. What is timed is then the GPU's work alone, as in a training step whose host
    runs ahead of the GPU; eager launch work is left out (flash-attn-4's Python launcher made its eager
    fwd+bwd take 0.7-1.3 ms at any T <= 2048 on the H100, varying between rounds:
    bench/results/h100-attention-eager.json).

    A graph holds its memory until the cell ends. Backends are captured smallest first while their graphs
    fit in GRAPH_MEMORY_SHARE of the card; the rest (those keeping (T, T) scores, whose long kernels leave
    launch work no weight) and any run that cannot be captured are timed eagerly, and their rows say why."""
    room = GRAPH_MEMORY_SHARE * torch.cuda.get_device_properties(device).total_memory / 2**20
    for m in sorted(measurements, key=lambda m: m.row.get("peak_mem_mib") or 0):
        eager, need = dict(m.runs), 2 * (m.row.get("peak_mem_mib") or 0)  # a fwd graph and a fwd+bwd graph
        if need > room:
            timing = f"eager (its graphs would hold ~{need:,.0f} MiB, {room:,.0f} MiB left for graphs)"
        else:
            try:
                for kind, (fn, grads) in eager.items():
                    m.runs[kind] = (cuda_graph(fn, grads, device).replay, ())  # the bound replay keeps the graph
                timing, room = "cuda graph", room - need
            except Exception as error:  # noqa: BLE001 - recorded, never swallowed
                m.runs = eager  # its graphs go, and their memory with them
                timing = f"eager (capture failed: {failure_reason(error)})"
                free_device_memory()
        for kind in eager:
            m.row[f"{kind}_timing"] = timing


def time_in_rounds(measurements: list[Measurement], args, device):
    """Time every backend of a cell in turn, `--rounds` times over. Each backend keeps the median of its
    round medians, so a drift of clocks or temperature during the cell hits all backends alike."""
    timing = dict(device=device, warmup_ms=args.warmup_ms, rep_ms=args.rep_ms)
    for _ in range(args.rounds):
        for m in measurements:
            for kind, (fn, grads) in list(m.runs.items()):
                try:
                    m.times[kind].append(median_ms(fn, grad_to_none=grads, **timing))
                except Exception as error:  # noqa: BLE001 - recorded, never swallowed
                    m.status[kind] = failure_reason(error)
                    m.times[kind] = []
                    del m.runs[kind]
                    free_device_memory()


def finish_measurement(m: Measurement, cell: Cell, heads: int) -> dict:
    row = m.row
    flops = dict(zip(("fwd", "fwd_bwd"), attention_flops(row["batch_size"], heads, cell.seq_len, cell.head_dim)))
    for kind, times in m.times.items():
        if times:
            row[f"{kind}_ms"] = statistics.median(times)
            row[f"{kind}_tflops"] = flops[kind] / row[f"{kind}_ms"] / 1e9
            row[f"{kind}_ms_rounds"] = [round(t, 4) for t in times]
    return finish_row(row, m.status["fwd"], m.status["fwd_bwd"])


def quick_skip_reason(backend: str, cell: Cell, args) -> str:
    """--quick on CPU: flex_attention compiles for 5-20 s per new shape there, so it runs in one cell only."""
    if args.quick and backend == "flex_attention" and (cell.head_dim, cell.seq_len, cell.docs) != args.flex_cell:
        d, t, _ = args.flex_cell
        return f"skipped in --quick: flex_attention compiles ~5-20 s per shape on CPU; measured at D={d}, T={t} only"
    return ""


def empty_row(backend: str, cell: Cell, batch: int) -> dict:
    return {
        "backend": backend,
        "resolved": None,
        "head_dim": cell.head_dim,
        "seq_len": cell.seq_len,
        "batch_size": batch,
        "docs": cell.docs,
        "dtype": str(cell.dtype).removeprefix("torch."),
        "fwd_ms": None,
        "fwd_bwd_ms": None,
        "fwd_tflops": None,
        "fwd_bwd_tflops": None,
        "peak_mem_mib": None,
        "mem_pass": None,
        "max_err": None,
        "rel_err": None,
        "first_call_s": None,
        "fwd_ms_rounds": None,
        "fwd_bwd_ms_rounds": None,
    }


def finish_row(row: dict, fwd_status: str, fwd_bwd_status: str) -> dict:
    row["fwd_status"], row["fwd_bwd_status"] = fwd_status, fwd_bwd_status
    if fwd_status != "ok":
        row["status"] = fwd_status
    elif fwd_bwd_status != "ok":
        row["status"] = f"fwd only; fwd_bwd: {fwd_bwd_status}"
    else:
        row["status"] = "ok"
    return row


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


def measure_cell(cell: Cell, args, device: torch.device) -> list[dict]:
    """Every backend's row in one cell: all prepared on the same inputs, then timed in turn (time_in_rounds)."""
    inputs = make_inputs(cell, args.heads, args.tokens, device)
    reference = reference_attention(*inputs[:3], inputs[4])
    measurements = []
    for backend in args.backends:
        measurements.append(prepare_backend(backend, cell, inputs, reference, args, device))
        if "OOM" in measurements[-1].status["fwd_bwd"]:
            free_device_memory()  # the failed call's tensors may sit in reference cycles until collected
    if args.timing == "graph" and device.type == "cuda":
        capture_graphs(measurements, device)
    time_in_rounds(measurements, args, device)
    rows = [finish_measurement(m, cell, args.heads) for m in measurements]
    del inputs, reference, measurements
    free_device_memory()
    return rows


def skipped_cell(cell: Cell, reason: str, args) -> list[dict]:
    batch = max(1, args.tokens // cell.seq_len)
    return [finish_row(empty_row(backend, cell, batch), reason, reason) for backend in args.backends]


def progress_line(row: dict) -> str:
    return (
        f"D={row['head_dim']:<3} T={row['seq_len']:<5} docs={int(row['docs'])} {row['backend']:<15} "
        f"fwd {number(row, 'fwd_ms', '{:.3f}'):>8} ms  fwd+bwd {number(row, 'fwd_bwd_ms', '{:.3f}'):>8} ms "
        f"{number(row, 'fwd_bwd_tflops', '{:.0f}'):>4} TF/s  mem {number(row, 'peak_mem_mib', '{:.0f}'):>6} MiB  "
        f"err {number(row, 'max_err', '{:.1e}')}  {row['status'] if row['status'] != 'ok' else ''}"
    )


COLUMNS = [
    Column("backend", "backend"),
    Column("resolved", "runs"),
    Column("head_dim", "D"),
    Column("seq_len", "T"),
    Column("batch_size", "B"),
    Column("docs", "docs"),
    Column("dtype", "dtype"),
    Column("fwd_ms", "fwd ms", "{:.3f}"),
    Column("fwd_bwd_ms", "fwd+bwd ms", "{:.3f}"),
    Column("fwd_tflops", "fwd TF/s", "{:.3g}"),
    Column("fwd_bwd_tflops", "fwd+bwd TF/s", "{:.3g}"),
    Column("peak_mem_mib", "mem MiB", "{:.0f}"),
    Column("max_err", "max err", "{:.1e}"),
    Column("status", "status"),
]


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


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    from torch._dynamo import config as dynamo_config  # here: importing this module stays cheap for tests

    # flex_attention is compiled with static shapes: one recompile per cell, more than dynamo's default 8.
    limit = "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"
    setattr(dynamo_config, limit, max(getattr(dynamo_config, limit), 256))
    grid = Grid(
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
    header, rows = run_grid(grid, cells_in_order(args), args, device, header)
    from bench.readme_table import backend_table

    print(backend_table({"header": header, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
