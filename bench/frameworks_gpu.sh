#!/usr/bin/env bash
# One device call: the framework integrations on the GPUs (2 if there are, else 1).
#   (a) DeepSpeed, ZeRO-2, bf16: bench/deepspeed_gpu.py (deepspeed.initialize, save_checkpoint
#       through ckptzip's checkpoint engine and through DeepSpeed's own, load_checkpoint, resume);
#   (b) Megatron-Core, GPTModel with the distributed optimizer: bench/megatron_gpu.py
#       (dist_checkpointing through the "ckptzip" backend and through "torch_dist", load, resume);
#   (c) JAX (the GPU image's own) arrays on the GPU through DLPack: tests/integrations/test_integration_jax.py.
# (a) and (b) print one JSON line each and check bit-exactness; the exit status is 1 if anything failed.
# Usage, from the repository root, with .whl/ (bench/gpu-wheels.sh) and .whl-fw/ (bench/framework-wheels.sh)
# carried:  bash bench/frameworks_gpu.sh        (logs and JSON in $OUT)
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site \
  .whl/*.whl .whl-fw/*.whl || exit 1
export PYTHONPATH=$PWD/.site:$PWD/src:$PWD/tests PYTHONUNBUFFERED=1
# Deterministic cuBLAS, so that a resumed run can match an uninterrupted one bit for bit; JAX
# takes GPU memory as it needs it, not 75% up front.
export CUBLAS_WORKSPACE_CONFIG=:4096:8 XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nproc=$(python3 -c 'import torch; print(min(2, torch.cuda.device_count()))') || exit 1
python3 -W ignore -c "import torch, deepspeed, megatron.core, jax; from nvidia import nvcomp
print('torch', torch.__version__, 'deepspeed', deepspeed.__version__, 'megatron-core', megatron.core.__version__,
      'jax', jax.__version__, 'nvcomp', nvcomp.__version__, 'gpus', torch.cuda.device_count())" 2>&1 | tail -1

status=0
step() {  # step NAME SECONDS COMMAND...: run it, its output to $OUT/NAME.log; print its last line, or its tail if it failed
  local name=$1 limit=$2; shift 2
  if timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; then
    tail -n 1 "$OUT/$name.log"
  else
    echo "$name FAILED (exit $?):"; tail -n 40 "$OUT/$name.log"; status=1
  fi
}
step deepspeed 130 python3 bench/deepspeed_gpu.py --nproc "$nproc" --stage 2 --json "$OUT/deepspeed.json"
step megatron 130 python3 bench/megatron_gpu.py --nproc "$nproc" --json "$OUT/megatron.json"
step jax 60 python3 -m pytest -q -p no:cacheprovider tests/integrations/test_integration_jax.py
exit $status
