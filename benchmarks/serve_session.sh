#!/usr/bin/env bash
# The serving measurements of one device call (H100/H200): the fast prefill checked and timed
# beside the float32 one, then `mkc serve` on North Mini Code (random weights) driven by
# `mkc bench-serve`, and `mkc bench` on the same card for the kernel alone. Logs and JSON land
# under $OUT, a line per stage in $OUT/summary.log; a stage that fails or runs out of time does
# not stop the rest. Carry the wheels the device image lacks in .whl/ (fastapi, uvicorn, httpx,
# prometheus-client, tqdm and what they need, for Python 3.12):
#
#   pip download -d .whl --python-version 3.12 --only-binary=:all: --platform manylinux2014_x86_64 \
#       fastapi uvicorn httpx prometheus-client tqdm
#   OUT=/path bash benchmarks/serve_session.sh --prefill    # limits 60 + 200 + 300 = 560 s
#   OUT=/path bash benchmarks/serve_session.sh --serve      # limits 60 + 240 + 200 + 60 = 560 s at most
#
# --prefill: the GPU tests of the prefill (tests/test_prefill_gpu.py, tests/test_backends_gpu.py),
#   then benchmarks/prefill_speed.py: prompts of 1K, 8K and 32K (fast, chunks of 2048 and 8192)
#   and 1K and 4K (the float32 reference), tile-ordered weights as the server holds them.
# --serve: mkc serve --max-batch 8 --context 16384 (start-up to healthy timed), then with
#   bench-serve: an 8K prompt's TTFT (alone, 3 requests in turn); a lone stream (512-token prompt,
#   256 tokens); 8 concurrent streams at ~8K (7936-token prompts, 256 tokens); 7 streams decoding
#   while an 8K prompt arrives (their ITL p99); then mkc bench at batch 1 and 8, context 8192.
set -u -o pipefail
OUT=${OUT:-serve-session}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
mode=${1:-}
stage() {  # name, timeout (s), command...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "$name: rc=$? in $((SECONDS - t0)) s ($(date -u +%H:%M:%S) UTC)" | tee -a "$OUT/summary.log"
  tail -6 "$OUT/$name.log"
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
stage pip 60 bash -c 'python3 -m pip install --no-deps --no-build-isolation -e . &&
  python3 -m pip install --no-index --find-links .whl fastapi uvicorn httpx prometheus-client tqdm'

case $mode in
  --prefill)
    stage prefill_tests 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_prefill_gpu.py \
      tests/test_backends_gpu.py
    stage prefill_speed 300 python3 benchmarks/prefill_speed.py --prompts 1024,8192,32768 \
      --reference-prompts 1024,4096 --chunks 2048,8192 -o "$OUT/prefill.json"
    ;;
  --serve)
    port=8011
    url=http://127.0.0.1:$port
    t0=$SECONDS
    mkc serve --config configs/north_mini_code.yaml --random-weights --backend cuda --max-batch 8 \
      --context 16384 --port $port --log-level info > "$OUT/server.log" 2>&1 &
    server=$!
    until curl -sf "$url/health" > /dev/null 2>&1; do
      if ! kill -0 $server 2> /dev/null || [ $((SECONDS - t0)) -gt 240 ]; then break; fi
      sleep 1
    done
    echo "server start to healthy: $((SECONDS - t0)) s" | tee -a "$OUT/summary.log"
    bs() { mkc bench-serve --url "$url" --vocab-size 262144 "$@"; }
    stage ttft_8k 60 bs --num-requests 3 --concurrency 1 --prompt-len 8192 --output-len 2 -o "$OUT/ttft_8k.json"
    stage lone 40 bs --num-requests 1 --concurrency 1 --prompt-len 512 --output-len 256 -o "$OUT/lone.json"
    stage eight 60 bs --num-requests 8 --concurrency 8 --prompt-len 7936 --output-len 256 -o "$OUT/eight.json"
    stage interleave 40 bash -c "mkc bench-serve --url $url --vocab-size 262144 --num-requests 7 --concurrency 7 \
        --prompt-len 512 --output-len 768 --seed 1 -o $OUT/interleave_streams.json & sleep 6;
      mkc bench-serve --url $url --vocab-size 262144 --num-requests 1 --prompt-len 8192 --output-len 2 --seed 2 \
        -o $OUT/interleave_prompt.json; wait"
    curl -s "$url/metrics" > "$OUT/metrics.txt"
    kill $server; wait $server 2> /dev/null
    stage bench 100 mkc bench --config configs/north_mini_code.yaml --random-weights --batch 1,8 --context 8192 \
      -o "$OUT/bench"
    ;;
  *) echo "usage: OUT=DIR bash benchmarks/serve_session.sh --prefill | --serve" >&2; exit 2 ;;
esac
