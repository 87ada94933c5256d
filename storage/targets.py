"""
Where a command may write a checkpoint-like file (python -m weights merge, safetensors, hf): one check for all of
them, made before anything is read or written (check_output_file).

- A path as a person types it: ~ is expanded and a relative path is taken from the current folder; the path the
  file really lands at (its folder's links resolved) is returned, for the command to report.
- Refused always: a path that names a folder (an existing one, or one ending in /), a folder that does not exist,
  a file the command reads, and any file in the out_dir of a run that trains now (its lock is held): the folder is
  the run's while it runs (it saves, rotates and resumes there), --overwrite or not.
- Refused unless the user says so (overwrite, the commands' --overwrite): an existing checkpoint a run can resume
  from (model, optimizer, iter_num): what these commands write holds weights alone, and the run could not go on.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import torch

from errors import CheckpointError
from storage.checkpoint import TORCH_LOAD_ERRORS, broken_link, live_lock_holder, other_file_kind
from storage.memory import check_archive_sizes


def check_output_file(typed, *, overwrite: bool, inputs=(), example: str = "model.pt") -> Path:
    """Where a file written at `typed` lands (see the module's docstring), or CheckpointError (one line) saying why
    it may not be written there. `inputs`: the files the command reads; `example`: a file name for the line that
    asks for one."""
    text = os.fspath(typed)
    path = Path(text).expanduser()
    if text.endswith(("/", os.sep)) or path.is_dir():
        what = "is a folder" if path.is_dir() else f"ends in {os.sep} (a folder)"
        raise CheckpointError(f"{text} {what}; name the file to write, e.g. {path / example}")
    folder = path.parent
    if not folder.is_dir():
        why = broken_link(folder) or f"folder {folder} does not exist"
        raise CheckpointError(f"cannot write {path}: {why}")
    real = folder.resolve() / path.name
    if any(real == Path(source).expanduser().resolve() for source in inputs):
        raise CheckpointError(f"refusing to write over {real}, which this command reads; name another file")
    holder = live_lock_holder(real.parent)
    if holder is not None:
        raise CheckpointError(
            f"refusing to write {real}: {real.parent} is the out_dir of a run training now (pid {holder}), which "
            f"saves, rotates and resumes there; write the file elsewhere, or wait for the run to finish"
        )
    iteration = resumable_iteration(real)
    if iteration is not None and not overwrite:
        raise CheckpointError(
            f"refusing to replace {real}, a checkpoint a run can resume from (iter {iteration}), with weights "
            f"alone; name another file, or pass --overwrite to replace it"
        )
    return real


def resumable_iteration(path: Path) -> int | None:
    """The iter_num of the checkpoint at `path` when a run can resume from it (it holds an optimizer state);
    None for anything else. Read memory-mapped: the tensors are not read."""
    if not path.is_file() or other_file_kind(path):
        return None
    try:
        check_archive_sizes(path)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except (CheckpointError, *TORCH_LOAD_ERRORS):
        return None
    if isinstance(state, dict) and "optimizer" in state and isinstance(state.get("iter_num"), int):
        return state["iter_num"]
    return None
