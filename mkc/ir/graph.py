"""Buffers, regions, tasks, and the task DAG whose edges are derived from declared regions.

Every task declares the rectangular regions of named buffers it reads and writes. Two tasks
conflict when their regions on one buffer overlap and at least one of them writes; the DAG orders
every conflicting pair by program order (the order the lowering emitted the tasks). Weights are
immutable and never create edges.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import networkx as nx
import numpy as np

from mkc.ir.ops import OP_INFO, Opcode

DTYPE_BYTES = {"bf16": 2, "f32": 4, "i32": 4, "fp8": 1}  # fp8: e4m3 weights (mkc/ir/fp8.py)


@dataclass(frozen=True, slots=True)
class Buffer:
    name: str  # unique, e.g. "L3.qkv"
    shape: tuple[int, ...]  # elements per dim
    dtype: str  # "bf16" | "f32" | "i32" | "fp8" (e4m3 weights, their scales beside: mkc/ir/fp8.py)
    kind: str  # "weight" (immutable) | "act" (per step) | "state" (KV cache) | "input" | "output"
    doc: str = ""  # layout comment, e.g. "[B, n_kv, ctx, head_dim]"

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def given(self, weights: dict[str, Any]) -> Any:
        """This weight buffer's tensor in ``weights`` (logical names, runtime/weights.py); raises
        KeyError when it is missing and ValueError when its shape is not the buffer's."""
        if self.name not in weights:
            raise KeyError(f"weight {self.name} {list(self.shape)} is missing from the weights given "
                           f"({len(weights)} tensors; see runtime/weights.py for the logical names)")
        w = weights[self.name]
        if tuple(w.shape) != self.shape:
            raise ValueError(f"weight {self.name} has shape {list(w.shape)}: expected {list(self.shape)}")
        return w

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_BYTES[self.dtype]


@dataclass(frozen=True, slots=True)
class Region:
    buffer: str  # buffer name
    box: tuple[tuple[int, int], ...]  # half-open [lo, hi) per dim

    def overlaps(self, other: Region) -> bool:
        if self.buffer != other.buffer:
            return False
        for (a_lo, a_hi), (b_lo, b_hi) in zip(self.box, other.box):
            if a_lo >= b_hi or b_lo >= a_hi:
                return False
        return True

    @property
    def numel(self) -> int:
        n = 1
        for lo, hi in self.box:
            n *= hi - lo
        return n

    def __str__(self) -> str:
        return f"{self.buffer}[{', '.join(f'{lo}:{hi}' for lo, hi in self.box)}]"


@dataclass(frozen=True, slots=True)
class Task:
    id: int  # position in program order
    op: Opcode
    layer: int  # decoder layer, -1 for embedding, num_layers for the head
    name: str  # human-readable, e.g. "L3.qkv[0:256]"
    operands: tuple[str, ...]  # buffer names in OP_INFO[op].operands order, "-" when absent
    args: tuple[int, ...]  # integers in OP_INFO[op].args order
    reads: tuple[Region, ...]  # every region read (weights included)
    writes: tuple[Region, ...]  # every region written
    weight_bytes: int  # bytes of immutable weights streamed (upper bound for routed experts)
    act_bytes: int  # bytes of activations / KV read and written
    flops: int  # multiply-adds x 2

    def arg(self, name: str) -> int:
        return self.args[OP_INFO[self.op].args.index(name)]

    def operand(self, role: str) -> str:
        return self.operands[OP_INFO[self.op].operands.index(role)]


@dataclass(slots=True)
class Program:
    """What the lowering produces: buffers, tasks in program order, and options used."""

    buffers: dict[str, Buffer]
    tasks: list[Task]
    options: dict[str, int | str | float] = field(default_factory=dict)
    graph: nx.DiGraph | None = None  # filled by derive_edges

    def buffer(self, name: str) -> Buffer:
        return self.buffers[name]


KINDS = ("RAW", "WAR", "WAW")  # conflict kinds, in program order; Conflicts.kind indexes this


@dataclass(frozen=True, slots=True)
class Conflicts:
    """Every conflicting pair as columns, in the order ``conflicting_pairs`` yields them."""

    a: np.ndarray  # [pairs] int64, the earlier task
    b: np.ndarray  # [pairs] int64, the later task
    buffer: np.ndarray  # [pairs] int64, index into names
    kind: np.ndarray  # [pairs] int64, index into KINDS
    names: tuple[str, ...]  # buffer names

    def __len__(self) -> int:
        return len(self.a)

    def __iter__(self) -> Iterator[tuple[int, int, str, str]]:
        for a, b, buf, kind in zip(self.a.tolist(), self.b.tolist(), self.buffer.tolist(), self.kind.tolist()):
            yield a, b, self.names[buf], KINDS[kind]


@dataclass(frozen=True, slots=True)
class _Accesses:
    """Every access to a buffer that is written at all, as columns in program order (a task's
    reads before its writes; weights are read-only, so reads of them are left out)."""

    names: tuple[str, ...]  # the buffers, in order of first access
    buffer: np.ndarray  # [access] index into names
    task: np.ndarray  # [access] task id
    write: np.ndarray  # [access] bool
    lo: np.ndarray  # [access, dim] lower bounds; past the buffer's rank 0 (with hi 1: [0, 1) overlaps [0, 1))
    hi: np.ndarray  # [access, dim] upper bounds (exclusive); past the buffer's rank 1


def _accesses(tasks: list[Task], buffers: dict[str, Buffer]) -> _Accesses:
    weights = {name for name, b in buffers.items() if b.kind == "weight"}
    index: dict[str, int] = {}
    buf, task, write, boxes = [], [], [], []
    for t in tasks:
        for w, regions in ((False, t.reads), (True, t.writes)):
            for r in regions:
                if w or r.buffer not in weights:
                    buf.append(index.setdefault(r.buffer, len(index)))
                    task.append(t.id)
                    write.append(w)
                    boxes.append(r.box)
    rank = np.fromiter(map(len, boxes), dtype=np.int64, count=len(boxes))
    bounds = np.fromiter(chain.from_iterable(chain.from_iterable(boxes)), dtype=np.int64)  # lo, hi, lo, ...
    real = np.arange(rank.max(initial=0)) < rank[:, None]  # [access, dim]
    lo, hi = np.zeros(real.shape, dtype=np.int64), np.ones(real.shape, dtype=np.int64)
    lo[real], hi[real] = bounds[0::2], bounds[1::2]
    buf_, write_ = np.array(buf, dtype=np.int64), np.array(write, dtype=bool)
    written = np.zeros(len(index), dtype=bool)
    written[buf_[write_]] = True
    keep = written[buf_]
    return _Accesses(names=tuple(name for name, i in index.items() if written[i]),
                     buffer=(np.cumsum(written) - 1)[buf_[keep]], task=np.array(task, dtype=np.int64)[keep],
                     write=write_[keep], lo=lo[keep], hi=hi[keep])


def _sweep_dims(acc: _Accesses) -> np.ndarray:
    """Per buffer, the dimension where the fewest pairs of its accesses overlap (the first such):
    sweeping along it meets the fewest candidate pairs."""
    n = len(acc.names)
    count = np.zeros((acc.lo.shape[1], n), dtype=np.int64)  # [dim, buffer]
    for d in range(acc.lo.shape[1]):
        lo, hi = _segmented(acc.buffer, acc.lo[:, d], acc.hi[:, d])
        los, his = np.sort(lo), np.sort(hi)
        # pairs (i, j) with lo_j < hi_i and hi_j > lo_i, counted over i (self included), then halved
        per = np.searchsorted(los, hi, "left") - np.searchsorted(his, lo, "right")
        count[d] = (np.bincount(acc.buffer, per, n).astype(np.int64) - np.bincount(acc.buffer, None, n)) // 2
    return count.argmin(axis=0)


def _segmented(buffer: np.ndarray, *bounds: np.ndarray) -> tuple[np.ndarray, ...]:
    """Bounds shifted so that each buffer's lie above every earlier buffer's: one sort or search
    over all accesses then acts per buffer."""
    low = min(int(b.min()) for b in bounds)
    span = max(int(b.max()) for b in bounds) - low + 1
    return tuple(buffer * span + (b - low) for b in bounds)


def _expand(src: np.ndarray, start: np.ndarray, stop: np.ndarray, targets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Pairs (src[k], targets[m]) for every k and start[k] <= m < stop[k], grouped by k."""
    count = np.maximum(stop - start, 0)
    first = np.repeat(start - (np.cumsum(count) - count), count)
    return np.repeat(src, count), targets[first + np.arange(int(count.sum()))]


def conflicts(tasks: list[Task], buffers: dict[str, Buffer]) -> Conflicts:
    """Every pair of tasks a < b whose regions on a non-weight buffer overlap with at least one
    write, as columns. Every region of a buffer must have the buffer's rank.

    The order is a sweep's, buffer by buffer (in order of first access): a buffer's accesses are
    swept in order of their lower bound on its ``_sweep_dims`` dimension (program order among
    equal bounds), and each access meets the earlier ones still open there. Pairs come out
    ordered by the later access in the sweep, then by the earlier one; a task pair is kept only
    the first time it is met on a buffer. Two reads never conflict, so only pairs with a write
    are generated, which keeps the work near the number of conflicts.
    """
    acc = _accesses(tasks, buffers)
    if not len(acc.task):
        empty = np.zeros(0, dtype=np.int64)
        return Conflicts(empty, empty, empty, empty, ())
    dim = _sweep_dims(acc)[acc.buffer]
    rows = np.arange(len(acc.task))
    start, stop = _segmented(acc.buffer, acc.lo[rows, dim], acc.hi[rows, dim])
    sweep = np.argsort(start, kind="stable")
    start, stop = start[sweep], stop[sweep]
    buf, task, write, lo, hi = (x[sweep] for x in (acc.buffer, acc.task, acc.write, acc.lo, acc.hi))
    # the accesses open while sweep position i is: i < j < end[i], all of i's buffer
    end = np.searchsorted(start, stop, "left")
    w, r = np.flatnonzero(write), np.flatnonzero(~write)
    i1, j1 = _expand(w, w + 1, end[w], rows)  # a write, then any access
    i2, j2 = _expand(r, np.searchsorted(w, r, "right"), np.searchsorted(w, end[r], "left"), w)  # a read, then a write
    i, j = np.concatenate([i1, i2]), np.concatenate([j1, j2])
    hit = (task[i] != task[j]) & np.all((lo[i] < hi[j]) & (lo[j] < hi[i]), axis=1)
    order = np.lexsort((i[hit], j[hit]))
    i, j = i[hit][order], j[hit][order]
    i_first = task[i] < task[j]
    a, b = np.where(i_first, task[i], task[j]), np.where(i_first, task[j], task[i])
    wa, wb = np.where(i_first, write[i], write[j]), np.where(i_first, write[j], write[i])
    kind = np.where(wa & wb, KINDS.index("WAW"), np.where(wa, KINDS.index("RAW"), KINDS.index("WAR")))
    n = int(task.max()) + 1
    seen = np.unique((buf[j] * n + a) * n + b, return_index=True)[1]
    seen.sort()
    return Conflicts(a[seen], b[seen], buf[j][seen], kind[seen], acc.names)


def conflicting_pairs(tasks: list[Task], buffers: dict[str, Buffer]) -> Iterator[tuple[int, int, str, str]]:
    """Yield (a, b, buffer, kind) for every pair of tasks a < b whose regions on a non-weight
    buffer overlap with at least one write. kind is "RAW", "WAR" or "WAW" in program order.

    A sweep over the buffer's most finely split dimension keeps this near-linear in practice.
    """
    yield from conflicts(tasks, buffers)


def derive_edges(program: Program) -> nx.DiGraph:
    """The task DAG: one node per task, an edge a → b for every conflicting pair (a first), with
    the buffers it conflicts on (a frozenset) and the kind of its first conflict. Edges are added
    in the order ``conflicting_pairs`` first meets them, which fixes the graph's adjacency order."""
    c = conflicts(program.tasks, program.buffers)
    first = np.unique(c.a * len(program.tasks) + c.b, return_index=True)[1]
    first.sort()
    again = np.ones(len(c), dtype=bool)  # a pair whose edge an earlier buffer already made
    again[first] = False
    # networkx copies the attributes into a dict of each edge's own, so edges can share them
    attrs = [[{"buffers": frozenset((name,)), "kind": kind} for kind in KINDS] for name in c.names]
    g = nx.DiGraph()
    with gc_paused():
        g.add_nodes_from(t.id for t in program.tasks)
        g.add_edges_from((a, b, attrs[buf][kind]) for a, b, buf, kind in
                         zip(c.a[first].tolist(), c.b[first].tolist(), c.buffer[first].tolist(),
                             c.kind[first].tolist()))
        for a, b, buf in zip(c.a[again].tolist(), c.b[again].tolist(), c.buffer[again].tolist()):
            g[a][b]["buffers"] |= {c.names[buf]}
    program.graph = g
    return g


@contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector while building large structures without reference cycles
    (what they leave behind is freed by reference counting all the same). Nested pauses are fine.

    A collection starts every few hundred container allocations, and a full one, which traverses
    everything alive, each time the heap has grown by a quarter: building a graph of a million
    edges (an attribute dict each) set off a dozen full collections that freed nothing and took
    as long as the build itself. Paused, the new objects are traversed a few times in all.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
