"""Step time of megakernel variants (codegen options) on North Mini Code, side by side in one run.

    python benchmarks/kernel_variants.py --batch 1 8 --context 8192 [--reps 20] [--variants NAME ...] [--rounds 2]

Each variant is a set of CodegenOptions (one kernel binary each); every variant runs the same
schedule, weights and KV cache, so differences are the kernel's alone. Timing as in
megakernel_step.py: one warm-up, then ``reps`` steps timed one by one with CUDA events, median.
Variants that differ only in prefetch hints or in how weights reach the registers (register batches
or the shared-memory ring) compute bitwise the same step: each variant's logits are compared with
the first variant's, and the same step is rerun (--repeat) to check it is deterministic.

The kernels need no GPU to build: ``--build-only`` compiles them on any machine with NVRTC into
the kernel cache (``MKC_CACHE_DIR``), and a GPU machine with the same NVRTC version finds them
there (the cache key leaves out include paths). Building into ``$PWD/.mkc-cache/h`` before a lent
GPU's call and naming ``.mkc-cache`` (git ignores it) among the paths the call carries sends them
with the working tree, so the call spends its time measuring: 16 variant runs at batch 1 and 4
took 47 s on an H200 that way (2026-12-02).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from mkc.codegen import CodegenOptions, build_kernel
from mkc.ir.spec import load_spec
from mkc.runtime.bench import (
    bench_tokens,
    decoder_in_place,
    device_random_weights,
    fill_bench_kv,
    format_rounds,
    in_turn,
    measure_read_bandwidth,
    time_step,
)
from mkc.schedule.plan import plan

ROOT = Path(__file__).resolve().parents[1]

# "default" is today's default (CodegenOptions()); each other variant changes one or two options.
VARIANTS: dict[str, CodegenOptions] = {
    "default": CodegenOptions(),
    "unroll-4": CodegenOptions(gemv_unroll=4),
    "unroll-6": CodegenOptions(gemv_unroll=6),
    "unroll-12": CodegenOptions(gemv_unroll=12),  # 12 KB per warp per batch (batch 1: 255 registers, 8 B of spills)
    "rows": CodegenOptions(weight_layout="rows"),
    # one online softmax per warp, blocks streamed through a per-warp ring (CodegenOptions.attn_warp_stages)
    "attn-warps-2": CodegenOptions(attn_warp_stages=2),
    "attn-warps-3": CodegenOptions(attn_warp_stages=3),
    # the routing's picks by rank, one thread per (token, expert), instead of TOP_K arg-max rounds
    # (the same picks and weights: bitwise the same logits)
    "routing-rank": CodegenOptions(routing_argmax="rank", norm_beside_routing="off"),
    # an expert gate/up tile's input normalised by warps 1.. while warp 0 derives the routing, with
    # the arg-max rounds or the ranks (the default at batch 1: "auto"); "redux-after" is neither (the
    # default at batch 1 until 2026-12-03)
    "norm-beside-routing": CodegenOptions(norm_beside_routing="on", routing_argmax="redux"),
    "norm-beside-rank": CodegenOptions(norm_beside_routing="on", routing_argmax="rank"),
    "redux-after": CodegenOptions(norm_beside_routing="off", routing_argmax="redux"),
    # the profiling kernel (phase marks in a profiled step; an unprofiled step runs the default's work)
    "profile-phases": CodegenOptions(profile_phases=True),
    # expert-up tiles wait for the router tiles' counter, then read the logits, or read the logits'
    # tagged copy (CodegenOptions.tagged_logits; the default "auto" is on up to batch 4 since
    # 2026-12-01)
    "counter-logits": CodegenOptions(tagged_logits="off"),
    "tagged-logits": CodegenOptions(tagged_logits="on"),
    # the epilogue of the tiles that end a layer (the O-projection at batch 1) inlined, or one
    # out-of-line function (CodegenOptions.residual_epilogue; "auto" inlines it since 2026-12-01)
    "epilogue-inline": CodegenOptions(residual_epilogue="inline"),
    "epilogue-call": CodegenOptions(residual_epilogue="call"),
    # a normed GEMV skips its staging where the task before on its SM left the same input in shared
    # memory (CodegenOptions.reuse_staged_norm, off)
    "norm-reuse": CodegenOptions(reuse_staged_norm=True),
    # L2 warm-up (CodegenOptions.l2_warm): waiting tasks ask L2 for weights a later tile of the
    # layer's chain streams; with or without the weight and KV streams marked evict-first
    # (CodegenOptions.weights_evict_first; both "auto": on at batch 2-4)
    "no-warm": CodegenOptions(l2_warm="off", weights_evict_first="off"),
    "evict-first": CodegenOptions(l2_warm="off", weights_evict_first="on"),
    "warm-o-splits": CodegenOptions(l2_warm="o_proj:splits", weights_evict_first="off"),
    "warm-o-splits-ef": CodegenOptions(l2_warm="o_proj:splits", weights_evict_first="on"),
    "warm-o-up-ef": CodegenOptions(l2_warm="o_proj:expert_up", weights_evict_first="on"),
    "warm-router-ef": CodegenOptions(l2_warm="next_router:combine", weights_evict_first="on"),
    "warm-o-router-ef": CodegenOptions(l2_warm="o_proj:splits,next_router:combine", weights_evict_first="on"),
    "warm-qkv-o-ef": CodegenOptions(l2_warm="o_proj:splits,next_qkv:combine", weights_evict_first="on"),
    "warm-o-up-router-ef": CodegenOptions(l2_warm="o_proj:expert_up,next_router:combine", weights_evict_first="on"),
    # a sequential block's attention reads little while its chain runs: the next layer's QKV
    # weights warmed by this layer's splits (and the O-projection's by its combine tasks)
    "warm-qkv-splits-ef": CodegenOptions(l2_warm="next_qkv:splits", weights_evict_first="on"),
    "warm-qkv-splits-o-combine-ef": CodegenOptions(l2_warm="next_qkv:splits,o_proj:combine", weights_evict_first="on"),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "north_mini_code.yaml"))
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--repeat", type=int, default=2, help="steps rerun on the same inputs to check determinism")
    ap.add_argument("--rounds", type=int, default=1,
                    help="time every variant this many times, in turn, every other round in reverse order (drift "
                         "between variants shows; a place in the round weighs on every variant alike)")
    ap.add_argument("--build-only", action="store_true", help="compile every variant's kernel (no GPU) and exit")
    ap.add_argument("--sms", type=int, default=132, help="SM count for --build-only")
    a = ap.parse_args()
    spec = load_spec(a.config)
    if a.build_only:
        for batch in a.batch:
            sc = plan(spec, batch, a.context, a.sms)
            for name in a.variants:
                art = build_kernel(sc, spec, VARIANTS[name])
                print(f"b{batch} {name}: {art.name} regs {art.regs} spills {art.spills}", flush=True)
        return
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    weights = device_random_weights(spec, 2026)
    bw = measure_read_bandwidth()
    print(f"read bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    for batch in a.batch:
        sc = plan(spec, batch, a.context, sms)
        tokens = bench_tokens(spec, batch)  # mkc bench's tokens and KV cache
        positions = torch.full((batch,), a.context - 1, dtype=torch.int32)
        ref = None
        times_us: dict[str, list[float]] = {name: [] for name in a.variants}
        for name in in_turn(a.variants, a.rounds):
            with decoder_in_place(sc, spec, weights, options=VARIANTS[name]) as dec:
                fill_bench_kv(dec, spec)
                logits, _ = dec.step(tokens, positions)
                repeat = all(torch.equal(logits, dec.step(tokens, positions)[0]) for _ in range(a.repeat))
                if ref is None:
                    ref = logits.clone()
                same = "bitwise equal to the first" if torch.equal(ref, logits) else (
                    f"DIFFERS from the first (max abs {float((ref - logits).abs().max()):.3g}, "
                    f"max |logit| {float(ref.abs().max()):.3g})")
                same += f"; {a.repeat} more steps " + ("bitwise the same" if repeat else "DIFFER (a race)")
                t, sol, times = time_step(dec, spec, batch, a.context, bw, a.reps)
                print(f"batch {batch} {name:<26} {t * 1e6:9.1f} µs  {batch / t:7.1f} tok/s  {sol:6.1%} SOL  "
                      f"(min {min(times) * 1e6:.1f}, max {max(times) * 1e6:.1f})  logits {same}  "
                      f"[{dec.artifact.name}, {dec.artifact.regs} regs]", flush=True)
                times_us[name].append(t * 1e6)
        print(format_rounds(batch, times_us), flush=True)


if __name__ == "__main__":
    main()
