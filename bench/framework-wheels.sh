#!/usr/bin/env bash
# Download the wheels that DeepSpeed and Megatron-Core need on a machine without network access,
# for Python 3.12 on x86-64, into .whl-fw/ at the repository root. Carry .whl-fw/ (with .whl/ from
# bench/gpu-wheels.sh) to the GPU machine; bench/frameworks_gpu.sh installs both from there.
#
#   bash bench/framework-wheels.sh                  # what the GPU machine's image lacks (~8 MiB)
#   FW_WHEELS_ALL=1 bash bench/framework-wheels.sh  # also what a plain torch install lacks (~25 MiB)
#
# Environment: PYTHON_VERSION (default 3.12), WHEEL_DIR (default .whl-fw), FW_WHEELS_ALL (see above).
# Every version is pinned, so each Python version gets the same set. DeepSpeed is an sdist on the
# package index: it is built here into a pure-Python wheel, without torch in its build environment,
# so no C++/CUDA op is compiled (the benches use torch's AdamW) and no torch is downloaded.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
dir="${WHEEL_DIR:-.whl-fw}"
pyver="${PYTHON_VERSION:-3.12}"
mkdir -p "$dir"

# Megatron-Core and DeepSpeed, and what they need that the GPU image (Python packages already
# there: the device notes) does not have. typing-extensions is there, maybe older than pydantic needs.
wheels=(megatron-core==0.16.1 hjson==3.1.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0
        typing-inspection==0.4.5 typing-extensions==4.16.0)
# What the GPU image has but a plain `pip install torch` does not.
if [[ -n "${FW_WHEELS_ALL:-}" ]]; then
  wheels+=(numpy==2.4.6 packaging==26.4 einops==0.8.2 msgpack==1.2.4 ninja==1.13.2 psutil==7.2.2 py-cpuinfo==9.0.0
           tqdm==4.70.1)
fi

python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$pyver" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 \
  --platform manylinux1_x86_64 -d "$dir" "${wheels[@]}"

if ! compgen -G "$dir/deepspeed-0.19.8-*.whl" > /dev/null; then
  # The build environment is isolated (setuptools only): without torch, DeepSpeed's setup.py
  # compiles no op and adds no CUDA-only requirement; DS_BUILD_OPS=0 says the same explicitly.
  DS_BUILD_OPS=0 python3 -m pip wheel -q --no-deps --no-binary=deepspeed -w "$dir" deepspeed==0.19.8
fi
ls -1s --block-size=K "$dir"
du -sh "$dir"
