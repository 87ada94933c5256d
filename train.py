"""
Train a GPT on one CPU or GPU, or on many GPUs with DDP.

    python train.py                                        # the embedded default: Shakespeare, chars, CPU-sized
    python train.py config/train_gpt2.py --batch_size=8    # a config file, then overrides
    torchrun --standalone --nproc_per_node=8 train.py config/train_gpt2.py
    python train.py --help                                 # every setting, its default and what it does

Every setting lives in TrainConfig below; config files and --key=value overrides only fill it. Then the run,
train(), its loop, train_loop(), and one optimizer step, train_step() (python -m bench.train_step times it as it is).
One step reads three files: this one, training/parallel.py and training/progress.py; a run's end, training/ending.py.
"""

from __future__ import annotations

import sys

from errors import as_command

if __name__ == "__main__":  # before torch's seconds of importing: see as_command
    as_command()

import contextlib
import dataclasses
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

import generation  # noqa: F401  (registers paged_attention: a run may name it, for its checkpoint's sampling)
import kernels  # noqa: F401  (registers flash-attn 3/4, flex_attention and auto's table)
from configurator import load_config_and_explicit_keys, parse_bool
from data.loader import Batches
from errors import CheckpointError, DataChanged, DataError, UsageError
from model import GPT, GPTConfig
from training import ending, fp8, parallel
from training.context import context_shard, use_context_parallel_attention
from training.preflight import (
    CUDA_GRAPH_MODES,
    check_before_training,
    check_checkpoint_shape,
    check_config,
    checkpoint_path,
    claim_run_out_dir,
    compiles_per_block,
    resolve_init_from,
)
from training.profiling import StepProfiler
from training.progress import StepReport, StopFlags, Throughput, TrainState, log_step, print_header, start_wandb
from training.runtime import (
    Runtime,
    StopOnSignals,
    agree,
    emit,
    leave_process_group,
    naming_the_failed_rank,
    setup_runtime,
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
    eval_only: bool = False  # evaluate init_from's weights once and exit (resume, .pt, HF, gpt2; not scratch)
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
    fp8: str = "auto"  # FP8 matmuls (torchao): off | tensorwise | rowwise | auto (where measured faster; fp8.py)
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
    compile_blocks: bool | None = None  # compile per block; None: yes, but whole with CUDA graphs or ddp_graph_split
    dist_backend: str = "nccl"  # DDP backend under torchrun: nccl | gloo
    parallelism: str = "ddp"  # under torchrun: ddp (a model copy per GPU) | fsdp (weights and optimizer sharded)
    context_parallel: int = 1  # under torchrun: ranks that split each sequence, for contexts one GPU cannot hold
    ddp_bucket_cap_mb: float = 100.0  # DDP all-reduces gradients in buckets of this size
    ddp_graph_split: bool = False  # compiled DDP: a graph per bucket, all-reduce overlapping backward (bench/NOTES.md)
    fsdp_reshard_after_forward: bool = True  # FSDP frees gathered weights after forward; False: kept for backward
    fsdp_blocks_per_unit: int = 1  # FSDP gathers and reduces this many consecutive blocks at once (fewer hooks)
    fsdp_reduce_every_micro_step: bool = False  # FSDP: no unsharded float32 gradients kept between micro-steps
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
# The run, its loop and one step


def train(cfg: TrainConfig, explicit: frozenset[str] = frozenset()) -> int:
    """Train until max_iters (exit code 0; 1 if the last state is not finite), a signal (saves, then 0) or
    max_bad_steps non-finite steps in a row (1). out_dir is this run's alone until it returns. A signal before
    the first step raises Stopped, once out_dir is let go of again (and removed, if the run created it and left
    it empty). The last line says what is on disk. explicit: the settings the user set (configurator's
    load_config_and_explicit_keys); the model settings left out take a checkpoint's shape."""
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
            state, batches, meta = setup_or_resume(cfg, runtime, hold, startup, explicit)
            wandb = start_wandb(state.cfg) if cfg.wandb_log and runtime.master else None
        except BaseException:
            startup.disarm()  # what `hold` lets go of is not cut short by another signal
            raise
        with state.stop.handling_signals(), naming_the_failed_rank(runtime):
            startup.disarm()  # from here on a signal finishes the step, saves and exits 0
            code = train_loop(state, batches, meta, wandb)
    ending.say_if_nothing_saved(state, code)  # once out_dir is let go of: what it holds now
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
                report = train_step(state)
            except DataChanged as change:  # raised alike on every rank: they save together
                return ending.save_and_exit_on_data_change(state, batches, meta, change)
            throughput.step_done(state.iter_num)
            profiler.step()
            if report.bad_streak and ending.too_many_bad_steps(state, report.bad_streak):
                return 1
            if state.iter_num % cfg.log_interval == 0 or report.stop_requested:
                log_step(state, report, throughput, wandb)
            if report.stop_requested:
                return ending.save_and_exit_on_signal(state, batches, meta)


def train_step(state: TrainState) -> StepReport:
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
        # gradients are averaged over ranks on the last micro-step only (FSDP: on each, where asked)
        sync = parallel.gradient_sync(
            state.model, state.train_model, last_micro_step, sharded_every_step=cfg.fsdp_reduce_every_micro_step
        )
        with sync:
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
    return StepReport(loss_sum, grad_norm, lr, stop_requested, bad_streak)


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
    if dtype == torch.float16 or not optimizer.defaults.get("fused"):  # param groups agree (keep_run_settings)
        scaler.unscale_(optimizer)
        grad_norm = parallel.replicated(torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip))
        if scaler.is_enabled():
            scaler.step(optimizer)
            scaler.update(None if dtype == torch.float16 else 1.0)
        elif torch.isfinite(grad_norm):  # no GradScaler for this device type: check on the host
            optimizer.step()
        return grad_norm
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)  # under FSDP a DTensor, as the flag
    fused = parallel.local_optimizer(optimizer)  # the fused AdamW itself, which reads found_inf
    fused.found_inf = (~torch.isfinite(grad_norm)).float()  # the fused kernel leaves everything as it was
    try:
        optimizer.step()
    finally:
        del fused.found_inf
    return parallel.replicated(grad_norm)


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


# ----------------------------------------------------------------------------------------------
# Evaluation and checkpoints


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
    why_not = ending.unsafe_to_save(state, losses)
    if why_not:  # best_val_loss stays that of a state on disk (or eval 0's)
        ending.say_not_saved(state, why_not, final)
        return not final
    previous_best, state.best_val_loss = state.best_val_loss, min(state.best_val_loss, losses["val"])
    path = write_checkpoint(state, batches, meta, improved)
    ending.say_saved(state, path, losses["val"], previous_best, improved)
    return True


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
# Setting up: data, model, optimizer, from scratch or from a checkpoint


def setup_or_resume(
    cfg: TrainConfig,
    runtime: Runtime,
    hold: contextlib.ExitStack,
    startup: StopOnSignals | None = None,
    explicit: frozenset[str] = frozenset(),
) -> tuple[TrainState, Batches, dict]:
    """Data, model and optimizer state, from scratch or from a checkpoint; prints the run's header.
    Everything a user can get wrong is checked first, on every rank, and the ranks stop together if one
    fails; then rank 0 claims out_dir (held until `hold` closes; not cut in half by a stop signal that `startup`
    raises). Returns (state, batches, the dataset's meta)."""
    error = None
    try:
        cfg, checkpoint, data_dir, meta, vocab_size = check_before_training(cfg, runtime, explicit)
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
        sharded = runtime.shards(cfg.parallelism)  # rank 0 builds the whole model for all
        weights_bytes = 4 * cfg.model_config(vocab_size=vocab_size).parameter_count()
        device = parallel.build_device(runtime, weights_bytes, sharded=sharded)
        model = build_model(cfg, vocab_size, checkpoint, shape_only=sharded and not runtime.master, device=device)
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


def build_model(
    cfg: TrainConfig, vocab_size: int, checkpoint: dict | None, *, shape_only: bool = False, device="cpu"
) -> GPT:
    """The model to train, built and initialized on `device`: fresh, or with a checkpoint's weights. shape_only:
    on the meta device, without weights or memory (the ranks of an FSDP run but 0, which get rank 0's weights as
    the model is sharded). cfg has the checkpoint's shape already (check_before_training)."""
    model_config = cfg.model_config(vocab_size=vocab_size)
    if checkpoint is not None:
        check_checkpoint_shape(model_config, checkpoint["model_config"])
    if shape_only:
        with torch.device("meta"):
            return GPT(model_config)  # a checkpoint's longer context is cropped to this block_size on rank 0
    if checkpoint is None:
        with torch.device(device):
            return setup_lora(GPT(model_config), cfg, None, "")
    saved = checkpoint["model_config"]
    with torch.device(device):
        model = GPT(dataclasses.replace(model_config, block_size=saved["block_size"]))
    load_model_weights(model, checkpoint, checkpoint_path(cfg), keep_adapters=cfg.init_from == "resume")
    if cfg.block_size < saved["block_size"]:
        model.crop_block_size(cfg.block_size)
    return setup_lora(model, cfg, checkpoint, checkpoint_path(cfg))


def build_train_state(cfg: TrainConfig, runtime: Runtime, model: GPT, next_batch: Callable) -> TrainState:
    """Place the model, resolve its attention for this device and dtype (before torch.compile, which then
    sees one backend), and build the compiled and DDP-wrapped (or FSDP-sharded) views, optimizer, GradScaler."""
    device = runtime.device
    use_compile = cfg.compile if cfg.compile is not None else device.type == "cuda"
    lora, sharded = cfg.lora_rank > 0, runtime.shards(cfg.parallelism)
    fp8_choice = fp8.setup_fp8(model, cfg.fp8, device, runtime.dtype, compiled=use_compile, lora=lora, sharded=sharded)
    model = parallel.place_model(
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
    scaler = parallel.grad_scaler(
        model, device.type, init_scale=2.0**16 if scaled else 1.0, enabled=device.type in ("cuda", "cpu")
    )
    per_block = use_compile and compiles_per_block(cfg, sharded=sharded)
    eval_model, train_model = parallel.wrap_model(
        model,
        runtime,
        use_compile=use_compile,
        compile_mode=cfg.compile_mode,
        per_block=per_block,
        bucket_cap_mb=cfg.ddp_bucket_cap_mb,
        graph_split=cfg.ddp_graph_split,
        reduce_dtype=cfg.ddp_reduce_dtype,
    )
    compiled = ("per block" if per_block else "whole model") if use_compile else ""
    optimizer = build_optimizer(cfg, runtime, model)
    if fp8_choice.fsdp_all_gather:
        fp8.precompute_scales_after_each_step(optimizer, model)
    own_grads = use_compile and cfg.compile_mode in CUDA_GRAPH_MODES  # parallel.keep_own_grads says why
    if own_grads:
        parallel.keep_own_grads(model)
    state = TrainState(
        cfg, runtime, model, eval_model, train_model, optimizer, scaler, StopFlags(runtime), next_batch, attention
    )
    state.own_grads, state.fp8, state.compiled = own_grads, fp8_choice, compiled
    return state


def build_optimizer(cfg: TrainConfig, runtime: Runtime, model: GPT) -> torch.optim.Optimizer:
    """The model's AdamW (configure_optimizers); with shard_optimizer, its state and step split over the ranks."""
    betas = (cfg.beta1, cfg.beta2)
    optimizer = model.configure_optimizers(cfg.weight_decay, cfg.learning_rate, betas, runtime.device.type)
    return parallel.zero_optimizer(optimizer, runtime) if cfg.shard_optimizer else optimizer


def main(argv: list[str] | None = None) -> int:
    """The command: exit code 0 when the run ended well; what ended it early maps to a code and a line (exit_for)."""
    argv = sys.argv[1:] if argv is None else argv
    cfg = None
    try:
        cfg, explicit = load_config_and_explicit_keys(TrainConfig(), argv, deprecated=DEPRECATED)
        code = train(cfg, explicit)
        ending.say_if_stdout_lost(cfg.out_dir)
        return code
    except ending.RUN_FAILURES as error:
        code, line = ending.exit_for(error, cfg)
        if line:
            emit(line, file=sys.stderr)
        return code
    finally:
        if dist.is_initialized():
            leave_process_group()


if __name__ == "__main__":
    sys.exit(main())
