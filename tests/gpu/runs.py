"""What the GPU end-to-end tests share: which cells this machine can run (GPUs, packages), a cell's command run as a
user runs it and read back (status, figure), and work that several cells need, done once per pytest run even when
xdist spreads the cells over workers."""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import math
import os
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from bench import launch

TIMEOUT_S = 600  # a cell's command; past it, it and everything it started are killed
LOG_TAIL_LINES = 40  # a failed cell's last lines of output, in its failure message
GPU_LOCK = "gpu.lock"  # under the run's shared folder: cells hold it shared, a cell timed alone exclusively
ENV = {"PYTHONUNBUFFERED": "1", "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}


# ----------------------------------------------------------------------------------------------
# What a cell needs


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


def installed(module: str) -> bool:
    """Whether `module` (a dotted name) can be imported, found without importing it; `a|b`: either."""
    if "|" in module:
        return any(installed(name) for name in module.split("|"))
    top, *rest = module.split(".")
    spec = importlib.util.find_spec(top)
    if spec is None or not rest:
        return spec is not None
    for location in map(Path, spec.submodule_search_locations or ()):
        if location.joinpath(*rest).is_dir() or location.joinpath(*rest[:-1], rest[-1] + ".py").is_file():
            return True
    return False


def needs(gpus: int = 1, packages: tuple[str, ...] = ()) -> pytest.MarkDecorator:
    """Skip the cell, saying what is missing, where this machine lacks its GPUs or packages."""
    have = gpu_count()
    missing = (
        []
        if have >= gpus
        else [f"needs {'a CUDA GPU' if gpus == 1 else f'{gpus} CUDA GPUs'} (this machine has {have})"]
    )
    missing += [f"needs {name.replace('|', ' or ')} (not installed)" for name in packages if not installed(name)]
    return pytest.mark.skipif(bool(missing), reason="; ".join(missing))


# ----------------------------------------------------------------------------------------------
# A cell's run and what it shows


def read_train(output: str) -> tuple[str, float | None]:
    """(status, final val loss) from train.py's eval lines: finite and falling."""
    vals = [float(v) for v in re.findall(r"^eval \d+ \| train \S+ \| val (\S+)", output, re.M)]
    if len(vals) < 2:
        return "no eval lines", None
    if not all(math.isfinite(v) for v in vals) or vals[-1] >= vals[0]:
        return f"loss did not fall: {vals}", vals[-1]
    return "ok", vals[-1]


def read_sample(output: str) -> tuple[str, float | None]:
    """(status, decode tokens/s) from sample.py's decode line."""
    found = re.search(r"^decode: \d+ tokens in \S+ s \((\S+) tokens/s\)", output, re.M)
    return ("ok", float(found.group(1).replace(",", ""))) if found else ("no decode line", None)


READERS = {"train": (read_train, "val loss"), "sample": (read_sample, "decode tok/s"), "done": (None, "")}


def cell_env(command: list[str]) -> dict:
    """A cell's environment. A one-process cell runs on its xdist worker's GPU (gw0 on GPU 0, gw1 on GPU 1, ...),
    so that cells spread over the machine's GPUs rather than queue on the first; a torchrun cell sees them all,
    and so does every cell where CUDA_VISIBLE_DEVICES is set already."""
    env = {**os.environ, **ENV}
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    torchrun = "torch.distributed.run" in command
    if worker.startswith("gw") and not torchrun and "CUDA_VISIBLE_DEVICES" not in os.environ and gpu_count() > 1:
        env["CUDA_VISIBLE_DEVICES"] = str(int(worker[2:]) % gpu_count())
    return env


def run_cell(command: list[str], read: str = "train", backend: str = "") -> dict:
    """Run a cell's command from the repo root: its status (ok, `skipped: why` where train.py fell back from
    `backend`, or what went wrong), figure, unit, seconds, and its output's last lines."""
    done = launch.run(command, cell_env(command), timeout=TIMEOUT_S)
    outcome = {"figure": None, "unit": READERS[read][1], "seconds": round(done.seconds, 1), "output": done.output}
    outcome["tail"] = "\n".join(done.output.splitlines()[-LOG_TAIL_LINES:])
    if done.code != 0:
        return {**outcome, "status": f"exit {done.code}: {done.failure()}"}
    fallback = re.search(r"WARNING: (\S+) requested but (.*); falling back to", done.output)
    if backend and fallback and fallback.group(1) == backend:
        return {**outcome, "status": f"skipped: {fallback.group(2)[:200]}"}
    reader = READERS[read][0]
    status, figure = reader(done.output) if reader else ("ok", None)
    return {**outcome, "status": status, "figure": figure}


def report(outcome: dict, record_property) -> None:
    """The cell's figure and seconds into its results row; skip or fail as its status says."""
    record_property("seconds", outcome["seconds"])
    if outcome["figure"] is not None:
        record_property("figure", outcome["figure"])
        record_property("unit", outcome["unit"])
    if outcome["status"].startswith("skipped: "):
        pytest.skip(outcome["status"].removeprefix("skipped: "))
    assert outcome["status"] == "ok", f"{outcome['status']}\n{outcome['tail']}"


# ----------------------------------------------------------------------------------------------
# Work several cells need, done once


@contextlib.contextmanager
def locked(path: Path, shared: bool = False):
    """An flock on `path` (created if missing): exclusive, or shared with other shared holders."""
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def once(folder: Path, name: str, make: Callable[[], dict]) -> dict:
    """make()'s answer (a JSON-able dict), made by the first worker that asks; the others wait for it and read it.
    It is made holding a shared turn of the GPU (folder/gpu.lock), as a cell runs: not beside a cell timed alone."""
    slug = re.sub(r"\W+", "-", name).strip("-")
    done = folder / f"{slug}.json"
    with locked(folder / f"{slug}.lock"):
        if not done.exists():
            with locked(folder / GPU_LOCK, shared=True):
                done.write_text(json.dumps(make()))
    return json.loads(done.read_text())
