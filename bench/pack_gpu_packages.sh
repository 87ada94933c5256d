#!/usr/bin/env bash
# flash-attn 2 and flash-attn-4 (with its CuTe DSL libraries) for a GPU machine without network, packed on a machine
# with network into .stage-a/ and .stage-b/ (halves of one xz tarball of a site folder, each under 64 MiB, with its
# SHA256SUMS), which bench/run_gpu.sh joins and unpacks there. bench/README.md says more.
#   bash bench/pack_gpu_packages.sh FLASH_ATTN_2_WHEEL   # a wheel built for the GPU machine's torch, CUDA, Python
set -euo pipefail
flash_attn_2=${1:?usage: bash bench/pack_gpu_packages.sh FLASH_ATTN_2_WHEEL}
[ -f "$flash_attn_2" ] || { echo "error: no file $flash_attn_2" >&2; exit 2; }
flash_attn_2=$(realpath "$flash_attn_2")  # given from the caller's folder; the script works from the repo root
cd "$(dirname "$0")/.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# The versions measured in bench/results, for the GPU machine's python 3.12, x86-64 and CUDA 13.
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
