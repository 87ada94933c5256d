"""
Checkpoints that survive a kill, load without running code, and never overwrite another run's work.

- One run owns an out_dir: claim_out_dir() creates it, proves it writable with a real write, and holds an flock
  on `out_dir/.lock` (which names the holder's pid) until the run ends. A second run on the same folder is
  refused, and so is a fresh run into a folder that already holds checkpoints, unless it resumes them or is
  told to overwrite them. The kernel drops the flock when its holder dies, so a stale lock file blocks nothing.
- Every file is written to a temporary name in the same folder (`.<name>.tmp.<pid>`), flushed, fsynced and
  renamed over the old one: a kill at any moment leaves the previous checkpoint whole.
- `out_dir/ckpt-0001000.pt` per save; `ckpt.pt` (latest) and `best.pt` (lowest val loss) are copies of it,
  files of their own, so `cp ckpt-0000500.pt ckpt.pt` (a rollback) changes nothing else. Where the filesystem
  clones files (XFS, Btrfs) the copies are copy-on-write clones: no bytes written, as safe as a copy. Rotation
  and the clean-up of a killed writer's temporary files touch only these names, never a user's own files.
- An FSDP run (training/parallel.py) also writes its sharded optimizer state as a torch.distributed.checkpoint folder,
  `ckpt-<iter>.dcp`, renamed into place once complete and before the files that name it; it goes when its
  `ckpt-<iter>.pt` is rotated away. ckpt.pt itself holds the full weights, so it loads like any other.
- Loading uses `torch.load(weights_only=True)`: only tensors and plain containers are read back, so a
  malicious file cannot run code. Everything saved (RNG states too) is stored in such types. A loaded
  checkpoint is checked against the schema below; every problem is one CheckpointError line.

Reading a checkpoint into a model (the schema's model_config, nanoGPT's checkpoints) is weights/load.py's.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import math
import os
import pickle
import random
import re
import shlex
import shutil
import stat
import time
import warnings
import zipfile
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from errors import CheckpointError
from storage.atomic import atomic_path, fsync_dir, tmp_path_for, tmp_target
from storage.memory import check_archive_sizes, format_bytes

log = logging.getLogger("storage")

LATEST, BEST = "ckpt.pt", "best.pt"
NUMBERED = re.compile(r"ckpt-\d{7,}\.pt")  # f"ckpt-{iter_num:07d}.pt"
SHARDED = re.compile(r"ckpt-\d{7,}\.dcp")  # an FSDP run's optimizer state (a DCP folder) beside ckpt-<iter>.pt
LOCK = ".lock"
PROBE = "write-probe"  # written (as .write-probe.tmp.<pid>) and deleted at start-up: is out_dir writable?
CLONE_PROBE = "clone-probe"  # the probe cloned (as .clone-probe.tmp.<pid>): does its filesystem clone files?
FICLONE = 0x40049409  # Linux ioctl (linux/fs.h): the target shares the source's blocks, copy-on-write

# What a checkpoint holds: key -> type. RESUME_KEYS are needed only to continue a run (--init_from=resume).
REQUIRED_KEYS = {"model": dict, "model_config": dict, "meta": dict}
RESUME_KEYS = {"optimizer": dict, "scaler": dict, "iter_num": int, "best_val_loss": (int, float), "rng": list}


def os_reason(error: OSError) -> str:
    """'No space left on device [ENOSPC]': the cause of an OSError without its file name."""
    code = errno.errorcode.get(error.errno or 0)
    return f"{error.strerror or error}" + (f" [{code}]" if code else "")


def is_checkpoint_name(name: str) -> bool:
    """ckpt.pt, best.pt, ckpt-<7+ digits>.pt and .dcp: the only names saves write, rotate or clean up after."""
    return name in (LATEST, BEST) or NUMBERED.fullmatch(name) is not None or SHARDED.fullmatch(name) is not None


def checkpoint_names(out_dir) -> list[str]:
    out_dir = Path(out_dir)
    return sorted(p.name for p in out_dir.iterdir() if is_checkpoint_name(p.name)) if out_dir.is_dir() else []


# ----------------------------------------------------------------------------------------------
# The out_dir: one run at a time


class OutDir:
    """A run's hold on its out_dir: the flock on out_dir/.lock, released (and the lock file removed) by release()
    or the end of a `with` block. Folders the claim created are removed again if the run left them empty."""

    def __init__(self, path: Path, lock_fd: int, created: list[Path]):
        self.path, self.lock_fd, self.created = path, lock_fd, created

    def release(self) -> None:
        """Let go of out_dir; never raises: a run ending on an error keeps that error's line and exit code."""
        if self.lock_fd is None:
            return
        lock = self.path / LOCK
        try:
            lock.unlink(missing_ok=True)  # while still holding it: see _lock for why this is safe
        except OSError as error:  # out_dir turned read-only, or was taken away: the lock ends with the fd anyway
            log.warning(f"could not remove {lock} ({os_reason(error)}); it blocks no later run: the lock ends here")
        os.close(self.lock_fd)
        self.lock_fd = None
        _remove_if_empty(self.created)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()


def claim_out_dir(out_dir, *, continuing: bool, overwrite: bool, first_save: SaveSize | None = None) -> OutDir:
    """Create out_dir, prove it writable, and lock it for this run. `continuing`: the run resumes the checkpoints
    there; otherwise existing checkpoints are refused unless `overwrite`. A disk with less free space than
    first_save needs there (SaveSize.need: less where the filesystem clones files, or where the save replaces
    best.pt and ckpt.pt) is refused too.
    CheckpointError (one line) on failure."""
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise CheckpointError(f"out_dir {out_dir} exists and is not a folder")
    blocking = next((folder for folder in out_dir.parents if folder.exists() and not folder.is_dir()), None)
    if blocking is not None:
        raise CheckpointError(f"out_dir {out_dir} cannot be created: {blocking} is a file, not a folder")
    created = []
    try:
        for folder in reversed([out_dir, *out_dir.parents]):
            if folder.is_dir():
                continue
            broken = broken_link(folder)
            if broken:
                raise CheckpointError(f"out_dir {out_dir} cannot be created: {broken}")
            try:
                folder.mkdir()
                created.append(folder)
            except FileExistsError:
                if not folder.is_dir():
                    raise
                # another run created it at the same moment: the lock below decides which of them goes on
        clones = _probe(out_dir)
        hold = OutDir(out_dir, _lock(out_dir / LOCK), created)
    except OSError as error:
        _remove_if_empty(created)
        where = f" ({error.filename})" if error.filename and Path(error.filename) != out_dir else ""
        raise CheckpointError(f"out_dir {out_dir} cannot be used: {os_reason(error)}{where}") from None
    except CheckpointError:
        _remove_if_empty(created)
        raise
    found = checkpoint_names(out_dir)
    if found and not continuing and not overwrite:
        hold.release()
        shown = ", ".join(found[:3]) + (f" and {len(found) - 3} more" if len(found) > 3 else "")
        raise CheckpointError(
            f"out_dir {out_dir} already holds checkpoints ({shown}); this run would replace them. "
            f"Continue that run with {resume_hint(out_dir)}, or replace them with --overwrite_out_dir=true, "
            f"or choose another --out_dir"
        )
    free = free_bytes(out_dir)
    replaces = all((out_dir / name).is_file() for name in (LATEST, BEST))
    first_save_bytes = (first_save or SaveSize()).need(clones, replaces)
    if free is not None and first_save_bytes > free:
        hold.release()
        raise CheckpointError(
            f"out_dir {out_dir} has {format_bytes(free)} free; the first save needs about "
            f"{format_bytes(first_save_bytes)}; free some space or choose another --out_dir"
        )
    return hold


def broken_link(path: Path) -> str:
    """'' unless `path` is a symbolic link that leads to no file: one line naming where it points, or the loop."""
    if not path.is_symlink():
        return ""
    try:
        os.stat(path)
    except FileNotFoundError:
        return (
            f"{path} is a symbolic link to {os.readlink(path)}, which does not exist (create that, or remove the link)"
        )
    except OSError as error:
        if error.errno == errno.ELOOP:
            return f"{path} is a symbolic link loop ({path} -> {os.readlink(path)} -> ...); remove the link"
    return ""


def _probe(out_dir: Path) -> bool:
    """A real write, fsynced: a read-only or full filesystem fails here, before training, not at the first save.
    Returns whether the filesystem clones files (see clone_or_copy)."""
    probe, clone = tmp_path_for(out_dir / PROBE), tmp_path_for(out_dir / CLONE_PROBE)
    try:
        with open(probe, "wb") as f:
            f.write(b"can this run write here?\n")
            f.flush()
            os.fsync(f.fileno())
        return clone_or_copy(probe, clone)
    except OSError as error:
        error.filename = error.filename or str(probe)  # a failed write names no file by itself
        raise
    finally:
        probe.unlink(missing_ok=True)
        clone.unlink(missing_ok=True)


def _lock(path: Path) -> int:
    """flock `path` (created if missing) and write our pid in it; CheckpointError naming the holder if taken."""
    import fcntl  # POSIX only; imported here so that loading checkpoints works everywhere

    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = lock_holder_pid(fd)
            os.close(fd)
            raise CheckpointError(
                f"out_dir {path.parent} is in use by another run (pid {holder}, which holds {path}); "
                f"wait for it to finish, stop it, or choose another --out_dir"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        # The holder before us removes the file before it lets go; if it did so after our open, we hold a lock
        # on a file no one else can find: start again with the file that is there now.
        try:
            current = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            current = False
        if current:
            break
        os.close(fd)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except OSError:
        os.close(fd)  # lets go of the lock
        raise
    return fd


PID_WAIT_S = 1.0  # a holder writes its pid right after it takes the lock: how long a loser waits to read it


def lock_holder_pid(fd: int) -> str:
    """The pid of the process holding the flock on the lock file open at `fd`: what it wrote there (waiting a
    moment for a holder that has just taken the lock to write it), else the kernel's list (/proc/locks), else
    'unknown'."""
    deadline = time.monotonic() + PID_WAIT_S
    while True:
        written = os.pread(fd, 64, 0).decode(errors="replace").strip()
        if written or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    if written:
        return written
    inode = os.fstat(fd).st_ino
    try:
        with open("/proc/locks", encoding="ascii", errors="replace") as f:
            for line in f:  # 1: FLOCK  ADVISORY  WRITE 1234 08:01:5678 0 EOF
                fields = line.split()
                if len(fields) > 5 and fields[1] == "FLOCK" and fields[5].rsplit(":", 1)[-1] == str(inode):
                    return fields[4]
    except OSError:
        pass
    return "unknown"


def live_lock_holder(out_dir) -> str | None:
    """The pid of the run that holds out_dir's lock now; None when no live run does (no lock file, or a stale
    one). Asked by taking a shared flock for an instant: a run starting in that instant is refused, as if a run
    held the folder, and names this process."""
    import fcntl  # POSIX only

    try:
        fd = os.open(Path(out_dir) / LOCK, os.O_RDONLY)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return lock_holder_pid(fd)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def _remove_if_empty(folders: list[Path]) -> None:
    for folder in reversed(folders):  # deepest first
        try:
            folder.rmdir()
        except OSError:
            return


# The start-up free-space check's estimate of a save: upper bounds of what a checkpoint file holds besides its
# tensors' bytes (torch 2.x, measured: ~300 bytes per tensor, ~15 KB per rank's RNG states, ~8 KB else).
TENSOR_RECORD_BYTES = 512  # a tensor's zip entry (local and central headers, 64-byte alignment) and its pickle
RANK_STATE_BYTES = 24 * 1024  # each rank's RNG states: torch's (5 KB), numpy's (5 KB), python's (4 KB)
FIXED_BYTES = 16 * 1024  # the pickle, the data stream's generator state (5 KB), scalars, the GradScaler's state
FILES_PER_SAVE = 3  # ckpt-<iter>.pt, and its copies best.pt and ckpt.pt: three files of the same size
BLOCK_BYTES = 4096  # a file takes whole blocks of its filesystem


def checkpoint_file_bytes(tensor_bytes: int, tensors: int, *, ranks: int = 1, other_bytes: int = 0) -> int:
    """An upper estimate of one checkpoint file: `tensors` tensors of `tensor_bytes` in all (their storages,
    each counted once), `ranks` ranks' RNG states, and other_bytes of other pickled entries (config, meta)."""
    return tensor_bytes + tensors * TENSOR_RECORD_BYTES + ranks * RANK_STATE_BYTES + FIXED_BYTES + other_bytes


SHARD_RECORD_BYTES = 4096  # torch.distributed.checkpoint: a rank's record of one tensor, with its .metadata entry


def sharded_state_bytes(tensor_bytes: int, tensors: int, ranks: int) -> int:
    """An upper estimate of a folder of shards (an FSDP run's optimizer state): `tensors` tensors of
    `tensor_bytes` in all, each a record in every rank's file (measured ~2 KB each), and those files' blocks."""
    return tensor_bytes + tensors * ranks * SHARD_RECORD_BYTES + (ranks + 1) * BLOCK_BYTES


class SaveSize(NamedTuple):
    """What a save writes: checkpoint files of file_bytes each, and other_bytes besides (an FSDP run's folder of
    optimizer shards)."""

    file_bytes: int = 0
    other_bytes: int = 0

    def need(self, clones: bool = False, replaces: bool = False) -> int:
        """The free space it needs: FILES_PER_SAVE files in whole blocks, or one where the copies are clones,
        and the rest. `replaces`: out_dir holds best.pt and ckpt.pt already, and each copy's temporary file
        replaces one of them before the next is written, so the peak is a file less."""
        files = 1 if clones else FILES_PER_SAVE - replaces
        return files * (-(-self.file_bytes // BLOCK_BYTES) * BLOCK_BYTES) + self.other_bytes


def free_bytes(out_dir) -> int | None:
    """Free space for an unprivileged writer on out_dir's filesystem; None where it cannot be asked."""
    try:
        stats = os.statvfs(out_dir)
    except (OSError, AttributeError):
        return None
    return stats.f_bavail * stats.f_frsize


# ----------------------------------------------------------------------------------------------
# Saving


def atomic_save(obj, path: Path) -> None:
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        try:
            torch.save(obj, f)
        except RuntimeError as error:
            # A failed write inside torch's zip writer surfaces as "unexpected pos 256000 vs 255892"; the
            # OSError that says why (a full disk, ...) is its context.
            if isinstance(error.__context__, OSError):
                raise error.__context__ from None
            raise


def clone_or_copy(source: Path, target: Path) -> bool:
    """Make target a copy of source: a copy-on-write clone where the filesystem makes them (XFS, Btrfs: instant,
    no bytes written, and a later write to either file, a `cp` onto it too, leaves the other as it was), else a
    byte copy. Returns whether it cloned."""
    try:
        import fcntl  # POSIX only

        with open(source, "rb") as src, open(target, "wb") as dst:
            fcntl.ioctl(dst.fileno(), FICLONE, src.fileno())
        return True
    except (ImportError, OSError):  # not Linux, or a filesystem that does not clone (ext4, tmpfs, NFS, ...)
        shutil.copyfile(source, target)
        return False


def _atomic_copy(source: Path, target: Path) -> None:
    with atomic_path(target) as tmp:
        clone_or_copy(source, tmp)


def save_checkpoint(state: dict, out_dir, iter_num: int, keep_last_k: int, is_best: bool) -> Path:
    """Write `ckpt-<iter>.pt`, then copies of it as best.pt (when is_best) and ckpt.pt; drop the oldest numbered
    files beyond the last k. An OSError (full disk, no permission, ...) is one CheckpointError line naming the
    file and the cause; ckpt.pt is then as it was before this call. Returns out_dir/ckpt.pt."""
    out_dir = Path(out_dir)
    numbered = out_dir / f"ckpt-{iter_num:07d}.pt"
    replaces_numbered = numbered.exists()
    written, target = [], out_dir
    try:
        _remove_leftovers(out_dir)
        target = numbered
        atomic_save(state, numbered)
        written.append(numbered.name)
        for name in [BEST, LATEST] if is_best else [LATEST]:
            target = out_dir / name
            _atomic_copy(numbered, target)
            written.append(name)
        target = out_dir
        _rotate(out_dir, keep_last_k, numbered)
    except OSError as error:
        if LATEST not in written and numbered.name in written and not replaces_numbered:
            with contextlib.suppress(OSError):  # a folder turned read-only keeps it: the line says it was written
                numbered.unlink(missing_ok=True)  # ckpt.pt stays the latest: no newer numbered file beside it
                written.remove(numbered.name)
        if LATEST in written:
            outcome = f"{', '.join(written)} were written"
        else:
            outcome = f"{', '.join(written)} written, " if written else ""
            outcome += f"{LATEST} is unchanged" if (out_dir / LATEST).exists() else f"no {LATEST} yet"
        raise CheckpointError(f"could not save iter {iter_num}: {target}: {os_reason(error)}; {outcome}") from None
    return out_dir / LATEST


def _remove_leftovers(out_dir: Path) -> None:
    """Temporary files of a writer killed mid-save; only ours (.ckpt.pt.tmp.<pid>, ...), never a user's."""
    for path in out_dir.iterdir():
        target = tmp_target(path.name)
        if target is not None and SHARDED.fullmatch(target) and path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        elif target is not None and (is_checkpoint_name(target) or target in (PROBE, CLONE_PROBE)):
            path.unlink(missing_ok=True)


def _rotate(out_dir: Path, keep_last_k: int, saved: Path) -> None:
    """Delete this run's oldest numbered saves beyond the last keep_last_k, `saved` (the one just written) always
    kept. Save order, not iteration order: a resumed run may save a lower iteration again. Only regular files
    count: a symbolic link or a folder with such a name is none of our saves, and is left alone; so is a file
    dated after `saved` (copied in with its time kept, or from another clock), which no save of ours can be."""
    saved_at = saved.lstat().st_mtime_ns
    older = []
    for path in out_dir.iterdir():
        if not NUMBERED.fullmatch(path.name) or path.name == saved.name:
            continue
        try:
            info = path.lstat()
        except FileNotFoundError:
            continue
        if stat.S_ISREG(info.st_mode) and info.st_mtime_ns <= saved_at:
            older.append((info.st_mtime_ns, path.name, path))
    older.sort()
    for _, _, old in older[: max(0, len(older) - (keep_last_k - 1))]:
        old.unlink(missing_ok=True)
    for folder in out_dir.iterdir():  # optimizer states whose ckpt-<iter>.pt is gone
        if SHARDED.fullmatch(folder.name) and not folder.is_symlink() and folder.is_dir():
            if not os.path.lexists(folder.with_suffix(".pt")):
                shutil.rmtree(folder)
    fsync_dir(out_dir)


# ----------------------------------------------------------------------------------------------
# Loading


def read_checkpoint_file(path, map_location="cpu"):
    """What the file at `path` holds, read without running code; CheckpointError (one line) when it is missing
    or not a torch file, naming what is there instead. weights.load.load_checkpoint converts and checks it."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(missing_checkpoint(path))
    return read_torch_file(path, map_location)


def missing_checkpoint(path: Path) -> str:
    """The line for a checkpoint path that is no file: what is there instead, and the way on."""
    folder = path.parent
    if path.is_dir():
        return f"{path} is a folder, not a checkpoint file" + (
            f"; its checkpoint is {path / LATEST}" if (path / LATEST).is_file() else f" (it holds no {LATEST})"
        )
    if path.exists():
        return f"{path} is not a regular file (a device, pipe or socket), not a checkpoint"
    if path.is_symlink():
        return f"no checkpoint at {path}: it is a link to {os.readlink(path)}, which does not exist"
    if path.name == LATEST and folder.is_dir():
        # A missing ckpt.pt beside numbered saves is not taken as "resume from the newest of them": the user may
        # have deleted it on purpose (a diverged state, or a run to throw away), and continuing from an older
        # save without a word would be a silent rollback. The line names that save and the command that makes it
        # the latest again; `--init_from=<it>` would be a fine-tune (a fresh optimizer), not a resume.
        saved = newest_save(folder)
        if saved is not None:
            return (
                f"no checkpoint at {path}, but {folder} holds {saved.name}, its newest save{_iteration(saved)}; "
                f"to continue from it, make it the latest: cp {shlex.quote(str(saved))} {shlex.quote(str(path))}"
            )
    if path.name == LATEST:
        there = f"{folder} holds no checkpoints" if folder.is_dir() else f"there is no folder {folder}"
        train = f"python train.py --out_dir={folder}"
        return f"no checkpoint at {path}: {there}; train first ({train}) or point at another checkpoint"
    return f"no checkpoint at {path}: no such file" + ("" if folder.is_dir() else f" (and no folder {folder})")


def newest_save(out_dir) -> Path | None:
    """The last checkpoint saved in out_dir other than ckpt.pt: the newest numbered file by save order (as
    rotation counts it: a resumed run may save a lower iteration again), else best.pt; None if neither is there."""
    out_dir = Path(out_dir)
    numbered = [p for p in out_dir.iterdir() if NUMBERED.fullmatch(p.name) and p.is_file()] if out_dir.is_dir() else []
    if numbered:
        return max(numbered, key=lambda p: (p.stat().st_mtime_ns, p.name))
    return out_dir / BEST if (out_dir / BEST).is_file() else None


def _iteration(path: Path) -> str:
    return f" (iter {int(path.name[5:-3])})" if NUMBERED.fullmatch(path.name) else ""


def resume_hint(out_dir) -> str:
    """How to continue the run whose checkpoints are in out_dir: --init_from=resume, after making its newest
    save the latest when ckpt.pt is gone (see missing_checkpoint)."""
    out_dir = Path(out_dir)
    saved = None if (out_dir / LATEST).is_file() else newest_save(out_dir)
    if saved is None:
        return "--init_from=resume"
    copy = f"cp {shlex.quote(str(saved))} {shlex.quote(str(out_dir / LATEST))}"
    return f"`{copy}` ({LATEST} is gone; {saved.name} is its newest save), then --init_from=resume"


def read_torch_file(path: Path, map_location="cpu"):
    """torch.load(weights_only=True): tensors and plain containers only; CheckpointError (one line) otherwise,
    naming what the file is when it is another kind of file. torch's warnings (a pickle protocol it did not
    write, ...) are not shown: the error line says what is wrong."""
    kind = other_file_kind(path)
    if kind:
        raise CheckpointError(kind)
    check_archive_sizes(path)  # before torch.load inflates or allocates anything
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return torch.load(path, map_location=map_location, weights_only=True)
    except TORCH_LOAD_ERRORS as error:
        raise CheckpointError(_load_failure(path, error)) from None


# what torch.load raises on a file that is not a checkpoint, or a damaged one
TORCH_LOAD_ERRORS = (
    pickle.UnpicklingError,
    RuntimeError,
    EOFError,
    zipfile.BadZipFile,
    OSError,
    ValueError,
    IndexError,
    KeyError,
    TypeError,
    AttributeError,
)
ZIP_MAGIC = b"PK\x03\x04"  # torch.save's format since torch 1.6: a zip archive
LEGACY_MAGIC = (0x1950A86A20F9469CFC6C).to_bytes(10, "little")  # what torch.save's older pickle format begins with


def other_file_kind(path: Path) -> str:
    """'' for a file that may be a torch checkpoint; else one line naming what it is instead, read from its first
    bytes: empty, a safetensors file, a NumPy array, a plain Python pickle, a text file, zeros, or no format that
    torch.save writes (a zip archive; before torch 1.6, a pickle; long before, a tar)."""
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
            size = os.fstat(f.fileno()).st_size
    except OSError:
        return ""  # torch.load says why
    unreadable = f"{path} is not a readable checkpoint"
    if not head:
        return f"{unreadable}: it is empty (0 bytes; an interrupted copy or save?)"
    if head.startswith(ZIP_MAGIC):
        return ""
    header = int.from_bytes(head[:8], "little") if len(head) > 8 else 0
    if 0 < header <= size - 8 and head[8:9] == b"{":
        return (
            f"{path} is a safetensors file (weights alone, without model_config or tokenizer), not a .pt checkpoint "
            f"of this repo; pass the .pt it was exported from, or a Hugging Face GPT-2 folder with it as "
            f"model.safetensors beside its config.json"
        )
    if head.startswith(b"\x93NUMPY"):
        return f"{path} is a NumPy array file (.npy), not a checkpoint"
    if head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05") and LEGACY_MAGIC not in head[:32]:
        return (
            f"{path} is a plain Python pickle (pickle.dump), not a checkpoint saved by torch.save; refused unread: "
            f"unpickling it could run arbitrary code"
        )
    if b"\0" not in head:
        try:
            text = head.decode("utf-8")
        except UnicodeDecodeError as error:
            text = head[: error.start].decode("utf-8") if error.start >= len(head) - 3 else None  # a cut character
        if text is not None:
            first = (text.strip().splitlines() or [""])[0][:40]
            return f"{unreadable}: it is a text file (it begins {first!r})"
    if not head.strip(b"\0"):
        return f"{unreadable}: its first {len(head):,} bytes are all zeros (a damaged file?)"
    if head[:1] != b"\x80" and head[257:262] != b"ustar":  # neither a pickle (torch's old format) nor a tar
        return f"{unreadable}: it is in no format torch.save writes (damaged, or another kind of file)"
    return ""


def _has_torch_records(path: Path) -> bool:
    """Whether a zip archive holds what torch.save writes (<name>/data.pkl); True where that cannot be told."""
    try:
        with zipfile.ZipFile(path) as archive:
            return any(name.endswith("/data.pkl") or name == "data.pkl" for name in archive.namelist())
    except (zipfile.BadZipFile, OSError, ValueError):
        return True


def _load_failure(path: Path, error: Exception) -> str:
    """One line for a failed torch.load. Torch's own text suggests weights_only=False, which would run whatever
    code the file holds: that advice is never passed on."""
    text = str(error)
    blocked = re.search(r"unsupported GLOBAL (\S+)|Unsupported global: GLOBAL (\S+)", text)
    if blocked:
        name = blocked.group(1) or blocked.group(2)
        return (
            f"{path} holds pickled Python objects ({name}), not only tensors and plain containers; refused: "
            f"loading it could run arbitrary code"
        )
    if "legacy .tar format" in text:
        return f"{path} is not a readable checkpoint (an old .tar format, or not a checkpoint)"
    if "central directory" in text:  # a zip archive without its end
        return (
            f"{path} is not a readable checkpoint: it is cut short (a zip archive without its end: an interrupted "
            f"copy or save?); copy it again, or use another checkpoint"
        )
    if ("data.pkl" in text or "inline_container" in text) and not _has_torch_records(path):
        return f"{path} is not a readable checkpoint: it is a zip archive, but not one torch.save wrote"
    unsafe = ("weights_only", "trusted source", "arbitrary code", "Weights only load failed", "file an issue")
    sentences = [s.strip() for s in re.split(r"(?<=\.)\s+|\n+", text) if s.strip()]
    sentences = [s for s in sentences if not any(word in s for word in unsafe) and not s.startswith("Check the")]
    reason = sentences[0].removeprefix("WeightsUnpickler error: ") if sentences else type(error).__name__
    return f"{path} is not a readable checkpoint ({reason[:200]})"


def check_schema(state, path, *, resume: bool = False) -> None:
    """Keys and their types; model_config known to this version's GPTConfig; meta naming a tokenizer."""
    if not isinstance(state, dict) or "model" not in state or "model_config" not in state:
        raise CheckpointError(f"{path} is not a checkpoint of this repo (no model or model_config)")
    schema = {**REQUIRED_KEYS, **(RESUME_KEYS if resume else {})}
    missing = [key for key in schema if key not in state]
    if missing:
        why = " (needed to resume a run; --init_from=PATH fine-tunes from its weights alone)" if resume else ""
        why += "; without meta, the tokenizer it was trained with is unknown" if "meta" in missing else ""
        raise CheckpointError(f"{path} lacks {', '.join(missing)}{why}")
    for key, kind in schema.items():
        value = state[key]
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            names = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
            raise CheckpointError(f"{path}: {key} is a {type(value).__name__}, expected {names}")
    bad = [str(k) for k, v in state["model"].items() if not isinstance(k, str) or not isinstance(v, torch.Tensor)]
    if bad:
        raise CheckpointError(f"{path}: model holds entries that are not named tensors: {', '.join(bad[:3])}")
    meta = state["meta"]
    if not isinstance(meta.get("tokenizer"), str) or not isinstance(meta.get("vocab_size"), int):
        raise CheckpointError(f"{path}: meta lacks tokenizer or vocab_size; this checkpoint's tokenizer is unknown")
    if resume:
        check_resume_values(state, path)
        # the data stream's state: one for all ranks, or (earlier versions) one per rank
        has_data = "data" in state or all(isinstance(r, dict) and "data" in r for r in state["rng"])
        if not state["rng"] or not all(isinstance(r, dict) and isinstance(r.get("rng"), dict) for r in state["rng"]):
            raise CheckpointError(f"{path}: rng is not a list of each rank's rng state")
        if not has_data:
            raise CheckpointError(f"{path}: lacks the data stream's state (data)")
        sharded = state.get("sharded")
        if sharded is not None and not (isinstance(sharded, str) and SHARDED.fullmatch(sharded)):
            raise CheckpointError(f"{path}: sharded is {sharded!r}, not the name of a ckpt-<iter>.dcp folder")
        if sharded is not None and not (Path(path).parent / sharded).is_dir():
            raise CheckpointError(f"{path}: its optimizer state {Path(path).parent / sharded} is missing")


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# The values a resume continues from, beyond their types: key -> (whether a value is allowed, what is allowed).
# A negative iter_num trains with negative learning rates; a NaN (or -inf) best_val_loss is never beaten, so
# best.pt would never be written again; a GradScaler's values as torch.amp.GradScaler itself allows them.
RESUME_VALUES = {
    "iter_num": (lambda v: v >= 0, "an int >= 0 (the optimizer steps done)"),
    "best_val_loss": (lambda v: v >= 0, "a number >= 0, or inf before any evaluation"),  # NaN >= 0 is False
}
SCALER_VALUES = {
    "scale": (lambda v: _is_number(v) and 0 < v < math.inf, "a finite number > 0"),
    "growth_factor": (lambda v: _is_number(v) and 1 < v < math.inf, "a finite number > 1"),
    "backoff_factor": (lambda v: _is_number(v) and 0 < v < 1, "a number in (0, 1)"),
    "growth_interval": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1, "an int >= 1"),
    "_growth_tracker": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0, "an int >= 0"),
}


STEP_COUNT = (lambda v: _is_number(v) and 0 <= v < math.inf, "a finite number >= 0")  # AdamW's bias correction


def check_resume_values(state: dict, path) -> None:
    """The counters, the optimizer's step counts and the GradScaler's state a resume restores, in range (their
    containers' types are checked before)."""
    scaler = state["scaler"]
    entries = [(key, state[key], rule) for key, rule in RESUME_VALUES.items()]
    entries += [(f"scaler's {key}", scaler[key], rule) for key, rule in SCALER_VALUES.items() if key in scaler]
    entries += [(f"optimizer's step of parameter {key}", step, STEP_COUNT) for key, step in _step_counts(state)]
    for name, value, (allowed, what) in entries:
        if not allowed(value):
            raise CheckpointError(f"{path}: {name} is {value!r}; it must be {what}")


def _step_counts(state: dict) -> list[tuple]:
    """(parameter id, AdamW step count) in a plain optimizer state dict; none in another layout (FSDP's shards)."""
    param_states = state["optimizer"].get("state")
    counts = []
    for key, param_state in param_states.items() if isinstance(param_states, dict) else ():
        step = param_state.get("step") if isinstance(param_state, dict) else None
        if isinstance(step, torch.Tensor) and step.numel() == 1:
            step = step.item()
        if step is not None:
            counts.append((key, step))
    return counts


def check_model_weights(expected: dict[str, torch.Tensor], saved: dict[str, torch.Tensor], path) -> None:
    """The saved model's tensor names and shapes against a model built from its model_config."""
    missing = sorted(set(expected) - set(saved))
    extra = sorted(set(saved) - set(expected))
    shapes = [
        f"{k} {tuple(saved[k].shape)} (model_config needs {tuple(expected[k].shape)})"
        for k in expected
        if k in saved and saved[k].shape != expected[k].shape
    ]
    problems = [f"missing {', '.join(missing[:3])}"] if missing else []
    problems += [f"unexpected {', '.join(extra[:3])}"] if extra else []
    problems += [f"shape of {', '.join(shapes[:3])}"] if shapes else []
    if problems:
        raise CheckpointError(f"{path}: the model weights do not fit its model_config: {'; '.join(problems)}")


def tokenizer_id(meta: dict) -> str:
    """sha256 of what turns ids into text: the tokenizer's name, the vocabulary size and, for char level, every
    char in order. Two datasets with the same vocab_size but another vocabulary get different ids."""
    identity = {"tokenizer": meta.get("tokenizer"), "vocab_size": meta.get("vocab_size"), "itos": meta.get("itos")}
    return hashlib.sha256(json.dumps(identity, sort_keys=True, ensure_ascii=False).encode()).hexdigest()


def check_same_tokenizer(saved_meta: dict, meta: dict, path, data_dir) -> None:
    """A checkpoint's ids mean the same text in the dataset it will now train on; CheckpointError otherwise."""
    saved, here = tokenizer_id(saved_meta), tokenizer_id(meta)
    if saved != here:

        def describe(m, digest):
            return f"{m.get('tokenizer')}, vocab {m.get('vocab_size')}, sha256 {digest[:12]}"

        raise CheckpointError(
            f"{path} was trained with another tokenizer than {data_dir} uses: checkpoint {describe(saved_meta, saved)} "
            f"vs dataset {describe(meta, here)}; train it on a dataset made with its tokenizer"
        )


# ----------------------------------------------------------------------------------------------
# RNG states in weights_only-loadable types


def capture_rng() -> dict:
    np_state = np.random.get_state()
    state = {
        "python": _to_lists(random.getstate()),
        "numpy": {
            "keys": torch.from_numpy(np_state[1].astype(np.int64)),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "gauss": float(np_state[4]),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict) -> None:
    random.setstate(_to_tuples(state["python"]))
    np_state = state["numpy"]
    np.random.set_state(
        (
            "MT19937",
            np_state["keys"].numpy().astype(np.uint32),
            np_state["pos"],
            np_state["has_gauss"],
            np_state["gauss"],
        )
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])


def _to_lists(value):
    return [_to_lists(v) for v in value] if isinstance(value, tuple) else value


def _to_tuples(value):
    return tuple(_to_tuples(v) for v in value) if isinstance(value, list) else value


# ----------------------------------------------------------------------------------------------
# Export


def write_safetensors(weights: dict[str, torch.Tensor], out_path: Path, metadata: dict[str, str]) -> Path:
    """Write `weights` (no tensor stored twice) atomically; an OSError is one CheckpointError line."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    try:
        with atomic_path(out_path) as tmp:
            save_file(weights, str(tmp), metadata=metadata)
    except OSError as error:
        raise CheckpointError(f"cannot write {out_path}: {os_reason(error)}") from None
    except SafetensorError as error:  # its writer's I/O errors: "Error while serializing: I/O error: <cause>"
        reason = str(error).strip().splitlines()[0].rsplit("I/O error: ", 1)[-1][:200]
        raise CheckpointError(f"cannot write {out_path}: {reason}") from None
    return out_path
