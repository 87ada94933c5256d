"""docs/multi-gpu.md's two-node launch, shown on one host: two torchrun agents (--nnodes=2, --node_rank 0 and 1, a
c10d rendezvous on localhost), each seeing its own half of the GPUs as each machine of a real two-node job does,
train as one launch of all of them does. Rank 0's logged losses are compared iteration by iteration with a
--standalone launch's, and that launch runs twice: its repeat shows how far two identical GPU runs drift apart."""

from __future__ import annotations

import os

import pytest
from gpu.runs import ENV, TIMEOUT_S, needs

from bench import launch
from helpers import free_port

pytestmark = [pytest.mark.gpu, needs(gpus=2)]

ITERS = 20
MODEL = ["--n_layer=4", "--n_head=4", "--n_embd=128", "--block_size=256", "--batch_size=16", "--dropout=0.0"]
TOLERANCE = 0.02  # nats: the least gap allowed, whatever the repeat shows (losses are logged to 4 decimals)


def losses(agents: list[tuple[list[str], dict]], settings: list[str]) -> dict[int, float]:
    """Start each agent's torchrun (its options, its environment) at once, wait for all; rank 0's loss by iteration
    (agent 0 holds rank 0)."""
    started = [
        launch.Launch(launch.train_command(settings, torchrun), {**os.environ, **ENV, **env})
        for torchrun, env in agents
    ]
    runs = [agent.wait(TIMEOUT_S) for agent in started]
    failed = [run for run in runs if run.code != 0]
    assert not failed, f"exit {[run.code for run in runs]}: {failed[0].failure()}\n{failed[0].output[-3000:]}"
    return {line["iter"]: line["loss"] for line in runs[0].lines}


def test_two_agents_train_as_one_launch(corpus, tmp_path, record_property):
    import torch

    ranks = 4 if torch.cuda.device_count() >= 4 else 2
    half = ranks // 2

    def settings(name: str) -> list[str]:
        run = [f"--data_dir={corpus}", f"--out_dir={tmp_path / name}", *MODEL, "--dtype=bfloat16", "--compile=false"]
        run += [f"--max_iters={ITERS}", f"--gradient_accumulation_steps={ranks}", "--log_interval=1"]
        return run + [f"--eval_interval={ITERS}", "--eval_iters=1", "--eval_on_start=false"]

    standalone = [(["--standalone", f"--nproc_per_node={ranks}"], {})]
    rendezvous = ["--nnodes=2", f"--nproc_per_node={half}", "--rdzv_backend=c10d", "--rdzv_id=two-nodes"]
    rendezvous.append(f"--rdzv_endpoint=127.0.0.1:{free_port()}")
    two_nodes = [
        (
            [*rendezvous, f"--node_rank={node}"],
            {"CUDA_VISIBLE_DEVICES": ",".join(map(str, range(node * half, (node + 1) * half)))},
        )
        for node in (0, 1)
    ]
    reference = losses(standalone, settings("standalone"))
    again = losses(standalone, settings("standalone-again"))
    nodes = losses(two_nodes, settings("two-nodes"))
    assert list(reference) == list(again) == list(nodes) and len(reference) >= ITERS - 1, (reference, nodes)
    noise = max(abs(again[it] - reference[it]) for it in reference)
    gap = max(abs(nodes[it] - reference[it]) for it in reference)
    record_property("figure", gap)
    record_property("unit", f"max |loss - one launch's| (its repeat: {noise:.4f})")
    assert gap <= max(TOLERANCE, 3 * noise), f"two agents' losses {gap:.4f} from one launch's; its repeat {noise:.4f}"
