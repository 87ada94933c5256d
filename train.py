"""
Train a GPT on one CPU or GPU, or on many GPUs with DDP.

    python train.py                                        # the embedded default: Shakespeare, chars, CPU-sized
    python train.py config/train_gpt2.py --batch_size=8    # a config file, then overrides
    torchrun --standalone --nproc_per_node=8 train.py config/train_gpt2.py
    python train.py --help                                 # every setting, its default and what it does

Every setting lives in TrainConfig below; config files and --key=value overrides only fill it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import logging
import math
import os
import resource
import signal
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from checkpoint import CheckpointError, capture_rng, load_checkpoint, restore_rng, save_checkpoint
from configurator import ConfigError, load_config, parse_bool
from data.common import DataError, open_split, read_meta
from model import GPT, GPTConfig

log = logging.getLogger("train")
DATA_ROOT = Path(__file__).resolve().parent / "data"


@dataclass
class TrainConfig:
    # ---- I/O ----
    out_dir: str = "out-shakespeare-char"  # checkpoints go here
    init_from: str = "scratch"  # scratch | resume (out_dir/ckpt.pt) | path to a .pt checkpoint to fine-tune from
    eval_interval: int = 250  # evaluate, and maybe checkpoint, every this many iterations
    eval_iters: int = 20  # batches per split in each evaluation
    eval_on_start: bool = True  # also evaluate before the first step
    eval_only: bool = False  # evaluate once and exit
    log_interval: int = 50  # one log line every this many iterations
    always_save_checkpoint: bool = False  # save at every evaluation, not only when val loss improves
    keep_last_k: int = 2  # numbered checkpoints to keep (best.pt is kept as well)
    wandb_log: bool = False  # log to Weights & Biases (pip install wandb; WANDB_MODE=offline works)
    wandb_project: str = "gpt"  # wandb project name
    wandb_run_name: str = "run"  # wandb run name
    # ---- data ----
    dataset: str = "shakespeare_char"  # a folder under data/ that has a prepare.py
    data_dir: str = ""  # folder with train.bin, val.bin, meta.json; empty means data/<dataset>
    gradient_accumulation_steps: int = 1  # micro-steps per optimizer step, over all ranks together
    batch_size: int = 12  # sequences per micro-step on each rank
    block_size: int = 64  # context length in tokens
    # ---- model ----
    n_layer: int = 4  # transformer blocks
    n_head: int = 4  # attention heads
    n_embd: int = 128  # embedding width
    dropout: float = 0.0  # dropout rate; 0 for pretraining, 0.1+ for fine-tuning
    bias: bool = False  # biases in Linear and LayerNorm layers (GPT-2 has them)
    vocab_size: int | None = None  # None: from meta.json (GPT-2's 50257 is padded up to 50304)
    attention_backend: str = (
        "auto"  # auto | flash_attn_4 | flash_attn_3 | flash_attn_2 | flex_attention | sdpa | manual
    )
    sdpa_kernel: str = "auto"  # pin one PyTorch SDPA kernel: auto | flash | cudnn | efficient | math
    # ---- optimizer ----
    learning_rate: float = 2e-3  # peak learning rate
    max_iters: int = 2000  # total optimizer steps
    weight_decay: float = 0.1  # AdamW weight decay on matrices and embeddings
    beta1: float = 0.9  # AdamW beta1
    beta2: float = 0.99  # AdamW beta2
    grad_clip: float = 1.0  # clip gradients at this global norm; 0 disables
    decay_lr: bool = True  # cosine decay after warmup; False keeps learning_rate constant
    warmup_iters: int = 100  # linear warmup steps
    lr_decay_iters: int = 2000  # steps until min_lr (usually = max_iters)
    min_lr: float = 1e-4  # learning rate at the end of the decay
    # ---- system ----
    device: str = "auto"  # auto (cuda > mps > cpu) | cpu | cuda | cuda:N | mps
    dtype: str = (
        "auto"  # auto (bfloat16 where supported, else float16 on GPUs, float32 on CPU) | bfloat16 | float16 | float32
    )
    compile: bool | None = None  # torch.compile the model; None: on for CUDA, off elsewhere
    backend: str = "nccl"  # DDP backend under torchrun: nccl | gloo
    seed: int = 1337  # base seed; each rank adds its rank
    peak_flops: float | None = None  # per-device peak FLOP/s for MFU; None: look up the GPU's name
    max_bad_steps: int = 5  # stop after this many consecutive steps with non-finite loss or gradients

    def __post_init__(self):
        positive = (
            "eval_interval",
            "eval_iters",
            "log_interval",
            "keep_last_k",
            "gradient_accumulation_steps",
            "batch_size",
            "block_size",
            "n_layer",
            "n_head",
            "n_embd",
            "max_bad_steps",
        )
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_iters", "warmup_iters", "lr_decay_iters"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.vocab_size is not None and self.vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1 or None, got {self.vocab_size}")
        for name in ("learning_rate", "min_lr", "weight_decay", "beta1", "beta2", "grad_clip", "dropout"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number, got {getattr(self, name)}")
        if not self.learning_rate > 0:
            raise ValueError(f"learning_rate must be > 0, got {self.learning_rate}")
        if self.decay_lr and not 0 <= self.min_lr <= self.learning_rate:
            raise ValueError(
                f"need 0 <= min_lr <= learning_rate when decay_lr is on, got "
                f"min_lr={self.min_lr}, learning_rate={self.learning_rate}"
            )
        if self.weight_decay < 0 or self.grad_clip < 0:
            raise ValueError("weight_decay and grad_clip must be >= 0")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            raise ValueError(f"beta1 and beta2 must be in [0, 1), got {self.beta1}, {self.beta2}")
        if self.decay_lr and self.warmup_iters > self.lr_decay_iters:
            raise ValueError(f"warmup_iters ({self.warmup_iters}) must be <= lr_decay_iters ({self.lr_decay_iters})")
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; choose one of {', '.join(DTYPES)}")
        if self.backend not in ("nccl", "gloo"):
            raise ValueError(f"unknown backend {self.backend!r}; choose nccl or gloo")
        if self.peak_flops is not None and not self.peak_flops > 0:
            raise ValueError(f"peak_flops must be > 0, got {self.peak_flops}")
        if not self.out_dir:
            raise ValueError("out_dir must not be empty")
        self.model_config()  # the model's own checks (head dim, backend names, ...)

    def model_config(self, **override) -> GPTConfig:
        fields = {f.name for f in dataclasses.fields(GPTConfig)} - {"use_flash_attention"}
        values = {name: getattr(self, name) for name in fields if hasattr(self, name)}
        values["vocab_size"] = values["vocab_size"] or 50304
        return GPTConfig(**{**values, **override})


DTYPES = ("auto", "bfloat16", "float16", "float32")
DEPRECATED = {
    "use_flash_attention": (
        "attention_backend",
        lambda value: "flash_attn_2" if (parse_bool(value) if isinstance(value, str) else bool(value)) else "manual",
    )
}


class UsageError(ValueError):
    """Bad input found after the config was read (device, data, checkpoint); one line, exit code 2."""


# ----------------------------------------------------------------------------------------------
# Peak FLOP/s for MFU: dense bf16/fp16 tensor-core rates from the vendors' datasheets

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


# ----------------------------------------------------------------------------------------------
# Runtime: device, dtype, DDP


@dataclass
class Runtime:
    device: torch.device
    dtype: torch.dtype
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


def pick_device(requested: str, local_rank: int) -> torch.device:
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
    if requested == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32  # CPU autocast is slow, and MPS mixed precision still has gaps
    if requested == "bfloat16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise UsageError("dtype bfloat16 is not supported on this GPU; use --dtype=float16")
    return getattr(torch, requested)


def setup_runtime(cfg: TrainConfig) -> Runtime:
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = pick_device(cfg.device, local_rank)
    if world_size > 1:
        if cfg.backend == "nccl" and device.type != "cuda":
            raise UsageError(f"backend nccl needs CUDA devices (device is {device.type}); use --backend=gloo")
        if cfg.gradient_accumulation_steps % world_size:
            raise UsageError(
                f"gradient_accumulation_steps ({cfg.gradient_accumulation_steps}) must be a "
                f"multiple of the number of ranks ({world_size})"
            )
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend=cfg.backend)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # TF32 for any float32 matmul left outside autocast
        torch.backends.cudnn.allow_tf32 = True
    return Runtime(device, pick_dtype(cfg.dtype, device), rank, local_rank, world_size)


# ----------------------------------------------------------------------------------------------
# Data: random windows of the token stream, from a generator whose state goes into checkpoints


class Batches:
    def __init__(self, data_dir: Path, cfg: TrainConfig, runtime: Runtime, vocab_size: int):
        self.data_dir, self.batch_size, self.block_size = data_dir, cfg.batch_size, cfg.block_size
        self.device = runtime.device
        for split in ("train", "val"):
            open_split(data_dir, split, cfg.block_size, vocab_size)  # validates; DataError names the fix
        self.generator = torch.Generator().manual_seed(cfg.seed + runtime.rank)

    def get(self, split: str, generator: torch.Generator | None = None):
        if generator is None:  # the training stream: remember where this batch starts, for checkpoints
            generator, self.state_before_last = self.generator, self.generator.get_state()
        # A fresh memmap per batch: a long-lived one grows the process's memory (numpy memmap leak).
        data = np.memmap(self.data_dir / f"{split}.bin", dtype=np.uint16, mode="r")
        starts = torch.randint(len(data) - self.block_size, (self.batch_size,), generator=generator).tolist()
        x = torch.from_numpy(np.stack([data[i : i + self.block_size] for i in starts]).astype(np.int64))
        y = torch.from_numpy(np.stack([data[i + 1 : i + 1 + self.block_size] for i in starts]).astype(np.int64))
        if self.device.type == "cuda":
            return x.pin_memory().to(self.device, non_blocking=True), y.pin_memory().to(self.device, non_blocking=True)
        return x.to(self.device), y.to(self.device)


def find_data(cfg: TrainConfig, runtime: Runtime) -> Path:
    """The dataset folder; runs the dataset's prepare (on rank 0, others wait) when its bins are missing."""
    if cfg.data_dir:
        data_dir = Path(cfg.data_dir)
        if not data_dir.is_dir():
            raise UsageError(f"data_dir {cfg.data_dir!r} is not a folder")
        return data_dir
    known = sorted(p.parent.name for p in DATA_ROOT.glob("*/prepare.py"))
    if cfg.dataset not in known:
        raise UsageError(f"unknown dataset {cfg.dataset!r}; choose one of {', '.join(known)} or set --data_dir")
    data_dir = DATA_ROOT / cfg.dataset
    missing = [name for name in ("train.bin", "val.bin", "meta.json") if not (data_dir / name).exists()]
    if missing and runtime.master:
        print(f"{data_dir}: {', '.join(missing)} missing; running python -m data.{cfg.dataset}.prepare", flush=True)
        importlib.import_module(f"data.{cfg.dataset}.prepare").main([])
    if missing and runtime.ddp:
        dist.barrier()
    return data_dir


# ----------------------------------------------------------------------------------------------
# Model and checkpoints

SHAPE_FIELDS = ("n_layer", "n_head", "n_embd", "vocab_size", "bias")


def model_vocab_size(cfg: TrainConfig, meta: dict) -> int:
    if cfg.vocab_size is not None:
        if cfg.vocab_size < meta["vocab_size"]:
            raise UsageError(f"vocab_size {cfg.vocab_size} is smaller than the dataset's {meta['vocab_size']}")
        return cfg.vocab_size
    vocab = meta["vocab_size"]
    return vocab if vocab < 1024 else -(-vocab // 64) * 64  # a multiple of 64 makes the big matmuls faster


def build_model(cfg: TrainConfig, vocab_size: int, checkpoint: dict | None) -> GPT:
    model_config = cfg.model_config(vocab_size=vocab_size)
    if checkpoint is None:
        return GPT(model_config)
    saved = checkpoint["model_config"]
    differ = [
        f"{k}={saved[k]} (config says {getattr(model_config, k)})"
        for k in SHAPE_FIELDS
        if saved.get(k) != getattr(model_config, k)
    ]
    if differ:
        raise UsageError(
            f"the checkpoint's model has another shape: {', '.join(differ)}; "
            f"use the same model settings or another out_dir"
        )
    if cfg.block_size > saved["block_size"]:
        raise UsageError(f"block_size {cfg.block_size} is larger than the checkpoint's {saved['block_size']}")
    model = GPT(dataclasses.replace(model_config, block_size=saved["block_size"]))
    model.load_state_dict(checkpoint["model"])
    if cfg.block_size < saved["block_size"]:
        model.crop_block_size(cfg.block_size)
    return model


def read_checkpoint(cfg: TrainConfig) -> dict | None:
    if cfg.init_from == "scratch":
        return None
    path = Path(cfg.out_dir) / "ckpt.pt" if cfg.init_from == "resume" else Path(cfg.init_from)
    if cfg.init_from != "resume" and not path.is_file():
        raise UsageError(f"init_from={cfg.init_from!r}: allowed are scratch, resume, or the path of a .pt checkpoint")
    return load_checkpoint(path)


def learning_rate_at(it: int, cfg: TrainConfig) -> float:
    """Linear warmup (non-zero at step 0), then cosine decay to min_lr."""
    if not cfg.decay_lr:
        return cfg.learning_rate
    if it < cfg.warmup_iters:
        return cfg.learning_rate * (it + 1) / (cfg.warmup_iters + 1)
    if it > cfg.lr_decay_iters:
        return cfg.min_lr
    progress = (it - cfg.warmup_iters) / max(1, cfg.lr_decay_iters - cfg.warmup_iters)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.learning_rate - cfg.min_lr)


@torch.no_grad()
def evaluate(model, batches: Batches, cfg: TrainConfig, runtime: Runtime) -> dict[str, float]:
    """Mean loss over eval_iters batches per split, averaged over ranks. The batches come from their own
    generator, re-seeded each time, so evaluation never shifts the training data stream."""
    model.eval()
    result = {}
    for offset, split in enumerate(("train", "val")):
        generator = torch.Generator().manual_seed(cfg.seed + 7919 * (runtime.rank + 1) + offset)
        total = torch.zeros((), device=runtime.device)
        for _ in range(cfg.eval_iters):
            x, y = batches.get(split, generator)
            with runtime.autocast():
                _, loss = model(x, y)
            total += loss.float()
        if runtime.ddp:
            dist.all_reduce(total)
        result[split] = total.item() / (cfg.eval_iters * runtime.world_size)
    model.train()
    return result


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
# Training


def format_log_line(
    it: int, loss: float, lr: float, dt: float, tokens_per_sec: float, mfu: float | None, mem_gib: float
) -> str:
    mfu_text = f"{mfu * 100:.1f}%" if mfu is not None else "n/a"
    return (
        f"iter {it} | loss {loss:.4f} | lr {lr:.1e} | {dt * 1000:.1f} ms | {tokens_per_sec:,.0f} tok/s | "
        f"MFU {mfu_text} | mem {mem_gib:.1f} GiB"
    )


def peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # peak RSS; Linux reports KiB


@dataclass
class Training:
    """What one optimizer step needs; train() and bench/bench_train.py build it the same way."""

    cfg: TrainConfig
    runtime: Runtime
    model: GPT  # the plain module: checkpoints save its state_dict (no _orig_mod. or module. prefixes)
    eval_model: torch.nn.Module  # compiled when compile is on
    train_model: torch.nn.Module  # eval_model, wrapped in DDP under torchrun
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    accum: int  # micro-steps per optimizer step on this rank


def build_training(cfg: TrainConfig, runtime: Runtime, model: GPT) -> Training:
    device = runtime.device
    model = model.to(device)
    optimizer = model.configure_optimizers(cfg.weight_decay, cfg.learning_rate, (cfg.beta1, cfg.beta2), device.type)
    # The GradScaler finds inf/NaN gradients on the device and skips that optimizer step without a host
    # sync (with fused AdamW). float16 needs its loss scaling; other dtypes keep the scale at exactly 1.
    scaled = runtime.dtype == torch.float16
    scaler = torch.amp.GradScaler(
        device.type, init_scale=2.0**16 if scaled else 1.0, enabled=device.type in ("cuda", "cpu")
    )
    use_compile = cfg.compile if cfg.compile is not None else device.type == "cuda"
    eval_model = torch.compile(model) if use_compile else model
    train_model = eval_model
    if runtime.ddp:
        from torch.nn.parallel import DistributedDataParallel

        train_model = DistributedDataParallel(eval_model, device_ids=[device.index] if device.type == "cuda" else None)
    return Training(
        cfg,
        runtime,
        model,
        eval_model,
        train_model,
        optimizer,
        scaler,
        cfg.gradient_accumulation_steps // runtime.world_size,
    )


def train_step(t: Training, x, y, next_batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One optimizer step over t.accum micro-batches, the first being (x, y); next_batch() draws the rest
    and, last, the next step's first. Returns (mean loss, gradient norm, next x, next y), on the device."""
    loss_sum = torch.zeros((), device=t.runtime.device)
    for micro_step in range(t.accum):
        last_micro_step = micro_step == t.accum - 1
        ddp_sync = contextlib.nullcontext() if (last_micro_step or not t.runtime.ddp) else t.train_model.no_sync()
        with ddp_sync:  # gradients are all-reduced on the last micro-step only
            with t.runtime.autocast():
                _, loss = t.train_model(x, y)
                loss = loss / t.accum
            x, y = next_batch()  # prefetch while the GPU works
            t.scaler.scale(loss).backward()
        loss_sum += loss.detach()
    t.scaler.unscale_(t.optimizer)
    grad_clip = t.cfg.grad_clip if t.cfg.grad_clip > 0 else math.inf
    grad_norm = torch.nn.utils.clip_grad_norm_(t.model.parameters(), grad_clip)
    if t.scaler.is_enabled():
        t.scaler.step(t.optimizer)  # skipped on the device when a gradient is inf/NaN
        if t.runtime.dtype == torch.float16:
            t.scaler.update()
        else:
            t.scaler.update(1.0)
    elif torch.isfinite(grad_norm):  # no GradScaler for this device type: check on the host
        t.optimizer.step()
    t.optimizer.zero_grad(set_to_none=True)
    return loss_sum, grad_norm, x, y


def train(cfg: TrainConfig) -> int:
    runtime = setup_runtime(cfg)
    if runtime.master:
        logging.basicConfig(level=logging.INFO, format="%(levelname)s: %(message)s", force=True)
    device = runtime.device
    tokens_per_iter = cfg.gradient_accumulation_steps * cfg.batch_size * cfg.block_size  # over all ranks

    if Path(cfg.out_dir).exists() and not Path(cfg.out_dir).is_dir():
        raise UsageError(f"out_dir {cfg.out_dir!r} exists and is not a folder")
    wandb = start_wandb(cfg) if cfg.wandb_log and runtime.master else None
    checkpoint = read_checkpoint(cfg)
    data_dir = find_data(cfg, runtime)
    meta = read_meta(data_dir)
    vocab_size = model_vocab_size(cfg, meta)
    batches = Batches(data_dir, cfg, runtime, vocab_size)

    torch.manual_seed(cfg.seed)  # the same initial weights on every rank
    t = build_training(cfg, runtime, build_model(cfg, vocab_size, checkpoint))
    model, optimizer, scaler = t.model, t.optimizer, t.scaler
    iter_num, best_val_loss = 0, float("inf")
    resuming = checkpoint is not None and cfg.init_from == "resume"
    if resuming:
        optimizer.load_state_dict(checkpoint["optimizer"])
        scaler.load_state_dict(checkpoint["scaler"])
        iter_num, best_val_loss = checkpoint["iter_num"], checkpoint["best_val_loss"]
        states = checkpoint["rng"]
        if len(states) == runtime.world_size:
            restore_rng(states[runtime.rank]["rng"])
            batches.generator.set_state(states[runtime.rank]["data"])
        elif runtime.master:
            log.warning(
                f"checkpoint was saved by {len(states)} ranks, this run has {runtime.world_size}: "
                f"data order and RNG streams start fresh"
            )
    checkpoint = None  # free the memory

    if runtime.master:
        settings = " ".join(f"{k}={v}" for k, v in dataclasses.asdict(cfg).items())
        print("config: " + textwrap.fill(settings, 110, subsequent_indent="  "))
        print(
            f"parameters: {model.num_params() / 1e6:.2f}M | tokens per iteration: {tokens_per_iter:,} "
            f"({runtime.world_size} ranks x {t.accum} micro-steps x {cfg.batch_size} x {cfg.block_size}) | "
            f"device {device} {str(runtime.dtype).removeprefix('torch.')}"
            + (f" | resuming at iter {iter_num}" if resuming else "")
        )
    with runtime.autocast():
        model.attention_for(device)  # logs the attention backend line, resolved for this device and dtype

    if cfg.compile is None and device.type != "cuda" and runtime.master:
        print(f"compile off on {device.type} (slow to compile for little gain there); --compile=true forces it")
    peak, no_mfu_reason = peak_flops_for(device, runtime.dtype, cfg.peak_flops)
    if runtime.master and no_mfu_reason:
        print(f"MFU n/a: {no_mfu_reason}")
    flops_per_iter = model.flops_per_token() * tokens_per_iter

    stop = StopFlags(runtime)
    x, y = batches.get("train")
    last_log_time, last_log_iter = time.time(), iter_num

    def save(is_best: bool) -> Path:
        ranks = [{"rng": capture_rng(), "data": batches.state_before_last}]  # draws the next step's batch
        if runtime.ddp:
            gathered = [None] * runtime.world_size
            dist.all_gather_object(gathered, ranks[0])
            ranks = gathered
        if not runtime.master:
            return Path(cfg.out_dir) / "ckpt.pt"
        state = {
            "model": model.state_dict(),
            "model_config": dataclasses.asdict(model.config),
            "optimizer": optimizer.state_dict(),
            "scaler": scaler.state_dict(),
            "iter_num": iter_num,
            "best_val_loss": best_val_loss,
            "config": dataclasses.asdict(cfg),
            "meta": meta,
            "rng": ranks,
        }
        return save_checkpoint(state, cfg.out_dir, iter_num, cfg.keep_last_k, is_best)

    with stop.handling_signals():
        while True:
            lr = learning_rate_at(iter_num, cfg)
            for group in optimizer.param_groups:
                group["lr"] = lr

            at_end = iter_num >= cfg.max_iters
            if (iter_num % cfg.eval_interval == 0 and (iter_num > 0 or cfg.eval_on_start)) or at_end or cfg.eval_only:
                losses = evaluate(t.eval_model, batches, cfg, runtime)
                if runtime.master:
                    print(f"eval {iter_num} | train {losses['train']:.4f} | val {losses['val']:.4f}", flush=True)
                    if wandb:
                        wandb.log(
                            {"iter": iter_num, "train/loss": losses["train"], "val/loss": losses["val"], "lr": lr}
                        )
                improved = losses["val"] < best_val_loss
                best_val_loss = min(best_val_loss, losses["val"])
                if iter_num > 0 and (improved or cfg.always_save_checkpoint):
                    path = save(improved)
                    if runtime.master:
                        print(f"saved {path} (iter {iter_num}, val {losses['val']:.4f})", flush=True)
            if cfg.eval_only or at_end:
                break

            loss_sum, grad_norm, x, y = train_step(t, x, y, lambda: batches.get("train"))
            iter_num += 1

            signalled, bad_streak = stop.record(grad_norm + loss_sum)  # both non-finite-checked in one number
            if bad_streak:
                if runtime.master:
                    log.warning(
                        f"iter {iter_num - 1}: loss or gradients not finite for {bad_streak} consecutive "
                        f"step(s); those steps were skipped"
                    )
                if bad_streak >= cfg.max_bad_steps:
                    if runtime.master:
                        print(
                            f"stopping at iter {iter_num}: {bad_streak} consecutive steps with non-finite loss or "
                            f"gradients (max_bad_steps={cfg.max_bad_steps}); the last good checkpoint in "
                            f"{cfg.out_dir} is untouched",
                            file=sys.stderr,
                            flush=True,
                        )
                    return 1

            if iter_num % cfg.log_interval == 0 or signalled:
                if runtime.ddp:
                    dist.all_reduce(loss_sum)
                    loss_sum /= runtime.world_size
                loss_value = loss_sum.item()
                now = time.time()
                dt = (now - last_log_time) / max(1, iter_num - last_log_iter)
                last_log_time, last_log_iter = now, iter_num
                tokens_per_sec = tokens_per_iter / dt
                mfu = flops_per_iter / dt / (peak * runtime.world_size) if peak else None
                if runtime.master:
                    print(
                        format_log_line(iter_num, loss_value, lr, dt, tokens_per_sec, mfu, peak_memory_gib(device)),
                        flush=True,
                    )
                    if wandb:
                        wandb.log(
                            {
                                "iter": iter_num,
                                "train/step_loss": loss_value,
                                "lr": lr,
                                "tokens_per_sec": tokens_per_sec,
                                **({"mfu": mfu} if mfu else {}),
                            }
                        )
            if signalled:
                path = save(False)
                if runtime.master:
                    print(
                        f"received {stop.signal_name or 'a stop signal'}; saved {path} at iter {iter_num}; exiting",
                        flush=True,
                    )
                return 0
    return 0


def start_wandb(cfg: TrainConfig):
    try:
        import wandb
    except ImportError:
        raise UsageError("wandb_log=True but the wandb package is not installed; pip install wandb") from None
    wandb.init(project=cfg.wandb_project, name=cfg.wandb_run_name, config=dataclasses.asdict(cfg))
    return wandb


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    cfg = None
    try:
        cfg = load_config(TrainConfig(), argv, deprecated=DEPRECATED)
        return train(cfg)
    except (ConfigError, DataError, CheckpointError, UsageError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except torch.cuda.OutOfMemoryError:
        example = ""
        if cfg is not None and cfg.batch_size > 1:
            example = (
                f" (e.g. --batch_size={cfg.batch_size // 2} "
                f"--gradient_accumulation_steps={cfg.gradient_accumulation_steps * 2})"
            )
        print(
            f"error: CUDA out of memory; lower --batch_size and raise --gradient_accumulation_steps by the same "
            f"factor{example}: same tokens per step, less memory; or shorten --block_size",
            file=sys.stderr,
        )
        return 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
