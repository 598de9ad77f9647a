"""The shared-bandwidth simulation against the profiled steps of several models, and its per-opcode
fixed times refitted over all of them at once (the cost model must hold for any model, not one).

    python benchmarks/calibrate_models.py DIR [DIR ...] [--num-sms 132]

Each DIR is the output of ``mkc bench --config configs/MODEL.yaml --random-weights --profile -o DIR``
(bench.json and one trace-bB-cC.npz per bf16 point; ``benchmarks/gpu_session.sh --models`` writes one
per model). Every point's schedule is planned again, so run this on the tree the profiles were
taken with. It prints, per point, the measured step beside the simulated one (at the run's read
bandwidth) with the shipped fixed times (cost.SIM_FIXED_US) and with the refitted ones, then the
refitted table: per opcode, a least-squares line run ≈ fixed + bytes / rate through every profiled
task of every model (calibrate_cost.py fits one step so), its intercept the fixed time.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import NamedTuple

import numpy as np

from mkc.ir.spec import load_spec
from mkc.schedule.cost import H200, SIM_FIXED_US, Ceilings, fit_run_line
from mkc.schedule.plan import plan
from mkc.schedule.schedule import Schedule
from mkc.schedule.simulate import simulated_step_us

ROOT = Path(__file__).resolve().parents[1]
MIN_FIXED_US = 0.5  # a fit below this (a tile that streams faster than its share) is clamped to it


class Point(NamedTuple):
    model: str
    batch: int
    context: int
    measured_us: float  # bench.json's median step
    read_bw: float  # bytes/s, measured in the same run
    schedule: Schedule
    run_us: np.ndarray  # each task's profiled run time (end - start), by task id


def load_points(dirs: list[Path], num_sms: int) -> list[Point]:
    """Every megakernel point of the bench outputs ``dirs`` that has a profile; SystemExit naming
    what is missing or does not match this tree."""
    points = []
    for d in dirs:
        try:
            bench = json.loads((d / "bench.json").read_text())
        except (OSError, ValueError) as e:
            raise SystemExit(f"{d}: no readable bench.json ({e}): expected an `mkc bench --profile -o DIR` output")
        model, page_size = bench["meta"]["model"], bench["meta"].get("page_size", 0)
        spec = load_spec(ROOT / "configs" / f"{model}.yaml")
        for r in bench["rows"]:
            if r["engine"] != "mkc":  # the baseline, or another weight format (planned otherwise)
                continue
            npz = d / f"trace-b{r['batch']}-c{r['context']}.npz"
            if not npz.exists():
                print(f"{npz}: not profiled: point left out", file=sys.stderr)
                continue
            sc = plan(spec, r["batch"], r["context"], num_sms, page_size=page_size)
            tl = np.load(npz)
            if len(tl["end"]) != len(sc.tasks) or not np.array_equal(tl["op"], [int(t.op) for t in sc.tasks]):
                raise SystemExit(f"{npz}: its tasks are not this tree's schedule of {model} at batch {r['batch']}, "
                                 f"context {r['context']}: profile again on this tree")
            points.append(Point(model, r["batch"], r["context"], r["step_us"], r["read_bw"], sc,
                                np.asarray(tl["end"] - tl["start"], dtype=np.float64)))
    if not points:
        raise SystemExit("no profiled megakernel point in " + ", ".join(map(str, dirs)))
    return points


def refit_fixed_us(points: list[Point]) -> dict[str, tuple[float, float, int]]:
    """Per opcode over every task of every point: (fixed µs, GB/s, tasks) of run ≈ fixed + bytes /
    rate; an opcode whose tasks all read the same bytes gets its mean run time less those bytes at
    the fair share of the slowest run's bandwidth (rate unknown: NaN)."""
    xs: dict[str, list[float]] = {}
    ys: dict[str, list[float]] = {}
    share: dict[str, float] = {}
    for p in points:
        fair = p.read_bw / len(p.schedule.queues) / 1e6  # bytes per µs
        for t in p.schedule.tasks:
            xs.setdefault(t.op.name, []).append(t.weight_bytes + t.act_bytes)
            ys.setdefault(t.op.name, []).append(p.run_us[t.id])
            share[t.op.name] = min(share.get(t.op.name, np.inf), fair)
    out = {}
    for op, sizes in xs.items():
        fixed, gbps = fit_run_line(np.array(sizes, dtype=np.float64), np.array(ys[op]), share[op])
        out[op] = (max(fixed, MIN_FIXED_US), gbps, len(sizes))
    return out


def report(points: list[Point], fits: dict[str, tuple[float, float, int]]) -> str:
    refit = {**SIM_FIXED_US, **{op: round(f, 2) for op, (f, _, _) in fits.items()}}
    head = (f"{'model':<16} {'batch':>5} {'context':>7} {'measured µs':>12} {'simulated':>10} {'':>7} "
            f"{'refitted':>10} {'':>7}")
    lines = [head]
    for p in points:
        shipped: Ceilings = dataclasses.replace(H200, read_bw=p.read_bw)
        now = simulated_step_us(p.schedule, shipped)
        new = simulated_step_us(p.schedule, dataclasses.replace(shipped, sim_fixed_us=refit))
        lines.append(f"{p.model:<16} {p.batch:>5} {p.context:>7} {p.measured_us:>12.1f} {now:>10.1f} "
                     f"{now / p.measured_us - 1:>+7.1%} {new:>10.1f} {new / p.measured_us - 1:>+7.1%}")
    lines += ["", f"{'op':<18} {'tasks':>7} {'fixed µs':>9} {'GB/s':>8} {'shipped µs':>11}"]
    for op, (fixed, gbps, n) in sorted(fits.items(), key=lambda kv: -kv[1][2]):
        rate = "one size" if np.isnan(gbps) else f"{gbps:.1f}"
        lines.append(f"{op:<18} {n:>7} {fixed:>9.2f} {rate:>8} {SIM_FIXED_US.get(op, float('nan')):>11.2f}")
    lines += ["", "SIM_FIXED_US refitted: " + json.dumps(refit)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dirs", nargs="+", type=Path, help="mkc bench --profile -o DIR outputs")
    ap.add_argument("--num-sms", type=int, default=132)
    a = ap.parse_args(argv)
    points = load_points(a.dirs, a.num_sms)
    print(report(points, refit_fixed_us(points)))


if __name__ == "__main__":
    main()
