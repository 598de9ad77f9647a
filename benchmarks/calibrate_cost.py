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

import numpy as np
import profiled

from mkc.schedule.cost import fit_op_costs
from mkc.schedule.simulate import simulated_step_us


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    profiled.add_arguments(ap)
    a = ap.parse_args()
    sc, tl = profiled.load(a)
    fits = fit_op_costs(sc.tasks, tl["end"] - tl["start"], a.num_sms)
    print(f"{'op':<14} {'tasks':>6} {'measured µs':>12} {'model µs':>9} {'fit fixed µs':>13} {'fit GB/s':>9}")
    for op, f in sorted(fits.items(), key=lambda kv: -kv[1].tasks * kv[1].mean_us):
        rate = "one size" if np.isnan(f.gbps) else f"{f.gbps:.1f}"  # one size: fixed at the fair share
        print(f"{op:<14} {f.tasks:>6} {f.mean_us:>12.2f} {f.predicted_us:>9.2f} {f.fixed_us:>13.2f} {rate:>9}")
    print(f"step: measured {tl['end'].max():.0f} µs, predicted {sc.predicted['step_us']:.0f} µs (list scheduler), "
          f"{simulated_step_us(sc):.0f} µs (shared-bandwidth simulation, mkc/schedule/simulate.py)")


if __name__ == "__main__":
    main()
