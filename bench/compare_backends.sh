#!/usr/bin/env bash
# Run train.py once per attention backend and tabulate the last log line of each run (bench/compare_backends.py).
#
#   bench/compare_backends.sh config/train_gpt2.py --batch_size=16        # arguments go to every train.py run
#   BACKENDS="auto sdpa flex_attention" bench/compare_backends.sh ...     # choose the backends
#
# Each run: python train.py --max_iters=100 --log_interval=25 (no evaluation until the end, checkpoints in a
# temporary folder that is removed) "$@" --attention_backend=X. Your arguments come after these defaults, so
# they win (e.g. --max_iters=200). The last log line covers the last 25 steps, so compile time is left out.
# Prints a markdown table and writes $OUT_DIR/<card>-compare_backends.{md,json} (default bench/results); logs
# stay in a temporary folder named at the end. KEEP_ROWS=1 keeps the rows of other backends from that card's
# earlier file (to re-run one backend, or to split the backends over several runs on the same card). PYTHON
# picks the interpreter.
set -uo pipefail
cd "$(dirname "$0")/.."

BACKENDS=${BACKENDS:-"auto sdpa flash_attn_2 flex_attention manual"}
keep_rows=$([ "${KEEP_ROWS:-}" = 1 ] && echo --keep-rows)
# shellcheck disable=SC2086  # BACKENDS: a list of names; keep_rows: one flag or none
exec "${PYTHON:-python3}" -m bench.compare_backends --out "${OUT_DIR:-bench/results}" --backends $BACKENDS \
    $keep_rows --command "BACKENDS=\"$BACKENDS\" bench/compare_backends.sh $*" -- "$@"
