"""`python -m bench.train_step`: train.py's training step timed per backend, batch size, context length or switch
set; its modes profile, phases, context, compare and curves. bench/README.md says how to run each."""

from __future__ import annotations

from errors import as_command

if __name__ == "__main__":  # before torch's seconds of importing: see as_command
    as_command()

import argparse
import ast
import math
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from bench import train_parts as parts
from bench.grid import BenchParser, dispatch, fresh_row, profiled, run_grid
from bench.report import model_settings, panels_by, plot, write_markdown
from configurator import parse_bool
from kernels.timing import timed
from train import TrainConfig, train_step
from training.profiling import summarize
from training.progress import TrainState
from training.runtime import model_flops_utilization, peak_flops_for, setup_runtime

BACKENDS = ("auto", "sdpa", "flash_attn_2", "flash_attn_4", "flex_attention", "manual")
MANUAL_MAX_SEQ_LEN = 1024


# Switches compared in one run (--variants). "plain" is nanoGPT's step: SDPA, compile, fused AdamW, the full
# logits; "default" is TrainConfig's defaults; the others are the default with one switch changed.
VARIANTS = {
    "plain": dict(attention_backend="sdpa", cross_entropy="plain"),
    "default": {},
    "plain-ce": dict(cross_entropy="plain"),
    "sdpa": dict(attention_backend="sdpa"),
    "autotune": dict(compile_mode="max-autotune-no-cudagraphs"),
    "cudagraphs": dict(compile_mode="max-autotune"),
    "ckpt-mlp": dict(activation_checkpointing="mlp"),
    "ckpt-block": dict(activation_checkpointing="block"),
    "docs": dict(packed_documents=True),  # 4 documents a row: attention and positions kept inside each
    "bf16": dict(fp8="off"),  # the default, whatever fp8=auto decides: the baseline of the FP8 rows
    "fp8-tensorwise": dict(fp8="tensorwise"),
    "fp8-rowwise": dict(fp8="rowwise"),
    "compile-whole": dict(compile_blocks=False),  # one graph for the whole model
    "compile-blocks": dict(compile_blocks=True),  # regional: each block and the head compiled apart
}


@dataclass(frozen=True)
class Case:
    backend: str
    seq_len: int
    batch_size: int
    variant: str = ""  # a key of VARIANTS: its switches apply over the backend


def model_setting(text: str) -> tuple[str, object]:
    """--model's KEY=VALUE, the value read as Python (n_embd=4096, rope=True)."""
    key, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return key, value


def cases_for(args) -> list[Case]:
    """Most wanted first: each backend (or --variants switch set) at the first batch size, the long context at batch 1,
    then the other batch sizes; --quick: T=64, no long context."""
    seq_len, long_seq_lens = (64, []) if args.quick else (1024, args.long_seq_lens)
    runs = [(backend, "") for backend in args.backends]
    if args.variants:
        runs = [(VARIANTS[v].get("attention_backend", "auto"), v) for v in args.variants]
    cases = [Case(b, seq_len, size, v) for size in args.batch_sizes[:1] for b, v in runs]
    cases += [Case(b, t, 1, v) for t in long_seq_lens for b, v in runs]
    return cases + [Case(b, seq_len, size, v) for size in args.batch_sizes[1:] for b, v in runs]


def case_config(case: Case, args) -> TrainConfig:
    shape = dict(batch_size=case.batch_size, block_size=case.seq_len, **model_settings(args.quick, **args.model))
    run = dict(attention_backend=case.backend, compile=args.compile, dtype=args.dtype, device=args.device)
    return TrainConfig(**{"out_dir": "bench-unused", **shape, **run, **VARIANTS.get(case.variant, {})})  # variant wins


ROW_FIELDS = ("compile", "ms_per_iter", "tokens_per_sec", "mfu", "peak_mem_mib", "first_step_s", "compile_s", "loss")


def empty_row(case: Case, cfg: TrainConfig, dtype: torch.dtype) -> dict:
    return {
        **dict(variant=case.variant, backend=case.backend, resolved=None, seq_len=case.seq_len),
        **dict(batch_size=case.batch_size, head_dim=cfg.n_embd // cfg.n_head, docs=cfg.packed_documents),
        **dict(dtype=str(dtype).removeprefix("torch."), **dict.fromkeys(ROW_FIELDS), vs_plain=None),
    }


def measure_case(case: Case, args, dtype: torch.dtype) -> list[dict]:
    cfg = case_config(case, args)
    row = empty_row(case, cfg, dtype)
    if case.backend == "manual" and case.seq_len > MANUAL_MAX_SEQ_LEN:  # its (T, T) float32 scores per layer and head
        gib = cfg.n_layer * cfg.n_head * case.seq_len**2 * 4 / 2**30
        return [{**row, "status": f"not run: manual's (T, T) scores need {gib:,.0f} GiB at T={case.seq_len}"}]
    with fresh_row(row):  # each row compiles afresh, as a new train.py process would
        time_row(row, cfg, args)
    return [row]


def time_row(row: dict, cfg: TrainConfig, args):
    """The row's state built and its steps timed, unless another backend or FP8 recipe runs (never timed under this
    one's name); the state goes when this returns (or raises)."""
    state = parts.build_state(cfg)
    attention, fp8 = state.attention, state.fp8
    row["resolved"] = attention.used
    row["compile"] = bool(state.compiled)  # per block keeps the model object: ask how torch.compile took it
    if cfg.attention_backend != "auto" and attention.used != cfg.attention_backend:
        row["status"] = f"falls back to {attention.used}: {attention.reason}"
    elif cfg.fp8 not in ("auto", "off") and fp8.recipe != cfg.fp8:
        row["status"] = f"falls back to bf16 matmuls: {fp8.reason}"
    else:
        row.update(time_steps(state, args))
        row["status"] = "ok" if math.isfinite(row["loss"]) else f"non-finite loss {row['loss']}"


def time_steps(state: TrainState, args) -> dict:
    cfg, device = state.cfg, state.runtime.device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    first_step_s = timed(lambda: train_step(state), device).wall_ms / 1e3  # compiles
    for _ in range(args.warmup_steps):
        train_step(state)
    # median over chunks of mean step time (train.py's log line is a mean too)
    chunks = [timed(lambda: [train_step(state) for _ in range(args.steps)], device) for _ in range(args.chunks)]
    ms = statistics.median(chunk.wall_ms / args.steps for chunk in chunks)
    step = chunks[-1].result[-1]
    tokens = cfg.batch_size * cfg.block_size * cfg.gradient_accumulation_steps
    peak, _ = peak_flops_for(device, state.runtime.dtype, cfg.peak_flops)
    flops = state.model.flops_per_token(cfg.block_size) * tokens
    return {
        "ms_per_iter": ms,
        "tokens_per_sec": tokens / (ms / 1000),
        "mfu": model_flops_utilization(flops, ms / 1000, peak),
        "peak_mem_mib": torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None,
        "first_step_s": first_step_s,
        "compile_s": max(0.0, first_step_s - ms / 1000),
        "loss": step.loss.item(),
    }


def add_ratios(rows: list[dict]) -> None:
    """vs_plain: tokens/s over the plain variant's at the same T and batch, measured in this run."""
    plain = {(r["seq_len"], r["batch_size"]): r["tokens_per_sec"] for r in rows if r["variant"] == "plain"}
    for row in rows:
        base = plain.get((row["seq_len"], row["batch_size"]))
        if base and row["tokens_per_sec"]:
            row["vs_plain"] = row["tokens_per_sec"] / base


COLUMNS = (
    "variant backend resolved seq_len batch_size dtype compile ms_per_iter tokens_per_sec mfu "
    "peak_mem_mib compile_s loss vs_plain status"
).split()


def plot_rows(rows: list[dict], path: Path):
    panels = panels_by(rows, "seq_len", "tokens_per_sec")
    plot(rows, path, x="batch_size", panels=panels, series=lambda r: r["variant"] or r["backend"], title="train step")


def parse_args(argv=None):
    modes = ("profile", "phases", "context", "compare", "curves")
    quick_help = "tiny CPU model, T=64, 2 steps, no compile"
    parser = BenchParser("train_step", __doc__, quick_help, modes, ("train", "train-quick"))
    # dtype auto: as train.py's, bfloat16 on CUDA, else float32
    parser.grid_options(("auto", "cpu"), ("auto", "auto"), ("auto", "bfloat16", "float16", "float32"), (200, 0))
    parser.option("--compile", None, False, type=parse_bool, help="torch.compile, true or false; None: as train.py")
    parser.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=BACKENDS)
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, help="rows per switch set instead of per backend")
    parser.option("--batch-sizes", [16, 32, 8], [4, 8], type=int, nargs="*", help="at T=1024; the first runs first")
    parser.option("--long-seq-lens", [8192, 32768], [], type=int, nargs="*", help="long-context rows at batch 1")
    parser.add_argument("--model", type=model_setting, nargs="*", default=[], help="model settings, e.g. n_embd=4096")
    parser.option("--steps", 10, 2, type=int, help="timed steps per chunk")
    parser.option("--chunks", 3, 1, type=int, help="timed chunks; the median is kept")
    parser.option("--warmup-steps", 2, 0, type=int, help="untimed steps after the first")
    args = parser.parse_args(argv)
    args.model = dict(args.model)
    return args


def grid(argv=None) -> int:
    args = parse_args(argv)
    cases = cases_for(args)
    probe = setup_runtime(args.device, args.dtype)  # the device and dtype every row will use
    model = model_settings(args.quick, **args.model)
    variants, case_fields = {v: VARIANTS[v] for v in args.variants or ()}, [vars(case) for case in cases]
    header = {
        "model": model,
        "grid": {"backends": args.backends, "variants": variants, "cases": case_fields, "dtype": str(probe.dtype)},
        "flop_convention": "MFU: model.flops_per_token(T) (6N + 12*L*H*D*T) * tokens / time / dense bf16 peak",
        "notes": {
            "model": ", ".join(f"{k}={v}" for k, v in model.items()),
            "step": "train.py's train_step on synthetic random tokens, torch.compile as train.py decides (--compile)",
            "timing": f"first step alone (compile_s = first - steady step), {args.warmup_steps} untimed; ms_per_iter = "
            f"median over {args.chunks} chunks of the mean of {args.steps} steps",
            "memory": "peak_mem_mib = torch.cuda.max_memory_allocated over the row; none on CPU",
        },
    }
    step_grid = dict(
        measure=lambda case: measure_case(case, args, probe.dtype),
        skipped=lambda case, reason: [{**empty_row(case, case_config(case, args), probe.dtype), "status": reason}],
        progress="seq_len batch_size variant backend ms_per_iter tokens_per_sec mfu peak_mem_mib status".split(),
        columns=COLUMNS,
        plot=plot_rows,
        finish=add_ratios,
    )
    run_grid(cases, args, probe.device, header, **step_grid)
    return 0


# ----------------------------------------------------------------------------------------------
# profile: train.py's step per variant under torch.profiler


def profile_variant(variant: str, args) -> str:
    case = Case(VARIANTS[variant].get("attention_backend", "auto"), args.seq_len, args.batch_size, variant)
    row: dict = {}
    with fresh_row(row):  # a variant that cannot run here says why, as a grid row does
        row["lines"] = profile_lines(variant, parts.build_state(case_config(case, args)), args)
    lines = [f"## {variant}: {row['status']}", ""] if "status" in row else row["lines"]
    return "\n".join(lines) + "\n"


def profile_lines(variant: str, state: TrainState, args) -> list[str]:
    """The state's steps profiled; the state goes when this returns (or raises)."""
    device = state.runtime.device
    for _ in range(3):  # compile and warm up
        train_step(state)
    prof, wall_ms = profiled(device, args.steps, lambda: train_step(state))
    lines = [f"## {variant}: {state.attention.used}, T={args.seq_len}, batch {args.batch_size}", ""]
    return lines + summarize(prof, args.steps, wall_ms, device.type == "cuda", 25, "step")


def profile(argv=None) -> int:
    doc = "torch.profiler over train.py's step per variant: GPU time by kernel kind"
    parser = BenchParser("train_step profile", doc, quick_help="tiny model on CPU, no compile")
    parser.add_argument("--variants", nargs="+", default=["plain", "default"], choices=VARIANTS)
    parser.add_argument("--steps", type=int, default=5, help="steps profiled (5)")
    args = parser.parse_args(argv)
    args.batch_size, args.seq_len = (4, 64) if args.quick else (16, 1024)
    args.device, args.compile, args.dtype = ("cpu", False, "auto") if args.quick else ("auto", None, "auto")
    args.model, name = {}, "profile-train" + ("-quick" if args.quick else "")
    sections = [profile_variant(variant, args) for variant in args.variants]
    device = torch.device("cuda" if torch.cuda.is_available() and not args.quick else "cpu")
    return write_markdown(args.out, name, device, "", sections)


def main(argv=None) -> int:
    modes = dict(phases=parts.phases, context=parts.context, compare=parts.compare, curves=parts.curves)
    return dispatch(argv, grid, profile=profile, **modes)


if __name__ == "__main__":
    sys.exit(main())
