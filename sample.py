"""
Sample text from a trained checkpoint.

    python sample.py --out_dir=out-shakespeare-char --start="ROMEO:" --num_samples=3 --max_new_tokens=300
    python sample.py --start=FILE:prompt.txt --temperature=0.8 --top_k=200 --seed=7
    python sample.py --start=FILE:prompts.txt --batch_size=8 --kv_cache=paged   # one prompt per line, 8 at a time
    python sample.py --init_from=gpt2 --start="Hello"      # Hugging Face GPT-2 weights (cached), or a folder of them

Generation reads each prompt once, then decodes one token per step from a KV cache (--kv_cache; none re-reads the
whole context every step); --compile compiles the decode step with CUDA graphs. Each sample is printed whole, then
a separator line; stderr gets the attention backend in use (an INFO line) and prefill and decode tokens/s.

Ctrl-C prints the samples in progress as far as they got and exits with code 130, a shell's code for SIGINT (so
`sample.py && next` stops); SIGTERM and SIGHUP (the terminal closed) do the same with 143 and 129. Output nobody
reads any more ends the run quietly with code 0: a closed stdout (`... | head -1`), a terminal that went away.
Output that cannot be stored (`> /dev/full`) is one `error: ` line on stderr and exit code 2, as bad input is.
"""

from __future__ import annotations

import sys

from errors import as_command

if __name__ == "__main__":  # before torch's seconds of importing: see as_command
    as_command()

import contextlib
import errno
import logging
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from os.path import expanduser
from pathlib import Path

import torch

import kernels  # noqa: F401  (registers flash-attn 3/4, flex_attention and auto's table)
from configurator import load_config
from data.tokenizer import load_tokenizer, tokenizer_vocab_size
from errors import (
    CheckpointError,
    ConfigError,
    DataError,
    NonFiniteLogits,
    Stopped,
    UsageError,
    silence,
    stream_failure,
)
from generation import stream
from generation.loop import check_generation
from model import GPT, canonical_backend
from storage.memory import fits_in_memory, format_bytes
from training.runtime import Runtime, StopOnSignals, pick_device, pick_dtype
from weights.hf import load_weights, model_from_checkpoint
from weights.load import check_finite_weights, load_checkpoint, saved_model_config

SEPARATOR = "---------------"


@dataclass
class SampleConfig:
    out_dir: str = "out-shakespeare-char"  # folder with ckpt.pt (from train.py)
    checkpoint: str = ""  # a .pt file to use instead of out_dir/ckpt.pt
    init_from: str = ""  # instead of out_dir: a .pt, an out_dir, a Hugging Face GPT-2 folder, or gpt2 ... gpt2-xl
    start: str = "\n"  # the prompt; FILE:path reads it from a file
    num_samples: int = 3  # how many samples
    max_new_tokens: int = 500  # tokens generated per sample
    temperature: float = 0.8  # < 1 is more conservative, > 1 more random; 0 is greedy (always the likeliest token)
    top_k: int | None = 200  # keep only the k likeliest tokens; None keeps all
    seed: int = 1337  # sampling seed
    device: str = "auto"  # auto | cpu | cuda | cuda:N | mps
    dtype: str = "auto"  # auto | bfloat16 | float16 | float32; bfloat16 on a GPU casts the weights (no autocast)
    attention_backend: str = "auto"  # attention kernel for sampling (see python -m kernels)
    kv_cache: str = "contiguous"  # none | contiguous | paged: the KV cache decoding reads (see generation/kv_cache.py)
    disable_mps_fix: bool = False  # on MPS, let SDPA decode from the KV cache (explicit masks) despite the NaN risk
    batch_size: int = 1  # samples generated together; above 1, a --start=FILE:path holds one prompt per line
    compile: bool = False  # torch.compile the decode step with CUDA graphs (on CUDA; elsewhere it runs eagerly)
    cuda_graph: bool = True  # on CUDA, capture the decode step and the draw once as a CUDA graph (no compile)
    slide: str = "half"  # past block_size: half (re-read the last block_size/2, decode on) | exact (nanoGPT's)

    def __post_init__(self):
        # paths as a person types them: a shell leaves the ~ of --out_dir=~/run as it is
        self.out_dir, self.checkpoint, self.init_from = map(expanduser, (self.out_dir, self.checkpoint, self.init_from))
        if self.start.startswith("FILE:"):
            self.start = "FILE:" + expanduser(self.start.removeprefix("FILE:"))
        if self.init_from and self.checkpoint:
            raise ValueError("set init_from or checkpoint, not both")
        if self.num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {self.num_samples}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be >= 1 or None, got {self.top_k}")
        self.attention_backend = canonical_backend(self.attention_backend)  # eager, flash_attention_2, ...
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        check_generation(self.max_new_tokens, self.temperature, self.top_k, self.kv_cache, self.compile, self.slide)


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


def read_prompts(start: str, per_line: bool) -> list[str]:
    """The prompt; with per_line, each non-empty line of a --start=FILE:path file is one."""
    text = read_prompt(start)
    if not (per_line and start.startswith("FILE:")):
        return [text]
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        raise UsageError(f"prompt file {start.removeprefix('FILE:')} has no non-empty line")
    return lines


@torch.no_grad()
def generate(
    model: GPT,
    idx: torch.Tensor,
    max_new_tokens: int,
    vocab_size: int,
    temperature: float,
    top_k: int | None,
    kv_cache: str = "contiguous",
    compile: bool = False,
    **options,
) -> Iterator[torch.Tensor]:
    """Yield idx (B, T) grown by one token at a time, drawn only from ids below vocab_size (the tokenizer's).

    A model's vocabulary is often padded (GPT-2's 50257 ids to 50304, char vocabularies of 1024+ to a multiple of
    64) and the padding ids decode to nothing; they are never drawn. Yielding each step lets Ctrl-C keep the
    tokens drawn so far. temperature 0 takes the likeliest token.
    """
    tokens_stream = stream(
        model,
        list(idx),
        max_new_tokens,
        temperature,
        top_k,
        kv_cache=kv_cache,
        compile=compile,
        vocab_size=vocab_size,
        **options,
    )
    for tokens in tokens_stream:
        idx = torch.cat((idx, tokens[:, None].to(idx.dtype)), dim=1)
        yield idx


class Timing:
    """Prefill (time to a batch's first token, the prompts read) and decode (the rest), over all batches."""

    def __init__(self, device: torch.device):
        self.device = device
        self.prefill_s = self.warmup_s = self.decode_s = 0.0
        self.prompt_tokens = self.decoded = 0

    def now(self) -> float:
        if self.device.type == "cuda":  # the GPU runs ahead of the host: wait for it
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def report(self, generated: int, elapsed: float):
        for name, tokens, seconds in (
            ("prefill", self.prompt_tokens, self.prefill_s),
            ("decode", self.decoded, self.decode_s),
        ):
            rate = f"{tokens / seconds:,.0f}" if seconds > 0 else "-"
            print(f"{name}: {tokens} tokens in {seconds:.2f} s ({rate} tokens/s)", file=sys.stderr)
            if name == "prefill" and self.warmup_s:  # a CUDA graph's capture, or a compile, in the first step
                print(f"warm-up: the first decode step took {self.warmup_s:.2f} s", file=sys.stderr)
        print(f"{generated} tokens in {elapsed:.1f} s ({generated / elapsed:,.0f} tokens/s)", file=sys.stderr)


def load_model(cfg: SampleConfig, device: torch.device):
    """The checkpoint's model on `device`, its tokenizer (encode, decode) and the tokenizer's vocabulary size."""
    if cfg.init_from:
        state, path = load_weights(cfg.init_from)
    else:
        path = cfg.checkpoint or Path(cfg.out_dir) / "ckpt.pt"
        state = load_checkpoint(path)
    saved_model_config(state, path, device)  # a model too large for the memory here is one line, not a traceback
    overrides = {"attention_backend": cfg.attention_backend, "disable_mps_fix": cfg.disable_mps_fix, "dropout": 0.0}
    model = model_from_checkpoint(state, path, **overrides)
    check_finite_weights(model.state_dict(), path, "nothing can be sampled from it")
    model.eval().to(device)  # the attention backend is resolved when generation starts, for its KV cache
    encode, decode = load_tokenizer(state["meta"])
    vocab_size = tokenizer_vocab_size(state["meta"])
    if vocab_size > model.config.vocab_size:
        raise CheckpointError(
            f"the checkpoint's tokenizer has {vocab_size} ids but its model only {model.config.vocab_size}"
        )
    return model, encode, decode, vocab_size


class OutputLost(Exception):
    """stdout failed: the samples cannot reach anyone (`error` is what the write met)."""

    def __init__(self, error: OSError):
        super().__init__(error.strerror or str(error))
        self.error = error


def encode_prompts(cfg: SampleConfig, encode, block_size: int) -> list[list[int]]:
    """The --start prompt(s) as token ids; a note on stderr for prompts longer than block_size."""
    texts = read_prompts(cfg.start, per_line=cfg.batch_size > 1)
    prompts = []
    for number, text in enumerate(texts, 1):
        try:
            prompt = encode(text)
        except DataError as e:  # a char outside a char vocabulary: say that it is the prompt's
            raise UsageError(f"--start{'' if len(texts) == 1 else f' prompt {number}'}: {e}") from None
        if not prompt:
            raise UsageError("the prompt is empty; give --start some text")
        prompts.append(prompt)
    long = sum(len(prompt) > block_size for prompt in prompts)
    # Cropped, not refused: the model always reads a sliding window of its last block_size tokens (a long
    # sample slides past its prompt the same way), and the whole prompt is still printed with each sample.
    if long and len(prompts) == 1:
        print(
            f"note: the prompt is {len(prompts[0])} tokens, longer than block_size {block_size}; "
            f"the model sees only its last {block_size}",
            file=sys.stderr,
        )
    elif long:
        print(
            f"note: {long} of the {len(prompts)} prompts are longer than block_size {block_size}; "
            f"the model sees only the last {block_size} tokens of each",
            file=sys.stderr,
        )
    return prompts


# What sampling keeps of each decode step until its samples are printed: the step's (B,) tensor (~520 bytes on
# CPU, measured, most of it the tensor object), and per row its id stacked, as a Python int, and as text
STEP_BYTES, ROW_TOKEN_BYTES = 512, 64


def check_sample_memory(cfg: SampleConfig) -> None:
    """UsageError (one line), before anything is loaded, for a max_new_tokens whose samples cannot be kept in
    the memory there is until they are printed (each sample is printed whole)."""
    rows = min(cfg.batch_size, cfg.num_samples)  # at least this many are generated together
    per_step = STEP_BYTES + rows * ROW_TOKEN_BYTES
    need = cfg.max_new_tokens * per_step
    fits, available = fits_in_memory(need)
    if not fits:
        raise UsageError(
            f"max_new_tokens={cfg.max_new_tokens:,} would keep about {format_bytes(need)} in memory until the "
            f"samples are printed ({per_step} bytes a step for {rows} rows), and {format_bytes(available)} is "
            f"available; ask for at most {available // per_step:,}"
        )


def sample(cfg: SampleConfig) -> int:
    check_sample_memory(cfg)
    device = pick_device(cfg.device)
    runtime = Runtime(device, pick_dtype(cfg.dtype, device))
    model, encode, decode, vocab_size = load_model(cfg, device)
    precision = inference_precision(model, runtime)
    source = cfg.init_from or cfg.checkpoint or Path(cfg.out_dir) / "ckpt.pt"
    prompts = encode_prompts(cfg, encode, model.config.block_size)
    torch.manual_seed(cfg.seed)
    jobs = [prompt for prompt in prompts for _ in range(cfg.num_samples)]  # each prompt's samples in turn
    timing = Timing(device)
    started = time.time()
    for first in range(0, len(jobs), cfg.batch_size):
        batch = jobs[first : first + cfg.batch_size]
        new: list[torch.Tensor] = []  # (B,) tokens per step: what Ctrl-C prints
        try:
            with precision:
                sample_batch(cfg, model, batch, vocab_size, timing, new)
        except KeyboardInterrupt as stop:  # Ctrl-C, SIGTERM, SIGHUP: print the samples so far
            print_samples(batch, new, decode, stopping=True)
            how, code = stop_words(stop)
            numbers = f"sample {first + 1}" if len(batch) == 1 else f"samples {first + 1}-{first + len(batch)}"
            print(
                f"{how}: {numbers} of {len(jobs)} stopped after {len(new)} of {cfg.max_new_tokens} tokens",
                file=sys.stderr,
            )
            return code
        except NonFiniteLogits:
            way_on = (  # only what would change something: a float32 run overflows in float32 already
                "try --dtype=float32, or an earlier checkpoint"
                if runtime.dtype != torch.float32
                else "they overflow in float32 too; use an earlier checkpoint"
            )
            raise CheckpointError(
                f"{source}: the model's logits are not finite (NaN or inf) while sampling "
                f"{'this prompt' if len(batch) == 1 else 'these prompts'}, with finite weights; {way_on}"
            ) from None
        print_samples(batch, new, decode)
    timing.report(len(jobs) * cfg.max_new_tokens, time.time() - started)
    return 0


def inference_precision(model: GPT, runtime: Runtime):
    """What a step computes in. bfloat16 on a GPU: the weights cast to it once and no autocast, as inference
    stacks run (half the weight memory, and no casts inside every decode step, which is bound by its count of
    small kernels: bench/results/h100-sampling.md); the residual stream is then bfloat16 too. float16 keeps its
    float32 weights under autocast (GPT-2's activations can overflow it), and so does everything else."""
    if runtime.device.type == "cuda" and runtime.dtype == torch.bfloat16:
        model.to(torch.bfloat16)
        return contextlib.nullcontext()
    return runtime.autocast()


def sample_batch(cfg: SampleConfig, model: GPT, batch: list[list[int]], vocab_size: int, timing: Timing, new: list):
    """Generate one batch's tokens into `new`, timing its prefill (to the first token), warm-up (the first decode
    step: a CUDA graph's capture, or a compile) and decode (the rest)."""
    device = timing.device
    begun = prefilled = warmed = timing.now()
    rows = [torch.tensor(prompt, dtype=torch.long, device=device) for prompt in batch]
    graph = None if cfg.cuda_graph else False  # None: where generation can (CUDA, a KV cache, not compiled)
    options = dict(kv_cache=cfg.kv_cache, compile=cfg.compile, cuda_graph=graph, slide=cfg.slide, vocab_size=vocab_size)
    for tokens in stream(model, rows, cfg.max_new_tokens, cfg.temperature, cfg.top_k, **options):
        new.append(tokens)
        if len(new) == 1:
            prefilled = warmed = timing.now()
        elif len(new) == 2:
            warmed = timing.now()
    timing.prefill_s += prefilled - begun
    timing.warmup_s += warmed - prefilled
    timing.decode_s += timing.now() - warmed
    timing.prompt_tokens += sum(min(len(prompt), model.config.block_size) for prompt in batch)
    timing.decoded += len(batch) * max(0, cfg.max_new_tokens - 2)  # the first two: prefill and warm-up


def print_samples(batch: list[list[int]], new: list[torch.Tensor], decode, stopping: bool = False):
    """Each prompt with its tokens drawn so far, then a separator line. OutputLost when stdout fails (unless
    `stopping`: the run ends anyway)."""
    drawn = torch.stack(new, dim=1).tolist() if new else [[] for _ in batch]
    try:
        for prompt, tokens in zip(batch, drawn):
            print(decode(prompt + tokens))
            print(SEPARATOR, flush=True)
    except OSError as error:  # stdout is not a QuietStream (sample.main called in-process): the same, by hand
        silence(sys.stdout)
        lost = error
    else:
        lost = stream_failure(sys.stdout)
    if lost is not None and not stopping:
        raise OutputLost(lost)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.INFO, format="%(levelname)s: %(message)s", force=True)  # the backend line
    try:
        with StopOnSignals():  # SIGTERM and SIGHUP stop it as Ctrl-C does
            return sample(load_config(SampleConfig(), argv, prog="sample.py"))
    except (ConfigError, CheckpointError, DataError, UsageError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except OutputLost as lost:
        if lost.error.errno in (errno.EPIPE, errno.EIO):  # the reader or the terminal is gone: nobody to tell
            return 0
        print(
            f"error: the samples could not be written to stdout ({lost}); nothing more was generated", file=sys.stderr
        )
        return 2
    except KeyboardInterrupt as stop:  # before sampling began: nothing generated yet
        how, code = stop_words(stop)
        print(how, file=sys.stderr)
        return code


def stop_words(stop: KeyboardInterrupt) -> tuple[str, int]:
    """How a stop is reported, and the exit code: a shell's for death by that signal (Ctrl-C: 130)."""
    if isinstance(stop, Stopped) and stop.signum != signal.SIGINT:
        return f"stopped by {stop.signal_name}", stop.exit_code
    return "interrupted", 128 + signal.SIGINT


if __name__ == "__main__":
    sys.exit(main())
