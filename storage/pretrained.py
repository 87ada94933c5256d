"""
Pretrained weights as plain data: a hub name (gpt2 ... gpt2-xl), a Hugging Face GPT-2 folder, or a checkpoint of
this repo or nanoGPT's, read as (model settings, a function that reads the weights). The settings are the names
of model.py's GPTConfig fields, but nothing here imports the model: the caller builds its config from them and
checks its size (check_fits_in_memory) before it reads the weights (GPT.from_pretrained, weights/hf.py). Bad
input is one ValueError line, so that model.py alone can say it; this module imports nothing else of this repo.

HF's GPT-2 keeps GPT-2's parameter names, as ours do, but stores its four projections as Conv1D with weights
(in, out) where nn.Linear has (out, in): they are transposed on the way in (and out, in weights/hf.py).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable
from pathlib import Path

import torch

HUB_NAMES = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")
HF_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")  # in order of preference
CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")  # stored (in, out)
MASK_BUFFERS = ("attn.bias", "attn.masked_bias")  # the causal mask, saved by older GPT-2 code: not weights
NANOGPT_ARGS = ("n_layer", "n_head", "n_embd", "block_size", "bias", "vocab_size", "dropout")  # its model_args
# config.json settings that GPT-2's math would need and ours does not do: {setting: (HF's default, what is allowed)}
# fmt: off
HF_EXACT = {"layer_norm_epsilon": (1e-5, "1e-05"), "activation_function": ("gelu_new", "gelu_new (tanh GELU)"),
            "scale_attn_weights": (True, "true"), "scale_attn_by_inverse_layer_idx": (False, "false"),
            "add_cross_attention": (False, "false")}
# fmt: on

Pretrained = tuple[dict, Callable[[], dict]]  # (GPTConfig fields, () -> state dict under our names)


def read_pretrained(source) -> Pretrained:
    """(GPTConfig fields, weights reader) of GPT.from_pretrained's `source`; ValueError, one line, for a source
    that is none of those it takes."""
    path = Path(source)
    if path.is_dir() and (path / "ckpt.pt").is_file():
        path = path / "ckpt.pt"
    if path.is_file():
        return read_checkpoint(path)
    if (path / "config.json").is_file() or str(source) in HUB_NAMES:
        return read_hf_folder(path if (path / "config.json").is_file() else hub_folder(str(source)))
    raise ValueError(
        f"{source!r} is not a checkpoint file, an out_dir with ckpt.pt, a Hugging Face GPT-2 folder "
        f"(config.json + weights) or a hub name ({', '.join(HUB_NAMES)})"
    )


def read_checkpoint(path: Path) -> Pretrained:
    """A .pt of this repo (model_config) or nanoGPT's (model_args), read without running code. torch.load reads
    the whole file, so its weights are at hand already; the reader returns them."""
    state = load_torch_file(path)
    config = state.get("model_config", state.get("model_args")) if isinstance(state, dict) else None
    if not isinstance(config, dict) or not isinstance(state.get("model"), dict):
        raise ValueError(f"{path} holds no model_config (or nanoGPT's model_args) and model")
    if "lora" in state:
        raise ValueError(f"{path} holds LoRA adapters; merge them first: python -m weights merge {path} OUT.pt")
    if "model_config" not in state:  # nanoGPT's: its own settings only (ours are checked whole, by the caller)
        config = {key: value for key, value in config.items() if key in NANOGPT_ARGS}
    weights = {str(k).removeprefix("_orig_mod."): v for k, v in state["model"].items() if not is_mask_buffer(str(k))}
    return config, lambda: weights


def load_torch_file(path: Path):
    """A torch.save file (tensors and containers only: no code runs) or a safetensors file, on the CPU."""
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            return load_file(path)
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # torch.load and safetensors raise many kinds for a file that is not one
        raise ValueError(f"{path} cannot be read as a checkpoint ({str(error).splitlines()[0]})") from None


def hub_folder(name: str) -> Path:
    """The cached snapshot of a hub model (downloaded first unless HF_HUB_OFFLINE=1); one line if it is not there."""
    try:
        from huggingface_hub import constants, snapshot_download
    except ImportError:
        raise ValueError(f"loading {name} by name needs huggingface_hub: pip install huggingface_hub") from None
    patterns = ["config.json", "model.safetensors"]
    with contextlib.suppress(OSError, ValueError):  # not cached (LocalEntryNotFoundError is an OSError)
        return Path(snapshot_download(name, allow_patterns=patterns, local_files_only=True))
    with contextlib.suppress(OSError, ValueError):  # no network, a failed download: HfHubHTTPError is an OSError
        if not constants.HF_HUB_OFFLINE:
            return Path(snapshot_download(name, allow_patterns=patterns))
    raise ValueError(
        f"{name} is not in the local Hugging Face cache and the hub cannot be reached; download it with "
        f"`hf download {name} config.json model.safetensors` or pass a local directory"
    )


def read_hf_folder(folder: Path) -> Pretrained:
    """(GPTConfig fields, weights reader) of a Hugging Face GPT-2 folder. Only config.json is read here: the
    weights wait for the reader, which the caller runs once it knows the model fits in memory."""
    model_config = hf_model_config(folder / "config.json")

    def read_weights() -> dict:
        path = next((folder / name for name in HF_WEIGHT_FILES if (folder / name).is_file()), None)
        if path is None:
            raise ValueError(
                f"{folder} is a Hugging Face GPT-2 folder with config.json but no weights "
                f"({' or '.join(HF_WEIGHT_FILES)}); copy or download its weights file into it"
            )
        saved = load_torch_file(path)
        if not isinstance(saved, dict):
            raise ValueError(f"{path} is not a state dict")
        return hf_state_dict(saved, model_config["tie_embeddings"])

    return model_config, read_weights


def hf_model_config(path: Path) -> dict:
    """config.json -> the GPTConfig fields it sets (HF's defaults where it is silent); a setting our GPT cannot
    reproduce exactly is one ValueError line. Each value's own check is GPTConfig's, where the caller builds it."""
    try:
        hf = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, RecursionError, json.JSONDecodeError) as error:
        raise ValueError(f"{path} cannot be read as JSON ({error})") from None
    if not isinstance(hf, dict):
        raise ValueError(f"{path} must hold a JSON object")
    if hf.get("model_type", "gpt2") != "gpt2":
        raise ValueError(f"{path}: model_type {hf['model_type']!r} is not gpt2; only GPT-2 models load")
    n_embd = hf.get("n_embd", 768)
    exact = {**HF_EXACT, "n_inner": (None, f"null or 4*n_embd = {4 * n_embd}")}
    for key, (default, allowed) in exact.items():
        value = hf.get(key, default)
        if value != default and not (key == "n_inner" and value == 4 * n_embd):
            raise ValueError(f"{path}: {key}={value!r} is not supported; allowed: {allowed}")
    return {  # vocab_size as is, never padded: the logits must be HF's
        "block_size": hf.get("n_positions", 1024),
        "vocab_size": hf.get("vocab_size", 50257),
        **{key: hf.get(key, 12) for key in ("n_layer", "n_head")},
        "n_embd": n_embd,
        "tie_embeddings": hf.get("tie_word_embeddings", True) is not False,
    }


def hf_state_dict(saved: dict, tied: bool = True) -> dict:
    """HF GPT-2's tensors under our names: Conv1D weights transposed, mask buffers dropped; lm_head is wte's
    where the model ties them, else its own (tie_word_embeddings=false)."""
    model = {}
    for key, tensor in saved.items():
        name = key.removeprefix("transformer.")  # older files (the hub's gpt2) have no prefix
        if is_mask_buffer(name) or name == "lm_head.weight":
            continue
        model["transformer." + name] = tensor.t() if name.endswith(CONV1D) and tensor.dim() == 2 else tensor
    if tied and "transformer.wte.weight" in model:
        model["lm_head.weight"] = model["transformer.wte.weight"]
    elif "lm_head.weight" in saved:
        model["lm_head.weight"] = saved["lm_head.weight"]
    return model


def is_mask_buffer(name: str) -> bool:
    return ".".join(name.split(".")[-2:]) in MASK_BUFFERS  # h.0.attn.bias is; h.0.attn.c_attn.bias is not


def check_fits_in_memory(config, bytes_per_param: int = 4) -> None:
    """ValueError, one line, for a model whose float32 weights alone exceed this machine's RAM: checked from the
    config (model.py's GPTConfig) before anything is allocated, since a config.json or checkpoint may ask for any
    size."""
    params = config.parameter_count()
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not on every platform
        return
    if params * bytes_per_param > ram:
        raise ValueError(
            f"the model asks for {params:,} parameters ({params * bytes_per_param / 2**30:,.1f} GiB in float32) but "
            f"this machine has {ram / 2**30:,.1f} GiB of RAM (n_layer={config.n_layer}, n_embd={config.n_embd}, "
            f"vocab_size={config.vocab_size})"
        )
