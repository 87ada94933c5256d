"""
Train a GPT on one CPU or GPU, or on many GPUs with DDP.

    python train.py                                        # the embedded default: Shakespeare, chars, CPU-sized
    python train.py config/train_gpt2.py --batch_size=8    # a config file, then overrides
    torchrun --standalone --nproc_per_node=8 train.py config/train_gpt2.py
    python train.py --help                                 # every setting, its default and what it does

Every setting lives in TrainConfig below; config files and --key=value overrides only fill it. The loop is
train(); one optimizer step is train_step(), which bench/bench_train.py times as it is.
"""

from __future__ import annotations

import sys

from errors import as_command

if __name__ == "__main__":  # before torch's seconds of importing: see as_command
    as_command()

import contextlib
import dataclasses
import errno
import logging
import math
import textwrap
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

import generation  # noqa: F401  (registers paged_attention: a run may name it, for its checkpoint's sampling)
import kernels  # noqa: F401  (registers flash-attn 3/4, flex_attention and auto's table)
from configurator import load_config, parse_bool
from data.loader import Batches
from errors import CheckpointError, ConfigError, DataChanged, DataError, PeerFailed, UsageError, stream_failure
from model import GPT, GPTConfig
from storage.checkpoint import BEST, LATEST, checkpoint_names
from training.context import context_shard, use_context_parallel_attention
from training.parallel import (
    grad_scaler,
    gradient_sync,
    local_optimizer,
    place_model,
    replicated,
    shard_optimizer,
    wrap_model,
)
from training.preflight import (
    CUDA_GRAPH_MODES,
    check_before_training,
    check_checkpoint_shape,
    check_config,
    checkpoint_path,
    claim_run_out_dir,
    resolve_init_from,
    with_weights_shape,
)
from training.profiling import StepProfiler
from training.runtime import (
    Runtime,
    StopFlags,
    StopOnSignals,
    Stopped,
    agree,
    emit,
    leave_process_group,
    model_flops_utilization,
    naming_the_failed_rank,
    peak_flops_for,
    peak_memory_gib,
    setup_runtime,
    synchronize,
)
from training.state import restore_progress, write_checkpoint
from weights.lora import load_model_weights, setup_lora

log = logging.getLogger("train")


@dataclass
class TrainConfig:
    # ---- I/O ----
    out_dir: str = "out-shakespeare-char"  # checkpoints go here
    init_from: str = "scratch"  # scratch | resume | auto (resume if out_dir has a ckpt.pt) | fine-tune: .pt, HF, gpt2
    overwrite_out_dir: bool = False  # let a scratch or fine-tune run replace the checkpoints already in out_dir
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
    packed_documents: bool = False  # attention and positions stay inside each document of a batch's rows
    document_separator: int | None = None  # the token that ends each document; None: meta.json's eot_token
    # ---- model ----
    n_layer: int = 4  # transformer blocks
    n_head: int = 4  # attention heads
    n_embd: int = 128  # embedding width
    dropout: float = 0.0  # dropout rate; 0 for pretraining, 0.1+ for fine-tuning
    lora_rank: int = 0  # > 0: train only LoRA adapters of this rank on the frozen model (lora.py); 0: off
    lora_alpha: float = 16.0  # LoRA scaling: the adapters' update is multiplied by lora_alpha / lora_rank
    lora_targets: str = "c_attn,c_proj"  # layers that get adapters: comma-separated module-name suffixes
    lora_dropout: float = 0.0  # dropout on the adapters' input
    bias: bool = False  # biases in Linear and LayerNorm layers (GPT-2 has them)
    vocab_size: int | None = None  # None: from meta.json (GPT-2's 50257 is padded up to 50304)
    rope: bool = False  # rotary position embedding on q and k instead of learned positions (no wpe)
    rope_theta: float = 10000.0  # RoPE's base
    norm: str = "layernorm"  # layernorm (GPT-2) | rmsnorm
    mlp: str = "gelu"  # gelu (GPT-2) | swiglu
    mlp_hidden: int | None = None  # MLP hidden width; None: 4·n_embd for gelu, 8/3·n_embd (up to 64s) for swiglu
    n_kv_head: int | None = None  # key/value heads (GQA; 1 = MQA); None: n_head
    qk_norm: bool = False  # normalize q and k per head before attention
    attention_backend: str = (
        "auto"  # auto | flash_attn_4 | flash_attn_3 | flash_attn_2 | flex_attention | sdpa | manual
    )
    sdpa_kernel: str = "auto"  # pin one PyTorch SDPA kernel: auto | flash | cudnn | efficient | math (and the
    # context-parallel chunks': flash, cudnn, or for efficient and math SDPA under a lower-right mask)
    cross_entropy: str = "auto"  # plain (full logits) | chunked (lm_head + loss by rows) | auto: chunked if big
    activation_checkpointing: str = "none"  # recompute in backward to save memory: none | mlp | block
    disable_mps_fix: bool = False  # on MPS, let SDPA run with explicit (document) masks despite the NaN risk
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
    compile_mode: str = "default"  # default | reduce-overhead | max-autotune | max-autotune-no-cudagraphs
    compile_blocks: bool = False  # compile each block and the head apart: compiles faster; DDP all-reduces in backward
    dist_backend: str = "nccl"  # DDP backend under torchrun: nccl | gloo
    parallelism: str = "ddp"  # under torchrun: ddp (a model copy per GPU) | fsdp (weights and optimizer sharded)
    context_parallel: int = 1  # under torchrun: ranks that split each sequence, for contexts one GPU cannot hold
    ddp_bucket_cap_mb: float = 100.0  # DDP all-reduces gradients in buckets of this size
    ddp_graph_split: bool = False  # compiled DDP: a graph per bucket, all-reduce overlapping backward (bench/NOTES.md)
    fsdp_reshard_after_forward: bool = True  # FSDP frees gathered weights after forward; False: kept for backward
    fsdp_blocks_per_unit: int = 1  # FSDP gathers and reduces this many consecutive blocks at once (fewer hooks)
    ddp_reduce_dtype: str = "float32"  # DDP's gradient all-reduce: float32 | bfloat16 (half the traffic; NCCL only)
    shard_optimizer: bool = False  # DDP: each rank keeps AdamW state for, and steps, 1/N of the weights (ZeRO-1)
    dist_timeout_s: float = 600.0  # a rank waiting this long for the others in a collective gives up
    seed: int = 1337  # seeds the weights and the data stream (the same on every rank); dropout adds the rank
    peak_flops: float | None = None  # per-device peak FLOP/s for MFU; None: look up the GPU's name
    max_bad_steps: int = 5  # stop after this many consecutive steps with non-finite loss or gradients
    profile_steps: int = 0  # > 0: torch.profiler over this many steps (after 6) on every rank, reports in out_dir

    def __post_init__(self):
        check_config(self)

    def model_config(self, **override) -> GPTConfig:
        fields = {f.name for f in dataclasses.fields(GPTConfig)} - {"use_flash_attention"}
        values = {name: getattr(self, name) for name in fields if hasattr(self, name)}
        values["vocab_size"] = values["vocab_size"] or 50304
        return GPTConfig(**{**values, **override})


DEPRECATED = {  # old key: (new key, old value -> new value); configurator warns and maps them
    "use_flash_attention": (
        "attention_backend",
        lambda value: "flash_attn_2" if (parse_bool(value) if isinstance(value, str) else bool(value)) else "manual",
    ),
    "backend": ("dist_backend", lambda value: value),
}


# ----------------------------------------------------------------------------------------------
# Model and checkpoints


def build_model(cfg: TrainConfig, vocab_size: int, checkpoint: dict | None, *, shape_only: bool = False) -> GPT:
    """The model to train: fresh, or with a checkpoint's weights. shape_only: on the meta device, without
    weights or memory (the ranks of an FSDP run but 0, which get rank 0's weights as the model is sharded)."""
    model_config = with_weights_shape(cfg, checkpoint).model_config(vocab_size=vocab_size)
    if checkpoint is not None:
        check_checkpoint_shape(model_config, checkpoint["model_config"])
    if shape_only:
        with torch.device("meta"):
            return GPT(model_config)  # a checkpoint's longer context is cropped to this block_size on rank 0
    if checkpoint is None:
        return setup_lora(GPT(model_config), cfg, None, "")
    saved = checkpoint["model_config"]
    model = GPT(dataclasses.replace(model_config, block_size=saved["block_size"]))
    load_model_weights(model, checkpoint, checkpoint_path(cfg), keep_adapters=cfg.init_from == "resume")
    if cfg.block_size < saved["block_size"]:
        model.crop_block_size(cfg.block_size)
    return setup_lora(model, cfg, checkpoint, checkpoint_path(cfg))


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
        generator = torch.Generator().manual_seed((cfg.seed + 7919 * (runtime.data_rank + 1) + offset) % 2**64)
        total = torch.zeros((), device=runtime.device)
        for _ in range(cfg.eval_iters):
            batch = batches.get(split, generator)  # (x, y) or, packed, (x, y, doc_ids)
            with runtime.autocast():
                _, loss = model(*batch)
            total += loss.float()
        if runtime.ddp:
            dist.all_reduce(total)
        result[split] = total.item() / (cfg.eval_iters * runtime.world_size)
    model.train()
    return result


# ----------------------------------------------------------------------------------------------
# The training state and its step: train() and bench/bench_train.py share both


@dataclass
class TrainState:
    """Everything an optimizer step reads and changes."""

    cfg: TrainConfig
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

    @property
    def accum(self) -> int:
        """Micro-steps per optimizer step on this rank."""
        return self.runtime.micro_steps(self.cfg.gradient_accumulation_steps)


@dataclass
class Step:
    """What train_step reports; the tensors stay on the device (reading them would wait for the GPU)."""

    loss: torch.Tensor  # mean loss over the step's micro-batches, this rank
    grad_norm: torch.Tensor  # before clipping; inf/NaN when the step was skipped
    lr: float
    stop_requested: bool  # a rank got SIGTERM/SIGINT (as of the previous step)
    bad_streak: int  # consecutive non-finite steps (as of the previous step)


def build_train_state(cfg: TrainConfig, runtime: Runtime, model: GPT, next_batch: Callable) -> TrainState:
    """Place the model, resolve its attention for this device and dtype (before torch.compile, which then
    sees one backend), and build the compiled and DDP-wrapped (or FSDP-sharded) views, optimizer, GradScaler."""
    device = runtime.device
    model = place_model(
        model,
        runtime,
        cfg.parallelism,
        reshard_after_forward=cfg.fsdp_reshard_after_forward,
        blocks_per_unit=cfg.fsdp_blocks_per_unit,
    )
    attention = model.setup_attention(
        device, runtime.dtype, training=True, seq_len=cfg.block_size, documents=cfg.packed_documents, measure=True
    )
    use_context_parallel_attention(model, runtime, cfg.attention_backend, log)  # before torch.compile traces it
    # float16 needs the GradScaler's loss scaling; other dtypes keep its scale at exactly 1 (clip_and_step)
    scaled = runtime.dtype == torch.float16
    scaler = grad_scaler(
        model, device.type, init_scale=2.0**16 if scaled else 1.0, enabled=device.type in ("cuda", "cpu")
    )
    use_compile = cfg.compile if cfg.compile is not None else device.type == "cuda"
    eval_model, train_model = wrap_model(
        model,
        runtime,
        use_compile=use_compile,
        compile_mode=cfg.compile_mode,
        per_block=cfg.compile_blocks,
        bucket_cap_mb=cfg.ddp_bucket_cap_mb,
        graph_split=cfg.ddp_graph_split,
        reduce_dtype=cfg.ddp_reduce_dtype,
    )
    optimizer = build_optimizer(cfg, runtime, model)
    # Under CUDA graphs the compiled backward returns gradients in graph memory, which the next micro-step's replay
    # overwrites; taken as .grad they would be lost to accumulation (pytorch/pytorch#169545). With .grad buffers of
    # our own, every backward adds into them instead.
    own_grads = use_compile and cfg.compile_mode in CUDA_GRAPH_MODES
    if own_grads:
        for param in model.parameters():
            if param.requires_grad:
                param.grad = torch.zeros_like(param)
    state = TrainState(
        cfg, runtime, model, eval_model, train_model, optimizer, scaler, StopFlags(runtime), next_batch, attention
    )
    state.own_grads = own_grads
    return state


def build_optimizer(cfg: TrainConfig, runtime: Runtime, model: GPT) -> torch.optim.Optimizer:
    """The model's AdamW (configure_optimizers); with shard_optimizer under DDP, its state and step split over
    the ranks (ZeRO-1)."""
    betas = (cfg.beta1, cfg.beta2)
    optimizer = model.configure_optimizers(cfg.weight_decay, cfg.learning_rate, betas, runtime.device.type)
    if not cfg.shard_optimizer:
        return optimizer
    if not runtime.ddp:
        log.info("shard_optimizer: one process, nothing to shard; the optimizer steps as usual")
        return optimizer
    ranks = runtime.world_size
    log.info(
        f"optimizer step sharded over {ranks} ranks (ZeRO-1): each steps ~1/{ranks} of the weights, keeps their state"
    )
    return shard_optimizer(optimizer)


def train_step(state: TrainState) -> Step:
    """One optimizer step at state.iter_num's learning rate, over state.accum micro-batches; the last
    micro-step prefetches the next step's first batch. Non-finite gradients skip the update, on the device."""
    cfg, runtime = state.cfg, state.runtime
    lr = learning_rate_at(state.iter_num, cfg)
    for group in state.optimizer.param_groups:
        group["lr"] = lr
    batch = state.batch if state.batch is not None else state.next_batch()  # the model's arguments
    loss_sum = torch.zeros((), device=runtime.device)
    for micro_step in range(state.accum):
        last_micro_step = micro_step == state.accum - 1
        # gradients are averaged over ranks on the last micro-step only
        with gradient_sync(state.model, state.train_model, enabled=last_micro_step):
            with runtime.autocast():
                _, loss = state.train_model(*batch)
                loss = loss / state.accum
            batch = state.next_batch()  # prefetch while the GPU works
            state.scaler.scale(loss).backward()
        loss_sum += loss.detach()
    state.batch = batch
    grad_clip = cfg.grad_clip if cfg.grad_clip > 0 else math.inf
    grad_norm = clip_and_step(state.optimizer, state.scaler, state.model, grad_clip, runtime.dtype)
    state.optimizer.zero_grad(set_to_none=not state.own_grads)
    state.iter_num += 1
    stop_requested, bad_streak = state.stop.record(grad_norm + loss_sum)  # both non-finite-checked in one number
    return Step(loss_sum, grad_norm, lr, stop_requested, bad_streak)


def clip_and_step(
    optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler, model: torch.nn.Module, grad_clip: float, dtype
) -> torch.Tensor:
    """Clip the gradients to norm grad_clip and take the optimizer step, which inf/NaN gradients skip, decided
    on the device (no host sync). Returns the norm before clipping.
    float16 trains with a loss scale: the GradScaler unscales the gradients, then steps. With any other dtype
    the scale is 1 and a fused AdamW is told of a non-finite norm directly, through the attribute by which the
    GradScaler itself tells it (found_inf): one pass over all gradients less, per step. Under ZeRO the gradients
    are whole on every rank (DDP averaged them), so the norm is the global one; the flag goes to this rank's own
    AdamW, which steps its share of the parameters. Under FSDP the norm, and so the flag, is a DTensor replicated
    over the ranks, which the fused kernel takes beside the sharded parameters."""
    if dtype == torch.float16 or not optimizer.defaults.get("fused"):  # param groups agree (keep_kernels)
        scaler.unscale_(optimizer)
        grad_norm = replicated(torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip))
        if scaler.is_enabled():
            scaler.step(optimizer)
            scaler.update(None if dtype == torch.float16 else 1.0)
        elif torch.isfinite(grad_norm):  # no GradScaler for this device type: check on the host
            optimizer.step()
        return grad_norm
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)  # under FSDP a DTensor, as the flag
    fused = local_optimizer(optimizer)  # the fused AdamW itself, which reads found_inf
    fused.found_inf = (~torch.isfinite(grad_norm)).float()  # the fused kernel leaves everything as it was
    try:
        optimizer.step()
    finally:
        del fused.found_inf
    return replicated(grad_norm)


# ----------------------------------------------------------------------------------------------
# The run around the steps: setup or resume, evaluation and checkpoints, log lines, stops


def setup_or_resume(
    cfg: TrainConfig, runtime: Runtime, hold: contextlib.ExitStack, startup: StopOnSignals | None = None
) -> tuple[TrainState, Batches, dict]:
    """Data, model and optimizer state, from scratch or from a checkpoint; prints the run's header.
    Everything a user can get wrong is checked first, on every rank, and the ranks stop together if one
    fails; then rank 0 claims out_dir (held until `hold` closes; not cut in half by a stop signal that `startup`
    raises). Returns (state, batches, the dataset's meta)."""
    error = None
    try:
        checkpoint, data_dir, meta, vocab_size = check_before_training(cfg, runtime)
        batches = Batches(
            data_dir,
            cfg.batch_size,
            cfg.block_size,
            runtime.device,
            seed=cfg.seed,
            vocab_size=vocab_size,
            rank=runtime.data_rank,
            world_size=runtime.data_ranks,
            accum=runtime.micro_steps(cfg.gradient_accumulation_steps),
            shard=getattr(context_shard(runtime), "batch", None),  # context parallelism: this rank's part
            packed_documents=cfg.packed_documents,
            document_separator=cfg.document_separator,
        )
        torch.manual_seed(cfg.seed)  # the same initial weights on every rank
        shape_only = cfg.parallelism == "fsdp" and runtime.ddp and not runtime.master  # rank 0 builds for all
        model = build_model(cfg, vocab_size, checkpoint, shape_only=shape_only)
        torch.manual_seed((cfg.seed + runtime.rank) % 2**64)  # and each rank its own dropout
        with startup.deferred() if startup is not None else contextlib.nullcontext():
            claim_run_out_dir(cfg, runtime, model, hold)
    except (CheckpointError, DataError, UsageError) as failure:
        error = failure
    agree(runtime, error)
    resuming = checkpoint is not None and cfg.init_from == "resume"
    if runtime.master:
        print_header(cfg, runtime, model, checkpoint["iter_num"] if resuming else None)
    state = build_train_state(cfg, runtime, model, lambda: batches.get("train"))
    if resuming:
        restore_progress(state, batches, checkpoint)
    return state, batches, meta


def tokens_per_iter(cfg: TrainConfig) -> int:
    return cfg.gradient_accumulation_steps * cfg.batch_size * cfg.block_size  # over all ranks


def print_header(cfg: TrainConfig, runtime: Runtime, model: GPT, resume_iter: int | None) -> None:
    settings = " ".join(f"{k}={v}" for k, v in dataclasses.asdict(cfg).items())
    emit("config: " + textwrap.fill(settings, 110, subsequent_indent="  "))
    accum = runtime.micro_steps(cfg.gradient_accumulation_steps)
    split = f", each sequence split over {runtime.context_parallel} ranks" if runtime.context_parallel > 1 else ""
    emit(
        f"parameters: {model.num_params() / 1e6:.2f}M | tokens per iteration: {tokens_per_iter(cfg):,} "
        f"({runtime.data_ranks} ranks x {accum} micro-steps x {cfg.batch_size} x {cfg.block_size}{split}) | "
        f"device {runtime.device} {str(runtime.dtype).removeprefix('torch.')}"
        + (f" | resuming at iter {resume_iter}" if resume_iter is not None else "")
    )
    if cfg.compile is None and runtime.device.type != "cuda":
        emit(f"compile off on {runtime.device.type} (slow to compile for little gain there); --compile=true forces it")
    _, no_mfu_reason = peak_flops_for(runtime.device, runtime.dtype, cfg.peak_flops)
    if no_mfu_reason:
        emit(f"MFU n/a: {no_mfu_reason}")


def evaluation_due(state: TrainState) -> bool:
    cfg, it = state.cfg, state.iter_num
    return (it % cfg.eval_interval == 0 and (it > 0 or cfg.eval_on_start)) or it >= cfg.max_iters or cfg.eval_only


def evaluate_and_maybe_save(state: TrainState, batches: Batches, meta: dict, wandb) -> bool:
    """Eval line, then a checkpoint when val loss improved, at every evaluation with always_save_checkpoint, and
    at max_iters, so that a run always leaves its last state. Never at iter 0, in eval_only, twice for one
    iteration, or from a non-finite state. Returns False when the run's last state could not be saved."""
    cfg, runtime, it = state.cfg, state.runtime, state.iter_num
    losses = evaluate(state.eval_model, batches, cfg, runtime)
    if runtime.master:
        emit(f"eval {it} | train {losses['train']:.4f} | val {losses['val']:.4f}")
        if wandb:
            lr = learning_rate_at(it, cfg)
            wandb.log({"iter": it, "train/loss": losses["train"], "val/loss": losses["val"], "lr": lr})
    improved = losses["val"] < state.best_val_loss
    final = it >= cfg.max_iters
    if cfg.eval_only or it == 0 or it == state.ckpt_iter or not (improved or cfg.always_save_checkpoint or final):
        state.best_val_loss = min(state.best_val_loss, losses["val"])  # eval 0's: the loss to beat
        return True
    why_not = unsafe_to_save(state, losses)
    if why_not:  # best_val_loss stays that of a state on disk (or eval 0's)
        if runtime.master and final:
            emit(f"not saving iter {it}: {why_not}; {on_disk(state)}", file=sys.stderr)
        elif runtime.master:
            log.warning(f"not saving iter {it}: {why_not}; {on_disk(state)}")
        return not final
    previous_best, state.best_val_loss = state.best_val_loss, min(state.best_val_loss, losses["val"])
    path = write_checkpoint(state, batches, meta, improved)
    if runtime.master:
        note = ""
        if not improved:  # the last iteration's state, saved although it is not the best
            best = Path(cfg.out_dir) / BEST
            note = (
                f"; not below the best val {previous_best:.4f}, which {best} keeps"
                if best.exists()
                else f"; val never went below {previous_best:.4f}, the starting loss, so there is no {best}"
            )
        emit(f"saved {path} (iter {it}, val {losses['val']:.4f}{note})")
    return True


def unsafe_to_save(state: TrainState, losses: dict[str, float]) -> str:
    """Why the current state must not become a checkpoint ('' when it may): a non-finite eval loss, or skipped
    non-finite steps just before (the same answer on every rank)."""
    if not (math.isfinite(losses["train"]) and math.isfinite(losses["val"])):
        return f"the eval loss is not finite (train {losses['train']:.4f}, val {losses['val']:.4f})"
    bad_streak = state.stop.bad_streak_now()
    if bad_streak:
        return f"the last {bad_streak} step(s) had non-finite loss or gradients"
    return ""


def on_disk(state: TrainState) -> str:
    """What out_dir holds of this run, for the last words of a run that could not save its last state."""
    latest = Path(state.cfg.out_dir) / LATEST
    if state.ckpt_iter is None:
        return "this run saved no checkpoint" + (
            f" ({latest} is an earlier run's, unchanged)" if latest.exists() else ""
        )
    if state.ckpt_iter == state.resumed_iter:
        return f"{latest} still holds iter {state.ckpt_iter}, the checkpoint this run resumed from"
    return f"{latest} holds iter {state.ckpt_iter}, the last state this run saved"


def out_dir_state(out_dir, unchanged: bool = True) -> str:
    """What out_dir holds (unchanged: and that this run wrote none of it), for a run's last words."""
    path = Path(out_dir)
    if not path.is_dir():
        return f"out_dir {path} does not exist"
    names = checkpoint_names(path)
    return f"out_dir {path} holds " + (
        ", ".join(names) + (", unchanged" if unchanged else "") if names else "no checkpoint"
    )


def nothing_saved(state: TrainState) -> str:
    """The last line of a run that ends without a checkpoint of its last iteration (eval_only, max_iters=0, or
    resumed at max_iters already): why, and what is on disk."""
    cfg, it = state.cfg, state.iter_num
    if cfg.eval_only:
        return f"eval_only: no checkpoint written; {out_dir_state(cfg.out_dir)}"
    if state.resumed_iter is not None and it == state.resumed_iter:
        return (
            f"nothing to train: resumed at iter {it} and max_iters={cfg.max_iters}; no checkpoint written; "
            f"{Path(cfg.out_dir) / LATEST} still holds iter {it}"
        )
    return f"max_iters={cfg.max_iters}: no step taken, no checkpoint written; {out_dir_state(cfg.out_dir)}"


def too_many_bad_steps(state: TrainState, bad_streak: int) -> bool:
    """Warn about skipped non-finite steps; True (after saying why) once there were max_bad_steps in a row."""
    cfg, master = state.cfg, state.runtime.master
    if master:
        log.warning(
            f"iter {state.iter_num - 1}: loss or gradients not finite for {bad_streak} consecutive "
            f"step(s); those steps were skipped"
        )
    if bad_streak < cfg.max_bad_steps:
        return False
    if master:
        emit(
            f"stopping at iter {state.iter_num}: {bad_streak} consecutive steps with non-finite loss or "
            f"gradients (max_bad_steps={cfg.max_bad_steps}); {on_disk(state)}",
            file=sys.stderr,
        )
    return True


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

    def step_done(self, iter_num: int) -> None:
        if iter_num == self.first_iter:  # wait for the first step once, and start the clock after it
            synchronize(self.device)
            now = time.time()
            self.first_step_s, self.last_time, self.last_iter = now - self.last_time, now, iter_num

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


def format_log_line(
    it: int, loss: float, lr: float, dt: float, tokens_per_sec: float, mfu: float | None, mem_gib: float
) -> str:
    mfu_text = f"{mfu * 100:.1f}%" if mfu is not None else "n/a"
    return (
        f"iter {it} | loss {loss:.4f} | lr {lr:.1e} | {dt * 1000:.1f} ms | {tokens_per_sec:,.0f} tok/s | "
        f"MFU {mfu_text} | mem {mem_gib:.1f} GiB"
    )


def log_step(state: TrainState, step: Step, throughput: Throughput, wandb) -> None:
    """The iter line (rank 0), with the loss averaged over ranks: the only host sync of a logged step."""
    runtime, it = state.runtime, state.iter_num
    loss = step.loss
    if runtime.ddp:
        dist.all_reduce(loss)
        loss /= runtime.world_size
    loss_value = loss.item()
    dt, tokens_per_sec, mfu = throughput.lap(it)
    if not runtime.master:
        return
    emit(format_log_line(it, loss_value, step.lr, dt, tokens_per_sec, mfu, peak_memory_gib(runtime.device)))
    if wandb:
        metrics = {"iter": it, "train/step_loss": loss_value, "lr": step.lr, "tokens_per_sec": tokens_per_sec}
        wandb.log({**metrics, **({"mfu": mfu} if mfu else {})})


def save_and_exit_on_signal(state: TrainState, batches: Batches, meta: dict) -> int:
    """Save (unless the last steps were non-finite: then say what is on disk) and return the exit code."""
    signal_name = state.stop.signal_name or "a stop signal"  # another rank may have got it
    bad_streak = state.stop.bad_streak_now()
    if bad_streak:
        if state.runtime.master:
            emit(
                f"received {signal_name}; not saving iter {state.iter_num}: the last {bad_streak} step(s) had "
                f"non-finite loss or gradients; {on_disk(state)}; exiting",
                file=sys.stderr,
            )
        return 1
    path = write_checkpoint(state, batches, meta, is_best=False)
    if state.runtime.master:
        emit(f"received {signal_name}; saved {path} at iter {state.iter_num}; exiting")
    return 0


def save_and_exit_on_data_change(state: TrainState, batches: Batches, meta: dict, change: DataChanged) -> int:
    """Save what the run trained (every step of it on the data as it was opened), say what changed; exit code 2."""
    saved = ""
    if state.iter_num not in (0, state.ckpt_iter, state.resumed_iter) and not state.stop.bad_streak_now():
        saved = f"saved {write_checkpoint(state, batches, meta, is_best=False)} at iter {state.iter_num}"
    if state.runtime.master:
        emit(f"error: {change}; {saved or on_disk(state)}; exiting", file=sys.stderr)
    return 2


# ----------------------------------------------------------------------------------------------
# The loop


def train(cfg: TrainConfig) -> int:
    """Train until max_iters (exit code 0; 1 if the last state is not finite), a signal (saves, then 0) or
    max_bad_steps non-finite steps in a row (1). out_dir is this run's alone until it returns. A signal before
    the first step raises Stopped, once out_dir is let go of again (and removed, if the run created it and left
    it empty). The last line says what is on disk."""
    with StopOnSignals() as startup, contextlib.ExitStack() as hold:
        try:
            cfg = resolve_init_from(cfg)
            runtime = setup_runtime(
                cfg.device,
                cfg.dtype,
                cfg.dist_backend,
                cfg.gradient_accumulation_steps,
                timeout_s=cfg.dist_timeout_s,
                context_parallel=cfg.context_parallel,
            )
            # rank 0 speaks for the job; the other ranks' warnings would repeat its own, unprefixed (Python's
            # last-resort handler prints them where logging is not set up), so they say errors only
            level = logging.INFO if runtime.master else logging.ERROR
            logging.basicConfig(level=level, format="%(levelname)s: %(message)s", force=True)
            state, batches, meta = setup_or_resume(cfg, runtime, hold, startup)
            wandb = start_wandb(cfg) if cfg.wandb_log and runtime.master else None
        except BaseException:
            startup.disarm()  # what `hold` lets go of is not cut short by another signal
            raise
        with state.stop.handling_signals(), naming_the_failed_rank(runtime):
            startup.disarm()  # from here on a signal finishes the step, saves and exits 0
            code = train_loop(state, batches, meta, wandb)
    if code == 0 and runtime.master and (state.ckpt_iter != state.iter_num or state.resumed_iter == state.iter_num):
        emit(nothing_saved(state))  # once out_dir is let go of: what it holds now (a run that saved said so last)
    return code


def train_loop(state: TrainState, batches: Batches, meta: dict, wandb) -> int:
    """Steps, evaluations and checkpoints until the run ends; its exit code."""
    cfg = state.cfg
    throughput = Throughput(state)
    with StepProfiler(cfg.profile_steps, cfg.out_dir, state.runtime.rank, state.runtime.device) as profiler:
        while True:
            try:
                if evaluation_due(state):
                    with throughput.paused():
                        batches.check_unchanged()  # the dataset's files, as the run opened them (DataChanged)
                        if not evaluate_and_maybe_save(state, batches, meta, wandb):
                            return 1
                if state.iter_num >= cfg.max_iters or cfg.eval_only:
                    return 0
                step = train_step(state)
            except DataChanged as change:  # raised alike on every rank: they save together
                return save_and_exit_on_data_change(state, batches, meta, change)
            throughput.step_done(state.iter_num)
            profiler.step()
            if step.bad_streak and too_many_bad_steps(state, step.bad_streak):
                return 1
            if state.iter_num % cfg.log_interval == 0 or step.stop_requested:
                log_step(state, step, throughput, wandb)
            if step.stop_requested:
                return save_and_exit_on_signal(state, batches, meta)


def start_wandb(cfg: TrainConfig):
    import wandb

    wandb.init(project=cfg.wandb_project, name=cfg.wandb_run_name, config=dataclasses.asdict(cfg))
    return wandb


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    cfg = None
    try:
        cfg = load_config(TrainConfig(), argv, deprecated=DEPRECATED)
        code = train(cfg)
        lost = stream_failure(sys.stdout)
        if lost is not None and lost.errno != errno.EPIPE:  # `| head` is a choice; a full disk is news
            emit(
                f"note: stdout could not be written ({lost.strerror or lost}), so the log lines were dropped; "
                f"the run went on: {out_dir_state(cfg.out_dir, unchanged=False)}",
                file=sys.stderr,
            )
        return code
    except PeerFailed:  # another rank failed and printed why
        return 2
    except (ConfigError, DataError, CheckpointError, UsageError) as error:
        emit(f"error: {error}", file=sys.stderr)
        return 2
    except Stopped as stop:  # a signal during start-up: nothing trained
        where = f"; {out_dir_state(cfg.out_dir)}" if cfg is not None else ""
        message = f"received {stop.signal_name} during start-up, before the first step: nothing saved{where}"
        emit(message, file=sys.stderr)
        return stop.exit_code
    except KeyboardInterrupt:  # Ctrl-C before train() took the signals (reading the config)
        emit("interrupted before training started: nothing saved", file=sys.stderr)
        return 130
    except torch.cuda.OutOfMemoryError:
        example = ""
        if cfg is not None and cfg.batch_size > 1:
            example = (
                f" (e.g. --batch_size={cfg.batch_size // 2} "
                f"--gradient_accumulation_steps={cfg.gradient_accumulation_steps * 2})"
            )
        emit(
            f"error: CUDA out of memory; lower --batch_size and raise --gradient_accumulation_steps by the same "
            f"factor{example}: same tokens per step, less memory; or shorten --block_size",
            file=sys.stderr,
        )
        return 2
    finally:
        if dist.is_initialized():
            leave_process_group()


if __name__ == "__main__":
    sys.exit(main())
