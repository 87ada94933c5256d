"""Context parallelism on CPU with gloo: a sequence split over ranks gives the unsharded loss and gradients
(training/context.py). test_parallel.py trains with it through train.py under torchrun."""

from __future__ import annotations

import contextlib
import json

from helpers import Child, free_port

WORKER = "tests.e2e.context_worker"  # run as a module from the repo root, which is then on sys.path


def test_a_sequence_split_over_two_ranks_gives_the_unsharded_loss_and_gradients(monkeypatch, warm_interpreter):
    """Two ranks (four chunks: rank 0 holds the first and last, rank 1 the middle two), float64, GPT-2's block
    and the modern one (RoPE, one key/value head, q/k norm), each chunk's attention by CPU flash on its prefix and
    diagonal (merged) and by the reference (SDPA, lower-right mask): loss and every gradient within 1e-12 of the
    whole sequence on one rank."""
    ranks = 2
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    monkeypatch.setenv("WORLD_SIZE", str(ranks))
    with contextlib.ExitStack() as stack:
        children = []
        for rank in range(ranks):
            monkeypatch.setenv("RANK", str(rank))  # each child takes the environment as it is when it starts
            children.append(stack.enter_context(Child("-m", [WORKER], warm=True)))
        results = [child.finish(timeout=120) for child in children]
    assert [code for code, _ in results] == [0] * ranks, results
    for _, output in results:
        worst = json.loads(output.strip().splitlines()[-1])["worst"]
        assert {name: errors["used"] for name, errors in worst.items()} == {
            "gpt2, auto": "cpu_flash",
            "modern, auto": "cpu_flash",
            "gpt2, sdpa_lower_right": "sdpa_lower_right",
            "modern, sdpa_lower_right": "sdpa_lower_right",
        }, worst
        assert all(errors["loss"] < 1e-12 and errors["grads"] < 1e-12 for errors in worst.values()), worst
