#!/usr/bin/env bash
# One device call that checks and times the tree (H100/H200). Logs and JSON land under $OUT
# (default ./gpu-session), one log per stage and a line per stage in $OUT/summary.log, all packed at the end
# into $OUT/out.tgz beside summary.log (the device brings back 8 files); a stage that
# fails or runs out of time does not stop the rest. Each mode's stage limits add up to under the
# 10-minute limit of one call. Several modes run in the order given (`--prefill --serve`), each
# stage's limit cut to what is left of the call (CALL_SECONDS, default 590 s): a stage with under
# 10 s left is skipped, and says so in summary.log.
#
#   OUT=/path bash benchmarks/gpu_session.sh [--quick]   # default mode
#   OUT=/path bash benchmarks/gpu_session.sh --bench     # timing only
#   OUT=/path bash benchmarks/gpu_session.sh --long      # long-context mode
#   OUT=/path bash benchmarks/gpu_session.sh --prefill --serve   # two modes in one call
#
# Kernels compile on the device (NVRTC, 12-15 s each) and a server plans each step's schedule (10 s,
# 25 s paged) unless MKC_CACHE_DIR names caches built on the CPU machine beforehand and sent along:
# `MKC_CACHE_DIR=$PWD/.mkc-cache/h python benchmarks/warm_cache.py --batch 1,2,4,8 --context 16384`
# (--serve; --context 40960 --page-size 256 --kv-pages 256 for --serve-long; --context 8192
# --weights bf16,fp8 for --fp8; --config configs/MODEL.yaml --batch 1,8 for --models) plans and
# builds what those runs ask for (the kernel key hashes the source, the templates and the NVRTC
# version, so a device whose NVRTC differs compiles them itself), then run
# this with the same MKC_CACHE_DIR and the folder carried (about 2 MB a kernel without kernel.cu).
#
# Default mode (limits 20 + 380 + 100 + 60 = 560 s):
#   pip          the package installed in place, no network, no dependencies (python3 -m pip
#                install --no-deps --no-build-isolation -e .): the device machine has torch and the
#                CUDA wheels but not mkc; log in $OUT/pip.log
#   gpu_tests    the GPU tests, by file (collecting tests/ whole fails there: openai and gguf are
#                missing): test_gpu, test_families_gpu, test_generate_gpu, test_backends_gpu,
#                test_paged_kv, test_transformers_oracle (338 s together on an H200, 2026-11-30)
#   bench        mkc bench at context 8192, batch 1,2,4,8 (--quick: 1,8), contiguous KV cache,
#                beside the CUDA-graph PyTorch baseline
#   profile      benchmarks/megakernel_step.py --profile at batch 1 and 8, context 8192
# --quick: the default stages at batch 1 and 8 only.
# --bench (limits 20 + 100 + 100 + 60 = 280 s): pip, bench, bench_paged (the same with the paged KV
#   cache, --page-size 256), profile.
# --reads (limits 20 + 120 + 120 = 260 s): pip, then benchmarks/sm_stream.py: what A SMs read
#   (sm_stream) and the L2's read rate and what stays in it under other streams (sm_stream_l2).
# --long (limits 20 + 270 + 270 = 560 s): pip, then mkc bench at batch 1 and 8 and contexts 32768
#   and 131072, contiguous (bench_long) and paged (bench_long_paged). Before each engine allocates,
#   bench compares its memory estimate with the GPU's free memory and skips it with what it needed
#   and what was free (the log, the table and bench.json's "skipped"): on an H200, batch 8 at
#   131072 (105 GB of KV cache beside 61 GB of weights) is skipped in both layouts.
# --prefill (limits 20 + 60 + 200 + 280 = 560 s): pip, the wheels the image lacks (from .whl/),
#   the prefill's GPU tests (tests/test_prefill_gpu.py, tests/test_backends_gpu.py), then
#   benchmarks/prefill_speed.py: prompts of 1K, 8K and 32K through the tensor-core prefill in calls
#   of 2048 and 8192 tokens, and 1K through the float32 one, over tile-ordered weights; 8K and 32K
#   with a layer run 4096 and 8192 positions at a time (FastPrefill's chunk, default 2048).
#   With BASE=DIR[:DIR...] (other trees, e.g. `git archive OLD | tar x -C DIR`), 8K and 32K in calls
#   of 8192 and the profile again, this script over each tree's library (installed to
#   /tmp/site-NAME), into prefill-NAME.json, NAME the folder's name: before and after on one card.
#   Each BASE tree adds its stages (60 + 150 s) beyond the 560, cut to what is left of the call.
# --prefill-attention (limits 20 + 240 = 260 s): pip, then benchmarks/prefill_attention.py: one
#   sliding and one global layer's attention for the last 8192 queries of 8K and 32K prompts, the
#   way FastPrefill computes it beside the candidates (smaller query blocks, SDPA's grouped-query
#   support, compiled FlexAttention), each checked against float32 (prefill_attention.json).
# --serve (limits 20 + 60 + 240 + 60 + 40 + 60 + 40 + 60 + 100, cut to the call's 590 s; a warm start
#   takes far less than its 240): pip and wheels, then
#   mkc serve --max-batch 8 --context 16384 (start to healthy timed) driven by mkc bench-serve: an
#   8K prompt's TTFT (3 in turn); a lone stream (512-token prompt, 256 tokens); 8 concurrent
#   streams at ~8K (7936-token prompts, 256 tokens); 8 sampled streams (temperature 0.8, top_p
#   0.95: the device-side sampling's cost beside greedy); 7 streams decoding while an 8K prompt arrives
#   (their ITL p99); its /metrics; then mkc bench at batch 1 and 8, context 8192, on the same card.
# --serve-long (limits 20 + 60 + 240 + 90 + 60 + 90 = 560 s at most): as --serve, with a paged KV
#   pool (--context 40960, 256 pages of 256): 7 streams decoding while a 32K prompt arrives (their
#   ITL p99, its TTFT), then two 32K prompts' TTFT in turn.
# --fp8 (limits 20 + 200 + 330 = 550 s): pip, the FP8 GPU tests (tests/test_fp8_gpu.py: the kernel
#   against the CPU executor on FP8 weights, e4m3 subnormals included; North Mini Code against the
#   mirror), then mkc bench --weights bf16,fp8 at batch 1,2,4,8, context 8192 (bench_fp8).
# --fp8-tune (limits 20 + 280 + 280 = 580 s): pip, then mkc bench --tune --weights fp8 at batch 1 and
#   at batch 8, context 8192 (tune_fp8_b1, tune_fp8_b8): FP8 schedules timed and recorded in
#   $OUT/tuning.json (MKC_TUNING_FILE), to merge into configs/tuning/ (their keys end in "+fp8").
# --qwen3-tune (limits 20 + 280 + 280 = 580 s): pip, then mkc bench --tune for Qwen3-30B-A3B at batch 1
#   and at batch 8, context 8192 (tune_qwen3_b1, tune_qwen3_b8), recorded in $OUT/tuning.json: the
#   compiler's own choices (its probe's layer end) among the schedules timed, beside the tune's pick
#   (issue 62: the compiler's schedule within 10% of the tune's).
# --models (limits 20 + 130 x 4 = 540 s): pip, then mkc bench at batch 1 and 8, context 8192, for
#   Qwen3-30B-A3B, Qwen3-0.6B, TinyLlama-1.1B and SmolLM2-135M (one stage each), beside the
#   CUDA-graph PyTorch step of the same run (issue 62's table), each point also profiled (its per-task
#   timeline, trace-b*-c8192.npz): out.tgz unpacked, python benchmarks/calibrate_models.py bench-* sets the
#   simulation beside each measured step and refits its fixed times over the four models.
# --sequential-warm (limits 20 + 260 + 260 = 540 s): pip, then benchmarks/kernel_variants.py at batch
#   1, context 8192, for TinyLlama-1.1B and Qwen3-30B-A3B (warm_tinyllama, warm_qwen3): their
#   sequential blocks' L2 warm-up rules (the next layer's QKV weights and this layer's O-projection's,
#   asked of L2 while the attention reads little) beside the default, in 2 rounds. The warm-up
#   variants share one kernel a model: `MKC_CACHE_DIR=$PWD/.device_out/warm-cache python
#   benchmarks/kernel_variants.py --build-only --config configs/MODEL.yaml --batch 1 --variants ...`
#   builds them here (carry the folder, MKC_CACHE_DIR naming it on the device).
# The wheels: pip download -d .whl --python-version 3.12 --only-binary=:all: \
#   --platform manylinux2014_x86_64 fastapi uvicorn httpx prometheus-client tqdm (carry .whl).
set -u -o pipefail
OUT=${OUT:-gpu-session}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export PYTHONUNBUFFERED=1
deadline=$((SECONDS + ${CALL_SECONDS:-590}))
batches=1,2,4,8
modes=()
for arg in "$@"; do
  case $arg in
    --quick) batches=1,8 ;;
    --bench|--long|--reads|--prefill|--prefill-attention|--serve|--serve-long|--fp8|--fp8-tune|--qwen3-tune|--models|--sequential-warm)
      m=${arg#--}; modes+=("${m//-/_}") ;;
    *) echo "usage: OUT=DIR bash benchmarks/gpu_session.sh [--quick] [--bench | --long | --reads | --prefill |" \
            "--prefill-attention | --serve | --serve-long | --fp8 | --fp8-tune | --qwen3-tune | --models |" \
            "--sequential-warm]..." >&2
       exit 2 ;;
  esac
done
[ ${#modes[@]} -eq 0 ] && modes=(default)
left() { echo $((deadline - SECONDS)); }
stage() {  # name, timeout (s), command...: the timeout cut to what is left of the call
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  [ "$limit" -gt "$(left)" ] && limit=$(left)
  if [ "$limit" -lt 10 ]; then
    echo "$name: skipped, $(left) s left of the call" | tee -a "$OUT/summary.log"
    return
  fi
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "$name: rc=$? in $((SECONDS - t0)) s ($(date -u +%H:%M:%S) UTC)" | tee -a "$OUT/summary.log"
  tail -4 "$OUT/$name.log"
}
bench() {  # stage name, timeout (s), mkc bench arguments...
  local name=$1 limit=$2; shift 2
  stage "$name" "$limit" python3 -m mkc.cli bench --config configs/north_mini_code.yaml --random-weights \
    --reps 20 -o "$OUT/${name//_/-}" "$@"
}
wheels_installed=0
wheels() {  # the serving wheels the device image lacks, from .whl/, once a call
  [ $wheels_installed = 1 ] && return
  stage wheels 60 python3 -m pip install -q --no-index --find-links .whl fastapi uvicorn httpx prometheus-client tqdm
  wheels_installed=1
}

run_reads() {
  stage sm_stream 120 python3 benchmarks/sm_stream.py --json "$OUT/sm_stream.json"
  stage sm_stream_l2 120 python3 benchmarks/sm_stream.py --l2 --json "$OUT/sm_stream_l2.json"
}

run_prefill() {
  wheels
  stage prefill_tests 200 python3 -m pytest -q -m gpu -p no:cacheprovider -rs tests/test_prefill_gpu.py \
    tests/test_backends_gpu.py tests/test_engine.py
  stage prefill_speed 280 python3 benchmarks/prefill_speed.py --prompts 1024,8192,32768 --profile 8192 \
    --reference-prompts 1024 --chunks 2048,8192 --sub-chunks 2048,4096,8192 -o "$OUT/prefill.json"
  local base name
  for base in ${BASE:+${BASE//:/ }}; do  # 8K and 32K in calls of 8192 and the profile over each other tree's library
    name=$(basename "$base")
    stage "install_$name" 60 python3 -m pip install -q --upgrade --no-deps --no-build-isolation \
      --target "/tmp/site-$name" "$base"
    PYTHONPATH=/tmp/site-$name stage "prefill_speed_$name" 150 python3 benchmarks/prefill_speed.py --profile 8192 \
      --prompts 8192,32768 --reference-prompts "" --chunks 8192 -o "$OUT/prefill-$name.json"
  done
}

run_prefill_attention() {
  stage prefill_attention 240 python3 benchmarks/prefill_attention.py --prompts 8192,32768 --chunk 8192 \
    -o "$OUT/prefill_attention.json"
}

run_serve() {  # serve or serve_long
  local kind=$1 url=http://127.0.0.1:8011 context server streams
  wheels
  local t0=$SECONDS wait_limit=240
  [ "$wait_limit" -gt "$(left)" ] && wait_limit=$(left)
  if [ "$kind" = serve ]; then context=(--context 16384); else
    # a 32K prompt beside 7 streams: a paged pool of 256 pages of 256 positions (6.5 GB of KV)
    context=(--context 40960 --kv-layout paged --page-size 256 --kv-pages 256)
  fi
  python3 -m mkc.cli serve --config configs/north_mini_code.yaml --random-weights --backend cuda --max-batch 8 \
    "${context[@]}" --port 8011 > "$OUT/server${kind#serve}.log" 2>&1 &
  server=$!
  until curl -sf "$url/health" > /dev/null 2>&1; do
    if ! kill -0 $server 2> /dev/null || [ $((SECONDS - t0)) -gt $wait_limit ]; then break; fi
    sleep 1
  done
  echo "$kind: server start to healthy: $((SECONDS - t0)) s" | tee -a "$OUT/summary.log"
  load() {  # stage name, timeout (s), mkc bench-serve arguments...
    local name=$1 limit=$2; shift 2
    stage "$name" "$limit" python3 -m mkc.cli bench-serve --url "$url" --vocab-size 262144 -o "$OUT/$name.json" "$@"
  }
  if [ "$kind" = serve_long ]; then
    # 7 streams decode; 6 s later a 32K prompt arrives: the streams' ITL p99, and its TTFT
    load long_streams 90 --num-requests 7 --concurrency 7 --prompt-len 512 --output-len 1536 --seed 1 &
    streams=$!
    sleep 6
    load long_prompt 60 --num-requests 1 --prompt-len 32768 --output-len 2 --seed 2
    wait $streams
    load ttft_32k 90 --num-requests 2 --concurrency 1 --prompt-len 32768 --output-len 2 --seed 3
    curl -s "$url/metrics" > "$OUT/metrics_long.txt"
    kill $server; wait $server 2> /dev/null
    return
  fi
  load ttft_8k 60 --num-requests 3 --concurrency 1 --prompt-len 8192 --output-len 2
  load lone 40 --num-requests 1 --concurrency 1 --prompt-len 512 --output-len 256
  load eight 60 --num-requests 8 --concurrency 8 --prompt-len 7936 --output-len 256
  load eight_sampled 40 --num-requests 8 --concurrency 8 --prompt-len 512 --output-len 256 --temperature 0.8 \
    --top-p 0.95
  # 7 streams decode (about 2,000 steps); 4 s later an 8K prompt arrives: the streams' ITL p99
  load interleave_streams 60 --num-requests 7 --concurrency 7 --prompt-len 512 --output-len 2048 --seed 1 &
  streams=$!
  sleep 4
  load interleave_prompt 30 --num-requests 1 --prompt-len 8192 --output-len 2 --seed 2
  wait $streams
  curl -s "$url/metrics" > "$OUT/metrics.txt"
  kill $server; wait $server 2> /dev/null
  bench bench 100 --batch 1,8 --context 8192
}

run_fp8() {
  stage fp8_tests 200 python3 -m pytest -q -m gpu -p no:cacheprovider -rs tests/test_fp8_gpu.py
  bench bench_fp8 330 --batch 1,2,4,8 --context 8192 --weights bf16,fp8
}

run_fp8_tune() {
  MKC_TUNING_FILE=$OUT/tuning.json bench tune_fp8_b1 280 --batch 1 --context 8192 --weights fp8 --tune
  MKC_TUNING_FILE=$OUT/tuning.json bench tune_fp8_b8 280 --batch 8 --context 8192 --weights fp8 --tune
}

run_qwen3_tune() {
  for b in 1 8; do
    MKC_TUNING_FILE=$OUT/tuning.json stage "tune_qwen3_b$b" 280 python3 -m mkc.cli bench \
      --config configs/qwen3_30b_a3b.yaml --random-weights --reps 20 --batch $b --context 8192 --tune \
      -o "$OUT/tune-qwen3-b$b"
  done
}

run_models() {
  for model in qwen3_30b_a3b qwen3_0_6b tinyllama_1_1b smollm2_135m; do
    stage "bench_$model" 130 python3 -m mkc.cli bench --config "configs/$model.yaml" --random-weights --reps 20 \
      --batch 1,8 --context 8192 --profile -o "$OUT/bench-$model"
  done
}

run_sequential_warm() {
  local variants="default warm-o-splits-ef warm-qkv-splits-ef warm-qkv-splits-o-combine-ef warm-qkv-o-ef"
  stage warm_tinyllama 260 python3 benchmarks/kernel_variants.py --config configs/tinyllama_1_1b.yaml \
    --batch 1 --context 8192 --rounds 2 --variants $variants
  stage warm_qwen3 260 python3 benchmarks/kernel_variants.py --config configs/qwen3_30b_a3b.yaml \
    --batch 1 --context 8192 --rounds 2 --variants $variants
}

run_long() {
  bench bench_long 270 --batch 1,8 --context 32768,131072
  bench bench_long_paged 270 --batch 1,8 --context 32768,131072 --page-size 256
}

run_default() {  # default (--quick: batch 1 and 8) and bench
  local kind=$1
  if [ "$kind" = default ]; then
    stage gpu_tests 380 python3 -m pytest -q -m gpu -p no:cacheprovider -rs tests/test_gpu.py \
      tests/test_families_gpu.py tests/test_generate_gpu.py tests/test_backends_gpu.py tests/test_paged_kv.py \
      tests/test_transformers_oracle.py
  fi
  bench bench 100 --batch "$batches" --context 8192
  [ "$kind" = bench ] && bench bench_paged 100 --batch "$batches" --context 8192 --page-size 256
  stage profile 60 python3 benchmarks/megakernel_step.py --batch 1 8 --context 8192 --reps 10 --profile "$OUT/prof"
}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/env.log" 2>&1
stage pip 20 python3 -m pip install -q --no-deps --no-build-isolation -e .
for mode in "${modes[@]}"; do
  case $mode in
    default|bench) run_default "$mode" ;;
    serve|serve_long) run_serve "$mode" ;;
    *) "run_$mode" ;;
  esac
done
# the device tool brings back at most 8 files: everything in one archive beside the summary
(cd "$OUT" && tar czf /tmp/gpu_session_out.tgz --exclude=out.tgz . && find . -mindepth 1 ! -name summary.log -delete \
  && mv /tmp/gpu_session_out.tgz out.tgz)
