"""The scheduler: task DAG → per-SM queues, counters and targets.

Rules, in the order they apply:

1. Priority is the upward rank: a task's predicted time plus the longest chain of predicted
   times after it (the critical path to the end of the step). Ties go to program order. With
   Ceilings.attention_inputs_first_us, the tasks that feed an attention split (and with
   Ceilings.splits_first the splits too) count that much more.
   A routing slot's expert tiles are predicted at their expert's full bytes, though the slots past
   the step's distinct experts stream nothing: placed by their expected bytes instead, the steps
   measured slower (the slots live in some steps only were stacked as cheap, and end the layer
   when live).
2. List scheduling: tasks are taken in priority order (which is a topological order) and each is
   placed on the SM where it can start earliest, preferring, among SMs already idle when its
   inputs are ready, the one that went idle last (it wastes the least). A task's start may
   overlap its wait by its prefetchable weight time (cost.py). With Ceilings.spread_siblings, a
   task whose SM already holds a sibling (a task of its layer and stage, stages.stage: e.g.
   another O-projection tile) goes instead to the first SM without one that can start it before
   it would end there, so a layer's tiles of one op run beside each other, not one after another.
3. Counters: an edge a → b already implied by a path a → c → b is not waited on (c's own wait
   covers it), unless the path runs through a routing edge: an expert-up tile's edge from the
   router tiles (schedule.routing_edge) orders the logits alone, since a kernel may read the
   logits' tagged copy instead of waiting for their counter (CodegenOptions.tagged_logits), so
   every other input of the tile, and of the tasks after it, is waited for on its own. Producers
   are then grouped by their exact set of remaining consumers; each group gets one counter whose
   target is the group's size, so no consumer ever waits on a producer it does not need. A
   consumer waits on the counter of every group it depends on, except groups whose producers all
   run earlier on its own SM (queue order already covers them) and groups an earlier task on its
   SM already waited for (that wait ended before this task starts: the QKV tiles queued on one SM
   poll the residual stream's counter once, not once per tile; an expert-up tile's wait on the
   router tiles does not count, see above).

Deterministic: no randomness, no dict-order dependence beyond insertion order.
"""

from __future__ import annotations

import bisect
from collections import defaultdict

import networkx as nx

from mkc.ir.graph import Program, Task
from mkc.schedule.cost import H200, Ceilings, prefetchable_time, task_time
from mkc.schedule.schedule import Counter, Schedule, routing_edge
from mkc.schedule.stages import stage


def upward_rank(g: nx.DiGraph, cost: list[float]) -> list[float]:
    rank = [0.0] * len(cost)
    for n in reversed(list(nx.topological_sort(g))):
        rank[n] = cost[n] + max((rank[s] for s in g.successors(n)), default=0.0)
    return rank


def schedule(program: Program, model: str, ceilings: Ceilings = H200) -> Schedule:
    g = program.graph
    assert g is not None, "derive_edges first"
    tasks = program.tasks
    n_sm = int(program.options["num_sms"])
    hop = ceilings.task_overhead
    cost = [task_time(t, n_sm, ceilings) for t in tasks]
    pre = [prefetchable_time(t, n_sm, ceilings) for t in tasks]
    boost = ceilings.attention_inputs_first_us * 1e-6
    raised = [boost > 0 and (any(tasks[s].op.name == "ATTN_SPLIT" for s in g.successors(t.id))
                             or (ceilings.splits_first and t.op.name == "ATTN_SPLIT")) for t in tasks]
    rank = upward_rank(g, [c + (boost if r else 0.0) for c, r in zip(cost, raised)])
    order = sorted(range(len(tasks)), key=lambda i: (-rank[i], i))

    # list scheduling; free = sorted list of (time the SM goes idle, sm)
    free: list[tuple[float, int]] = [(0.0, sm) for sm in range(n_sm)]
    queues: list[list[int]] = [[] for _ in range(n_sm)]
    start = [0.0] * len(tasks)
    end = [0.0] * len(tasks)
    sm_of = [-1] * len(tasks)
    holders: dict[tuple[int, str], set[int]] = defaultdict(set)  # (layer, stage) -> SMs holding one
    for t in order:
        ready = max((end[p] + hop for p in g.predecessors(t)), default=0.0)
        # the SM that went idle last among those idle by `ready`, else the first to go idle
        i = bisect.bisect_right(free, (ready, n_sm)) - 1
        i = max(i, 0)
        idle_at, sm = free[i]
        s = max(idle_at, ready - pre[t])
        siblings = holders[tasks[t].layer, stage(tasks[t])]
        if ceilings.spread_siblings and sm in siblings:
            # the first SM to go idle without a sibling, if it can start the task before it would end here
            for j, (idle_j, sm_j) in enumerate(free):
                if max(idle_j, ready - pre[t]) >= s + cost[t]:
                    break
                if sm_j not in siblings:
                    i, idle_at, sm = j, idle_j, sm_j
                    s = max(idle_at, ready - pre[t])
                    break
        free.pop(i)
        siblings.add(sm)
        start[t] = s
        end[t] = max(s + cost[t], ready + cost[t] - pre[t])
        sm_of[t] = sm
        queues[sm].append(t)
        bisect.insort(free, (end[t], sm))

    preds = _direct_predecessors(g, tasks)
    signals, counters = _counters(preds, len(tasks))
    waits = _waits(tasks, queues, sm_of, preds, signals, counters)

    step = max(end, default=0.0) + ceilings.launch_in_graph
    busy = defaultdict(float)
    for t in range(len(tasks)):
        busy[sm_of[t]] += cost[t]
    critical = _critical_path(g, cost)
    predicted = {
        "start_us": [round(x * 1e6, 3) for x in start],
        "end_us": [round(x * 1e6, 3) for x in end],
        "step_us": round(step * 1e6, 3),
        "critical_path": critical,
        "critical_path_us": round(sum(cost[i] for i in critical) * 1e6, 3),
        "sm_busy_us": [round(busy[i] * 1e6, 3) for i in range(n_sm)],
        "ceilings": {"read_bw": ceilings.read_bw, "task_overhead_s": ceilings.task_overhead},
    }
    return Schedule(model=model, batch=int(program.options["batch"]), context=int(program.options["context"]),
                    num_sms=n_sm, buffers=program.buffers, tasks=tasks, queues=queues, waits=waits,
                    signals=signals, counters=counters, predicted=predicted,
                    # an FP8 lowering's format travels with its buffers (mkc/ir/fp8.py)
                    meta={} if program.options.get("weights", "bf16") == "bf16"
                    else {"weights": program.options["weights"]})


def _counters(preds: list[list[int]], n: int) -> tuple[list[int], list[Counter]]:
    """Rule 3's counters: producers grouped by their exact set of consumers (``preds``: each task's
    direct predecessors), one counter per group with the group's size as target. Returns each
    task's signal (counter id, or -1) and the counters."""
    succs: list[list[int]] = [[] for _ in range(n)]
    for b, ps in enumerate(preds):
        for a in ps:
            succs[a].append(b)
    groups: dict[frozenset[int], list[int]] = {}
    for t in range(n):
        succ = frozenset(succs[t])
        if succ:
            groups.setdefault(succ, []).append(t)
    signals = [-1] * n
    counters: list[Counter] = []
    for cid, producers in enumerate(groups.values()):
        counters.append(Counter(cid, len(producers), tuple(producers)))
        for p in producers:
            signals[p] = cid
    return signals, counters


def _waits(tasks: list[Task], queues: list[list[int]], sm_of: list[int], preds: list[list[int]],
           signals: list[int], counters: list[Counter]) -> list[list[tuple[int, int]]]:
    """Rule 3's waits: each task waits on the counter of every group it depends on, except groups
    whose producers all run earlier on its own SM and groups an earlier task on its SM already
    waited for (a wait on the router tiles for their logits alone does not count)."""
    pos = [0] * len(tasks)
    for q in queues:
        for i, t in enumerate(q):
            pos[t] = i
    waits: list[list[tuple[int, int]]] = [[] for _ in tasks]
    for q in queues:
        waited: set[int] = set()  # counters a task earlier on this SM waited for
        for t in q:
            needed: dict[int, None] = {}
            for p in preds[t]:
                needed.setdefault(signals[p], None)
            for cid in needed:
                c = counters[cid]
                if cid in waited or all(sm_of[p] == sm_of[t] and pos[p] < pos[t] for p in c.producers):
                    continue
                waits[t].append((cid, c.target))
            waited.update(cid for cid, _ in waits[t]
                          if not all(routing_edge(tasks[p], tasks[t]) for p in counters[cid].producers))
    return waits


def _direct_predecessors(g: nx.DiGraph, tasks: list[Task]) -> list[list[int]]:
    """Per task, its predecessors minus those that are ancestors of another predecessor (a → … →
    c → b makes a → b redundant): e.g. the next layer's residual tile needs the previous residual
    tile, but the norm between them already waited for every tile. A routing edge c → b makes
    nothing redundant (neither c nor c's ancestors count as b's: see the module doc). Ancestor sets
    are bitsets (Python ints) built in topological order. Sorted, for determinism."""
    anc = [0] * g.number_of_nodes()
    out: list[list[int]] = [[] for _ in range(g.number_of_nodes())]
    for b in nx.topological_sort(g):
        ps = list(g.predecessors(b))
        ordering = [c for c in ps if not routing_edge(tasks[c], tasks[b])]
        reach = 0
        for c in ordering:
            reach |= anc[c]
        out[b] = sorted(a for a in ps if not (reach >> a) & 1)
        for a in ordering:
            reach |= 1 << a
        anc[b] = reach
    return out


def _critical_path(g: nx.DiGraph, cost: list[float]) -> list[int]:
    best: dict[int, tuple[float, int]] = {}
    for n in nx.topological_sort(g):
        prev = max(((best[p][0], p) for p in g.predecessors(n)), default=(0.0, -1))
        best[n] = (prev[0] + cost[n], prev[1])
    if not best:
        return []
    n = max(best, key=lambda k: best[k][0])
    path = []
    while n != -1:
        path.append(n)
        n = best[n][1]
    return path[::-1]
