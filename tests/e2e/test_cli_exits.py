"""How every command ends: bad input is one `error:` line and exit code 2 with nothing written, whichever command
(every module that does something when run is listed, and every module imports without side effects) and however
it is run (a module run as a script, imported again under its own name, must still match its own
error types); a signal during train.py's start-up is one line and leaves out_dir as it was; Ctrl-C while torch
imports is one line; a run's last line says what is on disk; a config file cannot end the run; sample.py names a
checkpoint that cannot be sampled and a temperature that is not finite."""

from __future__ import annotations

import contextlib
import fcntl
import importlib
import io
import math
import os
import re
import runpy
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings

import pytest
import torch

import sample
import train
from helpers import (
    REPO,
    WarmProcess,
    is_repo_module,
    subprocess_env,
    terminal_signals,
    tiny_args,
    tree_digest,
    warm_context,
)
from storage.checkpoint import checkpoint_names

pytestmark = pytest.mark.usefixtures("one_thread")


def one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if not line.startswith("INFO: ")]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


# ---- every command: bad input is one line, exit code 2, nothing written ----


def run_command(command: str, args: list[str], timeout: float = 120) -> tuple[int, str, str]:
    """`python <command> args` (a script) or `python -m <command> args` (`-m name`), forked from the warm
    interpreter: (exit code, stdout, stderr)."""
    with tempfile.TemporaryFile() as stdout, tempfile.TemporaryFile() as stderr:
        process = WarmProcess(command, list(args), stdout.fileno(), stderr.fileno())
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        stdout.seek(0), stderr.seek(0)
        return process.returncode, stdout.read().decode(errors="replace"), stderr.read().decode(errors="replace")


BENCHES = {  # each bench, and what its error line names for an unknown option
    **dict.fromkeys(
        ("attention", "multi_gpu", "generation", "train_step", "readme_table"),
        "--bogus",
    ),
}
COMMANDS = [  # (command, its arguments, what the error line names); {tmp}: the test's folder, {trained}: an out_dir
    ("train.py", ["--init_from=resume", "--out_dir={tmp}/out", "--device=cpu"], "ckpt.pt"),
    ("train.py", ["{tmp}/missing.py"], "missing.py"),
    ("sample.py", ["--checkpoint={tmp}/missing.pt", "--device=cpu"], "missing.pt"),
    ("sample.py", ["--out_dir={trained}", "--temperature=inf", "--device=cpu"], "temperature"),
    ("-m kernels", ["--bogus"], "takes no arguments"),
    ("-m weights", ["hf", "{tmp}/missing.pt", "{tmp}/hf"], "missing.pt"),
    ("-m weights", ["safetensors", "{tmp}/truncated.pt", "{tmp}/weights.safetensors"], "truncated.pt"),
    ("-m weights", ["merge", "{trained}/ckpt.pt", "{tmp}/merged.pt"], "ckpt.pt"),  # not a LoRA checkpoint
    ("-m weights", ["convert", "{tmp}/x.pt", "{tmp}/y"], "convert"),
    pytest.param(
        "-m data.shakespeare_char.prepare",
        ["--input", "{tmp}/missing.txt", "--out_dir", "{tmp}/prepared"],
        "missing.txt",
        id="-m data.shakespeare_char.prepare-missing-input",
    ),
    *[(f"-m data.{name}.prepare", ["--bogus"], "--bogus") for name in ("shakespeare_char", "shakespeare")],
    *[(f"-m data.{name}.prepare", ["--bogus"], "--bogus") for name in ("openwebtext", "fineweb")],
    *[(f"-m bench.{name}", ["--bogus"], BENCHES[name]) for name in BENCHES],
    ("-m bench.train_step", ["phases"], "the following arguments are required: parallelism"),
    ("-m bench.attention", ["fit"], "the following arguments are required: results"),
]


def repo_modules() -> dict[str, str]:
    """{module name: its command, as a user would run it} for each module of the repo: a file at the top is a
    script (train.py), the rest run with -m (a package's __main__ as the package). The tests are not the repo's
    commands, and config files are settings that train.py and sample.py read, not modules."""
    modules = {}
    for path in sorted(REPO.rglob("*.py")):
        relative = path.relative_to(REPO)
        if relative.parts[0] in ("tests", "config") or any(part.startswith(".") for part in relative.parts):
            continue
        if relative.name == "__init__.py":
            continue
        name = ".".join(relative.with_suffix("").parts)
        modules[name] = str(relative) if len(relative.parts) == 1 else "-m " + name.removesuffix(".__main__")
    return modules


def import_and_run_each(names: list[str], results) -> None:
    """In a child of the warm interpreter: each module imported afresh, then each run as `python -m name --bogus`
    would run it (as __main__), its output caught; what each did is sent to `results`. Imports first, all of them:
    a module's import must leave the process as it was (output, sys.path, signal handlers, argv)."""
    for name, module in list(sys.modules.items()):
        if is_repo_module(module):
            del sys.modules[name]
    stop_signals = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    before = (list(sys.path), [signal.getsignal(sig) for sig in stop_signals], list(sys.argv))
    imports = {name: caught(importlib.import_module, name) for name in names}
    after = (list(sys.path), [signal.getsignal(sig) for sig in stop_signals], list(sys.argv))
    runs = {}
    for name in names:
        sys.argv = [name, "--bogus"]
        runs[name] = caught(runpy.run_module, name.removesuffix(".__main__"), run_name="__main__", alter_sys=True)
    results.send((imports, (before, after), runs))


def caught(function, *args, **kwargs) -> str:
    """What calling `function` did: "nothing" (it returned and wrote nothing), or what it wrote or raised."""
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # runpy's for a module imported before it runs as __main__
            function(*args, **kwargs)
        what = ""
    except SystemExit as stop:
        what = f"exit {stop.code!r}"
    except BaseException as error:  # noqa: BLE001 (a module's import or run may raise anything)
        what = f"raised {type(error).__name__}: {error}"
    return " ".join(filter(None, (what, out.getvalue(), err.getvalue()))) or "nothing"


def test_every_command_of_the_repo_is_in_the_list(warm_interpreter):
    """A new command (a module that does something when run) is added to COMMANDS, and so gets its bad-input
    test: every module of the repo, run as a command with an unknown option, does nothing unless it is listed.
    And every module imports without side effects: nothing written or raised, sys.path, the stop signals'
    handlers and argv as they were."""
    modules = repo_modules()
    listed = {command.values[0] if hasattr(command, "values") else command[0] for command in COMMANDS}
    results, sender = warm_context().Pipe(duplex=False)
    child = warm_context().Process(target=import_and_run_each, args=(list(modules), sender))
    child.start()
    sender.close()
    try:
        assert results.poll(120), "nothing from the child"
        imports, (before, after), runs = results.recv()
    finally:
        child.join(30)
        child.kill()
    assert {name: what for name, what in imports.items() if what != "nothing"} == {}
    assert after == before  # sys.path, the handlers of SIGINT, SIGTERM and SIGHUP, sys.argv
    assert {modules[name] for name, what in runs.items() if what != "nothing"} == listed


@pytest.mark.parametrize("command, args, names", COMMANDS)
def test_bad_input_to_every_command_is_one_line_and_exit_2(command, args, names, trained_out, tmp_path):
    """Each command runs as a user runs it: a script as `__main__` (whose module a repo module may import again
    under its own name: then `except ItsError` would not match the error it raises, the double-import trap) or a
    module with -m. Whatever is wrong, one `error:` line on stderr, nothing on stdout, exit code 2, and nothing
    written: no output file, no empty folder."""
    (tmp_path / "truncated.pt").write_bytes((trained_out / "ckpt.pt").read_bytes()[:1000])
    argv = [arg.format(tmp=tmp_path, trained=trained_out) for arg in args]
    before = tree_digest(tmp_path, trained_out)
    code, out, err = run_command(command, argv)
    assert code == 2, err
    assert names in one_error_line(err)
    assert "Traceback" not in err and out == "", out
    assert tree_digest(tmp_path, trained_out) == before


# ---- Ctrl-C while torch imports ----


def read_line(fd: int, deadline: float) -> str:
    """The next line from `fd`, read a byte at a time (nothing past it leaves the pipe), without its newline."""
    line = b""
    while not line.endswith(b"\n"):
        assert select.select([fd], [], [], max(0.0, deadline - time.monotonic()))[0], "timed out; so far: " + str(line)
        byte = os.read(fd, 1)
        assert byte, f"the output ended first; so far: {line!r}"
        line += byte
    return line.decode(errors="replace").rstrip("\n")


@pytest.mark.parametrize(
    "script, stop, said",
    [
        ("train.py", signal.SIGINT, "interrupted"),
        ("sample.py", signal.SIGINT, "interrupted"),
        ("train.py", signal.SIGTERM, "stopped by SIGTERM"),
        ("-m bench.generation", signal.SIGHUP, "stopped by SIGHUP"),
    ],
)
def test_a_stop_signal_while_torch_imports_is_one_line(script, stop, said, tmp_path):
    """SIGINT, SIGTERM or SIGHUP in the middle of `import torch` (seconds of a command's start): one line, and
    the process ends killed by that signal (exit code 130, 143, 129 to a shell), as Python does on Ctrl-C, not
    silently (the default action of SIGTERM and SIGHUP). The interpreter lists each module it
    has imported on stderr (PYTHONPROFILEIMPORTTIME), into a one-page pipe read a byte at a time: once a torch
    submodule is listed, the test stops reading, so the child blocks within a page of listing while torch's
    thousand modules are still loading, and the signal comes there."""
    # bad input: a signal lost inside some import would end in an error line at once, not in a run
    args = [f"--out_dir={tmp_path / 'out'}", "--init_from=resume", "--device=cpu"] if script == "train.py" else []
    args += [f"--checkpoint={tmp_path / 'missing.pt'}", "--device=cpu"] if script == "sample.py" else []
    args += ["--bogus"] if script.startswith("-m") else []
    read_end, write_end = os.pipe()
    fcntl.fcntl(write_end, fcntl.F_SETPIPE_SZ, 4096)
    env = {**subprocess_env(), "PYTHONPROFILEIMPORTTIME": "1"}
    try:
        with terminal_signals():
            child = subprocess.Popen(
                [sys.executable, *script.split(), *args],
                cwd=REPO,
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=write_end,
            )
    finally:
        os.close(write_end)
    deadline = time.monotonic() + 120
    try:
        while not re.search(r"\|\s+torch\.\S+$", read_line(read_end, deadline)):
            pass
        child.send_signal(stop)
        rest = b""
        while chunk := os.read(read_end, 65536):
            rest += chunk
        code = child.wait(timeout=60)
    finally:
        os.close(read_end)
        if child.poll() is None:
            child.kill()
            child.wait()
    lines = [line for line in rest.decode(errors="replace").splitlines() if not line.startswith("import time:")]
    assert lines == [said], lines
    assert code == -stop
    assert not (tmp_path / "out").exists()


# ---- a signal during train.py's start-up ----


START_UP = {  # the moment of start-up, and the function of train's namespace during which the signal comes
    "checking-inputs": "check_before_training",
    "claiming-out_dir": "claim_run_out_dir",
    "printing-the-header": "print_header",
    "building-the-optimizer": "build_train_state",
    "restoring-the-resumed-state": "restore_progress",
}


@pytest.mark.parametrize("stop, said", [(signal.SIGINT, "interrupted"), (signal.SIGTERM, "stopped by SIGTERM")])
def test_a_stop_signal_inside_a_weakref_callback_is_not_lost(stop, said):
    """The race behind an import's lost Ctrl-C: a signal whose exception is raised inside a weakref callback (the
    import system's module-lock cleanup is one), where Python only prints it as "Exception ignored" and goes on.
    Under as_command the signal is sent again and ends the process as anywhere else: one line, death by it."""
    code = f"""
import os, signal, time, weakref
from errors import as_command
as_command()
class Thing: pass
def callback(ref):
    os.kill(os.getpid(), {int(stop)})
    for _ in range(1000): pass  # the handler runs here, inside the callback
thing = Thing()
ref = weakref.ref(thing, callback)
del thing
time.sleep(10)
print("went on")
"""
    with terminal_signals():  # the child must get SIGINT's default, not this runner's (SIG_IGN under `pytest &`)
        done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=subprocess_env(), capture_output=True,
                              text=True, timeout=60)  # fmt: skip
    assert (done.returncode, done.stderr.splitlines(), done.stdout) == (-stop, [said], "")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT], ids=lambda sig: sig.name)
@pytest.mark.parametrize("moment", START_UP)
def test_a_signal_during_start_up_is_one_line_and_leaves_out_dir_as_it_was(
    moment, sig, char_data, trained_out, tmp_path, monkeypatch, capsys
):
    """From its first line to its first step, a run has nothing to save. A stop signal then ends it at once with
    one line naming the signal and what out_dir holds, and exit code 128+N: no lock left, no folder the run
    created (a scratch run's out_dir goes again), no checkpoint changed (a resumed run's are as they were)."""
    out = tmp_path / "out"
    resume = moment == "restoring-the-resumed-state"
    if resume:
        shutil.copytree(trained_out, out)
    before = tree_digest(tmp_path)
    real = getattr(train, START_UP[moment])

    def signalled(*args, **kwargs):
        os.kill(os.getpid(), sig)  # delivered before kill returns: handled at the next Python instruction
        return real(*args, **kwargs)

    monkeypatch.setattr(train, START_UP[moment], signalled)
    unseen = []
    for stop_signal in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):  # a run that does not take the signal
        signal.signal(stop_signal, lambda signum, frame: unseen.append(signum))  # trains on (the fixture restores)
    extra = ("--init_from=resume", "--max_iters=8") if resume else ("--max_iters=2",)
    code = train.main(tiny_args(char_data, out, "--eval_interval=2", *extra))

    err = capsys.readouterr().err
    assert code == 128 + sig, err
    assert not unseen
    state = f"holds {', '.join(checkpoint_names(out))}, unchanged" if resume else "does not exist"
    assert err.splitlines()[-1] == (
        f"received {sig.name} during start-up, before the first step: nothing saved; out_dir {out} {state}"
    ), err
    assert "Traceback" not in err
    assert tree_digest(tmp_path) == before


# ---- the last line says what is on disk ----


@pytest.mark.parametrize("case", ["max_iters-0", "max_iters-0-existing-folder", "eval_only", "resumed-at-max_iters"])
def test_a_run_that_saves_nothing_says_so_and_what_out_dir_holds(case, char_data, trained_out, tmp_path, capsys):
    """max_iters=0, eval_only, or a resume at max_iters: exit code 0, no checkpoint written, and the last line
    says so and what out_dir holds, as it is after the run: no folder the run created and left empty (eval_only:
    which checkpoint it evaluated)."""
    out = tmp_path / "out"
    if case == "max_iters-0-existing-folder":
        out.mkdir()
    elif case in ("eval_only", "resumed-at-max_iters"):
        shutil.copytree(trained_out, out)
    before = tree_digest(tmp_path)
    extra = {
        "max_iters-0": ["--max_iters=0"],
        "max_iters-0-existing-folder": ["--max_iters=0"],
        "eval_only": ["--init_from=resume", "--eval_only=true"],
        "resumed-at-max_iters": ["--init_from=resume", "--max_iters=4"],
    }[case]
    code = train.main(tiny_args(char_data, out, *extra))
    last = capsys.readouterr().out.splitlines()[-1]
    assert code == 0
    assert (
        last
        == {
            "max_iters-0": f"max_iters=0: no step taken, no checkpoint written; out_dir {out} does not exist",
            "max_iters-0-existing-folder": f"max_iters=0: no step taken, no checkpoint written; out_dir {out} holds "
            "no checkpoint",
            "eval_only": f"eval_only: evaluated {out / 'ckpt.pt'} (iter 4); no checkpoint written",
            "resumed-at-max_iters": "nothing to train: resumed at iter 4 and max_iters=4; no checkpoint written; "
            f"{out / 'ckpt.pt'} still holds iter 4",
        }[case]
    )
    assert tree_digest(tmp_path) == before


# ---- a config file cannot end the run ----


@pytest.mark.parametrize(
    "ending, call",
    [("import sys\nsys.exit(0)", "sys.exit(0)"), ("exit()", "sys.exit()"), ("quit(3)", "sys.exit(3)")]
    + [("raise SystemExit('done')", "sys.exit('done')")],
)
@pytest.mark.parametrize("program", ["train", "sample"])
def test_a_config_file_that_exits_is_one_line_naming_it(program, ending, call, char_data, tmp_path, capsys):
    """A config file that calls sys.exit (exit(), quit(), raise SystemExit) would end the command with its code
    and no word: it is a config error naming the file and the line, exit code 2, nothing written."""
    config = tmp_path / "config.py"
    config.write_text(f"batch_size = 4\n{ending}\n")
    before = tree_digest(tmp_path)
    if program == "train":
        code = train.main(tiny_args(char_data, tmp_path / "out", str(config)))
    else:
        code = sample.main([str(config), f"--out_dir={tmp_path / 'out'}", "--device=cpu"])
    err = capsys.readouterr().err
    assert code == 2
    line = ending.count("\n") + 2
    assert one_error_line(err) == (
        f"error: {config}: line {line} calls {call}; a config file only assigns settings and cannot end the run"
    )
    assert tree_digest(tmp_path) == before


# ---- sample.py: what cannot be sampled ----


@pytest.mark.parametrize(
    "damage, names",
    [
        ("nan-embedding", "non-finite weights (NaN or inf in transformer.wte.weight"),
        ("inf-norm", "non-finite weights (NaN or inf in transformer.ln_f.weight)"),
        ("overflowing-logits", "the model's logits are not finite (NaN or inf) while sampling this prompt"),
    ],
)
def test_a_checkpoint_that_cannot_be_sampled_is_one_line_naming_it(damage, names, trained_out, tmp_path, capsys):
    """NaN or inf weights (a file from elsewhere: training never saves them), or finite weights whose logits
    overflow: one `error:` line naming the checkpoint and the cause, exit code 2, no sample printed."""
    state = torch.load(trained_out / "ckpt.pt", weights_only=True)
    weights = state["model"]
    if damage == "nan-embedding":
        weights["transformer.wte.weight"][3, 5] = math.nan
    elif damage == "inf-norm":
        weights["transformer.ln_f.weight"][0] = math.inf
    else:
        weights["transformer.h.0.mlp.c_fc.weight"].fill_(1e38)
    path = tmp_path / "damaged.pt"
    torch.save(state, path)
    code = sample.main([f"--checkpoint={path}", "--device=cpu", "--max_new_tokens=5"])
    captured = capsys.readouterr()
    assert code == 2
    line = one_error_line(captured.err)
    assert line.startswith(f"error: {path}") and names in line, line
    assert captured.out == ""


@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "1e400"])
def test_a_temperature_that_is_not_finite_is_named_so(value, trained_out, capsys):
    code = sample.main([f"--out_dir={trained_out}", f"--temperature={value}", "--device=cpu"])
    line = one_error_line(capsys.readouterr().err)
    assert code == 2
    assert line == f"error: temperature must be >= 0 (0 is greedy) and finite, got {float(value)}"


@pytest.mark.parametrize("requested", ["auto", "cuda"])
def test_a_local_rank_past_the_last_gpu_is_one_line_naming_the_gpu_count(monkeypatch, requested):
    """--device=auto and --device=cuda under torchrun's LOCAL_RANK=N with N >= the GPU count: the same check,
    naming the count and how many processes a node can take (CUDA faked: this machine has none)."""
    from errors import UsageError
    from training.runtime import pick_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert pick_device(requested, local_rank=1) == torch.device("cuda", 1)
    with pytest.raises(UsageError) as raised:
        pick_device(requested, local_rank=2)
    message = str(raised.value)
    assert "(LOCAL_RANK=2) needs cuda:2, but this machine has 2 CUDA device(s)" in message
    assert "torchrun --nproc_per_node=2" in message
    with pytest.raises(UsageError, match="'cuda:5' needs cuda:5, but this machine has 2"):
        pick_device("cuda:5")
