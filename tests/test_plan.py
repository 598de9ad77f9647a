"""Planning a step: the SMs a parallel block sets apart for its attention splits (mkc/schedule/plan.py)."""

from __future__ import annotations

import dataclasses
import gc
import json

import pytest
import torch
from conftest import ROOT

from mkc.ir.lower import lower
from mkc.ir.ops import Opcode
from mkc.ir.spec import SpecError, load_spec
from mkc.runtime.reference import DenseReference
from mkc.runtime.weights import random_weights
from mkc.schedule import tuning
from mkc.schedule.cost import H200
from mkc.schedule.executor import CpuExecutor
from mkc.schedule.plan import attention_sms_candidates, choose_attention_sms, plan, probe_spec
from mkc.schedule.scheduler import schedule
from mkc.schedule.validator import validate

# the float32 executor against the float32 dense reference: the same sums in other orders (longer
# attention splits, taller MLP tiles). The budget of tests/test_executor.py; measured 1.4e-6 at
# most here, while a wrong split or tile gives errors of 1e-2 and more
F32_ATOL, F32_RTOL = 5e-5, 5e-5


def layer_ops(prog, layer: int) -> dict[str, int]:
    out: dict[str, int] = {}
    for t in prog.tasks:
        if t.layer == layer:
            out[t.op.name] = out.get(t.op.name, 0) + 1
    return out


def test_candidates_are_streams_times_powers_of_two_up_to_half_the_sms(nmc):
    assert attention_sms_candidates(nmc, 1, 132) == [0, 4, 8, 16, 32, 64]
    assert attention_sms_candidates(nmc, 8, 132) == [0, 32, 64]
    assert attention_sms_candidates(load_spec("configs/mixtral_tiny.yaml"), 1, 132) == [0]


def test_probe_holds_every_kind_of_layer_up_to_three_times(nmc):
    probe = probe_spec(nmc)
    kinds = [(ls.attention, ls.mlp, ls.rope) for ls in nmc.layers]
    assert {(ls.attention, ls.mlp, ls.rope) for ls in probe.layers} == set(kinds)
    # dense 0, then three cycles of three sliding-window layers and a global one (the third: 12)
    assert probe.num_layers == len(probe.layers) == 13
    assert probe.layers == nmc.layers[:13] and kinds[:13].count(kinds[12]) == 3


def test_attention_sms_gives_the_splits_their_own_wave(nmc):
    """Batch 1: 4 (sequence, KV head) streams; 32 attention SMs give 8 splits per stream, and the
    expert gate/up tiles fill their share of the SMs (96 tiles: 8 experts x 12 tiles of 64 rows)."""
    default = layer_ops(lower(nmc, 1, 8192, 132), 1)
    split = layer_ops(lower(nmc, 1, 8192, 132, attention_sms=32), 1)
    assert default["ATTN_SPLIT"] == 128 and default["EXPERT_SWIGLU"] == 128
    assert split["ATTN_SPLIT"] == 32 and split["EXPERT_SWIGLU"] == 96
    for op in ("LINEAR", "ROPE_APPEND", "ATTN_COMBINE", "EXPERT_DOWN", "RESIDUAL", "TOPK"):
        assert split[op] == default[op], op
    # global layers hold the whole context: the same 32 splits, each twice as long
    assert layer_ops(lower(nmc, 1, 8192, 132, attention_sms=32), 4)["ATTN_SPLIT"] == 32


@pytest.mark.parametrize("batch, attention_sms", [(1, 32), (8, 64)])
def test_split_schedules_are_safe(nmc, batch, attention_sms):
    sc = schedule(lower(nmc, batch, 8192, 132, attention_sms=attention_sms), nmc.name)
    assert validate(sc) == []


def test_plan_pauses_the_garbage_collector_and_leaves_it_as_it_found_it(tiny, monkeypatch):
    """plan() pauses the cyclic collector while it lowers and places (graph.gc_paused), and gives it
    back as it was, after an error too."""
    from mkc.schedule import plan as plan_mod

    collecting = []
    real = plan_mod.schedule
    monkeypatch.setattr(plan_mod, "schedule", lambda *a: collecting.append(gc.isenabled()) or real(*a))
    assert gc.isenabled()
    plan(tiny, 2, 40, 8)
    assert collecting and not any(collecting) and gc.isenabled()
    with pytest.raises(SpecError):
        plan(tiny, 2, 40, 8, attention_sms=999)
    assert gc.isenabled()
    gc.disable()
    try:
        plan(tiny, 2, 40, 8)
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_a_cached_schedule_is_read_with_the_garbage_collector_paused(tiny, tmp_path, monkeypatch):
    """Reading a stored schedule back (JSON, then tens of thousands of tasks' tuples, no cycles)
    pauses the cyclic collector and gives it back as it was: a server reads one for each step batch
    at start, and each read otherwise slows as the earlier ones stay alive."""
    from mkc.schedule import plan_cache
    from mkc.schedule.schedule import Schedule

    plan_cache.cached_plan(tiny, 2, 40, 8, cache_dir=tmp_path)
    collecting = []
    real = Schedule._from_json.__func__
    monkeypatch.setattr(Schedule, "_from_json", classmethod(lambda cls, d: collecting.append(gc.isenabled())
                                                            or real(cls, d)))
    assert plan_cache.cached_plan(tiny, 2, 40, 8, cache_dir=tmp_path)[1] is True
    assert collecting == [False] and gc.isenabled()


def test_the_compiler_keeps_the_candidate_predicted_fastest(nmc):
    sc = plan(nmc, 1, 8192, 132)
    chosen, how = sc.meta["attention_sms"]["chosen"], sc.meta["attention_sms"]
    predicted = {int(a): us for a, us in how["probe_predicted_us"].items()}  # choose_attention_sms's
    assert set(predicted) == set(attention_sms_candidates(nmc, 1, 132))
    assert predicted[chosen] == min(predicted.values())
    assert how["chosen_by"] == "compiler"
    splits = sum(1 for t in sc.tasks if t.layer == 1 and t.op == Opcode.ATTN_SPLIT)
    assert splits == (chosen if chosen else 128)  # 4 streams: the chosen count divides among them


def test_candidates_are_placed_as_plan_places_and_ranked_under_shared_bandwidth(nmc, monkeypatch):
    """Each probe is placed with the caller's ceilings (as plan() places the step), and its step
    is the shared-bandwidth simulation's (simulate.py), not the list scheduler's prediction."""
    from mkc.schedule import plan as plan_mod

    placed, simulated = [], []
    real_schedule, real_simulate = plan_mod.schedule, plan_mod.simulated_step_us
    monkeypatch.setattr(plan_mod, "schedule", lambda prog, name, c: placed.append(c) or real_schedule(prog, name, c))

    def spy(sc, c):
        simulated.append(real_simulate(sc, c))
        return simulated[-1]

    monkeypatch.setattr(plan_mod, "simulated_step_us", spy)
    ceilings = dataclasses.replace(H200, split_bw=16e9, spread_siblings=True)
    chosen, predicted = choose_attention_sms(nmc, 2, 8192, 132, ceilings=ceilings)
    assert placed and all(c == ceilings for c in placed)
    assert sorted(predicted.values()) == sorted(round(x, 1) for x in simulated)
    assert predicted[chosen] == min(predicted.values())


# North Mini Code on an H200: each configs/tuning/h200.json entry's time of every attention-SM
# count (its first stage: no other choice of the entry applied), where the compiler's choice is
# the fastest; mkc/schedule/plan.py's module doc names the two points where it is not.
MEASURED_FASTEST = {(2, 8192): 32, (1, 32768): 64, (4, 32768): 64}


@pytest.mark.parametrize("point", list(MEASURED_FASTEST), ids=lambda p: f"b{p[0]}-{p[1]}")
def test_the_compiler_picks_the_count_measured_fastest(nmc, point):
    """Points where the list scheduler's prediction had picked a count 7.7-11.1% slower (64, 0, 0)."""
    rec = json.loads((ROOT / "configs" / "tuning" / "h200.json").read_text())[tuning.tuning_key(nmc, *point, 132)]
    times = {int(a): t for a, t in rec["measured_us"].items()}
    assert min(times, key=times.get) == MEASURED_FASTEST[point]
    assert choose_attention_sms(nmc, *point, 132)[0] == MEASURED_FASTEST[point]


def test_asked_count_is_used_and_recorded(nmc):
    sc = plan(nmc, 8, 8192, 132, attention_sms=0)
    assert sc.meta["attention_sms"] == {"chosen": 0, "chosen_by": "asked", "probe_predicted_us": {}}
    assert sum(1 for t in sc.tasks if t.layer == 1 and t.op == Opcode.ATTN_SPLIT) == 128


@pytest.mark.parametrize("bad", [132, 500, -1])
def test_impossible_attention_sms_is_a_clear_error(nmc, bad):
    with pytest.raises(SpecError, match="--attention-sms .*expected 0 .* or fewer than the 132 SMs"):
        lower(nmc, 1, 8192, 132, attention_sms=bad)


def test_sequential_block_refuses_attention_sms():
    spec = load_spec("configs/mixtral_tiny.yaml")
    with pytest.raises(SpecError, match="sequential block.*expected 0"):
        plan(spec, 1, 64, 16, attention_sms=4)
    assert plan(spec, 1, 64, 16).meta["attention_sms"]["chosen"] == 0


@pytest.mark.parametrize("batch, attention_sms", [(1, 2), (1, 4), (2, 8), (3, 6)])
def test_executor_with_split_sms_matches_the_dense_reference(tiny, batch, attention_sms):
    """Fewer, longer attention splits and fewer, taller MLP tiles compute the same step: the
    float32 executor (random interleavings) matches the dense reference past the sliding window."""
    weights = random_weights(tiny, seed=7, dtype=torch.float32, std=0.1)
    sc = plan(tiny, batch, 40, 16, attention_sms=attention_sms)
    assert validate(sc) == []
    ex = CpuExecutor(sc, tiny, weights)
    ref = DenseReference(tiny, weights)
    g = torch.Generator().manual_seed(batch)
    for step in range(12):
        tokens = torch.randint(0, tiny.vocab_size, (batch,), generator=g)
        pos = [max(0, step - 2 * b) for b in range(batch)]
        logits, _ = ex.step(tokens, pos, seed=step)
        want = ref.step(tokens, pos)
        err = (logits - want).abs()
        assert bool((err <= F32_ATOL + F32_RTOL * want.abs()).all()), (
            f"batch {batch} attention_sms {attention_sms} step {step}: max error {err.max().item():.3g}")


def test_the_compiler_sets_the_global_layers_splits_apart_only_for_a_clear_simulated_gain(nmc, monkeypatch):
    """Where nothing was measured, the global layers' splits are the candidate whose probe step is
    shortest under shared bandwidth, if it beats as many as the other layers' by
    GLOBAL_SPLITS_MIN_GAIN, and plan_choices says so; a count the caller gives is not chosen."""
    from mkc.schedule import plan as plan_mod
    from mkc.schedule.plan import GLOBAL_SPLITS_MIN_GAIN, choose_global_attention_sms

    steps = {0: 100.0, 128: 97.0, 256: 99.0, 512: 101.0}  # beside 64 attention SMs, the fastest count

    def fake(*args, attention_sms, global_attention_sms, **kw):
        return steps[global_attention_sms] if attention_sms == 64 else 200.0

    monkeypatch.setattr(plan_mod, "_probe_step_us", fake)
    assert choose_global_attention_sms(nmc, 2, 131072, 132, 64) == (128, steps)
    steps[128] = 100.0 * (1 - GLOBAL_SPLITS_MIN_GAIN) + 0.1  # a gain the simulation may have wrong
    assert choose_global_attention_sms(nmc, 2, 131072, 132, 64)[0] == 0
    assert choose_global_attention_sms(nmc, 2, 4096, 132, 64) == (0, {})  # no layer attends past the window
    steps[256] = 90.0
    chosen, _, how = plan_mod.plan_choices(nmc, 2, 131072, 132)
    assert chosen == 64 and how["chosen_by"] == "compiler" and how["global_attention_sms"] == 256
    assert how["global_attention_sms_probe_us"] == {str(w): us for w, us in steps.items()}
    assert plan_mod.plan_choices(nmc, 2, 131072, 132, global_attention_sms=512)[2].get("global_attention_sms") is None


def test_the_compilers_global_layers_splits_at_long_contexts(nmc):
    """North Mini Code at batch 2 and 128K, nothing measured: the probe picks 256 SMs' worth beside
    64 attention SMs (measured on an H200: 5595.5 µs, against 6285.1 with as many splits as the
    other layers; h200.json's batch-2 / 128K entry), and mkc compile's summary names the choice."""
    from mkc.schedule.visualize import format_summary, summary

    sc = plan(nmc, 2, 131072, 132)
    assert sc.meta["attention_sms"]["chosen"] == 64 and sc.meta["global_attention_sms"] == 256
    line = next(ln for ln in format_summary(summary(sc, nmc)).splitlines() if ln.startswith("global layers"))
    assert "256 SMs' worth of attention splits; chosen by a probe's step under shared bandwidth" in line, line


def test_the_compiler_ends_a_sequential_blocks_halves_by_its_gemvs_only_for_a_clear_simulated_gain(
        nmc, monkeypatch):
    """Where nothing was measured, a sequential block's layer end (LowerOptions.residual_in_o_proj)
    is the probe's faster under shared bandwidth, on only where it beats off by LAYER_END_MIN_GAIN,
    and plan_choices says so; a parallel block (North Mini Code) is not probed, and a choice the
    caller gives is not replaced."""
    from mkc.schedule import plan as plan_mod
    from mkc.schedule.plan import LAYER_END_MIN_GAIN, choose_residual_in_o_proj

    seq = load_spec(ROOT / "configs" / "llama_tiny.yaml")
    steps = {False: 100.0, True: 97.0}
    monkeypatch.setattr(plan_mod, "_probe_step_us", lambda *a, residual_in_o_proj, **kw: steps[residual_in_o_proj])
    assert choose_residual_in_o_proj(seq, 1, 8192, 132, 0) == (True, {"off": 100.0, "on": 97.0})
    steps[True] = 100.0 * (1 - LAYER_END_MIN_GAIN) + 0.1  # a gain the simulation may have wrong
    assert choose_residual_in_o_proj(seq, 1, 8192, 132, 0)[0] is False
    assert choose_residual_in_o_proj(nmc, 1, 8192, 132, 0) == (False, {})
    steps[True] = 90.0
    _, _, how = plan_mod.plan_choices(seq, 1, 8192, 132)
    assert how["residual_in_o_proj"] is True and how["residual_in_o_proj_probe_us"] == {"off": 100.0, "on": 90.0}
    assert "residual_in_o_proj" not in plan_mod.plan_choices(seq, 1, 8192, 132, residual_in_o_proj=False)[2]


def test_a_sequential_dense_model_without_an_entry_ends_its_layers_in_its_gemvs():
    """Qwen3-0.6B cut to three layers, nothing measured, batch 1 at 8K: the probe puts the residual
    in the O-projection and the down projection (one hand-off fewer per half layer), so no
    RESIDUAL task is left, and mkc compile's summary names the choice."""
    from mkc.schedule.visualize import format_summary, summary

    spec = load_spec(ROOT / "configs" / "qwen3_0_6b.yaml")
    spec = dataclasses.replace(spec, num_layers=3, layers=spec.layers[:3])
    sc = plan(spec, 1, 8192, 132)
    assert sc.meta["residual_in_o_proj"] is True
    assert not any(t.op == Opcode.RESIDUAL for t in sc.tasks)
    line = next(ln for ln in format_summary(summary(sc, spec)).splitlines() if ln.startswith("layer end"))
    assert "chosen by a probe's step under shared bandwidth" in line, line


def test_the_schedule_cache_gives_back_what_plan_made(tiny, tmp_path, monkeypatch):
    """A second call with the same inputs reads the stored schedule (plan() is not called again) and
    it equals plan()'s, JSON for JSON; an entry that cannot be read is planned again and replaced."""
    from mkc.schedule import plan_cache

    fresh = json.loads(json.dumps(plan(tiny, 2, 64, 8).to_json()))
    sc, cached = plan_cache.cached_plan(tiny, 2, 64, 8, cache_dir=tmp_path)
    assert cached is False and json.loads(json.dumps(sc.to_json())) == fresh
    (entry,) = (tmp_path / "schedules").iterdir()

    def no_plan(*a, **kw):
        raise AssertionError("planned again although the cache holds the schedule")

    monkeypatch.setattr(plan_cache, "plan", no_plan)
    sc, cached = plan_cache.cached_plan(tiny, 2, 64, 8, cache_dir=tmp_path)
    assert cached is True and json.loads(json.dumps(sc.to_json())) == fresh
    monkeypatch.undo()
    entry.write_bytes(b"not gzip")
    sc, cached = plan_cache.cached_plan(tiny, 2, 64, 8, cache_dir=tmp_path)
    assert cached is False and json.loads(json.dumps(sc.to_json())) == fresh
    assert plan_cache.cached_plan(tiny, 2, 64, 8, cache_dir=tmp_path)[1] is True


def test_the_schedule_cache_plans_again_when_an_input_of_plan_changes(tiny, tmp_path, monkeypatch):
    """The key covers the point, the lowering, the ceilings and the tuning tables plan() reads."""
    from mkc.schedule.plan_cache import plan_key

    base = plan_key(tiny, 2, 64, 8)
    assert plan_key(tiny, 2, 64, 8) == base
    changed = [plan_key(tiny, 1, 64, 8), plan_key(tiny, 2, 128, 8), plan_key(tiny, 2, 64, 16),
               plan_key(tiny, 2, 64, 8, page_size=16, kv_pages=9), plan_key(tiny, 2, 64, 8, attention_sms=2),
               plan_key(tiny, 2, 64, 8, ceilings=dataclasses.replace(H200, read_bw=3.05e12)),
               plan_key(tiny, 2, 64, 8, weights="fp8"), plan_key(dataclasses.replace(tiny, norm_eps=1e-5), 2, 64, 8)]
    assert len({base, *changed}) == len(changed) + 1
    table = tmp_path / "tuning.json"
    monkeypatch.setenv("MKC_TUNING_FILE", str(table))
    table.write_text("{}")
    empty = plan_key(tiny, 2, 64, 8)
    table.write_text(json.dumps({"x/b2/c64/sms8/page0": {"attention_sms": 0}}))
    assert plan_key(tiny, 2, 64, 8) != empty


def test_warm_cache_fills_the_caches_a_backend_then_reads(tmp_path, monkeypatch, capsys):
    """benchmarks/warm_cache.py plans and builds what the CUDA backend asks for: afterwards the
    backend's schedule comes from the schedule cache and the kernel from the kernel cache."""
    pytest.importorskip("cuda.bindings.nvrtc", reason="NVRTC (cuda-bindings) is not installed")
    from conftest import load_benchmark

    from mkc.codegen import build_kernel
    from mkc.runtime.backends import compile_schedule
    from mkc.schedule import plan_cache

    monkeypatch.setenv("MKC_CACHE_DIR", str(tmp_path))
    load_benchmark("warm_cache").main(["--config", str(ROOT / "configs" / "tiny.yaml"), "--batch", "2",
                                       "--context", "64", "--num-sms", "8"])
    (line,) = capsys.readouterr().out.splitlines()
    assert line.startswith("tiny bf16 batch 2 context 64: schedule")
    kernels = sorted(p.name for p in (tmp_path / "kernels").iterdir() if p.is_dir())
    spec = load_spec(ROOT / "configs" / "tiny.yaml")
    monkeypatch.setattr(plan_cache, "plan", lambda *a, **kw: pytest.fail("planned again"))
    monkeypatch.setattr("mkc.codegen.nvrtc.compile_cubin", lambda *a, **kw: pytest.fail("compiled again"))
    assert [build_kernel(compile_schedule(spec, 2, 64, 8), spec).name] == kernels
