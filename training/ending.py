"""A run's last words. However a run ends, its last line says why and what out_dir holds, so that a user knows
what is on disk without looking: the checkpoint it saved, the one it kept when the last state was not finite, the
one a stop signal saved, or that it saved nothing. A run that fails says so in one line with its exit code
(exit_for: main's table of the ways a run can fail)."""

from __future__ import annotations

import errno
import logging
import math
import sys
from pathlib import Path

import torch

from data.loader import Batches
from errors import CheckpointError, ConfigError, DataChanged, DataError, PeerFailed, Stopped, UsageError, stream_failure
from storage.checkpoint import BEST, LATEST, checkpoint_names
from training.preflight import evaluated_weights
from training.progress import TrainState
from training.runtime import emit
from training.state import write_checkpoint

log = logging.getLogger("train")


def out_dir_state(out_dir, unchanged: bool = True) -> str:
    """What out_dir holds (unchanged: and that this run wrote none of it), for a run's last words."""
    path = Path(out_dir)
    if not path.is_dir():
        return f"out_dir {path} does not exist"
    names = checkpoint_names(path)
    return f"out_dir {path} holds " + (
        ", ".join(names) + (", unchanged" if unchanged else "") if names else "no checkpoint"
    )


def on_disk(state: TrainState) -> str:
    """What out_dir holds of this run, for the last words of a run that could not save its last state."""
    latest = Path(state.cfg.out_dir) / LATEST
    if state.ckpt_iter is None:
        return "this run saved no checkpoint" + (
            f" ({latest} is an earlier run's, unchanged)" if latest.exists() else ""
        )
    if state.ckpt_iter == state.resumed_iter:
        return f"{latest} still holds iter {state.ckpt_iter}, the checkpoint this run resumed from"
    return f"{latest} holds iter {state.ckpt_iter}, the last state this run saved"


# ----------------------------------------------------------------------------------------------
# At an evaluation: saved, or why not


def unsafe_to_save(state: TrainState, losses: dict[str, float]) -> str:
    """Why the current state must not become a checkpoint ('' when it may): a non-finite eval loss, or skipped
    non-finite steps just before (the same answer on every rank)."""
    if not (math.isfinite(losses["train"]) and math.isfinite(losses["val"])):
        return f"the eval loss is not finite (train {losses['train']:.4f}, val {losses['val']:.4f})"
    bad_streak = state.stop.bad_streak_now()
    if bad_streak:
        return f"the last {bad_streak} step(s) had non-finite loss or gradients"
    return ""


def say_not_saved(state: TrainState, why_not: str, final: bool) -> None:
    """At max_iters (final) the run's last words, on stderr; before it a warning, and the run goes on."""
    if not state.runtime.master:
        return
    line = f"not saving iter {state.iter_num}: {why_not}; {on_disk(state)}"
    if final:
        emit(line, file=sys.stderr)
    else:
        log.warning(line)


def say_saved(state: TrainState, path: Path, val_loss: float, previous_best: float, improved: bool) -> None:
    """The line of a checkpoint written at an evaluation; one not below the best says where the best is."""
    if not state.runtime.master:
        return
    note = ""
    if not improved:  # the last iteration's state, saved although it is not the best
        best = Path(state.cfg.out_dir) / BEST
        note = (
            f"; not below the best val {previous_best:.4f}, which {best} keeps"
            if best.exists()
            else f"; val never went below {previous_best:.4f}, the starting loss, so there is no {best}"
        )
    emit(f"saved {path} (iter {state.iter_num}, val {val_loss:.4f}{note})")


# ----------------------------------------------------------------------------------------------
# The loop's ends: non-finite steps, a stop signal, nothing to save


def too_many_bad_steps(state: TrainState, bad_streak: int) -> bool:
    """Warn about skipped non-finite steps; True (after saying why) once there were max_bad_steps in a row."""
    cfg, master = state.cfg, state.runtime.master
    if master:
        log.warning(
            f"iter {state.iter_num - 1}: loss or gradients not finite for {bad_streak} consecutive "
            f"step(s); those steps were skipped"
        )
    if bad_streak < cfg.max_bad_steps:
        return False
    if master:
        emit(
            f"stopping at iter {state.iter_num}: {bad_streak} consecutive steps with non-finite loss or "
            f"gradients (max_bad_steps={cfg.max_bad_steps}); {on_disk(state)}",
            file=sys.stderr,
        )
    return True


def save_and_exit_on_signal(state: TrainState, batches: Batches, meta: dict) -> int:
    """Save (unless the last steps were non-finite: then say what is on disk) and return the exit code."""
    signal_name = state.stop.signal_name or "a stop signal"  # another rank may have got it
    bad_streak = state.stop.bad_streak_now()
    if bad_streak:
        if state.runtime.master:
            emit(
                f"received {signal_name}; not saving iter {state.iter_num}: the last {bad_streak} step(s) had "
                f"non-finite loss or gradients; {on_disk(state)}; exiting",
                file=sys.stderr,
            )
        return 1
    path = write_checkpoint(state, batches, meta, is_best=False)
    if state.runtime.master:
        emit(f"received {signal_name}; saved {path} at iter {state.iter_num}; exiting")
    return 0


def save_and_exit_on_data_change(state: TrainState, batches: Batches, meta: dict, change: DataChanged) -> int:
    """Save what the run trained (every step of it on the data as it was opened), say what changed; exit code 2."""
    saved = ""
    if state.iter_num not in (0, state.ckpt_iter, state.resumed_iter) and not state.stop.bad_streak_now():
        saved = f"saved {write_checkpoint(state, batches, meta, is_best=False)} at iter {state.iter_num}"
    if state.runtime.master:
        emit(f"error: {change}; {saved or on_disk(state)}; exiting", file=sys.stderr)
    return 2


def say_if_nothing_saved(state: TrainState, code: int) -> None:
    """The last line of a run that ends well without a checkpoint of its last iteration; said once out_dir is let
    go of, so that it is what out_dir holds now (a run that saved said so last)."""
    saved_last = state.ckpt_iter == state.iter_num and state.resumed_iter != state.iter_num
    if code == 0 and state.runtime.master and not saved_last:
        emit(nothing_saved(state))


def nothing_saved(state: TrainState) -> str:
    """Why a run saved nothing (eval_only, max_iters=0, or resumed at max_iters already) and what is on disk."""
    cfg, it = state.cfg, state.iter_num
    if cfg.eval_only:
        return f"eval_only: evaluated {evaluated_weights(cfg, state.resumed_iter)}; no checkpoint written"
    if state.resumed_iter is not None and it == state.resumed_iter:
        return (
            f"nothing to train: resumed at iter {it} and max_iters={cfg.max_iters}; no checkpoint written; "
            f"{Path(cfg.out_dir) / LATEST} still holds iter {it}"
        )
    return f"max_iters={cfg.max_iters}: no step taken, no checkpoint written; {out_dir_state(cfg.out_dir)}"


# ----------------------------------------------------------------------------------------------
# main's table: how a run that failed ends


# what main() turns into an exit code and one line; anything else is a bug, and its traceback is the report
RUN_FAILURES = (ConfigError, DataError, CheckpointError, UsageError, KeyboardInterrupt, torch.cuda.OutOfMemoryError)


def exit_for(error: BaseException, cfg) -> tuple[int, str]:
    """The exit code and the last line ('' for none) of a run that one of RUN_FAILURES ended; cfg is None while
    the settings are read. The order matters: PeerFailed is a UsageError, Stopped a KeyboardInterrupt."""
    if isinstance(error, PeerFailed):  # another rank failed and printed why
        return 2, ""
    if isinstance(error, Stopped):  # a signal during start-up: nothing trained
        where = f"; {out_dir_state(cfg.out_dir)}" if cfg is not None else ""
        return error.exit_code, (
            f"received {error.signal_name} during start-up, before the first step: nothing saved{where}"
        )
    if isinstance(error, KeyboardInterrupt):  # Ctrl-C before train() took the signals (reading the config)
        return 130, "interrupted before training started: nothing saved"
    if isinstance(error, torch.cuda.OutOfMemoryError):
        return 2, out_of_memory_line(cfg)
    return 2, f"error: {error}"  # ConfigError, DataError, CheckpointError, UsageError: the user's to fix


def out_of_memory_line(cfg) -> str:
    example = ""
    if cfg is not None and cfg.batch_size > 1:
        example = (
            f" (e.g. --batch_size={cfg.batch_size // 2} "
            f"--gradient_accumulation_steps={cfg.gradient_accumulation_steps * 2})"
        )
    # FSDP accumulating without a reduce-scatter each micro-step holds every gradient whole in float32
    sharded = cfg is not None and cfg.parallelism == "fsdp" and not cfg.fsdp_reduce_every_micro_step
    fsdp = (
        "; under FSDP, --fsdp_reduce_every_micro_step=true keeps only this GPU's shard of the gradients"
        if sharded
        else ""
    )
    return (
        f"error: CUDA out of memory; lower --batch_size and raise --gradient_accumulation_steps by the same "
        f"factor{example}: same tokens per step, less memory; or shorten --block_size{fsdp}"
    )


def say_if_stdout_lost(out_dir) -> None:
    """A run whose log lines could not be written (a full disk, ...) says so on stderr, and what out_dir holds;
    a closed pipe (`| head`) is the user's choice and goes unsaid."""
    lost = stream_failure(sys.stdout)
    if lost is not None and lost.errno != errno.EPIPE:
        emit(
            f"note: stdout could not be written ({lost.strerror or lost}), so the log lines were dropped; "
            f"the run went on: {out_dir_state(out_dir, unchanged=False)}",
            file=sys.stderr,
        )
