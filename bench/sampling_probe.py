"""Where a default sampling step's time goes: GPT-2 124M (random weights) at batch 1, 500 tokens after a one-token
prompt, temperature 0.8, top-k 200, timed in one process per decode variant (a CUDA graph or not, each decode
kernel, compiled, float32 weights under autocast or bfloat16 weights), with a profiler's per-kernel GPU time for
two of them. Prints a line per variant and writes <out>/sampling-probe.json.

    python -m bench.sampling_probe --out bench/results

bench/results/h100-sampling-probe-{1,2,3}.{json,log} are three runs of it as the decode step changed (the
variants of each are in its log; the first two before the draw moved into the CUDA graph). What sample.py gives
end to end is bench/results/h100-e2e-sampling*.json (python -m bench.e2e --only "speed gpt2")."""

from __future__ import annotations

from errors import as_command

if __name__ == "__main__":  # before torch's seconds of importing: see as_command
    as_command()

import contextlib
import json
import sys
import time
from pathlib import Path

import torch

import kernels  # noqa: F401  (registers flex_attention and the flash-attn backends)
from bench import report
from data.common import OneLineParser
from generation import stream
from model import GPT, GPTConfig

PROMPT, NEW_TOKENS, PROFILED_STEPS = 15496, 500, 20  # "Hello"


def profile_steps(name: str, steps):
    """Per-kernel GPU time of PROFILED_STEPS decode steps, the top 12 printed."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(PROFILED_STEPS):
            next(steps)
        torch.cuda.synchronize()
    events = prof.key_averages()
    gpu = sum(e.device_time_total for e in events if e.device_type.name == "CUDA") / PROFILED_STEPS
    launched = sum(e.count for e in events if e.device_type.name == "CUDA") / PROFILED_STEPS
    print(f"--- profile {name}: {gpu:.0f} us GPU/step, {launched:.0f} GPU ops/step")
    for e in sorted(events, key=lambda e: -e.device_time_total)[:12]:
        print(
            f"   {e.key[:70]:70s} n={e.count / PROFILED_STEPS:5.1f} gpu={e.device_time_total / PROFILED_STEPS:8.1f}us"
        )


def time_variant(name: str, model: GPT, autocast: bool, profiled=False, temperature=0.8, **options) -> dict:
    """Decode tokens/s after the prefill and the first decode step (the warm-up), which are timed apart."""
    context = torch.autocast("cuda", torch.bfloat16) if autocast else contextlib.nullcontext()
    prompt = [torch.tensor([PROMPT], device="cuda")]
    with context:
        steps = stream(model, prompt, NEW_TOKENS, temperature, 200, vocab_size=50257, **options)
        marks = [time.perf_counter()]
        for _ in range(2):  # prefill, then the warm-up step
            next(steps)
            torch.cuda.synchronize()
            marks.append(time.perf_counter())
        if profiled:
            profile_steps(name, steps)
        decoded = sum(1 for _ in steps)
        torch.cuda.synchronize()
    rate = decoded / (time.perf_counter() - marks[2])
    print(f"{name:50s} {rate:8.0f} tok/s  {1000 / rate:6.3f} ms  warm-up {marks[2] - marks[1]:.2f}s", flush=True)
    return dict(name=name, tok_s=rate, ms=1000 / rate, warmup_s=marks[2] - marks[1], prefill_s=marks[1] - marks[0])


def main(argv=None) -> int:
    parser = OneLineParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: the sampling probe times CUDA graphs on a CUDA GPU, and this machine has none", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    config = dict(report.GPT2_124M, vocab_size=50257, block_size=1024)  # the HF folder's vocabulary, unpadded
    gpt = GPT(GPTConfig(**config)).to("cuda").eval()
    rows = [
        time_variant("default: graph with the draw, auto", gpt, True),
        time_variant("graph, auto, greedy", gpt, True, temperature=0),
        time_variant("graph, auto (profiled)", gpt, True, profiled=True),
    ]
    for backend in ("sdpa", "manual", "flex_attention"):
        gpt.config.attention_backend = backend
        rows.append(time_variant(f"graph, {backend}", gpt, True))
    gpt.config.attention_backend = "auto"
    rows.append(time_variant("eager, auto", gpt, True, cuda_graph=False))
    rows.append(time_variant("compiled, auto", gpt, True, cuda_graph=False, compile=True))
    half = GPT(GPTConfig(**config)).to("cuda").eval().to(torch.bfloat16)
    rows.append(time_variant("graph, auto, bf16 weights no autocast", half, False))
    rows.append(time_variant("graph, auto, bf16 weights no autocast (profiled)", half, False, profiled=True))
    summary = dict(card=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows)
    (Path(args.out) / "sampling-probe.json").write_text(json.dumps(summary, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
