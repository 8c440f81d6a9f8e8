#!/usr/bin/env bash
# One device call, one GPU: issue 43's loop measured as its targets ask, within one call's time.
#   (a) the GPU tests of the memory the manager takes, of its staging and of stagings handed to
#       another process (skipped with SKIP_TESTS=1);
#   (b) `python -m ckptzip_bench.training_loop` on the GPU's configuration (h100 or h200, by the
#       name nvidia-smi gives; CONFIG overrides it): the control (`none`), the default manager and torch_checkpointing,
#       RUNS runs interleaved (default 3), every EVERY steps (default 45), CKPTS checkpoints a run
#       (default 2); its JSON is kept row by row, so a run the time limit ends keeps its rows. On an
#       H100 a method's run takes about a minute: the defaults fill one call, and the limit may
#       end run 3's last method.
# Extra arguments go to (b) (for instance --verify, or --methods ...). The exit status is 1 if a step
# failed. Usage, from the repository root, with .whl/ carried (bench/gpu-wheels.sh torch_checkpointing==0.1.1):
#   bash bench/training_loop_gpu.sh [--verify]      (logs and JSON in $OUT; LIMIT: seconds in all, default 590)
set -uo pipefail
T0=$(date +%s)
LIMIT=${LIMIT:-590}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site .whl/*.whl || exit 1
python3 setup.py -q build_ext --inplace > "$OUT/build.txt" 2>&1 || { tail -20 "$OUT/build.txt"; exit 1; }
export PYTHONPATH=$PWD/.site:$PWD/src:$PWD/tests:$PWD/bench PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc; free -g; df -h /tmp; } > "$OUT/host.txt" 2>&1
head -1 "$OUT/host.txt"
if [ -n "${CONFIG:-}" ]; then CFG=$CONFIG; elif grep -q H200 "$OUT/host.txt"; then CFG=h200; else CFG=h100; fi
left() { echo $(( LIMIT - ($(date +%s) - T0) )); }

status=0
if [ -z "${SKIP_TESTS:-}" ]; then
  timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/memory tests/staging tests/manager/test_snapshot.py \
    tests/manager/test_host_memory.py tests/engine/test_staged_portable.py \
    > "$OUT/gpu-tests.txt" 2>&1 || status=1
  tail -n 3 "$OUT/gpu-tests.txt"
fi
timeout "$(left)" python3 -m ckptzip_bench.training_loop --config $CFG --methods "${METHODS:-none,ckptzip-manager,torch_checkpointing}" \
  --every "${EVERY:-45}" --checkpoints "${CKPTS:-2}" --runs "${RUNS:-3}" --json "$OUT/loop.json" "$@" 2>&1 \
  | grep -v Warning > "$OUT/loop.txt"
rc=${PIPESTATUS[0]}
[ "$rc" -eq 0 ] || { echo "training loop ended early (exit $rc)"; status=1; }
tail -n 14 "$OUT/loop.txt"
echo "done at $(( $(date +%s) - T0 )) s"
exit $status
