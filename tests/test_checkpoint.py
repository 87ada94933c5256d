"""checkpoint.py: atomic saves (an exception or a kill -9 mid-write leaves the previous checkpoint whole),
rotation with hard links, weights_only loading, RNG capture, safetensors export, one-line errors."""

from __future__ import annotations

import io
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import checkpoint
from checkpoint import CheckpointError, capture_rng, export_safetensors, load_checkpoint, restore_rng, save_checkpoint
from helpers import REPO, run_script, subprocess_env

pytestmark = pytest.mark.usefixtures("one_thread")


def small_state(iter_num: int) -> dict:
    return {"model": {"w": torch.full((4,), float(iter_num))}, "model_config": {"n_layer": 1}, "iter_num": iter_num}


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if ".tmp" in p.name)


# ---- atomic save ----


def test_failed_save_leaves_previous_checkpoint(monkeypatch, tmp_path):
    save_checkpoint(small_state(1), tmp_path, 1, keep_last_k=2, is_best=True)

    def broken_save(obj, f, *args, **kwargs):
        f.write(b"PK\x03\x04 half a checkpoint")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint.torch, "save", broken_save)
    with pytest.raises(OSError):
        save_checkpoint(small_state(2), tmp_path, 2, keep_last_k=2, is_best=True)
    monkeypatch.undo()
    assert load_checkpoint(tmp_path / "ckpt.pt")["iter_num"] == 1
    assert load_checkpoint(tmp_path / "best.pt")["iter_num"] == 1
    assert not (tmp_path / "ckpt-0000002.pt").exists()
    assert leftovers(tmp_path) == []


KILLED_WRITER = """
import sys, torch
from checkpoint import save_checkpoint
state = {"model": {"w": torch.ones(50_000_000)}, "model_config": {}, "iter_num": 2}  # 200 MB
print("saving", flush=True)
save_checkpoint(state, sys.argv[1], 2, 2, True)
print("saved", flush=True)
"""


def test_kill_9_mid_save_leaves_previous_checkpoint(tmp_path):
    save_checkpoint(small_state(1), tmp_path, 1, keep_last_k=2, is_best=True)
    writer = subprocess.Popen(
        [sys.executable, "-c", KILLED_WRITER, str(tmp_path)],
        cwd=REPO,
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not [p for p in tmp_path.glob(".ckpt-0000002.pt.tmp.*") if p.stat().st_size > 0]:
            assert writer.poll() is None, writer.communicate()
            assert time.monotonic() < deadline, "the writer never started its temporary file"
            time.sleep(0.001)
        os.kill(writer.pid, signal.SIGKILL)
        stdout, _ = writer.communicate(timeout=30)
    finally:
        if writer.poll() is None:
            writer.kill()
    assert writer.returncode == -signal.SIGKILL
    assert "saved" not in stdout.split(), "the save finished before the kill: the test proved nothing"
    assert leftovers(tmp_path), "a kill mid-save leaves its temporary file"
    assert not (tmp_path / "ckpt-0000002.pt").exists()
    assert load_checkpoint(tmp_path / "ckpt.pt")["iter_num"] == 1
    assert load_checkpoint(tmp_path / "best.pt")["iter_num"] == 1

    save_checkpoint(small_state(3), tmp_path, 3, keep_last_k=2, is_best=False)
    assert leftovers(tmp_path) == []  # the next save cleans up after the killed writer
    assert load_checkpoint(tmp_path / "ckpt.pt")["iter_num"] == 3


# ---- rotation ----


@pytest.mark.parametrize("keep", [1, 2, 3])
def test_keep_last_k_rotation_keeps_links_and_best(tmp_path, keep):
    for it in range(1, 7):
        save_checkpoint(small_state(it), tmp_path, it, keep_last_k=keep, is_best=it == 2)
    numbered = sorted(p.name for p in tmp_path.glob("ckpt-*.pt"))
    assert numbered == [f"ckpt-{it:07d}.pt" for it in range(7 - keep, 7)]
    assert (tmp_path / "ckpt.pt").samefile(tmp_path / "ckpt-0000006.pt")
    assert load_checkpoint(tmp_path / "ckpt.pt")["iter_num"] == 6
    best = load_checkpoint(tmp_path / "best.pt")  # its numbered file is long gone; the link keeps the data
    assert best["iter_num"] == 2 and torch.equal(best["model"]["w"], torch.full((4,), 2.0))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(numbered + ["best.pt", "ckpt.pt"])


def test_rotation_keeps_the_newest_saves_in_a_reused_out_dir(tmp_path):
    for it in (1000, 2000):  # an earlier run's files
        save_checkpoint(small_state(it), tmp_path, it, keep_last_k=2, is_best=False)
    save_checkpoint(small_state(250), tmp_path, 250, keep_last_k=2, is_best=False)
    assert (tmp_path / "ckpt-0000250.pt").exists()
    assert load_checkpoint(tmp_path / "ckpt.pt")["iter_num"] == 250


# ---- loading: weights_only, errors ----


class RunsCode:
    """Unpickling this calls os.mkdir(marker): stands in for any code a malicious checkpoint would run."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return os.mkdir, (self.marker,)


def test_load_refuses_pickled_code(tmp_path):
    armed = tmp_path / "armed.pt"
    torch.save({"model": RunsCode(tmp_path / "proof"), "model_config": {}}, armed)
    torch.load(armed, weights_only=False)  # the payload works when code may run ...
    assert (tmp_path / "proof").is_dir()

    evil = tmp_path / "evil.pt"
    marker = tmp_path / "marker"
    torch.save({"model": RunsCode(marker), "model_config": {}}, evil)
    with pytest.raises(CheckpointError) as error:  # ... and load_checkpoint does not let it
        load_checkpoint(evil)
    assert not marker.exists()
    assert "\n" not in str(error.value) and str(evil) in str(error.value)


def draws() -> tuple:
    return (
        random.random(),
        random.gauss(0, 1),
        np.random.standard_normal(3).tolist(),
        np.random.rand(),
        torch.rand(3).tolist(),
        torch.randn(2).tolist(),
    )


def test_capture_restore_rng_roundtrip():
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    random.gauss(0, 1), np.random.standard_normal()  # leave a cached gaussian in both python and numpy state
    buffer = io.BytesIO()
    torch.save(capture_rng(), buffer)  # through a file, as in a checkpoint
    expected = draws()
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    assert draws() != expected
    buffer.seek(0)
    restore_rng(torch.load(buffer, weights_only=True))
    assert draws() == expected


DAMAGE = {  # "missing" writes nothing; "truncated" and "not-a-checkpoint" are made from real files below
    "empty": b"",
    "random-bytes": random.Random(0).randbytes(4096),  # seeded: some random bytes do unpickle by chance
    "zeros": bytes(4096),
    "text-file": b"this is not a checkpoint\n" * 100,
    "pickle-bad-memo": b"\x80\x02h\x05.",  # PROTO 2, BINGET 5 (never stored), STOP
}


@pytest.mark.parametrize(
    "damage",
    [
        "missing",
        "empty",
        "random-bytes",
        "zeros",
        "truncated",
        "not-a-checkpoint",
        "text-file",
        "pickle-bad-memo",
    ],
)
def test_unreadable_checkpoint_is_one_line_error(trained_out, tmp_path, damage):
    path = tmp_path / "ckpt.pt"
    if damage in DAMAGE:
        path.write_bytes(DAMAGE[damage])
    elif damage == "truncated":
        good = (trained_out / "ckpt.pt").read_bytes()
        path.write_bytes(good[: len(good) // 2])
    elif damage == "not-a-checkpoint":
        torch.save({"weights": torch.zeros(3)}, path)
    with pytest.raises(CheckpointError) as error:
        load_checkpoint(path)
    message = str(error.value)
    assert "\n" not in message and str(path) in message


# ---- export ----


def test_export_safetensors_weights_and_metadata(trained_out, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file

    state = load_checkpoint(trained_out / "ckpt.pt")
    out = export_safetensors(trained_out / "ckpt.pt", tmp_path / "model.safetensors")
    weights = load_file(out)
    assert set(weights) == set(state["model"]) - {"lm_head.weight"}
    for name, tensor in weights.items():
        assert torch.equal(tensor, state["model"][name]), name
    assert torch.equal(state["model"]["lm_head.weight"], weights["transformer.wte.weight"])  # tied: nothing lost
    with safe_open(str(out), "pt") as f:
        metadata = f.metadata()
    assert "lm_head.weight" in metadata["tied"] and "transformer.wte.weight" in metadata["tied"]
    assert json.loads(metadata["model_config"]) == state["model_config"]


def test_export_cli(trained_out, tmp_path):
    from safetensors.torch import load_file

    out = tmp_path / "model.safetensors"
    result = run_script("checkpoint.py", ["export", str(trained_out / "ckpt.pt"), str(out)], timeout=60)
    assert result.returncode == 0, result.stderr
    assert f"wrote {out}" in result.stdout
    assert "transformer.wte.weight" in load_file(out)


@pytest.mark.parametrize(
    "argv",
    [[], ["export"], ["import", "a.pt", "b.safetensors"], ["export", "NO.pt", "x"]],
    ids=["no-args", "missing-paths", "unknown-command", "missing-checkpoint"],
)
def test_export_cli_bad_input(tmp_path, capsys, argv):
    argv = [str(tmp_path / a) if a.endswith(("pt", "x")) and a != "export" else a for a in argv]
    assert checkpoint.main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith(("usage: ", "error: ")), err
