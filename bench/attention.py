"""`python -m bench.attention`: every attention backend of model.py on the same inputs (forward, forward+backward,
memory, error), and `fit`: auto's flash-attn-4 lengths from such a file. bench/README.md says how to run it."""

from __future__ import annotations

from errors import as_command

if __name__ == "__main__":  # before torch's seconds of importing: see as_command
    as_command()

import contextlib
import functools
import math
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

import kernels  # noqa: F401  (registers flash_attn_3/4, flex_attention and auto's table into model.BACKENDS)
from bench.grid import BenchParser, dispatch, failure_reason, free_device_memory, run_grid
from bench.readme_table import backend_table
from bench.report import panels_by, plot
from kernels.timing import Timed, median_ms, timed
from model import BACKENDS, AttentionMask, AttentionUse, resolve, sdpa_attention, why_not_sdpa_kernel

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
    shapes = [(docs, t, d) for docs in args.masks for t in args.seq_lens for d in args.head_dims]
    return [Cell(d, t, docs, dtype, seed=1000 + index) for index, (docs, t, d) in enumerate(shapes)]


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


def parse_args(argv=None):
    quick_help = "tiny CPU run: T 64/128, D 64, float32, manual/sdpa/flex/auto, with documents; nothing compiled"
    parser = BenchParser("attention", __doc__, quick_help, ("fit",), (None, "attention-quick"))  # None: see below
    device = "cuda" if torch.cuda.is_available() else "cpu"
    parser.grid_options((device, "cpu"), ("bfloat16", "float32"), ("bfloat16", "float16", "float32"), (240, 0))
    parser.option("--head-dims", [64, 128], [64], type=int, nargs="+", help="head dims D")
    parser.option("--seq-lens", list(DEFAULT_SEQ_LENS), [64, 128], type=int, nargs="+", help="T, in this order")
    parser.option("--tokens", 16384, 256, type=int, help="B*T per call (B >= 1)")
    parser.option("--heads", 16, 16, type=int, help="attention heads H, for every head dim")
    backends = list(ALL_BACKENDS), list(QUICK_BACKENDS)
    parser.option("--backends", *backends, nargs="+", choices=ALL_BACKENDS, help="in order")
    parser.option("--warmup-ms", 25, 5, type=float, help="do_bench warm-up per timing")
    parser.option("--rep-ms", 100, 20, type=float, help="do_bench repetition time per timing")
    parser.option("--rounds", 3, 1, type=int, help="timings per backend, interleaved over a cell's; median kept")
    parser.add_argument("--docs", action="store_true", help="also every cell with document masks (~4 a row)")
    parser.add_argument("--docs-only", action="store_true", help="only document-masked cells (name attention-docs)")
    parser.add_argument("--timing", default="graph", choices=("graph", "eager"), help="CUDA: graph replays or eager")
    args = parser.parse_args(argv)
    docs = args.docs or args.quick  # cheap on CPU, and it exercises the document path
    args.masks = (True,) if args.docs_only else (False, True) if docs else (False,)  # the values of `docs`, in order
    if args.name is None:
        dtype = "" if args.dtype == "bfloat16" else f"-{args.dtype}"
        args.name = "attention" + ("-docs" if args.docs_only else "") + dtype
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    return args


def grid(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    graphs = args.timing == "graph" and device.type == "cuda"
    notes = {
        "shapes": f"B = max(1, {args.tokens} // T), H = {args.heads} for every D; {args.dtype} inputs (B, H, T, D)",
        "timing": f"median over {args.rounds} interleaved rounds of triton.testing.do_bench's median; "
        + ("CUDA graph replays (fwd_timing/fwd_bwd_timing: where eager)" if graphs else "eager calls")
        + ("; --quick: nothing compiled, flex_attention runs eagerly" if args.quick else ""),
        "memory": "peak_mem_mib: max_memory_allocated in one fwd+bwd (mem_pass) minus what was allocated before",
        "error": "max_err = max |out - ref|, rel_err = ||out - ref|| / ||ref||; ref: float32 on upcast inputs, no TF32",
    }
    from torch._dynamo import config as dynamo_config  # here: importing this module stays cheap for tests

    # flex_attention is compiled with static shapes: one recompile per cell, more than dynamo's default 8.
    limit = "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"
    setattr(dynamo_config, limit, max(getattr(dynamo_config, limit), 256))
    cell_grid = dict(
        measure=lambda cell: measure_cell(cell, args, device),
        skipped=lambda cell, reason: skipped_cell(cell, reason, args),
        progress="head_dim seq_len docs backend fwd_ms fwd_bwd_ms fwd_bwd_tflops peak_mem_mib max_err status".split(),
        columns=COLUMNS,
        plot=plot_cells,
    )
    settings = {key: getattr(args, key) for key in ("backends", "head_dims", "seq_lens", "dtype", "heads")}
    settings.update(docs=list(args.masks), tokens_per_call=args.tokens)
    header = {"grid": settings, "flop_convention": FLOP_CONVENTION, "notes": notes}
    # --quick checks the script: flex runs eagerly there (compiling it on a CPU takes ~20 s; tests check the kernel)
    with torch.compiler.set_stance("force_eager") if args.quick else contextlib.nullcontext():
        header, rows = run_grid(cells_in_order(args), args, device, header, **cell_grid)
    print(backend_table({"header": header, "rows": rows}))
    return 0


# ----------------------------------------------------------------------------------------------
# One cell measured: inputs, float32 reference, first calls, CUDA graphs, timings

GRAPH_MEMORY_SHARE = 0.25  # of the card's memory, for the CUDA graphs of one cell (see capture_graphs)
REFERENCE_SCORES_BYTES = 2**30  # float32 scores per chunk of the reference: ~1 GiB, whatever T is


@dataclass(frozen=True)
class Cell:
    head_dim: int
    seq_len: int
    docs: bool
    dtype: torch.dtype
    seed: int = 0  # of the cell's random inputs


def document_ids(batch: int, seq_len: int, generator: torch.Generator, n_docs: int = 4) -> torch.Tensor:
    """(batch, T) ids: each row cut at n_docs-1 random distinct points into documents of random lengths."""
    cuts = torch.stack([torch.randperm(seq_len - 1, generator=generator)[: n_docs - 1] + 1 for _ in range(batch)])
    return torch.zeros(batch, seq_len, dtype=torch.int32).scatter_(1, cuts, 1).cumsum(1)


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
    saved = torch.get_float32_matmul_precision()  # the reference's matmuls; it runs no cuDNN kernel
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(saved)


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


def plan_backend(backend: str, cell: Cell, device: torch.device) -> tuple:
    """(the function, what actually runs: the backend itself or what auto picked, why not forward, why not backward)"""

    def need(training: bool) -> AttentionUse:
        return AttentionUse(device, cell.dtype, cell.head_dim, cell.docs, training=training, seq_len=cell.seq_len)

    if backend == "auto":  # resolved for training, as the model resolves it
        used = resolve("auto", need(True)).used
        return BACKENDS[used].kernel, used, "", ""
    if backend.startswith("sdpa:"):
        kernel = backend.split(":", 1)[1]
        # pinned: never let PyTorch pick another
        problem = BACKENDS["sdpa"].why_not(need(False)) or why_not_sdpa_kernel(kernel, need(False))
        return functools.partial(sdpa_attention, kernel=kernel), backend, problem, problem
    record = BACKENDS[backend]
    return record.kernel, backend, record.why_not(need(False)), record.why_not(need(True))


def memory_mib(run, device: torch.device, grads) -> float:
    """Peak memory of one run() on CUDA beyond what was allocated before it (inputs, mask, reference): the
    attention's own memory, gradients of q, k, v included (cleared before and after)."""
    for t in grads:
        t.grad = None
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    timed(run, device)
    for t in grads:
        t.grad = None
    return (torch.cuda.max_memory_allocated(device) - base) / 2**20


@dataclass
class Measurement:
    """One backend in one cell: its row, the runs still to be timed ('fwd', 'fwd_bwd' -> fn, grads), each run's
    status ('ok' or why it has no time) and its times, a round each."""

    row: dict
    runs: dict = field(default_factory=dict)
    status: dict = field(default_factory=dict)
    times: dict = field(default_factory=lambda: {"fwd": [], "fwd_bwd": []})


def prepare_backend(backend: str, cell: Cell, inputs, reference, args, device) -> Measurement:
    """Everything but the timing: the first calls (they compile flex and flash-attn-4 and build the mask form the
    backend needs), the forward's error, memory (of fwd+bwd; of the forward where only it runs). Any exception a
    kernel raises (RuntimeError, a Triton compile error, OOM) is the status of its run."""
    q, k, v, grad_out, mask = inputs
    fn, resolved, forward_problem, backward_problem = plan_backend(backend, cell, device)
    m = Measurement({**empty_row(backend, cell, q.size(0)), "resolved": resolved})
    m.status["fwd"] = m.status["fwd_bwd"] = forward_problem
    if m.status["fwd"]:
        return m
    if backward_problem:  # forward-only (flex on CPU): autograd inputs would make it refuse to run
        q, k, v = (t.detach() for t in (q, k, v))

    def forward():
        return fn(q, k, v, mask, 0.0)

    def forward_backward():
        fn(q, k, v, mask, 0.0).backward(grad_out)

    passes = {"fwd": (forward, ())}  # and fwd+bwd, where the backward runs
    if not backward_problem:
        passes["fwd_bwd"] = (forward_backward, (q, k, v))
    first_calls(m, passes, reference, device)
    if m.status["fwd"] != "ok" or backward_problem:
        m.status["fwd_bwd"] = backward_problem or m.status["fwd"]
    return m


def first_calls(m: Measurement, passes: dict, reference: torch.Tensor, device: torch.device) -> None:
    """Each pass's first call, the forward's error, and the memory of the last pass; a pass that fails stops."""
    for kind, (run, grads) in passes.items():
        try:
            first = timed(run, device)  # before memory is measured: compiling takes memory of its own
            if kind == "fwd":
                check_forward(m.row, first, reference)
            del first
            if device.type == "cuda" and kind == list(passes)[-1]:  # the memory of the largest pass that runs
                m.row["peak_mem_mib"], m.row["mem_pass"] = memory_mib(run, device, grads), kind
            m.runs[kind], m.status[kind] = (run, grads), "ok"
        except Exception as error:  # noqa: BLE001 - recorded, never swallowed
            m.status[kind] = failure_reason(error)
            break
        finally:
            for t in grads:
                t.grad = None


def check_forward(row: dict, first: Timed, reference: torch.Tensor) -> None:
    """The first call's seconds and its output's error against the reference, which must be finite."""
    error = first.result.detach().float() - reference
    row["first_call_s"], row["max_err"] = first.wall_ms / 1e3, error.abs().max().item()
    row["rel_err"] = (error.norm() / reference.norm()).item()
    if not math.isfinite(row["max_err"]):  # a NaN-producing kernel's time means nothing
        raise FloatingPointError(f"non-finite output (max error {row['max_err']})")


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


def capture_graphs(measurements: list[Measurement], device: torch.device):
    """Time graph replays instead of eager calls, so the host's launch work is left out, as in a training step
    whose host runs ahead (bench/results/h100-attention-eager.json has the eager times). Graphs are captured smallest
    backend first while they fit in GRAPH_MEMORY_SHARE of the card; the rest are timed eagerly, saying why."""
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
        m.row.update({f"{kind}_timing": timing for kind in eager})


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
    """The row: each run's median over its rounds and TFLOP/s, each run's status, and the row's status."""
    row = m.row
    forward = 4 * row["batch_size"] * heads * cell.seq_len**2 * cell.head_dim / 2  # FLOP_CONVENTION
    flops = {"fwd": forward, "fwd_bwd": 3.5 * forward}
    for kind, times in m.times.items():
        if times:
            row[f"{kind}_ms"] = statistics.median(times)
            row[f"{kind}_tflops"] = flops[kind] / row[f"{kind}_ms"] / 1e9
            row[f"{kind}_ms_rounds"] = [round(t, 4) for t in times]
    row["fwd_status"], row["fwd_bwd_status"] = fwd, fwd_bwd = m.status["fwd"], m.status["fwd_bwd"]
    row["status"] = fwd if fwd != "ok" else "ok" if fwd_bwd == "ok" else f"fwd only; fwd_bwd: {fwd_bwd}"
    return row


# the figures of a row, None until measured
FIGURES = ("fwd_ms", "fwd_bwd_ms", "fwd_tflops", "fwd_bwd_tflops", "peak_mem_mib", "mem_pass", "max_err", "rel_err")
TIMES = ("first_call_s", "fwd_ms_rounds", "fwd_bwd_ms_rounds")


def empty_row(backend: str, cell: Cell, batch: int) -> dict:
    dtype = str(cell.dtype).removeprefix("torch.")
    shape = dict(head_dim=cell.head_dim, seq_len=cell.seq_len, batch_size=batch, docs=cell.docs, dtype=dtype)
    return {"backend": backend, "resolved": None, **shape, **dict.fromkeys(FIGURES + TIMES)}


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
    rows = [empty_row(backend, cell, max(1, args.tokens // cell.seq_len)) for backend in args.backends]
    return [finish_measurement(Measurement(row, status={"fwd": reason, "fwd_bwd": reason}), cell, 0) for row in rows]


def main(argv=None) -> int:
    from bench import attention_fit

    return dispatch(argv, grid, fit=attention_fit.main)


if __name__ == "__main__":
    sys.exit(main())
