"""Training over several ranks (parallel.py, and train.py's data stream and restarts), on CPU with gloo: the same
steps whatever the number of ranks, micro-steps, launch agents, DDP or FSDP; FSDP checkpoints resume in one
process; a failing rank is named by the others, and torchrun restarts a killed job from its last checkpoint.

Each torchrun launch costs several interpreters importing torch (its workers; torchrun itself is forked from the
warm interpreter, helpers.WarmProcess), so torchrun launches only where it is under test (two launch agents, a
restart); elsewhere the ranks are forked from the warm interpreter (helpers.run_ranks, rank_environ), and the
single-process reference runs in-process."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import resource
import shutil
import signal
import time

import pytest
import torch

import train
from helpers import Child, free_port, one_torch_thread, rank_environ, run_ranks, tiny_args, tiny_config, warm_context
from model import GPT
from training import parallel
from training.runtime import Runtime, join_process_group, leave_process_group
from weights.load import load_checkpoint

ACCUM = 4  # micro-steps per optimizer step over all ranks: 1 rank x 4, 2 x 2, 4 x 1
MAX_ITERS = 30  # the restart test: a failure near iter 20, a kill at iter 12, a resume from 10 to the end


def run_args(data_dir, out_dir, *extra) -> list[str]:
    return tiny_args(
        data_dir,
        out_dir,
        "--n_layer=1",
        "--rope=true",  # tables outside the state dict: FSDP's ranks but 0 build on meta and get rank 0's
        f"--gradient_accumulation_steps={ACCUM}",
        "--dist_backend=gloo",
        "--eval_on_start=false",
        "--always_save_checkpoint=true",
        "--keep_last_k=20",
        *extra,
    )


def resume_in_one_process(char_data, out, reference, start: int, stop: int) -> None:
    """Roll `out` back to its checkpoint of iter `start` and train on to `stop` in this process: the reference
    run's losses and final weights."""
    ref_out, ref_losses = reference
    shutil.copyfile(out / f"ckpt-{start:07d}.pt", out / "ckpt.pt")
    stdout = io.StringIO()
    with one_torch_thread(), contextlib.redirect_stdout(stdout):
        code = train.main(run_args(char_data, out, "--init_from=auto", f"--max_iters={stop}", "--eval_interval=5"))
    assert code == 0, stdout.getvalue()
    assert f"resuming at iter {start}" in stdout.getvalue()
    assert_same_losses(losses(stdout.getvalue()), {it: ref_losses[it] for it in range(start + 1, stop + 1)})
    expected = load_checkpoint(ref_out / f"ckpt-{stop:07d}.pt")["model"]
    assert_same_weights(load_checkpoint(out / "ckpt.pt")["model"], expected)


def torchrun(*launcher: str) -> list[str]:
    """Child's arguments after `python -m`: torchrun with these options, then train.py's arguments."""
    return ["torch.distributed.run", *launcher, "train.py"]


def joined(ranks: list[tuple[int, str]]) -> tuple[int, str]:
    """One exit code (the first rank's that is not 0, else 0) and one output for ranks that ran side by side, as
    torchrun gives them."""
    return next((code for code, _ in ranks if code), 0), "".join(output for _, output in ranks)


def losses(output: str) -> dict[int, str]:
    """{iter: logged loss}; a restarted run logs some iterations twice, the later ones count."""
    return {int(it): loss for it, loss in re.findall(r"^iter (\d+) \| loss (\S+) ", output, re.M)}


def assert_same_losses(got: dict[int, str], want: dict[int, str]) -> None:
    """The same iterations and logged losses, give or take the last printed digit: the runs add the same
    gradients in another order (over ranks instead of micro-steps), and a float32 loss may round either way.
    The weights, compared to 1e-6, are the exact check."""
    assert sorted(got) == sorted(want), (got, want)
    assert all(abs(float(got[it]) - float(want[it])) < 1.5e-4 for it in want), (got, want)


def assert_same_weights(saved, expected, atol=1e-6):
    assert sorted(saved) == sorted(expected)
    for name, tensor in expected.items():
        torch.testing.assert_close(saved[name], tensor, rtol=0, atol=atol, msg=name)


def assert_the_space_check_covers_one_save(settings: list[str], data_dir, out_dir) -> None:
    """The free space the start-up check asks of a 4-rank FSDP run covers what its save at iter 10 wrote into a
    fresh out_dir: ckpt-<iter>.pt, best.pt and ckpt.pt of the weights, and the folder of optimizer shards."""
    from configurator import load_config
    from training.preflight import first_save_size

    cfg = load_config(train.TrainConfig(), settings)
    vocab_size = json.loads((data_dir / "meta.json").read_text())["vocab_size"]
    model = GPT(cfg.model_config(vocab_size=vocab_size))
    estimate = first_save_size(cfg, Runtime(torch.device("cpu"), torch.float32, world_size=4), model).need()
    shards = sum(path.stat().st_size for path in (out_dir / "ckpt-0000010.dcp").iterdir())
    written = 3 * (out_dir / "ckpt-0000010.pt").stat().st_size + shards
    assert written <= estimate <= 2 * written, (written, estimate)  # a tiny model: mostly fixed overheads


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
    """One process, 4 micro-steps per step, MAX_ITERS iterations, a checkpoint every 5: (out_dir, losses)."""
    out = tmp_path_factory.mktemp("reference")
    stdout = io.StringIO()
    with one_torch_thread(), contextlib.redirect_stdout(stdout):
        code = train.main(run_args(char_data, out, f"--max_iters={MAX_ITERS}", "--eval_interval=5"))
    assert code == 0, stdout.getvalue()
    return out, losses(stdout.getvalue())


def test_fsdp_over_two_launch_agents_trains_like_one_process_and_resumes_on_one(
    reference, char_data, tmp_path, warm_interpreter
):
    """FSDP on 4 ranks, started as the README's two-node launch with both "nodes" on this host: the same losses
    and weights as one process (rank 0 builds the model, the others its shape only, on the meta device); its
    checkpoint samples, and resumes under FSDP on 2 ranks and in one process (DCP reshards)."""
    ref_out, ref_losses = reference
    out, endpoint = tmp_path / "out", f"127.0.0.1:{free_port()}"
    settings = run_args(char_data, out, "--parallelism=fsdp", "--activation_checkpointing=block", "--max_iters=10")
    settings += ["--eval_interval=5"]
    with contextlib.ExitStack() as stack:
        agents = []
        for node_rank in (0, 1):
            launcher = ("--nnodes=2", "--nproc_per_node=2", f"--node_rank={node_rank}", "--rdzv_backend=c10d")
            launcher += (f"--rdzv_endpoint={endpoint}", "--rdzv_id=test")
            agents.append(stack.enter_context(Child("-m", torchrun(*launcher) + settings, warm=True)))
        results = [agent.finish(timeout=300) for agent in agents]
    assert [code for code, _ in results] == [0, 0], results
    output = "".join(text for _, text in results)
    assert "(4 ranks x 1 micro-steps x 4 x 16)" in output
    assert_same_losses(losses(output), {it: ref_losses[it] for it in range(1, 11)})
    saved = load_checkpoint(out / "ckpt.pt", resume=True)
    assert saved["sharded"] == "ckpt-0000010.dcp" and (out / "ckpt-0000010.dcp").is_dir()
    assert saved["optimizer"] == {} and len(saved["rng"]) == 4  # the optimizer state is in the DCP folder
    stored = torch.load(out / "ckpt.pt", weights_only=True)["model"]  # the tied embedding and head: stored once
    assert (
        stored["lm_head.weight"].untyped_storage().data_ptr()
        == stored["transformer.wte.weight"].untyped_storage().data_ptr()
    )
    assert_the_space_check_covers_one_save(settings, char_data, out)
    assert_same_weights(saved["model"], load_checkpoint(ref_out / "ckpt-0000010.pt")["model"])

    import sample  # what an FSDP run leaves samples like any other run's checkpoint

    model, _, _, _ = sample.load_model(sample.SampleConfig(out_dir=str(out), device="cpu"), torch.device("cpu"))
    assert model.lm_head.weight is model.transformer.wte.weight

    # Back to iter 5, then on under FSDP on 2 ranks: the 4 ranks' optimizer state resharded over 2
    shutil.copyfile(out / "ckpt-0000005.pt", out / "ckpt.pt")
    settings = run_args(char_data, out, "--parallelism=fsdp", "--init_from=auto", "--max_iters=10")
    code, output = joined(run_ranks("train.py", settings))
    assert code == 0 and "resuming at iter 5" in output, output
    assert_same_losses(losses(output), {it: ref_losses[it] for it in range(6, 11)})

    # Back to iter 5 again, then on in one process: the optimizer state of 4 ranks, unsharded
    resume_in_one_process(char_data, out, reference, 5, 10)


def test_a_failed_or_killed_rank_is_reported_and_the_job_restarts_from_the_last_checkpoint(
    reference, char_data, tmp_path, monkeypatch, warm_interpreter
):
    """DDP on 2 ranks with init_from=auto. First rank 1 alone cannot open another file (its limit of open files
    lowered mid-run), so its next check of the dataset's files (at the next evaluation) fails: rank 0, waiting for
    it in a collective, says which rank failed and why, and both ranks exit by themselves (forked from the warm
    interpreter: no launcher stops them). The job is launched again under torchrun --max-restarts=1, where rank 1 is
    killed (-9): rank 0 says it lost contact, and torchrun starts the ranks again. Each start resumes the last
    checkpoint, and in the end every logged loss and the weights are those of one process that was never
    interrupted (1 rank x 4 micro-steps = 2 x 2)."""
    ref_out, ref_losses = reference
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")  # restarted ranks must not read the old ones' keys
    out = tmp_path / "out"
    settings = run_args(char_data, out, "--init_from=auto", f"--max_iters={MAX_ITERS}", "--eval_interval=10")
    # A gloo send to a killed peer does not fail: it waits out dist_timeout_s ("Timed out waiting 15000ms for send
    # operation to complete"; about one kill in 20 lands there, where a receive fails at once). Past torchrun's
    # 30 s between its SIGTERM and SIGKILL, the rank would die without its line; at 15 s it says it lost contact
    settings.append("--dist_timeout_s=15")
    # rank 0's pipe holds a few dozen lines: the job cannot get far ahead of us; rank 1, read only at its end,
    # gets a pipe it never fills
    pipes = (4096, 1 << 20)
    with contextlib.ExitStack() as stack:
        ranks = [
            stack.enter_context(Child("train.py", settings, pipe_size=size, warm=True, environ=environ))
            for size, environ in zip(pipes, rank_environ(2, free_port()))
        ]
        ranks[0].wait_for(lambda line: line.startswith("saved ") and "(iter 10," in line)
        _, hard = resource.prlimit(ranks[1].pid, resource.RLIMIT_NOFILE)
        # no new descriptor at all: a limit of the count open now let a descriptor open at that instant, and
        # closed after, make room for the next batch's (the limit caps descriptor numbers, not their count)
        resource.prlimit(ranks[1].pid, resource.RLIMIT_NOFILE, (0, hard))
        failed = time.monotonic()
        failures = [rank.finish(timeout=60) for rank in ranks]
        assert time.monotonic() - failed < 60  # the ranks stopped in bounded time
    assert all(code != 0 for code, _ in failures), failures
    output = "".join(text for _, text in failures)
    assert re.search(r"^error: rank 1 failed: cannot read \S+train\.bin: Too many open files$", output, re.M), output
    assert re.search(r"^error: cannot read \S+train\.bin: Too many open files$", output, re.M), output  # rank 1's own

    args = torchrun("--standalone", "--nproc_per_node=2", "--max-restarts=1") + settings
    with Child("-m", args, warm=True) as child:
        child.wait_for(lambda line: "resuming at iter" in line)
        child.wait_for(lambda line: line.startswith("iter 12 |"))
        os.kill(pid_of_rank(child.pid, 1), signal.SIGKILL)
        code, restarted = child.finish(timeout=300)
    assert code == 0, restarted
    lost = r"^error: rank 0 lost contact with the other ranks \(.+\); one died or hangs$"
    said = "\n".join(
        line for line in restarted.splitlines() if not re.match(r"(iter|eval|saved) |config: |  \w+=", line)
    )
    assert re.search(lost, restarted, re.M), said  # what the ranks and torchrun said instead
    output += restarted
    assert "Traceback" not in output, output
    resumed = [int(it) for it in re.findall(r"resuming at iter (\d+)", output)]
    assert len(resumed) == 2 and all(10 <= it < MAX_ITERS for it in resumed), output
    assert_same_losses(losses(output), ref_losses)
    final = load_checkpoint(out / "ckpt.pt")["model"]
    assert_same_weights(final, load_checkpoint(ref_out / f"ckpt-{MAX_ITERS:07d}.pt")["model"])


def assert_plain_adamw_layout(saved: dict, expected: dict) -> None:
    """The optimizer state of a checkpoint as a plain AdamW's: the same param groups (settings and parameter
    indices), the same parameters with state, each with the same entries, and values as close as the weights."""
    assert saved.keys() == expected.keys() == {"state", "param_groups"}
    assert saved["param_groups"] == expected["param_groups"]
    assert list(saved["state"]) == list(expected["state"])
    for index, entries in expected["state"].items():
        assert saved["state"][index].keys() == entries.keys(), index
        for name, tensor in entries.items():
            torch.testing.assert_close(saved["state"][index][name], tensor, rtol=1e-4, atol=1e-6, msg=f"{index} {name}")


def test_sharded_optimizer_trains_like_one_process_and_its_checkpoints_resume_either_way(
    reference, char_data, tmp_path, warm_interpreter
):
    """--shard_optimizer=true (ZeRO-1) under DDP on 2 ranks resumes the one-process run's iter-5 checkpoint (a plain
    AdamW's state, split over the ranks), logs that run's losses, and saves its weights and optimizer state in a
    plain AdamW's layout; a checkpoint of it then resumes in one process without sharding, and goes on the same."""
    ref_out, ref_losses = reference
    out = tmp_path / "out"
    out.mkdir()
    shutil.copyfile(ref_out / "ckpt-0000005.pt", out / "ckpt.pt")
    settings = run_args(char_data, out, "--init_from=auto", "--shard_optimizer=true", "--max_iters=10")
    settings += ["--eval_interval=5"]
    code, output = joined(run_ranks("train.py", settings))
    assert code == 0, output
    assert "resuming at iter 5" in output and "(2 ranks x 2 micro-steps x 4 x 16)" in output, output
    assert "INFO: optimizer step sharded over 2 ranks (ZeRO-1)" in output, output
    assert_same_losses(losses(output), {it: ref_losses[it] for it in range(6, 11)})
    saved = load_checkpoint(out / "ckpt-0000010.pt", resume=True)
    expected = load_checkpoint(ref_out / "ckpt-0000010.pt", resume=True)
    assert_same_weights(saved["model"], expected["model"])
    assert_plain_adamw_layout(saved["optimizer"], expected["optimizer"])

    # On from its iter-10 checkpoint in one process, unsharded
    resume_in_one_process(char_data, out, reference, 10, 15)


@pytest.fixture(autouse=True)
def _gloo_only():
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is not available in this build")


def world_of_one_env() -> dict[str, str]:
    """torchrun's variables for a process group of this one process."""
    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0", "WORLD_SIZE": "1"}


@pytest.fixture
def gloo_world_of_one(monkeypatch):
    """A gloo process group of this one process, destroyed after the test."""
    for name, value in world_of_one_env().items():
        monkeypatch.setenv(name, value)
    join_process_group("gloo")
    yield
    leave_process_group()


def gloo_threads() -> int:
    names = (open(f"/proc/self/task/{task}/comm").read() for task in os.listdir("/proc/self/task"))
    return sum("gloo" in name for name in names)


def count_gloo_threads(environ: dict[str, str], results) -> None:
    """In a child of the warm interpreter, a process group of its own: for DDP and FSDP, the gloo threads while
    a wrapped model has trained a step, and after leave_process_group; sent to `results`."""
    os.environ.update(environ)
    runtime = Runtime(torch.device("cpu"), torch.float32, world_size=2)  # one process, placed as a rank of two
    counts = {}
    for parallelism in ("ddp", "fsdp"):
        join_process_group("gloo")
        model = parallel.place_model(GPT(tiny_config()), runtime, parallelism)
        eval_model, train_model = parallel.wrap_model(model, runtime, use_compile=False)
        scaler = parallel.grad_scaler(model, "cpu", init_scale=1.0, enabled=True)
        train_model(torch.zeros(1, 4, dtype=torch.long))[0].sum().backward()
        del model, eval_model, train_model, scaler
        alive = gloo_threads()
        leave_process_group()
        counts[parallelism] = (alive, gloo_threads())
    results.send(counts)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_leaving_the_process_group_stops_its_threads(warm_interpreter):
    """In a process of its own, as a rank under torchrun: nothing DDP or FSDP leaves behind keeps the group alive
    past leave_process_group. A gloo thread still running when the interpreter exits can abort the process after
    a run that finished (runtime.join_process_group says how)."""
    results, sender = warm_context().Pipe(duplex=False)
    child = warm_context().Process(target=count_gloo_threads, args=(world_of_one_env(), sender))
    child.start()
    sender.close()
    try:
        assert results.poll(120), "no counts from the child"
        counts = results.recv()
    finally:
        child.join(30)
        child.kill()
    assert child.exitcode == 0 and list(counts) == ["ddp", "fsdp"], (child.exitcode, counts)
    for alive, after in counts.values():
        assert alive > 0 and after == 0, counts  # the count sees gloo's threads, and none is left


def test_ddp_wrapping_follows_the_settings(monkeypatch, gloo_world_of_one):
    """wrap_model gives DDP its bucket size and tells torch.compile whether to cut the graph at the buckets
    (ddp_graph_split); with per_block (compile_blocks) DDP wraps the model itself, whose blocks and head are
    compiled apart."""
    compiled = []
    monkeypatch.setattr(torch, "compile", lambda model, **options: compiled.append(model) or model)
    runtime = Runtime(torch.device("cpu"), torch.float32, world_size=2)  # wraps in DDP; one process here
    # wrap_model sets dynamo's global optimize_ddp (right for train.py's one run); dynamo's own config.patch puts
    # it back after, as pytest's monkeypatch cannot for a torch config entry (its undo may delete the entry)
    with torch._dynamo.config.patch(optimize_ddp=torch._dynamo.config.optimize_ddp):
        for split in (False, True):
            model = GPT(tiny_config())
            _, ddp = parallel.wrap_model(model, runtime, use_compile=True, bucket_cap_mb=7, graph_split=split)
            assert torch._dynamo.config.optimize_ddp is split
            assert ddp.bucket_bytes_cap == 7 * 2**20
            assert compiled == [model]  # whole
            compiled.clear()
        model = GPT(tiny_config())
        eval_model, ddp = parallel.wrap_model(model, runtime, use_compile=True, per_block=True)
        assert eval_model is model and ddp.module is model
        blocks = [block.forward for block in model.transformer.h]
        assert compiled == [*blocks, model.head]
    # bf16 all-reduce: PyTorch's hook, which refuses gloo when registered; here its registration is recorded
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook
    from torch.nn.parallel import DistributedDataParallel

    hooks = []
    monkeypatch.setattr(DistributedDataParallel, "register_comm_hook", lambda ddp, state, hook: hooks.append(hook))
    parallel.wrap_model(GPT(tiny_config()), runtime, use_compile=False)
    assert hooks == []
    parallel.wrap_model(GPT(tiny_config()), runtime, use_compile=False, reduce_dtype="bfloat16")
    assert hooks == [bf16_compress_hook]


def test_a_sharded_optimizer_skips_a_non_finite_step_and_takes_a_finite_one_as_adamw(gloo_world_of_one):
    """clip_and_step drives ZeRO's fused AdamW as a plain one: a non-finite gradient norm reaches the AdamW inside
    (found_inf), which leaves every weight as it was; the skip is that step's alone (a step the optimizer then
    takes by itself moves every weight); a finite step moves the weights as a plain AdamW's does."""
    idx = torch.randint(0, tiny_config().vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    weights = {}
    for sharded in (False, True):
        torch.manual_seed(0)
        model = GPT(tiny_config())
        optimizer = model.configure_optimizers(0.1, 1e-2, (0.9, 0.99), "cpu")
        optimizer = parallel.shard_optimizer(optimizer) if sharded else optimizer
        scaler = torch.amp.GradScaler("cpu", init_scale=1.0)
        for step in ("non-finite", "the optimizer's own", "finite"):
            before = [p.detach().clone() for p in model.parameters()]
            model(idx, idx)[1].backward()
            if step == "non-finite":
                next(model.parameters()).grad[0, 0] = float("nan")
            if step == "the optimizer's own":
                optimizer.step()
            else:
                norm = train.clip_and_step(optimizer, scaler, model, 1.0, torch.float32)
                assert bool(torch.isfinite(norm)) is (step == "finite")
            moved = [not torch.equal(p, kept) for p, kept in zip(model.parameters(), before)]
            assert moved == [step != "non-finite"] * len(moved), step
            optimizer.zero_grad()
        weights[sharded] = [p.detach() for p in model.parameters()]
    torch.testing.assert_close(weights[True], weights[False], rtol=0, atol=0)


def test_fsdp_keeps_gathered_weights_for_backward_only_when_asked(monkeypatch, gloo_world_of_one):
    """fsdp_reshard_after_forward=False: after forward each block still holds its gathered (plain) weights, to
    be used by backward without a second all-gather; True: back to its shard (a DTensor). Same loss, same
    gradients."""
    from torch.distributed.tensor import DTensor

    runtime = Runtime(torch.device("cpu"), torch.float32, world_size=2)  # shards; one process here
    idx = torch.randint(0, tiny_config().vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    results = {}
    for reshard in (True, False):
        torch.manual_seed(0)
        model = parallel.place_model(GPT(tiny_config()), runtime, "fsdp", reshard_after_forward=reshard)
        _, loss = model(idx, idx)
        weight = model.transformer.h[0].attn.c_attn.weight
        assert isinstance(weight, DTensor) is reshard
        loss.backward()
        grads = [parallel.replicated(p.grad) for p in model.parameters()]
        results[reshard] = (loss.detach(), grads)
    torch.testing.assert_close(results[True], results[False], rtol=0, atol=0)


def test_fsdp_reduces_every_micro_step_only_when_asked_with_the_same_gradients(gloo_world_of_one):
    """Between two micro-steps FSDP holds its gradients whole (no shard on the weights yet) unless
    sharded_every_step reduce-scatters each; after the last, both hold the same sharded gradients."""
    from torch.distributed.tensor import DTensor

    runtime = Runtime(torch.device("cpu"), torch.float32, world_size=2)  # shards; one process here
    batches = torch.randint(0, 64, (2, 2, 16), generator=torch.Generator().manual_seed(0))
    results = {}
    for every_step in (False, True):
        torch.manual_seed(0)
        model = parallel.place_model(GPT(tiny_config()), runtime, "fsdp")
        for micro_step, idx in enumerate(batches):
            last = micro_step == len(batches) - 1
            with parallel.gradient_sync(model, model, last, sharded_every_step=every_step):
                model(idx, idx)[1].backward()
            sharded = [isinstance(p.grad, DTensor) for p in model.parameters()]
            assert sharded == [every_step or last] * len(sharded), (every_step, micro_step)
        results[every_step] = [parallel.replicated(p.grad) for p in model.parameters()]
    torch.testing.assert_close(results[True], results[False], rtol=1e-6, atol=1e-7)


def test_fsdp_gathers_runs_of_blocks_as_one_unit_with_the_same_loss_and_gradients(gloo_world_of_one):
    """fsdp_blocks_per_unit=2 over 3 blocks: blocks 0 and 1 are one FSDP unit (gathering block 0 gathers block 1's
    weights too), block 2 its own; the loss and gradients are those of one unit per block."""
    from torch.distributed.tensor import DTensor

    runtime = Runtime(torch.device("cpu"), torch.float32, world_size=2)  # shards; one process here
    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    results = {}
    for blocks_per_unit in (1, 2):
        torch.manual_seed(0)
        model = parallel.place_model(GPT(tiny_config(n_layer=3)), runtime, "fsdp", blocks_per_unit=blocks_per_unit)
        blocks = model.transformer.h
        blocks[0].unshard()  # FSDPModule's public all-gather: the unit of block 0, and nothing else
        gathered = [not isinstance(block.attn.c_attn.weight, DTensor) for block in blocks]
        assert gathered == [True, blocks_per_unit == 2, False]
        blocks[0].reshard()
        _, loss = model(idx, idx)
        loss.backward()
        results[blocks_per_unit] = (loss.detach(), [parallel.replicated(p.grad) for p in model.parameters()])
    torch.testing.assert_close(results[2], results[1], rtol=0, atol=0)


def test_fsdp_steps_with_the_fused_adamw_as_one_process(gloo_world_of_one):
    """Under FSDP, clip_and_step hands the fused AdamW its DTensor gradient norm as the non-finite flag: a
    non-finite norm leaves every shard as it was, a finite step moves the weights as one process's fused AdamW
    does, and the norm comes back a plain tensor."""
    from torch.distributed.tensor import DTensor

    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    weights = {}
    for world_size in (1, 2):  # 2: sharded (one process here)
        torch.manual_seed(0)
        runtime = Runtime(torch.device("cpu"), torch.float32, world_size=world_size)
        model = parallel.place_model(GPT(tiny_config()), runtime, "fsdp")
        optimizer = model.configure_optimizers(0.1, 1e-2, (0.9, 0.99), "cpu")
        assert optimizer.defaults["fused"]
        scaler = parallel.grad_scaler(model, "cpu", init_scale=1.0, enabled=True)
        before = [parallel.replicated(p.detach()).clone() for p in model.parameters()]
        for poison in (True, False):
            model(idx, idx)[1].backward()
            if poison:
                grad = next(model.parameters()).grad
                (grad.to_local() if isinstance(grad, DTensor) else grad)[0, 0] = float("nan")
            norm = train.clip_and_step(optimizer, scaler, model, 1.0, torch.float32)
            assert not isinstance(norm, DTensor) and bool(torch.isfinite(norm)) is not poison
            if poison:
                after = [parallel.replicated(p.detach()) for p in model.parameters()]
                torch.testing.assert_close(after, before, rtol=0, atol=0)
            optimizer.zero_grad()
        weights[world_size] = [parallel.replicated(p.detach()) for p in model.parameters()]
    torch.testing.assert_close(weights[2], weights[1], rtol=0, atol=0)


def test_sharded_model_compiles_without_graph_breaks(monkeypatch, gloo_world_of_one):
    """Under FSDP, torch.compile takes each block and the head apart from the loop over blocks, whose FSDP hooks
    would make it skip the whole forward (it cannot take a graph break inside a loop): no graph break, two
    compiled frames (Block.forward, once for all blocks; GPT.head), and the eager loss and gradients. Dynamo's
    "eager" backend keeps it cheap: the tracing is what is tested."""
    from torch._dynamo.utils import counters

    compile_for_real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, mode=None: compile_for_real(fn, backend="eager"))
    runtime = Runtime(torch.device("cpu"), torch.float32, world_size=2)  # shards; one process here
    idx = torch.randint(0, tiny_config().vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    results = {}
    for use_compile in (False, True):
        torch._dynamo.reset()
        counters.clear()
        torch.manual_seed(0)
        model = parallel.place_model(GPT(tiny_config()), runtime, "fsdp")
        _, train_model = parallel.wrap_model(model, runtime, use_compile=use_compile)
        _, loss = train_model(idx, idx)
        loss.backward()
        results[use_compile] = (loss.detach(), [parallel.replicated(p.grad) for p in model.parameters()])
    graph_breaks, graphs = dict(counters["graph_break"]), counters["stats"]["unique_graphs"]
    torch._dynamo.reset()  # no compiled frames left for later tests
    assert graph_breaks == {}
    assert graphs == 2
    torch.testing.assert_close(results[True], results[False], rtol=0, atol=0)


def test_context_parallel_over_two_ranks_trains_like_one_process(reference, char_data, tmp_path, warm_interpreter):
    """--context_parallel=2 under torchrun: both ranks read the same sequences, each trains on its half of every
    one (RoPE at the half's own positions), and the run logs the losses and saves the weights of one process
    that reads whole sequences; the header and the INFO line say how attention runs, and a warning comes once,
    from rank 0, not from every rank."""
    ref_out, ref_losses = reference
    out = tmp_path / "out"
    # manual asked for: context parallelism replaces it, and the warning that says so comes once
    settings = run_args(char_data, out, "--context_parallel=2", "--max_iters=10", "--eval_interval=10")
    settings.append("--attention_backend=manual")
    code, output = joined(run_ranks("train.py", settings))
    assert code == 0, output
    assert "(1 ranks x 4 micro-steps x 4 x 16, each sequence split over 2 ranks)" in output, output
    assert "INFO: context parallel: each sequence split over 2 ranks; attention: SDPA" in output, output
    assert output.count("attention_backend=manual applies without context parallelism") == 1, output
    assert_same_losses(losses(output), {it: ref_losses[it] for it in range(1, 11)})
    expected = load_checkpoint(ref_out / "ckpt-0000010.pt")["model"]
    assert_same_weights(load_checkpoint(out / "ckpt.pt")["model"], expected)
