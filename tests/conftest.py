"""Shared fixtures for the training-path tests: a tiny char dataset, a tiny model's command line, a trained
checkpoint, and helpers to run train.py in a subprocess (for kills and signals) or in-process (for speed)."""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import random
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

# A model small enough that one step takes milliseconds on a 2-core CPU.
TINY_MODEL = ("--n_layer=2", "--n_head=2", "--n_embd=32", "--block_size=16", "--batch_size=4", "--eval_iters=2",
              "--log_interval=1", "--device=cpu", "--compile=false")


def tiny_text(num_lines: int = 600) -> str:
    """~25 KB of deterministic play-like text: ~30 distinct chars, so the char vocab is small."""
    rng = random.Random(0)
    words = ("the king queen lord lady sword crown night day love death speak thou art my good sir "
             "what and with not be to of").split()
    speakers = ("ROMEO:", "JULIET:", "HAMLET:")
    lines = []
    for i in range(num_lines):
        if i % 5 == 0:
            lines.append(rng.choice(speakers))
        lines.append(" ".join(rng.choice(words) for _ in range(rng.randint(4, 9))) + rng.choice(".,!?"))
    return "\n".join(lines) + "\n"


def tiny_args(data_dir, out_dir, *extra: str) -> list[str]:
    """train.py's argv for the tiny model on `data_dir`, checkpoints in `out_dir`; `extra` overrides come last."""
    return [f"--data_dir={data_dir}", f"--out_dir={out_dir}", *TINY_MODEL, *extra]


def subprocess_env() -> dict:
    # One thread: faster for a model this small, and no spinning OpenMP threads when other test processes
    # share the 2 cores. Every subprocess run gets the same, so their losses can be compared bit for bit.
    return {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


def run_script(script: str, args: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    """`python <script> args` from the repo root; stdout and stderr captured separately."""
    return subprocess.run([sys.executable, script, *args], cwd=REPO, env=subprocess_env(), capture_output=True,
                          text=True, timeout=timeout)


class Child:
    """`python <script> args` in the background, stdout and stderr merged into a one-page pipe that is read
    one byte at a time: nothing past the line just returned leaves the pipe, so a child that keeps printing
    blocks after ~4 KB more output until it is read again. That bounds how far a child can run on between
    "the line we waited for" and the signal sent after it, whatever the load on the machine."""

    def __init__(self, script: str, args: list[str], pipe_size: int = 4096):
        read_end, write_end = os.pipe()
        try:
            fcntl.fcntl(write_end, fcntl.F_SETPIPE_SZ, pipe_size)
            self.proc = subprocess.Popen([sys.executable, script, *args], cwd=REPO, env=subprocess_env(),
                                         stdout=write_end, stderr=subprocess.STDOUT)
        finally:
            os.close(write_end)
        self.fd, self.lines = read_end, []

    @property
    def pid(self) -> int:
        return self.proc.pid

    def output(self) -> str:
        return "".join(self.lines)

    def readline(self, deadline: float) -> str:
        """The next line ('' at end of output); AssertionError once `deadline` (time.monotonic) passes."""
        line = bytearray()
        while not line.endswith(b"\n"):
            if not select.select([self.fd], [], [], max(0.0, deadline - time.monotonic()))[0]:
                raise AssertionError("timed out waiting for output; so far:\n" + self.output() + line.decode())
            byte = os.read(self.fd, 1)
            if not byte:
                break
            line += byte
        text = line.decode("utf-8", errors="replace")
        if text:
            self.lines.append(text)
        return text

    def wait_for(self, predicate, timeout: float = 120) -> str:
        """Read lines until one satisfies `predicate` and return it; fail if the output ends first."""
        deadline = time.monotonic() + timeout
        while line := self.readline(deadline):
            if predicate(line):
                return line
        self.proc.wait(timeout=10)
        raise AssertionError(f"process exited ({self.proc.returncode}) before the expected line; output:\n"
                             + self.output())

    def finish(self, timeout: float = 120) -> tuple[int, str]:
        """Read to the end of the output, wait for the exit; (exit code, whole output)."""
        deadline = time.monotonic() + timeout
        while self.readline(deadline):
            pass
        return self.proc.wait(timeout=max(1.0, deadline - time.monotonic())), self.output()

    def close(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def tree_digest(*roots: Path) -> dict[str, tuple[str, int]]:
    """{path: (sha256, mtime_ns)} of every file under roots: equal digests mean nothing on disk changed."""
    digest = {}
    for root in roots:
        root = Path(root)
        files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
        for path in files:
            digest[str(path)] = (hashlib.sha256(path.read_bytes()).hexdigest(), path.stat().st_mtime_ns)
        for path in (sorted(p for p in root.rglob("*") if p.is_dir()) if root.is_dir() else []):
            digest[str(path)] = ("dir", 0)
    return digest


@contextlib.contextmanager
def process_state_restored():
    """train.train() installs SIGTERM/SIGINT handlers and reconfigures the root logger; undo both, so an
    in-process run does not change how this pytest process reacts to Ctrl-C or where later logs go."""
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    root = logging.getLogger()
    root_handlers, root_level = root.handlers[:], root.level
    try:
        yield
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        root.handlers[:] = root_handlers
        root.setLevel(root_level)


@contextlib.contextmanager
def one_torch_thread():
    """In-process runs of the tiny model on one thread, like the subprocesses (see subprocess_env)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


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
    (8, which earlier tests may have used up) torch.compile silently falls back to eager. Patched through
    dynamo's own config.patch: pytest's monkeypatch cannot undo a torch config attribute cleanly."""
    import torch._dynamo

    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    with config.patch(**{name: max(64, getattr(config, name))}):
        yield


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
    with process_state_restored(), one_torch_thread(), open(os.devnull, "w") as sink, \
            contextlib.redirect_stdout(sink):
        code = train.main(tiny_args(char_data, out, "--max_iters=4", "--eval_interval=2",
                                    "--always_save_checkpoint=true"))
    assert code == 0
    assert (out / "ckpt.pt").is_file()
    return out
