"""What train.py's loop keeps and reports from step to step: the state every step reads and changes (TrainState),
what one step reports (StepReport), stop requests agreed on by all ranks without a host sync per step (StopFlags),
and the run's header and iter lines with their time, tokens/s and MFU (Throughput)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import signal
import textwrap
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from kernels.timing import synchronize
from model import GPT
from training.runtime import (
    Runtime,
    emit,
    give_back_stop_signals,
    model_flops_utilization,
    peak_flops_for,
    peak_memory_gib,
    take_stop_signals,
)

log = logging.getLogger("train")


@dataclass
class TrainState:
    """Everything an optimizer step reads and changes."""

    cfg: Any  # train.py's TrainConfig: every setting of the run
    runtime: Runtime
    model: GPT  # the plain module: checkpoints save its state_dict (no _orig_mod. or module. prefixes)
    eval_model: torch.nn.Module  # compiled when compile is on
    train_model: torch.nn.Module  # eval_model, wrapped in DDP under torchrun
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    stop: StopFlags
    next_batch: Callable[[], tuple[torch.Tensor, ...]]  # the training stream: model arguments, (x, y[, doc_ids])
    attention: object  # what model.setup_attention resolved: .used (the backend that runs) and .reason
    iter_num: int = 0  # optimizer steps done
    best_val_loss: float = math.inf
    ckpt_iter: int | None = None  # the iteration out_dir/ckpt.pt holds, saved or resumed from by this run
    resumed_iter: int | None = None
    batch: tuple[torch.Tensor, ...] | None = None  # the next step's first micro-batch, prefetched
    own_grads: bool = False  # .grad buffers allocated once and zeroed in place (CUDA graphs: build_train_state)
    fp8: object = None  # training/fp8.py's Fp8Choice: .recipe (tensorwise, rowwise or off) and .reason
    compiled: str = ""  # how torch.compile took the model: 'per block' or 'whole model'; '' when not compiled

    @property
    def accum(self) -> int:
        """Micro-steps per optimizer step on this rank."""
        return self.runtime.micro_steps(self.cfg.gradient_accumulation_steps)


@dataclass
class StepReport:
    """What train_step reports; the tensors stay on the device (reading them would wait for the GPU)."""

    loss: torch.Tensor  # mean loss over the step's micro-batches, this rank
    grad_norm: torch.Tensor  # before clipping; inf/NaN when the step was skipped
    lr: float
    stop_requested: bool  # a rank got SIGTERM/SIGINT (as of the previous step)
    bad_streak: int  # consecutive non-finite steps (as of the previous step)


class StopFlags:
    """SIGTERM/SIGINT/SIGHUP set a flag; the step that is running finishes, then the loop saves and exits.

    Each step puts [signal seen, consecutive non-finite steps] in a device tensor (max over ranks)
    and copies it to pinned host memory without waiting; the host reads it one step later, when that
    copy has long finished. So no step waits for the GPU, and every rank stops at the same step.
    """

    def __init__(self, runtime: Runtime):
        self.runtime, self.signal_name = runtime, ""
        self.signal_seen = torch.zeros((), device=runtime.device)
        self.bad_streak = torch.zeros((), device=runtime.device)
        self.host = torch.zeros(2, pin_memory=runtime.device.type == "cuda")
        self.pending = None

    @contextlib.contextmanager
    def handling_signals(self):
        previous = take_stop_signals(self._on_signal)
        try:
            yield
        finally:
            give_back_stop_signals(previous)

    def _on_signal(self, signum, frame):
        self.signal_name = signal.Signals(signum).name
        signal.signal(signum, signal.SIG_DFL)  # a second signal stops at once

    def record(self, grad_norm: torch.Tensor) -> tuple[bool, int]:
        """Add this step's result; return (stop requested, consecutive bad steps) as of the previous step."""
        previous = self._read()
        bad = ~torch.isfinite(grad_norm)
        self.bad_streak = torch.where(bad, self.bad_streak + 1, torch.zeros_like(self.bad_streak))
        if self.signal_name:
            self.signal_seen.fill_(1.0)  # a kernel with the value as argument: no copy from host memory
        flags = torch.stack([self.signal_seen, self.bad_streak])
        if self.runtime.ddp:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        self.host.copy_(flags, non_blocking=True)
        self.pending = torch.cuda.Event() if self.runtime.device.type == "cuda" else None
        if self.pending is not None:
            self.pending.record()
        return previous

    def bad_streak_now(self) -> int:
        """Consecutive non-finite steps up to the last one, the maximum over ranks; waits for the device."""
        streak = self.bad_streak.clone()
        if self.runtime.ddp:
            dist.all_reduce(streak, op=dist.ReduceOp.MAX)
        return int(streak.item())

    def _read(self) -> tuple[bool, int]:
        if self.pending is not None:
            self.pending.synchronize()
        return bool(self.host[0] > 0), int(self.host[1])


# ----------------------------------------------------------------------------------------------
# What the run says: its header, then one line every log_interval steps


def tokens_per_iter(cfg) -> int:
    return cfg.gradient_accumulation_steps * cfg.batch_size * cfg.block_size  # over all ranks


def print_header(cfg, runtime: Runtime, model: GPT, resume_iter: int | None) -> None:
    settings = " ".join(f"{k}={v}" for k, v in dataclasses.asdict(cfg).items())
    emit("config: " + textwrap.fill(settings, 110, subsequent_indent="  "))
    accum = runtime.micro_steps(cfg.gradient_accumulation_steps)
    split = f", each sequence split over {runtime.context_parallel} ranks" if runtime.context_parallel > 1 else ""
    emit(
        f"parameters: {model.get_num_params() / 1e6:.2f}M | tokens per iteration: {tokens_per_iter(cfg):,} "
        f"({runtime.data_ranks} ranks x {accum} micro-steps x {cfg.batch_size} x {cfg.block_size}{split}) | "
        f"device {runtime.device} {str(runtime.dtype).removeprefix('torch.')}"
        + (f" | resuming at iter {resume_iter}" if resume_iter is not None else "")
    )
    if cfg.compile is None and runtime.device.type != "cuda":
        emit(f"compile off on {runtime.device.type} (slow to compile for little gain there); --compile=true forces it")
    _, no_mfu_reason = peak_flops_for(runtime.device, runtime.dtype, cfg.peak_flops)
    if no_mfu_reason:
        emit(f"MFU n/a: {no_mfu_reason}")


class Throughput:
    """Time per iteration, tokens/s and MFU, averaged over the iterations since the previous log line. Kept out
    of the averages: the run's first step (it compiles and allocates) and evaluations with their checkpoints."""

    def __init__(self, state: TrainState):
        cfg, runtime = state.cfg, state.runtime
        self.tokens_per_iter = tokens_per_iter(cfg)
        self.flops_per_iter = state.model.flops_per_token() * self.tokens_per_iter
        self.peak_flops, _ = peak_flops_for(runtime.device, runtime.dtype, cfg.peak_flops)
        self.devices, self.device = runtime.world_size, runtime.device
        self.last_time, self.last_iter = time.time(), state.iter_num
        self.first_iter, self.first_step_s = state.iter_num + 1, 0.0
        self.compiled = state.compiled

    def step_done(self, iter_num: int) -> None:
        if iter_num == self.first_iter:  # wait for the first step once, and start the clock after it
            synchronize(self.device)
            now = time.time()
            self.first_step_s, self.last_time, self.last_iter = now - self.last_time, now, iter_num
            if self.compiled:
                log.info(first_step_line(self.first_step_s, self.compiled))

    @contextlib.contextmanager
    def paused(self):
        synchronize(self.device)
        start = time.time()
        yield
        self.last_time += time.time() - start

    def lap(self, iter_num: int) -> tuple[float, float, float | None]:
        """(seconds per iteration, tokens/s, MFU or None) since the previous lap; the first step's own
        time when it is the only one."""
        now = time.time()
        dt = (now - self.last_time) / (iter_num - self.last_iter) if iter_num > self.last_iter else self.first_step_s
        self.last_time, self.last_iter = now, iter_num
        return (
            dt,
            self.tokens_per_iter / dt,
            model_flops_utilization(self.flops_per_iter, dt, self.peak_flops, self.devices),
        )


def first_step_line(seconds: float, compiled: str) -> str:
    """What the first step cost: its time, torch.compile's included (the step's own run is a small part of it)."""
    return f"first step {seconds:.1f} s, compile included (torch.compile {compiled})"


def format_log_line(
    it: int, loss: float, lr: float, dt: float, tokens_per_sec: float, mfu: float | None, mem_gib: float
) -> str:
    mfu_text = f"{mfu * 100:.1f}%" if mfu is not None else "n/a"
    return (
        f"iter {it} | loss {loss:.4f} | lr {lr:.1e} | {dt * 1000:.1f} ms | {tokens_per_sec:,.0f} tok/s | "
        f"MFU {mfu_text} | mem {mem_gib:.1f} GiB"
    )


def log_step(state: TrainState, report: StepReport, throughput: Throughput, wandb) -> None:
    """The iter line (rank 0), with the loss averaged over ranks: the only host sync of a logged step."""
    runtime, it = state.runtime, state.iter_num
    loss = report.loss
    if runtime.ddp:
        dist.all_reduce(loss)
        loss /= runtime.world_size
    loss_value = loss.item()
    dt, tokens_per_sec, mfu = throughput.lap(it)
    if not runtime.master:
        return
    emit(format_log_line(it, loss_value, report.lr, dt, tokens_per_sec, mfu, peak_memory_gib(runtime.device)))
    if wandb:
        metrics = {"iter": it, "train/step_loss": loss_value, "lr": report.lr, "tokens_per_sec": tokens_per_sec}
        wandb.log({**metrics, **({"mfu": mfu} if mfu else {})})


def start_wandb(cfg):
    """Weights & Biases for rank 0's eval and iter lines (wandb_log)."""
    import wandb

    wandb.init(project=cfg.wandb_project, name=cfg.wandb_run_name, config=dataclasses.asdict(cfg))
    return wandb
