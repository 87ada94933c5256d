"""Every error type of this repo. Each one's message is one line: what was wrong and what is allowed or what
to do; the entry points print it after `error: ` and exit with code 2. Also how every command starts
(as_command): output it cannot write is dropped, never a crash, and a stop signal while it starts is one line."""

from __future__ import annotations

import _thread
import os
import signal
import sys
import time


class OneLineError(ValueError):
    """An error whose message is always one line (a multi-line cause is joined)."""

    def __init__(self, message: str = ""):
        super().__init__(" ".join(str(message).splitlines()))


class ConfigError(OneLineError):
    """A bad config file or --key=value override."""


class UsageError(ValueError):
    """Bad input found after the config was read (device, data, checkpoint)."""


class PeerFailed(UsageError):
    """Another rank failed and says why itself; this rank stops as well, without repeating the message."""


class DataError(ValueError):
    """A dataset is missing or broken; the message names the problem and the fix."""


class DataChanged(DataError):
    """A dataset file that a run opened changed under it (replaced, removed, rewritten): the run stops, and saves
    what it trained, all of it on the data as it was opened."""


class CheckpointError(ValueError):
    """A missing, unreadable or mismatched checkpoint, or an out_dir that cannot be used."""


class NonFiniteLogits(ValueError):
    """Generation drew tokens from logits that held NaN or inf (weights that overflow in a low precision)."""


class Stopped(KeyboardInterrupt):
    """A stop signal (SIGTERM, SIGINT or SIGHUP) that arrived before there was anything to save, raised where the
    program was, as Ctrl-C raises KeyboardInterrupt (which it is: what catches Ctrl-C catches it too)."""

    def __init__(self, signum: int):
        self.signum, self.signal_name = signum, signal.Signals(signum).name
        super().__init__(self.signal_name)

    @property
    def exit_code(self) -> int:
        return 128 + self.signum  # a shell's code for death by that signal: 143, 130, 129


# ----------------------------------------------------------------------------------------------
# How a command runs: output it cannot write is dropped, a Ctrl-C nothing caught is one line


class QuietStream:
    """sys.stdout or sys.stderr of a command: a write that fails never raises. The reader may be gone (a closed
    pipe, `| head -1`: EPIPE), the terminal may have gone away (a dropped ssh session: EIO), the file may be on a
    full disk (`> /dev/full`: ENOSPC) or not open for writing (EBADF): the stream then goes to /dev/null for the
    rest of the process (what it still buffers too, so the interpreter's flush at exit does not fail either), and
    `failure` keeps the first error. Everything else is the wrapped stream's."""

    def __init__(self, stream):
        self._stream = stream
        self.failure: OSError | None = None

    def write(self, text):
        try:
            return self._stream.write(text)
        except BlockingIOError:  # a non-blocking stream that is full for now: this write is lost, not the stream
            return len(text)
        except OSError as error:
            self._fail(error)
            return len(text)

    def writelines(self, lines):
        for line in lines:
            self.write(line)

    def flush(self):
        try:
            self._stream.flush()
        except BlockingIOError:
            pass
        except OSError as error:
            self._fail(error)

    def _fail(self, error: OSError) -> None:
        self.failure = self.failure or error
        if not silence(self._stream):  # not a file descriptor (a StringIO): drop it for one that is
            self._stream = open(os.devnull, "w")  # kept open for the rest of the process

    def __getattr__(self, name):
        return getattr(self._stream, name)


def silence(stream) -> bool:
    """Point a failed stream's file descriptor at /dev/null: the rest of what it buffers, and everything written to
    it later, goes nowhere. False when the stream has no file descriptor."""
    try:
        fd = stream.fileno()
    except (OSError, ValueError, AttributeError):  # io.UnsupportedOperation is both an OSError and a ValueError
        return False
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
    finally:
        os.close(devnull)
    try:
        stream.flush()  # what the failed write left in the buffer
    except (OSError, ValueError):
        pass
    return True


def stream_failure(stream) -> OSError | None:
    """The error a QuietStream's output met (None while it is fine, or for any other stream)."""
    return getattr(stream, "failure", None)


def as_command() -> None:
    """The first thing a command runs (in `if __name__ == "__main__":`, before its heavy imports: torch takes
    seconds). stdout and stderr become QuietStreams, so a log line or a result that cannot be written never stops
    the work; standard streams that were closed when the command started are opened on /dev/null (a file the
    command opens must not become its stdout); and a Ctrl-C that main() does not catch (while torch imports) is one
    line, `interrupted`, instead of a KeyboardInterrupt traceback. SIGTERM and SIGHUP, which would end the process
    without a word, raise Stopped until the command takes them itself, and end it the same way: one line, `stopped
    by SIGTERM`, then death by that signal (exit code 143 or 129 to a shell). A signal ignored at start (nohup)
    stays ignored; one whose exception Python would drop (raised inside a weakref callback) is sent again."""
    while True:  # the lowest free descriptor: a closed 0, 1 or 2 is filled, anything above is closed again
        fd = os.open(os.devnull, os.O_RDWR)
        if fd > 2:
            os.close(fd)
            break
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is None:  # closed when the interpreter started: it now has /dev/null
            stream = open(1 if name == "stdout" else 2, "w", closefd=False)
        if not isinstance(stream, QuietStream):
            setattr(sys, name, QuietStream(stream))
    if sys.excepthook is sys.__excepthook__:
        sys.excepthook = _interrupted_quietly
    if sys.unraisablehook is sys.__unraisablehook__:
        sys.unraisablehook = _resend_lost_signal
    for name in ("SIGTERM", "SIGHUP"):
        number = getattr(signal, name, None)
        if number is not None and signal.getsignal(number) is signal.SIG_DFL:
            signal.signal(number, _raise_stopped)


RESEND_DELAY_S = 0.05  # a lost signal is sent again this long after: time for the hook that met it to return


def _raise_stopped(signum, frame):
    raise Stopped(signum)


def _resend_lost_signal(unraisable) -> None:
    """sys.unraisablehook: a signal's exception raised where Python can only print and drop it (a weakref
    callback, such as the import system's module-lock cleanup while torch imports, or a __del__) would lose the
    signal; it is sent again instead, to land in ordinary code. Anything else is printed as Python prints it."""
    error = unraisable.exc_value
    if not isinstance(error, KeyboardInterrupt):
        sys.__unraisablehook__(unraisable)
        return
    signum = error.signum if isinstance(error, Stopped) else signal.SIGINT
    # sent by another thread once this hook has returned: sent from here, it would be handled (and dropped) here.
    # A bare thread, as threading.Timer.start() waits for its thread to run, and under load the signal came
    # during that wait, inside this hook, and was lost again
    _thread.start_new_thread(_send_signal_later, (signum, RESEND_DELAY_S))


def _send_signal_later(signum: int, delay_s: float) -> None:
    time.sleep(delay_s)
    os.kill(os.getpid(), signum)


def _interrupted_quietly(kind, error, trace) -> None:
    """sys.excepthook: a KeyboardInterrupt that nothing caught is one line; the interpreter then ends as Python
    ends on Ctrl-C, killed by SIGINT (exit code 130 to a shell, which then stops a script too). A Stopped by
    another signal ends by that signal instead."""
    if isinstance(error, Stopped) and error.signum != signal.SIGINT:
        print(f"stopped by {error.signal_name}", file=sys.stderr, flush=True)
        signal.signal(error.signum, signal.SIG_DFL)
        os.kill(os.getpid(), error.signum)
    elif issubclass(kind, KeyboardInterrupt):
        print("interrupted", file=sys.stderr, flush=True)
    else:
        sys.__excepthook__(kind, error, trace)
