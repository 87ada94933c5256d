"""Where a training step's time goes: torch.profiler over train.py's train_step, kernels grouped by kind.

    python bench/profile_train.py --variants plain default     # GPT-2 124M, T=1024, batch 16, on the GPU
    python bench/profile_train.py --quick                      # tiny model on CPU

Per variant (bench_train.py's VARIANTS), after a compile step and warm-up, it records a few steps and writes
<card>-profile-train.md: the step's wall time and its GPU time per kernel kind (matmul, attention, the fused
pointwise/reduction kernels torch.compile generates, the optimizer, communication, copies), then the top
kernels. GPU busy time well under the wall time means the step waits on the host.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch._dynamo
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.bench_train import VARIANTS, Case, build_state, case_config  # noqa: E402
from bench.report import DEFAULT_OUT, card_slug, free_device_memory  # noqa: E402
from runtime import synchronize  # noqa: E402
from train import train_step  # noqa: E402

KINDS = [  # (kind, pattern on the kernel name), first match wins
    ("attention", r"flash|fmha|attention|sdpa|cudnn.*(fprop|bprop)|FlashAttn"),
    ("matmul", r"gemm|matmul|cutlass|xmma|nvjet|cublas|aten::(addmm|mm|bmm)$"),
    ("optimizer", r"adam|multi_tensor|foreach|norm_kernel|lerp"),
    ("communication", r"nccl|allreduce|all_reduce"),
    ("compiled pointwise/reduction", r"triton"),
    ("copy/fill", r"copy|memcpy|memset|fill|cat|elementwise_kernel"),
]


def kind_of(name: str) -> str:
    for kind, pattern in KINDS:
        if re.search(pattern, name, re.IGNORECASE):
            return kind
    return "other"


def summarize(prof, steps: int, wall_ms: float, on_gpu: bool, top: int, unit: str) -> list[str]:
    """Markdown lines: wall and busy time per `unit`, time per kernel kind, the top kernels."""
    kernels = [e for e in prof.key_averages() if (e.device_type.name == "CUDA") == on_gpu]
    time_of = (lambda e: e.self_device_time_total) if on_gpu else (lambda e: e.self_cpu_time_total)
    by_kind = defaultdict(float)
    for event in kernels:
        by_kind[kind_of(event.key)] += time_of(event) / 1000 / steps
    busy = sum(by_kind.values())
    lines = [
        f"wall {wall_ms:.3f} ms/{unit}; {'GPU' if on_gpu else 'CPU op'} time {busy:.3f} ms/{unit} "
        f"({busy / wall_ms:.0%} of wall)",
        "",
        f"| kind | ms/{unit} | share |",
        "|---|---:|---:|",
    ]
    for kind, ms in sorted(by_kind.items(), key=lambda item: -item[1]):
        lines.append(f"| {kind} | {ms:.3f} | {ms / busy:.1%} |")
    return lines + [""] + top_table("top kernels", kernels, time_of, steps, top, unit, with_kind=True)


def top_table(title: str, events, time_of, steps: int, top: int, unit: str, with_kind: bool = False) -> list[str]:
    """Markdown rows of the `top` events by time_of (microseconds over `steps`): ms and calls per `unit`."""
    kind_column = " kind |" if with_kind else ""
    lines = [
        f"| {title} |{kind_column} ms/{unit} | calls/{unit} |",
        "|---|" + ("---|" if with_kind else "") + "---:|---:|",
    ]
    for event in sorted(events, key=time_of, reverse=True)[:top]:
        name = event.key if len(event.key) <= 90 else event.key[:87] + "..."
        kind = f" {kind_of(event.key)} |" if with_kind else ""
        lines.append(
            f"| `{name.replace('|', '/')}` |{kind} {time_of(event) / 1000 / steps:.3f} | {event.count / steps:.1f} |"
        )
    return lines


def profile_variant(variant: str, args) -> str:
    torch._dynamo.reset()
    case = Case(VARIANTS[variant].get("attention_backend", "auto"), args.seq_len, args.batch_size, variant)
    state = build_state(case_config(case, args))
    device = state.runtime.device
    for _ in range(3):  # compile and warm up
        train_step(state)
    synchronize(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(args.steps):
            train_step(state)
        synchronize(device)
        wall_ms = (time.perf_counter() - start) * 1000 / args.steps
    lines = [f"## {variant}: {state.attention.used}, T={args.seq_len}, batch {args.batch_size}", ""]
    lines += summarize(prof, args.steps, wall_ms, device.type == "cuda", args.top, "step")
    del state
    free_device_memory()
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny model on CPU, no compile")
    parser.add_argument("--variants", nargs="+", default=["plain", "default"], choices=VARIANTS)
    parser.add_argument("--seq-len", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    args.device = "cpu" if args.quick else "auto"
    args.compile = False if args.quick else None
    args.dtype = "auto"
    args.seq_len = args.seq_len or (64 if args.quick else 1024)
    args.batch_size = args.batch_size or (4 if args.quick else 16)
    sections = [profile_variant(variant, args) for variant in args.variants]
    card = card_slug()
    name = "profile-train-quick" if args.quick else "profile-train"
    text = f"# {name} on {card} (torch {torch.__version__})\n\n" + "\n".join(sections)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{card}-{name}.md"
    path.write_text(text)
    print(text)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
