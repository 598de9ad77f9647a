"""The shared-bandwidth simulation of a scheduled step (mkc/schedule/simulate.py)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from conftest import ROOT, load_benchmark

from mkc.ir.lower import lower
from mkc.ir.ops import Opcode
from mkc.schedule.cost import H200
from mkc.schedule.scheduler import schedule
from mkc.schedule.simulate import fair_rates, simulate, simulated_step_us

# no fixed time, no hop: only the bytes and the bandwidth's sharing decide
BARE = dataclasses.replace(H200, sim_fixed_us={op.name: 0.0 for op in Opcode}, sim_hop=0.0)


def test_fair_rates_give_capped_streams_their_cap_and_the_rest_to_the_others():
    np.testing.assert_allclose(fair_rates(np.array([10.0, 10.0]), 8.0), [4.0, 4.0])
    np.testing.assert_allclose(fair_rates(np.array([1.0, 10.0, 10.0]), 8.0), [1.0, 3.5, 3.5])
    np.testing.assert_allclose(fair_rates(np.array([2.0, 3.0]), 100.0), [2.0, 3.0])  # caps bind: bandwidth left
    assert fair_rates(np.array([5.0, 1.0, 5.0]), 6.0).sum() == pytest.approx(6.0)


@pytest.fixture()
def tiny_schedule(tiny):
    return schedule(lower(tiny, 1, 40, 4), tiny.name)


def test_every_task_starts_after_its_producers_and_the_task_before_it(tiny_schedule):
    from mkc.schedule.profile import blockers

    sc = tiny_schedule
    c = dataclasses.replace(H200, sim_hop=0.5e-6)
    start, end = simulate(sc, c)
    producers, before = blockers(sc)
    for t in range(len(sc.tasks)):
        assert end[t] > start[t]
        assert all(start[t] >= end[p] + 0.5 - 1e-6 for p in producers[t])
        assert before[t] < 0 or start[t] >= end[before[t]] - 1e-9
    assert simulated_step_us(sc, c) == pytest.approx(end.max() + H200.launch_in_graph * 1e6)


def test_a_lone_stream_runs_at_its_cap_and_streams_side_by_side_share_the_bandwidth(tiny_schedule):
    """One SM: each task streams alone, at the cap (bandwidth 10x the cap). Bandwidth at the cap
    shared by every SM: each task takes as long as on one SM only where it streams alone."""
    sc = tiny_schedule
    mb = np.array([t.weight_bytes + t.act_bytes for t in sc.tasks]) / 1e6
    one_sm = dataclasses.replace(sc, queues=[[t for q in sc.queues for t in q]] + [[] for _ in sc.queues[1:]])
    # the tasks in an order every producer comes first in: the scheduler's start times
    one_sm.queues[0].sort(key=lambda t: (sc.predicted["start_us"][t], t))
    alone = dataclasses.replace(BARE, sm_stream_cap=1e9, split_stream_cap=1e9, read_bw=10e9)
    start, end = simulate(one_sm, alone)
    np.testing.assert_allclose(end - start, mb / 1e-3, rtol=1e-9)  # 1 GB/s = 1e-3 MB/µs
    shared = dataclasses.replace(alone, read_bw=1e9)
    start, end = simulate(sc, shared)
    run = end - start
    assert (run >= mb / 1e-3 - 1e-6).all() and (run > mb / 1e-3 * 1.5).any()
    # a whole step's bytes at most at the bandwidth: no faster than that
    assert end.max() >= mb.sum() / 1e-3 - 1e-6


def test_a_schedule_whose_tasks_can_never_start_is_an_error_not_a_hang(tiny_schedule):
    sc = tiny_schedule
    q = [list(x) for x in sc.queues]
    for s in range(len(q)):  # the last task first on every SM: it waits for what comes after it
        if len(q[s]) > 1:
            q[s] = q[s][-1:] + q[s][:-1]
    with pytest.raises(ValueError, match="no task can start"):
        simulate(dataclasses.replace(sc, queues=q), H200)


def test_mkc_compile_reports_the_simulated_step_beside_the_list_schedulers(tiny, tmp_path):
    """compile_schedule's predicted timeline is the simulation's; the list scheduler's step stays
    as placement_step_us, and the summary and the trace say which is which."""
    import json

    from mkc.compiler import compile_schedule
    from mkc.schedule.plan import plan
    from mkc.schedule.visualize import format_summary, summary, write_trace

    sc, times = compile_schedule(tiny, 2, 40, 8)
    listed = plan(tiny, 2, 40, 8)
    _, end = simulate(listed)
    assert sc.predicted["placement_step_us"] == listed.predicted["step_us"]
    assert sc.predicted["step_us"] == pytest.approx(simulated_step_us(listed), abs=1e-3)  # stored to 1e-3 µs
    assert sc.predicted["end_us"] == [round(float(x), 3) for x in end]
    assert sc.queues == listed.queues and "simulate" in times
    line = next(ln for ln in format_summary(summary(sc, tiny)).splitlines() if ln.startswith("predicted step"))
    assert f"{sc.predicted['step_us']:.1f} µs" in line
    assert f"the list scheduler's placement estimate {listed.predicted['step_us']:.1f} µs" in line
    doc = json.loads(write_trace(sc, tmp_path / "trace.json").read_text())
    assert doc["otherData"]["source"] == "mkc shared-bandwidth simulation (predicted)"
    assert "placement estimate" not in format_summary(summary(listed, tiny))


def test_live_slot_probability_is_that_of_the_distinct_count_of_uniform_routing():
    """Every way 3 tokens can each pick 2 of 4 experts, counted: P(more than j distinct) per slot j;
    the slots' probabilities add up to the expected distinct count E (1 - (1 - k/E)^B); one
    token's slots are all live."""
    import itertools

    from mkc.schedule.cost import live_slot_probability

    picks = list(itertools.combinations(range(4), 2))
    counts = [len(set(a) | set(b) | set(c)) for a, b, c in itertools.product(picks, repeat=3)]
    by_enumeration = [sum(n > j for n in counts) / len(counts) for j in range(4)]
    np.testing.assert_allclose(live_slot_probability(4, 2, 3), by_enumeration, rtol=1e-12)
    assert by_enumeration[2] == pytest.approx(35 / 36)  # two distinct only when all three pick one pair
    for batch in (1, 2, 4, 8):
        live = live_slot_probability(128, 8, batch)
        assert len(live) == 8 * batch and (np.diff(live) <= 1e-12).all()
        assert live.sum() == pytest.approx(128 * (1 - (1 - 8 / 128) ** batch))
    np.testing.assert_array_equal(live_slot_probability(128, 8, 1), np.ones(8))
    with pytest.raises(ValueError, match="expected 0 < top_k <= num_experts"):
        live_slot_probability(4, 5, 1)


def test_expert_tiles_stream_their_expected_bytes(nmc):
    """North Mini Code at batch 8: the simulation streams a routing slot's expert tiles at its
    expected bytes (cost.expected_weight_bytes), 51.6 live slots of 64 on average, so a layer's
    last slot's tiles run at about their fixed time; every other task's bytes are its own."""
    from mkc.schedule.cost import expected_weight_bytes

    prog = lower(nmc, 8, 8192, 132, attention_sms=64)
    weights = expected_weight_bytes(prog.tasks, prog.buffers, 8)
    up = [t for t in prog.tasks if t.op is Opcode.EXPERT_SWIGLU and t.layer == 10]
    per_slot = {}
    for t in up:
        per_slot[t.arg("slot")] = per_slot.get(t.arg("slot"), 0.0) + weights[t.id]
    one_expert = sum(t.weight_bytes for t in up if t.arg("slot") == 0)
    assert sum(per_slot.values()) / one_expert == pytest.approx(128 * (1 - (120 / 128) ** 8))
    assert per_slot[63] < 1e-3 * one_expert and per_slot[0] == pytest.approx(one_expert)
    assert all(w == t.weight_bytes for w, t in zip(weights, prog.tasks) if t.op is not Opcode.EXPERT_SWIGLU
               and t.op is not Opcode.EXPERT_DOWN)
    assert expected_weight_bytes(prog.tasks, prog.buffers, 8) == weights
    sc = schedule(prog, nmc.name)
    start, end = simulate(sc)
    last = [t.id for t in up if t.arg("slot") == 63]
    first = [t.id for t in up if t.arg("slot") == 0]
    assert max(end[last] - start[last]) < 0.2 * min(end[first] - start[first])


def test_the_predicted_speed_of_light_counts_the_experts_a_step_routes_to_on_average(nmc):
    """North Mini Code at batch 8: mkc compile's speed-of-light bytes count the routing slots'
    experts at their expected bytes, as the simulated step streams them, so the predicted fraction
    stays under 1 (with every slot live it read 101%; the H200 measured 86.2% on 2026-12-04), and
    the summary names the bytes with every slot live."""
    from mkc.compiler import compile_schedule
    from mkc.schedule.cost import expected_weight_bytes
    from mkc.schedule.visualize import format_summary, summary

    sc, _ = compile_schedule(nmc, 8, 8192, 132, attention_sms=64, global_attention_sms=0)
    d = summary(sc, nmc)
    assert d["weight_bytes"] == pytest.approx(sum(expected_weight_bytes(sc.tasks, sc.buffers, 8)))
    assert d["bytes_every_slot"] == sum(t.weight_bytes + t.act_bytes for t in sc.tasks)
    assert 0.8 * d["bytes_every_slot"] < d["bytes"] < 0.9 * d["bytes_every_slot"]
    assert 0 < d["sol_fraction"] < 1
    line = next(ln for ln in format_summary(d).splitlines() if ln.startswith("bytes read"))
    assert "as expected under random routing" in line and f"{d['bytes_every_slot'] / 1e9:.2f} GB" in line


def test_the_unused_bandwidth_and_the_bytes_make_the_simulated_step(tiny, tmp_path):
    """predict's unused_bandwidth_us: the step is the bytes at the read bandwidth plus the unused
    bandwidth (plus the launch), every entry names a stage of the model or a finished SM, and mkc
    compile's summary and report.md show it, largest first."""
    from mkc.compiler import compile_schedule
    from mkc.schedule.stages import stage
    from mkc.schedule.visualize import format_summary, summary, write_report

    sc, _ = compile_schedule(tiny, 2, 40, 8)
    u = sc.predicted["unused_bandwidth_us"]
    d = summary(sc, tiny)
    # the entries and the step are stored rounded to 1e-3 µs (simulate.predict): 27 entries here, each off by
    # up to 5e-4 µs, on a 164 µs step (8e-5 relative at most)
    assert sum(x["us"] for x in u) + d["sol_us"] + H200.launch_in_graph * 1e6 == pytest.approx(d["step_us"], rel=1e-4)
    assert [x["us"] for x in u] == sorted((x["us"] for x in u), reverse=True) and u[0]["us"] > 0
    stages = {stage(t) for t in sc.tasks}
    assert all(x["stage"] in stages and x["state"] in ("fixed time", "waiting for inputs") or
               (x["stage"], x["state"]) in (("", "finished"), ("", "streams at their caps")) for x in u)
    assert all(type(x["us"]) is float for x in u)
    line = next(ln for ln in format_summary(d).splitlines() if ln.startswith("bandwidth unused"))
    top = u[0]
    assert f"{sum(x['us'] for x in u):.1f} µs" in line and f"{top['stage']} {top['state']} {top['us']:.1f}" in line
    report = write_report(sc, tiny, tmp_path / "report.md").read_text()
    assert "## Bandwidth left unused" in report and f"| {top['stage']} | {top['state']} | {top['us']:.1f} |" in report


def test_mkc_compile_predicts_an_h100_at_its_read_bandwidth(nmc):
    """compile_schedule(gpu="h100"): the same schedule, simulated at the H100's read bandwidth
    (cost.H100; on 2026-12-05 this put North Mini Code's step at 8K within 1.8% of the H100's
    measured ones at batch 1-8), its speed of light taken at that bandwidth too, and the summary
    names the card."""
    from mkc.compiler import compile_schedule
    from mkc.schedule.cost import GPUS, H100, gpu_name
    from mkc.schedule.visualize import format_summary, summary

    h200, _ = compile_schedule(nmc, 1, 8192, 132, attention_sms=32)
    h100, _ = compile_schedule(nmc, 1, 8192, 132, attention_sms=32, gpu="h100")
    assert h100.queues == h200.queues and h100.counters == h200.counters
    assert h100.predicted["simulated_on"] == {"gpu": "h100", "read_bw": H100.read_bw}
    assert h200.predicted["simulated_on"] == {"gpu": "h200", "read_bw": H200.read_bw}
    assert h100.predicted["step_us"] == pytest.approx(simulated_step_us(h200, H100), abs=1e-3)  # stored to 1e-3 µs
    assert h100.predicted["step_us"] > h200.predicted["step_us"]  # fewer bytes per µs, the same fixed times
    assert h100.meta["options"]["gpu"] == "h100"
    d = summary(h100, nmc)
    assert d["read_bw"] == H100.read_bw and d["sol_us"] == pytest.approx(d["bytes"] / H100.read_bw * 1e6)
    unused = sum(x["us"] for x in h100.predicted["unused_bandwidth_us"])
    assert unused + d["sol_us"] + H100.launch_in_graph * 1e6 == pytest.approx(d["step_us"], rel=1e-4)
    line = next(ln for ln in format_summary(d).splitlines() if ln.startswith("speed of light"))
    assert "at 3.05 TB/s (an H100's read bandwidth)" in line
    assert gpu_name("NVIDIA H100 80GB HBM3") == "h100" and gpu_name("NVIDIA H200") == "h200"
    assert set(GPUS) == {"h100", "h200"}


def test_mkc_bench_records_the_simulated_step_at_its_runs_bandwidth(tiny_schedule, tmp_path):
    """runtime/bench.py: each timed megakernel row carries what mkc compile's simulation predicts for
    the schedule it timed at the run's measured read bandwidth (predicted_us, in bench.json); the
    baseline's rows carry none."""
    import json

    from mkc.runtime import bench
    from mkc.schedule.cost import H100

    assert bench.predicted_step_us(tiny_schedule, H200.read_bw) == pytest.approx(simulated_step_us(tiny_schedule))
    assert bench.predicted_step_us(tiny_schedule, H100.read_bw) == pytest.approx(
        simulated_step_us(tiny_schedule, H100))
    base = bench.row("torch+graph", 2, 40, [1e-3], 10**6, 3e12)
    assert base.predicted_us is None
    mk = bench.row("mkc", 2, 40, [1e-4], 10**6, 3e12)
    mk.predicted_us = 101.5
    bench.write_json([mk, base], tmp_path / "bench.json", {})
    rows = json.loads((tmp_path / "bench.json").read_text())["rows"]
    assert [r["predicted_us"] for r in rows] == [101.5, None]


def _profiled_bench(folder, model: str, batch: int, context: int, truth) -> float:
    """An `mkc bench --profile -o folder` output for one point whose 'measured' step is the
    simulation under the ceilings ``truth``: bench.json and the timeline by task id."""
    import json

    from mkc.ir.spec import load_spec
    from mkc.schedule.plan import plan
    from mkc.schedule.simulate import simulate

    sc = plan(load_spec(ROOT / "configs" / f"{model}.yaml"), batch, context, 132)
    start, end = simulate(sc, truth)
    folder.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(folder / f"trace-b{batch}-c{context}.npz", op=np.array([int(t.op) for t in sc.tasks]),
                        start=start, end=end)
    step = float(end.max()) + truth.launch_in_graph * 1e6
    (folder / "bench.json").write_text(json.dumps({"meta": {"model": model, "page_size": 0}, "rows": [
        {"engine": "mkc", "batch": batch, "context": context, "step_us": step, "read_bw": truth.read_bw},
        {"engine": "torch+graph", "batch": batch, "context": context, "step_us": 2 * step, "read_bw": truth.read_bw}]}))
    return step


def test_calibrate_models_refits_the_fixed_times_over_several_models(tmp_path, capsys):
    """benchmarks/calibrate_models.py on two models' profiles made by the simulation itself with
    every fixed time 3 µs longer than shipped: with the shipped times the simulation is fast on both,
    with the times it refits over both it comes nearer each measured step; a profile of another
    schedule is refused in one line."""
    from mkc.schedule.cost import SIM_FIXED_US

    cal = load_benchmark("calibrate_models")
    truth = dataclasses.replace(H200, read_bw=3.0e12, sim_fixed_us={k: v + 3.0 for k, v in SIM_FIXED_US.items()})
    dirs = [tmp_path / "qwen3", tmp_path / "llama"]
    _profiled_bench(dirs[0], "qwen3_moe_tiny", 1, 256, truth)
    _profiled_bench(dirs[1], "llama_tiny", 2, 256, truth)
    points = cal.load_points(dirs, 132)
    assert [(p.model, p.batch) for p in points] == [("qwen3_moe_tiny", 1), ("llama_tiny", 2)]
    fits = cal.refit_fixed_us(points)
    assert fits["LINEAR"][0] > SIM_FIXED_US["LINEAR"] + 1.5
    cal.main([str(d) for d in dirs])
    rows = [ln.split() for ln in capsys.readouterr().out.splitlines()[1:3]]
    for r in rows:
        shipped, refitted = abs(float(r[5].rstrip("%"))), abs(float(r[7].rstrip("%")))
        assert float(r[5].rstrip("%")) < -5 and refitted < shipped / 2, r
    bad = tmp_path / "bad"  # llama_tiny's point at batch 1, its timeline qwen3_moe_tiny's
    _profiled_bench(bad, "llama_tiny", 1, 256, truth)
    (dirs[0] / "trace-b1-c256.npz").replace(bad / "trace-b1-c256.npz")
    with pytest.raises(SystemExit, match="its tasks are not this tree's schedule of llama_tiny at batch 1"):
        cal.load_points([bad], 132)
