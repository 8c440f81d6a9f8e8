#!/usr/bin/env bash
# One device call, one GPU: what issue 44 left to a GPU.
#   (a) the GPU tests of DCP's process mode through ckptzip's writer (with and without torchtitan's
#       stager), of stagings handed to another process, of the torch_checkpointing integration,
#       and of DCP's thread-mode staging: pytest -m gpu on their four files;
#   (b) bench/torchtitan_gpu.py: torchtitan 0.2's trainer (llama3 debugmodel) checkpointing with
#       torchtitan's manager, ckptzip's, torch_checkpointing's and ckptzip's in torch_checkpointing,
#       in every async mode; one JSON line each (lost training time per checkpoint, bytes, resume).
# The exit status is 1 if anything failed. Usage, from the repository root, with .whl/
# (bench/gpu-wheels.sh) and .whl-tt/ (bench/torchtitan-wheels.sh) carried:
#   bash bench/torchtitan_gpu.sh          (logs and JSON lines in $OUT; extra arguments go to (b))
set -uo pipefail
# a wheel in both folders (gpu-wheels.sh may have fetched torch_checkpointing too) is installed once:
# pip refuses the same distribution from two files
wheels=(.whl/*.whl)
for w in .whl-tt/*.whl; do [ -e ".whl/$(basename "$w")" ] || wheels+=("$w"); done
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site \
  "${wheels[@]}" || exit 1
export PYTHONPATH=$PWD/.site:$PWD/src:$PWD/tests:$PWD/bench PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -W ignore -c "import torch, torchtitan, torch_checkpointing; from nvidia import nvcomp
print('torch', torch.__version__, 'torchtitan', torchtitan.__version__, 'nvcomp', nvcomp.__version__,
      'gpu', torch.cuda.get_device_name(0))" 2>&1 | tail -1

status=0
step() {  # step NAME SECONDS COMMAND...: run it, its output to $OUT/NAME.log; print its tail, more of it if it failed
  local name=$1 limit=$2; shift 2
  if timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; then
    tail -n 3 "$OUT/$name.log"
  else
    echo "$name FAILED (exit $?):"; tail -n 60 "$OUT/$name.log"; status=1
  fi
}
step gpu-tests 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/dcp/test_dcp_process.py \
  tests/engine/test_staged_portable.py tests/integrations/test_integration_torch_checkpointing.py tests/dcp/test_dcp_staging.py
step torchtitan 330 python3 bench/torchtitan_gpu.py "$@"
grep '^{' "$OUT/torchtitan.log" > "$OUT/torchtitan.jsonl"
cat "$OUT/torchtitan.jsonl"
exit $status
