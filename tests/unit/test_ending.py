"""training/ending.py: main's table of the ways a run can fail, each one exit code and one line. The lines of a
run that ends well (saved, nothing saved, non-finite steps, a stop signal) are checked through train.main in
tests/e2e/test_cli_exits.py and tests/e2e/test_reliability.py."""

from __future__ import annotations

import signal
import types

import pytest
import torch

from errors import CheckpointError, ConfigError, DataError, PeerFailed, Stopped, UsageError
from training.ending import RUN_FAILURES, exit_for


def settings(out_dir, batch_size: int = 8, gradient_accumulation_steps: int = 3, **more):
    return types.SimpleNamespace(
        out_dir=str(out_dir),
        batch_size=batch_size,
        gradient_accumulation_steps=gradient_accumulation_steps,
        **{"parallelism": "ddp", "fsdp_reduce_every_micro_step": False, **more},
    )


@pytest.mark.parametrize("error_type", [ConfigError, DataError, CheckpointError, UsageError])
def test_the_users_errors_are_their_line_and_exit_code_2(error_type, tmp_path):
    error = error_type("batch_size must be >= 1, got 0")
    assert isinstance(error, RUN_FAILURES)
    assert exit_for(error, settings(tmp_path)) == (2, "error: batch_size must be >= 1, got 0")


def test_a_peer_that_failed_is_exit_code_2_without_a_line_of_this_ranks_own(tmp_path):
    """PeerFailed is a UsageError: the rank that failed printed why, and this one must not repeat it."""
    assert exit_for(PeerFailed("rank 1 failed: disk full"), settings(tmp_path)) == (2, "")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP], ids=lambda sig: sig.name)
def test_a_stop_signal_during_start_up_is_128_plus_n_and_names_what_out_dir_holds(sig, tmp_path):
    """Stopped is a KeyboardInterrupt, but has its own code and line; before the settings are read (cfg None),
    the line has no out_dir to name."""
    stop = Stopped(sig)
    assert exit_for(stop, settings(tmp_path / "out")) == (
        128 + sig,
        f"received {sig.name} during start-up, before the first step: nothing saved; "
        f"out_dir {tmp_path / 'out'} does not exist",
    )
    assert exit_for(stop, None) == (
        128 + sig,
        f"received {sig.name} during start-up, before the first step: nothing saved",
    )


def test_ctrl_c_while_reading_the_settings_is_130():
    assert exit_for(KeyboardInterrupt(), None) == (130, "interrupted before training started: nothing saved")


def test_out_of_memory_names_the_settings_that_keep_the_tokens_per_step(tmp_path):
    """Half the batch, twice the accumulation: same tokens per step; at batch 1, only the general advice."""
    error = torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
    code, line = exit_for(error, settings(tmp_path, batch_size=8, gradient_accumulation_steps=3))
    assert code == 2
    assert line == (
        "error: CUDA out of memory; lower --batch_size and raise --gradient_accumulation_steps by the same factor "
        "(e.g. --batch_size=4 --gradient_accumulation_steps=6): same tokens per step, less memory; or shorten "
        "--block_size"
    )
    assert "(e.g." not in exit_for(error, settings(tmp_path, batch_size=1))[1]
    assert "(e.g." not in exit_for(error, None)[1]
    fsdp = "; under FSDP, --fsdp_reduce_every_micro_step=true keeps only this GPU's shard of the gradients"
    assert exit_for(error, settings(tmp_path, parallelism="fsdp"))[1].endswith(fsdp)
    every_step = settings(tmp_path, parallelism="fsdp", fsdp_reduce_every_micro_step=True)
    assert fsdp not in exit_for(error, every_step)[1] and fsdp not in line
