"""train.py: the log a person reads, what a run leaves in its out_dir (and whose out_dir it is), the config
surface, the LR schedule, MFU peaks, exact resume after a kill -9, dataset auto-prepare, and wandb. CPU only;
subprocesses only where a real process is the point."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import pathlib
import re
import runpy
import shutil
import signal
import sys
import types

import pytest
import torch
import torch._dynamo

import train
from configurator import load_config, load_config_and_explicit_keys
from data import common, loader
from data.common import prepare_text
from errors import DataError
from helpers import REPO, TINY_MODEL, Child, file_size_limit, run_script, tiny_args, tree_digest
from model import GPT, GPTConfig
from storage import checkpoint
from storage.checkpoint import claim_out_dir
from train import DEPRECATED, TrainConfig, learning_rate_at
from training import preflight
from training.runtime import model_flops_utilization, peak_flops_for
from weights.hf import export_hf
from weights.load import load_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")

ITER_LINE = re.compile(
    r"iter \d+ \| loss \d+\.\d{4} \| lr \d\.\de[-+]\d{2} \| \d+\.\d ms \| "
    r"\d{1,3}(,\d{3})* tok/s \| MFU n/a \| mem \d+\.\d GiB"
)
EVAL_LINE = re.compile(r"eval \d+ \| train \d+\.\d{4} \| val \d+\.\d{4}")


def lines_starting(text: str, prefix: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(prefix)]


# ---- a real run: the log, the checkpoint ----


def test_smoke_run_log_lines_and_checkpoint(char_data, tmp_path, warm_interpreter):
    """`python train.py`, forked warm; fresh interpreters run train.py in test_ddp.py (torchrun) and
    test_bench.py (python -m bench.train_step compare)."""
    out = tmp_path / "out"
    result = run_script("train.py", tiny_args(char_data, out, "--max_iters=4", "--eval_interval=2"), warm=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    stdout = result.stdout.splitlines()

    # the start of the run: config, parameter count and tokens per iteration, attention backend, why no MFU
    assert stdout[0].startswith("config: out_dir=") and "n_layer=2" in result.stdout
    params = lines_starting(result.stdout, "parameters: ")
    assert len(params) == 1
    assert re.match(r"parameters: \d+\.\d+M \| tokens per iteration: 64\b", params[0]), params[0]  # 4 x 16 x 1
    assert re.search(r"^INFO: attention backend: (sdpa|manual)\b", result.stderr, re.M), result.stderr
    mfu = [line for line in stdout if line.startswith("MFU n/a")]
    assert len(mfu) == 1 and "cpu" in mfu[0] and "--peak_flops" in mfu[0], mfu

    iters = lines_starting(result.stdout, "iter ")
    assert [int(line.split()[1]) for line in iters] == [1, 2, 3, 4]
    for line in iters:
        assert ITER_LINE.fullmatch(line), line
    evals = lines_starting(result.stdout, "eval ")
    assert [int(line.split()[1]) for line in evals] == [0, 2, 4]
    for line in evals:
        assert EVAL_LINE.fullmatch(line), line
    assert re.search(rf"^saved {re.escape(str(out / 'ckpt.pt'))} \(iter 4, val \d+\.\d{{4}}\)$", result.stdout, re.M)

    state = load_checkpoint(out / "ckpt.pt")
    assert state["iter_num"] == 4
    assert not [k for k in state["model"] if "_orig_mod." in k]
    GPT(GPTConfig(**state["model_config"])).load_state_dict(state["model"])  # strict: the keys are the model's


def test_compiled_run_saves_unwrapped_state_dict(monkeypatch, char_data, tmp_path, capsys):
    """compile_blocks unset, a shallow model: torch.compile wraps the whole model; the checkpoint must still hold
    the plain model's keys, and the log names the first step's time, compile included. The wrapper is what
    matters, not inductor's code: dynamo's eager backend makes the same wrapper in a fraction of the time."""
    compiled = []

    def compile_eagerly(model, **kwargs):
        compiled.append(model)
        return real_compile(model, backend="eager")

    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", compile_eagerly)
    out = tmp_path / "out"
    args = tiny_args(char_data, out, "--compile=true", "--max_iters=1", "--eval_interval=1")
    try:
        assert train.main([*args, "--eval_iters=1", "--eval_on_start=false"]) == 0, capsys.readouterr().err
    finally:
        torch._dynamo.reset()  # no compiled frames left for later tests
    assert [type(model) for model in compiled] == [GPT]
    assert re.search(
        r"^INFO: first step \d+\.\d s, compile included \(torch.compile whole model\)$", capsys.readouterr().err, re.M
    )
    state = load_checkpoint(out / "ckpt.pt")
    assert not [k for k in state["model"] if "_orig_mod." in k]
    GPT(GPTConfig(**state["model_config"])).load_state_dict(state["model"])


def test_compile_blocks_compiles_each_block_and_the_head_and_trains_as_uncompiled(
    monkeypatch, char_data, tmp_path, capsys
):
    """compile_blocks=true (the default from PER_BLOCK_FROM_LAYERS blocks) hands torch.compile each block's
    forward and the head, never the GPT, trains with the losses of an uncompiled run, and names the first step's
    time, compile included (an uncompiled run does not). Dynamo's eager backend: what is compiled is under test,
    not inductor's code."""
    compiled = []
    real_compile = torch.compile

    def compile_eagerly(target, **kwargs):
        compiled.append(getattr(target, "__qualname__", type(target).__name__))
        return real_compile(target, backend="eager")

    monkeypatch.setattr(torch, "compile", compile_eagerly)
    losses, first_step_lines = {}, {}
    for name, compile_settings in (("blocks", ("--compile=true", "--compile_blocks=true")), ("plain", ())):
        steps = ("--max_iters=3", "--log_interval=1", "--eval_interval=3", "--eval_iters=1", "--eval_on_start=false")
        try:
            assert train.main(tiny_args(char_data, tmp_path / name, *compile_settings, *steps)) == 0
        finally:
            torch._dynamo.reset()  # no compiled frames left for later tests
        out, err = capsys.readouterr()
        losses[name] = re.findall(r"^iter \d+ \| loss (\S+)", out, re.M)
        first_step_lines[name] = re.findall(r"^INFO: first step \d+\.\d s, compile included \((.*)\)$", err, re.M)
    n_layer = int(next(a for a in TINY_MODEL if a.startswith("--n_layer=")).partition("=")[2])
    assert compiled == ["Block.forward"] * n_layer + ["GPT.head"]
    assert len(losses["plain"]) == 3 and losses["blocks"] == losses["plain"]
    assert first_step_lines == {"blocks": ["torch.compile per block"], "plain": []}


@pytest.mark.gpu
def test_gpu_cuda_graphs_accumulate_gradients_as_the_default_compile_does(char_data, tmp_path, capsys):
    """compile_mode=reduce-overhead replays CUDA graphs, whose gradient outputs the next micro-step's replay
    overwrites (train.build_train_state): 4 micro-steps a step, float32, no clipping to hide a wrong gradient's
    size; the same losses and weights as compile_mode=default."""
    losses, weights = {}, {}
    for mode in ("default", "reduce-overhead"):
        out = tmp_path / mode
        settings = ("--dtype=float32", "--compile=true", f"--compile_mode={mode}", "--grad_clip=0", "--max_iters=6")
        more = ("--gradient_accumulation_steps=4", "--eval_interval=6", "--log_interval=1", "--eval_on_start=false")
        try:
            assert train.main(tiny_args(char_data, out, *settings, *more)) == 0, capsys.readouterr().err
        finally:
            torch._dynamo.reset()
        losses[mode] = [float(line.split()[4]) for line in lines_starting(capsys.readouterr().out, "iter ")]
        weights[mode] = load_checkpoint(out / "ckpt.pt")["model"]
    assert len(losses["default"]) == 6
    assert losses["reduce-overhead"] == pytest.approx(losses["default"], abs=2e-4)
    for name, weight in weights["default"].items():
        torch.testing.assert_close(weights["reduce-overhead"][name], weight, rtol=1e-4, atol=1e-5, msg=name)


# ---- what a run leaves in its out_dir, and whose out_dir it is ----


def error_line(capsys) -> str:
    """The one line on stderr besides the run's INFO lines; it must be an error line."""
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if not line.startswith("INFO: ")]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    return lines[0]


def test_an_out_dir_in_use_is_refused_naming_the_holder(char_data, tmp_path, capsys):
    out = tmp_path / "out"
    with claim_out_dir(out, continuing=False, overwrite=False):  # another run's hold (flock: even in this process)
        assert train.main(tiny_args(char_data, out, "--max_iters=2", "--overwrite_out_dir=true")) == 2
        assert f"out_dir {out} is in use by another run (pid {os.getpid()}," in error_line(capsys)
        assert [p.name for p in out.iterdir()] == [".lock"]  # the holder's; this run wrote nothing
    assert train.main(tiny_args(char_data, out, "--max_iters=2", "--eval_interval=2")) == 0  # released
    assert sorted(p.name for p in out.iterdir()) == ["best.pt", "ckpt-0000002.pt", "ckpt.pt"]  # no .lock left


def test_overwrite_out_dir_lets_a_fresh_run_replace_an_earlier_runs_checkpoints(trained_out, char_data, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(trained_out, out)
    assert train.main(tiny_args(char_data, out, "--max_iters=2", "--eval_interval=2", "--overwrite_out_dir=true")) == 0
    assert load_checkpoint(out / "ckpt.pt")["iter_num"] == 2
    assert load_checkpoint(out / "best.pt")["iter_num"] == 2


def test_a_fine_tune_that_never_improves_still_leaves_its_last_state(monkeypatch, trained_out, tmp_path, capsys):
    """The val loss only rises after eval 0: no best.pt, but the last iteration is saved as ckpt.pt (exit 0),
    and the line says why there is no best.pt."""
    real_evaluate, rising = train.evaluate, iter(range(1, 100))

    def evaluate(*args):
        real_evaluate(*args)
        loss = float(next(rising))
        return {"train": loss, "val": loss}

    monkeypatch.setattr(train, "evaluate", evaluate)
    out = tmp_path / "out"
    data = load_checkpoint(trained_out / "ckpt.pt")["config"]["data_dir"]
    args = tiny_args(data, out, f"--init_from={trained_out / 'ckpt.pt'}", "--max_iters=3", "--eval_interval=1")
    assert train.main(args) == 0
    stdout = capsys.readouterr().out
    last = f"saved {out / 'ckpt.pt'} (iter 3, val 4.0000; val never went below 1.0000, the starting loss, "
    assert f"{last}so there is no {out / 'best.pt'})" in stdout.splitlines(), stdout
    assert sorted(p.name for p in out.iterdir()) == ["ckpt-0000003.pt", "ckpt.pt"]


@pytest.mark.parametrize("when", ["at-start-up", "at-a-save"])
def test_a_full_disk_is_one_line_and_keeps_the_previous_checkpoint(trained_out, char_data, tmp_path, capsys, when):
    """Before training, out_dir gets a real write (fsynced): a full disk (here the file size limit, which fails
    writes the same way) stops the run there. At a save, it is one line naming the file and the cause, not
    torch's 'unexpected pos ...', and ckpt.pt is the previous one."""
    out = tmp_path / "out"
    shutil.copytree(trained_out, out)
    before = tree_digest(out)
    args = tiny_args(char_data, out, "--init_from=resume", "--max_iters=6", "--eval_interval=2")
    with file_size_limit(1 if when == "at-start-up" else 64 * 1024):
        assert train.main(args) == 2
    line = error_line(capsys)
    if when == "at-start-up":
        assert line.startswith(f"error: out_dir {out} cannot be used: File too large [EFBIG] ({out}/.write-probe"), line
        assert "iter " not in capsys.readouterr().out  # no step was taken
    else:
        cause = "File too large [EFBIG]; ckpt.pt is unchanged"
        assert line == f"error: could not save iter 6: {out / 'ckpt-0000006.pt'}: {cause}", line
    assert tree_digest(out) == before


def test_a_disk_too_small_for_the_first_save_is_refused_before_training(monkeypatch, char_data, tmp_path, capsys):
    monkeypatch.setattr(checkpoint, "free_bytes", lambda folder: 100_000)
    assert train.main(tiny_args(char_data, tmp_path / "out", "--max_iters=2")) == 2
    line = error_line(capsys)
    assert "has 97.7 KiB free; the first save needs about" in line and "choose another --out_dir" in line, line
    assert not (tmp_path / "out").exists()


def statvfs_with_inodes(monkeypatch, files: int, free: int) -> None:
    """os.statvfs as it is, but with `files` inodes of which `free` are free (all for an unprivileged writer)."""
    real = os.statvfs

    def statvfs(path):
        fields = list(real(path))[:10]
        fields[5:8] = [files, free, free]  # f_files, f_ffree, f_favail
        return os.statvfs_result(fields)

    monkeypatch.setattr(os, "statvfs", statvfs)


@pytest.mark.parametrize("files, free", [(1000, 4), (0, 0)], ids=["4-inodes-free", "no-inode-count"])
def test_a_filesystem_out_of_inodes_is_refused_before_training(monkeypatch, char_data, tmp_path, capsys, files, free):
    """Free bytes but too few free inodes: no file could be created at the first save, so the run stops before
    training, in one line. A filesystem that counts no inodes (btrfs reports 0 of 0) is not refused."""
    statvfs_with_inodes(monkeypatch, files, free)
    out = tmp_path / "out"
    code = train.main(tiny_args(char_data, out, "--max_iters=0"))
    if files == 0:
        assert code == 0
        return
    assert code == 2
    line = error_line(capsys)
    assert line == (
        f"error: out_dir {out}: its filesystem has 4 free inodes (file entries; `df -i` shows them), and this run "
        "creates 5 files by the end of its first save; delete files there or choose another --out_dir"
    )
    assert not out.exists()


def test_an_out_dir_that_turns_read_only_mid_run_ends_with_the_save_error(monkeypatch, char_data, tmp_path, capsys):
    """The save fails (exit 2, its one error line); then .lock cannot be removed either: a warning line, not a
    PermissionError traceback with exit code 1."""
    out = tmp_path / "out"
    real_unlink = pathlib.Path.unlink

    def unlink(path, missing_ok=False):
        if path.name == ".lock":
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_unlink(path, missing_ok=missing_ok)

    def atomic_save(state, path):
        raise PermissionError(errno.EACCES, "Permission denied", str(path))

    monkeypatch.setattr(pathlib.Path, "unlink", unlink)
    monkeypatch.setattr(checkpoint, "atomic_save", atomic_save)
    assert train.main(tiny_args(char_data, out, "--max_iters=2", "--eval_interval=2")) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if not line.startswith("INFO: ")]
    assert lines == [
        f"WARNING: could not remove {out / '.lock'} (Permission denied [EACCES]); it blocks no later run: the lock "
        "ends here",
        f"error: could not save iter 2: {out / 'ckpt-0000002.pt'}: Permission denied [EACCES]; no ckpt.pt yet",
    ]
    monkeypatch.undo()
    with claim_out_dir(out, continuing=False, overwrite=False):  # the lock ended with the run
        pass


def test_a_resume_keeps_the_checkpoints_block_size_and_a_fine_tune_crops_it(trained_out, char_data, tmp_path, capsys):
    """A resume at a shorter block_size is refused (its next save would crop the checkpoint's position table for
    good); a fine-tune from the same file crops it, into its own out_dir."""
    out = tmp_path / "out"
    shutil.copytree(trained_out, out)
    before = tree_digest(out)
    assert train.main(tiny_args(char_data, out, "--init_from=resume", "--block_size=8", "--max_iters=6")) == 2
    assert error_line(capsys) == (
        "error: block_size 8 is smaller than the checkpoint's 16; a resume keeps the checkpoint's model: resume "
        f"with --block_size=16, or crop it in a fine-tune (--init_from={out / 'ckpt.pt'} --out_dir=ANOTHER_DIR)"
    )
    assert tree_digest(out) == before
    tuned = tmp_path / "tuned"
    args = tiny_args(char_data, tuned, f"--init_from={out / 'ckpt.pt'}", "--block_size=8", "--max_iters=2")
    assert train.main([*args, "--eval_interval=2"]) == 0
    assert load_checkpoint(tuned / "ckpt.pt")["model_config"]["block_size"] == 8
    assert load_checkpoint(out / "ckpt.pt")["model_config"]["block_size"] == 16


def cached_hub_model(monkeypatch, cache, name: str, checkpoint) -> None:
    """The Hugging Face cache in `cache`, offline, holding `checkpoint` exported as the hub model `name`."""
    from huggingface_hub import constants

    commit = "0123456789abcdef0123456789abcdef01234567"
    (cache / f"models--{name}" / "refs").mkdir(parents=True)
    (cache / f"models--{name}" / "refs" / "main").write_text(commit)
    export_hf(checkpoint, cache / f"models--{name}" / "snapshots" / commit)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # read when huggingface_hub was imported
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))


@pytest.mark.parametrize("source", ["resume", "pt", "hf", "gpt2"])
def test_eval_only_says_which_weights_it_evaluated(monkeypatch, trained_out, char_data, tmp_path, capsys, source):
    """eval_only from out_dir's checkpoint, a .pt, a Hugging Face folder, or a hub name (nanoGPT's eval_gpt2
    configs: eval_only with init_from='gpt2'); the last line names it."""
    out = tmp_path / "out"
    shutil.copytree(trained_out, out)
    init_from = {"resume": "resume", "pt": out / "ckpt-0000002.pt", "hf": tmp_path / "hf", "gpt2": "gpt2"}[source]
    if source == "hf":
        export_hf(out / "ckpt.pt", init_from)
    elif source == "gpt2":
        cached_hub_model(monkeypatch, tmp_path / "hub", "gpt2", out / "ckpt.pt")
    before = tree_digest(tmp_path)
    assert train.main(tiny_args(char_data, out, f"--init_from={init_from}", "--eval_only=true")) == 0
    stdout = capsys.readouterr().out
    evaluated = {
        "resume": f"{out / 'ckpt.pt'} (iter 4)",
        "pt": f"the weights of {init_from}",
        "hf": f"the Hugging Face GPT-2 {init_from}",
        "gpt2": "the Hugging Face GPT-2 gpt2",
    }[source]
    assert stdout.splitlines()[-1] == f"eval_only: evaluated {evaluated}; no checkpoint written", stdout
    assert len(EVAL_LINE.findall(stdout)) == 1
    assert tree_digest(tmp_path) == before


@pytest.mark.parametrize("init_from", ["scratch", "auto"])
def test_eval_only_of_a_random_model_is_refused(char_data, tmp_path, capsys, init_from):
    """init_from=scratch (or auto in an out_dir without ckpt.pt) would evaluate random weights."""
    out = tmp_path / "out"
    assert train.main(tiny_args(char_data, out, f"--init_from={init_from}", "--eval_only=true")) == 2
    line = error_line(capsys)
    assert line.startswith(
        f"error: eval_only=true with init_from=scratch would evaluate a randomly initialised model (there is no "
        f"{out / 'ckpt.pt'}); name the weights to evaluate with --init_from: resume (out_dir's ckpt.pt), a .pt file, "
    ), line
    assert line.endswith("or gpt2, gpt2-medium, gpt2-large, gpt2-xl"), line
    assert not out.exists()


def test_clip_and_step_without_a_loss_scale_clips_steps_and_skips_non_finite_gradients():
    """bfloat16/float32 with a fused AdamW: no GradScaler pass (the scaler is never touched), the same update as
    clip_grad_norm_ then step, and a NaN gradient leaves weights, moments and step counts exactly as they were."""
    torch.manual_seed(0)
    config = GPTConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=64, block_size=16)
    model, twin = GPT(config), GPT(config)
    twin.load_state_dict(model.state_dict())
    optimizer = model.configure_optimizers(0.1, 1e-2, (0.9, 0.95), "cpu")
    reference = twin.configure_optimizers(0.1, 1e-2, (0.9, 0.95), "cpu")
    assert optimizer.defaults["fused"]
    for _ in range(3):
        for a, b in zip(model.parameters(), twin.parameters()):
            a.grad = torch.randn_like(a) * 10  # a norm far above 1.0: clipping acts
            b.grad = a.grad.clone()
        norm = train.clip_and_step(optimizer, object(), model, 1.0, torch.bfloat16)  # object(): no scaler calls
        assert torch.equal(norm, torch.nn.utils.clip_grad_norm_(twin.parameters(), 1.0)) and norm > 1.0
        reference.step()
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters()))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    moments = [{k: v.clone() for k, v in optimizer.state[p].items()} for p in model.parameters()]
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    next(model.parameters()).grad[0, 0] = float("nan")
    norm = train.clip_and_step(optimizer, object(), model, 1.0, torch.float32)
    assert norm.isnan()
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    for p, kept in zip(model.parameters(), moments):
        assert all(torch.equal(optimizer.state[p][k], v) for k, v in kept.items())
    for p in model.parameters():  # the skip is this step's alone: the next finite step updates every weight
        p.grad = torch.ones_like(p)
    assert train.clip_and_step(optimizer, object(), model, 1.0, torch.float32).isfinite()
    assert all(not torch.equal(v, before[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("bias", [True, False])
def test_parameter_count_from_the_config_matches_the_model(bias):
    """Sizes are checked from the config alone, before anything is allocated: the count must be the model's."""
    config = GPTConfig(vocab_size=41, block_size=16, n_layer=3, n_head=2, n_embd=32, bias=bias)
    assert preflight.parameter_count(config) == sum(p.numel() for p in GPT(config).parameters())


# ---- the config surface ----


def test_help_lists_every_field(capsys):
    with pytest.raises(SystemExit) as exit_:
        train.main(["--help"])
    assert exit_.value.code == 0
    help_text = capsys.readouterr().out
    for field in dataclasses.fields(TrainConfig):
        assert re.search(rf"^\s+--{field.name}=", help_text, re.M), f"--help does not list {field.name}"
    assert "checkpoints go here" in help_text  # the field comments are the documentation


def test_deprecated_backend_key_sets_dist_backend(tmp_path):
    with pytest.warns(DeprecationWarning, match="^'backend' is deprecated; use dist_backend='gloo'$"):
        assert load_config(TrainConfig(), ["--backend=gloo"], DEPRECATED).dist_backend == "gloo"
    path = tmp_path / "ddp.py"
    path.write_text('backend = "gloo"\n')
    with pytest.warns(DeprecationWarning, match="'backend' is deprecated"):
        assert load_config(TrainConfig(), [str(path)], DEPRECATED).dist_backend == "gloo"
    assert load_config(TrainConfig(), ["--dist_backend=gloo"], DEPRECATED).dist_backend == "gloo"


def test_default_config_file_equals_train_config_defaults():
    path = REPO / "config" / "train_shakespeare_char.py"
    names = [name for name in runpy.run_path(str(path)) if not name.startswith("_")]
    assert len(names) > 10
    loaded, defaults = load_config(TrainConfig(), [str(path)]), TrainConfig()
    differ = {
        name: (getattr(loaded, name), getattr(defaults, name))
        for name in names
        if getattr(loaded, name) != getattr(defaults, name)
    }
    assert not differ, f"config file vs TrainConfig defaults: {differ}"
    assert loaded == defaults


def config_files():
    return [pytest.param(path, id=path.name) for path in sorted((REPO / "config").glob("*.py"))]


@pytest.mark.parametrize("path", config_files())
def test_every_config_file_loads(path):
    cfg = load_config(TrainConfig(), [str(path)])
    assert cfg != TrainConfig() or path.name == "train_shakespeare_char.py"


@pytest.mark.parametrize("size", ["", "_medium", "_large", "_xl"])
def test_nanogpts_eval_configs_evaluate_gpt2_on_openwebtext(size):
    """config/eval_gpt2*.py as nanoGPT's: GPT-2 of that size, evaluated once over 500 batches of 8, no wandb;
    the shape settings are left to the weights."""
    cfg, explicit = load_config_and_explicit_keys(TrainConfig(), [str(REPO / "config" / f"eval_gpt2{size}.py")])
    assert cfg == TrainConfig(
        batch_size=8,
        eval_iters=500,
        eval_only=True,
        init_from=f"gpt2{size.replace('_', '-')}",
        dataset="openwebtext",
        wandb_log=False,
    )
    assert not explicit & {"n_layer", "n_head", "n_embd", "block_size", "bias", "vocab_size"}


# ---- learning rate schedule ----

SCHEDULE = TrainConfig(learning_rate=1e-3, min_lr=1e-4, warmup_iters=10, lr_decay_iters=100, max_iters=120)


def test_learning_rate_is_nonzero_at_iter_0():
    assert learning_rate_at(0, SCHEDULE) > 0
    assert learning_rate_at(0, dataclasses.replace(SCHEDULE, warmup_iters=0)) == pytest.approx(1e-3)


def test_learning_rate_warmup_is_linear():
    lrs = [learning_rate_at(it, SCHEDULE) for it in range(SCHEDULE.warmup_iters + 1)]
    steps = [b - a for a, b in zip(lrs, lrs[1:])]
    assert all(step == pytest.approx(steps[0]) for step in steps) and steps[0] > 0
    assert lrs[-1] == pytest.approx(SCHEDULE.learning_rate)  # the peak at warmup_iters


def test_learning_rate_decays_to_min_lr_at_lr_decay_iters():
    decay = [learning_rate_at(it, SCHEDULE) for it in range(SCHEDULE.warmup_iters, SCHEDULE.lr_decay_iters + 1)]
    assert all(b <= a for a, b in zip(decay, decay[1:]))
    assert decay[-1] == pytest.approx(SCHEDULE.min_lr)
    assert learning_rate_at(SCHEDULE.lr_decay_iters + 15, SCHEDULE) == pytest.approx(SCHEDULE.min_lr)


def test_learning_rate_constant_without_decay():
    cfg = dataclasses.replace(SCHEDULE, decay_lr=False)
    assert {learning_rate_at(it, cfg) for it in (0, 5, 10, 50, 100, 500)} == {cfg.learning_rate}


# ---- MFU ----


@pytest.mark.parametrize(
    "name, flops",
    [
        ("NVIDIA H100 80GB HBM3", 989.5e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
    ],
)
def test_peak_flops_for_known_gpus(monkeypatch, name, flops):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert peak_flops_for(torch.device("cuda"), torch.bfloat16, None) == (flops, "")


def test_peak_flops_for_unknown_gpu_cpu_and_override(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Acme Tensor Card 9000")
    peak, why = peak_flops_for(torch.device("cuda"), torch.bfloat16, None)
    assert peak == 0 and "Acme Tensor Card 9000" in why and "--peak_flops" in why
    peak, why = peak_flops_for(torch.device("cpu"), torch.float32, None)
    assert peak == 0 and "cpu" in why and "--peak_flops" in why
    assert peak_flops_for(torch.device("cuda"), torch.bfloat16, 123e12) == (123e12, "")
    assert peak_flops_for(torch.device("cpu"), torch.float32, 5e11) == (5e11, "")


def test_mfu_is_model_flops_over_the_peak_of_all_devices():
    assert model_flops_utilization(4e14, 2.0, 1e15) == pytest.approx(0.2)
    assert model_flops_utilization(4e14, 2.0, 1e15, devices=4) == pytest.approx(0.05)
    assert model_flops_utilization(4e14, 2.0, 0.0) is None  # no known peak: MFU n/a


# ---- exact resume after kill -9 ----


def iter_fields(output: str) -> dict[int, str]:
    """{k: 'iter k | loss X | lr Y'}: the timing fields dropped."""
    found = {}
    for line in output.splitlines():
        match = re.match(r"(iter (\d+) \| loss \S+ \| lr \S+) \|", line)
        if match:
            found[int(match.group(2))] = match.group(1)
    return found


def test_exact_resume_after_kill_9(char_data, tmp_path, capsys, warm_interpreter):
    """2N iterations straight == N, kill -9 (no clean exit), resume to 2N: the same losses and learning
    rates at every iteration after N. Dropout is on, so the RNG streams must be restored too. Only the
    killed run needs a process of its own; the straight and resumed runs are in-process, on one thread
    like the child, so all three compute bit for bit alike."""
    n = 60  # > the ~50 log lines the one-page pipe holds: the killed run blocks long before its save at 2N
    common = (f"--max_iters={2 * n}", f"--eval_interval={n}", "--always_save_checkpoint=true", "--dropout=0.1")
    killed_out = tmp_path / "killed"
    with Child("train.py", tiny_args(char_data, killed_out, *common), warm=True) as killed:
        capsys.readouterr()
        assert train.main(tiny_args(char_data, tmp_path / "straight", *common)) == 0  # while the child starts
        straight_output = capsys.readouterr().out
        killed.wait_for(lambda line: line.startswith("saved ") and f"(iter {n}," in line)
        assert killed.proc.poll() is None
        os.kill(killed.pid, signal.SIGKILL)
        killed_code, killed_output = killed.finish(timeout=60)
    assert killed_code == -signal.SIGKILL
    assert load_checkpoint(killed_out / "ckpt.pt")["iter_num"] == n
    assert f"(iter {2 * n}," not in killed_output

    assert train.main(tiny_args(char_data, killed_out, *common, "--init_from=resume")) == 0
    resumed_output = capsys.readouterr().out
    assert f"resuming at iter {n}" in resumed_output
    want, got = iter_fields(straight_output), iter_fields(resumed_output)
    assert sorted(got) == list(range(n + 1, 2 * n + 1))
    assert [got[k] for k in got] == [want[k] for k in got]
    assert lines_starting(resumed_output, f"eval {2 * n} ") == lines_starting(straight_output, f"eval {2 * n} ")
    before_kill = iter_fields(killed_output)
    assert all(before_kill[k] == want[k] for k in range(1, n + 1))


# ---- datasets: auto-prepare and unknown names ----


def test_ensure_dataset_unknown_dataset_lists_known_ones():
    with pytest.raises(DataError) as error:
        loader.ensure_dataset("no_such_dataset")
    message = str(error.value)
    assert "no_such_dataset" in message and "shakespeare_char" in message and "--data_dir" in message


def test_missing_bins_run_the_dataset_prepare(monkeypatch, tmp_path, capsys):
    root = tmp_path / "data"
    (root / "fakeds").mkdir(parents=True)
    (root / "fakeds" / "prepare.py").write_text("# stands in for a real prepare script\n")
    calls = []

    def fake_prepare_main(argv):
        calls.append(argv)
        prepare_text("the king and the queen speak of love and death.\n" * 40, root / "fakeds", "char")

    real_import = loader.importlib.import_module

    def import_module(name, *args):
        if name == "data.fakeds.prepare":
            return types.SimpleNamespace(main=fake_prepare_main)
        return real_import(name, *args)

    monkeypatch.setattr(loader, "DATA_ROOT", root)
    monkeypatch.setattr(common, "DATA_ROOT", root)  # prepare_command names the datasets it finds there
    monkeypatch.setattr(loader.importlib, "import_module", import_module)
    argv = ["--dataset=fakeds", f"--out_dir={tmp_path / 'out'}", *TINY_MODEL, "--max_iters=2", "--eval_interval=2"]
    assert train.main(argv) == 0
    out = capsys.readouterr().out
    assert f"{root / 'fakeds'}: train.bin, val.bin, meta.json missing; running python -m data.fakeds.prepare" in out
    assert calls == [[]]
    assert "iter 2 |" in out

    argv[1] = f"--out_dir={tmp_path / 'out2'}"  # a second run of its own: out has the first run's checkpoints
    assert train.main(argv) == 0  # the bins exist now: no second prepare
    assert calls == [[]]


# ---- wandb ----


def test_wandb_missing_is_a_usage_error(monkeypatch, char_data, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    code = train.main(tiny_args(char_data, tmp_path / "out", "--wandb_log=true", "--max_iters=2"))
    err = capsys.readouterr().err
    assert code == 2
    errors = lines_starting(err, "error: ")
    assert len(errors) == 1 and "pip install wandb" in errors[0], err
    assert "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_wandb_offline_run(monkeypatch, char_data, tmp_path, capsys):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    code = train.main(tiny_args(char_data, tmp_path / "out", "--wandb_log=true", "--max_iters=2", "--eval_interval=2"))
    assert code == 0, capsys.readouterr().err


def test_an_fsdp_runs_space_check_counts_the_optimizer_state_once():
    """Under FSDP the three checkpoint files of a save hold the weights and the folder of shards the AdamW state,
    once: about 3 + 2 weights' bytes against DDP's 3 x (1 + 2), for a model whose overheads are small."""
    from training.preflight import first_save_size
    from training.runtime import Runtime

    model = GPT(GPTConfig(n_layer=2, n_head=4, n_embd=256, block_size=64, vocab_size=8192))
    weights = sum(p.numel() for p in model.parameters()) * 4
    runtime = Runtime(torch.device("cpu"), torch.float32, world_size=4)
    fsdp = first_save_size(TrainConfig(parallelism="fsdp", block_size=64), runtime, model).need()
    ddp = first_save_size(TrainConfig(parallelism="ddp", block_size=64), runtime, model).need()
    assert 5 * weights < fsdp < 5.2 * weights and 9 * weights < ddp < 9.2 * weights, (weights, fsdp, ddp)


def test_the_memory_check_counts_what_each_rank_holds(monkeypatch):
    """check_memory asks for each rank's share: 16 bytes a parameter alone or under DDP, 1/N of them under FSDP,
    1/N of AdamW's 8 under ZeRO-1, 4 to evaluate; FSDP without resharding the gathered weights too; and the
    activations of this rank's tokens (under context parallelism its 1/N share of each sequence), as its refusal
    says."""
    from errors import UsageError
    from storage.checkpoint import format_bytes
    from training import preflight
    from training.preflight import check_memory, state_bytes_per_param
    from training.runtime import Runtime

    sizes = [(TrainConfig(), 16), (TrainConfig(parallelism="fsdp"), 4), (TrainConfig(shard_optimizer=True), 10)]
    sizes += [(TrainConfig(eval_only=True), 4), (TrainConfig(parallelism="fsdp", eval_only=True), 1)]
    assert [state_bytes_per_param(cfg, 4) for cfg, _ in sizes] == [size for _, size in sizes]
    assert state_bytes_per_param(TrainConfig(shard_optimizer=True), 1) == 16

    def activations(cfg, runtime) -> str:  # what the refusal says of them, with 1 byte free
        with pytest.raises(UsageError, match="needs at least") as refusal:
            check_memory(cfg, 256, runtime)
        return re.search(r"and (\S+ \S+) of activations", str(refusal.value)).group(1)

    monkeypatch.setattr(preflight, "available_memory", lambda device: (1, "the test's device has 1 byte"))
    cfg = TrainConfig(n_layer=2, n_head=4, n_embd=256, block_size=65536, batch_size=1, activation_checkpointing="none")
    one = Runtime(torch.device("cpu"), torch.float32)
    split = Runtime(torch.device("cpu"), torch.float32, world_size=2, context_parallel=2)
    # 65,536 tokens x 4 bytes x (8 x 2 layers x 256 + the logits and their gradient, 2 x 256): 1.125 GiB
    assert activations(cfg, one) == "1.1 GiB"
    assert activations(dataclasses.replace(cfg, context_parallel=2), split) == "576.0 MiB"  # half the tokens

    # FSDP without resharding also keeps every unit's gathered weights: float32 here, 4 bytes a parameter
    ranks = Runtime(torch.device("cpu"), torch.float32, world_size=2)
    gathered = format_bytes(4 * preflight.parameter_count(cfg.model_config(vocab_size=256)))
    for reshard in (True, False):
        sharded = dataclasses.replace(cfg, parallelism="fsdp", fsdp_reshard_after_forward=reshard)
        with pytest.raises(UsageError, match="needs at least") as refusal:
            check_memory(sharded, 256, ranks)
        assert (f", {gathered} of weights gathered for backward" in str(refusal.value)) is not reshard

    # FSDP accumulating over micro-steps keeps its gradients whole in float32 unless it reduce-scatters each
    for accum, every_step, whole in ((4, False, True), (4, True, False), (2, False, False)):  # over 2 ranks
        sharded = dataclasses.replace(
            cfg, parallelism="fsdp", gradient_accumulation_steps=accum, fsdp_reduce_every_micro_step=every_step
        )
        with pytest.raises(UsageError, match="needs at least") as refusal:
            check_memory(sharded, 256, ranks)
        said = f", {gathered} of gradients kept whole" in str(refusal.value)
        assert said is whole and ("fsdp_reduce_every_micro_step=true" in str(refusal.value)) is whole, accum


def test_profile_steps_reports_where_the_steps_time_goes(char_data, tmp_path, capsys):
    """--profile_steps=2 on CPU: after the 6 steps the profiler waits and warms up on, steps 7 and 8 recorded;
    out_dir gets this rank's report (wall time, time by kind) and a gzipped Chrome trace; training goes on."""
    import gzip

    out = tmp_path / "out"
    code = train.main(tiny_args(char_data, out, "--max_iters=10", "--eval_interval=10", "--profile_steps=2"))
    assert code == 0, capsys.readouterr().err
    report = (out / "profile-rank0.md").read_text()
    assert report.startswith("# rank 0: steps 7..8 of this run") and "ms/step" in report, report
    assert "| kind | ms/step | share |" in report
    trace = json.loads(gzip.decompress((out / "profile-rank0.json.gz").read_bytes()))
    assert trace["traceEvents"]
    assert "profile of 2 steps" in capsys.readouterr().out


@pytest.mark.parametrize("max_iters, recorded", [(6, 0), (7, 1)], ids=["ends in the warm-up", "ends after 1 of 2"])
def test_a_run_that_ends_before_the_profiled_steps_are_done_says_what_it_recorded(
    max_iters, recorded, char_data, tmp_path, capsys
):
    """--profile_steps=2 with a run too short for it: ended in the profiler's warm-up step it says nothing was
    recorded, one step in it reports that one; either way it ends as a run does, without a traceback."""
    out = tmp_path / "out"
    code = train.main(tiny_args(char_data, out, f"--max_iters={max_iters}", "--profile_steps=2"))
    printed = capsys.readouterr()
    assert code == 0 and "Traceback" not in printed.err, printed.err
    assert ("nothing recorded, the run ended before step 7" in printed.out) is (recorded == 0)
    assert (out / "profile-rank0.md").exists() is (recorded == 1)
    assert recorded == 0 or "profile of 1 step:" in printed.out


def test_the_gpu_profile_counts_kernels_not_the_ranges_that_annotate_its_timeline():
    """device_events keeps the GPU's kernels and drops its user annotations (ProfilerStep#N spans the whole step:
    counted as a kernel, the GPU would look busy all the time, and no communication exposed); the host's ops apart."""
    from types import SimpleNamespace

    from training.profiling import device_events

    def event(name, device, annotation=False):
        return SimpleNamespace(name=name, device_type=SimpleNamespace(name=device), is_user_annotation=annotation)

    events = [
        event("ProfilerStep#7", "CUDA", annotation=True),
        event("nccl:_reduce_scatter_base", "CUDA", annotation=True),
        event("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL", "CUDA"),
        event("sm90_xmma_gemm_bf16", "CUDA"),
        event("aten::mm", "CPU"),
    ]
    assert [e.name for e in device_events(events, on_gpu=True)] == [
        "ncclDevKernel_ReduceScatter_Sum_f32_RING_LL",
        "sm90_xmma_gemm_bf16",
    ]
    assert [e.name for e in device_events(events, on_gpu=False)] == ["aten::mm"]


def test_communication_counts_as_hidden_where_a_compute_kernel_runs_beside_it():
    """exposed_communication over (name, start, end) kernels: the all-gather from 0 to 10 has a matmul beside it
    from 5 to 20, the all-reduce from 30 to 40 nothing: 20 of communication, 15 of it not hidden."""
    from training.profiling import exposed_communication, union_length

    kernels = [
        ("ncclDevKernel_AllGather_RING_LL", 0.0, 10.0),
        ("sm90_xmma_gemm_bf16", 5.0, 20.0),
        ("triton_poi_fused_add_0", 12.0, 14.0),
        ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 30.0, 40.0),
    ]
    assert exposed_communication(kernels) == (20.0, 15.0)
    assert union_length([(0, 2), (1, 3), (5, 6)]) == 4 and union_length([]) == 0


def test_a_fresh_model_is_built_where_it_is_asked_to_be():
    """train.py builds a fresh model on the GPU it trains on (initializing billions of weights there takes a second,
    on the CPU minutes); the meta device stands in for the GPU here."""
    cfg = TrainConfig(n_layer=2, n_head=2, n_embd=32, block_size=16)
    assert all(p.is_meta for p in train.build_model(cfg, 64, None, device="meta").parameters())
    assert all(p.device.type == "cpu" for p in train.build_model(cfg, 64, None).parameters())


@pytest.mark.parametrize(
    "device, weights_gb, sharded, built_on",
    [
        ("cpu", 1, False, "cpu"),
        ("cuda:0", 100, False, "cuda:0"),  # it trains there whole: built there
        ("cuda:0", 26, True, "cuda:0"),  # FSDP's rank 0 holds GPT-3 6.7B's weights on an 80 GB card for a moment
        ("cuda:0", 80, True, "cpu"),  # but not a model as large as the card: host memory
    ],
)
def test_where_the_model_is_built(monkeypatch, device, weights_gb, sharded, built_on):
    from training import parallel

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: types.SimpleNamespace(total_memory=80e9))
    runtime = types.SimpleNamespace(device=torch.device(device))
    assert parallel.build_device(runtime, int(weights_gb * 1e9), sharded=sharded) == torch.device(built_on)
