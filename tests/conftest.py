"""Fixtures shared by the tests; plain helpers live in helpers.py. `gpu` tests skip themselves without CUDA."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest

from helpers import one_torch_thread, process_state_restored, tiny_args, tiny_text, warm_context

pytest_plugins = ("gpu.results_table",)  # tests/gpu's results table, written by xdist's controller too


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_collection_finish(session):
    # The warm interpreter spends seconds importing torch: started now, it does so while the first tests run.
    if any("warm_interpreter" in getattr(item, "fixturenames", ()) for item in session.items):
        warm_context()


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    # The tests run in random order (pytest-randomly, a new seed each run); -q hides the header line that names
    # the seed, so a failed run names it here, to replay that order.
    seed = getattr(config.option, "randomly_seed", None)
    if exitstatus == pytest.ExitCode.TESTS_FAILED and isinstance(seed, int):
        terminalreporter.write_line(f"test order: python -m pytest -p randomly --randomly-seed={seed} replays it")


@pytest.fixture(scope="session")
def warm_interpreter():
    """For tests that fork children from the warm interpreter (helpers.WarmProcess, warm=True): asking for it
    starts that interpreter when collection ends, instead of when the first child is forked."""
    warm_context()


@pytest.fixture(autouse=True)
def _restore_process_state():
    with process_state_restored():
        yield


@pytest.fixture
def one_thread():
    """Use as `pytestmark = pytest.mark.usefixtures("one_thread")` in modules that train in-process."""
    with one_torch_thread():
        yield


@pytest.fixture
def allow_flex_recompiles():
    """Each shape/dtype/mask is a new compile of the one cached flex function; past dynamo's recompile limit
    (8) torch.compile silently falls back to eager flex, which a CUDA graph cannot capture. The test starts
    from no compiled frames (earlier tests' compiles count toward the limit) and a raised limit. Patched
    through dynamo's own config.patch: pytest's monkeypatch cannot undo a torch config attribute cleanly."""
    import torch._dynamo

    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    torch._dynamo.reset()
    try:
        with config.patch(**{name: max(64, getattr(config, name))}):
            yield
    finally:
        torch._dynamo.reset()


@pytest.fixture(scope="session")
def char_data(tmp_path_factory) -> Path:
    """A prepared tiny char dataset (train.bin, val.bin, meta.json). Shared: copy it before changing it."""
    from data.common import prepare_text

    out = tmp_path_factory.mktemp("char_data")
    prepare_text(tiny_text(), out, "char")
    return out


@pytest.fixture(scope="session")
def trained_out(char_data, tmp_path_factory) -> Path:
    """out_dir of a 4-iteration in-process run of the tiny model (ckpt.pt, best.pt, numbered files).
    Shared: copy it before changing it."""
    import train

    out = tmp_path_factory.mktemp("trained_out")
    with process_state_restored(), one_torch_thread(), open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink):
        code = train.main(
            tiny_args(char_data, out, "--max_iters=4", "--eval_interval=2", "--always_save_checkpoint=true")
        )
    assert code == 0
    assert (out / "ckpt.pt").is_file()
    return out
