"""Reading a measured step: where the SMs' time went and what the critical chain was.

A timeline holds, per task (task-id order), ``start`` and ``end`` in µs (the task began running /
signalled its counter) and optionally ``wait`` (it began waiting for its inputs) and ``sm``; the
megakernel records one with ``CudaDecoder.launch(profile=True)`` and ``timeline()``; a kernel built
with ``CodegenOptions.profile_phases`` adds ``staged`` (the task's inputs were staged: GEMV tiles;
the query heads of a warp attention split; NaN elsewhere) and ``done`` (its op was done, before the
counter's release): format_phases.
Everything here is plain arithmetic on it, so the same functions read a predicted step (the
schedule's ``predicted`` start / end) for comparison.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from mkc.schedule.schedule import Schedule
from mkc.schedule.stages import stage


@dataclass(frozen=True, slots=True)
class Chain:
    """The critical chain of a step, from its first task to the one that ended last."""

    tasks: list[int]  # task ids in execution order
    run_us: dict[str, float] = field(default_factory=dict)  # per op: run time of its chain tasks
    handoff_us: dict[str, float] = field(default_factory=dict)  # per op: its blocker's signal to its start

    @property
    def total_run_us(self) -> float:
        return sum(self.run_us.values())

    @property
    def total_handoff_us(self) -> float:
        return sum(self.handoff_us.values())


def critical_chain(sc: Schedule, start, end) -> Chain:
    """Walk back from the task that ended last: a task's blocker is whichever ended last of its
    queue predecessor on its SM and the producers of the counters it waits on. The chain's time
    splits into the run time of its tasks and the hand-offs (blocker's end to the task's start)."""
    start, end = np.asarray(start, dtype=np.float64), np.asarray(end, dtype=np.float64)
    pos = {t: (sm, i) for sm, q in enumerate(sc.queues) for i, t in enumerate(q)}
    run: dict[str, float] = {}
    hand: dict[str, float] = {}
    chain = [int(np.argmax(end))]
    while True:
        t = chain[-1]
        op = sc.tasks[t].op.name
        run[op] = run.get(op, 0.0) + float(end[t] - start[t])
        blockers = [p for c, _ in sc.waits[t] for p in sc.counters[c].producers]
        sm, i = pos[t]
        if i > 0:
            blockers.append(sc.queues[sm][i - 1])
        if not blockers:
            break
        b = max(blockers, key=lambda p: end[p])
        hand[op] = hand.get(op, 0.0) + max(float(start[t] - end[b]), 0.0)
        chain.append(b)
    return Chain(tasks=chain[::-1], run_us=run, handoff_us=hand)


def save_timeline(sc: Schedule, timeline: Mapping[str, np.ndarray], path) -> None:
    """A step's timeline as ``.npz`` by task id: each task's opcode and layer, then the timeline's
    arrays (wait, start, end, sm). benchmarks/replay_profile.py and calibrate_cost.py read it back
    against the schedule planned again."""
    np.savez_compressed(path, op=np.array([int(t.op) for t in sc.tasks]), layer=np.array([t.layer for t in sc.tasks]),
                        **{k: np.asarray(v) for k, v in timeline.items()})


@dataclass(frozen=True, slots=True)
class Gaps:
    """Median times (µs) between tasks in a measured step, per opcode: from the signal of a task's
    last producer to its start (``after_producer``), and from the end of the task before it on its
    SM to its start (``after_queue``), each over the tasks that that one held back."""

    after_producer: dict[str, float]
    after_queue: dict[str, float]
    default: float = 0.5  # for an opcode the step measured none of

    def producer(self, op: str) -> float:
        return self.after_producer.get(op, self.default)

    def queue(self, op: str) -> float:
        return self.after_queue.get(op, self.default)


def blockers(sc: Schedule) -> tuple[list[list[int]], list[int]]:
    """Per task: the producers of the counters it waits on, and the task before it on its SM (-1)."""
    producers = [[p for c, _ in sc.waits[t] for p in sc.counters[c].producers] for t in range(len(sc.tasks))]
    before = [-1] * len(sc.tasks)
    for q in sc.queues:
        for i in range(1, len(q)):
            before[q[i]] = q[i - 1]
    return producers, before


def measured_gaps(sc: Schedule, start, end) -> Gaps:
    """The gaps of a measured step (see Gaps): each task counts under whichever of its blockers
    ended last, its last producer or the task before it on its SM."""
    start, end = np.asarray(start, dtype=np.float64), np.asarray(end, dtype=np.float64)
    producers, before = blockers(sc)
    by_producer: dict[str, list[float]] = {}
    by_queue: dict[str, list[float]] = {}
    for t, task in enumerate(sc.tasks):
        pe = max((end[p] for p in producers[t]), default=-np.inf)
        qe = end[before[t]] if before[t] >= 0 else -np.inf
        if pe == qe == -np.inf:
            continue
        into = by_producer if pe > qe else by_queue
        into.setdefault(task.op.name, []).append(float(start[t] - max(pe, qe)))
    return Gaps({op: float(np.median(v)) for op, v in by_producer.items()},
                {op: float(np.median(v)) for op, v in by_queue.items()})


def replay(sc: Schedule, run_us, gaps: Gaps, queues: list[list[int]] | None = None,
           producers: list[list[int]] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The step the schedule would take if each task ran ``run_us[t]`` µs: every SM runs its queue
    in order, and a task starts at the later of its last producer's signal plus its opcode's
    producer gap and the end of the task before it plus its queue gap (the first task of a queue:
    its producers only). Returns (start, end) in µs, by task id. Replayed with the run times and
    gaps of a profiled step (measured_gaps), it gives back that step's span closely (North Mini
    Code at batch 1 on an H200: 2809 µs against 2802 measured), so it answers what-ifs on the same
    schedule: a shorter op, a smaller gap (benchmarks/replay_profile.py). ``queues`` and
    ``producers`` (per task, the tasks it waits for) replace the schedule's own: other placements
    of the same tasks, each after every DAG predecessor (a moved task may lose the queue order a
    dropped wait relied on)."""
    run = np.asarray(run_us, dtype=np.float64)
    n = len(sc.tasks)
    own_producers, before = blockers(sc)
    if queues is not None:
        before = [-1] * n
        for q in queues:
            for i in range(1, len(q)):
                before[q[i]] = q[i - 1]
    producers = producers if producers is not None else own_producers
    preds = [set(producers[t]) | ({before[t]} if before[t] >= 0 else set()) for t in range(n)]
    succs: list[list[int]] = [[] for _ in range(n)]
    for t in range(n):
        for p in preds[t]:
            succs[p].append(t)
    pending = [len(p) for p in preds]
    ready = [t for t in range(n) if not pending[t]]
    start, end = np.zeros(n), np.zeros(n)
    done = 0
    while ready:
        t = ready.pop()
        op = sc.tasks[t].op.name
        s = max((end[p] + gaps.producer(op) for p in producers[t]), default=0.0)
        if before[t] >= 0:
            s = max(s, end[before[t]] + gaps.queue(op))
        start[t], end[t] = s, s + run[t]
        done += 1
        for u in succs[t]:
            pending[u] -= 1
            if not pending[u]:
                ready.append(u)
    if done < n:
        raise ValueError(f"replay: {n - done} tasks never became ready (a cycle through waits and queue order)")
    return start, end


def read_rate(sc: Schedule, start, end, bin_us: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """The step's read rate over time: each task's bytes (weights and activations) spread evenly
    over its run [start, end), summed into bins of ``bin_us`` from 0. Returns (bin starts in µs,
    TB/s per bin). An estimate: a task that issued loads before its run began (weights before the
    wait) has them counted in its run. Phases where it is far below the read bandwidth are phases
    where few SMs stream."""
    start, end = np.asarray(start, dtype=np.float64), np.asarray(end, dtype=np.float64)
    n = max(1, int(np.ceil(float(end.max(initial=0.0)) / bin_us)))
    edges = np.arange(n + 1) * bin_us
    moved = np.zeros(n)  # bytes per bin
    for t in sc.tasks:
        s, e, b = float(start[t.id]), float(end[t.id]), float(t.weight_bytes + t.act_bytes)
        if e <= s or b <= 0:
            continue
        lo, hi = int(s // bin_us), min(n, int(np.ceil(e / bin_us)))
        overlap = np.minimum(edges[lo + 1:hi + 1], e) - np.maximum(edges[lo:hi], s)
        moved[lo:hi] += b * np.clip(overlap, 0.0, None) / (e - s)
    return edges[:-1], moved / (bin_us * 1e-6) / 1e12


def op_shares(sc: Schedule, start, end) -> dict[str, float]:
    """Per op, its share of the SMs' busy (running) time, largest first."""
    start, end = np.asarray(start, dtype=np.float64), np.asarray(end, dtype=np.float64)
    busy: dict[str, float] = {}
    for t in sc.tasks:
        busy[t.op.name] = busy.get(t.op.name, 0.0) + float(end[t.id] - start[t.id])
    total = sum(busy.values()) or 1.0
    return {op: v / total for op, v in sorted(busy.items(), key=lambda kv: -kv[1])}


def format_profile(sc: Schedule, timeline: Mapping[str, np.ndarray]) -> str:
    """Text report of a step: span, SM time running and waiting, per-op share, the critical chain."""
    start, end = timeline["start"], timeline["end"]
    span = float(np.max(end))
    busy = float(np.sum(end - start))
    lines = [f"step span {span:.1f} µs over {sc.num_sms} SMs; SMs running {busy / (span * sc.num_sms):.1%} of it"]
    if "wait" in timeline:
        waited = float(np.sum(start - timeline["wait"]))
        lines[0] += f", waiting {waited / (span * sc.num_sms):.1%}"
    lines.append("share of SM-busy time per op:")
    lines += [f"  {op:<14} {share:6.1%}" for op, share in op_shares(sc, start, end).items()]
    lines.append(format_chain(sc, start, end))
    lines.append(format_layer_times(sc, timeline))
    lines.append(format_stage_ends(sc, timeline))
    lines.append(format_last_tasks(sc, timeline))
    if "wait" in timeline:
        lines.append(format_handoffs(sc, timeline))
    if "done" in timeline:
        lines.append(format_phases(sc, timeline))
    return "\n".join(lines)


def phases(sc: Schedule, timeline: Mapping[str, np.ndarray], ids=None,
           by_stage: bool = False) -> dict[str, dict[str, float]]:
    """Per op (with ``by_stage``, per ``stage``: a LINEAR op's QKV, router and O-projection tiles
    apart), the mean µs of each phase of its tasks (all, or those in ``ids``): ``wait`` (began
    waiting → inputs ready), ``staging`` (→ inputs staged; tasks that stage), ``op`` (→ op done,
    from the staging where there is one), ``release`` (→ counter signalled), and ``routed`` (inputs
    ready → the routing available, for tasks that route; before the inputs for a tile that waits
    for the routing first). Needs a timeline with ``staged`` and ``done`` (CodegenOptions.
    profile_phases); ``routed`` is NaN where the timeline has no ``routed``."""
    start, end = np.asarray(timeline["start"], np.float64), np.asarray(timeline["end"], np.float64)
    wait = np.asarray(timeline.get("wait", start), np.float64)
    staged, done = np.asarray(timeline["staged"], np.float64), np.asarray(timeline["done"], np.float64)
    routed = np.asarray(timeline.get("routed", np.full(len(start), np.nan)), np.float64)
    groups: dict[str, list[int]] = {}
    for i in (range(len(sc.tasks)) if ids is None else ids):
        groups.setdefault(stage(sc.tasks[i]) if by_stage else sc.tasks[i].op.name, []).append(i)
    out = {}
    for name, idx in groups.items():
        ix = np.asarray(idx)
        has, routes = ~np.isnan(staged[ix]), ~np.isnan(routed[ix])
        op_from = np.where(has, staged[ix], start[ix])
        out[name] = {"tasks": float(len(ix)), "wait": float(np.mean(start[ix] - wait[ix])),
                     "staging": float(np.mean(staged[ix][has] - start[ix][has])) if has.any() else float("nan"),
                     "op": float(np.mean(done[ix] - op_from)), "release": float(np.mean(end[ix] - done[ix])),
                     "routed": float(np.mean(routed[ix][routes] - start[ix][routes])) if routes.any()
                     else float("nan")}
    return out


def staging_after(sc: Schedule, timeline: Mapping[str, np.ndarray]) -> dict[tuple[str, str], dict[str, float]]:
    """Per (stage, stage of the task before it on its SM, "first" where none), the tasks that stage
    (a ``staged`` mark, CodegenOptions.profile_phases) and their mean ``staging`` (inputs ready →
    inputs staged) and ``op`` (→ op done) in µs, to see whether a tile stages faster after a task
    of its own kind (whose code the SM just ran) than after another. The pairs with the most tasks
    first."""
    start = np.asarray(timeline["start"], np.float64)
    staged, done = np.asarray(timeline["staged"], np.float64), np.asarray(timeline["done"], np.float64)
    _, before = blockers(sc)
    rows: dict[tuple[str, str], list[int]] = {}
    for t in sc.tasks:
        if np.isnan(staged[t.id]):
            continue
        prev = before[t.id]
        rows.setdefault((stage(t), stage(sc.tasks[prev]) if prev >= 0 else "first"), []).append(t.id)
    out = {key: {"tasks": float(len(ix)), "staging": float(np.mean(staged[ix] - start[ix])),
                 "op": float(np.mean(done[ix] - staged[ix]))} for key, ix in rows.items()}
    return dict(sorted(out.items(), key=lambda kv: -kv[1]["tasks"]))


def format_staging_after(sc: Schedule, timeline: Mapping[str, np.ndarray], rows: int = 16) -> str:
    """staging_after as one line per pair of stages, the ``rows`` with the most tasks."""
    lines = ["staging by the stage before on the SM (mean µs; inputs ready → staged, staged → op done):",
             f"  {'stage':<14} {'after':<14} {'tasks':>6} {'staging':>8} {'op':>7}"]
    for (name, after), v in list(staging_after(sc, timeline).items())[:rows]:
        lines.append(f"  {name:<14} {after:<14} {int(v['tasks']):>6} {v['staging']:>8.2f} {v['op']:>7.2f}")
    return "\n".join(lines)


def format_phases(sc: Schedule, timeline: Mapping[str, np.ndarray]) -> str:
    """Per stage (phases(by_stage=True): a LINEAR op's QKV, router and O-projection tiles apart), the
    mean phases of its tasks, for every task and for the critical chain's."""
    head = f"  {'stage':<14} {'tasks':>6} {'wait':>7} {'staging':>8} {'op':>7} {'release':>8} {'routed':>7}  (mean µs)"

    def table(ph: dict[str, dict[str, float]]) -> list[str]:
        rows = sorted(ph.items(), key=lambda kv: -kv[1]["tasks"] * (kv[1]["op"] + kv[1]["release"]))
        return [f"  {op:<14} {int(v['tasks']):>6} {v['wait']:>7.2f} "
                + (f"{v['staging']:>8.2f}" if not np.isnan(v["staging"]) else f"{'-':>8}")
                + f" {v['op']:>7.2f} {v['release']:>8.2f}"
                + (f" {v['routed']:>7.2f}" if not np.isnan(v["routed"]) else f" {'-':>7}") for op, v in rows]

    chain = critical_chain(sc, timeline["start"], timeline["end"]).tasks
    title = ("phases per task (wait: began waiting → inputs ready; staging: → inputs staged; op: → op done; "
             "release: → counter signalled; routed: inputs ready → routing available):")
    lines = [title, head, *table(phases(sc, timeline, by_stage=True)),
             "the critical chain's tasks:", head, *table(phases(sc, timeline, chain, by_stage=True))]
    lines.append(format_staging_after(sc, timeline))
    if "synced" in timeline:
        lines.append(format_staging_phases(sc, timeline, chain))
    if "ranked" in timeline:
        lines.append(format_routing_phases(sc, timeline))
    return "\n".join(lines)


# A LINEAR tile's staging parts (a timeline of CodegenOptions.profile_phases; the kernel writes them
# into the routing's slots, which a LINEAR tile does not use, and CudaDecoder.timeline gives them
# columns of their own: ops.cuh WaitStageFinish): (name, from mark, to mark). "barrier": warp 0's
# poll done → every warp through the wait's barrier; "issue": → thread 0's copies issued; "landing":
# → thread 0's copies landed; "rest": → inputs staged (the RMSNorm, where the tile has one).
LINEAR_STAGING_PHASES = (("barrier", "start", "synced"), ("issue", "synced", "issued"),
                         ("landing", "issued", "landed"), ("rest", "landed", "staged"))


def staging_phases(sc: Schedule, timeline: Mapping[str, np.ndarray], ids=None) -> dict[str, dict[str, float]]:
    """The mean µs of each part of LINEAR_STAGING_PHASES, and ``tasks``, per stage of the tasks
    (all, or those in ``ids``) that have every mark: CudaDecoder.timeline gives them to the LINEAR
    tiles that waited inside their op alone. Stages with the most tasks first; empty where the
    timeline has none."""
    cols = {k: np.asarray(timeline[k], np.float64) for k in ("start", "synced", "issued", "landed", "staged")}
    marked = ~np.isnan(cols["synced"]) & ~np.isnan(cols["landed"]) & ~np.isnan(cols["staged"])
    groups: dict[str, list[int]] = {}
    for i in (range(len(sc.tasks)) if ids is None else ids):
        if marked[i]:
            groups.setdefault(stage(sc.tasks[i]), []).append(i)
    out = {}
    for name, idx in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        ix = np.asarray(idx)
        out[name] = {"tasks": float(len(ix)),
                     **{p: float(np.mean(cols[b][ix] - cols[a][ix])) for p, a, b in LINEAR_STAGING_PHASES}}
    return out


def format_staging_phases(sc: Schedule, timeline: Mapping[str, np.ndarray], chain=None) -> str:
    """staging_phases as a table, every marked tile's and the critical chain's (``chain``: its task
    ids where the caller has them, else found here)."""
    names = [n for n, _, _ in LINEAR_STAGING_PHASES]
    head = f"  {'stage':<14} {'tasks':>6} " + " ".join(f"{n:>8}" for n in names) + "  (mean µs)"

    def table(ph: dict[str, dict[str, float]]) -> list[str]:
        return [f"  {name:<14} {int(v['tasks']):>6} " + " ".join(f"{v[n]:>8.2f}" for n in names)
                for name, v in ph.items()]

    if chain is None:
        chain = critical_chain(sc, timeline["start"], timeline["end"]).tasks
    return "\n".join([("a LINEAR tile's staging (inputs ready → every warp through the wait's barrier → thread 0's "
                       "copies issued → landed → inputs staged):"), head, *table(staging_phases(sc, timeline)),
                      "the critical chain's:", head, *table(staging_phases(sc, timeline, chain))])


# The routing's phases (a timeline of CodegenOptions.profile_phases): (name, from mark, to mark);
# a task that lacks either mark (no opening outside the expert gate/up tiles, no tagged logits on
# the counter path) has none of that phase.
ROUTING_PHASES = (("opening", "start", "opened"), ("copies", "opened", "routing"), ("logits", "routing", "logits"),
                  ("rounds", "logits", "ranked"), ("rest", "ranked", "routed"), ("staging", "routed", "staged"))


def routing_phases(sc: Schedule, timeline: Mapping[str, np.ndarray]) -> dict[str, dict[str, float]]:
    """Per op whose tasks derived a routing in the profiled step (``ranked`` marked), the median µs
    of each of ROUTING_PHASES over those tasks: ``opening`` (inputs ready → an expert gate/up
    tile's op entered), ``copies`` (→ the routing began: its input's copies issued), ``logits``
    (→ the tagged logits read, every word of this step), ``rounds`` (→ the TOP_K arg-max rounds
    done, or with CodegenOptions.routing_argmax "rank" every pair ranked), ``rest`` (→ the routing available: weights, masks, slots), ``staging`` (→ the input
    staged: the RMSNorm). A phase whose marks a task lacks is NaN for it, and the median is over
    the tasks that have both (NaN where none has); ``tasks`` counts the op's routing tasks."""
    cols = {k: np.asarray(timeline[k], np.float64) for k in ("start", "opened", "routing", "logits", "ranked",
                                                              "routed", "staged") if k in timeline}
    derived = ~np.isnan(cols["ranked"])
    by_op: dict[str, list[int]] = {}
    for i in np.flatnonzero(derived).tolist():
        by_op.setdefault(sc.tasks[i].op.name, []).append(i)
    out = {}
    for op, idx in by_op.items():
        ix = np.asarray(idx)
        row = {"tasks": float(len(ix))}
        for name, a, b in ROUTING_PHASES:
            d = cols[b][ix] - cols[a][ix] if a in cols and b in cols else np.full(len(ix), np.nan)
            row[name] = float(np.median(d[~np.isnan(d)])) if (~np.isnan(d)).any() else float("nan")
        out[op] = row
    return out


def format_routing_phases(sc: Schedule, timeline: Mapping[str, np.ndarray]) -> str:
    """routing_phases as a table, one row per op that derived a routing."""
    names = [n for n, _, _ in ROUTING_PHASES]
    lines = [("the routing, where a task derived it (inputs ready → opened → routing began → tagged logits "
              "read → TOP_K rounds (or ranks) done → routing available → input staged):"),
             f"  {'op':<14} {'tasks':>6} " + " ".join(f"{n:>8}" for n in names) + "  (median µs)"]
    for op, v in routing_phases(sc, timeline).items():
        lines.append(f"  {op:<14} {int(v['tasks']):>6} "
                     + " ".join(f"{v[n]:>8.2f}" if not np.isnan(v[n]) else f"{'-':>8}" for n in names))
    return "\n".join(lines)


def format_chain(sc: Schedule, start, end) -> str:
    """The critical chain's running and hand-off time per op, as text."""
    ch = critical_chain(sc, start, end)
    head = f"critical chain: {len(ch.tasks)} tasks, running {ch.total_run_us:.0f} µs, hand-offs {ch.total_handoff_us:.0f} µs:"
    lines = [head]
    for op in sorted(ch.run_us, key=lambda o: -(ch.run_us[o] + ch.handoff_us.get(o, 0.0))):
        lines.append(f"  {op:<14} running {ch.run_us[op]:8.0f} µs, waiting after its blocker signalled "
                     f"{ch.handoff_us.get(op, 0.0):6.0f} µs")
    return "\n".join(lines)


def stage_ends(sc: Schedule, timeline: Mapping[str, np.ndarray]) -> dict[str, float]:
    """Per stage (``stage``) of the layers that have it, the mean over those layers of when its last
    task ended, in µs from the layer's first start; earliest first. The stages that end last are
    a layer's tail: e.g. how long the O-projection and the residual run after both branches of a
    parallel block are done."""
    start, end = np.asarray(timeline["start"], dtype=np.float64), np.asarray(timeline["end"], dtype=np.float64)
    first: dict[int, float] = {}
    last: dict[tuple[int, str], float] = {}
    for t in sc.tasks:
        first[t.layer] = min(first.get(t.layer, np.inf), float(start[t.id]))
        key = (t.layer, stage(t))
        last[key] = max(last.get(key, -np.inf), float(end[t.id]))
    by_stage: dict[str, list[float]] = {}
    for (layer, name), e in last.items():
        by_stage.setdefault(name, []).append(e - first[layer])
    means = {name: float(np.mean(v)) for name, v in by_stage.items()}
    return dict(sorted(means.items(), key=lambda kv: kv[1]))


def format_stage_ends(sc: Schedule, timeline: Mapping[str, np.ndarray]) -> str:
    """stage_ends as one line per stage (stages of at least two layers)."""
    counts: dict[str, set[int]] = {}
    for t in sc.tasks:
        counts.setdefault(stage(t), set()).add(t.layer)
    rows = [(name, us) for name, us in stage_ends(sc, timeline).items() if len(counts[name]) > 1]
    return "\n".join(["each stage's last end, µs from its layer's first start (mean over the layers that have it):",
                      *(f"  {name:<14} {us:8.1f}  ({len(counts[name])} layers)" for name, us in rows)])


@dataclass(frozen=True, slots=True)
class Handoff:
    """How tasks of one stage took over their SM from a task of another stage (medians over those
    tasks, µs): ``dispatch``, from the task before on the SM signalling to this task's wait
    beginning (the record's dispatch, the op's opening, and for a GEMV tile that issues its first
    weights before its wait, that batch); ``poll``, from the later of its wait beginning and its
    last producer's signal to its wait ending (the round trip that sees the counter; more where the
    signal came later than one poll); ``total``, from the later of its SM going free and its last
    producer's signal to its wait ending: the hand-off a task on the critical chain pays."""

    tasks: int
    dispatch: float
    poll: float
    total: float


def handoffs(sc: Schedule, timeline: Mapping[str, np.ndarray]) -> dict[tuple[str, str], Handoff]:
    """Per (stage, stage of the task before it on its SM), the Handoff of the tasks that have a
    task before them, from a timeline with ``wait`` times; the pairs that cost the most SM time
    (tasks x total) first. A task whose counters were all covered by its queue (no producer waited
    on) counts its SM's signal as its inputs."""
    start, end = np.asarray(timeline["start"], dtype=np.float64), np.asarray(timeline["end"], dtype=np.float64)
    wait = np.asarray(timeline["wait"], dtype=np.float64)
    producers, before = blockers(sc)
    rows: dict[tuple[str, str], list[tuple[float, float, float]]] = {}
    for t in sc.tasks:
        prev = before[t.id]
        if prev < 0:
            continue
        free = end[prev]
        inputs = max((end[p] for p in producers[t.id]), default=free)
        rows.setdefault((stage(t), stage(sc.tasks[prev])), []).append(
            (wait[t.id] - free, start[t.id] - max(inputs, wait[t.id]), start[t.id] - max(inputs, free)))
    out = {}
    for key, v in rows.items():
        a = np.asarray(v)
        out[key] = Handoff(tasks=len(v), dispatch=float(np.median(a[:, 0])), poll=float(np.median(a[:, 1])),
                           total=float(np.median(a[:, 2])))
    return dict(sorted(out.items(), key=lambda kv: -kv[1].tasks * kv[1].total))


def format_handoffs(sc: Schedule, timeline: Mapping[str, np.ndarray], rows: int = 12) -> str:
    """handoffs as one line per pair of stages, the costliest ``rows``."""
    title = ("hand-offs, by a task's stage and the stage before it on its SM (median µs: its SM free → its "
             "wait begins; the later of that and its inputs → its wait ends; the later of its SM free and "
             "its inputs → its wait ends):")
    lines = [title,
             f"  {'stage':<14} {'after':<14} {'tasks':>6} {'dispatch':>9} {'poll':>7} {'total':>7}"]
    for (name, after), h in list(handoffs(sc, timeline).items())[:rows]:
        lines.append(f"  {name:<14} {after:<14} {h.tasks:>6} {h.dispatch:>9.2f} {h.poll:>7.2f} {h.total:>7.2f}")
    return "\n".join(lines)


@dataclass(frozen=True, slots=True)
class LastTask:
    """What held a stage's last task in its layers (means over the layers that have the stage, µs
    from each layer's first start): when it ended and when its inputs were ready (``ready``), when
    its last producer signalled (``inputs``) and when the task before it on its SM ended (``sm_free``;
    the layer's first start where it is first in its queue); ``by_inputs`` / ``by_queue``: in how
    many layers the later of the two was the producers' signal, or its SM; ``after``: the stage
    of the task before it on its SM, most often."""

    end: float
    ready: float
    inputs: float
    sm_free: float
    by_inputs: int
    by_queue: int
    after: str


def last_tasks(sc: Schedule, timeline: Mapping[str, np.ndarray]) -> dict[str, LastTask]:
    """Per stage (``stage``), the layers' last-ending task of that stage and what it waited for
    (LastTask); in the order of ``stage_ends``. A stage whose last task is usually bound by its
    inputs moves only with its producers; one bound by its queue moves with its placement."""
    start, end = np.asarray(timeline["start"], dtype=np.float64), np.asarray(timeline["end"], dtype=np.float64)
    producers, before = blockers(sc)
    first: dict[int, float] = {}
    last: dict[tuple[int, str], int] = {}
    for t in sc.tasks:
        first[t.layer] = min(first.get(t.layer, np.inf), float(start[t.id]))
        key = (t.layer, stage(t))
        if key not in last or end[t.id] > end[last[key]]:
            last[key] = t.id
    rows: dict[str, list[tuple[float, float, float, float, str]]] = {}
    for (layer, name), tid in last.items():
        t0 = first[layer]
        inputs = max((float(end[p]) for p in producers[tid]), default=t0)
        prev = before[tid]
        free = float(end[prev]) if prev >= 0 else t0
        rows.setdefault(name, []).append((float(end[tid]) - t0, float(start[tid]) - t0, inputs - t0, free - t0,
                                          stage(sc.tasks[prev]) if prev >= 0 else "-"))
    out = {}
    for name in stage_ends(sc, timeline):
        v = rows[name]
        after = Counter(r[4] for r in v).most_common(1)[0][0]
        out[name] = LastTask(end=float(np.mean([r[0] for r in v])), ready=float(np.mean([r[1] for r in v])),
                             inputs=float(np.mean([r[2] for r in v])), sm_free=float(np.mean([r[3] for r in v])),
                             by_inputs=sum(r[2] >= r[3] for r in v), by_queue=sum(r[2] < r[3] for r in v),
                             after=after)
    return out


def format_last_tasks(sc: Schedule, timeline: Mapping[str, np.ndarray]) -> str:
    """last_tasks as one line per stage (stages of at least two layers)."""
    counts: dict[str, set[int]] = {}
    for t in sc.tasks:
        counts.setdefault(stage(t), set()).add(t.layer)
    head = (f"  {'stage':<14} {'end':>7} {'ready':>7} {'inputs':>7} {'SM free':>8}  bound by inputs / queue, "
            f"runs after")
    title = ("each stage's last task (mean µs from its layer's first start: its end, its inputs ready, its last "
             "producer's signal, its SM free):")
    lines = [title, head]
    for name, v in last_tasks(sc, timeline).items():
        if len(counts[name]) > 1:
            lines.append(f"  {name:<14} {v.end:>7.1f} {v.ready:>7.1f} {v.inputs:>7.1f} {v.sm_free:>8.1f}  "
                         f"{v.by_inputs} / {v.by_queue}, {v.after}")
    return "\n".join(lines)


def layer_kind(sc: Schedule, layer: int, tasks=None) -> str:
    """What a layer's tasks say it is: its attention (global, or sliding over W keys: the splits'
    window) and its MLP (MoE: expert tiles; dense: a SwiGLU), e.g. "global attention + MoE".
    ``tasks``: the layer's tasks, where the caller has them already."""
    ts = tasks if tasks is not None else [t for t in sc.tasks if t.layer == layer]
    windows = {t.arg("window") for t in ts if t.op.name == "ATTN_SPLIT"}
    attention = ("no attention" if not windows else "global attention" if windows == {0}
                 else f"sliding attention ({max(windows)} keys)")
    ops = {t.op.name for t in ts}
    mlp = "MoE" if ops & {"EXPERT_SWIGLU", "EXPERT_MLP"} else "dense" if "SWIGLU" in ops else "no MLP"
    return f"{attention} + {mlp}"


def layer_times(sc: Schedule, timeline: Mapping[str, np.ndarray]) -> dict[str, tuple[int, float, float, float]]:
    """Per kind of layer (layer_kind): how many layers, and the mean, least and most µs from a
    layer's first task start to the next layer's (the LM head's tasks, a layer past the last, close
    the last one), in order of the first layer of each kind. At a long context the layers of global
    attention take several times a sliding one's (LowerOptions.global_attention_sms)."""
    start = np.asarray(timeline["start"], dtype=np.float64)
    by_layer: dict[int, list] = {}
    for t in sc.tasks:
        if t.layer >= 0:
            by_layer.setdefault(t.layer, []).append(t)
    layers = sorted(by_layer)
    first = {L: float(start[[t.id for t in by_layer[L]]].min()) for L in layers}
    spans: dict[str, list[float]] = {}
    for a, b in itertools.pairwise(layers):
        spans.setdefault(layer_kind(sc, a, by_layer[a]), []).append(first[b] - first[a])
    return {k: (len(v), float(np.mean(v)), float(np.min(v)), float(np.max(v))) for k, v in spans.items()}


def format_layer_times(sc: Schedule, timeline: Mapping[str, np.ndarray]) -> str:
    rows = layer_times(sc, timeline)
    lines = ["layer time by kind (µs from a layer's first start to the next's: mean, least, most):"]
    lines += [f"  {k:<40} {m:8.1f} {lo:8.1f} {hi:8.1f}  ({n} layer{'s' if n > 1 else ''})" for k, (n, m, lo, hi) in rows.items()]
    return "\n".join(lines)


def format_layer(sc: Schedule, timeline: Mapping[str, np.ndarray], layer: int) -> str:
    """One layer of a step, in µs from its first task's start: per op its tasks, first and last
    start, last end and mean run time; then the layer's tasks on the critical chain (op, SM, the
    wait for its inputs, start, end), which show which phase holds the layer."""
    start, end = np.asarray(timeline["start"], dtype=np.float64), np.asarray(timeline["end"], dtype=np.float64)
    wait = np.asarray(timeline.get("wait", start), dtype=np.float64)
    sm = np.asarray(timeline.get("sm", np.full(len(start), -1)))
    ids = [t.id for t in sc.tasks if t.layer == layer]
    if not ids:
        raise ValueError(f"layer {layer}: no tasks (the schedule has layers {min(t.layer for t in sc.tasks)}.."
                         f"{max(t.layer for t in sc.tasks)})")
    t0 = float(start[ids].min())
    lines = [f"layer {layer} (µs from its first start, {t0:.1f} µs into the step):",
             f"  {'op':<14} {'tasks':>5} {'first start':>11} {'last start':>10} {'last end':>9} {'mean run':>9}"]
    by_op: dict[str, list[int]] = {}
    for i in ids:
        by_op.setdefault(sc.tasks[i].op.name, []).append(i)
    for op, ts in sorted(by_op.items(), key=lambda kv: float(start[kv[1]].min())):
        lines.append(f"  {op:<14} {len(ts):>5} {start[ts].min() - t0:>11.1f} {start[ts].max() - t0:>10.1f} "
                     f"{end[ts].max() - t0:>9.1f} {(end[ts] - start[ts]).mean():>9.1f}")
    # up to the next layer's first start (work deferred past it, like a KV append no one in the step
    # waits for, would stretch the window to the end of the step)
    later = [t.id for t in sc.tasks if t.layer == layer + 1]
    t1 = float(start[later].min()) if later else float(end[ids].max())
    bins, rate = read_rate(sc, start, end, 2.0)
    mid = bins + 1.0
    window = (mid >= t0) & (mid < max(t1, t0 + 2.0))
    lines.append("  read rate of the whole GPU, TB/s per 2 µs up to the next layer's first start (every task's "
                 "bytes over its run): " + " ".join(f"{r:.1f}" for r in rate[window]))
    chain = [t for t in critical_chain(sc, start, end).tasks if sc.tasks[t].layer == layer]
    lines.append(f"  on the critical chain: {len(chain)} tasks")
    for t in chain:
        lines.append(f"    {sc.tasks[t].name:<28} SM {int(sm[t]):>3}  waits from {wait[t] - t0:7.1f}  runs "
                     f"{start[t] - t0:7.1f} .. {end[t] - t0:7.1f}")
    return "\n".join(lines)
