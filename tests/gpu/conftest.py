"""Fixtures of the GPU end-to-end tests: one scratch folder for the whole run (every xdist worker's), the text
corpus the cells train on, and the GPU's turns: a cell that times something (`alone`) runs with no other cell."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from gpu.runs import GPU_LOCK, locked, once

from bench import launch


@pytest.fixture(scope="session")
def shared_folder(tmp_path_factory) -> Path:
    """A folder every worker of this run sees (xdist's workers each have a basetemp under one parent)."""
    base = tmp_path_factory.getbasetemp()
    folder = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "e2e-shared"
    folder.mkdir(exist_ok=True)
    return folder


@pytest.fixture(scope="session")
def corpus(shared_folder) -> Path:
    """A char-level dataset of this repo's own sources (no network needed)."""
    return Path(once(shared_folder, "corpus", lambda: {"path": str(launch.corpus(shared_folder / "data"))})["path"])


@pytest.fixture
def alone():
    """Asked for by a cell that times what it runs: it waits for the GPU to itself (gpu_turn)."""


@pytest.fixture(autouse=True)
def gpu_turn(request, shared_folder):
    """Cells share the GPU (small models), except one that asks to be `alone`: it waits until no other cell runs,
    and the others wait for it."""
    with locked(shared_folder / GPU_LOCK, shared="alone" not in request.fixturenames):
        yield
