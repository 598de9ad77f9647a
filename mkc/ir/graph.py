"""Buffers, regions, tasks, and the task DAG whose edges are derived from declared regions.

Every task declares the rectangular regions of named buffers it reads and writes. Two tasks
conflict when their regions on one buffer overlap and at least one of them writes; the DAG orders
every conflicting pair by program order (the order the lowering emitted the tasks). Weights are
immutable and never create edges.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field

import networkx as nx

from mkc.ir.ops import OP_INFO, Opcode

DTYPE_BYTES = {"bf16": 2, "f32": 4, "i32": 4}


@dataclass(frozen=True, slots=True)
class Buffer:
    name: str  # unique, e.g. "L3.qkv"
    shape: tuple[int, ...]  # elements per dim
    dtype: str  # "bf16" | "f32" | "i32"
    kind: str  # "weight" (immutable) | "act" (per step) | "state" (KV cache) | "input" | "output"
    doc: str = ""  # layout comment, e.g. "[B, n_kv, ctx, head_dim]"

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

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


def _access_list(tasks: list[Task], buffers: dict[str, Buffer]) -> dict[str, list[tuple[int, Region, bool]]]:
    per_buf: dict[str, list[tuple[int, Region, bool]]] = defaultdict(list)
    for t in tasks:
        for r in t.reads:
            if buffers[r.buffer].kind != "weight":
                per_buf[r.buffer].append((t.id, r, False))
        for r in t.writes:
            per_buf[r.buffer].append((t.id, r, True))
    return per_buf


def _overlapping_pair_count(intervals: list[tuple[int, int]]) -> int:
    """How many pairs of the half-open intervals overlap (the sweep's work on that dimension)."""
    los = sorted(lo for lo, _ in intervals)
    his = sorted(hi for _, hi in intervals)
    # pairs (i, j) with lo_j < hi_i and hi_j > lo_i, counted over i (self included), then halved
    total = sum(bisect.bisect_left(los, hi) - bisect.bisect_right(his, lo) for lo, hi in intervals)
    return (total - len(intervals)) // 2


def conflicting_pairs(tasks: list[Task], buffers: dict[str, Buffer]) -> Iterator[tuple[int, int, str, str]]:
    """Yield (a, b, buffer, kind) for every pair of tasks a < b whose regions on a non-weight
    buffer overlap with at least one write. kind is "RAW", "WAR" or "WAW" in program order.

    A sweep over the buffer's most finely split dimension keeps this near-linear in practice.
    """
    for buf, acc in _access_list(tasks, buffers).items():
        if not any(w for _, _, w in acc):
            continue
        ndim = len(acc[0][1].box)
        dim = min(range(ndim), key=lambda d: _overlapping_pair_count([r.box[d] for _, r, _ in acc]))
        acc.sort(key=lambda a: a[1].box[dim][0])
        active: list[tuple[int, Region, bool]] = []
        seen: set[tuple[int, int]] = set()
        last_lo = None
        for cur in acc:
            lo = cur[1].box[dim][0]
            if lo != last_lo:
                active = [a for a in active if a[1].box[dim][1] > lo]
                last_lo = lo
            for other in active:
                if not (cur[2] or other[2]) or cur[0] == other[0]:
                    continue
                if not cur[1].overlaps(other[1]):
                    continue
                a, b = (other, cur) if other[0] < cur[0] else (cur, other)
                key = (a[0], b[0])
                if key in seen:
                    continue
                seen.add(key)
                kind = "WAW" if a[2] and b[2] else ("RAW" if a[2] else "WAR")
                yield a[0], b[0], buf, kind
            active.append(cur)


def derive_edges(program: Program) -> nx.DiGraph:
    """The task DAG: one node per task, an edge a → b for every conflicting pair (a first)."""
    g = nx.DiGraph()
    g.add_nodes_from(t.id for t in program.tasks)
    for a, b, buf, kind in conflicting_pairs(program.tasks, program.buffers):
        if g.has_edge(a, b):
            g[a][b]["buffers"].add(buf)
        else:
            g.add_edge(a, b, buffers={buf}, kind=kind)
    program.graph = g
    return g
