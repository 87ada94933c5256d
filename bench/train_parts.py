"""`python -m bench.train_step phases` and `context`: parts of a training step measured alone (bench/README.md)."""

from __future__ import annotations

import argparse
import functools
import os
import statistics
from pathlib import Path

import torch
import torch.distributed as dist

from bench.grid import mode_parser
from bench.report import DEFAULT_OUT, GPT2_VOCAB, markdown_table, model_shape, plot_bars, save_results
from bench.train_step import build_state, random_batches
from kernels.timing import median_ms, timed
from training.context import CHUNK_KERNELS, REFERENCE, attend_chunk, resolve_chunk_kernel

# ----------------------------------------------------------------------------------------------
# phases

PHASE_COLUMNS = "parallelism ranks phase host_ms wall_ms slowest_ms rank_wall_ms".split()
PHASES = (
    "forward+backward (with its gradient reduction)",
    "forward+backward without reduction (no_sync)",
    "train.clip_and_step: clip, optimizer step",
    "zero_grad",
    "train.train_step: the whole step as train.py runs it",
)


def phase_model(quick: bool) -> dict:
    """GPT-2 124M at T=1024 (with vocab_size 50304), or the tiny --quick model at T=64."""
    return {**model_shape(quick), "block_size": 64 if quick else 1024}


def phase_works(parallelism: str, runtime, quick: bool) -> tuple:
    """What each of PHASES runs, in order, on one batch throughout (the timings do not depend on its tokens)."""
    import train
    from training.parallel import gradient_sync

    settings = dict(vocab_size=256 if quick else GPT2_VOCAB, batch_size=16, dropout=0.0, compile=not quick)
    cfg = train.TrainConfig(**phase_model(quick), **settings, parallelism=parallelism)
    cfg.gradient_accumulation_steps = runtime.world_size
    state = build_state(cfg, runtime)
    batch = random_batches(cfg, runtime.device, count=1)[0]

    def forward_backward(reduce: bool):
        with gradient_sync(state.model, state.train_model, enabled=reduce):
            with runtime.autocast():
                _, loss = state.train_model(*batch)
            state.scaler.scale(loss).backward()

    return (
        lambda: forward_backward(reduce=True),
        lambda: forward_backward(reduce=False),
        lambda: train.clip_and_step(state.optimizer, state.scaler, state.model, 1.0, runtime.dtype),
        lambda: state.optimizer.zero_grad(set_to_none=True),
        lambda: train.train_step(state),
    )


def time_phases(parallelism: str, runtime, steps: int, quick: bool) -> list[dict]:
    """Each phase between a barrier and a sync, on every rank; medians past the first quarter of the steps."""
    works, times = phase_works(parallelism, runtime, quick), {name: [] for name in PHASES}
    for _ in range(steps):
        for name, work in zip(PHASES, works):
            if runtime.ddp:  # one rank: the reference without DDP
                dist.barrier()
            times[name].append(timed(work, runtime.device)[1:])  # (host ms, wall ms)
    kept = {name: pairs[steps // 4 :] for name, pairs in times.items()}
    walls = {name: [wall for _, wall in pairs] for name, pairs in kept.items()}
    every_rank = [walls]
    if runtime.ddp:  # every rank timed every phase: the slowest rank is the one the others wait for
        every_rank = [None] * runtime.world_size
        dist.all_gather_object(every_rank, walls)
    return [
        {
            "parallelism": parallelism,
            "ranks": runtime.world_size,
            "phase": name,
            "host_ms": statistics.median(host for host, _ in pairs),
            "wall_ms": statistics.median(walls[name]),
            "slowest_ms": statistics.median(max(step) for step in zip(*(rank[name] for rank in every_rank))),
            "rank_wall_ms": " / ".join(f"{statistics.median(rank[name]):.2f}" for rank in every_rank),
        }
        for name, pairs in kept.items()
    ]


def plot_phases(rows: list[dict], path: Path) -> None:
    title = "one optimizer step, phase by phase: rank 0's wall ms (median)"
    plot_bars(rows, path, label=lambda r: f"{r['parallelism']}: {r['phase']}", value="wall_ms", title=title)


def phases(argv=None) -> int:
    parser = mode_parser("train_step", "phases", "one optimizer step phase by phase, DDP and FSDP (under torchrun)")
    parser.add_argument("parallelism", nargs="+", choices=("ddp", "fsdp"))
    parser.add_argument("--steps", type=int, default=20, help="steps per parallelism; the first quarter is left out")
    parser.add_argument("--quick", action="store_true", help="CPU, gloo, a tiny model: checks the script")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results folder (default bench/results)")
    parser.add_argument("--name", default=None, help="results name (default step-phases; --quick step-phases-quick)")
    args = parser.parse_args(argv)
    from training.runtime import setup_runtime

    ranks = int(os.environ.get("WORLD_SIZE", "1"))  # one micro-step per rank
    device, dtype, backend = ("cpu", "float32", "gloo") if args.quick else ("auto", "auto", "nccl")
    runtime = setup_runtime(device, dtype, backend, ranks)
    rows = [row for p in args.parallelism for row in time_phases(p, runtime, args.steps, args.quick)]
    if runtime.master:
        print(markdown_table(rows, PHASE_COLUMNS))
        model = ", ".join(f"{key} {value}" for key, value in phase_model(args.quick).items())
        notes = {"model": f"{model}, micro-batch 16, one micro-step per rank", "environment": "NCCL_NVLS_ENABLE=0"}
        name = args.name or ("step-phases-quick" if args.quick else "step-phases")
        save_results(args.out, name, runtime.device, rows, PHASE_COLUMNS, plot_phases, notes=notes)
    if runtime.ddp:
        dist.destroy_process_group()
    return 0


# ----------------------------------------------------------------------------------------------
# context

CONTEXT_COLUMNS = "kernel used max_rel_err status ms tflops".split()
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 1e-2, torch.float32: 1e-5, torch.float64: 1e-10}


def rank_inputs(args, dtype: torch.dtype, device: torch.device):
    """This rank's queries (B, H, 2L, D) as the model makes them (a transposed view), the gathered keys and values
    (B, H, T, D), an output gradient, and the rank's two chunk indices."""
    torch.manual_seed(0)
    B, H, D, T = 1, args.heads, args.head_dim, args.T
    length = T // (2 * args.ranks)
    qkv = torch.randn(B, 2 * length, 3 * H * D, device=device, dtype=dtype)
    q = qkv[..., : H * D].view(B, 2 * length, H, D).transpose(1, 2).detach().requires_grad_()
    k, v = (torch.randn(B, H, T, D, device=device, dtype=dtype, requires_grad=True) for _ in "kv")
    grad = torch.randn(B, H, 2 * length, D, device=device, dtype=dtype)
    return q, k, v, grad, (args.rank, 2 * args.ranks - 1 - args.rank)


def chunk_step(kernel: str, q, k, v, grad, chunks) -> tuple[torch.Tensor, ...]:
    """Both chunks' attention (as ContextShard.attend runs it), then the gradients of q, k and v."""
    length = q.size(2) // 2
    queries = [q[:, :, i * length : (i + 1) * length] for i in range(len(chunks))]
    seen = [(query, k[:, :, : (c + 1) * length], v[:, :, : (c + 1) * length]) for query, c in zip(queries, chunks)]
    out = torch.cat([attend_chunk(*chunk, kernel) for chunk in seen], dim=2)
    return (out, *torch.autograd.grad(out, (q, k, v), grad.to(out.dtype)))


def measure_chunks(args, device: torch.device, dtype: torch.dtype) -> list[dict]:
    q, k, v, grad, chunks = rank_inputs(args, dtype, device)
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    reference = chunk_step(REFERENCE, *(x.detach().to(wide).requires_grad_() for x in (q, k, v)), grad, chunks)
    length = q.size(2) // 2
    pairs = sum(length * c * length + length * (length + 1) // 2 for c in chunks)
    flops = 3.5 * 4 * q.size(0) * q.size(1) * q.size(3) * pairs
    rows = []
    for kernel in args.kernels:
        used = resolve_chunk_kernel(kernel, device.type, dtype, q.size(-1), 0.0)
        run = functools.partial(chunk_step, kernel, q, k, v, grad, chunks)
        results, _, first_ms = timed(run, device)
        error = max(((got.to(wide) - want).norm() / want.norm()).item() for got, want in zip(results, reference))
        ms = median_ms(run, device, warmup_ms=2 * first_ms, rep_ms=args.repeats * first_ms)  # ~--repeats runs
        status = "ok" if error < TOLERANCE[dtype] else f"wrong: above {TOLERANCE[dtype]:.0e}"
        rows.append(dict(kernel=kernel, used=used, max_rel_err=error, status=status, ms=ms, tflops=flops / ms / 1e9))
        print(f"{kernel:16} runs as {used:16} rel. error {error:.1e} {status:8} {ms:9.2f} ms {rows[-1]['tflops']:7.1f}")
    return rows


def plot_chunks(rows: list[dict], path) -> None:
    title = "context-parallel chunk attention, one rank: TFLOP/s, forward + backward"
    plot_bars(rows, path, label=lambda r: f"{r['kernel']} ({r['used']})", value="tflops", title=title)


def context_args(argv=None) -> argparse.Namespace:
    parser = mode_parser(
        "train_step", "context", "context parallelism's chunk kernels on one device, against the reference"
    )
    parser.add_argument("--T", type=int, default=32768, help="the whole sequence's length (32768)")
    parser.add_argument("--ranks", type=int, default=2, help="ranks the sequence is split over (2)")
    parser.add_argument("--rank", type=int, default=0, help="the rank measured (0: the first and last chunks)")
    parser.add_argument("--kernels", nargs="+", default=list(CHUNK_KERNELS), choices=CHUNK_KERNELS)
    parser.add_argument("--repeats", type=int, default=10, help="about this many timed runs (10)")
    parser.add_argument("--quick", action="store_true", help="CPU, float64, T=256, 2 heads of 16")
    parser.add_argument("--out", default=DEFAULT_OUT, help="results folder (default bench/results)")
    parser.add_argument("--name", default="context")
    args = parser.parse_args(argv)
    args.heads, args.head_dim = (2, 16) if args.quick else (12, 64)
    if args.quick:
        args.T, args.repeats = 256, 2
    if not 0 <= args.rank < args.ranks or args.T % (2 * args.ranks):
        parser.error(f"--rank must be below --ranks ({args.ranks}) and --T a multiple of 2 x ranks; got {args.T}")
    return args


def context(argv=None) -> int:
    args = context_args(argv)
    device = torch.device("cpu" if args.quick or not torch.cuda.is_available() else "cuda")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float64
    rows = measure_chunks(args, device, dtype)
    sizes = dict(T=args.T, ranks=args.ranks, rank=args.rank, heads=args.heads, head_dim=args.head_dim)
    save_results(args.out, args.name, device, rows, CONTEXT_COLUMNS, plot_chunks, dtype=str(dtype), **sizes)
    return 0 if all(row["status"] == "ok" for row in rows) else 1
