"""Helpers shared by the tests: a tiny model's command line and config, a tiny text, running train.py in a
subprocess (for kills and signals) or in-process (for speed), and digests of what is on disk."""

from __future__ import annotations

import ast
import contextlib
import fcntl
import functools
import hashlib
import io
import logging
import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver
import os
import random
import resource
import runpy
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from unittest import mock

REPO = Path(__file__).resolve().parents[1]

# A model small enough that one step takes milliseconds on a 2-core CPU.
TINY_MODEL = (
    "--n_layer=2",
    "--n_head=2",
    "--n_embd=32",
    "--block_size=16",
    "--batch_size=4",
    "--eval_iters=2",
    "--log_interval=1",
    "--device=cpu",
    "--compile=false",
)


def tiny_text(num_lines: int = 600) -> str:
    """~25 KB of deterministic play-like text: ~30 distinct chars, so the char vocab is small."""
    rng = random.Random(0)
    words = (
        "the king queen lord lady sword crown night day love death speak thou art my good sir "
        "what and with not be to of"
    ).split()
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


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _swallow(signum, frame):
    pass


@contextlib.contextmanager
def terminal_signals():
    """Children started inside get SIGINT, SIGTERM and SIGHUP as a command typed at a terminal does, whatever
    this process inherited. Under `nohup`, or as a shell script's background job (`pytest &` starts with SIGINT
    ignored), this process ignores them, and SIG_IGN survives exec: a child would never see the signal a test
    sends it. Meanwhile this process swallows them in a handler of its own instead, which exec resets to the
    default: the same for this process, the default for its children."""
    ignored = []
    if threading.current_thread() is threading.main_thread():  # only the main thread may set handlers
        ignored = [sig for sig in STOP_SIGNALS if signal.getsignal(sig) is signal.SIG_IGN]
    for sig in ignored:
        signal.signal(sig, _swallow)
    try:
        yield
    finally:
        for sig in ignored:
            signal.signal(sig, signal.SIG_IGN)


def run_script(script: str, args: list[str], timeout: float = 120, warm: bool = False) -> subprocess.CompletedProcess:
    """`python <script> args` from the repo root; stdout and stderr captured separately. warm=True: forked from
    the warm interpreter (WarmProcess) instead of started afresh."""
    command = [sys.executable, script, *args]
    if not warm:
        with terminal_signals():
            return subprocess.run(
                command, cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=timeout
            )
    with tempfile.TemporaryFile() as stdout, tempfile.TemporaryFile() as stderr:
        process = WarmProcess(script, args, stdout.fileno(), stderr.fileno())
        try:
            code = process.wait(timeout)
        finally:
            process.kill()  # if it ran past the timeout
        stdout.seek(0), stderr.seek(0)
        return subprocess.CompletedProcess(command, code, stdout.read().decode(), stderr.read().decode())


class Child:
    """`python <script> args` in the background, stdout and stderr merged into a one-page pipe that is read
    one byte at a time: nothing past the line just returned leaves the pipe, so a child that keeps printing
    blocks after ~4 KB more output until it is read again. That bounds how far a child can run on between
    "the line we waited for" and the signal sent after it, whatever the load on the machine.

    warm=True: forked from the warm interpreter (WarmProcess, with `environ` added to its environment) instead of
    started afresh."""

    def __init__(self, script: str, args: list[str], pipe_size: int = 4096, warm: bool = False, environ=None):
        read_end, write_end = os.pipe()
        try:
            fcntl.fcntl(write_end, fcntl.F_SETPIPE_SZ, pipe_size)
            if warm:
                self.proc = WarmProcess(script, args, write_end, write_end, environ)
            else:
                with terminal_signals():
                    self.proc = subprocess.Popen(
                        [sys.executable, script, *args],
                        cwd=REPO,
                        env=subprocess_env(),
                        stdout=write_end,
                        stderr=subprocess.STDOUT,
                    )
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
        raise AssertionError(
            f"process exited ({self.proc.returncode}) before the expected line; output:\n" + self.output()
        )

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


# What a train.py or sample.py start spends its seconds importing: the warm interpreter imports it once.
WARM_IMPORTS = ("train", "sample", "torch._dynamo")


@functools.cache
def warm_context() -> multiprocessing.context.BaseContext:
    """multiprocessing's fork server, started once per test session with WARM_IMPORTS imported, in the
    environment subprocess_env() gives a fresh child."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(WARM_IMPORTS))
    with mock.patch.dict(os.environ, subprocess_env()), terminal_signals():
        multiprocessing.forkserver.ensure_running()
    return context


@functools.cache
def fresh_sys_path() -> tuple[str, ...]:
    """sys.path of a fresh `python <script>`, less the script's folder that comes first."""
    command = [sys.executable, "-c", "import sys; print(repr(sys.path[1:]))"]
    result = subprocess.run(command, env=subprocess_env(), capture_output=True, text=True, check=True)
    return tuple(ast.literal_eval(result.stdout))


def is_repo_module(module) -> bool:
    spec = getattr(module, "__spec__", None)
    places = [getattr(spec, "origin", None), *(getattr(spec, "submodule_search_locations", None) or ())]
    return any(isinstance(place, str) and place.startswith(f"{REPO}{os.sep}") for place in places)


def run_as_main(script: str, args: list[str], stdout, stderr, path: tuple[str, ...], environ: dict | None = None):
    """In a child of the warm interpreter: what `python <script> args` (or, for `-m name`, `python -m name args`)
    does once torch is imported. The repo's own modules are imported afresh from the script's folder (the repo
    root for -m) and `path` (a fresh interpreter's sys.path), as the command would import them; stdout and stderr
    are unbuffered (PYTHONUNBUFFERED); SIGINT, SIGTERM and SIGHUP are as a fresh interpreter started at a terminal
    has them (see terminal_signals); os.environ is `environ` when given (a variable the test set after the warm
    interpreter started counts, as it would for a fresh child); the exit code of sys.exit(main()) is the child's."""
    if environ is not None:
        os.environ.clear()
        os.environ.update(environ)
        tempfile.tempdir = None  # the folder is read from TMPDIR afresh, as a fresh interpreter does
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    for fd, connection in ((1, stdout), (2, stderr)):
        os.dup2(connection.fileno(), fd)
        connection.close()
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), errors="backslashreplace", write_through=True)
    for name, module in list(sys.modules.items()):
        if is_repo_module(module):
            del sys.modules[name]
    os.chdir(REPO)
    module = script.removeprefix("-m ") if script.startswith("-m ") else None
    sys.path[:] = [str(REPO if module else (REPO / script).parent), *path]
    sys.argv = [module or script, *args]
    if module:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        runpy.run_path(script, run_name="__main__")


class WarmProcess:
    """`python <script> args` forked from the warm interpreter (warm_context): the same script, argv, output,
    signals and exit code, without the seconds of importing torch. For tests of what a script does, not of how
    an interpreter starts or exits. stdout and stderr go to the given file descriptors; `environ` adds to the
    environment; the part of subprocess.Popen that the tests use."""

    def __init__(self, script: str, args: list[str], stdout_fd: int, stderr_fd: int, environ: dict | None = None):
        if script == "-m":  # ("-m", [name, *args]), as Popen takes it
            script, args = f"-m {args[0]}", args[1:]
        outputs = [multiprocessing.connection.Connection(os.dup(fd), readable=False) for fd in (stdout_fd, stderr_fd)]
        context, path = warm_context(), fresh_sys_path()
        target_args = (script, list(args), *outputs, path, {**subprocess_env(), **(environ or {})})
        self.process = context.Process(target=run_as_main, args=target_args, name=script)
        try:
            self.process.start()
        finally:
            for output in outputs:
                output.close()

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def returncode(self) -> int | None:
        return self.process.exitcode  # -N when killed by signal N, as Popen's

    def poll(self) -> int | None:
        return self.process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self.process.join(timeout)
        if self.process.exitcode is None:
            raise subprocess.TimeoutExpired(self.process.name, timeout)
        return self.process.exitcode

    def kill(self):
        self.process.kill()


def rank_environ(world_size: int, port: int) -> list[dict[str, str]]:
    """What torchrun --standalone --nproc_per_node=world_size tells each of its workers about the process group."""
    group = {"WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size)}
    group |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    return [{**group, "RANK": str(rank), "LOCAL_RANK": str(rank)} for rank in range(world_size)]


def run_ranks(script: str, args: list[str], world_size: int = 2, timeout: float = 300) -> list[tuple[int, str]]:
    """`torchrun --standalone --nproc_per_node=world_size <script> args` without torchrun: the ranks forked from the
    warm interpreter with the environment torchrun gives its workers, side by side; each rank's (exit code, output),
    rank 0 first. For what the ranks do together; torchrun's own part (restarts, signals passed on) needs torchrun.
    Each rank writes to a file of its own, so a rank that prints a lot never blocks its peers."""
    with contextlib.ExitStack() as stack:
        outputs = [stack.enter_context(tempfile.TemporaryFile()) for _ in range(world_size)]
        ranks = []
        for environ, output in zip(rank_environ(world_size, free_port()), outputs):
            ranks.append(WarmProcess(script, args, output.fileno(), output.fileno(), environ))
            stack.callback(ranks[-1].kill)  # if it ran past the timeout (a no-op once it has exited)
        deadline = time.monotonic() + timeout
        codes = []
        for rank in ranks:
            rank.process.join(max(0.0, deadline - time.monotonic()))
            codes.append(rank.returncode)
        for output in outputs:
            output.seek(0)
        texts = [output.read().decode(errors="replace") for output in outputs]
    assert None not in codes, f"ranks still running after {timeout} s: {codes}; outputs:\n" + "\n".join(texts)
    return list(zip(codes, texts))


def tree_digest(*roots: Path) -> dict[str, tuple[str, int]]:
    """{path: (sha256, mtime_ns)} of every file under roots: equal digests mean nothing on disk changed."""
    digest = {}
    for root in roots:
        root = Path(root)
        files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
        for path in files:
            digest[str(path)] = (hashlib.sha256(path.read_bytes()).hexdigest(), path.stat().st_mtime_ns)
        for path in sorted(p for p in root.rglob("*") if p.is_dir()) if root.is_dir() else []:
            digest[str(path)] = ("dir", 0)
    return digest


@contextlib.contextmanager
def process_state_restored():
    """train.train() installs SIGTERM/SIGINT/SIGHUP handlers, reconfigures the root logger and turns TF32 on;
    undo all three, so an in-process run does not change how this pytest process reacts to Ctrl-C, where later
    logs go, or the float32 results of a later GPU test (a compiled-vs-eager comparison flips under TF32)."""
    import torch

    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    root = logging.getLogger()
    root_handlers, root_level = root.handlers[:], root.level
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        root.handlers[:] = root_handlers
        root.setLevel(root_level)


@contextlib.contextmanager
def file_size_limit(max_bytes: int):
    """Writes that would make a file larger than max_bytes fail with EFBIG, as a full disk fails them with ENOSPC:
    through the real write path, in this process, with no small filesystem to mount (RLIMIT_FSIZE)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # an error from write(), not a killed process
    resource.setrlimit(resource.RLIMIT_FSIZE, (max_bytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)


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


def tiny_config(**overrides):
    """A GPTConfig small enough for a CPU test: 2 layers, 2 heads, width 32, context 32, vocab 64."""
    from model import GPTConfig

    base = dict(block_size=32, vocab_size=64, n_layer=2, n_head=2, n_embd=32, dropout=0.0, bias=True)
    return GPTConfig(**{**base, **overrides})


def stand_in_flash_module(calls: list, table_keyword: str = "block_table"):
    """A stand-in flash-attn module (B, T, H, D): flash_attn_func, flash_attn_varlen_func (packed documents) and
    flash_attn_with_kvcache (contiguous or paged, causal aligned bottom-right), computed by explicit float64
    formulas; k and v may have fewer heads than q (grouped query heads), as flash-attn allows."""
    import math

    import torch

    def attend(q, k, v, q_positions):  # q (T, H, D), k/v (S, H_kv, D)
        k, v = (t.repeat_interleave(q.size(1) // t.size(1), dim=1) for t in (k, v))
        scores = torch.einsum("thd,shd->hts", q.double(), k.double()) / math.sqrt(q.size(-1))
        allowed = torch.arange(k.size(0))[None] <= q_positions[:, None]
        weights = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
        return torch.einsum("hts,shd->thd", weights, v.double()).to(q.dtype)

    def flash_attn_func(q, k, v, causal):
        calls.append("prefill")
        return torch.stack([attend(q[b], k[b], v[b], torch.arange(q.size(1))) for b in range(q.size(0))])

    def flash_attn_varlen_func(q, k, v, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal):
        calls.append("varlen")
        bounds = cu_seqlens_q.tolist()
        return torch.cat([attend(q[a:b], k[a:b], v[a:b], torch.arange(b - a)) for a, b in zip(bounds, bounds[1:])])

    def flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=None, causal=False, **table):
        assert causal and cache_seqlens.dtype == torch.int32 and set(table) <= {table_keyword}
        block_table = table.get(table_keyword)
        calls.append("paged" if block_table is not None else "contiguous")
        out = []
        for b in range(q.size(0)):
            n, T = int(cache_seqlens[b]), q.size(1)
            if block_table is None:
                k, v = k_cache[b, :n], v_cache[b, :n]
            else:
                pages = block_table[b, : -(-n // k_cache.size(1))].long()
                k, v = (c[pages].reshape(-1, *c.shape[2:])[:n] for c in (k_cache, v_cache))
            out.append(attend(q[b], k, v, torch.arange(n - T, n)))
        return torch.stack(out)

    function = {"block_table": flash_attn_with_kvcache}
    if table_keyword == "page_table":  # flash-attn 3's spelling of the page table

        def with_page_table(q, k_cache, v_cache, cache_seqlens=None, causal=False, page_table=None):
            return flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens, causal, page_table=page_table)

        function = {"page_table": with_page_table}
    return type(
        "FakeFlash",
        (),
        {"flash_attn_func": staticmethod(flash_attn_func)}
        | {"flash_attn_varlen_func": staticmethod(flash_attn_varlen_func)}
        | {"flash_attn_with_kvcache": staticmethod(function[table_keyword])},
    )


def stand_in_flash(monkeypatch, module):
    """A fresh flash kernel (kernels.flash.FlashAttention, without dropout) that imports `module` as a package
    named stand_in_flash, registered as flash_attn_2 (with its KV cache decode kernel,
    generation.kv_cache.DECODE_KERNELS) and allowed on CPU."""
    import model
    from generation import kv_cache
    from kernels.flash import FlashAttention

    monkeypatch.setitem(sys.modules, "stand_in_flash", module)
    kernel = FlashAttention("stand-in flash", (("stand_in_flash", "stand-in flash", "stand-in-flash"),))
    record = model.AttentionBackend("flash_attn_2", kernel, lambda use: "", "sdpa")
    monkeypatch.setitem(model.BACKENDS, "flash_attn_2", record)
    monkeypatch.setitem(kv_cache.DECODE_KERNELS, "flash_attn_2", kv_cache.flash_decode(kernel))
    return kernel


def run_module(module: str, args: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    """`python -m <module> args` from the repo root (a fresh interpreter); stdout and stderr captured separately."""
    command = [sys.executable, "-m", module, *args]
    return subprocess.run(command, cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=timeout)


def free_port() -> int:
    """A free TCP port on 127.0.0.1 below Linux's ephemeral range (32768-60999), where no process's next outgoing
    connection can take it before torchrun binds it. Drawn from the OS's randomness, not the `random` module's:
    pytest-randomly seeds that alike in every test and worker, which would give parallel tests the same ports."""
    for port in random.SystemRandom().sample(range(20000, 32768), 200):
        with socket.socket() as s, contextlib.suppress(OSError):
            s.bind(("127.0.0.1", port))
            return port
    raise RuntimeError("no free TCP port found in 20000-32767")
