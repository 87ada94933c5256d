"""The GPU end-to-end suite's results table: one row per test of tests/gpu (its cell id, status, seconds and
figure), written to <--e2e-results>/<card>-<--e2e-name>.json and .md (default bench/results/<card>-e2e.*) once
at least one of them ran (not all skipped).

A plugin that tests/conftest.py loads, not tests/gpu/conftest.py: under pytest-xdist only the controller sees
every worker's reports, and it loads the conftest files of the test folders only when named on its command line.
A cell's test adds its figure with record_property("figure", value) and ("unit", "val loss"), and its own
seconds with ("seconds", s) where the test's time holds more than the cell's.
"""

from __future__ import annotations

import json
import shlex
import sys
import time
from pathlib import Path

SUITE = "tests/gpu/"
DEFAULT_RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"


def pytest_addoption(parser):
    parser.addoption(
        "--e2e-results",
        default=str(DEFAULT_RESULTS),
        metavar="DIR",
        help="folder of the GPU end-to-end table, <card>-<name>.json and .md (default bench/results)",
    )
    parser.addoption("--e2e-name", default="e2e", help="the table's name after the card's (default e2e)")


def pytest_configure(config):
    if not hasattr(config, "workerinput"):  # an xdist worker sends its reports to the controller, which writes
        table = ResultsTable(Path(config.getoption("e2e_results")), config.getoption("e2e_name"))
        config.pluginmanager.register(table, "e2e-results-table")


def skip_reason(report) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, (tuple, list)) and len(longrepr) == 3:  # (file, line, "Skipped: why")
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


def failure_reason(report) -> str:
    """The failure's first line (an assertion's status line, an exception's message), with where it happened."""
    crash = getattr(report.longrepr, "reprcrash", None)
    message = crash.message if crash is not None else str(report.longrepr).strip().splitlines()[-1]
    where = "" if report.when == "call" else f"{report.when}: "
    return where + (message.splitlines() or [""])[0][:300]


def cell_id(nodeid: str) -> str:
    """tests/gpu/test_e2e.py::test_train[sdpa-plain-compiled] -> test_e2e.py::test_train[sdpa-plain-compiled]"""
    return nodeid.removeprefix(SUITE)


def add_report(rows: dict[str, dict], report) -> None:
    """Fold one phase's report (setup, call, teardown) of a tests/gpu test into its row."""
    if not report.nodeid.startswith(SUITE):
        return
    row = rows.setdefault(report.nodeid, {"cell": cell_id(report.nodeid), "status": "ok", "reason": "", "seconds": 0.0})
    properties = dict(report.user_properties)
    row["seconds"] = round(properties.get("seconds", row["seconds"] + report.duration), 1)
    if "figure" in properties:
        row["figure"], row["unit"] = properties["figure"], properties.get("unit", "")
    if report.failed and row["status"] != "failed":
        row["status"], row["reason"] = "failed", failure_reason(report)
    elif report.skipped and row["status"] == "ok":
        row["status"], row["reason"] = "skipped", skip_reason(report)


def summary(rows: list[dict], card: str, device_name: str, gpus: int, torch_version: str, seconds: float) -> dict:
    counts = {status: sum(row["status"] == status for row in rows) for status in ("ok", "failed", "skipped")}
    command = "python -m pytest " + shlex.join(sys.argv[1:])
    header = {"card": card, "device_name": device_name, "gpus": gpus, "torch": torch_version, "seconds": seconds}
    return {**header, **counts, "command": command, "rows": rows}


def markdown(table: dict) -> str:
    lines = [f"# GPU end-to-end tests on {table['device_name']} (torch {table['torch']}, {table['gpus']} GPU(s))", ""]
    lines += [f"{table['ok']} ok, {table['failed']} failed, {table['skipped']} skipped, {table['seconds']} s.", ""]
    lines += [f"`{table['command']}`", "", "| cell | status | figure | seconds |", "|---|---|---:|---:|"]
    for row in table["rows"]:
        figure = row.get("figure")
        shown = "" if figure is None else f"{figure:,.3f}" if abs(figure) < 100 else f"{figure:,.0f}"
        shown = f"{shown} {row.get('unit', '')}".strip()
        status = row["status"] + (f": {row['reason']}" if row["reason"] else "")
        cells = [row["cell"], status, shown, f"{row['seconds']:.0f}"]
        lines.append("| " + " | ".join(cell.replace("|", "/") for cell in cells) + " |")
    return "\n".join(lines) + "\n"


def write_table(table: dict, out_dir: Path, name: str = "e2e") -> Path:
    """<card>-<name>.json and .md under out_dir; the JSON's path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{table['card']}-{name}.json"
    path.write_text(json.dumps(table, indent=1) + "\n")
    path.with_suffix(".md").write_text(markdown(table))
    return path


class ResultsTable:
    def __init__(self, out_dir: Path, name: str = "e2e"):
        self.out_dir, self.name, self.rows, self.started = out_dir, name, {}, time.perf_counter()
        self.written: Path | None = None

    def pytest_runtest_logreport(self, report):
        add_report(self.rows, report)
        if report.when == "teardown":  # the table as it stands after each test: a run cut off keeps its rows
            self.write()

    def pytest_sessionfinish(self):
        self.write()

    def write(self):
        rows = sorted(self.rows.values(), key=lambda row: row["cell"])  # tests run in random order
        if all(row["status"] == "skipped" for row in rows):  # none ran (also: no tests/gpu test was selected)
            return
        import torch

        from bench.report import card_slug

        gpus = torch.cuda.device_count()
        device_name = torch.cuda.get_device_name() if gpus else "cpu"
        seconds = round(time.perf_counter() - self.started, 1)
        table = summary(rows, card_slug(), device_name, gpus, torch.__version__, seconds)
        self.written = write_table(table, self.out_dir, self.name)

    def pytest_terminal_summary(self, terminalreporter):
        if self.written is not None:
            terminalreporter.write_line(
                f"GPU end-to-end table: {self.written} and {self.written.with_suffix('.md').name}"
            )
