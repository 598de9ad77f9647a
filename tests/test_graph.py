"""Conflicts and edges from declared regions: the vectorised sweep against a plain one.

``conflicting_pairs`` fixes the order of the DAG's adjacency (and so the scheduler's tie-breaks)
and of the validator's race messages, so the test pins the order as well as the set: the
reference below is the region-by-region sweep that ``conflicts`` replaced, written for clarity.
"""

from __future__ import annotations

import bisect
from pathlib import Path

import networkx as nx
from hypothesis import given, settings
from hypothesis import strategies as st

from mkc.ir.graph import Buffer, Program, Region, Task, conflicting_pairs, conflicts, derive_edges
from mkc.ir.lower import lower
from mkc.ir.ops import Opcode
from mkc.ir.spec import load_spec

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def _pair_count(intervals: list[tuple[int, int]]) -> int:
    los, his = sorted(lo for lo, _ in intervals), sorted(hi for _, hi in intervals)
    total = sum(bisect.bisect_left(los, hi) - bisect.bisect_right(his, lo) for lo, hi in intervals)
    return (total - len(intervals)) // 2


def reference_pairs(tasks: list[Task], buffers: dict[str, Buffer]) -> list[tuple[int, int, str, str]]:
    """Per buffer (first access first): sweep along the dimension with the fewest overlapping
    pairs, each access against the earlier ones still open, every pair with a write, once."""
    per_buf: dict[str, list[tuple[int, Region, bool]]] = {}
    for t in tasks:
        for r in t.reads:
            if buffers[r.buffer].kind != "weight":
                per_buf.setdefault(r.buffer, []).append((t.id, r, False))
        for r in t.writes:
            per_buf.setdefault(r.buffer, []).append((t.id, r, True))
    out = []
    for buf, acc in per_buf.items():
        if not any(w for _, _, w in acc):
            continue
        dim = min(range(len(acc[0][1].box)), key=lambda d: _pair_count([r.box[d] for _, r, _ in acc]))
        acc.sort(key=lambda x: x[1].box[dim][0])
        seen = set()
        for j, cur in enumerate(acc):
            for other in acc[:j]:
                if cur[0] == other[0] or not (cur[2] or other[2]) or not cur[1].overlaps(other[1]):
                    continue
                a, b = (other, cur) if other[0] < cur[0] else (cur, other)
                if (a[0], b[0]) not in seen:
                    seen.add((a[0], b[0]))
                    out.append((a[0], b[0], buf, "WAW" if a[2] and b[2] else ("RAW" if a[2] else "WAR")))
    return out


SHAPES = {"x": (8,), "y": (6, 4), "z": (3, 4, 5), "w": (8, 8)}
KIND = {"x": "act", "y": "act", "z": "state", "w": "weight"}


@st.composite
def programs(draw) -> tuple[list[Task], dict[str, Buffer]]:
    """Random tasks with few, small boxes (empty ones included) so that overlaps are common."""
    buffers = {n: Buffer(n, s, "f32", KIND[n]) for n, s in SHAPES.items()}

    def region(name: str) -> Region:
        box = []
        for s in SHAPES[name]:
            lo = draw(st.integers(0, s))
            box.append((lo, draw(st.integers(lo, s))))
        return Region(name, tuple(box))

    tasks = []
    for i in range(draw(st.integers(0, 14))):
        reads = tuple(region(n) for n in draw(st.lists(st.sampled_from(sorted(SHAPES)), max_size=3)))
        writes = tuple(region(n) for n in draw(st.lists(st.sampled_from(["x", "y", "z"]), max_size=2)))
        tasks.append(Task(i, Opcode(1), 0, f"t{i}", (), (), reads, writes, 0, 0, 0))
    return tasks, buffers


@settings(max_examples=300, deadline=None)
@given(programs())
def test_conflicts_match_the_plain_sweep(prog):
    tasks, buffers = prog
    assert list(conflicting_pairs(tasks, buffers)) == reference_pairs(tasks, buffers)


@settings(max_examples=100, deadline=None)
@given(programs())
def test_edges_carry_every_conflicting_buffer(prog):
    tasks, buffers = prog
    g = derive_edges(Program(buffers, tasks))
    want: dict[tuple[int, int], tuple[set[str], str]] = {}
    for a, b, buf, kind in reference_pairs(tasks, buffers):
        want.setdefault((a, b), (set(), kind))[0].add(buf)
    assert {(a, b): (d["buffers"], d["kind"]) for a, b, d in g.edges(data=True)} == want
    # adjacency order (what the scheduler iterates) is the order conflicting_pairs first meets edges
    succ: dict[int, list[int]] = {t.id: [] for t in tasks}
    pred: dict[int, list[int]] = {t.id: [] for t in tasks}
    for a, b in want:
        succ[a].append(b)
        pred[b].append(a)
    assert {v: list(g.succ[v]) for v in g} == succ and {v: list(g.pred[v]) for v in g} == pred
    assert list(g.nodes) == [t.id for t in tasks]


def test_real_program_matches_the_plain_sweep():
    spec = load_spec(CONFIGS / "tiny.yaml")
    prog = lower(spec, batch=3, context=40, num_sms=8)
    ref = reference_pairs(prog.tasks, prog.buffers)
    assert list(conflicting_pairs(prog.tasks, prog.buffers)) == ref
    assert len(conflicts(prog.tasks, prog.buffers)) == len(ref)
    assert nx.is_directed_acyclic_graph(prog.graph)
