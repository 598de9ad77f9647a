"""Planning a step: lower and schedule, choosing how a parallel block shares the SMs.

In a parallel block (x + attn(n) + mlp(n)) the attention branch and the MLP branch read the same
normed input and run side by side. Lowered with every op filling all SMs, each phase is one wave
over the whole GPU and the layer becomes the sum of its phases: the attention splits queue behind
the expert tiles on the same SMs. ``LowerOptions.attention_sms`` gives the attention splits their
own SMs (one wave of splits there) and the MLP tiles the rest, so the latency-bound attention chain
(the splits and the combine) runs beside the weight stream.

How many SMs is a property of the model, the batch and the GPU, so the compiler decides it. The
candidates are 0 (no split) and the (sequence, KV head) streams times a power of two, up to half
the SMs: each stream then gets the same number of key splits. A choice measured on the GPU
(``mkc bench --tune``, mkc/schedule/tuning.py) wins, and at a context without one so do the
choices measured at the nearest context of the same batch (docs/tiling.md says why: the cost
model's own schedule measured 3.7-19.6% slower than the best at every measured point);
otherwise the compiler lowers a probe (the model cut after the third layer of each kind it has
three times or more, so every kind is in it: probe_spec) with each candidate, schedules it as plan()
would, and keeps the candidate whose step is shortest under shared bandwidth (simulate.py: the
SMs streaming at a moment share the read bandwidth, each up to a cap, rather than each holding a
fixed share). Ranked so, the counts of every entry of configs/tuning/h200.json come out fastest at
9 of 11 points (mean regret 0.3%); the list scheduler's own prediction picked the fastest at 3 of
11 (mean regret 3.7%, worst 11.1%). Hence also the measurement wins where there is one. More than
half the SMs measured no faster (a tie to 5% slower), so the candidates stop at half.

A measured entry may also carry the priority raise of the attention splits' inputs
(``Ceilings.attention_inputs_first_us``, and ``Ceilings.splits_first``: of the splits too) and
the spread of a layer's sibling tiles over SMs (``Ceilings.spread_siblings``) that ran faster at
its point; the planner schedules with them unless the caller passes its own ceilings. It may also
say that the layer ran faster ended by the O-projection (``LowerOptions.residual_in_o_proj``);
the planner then lowers so unless the caller says otherwise; and how many splits the layers of
global attention have (``LowerOptions.global_attention_sms``; where nothing was measured, the
compiler's choice by the same simulation: choose_global_attention_sms).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from mkc.ir.graph import gc_paused
from mkc.ir.lower import MAX_ATTENTION_WAVES, LowerOptions, lower
from mkc.ir.spec import ModelSpec
from mkc.schedule import tuning
from mkc.schedule.cost import H200, Ceilings
from mkc.schedule.schedule import Schedule
from mkc.schedule.scheduler import schedule
from mkc.schedule.simulate import simulated_step_us

# The lowering choices plan() passes on to lower() (LowerOptions' fields of these names), and their
# defaults. mkc bench --tune records them beside each measured count, since the count was fastest
# for them.
LOWERING_CHOICES = ("rope_in_splits", "residual_in_o_proj", "fused_experts", "global_attention_sms",
                    "expert_up_rows", "expert_down_rows", "weights")
# A tuning entry's measured Ceilings.attention_inputs_first_us for its point (mkc bench --tune times
# the fastest attention-SM count with and without the raise and records the faster), and the times
# under INPUTS_FIRST + "_measured_us".
INPUTS_FIRST = "attention_inputs_first_us"
INPUTS_FIRST_CANDIDATES = (0.0, 100.0)
# ... whether the raise goes to the splits themselves too (Ceilings.splits_first: timed as a third
# raise, its time under INPUTS_FIRST + "_measured_us" as SPLITS_FIRST_KEY) ...
SPLITS_FIRST = "splits_first"
SPLITS_FIRST_KEY = f"{INPUTS_FIRST_CANDIDATES[-1]:g}+splits"
# ... and its measured Ceilings.spread_siblings (timed with the count and raise chosen first), with
# the times under SPREAD + "_measured_us" ("off", "on").
SPREAD = "spread_siblings"
# ... and whether the O-projection ends the layer (LowerOptions.residual_in_o_proj: timed last, with
# the count, raise and spread chosen; its times under RESIDUAL_IN_O_PROJ + "_measured_us" ("off",
# "on"; measured by another tool: named under RESIDUAL_IN_O_PROJ + "_by")). An entry without it was
# measured without it. Where nothing was measured it is off: the probe's predictions (within 1%
# either way) disagreed in sign with the measurements (faster at batch 1, where the attention chain
# ends the layer; 5-17% slower at batch 2-8, where its tiles hold their SMs until the longer MoE
# branch ends). A sequential block has no branches side by side: there the compiler chooses by the
# probe (choose_residual_in_o_proj), on where it beats off by LAYER_END_MIN_GAIN.
RESIDUAL_IN_O_PROJ = "residual_in_o_proj"
# ... and the splits of the layers of global attention (LowerOptions.global_attention_sms: timed
# after the residual's choice, where the model has such layers and they attend more keys than its
# sliding windows; the times under GLOBAL_ATTENTION_SMS + "_measured_us", "0" for as many as the
# other layers). An entry without it was measured without it: 0. Where nothing was measured the
# compiler chooses (GLOBAL_SPLITS_MIN_GAIN below); the list scheduler's prediction, which chose
# before, had the sign wrong at batch 1 at 8K and 32K.
GLOBAL_ATTENTION_SMS = "global_attention_sms"
# Where nothing was measured, more splits in the global layers than in the others only where the
# probe's simulated step (choose_global_attention_sms) is this much shorter: the simulation ranked
# the tuner's decisions of 0.3-3% measured effect right only about half the time. Against the
# counts h200.json timed, this choice is the fastest or within 0.3% at 7 of 9 long-context points
# (mean regret 0.6%); with no threshold the mean regret is 1.2%, and as many splits as the other
# layers is 8-13% slower at 128K.
GLOBAL_SPLITS_MIN_GAIN = 0.02
# ... and the same margin for a sequential block's layer end where nothing was measured: the
# O-projection (and a dense down projection) adding the residual, one RESIDUAL hand-off fewer per
# half layer, only where the probe's step is this much shorter.
LAYER_END_MIN_GAIN = GLOBAL_SPLITS_MIN_GAIN
# ... and the rows of the expert-down tiles (LowerOptions.expert_down_rows, 0: the tiling rule), where
# an entry names them: not timed by mkc bench --tune (which keeps them when it rewrites the entry),
# so an entry has them only from another tool, which it names under EXPERT_DOWN_ROWS + "_by" with
# the times under EXPERT_DOWN_ROWS + "_measured_us" ("0" for the rule). North Mini Code at batch 8
# and 8K: 256 rows (eight tiles per slot instead of the rule's two of 1024) measured faster.
EXPERT_DOWN_ROWS = "expert_down_rows"
# ... and the rows of each routing slot's expert gate/up tiles (LowerOptions.expert_up_rows, as a
# list adding up to the expert intermediate size; empty: the tiling rule's equal tiles), kept and
# named like the expert-down rows (EXPERT_UP_ROWS + "_by", "_measured_us" by SIZExCOUNT terms,
# "rule" for the rule). North Mini Code at batch 4 and 8K: six tiles of 128 rows per slot instead
# of the rule's four of 192 measured faster.
EXPERT_UP_ROWS = "expert_up_rows"
# An entry that a later `mkc bench --tune` at its point timed side by side against its own choice,
# and that ran faster, stays with this record of that run (mkc/schedule/tune.py: keep_the_faster).
KEPT_OVER_RETUNE = "kept_over_retune"
DEFAULT_LOWERING = {f.name: f.default for f in dataclasses.fields(LowerOptions) if f.name in LOWERING_CHOICES}


def lowering_choices(given: dict[str, object]) -> dict[str, object]:
    """DEFAULT_LOWERING with ``given`` applied; an unknown name is an error naming the choices."""
    unknown = sorted(set(given) - set(LOWERING_CHOICES))
    if unknown:
        raise TypeError(f"unknown lowering choice {', '.join(unknown)}: expected one of {', '.join(LOWERING_CHOICES)}")
    return {**DEFAULT_LOWERING, **given}


def current_lowering(recorded: object) -> dict[str, object] | None:
    """A tuning entry's recorded lowering, less the choices mkc no longer has (an older entry names
    variants since retired: docs/decisions.md); None where the entry records none."""
    if not isinstance(recorded, dict):
        return None
    return {k: v for k, v in recorded.items() if k in LOWERING_CHOICES}


def attention_sms_candidates(spec: ModelSpec, batch: int, num_sms: int) -> list[int]:
    """0, then batch x KV heads x 2^i while at most half the SMs; only 0 for a sequential block."""
    if spec.block != "parallel":
        return [0]
    streams = batch * spec.attention.num_kv_heads
    out, a = [0], streams
    while a <= num_sms // 2:
        out.append(a)
        a *= 2
    return out


def global_attention_sms_candidates(spec: ModelSpec, batch: int, context: int, num_sms: int,
                                    attention_sms: int) -> list[int]:
    """0 (as many splits as the other layers), then twice, four and eight times ``attention_sms``
    (0: num_sms) within LowerOptions' bound; only 0 unless the model has layers of sliding-window
    attention and layers of global attention, and the context is longer than the windows (the
    global layers then attend more keys)."""
    kinds = {ls.attention for ls in spec.layers}
    window = spec.attention.sliding_window or 0
    if not {"global", "sliding"} <= kinds or context <= window:
        return [0]
    base = attention_sms or num_sms
    return [0] + [base * m for m in (2, 4, 8) if base * m <= MAX_ATTENTION_WAVES * num_sms]


def probe_spec(spec: ModelSpec) -> ModelSpec:
    """The model cut after the third layer of each kind (attention, MLP, RoPE) it has three times or
    more, and at least after the first of every kind (North Mini Code: its dense layer and three
    cycles of three sliding-window layers and a global one, 13 layers). Cut after the first of each
    kind (5 layers), the probes ranked the counts measured on an H200 worse than the whole model
    does (the fastest at 6 of 11 points against 9 of 11: the module doc); cut after the second (9
    layers), as well as it, but with batch 2 at 32K a near tie (0.02%) the simulation's bandwidth
    could turn."""
    seen: dict[tuple[str, str, bool], int] = {}
    last = 0
    for i, ls in enumerate(spec.layers):
        kind = (ls.attention, ls.mlp, ls.rope)
        seen[kind] = seen.get(kind, 0) + 1
        if seen[kind] <= 3:
            last = i
    return dataclasses.replace(spec, num_layers=last + 1, layers=spec.layers[:last + 1])


def choose_attention_sms(spec: ModelSpec, batch: int, context: int, num_sms: int, page_size: int = 0,
                         kv_pages: int = 0, ceilings: Ceilings = H200, **lowering) -> tuple[int, dict[int, float]]:
    """The candidate whose probe schedule (placed with ``ceilings``, as plan() places) is fastest
    under shared bandwidth (simulate.py; ties: the smaller), and every candidate's simulated probe
    step in µs. ``lowering``: LOWERING_CHOICES (default DEFAULT_LOWERING)."""
    lowering = lowering_choices(lowering)
    cands = attention_sms_candidates(spec, batch, num_sms)
    if len(cands) == 1:
        return cands[0], {}
    probe = probe_spec(spec)
    predicted = {a: _probe_step_us(probe, batch, context, num_sms, page_size, kv_pages, ceilings, attention_sms=a,
                                   **lowering) for a in cands}
    return min(cands, key=lambda a: (predicted[a], a)), predicted


def choose_global_attention_sms(spec: ModelSpec, batch: int, context: int, num_sms: int, attention_sms: int,
                                page_size: int = 0, kv_pages: int = 0, ceilings: Ceilings = H200,
                                step_with_none: float | None = None, **lowering) -> tuple[int, dict[int, float]]:
    """The splits of the layers of global attention (global_attention_sms_candidates, beside
    ``attention_sms``) whose probe schedule is fastest under shared bandwidth, as
    choose_attention_sms ranks (ties: the fewer), where it beats as many splits as the other layers
    (0) by GLOBAL_SPLITS_MIN_GAIN, else 0; and every candidate's simulated probe step in µs; (0, {})
    where there is one candidate. ``step_with_none``: that probe's step with 0, where
    choose_attention_sms already simulated it."""
    lowering = lowering_choices({**lowering, GLOBAL_ATTENTION_SMS: 0})
    cands = global_attention_sms_candidates(spec, batch, context, num_sms, attention_sms)
    if len(cands) == 1:
        return 0, {}
    probe = probe_spec(spec)
    predicted = {w: step_with_none if w == 0 and step_with_none is not None else
                 _probe_step_us(probe, batch, context, num_sms, page_size, kv_pages, ceilings,
                                attention_sms=attention_sms, **{**lowering, GLOBAL_ATTENTION_SMS: w})
                 for w in cands}
    best = min(cands, key=lambda w: (predicted[w], w))
    return (best if predicted[best] < predicted[0] * (1 - GLOBAL_SPLITS_MIN_GAIN) else 0), predicted


def choose_residual_in_o_proj(spec: ModelSpec, batch: int, context: int, num_sms: int, attention_sms: int,
                              page_size: int = 0, kv_pages: int = 0, ceilings: Ceilings = H200,
                              **lowering) -> tuple[bool, dict[str, float]]:
    """Whether a sequential block's GEMVs end its halves (LowerOptions.residual_in_o_proj): on where
    the probe's step under shared bandwidth beats off by LAYER_END_MIN_GAIN, and both probe steps in
    µs ("off", "on"). A parallel block: (False, {}), since there the probe's sign disagreed with the
    measurements (RESIDUAL_IN_O_PROJ's comment)."""
    if spec.block != "sequential":
        return False, {}
    lowering = lowering_choices(lowering)
    probe = probe_spec(spec)
    predicted = {name: _probe_step_us(probe, batch, context, num_sms, page_size, kv_pages, ceilings,
                                      attention_sms=attention_sms, **{**lowering, RESIDUAL_IN_O_PROJ: on})
                 for name, on in (("off", False), ("on", True))}
    return predicted["on"] < predicted["off"] * (1 - LAYER_END_MIN_GAIN), predicted


def _probe_step_us(probe: ModelSpec, batch: int, context: int, num_sms: int, page_size: int, kv_pages: int,
                   ceilings: Ceilings, **lowering) -> float:
    """The probe lowered with ``lowering``, placed with ``ceilings``: its step under shared bandwidth."""
    sc = schedule(lower(probe, batch, context, num_sms, page_size, kv_pages, **lowering), probe.name, ceilings)
    return round(simulated_step_us(sc, ceilings), 1)


def plan_choices(spec: ModelSpec, batch: int, context: int, num_sms: int, page_size: int = 0, kv_pages: int = 0,
                 attention_sms: int | None = None, ceilings: Ceilings = H200,
                 **lowering) -> tuple[int, Ceilings, dict[str, Any]]:
    """What plan() schedules with, before it lowers and schedules: the attention-SM count, the
    ceilings (with a measured entry's raise and spread applied) and ``meta["attention_sms"]``
    without the count (see plan). Where this context has no entry, the nearest measured context's
    (tuning.nearest; ``measured_at_context``) applies, its global layers' splits scaled
    (transferred_global_count). Unless the caller gives the count or ``residual_in_o_proj``, a
    measured entry's choice of it is ``how[RESIDUAL_IN_O_PROJ]`` (absent from the entry: False).
    FP8 weights take their own format's entries first, then bf16's (this model's, measured with the
    other weights: ``how["measured_lowering"]["weights"]`` says so)."""
    given = frozenset(lowering)  # the caller's lowering choices: an entry's do not replace them
    lowering = lowering_choices(lowering)
    how: dict[str, Any] = {"chosen_by": "asked", "probe_predicted_us": {}}
    keys = {w: tuning.tuning_key(spec, batch, context, num_sms, page_size, w)
            for w in dict.fromkeys((str(lowering["weights"]), "bf16"))}
    here = {w: tuning.TuningEntry.from_json(e) for w, k in keys.items() if (e := tuning.lookup(k))}
    if attention_sms is not None:
        # an asked count takes none of an entry's choices (the raise, spread, layer end, splits and
        # rows were measured together; mkc bench --tune and schedule_variants.py time counts so),
        # and the summary says that an entry exists
        measured = next(iter(here.values()), None)
        if measured and isinstance(measured.attention_sms, int):
            how["entry_not_applied"] = measured.attention_sms
        return attention_sms, ceilings, how
    counts = attention_sms_candidates(spec, batch, num_sms)
    measured_context, measured, measured_weights = context, None, None
    for weights, key in keys.items():
        if weights in here:  # measured here (an entry here is also the nearest one: nothing else to try)
            at, entry = context, here[weights]
        else:  # the choices measured at the nearest context of this batch, if any
            near = tuning.nearest(key)
            at, entry = (near[0], tuning.TuningEntry.from_json(near[1])) if near else (context, None)
        if entry and entry.attention_sms in counts:
            measured_context, measured, measured_weights = at, entry, weights
            break
    if not (measured and measured.attention_sms in counts):
        attention_sms, tried = choose_attention_sms(spec, batch, context, num_sms, page_size, kv_pages,
                                                    ceilings, **lowering)
        how = {"chosen_by": "compiler" if tried else "only candidate",
               "probe_predicted_us": {str(a): us for a, us in tried.items()}}
        if GLOBAL_ATTENTION_SMS not in given:  # and the global layers' splits beside that count, the same way
            wide, wide_tried = choose_global_attention_sms(spec, batch, context, num_sms, attention_sms, page_size,
                                                           kv_pages, ceilings, tried.get(attention_sms), **lowering)
            if wide_tried:
                how[GLOBAL_ATTENTION_SMS] = wide
                how[GLOBAL_ATTENTION_SMS + "_probe_us"] = {str(w): us for w, us in wide_tried.items()}
        if RESIDUAL_IN_O_PROJ not in given:  # a sequential block's layer end, beside those
            wide = {GLOBAL_ATTENTION_SMS: how[GLOBAL_ATTENTION_SMS]} if GLOBAL_ATTENTION_SMS in how else {}
            fold, fold_tried = choose_residual_in_o_proj(spec, batch, context, num_sms, attention_sms, page_size,
                                                         kv_pages, ceilings, **{**lowering, **wide})
            if fold_tried:
                how[RESIDUAL_IN_O_PROJ] = fold
                how[RESIDUAL_IN_O_PROJ + "_probe_us"] = fold_tried
        return attention_sms, ceilings, how
    how = {"chosen_by": "measured", **_measured_choices(spec, batch, context, num_sms, measured, measured_context,
                                                        ceilings == H200, given, lowering["fused_experts"])}
    if measured_weights != lowering["weights"]:  # another format's entry: the summary names the format
        how["measured_lowering"] = {**(how["measured_lowering"] or {}), "weights": measured_weights}
    if ceilings == H200:  # the entry's raise and spread, unless the caller asked for other ceilings
        ceilings = dataclasses.replace(ceilings, **{k: how[k] for k in (INPUTS_FIRST, SPLITS_FIRST, SPREAD)
                                                    if k in how})
    return int(measured.attention_sms), ceilings, how


def _measured_choices(spec: ModelSpec, batch: int, context: int, num_sms: int, measured: tuning.TuningEntry,
                      measured_context: int, default_ceilings: bool, given: frozenset[str],
                      fused_experts: bool) -> dict[str, Any]:
    """``meta["attention_sms"]`` of a measured entry (plan_choices), less "chosen_by": what it
    measured and each choice of it the planner applies (a choice the caller gave: not the entry's)."""
    how: dict[str, Any] = {
        "measured_us": _given(measured.measured_us, {}), "measured_on": _given(measured.gpu, "?"),
        "measured_at": _given(measured.date, "?"), "measured_lowering": current_lowering(measured.lowering),
        "measured_by": measured.by}
    if measured.not_timed_simulated_us:  # counts mkc bench --tune left out (runtime/bench.py)
        how["not_timed_simulated_us"] = measured.not_timed_simulated_us
    if isinstance(measured.kept_over_retune, dict):
        how[KEPT_OVER_RETUNE] = measured.kept_over_retune
    if measured_context != context:
        how["measured_at_context"] = measured_context
    # the priority raise of the attention splits' inputs (and splits) and the spread of sibling
    # tiles measured at this point (an entry without them: the ceilings' own), unless the caller
    # asked for other ceilings
    first, spread = measured.attention_inputs_first_us, measured.spread_siblings
    if isinstance(first, (int, float)) and default_ceilings:
        how[INPUTS_FIRST] = float(first)
        how[INPUTS_FIRST + "_measured_us"] = _given(measured.inputs_first_measured_us, {})
        if measured.splits_first is True:
            how[SPLITS_FIRST] = True
    if isinstance(spread, bool) and default_ceilings:
        how[SPREAD] = spread
        how[SPREAD + "_measured_us"] = _given(measured.spread_measured_us, {})
    if RESIDUAL_IN_O_PROJ not in given:
        how[RESIDUAL_IN_O_PROJ] = measured.residual_in_o_proj is True
        how[RESIDUAL_IN_O_PROJ + "_measured_us"] = _given(measured.residual_measured_us, {})
        if measured.residual_by:  # another tool than mkc bench --tune measured it
            how[RESIDUAL_IN_O_PROJ + "_by"] = measured.residual_by
    count = measured.global_attention_sms
    # a count mkc bench --tune tried (one of the candidates), or one another tool measured (*_by)
    # that the lowering takes (LowerOptions: at most MAX_ATTENTION_WAVES times the SMs)
    candidates = global_attention_sms_candidates(spec, batch, context, num_sms, int(measured.attention_sms))
    if measured_context != context and GLOBAL_ATTENTION_SMS not in given:  # splits of the size measured there
        there = count if isinstance(count, int) and not isinstance(count, bool) else 0
        how[GLOBAL_ATTENTION_SMS + "_measured_there"] = there
        count = transferred_global_count(candidates, int(measured.attention_sms) or num_sms, there,
                                         context / measured_context)
    other_tool = bool(measured.global_by) and len(candidates) > 1
    if GLOBAL_ATTENTION_SMS not in given and isinstance(count, int) and not isinstance(count, bool) and (
            count in candidates or (other_tool and 0 <= count <= MAX_ATTENTION_WAVES * num_sms)):
        how[GLOBAL_ATTENTION_SMS] = count
        how[GLOBAL_ATTENTION_SMS + "_measured_us"] = _given(measured.global_measured_us, {})
        if measured.global_by:  # another tool than mkc bench --tune measured it
            how[GLOBAL_ATTENTION_SMS + "_by"] = measured.global_by
    rows = measured.expert_down_rows
    if EXPERT_DOWN_ROWS not in given and isinstance(rows, int) and not isinstance(rows, bool) and rows >= 0 and rows % 16 == 0:
        how[EXPERT_DOWN_ROWS] = rows
        how[EXPERT_DOWN_ROWS + "_measured_us"] = _given(measured.expert_down_measured_us, {})
        how[EXPERT_DOWN_ROWS + "_by"] = _given(measured.expert_down_by, "?")
    up = measured_up_rows(spec, measured.expert_up_rows)
    if EXPERT_UP_ROWS not in given and up and not fused_experts:  # fused tiles keep equal parts (LowerOptions)
        how[EXPERT_UP_ROWS] = up
        how[EXPERT_UP_ROWS + "_measured_us"] = _given(measured.expert_up_measured_us, {})
        how[EXPERT_UP_ROWS + "_by"] = _given(measured.expert_up_by, "?")
    return how


def _given(value: object, default: object) -> object:
    """An entry's value, or ``default`` where the entry has none."""
    return default if value is None else value


def transferred_global_count(candidates: list[int], base: int, count: int, ratio: float) -> int:
    """A global layers' split count measured at another context, moved to this one so that each split
    attends as many keys as there: ``count`` (0: ``base``, the other layers' SMs' worth) times the
    contexts' ``ratio``, as the nearest of this point's ``candidates`` (global_attention_sms_candidates)
    by ratio (a tie: the larger); 0 where that is no more than ``base`` or the point has none."""
    wanted = (count or base) * ratio
    if len(candidates) == 1 or wanted <= base:
        return 0
    return min(candidates[1:], key=lambda w: (abs(math.log(w / wanted)), -w))


def measured_up_rows(spec: ModelSpec, rows: object) -> tuple[int, ...]:
    """A tuning entry's expert gate/up tile rows as LowerOptions.expert_up_rows, where they are a
    list of positive multiples of 16 adding up to the model's expert intermediate size; else ()
    (the tiling rule: an entry of another model shape or a hand-edited one is not applied)."""
    if not (isinstance(rows, list) and rows and spec.moe is not None):
        return ()
    if not all(isinstance(r, int) and not isinstance(r, bool) and r > 0 and r % 16 == 0 for r in rows):
        return ()
    return tuple(rows) if sum(rows) == spec.moe.intermediate else ()


def plan(spec: ModelSpec, batch: int, context: int, num_sms: int, page_size: int = 0, kv_pages: int = 0,
         attention_sms: int | None = None, ceilings: Ceilings = H200, **lowering) -> Schedule:
    """Lower and schedule one decode step: the schedule every runtime path runs.
    ``attention_sms=None`` lets the compiler choose (see the module doc); the choice, who made it
    and the candidates' measured or predicted step are in ``meta["attention_sms"]``; a measured
    choice also names the lowering it was measured with (``measured_lowering``) and the tool
    (``measured_by``; None where the entry does not say: mkc bench --tune), and the lowering may
    differ from this one.
    ``lowering``: the LOWERING_CHOICES (LowerOptions fields; default DEFAULT_LOWERING), each also in
    ``meta`` under its name."""
    with gc_paused():  # the lowerings and placements make millions of objects and no cycles
        attention_sms, ceilings, how = plan_choices(spec, batch, context, num_sms, page_size, kv_pages,
                                                    attention_sms, ceilings, **lowering)
        lowering = lowering_choices(lowering)
        for choice in (RESIDUAL_IN_O_PROJ, GLOBAL_ATTENTION_SMS, EXPERT_DOWN_ROWS, EXPERT_UP_ROWS):
            if choice in how:  # measured at this point (plan_choices)
                lowering[choice] = how[choice]
        program = lower(spec, batch, context, num_sms, page_size, kv_pages, attention_sms=attention_sms,
                        **lowering)
        sc = schedule(program, spec.name, ceilings)
    sc.meta["attention_sms"] = {"chosen": attention_sms, **how}
    sc.meta.update(lowering)
    return sc

