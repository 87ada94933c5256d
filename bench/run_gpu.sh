#!/usr/bin/env bash
# The GPU stages behind README.md's figures and the GPU tests; results go to $OUT (default bench/results).
#   bash bench/run_gpu.sh tests e2e twonodes      # python -m kernels + the GPU tests; tests/gpu; the two-node check
#   bash bench/run_gpu.sh scan attention float16  # fit auto's flash-attn-4 lengths; the attention grids
#   bash bench/run_gpu.sh train generate ddp      # the train-step grid; generation; 1, 2, 4 GPUs (DDP, FSDP)
# Every other measurement in bench/results is one command, written in bench/results/README.md.
#
# Flash packages for a GPU machine without network, copied into the repo (bench/README.md says more):
# - .whl/flash_attn-*.whl: a flash-attn 2 wheel for that machine, installed into /tmp/fa at each run;
# - .stage*/ (made by bench/pack_gpu_packages.sh): parts of one xz tarball of a site folder, copied to /tmp/stage
#   as they arrive; once SHA256SUMS matches the joined parts, unpacked to /tmp/site and put on PYTHONPATH.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ls .whl/flash_attn-*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/fa .whl/flash_attn-*.whl && export PYTHONPATH=/tmp/fa:${PYTHONPATH:-}
fi
mkdir -p /tmp/stage && cp .stage*/* /tmp/stage/ 2>/dev/null  # the parts that have arrived
if [ -f /tmp/stage/SHA256SUMS ] && [ ! -d /tmp/site ]; then
    if (cd /tmp/stage && cat site.tar.xz.part-* > site.tar.xz && sha256sum -c --quiet SHA256SUMS); then
        mkdir -p /tmp/site.new && tar xJf /tmp/stage/site.tar.xz -C /tmp/site.new && mv /tmp/site.new /tmp/site
        rm -f /tmp/stage/site.tar.xz
    else
        echo "staged packages: $(ls /tmp/stage | tr '\n' ' ')- not complete yet"
    fi
fi
# dsl_packages: what nvidia-cutlass-dsl's .pth would add in a real site folder
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:${PYTHONPATH:-}
# flash-attn-4 compiles its kernels on first use; keep them for the next process of this machine
export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=/tmp/fa4-kernels

gpu_tests() {  # python3 -m pytest -m gpu ARGS with $1 workers where pytest-xdist is installed, else one at a time
    local workers=$1 && shift
    if python3 -c "import xdist" 2>/dev/null; then set -- -n "$workers" "$@"; else set -- -o "addopts=-ra --strict-markers" "$@"; fi
    python3 -m pytest -m gpu -q -p no:cacheprovider "$@"
}

for stage in "$@"; do
    echo "===== $stage"
    case $stage in
    tests)
        nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
        python3 -m kernels
        # the whole log (tracebacks included) to $OUT, its end here
        python3 -m pytest -m gpu -q -p no:cacheprovider ${PYTEST_K:+-k "$PYTEST_K"} --ignore=tests/gpu tests/ 2>&1 \
            | tee "$OUT/gpu-tests.log" | tail -12  # tests/gpu: the e2e and twonodes stages
        ;;
    e2e)  # the end-to-end tests (tests/gpu) with the flash packages set up above, E2E_JOBS cells at a time; E2E_ONLY:
        # the cells a pytest -k expression picks (e.g. "train and flex"), named E2E_NAME; $OUT/<card>-e2e.{json,md}
        gpu_tests "${E2E_JOBS:-8}" tests/gpu --e2e-results "$OUT" --e2e-name "${E2E_NAME:-e2e}" ${E2E_ONLY:+-k "$E2E_ONLY"} \
            2>&1 | tee /tmp/gpu-e2e.log | tail -80
        ;;
    scan)  # sdpa against flash-attn-4, causal: bench/attention_fit.py writes the lengths auto uses to config/attention_auto.json
        python3 -m bench.attention --backends sdpa:auto flash_attn_4 --seq-lens 512 1024 2048 4096 8192 --rounds 1 \
            --rep-ms 30 --name attention-scan --out "$OUT" --budget 60 | tail -3
        python3 -m bench.attention fit "$OUT"/*-attention-scan.json --write
        ;;
    attention)
        python3 -m bench.attention --out "$OUT" --budget "${ATTN_BUDGET:-300}" --rep-ms "${REP_MS:-100}" | tail -3
        python3 -m bench.attention --docs-only --out "$OUT" --budget "${DOCS_BUDGET:-150}" --rep-ms "${REP_MS:-100}" \
            --seq-lens ${DOCS_SEQ_LENS:-1024 4096 16384 8192} | tail -3
        python3 -m pytest -q -o "addopts=-ra" tests/unit/test_readme_table.py | tail -3  # the targets, on bench/results
        ;;
    float16)
        python3 -m bench.attention --dtype float16 --out "$OUT" --budget "${FP16_BUDGET:-200}" --rep-ms "${REP_MS:-100}" | tail -3
        python3 -m pytest -q -o "addopts=-ra" tests/unit/test_readme_table.py | tail -3  # the targets, on bench/results
        ;;
    train)  # GPT-2 124M: every backend at T=1024 batch 16 and T=32768 batch 1, then batch 32 and 8
        python3 -m bench.train_step --out "$OUT" --name "${TRAIN_NAME:-train}" \
            --backends ${TRAIN_BACKENDS:-auto sdpa flash_attn_2 flash_attn_4 flex_attention manual} \
            --batch-sizes ${TRAIN_BATCH_SIZES:-16 32 8} --long-seq-lens 32768 --budget "${TRAIN_BUDGET:-300}" | tail -22
        ;;
    generate)  # GPT-2 124M shapes: batch 1 and 32, prompt 128 and 2048, 256 new tokens, per backend and KV cache
        python3 -m bench.generation --out "$OUT" --name "${GEN_NAME:-generate}" --budget "${GEN_BUDGET:-480}" \
            ${GEN_BACKENDS:+--backends $GEN_BACKENDS} | tail -40
        ;;
    ddp)  # the same global batch on 1 2 4 GPUs (GPT-2 124M, DDP), GPT-2 XL under FSDP, the largest GPT that trains
        NCCL_NVLS_ENABLE=0 python3 -m bench.multi_gpu --out "$OUT" --gpus ${DDP_GPUS:-1 2 4} ${DDP_FLAGS:---fsdp --largest} | tail -24
        ;;
    twonodes)  # the two-node launch on one host: 2 torchrun agents x half the GPUs (2 or 1) against one launch
        gpu_tests 0 tests/gpu/test_two_nodes.py --e2e-results "$OUT" --e2e-name two-nodes | tail -6
        ;;
    *) echo "unknown stage $stage; stages: tests e2e twonodes scan attention float16 train generate ddp"; exit 2 ;;
    esac
done
