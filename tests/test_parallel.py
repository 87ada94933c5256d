"""Training over several ranks (parallel.py, and train.py's data stream and restarts), on CPU with gloo: the same
steps whatever the number of ranks, micro-steps, launch agents or FSDP; resumes across a change of world size;
a failing rank named by the others; a killed rank restarted by torchrun from the last checkpoint.

Every torchrun launch costs several interpreters importing torch, so each launch serves several assertions and
the single-process reference runs in-process."""

from __future__ import annotations

import contextlib
import io
import os
import re
import resource
import shutil
import signal
import socket
import time

import pytest
import torch

import train
from checkpoint import load_checkpoint
from helpers import Child, one_torch_thread, tiny_args

ACCUM = 4  # micro-steps per optimizer step over all ranks: 1 rank x 4, 2 x 2, 4 x 1
MAX_ITERS = 60


def run_args(data_dir, out_dir, *extra) -> list[str]:
    return tiny_args(
        data_dir,
        out_dir,
        "--n_layer=1",
        f"--gradient_accumulation_steps={ACCUM}",
        "--dist_backend=gloo",
        "--eval_on_start=false",
        "--always_save_checkpoint=true",
        "--keep_last_k=10",
        *extra,
    )


def torchrun(*launcher: str) -> list[str]:
    """Child's arguments after `python -m`: torchrun with these options, then train.py's arguments."""
    return ["torch.distributed.run", *launcher, "train.py"]


def losses(output: str) -> dict[int, str]:
    """{iter: logged loss}; a restarted run logs some iterations twice, the later ones count."""
    return {int(it): loss for it, loss in re.findall(r"^iter (\d+) \| loss (\S+) ", output, re.M)}


def assert_same_weights(saved, expected, atol=1e-6):
    assert sorted(saved) == sorted(expected)
    for name, tensor in expected.items():
        torch.testing.assert_close(saved[name], tensor, rtol=0, atol=atol, msg=name)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pid_of_rank(launcher_pid: int, rank: int, timeout: float = 60) -> int:
    """The worker of `rank` among a torchrun launcher's children (from their environment)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            children = open(f"/proc/{launcher_pid}/task/{launcher_pid}/children").read().split()
            for pid in children:
                environ = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
                if f"RANK={rank}".encode() in environ:
                    return int(pid)
        time.sleep(0.1)
    raise AssertionError(f"no worker of rank {rank} under pid {launcher_pid}")


@pytest.fixture(scope="module")
def reference(char_data, tmp_path_factory):
    """One process, 4 micro-steps per step, MAX_ITERS iterations, a checkpoint every 10: (out_dir, losses)."""
    out = tmp_path_factory.mktemp("reference")
    stdout = io.StringIO()
    with one_torch_thread(), contextlib.redirect_stdout(stdout):
        code = train.main(run_args(char_data, out, f"--max_iters={MAX_ITERS}", "--eval_interval=10"))
    assert code == 0, stdout.getvalue()
    return out, losses(stdout.getvalue())


def test_fsdp_on_two_ranks_trains_like_one_process_and_resumes_on_one(reference, char_data, tmp_path):
    ref_out, ref_losses = reference
    out = tmp_path / "out"
    args = torchrun("--standalone", "--nproc_per_node=2")
    args += run_args(char_data, out, "--parallelism=fsdp", "--activation_checkpointing=block", "--max_iters=20")
    args += ["--eval_interval=10"]
    with Child("-m", args) as child:
        code, output = child.finish(timeout=300)
    assert code == 0, output
    assert "(2 ranks x 2 micro-steps x 4 x 16)" in output
    logged = losses(output)
    assert logged == {it: ref_losses[it] for it in range(1, 21)}, output
    saved = load_checkpoint(out / "ckpt.pt", resume=True)
    assert saved["sharded"] == "ckpt-0000020.dcp" and (out / "ckpt-0000020.dcp").is_dir()
    assert saved["optimizer"] == {}  # sharded, in the DCP folder
    assert_same_weights(saved["model"], load_checkpoint(ref_out / "ckpt-0000020.pt")["model"])

    import sample  # what an FSDP run leaves samples like any other run's checkpoint

    model, _, _, _ = sample.load_model(sample.SampleConfig(out_dir=str(out), device="cpu"), torch.device("cpu"))
    assert model.lm_head.weight is model.transformer.wte.weight

    # Back to iter 10 (a rollback), then on with one process: DCP reshards the optimizer state of 2 ranks
    shutil.copyfile(out / "ckpt-0000010.pt", out / "ckpt.pt")
    stdout = io.StringIO()
    with one_torch_thread(), contextlib.redirect_stdout(stdout):
        code = train.main(run_args(char_data, out, "--init_from=auto", "--max_iters=20", "--eval_interval=10"))
    assert code == 0, stdout.getvalue()
    assert "resuming at iter 10" in stdout.getvalue()
    assert losses(stdout.getvalue()) == {it: ref_losses[it] for it in range(11, 21)}
    resumed = load_checkpoint(out / "ckpt.pt")["model"]
    assert_same_weights(resumed, load_checkpoint(ref_out / "ckpt-0000020.pt")["model"])


def test_two_launch_agents_of_two_ranks_train_like_one_process(reference, char_data, tmp_path):
    """The README's two-node launch, both "nodes" on this host."""
    ref_out, ref_losses = reference
    endpoint = f"127.0.0.1:{free_port()}"
    agents = []
    with contextlib.ExitStack() as stack:
        for node_rank in (0, 1):
            launcher = ("--nnodes=2", "--nproc_per_node=2", f"--node_rank={node_rank}", "--rdzv_backend=c10d")
            launcher += (f"--rdzv_endpoint={endpoint}", "--rdzv_id=test")
            args = torchrun(*launcher) + run_args(char_data, tmp_path / "out", "--max_iters=10", "--eval_interval=10")
            agents.append(stack.enter_context(Child("-m", args)))
        results = [agent.finish(timeout=300) for agent in agents]
    assert [code for code, _ in results] == [0, 0], results
    output = "".join(text for _, text in results)
    assert "(4 ranks x 1 micro-steps x 4 x 16)" in output
    assert losses(output) == {it: ref_losses[it] for it in range(1, 11)}, output
    saved = load_checkpoint(tmp_path / "out" / "ckpt.pt")
    assert len(saved["rng"]) == 4
    assert_same_weights(saved["model"], load_checkpoint(ref_out / "ckpt-0000010.pt")["model"])


def test_a_failing_rank_is_named_by_the_others(char_data, tmp_path):
    """Rank 1 alone cannot open another file (its limit of open files lowered mid-run), so its next batch fails;
    rank 0, waiting for it in the step's all-reduce, stops too and says which rank failed and why."""
    args = torchrun("--standalone", "--nproc_per_node=2")
    args += run_args(char_data, tmp_path / "out", "--max_iters=100000", "--eval_interval=100000")
    with Child("-m", args) as child:
        child.wait_for(lambda line: line.startswith("iter 2 |"))
        rank1 = pid_of_rank(child.pid, 1)
        _, hard = resource.prlimit(rank1, resource.RLIMIT_NOFILE)
        resource.prlimit(rank1, resource.RLIMIT_NOFILE, (len(os.listdir(f"/proc/{rank1}/fd")), hard))
        started = time.monotonic()
        code, output = child.finish(timeout=120)
    assert code != 0
    assert time.monotonic() - started < 60, output
    assert re.search(r"^error: rank 1 failed: cannot read \S+train\.bin: Too many open files$", output, re.M), output
    assert re.search(r"^error: cannot read \S+train\.bin: Too many open files$", output, re.M), output  # rank 1's


def test_a_killed_rank_restarts_from_the_last_checkpoint(reference, char_data, tmp_path, monkeypatch):
    """kill -9 of one rank under --max-restarts=1: torchrun starts the ranks again, init_from=auto resumes the
    last checkpoint, and the losses from there on are those of a run never interrupted."""
    ref_out, ref_losses = reference
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")  # restarted ranks must not read the old ranks' keys
    out = tmp_path / "out"
    args = torchrun("--standalone", "--nproc_per_node=2", "--max-restarts=1")
    args += run_args(char_data, out, "--init_from=auto", f"--max_iters={MAX_ITERS}", "--eval_interval=10")
    with Child("-m", args) as child:  # its pipe holds a few dozen lines: the run cannot get far ahead of us
        child.wait_for(lambda line: line.startswith("saved ") and "(iter 10," in line)
        os.kill(pid_of_rank(child.pid, 1), signal.SIGKILL)
        code, output = child.finish(timeout=300)
    assert code == 0, output
    assert re.search(r"^error: rank 0 lost contact with the other ranks \(.+\); one died or hangs$", output, re.M)
    resumed = re.findall(r"resuming at iter (\d+)", output)
    assert len(resumed) == 1 and 10 <= int(resumed[0]) < MAX_ITERS, output
    assert losses(output) == ref_losses, output
    assert_same_weights(
        load_checkpoint(out / "ckpt.pt")["model"], load_checkpoint(ref_out / f"ckpt-{MAX_ITERS:07d}.pt")["model"]
    )


@pytest.fixture(autouse=True)
def _gloo_only():
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is not available in this build")
