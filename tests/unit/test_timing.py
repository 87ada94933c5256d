"""kernels/timing.py: the one timer of auto's measurement and of every bench, on the CPU."""

from __future__ import annotations

import time

import torch

from kernels.timing import median_ms, timed

CPU = torch.device("cpu")


def test_median_ms_is_positive_and_grows_with_the_work():
    # sleep never returns early, and a busy machine adds its lateness to both: their gap is what must show
    short = median_ms(lambda: time.sleep(0.002), CPU, warmup_ms=1, rep_ms=30)
    long = median_ms(lambda: time.sleep(0.02), CPU, warmup_ms=1, rep_ms=100)
    assert 2 <= short < long and long >= 20
    assert long - short > 9  # 18 ms apart


def test_median_ms_clears_the_gradients_it_is_given_before_each_run():
    w = torch.ones(3, requires_grad=True)

    def step():
        (w * 2).sum().backward()
        assert torch.equal(w.grad, torch.full((3,), 2.0))  # one run's gradient, never accumulated

    assert median_ms(step, CPU, grad_to_none=[w], warmup_ms=1, rep_ms=5) > 0


def test_timed_returns_the_result_and_the_time_until_the_device_is_done():
    result, launch_ms, wall_ms = timed(lambda: time.sleep(0.01) or "done", CPU)
    assert result == "done" and 10 <= launch_ms <= wall_ms
