"""sample.py: text from a trained checkpoint, on the command line and in-process."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

import sample
from helpers import REPO, subprocess_env

pytestmark = pytest.mark.usefixtures("one_thread")

SEPARATOR = "---------------"


def samples(stdout: str) -> list[str]:
    """The samples in sample.py's output: each one is followed by a separator line."""
    parts = stdout.split(f"\n{SEPARATOR}\n")
    assert parts[-1] == "", f"output does not end with the separator line: {stdout!r}"
    return parts[:-1]


@pytest.fixture(scope="module")
def cli_run(trained_out) -> tuple[subprocess.CompletedProcess, str, set[str]]:
    """`python sample.py ...` once, with the interpreter listing each module it imports (PYTHONPROFILEIMPORTTIME
    lines on stderr): (the run, stderr without those lines, the names of the imported modules)."""
    argv = [f"--out_dir={trained_out}", "--num_samples=2", "--max_new_tokens=20", "--device=cpu"]
    result = subprocess.run(
        [sys.executable, "sample.py", *argv],
        cwd=REPO,
        env={**subprocess_env(), "PYTHONPROFILEIMPORTTIME": "1"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    import_lines = [line for line in result.stderr.splitlines() if line.startswith("import time:")]
    imported = {line.rsplit("|", 1)[-1].strip() for line in import_lines}
    stderr = "\n".join(line for line in result.stderr.splitlines() if not line.startswith("import time:"))
    return result, stderr, imported


def test_sample_cli(cli_run):
    result, stderr, _ = cli_run
    assert result.returncode == 0, stderr
    texts = samples(result.stdout)
    assert len(texts) == 2
    assert all(len(text) == 1 + 20 and text.startswith("\n") for text in texts)  # the "\n" prompt + 20 chars
    assert re.search(r"^40 tokens in \d+\.\d s \([\d,]+ tokens/s\)$", stderr, re.M), stderr
    assert "Traceback" not in stderr


def test_sample_does_not_import_train(cli_run):
    _, _, imported = cli_run
    assert {"runtime", "model", "checkpoint"} <= imported  # the list is real
    assert "train" not in imported  # sampling needs no training code: device and dtype come from runtime.py


def run_sample(capsys, *argv: str) -> tuple[int, str, str]:
    code = sample.main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_prompt_from_file(trained_out, tmp_path, capsys):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("ROMEO:\nthe king")
    code, out, err = run_sample(
        capsys,
        f"--out_dir={trained_out}",
        f"--start=FILE:{prompt}",
        "--num_samples=1",
        "--max_new_tokens=5",
        "--device=cpu",
    )
    assert code == 0, err
    [text] = samples(out)
    assert text.startswith("ROMEO:\nthe king") and len(text) == len("ROMEO:\nthe king") + 5


def test_same_seed_same_text(trained_out, capsys):
    argv = (
        f"--out_dir={trained_out}",
        "--num_samples=2",
        "--max_new_tokens=30",
        "--device=cpu",
        "--temperature=1.5",
        "--top_k=None",
    )
    first = run_sample(capsys, *argv, "--seed=7")
    again = run_sample(capsys, *argv, "--seed=7")
    other = run_sample(capsys, *argv, "--seed=8")
    assert first[0] == again[0] == other[0] == 0
    assert samples(first[1]) == samples(again[1])
    assert samples(first[1]) != samples(other[1])


@pytest.mark.parametrize(
    "args, expect",
    [
        (["--out_dir={tmp}/empty"], "no checkpoint at"),
        (["--checkpoint={tmp}/nope.pt"], "no checkpoint at"),
        (["--temperature=0"], "temperature must be > 0"),
        (["--top_k=0"], "top_k"),
        (["--num_samples=0"], "num_samples"),
        (["--start=ROMEO€"], "vocabulary"),
        (["--start=FILE:{tmp}/missing.txt"], "missing.txt"),
        (["--start="], "prompt is empty"),
        (["--device=cuda"], "CUDA is not available"),
        (["--dtype=float64"], "unknown dtype 'float64'"),
        (["--tempreature=0.5"], "did you mean: temperature"),
    ],
    ids=[
        "missing-checkpoint",
        "missing-checkpoint-file",
        "temperature-0",
        "top_k-0",
        "num_samples-0",
        "unknown-char",
        "missing-prompt-file",
        "empty-prompt",
        "cuda",
        "unknown-dtype",
        "misspelled-key",
    ],
)
def test_bad_input(trained_out, tmp_path, capsys, args, expect):
    argv = [f"--out_dir={trained_out}", "--max_new_tokens=3", "--device=cpu"]
    argv += [arg.format(tmp=tmp_path) for arg in args]
    code, out, err = run_sample(capsys, *argv)
    assert code == 2
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expect in lines[0], err
    assert SEPARATOR not in out
