"""Replay a profiled step on its own schedule, then what-ifs: the same schedule with some tasks faster.

    python benchmarks/replay_profile.py TIMELINE.npz --batch 1 [--context 8192] \
        [--scale router=0.5 EXPERT_DOWN=0.75 ...] [--queue-gap LINEAR=1.0 ...]

TIMELINE.npz is written by ``benchmarks/megakernel_step.py --profile DIR`` or ``mkc bench --profile``
(``trace-b1-c8192.npz``); the schedule is planned again with the same options, so run this on the
tree the profile was taken with. Each task runs for its measured time and the gaps between tasks
are the step's own medians per opcode (mkc.schedule.profile: measured_gaps, replay). The replay of
the unchanged step comes first, beside the measured span, as a check of the model. Each ``--scale NAME=F`` multiplies the run time of the
tasks of one opcode (EXPERT_DOWN) or one label (router: the tasks named ``L<i>.router[...]``) by F;
each ``--queue-gap OP=US`` sets one opcode's gap after the task before it on its SM. Every what-if
is replayed alone, then all together. Durations are held fixed, so a what-if that would change
which tasks stream at once (and so their rates) is only a first estimate: a lever to measure.
"""

from __future__ import annotations

import argparse
import dataclasses

import numpy as np
import profiled

from mkc.schedule.profile import Gaps, measured_gaps, replay


def label(name: str) -> str:
    """A task's label: its name without the layer and the tile ("L10.expert_up[slot2][64:128]" →
    "expert_up")."""
    return name.split(".", 1)[-1].split("[", 1)[0]


def pairs(items: list[str], flag: str) -> list[tuple[str, float]]:
    out = []
    for item in items:
        key, _, value = item.partition("=")
        try:
            out.append((key, float(value)))
        except ValueError:
            raise SystemExit(f"{flag} {item}: expected NAME=NUMBER") from None
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    profiled.add_arguments(ap)
    ap.add_argument("--scale", nargs="*", default=[], metavar="NAME=F",
                    help="multiply the run time of an opcode's or a label's tasks by F")
    ap.add_argument("--queue-gap", nargs="*", default=[], metavar="OP=US",
                    help="set an opcode's gap after the task before it on its SM (µs)")
    a = ap.parse_args()
    sc, tl = profiled.load(a)
    run = tl["end"] - tl["start"]
    gaps = measured_gaps(sc, tl["start"], tl["end"])
    ops = {t.op.name for t in sc.tasks}
    labels = [label(t.name) for t in sc.tasks]
    scales, queue_gaps = pairs(a.scale, "--scale"), pairs(a.queue_gap, "--queue-gap")
    for name, _ in scales:
        if name not in ops and name not in labels:
            raise SystemExit(f"--scale {name}: expected an opcode ({', '.join(sorted(ops))}) or a task label "
                             f"({', '.join(sorted(set(labels)))})")
    for op, _ in queue_gaps:
        if op not in ops:
            raise SystemExit(f"--queue-gap {op}: expected an opcode ({', '.join(sorted(ops))})")

    def span(run_us, g: Gaps) -> float:
        start, end = replay(sc, run_us, g)
        return float(end.max() - start.min())

    measured = float(tl["end"].max() - tl["start"].min())
    base = span(run, gaps)
    print(f"measured span {measured:.1f} µs; replayed {base:.1f} µs ({base / measured - 1:+.1%})")
    print("gaps (µs, median): after a producer " + ", ".join(f"{k} {v:.2f}" for k, v in sorted(gaps.after_producer.items()))
          + "; after the task before on the SM " + ", ".join(f"{k} {v:.2f}" for k, v in sorted(gaps.after_queue.items())))

    def scaled(run_us, name: str, f: float):
        hit = np.array([t.op.name == name or labels[t.id] == name for t in sc.tasks])
        return np.where(hit, run_us * f, run_us)

    def with_gap(g: Gaps, op: str, us: float) -> Gaps:
        return dataclasses.replace(g, after_queue={**g.after_queue, op: us})

    every_run, every_gap = run, gaps
    for name, f in scales:
        s = span(scaled(run, name, f), gaps)
        print(f"  {name} run x {f:g}: {s:.1f} µs ({s - base:+.1f})")
        every_run = scaled(every_run, name, f)
    for op, us in queue_gaps:
        s = span(run, with_gap(gaps, op, us))
        print(f"  {op} queue gap {gaps.queue(op):.2f} -> {us:g} µs: {s:.1f} µs ({s - base:+.1f})")
        every_gap = with_gap(every_gap, op, us)
    if len(scales) + len(queue_gaps) > 1:
        s = span(every_run, every_gap)
        print(f"  all together: {s:.1f} µs ({s - base:+.1f})")


if __name__ == "__main__":
    main()
