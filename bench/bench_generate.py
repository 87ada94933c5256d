"""Time generation for GPT-2 124M shapes (random weights) per attention backend and KV cache.

    python bench/bench_generate.py                  # CUDA, bf16: batch 1 and 32, prompt 128 and 2048, 256 new tokens
    python bench/bench_generate.py --budget 0       # the whole grid, however long it takes
    python bench/bench_generate.py --quick          # tiny CPU model, a few tokens: seconds

Each row runs GPT.stream (model.py) greedily on random prompts, the same way sample.py generates: prefill time
is the time to the first token (the whole prompt read), decode time the rest; tok/s counts tokens of the whole
batch. A short untimed run of the same shapes comes first (flex_attention and torch.compile compile there, CUDA
graphs are captured). `compile` rows run the static decode step under torch.compile(mode="reduce-overhead").
A backend that falls back is not timed under its name. With `transformers` importable (and not --quick), a peer
row runs Hugging Face's GPT2LMHeadModel.generate with a static cache on the same weights.

Rows, most wanted first, so a --budget cut drops the least wanted: every backend with the contiguous and the
paged cache at each shape; then compiled decoding (--compile-backends, default auto); then the Hugging Face
peer; then no cache (the whole context every step, as nanoGPT generates).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch._dynamo

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.report import (  # noqa: E402
    DEFAULT_OUT,
    Budget,
    Column,
    failure_reason,
    free_device_memory,
    plot_lines,
    results_header,
    write_results,
)
from model import GPT, GPTConfig  # noqa: E402
from runtime import synchronize  # noqa: E402

GPT2_124M = dict(n_layer=12, n_head=12, n_embd=768, vocab_size=50304, bias=True, dropout=0.0)
TINY = dict(n_layer=2, n_head=2, n_embd=64, vocab_size=512, bias=True, dropout=0.0)
BACKENDS = ("auto", "sdpa", "flash_attn_2", "flash_attn_3", "flex_attention", "manual")
CACHES = ("contiguous", "paged", "none")
WARMUP_TOKENS = 8


@dataclass(frozen=True)
class Case:
    backend: str
    cache: str
    compile: bool
    batch_size: int
    prompt_len: int  # the longest prompt; with mixed, the batch's prompts spread from 1/16 of it up to it
    new_tokens: int
    mixed: bool = False

    def prompt_lens(self) -> list[int]:
        if not self.mixed or self.batch_size == 1:
            return [self.prompt_len] * self.batch_size
        shortest = max(1, self.prompt_len // 16)
        step = (self.prompt_len - shortest) / (self.batch_size - 1)
        return [round(shortest + b * step) for b in range(self.batch_size)]


def default_cases(args) -> list[Case]:
    if args.mixed:  # the paged cache's case: one row per cache, prompts of many lengths in one batch
        shapes = [(b, p) for p in args.prompt_lens for b in args.batch_sizes if b > 1]
        return [
            Case(k, c, False, b, p, args.new_tokens, True)
            for b, p in shapes
            for k in args.backends
            for c in args.caches
        ]
    shapes = [(b, p) for p in args.prompt_lens for b in args.batch_sizes]
    cached = [c for c in args.caches if c != "none"]
    cases = [Case(k, c, False, b, p, args.new_tokens) for b, p in shapes for k in args.backends for c in cached]
    if args.compile:
        cases += [
            Case(k, c, True, b, p, args.new_tokens) for b, p in shapes for k in args.compile_backends for c in cached
        ]
    if args.hf:
        cases += [Case("hf-transformers", "static", False, b, p, args.new_tokens) for b, p in shapes]
    if "none" in args.caches:
        cases += [Case(k, "none", False, b, p, args.new_tokens) for b, p in shapes for k in args.backends]
    return cases


# ----------------------------------------------------------------------------------------------
# One row


def build_model(case: Case, args, device: torch.device, dtype: torch.dtype) -> GPT:
    shapes = TINY if args.quick else GPT2_124M
    block_size = max(64 if args.quick else 1024, case.prompt_len + case.new_tokens)  # no sliding here
    torch.manual_seed(0)
    config = GPTConfig(block_size=block_size, attention_backend=case.backend, **shapes)
    with torch.device(device):  # initialised where it runs: seconds less per row on a GPU
        return GPT(config).to(dtype=dtype).eval()


def prompts_for(case: Case, vocab_size: int, device) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(case.batch_size * 100003 + case.prompt_len)
    ids = torch.randint(vocab_size, (case.batch_size, case.prompt_len), generator=generator)
    return [row[:n].to(device) for row, n in zip(ids, case.prompt_lens())]


def timed_stream(gpt: GPT, prompts, case: Case, device, tokens: int) -> tuple[float, float]:
    """(seconds to the first token, seconds for the rest) of greedy generation, stopped after `tokens`."""
    synchronize(device)
    start = time.perf_counter()
    stream = gpt.stream(prompts, case.new_tokens, temperature=0, kv_cache=case.cache, compile=case.compile)
    next(stream)
    synchronize(device)
    first = time.perf_counter()
    for _ in range(tokens - 1):
        next(stream)
    synchronize(device)
    end = time.perf_counter()
    stream.close()
    return first - start, end - first


def empty_row(case: Case, dtype: torch.dtype) -> dict:
    return {
        "backend": case.backend,
        "resolved": None,
        "cache": case.cache,
        "compile": case.compile,
        "batch_size": case.batch_size,
        "prompt_len": case.prompt_len,
        "prompts": f"{min(case.prompt_lens())}-{case.prompt_len}" if case.mixed else str(case.prompt_len),
        "new_tokens": case.new_tokens,
        "dtype": str(dtype).removeprefix("torch."),
        "prefill_ms": None,
        "prefill_tok_s": None,
        "decode_ms_per_token": None,
        "decode_tok_s": None,
        "peak_mem_mib": None,
        "warmup_s": None,
    }


def measure_case(case: Case, args, device: torch.device, dtype: torch.dtype) -> dict:
    row = empty_row(case, dtype)
    if case.backend == "manual" and case.prompt_len > args.manual_max_prompt:
        return {**row, "status": f"not run: manual's (T, T) scores at prompt {case.prompt_len}"}
    if case.backend == "paged_attention" and case.cache == "contiguous":
        return {**row, "status": "not run: paged_attention is a paged cache (its paged row)"}
    gpt = None
    torch._dynamo.reset()  # each row compiles afresh, as a new sample.py process would
    try:  # any failure (OOM, a kernel's refusal, a compile error) becomes this row's status
        if case.backend == "hf-transformers":
            return {**row, **hf_peer(case, args, device, dtype)}
        gpt = build_model(case, args, device, dtype)
        seq_len = case.prompt_len + case.new_tokens
        resolution = gpt.setup_attention(
            device, dtype, training=False, seq_len=seq_len, kv_cache=case.cache, compiled=case.compile
        )
        row["resolved"] = resolution.used
        if case.backend != "auto" and resolution.used != case.backend:  # never time another under this name
            return {**row, "status": f"falls back to {resolution.used}: {resolution.reason}"}
        prompts = prompts_for(case, gpt.config.vocab_size, device)
        started = time.perf_counter()
        timed_stream(gpt, prompts, case, device, min(WARMUP_TOKENS, case.new_tokens))
        row["warmup_s"] = time.perf_counter() - started
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        prefill_s, decode_s = timed_stream(gpt, prompts, case, device, case.new_tokens)
        row.update(rates(case, prefill_s, decode_s))
        row["peak_mem_mib"] = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None
        row["status"] = "ok"
    except Exception as error:  # noqa: BLE001 - recorded, never swallowed
        row["status"] = failure_reason(error)
    finally:
        del gpt
        torch._dynamo.reset()
        free_device_memory()
    return row


def rates(case: Case, prefill_s: float, decode_s: float) -> dict:
    decoded = case.new_tokens - 1  # the first new token comes with the prefill
    return {
        "prefill_ms": prefill_s * 1e3,
        "prefill_tok_s": sum(case.prompt_lens()) / prefill_s,
        "decode_ms_per_token": decode_s * 1e3 / max(1, decoded),
        "decode_tok_s": case.batch_size * decoded / decode_s if decoded else None,
    }


# ----------------------------------------------------------------------------------------------
# The Hugging Face peer: GPT2LMHeadModel.generate with a static cache, on the same weights


def hf_model(gpt: GPT):
    """transformers' GPT2LMHeadModel holding gpt's weights (its Conv1D stores Linear weights transposed)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    c = gpt.config
    config = GPT2Config(
        vocab_size=c.vocab_size,
        n_positions=c.block_size,
        n_embd=c.n_embd,
        n_layer=c.n_layer,
        n_head=c.n_head,
        activation_function="gelu_new",
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=None,  # random weights, no tokenizer: nothing ends a sequence early
        eos_token_id=None,
    )
    hf = GPT2LMHeadModel(config)
    transposed = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
    state = {k: v.t() if k.endswith(transposed) else v for k, v in gpt.state_dict().items()}
    missing, unexpected = hf.load_state_dict(state, strict=False)
    if unexpected or [k for k in missing if not k.endswith(".attn.bias") and not k.endswith(".attn.masked_bias")]:
        raise RuntimeError(f"weights do not map onto GPT2LMHeadModel: missing {missing}, unexpected {unexpected}")
    return hf


def hf_peer(case: Case, args, device, dtype) -> dict:
    gpt = build_model(
        Case("sdpa", "none", False, case.batch_size, case.prompt_len, case.new_tokens), args, "cpu", dtype
    )
    hf = hf_model(gpt).to(device=device, dtype=dtype).eval()
    ids = torch.stack(prompts_for(case, gpt.config.vocab_size, device))
    mask = torch.ones_like(ids)

    def timed(fn) -> float:
        synchronize(device)
        start = time.perf_counter()
        with torch.no_grad():
            fn()
        synchronize(device)
        return time.perf_counter() - start

    def generate():  # the static cache is sized by max_new_tokens: warm-up and timed run share its shapes
        hf.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=case.new_tokens,
            min_new_tokens=case.new_tokens,
            do_sample=False,
            cache_implementation="static",
            pad_token_id=0,
        )

    def prefill():
        hf(ids, attention_mask=mask)

    warmup_s = timed(generate) + timed(prefill)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    first = timed(prefill)
    whole = timed(generate)
    import transformers

    return {
        "resolved": f"transformers {transformers.__version__}",
        **rates(case, first, max(whole - first, 1e-9)),
        "peak_mem_mib": torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None,
        "warmup_s": warmup_s,
        "status": "ok",
    }


def hf_available() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


# ----------------------------------------------------------------------------------------------


def run_cases(cases: list[Case], args, device, dtype) -> list[dict]:
    budget = Budget(args.budget)
    rows = []
    for case in cases:
        if budget.exhausted():
            row = {**empty_row(case, dtype), "status": budget.reason()}
        else:
            row = measure_case(case, args, device, dtype)
        rows.append(row)
        print(progress_line(row, budget.elapsed()), flush=True)
    return rows


def progress_line(row: dict, elapsed: float) -> str:
    def num(key, fmt):
        return fmt.format(row[key]) if row.get(key) is not None else "-"

    label = f"{row['backend']}{'+compile' if row['compile'] else ''}"
    return (
        f"[{elapsed:6.1f}s] B={row['batch_size']:<3} prompt={row['prompts']:<9} {label:<22} {row['cache']:<10} "
        f"prefill {num('prefill_tok_s', '{:,.0f}'):>10} tok/s  decode {num('decode_tok_s', '{:,.0f}'):>9} tok/s "
        f"({num('decode_ms_per_token', '{:.2f}')} ms/step)  mem {num('peak_mem_mib', '{:,.0f}'):>7} MiB  "
        f"{row['status'] if row['status'] != 'ok' else ''}"
    )


COLUMNS = [
    Column("backend", "backend"),
    Column("resolved", "runs"),
    Column("cache", "cache"),
    Column("compile", "compile"),
    Column("batch_size", "B"),
    Column("prompts", "prompt"),
    Column("new_tokens", "new"),
    Column("dtype", "dtype"),
    Column("prefill_ms", "prefill ms", "{:.1f}"),
    Column("prefill_tok_s", "prefill tok/s", "{:,.0f}"),
    Column("decode_ms_per_token", "decode ms/step", "{:.2f}"),
    Column("decode_tok_s", "decode tok/s", "{:,.0f}"),
    Column("peak_mem_mib", "peak MiB", "{:,.0f}"),
    Column("warmup_s", "warm-up s", "{:.1f}"),
    Column("status", "status"),
]


def plot(rows: list[dict], path: Path):
    plot_lines(
        rows,
        path,
        x="batch_size",
        y="decode_tok_s",
        y_label="decode tokens/s (whole batch)",
        panel="prompt_len",
        series=lambda r: f"{r['backend']}/{r['cache']}{'+compile' if r['compile'] else ''}",
        title=f"generation, {rows[0]['dtype']}, {rows[0]['new_tokens']} new tokens",
        dashed=lambda name: name.endswith("/none"),
    )


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="tiny CPU model, prompts of 8, 4 new tokens")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results folder (default bench/results)")
    parser.add_argument("--device", default=None, help="cpu | cuda (default cuda if there is one; --quick: cpu)")
    parser.add_argument(
        "--dtype", default=None, choices=("bfloat16", "float16", "float32"), help="default bf16 on CUDA"
    )
    parser.add_argument("--backends", nargs="+", default=None, help=f"default: {' '.join(BACKENDS)}")
    parser.add_argument("--caches", nargs="+", default=list(CACHES), choices=CACHES)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=None, help="default 1 32")
    parser.add_argument("--prompt-lens", type=int, nargs="+", default=None, help="default 128 2048")
    parser.add_argument("--new-tokens", type=int, default=None, help="default 256")
    parser.add_argument(
        "--compile", default=None, choices=("true", "false"), help="also compiled decode rows (default: on CUDA)"
    )
    parser.add_argument("--compile-backends", nargs="+", default=["auto"], help="backends of the compiled rows")
    parser.add_argument(
        "--hf", default="auto", choices=("auto", "off"), help="the transformers peer row (auto: if importable)"
    )
    parser.add_argument(
        "--mixed", action="store_true", help="prompts of mixed lengths in each batch (1/16 of a prompt length up to it)"
    )
    parser.add_argument("--manual-max-prompt", type=int, default=2048, help="manual only up to this prompt length")
    parser.add_argument("--budget", type=float, default=None, help="seconds for all rows (default 480; 0: none)")
    parser.add_argument("--name", default=None, help="results name (default generate / generate-quick)")
    args = parser.parse_args(argv)
    quick = dict(
        device="cpu",
        dtype="float32",
        backends=["sdpa", "manual"],
        batch_sizes=[1, 3],
        prompt_lens=[8],
        new_tokens=4,
        compile="false",
        budget=0,
        name="generate-quick",
    )
    cuda = torch.cuda.is_available()
    full = dict(
        device="cuda" if cuda else "cpu",
        dtype="bfloat16" if cuda else "float32",
        backends=list(BACKENDS),
        batch_sizes=[1, 32],
        prompt_lens=[128, 2048],
        new_tokens=256,
        compile="true" if cuda else "false",
        budget=480,
        name="generate",
    )
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.compile = args.compile == "true"
    args.hf = args.hf == "auto" and not args.quick and hf_available()
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.quick:
        torch.set_num_threads(1)  # a tiny model gains nothing from threads, and a shared CPU makes them crawl
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    cases = default_cases(args)
    start = time.perf_counter()
    rows = run_cases(cases, args, device, dtype)
    shapes = TINY if args.quick else GPT2_124M
    header = results_header(
        args.name,
        device,
        model=shapes,
        wall_s=round(time.perf_counter() - start, 1),
        grid={"cases": [vars(c) for c in cases], "dtype": args.dtype},
        notes={
            "model": ", ".join(f"{k}={v}" for k, v in shapes.items())
            + f", random weights; block_size = max({64 if args.quick else 1024}, prompt + new): no row slides",
            "generation": "GPT.stream, greedy (temperature 0), random prompt ids; prefill = time to the first "
            "token; decode = the remaining new tokens; tok/s counts the whole batch",
            "warm-up": f"an untimed run of the same shapes stopped after {WARMUP_TOKENS} tokens first (compiles, "
            "CUDA graph capture: warmup_s)",
            "memory": "peak_mem_mib = torch.cuda.max_memory_allocated over the timed run; none on CPU",
            "hf peer": "GPT2LMHeadModel.generate(cache_implementation='static') on the same weights; prefill = "
            "one forward pass over the prompts, decode = the whole generate minus it"
            if args.hf
            else "not run (transformers not importable, or --quick / --hf off)",
        },
    )
    for path in write_results(args.out, args.name, header, rows, COLUMNS, plot):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
