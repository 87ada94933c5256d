"""
Reading a checkpoint for a model: ours (checked against the schema and this version's GPTConfig) or nanoGPT's
(converted on the way in). Plain file I/O lives in storage/checkpoint.py; this adds what needs the model.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from data.common import read_meta_pkl
from data.tokenizer import gpt2_meta
from errors import CheckpointError, DataError
from model import GPTConfig
from storage import checkpoint as storage
from storage.checkpoint import is_checkpoint_name, write_safetensors
from storage.memory import available_memory, format_bytes
from storage.pretrained import is_mask_buffer


def load_checkpoint(path, map_location="cpu", *, resume: bool = False) -> dict:
    """The checkpoint at `path` (a nanoGPT one converted), read without running code and checked: the schema
    (storage.checkpoint.check_schema) and a model_config this version knows. CheckpointError (one line) else."""
    path = Path(path)
    folder = path if path.is_dir() else path.parent if path.name == storage.LATEST and not path.exists() else None
    if folder is not None and (folder / "config.json").is_file():  # an out_dir was expected
        raise CheckpointError(hf_folder_line(folder))
    state = storage.read_checkpoint_file(path, map_location)
    if isinstance(state, dict) and "model_args" in state and "model_config" not in state:
        state = from_nanogpt(state, path)
        if resume:
            raise CheckpointError(
                f"{path} is a nanoGPT checkpoint: its weights load, but its run cannot be resumed here (nanoGPT "
                f"saves no data position or RNG states in our format); fine-tune from it into a new out_dir: "
                f"--init_from={path} --out_dir=<another folder>"
            )
    storage.check_schema(state, path, resume=resume)
    known_model_config(state, path)
    return state


def hf_folder_line(folder: Path) -> str:
    """A Hugging Face GPT-2 folder where a .pt checkpoint (or an out_dir) is needed."""
    if not any((folder / name).is_file() for name in ("model.safetensors", "pytorch_model.bin")):
        return (
            f"{folder} is a Hugging Face GPT-2 folder with config.json but no weights (model.safetensors or "
            f"pytorch_model.bin), not a .pt checkpoint of this repo"
        )
    return (
        f"{folder} is a Hugging Face GPT-2 folder (config.json + weights), not a .pt checkpoint of this repo; "
        f"train.py and sample.py read it as it is: --init_from={folder}"
    )


def known_model_config(state: dict, path) -> GPTConfig:
    """The checkpoint's GPTConfig; one line for settings this version does not know (a newer version's)."""
    try:
        return GPTConfig.from_dict(state["model_config"])
    except ValueError as error:
        raise CheckpointError(f"{path}: {error}") from None


def saved_model_config(state: dict, path, device: torch.device | None = None) -> GPTConfig:
    """The GPTConfig to build a checkpoint's model from: known_model_config's, and one line, before anything is
    allocated, for a model that cannot fit in the memory there is (on the host, and on `device`)."""
    config = known_model_config(state, path)
    check_model_memory(config, path)
    if device is not None and device.type == "cuda":
        check_model_memory(config, path, device)
    return config


def check_model_memory(config: GPTConfig, path, device: torch.device | None = None) -> None:
    """CheckpointError (one line) before a model is built whose float32 weights (as GPT builds them, on the host,
    then on `device`) cannot fit in the memory available: a checkpoint's config is untrusted input."""
    params = config.parameter_count()
    need = 4 * params
    if device is not None and device.type == "cuda":
        available, where = torch.cuda.mem_get_info(device)[0], f"{device} has"
    else:
        available, where = available_memory(), "this machine has"
    if available is not None and need > available:
        shape = f"n_layer={config.n_layer}, n_embd={config.n_embd}, vocab_size={config.vocab_size}"
        raise CheckpointError(
            f"{path}: its model_config asks for at least {params:,} parameters ({shape}), "
            f"{format_bytes(need)} in float32, but {where} {format_bytes(available)} available; "
            f"use it on a machine with more memory, or check that it is the checkpoint you meant"
        )


def check_finite_weights(weights: dict[str, torch.Tensor], path, consequence: str) -> None:
    """CheckpointError naming the tensors (the first first) when weights hold NaN or inf: nothing usable comes of
    them (training refuses to save such a state, but a file can come from elsewhere). `consequence`: what the
    caller cannot do, for the line."""
    bad = [name for name, tensor in weights.items() if tensor.is_floating_point() and not tensor.isfinite().all()]
    if bad:
        names = ", ".join(bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
        raise CheckpointError(
            f"{path} has non-finite weights (NaN or inf in {names}): {consequence}; "
            f"use an earlier checkpoint of the run (best.pt, ckpt-NNNNNNN.pt)"
        )


def from_nanogpt(state: dict, path: Path) -> dict:
    """A nanoGPT checkpoint (model_args, model) as ours: `_orig_mod.` prefixes (torch.compile's) and the causal
    mask buffers dropped; the tokenizer is GPT-2's for a GPT-2-sized vocabulary, else the char vocabulary of
    its dataset's meta.pkl (data/<dataset>/meta.pkl, or beside the checkpoint)."""
    args, weights = state.get("model_args"), state.get("model")
    if not isinstance(args, dict) or not isinstance(weights, dict):
        raise CheckpointError(f"{path}: a nanoGPT checkpoint needs model_args and model dicts")
    known = {f.name for f in dataclasses.fields(GPTConfig)}
    model_config = {key: value for key, value in args.items() if key in known}
    model = {
        str(key).removeprefix("_orig_mod."): value for key, value in weights.items() if not is_mask_buffer(str(key))
    }
    return {"model": model, "model_config": model_config, "meta": nanogpt_meta(state, path), "source": "nanoGPT"}


def nanogpt_meta(state: dict, path: Path) -> dict:
    vocab_size = state["model_args"].get("vocab_size")
    if isinstance(vocab_size, int) and vocab_size >= 50257:
        return gpt2_meta()
    dataset = (state.get("config") or {}).get("dataset", "")
    places = ([Path("data") / str(dataset) / "meta.pkl"] if dataset else []) + [path.parent / "meta.pkl"]
    found = next((place for place in places if place.is_file()), None)
    if found is None:
        raise CheckpointError(
            f"{path}: a nanoGPT checkpoint of vocab_size {vocab_size} needs its dataset's meta.pkl for the "
            f"tokenizer; put it at {' or '.join(map(str, places))}"
        )
    try:
        return read_meta_pkl(found)
    except DataError as error:
        raise CheckpointError(str(error)) from None


def refuse_adapters(state: dict, path: Path) -> None:
    """An export needs a plain checkpoint: an adapter checkpoint names the command that merges it."""
    if "lora" in state:
        merged = path.with_name(f"{path.stem}-merged.pt")
        raise CheckpointError(
            f"{path} is a LoRA adapter checkpoint (adapters on a base model), not a plain one; merge them into "
            f"their base first: python -m weights merge {path} {merged}"
        )


def export_safetensors(checkpoint_path, out_path) -> Path:
    """Model weights only (no optimizer, no pickle), with the model config in the file's metadata."""
    checkpoint_path, out_path = Path(checkpoint_path), Path(out_path)
    if out_path.resolve() == checkpoint_path.resolve() or is_checkpoint_name(out_path.name):
        raise CheckpointError(
            f"refusing to write the export over the checkpoint {out_path}; name another file (a checkpoint's name, "
            f"{out_path.name}, would hold a safetensors file)"
        )
    if not out_path.parent.is_dir():
        raise CheckpointError(f"cannot write {out_path}: folder {out_path.parent} does not exist")
    state = load_checkpoint(checkpoint_path)
    refuse_adapters(state, checkpoint_path)
    check_finite_weights(state["model"], checkpoint_path, "an export of them is of no use to any tool")
    # lm_head.weight is tied to transformer.wte.weight (unless tie_embeddings=False); safetensors stores shared
    # tensors only once
    tied = state["model_config"].get("tie_embeddings", True)
    weights = {k: v.contiguous() for k, v in state["model"].items() if k != "lm_head.weight" or not tied}
    metadata = {"model_config": json.dumps(state["model_config"])}
    metadata |= {"tied": "lm_head.weight=transformer.wte.weight"} if tied else {}
    return write_safetensors(weights, out_path, metadata)
