"""
GPT-2 weights in and out: Hugging Face GPT-2 checkpoints (and ours, and nanoGPT's) load into GPT, and our
checkpoints export as Hugging Face GPT-2 folders.

    python -m weights hf out/ckpt.pt hf-model/       # config.json + model.safetensors, for GPT2LMHeadModel
    model = from_pretrained("gpt2")                  # or a folder with config.json + model.safetensors

Reading a Hugging Face folder or a hub name is storage/pretrained.py's (GPT.from_pretrained reads through it
too); this adds the checks and one-line errors of this repo, LoRA checkpoints, and the export. Hugging Face's
GPT-2 stores its four projections as Conv1D with weights (in, out) where nn.Linear has (out, in): they are
transposed on the way in and out. Hub names (gpt2 ... gpt2-xl) resolve through the Hugging Face cache; with
HF_HUB_OFFLINE=1 only what is cached loads.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from pathlib import Path

import torch

from data.common import make_out_dir
from data.tokenizer import gpt2_meta
from errors import CheckpointError, DataError
from model import GPT, GPTConfig
from storage.atomic import atomic_path
from storage.checkpoint import (
    LATEST,
    check_model_weights,
    missing_checkpoint,
    newest_save,
    write_safetensors,
)
from storage.pretrained import CONV1D, HUB_NAMES, check_fits_in_memory, hub_folder, read_hf_folder
from weights.load import load_checkpoint, refuse_adapters
from weights.lora import load_model_weights

SOURCES = (
    "a .pt checkpoint, an out_dir with ckpt.pt, a Hugging Face GPT-2 folder (config.json + model.safetensors "
    f"or pytorch_model.bin), or a hub name ({', '.join(HUB_NAMES)})"
)
# GPTConfig fields HF GPT-2 writes in config.json (bias=False exports as zero biases), and fields that only say
# how the model runs here. Any other field must keep its default, GPT-2's architecture, to be exported.
EXPRESSIBLE = ("block_size", "vocab_size", "n_layer", "n_head", "n_embd", "dropout", "bias", "tie_embeddings")
RUNTIME_ONLY = ("attention_backend", "sdpa_kernel", "auto_measure", "use_flash_attention", "disable_mps_fix")


# ----------------------------------------------------------------------------------------------
# Loading: any source of weights -> a checkpoint dict of our format (model, model_config, meta)


def load_weights(source, also: tuple[str, ...] = ()) -> tuple[dict, Path]:
    """(checkpoint, its path) from `source`: see SOURCES. `also` names the caller's other allowed values, for
    the error line."""
    path = Path(source)
    if path.is_file():
        return load_checkpoint(path), path
    if path.is_dir() and (path / LATEST).is_file():
        return load_checkpoint(path / LATEST), path / LATEST
    if (path.is_dir() and (path / "config.json").is_file()) or str(source) in HUB_NAMES:
        return load_hf(source), path
    if path.is_dir() and newest_save(path) is not None:  # an out_dir whose ckpt.pt is gone
        raise CheckpointError(missing_checkpoint(path / LATEST))
    allowed = ", ".join(also) + (", or " if also else "") + SOURCES
    why = ""  # a word that is none of the allowed: the list says it all
    if path.is_dir():
        why = f"{path} is a folder that holds no {LATEST} and no config.json; "
    elif path.exists() or path.is_symlink():
        why = missing_checkpoint(path) + "; "
    elif path.suffix or os.sep in str(source):  # meant as a path
        why = f"no such file or folder {path}; "
    raise CheckpointError(f"init_from={str(source)!r}: {why}allowed are {allowed}")


def load_hf(name_or_dir) -> dict:
    """A Hugging Face GPT-2 checkpoint (a folder, or a hub name from the local cache) as our checkpoint dict; the
    reading is storage/pretrained.py's (as GPT.from_pretrained's), its one-line errors CheckpointErrors. The
    model's size is checked from config.json before its weights are read."""
    try:
        folder = Path(name_or_dir) if Path(name_or_dir).is_dir() else hub_folder(str(name_or_dir))
        fields, read_weights = read_hf_folder(folder)
        try:
            config = GPTConfig(**fields)
        except ValueError as error:  # a value config.json holds: the line names the file
            raise ValueError(f"{folder / 'config.json'}: {error}") from None
        check_fits_in_memory(config)
        weights = read_weights()
    except ValueError as error:
        raise CheckpointError(str(error)) from None
    meta = exported_meta(folder) or gpt2_meta()  # HF's own GPT-2 folders carry no tokenizer we read
    model_config = dataclasses.asdict(config)  # every field, as our checkpoints hold them
    return {"model": weights, "model_config": model_config, "meta": meta, "source": "huggingface"}


def exported_meta(folder: Path) -> dict | None:
    """The tokenizer meta export_hf wrote into model.safetensors' metadata, or None."""
    path = folder / "model.safetensors"
    if not path.is_file():
        return None
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = json.loads((f.metadata() or {}).get("meta", "null"))
    except (SafetensorError, OSError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{path} is not a readable safetensors file ({error})") from None
    return meta if isinstance(meta, dict) else None


def model_from_checkpoint(state: dict, path, **overrides) -> GPT:
    """A GPT with the checkpoint's weights; `overrides` set GPTConfig fields that do not change the weights'
    shapes (attention_backend, dropout, ...); a smaller block_size crops the position embeddings. The size the
    config asks for is checked before anything is allocated."""
    block_size = overrides.pop("block_size", None)
    try:
        config = GPTConfig(**{**state["model_config"], **overrides})
        check_fits_in_memory(config)
    except (TypeError, ValueError) as error:
        raise CheckpointError(f"{path}: {error}") from None
    model = GPT(config)
    load_model_weights(model, state, path)  # a mismatch is one line, not a traceback; LoRA adapters merged in
    if block_size is not None and block_size != model.config.block_size:
        model.crop_block_size(block_size)
    return model


def from_pretrained(source, **overrides) -> GPT:
    """GPT from a hub name (gpt2 ... gpt2-xl), a Hugging Face GPT-2 folder, or one of our or nanoGPT's
    checkpoints (LoRA adapters merged in), with this repo's checks and one-line CheckpointErrors;
    GPT.from_pretrained is the same loader for model.py alone. See model_from_checkpoint for `overrides`."""
    state, path = load_weights(source)
    return model_from_checkpoint(state, path, **{"dropout": 0.0, **overrides})


# ----------------------------------------------------------------------------------------------
# Export: our checkpoint -> a Hugging Face GPT-2 folder


def export_hf(model_or_checkpoint, out_dir) -> Path:
    """Write out_dir/config.json and out_dir/model.safetensors that GPT2LMHeadModel.from_pretrained loads with
    the same logits. Takes a GPT, a checkpoint dict, or the path of a checkpoint; returns out_dir."""
    meta, source = None, "the model"
    if isinstance(model_or_checkpoint, GPT):
        config, weights = dataclasses.asdict(model_or_checkpoint.config), model_or_checkpoint.state_dict()
    else:
        state = model_or_checkpoint
        if not isinstance(state, dict):
            source = Path(model_or_checkpoint)
            state = load_checkpoint(source)
            refuse_adapters(state, source)
        config, weights, meta = state["model_config"], state["model"], state.get("meta")
    # every check before out_dir is created: a refused export leaves no folder behind
    check_expressible(config)
    try:
        check_fits_in_memory(GPTConfig(**config))  # before a model of that size is built, even on the meta device
    except (TypeError, ValueError) as error:
        raise CheckpointError(f"{source}: {error}") from None
    with torch.device("meta"):  # names and shapes only, no memory: ours, and GPT-2's (which has biases)
        ours, gpt2 = GPT(GPTConfig(**config)), GPT(GPTConfig(**{**config, "bias": True}))
    check_model_weights(ours.state_dict(), weights, source)
    out_dir = Path(out_dir)
    created = [folder for folder in (out_dir, *out_dir.parents) if not folder.exists()]
    try:
        make_out_dir(out_dir)
    except DataError as error:
        raise CheckpointError(str(error)) from None
    try:
        write_hf_files(config, weights, meta, gpt2, out_dir)
    except BaseException:
        if created:  # out_dir is this call's own: what it wrote there goes with it
            for name in ("model.safetensors", "config.json"):
                (out_dir / name).unlink(missing_ok=True)
        for folder in created:  # deepest first; only the folders this call made, and only while empty
            with contextlib.suppress(OSError):
                folder.rmdir()
        raise
    return out_dir


def write_hf_files(config: dict, weights: dict, meta: dict | None, gpt2: GPT, out_dir: Path) -> None:
    dtype = weights["lm_head.weight"].dtype
    hf = {}
    for name, tensor in gpt2.state_dict().items():
        if name == "lm_head.weight" and config.get("tie_embeddings", True):  # tied to wte; HF stores it once too
            continue
        tensor = weights[name] if name in weights else torch.zeros(tensor.shape, dtype=dtype)  # bias=False: exact
        hf[name] = (tensor.t() if name.endswith(CONV1D) else tensor).contiguous()
    metadata = {"format": "pt"} | ({"meta": json.dumps(meta)} if meta else {})  # transformers wants format=pt
    write_safetensors(hf, out_dir / "model.safetensors", metadata)
    write_config_json(config, meta, out_dir / "config.json")


def check_expressible(config: dict) -> None:
    """Refuse, in one line, a model HF GPT-2 cannot express: a field other than EXPRESSIBLE/RUNTIME_ONLY that
    differs from GPTConfig's default (GPT-2's architecture)."""
    defaults = {f.name: f.default for f in dataclasses.fields(GPTConfig)}
    differ = [
        f"{key}={value!r}"
        for key, value in config.items()
        if key not in EXPRESSIBLE + RUNTIME_ONLY and key in defaults and value != defaults[key]
    ]
    if differ:
        raise CheckpointError(
            f"this model cannot be exported as Hugging Face GPT-2, which has no {', '.join(differ)}; "
            f"only models with GPT-2's architecture export"
        )


def write_config_json(config: dict, meta: dict | None, path: Path) -> None:
    gpt2_tokens = config["vocab_size"] >= 50257 and (meta is None or meta.get("tokenizer") == "gpt2")
    hf = {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": config["vocab_size"],
        "n_positions": config["block_size"],
        "n_embd": config["n_embd"],
        "n_layer": config["n_layer"],
        "n_head": config["n_head"],
        "n_inner": None,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": 1e-5,
        "resid_pdrop": config.get("dropout", 0.0),
        "embd_pdrop": config.get("dropout", 0.0),
        "attn_pdrop": config.get("dropout", 0.0),
        "initializer_range": 0.02,
        "scale_attn_weights": True,
        "tie_word_embeddings": config.get("tie_embeddings", True),
        "bos_token_id": 50256 if gpt2_tokens else None,  # <|endoftext|>
        "eos_token_id": 50256 if gpt2_tokens else None,
    }
    try:
        with atomic_path(path) as tmp:  # a failed write leaves the config.json that was there
            tmp.write_text(json.dumps(hf, indent=2) + "\n", encoding="utf-8")
    except OSError as error:
        raise CheckpointError(f"cannot write {path}: {error.strerror or error}") from None
