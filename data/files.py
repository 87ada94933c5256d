"""A dataset folder's files as one whole: written together, opened together, and held while a run reads them.

Writers stage train.bin and val.bin under temporary names and commit them with meta.json under the folder's
exclusive lock (DATASET_LOCK), meta.json removed first and written last; readers open the folder under the shared
lock. So a reader finds one writer's complete dataset or none (a folder without meta.json is refused), never the
bins of one prepare beside the meta.json of another.

A run holds the bins it opened (HeldSplits): a later prepare into the folder renames new files over the names,
which leaves the run's open files as they were; a write into a file it holds, or any change of the folder's files,
is found at the next check and named in one line (DataChanged).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
import time
import weakref
from collections.abc import Callable
from pathlib import Path

import numpy as np

from errors import DataChanged, DataError
from storage.atomic import fsync_dir, tmp_path_for

DATASET_LOCK = ".dataset.lock"  # never removed: see loader.prepare_once for why a lock file stays
SPLITS = ("train", "val")
MAX_META_BYTES = 16 << 20  # a char meta.json of 65,536 chars is under 1 MB; anything far bigger is not a meta


# ----------------------------------------------------------------------------------------------------------------
# opening untrusted files


def open_regular(path: Path, fix: str) -> int:
    """A read-only descriptor of `path`, which must be a regular file: opening a FIFO would wait for a writer
    forever (O_NONBLOCK returns at once instead, then fstat tells what it is). DataError, one line, otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise DataError(f"{path} is missing; {fix}") from None
    except OSError as e:
        raise DataError(f"{path} cannot be read ({e.strerror or e}); {fix}") from None
    mode = os.fstat(fd).st_mode
    if stat.S_ISREG(mode):
        return fd
    os.close(fd)
    if stat.S_ISDIR(mode):
        raise DataError(f"{path} cannot be read (Is a directory); {fix}")
    kind = "a FIFO (named pipe)" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "a device"
    raise DataError(f"{path} is {kind}, not a regular file; {fix}")


def read_small_file(path: Path, fix: str, limit: int = MAX_META_BYTES) -> bytes:
    """The bytes of a regular file of at most `limit` bytes (a meta.json or meta.pkl), checked before reading."""
    fd = open_regular(path, fix)
    with open(fd, "rb") as f:
        size = os.fstat(fd).st_size
        if size > limit:
            raise DataError(f"{path} is {size:,} bytes, more than any meta file holds ({limit:,}); {fix}")
        return f.read(size)  # no more: a file that grows meanwhile is cut, and then fails to parse


# ----------------------------------------------------------------------------------------------------------------
# writing: staged bins, committed with meta.json under the folder's lock


def _open_lock(folder: Path):
    for mode in ("a", "r"):  # "r": a lock file that exists in a folder this process may not write to
        try:
            return open(folder / DATASET_LOCK, mode)
        except OSError:
            pass
    return None


@contextlib.contextmanager
def dataset_lock(folder: Path, *, shared: bool = False):
    """Exclusive: a writer's commit. Shared: a reader's opening (several at once). A folder where the lock file
    can be neither created nor opened is read without it: no writer could have committed there either."""
    lock = _open_lock(Path(folder))
    if lock is None and not shared:
        raise DataError(f"cannot write a dataset in {folder}: {folder / DATASET_LOCK} cannot be created")
    with lock if lock is not None else contextlib.nullcontext():
        if lock is not None:
            fcntl.flock(lock, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)  # released when the file closes
        yield


@contextlib.contextmanager
def staged_bins(out_dir: Path):
    """{"train": path, "val": path}: temporary names beside train.bin and val.bin (one per writing process) to
    write the splits into; commit_dataset moves them in. What is left of them on the way out is removed."""
    staged = {split: tmp_path_for(Path(out_dir) / f"{split}.bin") for split in SPLITS}
    for tmp in staged.values():
        tmp.unlink(missing_ok=True)  # a leftover of an earlier process with this pid
    try:
        yield staged
    finally:
        for tmp in staged.values():
            tmp.unlink(missing_ok=True)  # no-op after a commit


def commit_dataset(out_dir: Path, staged: dict[str, Path], write_meta: Callable[[], dict]) -> dict:
    """Move the staged bins in and write meta.json (write_meta), under the folder's exclusive lock: meta.json
    goes first and comes back last, so no reader finds it beside bins of another commit, or of one cut short."""
    for tmp in staged.values():
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
    with dataset_lock(out_dir):
        (Path(out_dir) / "meta.json").unlink(missing_ok=True)
        fsync_dir(Path(out_dir))
        for split, tmp in staged.items():
            os.replace(tmp, Path(out_dir) / f"{split}.bin")
        fsync_dir(Path(out_dir))  # the bins are in place before a meta.json vouches for them
        return write_meta()


# ----------------------------------------------------------------------------------------------------------------
# reading: the bins a run holds


def _identity(info: os.stat_result) -> tuple[int, int, int, int]:
    return info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns


def _what_changed(path: Path, before: tuple, after: tuple | None) -> str:
    if after is None:
        return f"{path} was removed"
    if after[:2] != before[:2]:
        return f"{path} was replaced by another file (a prepare into this folder?)"
    if after[2] != before[2]:
        return f"{path} was rewritten in place ({before[2]:,} bytes, now {after[2]:,})"
    return f"{path} was rewritten in place (modified {time.strftime('%H:%M:%S', time.localtime(after[3] / 1e9))})"


class HeldSplits:
    """train.bin and val.bin of `data_dir`, open for as long as this object lives, read with pread (no memmap:
    its pages would count against the process's memory as they are touched, and a file cut short under a map is
    a SIGBUS that kills the process, where a read just comes back short). `watched` are further files of the
    folder (meta.json) whose identity is recorded now and compared at each check."""

    def __init__(self, data_dir: Path, fix: str, watched: tuple[str, ...] = ()):
        self.data_dir, self.fix = Path(data_dir), fix
        self.fds = {split: open_regular(self.data_dir / f"{split}.bin", fix) for split in SPLITS}
        self.close = weakref.finalize(self, _close_all, list(self.fds.values()))  # once, at close() or collection
        self.opened = {split: _identity(os.fstat(fd)) for split, fd in self.fds.items()}
        self.watched = {name: self._identity_of(self.data_dir / name) for name in watched}

    def tokens(self, split: str) -> int:
        return self.opened[split][2] // 2

    def read(self, split: str, starts: list[int], length: int) -> np.ndarray:
        """(len(starts), length) uint16 windows; DataChanged when the file changed in place, before or while
        it was read (the windows may mix old and new bytes), and nothing of them is used."""
        windows = np.empty((len(starts), length), dtype="<u2")  # the .bin format is little-endian
        fd, size, short = self.fds[split], length * 2, False
        for row, start in enumerate(starts):
            try:
                count = os.preadv(fd, [memoryview(windows[row]).cast("B")], start * 2)
            except OSError as error:  # an I/O error of the disk: one line, not a traceback
                raise DataError(f"cannot read {self.data_dir / f'{split}.bin'}: {error.strerror or error}") from None
            if count != size:  # the file is shorter than when it was opened
                short = True
                break
        change = self._held_change(split) or (
            self._message(f"{self.data_dir / f'{split}.bin'} got shorter") if short else ""
        )
        if change:
            raise DataChanged(change)
        return windows

    def _held_change(self, split: str) -> str:
        now = _identity(os.fstat(self.fds[split]))
        if now == self.opened[split]:
            return ""
        return self._message(_what_changed(self.data_dir / f"{split}.bin", self.opened[split], now))

    def change(self) -> str:
        """What changed in the folder since it was opened, in one line ('' when nothing did). Opens each path
        afresh: a file renamed over a held one, removed, rewritten, or no longer readable, all count."""
        held = [self._held_change(split) for split in SPLITS]
        if any(held):
            return next(change for change in held if change)
        paths = {f"{split}.bin": self.opened[split] for split in SPLITS} | self.watched
        for name, before in paths.items():
            now = self._identity_of(self.data_dir / name)
            if now != before:
                return self._message(_what_changed(self.data_dir / name, before, now))
        return ""

    def _identity_of(self, path: Path) -> tuple | None:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        except OSError as error:  # e.g. out of file descriptors: this process cannot check, nor go on reading
            raise DataError(f"cannot read {path}: {error.strerror or error}") from None
        try:
            return _identity(os.fstat(fd))
        finally:
            os.close(fd)

    def _message(self, what: str) -> str:
        return f"{what} since this run opened it; the run trained only on the data as it was opened"


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
