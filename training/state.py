"""What a checkpoint of a training run holds, and how a run continues from one: train.py's TrainState in and
out of checkpoint.py's files. Under FSDP the optimizer state goes to a DCP folder beside the file (parallel.py).

The data stream is one generator for all ranks (data/loader.py Batches), so a checkpoint holds one data
position, and a run resumed with another number of ranks trains on the same batches; each rank's RNG (dropout)
is restored when the number of ranks is the same."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import torch
import torch.distributed as dist

from data.loader import Batches
from errors import CheckpointError
from storage.checkpoint import LATEST, capture_rng, restore_rng, save_checkpoint
from training.parallel import (
    full_model_state,
    gather_optimizer_state,
    is_sharded,
    load_optimizer_state,
    load_sharded_optimizer,
    local_optimizer,
    save_sharded_optimizer,
)
from training.preflight import checkpoint_path
from training.runtime import agree
from weights.lora import checkpoint_entries

log = logging.getLogger("train")


def keep_run_settings(optimizer: torch.optim.Optimizer, settings: list[dict]) -> list[str]:
    """Give the param groups back this run's settings (each group's all but params, taken before loading), which
    loading a state dict replaces by the saving run's: the weight decay and betas the user set now, and this run's
    AdamW kernel (fused or foreach: a foreach AdamW, FSDP's in checkpoints from before it took the fused kernel,
    must not come back into a run whose fused one clip_and_step drives). Under ZeRO this rank's own optimizer
    takes them from these groups at each step. The fused kernel keeps its step counts on the parameters' device.
    Returns the settings that differ from the checkpoint's, 'name: saved -> now'."""
    changed = []
    for group, own in zip(optimizer.param_groups, settings):
        changed += [f"{key}: {group[key]} -> {own[key]}" for key in ("weight_decay", "betas") if group[key] != own[key]]
        group.update({key: value for key, value in own.items() if key not in ("lr", "initial_lr")})  # the schedule's
    if optimizer.defaults.get("fused"):
        for param, param_state in local_optimizer(optimizer).state.items():
            if "step" in param_state:
                param_state["step"] = param_state["step"].to(param.device, torch.float32)
    return list(dict.fromkeys(changed))


def restore_progress(state, batches: Batches, checkpoint: dict) -> None:
    """Optimizer, scaler, counters, the data stream, and (with the same number of ranks) each rank's RNG.
    Checkpoints of earlier versions hold a data position per rank instead of one stream: rank 0's continues."""
    runtime, path = state.runtime, checkpoint_path(state.cfg)
    ranks = checkpoint["rng"]
    settings = [
        {key: value for key, value in group.items() if key != "params"} for group in state.optimizer.param_groups
    ]
    try:
        if checkpoint.get("sharded"):  # an FSDP run's optimizer state, in a DCP folder beside the checkpoint
            load_sharded_optimizer(state.model, state.optimizer, path.parent / checkpoint["sharded"])
        elif runtime.shards(state.cfg.parallelism):
            raise CheckpointError(
                f"{path} was saved without FSDP, its optimizer state unsharded; resume it with --parallelism=ddp"
            )
        else:
            load_optimizer_state(state.optimizer, checkpoint["optimizer"])  # ZeRO: this rank's share
        changed = keep_run_settings(state.optimizer, settings)
        state.scaler.load_state_dict(checkpoint["scaler"])
        batches.restore(checkpoint["data"] if "data" in checkpoint else ranks[0]["data"])
        if len(ranks) == runtime.world_size:
            restore_rng(ranks[runtime.rank]["rng"])
    except (ValueError, KeyError, TypeError, IndexError, RuntimeError, OSError) as error:
        if isinstance(error, CheckpointError):
            raise
        reason = str(error).strip().splitlines()[0][:200] if str(error).strip() else type(error).__name__
        raise CheckpointError(f"{path}: its optimizer or RNG state cannot be restored ({reason})") from None
    state.iter_num, state.best_val_loss = checkpoint["iter_num"], float(checkpoint["best_val_loss"])
    state.ckpt_iter = state.resumed_iter = state.iter_num
    if runtime.master and changed:
        log.info(f"the optimizer takes this run's settings, not the checkpoint's: {', '.join(changed)}")
    if runtime.master and "data" not in checkpoint and len(ranks) > 1:
        log.warning(f"{path} holds a data position per rank (an earlier version's): the stream continues rank 0's")
    if runtime.master and len(ranks) != runtime.world_size and state.cfg.dropout > 0:
        log.warning(
            f"checkpoint was saved by {len(ranks)} ranks, this run has {runtime.world_size}: the data stream "
            f"continues, dropout's random numbers start afresh on each rank"
        )


def write_checkpoint(state, batches: Batches, meta: dict, is_best: bool) -> Path:
    """Write a checkpoint from rank 0, with the data stream's position and every rank's RNG (and under FSDP
    the sharded optimizer state, from every rank; under ZeRO rank 0 gathers it, in the plain layout); returns
    out_dir/ckpt.pt. A failed save (a full disk, ...) is a CheckpointError on every rank."""
    cfg, runtime = state.cfg, state.runtime
    ranks = [{"rng": capture_rng()}]
    if runtime.ddp:
        gathered = [None] * runtime.world_size
        dist.all_gather_object(gathered, ranks[0])
        ranks = gathered
    error, sharded = None, None
    try:
        # the weights: under FSDP gathered from every rank to rank 0; else as checkpoint_entries says (LoRA)
        entries = (
            {"model": full_model_state(state.model)} if is_sharded(state.model) else checkpoint_entries(state.model)
        )
        if runtime.shards(cfg.parallelism):
            sharded = f"ckpt-{state.iter_num:07d}.dcp"
            save_sharded_optimizer(state.model, state.optimizer, Path(cfg.out_dir) / sharded, runtime)
        gather_optimizer_state(state.optimizer, runtime.device)  # ZeRO: every rank's share to rank 0
    except (OSError, RuntimeError) as failure:  # DCP's CheckpointException is a RuntimeError
        reason = str(failure).strip().splitlines()[0][:200] if str(failure).strip() else type(failure).__name__
        error = CheckpointError(f"could not save iter {state.iter_num}: {reason}; {LATEST} is unchanged")
    if runtime.master and error is None:
        try:
            checkpoint = state_dict(state, meta, ranks, batches, entries, sharded)
            save_checkpoint(checkpoint, cfg.out_dir, state.iter_num, cfg.keep_last_k, is_best)
        except CheckpointError as failure:
            error = failure
    agree(runtime, error)
    state.ckpt_iter = state.iter_num
    return Path(cfg.out_dir) / LATEST


def state_dict(state, meta: dict, ranks: list[dict], batches: Batches, entries: dict, sharded: str | None) -> dict:
    """What a checkpoint holds (checkpoint.py's REQUIRED_KEYS and RESUME_KEYS, and the run's config). `entries`:
    "model" (with LoRA, the adapters, and "lora"); `sharded`: the DCP folder beside it that holds the optimizer
    state instead, under FSDP."""
    cfg = state.cfg
    return {
        **entries,
        "model_config": dataclasses.asdict(state.model.config),
        "optimizer": {} if sharded else state.optimizer.state_dict(),
        "scaler": state.scaler.state_dict(),
        "iter_num": state.iter_num,
        "best_val_loss": state.best_val_loss,
        "config": dataclasses.asdict(cfg),
        "meta": meta,
        "rng": ranks,  # each rank's RNG (dropout)
        "data": batches.state_before_last,  # where the next step's draw starts: the prefetched batch is its first
        **({"sharded": sharded} if sharded else {}),
    }
