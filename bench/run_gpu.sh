#!/usr/bin/env bash
# Everything this repo measures on a GPU, in one command (the lent H100 has no network and no flash-attn:
# carry the wheel in .whl/, see ../shared/GPU.md). Results go to $OUT (default bench/results).
#   bash bench/run_gpu.sh check      # python model.py, GPU tests, a short train run per backend
#   bash bench/run_gpu.sh attention  # bench_attention (causal, then document masks)
#   bash bench/run_gpu.sh train      # bench_train (GPT-2 124M; long context)
#   bash bench/run_gpu.sh all
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ls .whl/flash_attn-*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/fa .whl/flash_attn-*.whl && export PYTHONPATH=/tmp/fa:${PYTHONPATH:-}
fi
stage=${1:-all}

if [[ $stage == check || $stage == all ]]; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python3 model.py
    python3 -m pytest -m gpu -q -p no:cacheprovider tests/ 2>&1 | tail -25
    python3 -m data.shakespeare_char.prepare --input README.md --out_dir /tmp/smoke_data >/dev/null
    for backend in auto sdpa flash_attn_2 flash_attn_3 flex_attention manual; do
        echo "== train.py --attention_backend=$backend"
        python3 train.py --data_dir=/tmp/smoke_data --out_dir=/tmp/smoke_$backend --attention_backend=$backend \
            --max_iters=30 --log_interval=10 --eval_interval=30 --eval_iters=2 --block_size=64 2>&1 \
            | grep -E "^(iter|eval|WARNING|INFO|error)" | tail -4
    done
fi
if [[ $stage == attention || $stage == all ]]; then
    python3 bench/bench_attention.py --out "$OUT" --budget "${ATTN_BUDGET:-200}"
    python3 bench/bench_attention.py --docs-only --out "$OUT" --budget "${DOCS_BUDGET:-120}" --head-dims 64 128 \
        --seq-lens 1024 4096 16384
    python3 bench/readme_table.py "$OUT"/*-attention.json --check --readme /dev/null || true
fi
if [[ $stage == train || $stage == all ]]; then
    python3 bench/bench_train.py --out "$OUT" --budget "${TRAIN_BUDGET:-200}"
fi
