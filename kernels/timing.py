"""The one way this repo times code: auto's one-time measurement of the attention kernels and every bench.

median_ms: the median milliseconds of a call, through triton.testing.do_bench on CUDA (CUDA events around each
run, the L2 cache flushed before it) and torch.utils.benchmark.Timer elsewhere. timed: one call of a whole
step (a chunk of training steps, a prompt's first token) on the host clock, the device synchronised around it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch


def median_ms(
    fn: Callable[[], object],
    device: torch.device,
    grad_to_none: Sequence[torch.Tensor] = (),
    warmup_ms: float = 25,
    rep_ms: float = 100,
) -> float:
    """Median time of fn() in ms, after warm-up runs (a first call that compiles is one of them). grad_to_none:
    leaves whose .grad fn accumulates into, cleared before each run."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, grad_to_none=list(grad_to_none), return_mode="median"))
    from torch.utils.benchmark import Timer

    def run():
        for t in grad_to_none:
            t.grad = None
        fn()

    warmup_until = time.perf_counter() + warmup_ms / 1000
    run()
    while time.perf_counter() < warmup_until:
        run()
    # the process's own threads: Timer would time on one thread otherwise
    timer = Timer(stmt="run()", globals={"run": run}, num_threads=torch.get_num_threads())
    return timer.blocked_autorange(min_run_time=rep_ms / 1000).median * 1000


class Timed(NamedTuple):
    """What fn returned, the ms until it returned (the host's launch work) and until the device was done."""

    result: object
    launch_ms: float
    wall_ms: float


def timed(fn: Callable[[], object], device: torch.device) -> Timed:
    """One call of fn on the host clock, the device synchronised before and after."""
    synchronize(device)
    start = time.perf_counter()
    result = fn()
    launched = time.perf_counter()
    synchronize(device)
    return Timed(result, (launched - start) * 1e3, (time.perf_counter() - start) * 1e3)


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()
