"""Context parallelism's attention kernels on one device: one rank's two chunks of a sequence split over N ranks
(training/context.py), each chunk against the keys up to its end, forward and backward, per chunk kernel.

    python -m bench.bench_context                    # CUDA, bf16, T=32768 split over 2 ranks, rank 0, 12 heads of 64
    python -m bench.bench_context --T 131072 --ranks 4 --rank 1
    python -m bench.bench_context --quick            # CPU, float64, T=256: checks the script

No process group: the keys are made as if gathered. Every kernel's output and q, k, v gradients are compared with
the reference kernel (SDPA with a lower-right causal mask) run in float32 (float64 with --quick), and timed:
median of about --repeats runs after warm-up runs (kernels.timing.median_ms: CUDA events on a GPU). TFLOP/s
count the (query, key) pairs the rank computes, 4·D flops each forward and 2.5 times that backward. Results:
bench/results/<card>-context.{json,md,png}.
"""

from __future__ import annotations

from errors import as_command

if __name__ == "__main__":  # before torch's seconds of importing: see as_command
    as_command()

import argparse
import functools

import torch

from bench.report import DEFAULT_OUT, Column, pyplot, save_results
from data.common import OneLineParser
from kernels.timing import median_ms, timed
from training.context import CHUNK_KERNELS, REFERENCE, attend_chunk, resolve_chunk_kernel

COLUMNS = [
    Column("kernel", "kernel"),
    Column("used", "runs as"),
    Column("max_rel_err", "largest rel. error vs reference", "{:.1e}"),
    Column("status", "status"),
    Column("ms", "ms fwd+bwd", "{:.2f}"),
    Column("tflops", "TFLOP/s", "{:.1f}"),
]
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


def step(kernel: str, q, k, v, grad, chunks) -> tuple[torch.Tensor, ...]:
    """Both chunks' attention (as ContextShard.attend runs it), then the gradients of q, k and v."""
    length = q.size(2) // 2
    seen = [(q[:, :, i * length : (i + 1) * length], k[:, :, : (c + 1) * length], v[:, :, : (c + 1) * length])
            for i, c in enumerate(chunks)]  # fmt: skip
    out = torch.cat([attend_chunk(*chunk, kernel) for chunk in seen], dim=2)
    return (out, *torch.autograd.grad(out, (q, k, v), grad.to(out.dtype)))


def measure(args, device: torch.device, dtype: torch.dtype) -> list[dict]:
    q, k, v, grad, chunks = rank_inputs(args, dtype, device)
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    reference = step(REFERENCE, *(x.detach().to(wide).requires_grad_() for x in (q, k, v)), grad, chunks)
    length = q.size(2) // 2
    pairs = sum(length * c * length + length * (length + 1) // 2 for c in chunks)
    flops = 3.5 * 4 * q.size(0) * q.size(1) * q.size(3) * pairs
    rows = []
    for kernel in args.kernels:
        used = resolve_chunk_kernel(kernel, device.type, dtype, q.size(-1), 0.0)
        run = functools.partial(step, kernel, q, k, v, grad, chunks)
        results, _, first_ms = timed(run, device)
        error = max(((got.to(wide) - want).norm() / want.norm()).item() for got, want in zip(results, reference))
        ms = median_ms(run, device, warmup_ms=2 * first_ms, rep_ms=args.repeats * first_ms)  # ~--repeats runs
        status = "ok" if error < TOLERANCE[dtype] else f"wrong: above {TOLERANCE[dtype]:.0e}"
        rows.append(dict(kernel=kernel, used=used, max_rel_err=error, status=status, ms=ms, tflops=flops / ms / 1e9))
        print(f"{kernel:16} runs as {used:16} rel. error {error:.1e} {status:8} {ms:9.2f} ms {rows[-1]['tflops']:7.1f}")
    return rows


def plot(rows: list[dict], path) -> None:
    plt = pyplot()
    figure, axes = plt.subplots(figsize=(6, 3.5))
    axes.bar([f"{r['kernel']}\n({r['used']})" for r in rows], [r["tflops"] for r in rows])
    axes.set_ylabel("TFLOP/s, forward + backward")
    axes.set_title("context-parallel chunk attention, one rank")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def parse(argv=None) -> argparse.Namespace:
    parser = OneLineParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--T", type=int, default=32768, help="the whole sequence's length (32768)")
    parser.add_argument("--ranks", type=int, default=2, help="ranks the sequence is split over (2)")
    parser.add_argument("--rank", type=int, default=0, help="the rank measured (0: the first and last chunks)")
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--kernels", nargs="+", default=list(CHUNK_KERNELS), choices=CHUNK_KERNELS)
    parser.add_argument("--repeats", type=int, default=10, help="about this many timed runs (10)")
    parser.add_argument("--quick", action="store_true", help="CPU, float64, T=256, 2 heads of 16")
    parser.add_argument("--out", default=DEFAULT_OUT, help="results folder (default bench/results)")
    parser.add_argument("--name", default="context")
    args = parser.parse_args(argv)
    if args.quick:
        args.T, args.heads, args.head_dim, args.repeats = 256, 2, 16, 2
    if not 0 <= args.rank < args.ranks or args.T % (2 * args.ranks):
        parser.error(f"--rank must be below --ranks ({args.ranks}) and --T a multiple of 2 x ranks; got {args.T}")
    return args


def main(argv=None) -> int:
    args = parse(argv)
    device = torch.device("cpu" if args.quick or not torch.cuda.is_available() else "cuda")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float64
    rows = measure(args, device, dtype)
    sizes = dict(T=args.T, ranks=args.ranks, rank=args.rank, heads=args.heads, head_dim=args.head_dim)
    save_results(args.out, args.name, device, rows, COLUMNS, plot, dtype=str(dtype), **sizes)
    return 0 if all(row["status"] == "ok" for row in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
