"""
LoRA (Hu et al., 2021): fine-tune a GPT through small low-rank adapters beside chosen Linear layers while the
base weights stay frozen; the adapters alone train, and a checkpoint holds only them.

    python train.py config/finetune_shakespeare_lora.py               # adapters on a GPT-2 checkpoint
    python sample.py --out_dir=out-shakespeare-lora                   # base + adapters, merged
    python -m weights merge out-shakespeare-lora/ckpt.pt merged.pt    # one plain checkpoint of both

A LoRALinear keeps its Linear's `weight` and `bias` under their own names and adds `lora_A` (rank, in) and
`lora_B` (out, rank): the base model's state_dict keys do not change, so base weights load into a LoRA model and
a merged model saves as a plain GPT. (peft's LoRA layers rename the base weights to `<layer>.base_layer.weight`
and bring transformers and accelerate along; the wrapper is a few lines.)

An adapter checkpoint is a train.py checkpoint whose "model" holds only the adapter tensors, plus a "lora" entry:
rank, alpha, targets, dropout, and its base: the path of the checkpoint it was trained on and the sha256 of that
checkpoint's weights, checked when it is loaded. A base that is no file (training from scratch, or from another
adapter checkpoint merged) is saved inside the checkpoint instead (base ""), so such a checkpoint is full size.
"""

from __future__ import annotations

import hashlib
import logging
import math
from pathlib import Path

import torch
import torch.nn as nn
from torch.nn import functional as F

from errors import CheckpointError, UsageError
from model import GPT, GPTConfig
from storage.checkpoint import atomic_save, check_model_weights, os_reason
from weights.load import check_finite_weights, load_checkpoint, saved_model_config

log = logging.getLogger("lora")

ADAPTER_NAMES = ("lora_A", "lora_B")
ENTRY_TYPES = {"rank": int, "alpha": (int, float), "targets": str, "dropout": (int, float), "base": str}


class LoRALinear(nn.Module):
    """y = x W^T + b + dropout(x) A^T B^T * alpha/rank. B starts at zero, so until it trains y is exactly the
    Linear's output; W and b are the Linear's own Parameters, under the same names."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float = 0.0):
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias
        self.lora_A = nn.Parameter(base.weight.new_empty(rank, base.in_features))
        self.lora_B = nn.Parameter(base.weight.new_zeros(base.out_features, rank))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))  # as nn.Linear (and peft) initialize it
        self.rank, self.alpha, self.scaling = rank, alpha, alpha / rank
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def forward(self, x):
        update = F.linear(F.linear(self.dropout(x), self.lora_A), self.lora_B)  # (..., out) through (..., rank)
        return F.linear(x, self.weight, self.bias) + update * self.scaling

    @torch.no_grad()
    def merged(self) -> nn.Linear:
        """A plain Linear whose weight is W + B A * alpha/rank (the same Parameter, changed in place)."""
        self.weight += (self.lora_B.float() @ self.lora_A.float() * self.scaling).to(self.weight.dtype)
        linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        linear.weight, linear.bias = self.weight, self.bias
        return linear


# ----------------------------------------------------------------------------------------------
# Adapters on a model


def targetable_layers(model: nn.Module) -> dict[str, nn.Module]:
    """{module name: layer} LoRA can adapt (or has): every Linear except one tied to an embedding (GPT-2's lm_head
    shares wte's weight: merging an update into it would change the token embeddings too)."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    return {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, (nn.Linear, LoRALinear)) and id(module.weight) not in embeddings
    }


def select_targets(model: nn.Module, targets: str) -> list[str]:
    """Names of the layers `targets` (comma-separated module-name suffixes: c_attn, attn.c_proj, ...) picks;
    ValueError naming the suffixes there are when one picks nothing."""
    layers = list(targetable_layers(model))
    suffixes = [t.strip() for t in targets.split(",") if t.strip()]
    if not suffixes:
        raise ValueError("lora_targets is empty; name the layers to adapt, e.g. c_attn,c_proj")
    picked = []
    for suffix in suffixes:
        matches = [name for name in layers if name == suffix or name.endswith("." + suffix)]
        if not matches:
            there = sorted({name.rsplit(".", 1)[-1] for name in layers})
            raise ValueError(
                f"lora_targets: {suffix!r} matches no Linear layer; the model has {', '.join(there)} "
                f"(a longer suffix such as attn.c_proj picks fewer; lm_head is tied to wte and cannot be adapted)"
            )
        picked += [name for name in matches if name not in picked]
    return picked


def check_targets(config: GPTConfig, targets: str) -> None:
    """select_targets on a model of this config built on the meta device (no memory, no time)."""
    with torch.device("meta"):
        select_targets(GPT(config), targets)


def apply_lora(model: nn.Module, rank: int, alpha: float = 16.0, targets: str = "c_attn,c_proj", dropout=0.0):
    """Put a LoRALinear on each target layer and freeze everything else; returns the model (changed in place).
    Its output is unchanged until the adapters train."""
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ValueError(f"lora rank must be a positive integer, got {rank!r}")
    if any(isinstance(m, LoRALinear) for m in model.modules()):
        raise ValueError("the model already has LoRA adapters; merge_lora it first")
    for name in select_targets(model, targets):
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, child, LoRALinear(getattr(parent, child), rank, alpha, dropout))
    freeze_base(model)
    return model


def freeze_base(model: nn.Module) -> None:
    """Only adapter tensors train."""
    for name, param in model.named_parameters():
        param.requires_grad = name.rsplit(".", 1)[-1] in ADAPTER_NAMES


def merge_lora(model: nn.Module):
    """Fold every adapter into its layer's weight and put plain Linears back: a plain GPT, all of it trainable,
    whose outputs equal the LoRA model's (up to rounding)."""
    for name, module in list(model.named_modules()):
        if isinstance(module, LoRALinear):
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name), child, module.merged())
    for param in model.parameters():
        param.requires_grad = True
    model.__dict__.pop("lora_base", None)
    return model


def is_adapter_key(key: str) -> bool:
    return key.rsplit(".", 1)[-1] in ADAPTER_NAMES


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter tensors alone (`<layer>.lora_A`, `<layer>.lora_B`)."""
    return {key: value for key, value in model.state_dict().items() if is_adapter_key(key)}


def load_lora_state_dict(model: nn.Module, adapters: dict[str, torch.Tensor]) -> None:
    """Load adapter tensors into a model with the same adapters; ValueError (one line) when they do not fit."""
    check_model_weights(lora_state_dict(model), adapters, "the adapters")
    model.load_state_dict(adapters, strict=False)


def lora_settings(model: nn.Module) -> dict:
    """rank, alpha, targets, dropout of a LoRA model's adapters (targets: the adapted layers' names)."""
    layers = {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}
    first = next(iter(layers.values()))
    dropout = first.dropout.p if isinstance(first.dropout, nn.Dropout) else 0.0
    return {"rank": first.rank, "alpha": first.alpha, "targets": ",".join(layers), "dropout": dropout}


def weights_digest(weights: dict[str, torch.Tensor]) -> str:
    """sha256 over names, dtypes, shapes and bytes of a state_dict: names a base model's weights exactly."""
    digest = hashlib.sha256()
    for key in sorted(weights):
        tensor = weights[key].detach().cpu().contiguous()
        digest.update(f"{key} {tensor.dtype} {tuple(tensor.shape)}\n".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()


# ----------------------------------------------------------------------------------------------
# Checkpoints: what train.py and sample.py load and save


def load_model_weights(model: GPT, checkpoint: dict, path, *, keep_adapters: bool = False) -> None:
    """Load a checkpoint into `model`, a plain GPT built from its model_config. A plain checkpoint's weights load
    as they are; an adapter checkpoint's base (its base file, checked by sha256, or its own copy) loads, then its
    adapters go on: kept as adapters with keep_adapters (resuming LoRA training), else merged in. CheckpointError
    (one line) for anything that does not fit."""
    entry = checkpoint.get("lora")
    untied = checkpoint.get("model_config", {}).get("tie_embeddings", True) is False
    if untied and model.config.tie_embeddings:  # both hold lm_head.weight: loading would silently tie them
        raise CheckpointError(
            f"{path}: its output layer is untied from wte (tie_embeddings=False), and this model ties them; "
            f"build the model with tie_embeddings=False"
        )
    if entry is None:
        check_model_weights(model.state_dict(), checkpoint["model"], path)
        model.load_state_dict(checkpoint["model"])
        return
    check_entry(entry, path)
    adapters = {k: v for k, v in checkpoint["model"].items() if is_adapter_key(k)}
    base = {k: v for k, v in checkpoint["model"].items() if not is_adapter_key(k)}
    if entry["base"]:
        base = read_base(entry, path, model.config.block_size)
    check_model_weights(model.state_dict(), base, path)
    model.load_state_dict(base)
    try:
        apply_lora(model, entry["rank"], entry["alpha"], entry["targets"], entry["dropout"])
        load_lora_state_dict(model, adapters)
    except (ValueError, CheckpointError) as error:
        raise CheckpointError(f"{path}: its LoRA adapters do not fit its model ({error})") from None
    model.lora_base = {"base": entry["base"], "base_sha256": entry["base_sha256"]}
    if not keep_adapters:
        merge_lora(model)


def check_entry(entry, path) -> None:
    if not isinstance(entry, dict):
        raise CheckpointError(f"{path}: its 'lora' entry is not a dict")
    for key, kind in {**ENTRY_TYPES, "base_sha256": str}.items():
        if not isinstance(entry.get(key), kind) or isinstance(entry.get(key), bool):
            raise CheckpointError(f"{path}: its 'lora' entry lacks {key} or has the wrong type")


def read_base(entry: dict, path, block_size: int) -> dict[str, torch.Tensor]:
    """The weights of an adapter checkpoint's base file, checked against the sha256 saved with the adapters and
    cropped to the adapters' block_size (a fine-tune may train on shorter blocks)."""
    base_path = Path(entry["base"])
    if not base_path.is_file():
        raise CheckpointError(f"{path} holds LoRA adapters on {base_path}, which is missing; put the base back there")
    base = load_checkpoint(base_path)
    if "lora" in base:
        raise CheckpointError(f"{path}: its base {base_path} is itself an adapter checkpoint; merge it first")
    if weights_digest(base["model"]) != entry["base_sha256"]:
        raise CheckpointError(
            f"{path} holds LoRA adapters trained on other weights than {base_path} now holds (sha256 differs); "
            f"use the checkpoint they were trained on"
        )
    weights = dict(base["model"])
    weights["transformer.wpe.weight"] = weights["transformer.wpe.weight"][:block_size]
    return weights


def setup_lora(model: GPT, cfg, checkpoint: dict | None, path) -> GPT:
    """train.py, after the weights are loaded (and the context cropped): with lora_rank > 0, adapters on
    cfg.lora_targets (new, or the resumed checkpoint's, which must match the settings), the rest frozen, and the
    base remembered for checkpoints (see checkpoint_entries). UsageError when a run and its checkpoint disagree."""
    resumed = getattr(model, "lora_base", None) is not None
    if cfg.lora_rank == 0:
        if resumed:
            raise UsageError(f"{path} holds LoRA adapters; resume it with the same --lora_* settings it was saved with")
        return model
    if resumed:
        saved = lora_settings(model)
        wanted = {"rank": cfg.lora_rank, "alpha": cfg.lora_alpha, "dropout": cfg.lora_dropout}
        differ = [f"lora_{k}={saved[k]} (config says {v})" for k, v in wanted.items() if float(saved[k]) != v]
        layers = saved["targets"].split(",")
        if sorted(layers) != sorted(select_targets(model, cfg.lora_targets)):
            kinds = ", ".join(sorted({name.rsplit(".", 1)[-1] for name in layers}))
            differ.append(
                f"adapters on {len(layers)} {kinds} layers, not those lora_targets={cfg.lora_targets!r} picks"
            )
        if differ:
            raise UsageError(f"{path} holds adapters with {'; '.join(differ)}; resume with its settings")
    elif checkpoint is not None and cfg.init_from == "resume":
        raise UsageError(
            f"{path} is a full model's checkpoint; LoRA fine-tunes from --init_from=PATH into a new out_dir"
        )
    else:
        # a base file is named only where it is one of ours; a Hugging Face folder's weights go with the adapters
        plain_file = checkpoint is not None and "lora" not in checkpoint and Path(path).is_file()
        base = str(Path(path).resolve()) if plain_file else ""
        digest = weights_digest(checkpoint["model"]) if plain_file else ""
        apply_lora(model, cfg.lora_rank, cfg.lora_alpha, cfg.lora_targets, cfg.lora_dropout)
        model.lora_base = {"base": base, "base_sha256": digest}
    freeze_base(model)  # again after a crop, which makes a new position-embedding Parameter
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    base = model.lora_base["base"]
    where = f"read from {base}" if base else "saved with the adapters (no base file)"
    log.info(f"LoRA rank {cfg.lora_rank}: {trained:,} of {total:,} parameters train; base weights {where}")
    return model


def checkpoint_entries(model: GPT) -> dict:
    """A checkpoint's "model" (and "lora") entries: the whole state_dict, or, for a LoRA model, its adapters, the
    base's weights only when no base file holds them, and the adapters' settings and base."""
    base = getattr(model, "lora_base", None)
    if base is None:
        return {"model": model.state_dict()}
    weights = lora_state_dict(model) if base["base"] else model.state_dict()
    return {"model": weights, "lora": {**lora_settings(model), **base}}


# ----------------------------------------------------------------------------------------------
# python -m weights merge ADAPTER.pt OUT.pt


def merge_checkpoint(adapter_path, out_path) -> Path:
    """A plain checkpoint (model, model_config, meta) of an adapter checkpoint's base with its adapters merged."""
    adapter_path, out_path = Path(adapter_path), Path(out_path)
    state = load_checkpoint(adapter_path)
    if "lora" not in state:
        raise CheckpointError(f"{adapter_path} holds no LoRA adapters; it is a plain checkpoint already")
    model = GPT(saved_model_config(state, adapter_path))
    load_model_weights(model, state, adapter_path)
    base = state["lora"]["base"]
    if out_path.exists() and out_path.resolve() in (adapter_path.resolve(), *([Path(base).resolve()] if base else [])):
        raise CheckpointError(f"refusing to write the merged model over {out_path}; name another file")
    check_finite_weights(model.state_dict(), f"{adapter_path} merged into its base", "nothing usable can be written")
    merged = {"model": model.state_dict(), "model_config": state["model_config"], "meta": state["meta"]}
    try:
        atomic_save(merged, out_path)
    except OSError as error:
        raise CheckpointError(f"cannot write {out_path}: {os_reason(error)}") from None
    return out_path
