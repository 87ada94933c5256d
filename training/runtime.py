"""Where a run executes: device, compute dtype, DDP ranks, and the stop signals; and what the hardware can do
(peak FLOP/s, MFU, peak memory). train.py, sample.py and bench/ all pick their device here."""

from __future__ import annotations

import contextlib
import datetime
import gc
import os
import resource
import signal
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from errors import PeerFailed, Stopped, UsageError, silence
from model import peak_flops
from storage.checkpoint import format_bytes

DTYPES = ("auto", "bfloat16", "float16", "float32")
DIST_BACKENDS = ("nccl", "gloo")


# ----------------------------------------------------------------------------------------------
# Device, dtype, DDP


@dataclass
class Runtime:
    device: torch.device
    dtype: torch.dtype  # the compute dtype: autocast's, or float32 without autocast
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    context_parallel: int = 1  # ranks that split each sequence (training/context.py); they read the same data
    context_group: object = None  # this rank's group of context_parallel ranks, where that is more than 1

    @property
    def ddp(self) -> bool:
        return self.world_size > 1

    def shards(self, parallelism: str) -> bool:
        """Whether a run of this parallelism shards the model: FSDP under torchrun (one process trains it whole)."""
        return self.ddp and parallelism == "fsdp"

    @property
    def data_rank(self) -> int:
        """Which share of the data this rank reads: the ranks of one context-parallel group read the same."""
        return self.rank // self.context_parallel

    @property
    def data_ranks(self) -> int:
        return self.world_size // self.context_parallel

    def micro_steps(self, gradient_accumulation_steps: int) -> int:
        """This rank's micro-steps per optimizer step; the setting counts those of all ranks reading their own data."""
        return gradient_accumulation_steps // self.data_ranks

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
            return cuda_device(local_rank, "auto")
        mps = getattr(torch.backends, "mps", None)
        return torch.device("mps" if mps is not None and mps.is_available() else "cpu")
    try:
        device = torch.device(requested)
    except RuntimeError:
        raise UsageError(f"unknown device {requested!r}; allowed: {allowed}") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(f"device {requested!r} requested but CUDA is not available here; use --device=cpu")
        return cuda_device(device.index if device.index is not None else local_rank, requested)
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise UsageError(f"device {requested!r} requested but MPS is not available here; use --device=cpu")
    if device.type not in ("cpu", "cuda", "mps"):
        raise UsageError(f"unsupported device {requested!r}; allowed: {allowed}")
    return device


def cuda_device(index: int, requested: str) -> torch.device:
    """cuda:index, checked against the GPUs here: under torchrun, LOCAL_RANK picks the GPU, and a rank past the
    last GPU (more processes per node than GPUs) says so instead of failing at its first CUDA call."""
    count = torch.cuda.device_count()
    if index >= count:
        rank = f" (LOCAL_RANK={index})" if requested == "auto" or ":" not in requested else ""
        raise UsageError(
            f"device {requested!r}{rank} needs cuda:{index}, but this machine has {count} CUDA device(s); "
            f"start at most {count} processes per node (torchrun --nproc_per_node={count})"
        )
    return torch.device("cuda", index)


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
    device: str = "auto",
    dtype: str = "auto",
    dist_backend: str = "nccl",
    gradient_accumulation_steps: int = 1,
    timeout_s: float | None = None,
    context_parallel: int = 1,
) -> Runtime:
    """This process's device and dtype; under torchrun (WORLD_SIZE > 1) also joins the process group, whose
    collectives give up after timeout_s (None: torch's default), and with context_parallel > 1 the groups of that
    many consecutive ranks that split each sequence."""
    world_size = env_int("WORLD_SIZE", 1, low=1)
    rank, local_rank = env_int("RANK", 0, low=0), env_int("LOCAL_RANK", 0, low=0)
    check_ranks(rank, world_size, context_parallel, gradient_accumulation_steps)
    picked = pick_device(device, local_rank)
    if world_size > 1:
        if dist_backend == "nccl" and picked.type != "cuda":
            raise UsageError(f"dist_backend nccl needs CUDA devices (device is {picked.type}); use --dist_backend=gloo")
        if picked.type == "cuda":
            torch.cuda.set_device(picked)
        try:
            join_process_group(dist_backend, timeout_s)
        except (ValueError, RuntimeError) as error:  # no MASTER_ADDR, an unreachable or timed-out rendezvous
            reason = str(error).strip().splitlines()[0][:200] if str(error).strip() else type(error).__name__
            raise UsageError(
                f"cannot join the process group of {world_size} ranks ({reason}); start with torchrun"
            ) from None
    if picked.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # TF32 for any float32 matmul left outside autocast
        torch.backends.cudnn.allow_tf32 = True
    runtime = Runtime(picked, pick_dtype(dtype, picked), rank, local_rank, world_size, context_parallel)
    if context_parallel > 1:  # every rank takes part in making every group
        groups = [
            dist.new_group(list(range(first, first + context_parallel)))
            for first in range(0, world_size, context_parallel)
        ]
        runtime.context_group = groups[runtime.data_rank]
    return runtime


def check_ranks(rank: int, world_size: int, context_parallel: int, gradient_accumulation_steps: int) -> None:
    """torchrun's rank against its world size, and the world size against the settings that divide it."""
    if rank >= world_size:
        raise UsageError(f"environment variable RANK={rank} must be below WORLD_SIZE={world_size}")
    if world_size % context_parallel:
        raise UsageError(
            f"context_parallel={context_parallel} needs a multiple of {context_parallel} ranks, but there are "
            f"{world_size}; start with torchrun --nproc_per_node={context_parallel} (or a multiple of it)"
        )
    data_ranks = world_size // context_parallel
    if world_size > 1 and gradient_accumulation_steps % data_ranks:
        of_data = " reading their own data (ranks / context_parallel)" if context_parallel > 1 else ""
        raise UsageError(
            f"gradient_accumulation_steps ({gradient_accumulation_steps}) must be a "
            f"multiple of the number of ranks{of_data} ({data_ranks})"
        )


def join_process_group(dist_backend: str, timeout_s: float | None = None) -> None:
    """Joins the process group that torchrun's environment describes (MASTER_ADDR, RANK, WORLD_SIZE)."""
    # Imported first: functions here take group=group.WORLD as a default argument, read on import. DDP and FSDP's
    # grad scaler import them after the group exists, and the defaults then keep it alive past destroy_process_group:
    # its threads outlive the interpreter, and a gloo thread still running at exit can abort the process
    # ("terminate called without an active exception") after a run that finished.
    import torch.distributed.fsdp.sharded_grad_scaler  # noqa: F401
    import torch.distributed.nn  # noqa: F401

    timeout = datetime.timedelta(seconds=timeout_s) if timeout_s else None
    dist.init_process_group(backend=dist_backend, timeout=timeout)


def leave_process_group() -> None:
    """Destroys the process group, and with it its threads: left running, they would meet the interpreter's exit
    (see join_process_group). What else still holds the group is let go of first."""
    gc.collect()  # FSDP's modules hold it in reference cycles
    device_mesh = sys.modules.get("torch.distributed.device_mesh")
    if device_mesh is not None:  # DTensor's caches keep FSDP's meshes, and each its table of groups (torch 2.13)
        # by type, not isinstance: DeviceMesh's metaclass check warns about some objects of torch's
        for obj in gc.get_objects():
            if device_mesh.DeviceMesh in type(obj).__mro__:
                getattr(obj, "_pg_registry", {}).clear()
    dist.destroy_process_group()


def env_int(name: str, default: int, *, low: int) -> int:
    """An integer environment variable that torchrun sets (RANK, WORLD_SIZE, ...); UsageError if it is garbage."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < low:
        raise UsageError(
            f"environment variable {name}={text!r} must be an integer >= {low}; torchrun sets it, "
            f"so unset it to run one process, or start with torchrun"
        )
    return value


def agree(runtime: Runtime, error: Exception | None) -> None:
    """Raise on every rank when any rank failed, so that no rank waits forever in a collective for a peer that
    has given up. The failing rank raises its own error (rank 0's wins, so the message is printed once); the
    others raise PeerFailed, which main() does not print."""
    if runtime.ddp:
        reports = [None] * runtime.world_size
        dist.all_gather_object(reports, None if error is None else str(error))
        first = next((report for report in reports if report is not None), None)
        if first is not None:
            dist.barrier()  # every rank has read the reports before any rank leaves and closes its connections
        if first is not None and (error is None or (not runtime.master and reports[0] is not None)):
            raise PeerFailed(first)
    if error is not None:
        raise error


@contextlib.contextmanager
def naming_the_failed_rank(runtime: Runtime, wait_s: float = 3.0):
    """Around the training loop: when a rank fails, the others' next collective fails too (the connection
    closes, or dist_timeout_s passes). A rank that fails by itself writes its one line in the job's key-value
    store (torchrun's, which outlives the workers); the others, whose collective broke, look there (for up to
    wait_s) and one of them prints `error: rank R failed: ...`, or, when no rank said why (one was killed or
    hangs), that it lost contact with the others; they exit quietly, without the traceback of the collective."""
    try:
        yield
    except PeerFailed:
        raise
    except Exception as error:
        if not runtime.ddp:
            raise
        key = f"train/failed/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"  # one key per (re)start
        try:
            store = dist.distributed_c10d._get_default_store()
            if not is_communication_error(error):  # this rank's own failure: the first to say so is named
                mine = f"{runtime.rank}\t{one_line(error)}"
                if store.compare_set(key, "", mine).decode() == mine:
                    raise error
            deadline = time.monotonic() + wait_s
            while not store.check([key]) and time.monotonic() < deadline:  # check: no timeout warnings
                time.sleep(0.1)
            rank, line = store.get(key).decode().split("\t", 1) if store.check([key]) else (None, one_line(error))
        except (RuntimeError, ValueError) as lookup:  # RuntimeError covers DistStoreError: nobody said why
            if lookup is error:
                raise
            rank, line = None, one_line(error)
        if rank is None:
            emit(
                f"error: rank {runtime.rank} lost contact with the other ranks ({line}); one died or hangs",
                file=sys.stderr,
            )
            raise PeerFailed(line) from None
        if runtime.rank == (1 if rank == "0" else 0):
            emit(f"error: rank {rank} failed: {line}", file=sys.stderr)
        raise PeerFailed(f"rank {rank} failed: {line}") from None


def is_communication_error(error: BaseException) -> bool:
    """A collective that broke because a peer is gone or timed out (NCCL's DistError, gloo's RuntimeError)."""
    return isinstance(error, dist.DistError) or "third_party/gloo" in str(error)


def one_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0][:200] if text else type(error).__name__


def available_memory(device: torch.device) -> tuple[int, str]:
    """(bytes a run on `device` can use at most, what they are), or (0, '') where that is not known."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return free, f"{device} has {format_bytes(free)} free of {format_bytes(total)}"
    if device.type == "cpu":
        try:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):  # not on every platform
            return 0, ""
        return total, f"this machine has {format_bytes(total)} of RAM"
    return 0, ""


def emit(*values, file=None) -> None:
    """print(), flushed, as one write, for the run's output lines: unbuffered (PYTHONUNBUFFERED, as launchers often
    set it) print writes a line's text and its newline apart, and another process on the same pipe (another rank,
    torchrun) can write between them. A stream that fails must not stop a run: a closed stdout (`python train.py
    | head -1`: EPIPE), a terminal that went away (a dropped ssh session: EIO), a full disk (`> /dev/full`: ENOSPC)
    or a stream not open for writing (EBADF). The stream then goes to /dev/null and the run carries on without its
    lines (it still saves). Commands make their streams QuietStreams (errors.as_command), which never raise; this
    covers a run started in-process as well."""
    stream = file or sys.stdout
    try:
        stream.write(" ".join(map(str, values)) + "\n")
        stream.flush()
    except BlockingIOError:  # a non-blocking stream, full for now: this line is lost, not the stream
        pass
    except OSError:
        if not silence(stream):  # not a file descriptor: the rest of the process writes nothing to it
            for name in ("stdout", "stderr"):
                if getattr(sys, name) is stream:
                    setattr(sys, name, open(os.devnull, "w"))  # kept open for the rest of the process


# ----------------------------------------------------------------------------------------------
# Stop signals: at start-up they stop the run at once (StopOnSignals); from the first step on, the loop's
# StopFlags (progress.py) take them and the run saves first


STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGINT", "SIGHUP") if hasattr(signal, name))


def take_stop_signals(handler) -> dict:
    """`handler` for each stop signal; the handlers it replaced, to put back. A signal ignored when the command
    started stays ignored: `nohup python train.py` must outlive its terminal."""
    wanted = [sig for sig in STOP_SIGNALS if signal.getsignal(sig) is not signal.SIG_IGN]
    return {sig: signal.signal(sig, handler) for sig in wanted}


def give_back_stop_signals(previous: dict) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler)


class StopOnSignals:
    """Where there is nothing to save (a run's start-up, until the loop's StopFlags take over; sample.py): SIGTERM,
    SIGINT or SIGHUP raises Stopped at once, as Ctrl-C raises KeyboardInterrupt, and the `with` blocks it unwinds
    release what was held. A step that must not be cut in half (claiming out_dir: its lock and the folders it
    creates) runs under deferred(); a signal during it stops the run right after it. Signals ignored when the
    command starts stay ignored (nohup)."""

    def __init__(self):
        self.armed, self.deferring, self.pending = True, False, None
        self.previous = {}

    def __enter__(self):
        self.previous = take_stop_signals(self._on_signal)
        return self

    def __exit__(self, *exc):
        give_back_stop_signals(self.previous)

    def _on_signal(self, signum, frame):
        if not self.armed:  # past start-up: the loop's handlers had it; now the run is only letting go of out_dir
            return
        if self.deferring:
            self.pending = self.pending or signum
            return
        self.disarm()  # the unwinding that follows is not cut short by a repeated signal
        raise Stopped(signum)

    @contextlib.contextmanager
    def deferred(self):
        self.deferring = True
        try:
            yield
        finally:
            self.deferring = False
        if self.pending and self.armed:
            self.disarm()
            raise Stopped(self.pending)

    def disarm(self) -> None:
        """Start-up is over: the loop's handlers (StopFlags) take the signals, or the run is ending."""
        self.armed = False


# ----------------------------------------------------------------------------------------------
# Peak FLOP/s and MFU: dense bf16/fp16 tensor-core rates from the vendors' datasheets (model.PEAK_FLOPS)


def peak_flops_for(device: torch.device, dtype: torch.dtype, override: float | None) -> tuple[float, str]:
    """(peak FLOP/s of one device, '') or (0, why MFU cannot be given)."""
    if override:
        return override, ""
    if device.type != "cuda":
        return 0.0, f"no peak FLOP/s known for {device.type}; set --peak_flops to get MFU"
    if dtype == torch.float32:
        return 0.0, "the peak table is for bf16/fp16 tensor cores, this run is float32; set --peak_flops"
    flops = peak_flops(device)  # model.py's table (PEAK_FLOPS), which GPT.estimate_mfu reads too
    if flops:
        return flops, ""
    return 0.0, f"no peak FLOP/s known for {torch.cuda.get_device_name(device)!r}; set --peak_flops to get MFU"


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
