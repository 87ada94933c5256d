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
# (to re-run one backend, or to split the backends over several runs on the same card).
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

# the table and its files: bench/report.py's tabulate_compare_logs
"$PYTHON" -c '
import os, sys
from bench.report import tabulate_compare_logs
paths = tabulate_compare_logs(sys.argv[1], sys.argv[2], sys.argv[3:], os.environ["COMPARE_COMMAND"],
                              keep_rows=os.environ.get("KEEP_ROWS") == "1")
print(paths[1].read_text())
print("wrote " + ", ".join(map(str, paths)) + "; logs in " + sys.argv[1], file=sys.stderr)
' "$logs" "$OUT" $BACKENDS
