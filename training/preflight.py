"""
Checks before training: every setting, and everything about the machine, the dataset, the checkpoint and out_dir
that a user can get wrong, found before a weight is allocated or a checkpoint written, each in one line.

TrainConfig runs check_config when it is built. train.setup_or_resume runs check_before_training, builds the
model (check_checkpoint_shape), then claim_run_out_dir, on every rank, and the ranks stop together if one fails.
The mechanics live where their data does: out_dir's lock, write probe, free-space check and overwrite refusal,
and the tokenizer comparison in checkpoint.py; torchrun's environment in runtime.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import pickle
from pathlib import Path

from data.common import read_meta
from data.loader import ensure_dataset
from errors import CheckpointError, UsageError
from model import GPT, GPTConfig
from storage.checkpoint import (
    FILES_PER_SAVE,
    LATEST,
    LOCK,
    SaveSize,
    check_same_tokenizer,
    checkpoint_file_bytes,
    claim_out_dir,
    format_bytes,
    sharded_state_bytes,
)
from training.fp8 import FP8_MODES
from training.parallel import PARALLELISMS, REDUCE_DTYPES
from training.runtime import DIST_BACKENDS, DTYPES, Runtime, available_memory
from weights.hf import HUB_NAMES, load_weights
from weights.load import load_checkpoint
from weights.lora import check_targets, checkpoint_entries

log = logging.getLogger("train")

# The settings a checkpoint's weights depend on: field name -> the GPTConfig attribute compared (n_kv_head=None
# and n_kv_head=n_head are the same model)
SHAPE_FIELDS = {
    **{name: name for name in ("n_layer", "n_head", "n_embd", "vocab_size", "bias", "rope", "rope_theta", "norm")},
    **{"mlp": "mlp", "mlp_hidden": "mlp_width", "n_kv_head": "kv_heads", "qk_norm": "qk_norm"},
}
COMPILE_MODES = ("default", "max-autotune-no-cudagraphs", "max-autotune", "reduce-overhead")
CUDA_GRAPH_MODES = ("max-autotune", "reduce-overhead")  # the compile modes that replay CUDA graphs


def check_config(cfg) -> None:
    """Each setting alone and the settings together (ValueError); then the model's own checks."""
    check_numbers(cfg)
    check_optimizer(cfg)
    check_choices(cfg)
    check_parallelism(cfg)
    check_packing_and_lora(cfg)
    cfg.model_config()  # the model's own checks (head dim, backend names, ...)


def check_numbers(cfg) -> None:
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
        "fsdp_blocks_per_unit",
    )
    for name in positive:
        if getattr(cfg, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(cfg, name)}")
    for name in ("max_iters", "warmup_iters", "lr_decay_iters", "profile_steps"):
        if getattr(cfg, name) < 0:
            raise ValueError(f"{name} must be >= 0, got {getattr(cfg, name)}")
    if cfg.vocab_size is not None and cfg.vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1 or None, got {cfg.vocab_size}")
    for name in ("ddp_bucket_cap_mb", "dist_timeout_s"):
        if not getattr(cfg, name) > 0:
            raise ValueError(f"{name} must be > 0, got {getattr(cfg, name)}")
    if cfg.ddp_graph_split and cfg.ddp_bucket_cap_mb < 1:  # else torch's DDPOptimizer asserts mid-compile
        raise ValueError(
            "ddp_graph_split=true cuts the compiled graph at DDP's buckets, the first of which holds 1 MB: "
            f"ddp_bucket_cap_mb must be >= 1 with it, got {cfg.ddp_bucket_cap_mb}"
        )
    if cfg.peak_flops is not None and not cfg.peak_flops > 0:
        raise ValueError(f"peak_flops must be > 0, got {cfg.peak_flops}")
    if not 0 <= cfg.seed < 2**64:
        raise ValueError(f"seed must be in [0, 2**64), got {cfg.seed}")


def check_optimizer(cfg) -> None:
    for name in ("learning_rate", "min_lr", "weight_decay", "beta1", "beta2", "grad_clip", "dropout"):
        if not math.isfinite(getattr(cfg, name)):
            raise ValueError(f"{name} must be a finite number, got {getattr(cfg, name)}")
    if not cfg.learning_rate > 0:
        raise ValueError(f"learning_rate must be > 0, got {cfg.learning_rate}")
    if cfg.decay_lr and not 0 <= cfg.min_lr <= cfg.learning_rate:
        raise ValueError(
            f"need 0 <= min_lr <= learning_rate when decay_lr is on, got "
            f"min_lr={cfg.min_lr}, learning_rate={cfg.learning_rate}"
        )
    for name in ("weight_decay", "grad_clip"):  # grad_clip=0 turns clipping off
        if getattr(cfg, name) < 0:
            raise ValueError(f"{name} must be >= 0, got {getattr(cfg, name)}")
    if not (0 <= cfg.beta1 < 1 and 0 <= cfg.beta2 < 1):
        raise ValueError(f"beta1 and beta2 must be in [0, 1), got {cfg.beta1}, {cfg.beta2}")
    if cfg.decay_lr and cfg.warmup_iters > cfg.lr_decay_iters:
        raise ValueError(f"warmup_iters ({cfg.warmup_iters}) must be <= lr_decay_iters ({cfg.lr_decay_iters})")


def check_choices(cfg) -> None:
    if cfg.dtype not in DTYPES:
        raise ValueError(f"unknown dtype {cfg.dtype!r}; choose one of {', '.join(DTYPES)}")
    if cfg.dist_backend not in DIST_BACKENDS:
        raise ValueError(f"unknown dist_backend {cfg.dist_backend!r}; choose nccl or gloo")
    if cfg.fp8 not in FP8_MODES:
        raise ValueError(f"unknown fp8 {cfg.fp8!r}; choose one of {', '.join(FP8_MODES)}")
    if cfg.compile_mode not in COMPILE_MODES:
        raise ValueError(f"unknown compile_mode {cfg.compile_mode!r}; choose one of {', '.join(COMPILE_MODES)}")
    if not cfg.out_dir:
        raise ValueError("out_dir must not be empty")
    too_long = [part for part in Path(cfg.out_dir).parts if len(os.fsencode(part)) > 255]
    if too_long:
        raise ValueError(f"out_dir has a folder name of {len(os.fsencode(too_long[0]))} bytes; 255 is the most")


def check_parallelism(cfg) -> None:
    if cfg.parallelism not in PARALLELISMS:
        raise ValueError(f"unknown parallelism {cfg.parallelism!r}; choose one of {', '.join(PARALLELISMS)}")
    if cfg.parallelism == "fsdp" and cfg.compile_mode in CUDA_GRAPH_MODES:
        # tried on 2 GPUs: a graph's output was overwritten by the next replay before backward read it
        raise ValueError(
            f"compile_mode={cfg.compile_mode} replays CUDA graphs, which parallelism fsdp does not train with; "
            "use default or max-autotune-no-cudagraphs"
        )
    if cfg.compile_blocks and cfg.compile_mode in CUDA_GRAPH_MODES:
        raise ValueError(
            f"compile_mode={cfg.compile_mode} replays CUDA graphs of the whole model; compile_blocks=true compiles "
            "each block apart: use default or max-autotune-no-cudagraphs with it"
        )
    if cfg.compile_blocks and cfg.ddp_graph_split:  # each block's graph is smaller than a bucket: nothing to cut
        raise ValueError(
            "ddp_graph_split=true cuts the whole model's compiled graph at DDP's buckets; compile_blocks=true "
            "compiles each block apart (DDP all-reduces each bucket once its blocks' backward is done): choose one"
        )
    if cfg.parallelism == "fsdp" and cfg.lora_rank:
        raise ValueError("LoRA (lora_rank > 0) trains with parallelism ddp, not fsdp; its frozen base is not sharded")
    if cfg.parallelism == "fsdp" and cfg.shard_optimizer:
        raise ValueError("shard_optimizer=true is for parallelism ddp; parallelism fsdp shards the optimizer already")
    if cfg.context_parallel < 1:
        raise ValueError(f"context_parallel must be >= 1 (1 turns it off), got {cfg.context_parallel}")
    if cfg.context_parallel > 1 and cfg.block_size % (2 * cfg.context_parallel):
        raise ValueError(
            f"context_parallel={cfg.context_parallel} cuts each sequence into {2 * cfg.context_parallel} equal chunks; "
            f"block_size ({cfg.block_size}) must be a multiple of {2 * cfg.context_parallel}"
        )
    if cfg.context_parallel > 1 and cfg.packed_documents:
        raise ValueError("context_parallel > 1 trains whole sequences; packed_documents is not supported with it")
    if cfg.ddp_reduce_dtype not in REDUCE_DTYPES:
        raise ValueError(f"unknown ddp_reduce_dtype {cfg.ddp_reduce_dtype!r}; choose one of {', '.join(REDUCE_DTYPES)}")
    if cfg.ddp_reduce_dtype == "bfloat16" and cfg.dist_backend != "nccl":
        raise ValueError("ddp_reduce_dtype=bfloat16 needs dist_backend=nccl (no bf16 all-reduce hook for gloo)")


# compile_blocks unset: per block from this depth. On an H200 (bench/results/h200-compile-*-76cd1bb.md) per block
# gave the same speed at 48 layers (0.996) with a first step of 4 s against 66 s, but cost 2% at GPT-2 124M's
# 12 layers, whose whole-model compile takes 18.5 s.
PER_BLOCK_FROM_LAYERS = 24


def compiles_per_block(cfg, *, sharded: bool = False) -> bool:
    """Whether torch.compile takes the model block by block (regional compilation: one block's graph, compiled
    once and reused by every block, and the head; a deep model's first step in seconds, not minutes) or whole.
    compile_blocks=None chooses per block from PER_BLOCK_FROM_LAYERS blocks, but the whole model for a shallower
    model and where the whole graph is the point: a CUDA-graph compile_mode (it replays the whole model's graph)
    and ddp_graph_split (it cuts that graph at DDP's buckets).
    A sharded (FSDP) model always compiles per block (parallel.compile_blocks says why); a WARNING where
    compile_blocks=false asked otherwise."""
    if sharded:
        if cfg.compile_blocks is False:
            log.warning("compile_blocks=false: parallelism fsdp compiles each block apart all the same (FSDP's hooks)")
        return True
    if cfg.compile_blocks is not None:
        return cfg.compile_blocks
    deep = cfg.n_layer >= PER_BLOCK_FROM_LAYERS
    return deep and cfg.compile_mode not in CUDA_GRAPH_MODES and not cfg.ddp_graph_split


def check_packing_and_lora(cfg) -> None:
    if cfg.document_separator is not None and (cfg.document_separator < 0 or not cfg.packed_documents):
        raise ValueError(f"document_separator={cfg.document_separator} needs packed_documents=True and a token id >= 0")
    if cfg.lora_rank < 0:
        raise ValueError(f"lora_rank must be >= 0 (0 turns LoRA off), got {cfg.lora_rank}")
    if not (math.isfinite(cfg.lora_alpha) and cfg.lora_alpha > 0 and 0 <= cfg.lora_dropout < 1):
        raise ValueError(f"need lora_alpha > 0 and 0 <= lora_dropout < 1, got {cfg.lora_alpha}, {cfg.lora_dropout}")
    if cfg.lora_rank:
        check_targets(cfg.model_config(), cfg.lora_targets)


def check_before_training(cfg, runtime: Runtime, explicit: frozenset[str] = frozenset()):
    """Everything that can be checked before the model is built, in this order: wandb, that eval_only has
    weights to evaluate, the checkpoint to start from and the model shape it gives (with_weights_shape;
    `explicit`: the settings the user set; a resume keeps its block_size), the dataset (prepared if missing) and
    its tokenizer against the checkpoint's, the vocabulary size, and memory. Returns (cfg with the checkpoint's
    shape, checkpoint or None, data_dir, the dataset's meta, the model's vocab_size)."""
    check_wandb(cfg)
    check_eval_only(cfg)
    checkpoint = read_checkpoint(cfg)
    cfg = with_weights_shape(cfg, checkpoint, explicit)  # the run's header shows the shape taken
    check_resume_keeps_model(cfg, checkpoint)
    data_dir = ensure_dataset(cfg.dataset, cfg.data_dir, master=runtime.master, distributed=runtime.ddp)
    meta = read_meta(data_dir)
    if checkpoint is not None:
        check_same_tokenizer(checkpoint["meta"], meta, checkpoint_path(cfg), data_dir)
    vocab_size = model_vocab_size(cfg, meta)
    check_memory(cfg, vocab_size, runtime)
    return cfg, checkpoint, data_dir, meta, vocab_size


def checkpoint_path(cfg) -> Path:
    """The file the run's weights come from: out_dir's ckpt.pt to resume; init_from, an out_dir's ckpt.pt for an
    out_dir (a Hugging Face folder or hub name stays as it is)."""
    if cfg.init_from == "resume":
        return Path(cfg.out_dir) / LATEST
    path = Path(cfg.init_from)
    return path / LATEST if path.is_dir() and (path / LATEST).is_file() else path


def evaluated_weights(cfg, resumed_iter: int | None) -> str:
    """What an eval_only run evaluated, for its last line: the checkpoint resumed (and its iteration), the .pt
    file, or the Hugging Face folder or hub name."""
    if cfg.init_from == "resume":
        return f"{checkpoint_path(cfg)} (iter {resumed_iter})"
    path = checkpoint_path(cfg)
    return f"the weights of {path}" if path.is_file() else f"the Hugging Face GPT-2 {cfg.init_from}"


def check_eval_only(cfg) -> None:
    """eval_only evaluates weights that exist: from scratch it would report a random model's loss."""
    if not cfg.eval_only or cfg.init_from != "scratch":
        return
    latest = Path(cfg.out_dir) / LATEST
    found = f"{latest} is there: --init_from=resume evaluates it" if latest.is_file() else f"there is no {latest}"
    raise UsageError(
        f"eval_only=true with init_from=scratch would evaluate a randomly initialised model ({found}); name the "
        f"weights to evaluate with --init_from: resume (out_dir's {LATEST}), a .pt file, an out_dir, a Hugging Face "
        f"GPT-2 folder, or {', '.join(HUB_NAMES)}"
    )


def check_resume_keeps_model(cfg, checkpoint: dict | None) -> None:
    """A resume continues the checkpoint's model as it is. A shorter block_size would crop its position table,
    and the next save would make that permanent: the run could not resume at its own block_size again. A
    fine-tune (--init_from=PATH) may crop; a longer block_size is check_checkpoint_shape's to refuse."""
    if cfg.init_from != "resume" or checkpoint is None:
        return
    saved = checkpoint["model_config"].get("block_size", cfg.block_size)
    if isinstance(saved, int) and cfg.block_size < saved:
        raise UsageError(
            f"block_size {cfg.block_size} is smaller than the checkpoint's {saved}; a resume keeps the checkpoint's "
            f"model: resume with --block_size={saved}, or crop it in a fine-tune "
            f"(--init_from={checkpoint_path(cfg)} --out_dir=ANOTHER_DIR)"
        )


def resolve_init_from(cfg):
    """init_from=auto is resume when out_dir holds a ckpt.pt, else scratch: a job that torchrun restarts after a
    crash (--max-restarts) continues from its last checkpoint, and its first start begins afresh. Numbered
    checkpoints without a ckpt.pt are not resumed by themselves (a deleted ckpt.pt may be deliberate): the scratch
    run is refused by claim_out_dir, whose line names the newest of them and the cp that makes it the latest."""
    if cfg.init_from != "auto":
        return cfg
    return dataclasses.replace(cfg, init_from="resume" if (Path(cfg.out_dir) / LATEST).is_file() else "scratch")


def read_checkpoint(cfg) -> dict | None:
    if cfg.init_from == "scratch":
        return None
    if cfg.init_from == "resume":
        return load_checkpoint(checkpoint_path(cfg), resume=True)
    return load_weights(cfg.init_from, also=("scratch", "resume", "auto"))[0]


def with_weights_shape(cfg, checkpoint: dict | None, explicit: frozenset[str] = frozenset()):
    """cfg with the model shape of the checkpoint's weights, as nanoGPT's resume and init_from=gpt2 take it, so
    that --init_from needs no shape settings: every SHAPE_FIELDS setting the user did not set (`explicit`: those
    of the config files and --key=value), and block_size too (a fine-tune may set a smaller one, which crops the
    weights' context; a resume may not: check_resume_keeps_model). A shape setting the user set that the weights
    do not have is refused."""
    if checkpoint is None:
        return cfg
    saved = GPTConfig(**checkpoint["model_config"])  # a checkpoint of an older version: the fields it lacks at defaults
    conflicts = shape_conflicts(cfg, saved, explicit)
    if conflicts:
        (mine, theirs), *others = conflicts
        also = "".join(f", {other} with its {its}" for other, its in others)
        raise UsageError(
            f"{mine} conflicts with the checkpoint's {theirs}{also} ({checkpoint_path(cfg)}); "
            f"leave {'them' if others else 'it'} out to take the checkpoint's shape"
        )
    taken = [key for key in (*SHAPE_FIELDS, "block_size") if key not in explicit]
    try:
        return dataclasses.replace(cfg, **{key: getattr(saved, key) for key in taken})
    except ValueError as error:  # a setting that does not go with the weights' shape (context_parallel, LoRA, ...)
        raise UsageError(f"with the model shape of {checkpoint_path(cfg)}: {error}") from None


def shape_conflicts(cfg, saved: GPTConfig, explicit: frozenset[str]) -> list[tuple[str, str]]:
    """("--name=value", "name=the checkpoint's value") for each shape setting the user set that makes another
    model than the saved one; compared as the model sees them (n_kv_head=None and n_kv_head=n_head are one)."""
    given = {key: getattr(cfg, key) for key in SHAPE_FIELDS if key in explicit}
    try:
        mine = dataclasses.replace(saved, **given)
        differs = {key for key, attr in SHAPE_FIELDS.items() if getattr(mine, attr) != getattr(saved, attr)}
    except ValueError:  # no model at all (n_head=3 on the weights' n_embd=32): compare the values as set
        differs = {key for key, value in given.items() if value != getattr(saved, key)}
    return [
        (f"--{key}={value}", f"{key}={getattr(saved, SHAPE_FIELDS[key])}")
        for key, value in given.items()
        if key in differs
    ]


def claim_run_out_dir(cfg, runtime: Runtime, model: GPT, hold: contextlib.ExitStack) -> None:
    """Rank 0 of a run that will save claims out_dir (checkpoint.claim_out_dir: lock, write probe, free space
    for the first save, no overwriting another run's checkpoints unless asked), held until `hold` closes; free
    inodes for that save are counted first."""
    if runtime.master and not cfg.eval_only:
        check_free_inodes(cfg.out_dir, first_save_files(cfg, runtime))
        first_save = first_save_size(cfg, runtime, model)
        continuing, overwrite = cfg.init_from == "resume", cfg.overwrite_out_dir
        claim = claim_out_dir(cfg.out_dir, continuing=continuing, overwrite=overwrite, first_save=first_save)
        hold.enter_context(claim)


def first_save_files(cfg, runtime: Runtime) -> int:
    """The files (inodes) the first save creates: FILES_PER_SAVE checkpoint files; under FSDP also a folder of
    shards, with a file per rank and its .metadata."""
    sharded = runtime.shards(cfg.parallelism)
    return FILES_PER_SAVE + (runtime.world_size + 2 if sharded else 0)


def check_free_inodes(out_dir, save_files: int) -> None:
    """Refuse an out_dir whose filesystem has fewer free inodes (file entries) than the run creates before its
    first save is done: the folders still missing, .lock, and the save's files. Out of inodes, a disk with free
    bytes creates no file, and the free-space check (claim_out_dir) does not see it."""
    out_dir = Path(out_dir)
    missing = [folder for folder in (out_dir, *out_dir.parents) if not folder.exists()]
    existing = next((folder for folder in (out_dir, *out_dir.parents) if folder.exists()), None)
    if existing is None or not existing.is_dir():
        return  # claim_out_dir says what is wrong with the path
    free = free_inodes(existing)
    need = len(missing) + (not (out_dir / LOCK).exists()) + save_files
    if free is not None and need > free:
        raise CheckpointError(
            f"out_dir {out_dir}: its filesystem has {free:,} free inodes (file entries; `df -i` shows them), and this "
            f"run creates {need} files by the end of its first save; delete files there or choose another --out_dir"
        )


def free_inodes(folder) -> int | None:
    """Free inodes for an unprivileged writer on folder's filesystem; None where it cannot be asked, or the
    filesystem has no fixed number of them (btrfs reports 0 in all)."""
    try:
        stats = os.statvfs(folder)
    except (OSError, AttributeError):
        return None
    return stats.f_favail if stats.f_files else None


META_BYTES_PER_ID = 16  # a char vocabulary's meta (itos) pickles to at most this much per token id


def first_save_size(cfg, runtime: Runtime, model: GPT) -> SaveSize:
    """What the run's first save writes: the files of a save, each holding what training/state.py saves of this
    model: its weights (for LoRA the adapters, and the base only where no file holds it), AdamW's two float32
    moments and step count per trained tensor, every rank's RNG states, the config and the dataset's
    vocabulary, and each tensor's own overhead in the file; under FSDP the moments once, in a folder of shards."""
    storages = {}  # what torch.save writes: each storage once (lm_head.weight is wte's), whole (a cropped wpe)
    for tensor in checkpoint_entries(model)["model"].values():
        storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
    trained = [p for p in model.parameters() if p.requires_grad]
    moments = sum(8 * p.numel() + 4 for p in trained)
    other = len(pickle.dumps(dataclasses.asdict(cfg))) + META_BYTES_PER_ID * model.config.vocab_size
    sharded = runtime.shards(cfg.parallelism)  # the moments then go once to a folder of shards
    in_files = (0, 0) if sharded else (moments, 3 * len(trained))
    file_bytes = checkpoint_file_bytes(
        sum(storages.values()) + in_files[0], len(storages) + in_files[1], ranks=runtime.world_size
    )
    shards = sharded_state_bytes(moments, 3 * len(trained), runtime.world_size) if sharded else 0
    return SaveSize(file_bytes + other, shards)


def check_wandb(cfg) -> None:
    if not cfg.wandb_log:
        return
    try:
        import wandb  # noqa: F401
    except ImportError:
        raise UsageError("wandb_log=True but the wandb package is not installed; pip install wandb") from None


def model_vocab_size(cfg, meta: dict) -> int:
    if cfg.vocab_size is not None:
        if cfg.vocab_size < meta["vocab_size"]:
            raise UsageError(f"vocab_size {cfg.vocab_size} is smaller than the dataset's {meta['vocab_size']}")
        return cfg.vocab_size
    vocab = meta["vocab_size"]
    return vocab if vocab < 1024 else -(-vocab // 64) * 64  # a multiple of 64 makes the big matmuls faster


def check_checkpoint_shape(model_config: GPTConfig, saved: dict) -> None:
    """Refuse a checkpoint whose model (saved: its model_config) has another shape than the config's, or a
    shorter context."""
    saved_config = GPTConfig(**saved)  # a checkpoint of an older version: the fields it lacks at their defaults
    differ = [
        f"{name}={getattr(saved_config, attr)} (config says {getattr(model_config, attr)})"
        for name, attr in SHAPE_FIELDS.items()
        if getattr(saved_config, attr) != getattr(model_config, attr)
    ]
    if differ:
        raise UsageError(
            f"the checkpoint's model has another shape: {', '.join(differ)}; "
            f"build the model with the checkpoint's shape (with_weights_shape)"
        )
    if model_config.block_size > saved["block_size"]:
        raise UsageError(f"block_size {model_config.block_size} is larger than the checkpoint's {saved['block_size']}")


def parameter_count(config: GPTConfig) -> int:
    """GPT's parameter count from its config alone (GPTConfig.parameter_count, which the weights loaders use too)."""
    return config.parameter_count()


def state_bytes_per_param(cfg, ranks: int) -> float:
    """What each rank holds per parameter: float32 weights, and to train, their gradients and AdamW's two moments
    (16 bytes); FSDP holds 1/N of all of it, ZeRO-1 (shard_optimizer) 1/N of the moments."""
    if cfg.parallelism == "fsdp":
        return (4 if cfg.eval_only else 16) / ranks
    if cfg.eval_only:
        return 4
    return 8 + 8 / ranks if cfg.shard_optimizer else 16


def check_memory(cfg, vocab_size: int, runtime: Runtime) -> None:
    """Refuse, before allocating anything, a run whose weights, optimizer state and activations cannot fit in
    the device's memory (a lower bound of what it needs)."""
    model_config = cfg.model_config(vocab_size=vocab_size)
    params = parameter_count(model_config)
    bytes_per_param = state_bytes_per_param(cfg, runtime.world_size)
    # per token of this rank (context parallelism: its share of each sequence): the logits and their gradient
    # (unless chunked), and a floor of floats per layer and width kept for backward (8; fewer when recomputed)
    tokens = cfg.batch_size * cfg.block_size // cfg.context_parallel
    logits = 0 if model_config.chunks_loss(tokens) else 2 * vocab_size
    kept = {"none": 8, "mlp": 4, "block": 1}[cfg.activation_checkpointing]
    activation_bytes = tokens * 4 * (logits + kept * cfg.n_layer * cfg.n_embd)
    # FSDP without resharding keeps every unit's gathered weights, in the run's dtype, from forward to backward
    sharded = runtime.shards(cfg.parallelism)
    kept_whole = sharded and not cfg.fsdp_reshard_after_forward
    gathered_bytes = params * runtime.dtype.itemsize if kept_whole else 0
    # FSDP accumulating over micro-steps without reduce-scattering each keeps every gradient whole, in float32
    accumulates_whole = sharded and runtime.micro_steps(cfg.gradient_accumulation_steps) > 1
    whole_grad_bytes = params * 4 if accumulates_whole and not cfg.fsdp_reduce_every_micro_step else 0
    need = int(params * bytes_per_param) + gathered_bytes + whole_grad_bytes + activation_bytes
    available, where = available_memory(runtime.device)
    if available and need > available:
        gathered = f", {format_bytes(gathered_bytes)} of weights gathered for backward" if gathered_bytes else ""
        whole = f", {format_bytes(whole_grad_bytes)} of gradients kept whole" if whole_grad_bytes else ""
        fix = " (or fsdp_reduce_every_micro_step=true)" if whole_grad_bytes else ""
        raise UsageError(
            f"this run needs at least {format_bytes(need)} of memory ({params:,} parameters x {bytes_per_param:.3g} "
            f"bytes{gathered}{whole}, and {format_bytes(activation_bytes)} of activations for batch_size="
            f"{cfg.batch_size} x block_size={cfg.block_size}) but {where}; use a smaller model (n_layer, n_embd, "
            f"vocab_size) or batch_size{fix}"
        )
