"""Context parallelism on CPU with gloo: a sequence split over ranks gives the unsharded loss and gradients
(training/context.py). test_parallel.py trains with it through train.py under torchrun."""

from __future__ import annotations

import json
import subprocess
import sys

from helpers import REPO, free_port, subprocess_env

WORKER = REPO / "tests" / "e2e" / "context_worker.py"


def test_a_sequence_split_over_two_ranks_gives_the_unsharded_loss_and_gradients():
    """Two ranks (four chunks: rank 0 holds the first and last, rank 1 the middle two), float64, GPT-2's block
    and the modern one (RoPE, one key/value head, q/k norm): loss and every gradient within 1e-12 of the whole
    sequence on one rank."""
    ranks, port = 2, free_port()
    children = [
        subprocess.Popen(
            [sys.executable, str(WORKER)],
            cwd=REPO,
            env={
                **subprocess_env(),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "RANK": str(rank),
                "WORLD_SIZE": str(ranks),
                "PYTHONPATH": str(REPO),
            },
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(ranks)
    ]
    outputs = [child.communicate(timeout=120) for child in children]
    assert all(child.returncode == 0 for child in children), outputs
    for stdout, _ in outputs:
        worst = json.loads(stdout.strip().splitlines()[-1])["worst"]
        assert len(worst) == 4, worst
        assert all(errors["loss"] < 1e-12 and errors["grads"] < 1e-12 for errors in worst.values()), worst
