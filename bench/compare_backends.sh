#!/usr/bin/env bash
# Run train.py once per attention backend and tabulate the last log line of each run.
#
#   bench/compare_backends.sh config/train_gpt2.py --batch_size=16        # arguments go to every train.py run
#   BACKENDS="auto sdpa flex_attention" bench/compare_backends.sh ...     # choose the backends
#
# Each run: python train.py --max_iters=100 --log_interval=25 (no evaluation until the end, checkpoints in a
# temporary folder that is removed) "$@" --attention_backend=X. Your arguments come after these defaults, so
# they win (e.g. --max_iters=200). The last log line covers the last 25 steps, so compile time is left out.
# Prints a markdown table and writes bench/results/<card>-compare_backends.{md,json}; logs stay in a temporary
# folder named at the end. KEEP_ROWS=1 keeps the rows of other backends from that card's earlier file
# (to re-run one backend, or to split the backends over two sessions of the same machine).
set -uo pipefail
cd "$(dirname "$0")/.."

BACKENDS=${BACKENDS:-"auto sdpa flash_attn_2 flex_attention manual"}
PYTHON=${PYTHON:-python3}
OUT=${OUT_DIR:-bench/results}
logs=$(mktemp -d "${TMPDIR:-/tmp}/compare_backends.XXXXXX")
export COMPARE_COMMAND="BACKENDS=\"$BACKENDS\" bench/compare_backends.sh $*"

for backend in $BACKENDS; do
    echo "== $backend" >&2
    "$PYTHON" train.py --max_iters=100 --log_interval=25 --eval_interval=1000000 --eval_on_start=false \
        --eval_iters=1 --out_dir="$logs/out-$backend" "$@" --attention_backend="$backend" \
        >"$logs/$backend.log" 2>&1
    echo $? >"$logs/$backend.rc"
    rm -rf "$logs/out-$backend"  # the checkpoint of a 100-step run is not worth keeping
    tail -n 1 "$logs/$backend.log" >&2
done

"$PYTHON" - "$logs" "$OUT" $BACKENDS <<'EOF'
import json
import os
import re
import sys
from pathlib import Path

sys.path.insert(0, ".")
from bench.report import Column, bench_device, parse_log_line, results_header, results_stem, write_results

logs, out, backends = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]
rows = []
for backend in backends:
    text = (logs / f"{backend}.log").read_text(errors="replace")
    rc = int((logs / f"{backend}.rc").read_text())
    parsed = [p for p in map(parse_log_line, text.splitlines()) if p]
    # The first such line is the training resolution (train.py logs it before the loop; evaluation runs
    # without gradients and may resolve to another backend later).
    runs = re.findall(r"attention backend: ([\w:]+)", text)
    row = {"backend": backend, "runs": runs[0] if runs else None, **(parsed[-1] if parsed else {})}
    if rc == 0 and parsed:
        row["status"] = "ok"
    else:
        last = [line for line in text.splitlines() if line.strip()][-1:] or ["(no output)"]
        row["status"] = f"exit {rc}: {last[0][:160]}"
    rows.append(row)
columns = [Column("backend", "backend"), Column("runs", "runs"), Column("iter", "iter"),
           Column("loss", "loss", "{:.4f}"), Column("ms_per_iter", "ms/iter", "{:.1f}"),
           Column("tokens_per_sec", "tok/s", "{:,.0f}"), Column("mfu", "MFU", "{:.1%}"),
           Column("mem_gib", "mem GiB", "{:.1f}"), Column("status", "status")]
header = results_header("compare_backends", bench_device(), command=os.environ["COMPARE_COMMAND"], logs=str(logs),
                        notes={"source": "last log line of `python train.py ... --attention_backend=X` per backend"})
earlier = results_stem(out, "compare_backends", header["card"]).with_suffix(".json")
if os.environ.get("KEEP_ROWS") == "1" and earlier.exists():
    earlier = json.loads(earlier.read_text())
    if earlier["header"]["device_name"] == header["device_name"]:
        rows = [r for r in earlier["rows"] if r["backend"] not in backends] + rows
        header["kept_rows_from"] = {key: earlier["header"][key] for key in ("command", "date", "torch")}
paths = write_results(out, "compare_backends", header, rows, columns)
print(paths[1].read_text())
print(f"wrote {', '.join(map(str, paths))}; logs in {logs}", file=sys.stderr)
EOF
