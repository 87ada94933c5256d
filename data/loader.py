"""What training reads: the dataset folder (prepared on first use) and random batches from its token stream."""

from __future__ import annotations

import fcntl
import importlib
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from data.common import DATA_ROOT, open_split, prepare_command, read_meta, token_limit
from data.files import HeldSplits, dataset_lock
from errors import DataChanged, DataError

REQUIRED_FILES = ("train.bin", "val.bin", "meta.json")
PREPARE_LOCK = ".prepare.lock"  # held while a dataset folder is auto-prepared; never removed (see prepare_once)


def ensure_dataset(dataset: str, data_dir: str = "", *, master: bool = True, distributed: bool = False) -> Path:
    """The dataset folder: data_dir if given, else data/<dataset>, whose prepare.py runs first when its files
    are missing (on the master rank; under DDP the other ranks wait at a barrier)."""
    if data_dir:
        if not Path(data_dir).is_dir():
            raise DataError(f"data_dir {data_dir!r} is not a folder")
        return Path(data_dir)
    known = sorted(p.parent.name for p in DATA_ROOT.glob("*/prepare.py"))
    if dataset not in known:
        raise DataError(f"unknown dataset {dataset!r}; choose one of {', '.join(known)} or set --data_dir")
    folder = DATA_ROOT / dataset
    missing = _missing_files(folder)
    if missing and master:
        prepare_once(folder, lambda: importlib.import_module(f"data.{dataset}.prepare").main([]))
    if missing and distributed:
        dist.barrier()
    return folder


def _missing_files(folder: Path) -> list[str]:
    if not folder.is_dir():
        return list(REQUIRED_FILES)
    with dataset_lock(folder, shared=True):  # not in the middle of a writer's commit
        missing = [name for name in REQUIRED_FILES if not (folder / name).exists()]
    return [name for name in missing if name != "meta.json" or not (folder / "meta.pkl").exists()]  # nanoGPT's


def prepare_once(folder: Path, prepare: Callable[[], object]) -> None:
    """Run `prepare` unless `folder` holds a dataset by then, under an exclusive flock on folder/.prepare.lock:
    two first runs at once must not write the same files together, so the second waits and then finds the
    dataset ready. The kernel drops the lock when its holder exits, however it dies, so a stale lock file is
    harmless and stays (deleting it could let a third process lock a different file than a waiting one)."""
    try:
        lock = open(folder / PREPARE_LOCK, "a")  # closed by the `with` below, which releases the lock
    except OSError as e:
        raise DataError(f"cannot prepare {folder} ({e.strerror or e}); prepare it elsewhere, set --data_dir") from None
    with lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"{folder}: another process is preparing it; waiting", flush=True)
            fcntl.flock(lock, fcntl.LOCK_EX)
        missing = _missing_files(folder)  # again: the process we waited for has probably written them
        if missing:
            print(f"{folder}: {', '.join(missing)} missing; running {prepare_command(folder)}", flush=True)
            try:
                prepare()
            except OSError as e:  # a full disk, a lost connection...: what the prepare command itself says
                where = f"{e.filename}: " if e.filename else ""
                reason = " ".join(str(e.strerror or e).split()) or type(e).__name__
                raise DataError(f"{prepare_command(folder)} failed: {where}{reason}") from None


class Batches:
    """Random windows of a split's tokens. The training stream is one generator, seeded alike on every rank and
    saved in checkpoints: each optimizer step draws the start of every sequence of the step at once, for all
    ranks and micro-steps, and each rank takes its own part. So the sequences of a step do not depend on how
    the step is split over ranks and micro-steps (1 rank x 2 micro-steps trains on the same ones as 2 x 1), and
    a resumed run continues the same stream, with any number of ranks."""

    def __init__(
        self,
        data_dir: Path,
        batch_size: int,
        block_size: int,
        device: torch.device,
        *,
        seed: int,
        vocab_size: int,
        rank: int = 0,
        world_size: int = 1,
        accum: int = 1,
        packed_documents: bool = False,
        document_separator: int | None = None,
        shard: Callable[[tuple], tuple] | None = None,
    ):
        self.data_dir, self.batch_size, self.block_size, self.device = Path(data_dir), batch_size, block_size, device
        self.rank, self.world_size, self.accum = rank, world_size, accum  # accum: micro-steps per step, this rank
        self.shard = shard  # context parallelism: whole sequences' arguments -> this rank's part of them
        with dataset_lock(self.data_dir, shared=True):  # one writer's dataset, whole (data/files.py)
            for split in ("train", "val"):
                open_split(data_dir, split, block_size, vocab_size)  # validates; DataError names the fix
            meta = read_meta(data_dir)
            meta_file = "meta.json" if (self.data_dir / "meta.json").exists() else "meta.pkl"
            # held for the run: a prepare into the folder renames new files in, and this run reads on unchanged
            self.files = HeldSplits(self.data_dir, f"run: {prepare_command(data_dir)}", watched=(meta_file,))
        self.limit = token_limit(meta, vocab_size)  # every id drawn must be below it
        self.separator = separator_token(data_dir, document_separator, vocab_size) if packed_documents else None
        self.generator = torch.Generator().manual_seed(seed)
        self.state_before_last = self.generator.get_state()  # before the draw of the step being trained on
        self.pending: list[list[int]] = []  # this rank's starts for the rest of the current step
        self.undo: tuple | None = None  # how to take back the last draw, should its batch be unreadable

    def check_unchanged(self) -> None:
        """Raise DataChanged, on every rank alike, when any rank finds a file of the dataset changed since the run
        opened it (replaced, removed, rewritten); at a moment when every rank calls it (each evaluation)."""
        change = self.files.change()
        if dist.is_available() and dist.is_initialized():
            reports = [None] * dist.get_world_size()
            dist.all_gather_object(reports, change)
            change = next((report for report in reports if report), "")
        if change:
            raise DataChanged(change)

    def restore(self, generator_state: torch.Tensor) -> None:
        """Continue the training stream from a checkpoint's state_before_last: the next batch starts a step."""
        self.generator.set_state(generator_state)
        self.state_before_last, self.pending = self.generator.get_state(), []

    def get(self, split: str, generator: torch.Generator | None = None):
        """The model's arguments for one batch on the device: (x, y), y shifted by one token, and with packed
        documents also doc_ids (see document_ids); from `generator`, else the next micro-batch of the training
        stream."""
        path, high = self.data_dir / f"{split}.bin", self.files.tokens(split) - self.block_size
        if generator is None:
            starts = self._next_train_starts(high)
        else:
            starts = torch.randint(high, (self.batch_size,), generator=generator).tolist()
        try:
            windows = self.files.read(split, starts, self.block_size + 1)  # x, and y one token later
        except DataChanged as change:
            self._take_back_draw(generator)  # so a checkpoint saved now resumes this step's draw
            if dist.is_available() and dist.is_initialized():  # one rank mid-step: the others cannot save with it
                raise DataError(str(change)) from None
            raise
        self._check_ids(windows, starts, path)
        x = torch.from_numpy(windows[:, :-1].astype(np.int64))
        y = torch.from_numpy(windows[:, 1:].astype(np.int64))
        if self.device.type == "cuda":
            x, y = x.pin_memory().to(self.device, non_blocking=True), y.pin_memory().to(self.device, non_blocking=True)
        else:
            x, y = x.to(self.device), y.to(self.device)
        if self.shard is not None:
            return self.shard((x, y))
        return (x, y) if self.separator is None else (x, y, document_ids(x, self.separator))

    def _check_ids(self, windows: np.ndarray, starts: list[int], path: Path) -> None:
        """Every id drawn is below the vocabulary size (microseconds a batch). open_split checked the files at
        start-up, but a big bin's check trusts meta.json's cached largest id, and a file can change during the run:
        an id out of range would be an IndexError on a CPU and a device-side assert on a GPU."""
        largest = int(windows.max())
        if largest < self.limit:
            return
        row, column = np.unravel_index(int(windows.argmax()), windows.shape)
        position = starts[row] + int(column)
        raise DataError(
            f"{path} holds token id {largest} (at token {position:,}) >= vocab_size {self.limit}, which its "
            f"meta.json does not admit: the file changed after meta.json was written; rerun: "
            f"{prepare_command(self.data_dir)}"
        )

    def _take_back_draw(self, generator: torch.Generator | None) -> None:
        if generator is None and self.undo is not None:
            state_before_last, self.pending = self.undo
            if state_before_last is not self.state_before_last:  # the draw began a step: draw it again
                self.generator.set_state(self.state_before_last)
                self.state_before_last = state_before_last

    def _next_train_starts(self, high: int) -> list[int]:
        self.undo = (self.state_before_last, list(self.pending))
        if not self.pending:  # a new optimizer step: draw all of it; global micro-step m * world_size + rank
            self.state_before_last = self.generator.get_state()
            shape = (self.accum, self.world_size, self.batch_size)
            step = torch.randint(high, shape, generator=self.generator)  # (micro-step, rank, sequence)
            self.pending = step[:, self.rank].tolist()
        return self.pending.pop(0)


def document_ids(x: torch.Tensor, separator: int) -> torch.Tensor:
    """(B, T) int: which document of its row each token belongs to, counting from 0.

    The separator ENDS a document and belongs to it: the prepare scripts append end-of-text after each
    document, so the document's own tokens are what the separator is predicted from; the token after it
    starts the next document (position 0). A window that starts mid-document gives that part id 0."""
    ends = (x == separator).to(torch.int32)  # (B, T)
    return ends.cumsum(dim=1, dtype=torch.int32) - ends  # separators strictly before each token


def separator_token(data_dir: Path, separator: int | None, vocab_size: int) -> int:
    """The token that ends each document: `separator` if given, else meta.json's eot_token."""
    if separator is None:
        separator = read_meta(data_dir).get("eot_token")
    if separator is None:
        raise DataError(
            f"packed_documents=True needs the token that ends each document, but {Path(data_dir) / 'meta.json'} "
            f"names no eot_token (char-level datasets have none); set --document_separator=ID or turn packing off"
        )
    if not isinstance(separator, int) or isinstance(separator, bool) or not 0 <= separator < vocab_size:
        raise DataError(f"document_separator {separator!r} must be a token id in [0, {vocab_size})")
    return separator
