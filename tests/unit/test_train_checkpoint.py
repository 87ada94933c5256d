"""A run's checkpoint contents (training/state.py): one data stream for all ranks; checkpoints of earlier
versions, with a data position per rank, still resume."""

from __future__ import annotations

import contextlib
import io
import shutil

import pytest
import torch

import train
from helpers import tiny_args
from weights.load import load_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")


def test_a_checkpoint_with_a_data_position_per_rank_still_resumes_the_same_stream(trained_out, char_data, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(trained_out, out)
    state = load_checkpoint(out / "ckpt-0000002.pt", resume=True)
    assert isinstance(state["data"], torch.Tensor) and all("data" not in rank for rank in state["rng"])
    state["rng"] = [{**rank, "data": state.pop("data")} for rank in state["rng"]]  # how earlier versions saved it
    torch.save(state, out / "ckpt.pt")

    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        code = train.main(tiny_args(char_data, out, "--init_from=resume", "--max_iters=4", "--eval_interval=2"))
    assert code == 0, stdout.getvalue()
    assert "resuming at iter 2" in stdout.getvalue()
    resumed, uninterrupted = load_checkpoint(out / "ckpt.pt"), load_checkpoint(trained_out / "ckpt.pt")
    assert resumed["iter_num"] == uninterrupted["iter_num"] == 4
    for name, tensor in uninterrupted["model"].items():
        torch.testing.assert_close(resumed["model"][name], tensor, rtol=0, atol=0, msg=name)
    assert torch.equal(resumed["data"], uninterrupted["data"])


def test_a_resumed_run_trains_with_the_weight_decay_and_betas_it_is_given_and_says_they_changed(
    trained_out, char_data, tmp_path, capsys
):
    out = tmp_path / "out"
    shutil.copytree(trained_out, out)
    saved = load_checkpoint(out / "ckpt.pt", resume=True)["optimizer"]["param_groups"]
    assert saved[0]["weight_decay"] != 0.05 and saved[0]["betas"][1] != 0.9

    args = ("--init_from=resume", "--max_iters=6", "--eval_interval=2", "--weight_decay=0.05", "--beta2=0.9")
    assert train.main(tiny_args(char_data, out, *args)) == 0
    assert f"weight_decay: {saved[0]['weight_decay']} -> 0.05" in capsys.readouterr().err
    groups = load_checkpoint(out / "ckpt.pt", resume=True)["optimizer"]["param_groups"]
    assert [g["weight_decay"] for g in groups] == [0.05, 0.0]  # biases and norms stay undecayed
    assert all(tuple(g["betas"]) == (saved[0]["betas"][0], 0.9) for g in groups)
