"""Where a training step's time goes: torch.profiler over a few steps of every rank (train.py --profile_steps=N).

Each rank writes beside its checkpoints profile-rank<r>.md: the wall time per step and how much of it the GPU was
busy (well under 100%: the GPU waits on the host, Python and hooks), its kernels by kind (matmul, attention,
torch.compile's fused kernels, the optimizer, communication, copies), the communication no compute kernel ran
beside (all-reduces, all-gathers and reduce-scatters not hidden), the top kernels and the host ops that took the
most CPU time; and profile-rank<r>.json.gz, the Chrome trace (chrome://tracing, ui.perfetto.dev). The recorded
steps start after PROFILE_WAIT steps (compiling and warming up) and one more the profiler warms up on; they run
slower than the others (the profiler's own work), and so do the log's figures for them.
python -m bench.train_step profile summarizes the same way without train.py.
"""

from __future__ import annotations

import gzip
import re
import shutil
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, schedule

from kernels.timing import synchronize

PROFILE_WAIT = 5  # steps before the profiler starts: compiling, the caching allocator and NCCL warm up there
KINDS = [  # (kind, pattern on the kernel name), first match wins
    ("attention", r"flash|fmha|attention|sdpa|cudnn.*(fprop|bprop)|FlashAttn"),
    ("matmul", r"gemm|matmul|cutlass|xmma|nvjet|cublas|aten::(addmm|mm|bmm)$"),
    ("optimizer", r"adam|multi_tensor|foreach|norm_kernel|lerp"),
    ("communication", r"nccl|allreduce|all_reduce|all_gather|reduce_scatter"),
    ("compiled pointwise/reduction", r"triton"),
    ("copy/fill", r"copy|memcpy|memset|fill|cat|elementwise_kernel"),
]


def kind_of(name: str) -> str:
    for kind, pattern in KINDS:
        if re.search(pattern, name, re.IGNORECASE):
            return kind
    return "other"


def device_events(events, on_gpu: bool) -> list:
    """The GPU's kernels (on_gpu) or the host's ops among profiler events. Not the ranges that annotate the GPU's
    timeline (ProfilerStep#N over each whole step, "nccl:..." over each collective): counted as kernels they
    would fill every step and hide every gap."""
    return [
        event
        for event in events
        if (event.device_type.name == "CUDA") == on_gpu and not getattr(event, "is_user_annotation", False)
    ]


def summarize(prof, steps: int, wall_ms: float, on_gpu: bool, top: int, unit: str) -> list[str]:
    """Markdown lines: wall and busy time per `unit`, time per kernel kind, the top kernels."""
    kernels = device_events(prof.key_averages(), on_gpu)
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


def union_length(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of (start, end) intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def exposed_communication(kernels: list[tuple[str, float, float]]) -> tuple[float, float]:
    """(communication time, the part of it no other kernel ran beside) over (name, start, end) GPU kernels: the
    union of the communication kernels' intervals, and that union less its overlap with the compute kernels'."""
    communication = [(start, end) for name, start, end in kernels if kind_of(name) == "communication"]
    compute = [(start, end) for name, start, end in kernels if kind_of(name) != "communication"]
    both = union_length(communication) + union_length(compute) - union_length(communication + compute)
    return union_length(communication), union_length(communication) - both


class StepProfiler:
    """torch.profiler over `steps` training steps after PROFILE_WAIT (and one of the profiler's warm-up), with a
    report for this rank in out_dir; step() after every training step. steps=0: does nothing."""

    def __init__(self, steps: int, out_dir, rank: int, device: torch.device):
        self.steps, self.out_dir, self.rank, self.device = steps, Path(out_dir), rank, device
        self.calls, self.times, self.profile = 0, {}, None
        if steps:
            on_gpu = device.type == "cuda"
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
            plan = schedule(wait=PROFILE_WAIT, warmup=1, active=steps, repeat=1)
            self.profile = profile(activities=activities, schedule=plan, on_trace_ready=self.write)

    def __enter__(self):
        if self.profile is not None:
            self.profile.__enter__()
        return self

    def __exit__(self, *exc):
        if self.profile is None:
            return
        if self.calls <= PROFILE_WAIT + 1 and self.rank == 0:
            print(f"profile_steps: nothing recorded, the run ended before step {PROFILE_WAIT + 2}", flush=True)
        self.profile.__exit__(*exc)  # a run that ends inside the recorded steps reports the ones it took

    def step(self) -> None:
        if self.profile is None:
            return
        self.calls += 1
        if self.calls in (PROFILE_WAIT + 1, PROFILE_WAIT + 1 + self.steps):  # the recorded steps' bounds
            synchronize(self.device)
            self.times[self.calls] = time.perf_counter()
        self.profile.step()

    def write(self, prof) -> None:
        """This rank's report and trace, once the recorded steps are done."""
        if self.calls <= PROFILE_WAIT + 1:  # the run ended in the profiler's warm-up: nothing recorded (said on exit)
            return
        if len(self.times) == 1:  # the run ended inside the recorded steps
            synchronize(self.device)
            self.times[self.calls] = time.perf_counter()
        (start, first), (end, last) = sorted(self.times.items())
        self.steps = end - start
        wall_ms = (last - first) * 1000 / max(1, self.steps)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        stem = self.out_dir / f"profile-rank{self.rank}"
        report_path = stem.with_suffix(".md")
        report_path.write_text("\n".join(self.report(prof, wall_ms)) + "\n")
        plain = stem.with_suffix(".json")
        prof.export_chrome_trace(str(plain))
        with open(plain, "rb") as source, gzip.open(f"{plain}.gz", "wb") as packed:
            shutil.copyfileobj(source, packed)
        plain.unlink()
        if self.rank == 0:
            steps = f"{self.steps} steps" if self.steps != 1 else "1 step"
            print(f"profile of {steps}: {report_path} and {plain}.gz (a Chrome trace)", flush=True)

    def report(self, prof, wall_ms: float) -> list[str]:
        first = PROFILE_WAIT + 2
        lines = [f"# rank {self.rank}: steps {first}..{first + self.steps - 1} of this run", ""]
        if self.device.type == "cuda":
            kernels = [
                (event.name, event.time_range.start, event.time_range.end)
                for event in device_events(prof.events(), on_gpu=True)
            ]
            total, exposed = exposed_communication(kernels)
            lines += summarize(prof, self.steps, wall_ms, True, 25, "step")
            lines += ["", f"communication {total / 1000 / self.steps:.3f} ms/step, of which no other kernel ran "
                      f"beside {exposed / 1000 / self.steps:.3f} ms/step (not hidden)", ""]  # fmt: skip
            host = [e for e in prof.key_averages() if e.device_type.name == "CPU"]
            return lines + top_table("host ops", host, lambda e: e.self_cpu_time_total, self.steps, 25, "step")
        return lines + summarize(prof, self.steps, wall_ms, False, 25, "step")
