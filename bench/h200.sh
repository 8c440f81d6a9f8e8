#!/usr/bin/env bash
# `ckptzip bench` on the GPU machine (one H200), in under 7 minutes. See docs/BENCH.md.
#
# Run from the repository root with the wheels of bench/gpu-wheels.sh carried in .whl/
# (add safetensors and a zipnn wheel there to include those baselines), OUT set to the folder
# whose files come back:
#     bash bench/h200.sh
# Then keep the JSON in bench/results/headline/ and, from bench/, render the run's report, the plot
# and RESULTS.md's generated headline (docs/BENCH.md):
#     PYTHONPATH=. python -m ckptzip_bench.results results/headline/bench.json results/headline/bench-moe-bf16.json \
#         --results-md results/headline/REPORT.md --plot bench.png --update RESULTS.md
#
# Two runs, each under a soft budget (--budget-s: no method, repetition or state starts after it)
# and a hard timeout; every run rewrites its JSON after each method, so a stopped run keeps what it
# measured. Run 1 is the one the targets are read from: dense `medium` (3.25 GB), fp32 weights,
# every method, two timed repetitions. Run 2: the MoE model with bf16 weights + fp32 master
# weights, one repetition.
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT to the folder for the results}"

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site .whl/*.whl \
  || { echo "installing the carried wheels (.whl/) failed" >&2; exit 1; }
export PYTHONPATH=$PWD/.site:$PWD/src

scratch=${BENCH_DIR:-/tmp/ckptzip-bench}
mkdir -p "$scratch"
{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv; df -h "$scratch"; } \
  > "$OUT/machine.txt" 2>&1

# bench STEM TIMEOUT ARGS...: one run, its log and JSON under $OUT; prints its exit status.
bench() {
  local stem=$1 limit=$2
  shift 2
  timeout -k 10 "$limit" python3 -m ckptzip bench --steps 30 --dir "$scratch" \
    --out-json "$OUT/$stem.json" --results-md "$OUT/$stem.md" "$@" > "$OUT/$stem.log" 2>&1
  local status=$?
  grep -E '^(reads|disk|ceilings|== |  [a-z]|\[)' "$OUT/$stem.log" | cut -c1-220
  echo "== $stem: exit status $status (124: stopped by the timeout; its JSON keeps what was measured)"
  return $status
}

bench bench 230 --preset medium --moe-preset none --reps 2 --budget-s 185
first=$?
bench bench-moe-bf16 130 --preset none --moe-preset medium-moe --bf16-weights --reps 1 --budget-s 95
second=$?
exit $(( first != 0 ? first : second ))
