"""Validator: every real schedule is accepted; every broken one is rejected, naming what broke.

The property test compares the validator against a slow reference checker written here from the
counter semantics alone (greedy simulation, networkx reachability per conflicting pair), on random
mutations of real tiny schedules.
"""

from __future__ import annotations

import dataclasses
import random
from collections import defaultdict
from functools import cache
from pathlib import Path

import networkx as nx
import pytest
from hypothesis import HealthCheck, assume, given, note, settings
from hypothesis import strategies as st

from mkc.ir.graph import Buffer, Region, Task
from mkc.ir.lower import lower
from mkc.ir.ops import OP_INFO, Opcode
from mkc.ir.spec import load_spec
from mkc.schedule.schedule import Counter, Schedule, routing_edge
from mkc.schedule.scheduler import schedule
from mkc.schedule.validator import Problem, ScheduleError, check, validate

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


@cache
def _tiny(batch: int, context: int, num_sms: int) -> Schedule:
    spec = load_spec(CONFIGS / "tiny.yaml")
    return schedule(lower(spec, batch, context, num_sms), spec.name)


def tiny(batch: int = 2, context: int = 64, num_sms: int = 8) -> Schedule:
    """A fresh, mutable copy of a cached real schedule (tasks and buffers are immutable, shared)."""
    sc = _tiny(batch, context, num_sms)
    return dataclasses.replace(sc, queues=[list(q) for q in sc.queues], waits=[list(w) for w in sc.waits],
                               signals=list(sc.signals), counters=list(sc.counters), buffers=dict(sc.buffers))


def kinds(problems: list[Problem]) -> set[str]:
    return {p.kind for p in problems}


def of_kind(problems: list[Problem], kind: str) -> list[Problem]:
    out = [p for p in problems if p.kind == kind]
    assert out, f"no {kind!r} problem among: {[str(p) for p in problems]}"
    return out


def placement(sc: Schedule) -> dict[int, tuple[int, int]]:
    return {t: (s, i) for s, q in enumerate(sc.queues) for i, t in enumerate(q)}


def raw_pairs(sc: Schedule) -> list[tuple[int, int, str]]:
    """(writer, reader, buffer) for every read-after-write pair, found naively."""
    out = []
    for b in sc.tasks:
        for r in b.reads:
            if sc.buffers[r.buffer].kind == "weight":
                continue
            for a in sc.tasks[:b.id]:
                if any(w.overlaps(r) for w in a.writes):
                    out.append((a.id, b.id, r.buffer))
    return out


# -- accepted ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("num_sms", [1, 2, 8, 132])
@pytest.mark.parametrize("context", [1, 7, 64, 100])
@pytest.mark.parametrize("batch", [1, 2, 3, 8])
def test_real_tiny_schedules_are_safe(batch, context, num_sms):
    problems = validate(_tiny(batch, context, num_sms))
    assert problems == [], [str(p) for p in problems[:5]]


def test_round_trip_through_json_is_safe():
    sc = Schedule.from_json(_tiny(3, 100, 8).to_json())
    assert validate(sc) == []
    check(sc)


@pytest.mark.slow
def test_north_mini_code_batch1_is_safe():
    spec = load_spec(CONFIGS / "north_mini_code.yaml")
    sc = schedule(lower(spec, 1, 8192, 132), spec.name)
    problems = validate(sc, smem_bytes=200 * 1024, regs=128, threads=384)
    assert problems == [], [str(p) for p in problems[:5]]


# -- rejected, one class at a time --------------------------------------------------------------------

def test_check_raises_with_problems():
    sc = tiny()
    sc.queues[0].append(sc.queues[1][0])
    with pytest.raises(ScheduleError) as e:
        check(sc)
    assert e.value.problems and "queued 2 times" in str(e.value)


def test_dropped_wait_is_a_race_naming_writer_reader_and_buffer():
    base = _tiny(2, 64, 8)
    where = placement(base)
    for a, b, buf in raw_pairs(base):
        if where[a][0] == where[b][0]:
            continue
        c = base.signals[a]
        if (c, base.counters[c].target) not in base.waits[b]:
            continue
        sc = tiny(2, 64, 8)
        sc.waits[b] = [w for w in sc.waits[b] if w[0] != c]
        problems = validate(sc)
        races = [p for p in problems if p.kind == "race" and b in p.tasks]
        if not races:
            continue  # the wait was redundant (ordered through another path)
        assert kinds(problems) == {"race"}
        p = races[0]
        assert sc.tasks[b].name in p.message and sc.tasks[b].op.name in p.message
        assert "no happens-before" in p.message and "writes" in p.message and "reads" in p.message
        assert set(p.tasks) <= set(base.counters[c].producers) | {b}
        assert p.buffers and p.buffers[0] in p.message
        return
    pytest.fail("no wait whose removal races")


def test_consumer_before_producer_on_one_sm_is_out_of_order():
    sc = tiny(2, 64, 1)  # one SM: queue order alone orders everything, there are no waits
    assert not any(sc.waits)
    a, b, buf = raw_pairs(sc)[0]
    q = sc.queues[0]
    q.remove(b)
    q.insert(q.index(a), b)
    p = of_kind(validate(sc), "order")[0]
    assert (a, b) == p.tasks[:2] and buf in p.buffers
    assert sc.tasks[a].name in p.message and sc.tasks[b].name in p.message and "program order" in p.message


def test_consumer_before_producer_across_a_counter_deadlocks():
    base = _tiny(2, 64, 8)
    where = placement(base)
    b = next(t for t, ws in enumerate(base.waits) if ws)
    c, _ = base.waits[b][0]
    a = base.counters[c].producers[0]
    sc = tiny(2, 64, 8)
    sc.queues[where[b][0]].remove(b)
    q = sc.queues[where[a][0]]
    q.insert(q.index(a), b)  # b now waits on a counter that a, behind it, must signal
    problems = validate(sc)
    cyc = of_kind(problems, "cycle")[0]
    assert sc.tasks[a].name in cyc.message and sc.tasks[b].name in cyc.message
    assert f"counter {c}" in cyc.message
    dead = of_kind(problems, "deadlock")
    assert any(p.tasks[0] == b and c in p.counters for p in dead)


@pytest.mark.parametrize("delta", [1, -1])
def test_counter_target_off_by_one(delta):
    sc = tiny()
    c = next(c for c in sc.counters if c.target > 1)
    sc.counters[c.id] = dataclasses.replace(c, target=c.target + delta)
    p = of_kind(validate(sc), "counter")[0]
    assert p.counters == (c.id,) and f"counter {c.id} has target {c.target + delta}" in p.message
    assert ("never be reached" if delta > 0 else "partial join") in p.message


@pytest.mark.parametrize("delta", [1, -1])
def test_wait_target_off_by_one(delta):
    sc = tiny()
    t = next(t for t, ws in enumerate(sc.waits) if ws)
    c, n = sc.waits[t][0]
    sc.waits[t][0] = (c, n + delta)
    problems = validate(sc)
    p = of_kind(problems, "counter")[0]
    assert p.counters == (c,) and sc.tasks[t].name in p.message
    assert ("above" if delta > 0 else "below") in p.message
    if delta > 0:  # and the simulation sticks on it
        assert any(d.tasks[0] == t and c in d.counters for d in of_kind(problems, "deadlock"))


def test_wait_on_a_counter_that_does_not_exist():
    sc = tiny()
    sc.waits[5].append((10**6, 1))
    problems = validate(sc)
    p = of_kind(problems, "counter")[0]
    assert p.counters == (10**6,) and sc.tasks[5].name in p.message
    assert "not in the counter table" in p.message
    assert any(5 in d.tasks for d in of_kind(problems, "deadlock"))


def test_wait_on_a_counter_nobody_signals():
    sc = tiny()
    c = next(c for c in sc.counters if any(c.id == w[0] for ws in sc.waits for w in ws))
    for p in c.producers:
        sc.signals[p] = -1
    problems = validate(sc)
    msgs = [p.message for p in of_kind(problems, "counter") if p.counters == (c.id,)]
    assert any("which no task signals" in m for m in msgs)
    assert "deadlock" in kinds(problems)


def test_cycle_across_sms():
    sc = tiny(2, 64, 8)
    where = placement(sc)
    # tasks whose counters have one producer each, so the cycle has to pass through both; not
    # expert-up tiles, whose wait on a router tile would be a routing wait (no HB edge: the
    # simulation still finds the deadlock, test_routing_wait_orders_only_the_logits)
    def ok(t):
        return (sc.signals[t] >= 0 and sc.counters[sc.signals[t]].target == 1
                and sc.tasks[t].op != Opcode.EXPERT_SWIGLU)

    x = next(t for q in sc.queues for t in q if ok(t))
    y = next(t for q in sc.queues if x not in q for t in q if ok(t))
    cx, cy = sc.signals[x], sc.signals[y]
    sc.waits[x].append((cy, sc.counters[cy].target))
    sc.waits[y].append((cx, sc.counters[cx].target))
    problems = validate(sc)
    cyc = of_kind(problems, "cycle")
    assert any(x in p.tasks and y in p.tasks for p in cyc)
    p = next(p for p in cyc if x in p.tasks and y in p.tasks)
    loop = p.message.split(": ")[0]
    assert loop.count(" → ") >= 2 and sc.tasks[x].name in loop and sc.tasks[y].name in loop
    assert where[x][0] != where[y][0]
    assert "deadlock" in kinds(problems)


def test_routing_wait_orders_only_the_logits():
    """An expert-up tile's wait on the router tiles is a routing wait: a kernel may meet it by
    reading the logits' tagged copy, so it orders the logits and nothing else. Without its own wait
    on the residual stream, the tile's read of it is a race, although the router tiles waited
    for that stream before writing the logits (the path residual → router → expert-up)."""
    sc = tiny(2, 64, 8)
    assert validate(sc) == []
    t = next(t for t in sc.tasks if t.op == Opcode.EXPERT_SWIGLU and len(sc.waits[t.id]) > 1)
    routing = [(c, n) for c, n in sc.waits[t.id]
               if all(routing_edge(sc.tasks[p], t) for p in sc.counters[c].producers)]
    assert len(routing) == 1 and len(sc.waits[t.id]) > len(routing)
    sc.waits[t.id] = routing
    races = of_kind(validate(sc), "race")
    assert races and all(p.tasks[1] == t.id for p in races)
    read = {r.buffer for r in t.reads}
    assert {b for p in races for b in p.buffers} <= read - {t.operands[3]}  # never the logits
    # without the routing wait, the logits' read is the race
    sc.waits[t.id] = []
    assert any(t.operands[3] in p.buffers for p in of_kind(validate(sc), "race"))


def _synthetic(writes: list[tuple[int, int]], queues: list[list[int]], waits=None, signals=None) -> Schedule:
    """Tasks that each write buf[lo:hi] of one 16-element buffer."""
    buf = Buffer("buf", (16,), "f32", "act", "[16]")
    operands = tuple("buf" if role == "out" else "-" for role in OP_INFO[Opcode.LINEAR].operands)
    tasks = [Task(id=i, op=Opcode.LINEAR, layer=0, name=f"w{i}[{lo}:{hi}]", operands=operands,
                  args=(0, 0, 0, 0, 0, 0), reads=(), writes=(Region("buf", ((lo, hi),)),), weight_bytes=0,
                  act_bytes=0, flops=0) for i, (lo, hi) in enumerate(writes)]
    signals = signals or [-1] * len(tasks)
    prods = defaultdict(list)
    for t, c in enumerate(signals):
        if c >= 0:
            prods[c].append(t)
    counters = [Counter(c, len(prods[c]), tuple(prods[c])) for c in sorted(prods)]
    return Schedule(model="synthetic", batch=1, context=1, num_sms=len(queues), buffers={"buf": buf},
                    tasks=tasks, queues=queues, waits=waits or [[] for _ in tasks], signals=signals,
                    counters=counters)


def test_overlapping_writes_without_order_race():
    sc = _synthetic([(0, 8), (4, 12), (12, 16)], [[0, 2], [1]])
    p = of_kind(validate(sc), "race")
    assert len(p) == 1 and p[0].tasks == (0, 1) and p[0].buffers == ("buf",)
    assert "w0[0:8] (LINEAR) writes buf[0:8] and w1[4:12] (LINEAR) writes buf[4:12]" in p[0].message
    ordered = _synthetic([(0, 8), (4, 12), (12, 16)], [[0, 2], [1]], waits=[[], [(0, 1)], []],
                         signals=[0, -1, -1])
    assert validate(ordered) == []


def test_more_ctas_than_sms():
    sc = tiny(2, 64, 4)
    sc.queues.append([])
    p = of_kind(validate(sc), "resources")[0]
    assert "more CTAs than SMs" in p.message and "5 queues" in p.message
    assert "more CTAs than SMs" in of_kind(validate(tiny(2, 64, 8), device_sms=4), "resources")[0].message


def test_task_missing_from_queues():
    sc = tiny()
    t = sc.queues[2].pop(1)
    p = of_kind(validate(sc), "structure")[0]
    assert p.tasks == (t,) and sc.tasks[t].name in p.message and "no queue" in p.message


def test_task_queued_twice():
    sc = tiny()
    t = sc.queues[2][1]
    sc.queues[3].append(t)
    p = of_kind(validate(sc), "structure")[0]
    assert p.tasks == (t,) and sc.tasks[t].name in p.message and "queued 2 times" in p.message


def test_region_outside_its_buffer_or_of_an_unknown_buffer():
    sc = tiny()
    t = sc.tasks[3]
    r = t.writes[0]
    big = Region(r.buffer, tuple((lo, hi + 1000) for lo, hi in r.box))
    ghost = Region("nope", r.box)
    sc.tasks = list(sc.tasks)
    sc.tasks[3] = dataclasses.replace(t, writes=(big,), reads=(*t.reads, ghost))
    problems = of_kind(validate(sc), "region")
    assert any(r.buffer in p.buffers and "outside" in p.message for p in problems)
    assert any(p.buffers == ("nope",) and "no buffer nope" in p.message for p in problems)


def test_region_must_cover_each_operand():
    sc = tiny()
    t = sc.tasks[3]
    sc.tasks = list(sc.tasks)
    sc.tasks[3] = dataclasses.replace(t, writes=())
    p = of_kind(validate(sc), "coverage")[0]
    assert t.name in p.message and "declares no region" in p.message


def test_resources():
    sc = _tiny(2, 64, 8)
    assert validate(sc, smem_bytes=227 * 1024, regs=168, threads=384) == []
    msgs = [p.message for p in validate(sc, smem_bytes=300 * 1024, regs=200, threads=384)]
    assert any("shared memory" in m for m in msgs) and any("registers" in m for m in msgs)
    with pytest.raises(ValueError):
        validate(sc, regs=128)


# -- the reference checker and the property test ------------------------------------------------------

@cache
def _conflicts(batch: int, context: int, num_sms: int) -> tuple[tuple[int, int], ...]:
    """(a, b), a < b, for every pair of tasks whose non-weight regions overlap with a write: naive."""
    sc = _tiny(batch, context, num_sms)
    acc = [[(r, w) for rs, w in ((t.reads, False), (t.writes, True)) for r in rs
            if sc.buffers[r.buffer].kind != "weight"] for t in sc.tasks]
    return tuple((a, b) for b in range(len(acc)) for a in range(b)
                 if any((wa or wb) and ra.overlaps(rb) for ra, wa in acc[a] for rb, wb in acc[b]))


def reference_safe(sc: Schedule, conflicts: tuple[tuple[int, int], ...], seed: int = 0) -> bool:
    n = len(sc.tasks)
    if sorted(t for q in sc.queues for t in q) != list(range(n)) or len(sc.queues) > sc.num_sms:
        return False
    producers: dict[int, list[int]] = defaultdict(list)
    for t, c in enumerate(sc.signals):
        if c != -1:
            producers[c].append(t)
    ids = {c.id for c in sc.counters}
    if not set(producers) <= ids or any(c.target != len(producers[c.id]) for c in sc.counters):
        return False
    if any(c not in ids or not producers[c] or n_ != len(producers[c]) for ws in sc.waits for c, n_ in ws):
        return False
    # one step, random interleaving: run any SM whose head's waits are met; counters only grow, so
    # the order cannot matter for whether it completes
    rng = random.Random(seed)
    count: dict[int, int] = defaultdict(int)
    heads = [0] * len(sc.queues)
    while True:
        ready = [s for s, q in enumerate(sc.queues)
                 if heads[s] < len(q) and all(count[c] >= n_ for c, n_ in sc.waits[q[heads[s]]])]
        if not ready:
            break
        s = rng.choice(ready)
        t = sc.queues[s][heads[s]]
        heads[s] += 1
        if sc.signals[t] != -1:
            count[sc.signals[t]] += 1
    if any(h < len(q) for h, q in zip(heads, sc.queues)):
        return False
    g = nx.DiGraph()
    g.add_nodes_from(range(n))
    for q in sc.queues:
        nx.add_path(g, q)

    def routing(c: int, t: int) -> bool:  # a routing wait orders the router logits alone (schedule.py)
        return all(routing_edge(sc.tasks[p], sc.tasks[t]) for p in producers[c])

    for t, ws in enumerate(sc.waits):
        g.add_edges_from((p, t) for c, _ in ws if not routing(c, t) for p in producers[c])
    # a router tile and an expert-up tile conflict on the logits alone (the router reads only what
    # the expert-up tile reads too)
    routed = {(p, t) for t, ws in enumerate(sc.waits) for c, _ in ws if routing(c, t) for p in producers[c]}
    return all(nx.has_path(g, a, b) or (a, b) in routed for a, b in conflicts)


MUTATIONS = ["drop_wait", "move_earlier", "move_to_other_sm", "wait_target", "counter_target", "resignal"]


def mutate(sc: Schedule, kind: str, data: st.DataObject) -> str:
    draw = data.draw
    if kind == "drop_wait":
        ts = [t for t, ws in enumerate(sc.waits) if ws]
        assume(ts)
        t = draw(st.sampled_from(ts))
        w = sc.waits[t].pop(draw(st.integers(0, len(sc.waits[t]) - 1)))
        return f"{sc.tasks[t].name} no longer waits on {w}"
    if kind == "move_earlier":
        qs = [s for s, q in enumerate(sc.queues) if len(q) > 1]
        assume(qs)
        q = sc.queues[draw(st.sampled_from(qs))]
        i = draw(st.integers(1, len(q) - 1))
        j = draw(st.integers(0, i - 1))
        q.insert(j, q.pop(i))
        return f"{sc.tasks[q[j]].name} moved from #{i} to #{j}"
    if kind == "move_to_other_sm":
        assume(len(sc.queues) > 1)
        s = draw(st.sampled_from([s for s, q in enumerate(sc.queues) if q]))
        t = sc.queues[s].pop(draw(st.integers(0, len(sc.queues[s]) - 1)))
        d = draw(st.sampled_from([x for x in range(len(sc.queues)) if x != s]))
        j = draw(st.integers(0, len(sc.queues[d])))
        sc.queues[d].insert(j, t)
        return f"{sc.tasks[t].name} moved from SM {s} to SM {d} #{j}"
    if kind == "wait_target":
        ts = [t for t, ws in enumerate(sc.waits) if ws]
        assume(ts)
        t = draw(st.sampled_from(ts))
        i = draw(st.integers(0, len(sc.waits[t]) - 1))
        c, n = sc.waits[t][i]
        sc.waits[t][i] = (c, n + draw(st.sampled_from([-1, 1])))
        return f"{sc.tasks[t].name} waits for {sc.waits[t][i]}"
    if kind == "counter_target":
        assume(sc.counters)
        i = draw(st.integers(0, len(sc.counters) - 1))
        c = sc.counters[i]
        sc.counters[i] = dataclasses.replace(c, target=c.target + draw(st.sampled_from([-1, 1])))
        return f"counter {c.id} target {sc.counters[i].target}"
    assert kind == "resignal"
    t = draw(st.integers(0, len(sc.tasks) - 1))
    choices = [c.id for c in sc.counters if c.id != sc.signals[t]] + ([-1] if sc.signals[t] != -1 else [])
    assume(choices)
    sc.signals[t] = draw(st.sampled_from(choices))
    return f"{sc.tasks[t].name} signals {sc.signals[t]}"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(batch=st.integers(1, 4), num_sms=st.integers(1, 8), context=st.sampled_from([1, 7, 64]),
       kind=st.sampled_from(MUTATIONS), data=st.data())
def test_mutants_are_judged_like_the_reference(batch, num_sms, context, kind, data):
    sc = tiny(batch, context, num_sms)
    conflicts = _conflicts(batch, context, num_sms)
    note(mutate(sc, kind, data))
    expected = reference_safe(sc, conflicts)
    problems = validate(sc)
    note(f"reference: {'safe' if expected else 'unsafe'}; validator: {[str(p) for p in problems[:5]]}")
    assert (problems == []) == expected


def test_reference_accepts_the_real_schedules():
    for args in [(1, 7, 1), (2, 64, 4), (4, 1, 8)]:
        assert reference_safe(_tiny(*args), _conflicts(*args))


def test_every_dropped_wait_is_judged_like_the_reference():
    """Exhaustive over one schedule: harmless drops (a redundant wait) must be accepted too."""
    args = (2, 64, 4)
    base, conflicts = _tiny(*args), _conflicts(*args)
    verdicts = []
    for t, ws in enumerate(base.waits):
        for i in range(len(ws)):
            sc = tiny(*args)
            del sc.waits[t][i]
            expected = reference_safe(sc, conflicts)
            assert (validate(sc) == []) == expected, (sc.tasks[t].name, ws[i])
            verdicts.append(expected)
    assert not all(verdicts), "expected some dropped wait to race"
    assert any(verdicts), "expected some dropped wait to be harmless (else a validator rejecting every drop passes)"


def test_check_resources_after_the_kernel_build():
    """mkc compile runs duty 4 again with the built kernel's registers and shared memory."""
    from mkc.ir.lower import lower
    from mkc.ir.spec import load_spec
    from mkc.schedule.scheduler import schedule
    from mkc.schedule.validator import check_resources

    sc = schedule(lower(load_spec("configs/tiny.yaml"), 1, 16, 4), "tiny")
    check_resources(sc, smem_bytes=64 * 1024, regs=252, threads=256)  # the shipped kernel's shape
    with pytest.raises(ScheduleError, match="shared memory"):
        check_resources(sc, smem_bytes=300_000, regs=64, threads=256)
    with pytest.raises(ScheduleError, match="registers"):
        check_resources(sc, smem_bytes=1024, regs=255, threads=512)
