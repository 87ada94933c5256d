"""DDP under torchrun, on CPU with the gloo backend: two ranks train, checkpoint, stop together on SIGTERM
and resume with each rank's own RNG and data position."""

from __future__ import annotations

import os
import re
import signal

import pytest
import torch

from checkpoint import load_checkpoint
from helpers import Child, tiny_args

TORCHRUN = ("-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2")


def ddp_args(data_dir, out_dir, *extra):
    return [
        *TORCHRUN[1:],
        "train.py",
        *tiny_args(data_dir, out_dir, "--backend=gloo", "--gradient_accumulation_steps=4", *extra),
    ]


def run_torchrun(args, timeout=180) -> tuple[int, str]:
    with Child(TORCHRUN[0], args) as child:
        return child.finish(timeout)


def test_two_ranks_train_checkpoint_and_resume(char_data, tmp_path):
    out = tmp_path / "out"
    code, output = run_torchrun(
        ddp_args(
            char_data, out, "--max_iters=6", "--eval_interval=3", "--log_interval=3", "--always_save_checkpoint=true"
        )
    )
    assert code == 0, output
    assert "(2 ranks x 2 micro-steps x 4 x 16)" in output  # 4 accumulation steps split over 2 ranks
    assert len(re.findall(r"^iter \d+ \| loss", output, re.M)) == 2  # rank 0 alone prints
    state = load_checkpoint(out / "ckpt.pt")
    assert state["iter_num"] == 6 and len(state["rng"]) == 2
    assert not torch.equal(state["rng"][0]["data"], state["rng"][1]["data"])  # rank-offset data streams

    code, output = run_torchrun(
        ddp_args(char_data, out, "--max_iters=9", "--eval_interval=3", "--log_interval=3", "--init_from=resume")
    )
    assert code == 0, output
    assert "resuming at iter 6" in output and re.search(r"^iter 9 \|", output, re.M)


def test_sigterm_to_torchrun_stops_every_rank_at_the_same_step(char_data, tmp_path):
    out = tmp_path / "out"
    args = ddp_args(
        char_data, out, "--max_iters=100000", "--eval_interval=100000", "--log_interval=20", "--eval_on_start=false"
    )
    with Child(TORCHRUN[0], args) as child:
        child.wait_for(lambda line: line.startswith("iter 40 |"))
        os.kill(child.pid, signal.SIGTERM)  # torchrun passes it on to both workers
        _, output = child.finish(timeout=120)  # torchrun itself exits non-zero when signalled
    saved = re.search(r"^received SIGTERM; saved (\S+) at iter (\d+); exiting$", output, re.M)
    assert saved, output
    state = load_checkpoint(saved.group(1))
    assert state["iter_num"] == int(saved.group(2)) >= 40 and len(state["rng"]) == 2
    assert "Traceback" not in output.split("received SIGTERM")[0]


@pytest.fixture(autouse=True)
def _gloo_only():
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is not available in this build")
