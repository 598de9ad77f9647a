"""Replay a profiled step on its own schedule, then what-ifs: the same schedule with some tasks faster.

    python benchmarks/replay_profile.py TIMELINE.npz --batch 1 [--context 8192] \
        [--scale router=0.5 EXPERT_DOWN=0.75 ...] [--cut EXPERT_SWIGLU=2 expert_up@qkv=3 ...] \
        [--queue-gap LINEAR=1.0 ...] \
        [--place-greedily o_proj expert_down] [--lowering residual_in_o_proj=1 ...]

TIMELINE.npz is written by ``benchmarks/megakernel_step.py --profile DIR`` or ``mkc bench --profile``
(``trace-b1-c8192.npz``); the schedule is planned again with the same options, so run this on the
tree the profile was taken with (``--lowering``: the lowering choices it was profiled with, as
``megakernel_step.py --lowering`` takes them). Each task runs for its measured time and the gaps between tasks
are the step's own medians per opcode (mkc.schedule.profile: measured_gaps, replay). The replay of
the unchanged step comes first, beside the measured span, as a check of the model. Each ``--scale NAME=F`` multiplies the run time of the
tasks of one opcode (EXPERT_DOWN) or one label (router: the tasks named ``L<i>.router[...]``) by F;
each ``--cut NAME=US`` takes US µs off each such task's run (down to a tenth of it), and
``--cut NAME@BEFORE=US`` only off those that run right after a task of label or opcode BEFORE of
their own layer on their SM (expert_up@qkv: the expert tiles behind a QKV tile), a fixed cost
hidden or removed;
each ``--queue-gap OP=US`` sets one opcode's gap after the task before it on its SM. Every what-if
is replayed alone, then all together. Durations are held fixed, so a what-if that would change
which tasks stream at once (and so their rates) is only a first estimate: a lever to measure.
``--place-greedily LABEL ...`` moves those labels' tasks, layer by layer, onto the SM that frees
first in the replay (greedy_tail): what an oracle's placement of a layer's tail would gain.
"""

from __future__ import annotations

import argparse
import dataclasses

import numpy as np
import profiled

from mkc.ir.lower import lower
from mkc.schedule.plan import LOWERING_CHOICES
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


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    profiled.add_arguments(ap)
    ap.add_argument("--scale", nargs="*", default=[], metavar="NAME=F",
                    help="multiply the run time of an opcode's or a label's tasks by F")
    ap.add_argument("--cut", nargs="*", default=[], metavar="NAME[@BEFORE]=US",
                    help="take US µs off the run of an opcode's or a label's tasks (with @BEFORE: only those "
                         "right after a task of that label or opcode of their layer on their SM)")
    ap.add_argument("--queue-gap", nargs="*", default=[], metavar="OP=US",
                    help="set an opcode's gap after the task before it on its SM (µs)")
    ap.add_argument("--place-greedily", nargs="*", default=[], metavar="LABEL",
                    help="what-if: these labels' tasks (o_proj, expert_down) placed layer by layer on the SM "
                         "that frees first in the replay (an oracle's bound)")
    return ap.parse_args()


def main() -> None:
    a = parse_args()
    sc, tl = profiled.load(a)
    run = tl["end"] - tl["start"]
    gaps = measured_gaps(sc, tl["start"], tl["end"])
    labels = [label(t.name) for t in sc.tasks]
    scales, queue_gaps = pairs(a.scale, "--scale"), pairs(a.queue_gap, "--queue-gap")
    cuts = pairs(a.cut, "--cut")
    check_names(sc, labels, scales, cuts, queue_gaps)
    measured = float(tl["end"].max() - tl["start"].min())
    base = span(sc, run, gaps)
    print(f"measured span {measured:.1f} µs; replayed {base:.1f} µs ({base / measured - 1:+.1%})")
    print("gaps (µs, median): after a producer "
          + ", ".join(f"{k} {v:.2f}" for k, v in sorted(gaps.after_producer.items()))
          + "; after the task before on the SM "
          + ", ".join(f"{k} {v:.2f}" for k, v in sorted(gaps.after_queue.items())))
    print_what_ifs(sc, labels, run, gaps, base, scales, cuts, queue_gaps)
    if a.place_greedily:
        print_greedy_placement(a, sc, labels, run, gaps)


def check_names(sc, labels: list[str], scales: list[tuple[str, float]], cuts: list[tuple[str, float]],
                queue_gaps: list[tuple[str, float]]) -> None:
    """SystemExit naming the opcodes and labels of the schedule if a what-if names neither."""
    ops = {t.op.name for t in sc.tasks}
    names = [(name, "--scale") for name, _ in scales]
    names += [(n, "--cut") for name, _ in cuts for n in name.split("@")]
    for name, flag in names:
        if name not in ops and name not in labels:
            raise SystemExit(f"{flag} {name}: expected an opcode ({', '.join(sorted(ops))}) or a task label "
                             f"({', '.join(sorted(set(labels)))})")
    for op, _ in queue_gaps:
        if op not in ops:
            raise SystemExit(f"--queue-gap {op}: expected an opcode ({', '.join(sorted(ops))})")


def span(sc, run_us, g: Gaps) -> float:
    """The replayed step's span in µs, with these run times and gaps."""
    start, end = replay(sc, run_us, g)
    return float(end.max() - start.min())


def is_named(sc, labels: list[str], t: int, name: str) -> bool:
    """Whether task t has opcode or label ``name``."""
    return sc.tasks[t].op.name == name or labels[t] == name


def scaled_runs(sc, labels: list[str], run_us, name: str, f: float):
    """Run times with those of the tasks named ``name`` (opcode or label) multiplied by f."""
    hit = np.array([t.op.name == name or labels[t.id] == name for t in sc.tasks])
    return np.where(hit, run_us * f, run_us)


def cut_runs(sc, labels: list[str], before: list[int], run_us, name: str, us: float):
    """Run times with us µs taken off each task named ``name`` ("WHAT@AFTER": only those right after
    a task named AFTER of their layer on their SM), down to a tenth of its run."""
    what, _, after = name.partition("@")
    hit = np.array([is_named(sc, labels, t.id, what)
                    and (not after or (before[t.id] >= 0 and is_named(sc, labels, before[t.id], after)
                                       and sc.tasks[before[t.id]].layer == t.layer))
                    for t in sc.tasks])
    return np.where(hit, np.maximum(run_us - us, 0.1 * run_us), run_us)


def with_gap(g: Gaps, op: str, us: float) -> Gaps:
    return dataclasses.replace(g, after_queue={**g.after_queue, op: us})


def print_what_ifs(sc, labels: list[str], run, gaps: Gaps, base: float, scales: list[tuple[str, float]],
                   cuts: list[tuple[str, float]], queue_gaps: list[tuple[str, float]]) -> None:
    """Each --scale, --cut and --queue-gap replayed alone against ``base``, then all together."""
    before = [-1] * len(sc.tasks)  # the task before each on its SM
    for q in sc.queues:
        for i in range(1, len(q)):
            before[q[i]] = q[i - 1]
    every_run, every_gap = run, gaps
    for name, f in scales:
        s = span(sc, scaled_runs(sc, labels, run, name, f), gaps)
        print(f"  {name} run x {f:g}: {s:.1f} µs ({s - base:+.1f})")
        every_run = scaled_runs(sc, labels, every_run, name, f)
    for name, us in cuts:
        s = span(sc, cut_runs(sc, labels, before, run, name, us), gaps)
        print(f"  {name} run - {us:g} µs: {s:.1f} µs ({s - base:+.1f}, {s / base - 1:+.1%})")
        every_run = cut_runs(sc, labels, before, every_run, name, us)
    for op, us in queue_gaps:
        s = span(sc, run, with_gap(gaps, op, us))
        print(f"  {op} queue gap {gaps.queue(op):.2f} -> {us:g} µs: {s:.1f} µs ({s - base:+.1f})")
        every_gap = with_gap(every_gap, op, us)
    if len(scales) + len(cuts) + len(queue_gaps) > 1:
        s = span(sc, every_run, every_gap)
        print(f"  all together: {s:.1f} µs ({s - base:+.1f})")


def print_greedy_placement(a: argparse.Namespace, sc, labels: list[str], run, gaps: Gaps) -> None:
    """--place-greedily: the step replayed with those labels' tasks placed by greedy_tail, against
    the same queues replayed on every edge of the DAG of the lowering the profile was taken with."""
    unknown = sorted(set(a.place_greedily) - set(labels))
    if unknown:
        raise SystemExit(f"--place-greedily {', '.join(unknown)}: expected task labels "
                         f"({', '.join(sorted(set(labels)))})")
    lowering = {k: sc.meta[k] for k in LOWERING_CHOICES}  # as plan() lowered it (a measured entry's too)
    g = lower(profiled.spec_of(a), a.batch, a.context, a.num_sms, page_size=a.page_size,
              attention_sms=sc.meta["attention_sms"]["chosen"], **lowering).graph
    preds = [list(g.predecessors(t)) for t in range(len(sc.tasks))]
    base = float(np.max(replay(sc, run, gaps, sc.queues, preds)[1]))
    queues = greedy_tail(sc, preds, run, gaps, set(a.place_greedily))
    s = float(np.max(replay(sc, run, gaps, queues, preds)[1]))
    print(f"  {', '.join(a.place_greedily)} placed greedily, layer by layer: {s:.1f} µs ({s - base:+.1f} "
          f"against {base:.1f}, the same queues replayed on every DAG edge)")


def greedy_tail(sc, preds: list[list[int]], run_us, gaps: Gaps, tail: set[str]) -> list[list[int]]:
    """An oracle's placement: layer by layer, the tasks with a label in ``tail`` taken off their
    queues and, in the order their producers end (replayed), each put on the SM that frees first
    (the end of its tasks of this layer or earlier before its first residual tile, next-layer task
    or task that waits for a moved one), where it goes. Run times stay the measured ones, so this bounds what a placement rule
    could gain, not what it would."""
    queues = [list(q) for q in sc.queues]
    succs: list[list[int]] = [[] for _ in sc.tasks]
    for t, ps in enumerate(preds):
        for p in ps:
            succs[p].append(t)
    for layer in range(1, max(t.layer for t in sc.tasks)):
        _, end = replay(sc, run_us, gaps, queues, preds)
        moved = {t.id for t in sc.tasks if t.layer == layer and label(t.name) in tail}
        # the layer's tasks that wait (through others) for a moved one stay after it on every SM
        after, todo = set(), [u for t in moved for u in succs[t]]
        while todo:
            u = todo.pop()
            if u not in after and u not in moved and sc.tasks[u].layer == layer:
                after.add(u)
                todo.extend(succs[u])
        kept, cut, free = [], [], []
        for q in queues:
            k = [t for t in q if t not in moved]
            i = next((j for j, t in enumerate(k) if sc.tasks[t].layer > layer or t in after
                      or (sc.tasks[t].layer == layer and label(sc.tasks[t].name) == "residual")), len(k))
            kept.append(k)
            cut.append(i)
            free.append(max((end[t] for t in k[:i]), default=0.0))
        placed: list[list[int]] = [[] for _ in queues]
        ready = {t: max((end[p] for p in preds[t]), default=0.0) for t in moved}
        for t in sorted(moved, key=lambda t: (ready[t], t)):
            sm = min(range(len(queues)), key=lambda s: (max(free[s], ready[t]), s))
            placed[sm].append(t)
            free[sm] = max(free[sm], ready[t] + gaps.producer(sc.tasks[t].op.name)) + run_us[t]
        queues = [k[:i] + p + k[i:] for k, i, p in zip(kept, cut, placed)]
    return queues


if __name__ == "__main__":
    main()
