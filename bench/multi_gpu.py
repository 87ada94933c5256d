"""`python -m bench.multi_gpu`: train.py under torchrun on 1, 2, 4 GPUs (DDP, FSDP, the largest model, context
parallelism), its own log lines read. bench/README.md says how to run it."""

from __future__ import annotations

from errors import as_command

if __name__ == "__main__":  # before torch's seconds of importing: see as_command
    as_command()

import os
import re
import statistics
import sys
import time
from pathlib import Path

import torch

from bench import launch
from bench.grid import BenchParser
from bench.report import GPT2_124M, GPT2_VOCAB, TINY, cell, plot, save_results
from training.parallel import PARALLELISMS

GPT2_XL = {"n_layer": 48, "n_head": 25, "n_embd": 1600}
FSDP_MODELS = {  # --fsdp-model: GPT-2 XL, or a GPT-2 of width 4096 and 32 layers that one 80 GB GPU cannot train
    "gpt2-xl-1.5B": GPT2_XL,
    "gpt2-6.7B": {"n_layer": 32, "n_head": 32, "n_embd": 4096},
}
LARGEST_LAYERS = (48, 96, 192, 384, 768)  # width 1600: about 1.5B, 3B, 6B, 12B, 24B parameters
COLUMNS = (
    "run model settings params_m gpus block_size micro_steps_per_gpu tokens_per_step ms_per_iter "
    "tokens_per_sec tokens_per_sec_per_gpu scaling mfu mfu_vs_1gpu loss_vs_1gpu loss_gaps mem_gib status"
).split()


def params_millions(shape: dict, vocab_size: int | None, block_size: int) -> float:
    width = shape["n_embd"]
    return (((vocab_size or 256) + block_size) * width + shape["n_layer"] * 12 * width * width) / 1e6


def run_settings(args, shape: dict, parallelism: str, micro_batch: int, accum_total: int, block_size: int) -> list[str]:
    steps = dict(max_iters=args.iters, lr_decay_iters=args.iters, warmup_iters=min(5, args.iters))
    schedule = dict(learning_rate=3e-4, min_lr=3e-5, log_interval=args.log_interval, eval_interval=args.iters)
    settings = launch.flags(shape) + [
        f"--data_dir={launch.corpus(args.work / 'data', block_size)}",
        f"--parallelism={parallelism}",
        f"--batch_size={micro_batch}",
        f"--gradient_accumulation_steps={accum_total}",
        f"--block_size={block_size}",
        *([f"--vocab_size={args.vocab_size}"] if args.vocab_size else []),
        *launch.flags({**steps, **schedule}),
        "--eval_iters=1",
        "--eval_on_start=false",
    ]
    if args.quick:
        settings += ["--device=cpu", "--dist_backend=gloo", "--compile=false"]
    if parallelism == "fsdp":
        settings += ["--activation_checkpointing=block"]
    return settings + args.extra


def measure(args, run, model, shape, parallelism, gpus, micro_batch, settings=(), baseline=None, **own) -> dict:
    """One row: train.py under torchrun on `gpus` processes, its iter lines past the warmup summed up. `own`:
    warmup, stop_at_iter, block_size and accum_total (micro-steps over all GPUs) of this run, else the bench's."""
    # stopped once it logs its last step: its checkpoint (minutes for GPT-2 XL) is not what is measured
    warmup, last_iter = own.get("warmup", args.warmup), own.get("stop_at_iter", args.iters)
    accum_total = own.get("accum_total", max(args.gpus) * args.accum)
    block_size = own.get("block_size", args.block_size)
    row = {
        "run": run,
        "baseline": baseline or run,  # the run whose 1-GPU row scales this one
        "settings": " ".join(settings) or "-",
        "model": model,
        "params_m": params_millions(shape, args.vocab_size, block_size),
        "gpus": gpus,
        "block_size": block_size,
        "micro_batch": micro_batch,
        "micro_steps_per_gpu": max(1, accum_total // gpus),
        "tokens_per_step": accum_total * micro_batch * block_size,
    }
    settings = run_settings(args, shape, parallelism, micro_batch, accum_total, block_size) + list(settings)
    settings += [f"--out_dir={args.work / f'{run}-{model}-{gpus}'}", "--overwrite_out_dir=true"]
    command = launch.train_command(settings, ["--standalone", f"--nproc_per_node={gpus}"])
    result = launch.run(command, torchrun_env(args.quick), args.timeout, last_iter)
    shaped = [arg[2:] for arg in args.extra if arg.split("=")[0] in SHAPE_SETTINGS]
    if shaped:  # settings after -- changed the model: its name says how, and train.py counts its parameters
        row["model"] = f"{model} ({', '.join(shaped)})"
        counted = re.search(r"^parameters: ([\d.]+)M", result.output, re.M)
        row["params_m"] = float(counted.group(1)) if counted else None
    return {**row, **figures(result, warmup, last_iter, gpus)}


def figures(result: launch.Run, warmup: int, last_iter: int, gpus: int) -> dict:
    """Medians of the iter lines past `warmup` up to `last_iter` (the peak memory: the largest), or why there are
    none. A fast run may log a step past the one waited for before the stop lands: left out, so that every row ends
    at the same iteration (the loss a row ends with is then comparable)."""
    lines = [line for line in result.lines if line["iter"] <= last_iter]
    steady = [line for line in lines if line["iter"] > warmup]
    wall_s = round(result.seconds, 1)
    if result.code != 0 or not steady:
        return {"wall_s": wall_s, "status": f"exit {result.code}: {launch.failure_line(result.output)}"}
    mfus = [line["mfu"] for line in steady if line["mfu"] is not None]
    tokens_per_sec = statistics.median(line["tokens_per_sec"] for line in steady)
    return {
        "wall_s": wall_s,
        "ms_per_iter": statistics.median(line["ms_per_iter"] for line in steady),
        "tokens_per_sec": tokens_per_sec,
        "mfu": statistics.median(mfus) if mfus else None,
        "mem_gib": max(line["mem_gib"] for line in steady),  # rank 0's peak
        "final_loss": steady[-1]["loss"],
        "losses": {line["iter"]: line["loss"] for line in lines},  # every logged iteration's, from the first
        "status": "ok",
        "tokens_per_sec_per_gpu": tokens_per_sec / gpus,
    }


def add_scaling(rows: list[dict]) -> None:
    """Per-GPU tok/s over that of the same run and model on one GPU; for context-parallel rows, whose sequences
    are longer than one GPU's, MFU over the one-GPU row's (and, at the same T, each iteration's loss difference, the
    last one both logged as the row's)."""
    single = {(r["run"], r["model"]): r for r in rows if r["gpus"] == 1 and r.get("tokens_per_sec")}
    for row in rows:
        base = single.get((row["baseline"], row["model"]))
        if base is None or not row.get("tokens_per_sec") or row["gpus"] == 1:
            continue
        if not row["run"].startswith("context"):
            row["scaling"] = row["tokens_per_sec_per_gpu"] / base["tokens_per_sec"]
            continue
        if row.get("mfu") and base.get("mfu"):
            row["mfu_vs_1gpu"] = row["mfu"] / base["mfu"]
        if row["block_size"] == base["block_size"]:
            # iteration by iteration, from the first (the same weights and tokens: the forward alone): where a gap
            # opens; the last both logged is the row's loss gap
            losses, base_losses = row.get("losses", {}), base.get("losses", {})
            gaps = [losses[it] - base_losses[it] for it in losses if it in base_losses]
            if gaps:
                row["loss_vs_1gpu"] = gaps[-1]
                row["loss_gaps"] = " ".join(f"{gap:+.3f}" for gap in gaps)


# train.py settings that change the model's shape (and its parameter count)
SHAPE_SETTINGS = ("--n_layer", "--n_head", "--n_embd", "--vocab_size", "--n_kv_head", "--mlp_hidden")

# Context parallelism's sequences take seconds a step: a few compiled steps (--context-iters), the first two
# (compiling) untimed
CONTEXT = ("--warmup_iters=1", "--log_interval=1", "--activation_checkpointing=block")


def context_rows(args, on_row) -> None:
    """At each --context T: one GPU at T, then each GPU count N > 1 splitting sequences of N x T (context_parallel
    N), batch 1; at each --context-check T: the same T on one GPU and split over each N, whose losses should agree.
    Both stop once they log their last step, before the checkpoint."""
    model, shape = ("tiny", TINY) if args.quick else ("gpt2-124M", GPT2_124M)
    runs = [("context", t, g, t * g) for t in args.context for g in args.gpus]
    runs += [("context-check", t, g, t) for t in args.context_check for g in args.gpus]
    for run, t, gpus, block_size in runs:
        steps = (f"--max_iters={args.context_iters + 1}", f"--lr_decay_iters={args.context_iters + 1}")
        settings = (*CONTEXT, *steps, *([f"--context_parallel={gpus}"] if gpus > 1 else []))
        own = dict(warmup=2, stop_at_iter=args.context_iters, block_size=block_size, accum_total=1)
        on_row(measure(args, f"{run} T={t}", model, shape, "ddp", gpus, 1, settings, **own))


# Whether a model fits, not how fast: a few eager steps (compiling a model of billions of parameters takes minutes);
# the run is stopped once it logs its last step, before its checkpoint (weights and AdamW state: 16 bytes a parameter)
PROBE_ITERS = 4  # PROBE's max_iters
PROBE = launch.flags(dict(max_iters=4, lr_decay_iters=4, warmup_iters=1, eval_interval=4, log_interval=1))


def largest(args, parallelism: str, on_row) -> None:
    """Deeper and deeper width-1600 GPTs at micro-batch 1 on the most GPUs, until one does not train: four eager
    steps each, the last two timed, and no checkpoint."""
    base = TINY if args.quick else GPT2_XL  # --quick: tiny models 2 and 4 layers deep, to check the flow
    for layers in (2, 4) if args.quick else args.largest_layers:
        shape = {**base, "n_layer": layers}
        run, model, gpus = f"{parallelism}-largest", f"{layers}L-{base['n_embd']}", max(args.gpus)
        settings = (*PROBE, "--compile=false")
        row = measure(args, run, model, shape, parallelism, gpus, 1, settings, warmup=2, stop_at_iter=PROBE_ITERS)
        on_row(row)
        if row["status"] != "ok":
            break


def torchrun_env(quick: bool) -> dict:
    """The environment of every launched torchrun: NVLink multicast off, output unbuffered; --quick: one
    thread per CPU process."""
    threads = {"OMP_NUM_THREADS": "1"} if quick else {}
    return {**os.environ, "NCCL_NVLS_ENABLE": "0", "PYTHONUNBUFFERED": "1", **threads}


def plot_rows(rows: list[dict], path: Path) -> None:
    scaled = [r for r in rows if not r["run"].startswith(("ddp-", "fsdp-", "context"))]  # not largest, not context
    panels = [("tok/s per GPU, same global batch", "tokens_per_sec_per_gpu", scaled), ("scaling", "scaling", scaled)]
    plot(rows, path, x="gpus", panels=panels, series=lambda r: f"{r['run']} {r['model']}")


def parse_args(argv=None):
    quick_help = "CPU, gloo, tiny model: checks the script"
    parser = BenchParser("multi_gpu", __doc__, quick_help, name=("ddp", "ddp-quick"))
    parser.option("--gpus", [1, 2, 4], [1, 2], type=int, nargs="+", help="GPU counts")
    parser.option("--micro-batch", 16, 4, type=int, help="sequences per GPU and micro-step")
    parser.add_argument("--accum", type=int, default=2, help="micro-steps per GPU on the largest GPU count (2)")
    parser.option("--iters", 60, 6, type=int, help="iterations per run")
    parser.option("--warmup", 20, 2, type=int, help="iterations left out of the medians")
    parser.option("--log-interval", 10, 1, type=int, help="train.py's log_interval (a log line waits for the GPU)")
    parser.add_argument("--fsdp", action="store_true", help="also --fsdp-model under FSDP on each GPU count")
    parser.add_argument("--fsdp-model", choices=list(FSDP_MODELS), default="gpt2-xl-1.5B", help="(gpt2-xl-1.5B)")
    parser.add_argument("--skip-ddp", action="store_true", help="leave out the DDP rows (e.g. only --fsdp)")
    parser.add_argument("--context", type=int, nargs="+", default=[], metavar="T", help="T on 1 GPU, N x T over N")
    parser.add_argument("--context-iters", type=int, default=6, help="steps per context run, the first 2 untimed")
    parser.add_argument("--context-check", type=int, nargs="+", default=[], metavar="T", help="T on 1 GPU and on N")
    parser.add_argument("--largest", action="store_true", help="also the deepest width-1600 GPT that trains")
    parser.add_argument("--largest-layers", type=int, nargs="+", default=list(LARGEST_LAYERS), help="depths tried")
    parser.add_argument("--largest-parallelism", nargs="+", choices=PARALLELISMS, default=list(PARALLELISMS))
    parser.add_argument("--timeout", type=float, default=900, help="seconds per train.py run (900)")
    parser.add_argument("--work", type=Path, default=Path("out-bench-ddp"), help="folder for data and out_dirs")
    variant_help = "rows with these train.py settings on each GPU count > 1, scaled by the family's 1-GPU run"
    parser.add_argument("--variant", action="append", default=[], metavar="NAME:--key=value[,...]", help=variant_help)
    parser.add_argument("--variant-gpus", type=int, nargs="+", help="GPU counts of the --variant rows (all > 1)")
    parser.add_argument("extra", nargs="*", help="more train.py --key=value settings for every run (after --)")
    args = parser.parse_args(argv)
    args.block_size, args.vocab_size = (64, None) if args.quick else (1024, GPT2_VOCAB)  # quick: the corpus's
    args.variants = [text.partition(":")[::2] for text in args.variant]  # (name, settings)
    for text, (name, settings) in zip(args.variant, args.variants):
        if not name or not settings.startswith("--"):
            parser.error(f"--variant {text!r}: expected NAME:--key=value[,--key=value]")
    if args.variant_gpus and not set(args.variant_gpus) <= {g for g in args.gpus if g > 1}:
        parser.error(f"--variant-gpus {args.variant_gpus}: choose among --gpus above 1 ({args.gpus})")
    return args


def variant_row(args, run: str, model: str, shape: dict, parallelism: str, gpus: int, micro_batch: int, settings):
    """A --variant row, scaled by its family's plain 1-GPU run: the same tokens per optimizer step, also where the
    variant sets its own --batch_size (the micro-steps then make up the difference)."""
    accum_total = max(args.gpus) * args.accum
    tokens = accum_total * micro_batch
    for setting in settings:
        if setting.startswith("--batch_size="):
            micro_batch = int(setting.partition("=")[2])
            accum_total = max(gpus, tokens // micro_batch)
    kept = [s for s in settings if not s.startswith("--batch_size=")]  # the row's own micro-batch replaces it
    return measure(args, run, model, shape, parallelism, gpus, micro_batch, kept, parallelism, accum_total=accum_total)


def save(args, rows: list[dict], start: float) -> None:
    add_scaling(rows)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.quick else "cpu")
    wall_s = round(time.perf_counter() - start, 1)
    notes = {
        "runs": f"train.py under torchrun --standalone; medians of the iter lines after the first {args.warmup}",
        "global batch": f"gradient_accumulation_steps = {max(args.gpus)} x {args.accum}, micro-batch "
        f"{args.micro_batch}; scaling: tok/s per GPU over one GPU's",
        "every run": " ".join(args.extra) or "-",
        "environment": " ".join(f"{k}={v}" for k, v in sorted(torchrun_env(False).items()) if k.startswith("NCCL_")),
    }
    save_results(args.out, args.name, device, rows, COLUMNS, plot_rows, wall_s=wall_s, notes=notes)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not args.quick and torch.cuda.device_count() < max(args.gpus):
        print(f"error: {max(args.gpus)} GPUs asked for, {torch.cuda.device_count()} here", file=sys.stderr)
        return 2
    start, rows = time.perf_counter(), []

    def on_row(row: dict) -> None:  # the results so far are on disk after every run: a cut-off call keeps them
        rows.append(row)
        result = f"{row['status']}, {cell(row.get('tokens_per_sec_per_gpu'))} tok/s per GPU ({row['wall_s']} s)"
        print(f"{row['run']} {row['model']} on {row['gpus']}: {result}", flush=True)
        save(args, rows, start)

    small = ("tiny", TINY) if args.quick else ("gpt2-124M", GPT2_124M)
    large = small if args.quick else (args.fsdp_model, FSDP_MODELS[args.fsdp_model])
    half = args.micro_batch if large == small else max(1, args.micro_batch // 2)  # the FSDP models' micro-batch
    runs = [("ddp", *small, args.micro_batch)] if not args.skip_ddp else []
    runs += [("fsdp", *large, half)] if args.fsdp else []
    for parallelism, model, shape, micro_batch in runs:
        for gpus in args.gpus:
            on_row(measure(args, parallelism, model, shape, parallelism, gpus, micro_batch))
    for parallelism, model, shape, micro_batch in runs:
        for name, settings in args.variants:
            run, settings = f"{parallelism} {name}", settings.split(",")
            for gpus in args.variant_gpus or [g for g in args.gpus if g > 1]:
                on_row(variant_row(args, run, model, shape, parallelism, gpus, micro_batch, settings))
    if args.largest:
        for parallelism in args.largest_parallelism:
            largest(args, parallelism, on_row)
    context_rows(args, on_row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
