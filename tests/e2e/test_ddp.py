"""DDP under torchrun, on CPU with the gloo backend: two ranks train, stop together on SIGTERM with a checkpoint
of the data stream's position and each rank's RNG, and resume from it; a second launch on the same out_dir meanwhile is
refused by rank 0 and every rank exits (none waits for the others forever). One torchrun launch, for what torchrun
does (it passes SIGTERM on to its workers): it costs two fresh interpreters (its workers, the ranks under test), the
most expensive thing these tests do; torchrun itself is forked from the warm interpreter (helpers.WarmProcess),
which has torch imported already, and so are the ranks of the other two launches (helpers.run_ranks)."""

from __future__ import annotations

import os
import re
import signal

import pytest
import torch

from helpers import Child, run_ranks, tiny_args
from weights.load import load_checkpoint

TORCHRUN = ("-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2")


def ddp_args(data_dir, out_dir, *extra):
    """train.py's arguments for 2 ranks; the ranks are started by torchrun (TORCHRUN + these) or helpers.run_ranks."""
    return tiny_args(data_dir, out_dir, "--dist_backend=gloo", "--gradient_accumulation_steps=4", *extra)


def test_sigterm_stops_every_rank_at_the_same_step_and_the_run_resumes(char_data, tmp_path, warm_interpreter):
    out = tmp_path / "out"
    # log_interval=1: a few dozen steps fill its pipe, and there it waits instead of taking the CPU from the
    # second launch
    args = ddp_args(
        char_data, out, "--max_iters=100000", "--eval_interval=100000", "--log_interval=1", "--eval_on_start=false"
    )
    with Child(TORCHRUN[0], [*TORCHRUN[1:], "train.py", *args], warm=True) as child:
        child.wait_for(lambda line: line.startswith("parameters: "))  # printed once out_dir is claimed
        # While the run holds out_dir (training on, until its pipe is full), a second launch fails on all ranks
        holder = (out / ".lock").read_text().strip()
        second_args = ddp_args(char_data, out, "--max_iters=5", "--overwrite_out_dir=true")
        second = run_ranks("train.py", second_args, timeout=120)
        child.wait_for(lambda line: line.startswith("iter 20 |"))
        os.kill(child.pid, signal.SIGTERM)  # torchrun passes it on to both workers
        _, output = child.finish(timeout=120)  # torchrun itself exits non-zero when signalled
    refused = "".join(output for _, output in second)
    errors = [line for line in refused.splitlines() if line.startswith("error: ")]
    assert all(code != 0 for code, _ in second) and len(errors) == 1, second  # rank 0 says why; rank 1 stops too
    assert f"is in use by another run (pid {holder}," in errors[0], refused
    assert 'train.py", line' not in refused and "iter 1 |" not in refused, refused  # no traceback, no step
    assert "(2 ranks x 2 micro-steps x 4 x 16)" in output  # 4 accumulation steps split over 2 ranks
    assert len(re.findall(r"^parameters: ", output, re.M)) == 1  # rank 0 alone prints
    saved = re.search(r"^received SIGTERM; saved (\S+) at iter (\d+); exiting$", output, re.M)
    assert saved, output
    assert "Traceback" not in output.split("received SIGTERM")[0]
    stopped_at = int(saved.group(2))
    state = load_checkpoint(saved.group(1))
    assert state["iter_num"] == stopped_at >= 20 and len(state["rng"]) == 2  # every rank's state, one file
    assert "data" in state and all("data" not in rank for rank in state["rng"])  # one stream for all ranks
    assert not torch.equal(state["rng"][0]["rng"]["torch"], state["rng"][1]["rng"]["torch"])  # each its dropout

    resume = ddp_args(
        char_data,
        out,
        f"--max_iters={stopped_at + 3}",
        "--eval_interval=100000",  # evaluates and saves at max_iters only
        "--eval_on_start=false",
        "--log_interval=1",
        "--always_save_checkpoint=true",
        "--init_from=resume",
    )
    ranks = run_ranks("train.py", resume, timeout=180)
    output = "".join(output for _, output in ranks)
    assert [code for code, _ in ranks] == [0, 0], output
    assert f"resuming at iter {stopped_at}" in output and "checkpoint was saved by" not in output
    assert re.findall(r"^iter (\d+) \|", output, re.M) == [str(stopped_at + k) for k in (1, 2, 3)], output
    assert re.search(rf"^saved \S+ \(iter {stopped_at + 3}, val ", output, re.M), output
    state = load_checkpoint(out / "ckpt.pt")
    assert state["iter_num"] == stopped_at + 3 and len(state["rng"]) == 2


@pytest.fixture(autouse=True)
def _gloo_only():
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is not available in this build")
