"""The README's two-node launch, shown on one host: two torchrun agents (--nnodes=2, --node_rank 0 and 1, a c10d
rendezvous on localhost), each with half the GPUs, against one --standalone launch of all of them, twice (the
run-to-run noise of the GPU kernels). The train.py settings are the same; the logged losses are compared
iteration by iteration.

    python -m bench.bench_two_nodes            # a 4-GPU host: 2 agents x 2 GPUs against 1 x 4, GPT-2 124M shapes
    python -m bench.bench_two_nodes --quick    # CPU, gloo: 2 agents x 2 processes against 1 x 4, a tiny model

Results: bench/results/<card>-two-nodes.{json,md}. NCCL_NVLS_ENABLE=0 in every launched process.
"""

from __future__ import annotations

from errors import as_command

if __name__ == "__main__":  # before torch's seconds of importing: see as_command
    as_command()

import contextlib
import random
import socket
import statistics
import sys
import time
from pathlib import Path

import torch

from bench import launch
from bench.report import DEFAULT_OUT, GPT2_124M, GPT2_VOCAB, TINY, Column, save_results
from data.common import OneLineParser

COLUMNS = [
    Column("launch", "launch"),
    Column("ranks", "ranks"),
    Column("iters_logged", "iterations logged"),
    Column("final_loss", "last loss", "{:.4f}"),
    Column("max_abs_diff", "max |loss - first launch's|", "{:.4f}"),
    Column("tokens_per_sec", "tok/s", "{:,.0f}"),
    Column("wall_s", "wall s", "{:.1f}"),
    Column("status", "status"),
]


def free_port() -> int:
    """A free TCP port below Linux's ephemeral range (32768-60999). One that bind(0) finds free lies in that
    range, where any process's next outgoing connection may take it before torchrun binds it (torchrun's c10d
    rendezvous, finding its port taken, connects to it as a client instead)."""
    for port in random.SystemRandom().sample(range(20000, 32768), 200):  # not the seeded global generator
        with socket.socket() as s, contextlib.suppress(OSError):
            s.bind(("127.0.0.1", port))
            return port
    raise RuntimeError("no free TCP port found in 20000-32767")


def train_settings(args, out_dir: Path) -> list[str]:
    settings = launch.flags(TINY if args.quick else GPT2_124M) + [
        f"--data_dir={args.data}",
        f"--batch_size={4 if args.quick else 16}",
        f"--block_size={64 if args.quick else 1024}",
        f"--gradient_accumulation_steps={args.ranks}",  # one micro-step per rank
        f"--max_iters={args.iters}",
        f"--lr_decay_iters={args.iters}",
        f"--warmup_iters={min(5, args.iters)}",
        "--log_interval=1",
        f"--eval_interval={args.iters}",
        "--eval_iters=1",
        "--eval_on_start=false",
        f"--out_dir={out_dir}",
        "--overwrite_out_dir=true",
    ]
    if not args.quick:
        settings.append(f"--vocab_size={GPT2_VOCAB}")
    else:
        settings += ["--device=cpu", "--dist_backend=gloo", "--compile=false"]
    return settings + args.extra


def run(args, name: str, agents: list[tuple[list[str], dict]], out_dir: Path) -> dict:
    """Start every agent's torchrun (its arguments, its extra environment) at once, wait for all; the row of rank
    0's log lines (agent 0's output)."""
    env, settings = launch.torchrun_env(args.quick), train_settings(args, out_dir)
    start = time.perf_counter()
    started = [launch.Launch(launch.train_command(settings, torchrun), {**env, **extra}) for torchrun, extra in agents]
    runs = [agent.wait(args.timeout) for agent in started]
    codes, lines = [r.code for r in runs], runs[0].lines
    row = {"launch": name, "ranks": args.ranks, "wall_s": time.perf_counter() - start, "codes": codes}
    if any(codes) or not lines:
        failed = next((r for r in runs if r.code), runs[0])
        return {**row, "status": f"exit {codes}: {failed.failure()}"}
    steady = [line["tokens_per_sec"] for line in lines if line["iter"] > min(5, args.iters - 1)]
    return {
        **row,
        "losses": {line["iter"]: line["loss"] for line in lines},
        "iters_logged": len(lines),
        "final_loss": lines[-1]["loss"],
        "tokens_per_sec": statistics.median(steady) if steady else None,
        "status": "ok",
    }


def node_gpus(node: int, gpus_per_node: int, quick: bool) -> dict:
    """The environment that gives a node's agent its own GPUs, as a separate machine would have (each agent
    numbers its ranks' devices from cuda:0); none on CPU."""
    if quick:
        return {}
    first = node * gpus_per_node
    return {"CUDA_VISIBLE_DEVICES": ",".join(str(gpu) for gpu in range(first, first + gpus_per_node))}


def compare(rows: list[dict]) -> None:
    """Each row's largest logged-loss difference from the first row's, over the iterations both logged."""
    first = rows[0].get("losses") or {}
    for row in rows:
        losses = row.get("losses") or {}
        common = sorted(set(first) & set(losses))
        if common and len(common) == len(first) == len(losses):
            row["max_abs_diff"] = max(abs(losses[it] - first[it]) for it in common)


def parse_args(argv=None):
    parser = OneLineParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="CPU, gloo, a tiny model: checks the script")
    parser.add_argument("--ranks", type=int, default=4, help="processes in all, half per agent (default 4)")
    parser.add_argument("--iters", type=int, default=None, help="iterations per launch (default 30; --quick 6)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per launch (600)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results folder (default bench/results)")
    parser.add_argument("--work", type=Path, default=Path("out-bench-two-nodes"), help="folder for data and out_dirs")
    parser.add_argument("--name", default=None, help="results name (default two-nodes; --quick two-nodes-quick)")
    parser.add_argument("extra", nargs="*", help="more train.py --key=value settings for every launch (after --)")
    args = parser.parse_args(argv)
    if args.ranks < 2 or args.ranks % 2:
        parser.error(f"--ranks must be even and at least 2, got {args.ranks}")
    args.iters = args.iters or (6 if args.quick else 30)
    args.name = args.name or ("two-nodes-quick" if args.quick else "two-nodes")
    args.data = launch.corpus(args.work / "data")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if not args.quick and torch.cuda.device_count() < args.ranks:
        print(f"error: {args.ranks} GPUs asked for, {torch.cuda.device_count()} here", file=sys.stderr)
        return 2
    start, half, port = time.perf_counter(), args.ranks // 2, free_port()
    standalone = ["--standalone", f"--nproc_per_node={args.ranks}"]
    two_nodes = [
        (
            ["--nnodes=2", f"--node_rank={node}", f"--nproc_per_node={half}", "--rdzv_backend=c10d"]
            + [f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=two-nodes"],
            node_gpus(node, half, args.quick),
        )
        for node in (0, 1)
    ]
    rows = [
        run(args, f"1 agent x {args.ranks} (--standalone)", [(standalone, {})], args.work / "standalone"),
        run(args, f"1 agent x {args.ranks} (--standalone), again", [(standalone, {})], args.work / "standalone-again"),
        run(args, f"2 agents x {half} (--nnodes=2, c10d on localhost)", two_nodes, args.work / "two-nodes"),
    ]
    compare(rows)
    for row in rows:
        print(f"{row['launch']}: {row['status']}, max |loss diff| {row.get('max_abs_diff')}", flush=True)
    device = torch.device("cpu" if args.quick or not torch.cuda.is_available() else "cuda")
    notes = {
        "launches": "train.py under torchrun, the same settings, one micro-step per rank a step; the first "
        "launch's losses are the reference, its repeat shows the run-to-run noise",
        "losses": "rank 0's log lines (4 decimals), every iteration",
        "environment": "NCCL_NVLS_ENABLE=0",
    }
    save_results(args.out, args.name, device, rows, COLUMNS, wall_s=round(time.perf_counter() - start, 1), notes=notes)
    return 0 if all(row["status"] == "ok" for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
