"""How the model is spread over the ranks of a torchrun job: DDP (every rank holds the whole model and its
optimizer state; gradients are averaged) or FSDP2 (torch.distributed.fsdp.fully_shard: every rank holds 1/N of
the weights, gradients and optimizer state, and gathers a block's weights just before that block runs).
Under FSDP only rank 0 needs the whole model in host memory: the other ranks may build it on the meta device.

    torchrun --standalone --nproc_per_node=4 train.py config/train_gpt2_xl_fsdp.py    # parallelism = "fsdp"

Under DDP, shard_optimizer (ZeRO-1, torch's ZeroRedundancyOptimizer) splits the optimizer step instead: each
rank keeps the AdamW state of, and steps, about 1/N of the parameters, then sends them to the others.

Checkpoints of an FSDP run: rank 0 writes ckpt.pt as always, with the full weights (gathered to its CPU), so
sample.py, export and fine-tuning read it like any other; the optimizer state, sharded, goes to a
torch.distributed.checkpoint (DCP) folder beside it, ckpt-<iter>.dcp, that ckpt.pt names. DCP reshards on
load, so a run saved on 4 ranks resumes on 2, or on 1 process.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from errors import UsageError
from kernels.timing import synchronize
from storage.atomic import fsync_dir, tmp_path_for
from training.runtime import Runtime

log = logging.getLogger("train")

PARALLELISMS = ("ddp", "fsdp")
REDUCE_DTYPES = ("float32", "bfloat16")  # of DDP's gradient all-reduce


BUILD_ON_GPU_FRACTION = 0.4  # FSDP's rank 0 builds the whole model on its GPU where it takes at most this much


def build_device(runtime: Runtime, weights_bytes: int, *, sharded: bool = False) -> torch.device:
    """Where a model with `weights_bytes` of float32 weights is built and initialized: on the GPU it trains on (a
    second for 6.7B weights there, over a minute on the CPU). Under FSDP rank 0 builds the whole model for all
    ranks (place_model): on its GPU where that fits with room to spare, else in host memory, so that a model too
    large for one GPU still trains."""
    device = runtime.device
    if device.type != "cuda":
        return torch.device("cpu")
    fits = weights_bytes <= BUILD_ON_GPU_FRACTION * torch.cuda.get_device_properties(device).total_memory
    return device if fits or not sharded else torch.device("cpu")


def place_model(
    model: nn.Module,
    runtime: Runtime,
    parallelism: str,
    *,
    reshard_after_forward: bool = True,
    blocks_per_unit: int = 1,
) -> nn.Module:
    """The model on its device; under FSDP each rank's shard only, so a model too large for one GPU fits.
    Under FSDP the weights are rank 0's: the other ranks may have built the model on the meta device (train.py
    does), so that only rank 0 holds and initializes the whole model in host memory."""
    if runtime.shards(parallelism):
        weights = plain_tensors(model.state_dict()) if runtime.master else {}
        # moves each shard to the device
        shard_model(model, runtime, reshard_after_forward=reshard_after_forward, blocks_per_unit=blocks_per_unit)
        if any(param.is_meta for param in model.parameters()):
            model.to_empty(device=runtime.device)
        spread_from_rank0(model, weights)
        return model
    return model.to(runtime.device)


# Long for its docstring, which says what each DDP switch trades.
def wrap_model(
    model: nn.Module,
    runtime: Runtime,
    *,
    use_compile: bool,
    compile_mode: str = "default",
    per_block: bool = False,
    bucket_cap_mb: float = 100.0,
    graph_split: bool = False,
    reduce_dtype: str = "float32",
) -> tuple[nn.Module, nn.Module]:
    """(eval_model, train_model) of a model placed by place_model: compiled when use_compile (whole, or block by
    block with per_block, as a sharded model always is), and wrapped in DDP under torchrun unless sharded. Build
    the optimizer after place_model: FSDP replaces the parameters.
    per_block: one compiled graph per block, reused by all blocks (one compile, not n_layer), and a backward
    node per block, so DDP all-reduces each bucket as soon as its blocks' backward is done.
    graph_split: torch.compile cuts the graph at DDP's bucket boundaries, so each bucket's all-reduce starts
    while the rest of backward runs; off, backward is one graph (fusion across the whole model) and every
    all-reduce waits for its end. reduce_dtype bfloat16: each bucket is all-reduced in bf16 (PyTorch's
    bf16_compress_hook, NCCL only) and written back in float32, for half the traffic."""
    if is_sharded(model):  # place_model sharded it: FSDP, under torchrun
        if use_compile:
            compile_blocks(model, compile_mode)
        return model, model
    if use_compile and per_block:
        compile_blocks(model, compile_mode)
        eval_model = model
    else:
        eval_model = torch.compile(model, mode=compile_mode) if use_compile else model
    if not runtime.ddp:
        return eval_model, eval_model
    from torch.nn.parallel import DistributedDataParallel

    if use_compile:
        torch._dynamo.config.optimize_ddp = graph_split  # read when the wrapped model first compiles
    device = runtime.device
    train_model = DistributedDataParallel(
        eval_model,
        device_ids=[device.index] if device.type == "cuda" else None,
        bucket_cap_mb=bucket_cap_mb,
        gradient_as_bucket_view=True,  # gradients live in DDP's buckets: no copy in and out of them per step
        # static_graph stays off: with torch.compile and no_sync (accumulation) it fails an internal assert
        # in DDP's reducer (torch 2.13)
    )
    if reduce_dtype == "bfloat16":
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook

        train_model.register_comm_hook(None, bf16_compress_hook)
    return eval_model, train_model


def shard_model(
    model: nn.Module, runtime: Runtime, *, reshard_after_forward: bool = True, blocks_per_unit: int = 1
) -> None:
    """fully_shard each Block (or each run of `blocks_per_unit` consecutive blocks, gathered and reduced as one
    unit: fewer, larger collectives and less host work per block, for more gathered weights at a time), then the
    root, which holds the rest: wte and lm_head (one tied tensor, sharded once), wpe, ln_f. On CUDA the gathered
    weights are in the run's dtype and gradients are reduced in float32. reshard_after_forward=False keeps each
    unit's gathered weights from its forward to its backward (one all-gather a step instead of two, for the
    memory of the whole unsharded model: ZeRO-2 rather than 3)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if runtime.dtype == torch.float16:
        raise UsageError("parallelism fsdp trains in bfloat16 or float32, not float16; use --dtype=bfloat16")
    low_precision = runtime.dtype if runtime.device.type == "cuda" else None
    policy = MixedPrecisionPolicy(param_dtype=low_precision, reduce_dtype=torch.float32)
    blocks = list(model.transformer.h)
    for first in range(0, len(blocks), blocks_per_unit):
        unit = blocks[first : first + blocks_per_unit]
        fully_shard(unit if len(unit) > 1 else unit[0], mp_policy=policy, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mp_policy=policy, reshard_after_forward=reshard_after_forward)


def spread_from_rank0(model: nn.Module, weights: dict) -> None:
    """Each rank's shards of rank 0's full `weights` (ignored elsewhere), broadcast by torch's own state-dict
    loader; then rank 0's buffers, which the state dict leaves out (RoPE's tables)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, weights, options=options)
    for buffer in model.buffers():
        dist.broadcast(buffer, src=0)


def compile_blocks(model: nn.Module, compile_mode: str) -> None:
    """torch.compile a model piece by piece: each block's forward (one compiled graph that every block reuses),
    and the head (ln_f, lm_head, loss); the embeddings and the loop over blocks stay eager. A sharded model is
    always compiled so: compiled whole, its loop over blocks meets FSDP's hooks, graph breaks that torch.compile
    cannot take inside a loop: it skips GPT.forward's frame, and the head, with its loss over the whole
    vocabulary, runs eagerly (bench/NOTES.md). The hooks stay outside, eager."""
    for block in model.transformer.h:
        block.forward = torch.compile(block.forward, mode=compile_mode)
    model.head = torch.compile(model.head, mode=compile_mode)


def keep_own_grads(model: nn.Module) -> None:
    """.grad buffers of the model's own, zeroed in place between steps. Under CUDA graphs the compiled backward
    returns gradients in graph memory, which the next micro-step's replay overwrites; taken as .grad they would be
    lost to accumulation (pytorch/pytorch#169545). With buffers of our own, every backward adds into them."""
    for param in model.parameters():
        if param.requires_grad:
            param.grad = torch.zeros_like(param)


def is_sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def grad_scaler(model: nn.Module, device_type: str, *, init_scale: float, enabled: bool) -> torch.amp.GradScaler:
    """torch's GradScaler; for a sharded model its FSDP variant: each rank checks only its shards of the
    gradients for inf/NaN, and that one agrees over the ranks, so that every rank skips the same steps."""
    if is_sharded(model):
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        # its one-element inf flag meets the DTensor gradients, which DTensor accepts with a warning per process
        warnings.filterwarnings("ignore", message="Found a non-scalar tensor with numel=1", category=UserWarning)
        return ShardedGradScaler(device_type, init_scale=init_scale, enabled=enabled)
    return torch.amp.GradScaler(device_type, init_scale=init_scale, enabled=enabled)


# ----------------------------------------------------------------------------------------------
# The optimizer step sharded over DDP's ranks (ZeRO-1)


def shard_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """torch's ZeroRedundancyOptimizer around an optimizer that has not stepped yet: the same class, param groups
    and settings. Each rank keeps the state of, and steps, about 1/N of the parameters (whole tensors), then
    broadcasts them; DDP still averages every gradient on every rank, so clipping over all of them is unchanged.
    Its param_groups reach each rank's own optimizer at every step (the learning rate). The parameters stay where
    they are (parameters_as_bucket_view off): on, each would become a view of one flat tensor per rank, and the
    checkpoint's weights would share those tensors' storage."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    accepted = inspect.signature(type(optimizer)).parameters  # defaults has more: AdamW's decoupled_weight_decay
    settings = {key: value for key, value in optimizer.defaults.items() if key in accepted}
    groups = [dict(group) for group in optimizer.param_groups]
    return ZeroRedundancyOptimizer(groups, optimizer_class=type(optimizer), **settings)


def zero_optimizer(optimizer: torch.optim.Optimizer, runtime: Runtime) -> torch.optim.Optimizer:
    """shard_optimizer=true: under DDP the optimizer sharded over the ranks (ZeRO-1, shard_optimizer), saying so;
    in one process, the optimizer itself, saying there is nothing to shard."""
    if not runtime.ddp:
        log.info("shard_optimizer: one process, nothing to shard; the optimizer steps as usual")
        return optimizer
    ranks = runtime.world_size
    log.info(
        f"optimizer step sharded over {ranks} ranks (ZeRO-1): each steps ~1/{ranks} of the weights, keeps their state"
    )
    return shard_optimizer(optimizer)


def local_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer that holds this rank's state and runs its step: under ZeRO the one of this rank's share of
    the parameters; else the optimizer itself."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer


def gather_optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """Under ZeRO, every rank's share of the optimizer state to rank 0, whose state_dict() then holds all of it in
    the plain optimizer's layout; a collective, so every rank calls it. Other optimizers hold theirs already."""
    if local_optimizer(optimizer) is not optimizer:
        optimizer.consolidate_state_dict(to=0)
        synchronize(device)  # its copies to the CPU are non-blocking: done before torch.save reads them


def load_optimizer_state(optimizer: torch.optim.Optimizer, state_dict: dict) -> None:
    """A plain optimizer's state dict (any number of ranks saved it); under ZeRO each rank takes its share."""
    if local_optimizer(optimizer) is optimizer:
        optimizer.load_state_dict(state_dict)
        return
    optimizer.load_state_dict({**state_dict, "state": dict(state_dict["state"])})  # it blanks the others' entries
    # ZeRO also keeps every entry in its own `state`, which its steps never read: a second copy of this rank's
    # share, and None for the other ranks', which its state_dict() would save where their owner holds no state
    optimizer.state.clear()


def gradient_sync(model: nn.Module, train_model: nn.Module, enabled: bool, *, sharded_every_step: bool = False):
    """A context for one micro-step's backward: with enabled=False, gradients accumulate on each rank without
    being averaged over ranks (every micro-step of an optimizer step but the last).
    sharded_every_step: FSDP reduce-scatters at every micro-step all the same, so each rank accumulates only its
    shard of the gradients; skipping it keeps every gradient unsharded, in float32, until the last micro-step
    (4 bytes a parameter more on each GPU, for less traffic)."""
    if enabled:
        return contextlib.nullcontext()
    if hasattr(train_model, "no_sync"):  # DDP
        return train_model.no_sync()
    if is_sharded(model) and not sharded_every_step:
        return _fsdp_no_sync(model)
    return contextlib.nullcontext()


@contextlib.contextmanager
def _fsdp_no_sync(model):
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def replicated(tensor: torch.Tensor) -> torch.Tensor:
    """A plain tensor of a DTensor result (FSDP's gradient norm); other tensors as they are."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


# ----------------------------------------------------------------------------------------------
# Checkpoints of sharded models


def full_model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's weights as plain tensors, on rank 0's CPU ({} on the other ranks); a collective under FSDP,
    so every rank calls it."""
    if not is_sharded(model):
        return model.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    state = plain_tensors(state)  # ckpt.pt loads without torchao, as any checkpoint
    # It gathers a tied weight (the token embedding that is also the head) once per name, as two tensors, and
    # torch.save would write both: tie them again, one tensor for all its names, stored once (0.8 GB of a 6.7B's).
    names_of: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(param), []).append(name)
    for first, *aliases in names_of.values():
        for alias in aliases:
            if first in state and alias in state:
                state[alias] = state[first]
    return state


def plain_tensors(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A state dict with each tensor subclass that wraps one tensor (torchao's weights for FSDP's FP8 all-gather
    wrap the weight itself) replaced by that tensor: the same values, no copy."""
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    def plain(tensor: torch.Tensor) -> torch.Tensor:
        wrapper = is_traceable_wrapper_subclass(tensor) and not isinstance(tensor, DTensor)  # a shard stays one
        inner = tensor.__tensor_flatten__()[0] if wrapper else ()
        return plain(getattr(tensor, inner[0])) if len(inner) == 1 else tensor

    return {name: plain(tensor) for name, tensor in state.items()}


def save_sharded_optimizer(model: nn.Module, optimizer, folder: Path, runtime: Runtime) -> None:
    """Every rank writes its shard of the optimizer state into a temporary folder beside `folder`; rank 0 renames
    it to `folder` once all shards and DCP's metadata are written. OSError or DCP's CheckpointException on
    failure (on every rank: DCP gathers each rank's outcome)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    names = [str(tmp_path_for(folder))]  # rank 0's pid names the temporary folder of every rank
    dist.broadcast_object_list(names, src=0)
    tmp = Path(names[0])
    if runtime.master and tmp.exists():
        shutil.rmtree(tmp)  # a leftover of an earlier process with this pid
    dist.barrier()
    dcp.save({"optimizer": get_optimizer_state_dict(model, optimizer)}, checkpoint_id=tmp)
    dist.barrier()  # every rank's shard is written; rank 0 wrote the metadata last
    if runtime.master:
        if folder.exists():  # the same iteration saved again (a resumed run)
            shutil.rmtree(folder)
        os.replace(tmp, folder)
        fsync_dir(folder.parent)


def load_sharded_optimizer(model: nn.Module, optimizer, folder: Path) -> None:
    """Fill `optimizer` from a DCP folder written by save_sharded_optimizer on any number of ranks (DCP
    reshards); works sharded, under DDP, and in one process."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    state = {"optimizer": get_optimizer_state_dict(model, optimizer)}  # the layout to fill, on this rank
    one_process = not (dist.is_available() and dist.is_initialized())
    with warnings.catch_warnings():  # DCP warns that it loads in one process, even when told so by no_dist
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.load(state, checkpoint_id=folder, no_dist=one_process)
    set_optimizer_state_dict(model, optimizer, state["optimizer"])
