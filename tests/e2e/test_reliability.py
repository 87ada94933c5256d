"""train.py under stress: SIGTERM/SIGINT/SIGHUP save and exit cleanly, a closed stdout does not stop a run,
non-finite steps are skipped, stop the run and never become a checkpoint, a run always leaves its last state,
one run owns an out_dir, a failed write is one line before or during training, and every bad input is one
`error: ` line with exit code 2 that leaves the disk as it was."""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import random
import re
import shutil
import signal
import tempfile

import numpy as np
import pytest
import torch

import model
import train
from helpers import Child, WarmProcess, tiny_args, tree_digest
from training import state as train_checkpoint
from training.progress import StopFlags
from training.runtime import Runtime
from weights.load import load_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")


# ---- signals: finish the step, save, exit 0; resume from there ----


def test_stop_signals_save_and_exit_then_resume(char_data, tmp_path, capsys, warm_interpreter):
    """One child per signal, run side by side, each forked from the warm interpreter (no torch import of its
    own). SIGHUP (the terminal closed) stops a run like SIGTERM."""
    runs = {sig: tmp_path / sig.name for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    endless = ("--max_iters=100000", "--eval_interval=100000")
    with contextlib.ExitStack() as stack:
        children = {sig: Child("train.py", tiny_args(char_data, out, *endless), warm=True) for sig, out in runs.items()}
        for child in children.values():
            stack.enter_context(child)
        for sig, child in children.items():
            child.wait_for(lambda line: line.startswith("iter 3 |"))
            os.kill(child.pid, sig)
        finished = {sig: child.finish(timeout=120) for sig, child in children.items()}

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


def test_an_ignored_sighup_stays_ignored():
    """`nohup python train.py`: SIGHUP is ignored when the run starts and must stay so (the terminal may close)."""
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # the autouse fixture restores it
    with StopFlags(Runtime(torch.device("cpu"), torch.float32)).handling_signals():
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_IGN, signal.SIG_DFL)


def test_a_closed_stdout_does_not_stop_the_run(char_data, tmp_path, warm_interpreter):
    """`python train.py | head -1`: the log lines stop, the run trains on, saves and exits 0. The pipe holds
    4 KB and the run prints far more after its first line, so its writes do meet the closed pipe. (sample.py's
    closed-pipe test runs a fresh interpreter; this run is forked warm.)"""
    out = tmp_path / "out"
    read_end, write_end = os.pipe()
    fcntl.fcntl(write_end, fcntl.F_SETPIPE_SZ, 4096)
    args = tiny_args(char_data, out, "--max_iters=100", "--eval_interval=50")
    with tempfile.TemporaryFile() as stderr:
        with os.fdopen(read_end, "rb") as reader:
            try:
                run = WarmProcess("train.py", args, write_end, stderr.fileno())
            finally:
                os.close(write_end)
            first_line = reader.readline()  # what head -1 reads before it exits
        try:
            code = run.wait(timeout=120)
        finally:
            run.kill()  # if it ran past the timeout
        stderr.seek(0)
        err = stderr.read()
    assert first_line.startswith(b"config: ")
    assert code == 0, err.decode()
    assert b"Traceback" not in err and b"BrokenPipe" not in err, err.decode()
    assert load_checkpoint(out / "ckpt.pt")["iter_num"] == 100


def test_in_process_run_restores_signal_handlers(char_data, tmp_path, capsys):
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
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
    real_save = train_checkpoint.save_checkpoint

    def save_and_fingerprint(*args, **kwargs):
        path = real_save(*args, **kwargs)
        digest.update({name: value for name, value in tree_digest(out).items() if not name.endswith("/.lock")})
        return path

    monkeypatch.setattr(train_checkpoint, "save_checkpoint", save_and_fingerprint)
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


def test_no_checkpoint_from_non_finite_steps_and_the_last_words_say_what_is_on_disk(
    monkeypatch, char_data, tmp_path, capsys
):
    """always_save_checkpoint, and the last two steps non-finite (skipped): the evaluation at max_iters saves
    nothing and rotates nothing away; the run ends with exit 1 and names the checkpoint it left."""
    out = tmp_path / "out"
    inject_nan(monkeypatch, {6, 7})  # step indices 6 and 7 make iterations 7 and 8
    args = ("--max_iters=8", "--eval_interval=2", "--always_save_checkpoint=true", "--keep_last_k=2")
    assert train.main(tiny_args(char_data, out, *args)) == 1
    err = capsys.readouterr().err
    expect = (
        f"not saving iter 8: the last 2 step(s) had non-finite loss or gradients; "
        f"{out / 'ckpt.pt'} holds iter 6, the last state this run saved"
    )
    assert expect in err.splitlines(), err
    assert sorted(p.name for p in out.glob("ckpt-*.pt")) == ["ckpt-0000004.pt", "ckpt-0000006.pt"]
    assert load_checkpoint(out / "ckpt.pt")["iter_num"] == 6


def test_no_checkpoint_from_a_non_finite_eval_loss(monkeypatch, char_data, tmp_path, capsys):
    """A NaN val loss at iters 4 and 6 (max_iters): a warning at 4, the run goes on; at the end no NaN
    checkpoint, exit 1, and the last words name the checkpoint of iter 2."""
    out = tmp_path / "out"
    real_evaluate, calls = train.evaluate, []

    def evaluate(*args):
        losses = real_evaluate(*args)
        calls.append(losses)
        return {**losses, "val": math.nan} if len(calls) >= 3 else losses  # evals at iters 0, 2, 4, 6

    monkeypatch.setattr(train, "evaluate", evaluate)
    args = ("--max_iters=6", "--eval_interval=2", "--always_save_checkpoint=true")
    assert train.main(tiny_args(char_data, out, *args)) == 1
    err = capsys.readouterr().err.splitlines()
    not_saved = [line for line in err if "not saving" in line]
    on_disk = f"{out / 'ckpt.pt'} holds iter 2, the last state this run saved"
    assert len(not_saved) == 2 and not_saved[0].startswith("WARNING: not saving iter 4: the eval loss is not finite")
    assert not_saved[1].startswith("not saving iter 6: the eval loss is not finite (train ")
    assert all(line.endswith(on_disk) for line in not_saved), not_saved
    assert sorted(p.name for p in out.glob("ckpt-*.pt")) == ["ckpt-0000002.pt"]


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


def change_checkpoint(change):
    def setup(case):
        copy_checkpoint(case)
        path = case["out"] / "ckpt.pt"
        state = torch.load(path, weights_only=True)
        change(state)
        torch.save(state, path)

    return setup


def shrink_position_table(state):
    state["model"]["transformer.wpe.weight"] = state["model"]["transformer.wpe.weight"][:8].clone()


def copy_source(case):
    shutil.copyfile(case["trained"] / "ckpt.pt", case["tmp"] / "source.pt")


def other_tokenizer(case):
    """The same vocab_size, another vocabulary: the data's chars in reverse order."""
    path = case["data"] / "meta.json"
    meta = json.loads(path.read_text())
    meta["itos"] = meta["itos"][::-1]
    path.write_text(json.dumps(meta))


class RunsCode:
    """Unpickling this calls os.mkdir(marker): stands in for any code a malicious checkpoint would run."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.mkdir, (self.marker,)


def save_pickled_code(case):
    torch.save({"model": RunsCode(case["tmp"] / "marker"), "model_config": {}}, case["tmp"] / "evil.pt")


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
    case(
        "cfg-not-py",
        "{tmp}/settings.txt",
        setup=write("settings.txt", "batch_size = 8\n"),
        expect=("is not a .py file",),
    ),
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
    case("float-for-int", "--max_iters=1.5", expect=("--max_iters=1.5: expected int",)),
    case("bad-float", "--learning_rate=fast", expect=("--learning_rate=fast: expected float",)),
    case("bad-bool", "--compile=maybe", expect=("true/false/1/0/yes/no/on/off",)),
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
    case("zero-fsdp_blocks_per_unit", "--fsdp_blocks_per_unit=0", expect=("fsdp_blocks_per_unit must be >= 1",)),
    case(
        "compile_blocks-cuda-graphs",
        "--compile_blocks=true",
        "--compile_mode=reduce-overhead",
        expect=("compile_blocks=true compiles each block apart", "default or max-autotune-no-cudagraphs"),
    ),
    case(
        "graph_split-bucket-under-1MB",
        "--ddp_graph_split=true",
        "--ddp_bucket_cap_mb=0.5",
        expect=("ddp_bucket_cap_mb must be >= 1 with it, got 0.5",),
    ),
    case("negative-profile_steps", "--profile_steps=-1", expect=("profile_steps must be >= 0",)),
    case("zero-keep_last_k", "--keep_last_k=0", expect=("keep_last_k must be >= 1",)),
    case("zero-vocab_size", "--vocab_size=0", expect=("vocab_size must be >= 1",)),
    case("min_lr-above-lr", "--min_lr=1e-2", expect=("min_lr", "learning_rate")),
    case("zero-learning_rate", "--learning_rate=0", expect=("learning_rate must be > 0",)),
    case("warmup-above-decay", "--warmup_iters=500", "--lr_decay_iters=100", expect=("warmup_iters (500)",)),
    case("beta1-is-1", "--beta1=1.0", expect=("[0, 1)",)),
    case("beta2-negative", "--beta2=-0.1", expect=("[0, 1)",)),
    case("negative-grad_clip", "--grad_clip=-1", expect=("grad_clip must be >= 0, got -1.0",)),
    case("negative-weight_decay", "--weight_decay=-0.1", expect=("weight_decay must be >= 0, got -0.1",)),
    case("dropout-1.5", "--dropout=1.5", expect=("dropout", "[0, 1)")),
    case("peak_flops-negative", "--peak_flops=-1", expect=("peak_flops must be > 0",)),
    case("empty-out_dir", "--out_dir=", expect=("out_dir must not be empty",)),
    case("nan-min_lr", "--min_lr=nan", expect=("min_lr",)),
    case("nan-grad_clip", "--grad_clip=nan", expect=("grad_clip",)),
    # overrides: names with a fixed set of values
    case("unknown-dtype", "--dtype=float64", expect=("float64", "auto, bfloat16, float16, float32")),
    case("unknown-dist_backend", "--dist_backend=ddp", expect=("ddp", "nccl or gloo")),
    case("unknown-backend-deprecated-key", "--backend=ddp", expect=("dist_backend 'ddp'", "nccl or gloo")),
    case("unknown-parallelism", "--parallelism=zero3", expect=("zero3", "ddp, fsdp")),
    case("fsdp-with-lora", "--parallelism=fsdp", "--lora_rank=4", expect=("LoRA", "parallelism ddp")),
    case(
        "fsdp-with-shard_optimizer",
        "--parallelism=fsdp",
        "--shard_optimizer=true",
        expect=("shard_optimizer=true is for parallelism ddp",),
    ),
    case(
        "fsdp-with-cuda-graphs",
        "--parallelism=fsdp",
        "--compile_mode=reduce-overhead",
        expect=("compile_mode=reduce-overhead", "default or max-autotune-no-cudagraphs"),
    ),
    case("unknown-ddp_reduce_dtype", "--ddp_reduce_dtype=fp8", expect=("fp8", "float32, bfloat16")),
    case(
        "bf16-reduce-on-gloo",
        "--ddp_reduce_dtype=bfloat16",
        "--dist_backend=gloo",
        expect=("ddp_reduce_dtype=bfloat16 needs dist_backend=nccl",),
    ),
    case("zero-dist_timeout_s", "--dist_timeout_s=0", expect=("dist_timeout_s must be > 0",)),
    case("zero-context_parallel", "--context_parallel=0", expect=("context_parallel must be >= 1", "got 0")),
    case(
        "context_parallel-uneven-chunks",
        "--context_parallel=3",
        "--block_size=16",
        expect=("6 equal chunks", "block_size (16) must be a multiple of 6"),
    ),
    case(
        "context_parallel-with-documents",
        "--context_parallel=2",
        "--packed_documents=true",
        expect=("packed_documents is not supported",),
    ),
    case(
        "context_parallel-on-one-rank",
        "--context_parallel=2",
        expect=("context_parallel=2 needs a multiple of 2 ranks, but there are 1", "--nproc_per_node=2"),
    ),
    case(
        "unknown-attention_backend",
        "--attention_backend=flash3",
        expect=("flash3", "choose one of auto, ", *(f"{name}," for name in ("flash_attn_4", "flash_attn_3", "sdpa"))),
    ),
    case("unknown-sdpa_kernel", "--sdpa_kernel=fastest", expect=("fastest", "auto, flash, cudnn, efficient, math")),
    case("n_embd-not-divisible", "--n_embd=30", "--n_head=4", expect=("n_embd (30)", "n_head (4)")),
    case("odd-head-dim", "--n_embd=34", "--n_head=2", expect=("head dim n_embd/n_head = 17 must be even",)),
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
    case(
        "block_size-beyond-val-split",
        "--block_size={val_tokens}",
        expect=("val.bin has", "lower --block_size", "larger --val_fraction"),
    ),
    case("block_size-beyond-dataset", "--block_size=100000", expect=("train.bin has", "lower --block_size")),
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
        expect=(
            "--n_layer=3 conflicts with the checkpoint's n_layer=2 (",
            "leave it out to take the checkpoint's shape",
        ),
    ),
    case(
        "finetune-other-shape",
        "--init_from={out}/ckpt.pt",
        "--n_embd=64",
        "--n_head=4",
        setup=copy_checkpoint,
        expect=(
            "--n_head=4 conflicts with the checkpoint's n_head=2, --n_embd=64 with its n_embd=32",
            "leave them out",
        ),
    ),
    case(
        "finetune-other-shape-in-a-config-file",
        "{tmp}/c.py",
        "--init_from={tmp}/source.pt",
        setup=chain(copy_source, write("c.py", "rope = True\n")),
        expect=("--rope=True conflicts with the checkpoint's rope=False (", "source.pt); leave it out"),
    ),
    case(
        "resume-other-vocab",
        "--init_from=resume",
        "--vocab_size=128",
        setup=copy_checkpoint,
        expect=("--vocab_size=128 conflicts with the checkpoint's vocab_size=41",),
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
    # checkpoints: the schema, the weights, the tokenizer
    case(
        "resume-no-optimizer",
        "--init_from=resume",
        setup=change_checkpoint(lambda state: state.pop("optimizer")),
        expect=("lacks optimizer", "needed to resume"),
    ),
    case(
        "resume-negative-iter_num",
        "--init_from=resume",
        setup=change_checkpoint(lambda state: state.update(iter_num=-5)),
        expect=("ckpt.pt: iter_num is -5; it must be an int >= 0",),
    ),
    case(
        "resume-nan-best_val_loss",
        "--init_from=resume",
        setup=change_checkpoint(lambda state: state.update(best_val_loss=math.nan)),
        expect=("ckpt.pt: best_val_loss is nan; it must be a number >= 0, or inf before any evaluation",),
    ),
    case(
        "resume-shorter-block",
        "--init_from=resume",
        "--block_size=8",
        setup=copy_checkpoint,
        expect=("block_size 8 is smaller than the checkpoint's 16", "--block_size=16", "crop it in a fine-tune"),
    ),
    case(
        "eval_only-from-scratch",
        "--eval_only=true",
        expect=("eval_only=true with init_from=scratch would evaluate a randomly initialised model", "gpt2-xl"),
    ),
    case(
        "resume-no-meta",
        "--init_from=resume",
        setup=change_checkpoint(lambda state: state.pop("meta")),
        expect=("lacks meta",),
    ),
    case(
        "resume-newer-model_config",
        "--init_from=resume",
        setup=change_checkpoint(lambda state: state["model_config"].update(future_setting=1)),
        expect=("future_setting", "newer version"),
    ),
    case(
        "resume-weights-disagree-with-model_config",
        "--init_from=resume",
        setup=change_checkpoint(shrink_position_table),
        expect=("transformer.wpe.weight (8, 32) (model_config needs (16, 32))",),
    ),
    case(
        "resume-other-tokenizer-same-size",
        "--init_from=resume",
        setup=chain(copy_checkpoint, other_tokenizer),
        expect=("another tokenizer", "checkpoint char, vocab 41, sha256", "dataset char, vocab 41, sha256"),
    ),
    case(
        "finetune-other-tokenizer-same-size",
        "--init_from={tmp}/source.pt",
        setup=chain(copy_source, other_tokenizer),
        expect=("source.pt was trained with another tokenizer",),
    ),
    case(
        "finetune-pickled-code",
        "--init_from={tmp}/evil.pt",
        setup=save_pickled_code,
        expect=("holds pickled Python objects (posix.mkdir)", "refused"),
    ),
    # one run per out_dir: a fresh run does not replace another run's checkpoints
    case(
        "scratch-into-out_dir-with-checkpoints",
        setup=copy_checkpoint,
        expect=("already holds checkpoints (ckpt.pt)", "--init_from=resume", "--overwrite_out_dir=true"),
    ),
    case(
        "finetune-into-out_dir-with-checkpoints",
        "--init_from={tmp}/source.pt",
        setup=chain(copy_checkpoint, copy_source),
        expect=("already holds checkpoints (ckpt.pt)", "--init_from=resume", "--overwrite_out_dir=true"),
    ),
    # sizes, refused before anything is allocated
    case(
        "vocab_size-10**12",
        "--vocab_size=1000000000000",
        expect=("needs at least", "32,000,000,025,248 parameters x 16 bytes", "of RAM"),
    ),
    case("n_embd-1048576", "--n_embd=1048576", expect=("needs at least", "parameters x 16 bytes", "of RAM")),
    case("batch_size-10**8", "--batch_size=100000000", expect=("activations for batch_size=100000000", "of RAM")),
    case("seed-2**64", "--seed=18446744073709551616", expect=("seed must be in [0, 2**64)",)),
    case("seed-negative", "--seed=-1", expect=("seed must be in [0, 2**64)",)),
    # the out_dir itself
    case("out_dir-name-over-255-bytes", "--out_dir={tmp}/" + "é" * 128, expect=("256 bytes", "255 is the most")),
    case(
        "out_dir-under-a-file",
        "--out_dir={tmp}/afile/out",
        setup=write("afile", "not a folder\n"),
        expect=("afile is a file, not a folder",),
    ),
    case(
        "out_dir-is-a-file",
        "--out_dir={tmp}/afile",
        "--max_iters=1",
        "--eval_interval=1",
        setup=write("afile", "not a folder\n"),
        expect=("afile exists and is not a folder",),
    ),
]


def test_every_bad_input_case_names_the_words_its_error_line_must_hold():
    """Each case asserts its own message (test_bad_input), not only an exit code: none may expect nothing."""
    assert all(p.values[2] and max(len(text) for text in p.values[2]) >= 6 for p in BAD_INPUTS)
    assert len({p.id for p in BAD_INPUTS}) == len(BAD_INPUTS)


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
    assert "weights_only" not in lines[0]  # never torch's advice to load a file unsafely
    assert tree_digest(tmp_path, trained_out) == before


@pytest.mark.parametrize(
    "env, expect",
    [
        ({"WORLD_SIZE": "two"}, "WORLD_SIZE='two' must be an integer >= 1"),
        ({"WORLD_SIZE": "0"}, "WORLD_SIZE='0' must be an integer >= 1"),
        ({"RANK": "-1"}, "RANK='-1' must be an integer >= 0"),
        ({"LOCAL_RANK": "0x1"}, "LOCAL_RANK='0x1' must be an integer >= 0"),
        ({"RANK": "3", "WORLD_SIZE": "2"}, "RANK=3 must be below WORLD_SIZE=2"),
        ({"RANK": "0", "WORLD_SIZE": "2"}, "cannot join the process group of 2 ranks"),  # no MASTER_ADDR
    ],
    ids=["world-size-word", "world-size-0", "rank-negative", "local-rank-hex", "rank-beyond", "no-rendezvous"],
)
def test_garbage_torchrun_environment_is_one_line(monkeypatch, char_data, tmp_path, capsys, env, expect):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    args = tiny_args(char_data, tmp_path / "out", "--dist_backend=gloo", "--gradient_accumulation_steps=2")
    assert train.main(args) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and expect in err, err
    assert not (tmp_path / "out").exists()


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
