"""Artifacts a person can open, written beside ``schedule.json``: a summary, ``report.md``, a
Perfetto trace, a self-contained HTML page and ``manifest.json``.

Everything here reads the schedule and its ``predicted`` timeline; nothing changes them. Times are
the cost model's (cost.py), so they are predictions, never measurements.

Ops: a task's *op* is the tensor-level op of the op graph it was tiled from, taken from its name
(``L3.o_proj[kv1][0:256]`` → ``o_proj``), because one opcode (LINEAR) serves qkv, o_proj, router,
down. The opcode is kept beside it. Layers are ``embed`` (layer -1), ``L0`` … and ``head``.

Contract: every writer creates its file atomically (temp file + ``os.replace``) and may raise
``OSError``; a schedule without ``predicted`` raises ``KeyError`` naming the missing entry.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import importlib.resources
import itertools
import json
import os
import platform
import re
import tempfile
from collections import defaultdict
from datetime import UTC, datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import networkx as nx
import numpy as np
from jinja2.utils import htmlsafe_json_dumps
from markupsafe import Markup

import mkc
from mkc.ir.graph import Task, conflicts
from mkc.ir.ops import OP_INFO
from mkc.ir.spec import ModelSpec
from mkc.schedule.cost import H200, Ceilings, expected_weight_bytes, task_time
from mkc.schedule.plan import LOWERING_CHOICES
from mkc.schedule.profile import Chain, critical_chain
from mkc.schedule.schedule import Schedule

HTML_TEMPLATE = "schedule.html.j2"
# Tableau-20-like palette: distinct hues first, then their light variants
PALETTE = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7",
           "#9c755f", "#bab0ac", "#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#8c564b", "#17becf",
           "#bcbd22", "#7f7f7f", "#aec7e8", "#ffbb78")
_OP_RE = re.compile(r"^(?:L\d+\.)?([A-Za-z_][A-Za-z0-9_]*)")


# -- per-task views ------------------------------------------------------------------------------
def op_label(t: Task) -> str:
    """The op-graph op a task belongs to (its name without layer prefix and tile suffix)."""
    m = _OP_RE.match(t.name)
    return m.group(1) if m else t.op.name.lower()


def tile_label(t: Task) -> str:
    """The tile part of a task's name (``[slot3][0:256]``), or "" for a whole-op task."""
    i = t.name.find("[")
    return t.name[i:] if i >= 0 else ""


def layer_label(layer: int, num_layers: int) -> str:
    return "embed" if layer < 0 else ("head" if layer >= num_layers else f"L{layer}")


def _num_layers(sc: Schedule) -> int:
    return max((t.layer for t in sc.tasks), default=0)  # the head's layer index


def _ceilings(sc: Schedule) -> Ceilings:
    """The ceilings the schedule was predicted with (recorded by the scheduler), else H200's."""
    c = sc.predicted.get("ceilings", {})
    return dataclasses.replace(H200, read_bw=float(c.get("read_bw", H200.read_bw)),
                               task_overhead=float(c.get("task_overhead_s", H200.task_overhead)))


def _task_us(sc: Schedule) -> list[float]:
    """Predicted run time of each task (µs), the same numbers ``sm_busy_us`` sums: in the simulated
    step (simulate.predict) its end less its start; in the list scheduler's estimate alone, the
    cost model's time at a 1/num_sms share of the read bandwidth (whose start and end may hold a
    wait too)."""
    p = sc.predicted
    if "timeline" in p:
        return [e - s for s, e in zip(p["start_us"], p["end_us"])]
    c = _ceilings(sc)
    return [task_time(t, sc.num_sms, c) * 1e6 for t in sc.tasks]


def chain(sc: Schedule) -> Chain:
    """The critical chain of the predicted step (profile.critical_chain): from the task that ends
    last back to the first, each task's blocker being whichever ended last of its producers and
    the task before it on its SM. Its run times and hand-offs add up to the step without the
    launch, so it is the path that sets the predicted step."""
    return critical_chain(sc, sc.predicted["start_us"], sc.predicted["end_us"])


def _op_labels(sc: Schedule) -> list[str]:
    """``op_label`` of every task, by task id (each writer computes it once and passes it on)."""
    return [op_label(t) for t in sc.tasks]


def _ops_in_order(labels: list[str]) -> list[str]:
    """Op labels in order of first appearance in program order (stable colours and rows)."""
    return list(dict.fromkeys(labels))


def _layers_in_order(sc: Schedule) -> list[int]:
    return sorted({t.layer for t in sc.tasks})


def _color(i: int) -> str:
    if i < len(PALETTE):
        return PALETTE[i]
    return f"hsl({(i * 137) % 360}, 55%, 55%)"


def _stats(xs: list[float]) -> dict[str, float]:
    return {"min": min(xs, default=0), "mean": sum(xs) / len(xs) if xs else 0.0, "max": max(xs, default=0)}


# -- summary -------------------------------------------------------------------------------------
def summary(sc: Schedule, spec: ModelSpec) -> dict[str, Any]:
    """The headline numbers of a schedule.

    ``bytes`` is what the tasks as lowered move on average: their activations and weights, a
    routing slot's expert tiles' weights at their expected bytes under random routing
    (cost.expected_weight_bytes: the slots past the step's distinct experts read none), as the
    speed-of-light bytes count the distinct experts routed (docs/design.md) and the simulated step
    streams them; ``bytes_every_slot`` counts every slot live. ``sol_us`` is ``bytes`` at the read
    ceiling the schedule was predicted with, so ``sol_fraction`` is in (0, 1] for a step the list
    scheduler or the simulation predicts: no task streams faster than that bandwidth in all.
    """
    p = sc.predicted
    step_us = float(p["step_us"])
    sm = sc.sm_of()
    n_tasks = [len(q) for q in sc.queues]
    expected = expected_weight_bytes(sc.tasks, sc.buffers, sc.batch)
    sm_bytes = [0.0] * sc.num_sms
    for t, w in zip(sc.tasks, expected):
        sm_bytes[sm[t.id]] += w + t.act_bytes
    wbytes = sum(expected)
    abytes = sum(t.act_bytes for t in sc.tasks)
    every_slot = sum(t.weight_bytes for t in sc.tasks) + abytes
    on = p.get("simulated_on") or {}  # the GPU the step was simulated at (simulate.predict)
    read_bw = float(on.get("read_bw") or _ceilings(sc).read_bw)
    sol_us = (wbytes + abytes) / read_bw * 1e6
    busy = p.get("sm_busy_us") or [0.0] * sc.num_sms
    ch = chain(sc)
    return {
        "model": spec.name, "batch": sc.batch, "context": sc.context, "num_sms": sc.num_sms,
        "layers": spec.num_layers, "weights": sc.meta.get("weights", "bf16"),
        "tasks": len(sc.tasks), "counters": len(sc.counters), "waits": sum(len(w) for w in sc.waits),
        "sms_used": sum(1 for n in n_tasks if n),
        "tasks_per_sm": _stats(n_tasks), "bytes_per_sm": _stats(sm_bytes), "busy_us_per_sm": _stats(busy),
        "critical_path_tasks": len(ch.tasks),
        "critical_path_us": ch.total_run_us + ch.total_handoff_us,
        "critical_run_us": ch.total_run_us, "critical_handoff_us": ch.total_handoff_us,
        "step_us": step_us, "placement_step_us": p.get("placement_step_us"),
        "attention_sms": sc.meta.get("attention_sms"),
        "lowering": {k: sc.meta.get(k) for k in LOWERING_CHOICES},
        "bytes": wbytes + abytes, "weight_bytes": wbytes, "act_bytes": abytes, "bytes_every_slot": every_slot,
        "read_bw": read_bw, "gpu": on.get("gpu"),
        "sol_us": sol_us,
        "sol_fraction": sol_us / step_us if step_us > 0 else 0.0,
        "utilisation": sum(busy) / (sc.num_sms * step_us) if step_us > 0 else 0.0,
        "tok_s": sc.batch / step_us * 1e6 if step_us > 0 else 0.0,
        "unused_bandwidth_us": p.get("unused_bandwidth_us"),
        "bytes_by_sm": sm_bytes,
    }


def _fmt_bytes(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def _summary_rows(d: dict[str, Any], unused_all: str = "report.md lists all") -> list[tuple[str, str]]:
    """(label, value) pairs shared by the CLI block, the report and the HTML table; ``unused_all``
    says where the bandwidth left unused is listed in full."""
    tp, bp, up = d["tasks_per_sm"], d["bytes_per_sm"], d["busy_us_per_sm"]
    return [
        ("model", (f"{d['model']}  batch {d['batch']}  context {d['context']}  {d['num_sms']} SMs  "
                  f"{d['layers']} layers" + (f"  weights {d['weights']}" if d.get("weights", "bf16") != "bf16" else ""))),
        ("tasks", f"{d['tasks']}  counters {d['counters']}  waits {d['waits']}  SMs used {d['sms_used']}"),
        ("tasks / SM", f"{tp['min']} / {tp['mean']:.1f} / {tp['max']}  (min / mean / max)"),
        ("bytes / SM", f"{_fmt_bytes(bp['min'])} / {_fmt_bytes(bp['mean'])} / {_fmt_bytes(bp['max'])}"),
        ("busy / SM", (f"{up['min']:.1f} / {up['mean']:.1f} / {up['max']:.1f} µs  "
                      f"(utilisation {d['utilisation']:.1%})")),
        *([("attention SMs", _attention_sms_row(d))] if d.get("attention_sms") else []),
        *([("global layers", _global_attention_row(d))] if d.get("lowering", {}).get("global_attention_sms") else []),
        ("layer end", _layer_end_row(d)),
        *([("expert gate/up", _expert_up_row(d))] if d.get("lowering", {}).get("expert_up_rows") else []),
        *([("expert-down", _expert_down_row(d))] if d.get("lowering", {}).get("expert_down_rows") else []),
        ("critical path", (f"{d['critical_path_tasks']} tasks, {d['critical_path_us']:.1f} µs: "
                           f"{d['critical_run_us']:.1f} running, {d['critical_handoff_us']:.1f} in hand-offs "
                           f"(the chain of tasks, each waiting for the one before, that ends the step)")),
        ("bytes read", (f"{_fmt_bytes(d['bytes'])}  (weights {_fmt_bytes(d['weight_bytes'])}, "
                       f"activations/KV {_fmt_bytes(d['act_bytes'])}"
                       + (f"; the routing slots' experts as expected under random routing, "
                          f"{_fmt_bytes(d['bytes_every_slot'])} with every slot live"
                          if d.get("bytes_every_slot", d["bytes"]) > d["bytes"] * (1 + 1e-9) else "") + ")")),
        ("speed of light", f"{d['sol_us']:.1f} µs at {d['read_bw'] / 1e12:.2f} TB/s"
                           + (f" (an {d['gpu'].upper()}'s read bandwidth)" if d.get("gpu") else "")),
        ("predicted step", (f"{d['step_us']:.1f} µs  →  {d['tok_s']:.1f} tok/s, "
                           f"{d['sol_fraction']:.1%} of SOL"
                           + (f"  (simulated under shared bandwidth; the list scheduler's placement estimate "
                              f"{d['placement_step_us']:.1f} µs)" if d.get("placement_step_us") else ""))),
        *([("bandwidth unused", _unused_row(d, unused_all))] if d.get("unused_bandwidth_us") else []),
    ]


def _unused_row(d: dict[str, Any], listed: str) -> str:
    """The simulated step's unused read bandwidth and its largest causes (simulate.py)."""
    u = d["unused_bandwidth_us"]
    total = sum(x["us"] for x in u)
    top = ", ".join(f"{_unused_label(x)} {x['us']:.1f}" for x in u[:4])
    return (f"{total:.1f} µs of the simulated step in all (SMs not streaming), largest while the SMs are in: "
            f"{top} ({listed})")


def _unused_label(x: dict[str, Any]) -> str:
    return f"{x['stage']} {x['state']}" if x["stage"] else x["state"]


def _expert_up_row(d: dict[str, Any]) -> str:
    """The rows of each slot's expert gate/up tiles where not the tiling rule's
    (LowerOptions.expert_up_rows), and who chose them (plan.py)."""
    a = d.get("attention_sms") or {}
    runs = [(size, len(list(run))) for size, run in itertools.groupby(d["lowering"]["expert_up_rows"])]
    row = "each slot's rows in " + " + ".join(f"{n} {'tiles ' if i == 0 else ''}of {size}"
                                             for i, (size, n) in enumerate(runs))
    if "expert_up_rows" in a:  # a tuning entry named them
        timed = ", ".join(f"{k}: {v:.1f}" for k, v in a.get("expert_up_rows_measured_us", {}).items())
        return row + f"; measured fastest by {a.get('expert_up_rows_by', '?')} (step µs by rows: {timed})"
    return row + ", as asked"


def _expert_down_row(d: dict[str, Any]) -> str:
    """The rows of the expert-down tiles where not the tiling rule's (LowerOptions.expert_down_rows),
    and who chose them (plan.py)."""
    a = d.get("attention_sms") or {}
    row = f"tiles of {d['lowering']['expert_down_rows']} rows"
    if "expert_down_rows" in a:  # a tuning entry named them
        timed = ", ".join(f"{k}: {v:.1f}" for k, v in a.get("expert_down_rows_measured_us", {}).items())
        return row + f"; measured fastest by {a.get('expert_down_rows_by', '?')} (step µs by rows, 0: the rule: {timed})"
    return row + ", as asked"


def _layer_end_row(d: dict[str, Any]) -> str:
    """What ends each layer (LowerOptions.residual_in_o_proj), and who chose it (plan.py): a tuning
    entry's measurement either way, else the lowering's default or the caller's choice."""
    a = d.get("attention_sms") or {}
    on = d.get("lowering", {}).get("residual_in_o_proj")
    row = ("the O-projection tiles add the residual and the MLP's output (no residual tiles)" if on
           else "residual tiles add the attention and the MLP's output")
    timed = ", ".join(f"{k}: {v:.1f}" for k, v in a.get("residual_in_o_proj_measured_us", {}).items())
    if "residual_in_o_proj" in a and timed:  # the tuning entry measured both
        by = a.get("residual_in_o_proj_by") or "mkc bench --tune"
        return row + f"; measured faster by {by} (step µs, the O-projection ending the layer off / on: {timed})"
    if "residual_in_o_proj_probe_us" in a:  # the compiler chose it (plan.py: choose_residual_in_o_proj)
        tried = ", ".join(f"{k} {v:.1f}" for k, v in a["residual_in_o_proj_probe_us"].items())
        return row + f"; chosen by a probe's step under shared bandwidth (µs: {tried})"
    return row if not on else row + ", as asked"


def _global_attention_row(d: dict[str, Any]) -> str:
    """The splits of the layers of global attention (LowerOptions.global_attention_sms), and who
    chose them (plan.py)."""
    a = d.get("attention_sms") or {}
    row = f"{d['lowering']['global_attention_sms']} SMs' worth of attention splits"
    if "global_attention_sms_probe_us" in a:  # the compiler chose it (plan.py: choose_global_attention_sms)
        tried = ", ".join(f"{k}: {v:.1f}" for k, v in a["global_attention_sms_probe_us"].items())
        return row + (f"; chosen by a probe's step under shared bandwidth (µs by SMs' worth, 0: as the other "
                      f"layers: {tried})")
    if "global_attention_sms" in a:  # the entry of mkc bench --tune chose it
        timed = ", ".join(f"{k}: {v:.1f}" for k, v in a.get("global_attention_sms_measured_us", {}).items())
        by = a.get("global_attention_sms_by") or "mkc bench --tune"
        if "measured_at_context" in a:  # measured at the nearest context, scaled (plan.py)
            return row + (f"; the count measured fastest at context {a['measured_at_context']} by {by} "
                          f"({a['global_attention_sms_measured_there']}, 0: as the other layers) scaled by "
                          f"the contexts' ratio, so that each split attends as many keys")
        return row + (f"; measured fastest by {by} (step µs by SMs' worth, 0: as the other layers, W@A: with A "
                      f"attention SMs: {timed})")
    return row + ", as asked"


def _as_list(v: Any) -> Any:
    """A lowering value as JSON holds it (an entry's lists are a compile's tuples)."""
    return list(v) if isinstance(v, (list, tuple)) else v


def _attention_sms_row(d: dict[str, Any]) -> str:
    """How the parallel block's branches share the SMs, and why (mkc/schedule/plan.py)."""
    a = d["attention_sms"]
    n = a["chosen"]
    head = (f"{n} for the attention splits, {d['num_sms'] - n} for the MLP tiles" if n
            else "none set apart (every op fills all SMs)")
    if a["chosen_by"] == "measured":
        timed = ", ".join(f"{k}: {v:.1f}" for k, v in sorted(a["measured_us"].items(), key=lambda kv: int(kv[0])))
        there = (f" at context {a['measured_at_context']}, the nearest measured for this batch, whose "
                 f"choices this compile takes" if "measured_at_context" in a else "")
        by = f"{a.get('measured_by') or 'mkc bench --tune'} on {a['measured_on']}, {a['measured_at']}{there}"
        row = (f"{head}; measured fastest by {by} (step µs by attention SMs: {timed})" if len(a["measured_us"]) > 1
               else f"{head}, the only count (a sequential block); timed by {by} (step µs: {timed})")
        if a.get("not_timed_simulated_us"):
            left = ", ".join(f"{k}: {v:.1f}" for k, v in sorted(a["not_timed_simulated_us"].items(),
                                                                key=lambda kv: int(kv[0])))
            row += f"; not timed, their probe's simulated step far slower (µs by attention SMs: {left})"
        if a.get("kept_over_retune"):
            k = a["kept_over_retune"]
            on = f" ({k['gpu']})" if k.get("gpu") else ""
            row += (f"; kept over a re-tune on {k.get('date', '?')}{on}: side by side {k.get('entry_us', '?')} µs "
                    f"against {k.get('retuned_us', '?')} for its choice ({k.get('retuned', '?')})")
        fastest = min(a["measured_us"], key=a["measured_us"].get, default=None)
        if "global_attention_sms" in a and fastest is not None and fastest != str(n):
            row += (f", then with the layers of global attention on {fastest}'s splits or more, {n} measured faster "
                    f"(global layers, below)")
        # what the counts were timed with, where this compile differs; the choices the entry made
        # itself (the layer's end, the global layers' splits, the expert tiles' rows) were timed
        # after the count, with it (they are named below)
        decided = {k for k in ("residual_in_o_proj", "global_attention_sms", "expert_up_rows", "expert_down_rows")
                   if k in a}
        now = d.get("lowering", {})
        differ = {k: v for k, v in (a.get("measured_lowering") or {}).items()
                  if k not in decided and _as_list(v) != _as_list(now.get(k))}
        if differ:
            was = ", ".join(f"{k}={v}" for k, v in differ.items())
            row += f"; measured under {was} (this compile: {', '.join(f'{k}={now.get(k)}' for k in differ)})"
        if a.get("attention_inputs_first_us"):  # the tuned raise of the splits' inputs (plan.py)
            timed = ", ".join(f"{k}: {v:.1f}" for k, v in a.get("attention_inputs_first_us_measured_us", {}).items())
            what = "the splits and their inputs" if a.get("splits_first") else "the splits' inputs"
            row += (f"; {what} ranked {a['attention_inputs_first_us']:g} µs ahead, measured faster "
                    f"(step µs by raise: {timed})")
        if a.get("spread_siblings"):  # the tuned spread of a layer's sibling tiles (plan.py)
            timed = ", ".join(f"{k}: {v:.1f}" for k, v in a.get("spread_siblings_measured_us", {}).items())
            row += f"; sibling tiles spread over SMs, measured faster (step µs: {timed})"
        return row
    if a["chosen_by"] == "compiler":
        tried = ", ".join(f"{k}: {v:.1f}" for k, v in a["probe_predicted_us"].items())
        return (f"{head}; chosen by a probe's step under shared bandwidth (the model's first layers, "
                f"simulated: µs by attention SMs: {tried})")
    if a["chosen_by"] != "asked":
        return f"{head} (the only candidate)"
    if "entry_not_applied" in a:  # plan.py: an asked count takes none of a tuning entry's choices
        return (f"{head}, as asked; the tuning entry at this point ({a['entry_not_applied']} attention SMs, "
                f"measured) and its other choices not applied")
    return f"{head}, as asked"


def format_summary(d: dict[str, Any]) -> str:
    """A short block for the CLI, one ``label: value`` line per number group."""
    rows = _summary_rows(d)
    w = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{w}}  {v}" for k, v in rows)


# -- aggregation ---------------------------------------------------------------------------------
@dataclasses.dataclass(slots=True)
class _Agg:
    tasks: int = 0
    bytes: int = 0
    us: float = 0.0  # sum of predicted task times (SM-µs)
    first_us: float = float("inf")  # earliest predicted start
    last_us: float = 0.0  # latest predicted end

    def add(self, t: Task, us: float, start: float, end: float) -> None:
        self.tasks += 1
        self.bytes += t.weight_bytes + t.act_bytes
        self.us += us
        self.first_us = min(self.first_us, start)
        self.last_us = max(self.last_us, end)


def _aggregate(sc: Schedule, keys: list[Any], cost: list[float]) -> dict[Any, _Agg]:
    """Tasks grouped by keys[task id], in order of first appearance; cost is ``_task_us``."""
    start, end = sc.predicted["start_us"], sc.predicted["end_us"]
    out: dict[Any, _Agg] = defaultdict(_Agg)
    for t, k, us, s, e in zip(sc.tasks, keys, cost, start, end):
        out[k].add(t, us, s, e)
    return out


# -- report.md -----------------------------------------------------------------------------------
def _table(header: list[str], rows: list[list[Any]], align: str) -> list[str]:
    """A markdown table; align holds one of 'l'/'r' per column."""
    sep = ["---:" if a == "r" else "---" for a in align]
    return ["| " + " | ".join(header) + " |", "| " + " | ".join(sep) + " |",
            *("| " + " | ".join(str(c) for c in r) + " |" for r in rows)]


def _layer_kind(spec: ModelSpec, layer: int) -> str:
    if layer < 0:
        return "embedding"
    if layer >= spec.num_layers:
        return "final norm, LM head, argmax"
    ls = spec.layers[layer]
    return f"{ls.attention} attn{' + rope' if ls.rope else ''}, {ls.mlp}"


def _timeline_note(sc: Schedule) -> str:
    """Where the report's times come from."""
    if "timeline" in sc.predicted:
        return ("Predicted: the schedule's step simulated under shared read bandwidth "
                "(mkc/schedule/simulate.py) with the cost model's per-task constants (mkc/schedule/cost.py); "
                "no measurement.")
    return ("Predicted by the list scheduler's estimate (mkc/schedule/scheduler.py: each task streams a "
            "1/num_sms share of the read bandwidth); no measurement.")


def write_report(sc: Schedule, spec: ModelSpec, path: str | Path) -> Path:
    """report.md: summary, per-op and per-layer tables, the critical path and per-SM load. Every
    time in it comes from the one predicted timeline, so its numbers add up: the per-op SM-µs
    total is the summary's busy / SM, the per-layer chain µs add up to the critical path."""
    d = summary(sc, spec)
    share = sc.num_sms * d["step_us"] if d["step_us"] > 0 else 1.0  # SM-µs in the step
    lines = [f"# Schedule report: {spec.name}, batch {sc.batch}, context {sc.context}, {sc.num_sms} SMs", "",
             _timeline_note(sc), "", "## Summary", ""]
    lines += _table(["", "value"], [[k, v] for k, v in _summary_rows(d, "by stage below")], "ll")
    labels, cost = _op_labels(sc), _task_us(sc)
    lines += _per_op(sc, d, labels, cost, share)
    ch = chain(sc)
    lines += _per_layer(sc, spec, cost, ch, share)
    lines += _critical_path(sc, d, ch, labels, cost)
    lines += _unused_bandwidth(d)
    lines += _per_sm(sc, d)
    return _write_text(path, "\n".join(lines) + "\n")


def _per_op(sc: Schedule, d: dict[str, Any], labels: list[str], cost: list[float], share: float) -> list[str]:
    """report.md's per-op section: each op's tasks, bytes and SM-µs, the largest first, and a total."""
    step, nsm = d["step_us"], sc.num_sms
    lines = ["", "## Per op", "",
             ("SM-µs is the sum of the op's task run times in the predicted step; *% of step* is SM-µs over "
              f"{nsm} SMs × {step:.1f} µs, so the total is the share of SM-time spent running tasks, the "
              f"summary's utilisation ({d['utilisation']:.1%}). An SM runs a task while it streams and in "
              "its fixed time, so this is not the speed-of-light fraction "
              f"({d['sol_fraction']:.1%}: the step's bytes at the full read bandwidth, over the step). "
              "*Span* runs from the op's first task start to its last task end."), ""]
    by_op = _aggregate(sc, labels, cost)
    opcode = {op: t.op.name for op, t in zip(reversed(labels), reversed(sc.tasks))}
    rows = [[op, opcode[op], a.tasks, _fmt_bytes(a.bytes), f"{a.us:.1f}", f"{a.us / share:.1%}",
             f"{a.first_us:.1f} – {a.last_us:.1f}"] for op, a in by_op.items()]
    rows.sort(key=lambda r: -float(r[4]))
    tot = _Agg()
    for a in by_op.values():
        tot.tasks, tot.bytes, tot.us = tot.tasks + a.tasks, tot.bytes + a.bytes, tot.us + a.us
    rows.append(["**total**", "", tot.tasks, _fmt_bytes(tot.bytes), f"{tot.us:.1f}", f"{tot.us / share:.1%}",
                 ""])
    return lines + _table(["op", "opcode", "tasks", "bytes", "SM-µs", "% of step", "span µs"], rows,
                          "llrrrrl")


def _critical_path(sc: Schedule, d: dict[str, Any], ch: Chain, labels: list[str],
                   cost: list[float]) -> list[str]:
    """report.md's critical-path section: the chain that ends the step, task by task, with the
    hand-off before each."""
    step, L = d["step_us"], _num_layers(sc)
    start, end = sc.predicted["start_us"], sc.predicted["end_us"]
    sm = sc.sm_of()
    launch = step - d["critical_path_us"]
    lines = ["", "## Critical path", "",
             (f"The chain of tasks that ends the step: from the task that ends last, back through whichever "
              f"of its producers and the task before it on its SM ended last. {len(ch.tasks)} tasks, "
              f"{d['critical_path_us']:.1f} µs of the {step:.1f} µs step: {ch.total_run_us:.1f} running, "
              f"{ch.total_handoff_us:.1f} in hand-offs (a blocker's end to the next task's start)"
              + (f", {launch:.1f} the launch" if launch > 0.05 else "") + "."), ""]
    if "critical_path_us" in sc.predicted and "timeline" in sc.predicted:
        lines += [(f"The list scheduler placed the tasks by the DAG's longest path at each task's cost-model "
                   f"time, {float(sc.predicted['critical_path_us']):.1f} µs: a priority, not a time, since "
                   f"it gives every task a 1/{sc.num_sms} share of the read bandwidth, where in the step a "
                   f"task gets more whenever fewer SMs stream."), ""]
    prev_end = None
    rows = []
    for i, t in enumerate(ch.tasks):
        wait = f"{start[t] - prev_end:.2f}" if prev_end is not None else "–"
        rows.append([i, labels[t], layer_label(sc.tasks[t].layer, L), tile_label(sc.tasks[t]) or "–", sm[t],
                     f"{start[t]:.1f}", wait, f"{cost[t]:.2f}"])
        prev_end = end[t]
    return lines + _table(["#", "op", "layer", "tile", "SM", "start µs", "hand-off µs", "run µs"], rows,
                          "rlllrrrr")


def _unused_bandwidth(d: dict[str, Any]) -> list[str]:
    """report.md's section on the read bandwidth the simulated step leaves unused, by stage and
    what its SMs do instead; none without a simulated timeline."""
    if not d.get("unused_bandwidth_us"):
        return []
    u, step = d["unused_bandwidth_us"], d["step_us"]
    lines = ["", "## Bandwidth left unused", "",
             ("The simulated step (mkc/schedule/simulate.py) streams its bytes at most at the read "
              f"bandwidth, {d['read_bw'] / 1e12:.2f} TB/s. Where it streams less, the shortfall, in µs of "
              "the whole bandwidth, is split evenly between the SMs not streaming at that moment, by the "
              "stage of their task and what it is doing: its fixed time (dispatch, staging, routing, "
              "reductions) or waiting for its inputs. Together with the bytes at that bandwidth, "
              f"{d['sol_us']:.1f} µs, and the launch, it makes the step."), ""]
    rows = [[x["stage"] or "–", x["state"], f"{x['us']:.1f}", f"{x['us'] / step:.1%}" if step > 0 else "–"]
            for x in u]
    rows.append(["**total**", "", f"{sum(x['us'] for x in u):.1f}",
                 f"{sum(x['us'] for x in u) / step:.1%}" if step > 0 else "–"])
    return lines + _table(["stage", "SMs", "µs", "% of step"], rows, "llrr")


def _per_sm(sc: Schedule, d: dict[str, Any]) -> list[str]:
    """report.md's per-SM section: each SM's tasks, bytes, busy time and idle share of the step."""
    step = d["step_us"]
    busy = sc.predicted.get("sm_busy_us") or [0.0] * sc.num_sms
    sm_bytes = d["bytes_by_sm"]
    lines = ["", "## Per-SM load", "",
             (f"tasks {d['tasks_per_sm']['min']} / {d['tasks_per_sm']['mean']:.1f} / "
              f"{d['tasks_per_sm']['max']}, busy {d['busy_us_per_sm']['min']:.1f} / "
              f"{d['busy_us_per_sm']['mean']:.1f} / {d['busy_us_per_sm']['max']:.1f} µs (min / mean / max); "
              "idle is the part of the step an SM runs no task."), ""]
    rows = [[i, len(q), _fmt_bytes(sm_bytes[i]), f"{busy[i]:.1f}",
             f"{max(0.0, 1 - busy[i] / step) if step > 0 else 0.0:.1%}"] for i, q in enumerate(sc.queues)]
    return lines + _table(["SM", "tasks", "bytes", "busy µs", "idle"], rows, "rrrrr")


def layer_chain_us(sc: Schedule, ch: Chain) -> dict[int, float]:
    """µs of the critical chain in each layer: its tasks' run times there, each with the hand-off
    before it. They add up to the chain, from its first task's start to its last task's end."""
    start, end = sc.predicted["start_us"], sc.predicted["end_us"]
    out: dict[int, float] = defaultdict(float)
    prev = None
    for t in ch.tasks:
        out[sc.tasks[t].layer] += end[t] - (end[prev] if prev is not None else start[t])
        prev = t
    return dict(out)


def _per_layer(sc: Schedule, spec: ModelSpec, cost: list[float], ch: Chain, share: float) -> list[str]:
    """report.md's per-layer section: what each layer costs and how long it holds the step."""
    L = _num_layers(sc)
    step = float(sc.predicted["step_us"])
    by_layer = _aggregate(sc, [t.layer for t in sc.tasks], cost)
    layers = sorted(by_layer)
    on_chain = layer_chain_us(sc, ch)
    lines = ["", "## Per layer", "",
             ("*Starts* is the layer's first task start; *to next* the time from it to the next layer's "
              "first start (the last row: to the step's end), how long the layer holds the stream; *chain "
              "µs* the critical path's time in the layer (its tasks' run times and the hand-offs before "
              "them), which adds up to the critical path. A layer's last tasks can end much later than "
              "the next layer starts: its KV-cache appends, which nothing in the step waits for, run "
              "where SMs are free."), ""]
    rows = []
    for i, ly in enumerate(layers):
        a = by_layer[ly]
        nxt = by_layer[layers[i + 1]].first_us if i + 1 < len(layers) else step
        rows.append([layer_label(ly, L), _layer_kind(spec, ly), a.tasks, _fmt_bytes(a.bytes), f"{a.us:.1f}",
                     f"{a.us / share:.1%}", f"{a.first_us:.1f}", f"{nxt - a.first_us:.1f}",
                     f"{on_chain.get(ly, 0.0):.1f}"])
    return lines + _table(["layer", "kind", "tasks", "bytes", "SM-µs", "% of step", "starts µs", "to next µs",
                           "chain µs"], rows, "llrrrrrrr")


# -- trace.json ----------------------------------------------------------------------------------
def _latest_producer(sc: Schedule) -> list[int]:
    end = sc.predicted["end_us"]
    return [max(c.producers, key=lambda p: end[p]) if c.producers else -1 for c in sc.counters]


def trace_events(sc: Schedule) -> list[dict[str, Any]]:
    """Chrome trace events: one thread per SM, one slice per task, one flow arrow per
    (counter, waiting task) from the counter's latest-finishing producer."""
    p = sc.predicted
    start, end = p["start_us"], p["end_us"]
    sm = sc.sm_of()
    labels = _op_labels(sc)
    meta: list[dict[str, Any]] = [
        {"ph": "M", "pid": 0, "tid": 0, "name": "process_name", "args": {"name": "predicted step"}}]
    for i, q in enumerate(sc.queues):
        if q:
            meta.append({"ph": "M", "pid": 0, "tid": i, "name": "thread_name", "args": {"name": f"SM {i}"}})
            meta.append({"ph": "M", "pid": 0, "tid": i, "name": "thread_sort_index", "args": {"sort_index": i}})
    ev: list[dict[str, Any]] = []
    for t in sc.tasks:
        i = t.id
        args = {"id": i, "layer": t.layer, "op": labels[i], "opcode": t.op.name,
                **dict(zip(OP_INFO[t.op].args, t.args)),
                "weight_bytes": t.weight_bytes, "act_bytes": t.act_bytes,
                "waits": list(sc.waits[i]), "signal": sc.signals[i]}  # (counter, target) pairs
        ev.append({"ph": "X", "pid": 0, "tid": sm[i], "ts": start[i], "dur": round(end[i] - start[i], 3),
                   "name": t.name, "cat": labels[i], "args": args})
    latest = _latest_producer(sc)
    eps = 0.001  # 1 ns: keeps a flow end inside its slice after rounding
    fid = 0
    for i, ws in enumerate(sc.waits):
        for cid, _ in ws:
            src = latest[cid]
            if src < 0:
                continue
            # The arrow leaves the producer just before it ends and enters the waiter where its
            # wait is satisfied. A waiter may start before its producer ends (prefetch before
            # wait), so "f" is clamped to at least "s": importers pair flows in time order.
            s_ts = round(max(start[src], end[src] - eps), 3)
            f_ts = round(min(max(start[i] + eps, s_ts), max(start[i], end[i] - eps)), 3)
            ev.append({"ph": "s", "pid": 0, "tid": sm[src], "ts": s_ts, "id": fid, "cat": "counter",
                       "name": f"c{cid}"})
            ev.append({"ph": "f", "bp": "e", "pid": 0, "tid": sm[i], "ts": f_ts, "id": fid, "cat": "counter",
                       "name": f"c{cid}"})
            fid += 1
    order = {"X": 0, "s": 1, "f": 2}  # at equal ts: the slice first, then flow starts, then ends
    ev.sort(key=lambda e: (e["ts"], order[e["ph"]]))
    return meta + ev


def write_trace(sc: Schedule, path: str | Path) -> Path:
    """trace.json for Perfetto / chrome://tracing (ts and dur in µs)."""
    doc = {"traceEvents": trace_events(sc), "displayTimeUnit": "ns",
           "otherData": {"model": sc.model, "batch": sc.batch, "context": sc.context, "num_sms": sc.num_sms,
                         "step_us": sc.predicted["step_us"],
                         **({"simulated_on": sc.predicted["simulated_on"]} if "simulated_on" in sc.predicted else {}),
                         "source": ("mkc shared-bandwidth simulation (predicted)" if "timeline" in sc.predicted
                                    else "mkc cost model (predicted)")}}
    return _write_text(path, json.dumps(doc, separators=(",", ":")))


# -- op-level DAG --------------------------------------------------------------------------------
def op_edges(sc: Schedule, labels: list[str] | None = None) -> dict[tuple[tuple[int, str], tuple[int, str]], int]:
    """Op-level edges (layer, op) → (layer, op), each with the number of waits behind it. An edge
    joins two ops whenever a task of one must precede a task of the other: their regions overlap
    with at least one write (mkc/ir/graph.py: conflicts, as the scheduler derives the task DAG).
    Its waits count, per counter a task of the second op waits on, the first op among the
    counter's producers; an edge with none is ordered by queue order on one SM or through other
    waits (the scheduler leaves out a wait that another already implies). labels is
    ``_op_labels(sc)`` if the caller has it."""
    labels = _op_labels(sc) if labels is None else labels
    keys = list(dict.fromkeys((t.layer, labels[t.id]) for t in sc.tasks))
    index = {k: i for i, k in enumerate(keys)}
    key = np.array([index[(t.layer, labels[t.id])] for t in sc.tasks], dtype=np.int64)
    edges: dict[tuple[tuple[int, str], tuple[int, str]], int] = {}
    c = conflicts(sc.tasks, sc.buffers)
    ka, kb = key[c.a], key[c.b]
    for pair in np.unique(ka[ka != kb] * len(keys) + kb[ka != kb]).tolist():
        edges[(keys[pair // len(keys)], keys[pair % len(keys)])] = 0
    prod_ops: list[set[tuple[int, str]]] = [
        {(sc.tasks[p].layer, labels[p]) for p in c.producers} for c in sc.counters]
    for t in sc.tasks:
        dst = (t.layer, labels[t.id])
        for cid, _ in sc.waits[t.id]:
            for src in prod_ops[cid]:
                if src != dst:
                    edges[(src, dst)] = edges.get((src, dst), 0) + 1
    return edges


def _layer_dags(sc: Schedule, labels: list[str], cost: list[float], ops: list[str],
                crit_ops: set[tuple[int, str]]) -> dict[str, Any]:
    """Per layer: nodes [label, column, row, tasks, SM-µs, critical, ghost, op index] and edges
    [src, dst, waits], laid out by topological generations (columns) with one barycentre pass
    (rows). Ghost nodes are ops of other layers feeding or fed by this one."""
    L = _num_layers(sc)
    agg = _aggregate(sc, [(t.layer, op) for t, op in zip(sc.tasks, labels)], cost)
    op_idx = {o: i for i, o in enumerate(ops)}
    per_layer: dict[int, list[tuple[tuple[int, str], tuple[int, str], int]]] = defaultdict(list)
    for (a, b), n in op_edges(sc, labels).items():
        per_layer[a[0]].append((a, b, n))
        if b[0] != a[0]:
            per_layer[b[0]].append((a, b, n))
    out: dict[str, Any] = {}
    for layer in _layers_in_order(sc):
        g = nx.DiGraph()
        g.add_nodes_from(k for k in agg if k[0] == layer)
        for a, b, n in per_layer.get(layer, []):
            g.add_edge(a, b, n=n)
        gens = _generations(g)
        col = {k: c for c, gen in enumerate(gens) for k in gen}
        row: dict[tuple[int, str], float] = {}
        for gen in gens:
            keyed = []
            for k in gen:
                preds = [row[p] for p in g.predecessors(k) if p in row]
                keyed.append((sum(preds) / len(preds) if preds else -1.0, _first_start(agg, k), k))
            for r, (_, _, k) in enumerate(sorted(keyed, key=lambda x: (x[0], x[1]))):
                row[k] = r
        index = {k: i for i, k in enumerate(g.nodes)}
        nodes = []
        for k in g.nodes:
            ghost = k[0] != layer
            a = agg[k]
            where = layer_label(k[0], L)
            label = k[1] if not ghost or where == k[1] else f"{where}.{k[1]}"
            nodes.append([label, col[k], int(row[k]), a.tasks, round(a.us, 1), k in crit_ops, ghost,
                          op_idx.get(k[1], 0)])
        edges = [[index[a], index[b], d["n"]] for a, b, d in g.edges(data=True)]
        out[layer_label(layer, L)] = {"nodes": nodes, "edges": edges}
    return out


def _first_start(agg: dict[Any, _Agg], k: Any) -> float:
    return agg[k].first_us if k in agg else 0.0


def _generations(g: nx.DiGraph) -> list[list[Any]]:
    try:
        return [list(gen) for gen in nx.topological_generations(g)]
    except nx.NetworkXUnfeasible:  # an op-level cycle (tiles of two ops feeding each other): flatten it
        cond = nx.condensation(g)
        return [[k for c in gen for k in cond.nodes[c]["members"]] for gen in nx.topological_generations(cond)]


# -- schedule.html -------------------------------------------------------------------------------
@lru_cache(maxsize=1)
def _environment() -> jinja2.Environment:
    return jinja2.Environment(undefined=jinja2.StrictUndefined, autoescape=True, keep_trailing_newline=True)


def _template_text(name: str) -> str:
    """The template from package ``mkc.templates`` (installed), else from the repo's templates/."""
    try:
        return importlib.resources.files("mkc.templates").joinpath(name).read_text(encoding="utf-8")
    except (ModuleNotFoundError, FileNotFoundError):
        return (Path(__file__).parents[2] / "templates" / name).read_text(encoding="utf-8")


def html_data(sc: Schedule, spec: ModelSpec) -> dict[str, Any]:
    """The JSON embedded in schedule.html: per-task columns (times in ns), ops, the critical path
    (``chain``) and the per-layer op DAGs."""
    p = sc.predicted
    L = _num_layers(sc)
    labels, cost = _op_labels(sc), _task_us(sc)
    ops = _ops_in_order(labels)
    op_idx = {o: i for i, o in enumerate(ops)}
    layers = _layers_in_order(sc)
    ly_idx = {ly: i for i, ly in enumerate(layers)}
    start, end = p["start_us"], p["end_us"]
    sm = sc.sm_of()
    crit = chain(sc).tasks
    crit_ops = {(sc.tasks[i].layer, labels[i]) for i in crit}
    by_op = _aggregate(sc, labels, cost)
    return {
        "meta": {"model": spec.name, "batch": sc.batch, "context": sc.context, "num_sms": sc.num_sms,
                 "step_ns": round(float(p["step_us"]) * 1000)},
        "ops": ops, "colors": [_color(i) for i in range(len(ops))],
        "op_stats": [[by_op[o].tasks, by_op[o].bytes, round(by_op[o].us, 1)] for o in ops],
        "layers": [layer_label(ly, L) for ly in layers],
        "t": {
            "sm": sm,
            "s": [round(x * 1000) for x in start],
            "d": [round((e - s) * 1000) for s, e in zip(start, end)],
            "op": [op_idx[op] for op in labels],
            "ly": [ly_idx[t.layer] for t in sc.tasks],
            "b": [t.weight_bytes + t.act_bytes for t in sc.tasks],
            "w": [len(w) for w in sc.waits],
            "n": [t.name for t in sc.tasks],
        },
        "crit": crit,
        "dag": _layer_dags(sc, labels, cost, ops, crit_ops),
    }


def render_html(sc: Schedule, spec: ModelSpec) -> str:
    d = summary(sc, spec)
    data = html_data(sc, spec)
    default = next((k for k in data["layers"] if k == "L1"), data["layers"][0] if data["layers"] else "")
    tmpl = _environment().from_string(_template_text(HTML_TEMPLATE))
    return tmpl.render(
        title=f"{spec.name} b{sc.batch} ctx{sc.context} – mkc schedule",
        summary_rows=_summary_rows(d),
        source=("Predicted by the mkc shared-bandwidth simulation of the step" if "timeline" in sc.predicted
                else "Predicted by the mkc list scheduler's estimate"),
        legend=[{"op": o, "color": c, "tasks": s[0], "bytes": _fmt_bytes(s[1]), "us": s[2],
                 "share": s[2] / (sc.num_sms * d["step_us"]) if d["step_us"] > 0 else 0.0}
                for o, c, s in zip(data["ops"], data["colors"], data["op_stats"])],
        default_layer=default,
        data_json=Markup(htmlsafe_json_dumps(data, dumps=json.dumps, separators=(",", ":"))),
    )


def write_html(sc: Schedule, spec: ModelSpec, path: str | Path) -> Path:
    """schedule.html: self-contained (inline CSS/JS, data as embedded JSON), works offline."""
    return _write_text(path, render_html(sc, spec))


# -- manifest.json -------------------------------------------------------------------------------
def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def versions() -> dict[str, str | None]:
    """Versions from package metadata (torch is not imported: that costs seconds)."""
    return {"mkc": mkc.__version__, "python": platform.python_version(), "torch": _version("torch"),
            "networkx": _version("networkx"), "jinja2": _version("jinja2")}


def write_manifest(path: str | Path, *, spec_path: str | Path, spec: ModelSpec, options: dict[str, Any],
                   files: dict[str, Path]) -> Path:
    """manifest.json: inputs (spec path + sha256), options, sha256 of every artifact, versions,
    UTC timestamp. File paths are stored relative to the manifest's folder where possible."""
    root = Path(path).resolve().parent

    def rel(p: Path) -> str:
        p = Path(p).resolve()
        return str(p.relative_to(root)) if p.is_relative_to(root) else str(p)

    doc = {
        "format": "mkc-manifest/1",
        "model": spec.name,
        "inputs": {"spec": {"path": str(spec_path), "sha256": sha256_file(spec_path)}},
        "options": options,
        "files": {name: {"path": rel(p), "sha256": sha256_file(p), "bytes": Path(p).stat().st_size}
                  for name, p in files.items()},
        "versions": versions(),
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    return _write_text(path, json.dumps(doc, indent=2) + "\n")


def write_artifacts(sc: Schedule, spec: ModelSpec, out_dir: str | Path, *, spec_path: str | Path,
                    extra: dict[str, Path] | None = None) -> dict[str, Path]:
    """Write report.md, trace.json, schedule.html into out_dir, then manifest.json hashing them
    and any ``extra`` files (e.g. schedule.json, kernel.cu). Returns name → path, manifest included."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = {"report": write_report(sc, spec, out / "report.md"),
             "trace": write_trace(sc, out / "trace.json"),
             "html": write_html(sc, spec, out / "schedule.html"),
             **(extra or {})}
    options = {"batch": sc.batch, "context": sc.context, "num_sms": sc.num_sms}
    files["manifest"] = write_manifest(out / "manifest.json", spec_path=spec_path, spec=spec, options=options,
                                       files=files)
    return files


def _write_text(path: str | Path, text: str) -> Path:
    """Write atomically: a reader never sees a half-written artifact."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; artifacts are for people to open
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
