"""Tests of a dataset's files as a run and a prepare meet them (data/files.py and its users): a run holds what
it opened and says in one line when the folder changes under it; untrusted sizes and file types are checked
before any memory is spent or any read waits; a prepare refuses output no run can use; no network is needed."""

import os
import pickle
import shutil
import socket
import threading
import tracemalloc
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import train
from data import common, loader
from data.common import prepare_text, read_meta, write_dataset
from data.loader import Batches
from errors import DataChanged, DataError
from helpers import tiny_args, tiny_text

pytestmark = pytest.mark.usefixtures("one_thread")

ITOS = [chr(ord("a") + i) for i in range(20)]


@pytest.fixture
def folder(tmp_path) -> Path:
    """A char dataset of 2,000 train and 500 val tokens, ids 0..19."""
    out = tmp_path / "ds"
    write_dataset(out, np.arange(2000) % 20, np.arange(500) % 20, {"tokenizer": "char", "vocab_size": 20, "itos": ITOS})
    return out


def batches_of(folder: Path) -> Batches:
    return Batches(folder, batch_size=4, block_size=16, device=torch.device("cpu"), seed=1, vocab_size=20)


def prepare_again(folder: Path) -> None:
    """What `python -m data.<name>.prepare --out_dir FOLDER` does to a folder: new files renamed over the old."""
    write_dataset(folder, (np.arange(3000) * 7) % 20, np.arange(600) % 20, read_meta(folder))


# ---- A. a run holds what it opened ----


def test_a_prepare_into_the_folder_leaves_the_run_its_data_and_the_next_check_names_it(folder):
    batches = batches_of(folder)
    before = batches.get("val", torch.Generator().manual_seed(0))
    batches.check_unchanged()  # nothing changed yet
    prepare_again(folder)
    after = batches.get("val", torch.Generator().manual_seed(0))
    assert all(torch.equal(a, b) for a, b in zip(before, after))  # the files it opened, unchanged
    with pytest.raises(DataChanged, match=r"train\.bin was replaced by another file .* since this run opened it"):
        batches.check_unchanged()


@pytest.mark.parametrize("change", ["rewritten", "truncated"])
def test_a_write_into_a_held_file_refuses_the_batch_and_takes_back_its_draw(folder, change):
    """`cp other.bin train.bin` writes into the file the run holds: the batch read after it is refused, never
    trained on (it may mix old and new bytes), and the stream is as before that draw, for the checkpoint."""
    batches = batches_of(folder)
    batches.get("train")
    state, pending = batches.state_before_last.clone(), list(batches.pending)
    with open(folder / "train.bin", "r+b") as f:
        if change == "rewritten":
            f.write(np.full(2000, 3, dtype="<u2").tobytes())
            os.utime(f.fileno(), ns=(1, 1))  # a write within one clock tick of prepare's would not show
        else:
            f.truncate(10)  # below block_size+1 tokens: was a RuntimeError traceback
    with pytest.raises(DataChanged, match=r"train\.bin was rewritten in place"):
        batches.get("train")
    assert torch.equal(batches.state_before_last, state) and batches.pending == pending


def test_a_changed_meta_json_is_named_at_the_next_check(folder):
    batches = batches_of(folder)
    (folder / "meta.json").write_text((folder / "meta.json").read_text().replace('"ds"', '"other"'))
    with pytest.raises(DataChanged, match=r"meta\.json was"):
        batches.check_unchanged()


@pytest.mark.parametrize("change", ["prepare into the folder", "write in place"])
def test_a_run_whose_data_changes_stops_with_one_line_and_saves_what_it_trained(char_data, tmp_path, capsys, change):
    data, out = tmp_path / "data", tmp_path / "out"
    shutil.copytree(char_data, data)
    real_step = train.train_step

    def step_then_change(state):
        step = real_step(state)
        if state.iter_num == 3:
            if change == "prepare into the folder":
                prepare_text(tiny_text(300), data, "char")
            else:
                with open(data / "train.bin", "r+b") as f:
                    f.write(b"\0\0" * 64)
                os.utime(data / "train.bin", ns=(1, 1))
        return step

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(train, "train_step", step_then_change)
        code = train.main(tiny_args(data, out, "--max_iters=20", "--eval_interval=4"))
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    stopped_at = 4 if change == "prepare into the folder" else 3  # the next evaluation; the next batch
    what = "replaced by another file" if change == "prepare into the folder" else "rewritten in place"
    assert err.splitlines()[-1].startswith(f"error: {data / 'train.bin'} was {what}"), err
    assert err.splitlines()[-1].endswith(f"; saved {out / 'ckpt.pt'} at iter {stopped_at}; exiting"), err
    assert torch.load(out / "ckpt.pt", weights_only=False)["iter_num"] == stopped_at


# ---- B. untrusted sizes and file types ----


def test_a_tiny_meta_pkl_claiming_a_huge_vocabulary_is_refused_before_any_memory_is_spent(tmp_path):
    (tmp_path / "meta.pkl").write_bytes(pickle.dumps({"vocab_size": 10**9, "itos": {}, "stoi": {}}))
    assert (tmp_path / "meta.pkl").stat().st_size < 100
    tracemalloc.start()
    try:
        with pytest.raises(DataError, match=r"vocab_size 1000000000 must be an int in \[1, 65536\]"):
            read_meta(tmp_path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 10 << 20  # was 4.2 GB (a list of every id up to vocab_size)


def test_oversized_or_deeply_nested_meta_files_are_one_line(tmp_path):
    (tmp_path / "meta.json").write_text("[" * 200_000 + "]" * 200_000)
    with pytest.raises(DataError, match="nested too deeply"):
        read_meta(tmp_path)
    (tmp_path / "meta.json").write_bytes(b" " * (17 << 20))
    with pytest.raises(DataError, match="more than any meta file holds"):
        read_meta(tmp_path)


@pytest.mark.parametrize("name", ["meta.json", "train.bin"])
def test_a_fifo_in_place_of_a_dataset_file_is_refused_at_once(folder, name):
    """Opening a FIFO for reading waits for a writer: train.py sat there with no output."""
    (folder / name).unlink()
    os.mkfifo(folder / name)
    outcome = []

    def start():
        try:
            batches_of(folder)
        except DataError as error:
            outcome.append(str(error))

    opener = threading.Thread(target=start, daemon=True)
    opener.start()
    opener.join(timeout=20)
    if opener.is_alive():  # unblock it: a writer opens the FIFO
        os.close(os.open(folder / name, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail(f"opening a dataset with {name} a FIFO waits for a writer")
    assert outcome and f"{name} is a FIFO (named pipe), not a regular file" in outcome[0], outcome


def test_no_network_is_one_line_at_once_for_the_command_and_for_train(tmp_path, monkeypatch):
    """A hub name that does not resolve is found before datasets retries for half a minute; a connection error
    from datasets (its ConnectionError, huggingface_hub's or httpx's) is one line; and the run that prepares a
    missing dataset says the same line (it was a ConnectionError traceback)."""
    pytest.importorskip("datasets")  # a requirement; a GPU image may run the suite without it
    from data import hf

    calls = []

    def unresolvable(host, *args, **kwargs):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.delenv("HTTPS_PROXY", raising=False)
    monkeypatch.delenv("https_proxy", raising=False)
    monkeypatch.delenv("ALL_PROXY", raising=False)
    monkeypatch.delenv("all_proxy", raising=False)
    monkeypatch.setattr(hf.huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hf.datasets, "load_dataset", lambda *args, **kwargs: calls.append(args))
    monkeypatch.setattr(hf.socket, "getaddrinfo", unresolvable)
    with pytest.raises(DataError, match=r"hub is unreachable \(huggingface.co: Name or service not known\)"):
        hf.load_text_dataset(None, "Skylion007/openwebtext", None, 1)
    assert calls == []

    monkeypatch.setattr(hf.socket, "getaddrinfo", lambda *args, **kwargs: [])
    for failure in (
        ConnectionError("Couldn't reach 'Skylion007/openwebtext' on the Hub (LocalEntryNotFoundError)"),
        hf.huggingface_hub.errors.OfflineModeIsEnabled("offline"),
        hf.httpx.ConnectError("[Errno 101] Network is unreachable"),
    ):

        def load_dataset(*args, failure=failure, **kwargs):
            raise failure

        monkeypatch.setattr(hf.datasets, "load_dataset", load_dataset)
        with pytest.raises(DataError) as error:
            hf.load_text_dataset(None, "Skylion007/openwebtext", None, 1)
        assert str(error.value).startswith("cannot download Skylion007/openwebtext (") and "--dataset_path" in str(
            error.value
        )

    root = tmp_path / "data"  # train.py --dataset=web, whose files are missing: it runs the prepare
    (root / "web").mkdir(parents=True)
    (root / "web" / "prepare.py").write_text("# stands in for a real prepare script\n")
    real_import = loader.importlib.import_module

    def hub_prepare(argv):
        return hf.hf_prepare_main(argv, root / "web", "Skylion007/openwebtext", None, "web")

    def import_module(name, *args):
        return SimpleNamespace(main=hub_prepare) if name == "data.web.prepare" else real_import(name, *args)

    monkeypatch.setattr(loader, "DATA_ROOT", root)
    monkeypatch.setattr(common, "DATA_ROOT", root)
    monkeypatch.setattr(loader.importlib, "import_module", import_module)
    with pytest.raises(
        DataError, match=r"^cannot download Skylion007/openwebtext \(\[Errno 101\] Network is unreachable\)"
    ):
        loader.ensure_dataset("web")


def test_an_os_error_of_an_automatic_prepare_is_one_line(tmp_path):
    def disk_full():
        raise OSError(28, "No space left on device", str(tmp_path / "train.bin"))

    with pytest.raises(DataError, match=r"failed: \S+train\.bin: No space left on device$"):
        loader.prepare_once(tmp_path, disk_full)


# ---- C. a prepare refuses output no run can use, and says why ----


def test_a_char_corpus_of_more_than_65536_distinct_chars_says_to_use_bpe(tmp_path):
    text = "".join(chr(0x20000 + i) for i in range(70_000)) * 2
    with pytest.raises(DataError) as error:
        prepare_text(text, tmp_path / "out", "char", source="big.txt")
    message = str(error.value)
    assert "big.txt has 70,000 distinct characters" in message and "must fit uint16" in message
    assert "python -m data.shakespeare.prepare --input big.txt" in message and "meta.json" not in message
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


@pytest.mark.parametrize("val_fraction, split", [("1e-9", "val"), ("0.9999", "train")])
def test_a_split_too_small_to_use_is_refused_and_nothing_is_written(tmp_path, capsys, val_fraction, split):
    from data.shakespeare_char.prepare import main

    (tmp_path / "input.txt").write_text(tiny_text(), encoding="utf-8")
    out = tmp_path / "out"
    assert common.run_prepare(main, ["--input", str(tmp_path / "input.txt"), "--out_dir", str(out),
                                     "--val_fraction", val_fraction]) == 2  # fmt: skip
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"the {split} split would hold" in err and "at least 66" in err, err
    assert not out.exists()
