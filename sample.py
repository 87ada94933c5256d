"""
Sample text from a trained checkpoint.

    python sample.py --out_dir=out-shakespeare-char --start="ROMEO:" --num_samples=3 --max_new_tokens=300
    python sample.py --start=FILE:prompt.txt --temperature=0.8 --top_k=200 --seed=7
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from checkpoint import CheckpointError, load_checkpoint
from configurator import ConfigError, load_config
from data.common import DataError
from data.tokenizer import load_tokenizer
from model import GPT, GPTConfig
from runtime import Runtime, UsageError, pick_device, pick_dtype


@dataclass
class SampleConfig:
    out_dir: str = "out-shakespeare-char"  # folder with ckpt.pt (from train.py)
    checkpoint: str = ""  # a .pt file to use instead of out_dir/ckpt.pt
    start: str = "\n"  # the prompt; FILE:path reads it from a file
    num_samples: int = 3  # how many samples
    max_new_tokens: int = 500  # tokens generated per sample
    temperature: float = 0.8  # < 1 is more conservative, > 1 more random
    top_k: int | None = 200  # keep only the k likeliest tokens; None keeps all
    seed: int = 1337  # sampling seed
    device: str = "auto"  # auto | cpu | cuda | cuda:N | mps
    dtype: str = "auto"  # auto | bfloat16 | float16 | float32
    attention_backend: str = "auto"  # attention kernel for sampling (see python model.py)

    def __post_init__(self):
        if self.num_samples < 1 or self.max_new_tokens < 1:
            raise ValueError("num_samples and max_new_tokens must be >= 1")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be >= 1 or None, got {self.top_k}")


def read_prompt(start: str) -> str:
    if not start.startswith("FILE:"):
        return start
    path = Path(start.removeprefix("FILE:"))
    if not path.is_file():
        raise UsageError(f"prompt file {path} does not exist")
    return path.read_text(encoding="utf-8")


def sample(cfg: SampleConfig) -> int:
    device = pick_device(cfg.device)
    runtime = Runtime(device, pick_dtype(cfg.dtype, device))
    state = load_checkpoint(cfg.checkpoint or Path(cfg.out_dir) / "ckpt.pt")
    model = GPT(GPTConfig(**{**state["model_config"], "attention_backend": cfg.attention_backend, "dropout": 0.0}))
    model.load_state_dict(state["model"])
    model.eval().to(device)
    encode, decode = load_tokenizer(state["meta"])
    prompt = encode(read_prompt(cfg.start))
    if not prompt:
        raise UsageError("the prompt is empty; give --start some text")
    torch.manual_seed(cfg.seed)
    idx = torch.tensor(prompt, dtype=torch.long, device=device)[None, :]
    generated, started = 0, time.time()
    with runtime.autocast():
        for _ in range(cfg.num_samples):
            out = model.generate(idx, cfg.max_new_tokens, temperature=cfg.temperature, top_k=cfg.top_k)
            generated += cfg.max_new_tokens
            print(decode(out[0].tolist()))
            print("---------------", flush=True)
    elapsed = time.time() - started
    print(f"{generated} tokens in {elapsed:.1f} s ({generated / elapsed:,.0f} tokens/s)", file=sys.stderr)
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        return sample(load_config(SampleConfig(), argv))
    except (ConfigError, CheckpointError, DataError, UsageError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
