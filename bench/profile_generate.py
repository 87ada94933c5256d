"""Where a decode step's time goes: torch.profiler over GPT.stream's steady decoding, GPU kernels and host ops.

    python bench/profile_generate.py                 # GPT-2 124M shapes, bf16, batch 1, prompt 128, compiled
    python bench/profile_generate.py --quick         # tiny model on CPU

After a warm-up stream (compiles, records CUDA graphs) and the first tokens of the profiled one, it records
`--tokens` decode steps and writes <card>-profile-generate.md: wall time per token, GPU busy time per token by
kernel kind, the top kernels, and the host ops that take the most CPU time. GPU busy time well under the wall
time means decoding waits on the host (Python, launches), which CUDA graphs are meant to remove.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.profile_train import summarize, top_table  # noqa: E402
from bench.report import DEFAULT_OUT, card_slug  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402
from runtime import synchronize  # noqa: E402

GPT2_124M = dict(n_layer=12, n_head=12, n_embd=768, vocab_size=50304, bias=True, dropout=0.0)
TINY = dict(n_layer=2, n_head=2, n_embd=64, vocab_size=512, bias=True, dropout=0.0)


def profile_case(gpt: GPT, args, device: torch.device, compile: bool) -> list[str]:
    generator = torch.Generator().manual_seed(0)
    prompts = list(torch.randint(gpt.config.vocab_size, (args.batch_size, args.prompt_len), generator=generator))
    prompts = [p.to(device) for p in prompts]
    new_tokens = args.skip + args.tokens

    def stream():
        return gpt.stream(prompts, new_tokens, temperature=0, kv_cache=args.cache, compile=compile)

    for _ in stream():  # compile, record graphs
        pass
    tokens = stream()
    for _ in range(args.skip):  # prefill and the first decode steps stay out of the profile
        next(tokens)
    synchronize(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(args.tokens):
            next(tokens)
        synchronize(device)
        wall_ms = (time.perf_counter() - start) * 1000 / args.tokens
    tokens.close()
    lines = [f"## {'compiled' if compile else 'eager'}, {args.cache} cache", ""]
    lines += summarize(prof, args.tokens, wall_ms, device.type == "cuda", args.top, "token")
    host = [e for e in prof.key_averages() if e.device_type.name == "CPU"]
    return (
        lines
        + [""]
        + top_table("host ops (self CPU)", host, lambda e: e.self_cpu_time_total, args.tokens, args.top, "token")
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny model on CPU")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--cache", default="contiguous", choices=("contiguous", "paged"))
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--skip", type=int, default=16, help="decode steps before the profile starts")
    parser.add_argument("--tokens", type=int, default=64, help="decode steps profiled")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    device = torch.device("cpu" if args.quick or not torch.cuda.is_available() else "cuda")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    config = GPTConfig(block_size=1024, attention_backend=args.backend, **(TINY if args.quick else GPT2_124M))
    gpt = GPT(config).to(device, dtype).eval()
    sections = []
    for compile in (False, True) if device.type == "cuda" else (False,):
        sections.append("\n".join(profile_case(gpt, args, device, compile)) + "\n")
    card = card_slug() if device.type == "cuda" else "cpu"
    name = "profile-generate-quick" if args.quick else "profile-generate"
    title = (
        f"# {name} on {card} (torch {torch.__version__}): batch {args.batch_size}, prompt {args.prompt_len}, "
        f"greedy, {args.tokens} tokens profiled after {args.skip}\n\n"
    )
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{card}-{name}.md"
    path.write_text(title + "\n".join(sections))
    print(path.read_text())
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
