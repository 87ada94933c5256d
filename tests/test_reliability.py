"""train.py under stress: SIGTERM/SIGINT/SIGHUP save and exit cleanly, a closed stdout does not stop a run,
non-finite steps are skipped, stop the run and never become a checkpoint, a run always leaves its last state,
one run owns an out_dir, a failed write is one line before or during training, and every bad input is one
`error: ` line with exit code 2 that leaves the disk as it was."""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import re
import shutil
import signal

import numpy as np
import pytest
import torch

import model
import train
from checkpoint import load_checkpoint
from helpers import Child, tiny_args, tree_digest

pytestmark = pytest.mark.usefixtures("one_thread")


# ---- signals: finish the step, save, exit 0; resume from there ----


def test_stop_signals_save_and_exit_then_resume(char_data, tmp_path, capsys):
    """One child per signal, run side by side: the interpreter start is most of each child's time. SIGHUP (the
    terminal closed) stops a run like SIGTERM."""
    runs = {sig: tmp_path / sig.name for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    endless = ("--max_iters=100000", "--eval_interval=100000")
    with contextlib.ExitStack() as stack:
        children = {sig: Child("train.py", tiny_args(char_data, out, *endless)) for sig, out in runs.items()}
        for child in children.values():
            stack.enter_context(child)
        for sig, child in children.items():
            child.wait_for(lambda line: line.startswith("iter 3 |"))
            os.kill(child.pid, sig)
        finished = {sig: child.finish(timeout=60) for sig, child in children.items()}

    for sig, out in runs.items():
        code, output = finished[sig]
        assert code == 0, output
        assert "Traceback" not in output
        match = re.search(rf"^received {sig.name}; saved (\S+) at iter (\d+); exiting$", output, re.M)
        assert match, output
        path, stopped_at = match.group(1), int(match.group(2))
        assert path == str(out / "ckpt.pt")
        assert stopped_at >= 3
        assert re.findall(r"^iter (\d+) \|", output, re.M)[-1] == str(stopped_at)  # the last step is logged
        assert load_checkpoint(path)["iter_num"] == stopped_at

        capsys.readouterr()
        resume = ("--init_from=resume", f"--max_iters={stopped_at + 2}", "--eval_interval=100000")
        code = train.main(tiny_args(char_data, out, *resume))
        resumed = capsys.readouterr().out
        assert code == 0
        assert f"resuming at iter {stopped_at}" in resumed
        assert re.findall(r"^iter (\d+) \|", resumed, re.M) == [str(stopped_at + 1), str(stopped_at + 2)]


def test_in_process_run_restores_signal_handlers(char_data, tmp_path, capsys):
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    assert train.main(tiny_args(char_data, tmp_path / "out", "--max_iters=1", "--eval_interval=1")) == 0
    assert {sig: signal.getsignal(sig) for sig in before} == before


# ---- non-finite loss: skipped steps, a warning, a stop after max_bad_steps ----


def inject_nan(monkeypatch, bad_steps) -> dict:
    """Make the loss NaN (so the gradients are NaN too) on the training forward passes whose 0-based
    step index is in `bad_steps`; record the model and its weights at the first bad step."""
    real_forward = model.GPT.forward
    seen = {"steps": 0, "model": None, "weights_at_first_nan": None}

    def forward(self, idx, targets=None, doc_ids=None):
        logits, loss = real_forward(self, idx, targets, doc_ids)
        if self.training and targets is not None:
            step = seen["steps"]
            seen["steps"] += 1
            if step in bad_steps:
                if seen["weights_at_first_nan"] is None:
                    seen["model"] = self
                    seen["weights_at_first_nan"] = {k: v.clone() for k, v in self.state_dict().items()}
                loss = loss * float("nan")
        return logits, loss

    monkeypatch.setattr(model.GPT, "forward", forward)
    return seen


def test_persistent_nan_stops_with_exit_1(monkeypatch, char_data, tmp_path, capsys):
    out = tmp_path / "out"
    first_bad, max_bad = 4, 3  # step index 4 makes iter 5; the checkpoint at iter 4 is the last good one
    seen = inject_nan(monkeypatch, range(first_bad, 10_000))
    digest = {}
    real_save = train.save_checkpoint

    def save_and_fingerprint(*args, **kwargs):
        path = real_save(*args, **kwargs)
        digest.update({name: value for name, value in tree_digest(out).items() if not name.endswith("/.lock")})
        return path

    monkeypatch.setattr(train, "save_checkpoint", save_and_fingerprint)
    code = train.main(
        tiny_args(
            char_data,
            out,
            "--max_iters=40",
            "--eval_interval=4",
            f"--max_bad_steps={max_bad}",
            "--always_save_checkpoint=true",
        )
    )
    captured = capsys.readouterr()
    assert code == 1
    assert "Traceback" not in captured.err
    stop = [line for line in captured.err.splitlines() if line.startswith("stopping at iter ")]
    assert len(stop) == 1, captured.err
    stopped_at = int(re.match(r"stopping at iter (\d+):", stop[0]).group(1))
    assert first_bad + max_bad <= stopped_at <= first_bad + max_bad + 1  # the flag is read one step late
    assert f"{max_bad} consecutive" in stop[0] and f"max_bad_steps={max_bad}" in stop[0]
    assert stop[0].endswith(f"; {out / 'ckpt.pt'} holds iter {first_bad}, the last state this run saved"), stop[0]

    # the bad steps changed no weight, and the checkpoint from before them is untouched and the last one
    final = seen["model"].state_dict()
    assert all(torch.equal(final[k], v) for k, v in seen["weights_at_first_nan"].items())
    assert tree_digest(out) == digest
    state = load_checkpoint(out / "ckpt.pt")
    assert state["iter_num"] == first_bad
    assert sorted(p.name for p in out.glob("ckpt-*.pt"))[-1] == f"ckpt-{first_bad:07d}.pt"
    assert all(torch.equal(state["model"][k], v) for k, v in seen["weights_at_first_nan"].items())


def test_transient_nan_is_skipped_with_a_warning(monkeypatch, char_data, tmp_path, capsys):
    out = tmp_path / "out"
    seen = inject_nan(monkeypatch, {3})
    code = train.main(tiny_args(char_data, out, "--max_iters=8", "--eval_interval=8", "--max_bad_steps=3"))
    captured = capsys.readouterr()
    assert code == 0, captured.err
    warnings = [line for line in captured.err.splitlines() if "not finite" in line]
    assert len(warnings) == 1 and warnings[0].startswith("WARNING: ") and "1 consecutive" in warnings[0], captured.err
    losses = {
        int(m.group(1)): float(m.group(2)) for m in re.finditer(r"^iter (\d+) \| loss (\S+) \|", captured.out, re.M)
    }
    assert math.isnan(losses[4]) and math.isfinite(losses[8])
    val = float(re.search(r"^eval 8 \| train \S+ \| val (\S+)$", captured.out, re.M).group(1))
    assert math.isfinite(val)
    assert all(torch.isfinite(v).all() for v in load_checkpoint(out / "ckpt.pt")["model"].values())
    assert seen["steps"] == 8


# ---- bad input: exit 2, one line, nothing on disk changed ----


def write(path, text):
    def setup(case):
        (case["tmp"] / path).write_text(text)

    return setup


def copy_checkpoint(case):
    case["out"].mkdir(exist_ok=True)
    shutil.copyfile(case["trained"] / "ckpt.pt", case["out"] / "ckpt.pt")


def damage_checkpoint(how):
    def setup(case):
        copy_checkpoint(case)
        path = case["out"] / "ckpt.pt"
        data = path.read_bytes()
        if how == "corrupt":
            path.write_bytes(random.Random(0).randbytes(len(data)))  # seeded: the same error every run
        elif how == "text":
            path.write_text("this is not a checkpoint\n" * 100)
        else:
            path.write_bytes(data[: len(data) // 3])

    return setup


def data_file(name, how):
    def setup(case):
        path = case["data"] / name
        if how == "delete":
            path.unlink()
        elif how == "empty":
            path.write_bytes(b"")
        elif how == "odd":
            path.write_bytes(path.read_bytes()[:-1])
        elif how == "short":
            path.write_bytes(path.read_bytes()[:-100])
        elif how == "uint32":
            np.fromfile(path, dtype=np.uint16).astype(np.uint32).tofile(path)
        elif how == "big_id":
            ids = np.fromfile(path, dtype=np.uint16)
            ids[len(ids) // 2] = json.loads((case["data"] / "meta.json").read_text())["vocab_size"]
            ids.tofile(path)
        elif how == "not_json":
            path.write_text('{"vocab_size": 41, "tokenizer": ')
        elif how == "no_vocab":
            meta = json.loads(path.read_text())
            del meta["vocab_size"]
            path.write_text(json.dumps(meta))

    return setup


def save_foreign_pt(case):
    torch.save({"weights": torch.zeros(2)}, case["tmp"] / "foreign.pt")


def chain(*setups):
    def setup(case):
        for s in setups:
            s(case)

    return setup


def case(name, *args, setup=None, expect=()):
    return pytest.param(list(args), setup, expect, id=name)


BAD_INPUTS = [
    # config files
    case("cfg-missing", "{tmp}/nope.py", expect=("nope.py", "not found")),
    case("cfg-not-py", "{tmp}/settings.txt", setup=write("settings.txt", "batch_size = 8\n"), expect=(".py",)),
    case(
        "cfg-syntax-error", "{tmp}/c.py", setup=write("c.py", "batch_size = = 8\n"), expect=("syntax error on line 1",)
    ),
    case(
        "cfg-unknown-name",
        "{tmp}/c.py",
        setup=write("c.py", "learning_rat = 1e-3\n"),
        expect=("learning_rat", "did you mean: learning_rate"),
    ),
    case("cfg-wrong-type", "{tmp}/c.py", setup=write("c.py", "batch_size = '12'\n"), expect=("batch_size", "int")),
    case("cfg-float-for-int", "{tmp}/c.py", setup=write("c.py", "max_iters = 1.5\n"), expect=("max_iters", "int")),
    case("cfg-bool-for-int", "{tmp}/c.py", setup=write("c.py", "n_layer = True\n"), expect=("n_layer", "int")),
    case(
        "cfg-raises",
        "{tmp}/c.py",
        setup=write("c.py", "x = 1\nbatch_size = 8 // 0\n"),
        expect=("ZeroDivisionError", "line 2"),
    ),
    # overrides: syntax and types
    case("unknown-key", "--frobnicate=1", expect=("frobnicate", "--help")),
    case("misspelled-key", "--learning_rat=1e-3", expect=("did you mean: learning_rate",)),
    case("bad-int", "--batch_size=abc", expect=("--batch_size=abc", "int")),
    case("float-for-int", "--max_iters=1.5", expect=("int",)),
    case("bad-float", "--learning_rate=fast", expect=("float",)),
    case("bad-bool", "--compile=maybe", expect=("true/false/1/0/yes/no/on/off",)),
    case("space-form", "--batch_size", "8", expect=("--batch_size=VALUE", "'--key value' is not supported")),
    case("bare-non-bool-flag", "--batch_size", expect=("needs a value", "--batch_size=VALUE")),
    case("single-dash", "-batch_size=8", expect=("--key=value",)),
    # overrides: ranges
    case("negative-batch_size", "--batch_size=-4", expect=("batch_size must be >= 1",)),
    case("zero-block_size", "--block_size=0", expect=("block_size must be >= 1",)),
    case("zero-eval_iters", "--eval_iters=0", expect=("eval_iters must be >= 1",)),
    case("zero-eval_interval", "--eval_interval=0", expect=("eval_interval must be >= 1",)),
    case("zero-log_interval", "--log_interval=0", expect=("log_interval must be >= 1",)),
    case("negative-max_iters", "--max_iters=-1", expect=("max_iters must be >= 0",)),
    case("zero-grad-accum", "--gradient_accumulation_steps=0", expect=("gradient_accumulation_steps must be >= 1",)),
    case("zero-n_layer", "--n_layer=0", expect=("n_layer must be >= 1",)),
    case("zero-max_bad_steps", "--max_bad_steps=0", expect=("max_bad_steps must be >= 1",)),
    case("zero-keep_last_k", "--keep_last_k=0", expect=("keep_last_k must be >= 1",)),
    case("zero-vocab_size", "--vocab_size=0", expect=("vocab_size must be >= 1",)),
    case("min_lr-above-lr", "--min_lr=1e-2", expect=("min_lr", "learning_rate")),
    case("zero-learning_rate", "--learning_rate=0", expect=("learning_rate must be > 0",)),
    case("warmup-above-decay", "--warmup_iters=500", "--lr_decay_iters=100", expect=("warmup_iters (500)",)),
    case("beta1-is-1", "--beta1=1.0", expect=("[0, 1)",)),
    case("beta2-negative", "--beta2=-0.1", expect=("[0, 1)",)),
    case("negative-grad_clip", "--grad_clip=-1", expect=("grad_clip",)),
    case("negative-weight_decay", "--weight_decay=-0.1", expect=("weight_decay",)),
    case("dropout-1.5", "--dropout=1.5", expect=("dropout", "[0, 1)")),
    case("peak_flops-negative", "--peak_flops=-1", expect=("peak_flops must be > 0",)),
    case("empty-out_dir", "--out_dir=", expect=("out_dir must not be empty",)),
    case("nan-min_lr", "--min_lr=nan", expect=("min_lr",)),
    case("nan-grad_clip", "--grad_clip=nan", expect=("grad_clip",)),
    # overrides: names with a fixed set of values
    case("unknown-dtype", "--dtype=float64", expect=("float64", "auto, bfloat16, float16, float32")),
    case("unknown-dist_backend", "--dist_backend=ddp", expect=("ddp", "nccl or gloo")),
    case("unknown-backend-deprecated-key", "--backend=ddp", expect=("dist_backend 'ddp'", "nccl or gloo")),
    case(
        "unknown-attention_backend",
        "--attention_backend=flash3",
        expect=("flash3", "auto, flash_attn_4, flash_attn_3, flash_attn_2, flex_attention, sdpa, manual"),
    ),
    case("unknown-sdpa_kernel", "--sdpa_kernel=fastest", expect=("fastest", "auto, flash, cudnn, efficient, math")),
    case("n_embd-not-divisible", "--n_embd=30", "--n_head=4", expect=("n_embd (30)", "n_head (4)")),
    case("odd-head-dim", "--n_embd=34", "--n_head=2", expect=("even",)),
    # devices
    case("device-cuda", "--device=cuda", expect=("CUDA is not available", "--device=cpu")),
    case("device-cuda-7", "--device=cuda:7", expect=("cuda:7", "--device=cpu")),
    case("device-tpu", "--device=tpu", expect=("tpu", "auto, cpu, cuda, cuda:N, mps")),
    case("device-mps", "--device=mps", expect=("MPS is not available", "--device=cpu")),
    case("device-meta", "--device=meta", expect=("auto, cpu, cuda, cuda:N, mps",)),
    # datasets and data files
    case("unknown-dataset", "--data_dir=", "--dataset=no_such_data", expect=("no_such_data", "shakespeare_char")),
    case("data_dir-is-a-file", "--data_dir={data}/meta.json", expect=("is not a folder",)),
    case("data_dir-missing", "--data_dir={tmp}/nowhere", expect=("is not a folder",)),
    case("data_dir-empty-folder", "--data_dir={tmp}", expect=("meta.json is missing", "prepare")),
    case("missing-train.bin", setup=data_file("train.bin", "delete"), expect=("train.bin is missing", "prepare")),
    case("missing-val.bin", setup=data_file("val.bin", "delete"), expect=("val.bin is missing", "prepare")),
    case("empty-val.bin", setup=data_file("val.bin", "empty"), expect=("val.bin is empty", "prepare")),
    case("odd-size-train.bin", setup=data_file("train.bin", "odd"), expect=("odd size", "prepare")),
    case("truncated-train.bin", setup=data_file("train.bin", "short"), expect=("meta.json says", "prepare")),
    case("uint32-train.bin", setup=data_file("train.bin", "uint32"), expect=("meta.json says", "prepare")),
    case("token-id-beyond-vocab", setup=data_file("train.bin", "big_id"), expect=("token id 41", "vocab_size 41")),
    case("meta.json-corrupt", setup=data_file("meta.json", "not_json"), expect=("not valid JSON", "prepare")),
    case("meta.json-missing", setup=data_file("meta.json", "delete"), expect=("meta.json is missing", "prepare")),
    case("meta.json-no-vocab_size", setup=data_file("meta.json", "no_vocab"), expect=("lacks vocab_size",)),
    case("block_size-beyond-val-split", "--block_size={val_tokens}", expect=("val.bin has", "lower block_size")),
    case("block_size-beyond-dataset", "--block_size=100000", expect=("train.bin has", "lower block_size")),
    case("vocab_size-below-dataset", "--vocab_size=5", expect=("vocab_size 5", "dataset's 41")),
    # checkpoints
    case("resume-without-checkpoint", "--init_from=resume", expect=("no checkpoint at", "ckpt.pt")),
    case(
        "resume-corrupt-checkpoint",
        "--init_from=resume",
        setup=damage_checkpoint("corrupt"),
        expect=("not a readable checkpoint",),
    ),
    case(
        "resume-truncated-checkpoint",
        "--init_from=resume",
        setup=damage_checkpoint("truncate"),
        expect=("not a readable checkpoint",),
    ),
    case(
        "resume-text-file-checkpoint",
        "--init_from=resume",
        setup=damage_checkpoint("text"),
        expect=("not a readable checkpoint",),
    ),
    case(
        "resume-other-shape",
        "--init_from=resume",
        "--n_layer=3",
        setup=copy_checkpoint,
        expect=("n_layer=2 (config says 3)",),
    ),
    case(
        "finetune-other-shape",
        "--init_from={out}/ckpt.pt",
        "--n_embd=64",
        "--n_head=4",
        setup=copy_checkpoint,
        expect=("n_head=2 (config says 4)", "n_embd=32 (config says 64)"),
    ),
    case(
        "resume-other-vocab",
        "--init_from=resume",
        "--vocab_size=128",
        setup=copy_checkpoint,
        expect=("vocab_size=41 (config says 128)",),
    ),
    case(
        "resume-longer-block",
        "--init_from=resume",
        "--block_size=32",
        setup=copy_checkpoint,
        expect=("block_size 32", "checkpoint's 16"),
    ),
    case("init_from-nonexistent", "--init_from={tmp}/nonexistent.pt", expect=("scratch, resume",)),
    case("init_from-garbage-word", "--init_from=scratchy", expect=("'scratchy'", "scratch, resume")),
    case(
        "init_from-not-a-checkpoint",
        "--init_from={tmp}/foreign.pt",
        setup=save_foreign_pt,
        expect=("not a checkpoint of this repo",),
    ),
    # the out_dir itself
    case(
        "out_dir-is-a-file",
        "--out_dir={tmp}/afile",
        "--max_iters=1",
        "--eval_interval=1",
        setup=write("afile", "not a folder\n"),
        expect=("out_dir",),
    ),
]


def test_bad_input_cases_are_many():
    assert len(BAD_INPUTS) >= 50


@pytest.mark.parametrize("args, setup, expect", BAD_INPUTS)
def test_bad_input(args, setup, expect, char_data, trained_out, tmp_path, capsys):
    case = {"tmp": tmp_path, "data": tmp_path / "data", "out": tmp_path / "out", "trained": trained_out}
    shutil.copytree(char_data, case["data"])
    if setup:
        setup(case)
    values = {
        "tmp": tmp_path,
        "data": case["data"],
        "out": case["out"],
        "val_tokens": json.loads((char_data / "meta.json").read_text())["val_tokens"],
    }
    argv = tiny_args(case["data"], case["out"], "--max_iters=0") + [arg.format(**values) for arg in args]
    before = tree_digest(tmp_path, trained_out)

    code = train.main(argv)

    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for text in expect:
        assert text in lines[0], f"{text!r} not in {lines[0]!r}"
    assert tree_digest(tmp_path, trained_out) == before


def test_cuda_out_of_memory_suggests_smaller_batches(monkeypatch, char_data, tmp_path, capsys):
    """An OOM (raised here from the first forward, as a GPU would) gets one line and exit code 2."""

    def out_of_memory(self, *args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    monkeypatch.setattr(model.GPT, "forward", out_of_memory)
    code = train.main(tiny_args(char_data, tmp_path / "out", "--max_iters=2"))
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(errors) == 1 and "Traceback" not in err, err
    assert errors[0].startswith("error: CUDA out of memory")
    assert "--batch_size=2 --gradient_accumulation_steps=2" in errors[0]  # tiny model: batch 4, no accumulation
