"""Measured choices (mkc/schedule/tuning.py): ``mkc bench --tune`` records the fastest attention-SM
count, and the planner uses it instead of the cost model's prediction. On the CPU: the timed
megakernel is faked, so no GPU is needed."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from conftest import ROOT, load_benchmark

from mkc.ir.ops import Opcode
from mkc.ir.spec import load_spec
from mkc.runtime import bench
from mkc.schedule import tune, tuning
from mkc.schedule.plan import (
    attention_sms_candidates,
    global_attention_sms_candidates,
    plan,
    plan_choices,
    transferred_global_count,
)


@pytest.fixture()
def tuning_file(monkeypatch, tmp_path):
    path = tmp_path / "tuning.json"
    monkeypatch.setenv("MKC_TUNING_FILE", str(path))
    return path


@pytest.fixture()
def timed_on_an_h200(monkeypatch):
    """``timed_on_an_h200(fake_row)``: mkc bench times the megakernel with the test's fake_row (its
    arguments those of runtime/bench.py's _megakernel_row) on what reads as an H200."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    return lambda fake_row: monkeypatch.setattr(bench, "_megakernel_row", fake_row)


def entry(attention_sms: int) -> dict:
    return {"attention_sms": attention_sms, "measured_us": {"0": 120.0, str(attention_sms): 100.0},
            "gpu": "NVIDIA H200", "date": "2026-11-30 02:30 UTC", "reps": 20}


def test_a_recorded_choice_overrides_the_prediction(tiny, tuning_file):
    predicted = plan(tiny, 2, 40, 16).meta["attention_sms"]
    assert predicted["chosen_by"] == "compiler"
    other = next(a for a in attention_sms_candidates(tiny, 2, 16) if a != predicted["chosen"])
    tuning.record(tuning.tuning_key(tiny, 2, 40, 16), entry(other))
    meta = plan(tiny, 2, 40, 16).meta["attention_sms"]
    assert meta["chosen"] == other and meta["chosen_by"] == "measured"
    assert meta["measured_us"][str(other)] == 100.0 and meta["measured_on"] == "NVIDIA H200"
    # another batch or SM count still predicts (another context takes the nearest context's: below)
    for args in ((1, 40, 16), (2, 40, 32)):
        assert plan(tiny, *args).meta["attention_sms"]["chosen_by"] == "compiler", args
    # an explicit count still wins over the record, takes none of its choices, and says so
    from mkc.schedule.visualize import format_summary, summary

    asked = plan(tiny, 2, 40, 16, attention_sms=0)
    assert asked.meta["attention_sms"]["chosen_by"] == "asked"
    assert asked.meta["attention_sms"]["entry_not_applied"] == other
    assert (f"as asked; the tuning entry at this point ({other} attention SMs, measured) and its other choices "
            "not applied") in format_summary(summary(asked, tiny))
    assert "entry_not_applied" not in plan(tiny, 1, 40, 16, attention_sms=0).meta["attention_sms"]


def test_a_context_nothing_was_measured_at_takes_the_nearest_measured_contexts_choices(tiny, tuning_file):
    """Where this batch was measured at other contexts only, the planner takes the choices of the
    nearest one (by ratio) and says so, with the global layers' splits scaled by the contexts'
    ratio so that each attends as many keys as where they were measured; another batch or SM count
    takes nothing from it."""
    from mkc.schedule.visualize import format_summary, summary

    assert global_attention_sms_candidates(tiny, 2, 80, 16, 4) == [0, 8, 16, 32]
    tuning.record(tuning.tuning_key(tiny, 2, 40, 16),
                  {**entry(4), "attention_inputs_first_us": 100.0, "spread_siblings": True, "residual_in_o_proj": True,
                   "global_attention_sms": 8, "global_attention_sms_measured_us": {"0": 110.0, "8": 100.0}})
    sc = plan(tiny, 2, 80, 16)
    meta = sc.meta["attention_sms"]
    assert meta["chosen"] == 4 and meta["chosen_by"] == "measured" and meta["measured_at_context"] == 40
    assert meta["attention_inputs_first_us"] == 100.0 and meta["spread_siblings"] is True
    assert sc.meta["residual_in_o_proj"] is True
    # 8 SMs' worth at 40 keys: 16 at 80, each split as long
    assert sc.meta["global_attention_sms"] == 16 and meta["global_attention_sms_measured_there"] == 8
    text = format_summary(summary(sc, tiny))
    assert "measured fastest by mkc bench --tune on NVIDIA H200, 2026-11-30 02:30 UTC at context 40, the nearest" in text
    assert ("16 SMs' worth of attention splits; the count measured fastest at context 40 by mkc bench --tune (8, 0: "
            "as the other layers) scaled by the contexts' ratio") in text, text
    # at 20 keys, 4 SMs' worth would do: no more than the other layers' (0)
    assert plan(tiny, 2, 20, 16).meta["global_attention_sms"] == 0
    # the caller's count wins
    assert plan(tiny, 2, 80, 16, global_attention_sms=32).meta["global_attention_sms"] == 32
    assert plan(tiny, 1, 80, 16).meta["attention_sms"]["chosen_by"] == "compiler"
    assert plan(tiny, 2, 80, 32).meta["attention_sms"]["chosen_by"] == "compiler"
    # measured at this context: its own entry, as measured
    tuning.record(tuning.tuning_key(tiny, 2, 80, 16), entry(8))
    meta = plan(tiny, 2, 80, 16).meta["attention_sms"]
    assert meta["chosen"] == 8 and "measured_at_context" not in meta


def test_the_nearest_measured_context_is_by_ratio_and_a_tie_goes_to_the_shorter(tiny, tuning_file):
    key = lambda c: tuning.tuning_key(tiny, 2, c, 16)
    tuning.record(key(20), entry(4))
    tuning.record(key(80), entry(8))
    tuning.record(tuning.tuning_key(tiny, 1, 40, 16), entry(2))  # another batch
    assert tuning.nearest(key(40)) == (20, entry(4))  # 2x either way
    assert tuning.nearest(key(50)) == (80, entry(8))
    assert tuning.nearest(key(10)) == (20, entry(4))
    assert tuning.nearest(tuning.tuning_key(tiny, 4, 40, 16)) is None
    # a key of another form in a hand-edited file matches nothing and breaks nothing
    data = json.loads(tuning_file.read_text())
    tuning_file.write_text(json.dumps({**data, "odd": entry(4), "a/b/cx/sms16/page0": entry(4)}))
    assert tuning.nearest(key(40)) == (20, entry(4))


@pytest.mark.parametrize("count, ratio, want", [
    (8, 2.0, 16),  # twice the keys: twice the splits
    (0, 4.0, 16),  # measured with as many as the other layers (4): four times that
    (8, 0.5, 0),  # 4: no more than the other layers'
    (32, 2.0, 32),  # 64 wanted: the largest candidate
    (8, 1.4, 8),  # 11.2: nearer 8 than 16 by ratio
    (8, 1.5, 16),  # 12: nearer 16 by ratio
])
def test_a_transferred_global_count_keeps_the_splits_keys(count, ratio, want):
    assert transferred_global_count([0, 8, 16, 32], 4, count, ratio) == want
    assert transferred_global_count([0], 4, count, ratio) == 0  # no layers of global attention past the window


def test_the_shipped_h200_table_serves_the_contexts_between_its_points(nmc, monkeypatch):
    """North Mini Code at contexts the H200 table has no entry for: batch 1 at 64K takes 32K's
    choices (a tie with 128K: the shorter) with its global layers' 64 SMs' worth doubled, and batch 8
    at 128K takes 32K's with 128 quadrupled; batch 1 at 1K takes 8K's (no layer attends more keys
    than the window there, so as many splits in every layer)."""
    monkeypatch.setenv("MKC_TUNING_FILE", str(ROOT / "configs" / "tuning" / "h200.json"))
    for (batch, context), (there, count, wide) in {(1, 65536): (32768, 32, 128), (8, 131072): (32768, 64, 512),
                                                   (1, 1024): (8192, 32, 0)}.items():
        chosen, _, how = plan_choices(nmc, batch, context, 132)
        assert (how["measured_at_context"], chosen, how.get("global_attention_sms", 0)) == (there, count, wide), how


@pytest.mark.parametrize("batch, context", [(1, 65536), (2, 4097)])
def test_a_plan_with_the_nearest_contexts_choices_validates(nmc, monkeypatch, batch, context):
    """What a user at a context without an entry gets from the shipped table (batch 1 at 64K: 32K's
    choices with twice its global layers' splits; batch 2 just past the window: 8K's) is a schedule
    the validator accepts."""
    from mkc.schedule.validator import validate

    monkeypatch.setenv("MKC_TUNING_FILE", str(ROOT / "configs" / "tuning" / "h200.json"))
    sc = plan(nmc, batch, context, 132)
    assert sc.meta["attention_sms"]["measured_at_context"] in (8192, 32768)
    assert validate(sc) == []


def test_an_entrys_global_attention_count_from_another_tool_need_not_be_a_tune_candidate(tiny, tuning_file):
    """mkc bench --tune records one of its candidates; a count another tool measured (*_by, e.g.
    schedule_variants.py) is planned whatever it is, within the lowering's bound; any other count
    is ignored (the lowering's default)."""
    key = tuning.tuning_key(tiny, 2, 40, 16)
    candidates = global_attention_sms_candidates(tiny, 2, 40, 16, 4)
    odd = 24
    assert len(candidates) > 1 and odd not in candidates
    tuning.record(key, {**entry(4), "global_attention_sms": odd, "global_attention_sms_by": "schedule_variants.py, a test",
                        "global_attention_sms_measured_us": {"0": 110.0, str(odd): 100.0}})
    sc = plan(tiny, 2, 40, 16)
    assert sc.meta["global_attention_sms"] == odd
    assert sc.meta["attention_sms"]["global_attention_sms_by"] == "schedule_variants.py, a test"
    tuning.record(key, {**entry(4), "global_attention_sms": odd})  # not a candidate, no other tool named
    assert plan(tiny, 2, 40, 16).meta["global_attention_sms"] == 0
    tuning.record(key, {**entry(4), "global_attention_sms": 5 * 16, "global_attention_sms_by": "a test"})  # past the bound
    assert plan(tiny, 2, 40, 16).meta["global_attention_sms"] == 0


def test_an_entrys_layer_end_measured_by_another_tool_is_named(tiny, tuning_file):
    """The residual decision of an entry, either way, is planned and shown with its times and the
    tool that measured them (*_by; mkc bench --tune where none is named)."""
    from mkc.schedule.visualize import format_summary, summary

    key = tuning.tuning_key(tiny, 2, 40, 16)
    tuning.record(key, {**entry(4), "residual_in_o_proj": False, "residual_in_o_proj_by": "schedule_variants.py, a test",
                        "residual_in_o_proj_measured_us": {"off": 100.0, "on": 110.0}})
    sc = plan(tiny, 2, 40, 16)
    assert not sc.meta["residual_in_o_proj"] and any(t.op == Opcode.RESIDUAL for t in sc.tasks)
    assert sc.meta["attention_sms"]["residual_in_o_proj_by"] == "schedule_variants.py, a test"
    text = format_summary(summary(sc, tiny))
    assert ("residual tiles add the attention and the MLP's output; measured faster by schedule_variants.py, a test "
            "(step µs, the O-projection ending the layer off / on: off: 100.0, on: 110.0)") in text, text
    tuning.record(key, {**entry(4), "residual_in_o_proj": True, "residual_in_o_proj_measured_us": {"off": 110.0, "on": 100.0}})
    sc = plan(tiny, 2, 40, 16)
    assert sc.meta["residual_in_o_proj"] and not any(t.op == Opcode.RESIDUAL for t in sc.tasks)
    assert "(no residual tiles); measured faster by mkc bench --tune" in format_summary(summary(sc, tiny))


def test_an_entrys_expert_down_rows_are_planned_unless_asked_otherwise(tiny, tuning_file):
    """An entry that names expert-down tile rows (another tool measured them: *_by) lowers with them,
    says who chose them (meta and the compile summary), and an explicit choice wins; rows that are
    no multiple of 16 are ignored (the rule)."""
    from mkc.schedule.visualize import format_summary, summary

    rule = {t.arg("rows") for t in plan(tiny, 2, 40, 16).tasks if t.op == Opcode.EXPERT_DOWN}
    assert rule != {16}
    tuning.record(tuning.tuning_key(tiny, 2, 40, 16), {
        **entry(4), "expert_down_rows": 16, "expert_down_rows_by": "schedule_variants.py, a test",
        "expert_down_rows_measured_us": {"0": 110.0, "16": 100.0}})
    sc = plan(tiny, 2, 40, 16)
    assert {t.arg("rows") for t in sc.tasks if t.op == Opcode.EXPERT_DOWN} == {16}
    assert sc.meta["expert_down_rows"] == 16
    assert sc.meta["attention_sms"]["expert_down_rows_by"] == "schedule_variants.py, a test"
    assert "tiles of 16 rows; measured fastest by schedule_variants.py, a test" in format_summary(summary(sc, tiny))
    asked = plan(tiny, 2, 40, 16, expert_down_rows=0)
    assert {t.arg("rows") for t in asked.tasks if t.op == Opcode.EXPERT_DOWN} == rule
    tuning.record(tuning.tuning_key(tiny, 2, 40, 16), {**entry(4), "expert_down_rows": 20})
    assert {t.arg("rows") for t in plan(tiny, 2, 40, 16).tasks if t.op == Opcode.EXPERT_DOWN} == rule


def test_an_entrys_expert_up_rows_are_planned_unless_asked_otherwise(tiny, tuning_file):
    """An entry that names each slot's expert gate/up tile rows lowers with them and says who chose
    them; an explicit choice (or fused expert tiles) wins, and rows that are no multiples of 16 or
    do not add up to the expert intermediate size are ignored (the rule)."""
    from mkc.schedule.visualize import format_summary, summary

    inter = tiny.moe.intermediate
    up_rows = lambda sc: sorted(t.arg("rows") for t in sc.tasks if t.op == Opcode.EXPERT_SWIGLU
                                and t.layer == 1 and t.arg("slot") == 0)
    rule = up_rows(plan(tiny, 2, 40, 16))
    rows = [16] * (inter // 16)
    assert rule != rows
    key = tuning.tuning_key(tiny, 2, 40, 16)
    tuning.record(key, {**entry(4), "expert_up_rows": rows, "expert_up_rows_by": "schedule_variants.py, a test",
                        "expert_up_rows_measured_us": {"rule": 110.0, f"16x{len(rows)}": 100.0}})
    sc = plan(tiny, 2, 40, 16)
    assert up_rows(sc) == rows and sc.meta["expert_up_rows"] == tuple(rows)
    assert sc.meta["attention_sms"]["expert_up_rows_by"] == "schedule_variants.py, a test"
    assert (f"each slot's rows in {len(rows)} tiles of 16; measured fastest by schedule_variants.py, a test"
            in format_summary(summary(sc, tiny)))
    assert up_rows(plan(tiny, 2, 40, 16, expert_up_rows=())) == rule
    fused = plan(tiny, 2, 40, 16, residual_in_o_proj=True, fused_experts=True)
    assert fused.meta["expert_up_rows"] == () and "expert_up_rows" not in fused.meta["attention_sms"]
    for bad in ([24] * 2 + [16] * ((inter - 48) // 16), [16] * (inter // 16 + 1), "16x4", [True] * 4):
        tuning.record(key, {**entry(4), "expert_up_rows": bad})
        assert up_rows(plan(tiny, 2, 40, 16)) == rule, bad


def test_a_changed_model_does_not_match_old_records(tiny, tuning_file):
    import dataclasses

    tuning.record(tuning.tuning_key(tiny, 2, 40, 16), entry(4))
    changed = dataclasses.replace(tiny, norm_eps=1e-5)
    assert tuning.tuning_key(changed, 2, 40, 16) != tuning.tuning_key(tiny, 2, 40, 16)
    assert plan(changed, 2, 40, 16).meta["attention_sms"]["chosen_by"] == "compiler"


def test_a_record_that_is_no_candidate_is_ignored(tiny, tuning_file):
    tuning.record(tuning.tuning_key(tiny, 2, 40, 16), entry(5))  # not streams x 2^i
    assert plan(tiny, 2, 40, 16).meta["attention_sms"]["chosen_by"] == "compiler"


@pytest.mark.parametrize("text", ["{not json", "[1, 2]"])
def test_an_unreadable_file_is_reported_and_ignored(tiny, tuning_file, capsys, text):
    tuning_file.write_text(text)
    tuning._warned.discard(tuning_file)
    assert plan(tiny, 2, 40, 16).meta["attention_sms"]["chosen_by"] == "compiler"
    err = capsys.readouterr().err
    assert f"ignoring the tuning file {tuning_file}" in err and "the cost model decides instead" in err


def test_record_keeps_the_other_entries(tiny, tuning_file):
    tuning.record("a", {"attention_sms": 0})
    tuning.record("b", {"attention_sms": 4})
    tuning.record("a", {"attention_sms": 8})
    assert json.loads(tuning_file.read_text()) == {"a": {"attention_sms": 8}, "b": {"attention_sms": 4}}


def test_a_tune_stopped_part_way_keeps_the_decisions_it_made(tiny, tuning_file, timed_on_an_h200):
    """Each decision is recorded as it is made: a tune stopped while it times the residual in the
    O-projection (here the fake timer raises; on a GPU a time limit or ^C) leaves an entry with the
    attention SMs, the raise and the spread it measured, saying where it stopped, which the planner
    uses; the decisions it did not reach stay the planner's own."""

    class Stopped(Exception):
        pass

    def fake_row(spec, w, b, c, *, attention_sms, **kw):
        if kw.get("residual_in_o_proj"):
            raise Stopped
        return bench.row("mkc", b, c, [1e-4 * (1 + abs(attention_sms - 4))], 10**6, 4e12)

    timed_on_an_h200(fake_row)
    with pytest.raises(Stopped):
        bench.tune_attention_sms(tiny, {}, 2, 40, sms=16, bw=4e12, reps=3, log=lambda *_: None)
    rec = json.loads(tuning_file.read_text())[tuning.tuning_key(tiny, 2, 40, 16)]
    assert rec["attention_sms"] == 4 and set(rec["measured_us"]) == {str(a) for a in attention_sms_candidates(tiny, 2, 16)}
    assert rec["attention_inputs_first_us"] == 0.0 and rec["spread_siblings"] is False
    assert "residual_in_o_proj" not in rec and "global_attention_sms" not in rec
    assert rec["by"] == "mkc bench --tune, stopped after the sibling spread (the rest: the planner's own)"
    sc = plan(tiny, 2, 40, 16)
    meta = sc.meta["attention_sms"]
    assert meta["chosen"] == 4 and meta["chosen_by"] == "measured" and meta["measured_by"] == rec["by"]
    assert sc.meta["global_attention_sms"] == 0


def test_tune_times_every_candidate_and_records_the_fastest(tiny, tuning_file, timed_on_an_h200):
    """Fake timings (fastest at 4 attention SMs, 10% faster with the residual added by the
    O-projection, and 5% faster still with 16 SMs' worth of splits in the layers of global
    attention): every candidate is timed once, the fastest is recorded with every timing, and the
    planner then picks it, and lowers with the residual in the O-projection and those splits."""
    timed = []

    def fake_row(spec, w, b, c, *, attention_sms, **kw):
        timed.append(attention_sms)
        assert kw.pop("predict") is False  # a tune's many timings skip the simulated step
        fold = 0.9 if kw.get("residual_in_o_proj") else 1.0
        wide = 0.95 if kw.get("global_attention_sms") == 16 else 1.0
        return bench.row("mkc", b, c, [1e-4 * (1 + abs(attention_sms - 4)) * fold * wide], 10**6, 4e12)

    timed_on_an_h200(fake_row)
    logs = []
    best = bench.tune_attention_sms(tiny, {}, 2, 40, sms=16, bw=4e12, reps=3, log=logs.append)
    # the tiny model's placement is the same with its splits' inputs ranked first and with its
    # sibling tiles spread (neither is timed), not with its splits ranked first too (timed once
    # more; as fast here, so the plain ranking is kept), then the O-projection ending the layer,
    # then the global layers' splits (the tiny model's window, 8 keys, is shorter than the context)
    candidates = attention_sms_candidates(tiny, 2, 16)
    wide = global_attention_sms_candidates(tiny, 2, 40, 16, 4)
    assert wide == [0, 8, 16, 32]
    assert best == 4 and timed == [*candidates, 4, 4, 4, 4, 4]
    rec = json.loads(tuning_file.read_text())[tuning.tuning_key(tiny, 2, 40, 16)]
    assert rec["attention_sms"] == 4 and rec["gpu"] == "NVIDIA H200" and rec["reps"] == 3
    # what the counts were timed with
    assert rec["lowering"] == {"rope_in_splits": True, "residual_in_o_proj": False, "fused_experts": False,
                               "global_attention_sms": 0, "expert_up_rows": [], "expert_down_rows": 0,
                               "weights": "bf16"}
    assert set(rec["measured_us"]) == {str(a) for a in candidates}
    assert any("fastest with 4 attention SMs" in ln for ln in logs)
    t4 = rec["measured_us"]["4"]
    assert rec["attention_inputs_first_us"] == 0.0 and rec["splits_first"] is False
    assert rec["attention_inputs_first_us_measured_us"] == {"0": t4, "100+splits": t4}
    assert rec["spread_siblings"] is False and rec["spread_siblings_measured_us"] == {"off": t4}
    assert rec["residual_in_o_proj"] is True
    assert rec["residual_in_o_proj_measured_us"] == {"off": t4, "on": round(0.9 * t4, 1)}
    assert rec["global_attention_sms"] == 16
    folded = round(0.9 * t4, 1)
    assert rec["global_attention_sms_measured_us"] == {"0": folded, "8": folded, "16": round(0.95 * folded, 1),
                                                       "32": folded}
    assert any("and 16 SMs' worth of splits in the layers of global attention" in ln for ln in logs)
    sc = plan(tiny, 2, 40, 16)
    assert sc.meta["attention_sms"] == {
        "chosen": 4, "chosen_by": "measured", "measured_us": rec["measured_us"], "measured_on": "NVIDIA H200",
        "measured_at": rec["date"], "measured_lowering": rec["lowering"], "measured_by": None,
        "attention_inputs_first_us": 0.0, "attention_inputs_first_us_measured_us": {"0": t4, "100+splits": t4},
        "spread_siblings": False, "spread_siblings_measured_us": {"off": t4},
        "residual_in_o_proj": True, "residual_in_o_proj_measured_us": rec["residual_in_o_proj_measured_us"],
        "global_attention_sms": 16, "global_attention_sms_measured_us": rec["global_attention_sms_measured_us"]}
    assert sc.meta["residual_in_o_proj"] is True and not any(t.op == Opcode.RESIDUAL for t in sc.tasks)
    assert sc.meta["global_attention_sms"] == 16
    # the caller's lowering wins over the measured one
    assert plan(tiny, 2, 40, 16, residual_in_o_proj=False).meta["residual_in_o_proj"] is False
    assert plan(tiny, 2, 40, 16, global_attention_sms=0).meta["global_attention_sms"] == 0



def test_an_fp8_tune_records_its_own_entry_and_fp8_plans_take_bf16s_until_then(tiny, tuning_file, timed_on_an_h200):
    """FP8 weights are their own model in the tuning table: with only a bf16 entry, an FP8 plan takes
    it and says it was measured with bf16 weights; mkc bench --tune --weights fp8 times FP8 schedules
    and records them apart, leaving the bf16 entry as it was."""
    from mkc.schedule.visualize import format_summary, summary

    other = next(a for a in attention_sms_candidates(tiny, 2, 16) if a not in (0, 4))
    tuning.record(tuning.tuning_key(tiny, 2, 40, 16), entry(other))
    assert tuning.tuning_key(tiny, 2, 40, 16, weights="fp8") != tuning.tuning_key(tiny, 2, 40, 16)
    sc = plan(tiny, 2, 40, 16, weights="fp8")
    meta = sc.meta["attention_sms"]
    assert (meta["chosen"], meta["chosen_by"], meta["measured_lowering"]["weights"]) == (other, "measured", "bf16")
    assert "measured under weights=bf16 (this compile: weights=fp8)" in format_summary(summary(sc, tiny))
    timed = []

    def fake_row(spec, w, b, c, *, attention_sms, **kw):
        timed.append(kw.get("weights"))
        return bench.row("mkc", b, c, [1e-4 * (1 + abs(attention_sms - 4))], 10**6, 4e12)

    timed_on_an_h200(fake_row)
    best = bench._tune(tiny, {}, 2, 40, sms=16, bw=4e12, reps=3, page_size=0, log=print, weights_format="fp8")
    assert best[0] == 4 and timed and set(timed) == {"fp8"}
    table = json.loads(tuning_file.read_text())
    assert table[tuning.tuning_key(tiny, 2, 40, 16)] == entry(other)
    fp8 = table[tuning.tuning_key(tiny, 2, 40, 16, weights="fp8")]
    assert fp8["attention_sms"] == 4 and fp8["lowering"]["weights"] == "fp8"
    meta = plan(tiny, 2, 40, 16, weights="fp8").meta["attention_sms"]
    assert (meta["chosen"], meta["measured_lowering"]["weights"]) == (4, "fp8")
    assert plan(tiny, 2, 40, 16).meta["attention_sms"]["chosen"] == other

def test_a_re_tune_keeps_the_entry_its_choice_does_not_beat_side_by_side(tiny, tuning_file, timed_on_an_h200, tmp_path):
    """A tune at a point with an entry times the entry's schedule and its own choice in turn at the
    end (two runs each) and keeps the entry unless its choice runs faster there: here its choice, 8
    SMs' worth of global splits, was fast only in the run that chose it (noise), so the entry (16)
    stays, with a record of the side by side that the planner and mkc compile name. A choice that is
    faster side by side replaces the entry."""
    calls = {"lucky": 0}

    def timer(lucky: bool):
        def fake_row(spec, w, b, c, *, attention_sms, **kw):
            us = 100 * (1 + abs(attention_sms - 4)) * (0.9 if kw.get("residual_in_o_proj") else 1.0)
            wide = kw.get("global_attention_sms", 0)
            if wide == 16:
                us *= 0.95
            if wide == 8 and lucky:
                calls["lucky"] += 1
                us *= 0.9 if calls["lucky"] == 1 else 1.0  # only its first run: noise
            if wide == 8 and not lucky:
                us *= 0.9
            return bench.row("mkc", b, c, [us * 1e-6], 10**6, 4e12)
        return fake_row

    key = tuning.tuning_key(tiny, 2, 40, 16)
    timed_on_an_h200(timer(lucky=False))
    bench.tune_attention_sms(tiny, {}, 2, 40, sms=16, bw=4e12, reps=3, log=lambda line: None)
    first = json.loads(tuning_file.read_text())[key]
    assert first["global_attention_sms"] == 8  # no entry before: nothing side by side
    tuning.record(key, {**first, "global_attention_sms": 16})  # as if an earlier tune had chosen 16

    timed_on_an_h200(timer(lucky=True))
    logs = []
    assert bench.tune_attention_sms(tiny, {}, 2, 40, sms=16, bw=4e12, reps=3, log=logs.append) == 4
    assert calls["lucky"] == 3  # chosen in one run, then two more side by side
    rec = json.loads(tuning_file.read_text())[key]
    assert rec["global_attention_sms"] == 16 and rec["global_attention_sms_measured_us"] == \
        first["global_attention_sms_measured_us"]
    kept = rec["kept_over_retune"]
    # times are recorded to 0.1 µs (tune.py), so within 0.05 of the exact value
    assert kept["entry_us"] == pytest.approx(0.9 * 0.95 * 100, abs=0.06) and kept["retuned_us"] == pytest.approx(90.0)
    assert kept["runs"] == 2 and "8 SMs' worth of splits in the layers of global attention" in kept["retuned"]
    assert kept["gpu"] == "NVIDIA H200"  # the card the side by side ran on
    assert any("the entry measured before this tune stays" in ln for ln in logs)
    assert not any("fastest with" in ln for ln in logs)
    sc = plan(tiny, 2, 40, 16)
    assert sc.meta["global_attention_sms"] == 16 and sc.meta["attention_sms"]["kept_over_retune"] == kept
    r = subprocess.run([sys.executable, "-m", "mkc.cli", "compile", "configs/tiny.yaml", "-o", str(tmp_path / "out"),
                        "--batch", "2", "--context", "40", "--num-sms", "16", "--no-kernel"],
                       capture_output=True, text=True, cwd=ROOT, check=False)
    assert r.returncode == 0, r.stderr
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("attention SMs"))
    assert f"kept over a re-tune on {kept['date']} (NVIDIA H200)" in line

    # its choice faster side by side: the tune's entry replaces it
    timed_on_an_h200(timer(lucky=False))
    bench.tune_attention_sms(tiny, {}, 2, 40, sms=16, bw=4e12, reps=3, log=logs.append)
    rec = json.loads(tuning_file.read_text())[key]
    assert rec["global_attention_sms"] == 8 and "kept_over_retune" not in rec


def test_tune_keeps_the_expert_tile_rows_another_tool_measured(tiny, tuning_file, timed_on_an_h200):
    """mkc bench --tune rewrites its point's entry but keeps the expert-down and gate/up tile rows
    (and who measured them), which it does not choose itself, and times every schedule with them:
    the entry it records is a schedule that ran."""
    timed_rows = []

    def fake_row(spec, w, b, c, *, attention_sms, **kw):
        timed_rows.append((tuple(kw.get("expert_up_rows", ())), kw.get("expert_down_rows", 0)))
        return bench.row("mkc", b, c, [1e-4 * (1 + abs(attention_sms - 4))], 10**6, 4e12)

    timed_on_an_h200(fake_row)
    key = tuning.tuning_key(tiny, 2, 40, 16)
    up = [16] * (tiny.moe.intermediate // 16)
    tuning.record(key, {**entry(8), "expert_down_rows": 16, "expert_down_rows_by": "a test",
                        "expert_down_rows_measured_us": {"0": 2.0, "16": 1.0},
                        "expert_up_rows": up, "expert_up_rows_by": "a test", "expert_up_rows_measured_us": {"rule": 2.0}})
    assert bench.tune_attention_sms(tiny, {}, 2, 40, sms=16, bw=4e12, reps=3, log=lambda line: None) == 4
    rec = json.loads(tuning_file.read_text())[key]
    assert rec["attention_sms"] == 4 and rec["expert_down_rows"] == 16 and rec["expert_down_rows_by"] == "a test"
    assert rec["expert_down_rows_measured_us"] == {"0": 2.0, "16": 1.0}
    assert rec["expert_up_rows"] == up and rec["expert_up_rows_by"] == "a test"
    assert rec["expert_up_rows_measured_us"] == {"rule": 2.0}
    assert len(timed_rows) > 1 and set(timed_rows) == {(tuple(up), 16)}


def test_tune_tiles_times_the_expert_tiles_rows_last_and_records_the_fastest(tiny, tuning_file, timed_on_an_h200):
    """--tune-tiles: after every other decision the tune times each slot's expert gate/up tiles in
    other equal counts (the rule's run reused), then the expert-down tiles' rows with the gate/up
    rows chosen, and records both with their times and the tool; the planner then lowers with them
    and mkc compile says so. Fake timings: 5% faster with gate/up tiles of 32 rows, 3% more with
    expert-down tiles of 64."""
    from mkc.schedule.tune import expert_tile_candidates
    from mkc.schedule.visualize import format_summary, summary

    timed = []

    def fake_row(spec, w, b, c, *, attention_sms, **kw):
        up, down = tuple(kw.get("expert_up_rows", ())), kw.get("expert_down_rows", 0)
        timed.append((attention_sms, up, down))
        us = 100 * (1 + abs(attention_sms - 4)) * (0.95 if up == (32, 32) else 1.0) * (0.97 if down == 64 else 1.0)
        return bench.row("mkc", b, c, [us * 1e-6], 10**6, 4e12)

    timed_on_an_h200(fake_row)
    logs = []
    assert bench.tune_attention_sms(tiny, {}, 2, 40, sms=16, bw=4e12, reps=3, log=logs.append, tiles=True) == 4
    ups, downs = expert_tile_candidates(plan(tiny, 2, 40, 16, attention_sms=4))
    assert ups == [(), (32, 32)] and downs == [0, 64, 32]
    # the rule's gate/up and down tiles are not timed again; the gate/up rows are, then the down rows
    assert timed[-3:] == [(4, (32, 32), 0), (4, (32, 32), 64), (4, (32, 32), 32)]
    rec = json.loads(tuning_file.read_text())[tuning.tuning_key(tiny, 2, 40, 16)]
    assert rec["expert_up_rows"] == [32, 32] and rec["expert_down_rows"] == 64
    assert rec["expert_up_rows_by"] == rec["expert_down_rows_by"] == "mkc bench --tune --tune-tiles"
    assert rec["expert_up_rows_measured_us"] == {"rule": 100.0, "32x2": 95.0}
    # recorded to 0.1 µs (tune.py)
    assert rec["expert_down_rows_measured_us"] == {"0": 95.0, "64": pytest.approx(92.15, abs=0.06), "32": 95.0}
    assert any("and expert gate/up tiles of 32x2 rows and expert-down tiles of 64 rows" in ln for ln in logs)
    sc = plan(tiny, 2, 40, 16)
    assert sc.meta["expert_up_rows"] == (32, 32) and sc.meta["expert_down_rows"] == 64
    assert {t.arg("rows") for t in sc.tasks if t.op == Opcode.EXPERT_DOWN} == {64}
    assert "each slot's rows in 2 tiles of 32; measured fastest by mkc bench --tune --tune-tiles" in format_summary(
        summary(sc, tiny))
    # without --tune-tiles the tune keeps them (the test above) and times every schedule with them
    timed.clear()
    assert bench.tune_attention_sms(tiny, {}, 2, 40, sms=16, bw=4e12, reps=3, log=logs.append) == 4
    assert timed and all(up == (32, 32) and down == 64 for _, up, down in timed)


def test_tune_rounds_time_each_decisions_options_in_turn(tiny, tuning_file, timed_on_an_h200):
    """--tune-rounds 2: every decision times its options in turn twice, the second time in reverse
    order (mkc/schedule/tune.py: in_turn), the option chosen before included (a decision with one
    option times nothing again), and compares medians; a first sample that flatters a slower count
    does not win. The entry records the medians and the rounds."""
    timed = []

    def fake_row(spec, w, b, c, *, attention_sms, ceilings, **kw):
        fold = bool(kw.get("residual_in_o_proj"))
        timed.append((attention_sms, ceilings.attention_inputs_first_us > 0, ceilings.splits_first,
                      ceilings.spread_siblings, fold, kw.get("global_attention_sms", 0)))
        us = 100 * (1 + abs(attention_sms - 4) / 4) * (0.9 if fold else 1.0)
        if len(timed) == 1:  # the first sample of 0 attention SMs: far too fast (noise)
            us = 50.0
        return bench.row("mkc", b, c, [us * 1e-6], 10**6, 4e12)

    timed_on_an_h200(fake_row)
    assert bench.tune_attention_sms(tiny, {}, 2, 40, sms=16, bw=4e12, reps=3, log=print, rounds=2) == 4
    candidates = attention_sms_candidates(tiny, 2, 16)
    plain = (4, False, False, False, False, 0)
    splits = (4, True, True, False, False, 0)  # the tiny model places only this raise otherwise
    folded = (4, False, False, False, True, 0)
    counts = [(a, False, False, False, False, 0) for a in candidates]
    wide = [(*folded[:5], w) for w in (0, 8, 16, 32)]
    assert timed == (counts + counts[::-1]
                     + [plain, splits, splits, plain]  # the raises (the spread places nothing otherwise: not timed)
                     + [plain, folded, folded, plain]  # the residual in the O-projection
                     + wide + wide[::-1])  # the global layers' splits
    rec = json.loads(tuning_file.read_text())[tuning.tuning_key(tiny, 2, 40, 16)]
    assert rec["rounds"] == 2 and rec["attention_sms"] == 4
    assert rec["measured_us"]["0"] == pytest.approx((50.0 + 200.0) / 2, abs=0.1)  # the median of its two, to 0.1 µs
    assert rec["residual_in_o_proj"] is True and rec["residual_in_o_proj_measured_us"] == {"off": 100.0, "on": 90.0}


def test_tune_keeps_the_residual_tiles_where_the_o_projection_cannot_end_the_layer(tiny, tuning_file, timed_on_an_h200):
    """A lowering with the residual in the O-projection that cannot be built at a point (here a
    CodegenError) is reported and recorded off; the tune still records the rest."""
    from mkc.codegen import CodegenError

    def fake_row(spec, w, b, c, *, attention_sms, **kw):
        if kw.get("residual_in_o_proj"):
            raise CodegenError("shared memory 300000 B: expected at most 232448 B")
        return bench.row("mkc", b, c, [1e-4 * (1 + abs(attention_sms - 4))], 10**6, 4e12)

    timed_on_an_h200(fake_row)
    logs = []
    assert bench.tune_attention_sms(tiny, {}, 2, 40, sms=16, bw=4e12, reps=3, log=logs.append) == 4
    rec = json.loads(tuning_file.read_text())[tuning.tuning_key(tiny, 2, 40, 16)]
    assert rec["residual_in_o_proj"] is False and set(rec["residual_in_o_proj_measured_us"]) == {"off"}
    assert any("cannot be built here: shared memory 300000 B" in ln for ln in logs)


def test_tune_times_the_splits_inputs_first_where_it_places_differently(nmc, tuning_file, timed_on_an_h200):
    """North Mini Code at batch 8: ranking the attention splits' inputs first (Ceilings.
    attention_inputs_first_us) changes the placement, and ranking the splits first too (Ceilings.
    splits_first) changes it again, so the fastest count is timed with each, and the fastest is
    recorded; the planner then schedules with it. Spreading sibling tiles (Ceilings.
    spread_siblings) changes it too, so that is timed next, with the raise; slower here, it is
    recorded off."""
    import dataclasses

    from mkc.schedule.cost import H200

    timed = []

    def fake_row(spec, w, b, c, *, attention_sms, ceilings=None, **kw):
        raised = ceilings is not None and ceilings.attention_inputs_first_us > 0
        splits = ceilings is not None and ceilings.splits_first
        spread = ceilings is not None and ceilings.spread_siblings
        timed.append((attention_sms, raised, splits, spread))
        us = 100 * (1 + abs(attention_sms - 64) / 64) - (5 if raised else 0) - (2 if splits else 0) + (3 if spread else 0)
        return bench.row("mkc", b, c, [us * 1e-6], 10**6, 4e12)

    timed_on_an_h200(fake_row)
    logs = []
    assert bench.tune_attention_sms(nmc, {}, 8, 8192, sms=132, bw=4e12, reps=3, log=logs.append) == 64
    candidates = attention_sms_candidates(nmc, 8, 132)
    assert timed == ([(a, False, False, False) for a in candidates]
                     + [(64, True, False, False), (64, True, True, False), (64, True, True, True)]
                     + [(64, True, True, False)]  # the chosen schedule with the residual in the O-projection
                     + [(64, True, True, False)] * 3  # and with 128, 256 and 512 SMs' worth of global splits
                     + [(32, True, True, False)] * 3)  # and 64, 128, 256 over 32 attention SMs
    rec = json.loads(tuning_file.read_text())[tuning.tuning_key(nmc, 8, 8192, 132)]
    assert rec["attention_inputs_first_us"] == 100.0 and rec["splits_first"] is True
    assert rec["attention_inputs_first_us_measured_us"] == {"0": 100.0, "100": 95.0, "100+splits": 93.0}
    assert rec["spread_siblings"] is False and rec["spread_siblings_measured_us"] == {"off": 93.0, "on": 96.0}
    assert rec["residual_in_o_proj"] is False and rec["residual_in_o_proj_measured_us"] == {"off": 93.0, "on": 93.0}
    # as fast here: as many splits in the global layers as in the others
    assert rec["global_attention_sms"] == 0
    assert rec["global_attention_sms_measured_us"] == {"0": 93.0, "128": 93.0, "256": 93.0, "512": 93.0,
                                                       "64@32": 143.0, "128@32": 143.0, "256@32": 143.0}
    assert any("and the splits' inputs and the splits ranked 100 µs higher" in ln for ln in logs)
    # what plan() then schedules with (each raise placed differently, or the tuner had not timed it)
    count, ceilings, how = plan_choices(nmc, 8, 8192, 132)
    assert count == 64 and ceilings == dataclasses.replace(H200, attention_inputs_first_us=100.0, splits_first=True)
    assert how["attention_inputs_first_us"] == 100.0 and how["splits_first"] is True


def test_tune_times_the_sliding_layers_on_fewer_sms_beneath_the_global_layers(tiny, tuning_file, timed_on_an_h200):
    """The whole model runs fastest on 4 attention SMs (at a long context its global layers
    decide), but with the global layers on 4 SMs' worth of splits the sliding ones run faster on 2
    (fake timings, as North Mini Code at batch 1 and 32K measured on an H200: 32 beneath 64's
    splits, -1.5%). The tuner times those pairs last and records 2 attention SMs with 4 for the
    global layers; the planner lowers with both, and mkc compile's summary says why 2 is not the
    fastest of the first times."""
    from mkc.schedule.visualize import format_summary, summary

    def fake_row(spec, w, b, c, *, attention_sms, ceilings=None, **kw):
        wide = kw.get("global_attention_sms", 0)
        us = 100 * (1 + abs(attention_sms - 4) / 4)
        if (attention_sms, wide) == (2, 4):
            us = 98.0
        return bench.row("mkc", b, c, [us * 1e-6], 10**6, 4e12)

    timed_on_an_h200(fake_row)
    logs = []
    assert bench.tune_attention_sms(tiny, {}, 1, 40, sms=16, bw=4e12, reps=3, log=logs.append) == 2
    rec = json.loads(tuning_file.read_text())[tuning.tuning_key(tiny, 1, 40, 16)]
    assert rec["attention_sms"] == 2 and rec["global_attention_sms"] == 4
    assert min(rec["measured_us"], key=rec["measured_us"].get) == "4"
    assert rec["global_attention_sms_measured_us"] == {"0": 100.0, "8": 100.0, "16": 100.0, "32": 100.0,
                                                       "4@2": 98.0, "8@2": 150.0, "16@2": 150.0}
    assert any("fastest with 2 attention SMs and 4 SMs' worth of splits in the layers of global attention" in ln
               for ln in logs)
    sc = plan(tiny, 1, 40, 16)
    assert sc.meta["attention_sms"]["chosen"] == 2 and sc.meta["global_attention_sms"] == 4
    text = format_summary(summary(sc, tiny))
    assert "then with the layers of global attention on 4's splits or more, 2 measured faster" in text
    assert "4 SMs' worth of attention splits; measured fastest by mkc bench --tune" in text


def test_tune_times_the_global_layers_splits_on_a_count_that_tied_with_the_fastest(tiny, tuning_file, timed_on_an_h200):
    """No attention SMs run 0.3% faster than 4 (a tie within the run's noise, as North Mini Code at
    batch 1 and 128K measured on an H200: none against 64), but 4 with 16 SMs' worth of splits in
    the layers of global attention runs faster than anything with none set apart (fake timings).
    The tuner times the global layers' splits on the tied count as well, and records that pair."""

    def fake_row(spec, w, b, c, *, attention_sms, ceilings=None, **kw):
        wide = kw.get("global_attention_sms", 0)
        us = {0: 100.0, 4: 100.3}.get(attention_sms, 150.0)
        if (attention_sms, wide) == (4, 16):
            us = 93.0
        return bench.row("mkc", b, c, [us * 1e-6], 10**6, 4e12)

    timed_on_an_h200(fake_row)
    logs = []
    assert bench.tune_attention_sms(tiny, {}, 1, 40, sms=16, bw=4e12, reps=3, log=logs.append) == 4
    rec = json.loads(tuning_file.read_text())[tuning.tuning_key(tiny, 1, 40, 16)]
    assert rec["attention_sms"] == 4 and rec["global_attention_sms"] == 16
    timed = rec["global_attention_sms_measured_us"]
    assert timed["16@4"] == 93.0 and set(timed) == {"0", "32", "64", "8@4", "16@4", "32@4"}
    assert any("fastest with 4 attention SMs and 16 SMs' worth of splits" in ln for ln in logs)


def test_tune_times_no_other_count_where_none_tied(tiny, tuning_file, timed_on_an_h200):
    """The same with 4 attention SMs 3% slower than none: only none's pairs are timed."""
    asked = []

    def fake_row(spec, w, b, c, *, attention_sms, ceilings=None, **kw):
        asked.append((attention_sms, kw.get("global_attention_sms", 0)))
        return bench.row("mkc", b, c, [{0: 100.0, 4: 103.0}.get(attention_sms, 150.0) * 1e-6], 10**6, 4e12)

    timed_on_an_h200(fake_row)
    assert bench.tune_attention_sms(tiny, {}, 1, 40, sms=16, bw=4e12, reps=3, log=lambda line: None) == 0
    assert {wide for a, wide in asked if a == 0} == {0, 32, 64}
    assert not [a for a, wide in asked if wide and a != 0]


def test_tune_leaves_out_the_counts_the_simulation_puts_far_behind(nmc, tuning_file, timed_on_an_h200):
    """North Mini Code at batch 1 and 128K: the counts whose probe step the shared-bandwidth
    simulation puts more than TUNE_SIMULATED_MARGIN above the fastest count's (4, 8, 16 and 32
    attention SMs: 5-28 ms a step on an H200, against 4 ms) are not timed; the log and the entry
    say so with their simulated steps, and mkc compile's summary names them. 32, the next count
    below the fastest, is still timed beneath the global layers' splits (the pair measured fastest
    on an H200)."""
    from mkc.schedule.visualize import format_summary, summary

    asked = []

    def fake_row(spec, w, b, c, *, attention_sms, ceilings=None, **kw):
        wide = kw.get("global_attention_sms", 0)
        asked.append((attention_sms, wide))
        us = {0: 100.0, 64: 99.0}.get(attention_sms, 150.0)
        if (attention_sms, wide) == (32, 256):
            us = 90.0
        return bench.row("mkc", b, c, [us * 1e-6], 10**6, 4e12)

    timed_on_an_h200(fake_row)
    logs = []
    assert bench.tune_attention_sms(nmc, {}, 1, 131072, sms=132, bw=4e12, reps=3, log=logs.append) == 32
    assert {a for a, wide in asked if not wide} == {0, 64}
    assert {a for a, wide in asked if wide} == {0, 32, 64}  # 0: within TUNE_TIE of 64
    rec = json.loads(tuning_file.read_text())[tuning.tuning_key(nmc, 1, 131072, 132)]
    assert set(rec["measured_us"]) == {"0", "64"}
    assert rec["attention_sms"] == 32 and rec["global_attention_sms"] == 256
    far = rec["not_timed_simulated_us"]  # the probe steps of the counts left out
    assert set(far) == {"4", "8", "16", "32"}
    said = [ln for ln in logs if "attention SMs not timed: its simulated probe step" in ln]
    fastest = float(re.search(r"above the fastest count's \(([\d.]+) µs", said[0]).group(1))
    assert len(said) == 4 and all(us > fastest * (1 + tune.TUNE_SIMULATED_MARGIN) for us in far.values())
    assert any("4 attention SMs not timed: its simulated probe step" in ln for ln in logs)
    text = format_summary(summary(plan(nmc, 1, 131072, 132), nmc))
    assert "not timed, their probe's simulated step far slower (µs by attention SMs: 4: " in text


def test_a_tune_plans_each_schedule_once_for_its_placements_and_its_timings(tiny, tuning_file, timed_on_an_h200,
                                                                             monkeypatch):
    """A decision compares its options' placements, then times each, in turn with rounds: each
    schedule is planned once for all of that (North Mini Code: about 10 s a plan), and the timings
    run the schedules the tune planned."""
    planned = []

    def counted_plan(*args, **kw):
        planned.append(repr(sorted(kw.items())))
        return plan(*args, **kw)

    monkeypatch.setattr(tune, "plan", counted_plan)
    timed = []

    def fake_row(spec, w, b, c, *, attention_sms, schedule, ceilings=None, **kw):
        sc = schedule()
        timed.append(sc.meta["attention_sms"]["chosen"] == attention_sms)
        return bench.row("mkc", b, c, [1e-4 * (1 + abs(attention_sms - 4))], 10**6, 4e12)

    timed_on_an_h200(fake_row)
    bench.tune_attention_sms(tiny, {}, 2, 40, sms=16, bw=4e12, reps=3, log=lambda line: None, rounds=2)
    assert len(timed) > 2 * len(attention_sms_candidates(tiny, 2, 16)) and all(timed)
    assert len(planned) == len(set(planned)), "a schedule planned twice"


def test_tune_every_count_times_the_counts_the_simulation_puts_far_behind(tiny, tuning_file, timed_on_an_h200,
                                                                          monkeypatch):
    """The tiny model with a simulation that puts 8 attention SMs 50% behind the others: left out
    of the first times by default, timed with every_count (mkc bench --tune-every-count)."""
    from mkc.schedule import plan as plan_mod

    candidates = attention_sms_candidates(tiny, 2, 16)
    assert 8 in candidates
    monkeypatch.setattr(plan_mod, "choose_attention_sms",
                        lambda *a, **kw: (0, {c: 150.0 if c == 8 else 100.0 for c in candidates}))
    firsts = []

    def fake_row(spec, w, b, c, *, attention_sms, ceilings=None, **kw):
        if not (ceilings and (ceilings.attention_inputs_first_us or ceilings.spread_siblings)) and not kw.get(
                "residual_in_o_proj") and not kw.get("global_attention_sms"):
            firsts.append(attention_sms)
        return bench.row("mkc", b, c, [1e-4 * (1 + attention_sms)], 10**6, 4e12)

    timed_on_an_h200(fake_row)
    key = tuning.tuning_key(tiny, 2, 40, 16)
    bench.tune_attention_sms(tiny, {}, 2, 40, sms=16, bw=4e12, reps=3, log=lambda line: None)
    assert 8 not in firsts and set(firsts) == set(candidates) - {8}
    assert json.loads(tuning_file.read_text())[key]["not_timed_simulated_us"] == {"8": 150.0}
    firsts.clear()
    tuning_file.unlink()
    bench.tune_attention_sms(tiny, {}, 2, 40, sms=16, bw=4e12, reps=3, log=lambda line: None, every_count=True)
    assert set(firsts) == set(candidates)
    assert "not_timed_simulated_us" not in json.loads(tuning_file.read_text())[key]


def test_tune_times_a_sequential_blocks_other_choices(tuning_file, timed_on_an_h200):
    """A sequential block has one attention-SM count (0): the tune times it once, then the choices
    that do apply (here the layer's end: the residual added by the O-projection, faked 10% faster),
    records them, and the planner then takes the entry instead of its probes."""
    spec = load_spec(ROOT / "configs" / "mixtral_tiny.yaml")
    assert attention_sms_candidates(spec, 1, 16) == [0]
    timed = []

    def fake_row(spec, w, b, c, *, attention_sms, **kw):
        timed.append((attention_sms, bool(kw.get("residual_in_o_proj"))))
        return bench.row("mkc", b, c, [1e-4 * (0.9 if kw.get("residual_in_o_proj") else 1.0)], 10**6, 4e12)

    timed_on_an_h200(fake_row)
    logs = []
    assert bench.tune_attention_sms(spec, {}, 1, 64, sms=16, bw=4e12, reps=3, log=logs.append) == 0
    assert timed[:2] == [(0, False), (0, True)] and all(a == 0 for a, _ in timed)
    rec = json.loads(tuning_file.read_text())[tuning.tuning_key(spec, 1, 64, 16)]
    assert rec["attention_sms"] == 0 and rec["measured_us"] == {"0": 100.0}
    assert rec["residual_in_o_proj"] is True and rec["residual_in_o_proj_measured_us"] == {"off": 100.0, "on": 90.0}
    assert any("fastest with 0 attention SMs and the residual added by the O-projection" in ln for ln in logs)
    sc = plan(spec, 1, 64, 16)
    assert sc.meta["attention_sms"]["chosen_by"] == "measured" and sc.meta["residual_in_o_proj"] is True
    from mkc.schedule.visualize import format_summary, summary

    assert "the only count (a sequential block); timed by mkc bench --tune on NVIDIA H200" in format_summary(
        summary(sc, spec))


@pytest.mark.parametrize("profiled", [False, True])
def test_run_bench_tunes_then_reports_the_fastest_run(tiny, tuning_file, monkeypatch, tmp_path, profiled):
    """With --tune every candidate is timed once and the fastest count's run is the megakernel row
    (its log lines reported with it); with --profile that count runs once more, profiled."""
    runs = []
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a: SimpleNamespace(multi_processor_count=16))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (10**12, 10**12))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(bench, "measure_read_bandwidth", lambda: 4e12)

    def fake_row(spec, w, b, c, *, attention_sms=None, profile_dir=None, log, **kw):
        runs.append((attention_sms, profile_dir is not None))
        log(f"kernel line of the run with {attention_sms} attention SMs")
        a = 4 if attention_sms is None else attention_sms  # the profiled rerun: the recorded 4
        return bench.row("mkc", b, c, [1e-4 * (1 + abs(a - 4))], 10**6, 4e12)

    monkeypatch.setattr(bench, "_megakernel_row", fake_row)
    monkeypatch.setattr(bench, "_baseline_row", lambda spec, w, b, c, **kw: runs.append(("torch", False))
                        or bench.row("torch+graph", b, c, [2e-4], 10**6, 4e12))
    logs = []
    rows = bench.run_bench(tiny, {}, [2], [40], reps=3, tune=True, log=logs.append,
                           profile_dir=tmp_path if profiled else None)
    candidates = attention_sms_candidates(tiny, 2, 16)
    # the splits ranked first too: another placement; then the residual in the O-projection, and
    # 8, 16 and 32 SMs' worth of splits in the global layers
    timed = [(a, False) for a in candidates] + [(4, False)] * 5
    assert runs == timed + ([(None, True)] if profiled else []) + [("torch", False)]
    assert rows[0].step_us == pytest.approx(100.0)  # the 4-SM run, the fastest
    assert ("kernel line of the run with 4 attention SMs" in logs) != profiled
    assert sum(ln.startswith("kernel line") for ln in logs) == 1  # the reported run's only


def test_compile_says_the_choice_was_measured(tiny, tuning_file, tmp_path):
    tuning.record(tuning.tuning_key(tiny, 2, 64, 8), entry(4))
    r = subprocess.run([sys.executable, "-m", "mkc.cli", "compile", "configs/tiny.yaml", "-o", str(tmp_path / "out"),
                        "--batch", "2", "--context", "64", "--num-sms", "8", "--no-kernel"],
                       capture_output=True, text=True, cwd=ROOT, check=False)
    assert r.returncode == 0, r.stderr
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("attention SMs"))
    assert "4 for the attention splits" in line and "measured fastest by mkc bench --tune on NVIDIA H200" in line


# What configs/tuning/h200.json chose at each point, as measured on an H200 (BENCHMARKS.md): the
# attention SMs, the raise of the splits' inputs (µs; "+splits": the splits too), the sibling
# spread, the residual added by the O-projection and the global layers' splits (SMs' worth; 0: as
# the sliding layers). Batch 1 at 32K: the first stage measured 64 attention SMs fastest, the last
# 32 for the sliding layers beneath 64 SMs' worth of splits in the global ones ("64@32"); batch 1
# at 128K likewise, 32 beneath 256 ("256@32", 2026-12-05). Batch 2 at 128K and batch 8 at 32K were
# re-tuned on 2026-12-05 10:13-10:17 UTC (the first stage pruned by the simulation), batch 2 at 32K at 12:14.
SHIPPED_H200 = {
    (1, 8192): (32, 0.0, False, True, 0),
    (2, 8192): (32, 0.0, True, False, 0),
    (4, 8192): (64, 100.0, True, False, 0),
    (8, 8192): (64, "100+splits", False, False, 0),
    (1, 32768): (32, 0.0, False, False, 64),
    (2, 32768): (64, 100.0, False, False, 256),
    (4, 32768): (64, 100.0, True, False, 256),
    (8, 32768): (64, "100+splits", True, False, 256),
    (1, 131072): (32, "100+splits", False, False, 256),
    (2, 131072): (64, 100.0, False, False, 256),
    (4, 131072): (0, 100.0, True, False, 512),
}


@pytest.mark.parametrize("point", list(SHIPPED_H200), ids=lambda p: f"b{p[0]}-{p[1]}")
def test_the_shipped_h200_table_matches_north_mini_code(nmc, monkeypatch, point):
    """configs/tuning/h200.json (mkc bench --tune and schedule_variants.py on an H200, 2026-11-30 to
    12-04) is keyed by today's North Mini Code spec: pointed at it, the planner takes each point's
    measured choices (a changed spec would silently stop matching, which this catches), and each
    choice is the fastest of the times its entry holds."""
    monkeypatch.setenv("MKC_TUNING_FILE", str(ROOT / "configs" / "tuning" / "h200.json"))
    batch, context = point
    want, raise_us, spread_want, fold_want, wide_want = SHIPPED_H200[point]
    rec = tuning.load()[tuning.tuning_key(nmc, batch, context, 132)]
    fastest = min(rec["measured_us"], key=lambda a: rec["measured_us"][a])
    first = 64 if point in ((1, 32768), (1, 131072)) else want
    assert rec["attention_sms"] == want and fastest == str(first), rec
    chosen, _, how = plan_choices(nmc, batch, context, 132)  # what plan() schedules with
    meta = {"chosen": chosen, **how}
    assert meta["chosen"] == want and meta["chosen_by"] == "measured", meta
    raised = meta.get("attention_inputs_first_us", 0.0)
    splits_first = raise_us == "100+splits"
    assert raised == (100.0 if splits_first else raise_us), meta
    assert meta.get("splits_first", False) == splits_first, meta
    if raised:
        times = meta["attention_inputs_first_us_measured_us"]
        assert times["100+splits" if splits_first else "100"] == min(times.values()), times
    spread = meta.get("spread_siblings", False)
    assert spread == spread_want, meta
    if spread:
        times = meta["spread_siblings_measured_us"]
        assert times["on"] < times["off"], times
    # an entry measured before the residual decision was timed leaves it off
    fold = meta.get("residual_in_o_proj")
    assert fold == fold_want, meta
    if "residual_in_o_proj" in rec:
        times = meta["residual_in_o_proj_measured_us"]
        assert (times["on"] < times["off"]) == fold, times
    # an entry measured before the global layers' splits were timed has none
    wide = meta.get("global_attention_sms", 0)
    assert wide == wide_want, meta
    if "global_attention_sms" in rec:
        times = rec["global_attention_sms_measured_us"]
        key = str(wide) if want == first else f"{wide}@{want}"
        assert min(times, key=times.get) == key, times


def test_the_shipped_table_reads_into_entries_and_writes_back_the_same(tmp_path):
    """Each entry of configs/tuning/h200.json read as a TuningEntry and recorded again: the file
    written is the shipped one, byte for byte (and an unknown key or a null is kept as read)."""
    shipped = ROOT / "configs" / "tuning" / "h200.json"
    path = tmp_path / "tuning.json"
    for key, obj in tuning.load(shipped).items():
        tuning.record(key, tuning.TuningEntry.from_json(obj), path)
    assert path.read_text() == shipped.read_text()
    odd = {**entry(4), "a_later_decision": [1, 2], "spread_siblings": None}
    assert tuning.TuningEntry.from_json(odd).to_json() == odd
    assert tuning.TuningEntry.from_json(odd).spread_siblings is None


def test_without_a_named_file_the_shipped_tables_apply_under_the_cache(nmc, monkeypatch, tmp_path):
    """MKC_TUNING_FILE unset: the kernel cache's tuning.json first, then configs/tuning/*.json."""
    monkeypatch.delenv("MKC_TUNING_FILE", raising=False)
    monkeypatch.setenv("MKC_CACHE_DIR", str(tmp_path))
    chosen, _, how = plan_choices(nmc, 8, 8192, 132)  # what plan() schedules with
    assert chosen == 64 and how["chosen_by"] == "measured" and how["measured_on"] == "NVIDIA H200"
    tuning.record(tuning.tuning_key(nmc, 8, 8192, 132), entry(32))  # this machine's own measurement
    assert (tmp_path / "tuning.json").exists()
    chosen, _, how = plan_choices(nmc, 8, 8192, 132)
    assert chosen == 32 and how["measured_us"]["32"] == 100.0


def test_a_measured_count_names_its_tool_and_lowering(nmc, tuning_file):
    """An entry says which lowering it was measured under and, unless mkc bench --tune, which tool
    measured it; mkc compile's summary names the tool, and the lowering where it is not the one
    being compiled."""
    from mkc.schedule.visualize import format_summary, summary

    unrotated = {"rope_in_splits": False}
    tuning.record(tuning.tuning_key(nmc, 2, 8192, 132), {**entry(32), "lowering": unrotated})
    tuning.record(tuning.tuning_key(nmc, 1, 8192, 132),
                  {**entry(32), "lowering": {"mlp_share": "bytes", "rope_in_splits": True},
                   "by": "benchmarks/schedule_variants.py"})
    sc = plan(nmc, 2, 8192, 132)
    assert sc.meta["attention_sms"]["measured_lowering"] == unrotated
    text = format_summary(summary(sc, nmc))
    assert "measured fastest by mkc bench --tune on NVIDIA H200" in text
    assert "measured under rope_in_splits=False (this compile: rope_in_splits=True)" in text
    sc = plan(nmc, 1, 8192, 132)
    text = format_summary(summary(sc, nmc))
    assert "measured fastest by benchmarks/schedule_variants.py on NVIDIA H200" in text
    assert "measured under" not in text
    # compiled under the lowering it was measured with: no remark
    sc = plan(nmc, 2, 8192, 132, rope_in_splits=False)
    assert "measured under" not in format_summary(summary(sc, nmc))


def test_compile_names_the_global_layers_measured_splits(nmc, monkeypatch):
    """mkc compile's summary at a point where the shipped table chose more splits for the layers of
    global attention (batch 1 at 128K) says how many, who measured them and every time; at a point
    where it chose none (batch 1 at 8K) it has no such line. Neither says the count was measured under
    another lowering."""
    from mkc.schedule.visualize import format_summary, summary

    monkeypatch.setenv("MKC_TUNING_FILE", str(ROOT / "configs" / "tuning" / "h200.json"))
    text = format_summary(summary(plan(nmc, 1, 131072, 132), nmc))
    line = next(ln for ln in text.splitlines() if ln.startswith("global layers"))
    assert "256 SMs' worth of attention splits; measured fastest by mkc bench --tune" in line
    rec = tuning.load()[tuning.tuning_key(nmc, 1, 131072, 132)]
    assert ", ".join(f"{k}: {v:.1f}" for k, v in rec["global_attention_sms_measured_us"].items()) in line
    # the entry's own choices (its global count, its empty row lists) are not a lowering it differs in
    assert "measured under" not in text, text
    assert "global layers" not in format_summary(summary(plan(nmc, 1, 8192, 132), nmc))


@pytest.mark.parametrize("rows", [(128,) * 6, (80,) * 6 + (48,) * 6, (256, 128, 128), (96,)])
def test_tile_row_labels_read_back_as_their_rows(rows):
    """An entry's row times are keyed by rows_label; the benchmarks' --expert-up-rows read the same
    labels back with row_list."""
    label = tuning.rows_label(rows)
    assert tuning.ROW_LIST.fullmatch(label), label
    assert tuning.row_list(label) == rows
    assert tuning.row_list("80+48x2") == (80, 48, 48)


def test_schedule_variants_names_each_variant_by_what_sets_it_apart():
    """benchmarks/schedule_variants.py's side-by-side summary: a variant's name lists only the choices
    that differ between the run's variants (an expert-tile row list of () is the tiling rule's)."""
    mod = load_benchmark("schedule_variants")
    rows = [(None, {"rope_in_splits": True}, "default"),
            (None, {"rope_in_splits": True, "expert_down_rows": 256}, "default")]
    assert [mod.short_name(v, rows) for v in rows] == ["expert_down_rows=auto", "expert_down_rows=256"]
    mixed = [(None, {"expert_up_rows": (128, 128)}, "default"), (32, {"expert_up_rows": ()}, "spread")]
    assert [mod.short_name(v, mixed) for v in mixed] == ["attention_sms=auto, expert_up_rows=128+128, default",
                                                         "attention_sms=32, expert_up_rows=rule, spread"]
    assert mod.short_name(rows[0], rows[:1]) == "default"
