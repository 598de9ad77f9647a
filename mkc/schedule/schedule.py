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

from mkc.ir.graph import Buffer, Region, Task
from mkc.ir.ops import OP_INFO, Opcode

FORMAT = "mkc-schedule/1"


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
    def from_json(cls, d: dict[str, Any]) -> Schedule:
        if d.get("format") != FORMAT:
            raise ValueError(f"schedule format {d.get('format')!r}: expected {FORMAT!r}")
        buffers = {b["name"]: Buffer(b["name"], tuple(b["shape"]), b["dtype"], b["kind"], b.get("doc", ""))
                   for b in d["buffers"]}

        def regions(rs: list) -> tuple[Region, ...]:
            return tuple(Region(name, tuple((int(lo), int(hi)) for lo, hi in bx)) for name, bx in rs)

        tasks, waits, signals = [], [], []
        for i, t in enumerate(d["tasks"]):
            if t["id"] != i:
                raise ValueError(f"task at index {i} has id {t['id']}: expected ids 0..n-1 in order")
            tasks.append(Task(id=i, op=Opcode[t["op"]], layer=t["layer"], name=t["name"],
                              operands=tuple(t["operands"]), args=tuple(t["args"]), reads=regions(t["reads"]),
                              writes=regions(t["writes"]), weight_bytes=t["weight_bytes"],
                              act_bytes=t["act_bytes"], flops=t["flops"]))
            waits.append([(int(c), int(n)) for c, n in t["wait"]])
            signals.append(int(t["signal"]))
        counters = [Counter(c["id"], c["target"], tuple(c["producers"])) for c in d["counters"]]
        return cls(model=d["model"], batch=d["batch"], context=d["context"], num_sms=d["num_sms"],
                   buffers=buffers, tasks=tasks, queues=[list(q) for q in d["queues"]], waits=waits,
                   signals=signals, counters=counters, predicted=d.get("predicted", {}), meta=d.get("meta", {}))

    @classmethod
    def load(cls, path: str | Path) -> Schedule:
        return cls.from_json(json.loads(Path(path).read_text()))
