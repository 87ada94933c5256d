"""bench/README.md's generated tables against their results files, and the attention targets on the attention
results (bench/results/<card>-attention.json, -attention-docs and -attention-float16, as bench/run_gpu.sh's attention
and float16 stages write them), in every (dtype, masking, head dim, seq len) cell:
  1. `auto` is within 5% of the fastest backend's fwd+bwd time;
  2. every backend that does not keep the (T, T) scores by design uses attention memory per sequence
     (peak_mem_mib / batch_size) that grows ~linearly in T: the slope of log(memory) against log(T) is at most 1.2.
     At a constant token count, memory per sequence is what separates O(T) (slope 1) from O(T^2) (slope 2);
  3. every backend's forward agrees with the float32 reference: ||out - ref|| / ||ref|| <= 1e-2 in every cell it
     ran. bf16 keeps 8 significant bits, so rounding the output alone errs by up to 2^-8 = 3.9e-3 per value (~2e-3
     in norm, what a correct kernel shows); 1e-2 leaves room for rounded inputs and long sums, while a wrong mask or
     scale gives errors of order 1.
"""

from __future__ import annotations

import json
import math
import re

import pytest

from bench import readme_table
from helpers import REPO

RESULTS = REPO / "bench" / "results"
ATTENTION = sorted(
    p for pattern in ("attention", "attention-docs", "attention-float16") for p in RESULTS.glob(f"*-{pattern}.json")
)
AUTO_TOLERANCE, MAX_SLOPE, MAX_REL_ERR = 0.05, 1.2, 1e-2


def keeps_scores(row: dict) -> bool:
    """Whether this backend keeps the (T, T) scores by design: manual, SDPA's math kernel, SDPA with documents
    (a dense mask). Their memory is exempt from target 2."""
    runs = row.get("resolved") or row["backend"]
    return runs in ("manual", "sdpa:math") or (row["docs"] and runs.startswith("sdpa"))


def slow_autos(rows: list[dict]) -> list[str]:
    """Cells where auto's fwd+bwd time is more than AUTO_TOLERANCE over the fastest other backend's."""
    cells: dict[tuple, list[dict]] = {}
    for row in rows:
        cells.setdefault((row["dtype"], row["docs"], row["head_dim"], row["seq_len"]), []).append(row)
    slow = []
    for (dtype, docs, head_dim, seq_len), group in sorted(cells.items()):
        auto = next((r for r in group if r["backend"] == "auto"), None)
        others = [r for r in group if r["backend"] != "auto" and r.get("fwd_bwd_ms") is not None]
        if auto is None or not others or (auto.get("fwd_bwd_ms") is None and auto["status"].startswith("skipped")):
            continue
        where = f"{dtype} {'docs' if docs else 'causal'} D={head_dim} T={seq_len}"
        fastest = min(others, key=lambda r: r["fwd_bwd_ms"])
        if auto.get("fwd_bwd_ms") is None:
            slow.append(f"{where}: auto has no fwd+bwd time: {auto['status']}")
        elif auto["fwd_bwd_ms"] > (1 + AUTO_TOLERANCE) * fastest["fwd_bwd_ms"]:
            slow.append(
                f"{where}: auto {auto['fwd_bwd_ms']:.3f} ms vs {fastest['backend']} {fastest['fwd_bwd_ms']:.3f}"
            )
    return slow


def log_log_slope(points: list[tuple[float, float]]) -> float:
    xs, ys = [math.log(x) for x, _ in points], [math.log(y) for _, y in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def superlinear_memory(rows: list[dict]) -> list[str]:
    """(dtype, masking, backend, head dim) series whose memory per sequence grows faster than T^MAX_SLOPE; auto
    counts once per backend it ran, since the kernels differ in memory."""
    series: dict[tuple, list[dict]] = {}
    for row in rows:
        backend = row["backend"] if row["backend"] != "auto" else f"auto→{row.get('resolved')}"
        series.setdefault((row["dtype"], row["docs"], backend, row["head_dim"]), []).append(row)
    steep = []
    for (dtype, docs, backend, head_dim), group in series.items():
        points = sorted(
            (r["seq_len"], r["peak_mem_mib"] / r["batch_size"])
            for r in group
            if r.get("mem_pass") == "fwd_bwd" and r.get("peak_mem_mib") and r["peak_mem_mib"] > 0
        )
        if any(keeps_scores(r) for r in group) or len(points) < 2:
            continue
        if (slope := log_log_slope(points)) > MAX_SLOPE:
            steep.append(f"{dtype} {'docs' if docs else 'causal'} {backend} D={head_dim}: memory ~ T^{slope:.2f}")
    return steep


def wrong_forwards(rows: list[dict]) -> list[str]:
    """Backends whose forward is off the float32 reference by more than MAX_REL_ERR (or not finite) in a cell."""
    wrong = []
    for row in rows:
        ran = row.get("fwd_status") == "ok" or "non-finite" in row.get("status", "")
        error = row.get("rel_err")
        if ran and row["backend"] != "auto" and (error is None or not math.isfinite(error) or error > MAX_REL_ERR):
            wrong.append(f"{row['dtype']} {row['backend']} D={row['head_dim']} T={row['seq_len']}: error {error}")
    return wrong


def load(path) -> list[dict]:
    return json.loads(path.read_text())["rows"]


@pytest.mark.parametrize("path", ATTENTION, ids=[p.name for p in ATTENTION])
def test_auto_is_within_5_percent_of_the_fastest_backend(path):
    assert not slow_autos(load(path)), "\n".join(slow_autos(load(path)))


@pytest.mark.parametrize("path", ATTENTION, ids=[p.name for p in ATTENTION])
def test_attention_memory_grows_linearly_in_t_where_no_scores_are_kept(path):
    assert not superlinear_memory(load(path)), "\n".join(superlinear_memory(load(path)))


@pytest.mark.parametrize("path", ATTENTION, ids=[p.name for p in ATTENTION])
def test_every_forward_agrees_with_float32(path):
    assert not wrong_forwards(load(path)), "\n".join(wrong_forwards(load(path)))


def made_up(auto_slowdown: float = 1.0, flex_memory_power: float = 1.0, flex_error: float = 2e-3) -> list[dict]:
    """Times ~ T at equal tokens per call; memory per sequence ~ T (flex: T^power, manual: T^2)."""
    rows = []
    for seq_len in (1024, 2048, 4096, 8192):
        batch = 16384 // seq_len
        for backend, factor in {"sdpa:auto": 1.0, "flex_attention": 1.3, "manual": 10.0, "auto": auto_slowdown}.items():
            power = {"manual": 2.0, "flex_attention": flex_memory_power}.get(backend, 1.0)
            rows.append(
                {"backend": backend, "resolved": "sdpa:auto" if backend == "auto" else backend, "head_dim": 64,
                 "seq_len": seq_len, "batch_size": batch, "docs": False, "dtype": "bfloat16", "status": "ok",
                 "fwd_status": "ok", "rel_err": flex_error if backend == "flex_attention" else 2e-3,
                 "fwd_bwd_ms": factor * seq_len / 1024, "mem_pass": "fwd_bwd",
                 "peak_mem_mib": batch * (seq_len / 1024) ** power}
            )  # fmt: skip
    return rows


def test_the_checks_pass_good_results_and_catch_each_broken_target():
    assert slow_autos(made_up(1.03)) == superlinear_memory(made_up()) == wrong_forwards(made_up()) == []
    assert len(slow_autos(made_up(auto_slowdown=1.10))) == 4
    assert [line.split(":")[0] for line in superlinear_memory(made_up(flex_memory_power=2.0))] == [
        "bfloat16 causal flex_attention D=64"
    ]
    assert len(wrong_forwards(made_up(flex_error=0.3))) == 4
    # auto that runs a lean kernel at short T and another at long T is two linear series, not one steep one
    switching = made_up()
    for row in switching:
        if row["backend"] == "auto" and row["seq_len"] <= 2048:
            row["resolved"], row["peak_mem_mib"] = "flex_attention", row["peak_mem_mib"] / 8
    assert superlinear_memory(switching) == []


def generated_tables() -> list[tuple[str, str, list[str]]]:
    """(marker name, the table between its markers in bench/README.md, the results files its Source line names)."""
    text = (REPO / "bench" / "README.md").read_text()
    tables = []
    for name in ("attention", "attention-docs", "train"):
        found = re.search(rf"^<!-- bench:{name}:start -->\n(.*?)\n<!-- bench:{name}:end -->$", text, re.S | re.M)
        if found:
            source = next(line for line in found.group(1).splitlines() if line.startswith("Source:"))
            tables.append((name, found.group(1), re.findall(r"`(bench/results/[^`]+\.json)`", source)))
    return tables


def test_the_tables_in_bench_readme_are_what_their_results_files_give():
    tables = generated_tables()
    assert [name for name, _, _ in tables] == ["attention", "attention-docs", "train"]
    for name, table, sources in tables:
        loaded = [json.loads((REPO / source).read_text()) for source in sources]
        if name == "train":
            expected = readme_table.train_table(loaded, sources)
        else:
            expected = readme_table.backend_table(loaded[0], docs=name == "attention-docs", source=sources[0])
        assert table == expected, f"bench/README.md's {name} table: python -m bench.readme_table writes it anew"
