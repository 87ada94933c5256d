"""tests/gpu's results table (gpu/results_table.py): the rows it builds from pytest's reports, and the files it
writes, on reports made up here (the cells themselves need a GPU)."""

from __future__ import annotations

import json
import types

import pytest
from gpu import results_table
from gpu.results_table import ResultsTable, cell_id

TRAIN = "tests/gpu/test_e2e.py::test_train[sdpa-plain-compiled]"
DDP = "tests/gpu/test_e2e.py::test_torchrun_2_gpus[ddp]"
SAMPLE = "tests/gpu/test_e2e.py::test_sample[none-eager-inside-batch1]"
LORA = "tests/gpu/test_e2e.py::test_lora_sample"
TWO_NODES = "tests/gpu/test_two_nodes.py::test_two_agents_train_as_one_launch"


def made_up(nodeid: str, when: str, outcome: str, longrepr=None, properties=(), duration=1.0) -> pytest.TestReport:
    location = (nodeid.split("::")[0], 1, nodeid.split("::")[1])
    return pytest.TestReport(
        nodeid, location, {}, outcome, longrepr, when, user_properties=properties, duration=duration
    )


def a_run() -> list[pytest.TestReport]:
    """One cell passed with its figure, one skipped for want of GPUs, one failed, one errored in its setup, and a
    test outside tests/gpu. A test's properties are in the reports of its call and teardown, as pytest makes them."""
    recorded = [("seconds", 12.3), ("figure", 2.01), ("unit", "val loss")]
    two_nodes = [("figure", 0.003), ("unit", "max |loss - one launch's|")]
    return [
        made_up(TRAIN, "setup", "passed", duration=0.5),
        made_up(TRAIN, "call", "passed", properties=recorded),
        made_up(TRAIN, "teardown", "passed", properties=recorded),
        made_up(
            DDP, "setup", "skipped", ("tests/gpu/test_e2e.py", 300, "Skipped: needs 2 CUDA GPUs (this machine has 1)")
        ),
        made_up(DDP, "teardown", "passed"),
        made_up(SAMPLE, "setup", "passed"),
        made_up(SAMPLE, "call", "failed", "E   AssertionError: no decode line\nassert 'no decode line' == 'ok'"),
        made_up(SAMPLE, "teardown", "passed"),
        made_up(LORA, "setup", "failed", "Failed: needs lora train, which did not pass: exit 1: error: boom"),
        made_up(TWO_NODES, "call", "passed", properties=two_nodes, duration=40.0),
        made_up("tests/unit/test_model.py::test_forward", "call", "passed"),
    ]


def test_each_gpu_test_is_one_row_with_its_status_reason_seconds_and_figure():
    rows = {}
    for report in a_run():
        results_table.add_report(rows, report)
    assert list(rows.values()) == [
        {"cell": "test_e2e.py::test_train[sdpa-plain-compiled]", "status": "ok", "reason": "", "seconds": 12.3,
         "figure": 2.01, "unit": "val loss"},
        {"cell": "test_e2e.py::test_torchrun_2_gpus[ddp]", "status": "skipped", "reason":
         "needs 2 CUDA GPUs (this machine has 1)", "seconds": 2.0},
        {"cell": "test_e2e.py::test_sample[none-eager-inside-batch1]", "status": "failed", "reason":
         "assert 'no decode line' == 'ok'", "seconds": 3.0},
        {"cell": "test_e2e.py::test_lora_sample", "status": "failed", "reason":
         "setup: Failed: needs lora train, which did not pass: exit 1: error: boom", "seconds": 1.0},
        {"cell": "test_two_nodes.py::test_two_agents_train_as_one_launch", "status": "ok", "reason": "",
         "seconds": 40.0, "figure": 0.003, "unit": "max |loss - one launch's|"},
    ]  # fmt: skip


def finish(table: ResultsTable, reports) -> list[str]:
    """Feed the reports to the plugin as pytest does, end the session; the lines it adds to the terminal summary."""
    lines = []
    for report in reports:
        table.pytest_runtest_logreport(report)
    table.pytest_sessionfinish()
    table.pytest_terminal_summary(types.SimpleNamespace(write_line=lines.append))
    return lines


def test_a_run_writes_the_json_and_markdown_table_named_after_the_card(tmp_path):
    lines = finish(ResultsTable(tmp_path), a_run())
    written = json.loads((tmp_path / "cpu-e2e.json").read_text())  # no GPU here: the card is `cpu`
    assert (written["card"], written["ok"], written["failed"], written["skipped"]) == ("cpu", 2, 2, 1)
    assert [row["cell"] for row in written["rows"]] == sorted(row["cell"] for row in written["rows"])
    assert written["command"].startswith("python -m pytest") and written["torch"] and written["seconds"] >= 0
    table = (tmp_path / "cpu-e2e.md").read_text()
    assert "| test_e2e.py::test_train[sdpa-plain-compiled] | ok | 2.010 val loss | 12 |" in table
    assert (
        "| test_e2e.py::test_torchrun_2_gpus[ddp] | skipped: needs 2 CUDA GPUs (this machine has 1) |  | 2 |" in table
    )
    assert "| 0.003 max /loss - one launch's/ | 40 |" in table  # a | would end the cell
    assert "2 ok, 2 failed, 1 skipped" in table and lines == [
        f"GPU end-to-end table: {tmp_path / 'cpu-e2e.json'} and cpu-e2e.md"
    ]


def test_a_run_where_every_gpu_test_skipped_writes_nothing(tmp_path):
    skipped = [report for report in a_run() if report.nodeid in (DDP,) or not report.nodeid.startswith("tests/gpu/")]
    assert finish(ResultsTable(tmp_path / "results"), skipped) == []
    assert finish(ResultsTable(tmp_path / "results"), []) == []
    assert not (tmp_path / "results").exists()


def test_a_run_cut_off_before_its_end_keeps_the_rows_of_the_tests_that_finished(tmp_path):
    """The table is rewritten after each test's teardown, so a run killed by a time limit (no session finish)
    leaves the rows it had."""
    table, reports = ResultsTable(tmp_path), a_run()
    for report in reports:
        table.pytest_runtest_logreport(report)
    finished = {report.nodeid for report in reports if report.when == "teardown"}
    written = json.loads((tmp_path / "cpu-e2e.json").read_text())
    assert finished and len(written["rows"]) == len({cell_id(nodeid) for nodeid in finished})
