"""`python -m bench.generation`: prefill and decode speed per attention backend and KV cache for GPT-2 124M
shapes; its modes profile and probe. bench/README.md says how to run each."""

from __future__ import annotations

from errors import as_command

if __name__ == "__main__":  # before torch's seconds of importing: see as_command
    as_command()

import importlib.util
import json
import sys
import tempfile
from dataclasses import dataclass
from itertools import product
from pathlib import Path

import numpy
import torch

import generation
from bench.grid import BenchParser, dispatch, fresh_row, profiled, run_grid
from bench.report import GPT2_124M, model_settings, panels_by, plot, write, write_markdown
from configurator import parse_bool
from generation.loop import decode_step_for, generation_attention
from kernels.timing import timed
from model import GPT, GPTConfig
from training.profiling import summarize, top_table

BACKENDS = ("auto", "sdpa", "flash_attn_2", "flash_attn_3", "flex_attention", "manual")
CACHES = ("contiguous", "paged", "none")
WARMUP_TOKENS = 8
MANUAL_MAX_PROMPT = 2048  # manual's (T, T) scores beyond it


@dataclass(frozen=True)
class Case:
    backend: str
    cache: str
    compile: bool
    batch_size: int
    prompt_len: int  # the longest prompt; with mixed, the batch's prompts spread from 1/16 of it up to it
    new_tokens: int
    mixed: bool = False
    slide: str = ""  # "": block_size fits prompt + new (no sliding); half | exact: block_size stays, rows slide

    def prompt_lens(self) -> list[int]:
        shortest = max(1, self.prompt_len // 16) if self.mixed and self.batch_size > 1 else self.prompt_len
        return [round(n) for n in numpy.linspace(shortest, self.prompt_len, self.batch_size)]


def default_cases(args) -> list[Case]:
    new = args.new_tokens
    if args.mixed:  # the paged cache's case: one row per cache, prompts of many lengths in one batch
        shapes = [(b, p) for p in args.prompt_lens for b in args.batch_sizes if b > 1]
        return [Case(k, c, False, b, p, new, True) for (b, p), k, c in product(shapes, args.backends, args.caches)]
    shapes = [(b, p) for p in args.prompt_lens for b in args.batch_sizes]
    cached = [c for c in args.caches if c != "none"]
    cases = [Case(k, c, False, b, p, new) for (b, p), k, c in product(shapes, args.backends, cached)]
    if args.compile:
        cases += [Case(k, c, True, b, p, new) for (b, p), k, c in product(shapes, args.compile_backends, cached)]
    if args.hf:
        cases += [Case("hf-transformers", "static", False, b, p, new) for b, p in shapes]
    if "none" in args.caches:
        cases += [Case(k, "none", False, b, p, new) for (b, p), k in product(shapes, args.backends)]
    window = block_size_for(args, 0, 0)  # the slide rows: past block_size, as sample.py runs a long sample
    cases += [Case("auto", c, False, 1, 16, 3 * window, slide=slide) for slide in args.slide for c in cached]
    return cases


# ----------------------------------------------------------------------------------------------
# One row


def build_model(case: Case, args, device: torch.device, dtype: torch.dtype) -> GPT:
    shapes = model_settings(args.quick, bias=True)
    block_size = block_size_for(args, case.prompt_len, case.new_tokens if not case.slide else 0)
    torch.manual_seed(0)
    config = GPTConfig(block_size=block_size, attention_backend=case.backend, **shapes)
    with torch.device(device):  # initialised where it runs: seconds less per row on a GPU
        return GPT(config).to(dtype=dtype).eval()


def block_size_for(args, prompt_len: int, new_tokens: int) -> int:
    """GPT-2's 1024 (64 --quick), or more where prompt + new would not fit: only the slide rows slide."""
    return max(64 if args.quick else 1024, prompt_len + new_tokens)


def prompts_for(case: Case, vocab_size: int, device) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(case.batch_size * 100003 + case.prompt_len)
    ids = torch.randint(vocab_size, (case.batch_size, case.prompt_len), generator=generator)
    return [row[:n].to(device) for row, n in zip(ids, case.prompt_lens())]


def timed_stream(gpt: GPT, prompts, case: Case, device, tokens: int) -> tuple[float, float]:
    """(seconds to the first token, seconds for the rest) of greedy generation, stopped after `tokens`."""
    options = dict(kv_cache=case.cache, compile=case.compile, slide=case.slide or "exact")
    stream = generation.stream(gpt, prompts, case.new_tokens, temperature=0, **options)
    first_ms = timed(lambda: next(stream), device).wall_ms
    rest_ms = timed(lambda: [next(stream) for _ in range(tokens - 1)], device).wall_ms
    stream.close()
    return first_ms / 1e3, rest_ms / 1e3


ROW_FIELDS = ("prefill_ms", "prefill_tok_s", "decode_ms_per_token", "decode_tok_s", "peak_mem_mib", "warmup_s")


def empty_row(case: Case, dtype: torch.dtype) -> dict:
    prompts = f"{min(case.prompt_lens())}-{case.prompt_len}" if case.mixed else str(case.prompt_len)
    return {
        **dict(backend=case.backend, resolved=None, cache=case.cache, compile=case.compile),
        **dict(batch_size=case.batch_size, prompt_len=case.prompt_len, prompts=prompts, new_tokens=case.new_tokens),
        **dict(slide=case.slide or None, dtype=str(dtype).removeprefix("torch.")),
        **dict.fromkeys(ROW_FIELDS),
    }


def measure_case(case: Case, args, device: torch.device, dtype: torch.dtype) -> list[dict]:
    row = empty_row(case, dtype)
    if case.backend == "manual" and case.prompt_len > MANUAL_MAX_PROMPT:
        return [{**row, "status": f"not run: manual's (T, T) scores at prompt {case.prompt_len}"}]
    if case.backend == "paged_attention" and case.cache == "contiguous":
        return [{**row, "status": "not run: paged_attention is a paged cache (its paged row)"}]
    with fresh_row(row):  # each row compiles afresh, as a new sample.py process would
        if case.backend == "hf-transformers":
            row.update(hf_peer(case, args, device, dtype))
        else:
            time_row(row, case, args, device, dtype)
    return [row]


def time_row(row: dict, case: Case, args, device: torch.device, dtype: torch.dtype):
    """The row's model built and its generation timed; the model goes when this returns (or raises)."""
    gpt = build_model(case, args, device, dtype)
    seq_len = case.prompt_len + case.new_tokens
    step = decode_step_for(device, case.cache, case.compile)
    need = gpt.attention_use(device, dtype, training=False, seq_len=seq_len, kv_cache=case.cache, decode_step=step)
    resolution = generation_attention(gpt, need)[0].resolution
    row["resolved"] = resolution.used
    if case.backend != "auto" and resolution.used != case.backend:  # never time another under this name
        row["status"] = f"falls back to {resolution.used}: {resolution.reason}"
        return
    prompts = prompts_for(case, gpt.config.vocab_size, device)
    warmup = timed(lambda: timed_stream(gpt, prompts, case, device, min(WARMUP_TOKENS, case.new_tokens)), device)
    row["warmup_s"] = warmup.wall_ms / 1e3
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    prefill_s, decode_s = timed_stream(gpt, prompts, case, device, case.new_tokens)
    row.update(rates(case, prefill_s, decode_s))
    row["peak_mem_mib"] = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None
    row["status"] = "ok"


def rates(case: Case, prefill_s: float, decode_s: float) -> dict:
    decoded = case.new_tokens - 1  # the first new token comes with the prefill
    return {
        "prefill_ms": prefill_s * 1e3,
        "prefill_tok_s": sum(case.prompt_lens()) / prefill_s,
        "decode_ms_per_token": decode_s * 1e3 / max(1, decoded),
        "decode_tok_s": case.batch_size * decoded / decode_s if decoded else None,
    }


def hf_peer(case: Case, args, device, dtype) -> dict:
    """The Hugging Face peer's row: GPT2LMHeadModel.generate with a static cache, on the same weights; prefill = one
    forward pass over the prompts, decode = the whole generate minus it."""
    import transformers

    from weights.hf import export_hf

    shapes = Case("sdpa", "none", False, case.batch_size, case.prompt_len, case.new_tokens)
    gpt = build_model(shapes, args, "cpu", dtype)
    with tempfile.TemporaryDirectory() as folder:  # gpt's weights through python -m weights hf's export
        hf = transformers.GPT2LMHeadModel.from_pretrained(export_hf(gpt, folder)).to(device=device, dtype=dtype).eval()
    ids = torch.stack(prompts_for(case, hf.config.vocab_size, device))
    mask = torch.ones_like(ids)
    # the static cache is sized by max_new_tokens: warm-up and timed run share its shapes
    settings = dict(max_new_tokens=case.new_tokens, min_new_tokens=case.new_tokens, pad_token_id=0)

    def generate():
        hf.generate(ids, attention_mask=mask, do_sample=False, cache_implementation="static", **settings)

    def prefill():
        hf(ids, attention_mask=mask)

    with torch.no_grad():
        warmup_s = (timed(generate, device).wall_ms + timed(prefill, device).wall_ms) / 1e3
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        first, whole = timed(prefill, device).wall_ms / 1e3, timed(generate, device).wall_ms / 1e3
    peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None
    row = {"resolved": f"transformers {transformers.__version__}", "peak_mem_mib": peak, "warmup_s": warmup_s}
    return {**row, **rates(case, first, max(whole - first, 1e-9)), "status": "ok"}


COLUMNS = (
    "backend resolved cache compile batch_size prompts new_tokens slide dtype prefill_ms prefill_tok_s "
    "decode_ms_per_token decode_tok_s peak_mem_mib warmup_s status"
).split()


def plot_rows(rows: list[dict], path: Path):
    def series(row):
        return f"{row['backend']}/{row['cache']}{'+compile' if row['compile'] else ''}"

    panels = panels_by(rows, "prompt_len", "decode_tok_s")
    plot(rows, path, x="batch_size", panels=panels, series=series, title="generation: decode tok/s (whole batch)")


def parse_args(argv=None):
    cuda = torch.cuda.is_available()
    quick_help = "tiny CPU model, prompts of 8, 4 new tokens"
    parser = BenchParser("generation", __doc__, quick_help, ("profile", "probe"), ("generate", "generate-quick"))
    device, dtype = ("cuda", "bfloat16") if cuda else ("cpu", "float32")
    parser.grid_options((device, "cpu"), (dtype, "float32"), ("bfloat16", "float16", "float32"), (480, 0))
    parser.option("--backends", list(BACKENDS), ["sdpa", "manual"], nargs="+", help="attention backends")
    parser.add_argument("--caches", nargs="+", default=list(CACHES), choices=CACHES)
    parser.option("--batch-sizes", [1, 32], [1, 3], type=int, nargs="+", help="batch sizes")
    parser.option("--prompt-lens", [128, 2048], [8], type=int, nargs="+", help="prompt lengths")
    parser.option("--new-tokens", 256, 4, type=int, help="tokens generated")
    parser.option("--compile", cuda, False, type=parse_bool, help="compiled rows too, true or false")
    parser.add_argument("--compile-backends", nargs="+", default=["auto"], help="backends of the compiled rows")
    parser.add_argument("--hf", default="auto", choices=("auto", "off"), help="the transformers peer (auto: if there)")
    parser.add_argument("--mixed", action="store_true", help="prompts of 1/16 of a prompt length up to it per batch")
    slides = ("half", "exact")
    parser.add_argument("--slide", nargs="*", default=list(slides), choices=slides, help="3 windows past block_size")
    args = parser.parse_args(argv)
    args.hf = args.hf == "auto" and not args.quick and importlib.util.find_spec("transformers") is not None
    return args


def speed(argv=None) -> int:
    args = parse_args(argv)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    cases = default_cases(args)
    shapes, block_size = model_settings(args.quick, bias=True), 64 if args.quick else 1024
    header = {
        "model": shapes,
        "grid": {"cases": [vars(c) for c in cases], "dtype": args.dtype},
        "notes": {
            "model": ", ".join(f"{k}={v}" for k, v in shapes.items())
            + f", random weights; block_size = max({block_size}, prompt + new), except the slide rows'",
            "generation": "generation.stream, greedy; prefill = time to the first token; decode = the rest; tok/s "
            f"counts the whole batch; after an untimed run of {WARMUP_TOKENS} tokens (warmup_s)",
            "hf peer": "GPT2LMHeadModel.generate(cache_implementation='static') on the same weights"
            if args.hf
            else "not run",
        },
    }
    grid = dict(
        measure=lambda case: measure_case(case, args, device, dtype),
        skipped=lambda case, reason: [{**empty_row(case, dtype), "status": reason}],
        progress="batch_size prompts backend compile slide cache prefill_tok_s decode_tok_s status".split(),
        columns=COLUMNS,
        plot=plot_rows,
    )
    run_grid(cases, args, device, header, **grid)
    return 0


# ----------------------------------------------------------------------------------------------
# profile: steady decoding, eager and compiled (where a decode step's time goes)

PROFILE_TOP = 15  # kernels and host ops listed


def profile_decoding(gpt: GPT, case: Case, args, device: torch.device) -> list[str]:
    prompts = prompts_for(case, gpt.config.vocab_size, device)

    def stream():
        options = dict(kv_cache=case.cache, compile=case.compile)
        return generation.stream(gpt, prompts, case.new_tokens, temperature=0, **options)

    list(stream())  # a whole run first: compile, record graphs
    tokens = stream()
    for _ in range(args.skip):  # prefill and the first decode steps stay out of the profile
        next(tokens)
    prof, wall_ms = profiled(device, args.tokens, lambda: next(tokens))
    tokens.close()
    lines = [f"## {'compiled' if case.compile else 'eager'}, {case.cache} cache", ""]
    lines += summarize(prof, args.tokens, wall_ms, device.type == "cuda", PROFILE_TOP, "token")
    host = [e for e in prof.key_averages() if e.device_type.name == "CPU"]
    top = top_table("host ops (self CPU)", host, lambda e: e.self_cpu_time_total, args.tokens, PROFILE_TOP, "token")
    return lines + [""] + top


def profile(argv=None) -> int:
    doc = "torch.profiler over steady decoding: GPU time by kernel kind, host ops"
    parser = BenchParser("generation profile", doc, quick_help="tiny model on CPU")
    args = parser.parse_args(argv)
    prompt_len, args.skip, args.tokens = (4, 1, 2) if args.quick else (128, 16, 64)
    device = torch.device("cpu" if args.quick or not torch.cuda.is_available() else "cuda")
    compiles = (False, True) if device.type == "cuda" else (False,)
    cases = [Case("auto", "contiguous", compile, 1, prompt_len, args.skip + args.tokens) for compile in compiles]
    gpt = build_model(cases[0], args, device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    sections = ["\n".join(profile_decoding(gpt, case, args, device)) + "\n" for case in cases]
    title = f": batch 1, prompt {prompt_len}, greedy, {args.tokens} tokens after {args.skip}"
    return write_markdown(args.out, "profile-generate" + ("-quick" if args.quick else ""), device, title, sections)


# ----------------------------------------------------------------------------------------------
# probe: a default sampling step per decode variant

PROMPT, NEW_TOKENS, PROFILED_STEPS = 15496, 500, 20  # "Hello"


def probe_variant(name: str, model: GPT, autocast: bool, profile_it=False, temperature=0.8, **options) -> dict:
    """Decode tokens/s after the prefill and the first decode step (the warm-up), which are timed apart."""
    device = torch.device("cuda")
    with torch.autocast("cuda", torch.bfloat16, enabled=autocast):
        prompt = [torch.tensor([PROMPT], device=device)]
        steps = generation.stream(model, prompt, NEW_TOKENS, temperature, 200, vocab_size=50257, **options)
        prefill_ms, warmup_ms = (timed(lambda: next(steps), device).wall_ms for _ in range(2))

        def rest() -> int:  # a profiled variant's time includes the profiler's steps, its count does not
            if profile_it:
                prof, wall_ms = profiled(device, PROFILED_STEPS, lambda: next(steps))
                print(f"--- profile {name}")
                print("\n".join(summarize(prof, PROFILED_STEPS, wall_ms, True, 12, "step")))
            return sum(1 for _ in steps)

        decoded = timed(rest, device)
    rate = decoded.result / (decoded.wall_ms / 1e3)
    print(f"{name:50s} {rate:8.0f} tok/s  {1000 / rate:6.3f} ms  warm-up {warmup_ms / 1e3:.2f}s", flush=True)
    return dict(name=name, tok_s=rate, ms=1000 / rate, warmup_s=warmup_ms / 1e3, prefill_s=prefill_ms / 1e3)


def probe(argv=None) -> int:
    parser = BenchParser("generation probe", "a default sampling step's tok/s per decode variant (CUDA)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: the sampling probe times CUDA graphs on a CUDA GPU, and this machine has none", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    config = dict(GPT2_124M, vocab_size=50257, block_size=1024)  # the HF folder's vocabulary, unpadded
    gpt = GPT(GPTConfig(**config)).to("cuda").eval()
    rows = [
        probe_variant("default: graph with the draw, auto", gpt, True),
        probe_variant("graph, auto, greedy", gpt, True, temperature=0),
        probe_variant("graph, auto (profiled)", gpt, True, profile_it=True),
    ]
    for backend in ("sdpa", "manual", "flex_attention"):
        gpt.config.attention_backend = backend
        rows.append(probe_variant(f"graph, {backend}", gpt, True))
    gpt.config.attention_backend = "auto"
    rows.append(probe_variant("eager, auto", gpt, True, cuda_graph=False))
    rows.append(probe_variant("compiled, auto", gpt, True, cuda_graph=False, compile=True))
    half = GPT(GPTConfig(**config)).to("cuda").eval().to(torch.bfloat16)
    rows.append(probe_variant("graph, auto, bf16 weights no autocast", half, False))
    rows.append(probe_variant("graph, auto, bf16 weights no autocast (profiled)", half, False, profile_it=True))
    summary = dict(card=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows)
    write(args.out / "sampling-probe.json", json.dumps(summary, indent=1) + "\n")
    return 0


def main(argv=None) -> int:
    return dispatch(argv, speed, profile=profile, probe=probe)


if __name__ == "__main__":
    sys.exit(main())
