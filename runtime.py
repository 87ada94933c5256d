"""Where a run executes: device, compute dtype, DDP ranks, and stop requests agreed on by all ranks; and what
the hardware can do (peak FLOP/s, MFU, peak memory). train.py, sample.py and bench/ all pick their device here."""

from __future__ import annotations

import contextlib
import os
import resource
import signal
from dataclasses import dataclass

import torch
import torch.distributed as dist

DTYPES = ("auto", "bfloat16", "float16", "float32")
DIST_BACKENDS = ("nccl", "gloo")


class UsageError(ValueError):
    """Bad input found after the config was read (device, data, checkpoint); one line, exit code 2."""


# ----------------------------------------------------------------------------------------------
# Device, dtype, DDP


@dataclass
class Runtime:
    device: torch.device
    dtype: torch.dtype  # the compute dtype: autocast's, or float32 without autocast
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1

    @property
    def ddp(self) -> bool:
        return self.world_size > 1

    @property
    def master(self) -> bool:
        return self.rank == 0

    def autocast(self):
        if self.dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.dtype)


def pick_device(requested: str, local_rank: int = 0) -> torch.device:
    """auto (cuda > mps > cpu) | cpu | cuda | cuda:N | mps; UsageError, naming the fix, when it is not here."""
    allowed = "auto, cpu, cuda, cuda:N, mps"
    if requested == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", local_rank)
        mps = getattr(torch.backends, "mps", None)
        return torch.device("mps" if mps is not None and mps.is_available() else "cpu")
    try:
        device = torch.device(requested)
    except RuntimeError:
        raise UsageError(f"unknown device {requested!r}; allowed: {allowed}") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(f"device {requested!r} requested but CUDA is not available here; use --device=cpu")
        index = device.index if device.index is not None else local_rank
        if index >= torch.cuda.device_count():
            raise UsageError(f"device {requested!r}: only {torch.cuda.device_count()} CUDA device(s) here")
        return torch.device("cuda", index)
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise UsageError(f"device {requested!r} requested but MPS is not available here; use --device=cpu")
    if device.type not in ("cpu", "cuda", "mps"):
        raise UsageError(f"unsupported device {requested!r}; allowed: {allowed}")
    return device


def pick_dtype(requested: str, device: torch.device) -> torch.dtype:
    """auto: bfloat16 where the GPU has it, else float16 on GPUs; float32 on CPU and MPS."""
    if requested not in DTYPES:
        raise UsageError(f"unknown dtype {requested!r}; choose one of {', '.join(DTYPES)}")
    if requested == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32  # CPU autocast is slow, and MPS mixed precision still has gaps
    if requested == "bfloat16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise UsageError("dtype bfloat16 is not supported on this GPU; use --dtype=float16")
    return getattr(torch, requested)


def setup_runtime(
    device: str = "auto", dtype: str = "auto", dist_backend: str = "nccl", gradient_accumulation_steps: int = 1
) -> Runtime:
    """This process's device and dtype; under torchrun (WORLD_SIZE > 1) also joins the process group."""
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    picked = pick_device(device, local_rank)
    if world_size > 1:
        if dist_backend == "nccl" and picked.type != "cuda":
            raise UsageError(f"dist_backend nccl needs CUDA devices (device is {picked.type}); use --dist_backend=gloo")
        if gradient_accumulation_steps % world_size:
            raise UsageError(
                f"gradient_accumulation_steps ({gradient_accumulation_steps}) must be a "
                f"multiple of the number of ranks ({world_size})"
            )
        if picked.type == "cuda":
            torch.cuda.set_device(picked)
        dist.init_process_group(backend=dist_backend)
    if picked.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # TF32 for any float32 matmul left outside autocast
        torch.backends.cudnn.allow_tf32 = True
    return Runtime(picked, pick_dtype(dtype, picked), rank, local_rank, world_size)


# ----------------------------------------------------------------------------------------------
# Stop requests: signals, and non-finite steps, agreed on by all ranks without a sync per step


class StopFlags:
    """SIGTERM/SIGINT set a flag; the step that is running finishes, then the loop saves and exits.

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
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

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

    def _read(self) -> tuple[bool, int]:
        if self.pending is not None:
            self.pending.synchronize()
        return bool(self.host[0] > 0), int(self.host[1])


# ----------------------------------------------------------------------------------------------
# Peak FLOP/s and MFU: dense bf16/fp16 tensor-core rates from the vendors' datasheets

PEAK_FLOPS = (  # (name fragment, FLOP/s); the first fragment found in the GPU's name wins
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("GH200", 989.5e12),
    ("H200", 989.5e12),
    ("H100", 989.5e12),
    ("H800", 989.5e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("L40", 181e12),
    ("L4", 121e12),
    ("A10G", 70e12),
    ("A10", 125e12),
    ("RTX 4090", 165.2e12),
    ("RTX 3090", 71e12),
    ("TITAN RTX", 130e12),
    ("T4", 65e12),
    ("V100", 125e12),
)


def peak_flops_for(device: torch.device, dtype: torch.dtype, override: float | None) -> tuple[float, str]:
    """(peak FLOP/s of one device, '') or (0, why MFU cannot be given)."""
    if override:
        return override, ""
    if device.type != "cuda":
        return 0.0, f"no peak FLOP/s known for {device.type}; set --peak_flops to get MFU"
    name = torch.cuda.get_device_name(device)
    if dtype == torch.float32:
        return 0.0, "the peak table is for bf16/fp16 tensor cores, this run is float32; set --peak_flops"
    for fragment, flops in PEAK_FLOPS:
        if fragment.lower() in name.lower():
            return flops, ""
    return 0.0, f"no peak FLOP/s known for {name!r}; set --peak_flops to get MFU"


def model_flops_utilization(
    flops_per_iter: float, seconds_per_iter: float, peak_flops: float, devices: int = 1
) -> float | None:
    """Model FLOPs (model.flops_per_token x tokens) per second over the peak of all devices; None without a peak."""
    if not peak_flops:
        return None
    return flops_per_iter / seconds_per_iter / (peak_flops * devices)


def peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # peak RSS; Linux reports KiB
