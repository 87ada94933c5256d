"""The benches (bench/): each tool's --quick run end to end, and the README table.

The end-to-end runs (the attention and train-step --quick runs, the phases and train.py per backend) start
together in one fixture; the rest is pure Python on small synthetic results or cheap in-process runs.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import types
from pathlib import Path

import pytest
import torch

from bench import grid, launch, readme_table, report, train_parts, train_step
from bench.launch import parse_log_line
from bench.report import card_slug
from helpers import WarmProcess
from training.progress import format_log_line

HEADER_FIELDS = (
    "device_name",
    "card",
    "torch",
    "cuda",
    "cudnn",
    "triton",
    "flash_attn",
    "date",
    "command",
    "flop_convention",
)
ATTENTION_FIELDS = (
    "backend",
    "head_dim",
    "seq_len",
    "batch_size",
    "docs",
    "dtype",
    "fwd_ms",
    "fwd_bwd_ms",
    "fwd_tflops",
    "fwd_bwd_tflops",
    "peak_mem_mib",
    "max_err",
    "status",
)
TRAIN_FIELDS = (
    "backend",
    "seq_len",
    "batch_size",
    "dtype",
    "ms_per_iter",
    "tokens_per_sec",
    "mfu",
    "peak_mem_mib",
    "compile_s",
    "status",
)


# ---- the end-to-end runs --------------------------------------------------------------------

COMPARE_ARGUMENTS = (
    "--n_layer=1",
    "--n_head=2",
    "--n_embd=32",
    "--block_size=16",
    "--batch_size=4",
    "--max_iters=4",
    "--log_interval=2",
    "--device=cpu",
)


@pytest.fixture(scope="module")
def runs(char_data, tmp_path_factory, warm_interpreter):
    """{name: (exit code, stdout, stderr, out folder)} of `python -m bench.attention --quick`,
    `bench.train_step --quick`, `bench.train_step phases --quick` (one process) and `bench.train_step compare`
    (sdpa, manual), as the benches run: modules from the repo root. Started together, each on one CPU thread,
    forked from the warm interpreter (helpers.WarmProcess), which has torch imported already."""
    commands = {  # the shortest timings that still time: these tests check rows and statuses, not speed
        "compare": ["bench.train_step", "compare", "--backends", "sdpa", "manual"],
        "attention-quick": ["bench.attention", "--quick", "--warmup-ms", "1", "--rep-ms", "5"],
        "train-quick": ["bench.train_step", "--quick"],
        "step-phases-quick": ["bench.train_step", "phases", "--quick", "--steps", "4", "ddp"],
        "multi-gpu-quick": ["bench.multi_gpu", "--quick", "--gpus", "1", "--iters", "3", "--warmup", "1", "--work"],
    }
    started = {}
    for name, command in commands.items():
        out = tmp_path_factory.mktemp(name)
        with open(out / "stdout.txt", "w") as stdout, open(out / "stderr.txt", "w") as stderr:
            argv, environ = [*command, "--out", str(out)], None
            if name == "compare":  # TMPDIR: the run's log folder lands in out, not in /tmp
                argv, environ = [*argv, "--", f"--data_dir={char_data}", *COMPARE_ARGUMENTS], {"TMPDIR": str(out)}
            elif command[-1] == "--work":  # its runs' folders: in out
                argv = [*command, str(out), "--out", str(out)]
            process = WarmProcess("-m", argv, stdout.fileno(), stderr.fileno(), environ)
            started[name] = (process, out)
    finished = {}
    try:
        for name, (process, out) in started.items():
            code = process.wait(timeout=240)
            finished[name] = (code, (out / "stdout.txt").read_text(), (out / "stderr.txt").read_text(), out)
    finally:  # past a timeout: a child left running would keep pytest from exiting
        for process, _ in started.values():
            if process.poll() is None:
                process.kill()
    return finished


@pytest.fixture(scope="module")
def quick_runs(runs):
    """{name: (results dict, out folder)} of the two --quick runs."""
    results = {}
    for name in ("attention-quick", "train-quick"):
        code, stdout, stderr, out = runs[name]
        assert code == 0, f"{name} failed:\n{(stdout + stderr)[-3000:]}"
        results[name] = (json.loads((out / f"cpu-{name}.json").read_text()), out)
    return results


def test_attention_quick_has_a_row_with_a_status_for_every_backend_and_cell(quick_runs):
    results, out = quick_runs["attention-quick"]
    header, rows = results["header"], results["rows"]
    assert all(header.get(k) is not None or k in ("cuda", "cudnn", "triton", "flash_attn") for k in HEADER_FIELDS)
    assert "3.5" in header["flop_convention"]
    grid = header["grid"]
    expected = {
        (b, d, t, docs)
        for b in grid["backends"]
        for d in grid["head_dims"]
        for t in grid["seq_lens"]
        for docs in grid["docs"]
    }
    assert sorted((r["backend"], r["head_dim"], r["seq_len"], r["docs"]) for r in rows) == sorted(expected)
    for row in rows:
        assert set(ATTENTION_FIELDS) <= set(row), row
        assert isinstance(row["status"], str) and row["status"], row
        if row["fwd_status"] == "ok":  # float32 on CPU: every backend is near the float32 reference
            assert math.isfinite(row["max_err"]) and row["max_err"] < 1e-4, row
            assert row["fwd_ms"] > 0 and row["fwd_tflops"] > 0
        if row["status"] == "ok":
            assert row["fwd_bwd_ms"] > 0 and row["fwd_bwd_tflops"] > 0
    by_key = {(r["backend"], r["seq_len"], r["docs"]): r for r in rows}
    assert by_key[("manual", 64, True)]["status"] == "ok"
    assert by_key[("auto", 64, False)]["resolved"] == "sdpa"
    assert "CUDA only" in by_key[("sdpa:cudnn", 64, False)]["status"]
    for flex in (by_key[("flex_attention", 64, False)], by_key[("flex_attention", 128, True)]):
        assert flex["fwd_status"] == "ok" and "backward" in flex["fwd_bwd_status"]  # CPU flex: forward only
    assert "nothing compiled" in header["notes"]["timing"]  # flex runs eagerly in --quick: its time is no kernel's
    assert (out / "cpu-attention-quick.md").stat().st_size > 0
    assert (out / "cpu-attention-quick.png").read_bytes()[:4] == b"\x89PNG"


def test_train_quick_times_the_real_step_and_records_why_a_backend_cannot_run(quick_runs):
    results, out = quick_runs["train-quick"]
    header, rows = results["header"], results["rows"]
    assert all(k in header for k in HEADER_FIELDS)
    assert len(rows) == len(header["grid"]["cases"])
    for row in rows:
        assert set(TRAIN_FIELDS) <= set(row), row
        assert row["status"]
        if row["status"] == "ok":
            assert row["ms_per_iter"] > 0 and row["tokens_per_sec"] > 0 and math.isfinite(row["loss"])
    statuses = {r["backend"]: r["status"] for r in rows}
    assert statuses["auto"] == statuses["sdpa"] == statuses["manual"] == "ok"
    assert "backward" in statuses["flex_attention"]  # CPU flex cannot train: recorded, not timed as sdpa
    assert (out / "cpu-train-quick.md").exists() and (out / "cpu-train-quick.png").exists()


# ---- shared helpers ---------------------------------------------------------------------------


def test_step_phases_time_train_pys_own_step_phase_by_phase(runs):
    code, stdout, stderr, out = runs["step-phases-quick"]
    assert code == 0, (stdout + stderr)[-3000:]
    rows = json.loads((out / "cpu-step-phases-quick.json").read_text())["rows"]
    assert [row["phase"] for row in rows] == list(train_parts.PHASES)
    for row in rows:  # one process: it is its own slowest rank
        assert 0 < row["host_ms"] <= row["wall_ms"] * 1.01 and row["slowest_ms"] == row["wall_ms"], row
        assert row["rank_wall_ms"] == f"{row['wall_ms']:.2f}" and row["ranks"] == 1
    assert (out / "cpu-step-phases-quick.png").read_bytes()[:4] == b"\x89PNG"


def test_multi_gpu_quick_runs_train_py_under_torchrun_and_reads_its_log(runs):
    code, stdout, stderr, out = runs["multi-gpu-quick"]
    assert code == 0, (stdout + stderr)[-3000:]
    (row,) = json.loads((out / "cpu-ddp-quick.json").read_text())["rows"]
    assert (row["run"], row["gpus"], row["status"]) == ("ddp", 1, "ok"), row
    assert row["tokens_per_sec"] > 0 and sorted(row["losses"]) == ["1", "2", "3"]
    assert (out / "cpu-ddp-quick.png").read_bytes()[:4] == b"\x89PNG"


def test_a_plot_panel_without_a_series_draws_no_legend_and_warns_nothing(tmp_path):
    """A scaling panel whose rows have no scaling (one GPU count) holds only the 1.0 line: no legend, no warning."""
    import warnings

    rows = [{"gpus": 1, "scaling": None, "run": "ddp"}, {"gpus": 2, "scaling": 0.9, "run": "ddp"}]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for shown in (rows[:1], rows):
            report.plot(shown, tmp_path / "p.png", x="gpus", panels=[("scaling", "scaling", shown)], series=str)
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


def test_every_bench_takes_its_models_from_one_place():
    assert report.TINY == {"n_layer": 2, "n_head": 2, "n_embd": 64}
    assert report.model_settings(quick=True).items() >= report.TINY.items()
    assert report.model_settings(quick=False).items() >= report.GPT2_124M.items()
    report.model_settings(quick=True)["n_layer"] = 99  # a copy: a bench cannot change the shared shape
    assert report.TINY["n_layer"] == 2
    assert launch.flags(report.TINY) == ["--n_layer=2", "--n_head=2", "--n_embd=64"]


def test_bench_parser_fills_what_is_left_unset_from_the_quick_or_the_full_defaults():
    def parse(*argv):
        parser = grid.BenchParser("demo", "Demo bench.", quick_help="tiny", name=("demo", "demo-q"))
        parser.grid_options(("cuda", "cpu"), ("bfloat16", "float32"), ("bfloat16", "float32"), (60, 0))
        parser.option("--sizes", [8, 16], [1], type=int, nargs="*", help="sizes")
        return parser.parse_args(list(argv))

    args = parse()
    assert (args.device, args.dtype, args.budget, args.name, args.sizes) == ("cuda", "bfloat16", 60, "demo", [8, 16])
    assert args.out == report.DEFAULT_OUT
    args = parse("--quick", "--budget", "5", "--sizes")
    assert (args.device, args.dtype, args.budget, args.name, args.sizes) == ("cpu", "float32", 5, "demo-q", [])


def test_the_grid_runner_records_cases_past_the_budget_as_skipped_and_writes_the_results(tmp_path, capsys):
    """One runner for the attention, train and generate benches: rows in case order, one progress line each,
    the budget's reason in every row it left out, finish() over all rows, then <card>-<name>.json and .md (a name
    may hold dots, as model sizes do)."""
    from types import SimpleNamespace

    def measure(case):
        time.sleep(0.05)  # longer than the whole budget: every later case is skipped
        return [{"case": case, "part": part, "status": "ok"} for part in ("a", "b")]

    demo = dict(
        measure=measure,
        skipped=lambda case, reason: [{"case": case, "part": "a", "status": reason}],
        progress=["case", "part", "status"],
        columns=["case", "status"],
        finish=lambda rows: rows.append({"case": "all", "part": "", "status": f"{len(rows)} rows"}),
    )
    args = SimpleNamespace(quick=False, budget=0.01, name="grid-demo-6.7b", out=tmp_path)
    header, rows = grid.run_grid([1, 2, 3], args, torch.device("cpu"), {"grid": {"cases": [1, 2, 3]}}, **demo)
    assert [(r["case"], r["part"]) for r in rows] == [(1, "a"), (1, "b"), (2, "a"), (3, "a"), ("all", "")]
    assert rows[2]["status"] == rows[3]["status"] == "skipped: --budget 0.01 s used up"
    assert rows[-1]["status"] == "4 rows"
    saved = json.loads((tmp_path / "cpu-grid-demo-6.7b.json").read_text())
    assert saved == json.loads(json.dumps({"header": header, "rows": rows}))
    assert header["bench"] == "grid-demo-6.7b" and header["grid"] == {"cases": [1, 2, 3]} and header["wall_s"] >= 0.05
    assert "| 3 | skipped: --budget 0.01 s used up |" in (tmp_path / "cpu-grid-demo-6.7b.md").read_text()
    out = capsys.readouterr().out
    assert "case 1 part b status ok" in out and "case 3 part a status skipped" in out and "wrote " in out


def test_train_py_is_launched_one_way():
    assert launch.train_command(["--a=1"]) == [sys.executable, "train.py", "--a=1"]
    torchrun = launch.train_command(["--a=1"], ["--standalone", "--nproc_per_node=2"])
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    assert torchrun == [*launcher, "train.py", "--a=1"]


def test_the_train_step_profile_writes_each_variants_kernels_by_kind(tmp_path, capsys):
    argv = ["profile", "--quick", "--steps", "1", "--variants", "plain", "docs", "--out", str(tmp_path)]
    assert train_step.main(argv) == 0
    text = (tmp_path / "cpu-profile-train-quick.md").read_text()
    assert text.startswith("# profile-train-quick on cpu") and "wrote " in capsys.readouterr().out
    assert "## plain: sdpa, T=64, batch 4" in text and "## docs: " in text


@pytest.mark.parametrize(
    "name, slug",
    [
        ("NVIDIA H100 80GB HBM3", "h100"),
        ("NVIDIA H200", "h200"),
        ("NVIDIA A100-SXM4-80GB", "a100"),
        ("NVIDIA GeForce RTX 4090", "rtx-4090"),
        ("NVIDIA GH200 480GB", "gh200"),
        ("Tesla T4", "t4"),
    ],
)
def test_card_slug(name, slug):
    assert card_slug(name) == slug


@pytest.mark.parametrize("mfu", [0.391, None])
def test_log_line_parser_reads_what_train_py_writes(mfu):
    line = format_log_line(120, 2.913, 6e-4, 0.0362, 452424.0, mfu, 11.5)
    parsed = parse_log_line("some prefix " + line)
    assert parsed["iter"] == 120 and parsed["loss"] == pytest.approx(2.913)
    assert parsed["ms_per_iter"] == pytest.approx(36.2) and parsed["tokens_per_sec"] == 452424
    assert parsed["mfu"] == (pytest.approx(mfu, abs=1e-3) if mfu else None) and parsed["mem_gib"] == 11.5
    assert parse_log_line("eval 100 | train 2.9 | val 3.0") is None


# ---- README table and target checks, on synthetic results ------------------------------------

SEQ_LENS = (1024, 2048, 4096, 8192, 16384)


def synthetic_results(auto_slowdown: float = 1.0, flex_memory_power: float = 1.0) -> dict:
    """Times proportional to T (equal tokens per call), memory per sequence ~ T (flex: T^power, manual: T^2)."""
    speed = {"sdpa:auto": 1.0, "flex_attention": 1.3, "manual": 10.0, "auto": auto_slowdown}
    rows = []
    for head_dim in (64, 128):
        for seq_len in SEQ_LENS:
            batch = 16384 // seq_len
            for backend, factor in speed.items():
                power = {"manual": 2.0, "flex_attention": flex_memory_power}.get(backend, 1.0)
                manual_oom = backend == "manual" and seq_len == 16384
                rows.append(
                    {
                        "backend": backend,
                        "resolved": "sdpa" if backend == "auto" else backend,
                        "head_dim": head_dim,
                        "seq_len": seq_len,
                        "batch_size": batch,
                        "docs": False,
                        "dtype": "bfloat16",
                        "fwd_ms": None,
                        "fwd_tflops": None,
                        "max_err": 1e-3,
                        "fwd_bwd_ms": None if manual_oom else factor * seq_len / 1024,
                        "fwd_bwd_tflops": None if manual_oom else 300 / factor,
                        "peak_mem_mib": None if manual_oom else batch * 0.01 * (seq_len / 1024) ** power * 1024,
                        "mem_pass": None if manual_oom else "fwd_bwd",
                        "fwd_bwd_status": "OOM" if manual_oom else "ok",
                        "status": "OOM" if manual_oom else "ok",
                    }
                )
    header = {
        "device_name": "NVIDIA H100 80GB HBM3",
        "torch": "2.11.0",
        "date": "2026-11-26T00:00:00+00:00",
        "grid": {"dtype": "bfloat16", "tokens_per_call": 16384, "heads": 16},
    }
    return {"header": header, "rows": rows}


def test_readme_table_has_backends_seq_lens_memory_and_source():
    table = readme_table.backend_table(synthetic_results(), source="bench/results/h100-attention.json")
    lines = table.splitlines()
    assert lines[0] == (
        "| backend | D=64 T=1k | D=64 T=4k | D=64 T=16k | D=128 T=1k | D=128 T=4k | D=128 T=16k "
        "| mem D=64 T=16k (MiB) | mem D=128 T=16k (MiB) |"
    )
    manual = next(line for line in lines if line.startswith("| manual"))
    assert manual.split("|")[3].strip() == "30" and "OOM" in manual
    assert any(line.startswith("| auto (→ sdpa) |") for line in lines)
    assert "bench/results/h100-attention.json" in lines[-1] and "NVIDIA H100" in lines[-1]


def test_readme_update_replaces_only_between_markers(tmp_path):
    readme = tmp_path / "README.md"
    start, end = readme_table.markers(docs=False)
    readme.write_text(f"intro\n{start}\nold table\n{end}\noutro\n")
    assert readme_table.update_readme(readme, "| new |")
    assert readme.read_text() == f"intro\n{start}\n| new |\n{end}\noutro\n"
    plain = tmp_path / "PLAIN.md"
    plain.write_text("no markers\n")
    assert not readme_table.update_readme(plain, "| new |") and plain.read_text() == "no markers\n"
    assert not readme_table.update_readme(tmp_path / "missing.md", "| new |")
    quoted = tmp_path / "QUOTED.md"  # a marker named in a sentence is not where the table goes
    quoted.write_text(f"see `{start}` below\n{start}\nold\n{end}\n")
    assert readme_table.update_readme(quoted, "| new |")
    assert quoted.read_text() == f"see `{start}` below\n{start}\n| new |\n{end}\n"


def test_compare_backends_tabulates_each_backends_last_log_line(runs):
    """One real run of the script for two backends: a row each, from its last log line."""
    code, stdout, stderr, out = runs["compare"]
    assert code == 0, stderr
    rows = {line.split("|")[1].strip(): line for line in stdout.splitlines() if line.startswith("| ")}
    assert set(rows) >= {"sdpa", "manual"}
    for backend in ("sdpa", "manual"):
        cells = [c.strip() for c in rows[backend].split("|")[1:-1]]
        assert cells[1] == backend and cells[2] == "4" and cells[-1] == "ok", rows[backend]
    saved = json.loads((out / "cpu-compare_backends.json").read_text())
    assert [r["backend"] for r in saved["rows"]] == ["sdpa", "manual"]
    assert "compare --backends sdpa manual" in saved["header"]["command"]
    (logs,) = out.glob("compare_backends.*")
    assert f"logs in {logs}" in stderr


def test_compare_row_records_a_failed_run_with_its_last_line():
    row = train_parts.compare_row("flash_attn_2", "INFO: attention backend: sdpa\nerror: no such thing\n", 2)
    assert row == {"backend": "flash_attn_2", "runs": "sdpa", "status": "exit 2: error: no such thing"}


def test_graphs_go_to_the_smallest_backends_and_a_failed_capture_times_eagerly(monkeypatch):
    """capture_graphs on a pretend 100 GiB card: graphs of a cell may hold 25 GiB, smallest backends first;
    a backend past that, or whose capture fails, keeps its eager runs and says why in its row."""
    from types import SimpleNamespace

    from bench import attention

    captured = []

    def fake_graph(fn, grads, device):
        if fn == "breaks":
            raise RuntimeError("operation not permitted when stream is capturing")
        captured.append(fn)
        return SimpleNamespace(replay=f"replay {fn}")

    monkeypatch.setattr(attention, "cuda_graph", fake_graph)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=100 * 2**30))

    def measurement(name, mib, fn=None):
        runs = {"fwd": (fn or f"{name} fwd", ()), "fwd_bwd": (fn or f"{name} fwd_bwd", ())}
        return attention.Measurement({"backend": name, "peak_mem_mib": mib}, runs, {}, {})

    ms = [
        measurement("manual", 20_000),
        measurement("sdpa", 300),
        measurement("broken", 100, "breaks"),
        measurement("flex", 5_000),
    ]
    attention.capture_graphs(ms, torch.device("cuda"))
    manual, sdpa, broken, flex = ms
    assert captured == ["sdpa fwd", "sdpa fwd_bwd", "flex fwd", "flex fwd_bwd"]
    assert sdpa.runs["fwd"] == ("replay sdpa fwd", ()) and sdpa.row["fwd_bwd_timing"] == "cuda graph"
    assert flex.row["fwd_timing"] == "cuda graph"
    assert manual.runs["fwd"] == ("manual fwd", ()) and "would hold ~40,000 MiB" in manual.row["fwd_timing"]
    assert broken.runs["fwd"] == ("breaks", ()) and "capture failed" in broken.row["fwd_bwd_timing"]


@pytest.mark.parametrize(
    "output, line",
    [
        ("iter 1\nerror: rank 1 failed: boom\n====\n", "error: rank 1 failed: boom"),
        (
            "[rank2]: Traceback\n[rank2]: torch.distributed.DistBackendError: NCCL error: Duplicate GPU\n"
            "======\nRoot Cause (first observed failure):\n------\n",
            "[rank2]: torch.distributed.DistBackendError: NCCL error: Duplicate GPU",
        ),
        ("starting\nkilled\n=========\n", "killed"),
        ("", "(no output)"),
        ("iter 1 | loss 3.0\ntimed out after 150 s", "timed out after 150 s; last output: iter 1 | loss 3.0"),
        ("timed out after 150 s", "timed out after 150 s"),
    ],
)
def test_a_failed_run_is_summed_up_by_its_error_not_torchruns_rules(output, line):
    assert launch.failure_line(output) == line


def test_a_probe_stops_at_its_last_step_and_a_timeout_leaves_nothing_running(tmp_path):
    """launch.run kills the whole process tree, also a grandchild in a session of its own (as torchrun's
    workers are), once the run logs the iteration it waits for, or at its timeout."""
    pid_file = tmp_path / "grandchild.pid"
    grandchild = "import time; time.sleep(60)"
    script = (
        "import subprocess, sys, time\n"
        f"p = subprocess.Popen([sys.executable, '-c', {grandchild!r}], start_new_session=True)\n"
        f"open({str(pid_file)!r}, 'w').write(str(p.pid))\n"
        "for it in (1, 2, 3):\n"
        f"    print({format_log_line(0, 3.0, 1e-3, 0.1, 1000.0, None, 1.0)!r}.replace('iter 0', f'iter {{it}}'), "
        "flush=True)\n"
        "time.sleep(60)\n"
    )
    command = [sys.executable, "-c", script]

    def gone(pid: int) -> bool:
        for _ in range(50):
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return True
            stat = open(f"/proc/{pid}/stat").read() if os.path.exists(f"/proc/{pid}/stat") else ""
            if ") Z " in stat:  # killed, waiting for its (dead) parent's reaper
                return True
            time.sleep(0.1)
        return False

    run = launch.run(command, dict(os.environ), timeout=30, stop_at_iter=2)
    assert run.code == 0 and "iter 2" in run.output and run.seconds < 20
    assert [line["iter"] for line in run.lines][:2] == [1, 2]
    assert gone(int(pid_file.read_text()))

    run = launch.run(command, dict(os.environ), timeout=1.5)
    assert run.code == 124 and "timed out after 1.5 s" in run.output and run.seconds < 20
    assert gone(int(pid_file.read_text()))


def test_multi_gpu_context_rows_split_n_times_one_gpus_t_and_compare_mfu_and_loss(monkeypatch):
    """--context T: one GPU at T, N GPUs at N x T with context_parallel=N; --context-check T: T on both. Scaling
    compares tok/s per GPU for DDP rows, MFU for context rows, and the final loss where T is the same."""
    from bench import multi_gpu

    calls = []

    def measure(args, run, model, shape, parallelism, gpus, micro_batch, settings, **options):
        calls.append((run, gpus, options["block_size"], [s for s in settings if "context_parallel" in s]))
        return {"run": run}

    monkeypatch.setattr(multi_gpu, "measure", measure)
    args = types.SimpleNamespace(quick=True, gpus=[1, 2], context=[64], context_check=[32], context_iters=6)
    multi_gpu.context_rows(args, lambda row: None)
    assert calls == [
        ("context T=64", 1, 64, []),
        ("context T=64", 2, 128, ["--context_parallel=2"]),
        ("context-check T=32", 1, 32, []),
        ("context-check T=32", 2, 32, ["--context_parallel=2"]),
    ]

    def row(run, gpus, block_size, tok_s, mfu, loss):
        return dict(run=run, baseline=run, model="m", gpus=gpus, block_size=block_size, tokens_per_sec=tok_s,
                    tokens_per_sec_per_gpu=tok_s / gpus, mfu=mfu, final_loss=loss,
                    losses={1: 11.0, 2: loss})  # fmt: skip

    rows = [
        row("ddp", 1, 1024, 100.0, 0.40, 3.0),
        row("ddp", 2, 1024, 190.0, 0.38, 3.0),
        row("context T=64", 1, 64, 100.0, 0.50, 3.0),
        row("context T=64", 2, 128, 120.0, 0.40, 2.9),
        row("context-check T=32", 1, 32, 100.0, 0.50, 3.0),
        row("context-check T=32", 2, 32, 90.0, 0.20, 3.001),
    ]
    multi_gpu.add_scaling(rows)
    assert rows[1]["scaling"] == pytest.approx(0.95) and "mfu_vs_1gpu" not in rows[1]
    assert rows[3]["mfu_vs_1gpu"] == pytest.approx(0.8) and "scaling" not in rows[3] and "loss_vs_1gpu" not in rows[3]
    assert rows[5]["mfu_vs_1gpu"] == pytest.approx(0.4) and rows[5]["loss_vs_1gpu"] == pytest.approx(0.001)
    assert rows[5]["loss_gaps"] == "+0.000 +0.001" and "loss_gaps" not in rows[3]
    assert not any(key in rows[0] for key in ("scaling", "mfu_vs_1gpu", "loss_vs_1gpu"))
    # the one-GPU run logged a third iteration, whose loss is far from the second's: compared iteration by iteration
    rows[4]["losses"][3] = rows[4]["final_loss"] = 2.5
    multi_gpu.add_scaling(rows)
    assert rows[5]["loss_vs_1gpu"] == pytest.approx(0.001) and rows[5]["loss_gaps"] == "+0.000 +0.001"


def test_multi_gpu_rows_end_at_the_iteration_waited_for_and_read_a_corpus_sized_by_their_own_t(monkeypatch, tmp_path):
    """A fast run logs a step past the stop before the kill lands: the row leaves it out, so two rows of one check end
    at the same iteration (a GPU check once compared one GPU's fifth loss with two GPUs' fourth: 0.49 apart). Each
    run's corpus is sized by its own sequence length, so a check at one T reads the same tokens in every bench
    process, whatever longer runs that process also makes."""
    from types import SimpleNamespace

    from bench import launch, multi_gpu

    line = "iter {} | loss {} | lr 1.0e-04 | 9.0 ms | 1,000 tok/s | MFU 40.0% | mem 1.0 GiB\n"
    output = "".join(line.format(it, loss) for it, loss in ((1, 10.9), (2, 8.8), (3, 7.9), (4, 7.2)))
    commands = []
    monkeypatch.setattr(launch, "run", lambda command, *args: commands.append(command) or launch.Run(0, output, 1.0))
    monkeypatch.setattr(launch, "corpus", lambda folder, longest: folder.with_name(f"data-{longest}"))
    args = SimpleNamespace(gpus=[1, 2], accum=1, block_size=64, vocab_size=None, iters=6, log_interval=1,
                           quick=True, work=tmp_path, timeout=10, warmup=0, extra=[])  # fmt: skip
    row = multi_gpu.measure(args, "context-check", "tiny", multi_gpu.TINY, "ddp", 2, 1, stop_at_iter=3, block_size=32)
    assert row["losses"] == {1: 10.9, 2: 8.8, 3: 7.9} and row["final_loss"] == 7.9
    assert f"--data_dir={tmp_path / 'data-32'}" in commands[0]


def test_the_bench_corpus_grows_until_its_validation_split_holds_the_longest_sequence(tmp_path, monkeypatch):
    """launch.corpus: four copies of the sources by default; for sequences longer than that validation split
    (a tenth), as many copies as it takes, in a folder of their own."""
    sources = tmp_path / "repo"
    sources.mkdir()
    (sources / "a.py").write_text("x = 1  # some source\n" * 50)  # 1,050 characters
    monkeypatch.setattr(launch, "ROOT", sources)
    plain = launch.corpus(tmp_path / "data")
    longer = launch.corpus(tmp_path / "data", longest=2000)
    assert plain == tmp_path / "data" and longer != plain
    val_tokens = [(folder / "val.bin").stat().st_size // 2 for folder in (plain, longer)]  # uint16 ids
    assert val_tokens[0] < 2002 <= val_tokens[1]


def test_a_stopped_bench_leaves_no_run_behind(monkeypatch, capsys):
    """Ctrl-C or SIGTERM while a run is going: the run and what it started are killed, its last lines printed, and
    the stop goes on up (the bench ends, as asked)."""
    child = "import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])"
    child += "; print('started', p.pid, flush=True); print('stop here', flush=True); time.sleep(60)"

    def parse(line):
        if line.startswith("stop here"):
            raise KeyboardInterrupt  # as SIGTERM raises it (errors.Stopped) where the bench was
        return None

    monkeypatch.setattr(launch, "parse_log_line", parse)
    run = launch.Launch([sys.executable, "-c", child])
    with pytest.raises(KeyboardInterrupt):
        run.wait(timeout=30, stop_at_iter=1)
    assert run.process.wait(timeout=10) == -9
    printed = capsys.readouterr().err
    grandchild = Path(f"/proc/{printed.split('started ')[1].split()[0]}/stat")
    time.sleep(0.5)  # SIGKILL is delivered at once; the state changes as it is
    assert not grandchild.exists() or grandchild.read_text().rsplit(")", 1)[1].split()[0] in "ZX"  # dead or reaped


def test_bench_context_checks_each_chunk_kernel_against_the_reference(tmp_path):
    """train_step context --quick (CPU, float64): one row per chunk kernel, each with the kernel it runs as; CPU's
    flash kernel, merged over prefix and diagonal, within 1e-10 of the lower-right-masked reference; results
    written."""
    assert train_step.main(["context", "--quick", "--out", str(tmp_path), "--ranks", "4", "--rank", "1"]) == 0
    rows = json.loads((tmp_path / "cpu-context.json").read_text())["rows"]
    used = {row["kernel"]: row["used"] for row in rows}
    assert used["auto"] == used["cpu_flash"] == "cpu_flash" and used["cudnn"] == "sdpa_lower_right"
    assert all(row["status"] == "ok" and row["ms"] > 0 for row in rows)
    assert 0 < next(row["max_rel_err"] for row in rows if row["kernel"] == "cpu_flash") < 1e-10
    assert (tmp_path / "cpu-context.md").exists() and (tmp_path / "cpu-context.png").exists()


def test_multi_gpu_fsdp_model_picks_the_sharded_models_shape_at_half_the_micro_batch(monkeypatch, tmp_path):
    """--fsdp-model gpt2-6.7B: the FSDP rows train a GPT-2 of width 4096 and 32 layers (6.65B parameters with its
    vocabulary) at half the --micro-batch, as GPT-2 XL's do; the default stays GPT-2 XL."""
    from bench import launch, multi_gpu

    calls = []

    def measure(args, run, model, shape, parallelism, gpus, micro_batch, *rest, **options):
        calls.append((model, shape, gpus, micro_batch, round(multi_gpu.params_millions(shape, 50304, 1024))))
        return {"run": run, "model": model, "gpus": gpus, "status": "ok", "wall_s": 0, "tokens_per_sec": 1.0,
                "tokens_per_sec_per_gpu": 1.0}  # fmt: skip

    monkeypatch.setattr(multi_gpu, "measure", measure)
    monkeypatch.setattr(multi_gpu, "save", lambda *args: [])
    monkeypatch.setattr(launch, "corpus", lambda folder, longest: folder)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    common = ["--skip-ddp", "--fsdp", "--gpus", "4", "--micro-batch", "8", "--work", str(tmp_path)]
    assert multi_gpu.main([*common, "--fsdp-model", "gpt2-6.7B"]) == 0
    assert multi_gpu.main(common) == 0
    assert calls == [
        ("gpt2-6.7B", {"n_layer": 32, "n_head": 32, "n_embd": 4096}, 4, 4, 6653),
        ("gpt2-xl-1.5B", multi_gpu.GPT2_XL, 4, 4, 1557),
    ]


def test_multi_gpu_rows_name_a_model_that_settings_after_the_dashes_reshape(monkeypatch, tmp_path):
    """`-- --n_layer=12 --n_embd=768` on a --quick run changes the model the rows train: their model says so, and
    the parameters are train.py's own count, not the bench's shape's; other settings leave both as they were."""
    from types import SimpleNamespace

    from bench import launch, multi_gpu

    output = "parameters: 123.59M | tokens per iteration: 2,048\niter 1 | loss 10.8 | lr 1e-4 | 9.0 ms | 1 tok/s\n"
    monkeypatch.setattr(launch, "run", lambda *args: launch.Run(0, output, 1.0))
    monkeypatch.setattr(launch, "corpus", lambda folder, longest: folder)
    args = SimpleNamespace(gpus=[1], accum=1, block_size=64, vocab_size=None, iters=1,
                           log_interval=1, quick=True, work=tmp_path, timeout=10, warmup=0)  # fmt: skip
    rows = {}
    for extra in (["--n_layer=12", "--n_embd=768", "--dtype=bfloat16"], ["--dtype=bfloat16"]):
        args.extra = extra
        rows[len(extra)] = multi_gpu.measure(args, "context-check", "tiny", multi_gpu.TINY, "ddp", 1, 1)
    assert (rows[3]["model"], rows[3]["params_m"]) == ("tiny (n_layer=12, n_embd=768)", 123.59)
    expected = multi_gpu.params_millions(multi_gpu.TINY, None, 64)
    assert (rows[1]["model"], rows[1]["params_m"]) == ("tiny", expected)


def test_multi_gpu_variants_keep_the_tokens_of_a_step_for_each_family(monkeypatch):
    """--variant rows for DDP and, with --fsdp, GPT-2 XL: each scaled by its own family's 1-GPU run; a variant's
    --batch_size keeps the tokens a step (fewer micro-steps) and leaves the train.py settings."""
    from bench import multi_gpu

    calls = []

    def measure(args, run, model, shape, parallelism, gpus, micro_batch, settings, baseline=None, **options):
        calls.append((run, model, gpus, micro_batch, options.get("accum_total"), list(settings), baseline))
        return {"run": run}

    monkeypatch.setattr(multi_gpu, "measure", measure)
    args = types.SimpleNamespace(gpus=[1, 2], accum=2)
    shape = multi_gpu.GPT2_XL
    multi_gpu.variant_row(args, "fsdp mb16", "xl", shape, "fsdp", 2, 8, ["--batch_size=16", "--compile=true"])
    multi_gpu.variant_row(args, "ddp plain", "small", shape, "ddp", 2, 16, ["--ddp_graph_split=true"])
    assert calls == [
        ("fsdp mb16", "xl", 2, 16, 2, ["--compile=true"], "fsdp"),  # 4 x 8 sequences a step = 2 x 16
        ("ddp plain", "small", 2, 16, 4, ["--ddp_graph_split=true"], "ddp"),
    ]


def test_curves_compare_a_run_set_on_the_same_settings_and_measure_each_gap_to_the_first(monkeypatch, tmp_path):
    """`curves --runs fp8 -- SETTINGS`: bf16 then FP8, each run with the settings after the dashes, each row's gap
    the mean distance of its losses to the first run's over the last third (train.py's runs made up here)."""
    launched = []

    def made_up_run(settings):
        launched.append(settings)
        out_dir = Path(next(s for s in settings if s.startswith("--out_dir=")).partition("=")[2])
        out_dir.mkdir(parents=True)
        (out_dir / "ckpt.pt").write_bytes(b"weights")  # a 4096-wide run's are 34 GiB: removed once the log is read
        shift = 0.01 if "--fp8=tensorwise" in settings else 0.0
        lines = [{"loss": 3.0 - 0.1 * i + shift, "tokens_per_sec": 1e3, "mfu": None} for i in range(6)]
        return types.SimpleNamespace(code=0, lines=lines, output="")

    monkeypatch.setattr(train_parts, "train_log", made_up_run)
    argv = ["--quick", "--runs", "fp8", "--iters", "6", "--out", str(tmp_path), "--work", str(tmp_path / "w")]
    assert train_parts.curves([*argv, "--", "--n_embd=64"]) == 0
    assert not any((tmp_path / "w").iterdir())  # each run's out_dir
    assert all("--n_embd=64" in settings for settings in launched) and len(launched) == 2
    rows = json.loads((tmp_path / "cpu-loss-curves-quick.json").read_text())["rows"]
    assert [(r["run"], r["switches"]) for r in rows] == [("bf16", "--fp8=off"), ("fp8 tensorwise", "--fp8=tensorwise")]
    assert rows[0]["gap_vs_first"] == 0 and rows[1]["gap_vs_first"] == pytest.approx(0.01)
