"""
FP8 matmuls for training, through torchao's float8 training (Float8Linear): which recipe runs, on which linears.

`--fp8` is off | tensorwise | rowwise | auto. A linear converts when its shape is one where FP8 beats bf16
(`converts`, torchao's measured thresholds); `auto` turns FP8 on only for a model width that a measurement on this
card family says wins as a whole (AUTO_FP8; no entry: bf16). Where FP8 cannot run (LoRA, eager, no CUDA GPU of
sm89 or newer, bf16 not the compute dtype, torchao missing) training stays in bf16 with one WARNING saying why.
Checkpoints keep their format: Float8Linear keeps the nn.Linear's weight and bias as they were, and casts them to
FP8 inside each matmul; MFU keeps the bf16 peak as its denominator. Under FSDP with tensorwise scaling, FSDP
all-gathers the converted weights in FP8 (float8_config), their scales precomputed after each optimizer step.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
from collections import Counter
from typing import NamedTuple

import torch
import torch.nn as nn

from kernels.auto import card_key

log = logging.getLogger("train")

FP8_MODES = ("off", "tensorwise", "rowwise", "auto")
# auto: per card family, the narrowest model width from which a recipe measured faster than bf16 for the whole
# train step (bench: python -m bench.train_step --variants bf16 fp8-tensorwise fp8-rowwise, per width) and trained
# to bf16's loss. On an H200, 4-layer models: tensorwise ran 1.17x bf16's speed at width 1600 and 1.41x at 4096
# (bench/results/h200-fp8-width-*-76cd1bb.md); at 4096 with GPT-3 6.7B's learning rate, 300 iterations ended
# 0.002 from bf16 (h200-fp8-parity-4096-lr1.2e-4-3d3c795.md; 0.021 at GPT-2 124M's 6e-4, too high for that width).
# Below 4096 no parity run was made, so auto stays bf16 there (GPT-2 124M and XL).
AUTO_FP8: dict[str, tuple[int, str]] = {"sm90": (4096, "tensorwise")}
MIN_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada (sm89), Hopper (sm90) and newer


class Fp8Choice(NamedTuple):
    recipe: str  # tensorwise | rowwise | off
    reason: str  # why FP8 is off (or how auto chose); '' when the request runs as asked
    fsdp_all_gather: bool = False  # FSDP all-gathers the converted weights in FP8 (float8_config)


def card_family(device: torch.device) -> str:
    """auto's table key: the GPU's compute capability, as auto's attention table keys it (sm90), else cpu, mps."""
    return card_key(device) or device.type


def why_fp8_cannot_run(device: torch.device, dtype: torch.dtype, *, compiled: bool, lora: bool) -> str:
    """Why FP8 training cannot run here ('' when it can). Cheap: torchao is looked for, not imported."""
    if lora:
        return "LoRA adapters train in bf16 (their frozen base has no gradients to scale)"
    if device.type != "cuda":
        return f"FP8 matmuls need a CUDA GPU (device is {device.type})"
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        return "FP8 matmuls need compute capability >= 8.9 (this GPU is sm{}{})".format(*capability)
    if dtype != torch.bfloat16:
        return f"FP8 training runs under bfloat16 autocast (this run is {str(dtype).removeprefix('torch.')})"
    if not compiled:
        return "FP8 without torch.compile is slower than bf16 (its casts run as separate kernels); compile=true"
    if importlib.util.find_spec("torchao") is None:
        return "torchao is not installed (pip install torchao)"
    return ""


def choose_fp8(mode: str, n_embd: int, device, dtype: torch.dtype, *, compiled: bool, lora: bool) -> Fp8Choice:
    """The recipe that runs for a requested mode, and why it differs from the request."""
    if mode == "off":
        return Fp8Choice("off", "")
    device = torch.device(device)
    problem = why_fp8_cannot_run(device, dtype, compiled=compiled, lora=lora)
    if mode != "auto":
        return Fp8Choice("off", problem) if problem else Fp8Choice(mode, "")
    if problem:
        return Fp8Choice("off", f"auto: {problem}")
    family = card_family(device)
    width, recipe = AUTO_FP8.get(family, (0, "off"))
    if recipe == "off" or n_embd < width:
        measured = f"from width {width}" if width else "at no width yet"
        return Fp8Choice("off", f"auto: FP8 measured faster than bf16 on {family} {measured} (this model: {n_embd})")
    return Fp8Choice(recipe, f"auto: measured faster than bf16 on {family} from width {width}")


def converts(linear: nn.Linear, recipe: str) -> bool:
    """Whether FP8 pays for this linear's shape (out_features N, in_features K): both multiples of 16 (the FP8
    kernels' rule), and past the sizes below which torchao's H100 measurements found the casts cost more than the
    faster matmul saves. lm_head is a candidate like any other."""
    n, k = linear.out_features, linear.in_features
    if n % 16 or k % 16:
        return False
    if recipe == "rowwise":
        return n > 2048 and k > 1024 and not (n <= 4096 and k <= 2048)
    return not (k <= 4096 and n <= 1024)


def float8_config(recipe: str, *, sharded: bool):
    """torchao's Float8LinearConfig for `recipe`. Sharded by FSDP with tensorwise scaling (the one recipe torchao
    offers it for), FSDP all-gathers the converted weights in FP8, half of bf16's bytes, each with its scale."""
    from torchao.float8 import Float8LinearConfig

    config = Float8LinearConfig.from_recipe_name(recipe)
    if gathers_in_fp8(recipe, sharded=sharded):
        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    return config


def gathers_in_fp8(recipe: str, *, sharded: bool) -> bool:
    """Whether FSDP all-gathers the weights `recipe` converts in FP8 (torchao offers it for tensorwise only)."""
    return sharded and recipe == "tensorwise"


def convert_to_fp8(model: nn.Module, recipe: str, *, sharded: bool = False) -> list[str]:
    """Swap the linears that `converts` picks for torchao's Float8Linear (in place); their names. Under the FP8
    all-gather a linear whose weight another module shares (lm_head, tied to the token embedding) stays as it is:
    torchao gives a converted linear a weight of its own type, which would untie it."""
    from torchao.float8 import convert_to_float8_training

    config = float8_config(recipe, sharded=sharded)
    shared = shared_weights(model) if config.enable_fsdp_float8_all_gather else set()
    chosen: list[str] = []

    def pick(module: nn.Module, name: str) -> bool:
        if isinstance(module, nn.Linear) and converts(module, recipe) and id(module.weight) not in shared:
            chosen.append(name)
            return True
        return False

    convert_to_float8_training(model, module_filter_fn=pick, config=config)
    return chosen


def shared_weights(model: nn.Module) -> set[int]:
    """The ids of the parameters that more than one module holds (tied weights)."""
    holders = Counter(id(param) for _, param in model.named_parameters(remove_duplicate=False))
    return {param_id for param_id, count in holders.items() if count > 1}


def precompute_scales_after_each_step(optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
    """Under the FP8 all-gather: after every optimizer step, each converted weight's scale for the next step's
    all-gathers, from one all-reduce of all their maxima (else each weight's all-gather runs its own), as torchao
    recommends."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    optimizer.register_step_post_hook(lambda *_: precompute_float8_dynamic_scale_for_fsdp(model))


def setup_fp8(
    model: nn.Module, mode: str, device, dtype: torch.dtype, *, compiled: bool, lora: bool, sharded: bool = False
) -> Fp8Choice:
    """Convert `model` for the recipe `mode` resolves to, before FSDP shards it (sharded: it will), compile and the
    optimizer; log a WARNING when an explicit request falls back (saying why) and one INFO line naming what runs."""
    n_embd = model.config.n_embd
    choice = choose_fp8(mode, n_embd, device, dtype, compiled=compiled, lora=lora)
    if mode in ("tensorwise", "rowwise") and choice.recipe == "off":
        log.warning(f"fp8={mode} requested but {choice.reason}; training in bf16")
    if choice.recipe == "off":
        if mode != "off":
            log.info(f"fp8: off, bf16 matmuls ({choice.reason})")
        return choice
    total = sum(isinstance(m, nn.Linear) for m in model.modules())
    names = convert_to_fp8(model, choice.recipe, sharded=sharded)
    choice = choice._replace(fsdp_all_gather=gathers_in_fp8(choice.recipe, sharded=sharded))
    gather = "; FSDP all-gathers their weights in FP8" if choice.fsdp_all_gather else ""
    note = f"; {choice.reason}" if choice.reason else ""
    log.info(
        f"fp8: {choice.recipe} scaling on {len(names)} of {total} linears (torchao Float8Linear){gather}{note}; "
        f"MFU stays against the bf16 peak"
    )
    return choice
