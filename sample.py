"""
Sample text from a trained checkpoint.

    python sample.py --out_dir=out-shakespeare-char --start="ROMEO:" --num_samples=3 --max_new_tokens=300
    python sample.py --start=FILE:prompt.txt --temperature=0.8 --top_k=200 --seed=7

Each sample is printed whole, then a separator line. Ctrl-C prints the sample in progress as far as it got and
exits with code 130, a shell's code for SIGINT (so `sample.py && next` stops); a closed stdout (`... | head -1`)
ends the run quietly with code 0. Bad input is one `error: ` line on stderr and exit code 2.
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from checkpoint import CheckpointError, load_checkpoint
from configurator import ConfigError, load_config
from data.common import DataError
from data.tokenizer import load_tokenizer, tokenizer_vocab_size
from model import GPT, GPTConfig
from runtime import Runtime, UsageError, pick_device, pick_dtype

SEPARATOR = "---------------"


@dataclass
class SampleConfig:
    out_dir: str = "out-shakespeare-char"  # folder with ckpt.pt (from train.py)
    checkpoint: str = ""  # a .pt file to use instead of out_dir/ckpt.pt
    start: str = "\n"  # the prompt; FILE:path reads it from a file
    num_samples: int = 3  # how many samples
    max_new_tokens: int = 500  # tokens generated per sample
    temperature: float = 0.8  # < 1 is more conservative, > 1 more random; 0 is greedy (always the likeliest token)
    top_k: int | None = 200  # keep only the k likeliest tokens; None keeps all
    seed: int = 1337  # sampling seed
    device: str = "auto"  # auto | cpu | cuda | cuda:N | mps
    dtype: str = "auto"  # auto | bfloat16 | float16 | float32
    attention_backend: str = "auto"  # attention kernel for sampling (see python model.py)

    def __post_init__(self):
        if self.num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {self.num_samples}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be >= 0 (0 is greedy), got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be >= 1 or None, got {self.top_k}")


def read_prompt(start: str) -> str:
    if not start.startswith("FILE:"):
        return start
    path = Path(start.removeprefix("FILE:"))
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UsageError(f"prompt file {path} does not exist") from None
    except UnicodeDecodeError as e:
        raise UsageError(f"prompt file {path} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:  # a directory, no permission, a symlink loop, ...
        raise UsageError(f"prompt file {path} cannot be read ({e.strerror or e})") from None


@torch.no_grad()
def generate(
    model: GPT, idx: torch.Tensor, max_new_tokens: int, vocab_size: int, temperature: float, top_k: int | None
) -> Iterator[torch.Tensor]:
    """Yield idx (B, T) grown by one token at a time, drawn only from ids below vocab_size (the tokenizer's).

    A model's vocabulary is often padded (GPT-2's 50257 ids to 50304, char vocabularies of 1024+ to a multiple of
    64) and the padding ids decode to nothing; GPT.generate would draw them too. Yielding each step lets Ctrl-C
    keep the tokens drawn so far. temperature 0 takes the likeliest token.
    """
    block_size = model.config.block_size
    for _ in range(max_new_tokens):
        logits, _ = model(idx[:, -block_size:])  # the model reads at most block_size tokens
        logits = logits[:, -1, :vocab_size].float()  # (B, vocab_size): the padding ids are never candidates
        if temperature == 0:
            next_token = logits.argmax(dim=-1, keepdim=True)
        else:
            logits = logits / temperature
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, vocab_size)).values[:, [-1]]
                logits[logits < kth] = -float("inf")
            next_token = torch.multinomial(torch.softmax(logits, dim=-1), num_samples=1)
        idx = torch.cat((idx, next_token), dim=1)
        yield idx


def sample(cfg: SampleConfig) -> int:
    device = pick_device(cfg.device)
    runtime = Runtime(device, pick_dtype(cfg.dtype, device))
    state = load_checkpoint(cfg.checkpoint or Path(cfg.out_dir) / "ckpt.pt")
    model = GPT(GPTConfig(**{**state["model_config"], "attention_backend": cfg.attention_backend, "dropout": 0.0}))
    model.load_state_dict(state["model"])
    model.eval().to(device)
    model.setup_attention(device, runtime.dtype, training=False)
    encode, decode = load_tokenizer(state["meta"])
    vocab_size = tokenizer_vocab_size(state["meta"])
    if vocab_size > model.config.vocab_size:
        raise CheckpointError(
            f"the checkpoint's tokenizer has {vocab_size} ids but its model only {model.config.vocab_size}"
        )
    try:
        prompt = encode(read_prompt(cfg.start))
    except DataError as e:  # a char outside a char vocabulary: say that it is the prompt's
        raise UsageError(f"--start: {e}") from None
    if not prompt:
        raise UsageError("the prompt is empty; give --start some text")
    block_size = model.config.block_size
    if len(prompt) > block_size:
        # Cropped, not refused: the model always reads a sliding window of its last block_size tokens (a long
        # sample slides past its prompt the same way), and the whole prompt is still printed with each sample.
        print(
            f"note: the prompt is {len(prompt)} tokens, longer than block_size {block_size}; "
            f"the model sees only its last {block_size}",
            file=sys.stderr,
        )
    torch.manual_seed(cfg.seed)
    idx = torch.tensor(prompt, dtype=torch.long, device=device)[None, :]
    generated, started = 0, time.time()
    for number in range(1, cfg.num_samples + 1):
        out = idx
        try:
            with runtime.autocast():
                for grown in generate(model, idx, cfg.max_new_tokens, vocab_size, cfg.temperature, cfg.top_k):
                    out = grown  # the last complete step, kept for Ctrl-C
        except KeyboardInterrupt:  # Ctrl-C: print the sample so far, whose tokens are in `out`
            print(decode(out[0].tolist()))
            print(SEPARATOR, flush=True)
            new_tokens = out.size(1) - idx.size(1)
            print(
                f"interrupted: sample {number} of {cfg.num_samples} stopped after "
                f"{new_tokens} of {cfg.max_new_tokens} tokens",
                file=sys.stderr,
            )
            return 130
        generated += cfg.max_new_tokens
        print(decode(out[0].tolist()))
        print(SEPARATOR, flush=True)
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
    except KeyboardInterrupt:  # before sampling began: nothing generated yet
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader is gone (`| head -1` has its line): stop quietly. Text left in stdout's buffer would make
        # the interpreter's flush at exit complain, so stdout goes to /dev/null first.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
