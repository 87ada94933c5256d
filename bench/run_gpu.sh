#!/usr/bin/env bash
# Everything this repo measures on a GPU, stage by stage. Results go to $OUT (default bench/results). Every bench
# runs as a module from the repo root (python3 -m bench.X).
#   bash bench/run_gpu.sh tests attention     # what this machine runs + GPU tests; attention benches (bf16)
#   bash bench/run_gpu.sh float16 train       # attention bench in fp16; train-step bench
#   bash bench/run_gpu.sh e2e                 # the end-to-end tests (tests/gpu), flash cells included where the packages came
#   bash bench/run_gpu.sh smoke compare       # a short train.py run per backend; train.py per backend, 100 steps
#   bash bench/run_gpu.sh scan attention      # fit auto's flash-attn-4 lengths (sm90) first, then measure them
#   bash bench/run_gpu.sh generate            # generation: prefill and decode tok/s per backend and KV cache
#   bash bench/run_gpu.sh speed profile long curves   # train-step speed: plain vs default, profile, long T, loss
#   bash bench/run_gpu.sh ddp                 # 1, 2, 4 GPUs: DDP scaling, GPT-2 XL under FSDP, the largest model
#   bash bench/run_gpu.sh twonodes            # 2+ GPUs: two torchrun agents (--nnodes=2) against one launch (a test)
#   bash bench/run_gpu.sh phases              # 4 GPUs: one step phase by phase, DDP and FSDP (PHASE_GPUS=2: 2)
#   bash bench/run_gpu.sh context zero fsdpxl # 2+ GPUs: context parallelism; DDP at one micro-step a GPU; GPT-2 XL, FSDP
#   bash bench/run_gpu.sh zerochannels        # 4 GPUs: DDP at one micro-step a GPU, NCCL on 4, 8, 16 channels
#   bash bench/run_gpu.sh zeroprofile         # 4 GPUs: DDP at one micro-step a GPU profiled, plain and compile_blocks
#   bash bench/run_gpu.sh contextcheck        # 2+ GPUs: context parallelism's loss check per chunk kernel, and eager
#   bash bench/run_gpu.sh chunks              # 1 GPU: context parallelism's chunk kernels alone at T=524288
#   bash bench/run_gpu.sh big                 # 4 GPUs: a 6.7B GPT-2 under FSDP
#   bash bench/run_gpu.sh bigresume           # 4 GPUs: the 6.7B config saves, then resumes on 2 GPUs
#
# On a GPU machine without network, the flash packages can come with the repo, in either form:
# - .whl/flash_attn-*.whl: a flash-attn 2 wheel built for that machine's torch, CUDA and Python, installed
#   into /tmp/fa at each run;
# - .stage*/ (e.g. .stage-a/ and .stage-b/, made by bench/pack_gpu_packages.sh): parts of one xz tarball of a
#   site folder with flash-attn 2 and flash-attn-4 with its CuTe DSL libraries. Each run copies the parts it
#   finds to /tmp/stage, so they may arrive in separate runs on the same machine; once SHA256SUMS matches the
#   joined parts, they are unpacked to /tmp/site and put on PYTHONPATH.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ls .whl/flash_attn-*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/fa .whl/flash_attn-*.whl && export PYTHONPATH=/tmp/fa:${PYTHONPATH:-}
fi
if ls .stage*/* >/dev/null 2>&1; then
    mkdir -p /tmp/stage && for part in .stage*/*; do cp "$part" /tmp/stage/; done
fi
if [ -f /tmp/stage/SHA256SUMS ] && [ ! -d /tmp/site ]; then
    if (cd /tmp/stage && cat site.tar.xz.part-* > site.tar.xz && sha256sum -c --quiet SHA256SUMS); then
        mkdir -p /tmp/site.new && tar xJf /tmp/stage/site.tar.xz -C /tmp/site.new && mv /tmp/site.new /tmp/site
        rm -f /tmp/stage/site.tar.xz
    else
        echo "staged packages: $(ls /tmp/stage | tr '\n' ' ')- not complete yet"
    fi
fi
if [ -d /tmp/site ]; then  # dsl_packages: what nvidia-cutlass-dsl's .pth would add in a real site folder
    export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:${PYTHONPATH:-}
fi
# flash-attn-4 compiles its kernels on first use; keep them for the next process of this machine
export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=/tmp/fa4-kernels

gpu_tests() {  # python3 -m pytest -m gpu ARGS with $1 workers where pytest-xdist is installed, else one at a time
    local workers=$1 && shift
    if python3 -c "import xdist" 2>/dev/null; then set -- -n "$workers" "$@"; else set -- -o "addopts=-ra --strict-markers" "$@"; fi
    python3 -m pytest -m gpu -q -p no:cacheprovider "$@"
}

corpus() {  # a text corpus for train.py runs that needs no network: this repo's own sources
    cat ./*.py ./*/*.py ./*.md > /tmp/corpus.txt
    python3 -m data.shakespeare_char.prepare --input /tmp/corpus.txt --out_dir "$1" >/dev/null
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
    smoke)  # every backend name trains a few steps on this GPU (SMOKE_ARGS: extra settings, e.g. the modern block)
        corpus /tmp/smoke_data
        for backend in ${SMOKE_BACKENDS:-auto sdpa flash_attn_2 flash_attn_3 flash_attn_4 flex_attention manual}; do
            echo "== train.py --attention_backend=$backend"
            python3 train.py --data_dir=/tmp/smoke_data --out_dir=/tmp/smoke_$backend --attention_backend=$backend \
                --max_iters=${SMOKE_ITERS:-20} --log_interval=10 --eval_interval=${SMOKE_ITERS:-20} --eval_iters=2 \
                --block_size=64 --overwrite_out_dir=true ${SMOKE_ARGS:-} 2>&1 | grep -E "^(iter|eval|WARNING|INFO|error)" | tail -3
        done
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
        python3 -m bench.attention --dtype float16 --out "$OUT" --budget "${FP16_BUDGET:-200}" --rep-ms "${REP_MS:-100}" \
            --seq-lens ${FP16_SEQ_LENS:-1024 4096 16384 512 2048 8192 32768} | tail -3
        python3 -m pytest -q -o "addopts=-ra" tests/unit/test_readme_table.py | tail -3  # the targets, on bench/results
        ;;
    train)  # GPT-2 124M: every backend at T=1024 batch 16 and T=32768 batch 1, then batch 32 and 8
        python3 -m bench.train_step --out "$OUT" --name "${TRAIN_NAME:-train}" \
            --backends ${TRAIN_BACKENDS:-auto sdpa flash_attn_2 flash_attn_4 flex_attention manual} \
            --batch-sizes ${TRAIN_BATCH_SIZES:-16 32 8} --long-seq-lens 32768 --budget "${TRAIN_BUDGET:-300}" | tail -22
        ;;
    compare)  # train.py's own loop: --max_iters=100 per backend, GPT-2 124M shapes on a char corpus
        corpus /tmp/compare_data
        python3 -m bench.train_step compare --out "$OUT" \
            --backends ${COMPARE_BACKENDS:-auto sdpa flash_attn_2 flash_attn_4 flex_attention manual} \
            -- config/train_gpt2.py --data_dir=/tmp/compare_data --gradient_accumulation_steps=1 --batch_size=16 \
            --vocab_size=50304
        ;;
    generate)  # GPT-2 124M shapes: batch 1 and 32, prompt 128 and 2048, 256 new tokens, per backend and KV cache
        python3 -m bench.generation --out "$OUT" --name "${GEN_NAME:-generate}" --budget "${GEN_BUDGET:-480}" \
            ${GEN_BACKENDS:+--backends $GEN_BACKENDS} | tail -40
        ;;
    speed)  # the plain path (nanoGPT's step) against the default and single switches, one call, ratios in vs_plain
        python3 -m bench.train_step --out "$OUT" --name "${SPEED_NAME:-train-speed}" --budget 0 --long-seq-lens \
            --variants ${SPEED_VARIANTS:-plain default plain-ce} --batch-sizes ${SPEED_BATCH_SIZES:-16 32} | tail -14
        ;;
    profile)  # where the step's time goes, plain and default
        python3 -m bench.train_step profile --out "$OUT" --variants ${PROFILE_VARIANTS:-plain default} | grep -E "^(##|wall|\| [a-z])"
        ;;
    long)  # the longest context GPT-2 124M trains at batch 1
        python3 -m bench.train_step --out "$OUT" --name "${LONG_NAME:-train-long}" --budget 0 --batch-sizes \
            --variants ${LONG_VARIANTS:-default ckpt-mlp} --long-seq-lens ${LONG_SEQ_LENS:-32768 65536 131072} \
            --steps 3 --chunks 2 --warmup-steps 1 | tail -10
        ;;
    curves)  # 300 iterations of plain and default on Shakespeare (GPT-2 BPE; data/shakespeare prepared beforehand)
        python3 -m bench.train_step curves --out "$OUT" ${CURVE_ITERS:+--iters $CURVE_ITERS} | tail -12
        ;;
    ddp)  # the same global batch on 1 2 4 GPUs (GPT-2 124M, DDP), GPT-2 XL under FSDP, the largest GPT that trains
        NCCL_NVLS_ENABLE=0 python3 -m bench.multi_gpu --out "$OUT" --gpus ${DDP_GPUS:-1 2 4} ${DDP_FLAGS:---fsdp --largest} | tail -24
        ;;
    chunks)  # one GPU: rank 0's chunk attention at the context stage's T=524288, each LSE kernel in its own
        # process under a timeout, so a kernel that hangs at these lengths names itself
        for kernel in cudnn flash; do
            timeout "${KERNEL_TIMEOUT:-240}" python3 -m bench.train_step context --T 524288 --kernels "$kernel" --repeats 3 \
                --name "context-kernels-$kernel" --out "$OUT" | tail -3 || echo "train_step context --kernels $kernel: exit $?"
        done
        ;;
    context)  # context parallelism: T=262144 on 1 GPU against 524288 over 2, then the losses of both at 8192. The
        # 2-GPU run's first step compiles for minutes; on 3+ GPUs the one-GPU side runs at the same time on GPU 2
        # (its own files, context-1gpu). CONTEXT_EXTRA: train.py settings for both (e.g. --compile_blocks=true)
        if [ "$(nvidia-smi -L | wc -l)" -ge 3 ]; then
            CUDA_VISIBLE_DEVICES=2 NCCL_NVLS_ENABLE=0 python3 -m bench.multi_gpu --out "$OUT" --work /tmp/context-1gpu \
                --name context-1gpu --skip-ddp --gpus 1 --context 262144 --context-iters 4 --context-check 8192 \
                --timeout "${RUN_TIMEOUT:-540}" -- ${CONTEXT_EXTRA:-} > /tmp/context-1gpu.log 2>&1 &
            CUDA_VISIBLE_DEVICES=0,1 NCCL_NVLS_ENABLE=0 python3 -m bench.multi_gpu --out "$OUT" --name context --skip-ddp \
                --gpus 2 --context 262144 --context-iters 4 --context-check 8192 --timeout "${RUN_TIMEOUT:-540}" \
                -- ${CONTEXT_EXTRA:-} | tail -8
            wait && tail -4 /tmp/context-1gpu.log
        else
            NCCL_NVLS_ENABLE=0 python3 -m bench.multi_gpu --out "$OUT" --name context --skip-ddp --gpus 2 1 \
                --context 262144 --context-iters 4 --context-check 8192 --timeout "${RUN_TIMEOUT:-540}" \
                -- ${CONTEXT_EXTRA:-} | tail -8
        fi
        ;;
    contextcheck)  # context parallelism's loss check at T=8192 (one GPU, then split over 2) with each chunk kernel
        # pinned, and eager: each row shows each step's loss gap to one GPU's, so where a gap opens and with what;
        # two checks at a time on 4+ GPUs (GPUs 0-1 and 2-3)
        # first the op alone at the check's sizes, each kernel against float64 (seconds): which kernel is off, if any
        python3 -m pytest -m gpu -q -p no:cacheprovider tests/unit/test_context_attention.py 2>&1 \
            | tee "$OUT/gpu-tests-context.log" | tail -12
        pairs=$([ "$(nvidia-smi -L | wc -l)" -ge 4 ] && echo 2 || echo 1)
        run_check() {  # $1: the GPUs, $2: a train.py setting, which names the results (context-check-sdpa_kernel-flash)
            local name=${2#--}
            CUDA_VISIBLE_DEVICES=$1 NCCL_NVLS_ENABLE=0 python3 -m bench.multi_gpu --out "$OUT" --work "/tmp/check-$1" \
                --name "context-check-${name//=/-}" --skip-ddp --gpus 1 2 --context-check 8192 --context-iters 4 \
                --timeout "${RUN_TIMEOUT:-240}" -- "$2" | grep -E "^context-check"
        }
        checks=(--sdpa_kernel=cudnn --sdpa_kernel=flash --sdpa_kernel=math --compile=false)
        for ((i = 0; i < ${#checks[@]}; i += pairs)); do
            run_check 0,1 "${checks[i]}" &
            [ "$pairs" = 2 ] && [ $((i + 1)) -lt ${#checks[@]} ] && run_check 2,3 "${checks[i + 1]}" &
            wait
        done
        ;;
    zero)  # DDP at one micro-step of 16 x 1024 tokens per GPU on 2 and on 4 GPUs (--accum counts the micro-steps on
        # the largest count, so each count is its own run against one GPU), plain against the all-reduces
        # overlapping backward: the compiled graph cut per 25 MB bucket, or each block compiled apart
        for gpus in ${DDP_GPUS:-2 4}; do
            NCCL_NVLS_ENABLE=0 python3 -m bench.multi_gpu --out "$OUT" --name "ddp-one-micro-step-${gpus}gpu" --gpus 1 "$gpus" \
                --accum 1 --variant split25:--ddp_graph_split=true,--ddp_bucket_cap_mb=25 \
                --variant blocks:--compile_blocks=true | tail -5
        done
        ;;
    zerochannels)  # DDP on 4 GPUs at one micro-step a GPU with NCCL held to fewer channels (NCCL_MAX_NCHANNELS), so
        # its all-reduce, overlapping backward with each block compiled apart, takes fewer of the SMs backward runs on
        for channels in ${NCCL_CHANNELS:-4 8 16}; do
            NCCL_MAX_NCHANNELS=$channels NCCL_NVLS_ENABLE=0 python3 -m bench.multi_gpu --out "$OUT" \
                --name "ddp-one-micro-step-4gpu-nccl$channels" --gpus 1 4 --accum 1 --variant blocks:--compile_blocks=true \
                | grep -E " on [0-9]"
        done
        ;;
    zeroprofile)  # GPT-2 124M under DDP on 4 GPUs at one micro-step of 16 x 1024 a GPU, profiled: plain, then each
        # block compiled apart; whether the all-reduce runs beside backward, and what that costs backward
        # (PROFILE_GPUS=2: on 2; ZERO_PROFILE_VARIANTS=plain: that one only)
        corpus /tmp/char-corpus
        for variant in ${ZERO_PROFILE_VARIANTS:-plain blocks}; do
            NCCL_NVLS_ENABLE=0 torchrun --standalone --nproc_per_node="${PROFILE_GPUS:-4}" train.py config/train_gpt2.py \
                --data_dir=/tmp/char-corpus --vocab_size=50304 --out_dir="/tmp/ddp-profile-$variant" --overwrite_out_dir=true \
                --batch_size=16 --gradient_accumulation_steps="${PROFILE_GPUS:-4}" --max_iters=9 --eval_interval=1000 \
                --eval_on_start=false --log_interval=1 --compile_blocks="$([ $variant = blocks ] && echo true || echo false)" \
                --profile_steps=2 2>&1 | tail -3
            mkdir -p "$OUT/ddp-profile-$variant" && cp /tmp/ddp-profile-$variant/profile-rank*.md "$OUT/ddp-profile-$variant/"
        done
        ;;
    fsdpxl)  # GPT-2 XL: 1 GPU at 8 x 4 micro-steps against FSDP: one unit per block, 8 blocks a unit, and
        # config/train_gpt2_xl_fsdp.py's settings; then that config profiled (each rank's report under $OUT/fsdp-xl-profile)
        NCCL_NVLS_ENABLE=0 python3 -m bench.multi_gpu --out "$OUT" --name fsdp-xl --skip-ddp --fsdp --gpus ${DDP_GPUS:-1 2} \
            --iters 16 --warmup 6 --log-interval 2 --accum 2 --timeout 300 --variant unit8:--fsdp_blocks_per_unit=8 \
            --variant shipped:--batch_size=16,--fsdp_reshard_after_forward=false,--fsdp_blocks_per_unit=8 \
            -- --activation_checkpointing=none | tail -10
        corpus /tmp/char-corpus
        NCCL_NVLS_ENABLE=0 torchrun --standalone --nproc_per_node="${PROFILE_GPUS:-2}" train.py config/train_gpt2_xl_fsdp.py \
            --data_dir=/tmp/char-corpus --vocab_size=50304 --out_dir=/tmp/fsdp-xl-profile --overwrite_out_dir=true \
            --max_iters=9 --eval_interval=1000 --eval_on_start=false --log_interval=1 \
            --gradient_accumulation_steps="${PROFILE_GPUS:-2}" --profile_steps=2 2>&1 | tail -6
        mkdir -p "$OUT/fsdp-xl-profile" && cp /tmp/fsdp-xl-profile/profile-rank*.md "$OUT/fsdp-xl-profile/"
        ;;
    bigresume)  # 4 GPUs: config/train_gpt_6.7b_fsdp.py's model trains 4 steps and saves; what the save wrote; then
        # the run continues on 2 GPUs from that save (block recomputation there: each GPU holds twice the shards)
        corpus /tmp/big_data
        BIG="config/train_gpt_6.7b_fsdp.py --data_dir=/tmp/big_data --vocab_size=50304 --out_dir=/tmp/big_out
            --gradient_accumulation_steps=8 --eval_interval=4 --eval_iters=1 --eval_on_start=false --log_interval=1
            --warmup_iters=2 --lr_decay_iters=8"
        OMP_NUM_THREADS=16 NCCL_NVLS_ENABLE=0 timeout "${RUN_TIMEOUT:-330}" torchrun --standalone --nproc_per_node=4 \
            train.py $BIG --max_iters=4 --overwrite_out_dir=true 2>&1 | grep -E "^(iter|eval|error|WARNING)|save" | tail -8
        du -sh /tmp/big_out/* && df -h /tmp | tail -1
        CUDA_VISIBLE_DEVICES=0,1 NCCL_NVLS_ENABLE=0 timeout "${RUN_TIMEOUT:-330}" torchrun --standalone --nproc_per_node=2 \
            train.py $BIG --max_iters=6 --init_from=resume --activation_checkpointing=block 2>&1 \
            | grep -E "^(iter|eval|error|WARNING)|resum" | tail -8
        ;;
    big)  # 4 GPUs: a GPT-2 of width 4096 and 32 layers (6.7B), which one GPU cannot train, under FSDP at micro-batch 4
        # (--micro-batch 8 is the 124M's; the large model gets half): one unit per block, then 4 blocks a unit without
        # resharding; two runs within one 600 s call (OMP threads for rank 0's initialization of the model on its CPU)
        OMP_NUM_THREADS=16 NCCL_NVLS_ENABLE=0 python3 -m bench.multi_gpu --out "$OUT" --name fsdp-6.7b --skip-ddp --fsdp \
            --fsdp-model gpt2-6.7B --gpus ${BIG_GPUS:-4} --micro-batch 8 --accum 2 --iters 12 --warmup 4 --log-interval 2 \
            --timeout "${RUN_TIMEOUT:-280}" \
            --variant unit4-noreshard:--fsdp_blocks_per_unit=4,--fsdp_reshard_after_forward=false \
            -- --activation_checkpointing=none | tail -6
        ;;
    twonodes)  # the two-node launch on one host: 2 torchrun agents x half the GPUs (2 or 1) against one launch
        gpu_tests 0 tests/gpu/test_two_nodes.py --e2e-results "$OUT" --e2e-name two-nodes | tail -6
        ;;
    phases)  # one optimizer step phase by phase (host and GPU time), DDP and FSDP, GPT-2 124M
        NCCL_NVLS_ENABLE=0 python3 -m torch.distributed.run --standalone --nproc_per_node="${PHASE_GPUS:-4}" \
            -m bench.train_step phases --out "$OUT" ddp fsdp | grep -E "^(ddp|fsdp|wrote)"
        ;;
    *) echo "unknown stage $stage; stages: tests e2e smoke scan attention float16 train compare generate speed profile long curves ddp twonodes phases chunks context contextcheck zero zerochannels zeroprofile fsdpxl big bigresume"; exit 2 ;;
    esac
done
