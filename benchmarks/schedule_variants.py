"""Step time of schedules made with different cost-model assumptions, side by side in one run.

    python benchmarks/schedule_variants.py --batch 1 8 --context 8192 [--reps 20] [--variants NAME ...]

Every variant lowers the same program and runs the same default kernel over the same weights and
KV cache; only the scheduler's cost model (mkc/schedule/cost.py: Ceilings) differs, so only the
placement, queue order and counters change. The profile of 2026-11-29 (BENCHMARKS.md, "Where the
time goes now") found the model optimistic between tasks: it credits up to 96 KB of prefetch per
task as overlap with its wait and charges 0.6 µs per hand-off, while the critical chain measured
0.75 µs a hop and no overlap. Timing as megakernel_step.py: one warm-up, then ``reps`` steps timed
one by one with CUDA events, median.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import torch

from mkc.ir.lower import lower
from mkc.ir.spec import load_spec
from mkc.runtime.bench import (
    device_random_weights,
    fill_random_kv,
    measure_read_bandwidth,
    release,
    time_step,
)
from mkc.runtime.cuda_backend import CudaDecoder
from mkc.schedule.cost import H200
from mkc.schedule.scheduler import schedule

ROOT = Path(__file__).resolve().parents[1]

VARIANTS = {
    "default": H200,
    "no-prefetch-credit": dataclasses.replace(H200, prefetch_bytes=0),
    "no-credit-1us-hops": dataclasses.replace(H200, prefetch_bytes=0, task_overhead=1.0e-6),
    # the streaming rate the profile measured per SM while all stream (~24 GB/s, 3.2 TB/s in all)
    "measured-rate": dataclasses.replace(H200, read_bw=3.2e12, prefetch_bytes=0, task_overhead=0.75e-6),
    "measured-rate-credit": dataclasses.replace(H200, read_bw=3.2e12, task_overhead=0.75e-6),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "north_mini_code.yaml"))
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    a = ap.parse_args()
    spec = load_spec(a.config)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    bw = measure_read_bandwidth()
    weights = device_random_weights(spec, 2026)
    print(f"read bandwidth {bw / 1e12:.2f} TB/s")
    for batch in a.batch:
        program = lower(spec, batch, a.context, sms)
        tokens = torch.randint(0, spec.vocab_size, (batch,), dtype=torch.int32)
        positions = torch.full((batch,), a.context - 1, dtype=torch.int32)
        for name in a.variants:
            sc = schedule(program, spec.name, VARIANTS[name])
            dec = CudaDecoder(sc, spec, weights)
            # the same KV cache for every variant
            fill_random_kv(dec, spec, torch.Generator(device="cuda").manual_seed(batch))
            dec.step(tokens, positions)
            med, sol, _ = time_step(dec, spec, batch, a.context, bw, a.reps)
            print(f"batch {batch} {name:<20} measured {med * 1e6:8.1f} µs ({sol:.1%} SOL), "
                  f"predicted {sc.predicted['step_us']:8.1f} µs", flush=True)
            release(dec)
            del dec


if __name__ == "__main__":
    main()
