"""`python -m bench.generation profile` and `probe`: where a decode step's time goes (bench/README.md)."""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

import torch

import generation
from bench import report
from bench.generation import model_settings
from bench.grid import mode_parser, profiled
from bench.report import DEFAULT_OUT, card_slug, write_markdown
from kernels.timing import timed
from model import GPT, GPTConfig
from training.profiling import summarize, top_table

PROMPT, NEW_TOKENS, PROFILED_STEPS = 15496, 500, 20  # "Hello"


# ----------------------------------------------------------------------------------------------
# profile: steady decoding, eager and compiled


def profile_decoding(gpt: GPT, args, device: torch.device, compile: bool) -> list[str]:
    generator = torch.Generator().manual_seed(0)
    prompts = list(torch.randint(gpt.config.vocab_size, (args.batch_size, args.prompt_len), generator=generator))
    prompts = [p.to(device) for p in prompts]

    def stream():
        new_tokens = args.skip + args.tokens
        return generation.stream(gpt, prompts, new_tokens, temperature=0, kv_cache=args.cache, compile=compile)

    for _ in stream():  # compile, record graphs
        pass
    tokens = stream()
    for _ in range(args.skip):  # prefill and the first decode steps stay out of the profile
        next(tokens)
    prof, wall_ms = profiled(device, args.tokens, lambda: next(tokens))
    tokens.close()
    lines = [f"## {'compiled' if compile else 'eager'}, {args.cache} cache", ""]
    lines += summarize(prof, args.tokens, wall_ms, device.type == "cuda", args.top, "token")
    host = [e for e in prof.key_averages() if e.device_type.name == "CPU"]
    top = top_table("host ops (self CPU)", host, lambda e: e.self_cpu_time_total, args.tokens, args.top, "token")
    return lines + [""] + top


def profile(argv=None) -> int:
    parser = mode_parser(
        "generation", "profile", "torch.profiler over steady decoding: GPU time by kernel kind, host ops"
    )
    parser.add_argument("--quick", action="store_true", help="tiny model on CPU")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results folder (default bench/results)")
    args = parser.parse_args(argv)
    args.batch_size, args.cache, args.top = 1, "contiguous", 15
    args.prompt_len, args.skip, args.tokens = (4, 1, 2) if args.quick else (128, 16, 64)
    name = "profile-generate" + ("-quick" if args.quick else "")
    device = torch.device("cpu" if args.quick or not torch.cuda.is_available() else "cuda")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    config = GPTConfig(block_size=1024, **model_settings(args.quick))
    gpt = GPT(config).to(device, dtype).eval()
    compiles = (False, True) if device.type == "cuda" else (False,)
    sections = ["\n".join(profile_decoding(gpt, args, device, compile)) + "\n" for compile in compiles]
    card = card_slug() if device.type == "cuda" else "cpu"
    title = (
        f"# {name} on {card} (torch {torch.__version__}): batch {args.batch_size}, prompt {args.prompt_len}, "
        f"greedy, {args.tokens} tokens profiled after {args.skip}\n\n"
    )
    return write_markdown(args.out / f"{card}-{name}.md", title + "\n".join(sections))


# ----------------------------------------------------------------------------------------------
# probe: a default sampling step per decode variant


def probe_variant(name: str, model: GPT, autocast: bool, profile_it=False, temperature=0.8, **options) -> dict:
    """Decode tokens/s after the prefill and the first decode step (the warm-up), which are timed apart."""
    device = torch.device("cuda")
    context = torch.autocast("cuda", torch.bfloat16) if autocast else contextlib.nullcontext()
    with context:
        steps = generation.stream(
            model, [torch.tensor([PROMPT], device=device)], NEW_TOKENS, temperature, 200, vocab_size=50257, **options
        )
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
    parser = mode_parser("generation", "probe", "a default sampling step's tok/s per decode variant (CUDA)")
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: the sampling probe times CUDA graphs on a CUDA GPU, and this machine has none", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    config = dict(report.GPT2_124M, vocab_size=50257, block_size=1024)  # the HF folder's vocabulary, unpadded
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
    (Path(args.out) / "sampling-probe.json").write_text(json.dumps(summary, indent=1) + "\n")
    return 0
