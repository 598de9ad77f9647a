"""The schedule: per-SM task queues, counters with targets, and the predicted timeline.

This is the contract between the compiler and everything after it (validator, CPU executor,
codegen, visualisation). It round-trips through ``schedule.json`` (format in docs/schedule.md).

Counter semantics (the kernel and the CPU executor implement exactly this): counters start at 0
and are never reset; in step s (1-based) a task waits until ``counter >= target * s`` for each of
its waits, runs, then adds 1 to its signal counter (if any) after its writes are visible. A
counter's target equals the number of tasks that signal it.

A routing wait orders the router logits alone: an expert-up tile's wait on a counter whose
producers all write its router logits (``routing_edge``) may be met by reading the logits' tagged
copy instead of the counter (CodegenOptions.tagged_logits), so it orders those producers' logits
before the tile's read and nothing else; every other input of the tile, and of the tasks after
it, needs a wait of its own (the scheduler and the validator hold schedules to this).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mkc.ir.graph import Buffer, Region, Task, gc_paused
from mkc.ir.ops import OP_INFO, Opcode

FORMAT = "mkc-schedule/1"
_JSON_KINDS = {list: "array", str: "string", int: "number", float: "number", bool: "boolean", type(None): "null"}


def logits_operand(t: Task) -> str:
    """The router logits buffer a routing task (expert-up, expert-down, fused expert) reads."""
    return t.operands[OP_INFO[t.op].operands.index("logits")]


def routing_edge(a: Task, b: Task) -> bool:
    """b is an expert-up tile (EXPERT_SWIGLU, EXPERT_MLP) and a writes its router logits (see the
    module doc)."""
    if b.op not in (Opcode.EXPERT_SWIGLU, Opcode.EXPERT_MLP):
        return False
    logits = logits_operand(b)
    return any(r.buffer == logits for r in a.writes)


@dataclass(frozen=True, slots=True)
class Counter:
    id: int
    target: int  # producers that signal it per step
    producers: tuple[int, ...]  # task ids (informational; the validator recomputes it)


@dataclass(slots=True)
class Schedule:
    model: str  # model name
    batch: int  # sequences per step
    context: int  # context bucket (KV positions per sequence)
    num_sms: int  # persistent CTAs
    buffers: dict[str, Buffer]
    tasks: list[Task]  # indexed by task id
    queues: list[list[int]]  # queues[sm] = task ids in execution order
    waits: list[list[tuple[int, int]]]  # waits[task] = [(counter id, target per step)]
    signals: list[int]  # signals[task] = counter id, or -1
    counters: list[Counter]
    predicted: dict[str, Any] = field(default_factory=dict)  # start/end per task, step time, ...
    meta: dict[str, Any] = field(default_factory=dict)  # spec hash, options, versions

    def sm_of(self) -> list[int]:
        sm = [-1] * len(self.tasks)
        for i, q in enumerate(self.queues):
            for t in q:
                sm[t] = i
        return sm

    # -- JSON --------------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        """The schedule.json document. Tuples stand for JSON arrays (``json`` writes them as
        such): the tasks' own tuples go in as they are, so nothing is copied element by element."""
        return {
            "format": FORMAT,
            "model": self.model, "batch": self.batch, "context": self.context, "num_sms": self.num_sms,
            "meta": self.meta,
            "buffers": [{"name": b.name, "shape": b.shape, "dtype": b.dtype, "kind": b.kind, "doc": b.doc}
                        for b in self.buffers.values()],
            "tasks": [{
                "id": t.id, "op": t.op.name, "layer": t.layer, "name": t.name,
                "operands": t.operands, "args": t.args,
                "reads": [(r.buffer, r.box) for r in t.reads],
                "writes": [(r.buffer, r.box) for r in t.writes],
                "weight_bytes": t.weight_bytes, "act_bytes": t.act_bytes, "flops": t.flops,
                "wait": list(self.waits[t.id]), "signal": self.signals[t.id],
            } for t in self.tasks],
            "queues": self.queues,
            "counters": [{"id": c.id, "target": c.target, "producers": c.producers} for c in self.counters],
            "predicted": self.predicted,
        }

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), separators=(",", ":")))

    @classmethod
    def from_json(cls, d: Any) -> Schedule:
        """The schedule of a parsed schedule.json. Raises ValueError naming what is wrong for a
        document that is not one (another JSON value, a missing key, a value of the wrong type, a
        task, counter or queue entry that refers past the end of its list), so that nothing
        downstream (the validator, the executor) meets an index it cannot follow."""
        fmt = d.get("format") if isinstance(d, dict) else None
        if fmt != FORMAT:
            what = (f"schedule format {fmt!r}" if isinstance(d, dict)
                    else f"a JSON {_JSON_KINDS.get(type(d), type(d).__name__)}")
            raise ValueError(f"{what}: expected an object with \"format\": {FORMAT!r}")
        try:
            with gc_paused():  # tens of thousands of tasks' tuples, no cycles
                sc = cls._from_json(d)
        except KeyError as e:
            raise ValueError(f"missing key {e.args[0]!r}") from None
        except (TypeError, AttributeError, IndexError) as e:
            raise ValueError(f"a value of the wrong type or shape ({e})") from None
        _check_references(sc)
        return sc

    @classmethod
    def _from_json(cls, d: dict[str, Any]) -> Schedule:
        buffers = {b["name"]: Buffer(b["name"], tuple(b["shape"]), b["dtype"], b["kind"], b.get("doc", ""))
                   for b in d["buffers"]}

        def regions(rs: list) -> tuple[Region, ...]:
            return tuple(Region(name, tuple((int(lo), int(hi)) for lo, hi in bx)) for name, bx in rs)

        tasks, waits, signals = [], [], []
        for i, t in enumerate(d["tasks"]):
            if t["id"] != i:
                raise ValueError(f"task at index {i} has id {t['id']}: expected ids 0..n-1 in order")
            if t["op"] not in Opcode.__members__:
                raise ValueError(f"task {i} has op {t['op']!r}: expected one of {list(Opcode.__members__)}")
            tasks.append(Task(id=i, op=Opcode[t["op"]], layer=int(t["layer"]), name=str(t["name"]),
                              operands=tuple(t["operands"]), args=tuple(t["args"]), reads=regions(t["reads"]),
                              writes=regions(t["writes"]), weight_bytes=int(t["weight_bytes"]),
                              act_bytes=int(t["act_bytes"]), flops=int(t["flops"])))
            waits.append([(int(c), int(n)) for c, n in t["wait"]])
            signals.append(int(t["signal"]))
        counters = [Counter(int(c["id"]), int(c["target"]), tuple(int(p) for p in c["producers"]))
                    for c in d["counters"]]
        return cls(model=str(d["model"]), batch=int(d["batch"]), context=int(d["context"]),
                   num_sms=int(d["num_sms"]), buffers=buffers, tasks=tasks,
                   queues=[[int(t) for t in q] for q in d["queues"]], waits=waits, signals=signals,
                   counters=counters, predicted=dict(d.get("predicted") or {}), meta=dict(d.get("meta") or {}))

    @classmethod
    def load(cls, path: str | Path) -> Schedule:
        with gc_paused():
            return cls.from_json(json.loads(Path(path).read_text()))


def _check_references(sc: Schedule) -> None:
    """Every id a schedule holds names an existing task, counter or buffer (ValueError if not)."""
    n, nc = len(sc.tasks), len(sc.counters)
    for i, c in enumerate(sc.counters):
        if c.id != i:
            raise ValueError(f"counter at index {i} has id {c.id}: expected ids 0..n-1 in order")
        bad = [p for p in c.producers if not 0 <= p < n]
        if bad:
            raise ValueError(f"counter {i} names producer {bad[0]}: expected task ids 0..{n - 1}")
    for sm, q in enumerate(sc.queues):
        bad = [t for t in q if not 0 <= t < n]
        if bad:
            raise ValueError(f"the queue of SM {sm} holds task {bad[0]}: expected task ids 0..{n - 1}")
    for t in sc.tasks:
        bad = [c for c, _ in sc.waits[t.id] if not 0 <= c < nc]
        if bad or not -1 <= sc.signals[t.id] < nc:
            c = bad[0] if bad else sc.signals[t.id]
            raise ValueError(f"task {t.id} ({t.name}) refers to counter {c}: expected counter ids 0..{nc - 1}")
        unknown = [r.buffer for r in (*t.reads, *t.writes) if r.buffer not in sc.buffers]
        if unknown:
            raise ValueError(f"task {t.id} ({t.name}) touches buffer {unknown[0]!r}, which the schedule does "
                             f"not declare")
