"""train.py as a subprocess: its command (plain or under torchrun), a run to its end, to a logged iteration or
to a timeout (nothing it started left running), and its iter lines parsed."""

from __future__ import annotations

import contextlib
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# ----------------------------------------------------------------------------------------------
# train.py's log lines (training/progress.py's format_log_line)

LOG_LINE = re.compile(  # group names: the keys of parse_log_line's dict
    r"iter (?P<iter>\d+) \| loss (?P<loss>\S+) \| lr (?P<lr>\S+) \| (?P<ms_per_iter>[\d.]+) ms \| "
    r"(?P<tokens_per_sec>[\d,]+) tok/s \| MFU (?P<mfu>[\d.]+%|n/a) \| mem (?P<mem_gib>[\d.]+) GiB"
)


def parse_log_line(line: str) -> dict | None:
    """The fields of one train.py log line (format_log_line), or None if the line is not one."""
    match = LOG_LINE.search(line)
    if match is None:
        return None
    fields = {key: float(text.replace(",", "").rstrip("%")) for key, text in match.groupdict().items() if text != "n/a"}
    fields["iter"] = int(fields["iter"])
    fields["mfu"] = fields["mfu"] / 100 if "mfu" in fields else None  # n/a: no peak FLOP/s known for the device
    return fields


def log_lines(output: str) -> list[dict]:
    """Every iter line of a run's output, parsed."""
    return [parsed for line in output.splitlines() if (parsed := parse_log_line(line))]


def failure_line(output: str) -> str:
    """What a failed run said: its last `error:` line, else the last exception line of a traceback, else its last
    line that is not torchrun's ==== or ---- rule. A timeout says how far the run had got."""
    lines = [line.strip() for line in output.splitlines() if line.strip().strip("=-")]
    if len(lines) > 1 and lines[-1].startswith("timed out after"):
        return f"{lines[-1]}; last output: {lines[-2]}"[:200]
    errors = [line for line in lines if line.startswith("error:")]
    exceptions = [line for line in lines if re.match(r"^(\[rank\d+\]:)?\s*[\w.]*(Error|Exception)\b.*:", line)]
    return ((errors or exceptions or lines or ["(no output)"])[-1])[:200]


# ----------------------------------------------------------------------------------------------
# The command, and running it


def flags(settings: dict) -> list[str]:
    """train.py's --key=value for each setting."""
    return [f"--{key}={value}" for key, value in settings.items()]


def train_command(settings: Sequence[str], torchrun: Sequence[str] | None = None) -> list[str]:
    """`python train.py settings`, or under torchrun with its options (e.g. --standalone --nproc_per_node=4)."""
    launcher = [sys.executable] if torchrun is None else [sys.executable, "-m", "torch.distributed.run", *torchrun]
    return [*launcher, "train.py", *settings]


def corpus(folder: Path, longest: int = 0) -> Path:
    """A char-level dataset of this repo's own sources (no network needed on the GPU host), repeated until its
    validation split (a tenth) holds sequences of `longest` tokens; one folder per number of copies."""
    from data.common import prepare_text

    text = "".join(p.read_text(errors="replace") for p in sorted(ROOT.glob("**/*.py")) + sorted(ROOT.glob("*.md")))
    copies = max(4, math.ceil(10 * (longest + 2) / len(text)) + 1)
    folder = folder if copies == 4 else folder.with_name(f"{folder.name}-{copies}x")
    if not (folder / "meta.json").exists():
        prepare_text(text * copies, folder, "char")
    return folder


@dataclass
class Run:
    """A finished run: exit code (124 past its timeout; 0 once stopped at the iteration waited for), stdout and
    stderr together, seconds."""

    code: int
    output: str
    seconds: float

    @property
    def lines(self) -> list[dict]:
        return log_lines(self.output)


class Launch:
    """A command started in the repo root now, stdout and stderr read together."""

    def __init__(self, command: list[str], env: dict | None = None):
        self.start = time.perf_counter()
        pipe = dict(stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # stdout and stderr as one text
        self.process = subprocess.Popen(command, cwd=ROOT, env=env, **pipe)

    def wait(self, timeout: float | None = None, stop_at_iter: int | None = None) -> Run:
        """Its end; or, once it logs iteration stop_at_iter, it is stopped (exit code 0: a probe has its answer,
        and the final checkpoint of a model of billions of parameters is not worth its minutes); or past
        `timeout` seconds from now, killed (124). Either way nothing it started is left running."""
        timer = threading.Timer(timeout or 0, kill_tree, [self.process.pid])
        if timeout is not None:
            timer.start()
        lines, reached = [], False
        try:
            for line in self.process.stdout:
                lines.append(line)
                parsed = parse_log_line(line) if stop_at_iter is not None else None
                if parsed and parsed["iter"] >= stop_at_iter:
                    reached = True
                    kill_tree(self.process.pid)
                    break
        except BaseException:  # the bench itself stopped (Ctrl-C, SIGTERM): its runs stop too, saying where they were
            kill_tree(self.process.pid)
            print("".join(f"  | {line}" for line in lines[-8:]), end="", file=sys.stderr)
            raise
        lines += self.process.stdout.readlines()
        self.process.wait()
        timed_out = timeout is not None and not timer.is_alive() and not reached
        timer.cancel()
        code = 0 if reached else 124 if timed_out else self.process.returncode
        output = "".join(lines) + (f"\ntimed out after {timeout} s" if timed_out else "")
        return Run(code, output, time.perf_counter() - self.start)


def run(command: list[str], env: dict | None = None, timeout: float | None = None, stop_at_iter=None) -> Run:
    """Start a command and wait for it (Launch.wait)."""
    return Launch(command, env).wait(timeout, stop_at_iter)


def kill_tree(pid: int) -> None:
    """SIGKILL a process and all its descendants: torchrun starts each worker in a session of its own, so killing
    torchrun alone would leave them holding their GPUs."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    family = [pid]
    for member in family:  # the list grows as it is walked: each member's children join it
        family += children.get(member, [])
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(member, signal.SIGKILL)
