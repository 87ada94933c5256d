"""sample.py: text from a trained checkpoint, on the command line and in-process."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import warnings

import pytest
import torch

import sample
from data.tokenizer import gpt2_meta, load_tokenizer, tokenizer_vocab_size
from helpers import REPO, Child, run_script, subprocess_env, tree_digest
from model import GPT, GPTConfig
from weights.load import load_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")

SEPARATOR = "---------------"


def samples(stdout: str) -> list[str]:
    """The samples in sample.py's output: each one is followed by a separator line."""
    parts = stdout.split(f"\n{SEPARATOR}\n")
    assert parts[-1] == "", f"output does not end with the separator line: {stdout!r}"
    return parts[:-1]


@pytest.fixture(scope="module")
def fresh_run_to_a_closed_pipe(trained_out) -> tuple[int, str, set[str]]:
    """`python sample.py ...` in a fresh interpreter from start to exit, its stdout a pipe closed before the first
    write (what `| head -1` does to the writes after its line), listing each module it imports (PYTHONPROFILEIMPORTTIME
    lines on stderr): (exit code, stderr without those lines, the names of the imported modules)."""
    argv = [f"--out_dir={trained_out}", "--start=ROMEO:", "--num_samples=3", "--max_new_tokens=50", "--device=cpu"]
    piped = subprocess.Popen(
        [sys.executable, "sample.py", *argv],
        cwd=REPO,
        env={**subprocess_env(), "PYTHONPROFILEIMPORTTIME": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    piped.stdout.close()  # the reader is gone: every write to stdout fails with EPIPE
    try:
        err = piped.stderr.read()
        code = piped.wait(timeout=60)
    finally:
        piped.kill()  # if it ran past the timeout
        piped.stderr.close()
    import_lines = [line for line in err.splitlines() if line.startswith("import time:")]
    imported = {line.rsplit("|", 1)[-1].strip() for line in import_lines}
    stderr = "\n".join(line for line in err.splitlines() if not line.startswith("import time:"))
    return code, stderr, imported


def test_sample_cli(trained_out, warm_interpreter):
    argv = [f"--out_dir={trained_out}", "--num_samples=2", "--max_new_tokens=20", "--device=cpu"]
    result = run_script("sample.py", argv, timeout=60, warm=True)
    assert result.returncode == 0, result.stderr
    texts = samples(result.stdout)
    assert len(texts) == 2
    assert all(len(text) == 1 + 20 and text.startswith("\n") for text in texts)  # the "\n" prompt + 20 chars
    assert re.search(r"^40 tokens in \d+\.\d s \([\d,]+ tokens/s\)$", result.stderr, re.M), result.stderr
    assert "Traceback" not in result.stderr


def test_sample_does_not_import_train(fresh_run_to_a_closed_pipe):
    _, _, imported = fresh_run_to_a_closed_pipe
    assert {"training.runtime", "model", "storage.checkpoint", "generation.loop"} <= imported  # the list is real
    # sampling needs no training code: device and dtype come from training/runtime.py, and that is all of training/
    training_code = {"train", "training.state", "training.parallel", "training.preflight"}
    assert not training_code & imported, training_code & imported


def test_a_closed_stdout_is_quiet(fresh_run_to_a_closed_pipe):
    """stdout closed before the first write: nobody reads, so exit 0 and nothing said, at exit either (what an
    interpreter does with a closed stdout is part of the test: a fresh one, from start to exit)."""
    code, stderr, _ = fresh_run_to_a_closed_pipe
    assert code == 0, stderr
    assert "Traceback" not in stderr and "Exception ignored" not in stderr, stderr


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
        (["--temperature=-0.1"], "temperature must be >= 0 (0 is greedy), got -0.1"),
        (["--temperature=nan"], "temperature must be >= 0"),
        (["--top_k=0"], "top_k must be >= 1 or None, got 0"),
        (["--num_samples=0"], "num_samples must be >= 1, got 0"),
        (["--max_new_tokens=-1"], "max_new_tokens must be >= 1, got -1"),
        (["--start=ROMEO€ and ☃"], "--start: char '€' (U+20AC) at position 5 is not in this dataset's vocabulary"),
        (["--start=FILE:{tmp}/missing.txt"], "missing.txt"),
        (["--start=FILE:{tmp}"], "cannot be read (Is a directory)"),
        (["--start=FILE:{tmp}/latin1.txt"], "latin1.txt is not UTF-8 text (invalid continuation byte at byte 3)"),
        (["--start=FILE:{tmp}/loop.txt"], "loop.txt cannot be read (Too many levels of symbolic links)"),
        (["--start="], "prompt is empty"),
        (["--device=cuda"], "CUDA is not available"),
        (["--dtype=float64"], "unknown dtype 'float64'"),
        (["--tempreature=0.5"], "did you mean: temperature"),
    ],
    ids=[
        "missing-checkpoint",
        "missing-checkpoint-file",
        "temperature-negative",
        "temperature-nan",
        "top_k-0",
        "num_samples-0",
        "max_new_tokens-negative",
        "unknown-char",
        "missing-prompt-file",
        "prompt-file-is-a-directory",
        "prompt-file-not-utf8",
        "prompt-file-unreadable",
        "empty-prompt",
        "cuda",
        "unknown-dtype",
        "misspelled-key",
    ],
)
def test_bad_input(trained_out, tmp_path, capsys, args, expect):
    (tmp_path / "latin1.txt").write_bytes("café au lait".encode("latin-1"))
    (tmp_path / "loop.txt").symlink_to("loop.txt")  # unreadable even for root, unlike a chmod 000 file
    argv = [f"--out_dir={trained_out}", "--max_new_tokens=3", "--device=cpu"]
    argv += [arg.format(tmp=tmp_path) for arg in args]
    before = tree_digest(trained_out)
    code, out, err = run_sample(capsys, *argv)
    assert code == 2
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expect in lines[0], err
    assert SEPARATOR not in out
    assert tree_digest(trained_out) == before  # nothing written: not beside the checkpoint, not here
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latin1.txt", "loop.txt"]


def test_greedy_and_long_prompt(trained_out, capsys):
    """temperature 0 is greedy: the seed does not matter. A prompt longer than block_size (16) is kept whole in
    the output, with a note that the model reads only its last block_size tokens."""
    prompt = "ROMEO:\nthe king and the queen speak of love"
    argv = (f"--out_dir={trained_out}", f"--start={prompt}", "--num_samples=1", "--max_new_tokens=20", "--device=cpu")
    first = run_sample(capsys, *argv, "--temperature=0", "--seed=1")
    again = run_sample(capsys, *argv, "--temperature=0", "--seed=2")
    assert first[0] == again[0] == 0, first[2]
    [text] = samples(first[1])
    assert samples(again[1]) == [text] and text.startswith(prompt) and len(text) == len(prompt) + 20
    note = f"note: the prompt is {len(prompt)} tokens, longer than block_size 16; the model sees only its last 16"
    assert note in first[2].splitlines()


def padded_checkpoint(trained_out, tmp_path, tokenizer: str):
    """A checkpoint whose model has 64 ids (char) or GPT-2's padded 50304, more than its tokenizer, with weights
    that make every padding id far likelier than any real one: ln_f outputs the constant vector of ones and
    the padding rows of lm_head point along it."""
    state = load_checkpoint(trained_out / "ckpt.pt")
    meta = state["meta"] if tokenizer == "char" else gpt2_meta()
    real = tokenizer_vocab_size(meta)
    config = {**state["model_config"], "vocab_size": 64 if tokenizer == "char" else 50304, "bias": True}
    model = GPT(GPTConfig(**config))
    with torch.no_grad():
        model.transformer.ln_f.weight.zero_()
        model.transformer.ln_f.bias.fill_(1.0)
        model.lm_head.weight[real:] = 1.0  # padding logits = n_embd = 32; real ones ~N(0, 0.02 * sqrt(32))
    path = tmp_path / "padded.pt"
    torch.save({**state, "model": model.state_dict(), "model_config": config, "meta": meta}, path)
    return path, model, meta, real


@pytest.mark.parametrize("tokenizer", ["char", "gpt2"])
def test_padding_ids_are_never_sampled(trained_out, tmp_path, capsys, tokenizer):
    path, model, meta, real = padded_checkpoint(trained_out, tmp_path, tokenizer)
    encode, decode = load_tokenizer(meta)
    idx = torch.tensor([encode("ROMEO:")])
    model.eval()
    assert model(idx)[0][0, -1].argmax() >= real  # the model really prefers its padding
    for temperature, top_k in ((1.0, None), (1.0, 5), (0.0, None)):
        torch.manual_seed(0)
        *_, out = sample.generate(model, idx, 40, real, temperature, top_k)
        assert out.shape == (1, idx.size(1) + 40) and int(out.max()) < real, (temperature, top_k)

    code, stdout, err = run_sample(
        capsys, f"--checkpoint={path}", "--start=ROMEO:", "--num_samples=2", "--max_new_tokens=40", "--device=cpu"
    )
    assert code == 0, err
    texts = samples(stdout)
    assert len(texts) == 2 and all(text.startswith("ROMEO:") for text in texts)
    if tokenizer == "char":  # one char per id: all 40 new ids decoded
        assert all(len(text) == len("ROMEO:") + 40 for text in texts)


def test_ctrl_c_keeps_the_sample_so_far(trained_out, warm_interpreter):
    """SIGINT during the second sample: the first is printed whole, the second as far as it got, exit 130."""
    max_new = 1500  # ~1.5 s a sample on one CPU thread: the second is still running when the signal arrives
    args = [
        f"--out_dir={trained_out}",
        "--start=ROMEO:",
        "--device=cpu",
        "--num_samples=2",
        f"--max_new_tokens={max_new}",
    ]
    with Child("sample.py", args, warm=True) as child:
        child.wait_for(lambda line: line == sample.SEPARATOR + "\n", timeout=60)
        time.sleep(0.3)  # let the second sample draw some tokens
        os.kill(child.pid, signal.SIGINT)
        code, output = child.finish(timeout=60)
    assert code == 130, output
    assert "Traceback" not in output
    stopped = re.search(rf"^interrupted: sample 2 of 2 stopped after (\d+) of {max_new} tokens$", output, re.M)
    assert stopped, output
    first, partial = output[output.index("ROMEO:") :].split(f"\n{sample.SEPARATOR}\n")[:2]  # log lines come first
    assert len(first) == len("ROMEO:") + max_new  # the whole first sample
    assert partial.startswith("ROMEO:") and len(partial) == len("ROMEO:") + int(stopped.group(1))


def test_weights_that_do_not_fit_model_config_are_one_line(trained_out, tmp_path, capsys):
    state = torch.load(trained_out / "ckpt.pt", weights_only=True)
    state["model_config"]["block_size"] = 8  # wpe holds 16 positions
    torch.save(state, tmp_path / "odd.pt")
    code, out, err = run_sample(capsys, f"--checkpoint={tmp_path / 'odd.pt'}", "--max_new_tokens=3", "--device=cpu")
    assert code == 2 and err.count("\n") == 1 and err.startswith("error: ")
    assert "transformer.wpe.weight (16, 32) (model_config needs (8, 32))" in err, err


def test_bfloat16_sampling_on_a_gpu_casts_the_weights_and_drops_autocast():
    """On a GPU in bfloat16 the weights are cast once and no autocast wraps the steps (its casts sit inside every
    decode step); float16 (GPT-2 overflows it) and float32 keep float32 weights, under autocast for float16."""
    from training.runtime import Runtime

    for dtype, weights, autocast in ((torch.bfloat16, torch.bfloat16, False), (torch.float16, torch.float32, True)):
        gpt = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16, vocab_size=64))
        with warnings.catch_warnings():  # autocast(device_type="cuda") without CUDA says it is disabled
            warnings.simplefilter("ignore")
            context = sample.inference_precision(gpt, Runtime(torch.device("cuda"), dtype))  # nothing moves
        assert {p.dtype for p in gpt.parameters()} == {weights}
        assert isinstance(context, torch.autocast) == autocast, dtype
    gpt = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16, vocab_size=64))
    sample.inference_precision(gpt, Runtime(torch.device("cpu"), torch.bfloat16))
    assert {p.dtype for p in gpt.parameters()} == {torch.float32}  # CPU: autocast, as training evaluates


# ---- untrusted sizes, checked before memory is spent; messages that say what would help ----


def test_a_checkpoint_asking_for_a_huge_model_is_one_line_before_it_is_built(trained_out, tmp_path, capsys):
    """A model_config of 5e12 parameters (20 TB in float32) with the tiny weights beside it: refused from its
    config, not by an allocation that fails (a traceback) or swaps the machine to a halt."""
    state = torch.load(trained_out / "ckpt.pt", weights_only=True)
    state["model_config"].update(n_layer=96, n_embd=65536, n_head=64, vocab_size=50304)
    torch.save(state, tmp_path / "huge.pt")
    code, out, err = run_sample(capsys, f"--checkpoint={tmp_path / 'huge.pt'}", "--max_new_tokens=3", "--device=cpu")
    assert code == 2 and out == "" and err.count("\n") == 1 and err.startswith("error: "), err
    assert re.search(r"its model_config asks for at least [\d,]+ parameters \(n_layer=96, n_embd=65536", err), err


def test_a_max_new_tokens_beyond_memory_is_one_line(trained_out, capsys):
    code, out, err = run_sample(capsys, f"--out_dir={trained_out}", "--max_new_tokens=1000000000000", "--device=cpu")
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert err.startswith("error: max_new_tokens=1,000,000,000,000 would keep about ") and "ask for at most" in err


def test_help_names_sample_py(capsys):
    with pytest.raises(SystemExit) as stop:
        sample.main(["--help"])
    assert stop.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: sample.py ") and "--max_new_tokens=500" in out


def test_logits_that_overflow_in_float32_do_not_suggest_float32(trained_out, tmp_path, capsys):
    """Finite weights whose logits overflow: a float32 run is told to use an earlier checkpoint, not to switch to
    the dtype it runs in."""
    state = torch.load(trained_out / "ckpt.pt", weights_only=True)
    state["model"]["transformer.wte.weight"].fill_(3e38)  # finite, but the first norm's variance is inf
    torch.save(state, tmp_path / "overflow.pt")
    argv = (f"--checkpoint={tmp_path / 'overflow.pt'}", "--max_new_tokens=3", "--device=cpu", "--dtype=float32")
    code, out, err = run_sample(capsys, *argv)
    assert code == 2 and err.splitlines()[-1].startswith("error: ") and "logits are not finite" in err, err
    assert "--dtype=float32" not in err and "earlier checkpoint" in err, err


def test_paths_with_a_tilde_are_in_the_home_folder(trained_out, tmp_path, capsys, monkeypatch):
    """A shell leaves the ~ of --out_dir=~/run alone: sample.py reads it as the home folder, as the shell would."""
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "run").symlink_to(trained_out)
    (tmp_path / "prompt.txt").write_text("ROMEO:")
    argv = ("--out_dir=~/run", "--start=FILE:~/prompt.txt", "--num_samples=1", "--max_new_tokens=3", "--device=cpu")
    code, out, err = run_sample(capsys, *argv)
    assert code == 0 and samples(out)[0].startswith("ROMEO:"), err
    code, out, err = run_sample(capsys, "--checkpoint=~/run/ckpt.pt", "--max_new_tokens=3", "--device=cpu")
    assert code == 0, err
