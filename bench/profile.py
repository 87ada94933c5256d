"""Where the time goes: torch.profiler over train.py's train_step (--what train) or over generation's steady
decoding (--what generate), GPU kernels grouped by kind.

    python -m bench.profile --variants plain default          # GPT-2 124M, T=1024, batch 16, on the GPU
    python -m bench.profile --what generate                   # GPT-2 124M shapes, bf16, batch 1, prompt 128
    python -m bench.profile --quick [--what generate]         # tiny model on CPU

train: per variant (bench_train.py's VARIANTS), after a compile step and warm-up, a few steps are recorded;
<card>-profile-train.md has the step's wall time and its GPU time per kernel kind (matmul, attention, the fused
pointwise/reduction kernels torch.compile generates, the optimizer, communication, copies), then the top
kernels. GPU busy time well under the wall time means the step waits on the host.

generate: after a warm-up stream (compiles, records CUDA graphs) and the first tokens of the profiled one,
`--tokens` decode steps are recorded, eager and (on CUDA) compiled; <card>-profile-generate.md has wall time
per token, GPU busy time per token by kernel kind, the top kernels, and the host ops that take the most CPU
time. GPU busy time well under the wall time means decoding waits on the host (Python, launches), which CUDA
graphs are meant to remove.
"""

from __future__ import annotations

from errors import as_command

if __name__ == "__main__":  # before torch's seconds of importing: see as_command
    as_command()

import argparse
import functools
import sys
import time
from pathlib import Path

import torch
import torch._dynamo
from torch.profiler import ProfilerActivity, profile

from bench.bench_train import VARIANTS, Case, build_state, case_config
from bench.grid import free_device_memory
from bench.report import DEFAULT_OUT, card_slug
from data.common import OneLineParser
from train import train_step
from training.profiling import summarize
from training.runtime import synchronize


def profiled(device: torch.device, steps: int, step) -> tuple[object, float]:
    """The profiler over `steps` calls of step() (CPU ops, and CUDA kernels on a GPU), and their wall ms each."""
    synchronize(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            step()
        synchronize(device)
        wall_ms = (time.perf_counter() - start) * 1000 / steps
    return prof, wall_ms


# ----------------------------------------------------------------------------------------------
# --what train: train.py's step per variant


def profile_variant(variant: str, args) -> str:
    torch._dynamo.reset()
    case = Case(VARIANTS[variant].get("attention_backend", "auto"), args.seq_len, args.batch_size, variant)
    state = build_state(case_config(case, args))
    device = state.runtime.device
    for _ in range(3):  # compile and warm up
        train_step(state)
    prof, wall_ms = profiled(device, args.steps, functools.partial(train_step, state))
    lines = [f"## {variant}: {state.attention.used}, T={args.seq_len}, batch {args.batch_size}", ""]
    lines += summarize(prof, args.steps, wall_ms, device.type == "cuda", args.top, "step")
    del state
    free_device_memory()
    return "\n".join(lines) + "\n"


def profile_train(args) -> tuple[str, str]:
    """(card, the markdown file's text)."""
    args.device, args.compile, args.dtype = ("cpu", False, "auto") if args.quick else ("auto", None, "auto")
    sections = [profile_variant(variant, args) for variant in args.variants]
    card = card_slug()
    return card, f"# {args.name} on {card} (torch {torch.__version__})\n\n" + "\n".join(sections)


# ----------------------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    parser = OneLineParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--what", choices=("train",), default="train", help="what to profile (train)")
    parser.add_argument("--quick", action="store_true", help="tiny model on CPU (train: no compile)")
    parser.add_argument("--batch-size", type=int, help="train: 16 (--quick 4); generate: 1")
    parser.add_argument("--top", type=int, help="rows of each top table (train 25; generate 15)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results folder (default bench/results)")
    train = parser.add_argument_group("--what train")
    train.add_argument("--variants", nargs="+", default=["plain", "default"], choices=VARIANTS)
    train.add_argument("--seq-len", type=int, help="default 1024 (--quick 64)")
    train.add_argument("--steps", type=int, default=5, help="steps profiled (5)")
    args = parser.parse_args(argv)
    train_run = args.what == "train"
    args.batch_size = args.batch_size or ((4 if args.quick else 16) if train_run else 1)
    args.top = args.top or (25 if train_run else 15)
    args.seq_len = args.seq_len or (64 if args.quick else 1024)
    args.name = f"profile-{args.what}" + ("-quick" if args.quick else "")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    card, text = profile_train(args)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{card}-{args.name}.md"
    path.write_text(text)
    print(text)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
