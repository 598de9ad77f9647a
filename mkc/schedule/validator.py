"""The validator: proves, from a ``Schedule`` alone, that one decode step cannot deadlock or race.

Contract. ``validate(sc)`` returns the list of ``Problem``s it found (empty = safe); ``check(sc)``
raises ``ScheduleError`` carrying that list. Neither mutates the schedule, neither raises on a
malformed schedule (a malformation is a problem), and only the file's contents are used: tasks
with their regions, queues, waits, signals and counters, never ``Program.graph``, so ``mkc check``
on a ``schedule.json`` proves exactly what ``mkc compile`` proved. Task ids are program order: the
lowering's sequential semantics is the specification every schedule must implement.

What is proved, in the order it is checked (each problem names its tasks, counters and buffers):

1. Structure ("structure", "counter", "region", "coverage"): task ids are 0..n-1; every task is in
   exactly one queue exactly once; every signalled and waited counter exists; every waited counter
   has producers; every counter's target, and every wait's target, equals the number of tasks that
   signal it (a counter cannot tell its producers apart, so a lower target is a partial join that
   lets a waiter pass before some producer has finished, and a higher one never completes); every
   region names an existing buffer, has its rank and lies inside its shape; no task writes a
   weight (weights are prefetched before waits); every operand buffer is covered by a declared
   region and every region's buffer is an operand.
2. Happens-before ("cycle", "deadlock"): the HB graph has an edge between consecutive tasks of a
   queue, and for each counter a node with an edge from each producer and to each waiter (only for
   waits whose target covers every producer). A cycle is reported as ``a → b → a``. Deadlock
   freedom is proved by simulating the queues against the counters for one step: every SM runs its
   queue in order, a task runs once each of its waits is met. Counters only grow, so running a
   ready task never disables another: if any interleaving completes, this one does, and if it
   sticks, every interleaving sticks (the blocked head of each stuck SM is reported).
3. Ordering ("race", "order"): for every pair of tasks a < b whose regions overlap on a non-weight
   buffer with at least one write (``conflicts``), a must happen-before b. A routing wait (an
   expert-up tile's wait on a counter whose producers all write its router logits, which a kernel
   may meet by reading the logits' tagged copy: schedule.py) is no HB edge: it orders those
   producers' writes of the logits before the tile's read of them, and nothing else. No HB path is a
   race; a path only from b to a runs the pair against program order (e.g. a consumer moved before
   its producer on one SM), which computes the wrong value even though it is not a race. Vector
   clocks make this fast: ``vc[t, s]`` is the last queue position on SM s that happens-before t
   (queues are chains), so a → b iff ``vc[b, sm(a)] >= pos(a)``.
4. Resources ("resources"): the grid (one persistent CTA per queue, occupancy 1) is at most
   ``num_sms`` (and the device's SM count, if given), so every CTA is co-resident and a spinning
   CTA cannot starve an unscheduled one; shared memory and registers per CTA are within limits.

One step is proved. Steps are separated by kernel launches, so counters with monotonic targets
(``target * s``) behave as in the single-step simulation.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from itertools import pairwise

import networkx as nx
import numpy as np

from mkc.ir.graph import KINDS, Region, conflicts
from mkc.ir.ops import OP_INFO
from mkc.schedule.schedule import Schedule, logits_operand, routing_edge

MAX_REGS_PER_THREAD = 255  # sm_90 architectural limit
MAX_THREADS_PER_CTA = 1024
_SHOW = 3  # names listed before "and N more"


@dataclass(frozen=True, slots=True)
class Problem:
    kind: str  # structure | counter | region | coverage | cycle | deadlock | race | order | resources
    message: str  # names the tasks (name and op), counters and buffers involved
    tasks: tuple[int, ...] = ()  # task ids involved
    counters: tuple[int, ...] = ()  # counter ids involved
    buffers: tuple[str, ...] = ()  # buffer names involved

    def __str__(self) -> str:
        return f"{self.kind}: {self.message}"


class ScheduleError(Exception):
    """A schedule is unsafe; ``problems`` lists every reason found."""

    def __init__(self, problems: list[Problem], shown: int = 20):
        self.problems = problems
        lines = [str(p) for p in problems[:shown]]
        if len(problems) > shown:
            lines.append(f"... and {len(problems) - shown} more")
        super().__init__(f"{len(problems)} problem(s):\n  " + "\n  ".join(lines))


def check(sc: Schedule, **kw) -> None:
    """Raise ScheduleError unless ``validate(sc, **kw)`` finds nothing."""
    problems = validate(sc, **kw)
    if problems:
        raise ScheduleError(problems)


def check_resources(sc: Schedule, *, smem_bytes: int, regs: int, threads: int, max_smem: int = 227 * 1024,
                    max_regs: int = 65536) -> None:
    """Duty 4 alone, once the kernel is built: raise ScheduleError if one persistent CTA per queue
    cannot be resident (shared memory, registers, threads). The rest is ``check``'s."""
    v = _Validator(sc)
    v.resources(smem_bytes, regs, max_smem, max_regs, threads, None)
    if v.problems:
        raise ScheduleError(v.problems)


def validate(sc: Schedule, *, smem_bytes: int | None = None, regs: int | None = None,
             max_smem: int = 227 * 1024, max_regs: int = 65536, threads: int | None = None,
             device_sms: int | None = None) -> list[Problem]:
    """Every problem of the schedule (empty = safe). ``smem_bytes`` and ``regs`` (per thread, with
    ``threads`` per CTA) are the kernel's; ``device_sms`` is the SM count of the GPU it will run on.
    Raises ValueError only for a bad call (``regs`` without ``threads``)."""
    if regs is not None and threads is None:
        raise ValueError("validate(regs=...) needs threads= (threads per CTA) to check registers per SM")
    v = _Validator(sc)
    v.resources(smem_bytes, regs, max_smem, max_regs, threads, device_sms)
    if not v.tables():
        return v.problems
    placed = v.placement()
    v.counters()
    regions_ok = v.regions()
    if placed:
        order = v.hb_order()
        v.simulate()
        if order is not None and regions_ok:
            v.ordering(order)
    return v.problems


class _Validator:
    def __init__(self, sc: Schedule):
        self.sc = sc
        self.problems: list[Problem] = []
        n = len(sc.tasks)
        self.sm = [-1] * n  # SM of each task
        self.pos = [-1] * n  # position in its queue
        self.cidx: dict[int, int] = {}  # counter id → index in sc.counters
        self.producers: dict[int, list[int]] = defaultdict(list)  # counter id → tasks signalling it

    def add(self, kind: str, message: str, tasks=(), counters=(), buffers=()) -> None:
        self.problems.append(Problem(kind, message, tuple(tasks), tuple(counters), tuple(buffers)))

    def t(self, i: int) -> str:
        task = self.sc.tasks[i]
        return f"{task.name} ({task.op.name})"

    def names(self, ids: list[int]) -> str:
        s = ", ".join(self.t(i) for i in ids[:_SHOW])
        return s + (f" and {len(ids) - _SHOW} more" if len(ids) > _SHOW else "")

    # -- 1. structure ---------------------------------------------------------------------------
    def tables(self) -> bool:
        """Per-task tables line up with the task list; ids are program positions."""
        sc, n = self.sc, len(self.sc.tasks)
        ok = True
        for name, table in (("waits", sc.waits), ("signals", sc.signals)):
            if len(table) != n:
                self.add("structure", f"{name} has {len(table)} entries for {n} tasks: expected one per task")
                ok = False
        for i, task in enumerate(sc.tasks):
            if task.id != i:
                self.add("structure", f"task {task.name} ({task.op.name}) at index {i} has id {task.id}: "
                         "ids must equal program positions", tasks=(i,))
                ok = False
        return ok

    def placement(self) -> bool:
        sc, n = self.sc, len(self.sc.tasks)
        seen: dict[int, list[tuple[int, int]]] = defaultdict(list)
        ok = True
        for s, q in enumerate(sc.queues):
            for p, t in enumerate(q):
                if not (isinstance(t, int) and 0 <= t < n):
                    self.add("structure", f"queue of SM {s} holds {t!r} at position {p}: "
                             f"not a task id (0..{n - 1})")
                    ok = False
                    continue
                seen[t].append((s, p))
        for t in range(n):
            where = seen.get(t, [])
            if not where:
                self.add("structure", f"{self.t(t)} is in no queue: it would never run", tasks=(t,))
                ok = False
            elif len(where) > 1:
                at = ", ".join(f"SM {s} #{p}" for s, p in where)
                self.add("structure", f"{self.t(t)} is queued {len(where)} times ({at}): each task runs once",
                         tasks=(t,))
                ok = False
            else:
                self.sm[t], self.pos[t] = where[0]
        return ok

    def counters(self) -> None:
        sc = self.sc
        for i, c in enumerate(sc.counters):
            if c.id in self.cidx:
                self.add("structure", f"counter id {c.id} appears twice in the counter table",
                         counters=(c.id,))
            self.cidx.setdefault(c.id, i)
        for t, c in enumerate(sc.signals):
            if c == -1:
                continue
            if c not in self.cidx:
                self.add("counter", f"{self.t(t)} signals counter {c}, which is not in the counter table",
                         tasks=(t,), counters=(c,))
            self.producers[c].append(t)
        for c in sc.counters:
            prod = self.producers.get(c.id, [])
            if c.target != len(prod):
                why = ("it can never be reached, so its waiters deadlock" if c.target > len(prod) else
                       "a waiter could pass before every producer has finished (a partial join)")
                self.add("counter", f"counter {c.id} has target {c.target} but {len(prod)} task(s) signal it"
                         f"{' (' + self.names(prod) + ')' if prod else ''}: {why}; the target must equal "
                         "the producer count", tasks=prod, counters=(c.id,))
        for t, ws in enumerate(sc.waits):
            for c, target in ws:
                prod = self.producers.get(c, [])
                if c not in self.cidx:
                    self.add("counter", f"{self.t(t)} waits on counter {c}, which is not in the "
                             "counter table",
                             tasks=(t,), counters=(c,))
                elif not prod:
                    self.add("counter", f"{self.t(t)} waits on counter {c}, which no task signals",
                             tasks=(t,), counters=(c,))
                elif target != len(prod):
                    what = "above" if target > len(prod) else "below"
                    self.add("counter", f"{self.t(t)} waits for counter {c} to reach {target}, {what} its "
                             f"{len(prod)} producer(s) ({self.names(prod)}); counter target is "
                             f"{sc.counters[self.cidx[c]].target}", tasks=(t, *prod), counters=(c,))

    def regions(self) -> bool:
        """Regions lie inside existing buffers; operands and regions agree; weights are read-only."""
        sc, ok = self.sc, True
        shapes = {name: b.shape for name, b in sc.buffers.items()}
        for task in sc.tasks:
            t = task.id
            for mode, regs in (("reads", task.reads), ("writes", task.writes)):
                for r in regs:
                    if not _inside(r.box, shapes.get(r.buffer)):
                        self._report_region(t, mode, r)
                        ok = False
                    elif mode == "writes" and sc.buffers[r.buffer].kind == "weight":
                        self.add("region", f"{self.t(t)} writes {r}, but {r.buffer} is an immutable weight "
                                 "(weights are prefetched before waits)", tasks=(t,), buffers=(r.buffer,))
            roles = OP_INFO[task.op].operands
            if len(task.operands) != len(roles):
                self.add("coverage", f"{self.t(t)} lists {len(task.operands)} operands; {task.op.name} has "
                         f"{len(roles)} ({', '.join(roles)})", tasks=(t,))
                continue
            declared = {r.buffer for r in (*task.reads, *task.writes)}
            named = {b for b in task.operands if b != "-"}
            for role, b in zip(roles, task.operands):
                if b != "-" and b not in declared:
                    self.add("coverage", f"{self.t(t)} names {b} as its {role!r} operand but declares no "
                             "region of it", tasks=(t,), buffers=(b,))
            for b in sorted(declared - named):
                self.add("coverage", f"{self.t(t)} declares a region of {b}, which is none of its operands "
                         f"({', '.join(task.operands)})", tasks=(t,), buffers=(b,))
        return ok

    def _report_region(self, t: int, mode: str, r: Region) -> None:
        """Why region r of task t is not ``_inside`` its buffer."""
        buf = self.sc.buffers.get(r.buffer)
        if buf is None:
            self.add("region", f"{self.t(t)} {mode} {r}, but there is no buffer {r.buffer}", tasks=(t,),
                     buffers=(r.buffer,))
        elif len(r.box) != len(buf.shape):
            self.add("region", f"{self.t(t)} {mode} {r} of rank {len(r.box)}, but {r.buffer} has shape "
                     f"{list(buf.shape)}", tasks=(t,), buffers=(r.buffer,))
        else:
            self.add("region", f"{self.t(t)} {mode} {r}, outside {r.buffer} of shape {list(buf.shape)}",
                     tasks=(t,), buffers=(r.buffer,))

    # -- 4. resources ---------------------------------------------------------------------------
    def resources(self, smem: int | None, regs: int | None, max_smem: int, max_regs: int,
                  threads: int | None, device_sms: int | None) -> None:
        grid = len(self.sc.queues)
        for sms, what in ((self.sc.num_sms, "the schedule's num_sms"), (device_sms, "the device's SM count")):
            if sms is not None and grid > sms:
                self.add("resources", f"more CTAs than SMs: {grid} queues (persistent CTAs) but {what} is "
                         f"{sms}; CTAs that are not co-resident can deadlock against spinning ones")
        if smem is not None and smem > max_smem:
            self.add("resources", f"{smem} bytes of shared memory per CTA, above the {max_smem} available: "
                     "the kernel cannot launch at occupancy 1")
        if threads is not None and threads > MAX_THREADS_PER_CTA:
            self.add("resources", f"{threads} threads per CTA, above the limit of {MAX_THREADS_PER_CTA}")
        if regs is not None and threads is not None:
            if regs > MAX_REGS_PER_THREAD:
                self.add("resources", f"{regs} registers per thread, above the limit of "
                         f"{MAX_REGS_PER_THREAD}")
            if regs * threads > max_regs:
                self.add("resources", f"{regs} registers x {threads} threads = {regs * threads} per CTA, "
                         f"above the {max_regs} of one SM: the kernel cannot launch at occupancy 1")

    # -- 2. happens-before: deadlock and cycles -------------------------------------------------
    def _ordering_waits(self, t: int) -> list[int]:
        """Counter ids whose wait orders every producer before t (the target covers them all),
        routing waits excepted."""
        out = []
        for c, target in self.sc.waits[t]:
            prod = self.producers.get(c)
            if c in self.cidx and prod and target >= len(prod) and c not in out and not self._routing_wait(c, t):
                out.append(c)
        return out

    def _routing_wait(self, c: int, t: int) -> bool:
        """t's wait on counter c is a routing wait (schedule.py): every producer writes t's logits."""
        prod = self.producers.get(c)
        return bool(prod) and all(routing_edge(self.sc.tasks[p], self.sc.tasks[t]) for p in prod)

    def _routed(self, a: int, b: int, buf: str) -> bool:
        """b's routing wait orders a's write of b's router logits ``buf`` before b reads it."""
        tb, c = self.sc.tasks[b], self.sc.signals[a]
        return (routing_edge(self.sc.tasks[a], tb) and buf == logits_operand(tb)
                and any(w == c and n >= len(self.producers.get(c, ())) for w, n in self.sc.waits[b])
                and self._routing_wait(c, b))

    def simulate(self) -> None:
        """Run every queue in order against the counters (one step); report each stuck SM."""
        sc = self.sc
        count: dict[int, int] = defaultdict(int)
        head = [0] * len(sc.queues)
        blocked: dict[int, list[tuple[int, int]]] = defaultdict(list)  # counter → (sm, target)
        work = list(range(len(sc.queues)))
        while work:
            s = work.pop()
            q = sc.queues[s]
            while head[s] < len(q):
                t = q[head[s]]
                unmet = next(((c, n) for c, n in sc.waits[t] if count[c] < n), None)
                if unmet is not None:
                    blocked[unmet[0]].append((s, unmet[1]))
                    break
                head[s] += 1
                c = sc.signals[t]
                if c != -1:
                    count[c] += 1
                    if blocked.get(c):
                        woken = [b for b in blocked[c] if count[c] >= b[1]]
                        blocked[c] = [b for b in blocked[c] if count[c] < b[1]]
                        work.extend(b[0] for b in woken)
        ran = {t for s, q in enumerate(sc.queues) for t in q[:head[s]]}
        for s, q in enumerate(sc.queues):
            if head[s] == len(q):
                continue
            t = q[head[s]]
            waits = [(c, n) for c, n in sc.waits[t] if count[c] < n]
            parts, involved = [], []
            for c, n in waits:
                pending = [p for p in self.producers.get(c, []) if p not in ran]
                involved += pending[:_SHOW]
                if pending:
                    why = f"not run: {self.names(pending)}"
                else:
                    why = "every producer has run" if self.producers.get(c) else "no task signals it"
                parts.append(f"counter {c} (at {count[c]} of {n}; {why})")
            self.add("deadlock", f"SM {s} is stuck at {self.t(t)} (#{head[s]} of {len(q)}) waiting for "
                     + " and ".join(parts), tasks=(t, *involved), counters=tuple(c for c, _ in waits))

    def hb_order(self) -> list[int] | None:
        """A topological order of the HB graph over tasks (ids) and counters (-1 - counter index),
        or None after reporting the cycles it has."""
        sc, n = self.sc, len(self.sc.tasks)
        nc = len(sc.counters)
        succ: list[list[int]] = [[] for _ in range(n + nc)]  # counter index k is node n + k
        indeg = [0] * (n + nc)
        for q in sc.queues:
            for a, b in pairwise(q):
                succ[a].append(b)
                indeg[b] += 1
        for t, c in enumerate(sc.signals):
            if c in self.cidx:
                succ[t].append(n + self.cidx[c])
                indeg[n + self.cidx[c]] += 1
        for t in range(n):
            for c in self._ordering_waits(t):
                succ[n + self.cidx[c]].append(t)
                indeg[t] += 1
        ready = [v for v in range(n + nc) if indeg[v] == 0]
        order: list[int] = []
        while ready:
            v = ready.pop()
            order.append(v)
            for w in succ[v]:
                indeg[w] -= 1
                if indeg[w] == 0:
                    ready.append(w)
        if len(order) == n + nc:
            return [v if v < n else -1 - (v - n) for v in order]
        rest = [v for v in range(n + nc) if indeg[v] > 0]
        g = nx.DiGraph()
        g.add_edges_from((v, w) for v in rest for w in succ[v] if indeg[w] > 0)
        for comp in nx.strongly_connected_components(g):
            if len(comp) > 1 or any(g.has_edge(v, v) for v in comp):
                self._report_cycle(nx.find_cycle(g.subgraph(comp)))
        return None

    def _report_cycle(self, edges: list[tuple[int, int]]) -> None:
        n, sc = len(self.sc.tasks), self.sc
        tasks = [v for v, _ in edges if v < n]
        counters = [sc.counters[v - n].id for v, _ in edges if v >= n]
        hops = []
        for v, w in edges:
            if v < n and w < n:
                hops.append(f"{sc.tasks[w].name} follows {sc.tasks[v].name} in the queue of SM {self.sm[v]}")
            elif v >= n:
                src = next(u for u, x in edges if x == v)
                hops.append(f"{sc.tasks[w].name} waits on counter {sc.counters[v - n].id}, which "
                            f"{sc.tasks[src].name} signals")
        loop = " → ".join(sc.tasks[t].name for t in tasks + tasks[:1])
        self.add("cycle", f"{loop}: {'; '.join(hops)}", tasks=tasks, counters=counters)

    # -- 3. ordering of conflicting pairs -------------------------------------------------------
    def ordering(self, order: list[int]) -> None:
        """Every conflicting pair a < b must have a → b in the HB graph (vector clocks)."""
        sc, n = self.sc, len(self.sc.tasks)
        ns = max(len(sc.queues), 1)
        vc = np.full((n, ns), -1, dtype=np.int32)  # [task, sm] last position on sm that happens-before
        cvc = np.full((len(sc.counters), ns), -1, dtype=np.int32)  # [counter index, sm]
        prev = [-1] * n  # queue predecessor
        for q in sc.queues:
            for a, b in pairwise(q):
                prev[b] = a
        by_counter = {self.cidx[c]: p for c, p in self.producers.items() if c in self.cidx}  # index → tasks
        waits = [[self.cidx[c] for c in self._ordering_waits(t)] for t in range(n)]
        for v in order:
            if v < 0:
                k = -1 - v
                if k in by_counter:
                    cvc[k] = vc[by_counter[k]].max(axis=0)
                continue
            row = vc[v]
            if prev[v] >= 0:
                row[:] = vc[prev[v]]
            for k in waits[v]:
                np.maximum(row, cvc[k], out=row)
            row[self.sm[v]] = self.pos[v]
        pairs = conflicts(sc.tasks, sc.buffers)
        if not len(pairs):
            return
        a, b = pairs.a, pairs.b
        sm, pos = np.asarray(self.sm), np.asarray(self.pos)
        fwd = vc[b, sm[a]] >= pos[a]
        bad = np.flatnonzero(~fwd)
        if not len(bad):
            return
        rev = vc[a[bad], sm[b[bad]]] >= pos[b[bad]]
        grouped: dict[tuple[int, int], list[tuple[str, str]]] = {}
        reversed_ = {}
        for i, r in zip(bad.tolist(), rev.tolist()):
            x, y = int(a[i]), int(b[i])
            buf = pairs.names[pairs.buffer[i]]
            if not r and self._routed(x, y, buf):
                continue
            grouped.setdefault((x, y), []).append((buf, KINDS[pairs.kind[i]]))
            reversed_[(x, y)] = r
        for (x, y), accesses in grouped.items():
            self._report_pair(x, y, accesses, reversed_[(x, y)])

    def _report_pair(self, a: int, b: int, accesses: list[tuple[str, str]], reverse: bool) -> None:
        ta, tb = self.sc.tasks[a], self.sc.tasks[b]
        said = []
        for buf, kind in accesses:
            mode_a, mode_b = _MODES[kind]
            ra = _overlap(getattr(ta, mode_a), getattr(tb, mode_b), buf)
            rb = _overlap(getattr(tb, mode_b), getattr(ta, mode_a), buf)
            said.append(f"{self.t(a)} {mode_a} {ra} and {self.t(b)} {mode_b} {rb}")
        what = said[0] + (f" (and {len(said) - 1} more buffer(s))" if len(said) > 1 else "")
        bufs = tuple(dict.fromkeys(buf for buf, _ in accesses))
        where = f"SM {self.sm[a]} #{self.pos[a]}, SM {self.sm[b]} #{self.pos[b]}"
        if reverse:
            self.add("order", f"{what}, but {tb.name} happens before {ta.name} ({where}): program order "
                     f"needs {ta.name} first", tasks=(a, b), buffers=bufs)
            return
        c = self.sc.signals[a]
        fix = (f"{tb.name} needs a wait on counter {c}, which {ta.name} signals" if c != -1
               else f"{ta.name} signals no counter")
        self.add("race", f"{what} with no happens-before (no counter wait or same-SM order; {where}): {fix}",
                 tasks=(a, b), counters=(c,) if c != -1 else (), buffers=bufs)


def _inside(box: tuple[tuple[int, int], ...], shape: tuple[int, ...] | None) -> bool:
    """The box has the shape's rank and lies inside it (False for a missing buffer's None)."""
    if shape is None or len(box) != len(shape):
        return False
    for (lo, hi), n in zip(box, shape):
        if not 0 <= lo <= hi <= n:
            return False
    return True


_MODES = {"RAW": ("writes", "reads"), "WAR": ("reads", "writes"), "WAW": ("writes", "writes")}


def _overlap(mine: tuple[Region, ...], theirs: tuple[Region, ...], buf: str) -> Region:
    """My region on ``buf`` that overlaps one of theirs (the first on ``buf`` if none does)."""
    own = [r for r in mine if r.buffer == buf]
    return next((r for r in own if any(r.overlaps(o) for o in theirs)), own[0])
