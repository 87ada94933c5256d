"""Bad input of reliability round 3 (issue 28): every loader names what is actually wrong with what it was given,
in one `error:` line with exit code 2, and writes nothing and leaves nothing behind.

- a dataset whose meta.json caches a false largest token id (data/common.py open_split, data/loader.py Batches);
- a disk slightly too small for the first save (training/preflight.py first_save_size);
- an out_dir whose ckpt.pt is gone beside numbered checkpoints (storage/checkpoint.py missing_checkpoint);
- files and folders of the wrong kind given where a checkpoint is read (storage/checkpoint.py read_torch_file,
  weights/load.py, weights/hf.py), through each entry point that reads one;
- an export that fails while writing (weights/hf.py export_hf, storage/checkpoint.py write_safetensors).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import shutil
import warnings
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

import sample
import train
from data import common
from data.common import open_split, write_dataset
from errors import CheckpointError
from helpers import file_size_limit, run_script, tiny_args, tree_digest
from storage import checkpoint
from weights.__main__ import main as weights_main
from weights.hf import export_hf, load_weights
from weights.load import export_safetensors, load_checkpoint
from weights.lora import weights_digest

pytestmark = pytest.mark.usefixtures("one_thread")


def redirected(out, err):
    stack = contextlib.ExitStack()
    stack.enter_context(contextlib.redirect_stdout(out))
    stack.enter_context(contextlib.redirect_stderr(err))
    return stack


def run_quietly(main, argv: list[str]) -> tuple[int, str, str, list]:
    """main(argv) in-process: (exit code, stdout, stderr, the warnings it raised). Warnings are recorded, not
    printed; under pytest they would never reach stderr, so they are counted here instead."""
    out, err = io.StringIO(), io.StringIO()
    with warnings.catch_warnings(record=True) as raised, redirected(out, err):
        warnings.simplefilter("always")
        try:
            code = main(argv)
        except SystemExit as stop:
            code = stop.code
    return code, out.getvalue(), err.getvalue(), raised


def the_error_line(code: int, err: str, raised: list) -> str:
    """The one line a refused command prints: exit code 2, `error: ...`, no traceback, no warning before it."""
    lines = [line for line in err.splitlines() if not line.startswith("INFO: ")]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (code, err)
    assert "Traceback" not in err and not raised, (err, [str(w.message) for w in raised])
    return lines[0]


# ----------------------------------------------------------------------------------------------
# 1. meta.json's cached largest token id is never trusted into an IndexError


VOCAB = 20
ITOS = [chr(ord("a") + i) for i in range(VOCAB)]


def big_dataset(folder: Path, tokens: int = 4_000_000) -> dict:
    """A char dataset of `tokens` train tokens, ids below VOCAB; returns what write_dataset wrote to meta.json."""
    ids = np.arange(tokens) % VOCAB
    return write_dataset(folder, ids, ids[:1000], {"tokenizer": "char", "vocab_size": VOCAB, "itos": ITOS})


def put_ids_beyond_the_vocabulary(folder: Path, where: slice, value: int = 25) -> None:
    """Ids >= VOCAB into train.bin in place (same size, same token count), as an edit after prepare would."""
    ids = np.fromfile(folder / "train.bin", dtype=np.uint16)
    ids[where] = value
    ids.tofile(folder / "train.bin")


def meta_rewritten_after(folder: Path, meta: dict) -> None:
    """meta.json written again after the bin changed, its cached train_max_id unchanged (a script that edits
    another field of it): meta.json is now newer than the bin it no longer describes."""
    (folder / "meta.json").write_text(json.dumps(meta))
    later = (folder / "train.bin").stat().st_mtime_ns + 10**9
    os.utime(folder / "meta.json", ns=(later, later))


def bin_dated_back(folder: Path, meta: dict) -> None:
    """The changed bin's mtime set before meta.json's (a copy that keeps mtimes, a restore from a backup)."""
    earlier = (folder / "meta.json").stat().st_mtime_ns - 10**9
    os.utime(folder / "train.bin", ns=(earlier, earlier))


def meta_hand_edited(folder: Path, meta: dict) -> None:
    """A smaller vocabulary written into meta.json by hand, with a train_max_id to match: false for the bin."""
    ids = np.arange(4_000_000) % (VOCAB + 10)  # ids up to 29 in a bin that meta.json will say ends at 19
    ids.astype("<u2").tofile(folder / "train.bin")
    (folder / "meta.json").write_text(json.dumps(meta))
    bin_dated_back(folder, meta)


FALSE_CACHES = [
    pytest.param(meta_rewritten_after, id="meta-rewritten-after-the-bin"),
    pytest.param(bin_dated_back, id="bin-dated-back"),
    pytest.param(meta_hand_edited, id="meta-hand-edited"),
]


@pytest.mark.parametrize("make_false", FALSE_CACHES)
def test_a_false_cached_max_id_is_one_error_line_before_training(tmp_path, make_false):
    """Ids >= vocab_size near the end of a 4M-token train.bin, and a meta.json whose train_max_id says there are
    none: refused at start-up, naming the file and the command that rebuilds it; nothing written."""
    data = tmp_path / "data"
    meta = big_dataset(data)
    put_ids_beyond_the_vocabulary(data, slice(-1000, None))  # near the end: no eval batch need draw them
    make_false(data, meta)
    assert json.loads((data / "meta.json").read_text())["train_max_id"] == VOCAB - 1  # the cache is false
    before = tree_digest(tmp_path)

    code, _, err, raised = run_quietly(train.main, tiny_args(data, tmp_path / "out", "--max_iters=2"))

    line = the_error_line(code, err, raised)
    assert f"{data / 'train.bin'} holds token id" in line and f">= vocab_size {VOCAB}" in line, line
    assert f"python -m data.<dataset>.prepare --out_dir {data}" in line, line
    assert tree_digest(tmp_path) == before and not (tmp_path / "out").exists()


def test_a_false_cache_that_is_trusted_is_caught_in_the_first_batch_that_draws_a_bad_id(tmp_path, monkeypatch):
    """A bin big enough that its cached max id is trusted (here: every bin, SCAN_ALWAYS_TOKENS=0) while meta.json
    vouches for it: every batch drawn is checked, so the bad id is one error line, not an IndexError."""
    monkeypatch.setattr(common, "SCAN_ALWAYS_TOKENS", 0, raising=False)
    data = tmp_path / "data"
    meta = big_dataset(data, tokens=200_000)
    put_ids_beyond_the_vocabulary(data, slice(None, None, 7))  # every 7th token: the first eval batch has one
    bin_dated_back(data, meta)
    assert len(open_split(data, "train", block_size=16)) == 200_000  # the cache was trusted at start-up

    code, _, err, raised = run_quietly(train.main, tiny_args(data, tmp_path / "out", "--max_iters=2"))

    line = the_error_line(code, err, raised)
    assert f"{data / 'train.bin'} holds token id 25 (at token " in line and f">= vocab_size {VOCAB}" in line, line
    assert f"rerun: python -m data.<dataset>.prepare --out_dir {data}" in line, line
    assert not (tmp_path / "out").exists()  # the run had claimed it: released and removed, as it held nothing


def test_a_cached_max_id_that_would_refuse_the_bin_is_checked_first(tmp_path, monkeypatch):
    """A trusted cache that is false the other way (train_max_id beyond the vocabulary, the bin fine) does not
    refuse a good dataset: the bin is scanned before it is refused."""
    monkeypatch.setattr(common, "SCAN_ALWAYS_TOKENS", 0, raising=False)
    data = tmp_path / "data"
    meta = big_dataset(data, tokens=100_000)
    (data / "meta.json").write_text(json.dumps({**meta, "train_max_id": VOCAB + 5}))
    bin_dated_back(data, meta)
    assert len(open_split(data, "train", block_size=16)) == 100_000


# ----------------------------------------------------------------------------------------------
# 2. the start-up free-space check counts what a save really writes


def test_a_disk_slightly_too_small_for_the_first_save_is_refused(char_data, trained_out, tmp_path, monkeypatch):
    """The first save writes ckpt-<iter>.pt, best.pt and ckpt.pt, each with its weights, AdamW's moments and
    tens of KB of per-file overhead (RNG states, config, each tensor's zip entry). A disk one byte short of that
    is refused before training; one with a quarter more room than that is not (the estimate is not wild)."""
    one_file = (trained_out / "ckpt.pt").stat().st_size  # the same model: about the size this run will save
    monkeypatch.setattr(checkpoint, "free_bytes", lambda folder: int(1.25 * 3 * one_file))
    roomy = tmp_path / "roomy"
    code, _, err, _ = run_quietly(train.main, tiny_args(char_data, roomy, "--max_iters=1", "--eval_interval=1"))
    assert code == 0, err
    need = 3 * (roomy / "ckpt-0000001.pt").stat().st_size  # the bytes alone: on disk, whole blocks need more

    monkeypatch.setattr(checkpoint, "free_bytes", lambda folder: need - 1)
    out = tmp_path / "out"
    code, _, err, raised = run_quietly(train.main, tiny_args(char_data, out, "--max_iters=1", "--eval_interval=1"))

    line = the_error_line(code, err, raised)
    assert f"out_dir {out} has {checkpoint.format_bytes(need - 1)} free; the first save needs about" in line, line
    assert "free some space or choose another --out_dir" in line, line
    assert not out.exists()


# ----------------------------------------------------------------------------------------------
# 3. ckpt.pt deleted beside numbered checkpoints: the line names the newest save and the command


@pytest.fixture
def latest_deleted(trained_out, tmp_path) -> Path:
    """A copy of trained_out (ckpt-0000002.pt, ckpt-0000004.pt, best.pt) without its ckpt.pt."""
    out = tmp_path / "out"
    shutil.copytree(trained_out, out)  # copy2: the mtimes, so the save order, stay
    (out / "ckpt.pt").unlink()
    return out


ENTRY_POINTS_OF_AN_OUT_DIR = [
    pytest.param(train.main, ["--init_from=resume"], id="train-resume"),
    pytest.param(train.main, ["--init_from=auto"], id="train-auto"),
    pytest.param(train.main, [], id="train-scratch"),
    pytest.param(train.main, ["--init_from={out}"], id="train-finetune-from-the-out_dir"),
    pytest.param(sample.main, ["--out_dir={out}", "--device=cpu"], id="sample"),
    pytest.param(weights_main, ["safetensors", "{out}", "{tmp}/model.safetensors"], id="weights-safetensors"),
    pytest.param(weights_main, ["hf", "{out}", "{tmp}/hf"], id="weights-hf"),
]


@pytest.mark.parametrize("main, args", ENTRY_POINTS_OF_AN_OUT_DIR)
def test_a_deleted_ckpt_pt_is_named_with_the_newest_save_and_the_command(char_data, latest_deleted, main, args):
    """No circle between "train first" and "use --init_from=resume": each entry point names the newest numbered
    checkpoint and the cp that makes it the latest again; nothing is written, and the advice works."""
    out, tmp = latest_deleted, latest_deleted.parent
    argv = [arg.format(out=out, tmp=tmp) for arg in args]
    if main is train.main:
        argv = tiny_args(char_data, out, "--max_iters=5", *argv)
    before = tree_digest(tmp)

    code, _, err, raised = run_quietly(main, argv)

    line = the_error_line(code, err, raised)
    assert "ckpt-0000004.pt" in line and f"cp {out / 'ckpt-0000004.pt'} {out / 'ckpt.pt'}" in line, line
    assert "train first" not in line, line
    assert tree_digest(tmp) == before


def test_the_command_named_for_a_deleted_ckpt_pt_resumes_the_run(char_data, latest_deleted):
    code, _, err, raised = run_quietly(train.main, tiny_args(char_data, latest_deleted, "--init_from=resume"))
    command = the_error_line(code, err, raised).rsplit(": ", 1)[1]
    assert command == f"cp {latest_deleted / 'ckpt-0000004.pt'} {latest_deleted / 'ckpt.pt'}", command
    source, target = command.split()[1:]
    shutil.copy(source, target)  # the advice, followed
    argv = tiny_args(char_data, latest_deleted, "--max_iters=5", "--eval_interval=5", "--init_from=resume")
    code, stdout, err, _ = run_quietly(train.main, argv)
    assert code == 0 and "resuming at iter 4" in stdout and "saved" in stdout, err


def test_the_newest_save_is_the_last_one_written_not_the_highest_iteration(latest_deleted):
    """As rotation counts them: a run resumed from an older checkpoint saves lower iterations again."""
    later = (latest_deleted / "ckpt-0000004.pt").stat().st_mtime_ns + 10**9
    os.utime(latest_deleted / "ckpt-0000002.pt", ns=(later, later))
    with pytest.raises(CheckpointError, match=r"holds ckpt-0000002\.pt, its newest save \(iter 2\)"):
        load_checkpoint(latest_deleted / "ckpt.pt", resume=True)


# ----------------------------------------------------------------------------------------------
# 4 and 5. files and folders of the wrong kind, where a checkpoint is read


class Thing:
    """Any class: a pickle of it names it."""


def missing(tmp, good):
    return tmp / "missing.pt"


def folder(tmp, good):
    (tmp / "folder").mkdir()
    (tmp / "folder" / "notes.txt").write_text("not a checkpoint\n")
    return tmp / "folder"


def empty_file(tmp, good):
    (tmp / "empty.pt").write_bytes(b"")
    return tmp / "empty.pt"


def truncated(tmp, good):
    data = good.read_bytes()
    (tmp / "cut.pt").write_bytes(data[: len(data) // 3])
    return tmp / "cut.pt"


def text_file(tmp, good):
    (tmp / "notes.pt").write_text("step 1: train\nstep 2: sample\n")
    return tmp / "notes.pt"


def zip_archive(tmp, good):
    with zipfile.ZipFile(tmp / "bundle.pt", "w") as archive:
        archive.writestr("README.txt", "a zip, but not one torch.save wrote\n")
    return tmp / "bundle.pt"


def safetensors_file(tmp, good):
    return export_safetensors(good, tmp / "model.safetensors")


def raw_pickle(tmp, good):
    with open(tmp / "raw.pt", "wb") as f:
        pickle.dump({"model": {"w": [0.0]}, "note": Thing()}, f)  # protocol 4+: torch warns about it
    return tmp / "raw.pt"


def torch_pickled_object(tmp, good):
    torch.save({"model": Thing(), "model_config": {}}, tmp / "object.pt")
    return tmp / "object.pt"


def nanogpt_without_meta(tmp, good):
    """nanoGPT's format (model_args, model) of a char model, with no meta.pkl anywhere to say its characters."""
    state = torch.load(good, weights_only=True)
    args = {key: state["model_config"][key] for key in ("n_layer", "n_head", "n_embd", "block_size", "bias")}
    args["vocab_size"] = state["model_config"]["vocab_size"]
    torch.save({"model": state["model"], "model_args": args, "config": {"dataset": "no_such_dataset"}}, tmp / "ng.pt")
    return tmp / "ng.pt"


def hf_folder_without_weights(tmp, good):
    (tmp / "hf-model").mkdir()
    (tmp / "hf-model" / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2}))
    return tmp / "hf-model"


def hf_folder(tmp, good):
    return export_hf(good, tmp / "hf-model")


def adapter_checkpoint(tmp, good):
    """A LoRA run's checkpoint: adapters (here zeros) and the base they go on."""
    state = torch.load(good, weights_only=True)
    base = state["model"]
    state["model"] = {
        "transformer.h.0.attn.c_attn.lora_A": torch.zeros(2, base["transformer.h.0.attn.c_attn.weight"].shape[1]),
        "transformer.h.0.attn.c_attn.lora_B": torch.zeros(base["transformer.h.0.attn.c_attn.weight"].shape[0], 2),
    }
    digest = weights_digest(base)
    shutil.copy(good, tmp / "base.pt")
    state["lora"] = {"rank": 2, "alpha": 16.0, "targets": "transformer.h.0.attn.c_attn", "dropout": 0.0}
    state["lora"] |= {"base": str(tmp / "base.pt"), "base_sha256": digest}
    torch.save(state, tmp / "adapters.pt")
    return tmp / "adapters.pt"


# Where a checkpoint is read: (name, main or None for load_checkpoint, argv with {src} and {tmp})
READERS = {
    "load_checkpoint": (None, []),
    "train-init_from": (train.main, ["--init_from={src}"]),
    "sample-init_from": (sample.main, ["--init_from={src}", "--device=cpu", "--max_new_tokens=2"]),
    "weights-hf": (weights_main, ["hf", "{src}", "{tmp}/exported-hf"]),
    "weights-safetensors": (weights_main, ["safetensors", "{src}", "{tmp}/exported.safetensors"]),
    "weights-merge": (weights_main, ["merge", "{src}", "{tmp}/merged.pt"]),
}
EVERY = tuple(READERS)
NEEDS_OUR_PT = ("load_checkpoint", "weights-hf", "weights-safetensors", "weights-merge")

# (case, make it, the readers that must refuse it, what the line must say)
BAD_SOURCES = [
    ("missing", missing, EVERY, ("missing.pt", "no such file")),
    ("folder", folder, EVERY, ("folder", "holds no")),
    ("empty-file", empty_file, EVERY, ("empty.pt is not a readable checkpoint: it is empty (0 bytes",)),
    ("truncated", truncated, EVERY, ("cut.pt is not a readable checkpoint: it is cut short",)),
    ("text-file", text_file, EVERY, ("notes.pt is not a readable checkpoint: it is a text file", "'step 1: train'")),
    ("zip-archive", zip_archive, EVERY, ("bundle.pt is not a readable checkpoint: it is a zip archive, but not",)),
    ("safetensors", safetensors_file, EVERY, ("model.safetensors is a safetensors file", "not a .pt checkpoint")),
    ("raw-pickle", raw_pickle, EVERY, ("raw.pt is a plain Python pickle (pickle.dump)", "refused unread")),
    ("torch-pickled-object", torch_pickled_object, EVERY, ("holds pickled Python objects (test_bad_inputs.Thing)",)),
    ("nanogpt-without-meta", nanogpt_without_meta, EVERY, ("ng.pt: a nanoGPT checkpoint of vocab_size", "meta.pkl")),
    ("hf-without-weights", hf_folder_without_weights, EVERY, ("hf-model", "config.json but no weights")),
    ("hf-folder-for-a-pt", hf_folder, NEEDS_OUR_PT, ("hf-model is a Hugging Face GPT-2 folder", "--init_from=")),
    (
        "adapters-for-a-plain-checkpoint",
        adapter_checkpoint,
        ("weights-hf", "weights-safetensors"),
        ("adapters.pt is a LoRA adapter checkpoint", "python -m weights merge {tmp}/adapters.pt"),
    ),
]
CASES = [
    pytest.param(make, reader, expect, id=f"{name}-{reader}")
    for name, make, readers, expect in BAD_SOURCES
    for reader in readers
]


@pytest.mark.parametrize("make, reader, expect", CASES)
def test_a_source_of_the_wrong_kind_is_named_for_what_it_is(char_data, trained_out, tmp_path, make, reader, expect):
    """Each loader names the real cause (missing, a folder, empty, cut short, text, another format, a pickle, a
    checkpoint of another kind and the command for it), in one line with no warning before it, and writes
    nothing: no export, no merged file, no out_dir, not even an empty folder."""
    src = make(tmp_path, trained_out / "ckpt.pt")
    expect = [text.format(tmp=tmp_path) for text in expect]
    main, args = READERS[reader]
    before = tree_digest(tmp_path)

    if main is None:
        with warnings.catch_warnings(record=True) as raised, pytest.raises(CheckpointError) as error:
            warnings.simplefilter("always")
            load_checkpoint(src)
        line = f"error: {error.value}"
        assert "\n" not in line and not raised, (line, [str(w.message) for w in raised])
    else:
        argv = [arg.format(src=src, tmp=tmp_path) for arg in args]
        if main is train.main:
            argv = tiny_args(char_data, tmp_path / "train-out", "--max_iters=1", *argv)
        code, stdout, err, raised = run_quietly(main, argv)
        line = the_error_line(code, err, raised)
        assert stdout == "" or main is train.main, stdout

    for text in expect:
        assert text in line, f"{text!r} not in {line!r}"
    assert "weights_only" not in line and "Unsupported operand" not in line, line
    assert tree_digest(tmp_path) == before  # nothing written, nothing left behind


def test_a_hub_name_typo_and_a_missing_path_say_different_things(char_data, tmp_path):
    """init_from takes settings, paths and hub names: a missing path says it is missing; a word is not a path."""
    with pytest.raises(CheckpointError) as error:
        load_weights(tmp_path / "runs" / "ckpt-0000100.pt", also=("scratch", "resume", "auto"))
    assert f"no such file or folder {tmp_path / 'runs' / 'ckpt-0000100.pt'}" in str(error.value)
    with pytest.raises(CheckpointError) as error:
        load_weights("gpt-2", also=("scratch", "resume", "auto"))
    assert str(error.value).startswith("init_from='gpt-2': allowed are scratch, resume, auto, or a .pt checkpoint")
    assert "gpt2-medium" in str(error.value) and "no such file" not in str(error.value)


def test_a_nanogpt_checkpoint_is_not_resumed_but_named(trained_out, tmp_path):
    """Resuming needs our run state; a nanoGPT checkpoint (with its meta.pkl) says so and how to fine-tune."""
    path = nanogpt_without_meta(tmp_path, trained_out / "ckpt.pt")
    meta = load_checkpoint(trained_out / "ckpt.pt")["meta"]
    with open(tmp_path / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": meta["vocab_size"], "itos": dict(enumerate(meta["itos"])), "stoi": {}}, f)
    assert load_checkpoint(path)["source"] == "nanoGPT"  # its weights load
    with pytest.raises(CheckpointError, match=r"ng\.pt is a nanoGPT checkpoint: .* --init_from="):
        load_checkpoint(path, resume=True)


def test_the_weights_cli_on_a_raw_pickle_prints_one_line_and_no_torch_warning(tmp_path):
    """`python -m weights`, as a user runs it (forked from the warm interpreter): stderr holds the error line and
    nothing else."""
    src = raw_pickle(tmp_path, None)
    args = ["weights", "safetensors", str(src), str(tmp_path / "out.safetensors")]
    result = run_script("-m", args, warm=True)
    assert result.returncode == 2 and result.stdout == "", result
    line = f"error: {src} is a plain Python pickle (pickle.dump), not a checkpoint saved by torch.save; refused unread"
    assert result.stderr.splitlines() == [f"{line}: unpickling it could run arbitrary code"], result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["raw.pt"]


def test_an_export_that_fails_while_writing_leaves_no_folder_behind(trained_out, tmp_path):
    """`python -m weights hf` creates its output folder; a write that fails there (a full disk: here a file size
    limit) takes the folder and what was written into it away again. A folder that was there stays."""
    out = tmp_path / "exports" / "hf"
    with file_size_limit(4096), pytest.raises(CheckpointError, match=r"cannot write .*model\.safetensors"):
        export_hf(trained_out / "ckpt.pt", out)
    assert sorted(tmp_path.iterdir()) == []
    out.mkdir(parents=True)
    with file_size_limit(4096), pytest.raises(CheckpointError):
        export_hf(trained_out / "ckpt.pt", out)
    assert out.is_dir() and sorted(out.iterdir()) == []


def test_a_safetensors_export_that_fails_while_writing_is_one_line_and_leaves_nothing(trained_out, tmp_path):
    """safetensors' own writer reports a full disk as a SafetensorError, not an OSError: still one line."""
    out = tmp_path / "model.safetensors"
    with file_size_limit(4096):
        code, stdout, err, raised = run_quietly(weights_main, ["safetensors", str(trained_out / "ckpt.pt"), str(out)])
    line = the_error_line(code, err, raised)
    assert line == f"error: cannot write {out}: File too large (os error 27)", line
    assert sorted(tmp_path.iterdir()) == []  # neither the file nor its temporary
