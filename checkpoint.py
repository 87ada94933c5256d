"""
Checkpoints that survive a kill, and load without running code.

- Every file is written to a temporary name in the same folder, flushed, fsynced and renamed over the
  old one: a kill at any moment leaves the previous checkpoint whole.
- `out_dir/ckpt-0001000.pt` per save; `ckpt.pt` (latest) and `best.pt` (lowest val loss) are hard
  links to them, so keeping the last `keep_last_k` costs no copies.
- Loading uses `torch.load(weights_only=True)`: only tensors and plain containers are read back, so a
  malicious file cannot run code. Everything saved (RNG states too) is stored in such types.

    python checkpoint.py export out/ckpt.pt out/model.safetensors   # weights only, for other tools
"""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil
import sys
import zipfile
from pathlib import Path

import numpy as np
import torch

from data.atomic import TMP_MARKER, atomic_path, fsync_dir

LATEST, BEST = "ckpt.pt", "best.pt"


class CheckpointError(ValueError):
    """A missing, unreadable or mismatched checkpoint; one line saying what and what to do."""


def atomic_save(obj, path: Path) -> None:
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        torch.save(obj, f)


def _atomic_link(source: Path, target: Path) -> None:
    """Point `target` at `source`'s data in one rename (a copy where hard links are not supported)."""
    with atomic_path(target) as tmp:
        try:
            os.link(source, tmp)
        except OSError:
            shutil.copyfile(source, tmp)


def save_checkpoint(state: dict, out_dir, iter_num: int, keep_last_k: int, is_best: bool) -> Path:
    """Write `ckpt-<iter>.pt`, repoint ckpt.pt (and best.pt), drop numbered files beyond the last k."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for leftover in out_dir.glob(f".*{TMP_MARKER}*"):  # from a writer killed mid-save
        leftover.unlink(missing_ok=True)
    numbered = out_dir / f"ckpt-{iter_num:07d}.pt"
    atomic_save(state, numbered)
    _atomic_link(numbered, out_dir / LATEST)
    if is_best or not (out_dir / BEST).exists():
        _atomic_link(numbered, out_dir / BEST)
    by_age = sorted(out_dir.glob("ckpt-*.pt"), key=lambda p: (p.stat().st_mtime_ns, p.name))  # save order, not
    for old in by_age[:-keep_last_k]:  # iteration order: a resumed run may save a lower iteration again
        old.unlink()  # best.pt and ckpt.pt keep their data through their own links
    fsync_dir(out_dir)
    return out_dir / LATEST


def load_checkpoint(path, map_location="cpu") -> dict:
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {path}; train first (python train.py) or point at another out_dir")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except (
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
    ) as error:  # what torch's loader raises on garbage
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise CheckpointError(f"{path} is not a readable checkpoint ({first_line[:200]})") from None
    if not isinstance(state, dict) or "model" not in state or "model_config" not in state:
        raise CheckpointError(f"{path} is not a checkpoint of this repo (no model or model_config)")
    return state


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


def export_safetensors(checkpoint_path, out_path) -> Path:
    """Model weights only (no optimizer, no pickle), with the model config in the file's metadata."""
    from safetensors.torch import save_file

    state = load_checkpoint(checkpoint_path)
    # lm_head.weight is tied to transformer.wte.weight; safetensors stores shared tensors only once
    weights = {k: v.contiguous() for k, v in state["model"].items() if k != "lm_head.weight"}
    out_path = Path(out_path)
    save_file(
        weights,
        str(out_path),
        metadata={"model_config": json.dumps(state["model_config"]), "tied": "lm_head.weight=transformer.wte.weight"},
    )
    return out_path


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 3 or argv[0] != "export":
        print("usage: python checkpoint.py export CKPT.pt OUT.safetensors", file=sys.stderr)
        return 2
    try:
        out = export_safetensors(argv[1], argv[2])
    except CheckpointError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
