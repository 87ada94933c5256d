"""Output that cannot be written never stops the work. A terminal that goes away (EIO, and SIGHUP when it was the
controlling one), a closed pipe (EPIPE), a full disk (ENOSPC) and a descriptor not open for writing (EBADF), on
stdout or on stderr: train.py drops its log lines and trains on, and on SIGHUP saves and exits 0; sample.py stops
quietly when nobody reads any more, and says in one line why when its samples cannot be stored."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import io
import multiprocessing.connection
import os
import re
import select
import signal
import subprocess
import sys
import tempfile
import termios
import time

import pytest

from helpers import (
    REPO,
    WarmProcess,
    fresh_sys_path,
    run_as_main,
    subprocess_env,
    terminal_signals,
    tiny_args,
    warm_context,
)
from storage.checkpoint import checkpoint_names
from training.runtime import emit
from weights.load import load_checkpoint

SEPARATOR = "---------------"
KINDS = ("EPIPE", "EIO", "ENOSPC", "EBADF")
BAD_OUTPUT = ("Traceback", "Logging error", "Exception ignored", "OSError", "BrokenPipeError")  # a failed write's trail


@contextlib.contextmanager
def failing_fd(kind: str):
    """A file descriptor whose every write fails with errno `kind`: a pipe whose reader is gone (EPIPE), a
    pseudo-terminal whose other side was closed (EIO), /dev/full (ENOSPC), /dev/null opened read-only (EBADF)."""
    if kind == "EPIPE":
        read_end, fd = os.pipe()
        os.close(read_end)
    elif kind == "EIO":
        master, fd = os.openpty()
        os.close(master)
    elif kind == "ENOSPC":
        fd = os.open("/dev/full", os.O_WRONLY)
    else:
        fd = os.open(os.devnull, os.O_RDONLY)
    try:
        with pytest.raises(OSError) as failed:
            os.write(fd, b"x")
        assert failed.value.errno == getattr(errno, kind)
        yield fd
    finally:
        os.close(fd)


def run_warm(script: str, args: list[str], stdout_fd: int, stderr_fd: int, timeout: float = 120) -> int:
    """`python <script> args`, forked from the warm interpreter, with the given stdout and stderr; its exit code."""
    process = WarmProcess(script, args, stdout_fd, stderr_fd)
    try:
        return process.wait(timeout)
    finally:
        process.kill()  # if it ran past the timeout


def read_file(file) -> str:
    file.seek(0)
    return file.read().decode(errors="replace")


def assert_clean(text: str):
    assert not any(bad in text for bad in BAD_OUTPUT), text


# ---- train.py: log lines dropped, the run trains on and saves ----


@pytest.mark.parametrize("stream", ["stdout", "stderr"])
@pytest.mark.parametrize("kind", KINDS)
def test_train_trains_on_and_saves_whatever_way_a_stream_fails(char_data, tmp_path, kind, stream, warm_interpreter):
    """The failing stream is broken from the first write; the other is a file read afterwards: it has no traceback
    and no logging error, and the run trains to max_iters, saves and exits 0."""
    out = tmp_path / "out"
    args = tiny_args(char_data, out, "--max_iters=6", "--eval_interval=3")
    with failing_fd(kind) as broken, tempfile.TemporaryFile() as good:
        fds = (broken, good.fileno()) if stream == "stdout" else (good.fileno(), broken)
        code = run_warm("train.py", args, *fds)
        other = read_file(good)
    assert code == 0, other
    assert_clean(other)
    if stream == "stderr":  # the log is whole, down to the last line
        assert re.search(rf"^saved {re.escape(str(out / 'ckpt.pt'))} \(iter 6, ", other.splitlines()[-1]), other
    else:
        assert f"note: stdout could not be written ({os.strerror(getattr(errno, kind))})" in other or kind == "EPIPE"
    assert load_checkpoint(out / "ckpt.pt")["iter_num"] == 6
    assert not (out / ".lock").exists()


def test_train_to_dev_full_in_a_fresh_interpreter_trains_and_saves(char_data, tmp_path):
    """`python train.py ... > /dev/full`, a fresh interpreter from start to exit, with stdout block-buffered as a
    file is (no PYTHONUNBUFFERED): what the interpreter flushes at exit must not fail either. stderr's last line
    says why the log is missing and what was saved."""
    out = tmp_path / "out"
    env = {key: value for key, value in subprocess_env().items() if key != "PYTHONUNBUFFERED"}
    args = tiny_args(char_data, out, "--max_iters=4", "--eval_interval=2")
    with open("/dev/full", "w") as full, terminal_signals():
        done = subprocess.run(
            [sys.executable, "train.py", *args], cwd=REPO, env=env, stdout=full, stderr=subprocess.PIPE, timeout=120
        )
    err = done.stderr.decode()
    assert done.returncode == 0, err
    assert_clean(err)
    last = err.splitlines()[-1]
    assert last.startswith("note: stdout could not be written (No space left on device)"), err
    assert f"out_dir {out} holds best.pt, ckpt-0000002.pt, ckpt-0000004.pt, ckpt.pt" in last, err
    assert load_checkpoint(out / "ckpt.pt")["iter_num"] == 4


# ---- a real pseudo-terminal that goes away ----


def _run_on_terminal(script: str, args: list[str], slave, path: tuple[str, ...]):
    """In a child of the warm interpreter: become a session leader whose controlling terminal is `slave`, as a
    login shell's command is, with stdout and stderr on it; then run the script (helpers.run_as_main)."""
    os.setsid()
    fcntl.ioctl(slave.fileno(), termios.TIOCSCTTY, 0)
    outputs = [multiprocessing.connection.Connection(os.dup(slave.fileno()), readable=False) for _ in range(2)]
    slave.close()
    run_as_main(script, args, *outputs, path)


class OnTerminal:
    """`python <script> args` on a new pseudo-terminal, its controlling terminal, forked from the warm interpreter;
    the test holds the terminal's other side (master) and reads what the script writes."""

    def __init__(self, script: str, args: list[str]):
        self.master, slave = os.openpty()
        try:
            terminal = multiprocessing.connection.Connection(os.dup(slave), writable=False)
            self.process = warm_context().Process(
                target=_run_on_terminal, args=(script, list(args), terminal, fresh_sys_path()), name=script
            )
            self.process.start()
            terminal.close()
        finally:
            os.close(slave)
        self.output = ""

    def read_until(self, text: str, timeout: float = 120) -> str:
        deadline = time.monotonic() + timeout
        while text not in self.output:
            if not select.select([self.master], [], [], max(0.0, deadline - time.monotonic()))[0]:
                raise AssertionError(f"timed out waiting for {text!r}; so far:\n{self.output}")
            try:
                chunk = os.read(self.master, 1024)
            except OSError:  # EIO: every process let go of the terminal
                chunk = b""
            if not chunk:
                raise AssertionError(f"the output ended before {text!r}:\n{self.output}")
            self.output += chunk.decode(errors="replace").replace("\r\n", "\n")
        return self.output

    def hang_up(self, timeout: float = 120) -> int:
        """Close the terminal, as a dropped ssh session does (the kernel sends SIGHUP to the session's leader,
        and every later write to the terminal fails with EIO); the exit code."""
        os.close(self.master)
        self.master = None
        self.process.join(timeout)
        assert self.process.exitcode is not None, "still running after its terminal closed"
        return self.process.exitcode

    def close(self):
        if self.master is not None:
            os.close(self.master)
        if self.process.exitcode is None:
            self.process.kill()
            self.process.join()


def test_train_on_a_terminal_that_closes_saves_and_exits_0(char_data, tmp_path, warm_interpreter):
    """The issue's case: train.py on a terminal, which closes after `iter 3`. The hang-up's SIGHUP stops the run
    at the end of its step, and every line after (the step's log line, the signal's own `saved` line) meets EIO:
    it saves that step and exits 0, and its out_dir holds the checkpoint and no lock."""
    out = tmp_path / "out"
    terminal = OnTerminal("train.py", tiny_args(char_data, out, "--max_iters=100000", "--eval_interval=100000"))
    try:
        terminal.read_until("iter 3 |")
        code = terminal.hang_up()
    finally:
        terminal.close()
    assert code == 0, terminal.output
    assert load_checkpoint(out / "ckpt.pt")["iter_num"] >= 3
    assert sorted(path.name for path in out.iterdir()) == checkpoint_names(out)  # no .lock, nothing half-written


def test_sample_on_a_terminal_that_closes_stops_like_ctrl_c(trained_out, warm_interpreter):
    """sample.py on a terminal that closes after the first sample: the SIGHUP stops it as Ctrl-C does (exit
    code 129, a shell's code for SIGHUP; what it would print goes nowhere), with nothing raised at the dead
    terminal."""
    args = [f"--out_dir={trained_out}", "--device=cpu", "--num_samples=1000", "--max_new_tokens=200"]
    terminal = OnTerminal("sample.py", args)
    try:
        terminal.read_until(f"\n{SEPARATOR}\n")
        code = terminal.hang_up()
    finally:
        terminal.close()
    assert code == 128 + signal.SIGHUP, terminal.output


# ---- sample.py: nobody reads any more (quiet, 0), or the samples cannot be stored (one line, 2) ----


@pytest.mark.parametrize("kind", KINDS)
def test_sample_with_a_stdout_that_fails(trained_out, kind, warm_interpreter):
    """A closed pipe or a closed terminal: nobody reads, so it stops quietly with 0 (the README's `| head -1`).
    A full disk or a descriptor not open for writing: the samples are lost, so one `error:` line says why, exit
    code 2. Never a traceback."""
    args = [f"--out_dir={trained_out}", "--device=cpu", "--num_samples=2", "--max_new_tokens=10"]
    with failing_fd(kind) as broken, tempfile.TemporaryFile() as stderr:
        code = run_warm("sample.py", args, broken, stderr.fileno())
        err = read_file(stderr)
    lines = [line for line in err.splitlines() if not line.startswith("INFO: ")]
    if kind in ("EPIPE", "EIO"):
        assert code == 0 and lines == [], err
    else:
        assert code == 2, err
        reason = os.strerror(getattr(errno, kind))
        assert lines == [f"error: the samples could not be written to stdout ({reason}); nothing more was generated"]
    assert "Traceback" not in err


@pytest.mark.parametrize("kind", KINDS)
def test_sample_with_a_stderr_that_fails_prints_every_sample(trained_out, kind, warm_interpreter):
    args = [f"--out_dir={trained_out}", "--device=cpu", "--num_samples=2", "--max_new_tokens=10"]
    with failing_fd(kind) as broken, tempfile.TemporaryFile() as stdout:
        code = run_warm("sample.py", args, stdout.fileno(), broken)
        out = read_file(stdout)
    assert code == 0, out
    assert out.count(f"\n{SEPARATOR}\n") == 2, out


def test_sample_to_dev_full_in_a_fresh_interpreter_is_one_line(trained_out):
    """A fresh interpreter, stdout block-buffered as a file is: the failure may first show at a flush, or at exit."""
    env = {key: value for key, value in subprocess_env().items() if key != "PYTHONUNBUFFERED"}
    args = [f"--out_dir={trained_out}", "--device=cpu", "--num_samples=2", "--max_new_tokens=10"]
    with open("/dev/full", "w") as full:
        done = subprocess.run(
            [sys.executable, "sample.py", *args], cwd=REPO, env=env, stdout=full, stderr=subprocess.PIPE, timeout=120
        )
    lines = [line for line in done.stderr.decode().splitlines() if not line.startswith("INFO: ")]
    assert done.returncode == 2 and len(lines) == 1, done.stderr.decode()
    assert lines[0].startswith("error: the samples could not be written to stdout (No space left on device)")


def emit_lines(tag: str, output, together) -> None:
    """In a child of the warm interpreter: stdout on `output`, unbuffered as PYTHONUNBUFFERED makes it; once the
    other child is ready too (`together`, a barrier), 20000 lines through emit."""
    os.dup2(output.fileno(), 1)
    output.close()
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
    together.wait(60)
    for i in range(20000):
        emit(f"{tag} {i} " + "x" * 50)


def test_lines_of_processes_sharing_an_output_stay_whole(tmp_path, warm_interpreter):
    """Ranks and torchrun write to one output. Unbuffered (PYTHONUNBUFFERED, as in these tests and many launches),
    print writes a line's text and its newline apart, and another process's line can land between them; emit
    writes each line at once. Two processes, 20000 lines each at the same time, one file: every line is whole."""
    together = warm_context().Barrier(2)
    with open(tmp_path / "out", "w") as shared:
        runs = []
        for tag in "AB":
            output = multiprocessing.connection.Connection(os.dup(shared.fileno()), readable=False)
            runs.append(warm_context().Process(target=emit_lines, args=(tag, output, together)))
            runs[-1].start()
            output.close()
        for run in runs:
            run.join(120)
            run.kill()  # if it ran past the timeout
        assert [run.exitcode for run in runs] == [0, 0]
    lines = (tmp_path / "out").read_text().splitlines()
    assert len(lines) == 40000 and all(re.fullmatch(r"[AB] \d+ x{50}", line) for line in lines), lines[:20]
