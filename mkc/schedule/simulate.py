"""A scheduled step replayed under shared memory bandwidth: how long it takes, by task.

The list scheduler (scheduler.py) places each task with a fixed share of the GPU's bandwidth,
``read_bw / num_sms``, whatever else runs at that moment; its predicted step is what placement
ranks by, not a forecast (North Mini Code at batch 1 and 8K: 2805 µs predicted, 2374 measured).
Here the schedule's queues run as they are, and the SMs that stream at any moment share the read
bandwidth, max-min fair: each gets an equal share, at most ``Ceilings.sm_stream_cap`` (an
attention split at most ``split_stream_cap``: its chunks wait on their softmax), and what a capped
SM leaves goes to the others. So the tail of a layer, where few SMs still stream, runs each of them
faster, as profiles show (expert-down tiles 52 GB/s against a 32 GB/s share). Each task first
spends its opcode's fixed time (``cost.SIM_FIXED_US``: staging, routing, reductions), then streams its
bytes, and starts once the task before it on its SM has ended and every producer it waits for has
ended ``Ceilings.sim_hop`` earlier.

A routing slot's expert tiles read their expert's weights only when the step routes to at least as
many distinct experts as the slot's number (slot j runs the j-th distinct expert; the tiles of the
slots beyond do their routing and end). Which slots are live is known only at run time, so each
expert tile streams its weights times the probability that its slot is live when every token picks
its top-k experts uniformly at random (cost.expected_weight_bytes): North Mini Code at batch 8
routes 51.6 distinct experts of its 64 slots on average, at batch 4 29.1 of 32, at batch 2 15.5 of
16, as random weights do (the speed-of-light bytes of the steps measured at batch 8 agree: 30.4 GB,
30.5 expected). Counting every slot's bytes put the simulated step at batch 8 and 8K 16% above the
measured one; with the expected bytes, 4.9%.

The planner ranks its attention-SM counts and the global layers' splits by this where nothing was
measured (plan.py: choose_attention_sms, choose_global_attention_sms), since the list scheduler's
own prediction ranked the counts wrong at most measured points; mkc compile reports its step and
timeline (predict). Against North Mini Code's measured steps on an H200 (the shipped schedules of
configs/tuning/h200.json): within 5% at every point (batch 1, 2, 4 and 8 at 8K, 32K and 128K;
mean 2.5%, the largest 4.9% high at batch 8 and 8K), where the list scheduler's prediction is
17-44% high. Effects under ~3% it
does not rank reliably: of the tuner's 37 decisions timed in h200.json after the attention-SM count
(raise, spread, layer end, global splits), it picks the measured fastest option at 19, as the list
scheduler does.
"""

from __future__ import annotations

import numpy as np

from mkc.schedule.cost import DEFAULT_SIM_FIXED_US, GPUS, H200, Ceilings, expected_weight_bytes
from mkc.schedule.profile import blockers
from mkc.schedule.schedule import Schedule
from mkc.schedule.stages import stage


def fair_rates(caps: np.ndarray, total: float) -> np.ndarray:
    """Max-min fair shares of ``total`` among streams each capped at ``caps``."""
    rates = np.empty(len(caps))
    left, n = total, len(caps)
    for i, j in enumerate(np.argsort(caps, kind="stable")):
        rates[j] = min(caps[j], left / (n - i))
        left -= rates[j]
    return rates


# what an SM that does not stream is doing, for simulate's ``unused`` (by the stage of its task)
FIXED_TIME, WAITING, FINISHED, AT_CAP = "fixed time", "waiting for inputs", "finished", "streams at their caps"
# an SM's phase in simulate: waiting for its task's inputs, in its fixed time, streaming, queue done
_WAIT, _FIXED, _STREAM, _DONE = range(4)


def simulate(sc: Schedule, c: Ceilings = H200,
             unused: dict[tuple[str, str], float] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(start, end) of every task in µs, by task id, for the schedule's queues under shared
    bandwidth (module doc). With ``unused``, adds to it the bandwidth the step leaves unused, in µs
    of the whole read bandwidth, by what the SMs that do not stream are doing: the unused share of
    each moment split evenly between them, keyed (stage, FIXED_TIME) for an SM in its task's fixed
    time, (stage, WAITING) for one whose task waits for its inputs (stages.stage: the task's op
    within its layer, such as qkv or o_proj), ("", FINISHED) for one whose queue is done; ("",
    AT_CAP) where every SM streams, each at its cap."""
    tasks = sc.tasks
    n, sms = len(tasks), len(sc.queues)
    producers, _ = blockers(sc)
    succs: list[list[int]] = [[] for _ in range(n)]
    pending = np.zeros(n, dtype=np.int64)
    for t in range(n):
        ps = set(producers[t])
        pending[t] = len(ps)
        for p in ps:
            succs[p].append(t)
    ready_at = np.zeros(n)
    weights = expected_weight_bytes(tasks, sc.buffers, sc.batch)
    mb = np.array([w + t.act_bytes for w, t in zip(weights, tasks)]) / 1e6  # MB; rates in MB/µs
    fixed = np.array([c.sim_fixed_us.get(t.op.name, DEFAULT_SIM_FIXED_US) for t in tasks])
    cap = np.array([c.split_stream_cap if t.op.name == "ATTN_SPLIT" else c.sm_stream_cap for t in tasks]) / 1e12
    total, hop = c.read_bw / 1e12, c.sim_hop * 1e6
    phase = np.full(sms, _WAIT)
    cur = np.full(sms, -1)
    pos = np.zeros(sms, dtype=np.int64)
    fixed_end = np.full(sms, np.inf)
    left = np.zeros(sms)
    start, end = np.zeros(n), np.zeros(n)
    for s in range(sms):
        if sc.queues[s]:
            cur[s] = sc.queues[s][0]
        else:
            phase[s] = _DONE
    now, eps = 0.0, 1e-9
    while True:
        for s in np.nonzero(phase == _WAIT)[0]:
            t = cur[s]
            if pending[t] == 0 and ready_at[t] <= now + eps:
                phase[s], start[t], fixed_end[s] = _FIXED, now, now + fixed[t]
        if (phase == _DONE).all():
            return start, end
        streaming = np.nonzero(phase == _STREAM)[0]
        rate = fair_rates(cap[cur[streaming]], total) if len(streaming) else np.zeros(0)
        nxt = min([fixed_end[phase == _FIXED].min()] if (phase == _FIXED).any() else [np.inf])
        if len(streaming):
            nxt = min(nxt, now + float((left[streaming] / rate).min()))
        waiting = [cur[s] for s in np.nonzero(phase == _WAIT)[0] if pending[cur[s]] == 0]
        if waiting:
            nxt = min(nxt, float(ready_at[waiting].min()))
        if nxt == np.inf:  # the validator rejects such a schedule; say which tasks never start
            stuck = sorted(tasks[cur[s]].name for s in np.nonzero(phase == _WAIT)[0])[:4]
            raise ValueError(f"simulate: no task can start (waiting forever: {', '.join(stuck)})")
        if len(streaming):
            left[streaming] -= rate * (nxt - now)
        if unused is not None and nxt > now:
            _add_unused(unused, (total - float(rate.sum())) / total * (nxt - now), phase, cur, tasks)
        now = nxt
        for s in np.nonzero((phase == _FIXED) & (fixed_end <= now + eps))[0]:
            phase[s], left[s], fixed_end[s] = _STREAM, mb[cur[s]], np.inf
        for s in np.nonzero((phase == _STREAM) & (left <= eps))[0]:
            t = cur[s]
            end[t] = now
            for u in succs[t]:
                pending[u] -= 1
                ready_at[u] = max(ready_at[u], now + hop)
            pos[s] += 1
            if pos[s] < len(sc.queues[s]):
                cur[s], phase[s] = sc.queues[s][pos[s]], _WAIT
            else:
                phase[s] = _DONE


def _add_unused(unused: dict[tuple[str, str], float], lost: float, phase: np.ndarray, cur: np.ndarray,
                tasks) -> None:
    """simulate's accounting of ``lost`` µs of unused bandwidth over one interval."""
    if lost <= 1e-12:
        return
    idle = np.nonzero(phase != _STREAM)[0]
    if not len(idle):
        unused[("", AT_CAP)] = unused.get(("", AT_CAP), 0.0) + lost
        return
    share = lost / len(idle)
    for s in idle:
        key = ((stage(tasks[cur[s]]), FIXED_TIME) if phase[s] == _FIXED else
               (stage(tasks[cur[s]]), WAITING) if phase[s] == _WAIT else ("", FINISHED))
        unused[key] = unused.get(key, 0.0) + share


def simulated_step_us(sc: Schedule, c: Ceilings = H200) -> float:
    """The step's span in µs under shared bandwidth (simulate), with the launch."""
    _, end = simulate(sc, c)
    return float(end.max(initial=0.0)) + c.launch_in_graph * 1e6


def predict(sc: Schedule, gpu: str = "h200") -> Schedule:
    """Put the simulation's timeline in ``sc.predicted`` (start_us, end_us, step_us, sm_busy_us), in
    place of the list scheduler's estimate, whose step stays as ``placement_step_us``: what mkc
    compile reports and its trace shows, and ``unused_bandwidth_us``: the read bandwidth the step
    leaves unused, in µs, by stage and what its SMs do instead (simulate's ``unused``), largest
    first; ``simulated_on``: the GPU (``gpu``, a name of cost.GPUS, whose ceilings it is simulated
    at) and its read bandwidth, which the speed-of-light fraction is then taken against. The queues,
    counters and critical path are unchanged. Returns ``sc``."""
    c = GPUS[gpu]
    unused: dict[tuple[str, str], float] = {}
    start, end = simulate(sc, c, unused)
    p = sc.predicted
    p["simulated_on"] = {"gpu": gpu, "read_bw": c.read_bw}
    p.setdefault("placement_step_us", p.get("step_us"))
    p["start_us"] = [round(float(x), 3) for x in start]
    p["end_us"] = [round(float(x), 3) for x in end]
    p["step_us"] = round(float(end.max(initial=0.0)) + c.launch_in_graph * 1e6, 3)
    busy = np.zeros(len(sc.queues))
    for s, q in enumerate(sc.queues):
        busy[s] = float(sum(end[t] - start[t] for t in q))
    p["sm_busy_us"] = [round(float(x), 3) for x in busy]
    p["unused_bandwidth_us"] = [{"stage": name, "state": state, "us": round(float(us), 3)}
                                for (name, state), us in sorted(unused.items(), key=lambda kv: -kv[1])]
    p["timeline"] = "shared-bandwidth simulation (mkc/schedule/simulate.py)"
    return sc
