"""`python -m bench.readme_table`: bench/README.md's tables, written between their markers from results files."""

from __future__ import annotations

from errors import as_command

if __name__ == "__main__":  # before torch's seconds of importing: see as_command
    as_command()

import json
import os
import re
import sys
from pathlib import Path

from data.common import OneLineParser

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_RESULTS = REPO_ROOT / "bench" / "results" / "h100-attention.json"
DEFAULT_README = REPO_ROOT / "bench" / "README.md"
README_SEQ_LENS = (1024, 4096, 16384)


def markers(docs: bool = False, train: bool = False) -> tuple[str, str]:
    """The markers of the causal table, the document-masked one, or the train-step one."""
    name = "train" if train else "attention-docs" if docs else "attention"
    return f"<!-- bench:{name}:start -->", f"<!-- bench:{name}:end -->"


def short_t(seq_len: int) -> str:
    return f"{seq_len // 1024}k" if seq_len % 1024 == 0 else str(seq_len)


def cell_text(row: dict | None, key: str) -> str:
    """The number, or why there is none: OOM, skipped (budget), n/a (cannot run here: reason in the file)."""
    if row is None:
        return "–"
    value = row.get(key)
    if value is not None:
        return f"{value:,.0f}" if abs(value) >= 10 else f"{value:.2g}"
    status = row.get("fwd_bwd_status") or row.get("status", "")
    return "OOM" if "OOM" in status else "skipped" if status.startswith("skipped") else "n/a"


def backend_label(rows: list[dict], backend: str) -> str:
    if backend != "auto":
        return backend
    picks = sorted({r["resolved"] for r in rows if r["backend"] == "auto" and r.get("resolved")})
    return f"auto (→ {', '.join(picks)})" if picks else "auto"


def backend_table(results: dict, docs: bool = False, source: str | None = None) -> str:
    """Rows = backends; columns = fwd+bwd TF/s at a few seq lens per head dim, then memory at the longest
    seq len every head dim has; the results file and its card named under the table."""
    dtype = results["header"].get("grid", {}).get("dtype") or results["rows"][0]["dtype"]
    rows = [r for r in results["rows"] if r["docs"] == docs and r["dtype"] == dtype]
    if not rows:
        return f"(no {dtype} rows with docs={docs} in the results)"
    index = {(r["backend"], r["head_dim"], r["seq_len"]): r for r in rows}
    backends = list(dict.fromkeys(r["backend"] for r in rows))
    head_dims = sorted({r["head_dim"] for r in rows})
    present = sorted({r["seq_len"] for r in rows})
    shown = [t for t in README_SEQ_LENS if t in present] or present[:4]
    complete = [t for t in present if all((b, d, t) in index for b in backends for d in head_dims)]
    longest = max(complete, default=present[-1])
    titles = [f"D={d} T={short_t(t)}" for d in head_dims for t in shown]
    titles += [f"mem D={d} T={short_t(longest)} (MiB)" for d in head_dims]
    lines = ["| backend | " + " | ".join(titles) + " |", "|---|" + "---:|" * len(titles)]
    for backend in backends:
        cells = [cell_text(index.get((backend, d, t)), "fwd_bwd_tflops") for d in head_dims for t in shown]
        cells += [cell_text(index.get((backend, d, longest)), "peak_mem_mib") for d in head_dims]
        lines.append(f"| {backend_label(rows, backend)} | " + " | ".join(cells) + " |")
    header = results["header"]
    grid = header.get("grid", {})
    masking = "causal, document masks" if docs else "causal"
    lines += [
        "",
        f"fwd+bwd TF/s ({masking}, {dtype}, B·T = {grid.get('tokens_per_call', '?')} tokens, "
        f"H = {grid.get('heads', '?')}; FLOPs: fwd = 2·B·H·T²·D, fwd+bwd = 3.5 × fwd); mem = the "
        f"attention's own peak memory in one fwd+bwd. OOM: out of memory; n/a: cannot run here; "
        f"the reasons are in the results file.",
        f"Source: `{source or 'results file'}` ({header.get('device_name')}, torch {header.get('torch')}, "
        f"{header.get('date', '')[:10]}).",
    ]
    return "\n".join(lines)


def train_table(results_list: list[dict], sources: list[str]) -> str:
    """The measured rows of bench.train_step results (one or more files of the same card)."""
    lines = ["| backend | T | batch | ms/iter | tokens/s | MFU | peak memory |", "|---|---:|---:|---:|---:|---:|---:|"]
    for results in results_list:
        for r in results["rows"]:
            if r.get("ms_per_iter") is None:
                continue
            name = f"auto (→ {r['resolved']})" if r["backend"] == "auto" else r["backend"]
            mfu = f"{r['mfu']:.1%}" if r.get("mfu") is not None else "n/a"
            mem = f"{r['peak_mem_mib'] / 1024:.1f} GiB" if r.get("peak_mem_mib") is not None else "n/a"
            speed = f"{r['ms_per_iter']:.1f} | {r['tokens_per_sec']:,.0f}"
            lines.append(f"| {name} | {r['seq_len']} | {r['batch_size']} | {speed} | {mfu} | {mem} |")
    header = results_list[0]["header"]
    files = ", ".join(f"`{s}`" for s in sources)
    lines += [
        "",
        f"Source: {files} ({header.get('device_name')}, torch {header.get('torch')}, {header.get('date', '')[:10]}).",
    ]
    return "\n".join(lines)


def update_readme(readme: Path, table: str, docs: bool = False, train: bool = False) -> bool:
    """Replace what is between the markers, each a line of its own (a marker quoted in a sentence is not
    one); False (and the file untouched) when there are no markers."""
    start, end = (re.escape(marker) for marker in markers(docs, train))
    text = readme.read_text() if readme.is_file() else ""
    new, found = re.subn(f"(?ms)^({start})$.*?^({end})$", lambda m: f"{m[1]}\n{table}\n{m[2]}", text, count=1)
    if found:
        readme.write_text(new)
    return bool(found)


def main(argv=None) -> int:
    parser = OneLineParser(prog="python -m bench.readme_table", description=__doc__)
    parser.add_argument("results", nargs="*", type=Path, default=[DEFAULT_RESULTS], help="results JSON files")
    parser.add_argument("--docs", action="store_true", help="the document-masked table")
    parser.add_argument("--train", action="store_true", help="the train-step table, of bench.train_step files")
    args = parser.parse_args(argv)
    missing = [str(path) for path in args.results if not path.is_file()]
    if missing:
        print(f"error: no results file {', '.join(missing)}; run the bench first", file=sys.stderr)
        return 2
    loaded = [json.loads(path.read_text()) for path in args.results]
    sources = [os.path.relpath(path.resolve(), REPO_ROOT) for path in args.results]
    table = train_table(loaded, sources) if args.train else backend_table(loaded[0], docs=args.docs, source=sources[0])
    print(table)
    if not update_readme(DEFAULT_README, table, args.docs, args.train):
        print(f"({DEFAULT_README} has no {markers(args.docs, args.train)[0]} markers: printed only)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
