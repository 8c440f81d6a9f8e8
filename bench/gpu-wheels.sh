#!/usr/bin/env bash
# Download the wheels a GPU machine without network access needs to run ckptzip's GPU path
# (nvCOMP for CUDA 13, and the CPU codecs), for Python 3.12 on x86-64, into .whl/ at the
# repository root. Carry .whl/ to that machine; bench/gpu_check.sh installs it from there.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
  "nvidia-nvcomp-cu13==${NVCOMP_VERSION:-6.0.0.12}" "nvidia-libnvcomp-cu13==${NVCOMP_VERSION:-6.0.0.12}" \
  zstandard lz4 "$@"
ls -1 .whl
