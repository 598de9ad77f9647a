"""Reading a step's timeline (mkc/schedule/profile.py, runtime/bench.write_profile): checked on the
schedule's own predicted timeline, which has the same form as a measured one."""

from __future__ import annotations

import dataclasses
import itertools
import json
import re

import numpy as np
import pytest
import torch

from mkc.ir.lower import lower
from mkc.ir.spec import load_spec
from mkc.runtime.bench import write_profile
from mkc.schedule.profile import (
    Gaps,
    critical_chain,
    format_handoffs,
    format_last_tasks,
    format_layer,
    format_layer_times,
    format_phases,
    format_profile,
    format_staging_after,
    format_staging_phases,
    handoffs,
    last_tasks,
    layer_kind,
    layer_times,
    measured_gaps,
    op_shares,
    phases,
    read_rate,
    replay,
    routing_phases,
    stage,
    stage_ends,
    staging_after,
    staging_phases,
)
from mkc.schedule.scheduler import schedule


@pytest.fixture(scope="module")
def sc_tl():
    spec = load_spec("configs/tiny.yaml")
    sc = schedule(lower(spec, 2, 32, 8), spec.name)
    start, end = np.array(sc.predicted["start_us"]), np.array(sc.predicted["end_us"])
    sm = np.empty(len(sc.tasks), dtype=np.int64)
    for i, q in enumerate(sc.queues):
        sm[q] = i
    return sc, {"start": start, "end": end, "wait": start - 0.5, "sm": sm}


def test_chain_links_each_task_to_a_blocker(sc_tl):
    sc, tl = sc_tl
    ch = critical_chain(sc, tl["start"], tl["end"])
    assert ch.tasks[-1] == int(np.argmax(tl["end"]))
    assert not sc.waits[ch.tasks[0]] and any(q and q[0] == ch.tasks[0] for q in sc.queues)  # nothing before it
    pos = {t: (s, i) for s, q in enumerate(sc.queues) for i, t in enumerate(q)}
    for a, b in zip(ch.tasks, ch.tasks[1:]):
        by_counter = any(a in sc.counters[c].producers for c, _ in sc.waits[b])
        by_queue = pos[a][0] == pos[b][0] and pos[a][1] == pos[b][1] - 1
        assert by_counter or by_queue, (sc.tasks[a].name, sc.tasks[b].name)
    run = sum(tl["end"][t] - tl["start"][t] for t in ch.tasks)
    assert ch.total_run_us == pytest.approx(run)


def test_shares_and_report(sc_tl):
    sc, tl = sc_tl
    shares = op_shares(sc, tl["start"], tl["end"])
    assert sum(shares.values()) == pytest.approx(1.0) and list(shares.values()) == sorted(shares.values(), reverse=True)
    text = format_profile(sc, tl)
    assert "critical chain:" in text and "waiting" in text and next(iter(shares)) in text


def test_phases_split_each_task_at_its_marks(sc_tl):
    """A timeline of the phase-marking kernel (CodegenOptions.profile_phases): each op's mean wait,
    staging (tasks that stage only), op, release and routed (tasks that route only) are the
    differences of its tasks' marks."""
    sc, tl = sc_tl
    start, end = tl["start"], tl["end"]
    stages = np.array([t.op.name in ("LINEAR", "SWIGLU", "EXPERT_SWIGLU", "EXPERT_DOWN") for t in sc.tasks])
    run = end - start
    staged = np.where(stages, start + 0.25 * run, np.nan)
    done = end - 0.125 * run
    ph = phases(sc, {**tl, "staged": staged, "done": done})
    for op, v in ph.items():
        idx = [t.id for t in sc.tasks if t.op.name == op]
        r = run[idx]
        assert v["tasks"] == len(idx) and v["wait"] == pytest.approx(0.5)
        assert v["release"] == pytest.approx(0.125 * r.mean())
        if stages[idx[0]]:
            assert v["staging"] == pytest.approx(0.25 * r.mean()) and v["op"] == pytest.approx(0.625 * r.mean())
        else:
            assert np.isnan(v["staging"]) and v["op"] == pytest.approx(0.875 * r.mean())
        assert np.isnan(v["routed"])  # this timeline has no routed marks
    routes = np.array([t.op.name in ("EXPERT_SWIGLU", "EXPERT_DOWN", "TOPK") for t in sc.tasks])
    assert routes.any()
    routed = np.where(routes, start + 0.125 * run, np.nan)
    for op, v in phases(sc, {**tl, "staged": staged, "done": done, "routed": routed}).items():
        idx = [t.id for t in sc.tasks if t.op.name == op]
        if routes[idx[0]]:
            assert v["routed"] == pytest.approx(0.125 * run[idx].mean())
        else:
            assert np.isnan(v["routed"])
    chain = critical_chain(sc, start, end).tasks
    assert sum(v["tasks"] for v in phases(sc, {**tl, "staged": staged, "done": done}, chain).values()) == len(chain)
    # by stage: each stage's tasks are those of its label (a LINEAR op's roles apart), same marks
    by_stage = phases(sc, {**tl, "staged": staged, "done": done}, by_stage=True)
    linear = {stage(t) for t in sc.tasks if t.op.name == "LINEAR"}
    assert len(linear) > 1 and linear <= set(by_stage)
    assert sum(by_stage[s]["tasks"] for s in linear) == ph["LINEAR"]["tasks"]
    for s in linear:
        idx = [t.id for t in sc.tasks if stage(t) == s]
        assert by_stage[s]["tasks"] == len(idx)
        assert by_stage[s]["staging"] == pytest.approx(0.25 * run[idx].mean())
    text = format_profile(sc, {**tl, "staged": staged, "done": done})
    assert format_phases(sc, {**tl, "staged": staged, "done": done}) in text and "the critical chain's tasks:" in text
    assert "phases per task" not in format_profile(sc, tl)  # a timeline without the marks


def test_routing_phases_are_the_marks_differences(sc_tl):
    """A timeline with the routing's marks (CodegenOptions.profile_phases): per op whose tasks
    derived a routing, the median of each phase over the tasks that have both of its marks; an op
    without the opening or the tagged logits' mark (the routing task, the counter path) shows "-"
    there; tasks that found the routing known (no "ranked") are not counted."""
    sc, tl = sc_tl
    start, end = tl["start"], tl["end"]
    run = end - start
    op = np.array([t.op.name for t in sc.tasks])
    up, topk, down = op == "EXPERT_SWIGLU", op == "TOPK", op == "EXPERT_DOWN"
    assert up.any() and topk.any() and down.any()
    nan = np.full(len(op), np.nan)
    marks = {"opened": np.where(up, start + 0.05 * run, nan),
             "routing": np.where(up | topk, start + 0.10 * run, nan),
             "logits": np.where(up, start + 0.15 * run, nan),
             "ranked": np.where(up | topk, start + 0.25 * run, nan),
             "routed": np.where(up | topk | down, start + 0.30 * run, nan),
             "staged": np.where(up | down, start + 0.40 * run, nan),
             "done": end - 0.05 * run}
    ph = routing_phases(sc, {**tl, **marks})
    assert set(ph) == {"EXPERT_SWIGLU", "TOPK"}  # the expert-down tiles found the routing known
    r = run[up]
    assert ph["EXPERT_SWIGLU"]["tasks"] == up.sum()
    for name, frac in (("opening", 0.05), ("copies", 0.05), ("logits", 0.05), ("rounds", 0.10),
                       ("rest", 0.05), ("staging", 0.10)):
        assert ph["EXPERT_SWIGLU"][name] == pytest.approx(frac * np.median(r)), name
    t = ph["TOPK"]
    assert np.isnan(t["opening"]) and np.isnan(t["copies"]) and np.isnan(t["logits"]) and np.isnan(t["rounds"])
    assert t["rest"] == pytest.approx(0.05 * np.median(run[topk])) and np.isnan(t["staging"])
    text = format_phases(sc, {**tl, **marks})
    assert "the routing, where a task derived it" in text
    assert re.search(r"^  TOPK\s+\d+\s+-\s+-\s+-\s+-\s+\d", text, re.MULTILINE), text
    no_marks = {k: v for k, v in marks.items() if k in ("routed", "staged", "done")}
    assert "the routing, where" not in format_phases(sc, {**tl, **no_marks})


def test_read_rate_conserves_the_bytes(sc_tl):
    """The read rate spreads each task's bytes over its run: integrated over the step it gives back
    every byte, at any bin width, and a bin where no task runs reads nothing."""
    sc, tl = sc_tl
    total = sum(t.weight_bytes + t.act_bytes for t in sc.tasks if tl["end"][t.id] > tl["start"][t.id])
    for width in (0.25, 1.0, 3.0):
        bins, rate = read_rate(sc, tl["start"], tl["end"], width)
        assert len(bins) == len(rate) and bins[0] == 0.0
        assert float(np.sum(rate) * 1e12 * width * 1e-6) == pytest.approx(total, rel=1e-9)
    one = {"start": np.full(len(sc.tasks), 50.0), "end": np.full(len(sc.tasks), 50.0)}
    one["start"][0], one["end"][0] = 2.0, 4.0
    bins, rate = read_rate(sc, one["start"], one["end"], 1.0)
    b = sc.tasks[0].weight_bytes + sc.tasks[0].act_bytes
    assert list(rate[:5] * 1e12 * 1e-6) == pytest.approx([0.0, 0.0, b / 2, b / 2, 0.0])


def test_layer_view(sc_tl):
    """Every op of the layer gets a row with its task count, and the layer's chain tasks are listed
    with the times of the timeline."""
    sc, tl = sc_tl
    text = format_layer(sc, tl, 1)
    ids = [t.id for t in sc.tasks if t.layer == 1]
    t0 = tl["start"][ids].min()
    for op in {sc.tasks[i].op.name for i in ids}:
        n = sum(sc.tasks[i].op.name == op for i in ids)
        assert any(line.split()[:2] == [op, str(n)] for line in text.splitlines()), (op, text)
    on_chain = [t for t in critical_chain(sc, tl["start"], tl["end"]).tasks if sc.tasks[t].layer == 1]
    assert f"on the critical chain: {len(on_chain)} tasks" in text
    for t in on_chain:
        assert f"{sc.tasks[t].name}" in text and f"{tl['end'][t] - t0:7.1f}" in text
    assert "read rate of the whole GPU, TB/s per 2 µs up to the next layer's first start" in text
    with pytest.raises(ValueError, match="layer 99: no tasks"):
        format_layer(sc, tl, 99)


def test_stage_ends_are_each_stage_last_end_from_its_layer_start(sc_tl):
    """stage_ends: per stage (a task's name without layer and tile: the LINEAR tiles of qkv, router
    and o_proj count apart), the mean over layers of its last task's end from the layer's first
    start. A synthetic timeline where every layer starts at 100 L and each stage's tasks end at
    100 L + 10 + (the stage's rank): the means are exactly 10 + rank."""
    sc, _ = sc_tl
    assert stage(next(t for t in sc.tasks if "o_proj" in t.name)) == "o_proj"
    names = sorted({stage(t) for t in sc.tasks})
    rank = {n: i for i, n in enumerate(names)}
    start = np.array([100.0 * t.layer + 1.0 for t in sc.tasks])
    end = np.array([100.0 * t.layer + 10.0 + rank[stage(t)] - (t.id % 3) for t in sc.tasks])
    for layer in {t.layer for t in sc.tasks}:  # every layer's first task starts at 100 L, each stage's
        ids = [t.id for t in sc.tasks if t.layer == layer]  # last task ends at 100 L + 10 + rank
        start[ids[0]] = 100.0 * layer
        for n in {stage(sc.tasks[i]) for i in ids}:
            end[next(i for i in ids if stage(sc.tasks[i]) == n)] = 100.0 * layer + 10.0 + rank[n]
    got = stage_ends(sc, {"start": start, "end": end})
    assert got == {n: 10.0 + rank[n] for n in names}
    assert list(got) == names  # earliest first
    assert "each stage's last end" in format_profile(sc, {"start": start, "end": end})


def test_write_profile_files(sc_tl, tmp_path, monkeypatch):
    sc, tl = sc_tl
    path = tmp_path / "trace-b2-c32.json"
    write_profile(sc, tl, path)  # no GPU here: the predicted step is an H200's
    assert json.loads(path.with_suffix(".predicted.json").read_text())["otherData"]["simulated_on"]["gpu"] == "h200"
    # profiled on an H100: the predicted step beside it is simulated at that card's read bandwidth
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    write_profile(sc, tl, path)
    assert json.loads(path.with_suffix(".predicted.json").read_text())["otherData"]["simulated_on"] == {
        "gpu": "h100", "read_bw": 3.05e12}
    events = json.loads(path.read_text())["traceEvents"]
    chain_track = [e for e in events if e.get("tid") == len(sc.queues) and e["ph"] == "X"]
    assert len(chain_track) == len(critical_chain(sc, tl["start"], tl["end"]).tasks)
    rate = [e for e in events if e["ph"] == "C"]  # the read rate's counter track, one point per µs
    assert rate and all(e["name"] == "read rate (TB/s)" and e["args"]["TB/s"] >= 0 for e in rate)
    assert len(rate) == len(read_rate(sc, tl["start"], tl["end"])[0])
    assert json.loads(path.with_suffix(".predicted.json").read_text())["otherData"]["source"].endswith("(predicted)")
    report = path.with_suffix(".txt").read_text()
    layers = sorted({t.layer for t in sc.tasks if t.layer >= 0})
    assert "critical chain" in report and f"layer {layers[len(layers) // 2]} (µs from its first start" in report
    saved = np.load(path.with_suffix(".npz"))  # the timeline, for benchmarks/replay_profile.py
    assert list(saved["op"]) == [int(t.op) for t in sc.tasks] and list(saved["layer"]) == [t.layer for t in sc.tasks]
    for k in ("wait", "start", "end", "sm"):
        assert np.array_equal(saved[k], tl[k]), k


def test_replay_keeps_every_wait_and_queue_order(sc_tl):
    sc, tl = sc_tl
    run = tl["end"] - tl["start"]
    gaps = Gaps({"LINEAR": 0.5}, {"LINEAR": 2.0, "RESIDUAL": 0.75}, default=0.25)
    start, end = replay(sc, run, gaps)
    assert np.allclose(end - start, run)
    for t, task in enumerate(sc.tasks):
        for c, _ in sc.waits[t]:
            for p in sc.counters[c].producers:
                assert start[t] >= end[p] + gaps.producer(task.op.name) - 1e-9, (sc.tasks[p].name, task.name)
    for q in sc.queues:
        for a, b in itertools.pairwise(q):
            assert start[b] >= end[a] + gaps.queue(sc.tasks[b].op.name) - 1e-9
        for t in q:  # and as soon as the later of its blockers allows, not later
            limits = [end[p] + gaps.producer(sc.tasks[t].op.name) for c, _ in sc.waits[t] for p in sc.counters[c].producers]
            i = q.index(t)
            if i:
                limits.append(end[q[i - 1]] + gaps.queue(sc.tasks[t].op.name))
            assert start[t] == pytest.approx(max(limits, default=0.0))


def test_replay_of_its_own_gaps_is_a_fixed_point(sc_tl):
    """Gaps measured on a replayed step are the gaps it was replayed with (for the opcodes each kind
    of blocker held back), and replaying with them gives the same step. (Each opcode has one gap
    for both kinds here: a task is counted under whichever blocker ended last, which is the one
    that held it back only when both gaps are equal.)"""
    sc, tl = sc_tl
    run = tl["end"] - tl["start"]
    per_op = {op.name: 0.5 + 0.1 * i for i, op in enumerate(sorted({t.op for t in sc.tasks}))}
    gaps = Gaps(per_op, dict(per_op))
    start, end = replay(sc, run, gaps)
    got = measured_gaps(sc, start, end)
    assert got.after_producer and got.after_queue
    for op, v in got.after_producer.items():
        assert v == pytest.approx(gaps.producer(op)), op
    for op, v in got.after_queue.items():
        assert v == pytest.approx(gaps.queue(op)), op
    again = replay(sc, run, got)
    assert np.allclose(again[0], start) and np.allclose(again[1], end)


def test_replay_names_a_cycle(sc_tl):
    """A queue that puts a task before its own producer cannot be replayed: a clear error."""
    sc, tl = sc_tl
    t = next(t for t in range(len(sc.tasks)) if sc.waits[t])
    p = sc.counters[sc.waits[t][0][0]].producers[0]
    queues = [[x for x in q if x not in (t, p)] for q in sc.queues]
    queues[0] = [t, p, *queues[0]]
    bad = dataclasses.replace(sc, queues=queues)
    with pytest.raises(ValueError, match="never became ready"):
        replay(bad, tl["end"] - tl["start"], Gaps({}, {}))


def test_last_tasks_name_what_held_each_stage(sc_tl):
    """Each stage's last task per layer, with its last producer's signal and its SM's previous
    task's end, counted as bound by whichever came later. Held back on purpose (the task before
    each layer's last combine task ends 1 µs after that task's inputs and start), the combine
    stage is queue-bound in every layer where that task is neither a producer nor a combine tile,
    and its SM-free time is the one set."""
    sc, tl = sc_tl
    report = last_tasks(sc, tl)
    assert list(report) == list(stage_ends(sc, tl))
    layers: dict[str, set[int]] = {}
    for t in sc.tasks:
        layers.setdefault(stage(t), set()).add(t.layer)
    for name, v in report.items():
        assert v.by_inputs + v.by_queue == len(layers[name]) and v.end == pytest.approx(stage_ends(sc, tl)[name])
    start, end = tl["start"], tl["end"].copy()
    before = {q[i]: q[i - 1] for q in sc.queues for i in range(1, len(q))}
    name = "combine"
    first = {L: min(start[t.id] for t in sc.tasks if t.layer == L) for L in layers[name]}
    held, frees = 0, []
    for L in sorted(layers[name]):
        tid = max((t.id for t in sc.tasks if t.layer == L and stage(t) == name), key=lambda i: tl["end"][i])
        producers = {p for c, _ in sc.waits[tid] for p in sc.counters[c].producers}
        inputs = max(tl["end"][p] for p in producers)
        prev = before.get(tid)
        if prev is not None and prev not in producers and stage(sc.tasks[prev]) != name:
            end[prev] = max(start[tid], inputs) + 1.0
            held += 1
            frees.append(end[prev] - first[L])
        else:
            frees.append((tl["end"][prev] if prev is not None else first[L]) - first[L])
    assert held
    v = last_tasks(sc, {**tl, "end": end})[name]
    assert v.by_queue >= held and v.by_queue + v.by_inputs == len(layers[name])
    assert v.sm_free == pytest.approx(np.mean(frees))
    text = format_last_tasks(sc, tl)
    assert "each stage's last task" in text and "residual" in text and text in format_profile(sc, tl)


def test_replay_profile_replays_the_lowering_it_was_profiled_with(tmp_path, capsys, monkeypatch):
    """benchmarks/replay_profile.py on a timeline of a non-default lowering (--lowering
    residual_in_o_proj=1, as megakernel_step.py takes it): the schedule is planned again with it,
    and the oracle placement (--place-greedily) walks that lowering's DAG, not the default's (whose
    RESIDUAL tiles the schedule does not have). The timeline here is the schedule's own prediction."""
    import sys
    from pathlib import Path

    from mkc.schedule.plan import plan

    root = Path(__file__).resolve().parents[1]
    monkeypatch.syspath_prepend(str(root / "benchmarks"))
    import replay_profile

    config = root / "configs" / "tiny.yaml"
    sc = plan(load_spec(config), 1, 64, 8, residual_in_o_proj=True)
    start, end = (np.asarray(sc.predicted[k], dtype=np.float64) for k in ("start_us", "end_us"))
    path = tmp_path / "timeline.npz"
    np.savez(path, op=np.array([int(t.op) for t in sc.tasks]), layer=np.array([t.layer for t in sc.tasks]),
             wait=start, start=start, end=end, sm=np.array(sc.sm_of()))
    monkeypatch.setattr(sys, "argv", ["replay_profile.py", str(path), "--batch", "1", "--context", "64",
                                      "--num-sms", "8", "--config", str(config),
                                      "--lowering", "residual_in_o_proj=1", "--place-greedily", "o_proj"])
    replay_profile.main()
    out = capsys.readouterr().out
    assert "measured span" in out and "o_proj placed greedily, layer by layer" in out, out
    monkeypatch.setattr(sys, "argv", ["replay_profile.py", str(path), "--batch", "1", "--context", "64",
                                      "--num-sms", "8", "--config", str(config)])
    with pytest.raises(SystemExit, match="not this tree's schedule"):  # planned without the lowering
        replay_profile.main()


def test_staging_after_groups_by_the_task_before_on_the_sm(sc_tl):
    """staging_after on a timeline made to order: a staging task's staging is 1 µs after a task of
    its own stage on its SM and 3 µs after any other (or first in its queue), its op 2 µs; the
    means come back per (stage, stage before), every staging task counted once."""
    sc, tl = sc_tl
    start = tl["start"]
    before = {q[i]: q[i - 1] for q in sc.queues for i in range(1, len(q))}
    stages = np.array([t.op.name in ("LINEAR", "SWIGLU", "EXPERT_SWIGLU", "EXPERT_DOWN") for t in sc.tasks])
    after = {t.id: stage(sc.tasks[before[t.id]]) if t.id in before else "first" for t in sc.tasks}
    took = np.array([1.0 if after[t.id] == stage(t) else 3.0 for t in sc.tasks])
    staged = np.where(stages, start + took, np.nan)
    done = staged + 2.0
    made = {**tl, "staged": staged, "done": done}
    report = staging_after(sc, made)
    assert sum(v["tasks"] for v in report.values()) == int(stages.sum())
    assert any(name == prev for name, prev in report) and any(name != prev for name, prev in report)
    for (name, prev), v in report.items():
        assert v["staging"] == pytest.approx(1.0 if name == prev else 3.0) and v["op"] == pytest.approx(2.0)
        ids = [t.id for t in sc.tasks if stages[t.id] and stage(t) == name and after[t.id] == prev]
        assert v["tasks"] == len(ids)
    counts = [v["tasks"] for v in report.values()]
    assert counts == sorted(counts, reverse=True)
    text = format_staging_after(sc, made, rows=2)
    assert text.count("\n") == 3 and format_staging_after(sc, made) in format_phases(sc, made)


def test_staging_phases_split_a_linear_tiles_staging(sc_tl):
    """staging_phases on a timeline made to order: every LINEAR tile's marks (the kernel's, moved
    to columns of their own by timeline_from_profile) put its barrier, copies' issue, landing and the rest at 0.25, 0.5,
    1 and 0.125 µs times the stage's rank; other ops carry no such marks, and a LINEAR tile that
    lacks one (as a tile that waited in the kernel loop does) counts nowhere. The means come back
    per stage, every marked tile counted once, the stages with the most tiles first; format_phases
    prints the table where the timeline has the marks."""
    sc, tl = sc_tl
    start = tl["start"]
    linear = [t for t in sc.tasks if t.op.name == "LINEAR"]
    names = sorted({stage(t) for t in linear})
    assert len(names) >= 2  # qkv, router, o_proj at least
    k = np.array([names.index(stage(t)) + 1.0 if t.op.name == "LINEAR" else np.nan for t in sc.tasks])
    synced, issued = start + 0.25 * k, start + 0.75 * k
    landed, staged = issued + 1.0 * k, issued + 1.125 * k
    unmarked = linear[0].id  # a LINEAR tile without the marks
    synced[unmarked] = np.nan
    made = {**tl, "synced": synced, "issued": issued, "landed": landed, "staged": staged,
            "done": np.where(np.isnan(staged), start, staged) + 1.0, "ranked": np.full(len(start), np.nan)}
    report = staging_phases(sc, made)
    assert set(report) == set(names)
    assert sum(v["tasks"] for v in report.values()) == len(linear) - 1
    for name, v in report.items():
        r = names.index(name) + 1.0
        assert (v["barrier"], v["issue"], v["landing"], v["rest"]) == pytest.approx((0.25 * r, 0.5 * r, r, 0.125 * r))
        assert v["tasks"] == sum(1 for t in linear if stage(t) == name and t.id != unmarked)
    counts = [v["tasks"] for v in report.values()]
    assert counts == sorted(counts, reverse=True)
    chain = critical_chain(sc, made["start"], made["end"]).tasks
    assert sum(v["tasks"] for v in staging_phases(sc, made, chain).values()) == sum(
        1 for i in chain if sc.tasks[i].op.name == "LINEAR" and i != unmarked)
    text = format_staging_phases(sc, made)
    assert text in format_phases(sc, made) and all(f"  {n:<14}" in text for n in names)
    assert "LINEAR tile's staging" not in format_phases(sc, {k: v for k, v in made.items() if k != "synced"})


def test_handoffs_split_each_take_over_into_dispatch_and_poll(sc_tl):
    """handoffs on a timeline made to order: each task's wait begins a per-stage delay after the task
    before it on its SM signalled, and ends a per-stage poll after the later of that and its last
    producer's signal. The medians come back per (stage, stage before it); the total is measured
    from the later of its SM going free and its inputs; every task with a task before it counts."""
    sc, tl = sc_tl
    end = tl["end"]
    stages = sorted({stage(t) for t in sc.tasks})
    delay = {name: 0.25 * (i + 1) for i, name in enumerate(stages)}
    poll = {name: 0.1 * (i + 1) for i, name in enumerate(stages)}
    producers = [[p for c, _ in sc.waits[t] for p in sc.counters[c].producers] for t in range(len(sc.tasks))]
    before = {q[i]: q[i - 1] for q in sc.queues for i in range(1, len(q))}
    wait, start = tl["start"].copy(), tl["start"].copy()
    totals: dict[tuple[str, str], list[float]] = {}
    for t in sc.tasks:
        if t.id not in before:
            continue
        free = end[before[t.id]]
        inputs = max((end[p] for p in producers[t.id]), default=free)
        wait[t.id] = free + delay[stage(t)]
        start[t.id] = max(inputs, wait[t.id]) + poll[stage(t)]
        totals.setdefault((stage(t), stage(sc.tasks[before[t.id]])), []).append(start[t.id] - max(inputs, free))
    made = {**tl, "wait": wait, "start": start}
    report = handoffs(sc, made)
    assert set(report) == set(totals) and sum(h.tasks for h in report.values()) == len(before)
    for (name, after), h in report.items():
        assert h.dispatch == pytest.approx(delay[name]) and h.poll == pytest.approx(poll[name])
        assert h.total == pytest.approx(float(np.median(totals[name, after])))
        assert h.total >= h.poll - 1e-9  # the wait ends a poll after the later of its inputs and its wait
    costs = [h.tasks * h.total for h in report.values()]
    assert costs == sorted(costs, reverse=True)
    text = format_handoffs(sc, made, rows=3)
    assert text.count("\n") == 4 and text in format_profile(sc, made)


def test_layer_times_by_kind():
    """Each layer's time from its first task's start to the next layer's, grouped by what its tasks
    say it is (the tiny model: layer 0 global attention and a dense MLP, 1-3 sliding over 8 keys
    and MoE, 4 global and MoE; the LM head's tasks close the last layer, the embedding's are not a
    layer)."""
    spec = load_spec("configs/tiny.yaml")
    sc = schedule(lower(spec, 1, 32, 8), spec.name)
    assert [layer_kind(sc, L) for L in range(5)] == [
        "global attention + dense", *["sliding attention (8 keys) + MoE"] * 3, "global attention + MoE"]
    assert max(t.layer for t in sc.tasks) == 5  # the LM head
    first = {0: 0.0, 1: 50.0, 2: 70.0, 3: 100.0, 4: 140.0, 5: 150.0}
    start = np.array([first.get(t.layer, -5.0) + 1.0 for t in sc.tasks])
    for L, t0 in first.items():  # each layer's first task starts at its mark, the rest 1 µs later
        start[next(t.id for t in sc.tasks if t.layer == L)] = t0
    tl = {"start": start, "end": start + 1.0}
    assert layer_times(sc, tl) == {"global attention + dense": (1, 50.0, 50.0, 50.0),
                                   "sliding attention (8 keys) + MoE": (3, 30.0, 20.0, 40.0),
                                   "global attention + MoE": (1, 10.0, 10.0, 10.0)}
    text = format_layer_times(sc, tl)
    assert "global attention + dense" in text and "(1 layer)" in text and "(3 layers)" in text
    assert text in format_profile(sc, tl)


def test_replay_profile_cuts_a_fixed_time_off_the_tasks_named(tmp_path, capsys, monkeypatch):
    """benchmarks/replay_profile.py --cut: NAME=US takes US µs off every task of that opcode or
    label (never below a tenth of its run), NAME@BEFORE=US only off those right after a task of
    BEFORE of their own layer on their SM; a shorter chain replays shorter, a cut of tasks that
    no task of BEFORE precedes changes nothing, and an unknown name is refused."""
    import re
    import sys
    from pathlib import Path

    from mkc.schedule.plan import plan

    root = Path(__file__).resolve().parents[1]
    monkeypatch.syspath_prepend(str(root / "benchmarks"))
    import replay_profile

    config = root / "configs" / "tiny.yaml"
    sc = plan(load_spec(config), 1, 64, 8)
    start, end = (np.asarray(sc.predicted[k], dtype=np.float64) for k in ("start_us", "end_us"))
    path = tmp_path / "timeline.npz"
    np.savez(path, op=np.array([int(t.op) for t in sc.tasks]), layer=np.array([t.layer for t in sc.tasks]),
             wait=start, start=start, end=end, sm=np.array(sc.sm_of()))
    args = ["replay_profile.py", str(path), "--batch", "1", "--context", "64", "--num-sms", "8", "--config", str(config)]
    monkeypatch.setattr(sys, "argv", [*args, "--cut", "LINEAR=1", "LINEAR@EMBED=1", "LINEAR@LM_HEAD=1"])
    replay_profile.main()
    out = capsys.readouterr().out
    base = float(re.search(r"replayed ([\d.]+) µs", out).group(1))
    every = float(re.search(r"LINEAR run - 1 µs: ([\d.]+) µs", out).group(1))
    nothing = float(re.search(r"LINEAR@LM_HEAD run - 1 µs: ([\d.]+) µs", out).group(1))
    assert every < base and nothing == base, out  # no LINEAR tile of a layer follows the LM head
    assert "LINEAR@EMBED run - 1 µs" in out and "all together" in out
    monkeypatch.setattr(sys, "argv", [*args, "--cut", "LINEAR@nothing=1"])
    with pytest.raises(SystemExit, match="--cut nothing: expected an opcode"):
        replay_profile.main()


def test_timeline_from_profile_reads_the_words_in_task_order():
    """The profile buffer read into a timeline (cuda_backend.timeline_from_profile), on words made
    to order: two SMs, rows in queue order, ns. A task starts when its wait ends; times are µs from
    the earliest wait, rows in task-id order."""
    from mkc.runtime.cuda_backend import timeline_from_profile

    queues = [[2, 0, 3], [1]]  # SM 0 runs tasks 2, 0, 3; SM 1 task 1
    raw = np.array([
        [1000, 2000, 9000],    # task 2: waits 1-2 µs, runs to 9
        [9000, 10000, 12000],  # task 0: waits from task 2's signal
        [12000, 13000, 15000],  # task 3
        [1500, 5000, 7000],    # task 1 (SM 1): inputs at 5 µs
    ], dtype=np.int64)
    tl = timeline_from_profile(raw, queues)
    assert tl["sm"].tolist() == [0, 1, 0, 0]
    np.testing.assert_allclose(tl["wait"], [8.0, 0.5, 0.0, 11.0])
    np.testing.assert_allclose(tl["start"], [9.0, 4.0, 1.0, 12.0])  # the wait's end, as recorded
    np.testing.assert_allclose(tl["end"], [11.0, 6.0, 8.0, 14.0])
    # the phase-marking kernel's words: its unmarked phases (0) read as NaN
    marks = np.zeros((4, 10), dtype=np.int64)
    marks[:, :3] = raw
    marks[0, 3] = 1500
    ph = timeline_from_profile(marks, queues)
    assert ph["staged"][2] == 0.5 and np.isnan(ph["staged"][0]) and np.isnan(ph["routed"]).all()
    # the routing's slots (opened, routing, logits): a LINEAR tile's staging marks there (task 0
    # here) move to synced / issued / landed, and a routing task's (task 3) stay
    marks[1, 6:9] = [10100, 10200, 10400]  # task 0's row (queue index 1)
    marks[2, 6:9] = [13100, 13300, 13600]  # task 3's
    ph = timeline_from_profile(marks, queues, staging=[True, False, False, False])
    np.testing.assert_allclose([ph["synced"][0], ph["issued"][0], ph["landed"][0]], [9.1, 9.2, 9.4])
    np.testing.assert_allclose([ph["opened"][3], ph["routing"][3], ph["logits"][3]], [12.1, 12.3, 12.6])
    assert np.isnan([ph[k][0] for k in ("opened", "routing", "logits")]).all()
    assert np.isnan([ph[k][i] for k in ("synced", "issued", "landed") for i in (1, 2, 3)]).all()
    with pytest.raises(ValueError, match="expected one per task"):
        timeline_from_profile(marks, queues, staging=[True])
