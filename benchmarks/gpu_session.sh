#!/usr/bin/env bash
# One device call that checks and times the tree (H100/H200): every GPU test, `mkc bench` with the
# contiguous and the paged KV cache side by side with the PyTorch baseline, and a profiled step.
# The stage limits add up to under ten minutes.
# Logs and JSON land under $OUT (default ./gpu-session); a stage that fails does not stop the rest.
#
#   OUT=/path bash benchmarks/gpu_session.sh [--quick]     # --quick: batch 1 and 8 only
set -u -o pipefail
OUT=${OUT:-gpu-session}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
batches=1,2,4,8
[ "${1:-}" = "--quick" ] && batches=1,8
stage() {  # name, timeout (s), command...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "$name: rc=$? in $((SECONDS - t0)) s ($(date -u +%H:%M:%S) UTC)" | tee -a "$OUT/summary.log"
  tail -4 "$OUT/$name.log"
}
nvidia-smi --query-gpu=name,driver_version --format=csv > "$OUT/env.log" 2>&1
stage gpu_tests 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/
stage bench 100 python3 -m mkc.cli bench --config configs/north_mini_code.yaml --random-weights \
  --batch "$batches" --context 8192 --reps 20 -o "$OUT/bench"
stage bench_paged 100 python3 -m mkc.cli bench --config configs/north_mini_code.yaml --random-weights \
  --batch "$batches" --context 8192 --reps 20 --page-size 256 -o "$OUT/bench-paged"
stage profile 70 python3 benchmarks/megakernel_step.py --batch 1 8 --context 8192 --reps 10 --profile "$OUT/prof"
