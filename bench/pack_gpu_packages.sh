#!/usr/bin/env bash
# Pack flash-attn 2 (the wheel prebuilt for the lent GPU's image) and flash-attn-4 with its CuTe DSL
# libraries for that GPU, which has no network. The result is one xz tarball of a site folder, 84 MB. It is
# split in halves under .stage-a/ and .stage-b/, each under a call's 64 MiB carry limit. bench/run_gpu.sh
# joins and unpacks the halves on the device.
#   bash bench/pack_gpu_packages.sh [FLASH_ATTN_2_WHEEL]   # default: ../shared/wheels/flash_attn-*.whl
# Then carry [".stage-a"] in one call and [".stage-b"] in the next, on the same warm machine.
set -euo pipefail
cd "$(dirname "$0")/.."
flash_attn_2=${1:-$(ls ../shared/wheels/flash_attn-*.whl)}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# The versions measured in bench/results (python 3.12, x86-64, CUDA 13 image).
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$work/wheels" \
    flash-attn-4==4.0.0b36 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 \
    nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1 apache-tvm-ffi==0.1.15.post2 \
    torch-c-dlpack-ext==0.1.5 quack-kernels==0.6.5
mkdir "$work/site"
unzip -q -o "$flash_attn_2" -d "$work/site"
rm -rf "$work/site/flash_attn/cute"  # flash-attn 2.8's early draft; flash-attn-4 brings the real one
for wheel in "$work"/wheels/*.whl; do
    unzip -q -o "$wheel" -d "$work/site"
done
# run_gpu.sh puts nvidia_cutlass_dsl/dsl_packages on PYTHONPATH instead of the .pth; build_backend.py is
# apache-tvm-ffi's build hook, unused at run time
rm -f "$work"/site/*.pth "$work/site/build_backend.py"
tar cf - -C "$work/site" . | xz -T0 -9e > "$work/site.tar.xz"
(cd "$work" && sha256sum site.tar.xz > SHA256SUMS && split -n 2 site.tar.xz site.tar.xz.part-)
rm -rf .stage-a .stage-b
mkdir .stage-a .stage-b
cp "$work/SHA256SUMS" .stage-a/ && cp "$work/SHA256SUMS" .stage-b/
mv "$work/site.tar.xz.part-aa" .stage-a/ && mv "$work/site.tar.xz.part-ab" .stage-b/
du -sh .stage-a .stage-b
