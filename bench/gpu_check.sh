#!/usr/bin/env bash
# One device call: install the carried wheels, run the GPU tests, then probe the engine.
# Usage (from the repository root, wheels from bench/gpu-wheels.sh in .whl/): bash bench/gpu_check.sh [probe args...]
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site .whl/*.whl || exit 1
export PYTHONPATH=$PWD/.site:$PWD/src:$PWD/tests PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton; from nvidia import nvcomp; print('torch', torch.__version__, 'triton', triton.__version__, 'nvcomp', nvcomp.__version__)"
python3 -m pytest -q -rfE --tb=short -p no:cacheprovider --timeout=240 ${GPU_TESTS:--m gpu tests} > "$OUT/gpu-tests.txt" 2>&1
rc=$?; tail -15 "$OUT/gpu-tests.txt"
if [ $rc -ge 128 ]; then  # the process crashed: run each file apart, to tell a crash's cause from its victims
  echo "GPU tests crashed (exit $rc); again, one process per file:"
  for f in $(grep -rl --include="test_*.py" "mark.gpu" tests); do
    python3 -m pytest -q -rfE --tb=short -p no:cacheprovider --timeout=240 -m gpu "$f" >> "$OUT/gpu-tests-by-file.txt" 2>&1
    echo "  $f: exit $?"
  done
fi
python3 bench/engine_probe.py "$@" 2>&1 | tee "$OUT/probe.txt"
