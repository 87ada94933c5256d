"""train.py's state on synthetic tokens, which every `python -m bench.train_step` mode runs on; the modes phases,
context (parts of a training step measured alone), compare and curves (train.py itself, its log lines read).
bench/README.md says how to run each."""

from __future__ import annotations

import argparse
import functools
import itertools
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from bench import launch
from bench.grid import BenchParser
from bench.report import GPT2_124M, GPT2_VOCAB, TINY, markdown_table, plot, plot_bars, save_results
from kernels.timing import median_ms, timed
from train import TrainConfig, build_model, build_train_state, clip_and_step, train_step
from training.context import CHUNK_KERNELS, REFERENCE, attend_chunk, resolve_chunk_kernel
from training.parallel import gradient_sync
from training.progress import TrainState
from training.runtime import setup_runtime

# ----------------------------------------------------------------------------------------------
# The state a step runs on: train.py's own, on synthetic tokens


def build_state(cfg: TrainConfig, runtime=None) -> TrainState:
    """train.py's state for cfg, on `runtime` (one per process: the phases under torchrun share theirs) or a new one."""
    runtime = runtime or setup_runtime(cfg.device, cfg.dtype, cfg.dist_backend, cfg.gradient_accumulation_steps)
    torch.manual_seed(cfg.seed)
    batches = itertools.cycle(random_batches(cfg, runtime.device))
    return build_train_state(cfg, runtime, build_model(cfg, cfg.vocab_size, None), lambda: next(batches))


def random_batches(cfg: TrainConfig, device: torch.device, count: int = 4):
    """Synthetic tokens: uniform random ids, a few batches used in turn (no data loading in the timing); with
    packed_documents, each row holds 4 documents (doc_ids, as data/loader.py gives them)."""
    generator = torch.Generator().manual_seed(cfg.seed)
    shape = (cfg.batch_size, cfg.block_size)
    batches = [
        tuple(torch.randint(cfg.vocab_size, shape, generator=generator).to(device) for _ in range(2))
        for _ in range(count)
    ]
    if cfg.packed_documents:
        doc_ids = (torch.arange(cfg.block_size) // max(1, cfg.block_size // 4)).to(device, torch.int32).expand(shape)
        batches = [(x, y, doc_ids) for x, y in batches]
    return batches


# ----------------------------------------------------------------------------------------------
# phases

PHASE_COLUMNS = "parallelism ranks phase host_ms wall_ms slowest_ms rank_wall_ms".split()
PLOT_PHASES = plot_bars("{parallelism}: {phase}", "wall_ms", "one optimizer step by phase: rank 0's wall ms (median)")
PHASES = (
    "forward+backward (with its gradient reduction)",
    "forward+backward without reduction (no_sync)",
    "train.clip_and_step: clip, optimizer step",
    "zero_grad",
    "train.train_step: the whole step as train.py runs it",
)


def phase_model(quick: bool) -> dict:
    """GPT-2 124M at T=1024 (with vocab_size 50304), or the tiny --quick model at T=64."""
    return {**(TINY if quick else GPT2_124M), "block_size": 64 if quick else 1024}


def phase_works(parallelism: str, runtime, quick: bool) -> tuple:
    """What each of PHASES runs, in order, on one batch throughout (the timings do not depend on its tokens)."""
    settings = dict(vocab_size=256 if quick else GPT2_VOCAB, batch_size=16, dropout=0.0, compile=not quick)
    cfg = TrainConfig(**phase_model(quick), **settings, parallelism=parallelism)
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
        lambda: clip_and_step(state.optimizer, state.scaler, state.model, 1.0, runtime.dtype),
        lambda: state.optimizer.zero_grad(set_to_none=True),
        lambda: train_step(state),
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


def phases(argv=None) -> int:
    doc = "one optimizer step phase by phase, DDP and FSDP (under torchrun)"
    quick_help = "CPU, gloo, a tiny model: checks the script"
    parser = BenchParser("train_step phases", doc, quick_help, name=("step-phases", "step-phases-quick"))
    parser.add_argument("parallelism", nargs="+", choices=("ddp", "fsdp"))
    parser.add_argument("--steps", type=int, default=20, help="steps per parallelism; the first quarter is left out")
    args = parser.parse_args(argv)
    ranks = int(os.environ.get("WORLD_SIZE", "1"))  # one micro-step per rank
    device, dtype, backend = ("cpu", "float32", "gloo") if args.quick else ("auto", "auto", "nccl")
    runtime = setup_runtime(device, dtype, backend, ranks)
    rows = [row for p in args.parallelism for row in time_phases(p, runtime, args.steps, args.quick)]
    if runtime.master:
        print(markdown_table(rows, PHASE_COLUMNS))
        model = ", ".join(f"{key} {value}" for key, value in phase_model(args.quick).items())
        notes = {"model": f"{model}, micro-batch 16, one micro-step per rank", "environment": "NCCL_NVLS_ENABLE=0"}
        save_results(args.out, args.name, runtime.device, rows, PHASE_COLUMNS, PLOT_PHASES, notes=notes)
    if runtime.ddp:
        dist.destroy_process_group()
    return 0


# ----------------------------------------------------------------------------------------------
# context

CONTEXT_COLUMNS = "kernel used max_rel_err status ms tflops".split()
PLOT_CHUNKS = plot_bars("{kernel} ({used})", "tflops", "context-parallel chunk attention, one rank: fwd+bwd TFLOP/s")
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


def context_args(argv=None) -> argparse.Namespace:
    doc = "context parallelism's chunk kernels on one device, against the reference"
    parser = BenchParser("train_step context", doc, "CPU, float64, T=256, 2 heads of 16", name=("context", "context"))
    parser.option("--T", 32768, 256, type=int, help="the whole sequence's length")
    parser.add_argument("--ranks", type=int, default=2, help="ranks the sequence is split over (2)")
    parser.add_argument("--rank", type=int, default=0, help="the rank measured (0: the first and last chunks)")
    parser.add_argument("--kernels", nargs="+", default=list(CHUNK_KERNELS), choices=CHUNK_KERNELS)
    parser.option("--repeats", 10, 2, type=int, help="about this many timed runs")
    args = parser.parse_args(argv)
    args.heads, args.head_dim = (2, 16) if args.quick else (12, 64)
    if not 0 <= args.rank < args.ranks or args.T % (2 * args.ranks):
        parser.error(f"--rank must be below --ranks ({args.ranks}) and --T a multiple of 2 x ranks; got {args.T}")
    return args


def context(argv=None) -> int:
    args = context_args(argv)
    device = torch.device("cpu" if args.quick or not torch.cuda.is_available() else "cuda")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float64
    rows = measure_chunks(args, device, dtype)
    sizes = dict(T=args.T, ranks=args.ranks, rank=args.rank, heads=args.heads, head_dim=args.head_dim)
    save_results(args.out, args.name, device, rows, CONTEXT_COLUMNS, PLOT_CHUNKS, dtype=str(dtype), **sizes)
    return 0 if all(row["status"] == "ok" for row in rows) else 1


# ----------------------------------------------------------------------------------------------
# compare (the last log line per backend) and curves: train.py run as a user runs it

BACKENDS = ("auto", "sdpa", "flash_attn_2", "flex_attention", "manual")
COMPARE_SETTINGS = ["--max_iters=100", "--log_interval=25", "--eval_interval=1000000"]  # the caller's win
COMPARE_COLUMNS = "backend runs iter loss ms_per_iter tokens_per_sec mfu mem_gib status".split()


def train_log(settings: Sequence[str]) -> launch.Run:
    """train.py run to its end with these settings after the evaluation and logging the runs have in common."""
    quiet = ["--eval_iters=1", "--eval_on_start=false", "--overwrite_out_dir=true"]
    return launch.run(launch.train_command([*quiet, *settings]))


def compare_row(backend: str, log_text: str, exit_code: int) -> dict:
    """One row: the last log line of `train.py --attention_backend=backend`."""
    parsed = launch.log_lines(log_text)
    # The first such line is the training resolution (train.py logs it before the loop; evaluation runs
    # without gradients and may resolve to another backend later).
    runs = re.findall(r"attention backend: ([\w:]+)", log_text)
    row = {"backend": backend, "runs": runs[0] if runs else None, **(parsed[-1] if parsed else {})}
    row["status"] = "ok" if exit_code == 0 and parsed else f"exit {exit_code}: {launch.failure_line(log_text)}"
    return row


def compare(argv=None) -> int:
    parser = BenchParser("train_step compare", "train.py once per attention backend: its last log line each")
    parser.add_argument("--backends", nargs="+", default=list(BACKENDS), help=f"default {' '.join(BACKENDS)}")
    parser.add_argument("train_args", nargs="*", help="train.py's config file and --key=value settings (after --)")
    args = parser.parse_args(argv)
    logs, rows = Path(tempfile.mkdtemp(prefix="compare_backends.")), []
    for backend in args.backends:  # <logs>/<backend>.log: stdout and stderr
        print(f"== {backend}", file=sys.stderr, flush=True)
        out_dir = logs / f"out-{backend}"
        run = train_log([*COMPARE_SETTINGS, f"--out_dir={out_dir}", *args.train_args, f"--attention_backend={backend}"])
        (logs / f"{backend}.log").write_text(run.output)
        shutil.rmtree(out_dir, ignore_errors=True)  # the checkpoint of a 100-step run is not worth keeping
        rows.append(compare_row(backend, run.output, run.code))
        print((run.output.splitlines() or [""])[-1], file=sys.stderr, flush=True)
    notes = {"source": "last log line of `python train.py ... --attention_backend=X` per backend"}
    print(markdown_table(rows, COMPARE_COLUMNS))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    save_results(args.out, "compare_backends", device, rows, COMPARE_COLUMNS, logs=str(logs), notes=notes)
    print(f"logs in {logs}", file=sys.stderr)
    return 0


# ----------------------------------------------------------------------------------------------
# curves: the loss curves of plain and default

PLAIN = ["--attention_backend=sdpa", "--cross_entropy=plain"]
RUN_SETS = {  # --runs: {run: (seed, switches)}; each run's gap is to the first run's losses
    "switches": {"plain": (1337, PLAIN), "default": (1337, []), "plain, seed 2": (2, PLAIN)},
    "fp8": {"bf16": (1337, ["--fp8=off"]), "fp8 tensorwise": (1337, ["--fp8=tensorwise"])},
}
GPT2_SHAKESPEARE = [
    "--dataset=shakespeare",
    *launch.flags({**GPT2_124M, "block_size": 1024, "batch_size": 16}),
    *launch.flags({"learning_rate": 6e-4, "min_lr": 6e-5, "warmup_iters": 30, "beta2": 0.95}),
]
TINY_CHAR = ["--dataset=shakespeare_char", *launch.flags(TINY), "--block_size=32", "--batch_size=8", "--warmup_iters=3"]
CURVE_COLUMNS = "run seed switches first_loss tail_loss gap_vs_first log_tokens_per_sec log_mfu".split()


def curve_row(run: str, seed: int, switches: list[str], log: list[dict], tail: int) -> dict:
    losses = [line["loss"] for line in log]
    steady = log[min(10, len(log) - 1) :]  # the log's own figures, past the first iterations
    mfus = [line["mfu"] for line in steady if line["mfu"] is not None]
    return {
        "run": run,
        "seed": seed,
        "switches": " ".join(switches) or "(defaults)",
        "first_loss": losses[0],
        "tail_loss": statistics.fmean(losses[-tail:]),
        "log_tokens_per_sec": statistics.median(line["tokens_per_sec"] for line in steady),
        "log_mfu": statistics.median(mfus) if mfus else None,
        "losses": losses,
    }


def plot_curves(rows: list[dict], path: Path) -> None:
    points = [
        {"run": r["run"], "iteration": i, "loss": statistics.fmean(r["losses"][max(0, i - 19) : i + 1])}
        for r in rows
        for i in range(len(r["losses"]))
    ]
    panels = [("train loss (mean of the last 20)", "loss", points)]
    plot(points, path, x="iteration", panels=panels, series=lambda r: r["run"], title="same model, same data")


def curves(argv=None) -> int:
    doc = "loss curves of runs that differ in one switch: plain, default and plain from another seed; or bf16 and FP8"
    parser = BenchParser("train_step curves", doc, "tiny char model on CPU, 30 iterations", name=("loss-curves", None))
    parser.option("--iters", 300, 30, type=int, help="iterations per run")
    parser.add_argument("--work", type=Path, default=Path("out-loss-curves"), help="folder for the runs' out_dirs")
    parser.add_argument("--runs", choices=RUN_SETS, default="switches", help="the runs compared (default switches)")
    parser.add_argument("train_args", nargs="*", help="more train.py settings for every run (after --)")
    args = parser.parse_args(argv)
    iters = args.iters
    settings = [*([*TINY_CHAR, "--device=cpu"] if args.quick else GPT2_SHAKESPEARE), *args.train_args]
    steps = [f"--max_iters={iters}", f"--lr_decay_iters={iters}", "--log_interval=1", f"--eval_interval={iters}"]
    start, rows, tail = time.perf_counter(), [], max(1, iters // 3)  # the last third, where the curves have settled
    for index, (run, (seed, switches)) in enumerate(RUN_SETS[args.runs].items()):
        out_dir = args.work / f"run{index}"
        result = train_log([*settings, *switches, f"--seed={seed}", *steps, "--eval_iters=5", f"--out_dir={out_dir}"])
        shutil.rmtree(out_dir, ignore_errors=True)  # only the log is read; a 4096-wide run's checkpoints are 34 GiB
        if result.code != 0 or len(result.lines) != iters:
            lines = f"{len(result.lines)} of {iters} iter lines"
            raise SystemExit(f"{run}: exit {result.code}, {lines}\n{result.output[-4000:]}")
        rows.append(curve_row(run, seed, switches, result.lines, tail))
        print(f"{run}: first {rows[-1]['first_loss']:.4f}, mean of the last {tail} {rows[-1]['tail_loss']:.4f}")
    for row in rows:
        pairs = zip(row["losses"][-tail:], rows[0]["losses"][-tail:])
        row["gap_vs_first"] = statistics.fmean(abs(a - b) for a, b in pairs)
    first = rows[0]["run"]  # 'plain, seed 2' against 'plain': the run-to-run noise
    gap = f"mean |loss - {first}'s loss| per iteration over the last {tail} iterations; the same seed, the same data"
    notes = {"settings": " ".join(settings) + f" --max_iters={iters}", "gap": gap}
    device, name = torch.device("cpu" if args.quick else "cuda"), args.name or "loss-curves-quick"
    wall_s = round(time.perf_counter() - start, 1)
    save_results(args.out, name, device, rows, CURVE_COLUMNS, plot_curves, wall_s=wall_s, notes=notes)
    return 0
