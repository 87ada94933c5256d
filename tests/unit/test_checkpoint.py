"""storage/checkpoint.py: atomic saves (a failed write or a kill -9 at any moment leaves the previous checkpoint
whole), rotation of the run's own files only, one run per out_dir, weights_only loading and the checkpoint schema
(weights/load.py's load_checkpoint), RNG capture; safetensors export (`python -m weights safetensors`), one-line
errors."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import io
import json
import math
import multiprocessing
import os
import random
import shutil
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from errors import CheckpointError
from helpers import file_size_limit, run_script, tiny_config, tree_digest, warm_context
from storage import checkpoint
from storage.checkpoint import capture_rng, claim_out_dir, restore_rng, save_checkpoint
from weights.__main__ import main as weights_main
from weights.load import export_safetensors, load_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")


@functools.cache
def tiny_weights() -> dict[str, torch.Tensor]:
    from model import GPT

    return GPT(tiny_config()).state_dict()


def small_state(iter_num: int) -> dict:
    """A checkpoint that passes load_checkpoint's schema; every weight is iter_num, so copies can be told apart."""
    return {
        "model": {name: torch.full_like(w, float(iter_num)) for name, w in tiny_weights().items()},
        "model_config": dataclasses.asdict(tiny_config()),
        "meta": {"tokenizer": "char", "vocab_size": 64, "itos": [chr(32 + i) for i in range(64)]},
        "iter_num": iter_num,
    }


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if ".tmp" in p.name)


def iter_of(path: Path) -> int:
    return load_checkpoint(path)["iter_num"]


# ---- atomic save ----


def fail_copies(monkeypatch):
    def copyfile(source, target, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint.shutil, "copyfile", copyfile)


@pytest.mark.parametrize("failing", ["numbered-file", "copy-to-ckpt.pt"])
def test_failed_save_is_one_line_and_leaves_previous_checkpoint(monkeypatch, tmp_path, failing):
    """A write that fails (here: the file size limit, the way a full disk fails it, inside torch's zip writer;
    or the copy to ckpt.pt) is one line naming the file and the cause; the previous checkpoint is whole."""
    save_checkpoint(small_state(1), tmp_path, 1, keep_last_k=2, is_best=True)
    before = tree_digest(tmp_path)
    with contextlib.ExitStack() as stack:
        if failing == "numbered-file":
            stack.enter_context(file_size_limit(4096))
        else:
            fail_copies(monkeypatch)
        with pytest.raises(CheckpointError) as error:
            save_checkpoint(small_state(2), tmp_path, 2, keep_last_k=2, is_best=True)
    message = str(error.value)
    assert "\n" not in message and "unexpected pos" not in message
    if failing == "numbered-file":
        assert str(tmp_path / "ckpt-0000002.pt") in message and "File too large [EFBIG]" in message, message
    else:
        assert str(tmp_path / "best.pt") in message and "No space left on device [ENOSPC]" in message, message
    assert message.endswith("ckpt.pt is unchanged"), message
    assert tree_digest(tmp_path) == before  # no temporary file, no new numbered file, ckpt.pt and best.pt as they were
    assert iter_of(tmp_path / "ckpt.pt") == 1 and iter_of(tmp_path / "best.pt") == 1


def test_a_folder_that_turns_read_only_mid_save_is_one_line(monkeypatch, tmp_path):
    """The numbered file is written, then the folder takes no more changes: the copy fails, and so does removing
    the numbered file again. One line that says what was written, not the second failure's traceback."""
    save_checkpoint(small_state(1), tmp_path, 1, keep_last_k=2, is_best=True)
    real_unlink, read_only = Path.unlink, []

    def copyfile(source, target, **kwargs):
        read_only.append(True)  # from the first copy on
        raise PermissionError(errno.EACCES, "Permission denied", str(target))

    def unlink(path, missing_ok=False):
        if read_only and Path(path).parent == tmp_path:
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_unlink(path, missing_ok=missing_ok)

    monkeypatch.setattr(checkpoint.shutil, "copyfile", copyfile)
    monkeypatch.setattr(Path, "unlink", unlink)
    with pytest.raises(CheckpointError) as error:
        save_checkpoint(small_state(2), tmp_path, 2, keep_last_k=2, is_best=True)
    assert str(error.value) == (
        f"could not save iter 2: {tmp_path / 'best.pt'}: Permission denied [EACCES]; ckpt-0000002.pt written, "
        "ckpt.pt is unchanged"
    )
    monkeypatch.undo()
    assert iter_of(tmp_path / "ckpt.pt") == 1 and iter_of(tmp_path / "ckpt-0000002.pt") == 2


def save_iterations(out: Path, source: Path, first: int) -> None:
    """In a child of the warm interpreter: the checkpoint at `source` saved as iterations first, first + 1, ...
    until the child is killed; padded to 40 MB, so that every step of a save lasts long enough to be caught."""
    state = torch.load(source, weights_only=True)
    state["padding"] = torch.ones(10_000_000)
    for it in range(first, first + 1000):
        save_checkpoint({**state, "iter_num": it}, out, it, 2, it % 2 == 0)


# Kill moments: while writing the numbered file, while copying it to best.pt, to ckpt.pt, and at a random time
KILL_AT = (".ckpt-*.pt.tmp.", ".best.pt.tmp.", ".ckpt.pt.tmp.", None)  # + the writer's pid


def test_kill_9_at_any_moment_of_a_save_leaves_loadable_checkpoints(tmp_path, warm_interpreter):
    """kill -9 a saving process at each step of a save, and once at random: ckpt.pt and best.pt always load,
    and the next save removes what the killed writer left. Every writer is forked from the warm interpreter
    (cheap)."""
    out = tmp_path / "out"
    out.mkdir()
    save_checkpoint(small_state(1), out, 1, keep_last_k=2, is_best=True)
    shutil.copyfile(out / "ckpt.pt", tmp_path / "source.pt")
    rng, caught = random.Random(0), []
    for round_, pattern in enumerate(KILL_AT):
        writer = warm_context().Process(target=save_iterations, args=(out, tmp_path / "source.pt", 100 * (round_ + 1)))
        writer.start()
        try:
            deadline = time.monotonic() + 60
            while not [p for p in out.glob(f"{pattern or '.*.tmp.'}{writer.pid}") if p.stat().st_size > 0]:
                assert time.monotonic() < deadline, f"the writer never wrote {pattern}"
                time.sleep(0.001)
            if pattern is None:  # once it has started saving
                time.sleep(rng.uniform(0.0, 0.5))
        finally:
            os.kill(writer.pid, signal.SIGKILL)
            writer.join()
        caught.append(leftovers(out))
        for name in ("ckpt.pt", "best.pt", *(p.name for p in out.glob("ckpt-*.pt"))):
            load_checkpoint(out / name)  # raises if any file is torn
    assert any(caught), "no kill landed mid-save: the test proved nothing"
    save_checkpoint(small_state(2), out, 2, keep_last_k=2, is_best=False)
    assert leftovers(out) == []  # the next save cleans up after the killed writers
    assert iter_of(out / "ckpt.pt") == 2


# ---- rotation, and files that are not the run's ----


@pytest.mark.parametrize("keep", [1, 2, 3])
def test_keep_last_k_rotation_keeps_best(tmp_path, keep):
    for it in range(1, 7):
        save_checkpoint(small_state(it), tmp_path, it, keep_last_k=keep, is_best=it == 2)
    numbered = sorted(p.name for p in tmp_path.glob("ckpt-*.pt"))
    assert numbered == [f"ckpt-{it:07d}.pt" for it in range(7 - keep, 7)]
    assert iter_of(tmp_path / "ckpt.pt") == 6
    best = load_checkpoint(tmp_path / "best.pt")  # its numbered file is long gone; best.pt is a file of its own
    assert best["iter_num"] == 2 and all(torch.equal(w, torch.full_like(w, 2.0)) for w in best["model"].values())
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(numbered + ["best.pt", "ckpt.pt"])


def test_rollback_by_copy_changes_no_other_checkpoint(tmp_path):
    """`cp ckpt-0000001.pt ckpt.pt` writes into ckpt.pt's own file: best.pt and the numbered files must not
    share it (hard links would turn the rollback into a rewrite of all three)."""
    for it in (1, 2):
        save_checkpoint(small_state(it), tmp_path, it, keep_last_k=2, is_best=it == 2)
    others = tree_digest(tmp_path / "best.pt", tmp_path / "ckpt-0000002.pt", tmp_path / "ckpt-0000001.pt")
    shutil.copyfile(tmp_path / "ckpt-0000001.pt", tmp_path / "ckpt.pt")  # opens ckpt.pt in place, as cp does
    assert iter_of(tmp_path / "ckpt.pt") == 1
    assert tree_digest(tmp_path / "best.pt", tmp_path / "ckpt-0000002.pt", tmp_path / "ckpt-0000001.pt") == others
    assert iter_of(tmp_path / "best.pt") == 2


def filesystem(monkeypatch, clones: bool) -> list:
    """Stand in for out_dir's filesystem's answer to a clone (Linux's FICLONE ioctl): made (the bytes copied,
    as a clone reads), or refused as ext4 refuses it. Returns the clones asked for."""
    import fcntl

    asked = []

    def ioctl(target_fd, request, source_fd):
        assert request == checkpoint.FICLONE
        asked.append(request)
        if not clones:
            raise OSError(errno.EOPNOTSUPP, "Operation not supported")
        os.lseek(source_fd, 0, os.SEEK_SET)
        while chunk := os.read(source_fd, 1 << 20):
            os.write(target_fd, chunk)

    monkeypatch.setattr(fcntl, "ioctl", ioctl)
    return asked


@pytest.mark.parametrize("clones", [True, False], ids=["clones", "copies"])
def test_best_and_latest_are_clones_where_the_filesystem_makes_them_else_copies(monkeypatch, tmp_path, clones):
    """On XFS or Btrfs best.pt and ckpt.pt are copy-on-write clones of ckpt-<iter>.pt (no bytes written, and a
    write into one leaves the others as they were); elsewhere byte copies. Either way the same bytes."""
    asked = filesystem(monkeypatch, clones)
    copied = []
    real_copyfile = shutil.copyfile
    monkeypatch.setattr(shutil, "copyfile", lambda *args: copied.append(args) or real_copyfile(*args))
    save_checkpoint(small_state(1), tmp_path, 1, keep_last_k=2, is_best=True)
    assert len(asked) == 2 and len(copied) == (0 if clones else 2)
    numbered = (tmp_path / "ckpt-0000001.pt").read_bytes()
    assert (tmp_path / "best.pt").read_bytes() == numbered == (tmp_path / "ckpt.pt").read_bytes()


@pytest.mark.parametrize("clones", [True, False], ids=["clones", "copies"])
def test_the_free_space_check_asks_for_one_file_where_the_copies_are_clones(monkeypatch, tmp_path, clones):
    filesystem(monkeypatch, clones)
    monkeypatch.setattr(checkpoint, "free_bytes", lambda folder: 10_000)
    out = tmp_path / "out"
    first_save = checkpoint.SaveSize(file_bytes=4096)  # one block a file: three files need 12 KiB, one 4 KiB
    claim = functools.partial(claim_out_dir, out, continuing=False, overwrite=False, first_save=first_save)
    if clones:
        with claim():
            assert sorted(p.name for p in out.iterdir()) == [".lock"]  # the probes are gone
    else:
        with pytest.raises(CheckpointError, match="has 9.8 KiB free; the first save needs about 12.0 KiB"):
            claim()


@pytest.mark.parametrize("held", [("ckpt.pt",), ("ckpt.pt", "best.pt")], ids=["latest", "latest and best"])
def test_the_free_space_check_asks_for_a_file_less_where_the_save_replaces_best_and_latest(monkeypatch, tmp_path, held):
    """A resumed run's save writes ckpt-<iter>.pt, then each copy to a temporary file that replaces best.pt or
    ckpt.pt before the next: two files at the peak where both are there, three where one of them is new."""
    filesystem(monkeypatch, clones=False)
    monkeypatch.setattr(checkpoint, "free_bytes", lambda folder: 10_000)
    out = tmp_path / "out"
    out.mkdir()
    for name in held:
        (out / name).write_bytes(b"an earlier save")
    first_save = checkpoint.SaveSize(file_bytes=4096)  # one block a file
    claim = functools.partial(claim_out_dir, out, continuing=True, overwrite=False, first_save=first_save)
    if len(held) == 2:
        claim().release()
    else:
        with pytest.raises(CheckpointError, match="has 9.8 KiB free; the first save needs about 12.0 KiB"):
            claim()


def test_rotation_and_cleanup_touch_only_the_runs_own_files(tmp_path):
    users = {
        "ckpt-backup-before-lr-change.pt": b"a user's backup",
        ".notes.tmp.txt": b"a user's notes",
        "ckpt-12.pt": b"not a name saves write",
        ".ckpt.pt.tmp.txt": b"not a temporary name of ours",
        "model.safetensors": b"an export",
    }
    for name, data in users.items():
        (tmp_path / name).write_bytes(data)
    (tmp_path / ".ckpt-0000009.pt.tmp.999999").write_bytes(b"half a checkpoint of a killed writer")
    for it in range(1, 5):
        save_checkpoint(small_state(it), tmp_path, it, keep_last_k=1, is_best=False)
    assert {name: (tmp_path / name).read_bytes() for name in users} == users
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*users, "ckpt-0000004.pt", "ckpt.pt"])


def test_rotation_keeps_the_newest_saves_in_a_resumed_out_dir(tmp_path):
    """A run resumed from a rolled-back ckpt.pt saves lower iterations than the files beside it: rotation goes
    by save order. (A fresh run never gets here: train.py refuses an out_dir that holds checkpoints.)"""
    for it in (1000, 2000):
        save_checkpoint(small_state(it), tmp_path, it, keep_last_k=2, is_best=False)
    save_checkpoint(small_state(250), tmp_path, 250, keep_last_k=2, is_best=False)
    assert sorted(p.name for p in tmp_path.glob("ckpt-*.pt")) == ["ckpt-0000250.pt", "ckpt-0002000.pt"]
    assert iter_of(tmp_path / "ckpt.pt") == 250


def test_rotation_never_deletes_the_runs_newest_saves_whatever_stands_beside_them(tmp_path):
    """Another run's ckpt-9999999.pt dated in the future, a link to our own save, a dangling link, a folder and a
    link loop, all with names of numbered saves: the run's last keep_last_k saves stay, the others are untouched."""
    future = tmp_path / "ckpt-9999999.pt"
    future.write_bytes(b"another run's save, copied in with its time kept")
    os.utime(future, (time.time() + 3600, time.time() + 3600))
    (tmp_path / "ckpt-0000005.pt").symlink_to("nowhere.pt")
    (tmp_path / "ckpt-0000006.pt").mkdir()
    (tmp_path / "ckpt-0000007.pt").symlink_to("ckpt-0000007.pt")
    strangers = sorted(p.name for p in tmp_path.iterdir())
    for it in (10, 20, 30):
        save_checkpoint(small_state(it), tmp_path, it, keep_last_k=2, is_best=False)
        (tmp_path / "ckpt-8888888.pt").unlink(missing_ok=True)
        (tmp_path / "ckpt-8888888.pt").symlink_to(f"ckpt-{it:07d}.pt")  # a link to the newest save
    names = sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("."))
    ours = ["ckpt-0000020.pt", "ckpt-0000030.pt", "ckpt-8888888.pt", "ckpt.pt"]
    assert names == sorted([*strangers, *ours])
    assert iter_of(tmp_path / "ckpt-0000030.pt") == 30 and iter_of(tmp_path / "ckpt-0000020.pt") == 20
    assert future.read_bytes().startswith(b"another run's")


# ---- one run per out_dir ----


def test_out_dir_lock_names_its_holder_and_a_stale_lock_blocks_nothing(tmp_path):
    out = tmp_path / "a" / "out"
    with claim_out_dir(out, continuing=False, overwrite=False):
        assert (out / ".lock").read_text() == f"{os.getpid()}\n"
        with pytest.raises(CheckpointError) as error:
            claim_out_dir(out, continuing=True, overwrite=True)  # flock: a second open file, even in this process
        assert f"in use by another run (pid {os.getpid()}" in str(error.value)
    assert not (tmp_path / "a").exists()  # released: the lock file and the folders the claim made are gone

    out.mkdir(parents=True)
    (out / ".lock").write_text("999999999\n")  # left by a killed run: no process holds a flock on it
    with claim_out_dir(out, continuing=False, overwrite=False):
        assert (out / ".lock").read_text() == f"{os.getpid()}\n"


def test_out_dir_with_checkpoints_is_refused_unless_resumed_or_overwritten(tmp_path):
    save_checkpoint(small_state(1), tmp_path, 1, keep_last_k=2, is_best=True)
    before = tree_digest(tmp_path)
    with pytest.raises(CheckpointError) as error:
        claim_out_dir(tmp_path, continuing=False, overwrite=False)
    message = str(error.value)
    assert "already holds checkpoints (best.pt, ckpt-0000001.pt, ckpt.pt)" in message
    assert "--init_from=resume" in message and "--overwrite_out_dir=true" in message
    assert tree_digest(tmp_path) == before
    for continuing, overwrite in ((True, False), (False, True)):
        with claim_out_dir(tmp_path, continuing=continuing, overwrite=overwrite):
            pass


@pytest.mark.parametrize("where", ["under-a-file", "is-a-file", "disk-full"])
def test_out_dir_that_cannot_be_written_is_one_line(tmp_path, where):
    (tmp_path / "afile").write_text("a regular file\n")
    out = {"under-a-file": tmp_path / "afile" / "out", "is-a-file": tmp_path / "afile"}.get(where, tmp_path / "out")
    before = tree_digest(tmp_path)
    with contextlib.ExitStack() as stack:
        if where == "disk-full":
            stack.enter_context(file_size_limit(1))  # the probe's real write fails
        with pytest.raises(CheckpointError) as error:
            claim_out_dir(out, continuing=False, overwrite=False)
    expect = {"under-a-file": "afile is a file", "is-a-file": "is not a folder", "disk-full": "File too large [EFBIG]"}
    assert expect[where] in str(error.value) and str(out) in str(error.value)
    assert tree_digest(tmp_path) == before  # nothing left behind: no folder, no probe file, no lock


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
    message = str(error.value)
    assert "\n" not in message and str(evil) in message
    assert "holds pickled Python objects (posix.mkdir" in message and "refused" in message, message
    assert "weights_only" not in message  # torch's advice to load it unsafely is not passed on


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


UNREADABLE = [  # (damage, how the line begins)
    ("missing", "no checkpoint at {path}: {tmp} holds no checkpoints; train first"),
    ("empty", "{path} is not a readable checkpoint: it is empty (0 bytes"),
    ("random-bytes", "{path} is not a readable checkpoint: it is in no format torch.save writes"),
    ("zeros", "{path} is not a readable checkpoint: its first 4,096 bytes are all zeros"),
    ("truncated", "{path} is not a readable checkpoint: it is cut short"),
    ("not-a-checkpoint", "{path} is not a checkpoint of this repo (no model or model_config)"),
    ("text-file", "{path} is not a readable checkpoint: it is a text file (it begins 'this is not a checkpoint')"),
    ("pickle-bad-memo", "{path} is a plain Python pickle (pickle.dump), not a checkpoint saved by torch.save"),
]


@pytest.mark.parametrize("damage, cause", [pytest.param(*case, id=case[0]) for case in UNREADABLE])
def test_unreadable_checkpoint_is_one_line_error(trained_out, tmp_path, damage, cause):
    """Each line names what is wrong with the file (not torch's internals), and reading it changes nothing."""
    path = tmp_path / "ckpt.pt"
    if damage in DAMAGE:
        path.write_bytes(DAMAGE[damage])
    elif damage == "truncated":
        good = (trained_out / "ckpt.pt").read_bytes()
        path.write_bytes(good[: len(good) // 2])
    elif damage == "not-a-checkpoint":
        torch.save({"weights": torch.zeros(3)}, path)
    before = tree_digest(tmp_path)
    with pytest.raises(CheckpointError) as error:
        load_checkpoint(path)
    message = str(error.value)
    assert "\n" not in message and message.startswith(cause.format(path=path, tmp=tmp_path)), message
    assert "weights_only" not in message and "trusted source" not in message, message
    assert tree_digest(tmp_path) == before


def drop(key):
    return lambda state: state.pop(key)


def put(key, value):
    return lambda state: state.__setitem__(key, value)


def put_in(key, field, value):
    return lambda state: state[key].__setitem__(field, value)


SCHEMA = [  # (change to a good checkpoint, load for resume?, words in the message)
    pytest.param(drop("meta"), False, ("lacks meta",), id="no-meta"),
    pytest.param(
        put("model_config", [1, 2]), False, ("model_config is a list, expected dict",), id="model_config-list"
    ),
    pytest.param(
        put_in("model_config", "future_setting", 1), False, ("future_setting", "newer version"), id="newer-config"
    ),
    pytest.param(
        put_in("model_config", "n_head", 3), False, ("n_embd (32) must be divisible by n_head (3)",), id="bad-config"
    ),
    pytest.param(put_in("model", "lm_head.weight", [0.0]), False, ("not named tensors", "lm_head"), id="weight-list"),
    pytest.param(drop("model"), False, ("not a checkpoint of this repo",), id="no-model"),
    pytest.param(put_in("meta", "tokenizer", None), False, ("tokenizer is unknown",), id="meta-no-tokenizer"),
    pytest.param(drop("optimizer"), True, ("lacks optimizer", "needed to resume"), id="resume-no-optimizer"),
    pytest.param(put("iter_num", "12"), True, ("iter_num is a str, expected int",), id="resume-iter_num-str"),
    pytest.param(put("iter_num", True), True, ("iter_num is a bool",), id="resume-iter_num-bool"),
    pytest.param(put("rng", [{"data": 1}]), True, ("rng is not a list of each rank",), id="resume-bad-rng"),
    # in range: what a resume continues from
    pytest.param(put("iter_num", -5), True, ("iter_num is -5; it must be an int >= 0",), id="resume-iter_num-negative"),
    pytest.param(
        put("best_val_loss", math.nan), True, ("best_val_loss is nan; it must be a number >= 0",), id="resume-best-nan"
    ),
    pytest.param(put("best_val_loss", -math.inf), True, ("best_val_loss is -inf",), id="resume-best-minus-inf"),
    pytest.param(put_in("scaler", "scale", 0.0), True, ("scaler's scale is 0.0; it must be a finite",), id="scale-0"),
    pytest.param(put_in("scaler", "scale", math.nan), True, ("scaler's scale is nan",), id="scale-nan"),
    pytest.param(put_in("scaler", "backoff_factor", 1.5), True, ("backoff_factor is 1.5",), id="backoff-1.5"),
    pytest.param(put_in("scaler", "growth_interval", 0), True, ("growth_interval is 0",), id="growth_interval-0"),
    pytest.param(
        lambda state: next(iter(state["optimizer"]["state"].values())).update(step=torch.tensor(-3.0)),
        True,
        ("optimizer's step of parameter 0 is -3.0; it must be a finite number >= 0",),
        id="optimizer-step-negative",
    ),
]


@pytest.mark.parametrize("change, resume, expect", SCHEMA)
def test_checkpoint_schema_is_checked_at_load(trained_out, tmp_path, change, resume, expect):
    state = load_checkpoint(trained_out / "ckpt.pt", resume=True)
    change(state)
    path = tmp_path / "ckpt.pt"
    torch.save(state, path)
    with pytest.raises(CheckpointError) as error:
        load_checkpoint(path, resume=resume)
    message = str(error.value)
    assert "\n" not in message and message.startswith(str(path)), message
    for text in expect:
        assert text in message, message


@pytest.mark.parametrize("best_val_loss", [math.inf, 0.0, 2])
def test_a_resume_takes_every_best_val_loss_a_run_can_save(trained_out, tmp_path, best_val_loss):
    """inf: no evaluation yet; an int: a checkpoint of another program. A fine-tune reads no counters at all."""
    state = load_checkpoint(trained_out / "ckpt.pt", resume=True)
    state["best_val_loss"] = best_val_loss
    torch.save(state, tmp_path / "ckpt.pt")
    assert load_checkpoint(tmp_path / "ckpt.pt", resume=True)["best_val_loss"] == best_val_loss
    state["iter_num"] = -1
    torch.save(state, tmp_path / "ckpt.pt")
    assert load_checkpoint(tmp_path / "ckpt.pt")["iter_num"] == -1


def test_fine_tune_needs_no_optimizer_state(trained_out, tmp_path):
    state = load_checkpoint(trained_out / "ckpt.pt", resume=True)
    for key in ("optimizer", "scaler", "rng"):
        del state[key]
    torch.save(state, tmp_path / "weights.pt")
    assert load_checkpoint(tmp_path / "weights.pt")["iter_num"] == state["iter_num"]


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


def weights_cli(capsys, *argv: str) -> tuple[int, str, str]:
    """`python -m weights ARGV` in-process (weights/__main__.py's main): (exit code, stdout, stderr). A bad
    command line exits through argparse (SystemExit), which counts as the code it exits with."""
    try:
        code = weights_main(list(argv))
    except SystemExit as exit:
        code = exit.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_export_cli(trained_out, tmp_path, warm_interpreter):
    """`python -m weights safetensors OUT_DIR FILE`, a process of its own (forked from the warm interpreter): an
    out_dir means its ckpt.pt."""
    from safetensors.torch import load_file

    out = tmp_path / "model.safetensors"
    result = run_script("-m", ["weights", "safetensors", str(trained_out), str(out)], timeout=60, warm=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"wrote {out}\n" and "Traceback" not in result.stderr, result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]  # no temporary file left
    weights, state = load_file(out), load_checkpoint(trained_out / "ckpt.pt")
    assert set(weights) == set(state["model"]) - {"lm_head.weight"}
    assert all(torch.equal(tensor, state["model"][name]) for name, tensor in weights.items())


@pytest.mark.parametrize(
    "argv, message",
    [
        ([], "the following arguments are required: command"),
        (["safetensors"], "the following arguments are required: checkpoint, out"),
        (["import", "a.pt", "b.safetensors"], "invalid choice: 'import'"),
        (["safetensors", "NO.pt", "x"], "no checkpoint at {tmp}/NO.pt"),
        (["safetensors", "{ckpt}", "{ckpt}"], "refusing to write over {ckpt}, which this command reads"),
        (["safetensors", "{ckpt}", "{folder}/../out/ckpt.pt"], "refusing to write over {ckpt}, which this command"),
        (["safetensors", "{ckpt}", "{folder}/best.pt"], "refusing to replace {folder}/best.pt, a checkpoint a run"),
        (["safetensors", "{ckpt}", "{folder}/best.pt", "--overwrite"], "export over the checkpoint {folder}/best.pt"),
        (["safetensors", "{ckpt}", "{folder}/no/such/folder/model.safetensors"], "folder {folder}/no/such/folder"),
        (["merge", "{ckpt}", "{folder}/merged.pt"], "{ckpt} holds no LoRA adapters; it is a plain checkpoint"),
    ],
    ids=[
        "no-args",
        "missing-paths",
        "unknown-command",
        "missing-checkpoint",
        "onto-its-input",
        "onto-its-input-by-another-path",
        "onto-a-checkpoint",
        "onto-a-checkpoint-name",
        "missing-folder",
        "merge-a-plain-checkpoint",
    ],
)
def test_export_cli_bad_input(trained_out, tmp_path, capsys, argv, message):
    out = tmp_path / "out"
    shutil.copytree(trained_out, out)
    values = {"ckpt": out / "ckpt.pt", "folder": out, "tmp": tmp_path}
    argv = [a.format(**values) if "{" in a else str(tmp_path / a) if a.endswith(("pt", "x")) else a for a in argv]
    before = tree_digest(tmp_path)
    code, stdout, err = weights_cli(capsys, *argv)
    assert code == 2 and stdout == "", err
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and message.format(**values) in err, err
    assert tree_digest(tmp_path) == before  # the checkpoint is intact, and nothing was written


# ---- what stands where an out_dir should be ----


@pytest.mark.parametrize("kind", ["dangling", "loop", "dangling-parent"])
def test_an_out_dir_that_is_a_broken_link_says_where_it_points(tmp_path, kind):
    link = tmp_path / "out"
    link.symlink_to("out" if kind == "loop" else tmp_path / "moved" / "out")
    out = link / "run" if kind == "dangling-parent" else link
    with pytest.raises(CheckpointError) as error:
        claim_out_dir(out, continuing=False, overwrite=False)
    message = str(error.value)
    assert "EEXIST" not in message and "\n" not in message, message
    if kind == "loop":
        assert f"{link} is a symbolic link loop" in message, message
    else:
        assert f"{link} is a symbolic link to {tmp_path / 'moved' / 'out'}, which does not exist" in message, message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_folder_created_by_another_run_at_the_same_moment_is_no_error(tmp_path, monkeypatch):
    """The other run's mkdir lands between our look and our mkdir: ours then finds it there, and goes on."""
    out = tmp_path / "new" / "out"
    real_mkdir = Path.mkdir

    def mkdir_after_another_run(self, *args, **kwargs):
        if self == out:
            real_mkdir(self, *args, **kwargs)  # the other run's
        return real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", mkdir_after_another_run)
    with claim_out_dir(out, continuing=False, overwrite=False):
        assert (out / ".lock").read_text() == f"{os.getpid()}\n"
    assert out.is_dir()  # made by the other run: not ours to remove


def claim_and_report(out: Path, barrier, results, done) -> None:
    """A run's start in a child process: claim out_dir together with the others, report, hold until done."""
    barrier.wait()
    try:
        with claim_out_dir(out, continuing=False, overwrite=False):
            results.put((os.getpid(), "held"))
            done.wait(30)
    except CheckpointError as error:
        results.put((os.getpid(), str(error)))


def test_runs_racing_for_a_new_out_dir_one_wins_the_others_name_it(tmp_path):
    """Four processes start at once on a folder that does not exist yet: one holds it, and each of the others
    says that run holds it, by its pid; none says EEXIST or pid unknown."""
    context = multiprocessing.get_context("fork")
    barrier, results, done = context.Barrier(4), context.Queue(), context.Event()
    out = tmp_path / "new" / "out"
    children = [context.Process(target=claim_and_report, args=(out, barrier, results, done)) for _ in range(4)]
    for child in children:
        child.start()
    try:
        reports = [results.get(timeout=60) for _ in children]
    finally:
        done.set()
        for child in children:
            child.join(30)
    winners = [pid for pid, report in reports if report == "held"]
    assert len(winners) == 1, reports
    for _, report in reports:
        assert report == "held" or f"in use by another run (pid {winners[0]}," in report, report


def test_a_lock_holder_that_has_not_written_its_pid_yet_is_named(tmp_path):
    """The kernel's list of locks names the holder when the lock file does not (yet)."""
    import fcntl

    out = tmp_path / "out"
    out.mkdir()
    fd = os.open(out / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(CheckpointError, match=f"in use by another run \\(pid {os.getpid()},"):
            claim_out_dir(out, continuing=False, overwrite=False)
    finally:
        os.close(fd)


# ---- where an export may write, and what it may export ----


@pytest.mark.parametrize("command", ["safetensors", "hf"])
def test_an_export_into_a_training_runs_out_dir_is_refused_until_it_ends(trained_out, tmp_path, capsys, command):
    """While a run holds its out_dir, nothing is written there, --overwrite or not; once it ends, the export is."""
    run = tmp_path / "run"
    shutil.copytree(trained_out, run)
    target = run / "best.safetensors" if command == "safetensors" else run
    with claim_out_dir(run, continuing=True, overwrite=False):
        before = tree_digest(run)
        code, out, err = weights_cli(capsys, command, str(run / "best.pt"), str(target), "--overwrite")
        assert code == 2 and out == "" and err.count("\n") == 1, err
        assert f"is the out_dir of a run training now (pid {os.getpid()})" in err, err
        assert tree_digest(run) == before
    code, out, err = weights_cli(capsys, command, str(run / "best.pt"), str(target))
    assert code == 0 and out.startswith(f"wrote {target}"), err


@pytest.mark.parametrize("command", ["safetensors", "hf"])
def test_an_export_of_non_finite_weights_is_refused_naming_the_tensor(trained_out, tmp_path, capsys, command):
    state = torch.load(trained_out / "ckpt.pt", weights_only=True)
    state["model"]["transformer.h.1.mlp.c_fc.weight"][3, 4] = float("nan")
    torch.save(state, tmp_path / "nan.pt")
    target = tmp_path / ("export.safetensors" if command == "safetensors" else "hf")
    code, out, err = weights_cli(capsys, command, str(tmp_path / "nan.pt"), str(target))
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert f"{tmp_path / 'nan.pt'} has non-finite weights (NaN or inf in transformer.h.1.mlp.c_fc.weight)" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["nan.pt"]
