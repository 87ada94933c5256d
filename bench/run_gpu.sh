#!/usr/bin/env bash
# Everything this repo measures on a GPU, stage by stage (the lent H100 has no network and no flash-attn:
# carry the wheel in .whl/, see ../shared/GPU.md). Results go to $OUT (default bench/results).
#   bash bench/run_gpu.sh tests attention     # python model.py + GPU tests; attention benches
#   bash bench/run_gpu.sh smoke train         # a short train.py run per backend; train-step bench
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ls .whl/flash_attn-*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/fa .whl/flash_attn-*.whl && export PYTHONPATH=/tmp/fa:${PYTHONPATH:-}
fi

for stage in "$@"; do
    echo "===== $stage"
    case $stage in
    tests)
        nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
        python3 model.py
        python3 -m pytest -m gpu -q -p no:cacheprovider tests/ 2>&1 | tail -8
        ;;
    smoke)  # every backend name trains a few steps on this GPU (tiny data made from the README)
        python3 -m data.shakespeare_char.prepare --input README.md --out_dir /tmp/smoke_data >/dev/null
        for backend in ${SMOKE_BACKENDS:-auto sdpa flash_attn_2 flash_attn_3 flex_attention manual eager flex}; do
            echo "== train.py --attention_backend=$backend"
            python3 train.py --data_dir=/tmp/smoke_data --out_dir=/tmp/smoke_$backend --attention_backend=$backend \
                --max_iters=20 --log_interval=10 --eval_interval=20 --eval_iters=2 --block_size=64 2>&1 \
                | grep -E "^(iter|eval|WARNING|INFO|error)" | tail -3
        done
        ;;
    attention)
        python3 bench/bench_attention.py --out "$OUT" --budget "${ATTN_BUDGET:-200}" | tail -3
        python3 bench/bench_attention.py --docs-only --out "$OUT" --budget "${DOCS_BUDGET:-100}" \
            --seq-lens 1024 4096 16384 | tail -3
        python3 bench/readme_table.py "$OUT"/*-attention.json --check --readme /dev/null
        ;;
    train)  # the most wanted rows first: auto/flash_attn_2 at T=1024 and at T=32768, then the others
        python3 bench/bench_train.py --out "$OUT" --backends auto flash_attn_2 --batch-sizes 16 \
            --long-seq-lens 32768 --budget "${TRAIN_BUDGET:-200}" | tail -12
        python3 bench/bench_train.py --out "$OUT" --name train-more --backends sdpa flex_attention manual \
            --batch-sizes 16 32 --long-seq-lens 32768 --budget "${TRAIN_MORE_BUDGET:-150}" | tail -12
        ;;
    *) echo "unknown stage $stage; stages: tests smoke attention train"; exit 2 ;;
    esac
done
