"""The tuner behind ``mkc bench --tune``: which schedule runs fastest at one point, decided one
choice at a time on the GPU and recorded in the tuning table (mkc/schedule/tuning.py).

A schedule the tuner times is a Candidate. The search is one loop over DECISIONS, in order: each
decision names the options it times given the schedule chosen so far, applies an option to that
schedule, and says what of its outcome the entry records. The entry is written after each decision,
so that a tune stopped part-way (a time limit, ^C) keeps what it measured.

The GPU is not touched here: runtime/bench.py passes ``time``, which builds and times one
Candidate's megakernel (and keeps its run to report), and the GPU's name.
"""

from __future__ import annotations

import dataclasses
import datetime
import statistics
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from mkc.ir.fp8 import weights_choice
from mkc.ir.spec import ModelSpec
from mkc.schedule import plan as planner
from mkc.schedule import tuning
from mkc.schedule.cost import H200, Ceilings
from mkc.schedule.plan import (
    DEFAULT_LOWERING,
    EXPERT_DOWN_ROWS,
    EXPERT_UP_ROWS,
    GLOBAL_ATTENTION_SMS,
    INPUTS_FIRST_CANDIDATES,
    RESIDUAL_IN_O_PROJ,
    SPLITS_FIRST_KEY,
    attention_sms_candidates,
    global_attention_sms_candidates,
    plan,
    plan_choices,
)
from mkc.schedule.schedule import Schedule

T = TypeVar("T")

# Two counts of attention SMs whose whole-model times differ by at most this fraction are a tie
# for mkc bench --tune: the same schedule's median moves by 1-2% between runs. Tied counts are all
# tried with the global layers' splits (batch 1 at 128K: 0 attention SMs timed 0.3% faster than
# 64 alone, but 64 with more global splits ran 7% faster than 0 with them).
TUNE_TIE = 0.02
SCHEDULES_KEPT = 8  # a tune's latest schedules kept planned (North Mini Code: about 10 s to plan each)
# mkc bench --tune does not time an attention-SM count whose probe step under the shared-bandwidth
# simulation (plan.py: choose_attention_sms) is more than this fraction slower than the fastest
# count's (unless asked to time every count). Over the 11 points of configs/tuning/h200.json, the
# measured fastest count's simulated probe step was at most 6.9% above the fastest simulated (batch
# 1 at 128K; batch 4 at 128K 0.7%, the others 0), while the 20 counts this leaves out had measured
# 1.33-7.0x the fastest (batch 1 at 8K: 4 and 8 attention SMs; at 32K 4, 8 and 16; at 128K 4, 8,
# 16 and 32; none at batch 4 and 8 at 8K). Each count left out saves a kernel build and its timed
# steps (~20 s, more at long contexts).
TUNE_SIMULATED_MARGIN = 0.25


def in_turn(options: Sequence[T], rounds: int) -> list[T]:
    """``options`` timed ``rounds`` times in turn, every other round in reverse order (A B B A ...),
    so that a place in the round weighs on every option alike: the first of two identical schedules
    in each round measured 0.6-2.6% slower than the second."""
    return [o for r in range(rounds) for o in (options if r % 2 == 0 else options[::-1])]


@dataclass(frozen=True, slots=True)
class Candidate:
    """One schedule the tuner times: an attention-SM count with the ceilings and lowering to plan it."""

    attention_sms: int  # SMs set apart for the attention splits (LowerOptions.attention_sms)
    raise_us: float = 0.0  # Ceilings.attention_inputs_first_us, µs
    splits_first: bool = False  # Ceilings.splits_first
    spread: bool = False  # Ceilings.spread_siblings
    residual_in_o_proj: bool = False  # LowerOptions.residual_in_o_proj
    global_attention_sms: int = 0  # LowerOptions.global_attention_sms (0: as the other layers)
    up_rows: tuple[int, ...] = ()  # LowerOptions.expert_up_rows (): the tiling rule's
    down_rows: int = 0  # LowerOptions.expert_down_rows (0: the tiling rule's)
    weights: str = "bf16"  # LowerOptions.weights: the weight format, the same for every candidate of a tune

    def ceilings(self) -> Ceilings:
        return dataclasses.replace(H200, attention_inputs_first_us=self.raise_us, splits_first=self.splits_first,
                                   spread_siblings=self.spread)

    def lowering(self) -> dict[str, Any]:
        """Its lowering choices (plan's LOWERING_CHOICES) that differ from the default lowering."""
        return {**({RESIDUAL_IN_O_PROJ: True} if self.residual_in_o_proj else {}),
                **({GLOBAL_ATTENTION_SMS: self.global_attention_sms} if self.global_attention_sms else {}),
                **({EXPERT_UP_ROWS: self.up_rows} if self.up_rows else {}),
                **({EXPERT_DOWN_ROWS: self.down_rows} if self.down_rows else {}),
                **weights_choice(self.weights)}

    def describe(self) -> str:
        """In words, as mkc bench --tune logs its choice."""
        parts = [f"{self.attention_sms} attention SMs"]
        if self.raise_us:
            parts.append(f"the splits' inputs{' and the splits' if self.splits_first else ''} ranked "
                         f"{self.raise_us:g} µs higher")
        parts += ["sibling tiles spread over SMs"] if self.spread else []
        parts += ["the residual added by the O-projection"] if self.residual_in_o_proj else []
        if self.global_attention_sms:
            parts.append(f"{self.global_attention_sms} SMs' worth of splits in the layers of global attention")
        parts += [f"expert gate/up tiles of {tuning.rows_label(self.up_rows)} rows"] if self.up_rows else []
        parts += [f"expert-down tiles of {self.down_rows} rows"] if self.down_rows else []
        return " and ".join(parts)


# Times one candidate's megakernel, logging the line (what it is, its time) and returning its step in µs;
# its third argument gives the candidate's schedule, planned once for the tune's queues and timings alike.
Timer = Callable[[Candidate, str, Callable[[], Schedule]], float]


@dataclass(frozen=True, slots=True)
class Decision:
    """One choice of the search. Each function gets the Tuner (the schedule chosen so far is
    ``tuner.chosen``); an option is the decision's own value (a count, a raise, on or off, rows)."""

    name: str  # as the note of a tune stopped after it says
    options: Callable[[Tuner], list | None]  # the options to time, the choice before first; None: none here
    apply: Callable[[Candidate, Any], Candidate]  # the schedule so far with an option
    what: Callable[[Tuner, Any], str]  # an option in words, as each timing is logged
    rank: Callable[[Tuner, Any], Any]  # the tie-break between options of the same time
    record: Callable[[Tuner, Any, dict[Any, float]], dict[str, Any]]  # the entry's fields: choice, medians
    cannot_build: str = ""  # where an option may fail to build: what the log says, the first option kept


class Tuner:
    """One point's search (run_tune): what has been timed and chosen so far."""

    def __init__(self, spec: ModelSpec, batch: int, context: int, sms: int, page_size: int, *, time: Timer,
                 log: Callable[[str], object], rounds: int, reps: int, gpu: Callable[[], str],
                 build_errors: tuple[type, ...], weights: str = "bf16"):
        self.spec, self.batch, self.context, self.sms, self.page_size = spec, batch, context, sms, page_size
        self.weights = weights
        self.time, self.log, self.rounds, self.reps, self.gpu = time, log, rounds, reps, gpu
        self.build_errors = build_errors
        self.times: dict[Candidate, list[float]] = {}  # every timed step, in the order run (µs)
        self.medians: dict[str, dict[Any, float]] = {}  # decision name -> option -> median µs
        self.chosen_options: dict[str, Any] = {}  # decision name -> the option chosen
        self.placed: dict[Candidate, list[list[int]]] = {}
        self.planned: OrderedDict[Candidate, Schedule] = OrderedDict()  # the latest SCHEDULES_KEPT planned
        self.every: list[int] = []  # every attention-SM count the planner considers
        self.counts: list[int] = []  # those timed
        self.not_timed: dict[int, float] = {}  # count -> its simulated probe step (µs), where left out
        self.tile_choice: tuple[list[tuple[int, ...]], list[int]] | None = None
        self.chosen = Candidate(0, weights=weights)
        self.entry = tuning.TuningEntry()
        self.key = tuning.tuning_key(spec, batch, context, sms, page_size, weights)

    def say(self, line: str) -> None:
        self.log(f"batch {self.batch} context {self.context}: {line}")

    def time_once(self, c: Candidate, what: str) -> None:
        self.times.setdefault(c, []).append(self.time(c, what, lambda: self.plan(c)))

    def decide(self, options: dict[Candidate, str]) -> None:
        """Time ``options``: with one round each once (a schedule timed before is not timed again);
        with more, every option, the one chosen before included, once per round in turn, so that the
        medians decide (drift between rounds falls on every option alike)."""
        again = self.rounds > 1 and len(options) > 1  # one option is nothing to compare
        for c in in_turn(list(options), self.rounds if again else 1):
            if again or c not in self.times:
                self.time_once(c, options[c])

    def plan(self, c: Candidate) -> Schedule:
        """``c``'s schedule, planned once while it is among the latest SCHEDULES_KEPT asked for (a
        decision compares its options' placements, then times each, in turn with rounds)."""
        sc = self.planned.pop(c, None)
        if sc is None:
            sc = plan(self.spec, self.batch, self.context, self.sms, page_size=self.page_size,
                      attention_sms=c.attention_sms, ceilings=c.ceilings(), **c.lowering())
        self.planned[c] = sc
        while len(self.planned) > SCHEDULES_KEPT:
            self.planned.popitem(last=False)
        return sc

    def queues(self, c: Candidate) -> list[list[int]]:
        """How ``c`` places the tasks (a raise or spread that places nothing differently is not timed)."""
        if c not in self.placed:
            self.placed[c] = self.plan(c).queues
        return self.placed[c]

    def run(self, decision: Decision) -> None:
        """Time the decision's options, choose the fastest by median (ties: its rank) and record it."""
        options = decision.options(self)
        if options is None:
            return
        cands = {o: decision.apply(self.chosen, o) for o in options}
        try:
            self.decide({c: decision.what(self, o) for o, c in cands.items()})
        except self.build_errors as e:
            if not decision.cannot_build:
                raise
            self.say(f"{decision.cannot_build}: {e}")
            options = options[:1]
        med = {o: statistics.median(self.times[cands[o]]) for o in options}
        best = min(options, key=lambda o: (med[o], decision.rank(self, o)))
        self.medians[decision.name], self.chosen_options[decision.name] = med, best
        self.chosen = cands[best]
        self.entry = dataclasses.replace(self.entry, **decision.record(self, best, med))
        self.write(decision.name)

    def write(self, done: str | None) -> Path:
        """Record the decisions so far (``done``: the last one, while more may come; the rest stays the
        planner's); returns the path written."""
        by = None if done is None else f"mkc bench --tune, stopped after {done} (the rest: the planner's own)"
        return tuning.record(self.key, dataclasses.replace(self.entry, by=by, gpu=self.gpu(), reps=self.reps,
                                                           rounds=self.rounds,
                                                           lowering={**DEFAULT_LOWERING, "weights": self.weights},
                                                           date=_now()))


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")


def _us(t: float) -> float:
    return round(t, 1)


def _on_off(on: bool) -> str:
    return "on" if on else "off"


def _count_options(t: Tuner) -> list[int]:
    return t.counts


def _raise_options(t: Tuner) -> list[tuple[float, bool]]:
    """The raises (µs, the splits too) that place the tasks otherwise than every raise before them."""
    raises = [(us, False) for us in INPUTS_FIRST_CANDIDATES] + [(INPUTS_FIRST_CANDIDATES[-1], True)]
    kept = [raises[0]]
    for r in raises[1:]:
        if not any(t.queues(_with_raise(t.chosen, r)) == t.queues(_with_raise(t.chosen, k)) for k in kept):
            kept.append(r)
    return kept


def _with_raise(c: Candidate, r: tuple[float, bool]) -> Candidate:
    return dataclasses.replace(c, raise_us=r[0], splits_first=r[1])


def _raise_words(t: Tuner, r: tuple[float, bool]) -> str:
    us, splits = r
    a = t.chosen.attention_sms
    if not us:
        return f"{a} attention SMs"
    return f"{a} attention SMs, the splits' inputs" + (" and the splits" if splits else "") + f" ranked {us:g} µs higher"


def _spread_options(t: Tuner) -> list[bool]:
    on = dataclasses.replace(t.chosen, spread=True)
    return [False, True] if t.queues(on) != t.queues(dataclasses.replace(t.chosen, spread=False)) else [False]


def _global_options(t: Tuner) -> list[tuple[int, int]]:
    """Pairs (attention SMs, global layers' SMs' worth). The count chosen so far is the one the whole
    model ran fastest with, which at a long context the global layers decide; so the sliding layers
    are also timed on the next smaller count of all (though left out of the first times: beneath
    the global layers' splits it is another schedule; batch 1 at 128K measured fastest so), and on
    any count that ran within TUNE_TIE of the chosen one (a tie the run's noise may have broken
    either way, which more splits in the global layers may favour)."""
    best = t.chosen.attention_sms
    pairs = [(best, w) for w in global_attention_sms_candidates(t.spec, t.batch, t.context, t.sms, best)]
    if len(pairs) > 1:
        measured = t.medians[ATTENTION_SMS.name]
        smaller = max((a for a in t.every if 0 < a < best), default=0)
        tied = [a for a in t.counts if a != best and measured[a] <= measured[best] * (1 + TUNE_TIE)]
        for a in sorted(set(tied) | ({smaller} if smaller else set()), key=t.every.index):
            pairs += [(a, w) for w in global_attention_sms_candidates(t.spec, t.batch, t.context, t.sms, a) if w]
    return pairs


def _global_words(t: Tuner, pair: tuple[int, int]) -> str:
    a, w = pair
    if not w:
        return "the same, as many splits in the layers of global attention"
    return (f"the same with {w} SMs' worth of splits in the layers of global attention"
            + (f" and {a} attention SMs" if a != t.chosen.attention_sms else ""))


def _global_record(t: Tuner, pair: tuple[int, int], med: dict[tuple[int, int], float]) -> dict[str, Any]:
    best = t.chosen_options[ATTENTION_SMS.name]
    # "W": with the count chosen first; "W@A": with A attention SMs
    return {"attention_sms": pair[0], "global_attention_sms": pair[1],
            "global_measured_us": {(f"{w}" if a == best else f"{w}@{a}"): _us(us) for (a, w), us in med.items()}}


def _up_options(t: Tuner) -> list[tuple[int, ...]] | None:
    t.tile_choice = expert_tile_candidates(t.plan(t.chosen))
    return t.tile_choice[0] if t.tile_choice else None


def _down_record(t: Tuner, down: int, med: dict[int, float]) -> dict[str, Any]:
    """The expert tiles' rows, both decisions' (the gate/up rows are recorded with the down rows)."""
    by = "mkc bench --tune --tune-tiles"
    ups = t.medians[UP_ROWS.name]
    return {"expert_up_rows": list(t.chosen.up_rows), "expert_up_by": by,
            "expert_up_measured_us": {tuning.rows_label(up) if up else "rule": _us(us) for up, us in ups.items()},
            "expert_down_rows": down, "expert_down_by": by,
            "expert_down_measured_us": {str(d): _us(us) for d, us in med.items()}}


ATTENTION_SMS = Decision(
    "the attention SMs", _count_options, lambda c, a: Candidate(a, up_rows=c.up_rows, down_rows=c.down_rows,
                                                             weights=c.weights),
    lambda t, a: f"{a} attention SMs", lambda t, a: a,
    lambda t, a, med: {"attention_sms": a, "measured_us": {str(n): _us(us) for n, us in med.items()},
                       "not_timed_simulated_us": {str(n): us for n, us in t.not_timed.items()} or None})
RAISE = Decision(
    "the splits' inputs' raise", _raise_options, _with_raise, _raise_words, lambda t, r: r,
    lambda t, r, med: {"attention_inputs_first_us": r[0], "splits_first": r[1], "inputs_first_measured_us": {
        (SPLITS_FIRST_KEY if splits else f"{us:g}"): _us(t_us) for (us, splits), t_us in med.items()}})
SPREAD = Decision(
    "the sibling spread", _spread_options, lambda c, on: dataclasses.replace(c, spread=on),
    lambda t, on: "the same with sibling tiles spread over SMs" if on else "the same, sibling tiles not spread",
    lambda t, on: on,
    lambda t, on, med: {"spread_siblings": on, "spread_measured_us": {_on_off(o): _us(us) for o, us in med.items()}})
RESIDUAL = Decision(
    "the residual in the O-projection", lambda t: [False, True],
    lambda c, on: dataclasses.replace(c, residual_in_o_proj=on),
    lambda t, on: "the same with the residual added by the O-projection" if on else "the same, residual tiles",
    lambda t, on: on,
    lambda t, on, med: {"residual_in_o_proj": on,
                        "residual_measured_us": {_on_off(o): _us(us) for o, us in med.items()}},
    # e.g. its residual terms do not fit the shared memory
    cannot_build="the residual added by the O-projection cannot be built here")
GLOBAL = Decision(
    "the global layers' splits", _global_options,
    lambda c, p: dataclasses.replace(c, attention_sms=p[0], global_attention_sms=p[1]), _global_words,
    lambda t, p: (p[1], p[0] != t.chosen.attention_sms), _global_record)  # ties: fewer splits, the count first
UP_ROWS = Decision(
    "the expert gate/up tiles", _up_options, lambda c, up: dataclasses.replace(c, up_rows=up),
    lambda t, up: ("the same, the rule's expert gate/up tiles" if not up else
                   f"the same with each slot's expert gate/up tiles of {tuning.rows_label(up)} rows"),
    lambda t, up: up != (), lambda t, up, med: {})  # recorded with the down rows
DOWN_ROWS = Decision(
    "the expert-down tiles", lambda t: t.tile_choice[1] if t.tile_choice else None,
    lambda c, down: dataclasses.replace(c, down_rows=down),
    lambda t, down: "the same, the rule's expert-down tiles" if not down else
    f"the same with expert-down tiles of {down} rows",
    lambda t, down: down != 0, _down_record)
# In the order they are made, each with the choices made before it; the expert tiles' rows only
# when asked (mkc bench --tune-tiles).
DECISIONS = (ATTENTION_SMS, RAISE, SPREAD, RESIDUAL, GLOBAL)
TILE_DECISIONS = (UP_ROWS, DOWN_ROWS)


def run_tune(spec: ModelSpec, batch: int, context: int, sms: int, page_size: int, *, time: Timer,
             log: Callable[[str], object], rounds: int = 1, reps: int, gpu: Callable[[], str], tiles: bool = False,
             every_count: bool = False, build_errors: tuple[type, ...] = (),
             weights: str = "bf16") -> Candidate:
    """Choose and record (tuning.record) the fastest schedule at this point, timing each with
    ``time``: DECISIONS in order (and TILE_DECISIONS with ``tiles``); the schedule that the entry
    now records. A sequential block has one attention-SM count (0): it is timed once, as the
    schedule the other decisions start from. Unless ``every_count``, the counts
    whose simulated probe step is more than TUNE_SIMULATED_MARGIN above the fastest count's are left
    out (the entry records their simulated steps). With ``rounds`` > 1 each decision times its
    options in turn that many times and compares medians (the entry's times are those medians).
    ``build_errors``: what ``time`` raises for a schedule that cannot be built (a decision that
    allows it keeps its first option). ``reps`` and the name ``gpu`` gives are recorded beside the choices.
    ``weights``: the weight format every schedule is lowered with; its entries are its own
    (tuning.tuning_key).

    Where the point had an entry measured here, its schedule and the tune's choice are then timed
    side by side (keep_the_faster), and the entry stays unless the tune's choice is faster. Where
    that entry has expert tile rows another tool measured, they stay (unless ``tiles``), and every
    schedule is timed with them, so that the entry records a schedule that ran (a re-tune timed
    with the rule's rows and recorded beside another tool's ran 2.9% slower than its old entry)."""
    t = Tuner(spec, batch, context, sms, page_size, time=time, log=log, rounds=rounds, reps=reps, gpu=gpu,
              build_errors=build_errors, weights=weights)
    t.every = t.counts = attention_sms_candidates(spec, batch, sms)
    if len(t.every) > 1 and not every_count:
        _, simulated = planner.choose_attention_sms(spec, batch, context, sms, page_size=page_size,
                                                    **weights_choice(weights))
        fastest = min(simulated.values())
        t.not_timed = {a: us for a, us in simulated.items() if us > fastest * (1 + TUNE_SIMULATED_MARGIN)}
        for a, us in t.not_timed.items():
            t.say(f"{a} attention SMs not timed: its simulated probe step, {us:.1f} µs, is {us / fastest - 1:.0%} "
                  f"above the fastest count's ({fastest:.1f} µs; more than {TUNE_SIMULATED_MARGIN:.0%})")
        t.counts = [a for a in t.every if a not in t.not_timed]
    before = tuning.lookup(t.key)  # measured at this point before this tune
    incumbent, rows, kept = _incumbent(t, tuning.TuningEntry.from_json(before) if before else None)
    if kept is not None:  # recorded as they were (until the tune times the rows itself)
        t.entry = kept
        if not tiles:  # and every schedule is timed with them
            t.chosen = dataclasses.replace(t.chosen, up_rows=rows[0], down_rows=rows[1])
    for decision in DECISIONS + (TILE_DECISIONS if tiles else ()):
        t.run(decision)
    path = t.write(None)
    if incumbent is not None and incumbent != t.chosen:
        kept = keep_the_faster(t, incumbent, t.chosen, max(rounds, 2))
        if kept:
            path = tuning.record(t.key, {**before, "kept_over_retune": kept})
            t.say(f"the entry measured before this tune stays: side by side, in turn, {kept['entry_us']:.1f} µs "
                  f"against {kept['retuned_us']:.1f} µs for the tune's choice (medians of {kept['runs']} runs each); "
                  f"recorded in {path}")
            return incumbent
    t.say(f"fastest with {t.chosen.describe()}; recorded in {path}")
    return t.chosen


def _incumbent(t: Tuner, before: tuning.TuningEntry | None) -> tuple[Candidate | None, tuple[tuple[int, ...], int],
                                                                       tuning.TuningEntry | None]:
    """The schedule of the entry measured at this point before this tune, as the planner applies it
    (None: no entry, or one moved from another context); the expert tile rows the planner applies
    there; and the entry's expert tile rows that another tool measured, as an entry of them alone
    (None where it has none)."""
    if before is None:
        return None, ((), 0), None
    a, c, how = plan_choices(t.spec, t.batch, t.context, t.sms, t.page_size, **weights_choice(t.weights))
    here = how.get("chosen_by") == "measured" and "measured_at_context" not in how
    rows = (tuple(how.get(EXPERT_UP_ROWS, ())), int(how.get(EXPERT_DOWN_ROWS, 0)))
    incumbent = Candidate(a, c.attention_inputs_first_us, c.splits_first, c.spread_siblings,
                          bool(how.get(RESIDUAL_IN_O_PROJ)), int(how.get(GLOBAL_ATTENTION_SMS, 0)),
                          *rows, t.weights) if here else None
    kept = {f: v for f in ("expert_up_rows", "expert_up_measured_us", "expert_up_by", "expert_down_rows",
                           "expert_down_measured_us", "expert_down_by") if (v := getattr(before, f)) is not None}
    return incumbent, rows, tuning.TuningEntry(**kept) if kept else None


def keep_the_faster(t: Tuner, before: Candidate, chosen: Candidate, turns: int) -> dict[str, Any] | None:
    """Time the entry's schedule ``before`` and the tune's ``chosen`` in turn, ``turns`` times each;
    None where the tune's is faster (by the medians of these runs alone: the tune's earlier run was
    the fastest of its options, so it is biased low), else what the entry records of it. Re-tunes of
    one round had chosen schedules that ran 2.9% (batch 8 at 8K) and 0.8% (batch 4 at 128K) slower
    than the entries they replaced."""
    fresh: dict[Candidate, list[float]] = {before: [], chosen: []}
    what = {before: "the entry measured before this tune", chosen: "the tune's choice"}
    try:
        for c in in_turn([before, chosen], turns):
            t.time_once(c, what[c] + ", side by side")
            fresh[c].append(t.times[c][-1])
    except t.build_errors as e:  # the old entry no longer builds: the tune's stays
        t.say(f"the entry measured before this tune cannot be built: {e}")
        return None
    entry_us, retuned_us = statistics.median(fresh[before]), statistics.median(fresh[chosen])
    if retuned_us < entry_us:
        return None
    # the GPU these runs were on: a shipped entry may have been measured on another card (the key
    # names none), and the side by side holds for this one
    return {"date": _now(), "gpu": t.gpu(), "entry_us": _us(entry_us), "retuned_us": _us(retuned_us), "runs": turns,
            "retuned": chosen.describe()}


def expert_tile_candidates(sc: Schedule) -> tuple[list[tuple[int, ...]], list[int]] | None:
    """The expert tiles' rows mkc bench --tune --tune-tiles times at a point, from the schedule ``sc``
    planned with the rule's tiles: each slot's gate/up rows in the rule's count of equal tiles (``()``,
    first), in half as many, 1.5 and 2 times as many (equal tiles of a multiple of 16 rows only); and
    the expert-down tiles' rows: the rule's (0, first), half, a quarter and twice them (multiples of
    16, at most the hidden size). None where the schedule has no expert gate/up and down tiles (a
    dense model, fused expert tiles). North Mini Code ran faster with 1.5 times as many gate/up tiles
    at batch 4 and a quarter of the down rows at 8."""
    up = [t for t in sc.tasks if t.op.name == "EXPERT_SWIGLU"]
    down = [t for t in sc.tasks if t.op.name == "EXPERT_DOWN"]
    if not up or not down:
        return None
    first = min((t.layer, int(t.arg("slot"))) for t in up)
    rule_up = [int(t.arg("rows")) for t in up if (t.layer, int(t.arg("slot"))) == first]
    inter, n = sum(rule_up), len(rule_up)
    ups: list[tuple[int, ...]] = [()]
    for count in (n // 2, n * 3 // 2, n * 2):
        if count >= 1 and count != n and inter % count == 0 and (inter // count) % 16 == 0:
            ups.append((inter // count,) * count)
    hidden = max(int(t.arg("row0")) + int(t.arg("rows")) for t in down)
    rule_down = max(int(t.arg("rows")) for t in down)
    downs = [0] + [r for r in (rule_down // 2, rule_down // 4, rule_down * 2)
                   if r >= 16 and r % 16 == 0 and r <= hidden and r != rule_down]
    return list(dict.fromkeys(ups)), list(dict.fromkeys(downs))
