"""Write a file so that a crash or kill at any moment leaves either the old file or the new one, whole.

Used for datasets (data/common.py) and checkpoints (storage/checkpoint.py); it imports nothing of this repo.
"""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path

TMP_MARKER = ".tmp."  # temporary names are .<name>.tmp.<pid>: hidden, and one per writing process
TMP_NAME = re.compile(r"\.(?P<target>.+)\.tmp\.(?P<pid>\d+)")


def tmp_path_for(path: Path) -> Path:
    return path.with_name(f".{path.name}{TMP_MARKER}{os.getpid()}")


def tmp_target(name: str) -> str | None:
    """The file name a temporary file of ours was going to replace (`.ckpt.pt.tmp.123` -> `ckpt.pt`); None for
    any other name, such as a user's `.notes.tmp.txt`."""
    match = TMP_NAME.fullmatch(name)
    return match.group("target") if match else None


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike):
    """Yield a temporary path beside `path` to write into; on success fsync it, rename it over `path` and fsync
    the folder; on error delete it. The rename is atomic, so `path` is never a half-written file."""
    path = Path(path)
    tmp = tmp_path_for(path)
    tmp.unlink(missing_ok=True)  # a leftover of an earlier process with this pid
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)  # no-op after a successful replace
    fsync_dir(path.parent)


def fsync_dir(folder: Path) -> None:
    """Make a rename in `folder` durable."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # some platforms cannot open folders; the rename is still atomic
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
