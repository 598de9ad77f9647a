"""Compare the scheduler's cost model with a profiled step, per opcode.

    python benchmarks/calibrate_cost.py TIMELINE.npz --batch 1 [--context 8192] [--num-sms 132]

TIMELINE.npz is written by ``benchmarks/megakernel_step.py --profile DIR`` (one real step of the
megakernel: each task's wait / start / end). The schedule is lowered again from the same options,
so run this on the tree the profile was taken with. For every opcode it prints the measured mean
run time, a least-squares fit run ≈ fixed + bytes / rate over its tasks, and the cost model's mean
prediction (mkc/schedule/cost.py): the numbers ``OP_FIXED_US`` is re-measured from.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from mkc.ir.spec import load_spec
from mkc.schedule.cost import fit_op_costs
from mkc.schedule.plan import plan

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("timeline")
    ap.add_argument("--config", default=str(ROOT / "configs" / "north_mini_code.yaml"))
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--num-sms", type=int, default=132)
    ap.add_argument("--page-size", type=int, default=0)
    ap.add_argument("--attention-sms", type=int, default=None, help="as profiled (default: the compiler's choice)")
    a = ap.parse_args()
    spec = load_spec(a.config)
    sc = plan(spec, a.batch, a.context, a.num_sms, page_size=a.page_size, attention_sms=a.attention_sms)
    tl = np.load(a.timeline)
    if len(tl["end"]) != len(sc.tasks) or not np.array_equal(tl["op"], [int(t.op) for t in sc.tasks]):
        raise SystemExit(f"{a.timeline}: its tasks are not this tree's schedule for batch {a.batch}, "
                         f"context {a.context}: profile again with the same options")
    fits = fit_op_costs(sc.tasks, tl["end"] - tl["start"], a.num_sms)
    print(f"{'op':<14} {'tasks':>6} {'measured µs':>12} {'model µs':>9} {'fit fixed µs':>13} {'fit GB/s':>9}")
    for op, f in sorted(fits.items(), key=lambda kv: -kv[1].tasks * kv[1].mean_us):
        rate = "one size" if np.isnan(f.gbps) else f"{f.gbps:.1f}"  # one size: fixed at the fair share
        print(f"{op:<14} {f.tasks:>6} {f.mean_us:>12.2f} {f.predicted_us:>9.2f} {f.fixed_us:>13.2f} {rate:>9}")
    print(f"step: measured {tl['end'].max():.0f} µs, predicted {sc.predicted['step_us']:.0f} µs")


if __name__ == "__main__":
    main()
