#!/usr/bin/env bash
# Download what bench/torchtitan_gpu.sh installs on a machine without network access, for Python
# 3.12, into .whl-tt/ at the repository root (~3 MiB, all pure-Python wheels): torchtitan 0.2.2
# (the torchtitan torch 2.11 runs) and torchdata, which it imports, its config parser (tyro and
# what tyro needs), and torch_checkpointing. Carry .whl-tt/ with .whl/ (bench/gpu-wheels.sh).
# TensorBoard and Hugging Face datasets, which torchtitan 0.2 also asks for, are used by none of
# the runs (bench/ckptzip_bench/titan.py stands in for them where they are missing).
#
#   bash bench/torchtitan-wheels.sh
#
# Environment: PYTHON_VERSION (default 3.12), WHEEL_DIR (default .whl-tt).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
dir="${WHEEL_DIR:-.whl-tt}"
mkdir -p "$dir"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "${PYTHON_VERSION:-3.12}" \
  --implementation py --platform any -d "$dir" \
  torchtitan==0.2.2 torchdata==0.11.0 torch_checkpointing==0.1.1 tyro==1.0.17 docstring_parser==0.18.0 \
  typeguard==4.6.1 shtab==1.13.0 tomli==2.5.0
ls -1s --block-size=K "$dir"
du -sh "$dir"
