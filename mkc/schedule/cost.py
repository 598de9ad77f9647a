"""Cost model: predicted time of a task on one SM, from bytes and FLOPs at measured H200 ceilings.

The ceilings are the measured numbers of docs/design.md (an H200, 132 SMs). When every SM
streams at once each gets an equal share of HBM bandwidth, so a task's streaming time is its bytes
over (bandwidth / num_sms). A task's weights are immutable, so up to ``Ceilings.prefetch_bytes`` of them
are loaded before its wait completes ("prefetch before wait").

Every task also pays a fixed time that does not depend on its bytes: the counter hand-off, staging
its inputs, reductions, dependent reads of the routing. ``Ceilings.op_fixed_us`` holds it per opcode
(default ``OP_FIXED_US``), as measured from per-task timelines of the megakernel (``mkc bench
--profile``; H200, batch 1, context 8192: a task's run time minus its bytes at the per-SM bandwidth).
Small ops on the critical chain (top-k, combine, norm) are dominated by it, so without it the
scheduler would queue the attention chain behind bulky expert tiles.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from math import comb

import numpy as np

from mkc.ir.graph import Buffer, Task
from mkc.ir.ops import Opcode

# fixed time per task (µs) beyond its bytes, measured (see the module docstring); others: 1 µs.
# An expert-up tile also derives the routing and normalises its input before its stream starts; a
# GEMV tile stages the f32 residual stream. Values refitted to a later profile placed worse.
OP_FIXED_US: dict[str, float] = {
    "TOPK": 7.0,
    "ROPE_APPEND": 4.0,
    "ATTN_SPLIT": 5.0,
    "ATTN_COMBINE": 4.5,
    "LINEAR": 2.0,
    "EXPERT_SWIGLU": 6.0,
    "EXPERT_DOWN": 4.0,
    "EXPERT_DOWN_SPLIT": 4.0,  # as EXPERT_DOWN's (not yet measured on its own)
    "EXPERT_MLP": 6.0,  # as EXPERT_SWIGLU's (not yet measured on its own)
    "RESIDUAL": 2.5,
}
DEFAULT_FIXED_US = 1.0
# Fixed µs per task before its bytes stream in the shared-bandwidth simulation (simulate.py), by
# opcode (others: DEFAULT_SIM_FIXED_US): the fits of a profiled step (benchmarks/calibrate_cost.py,
# North Mini Code at batch 1 and 8K on an H200: run ≈ fixed + bytes / rate per opcode). EXPERT_DOWN
# and LM_HEAD fit below zero (their tiles stream faster than the fair share): 1.5 and 3.0.
SIM_FIXED_US: dict[str, float] = {
    "EXPERT_SWIGLU": 2.9, "EXPERT_MLP": 2.9, "LINEAR": 3.4, "SWIGLU": 1.0, "EXPERT_DOWN": 1.5, "EXPERT_DOWN_SPLIT": 1.5,
    "LM_HEAD": 3.0,
    "ATTN_SPLIT": 9.0, "ATTN_COMBINE": 3.5, "ROPE_APPEND": 2.3, "TOPK": 3.3, "RESIDUAL": 2.0, "EMBED": 3.5,
    "ARGMAX": 2.0,
}
DEFAULT_SIM_FIXED_US = 1.0


@dataclass(frozen=True, slots=True)
class Ceilings:
    read_bw: float = 4.25e12  # bytes/s, torch sum over 4 GiB on an H200
    gemv_bw: float = 3.76e12  # bytes/s, torch batch-1 GEMV
    tensor_flops: float = 790e12  # bf16 dense FLOP/s
    sms: int = 132  # SMs the bandwidth was measured over
    task_overhead: float = 0.6e-6  # s: one counter hand-off (acquire + release)
    grid_barrier: float = 0.8e-6  # s: a grid-wide counter barrier
    launch_in_graph: float = 0.5e-6  # s: kernel launch inside a CUDA graph
    # weights a task may load before its inputs are ready (prefetch before wait), credited by the
    # scheduler as overlap with the wait: the first register batch a GEMV tile issues before its
    # staging ends. Schedules made without the credit were no faster.
    prefetch_bytes: int = 96 * 1024
    # the rate (bytes/s) one attention split streams its K and V at (0: the fair per-SM share, like
    # every other task). Splits measured 12-30 GB/s against a 32 GB/s share; at the share the
    # scheduler stacked two splits of a layer on one SM at batch 4 and 8, and 16 GB/s placed better
    # at every batch. The placement is what the rate tunes, not a prediction of the split alone;
    # the planner ranks its attention-SM candidates at the share all the same (plan.py says why).
    split_bw: float = 16e9
    # fixed µs per task beyond its bytes, by opcode (others: DEFAULT_FIXED_US)
    op_fixed_us: dict[str, float] = field(default_factory=lambda: dict(OP_FIXED_US))
    # µs added to the priority (upward rank, not the predicted time) of the tasks that feed an
    # attention split (the QKV projection's tiles), so the list scheduler places them ahead of the
    # expert tiles that start with them on an SM: queued behind a long expert-up tile, one late QKV
    # tile holds back every split of its KV head. 0: rank by predicted time alone. Faster at some
    # points, slower at others: `mkc bench --tune` times it per point and plan.py applies the
    # recorded choice (configs/tuning/h200.json).
    attention_inputs_first_us: float = 0.0
    # Spread a layer's tiles of one op over SMs (scheduler.py, rule 2): a tile whose SM already
    # holds a sibling goes to the first SM without one that can start it before it would end there.
    # Tuned per point, as attention_inputs_first_us.
    spread_siblings: bool = False
    # With attention_inputs_first_us, the attention splits themselves take the raise too, so the
    # list scheduler places each split (and, through the rank, its inputs) ahead of the expert tiles
    # instead of queueing it behind one. Tuned per point, as attention_inputs_first_us.
    splits_first: bool = False
    # The shared-bandwidth simulation (simulate.py), by which the planner ranks attention-SM counts:
    # the most one SM streams at (bytes/s) when few others do, an attention split's most, the
    # time from a producer's end to its consumer's start, and the fixed µs per task by opcode.
    # Checked against North Mini Code's measured steps (configs/tuning/h200.json, each entry's time
    # of every count): these caps pick the fastest count at 9 of 11 points. A saturation curve
    # fitted to a direct per-SM measurement (benchmarks/sm_stream.py) put the measured steps no
    # nearer, so the caps stay.
    sm_stream_cap: float = 60e9
    split_stream_cap: float = 40e9
    sim_hop: float = 0.8e-6
    sim_fixed_us: dict[str, float] = field(default_factory=lambda: dict(SIM_FIXED_US))


H200 = Ceilings()
# An H100 (80 GB HBM3, 132 SMs): its read bandwidth as mkc bench measures it (torch sum over 4
# GiB); the rest as the H200's, whose Hopper SMs it shares. The simulation of the schedules
# planned for the H200 at this bandwidth put the H100's measured steps within 1.8%. Only the
# prediction uses it (mkc compile --gpu h100); placement and the tuning table stay the H200's.
H100 = Ceilings(read_bw=3.05e12)
# the GPUs mkc compile predicts a step for, by the name --gpu takes
GPUS: dict[str, Ceilings] = {"h200": H200, "h100": H100}


def gpu_name(device_name: str) -> str:
    """The name in GPUS of a device as CUDA names it ("NVIDIA H100 80GB HBM3": h100); h200 otherwise."""
    return "h100" if "H100" in device_name.upper() else "h200"


# the opcodes whose tiles read the weights of their routing slot's expert (their "slot" argument):
# slot j runs the j-th distinct expert the step routed to, and nothing when it routed to j or fewer
SLOT_OPS = (Opcode.EXPERT_SWIGLU, Opcode.EXPERT_DOWN, Opcode.EXPERT_MLP, Opcode.EXPERT_DOWN_SPLIT)


def live_slot_probability(num_experts: int, top_k: int, batch: int) -> np.ndarray:
    """P(slot j is live) for j < min(num_experts, batch * top_k): the probability that ``batch``
    tokens, each routed to ``top_k`` distinct experts drawn uniformly, route to more than j
    distinct experts in all (exact: the distribution of the distinct count, token by token)."""
    if not 0 < top_k <= num_experts or batch < 1:
        raise ValueError(f"live_slot_probability: top_k = {top_k} of {num_experts} experts at batch {batch}: "
                         f"expected 0 < top_k <= num_experts and batch >= 1")
    p = np.zeros(num_experts + 1)  # p[d]: the probability of d distinct experts so far
    p[0] = 1.0
    ways = comb(num_experts, top_k)
    for _ in range(batch):
        q = np.zeros_like(p)
        for d in np.nonzero(p)[0]:
            for new in range(max(0, top_k - d), min(top_k, num_experts - d) + 1):
                q[d + new] += p[d] * comb(num_experts - d, new) * comb(d, top_k - new) / ways
        p = q
    live = 1.0 - np.cumsum(p)  # live[j] = P(distinct > j)
    return np.clip(live[:min(num_experts, batch * top_k)], 0.0, 1.0)


def expected_weight_bytes(tasks: list[Task], buffers: dict[str, Buffer], batch: int) -> list[float]:
    """Each task's weight bytes on average over random routing: a routing slot's expert tile's
    times live_slot_probability of its slot, every other task's as they are. The top-k is the
    width of the layer's TOPK task's ``selected`` ([batch, top_k]); a layer without a TOPK task
    counts every slot live. North Mini Code at batch 8: 51.6 of 64 slots live on average, at batch
    4 29.1 of 32, at batch 2 15.5 of 16, at batch 1 all 8."""
    top_k = {t.layer: buffers[t.operand("selected")].shape[-1] for t in tasks if t.op is Opcode.TOPK}
    live: dict[tuple[int, int], np.ndarray] = {}
    out = []
    for t in tasks:
        weights = float(t.weight_bytes)
        if t.op in SLOT_OPS and t.layer in top_k:
            key = (buffers[t.operand("weight")].shape[0], top_k[t.layer])
            if key not in live:
                live[key] = live_slot_probability(*key, batch)
            slot = t.arg("slot")
            weights *= float(live[key][slot]) if slot < len(live[key]) else 0.0
        out.append(weights)
    return out


def task_time(t: Task, num_sms: int, c: Ceilings = H200) -> float:
    """Seconds for task t on one SM while all num_sms SMs stream."""
    per_sm_bw = c.read_bw / max(num_sms, 1)
    if c.split_bw and t.op.name == "ATTN_SPLIT":
        per_sm_bw = min(per_sm_bw, c.split_bw)
    per_sm_flops = c.tensor_flops / c.sms
    fixed = c.op_fixed_us.get(t.op.name, DEFAULT_FIXED_US) * 1e-6
    return max((t.weight_bytes + t.act_bytes) / per_sm_bw, t.flops / per_sm_flops) + fixed


def prefetchable_time(t: Task, num_sms: int, c: Ceilings = H200) -> float:
    """The part of task_time that can run before the task's inputs are ready."""
    return min(t.weight_bytes, c.prefetch_bytes) / (c.read_bw / max(num_sms, 1))


@dataclass(frozen=True, slots=True)
class OpFit:
    """Measured run times of one opcode's tasks against their bytes: run ≈ fixed + bytes / rate."""

    tasks: int
    mean_us: float  # mean measured run time
    fixed_us: float  # fitted time at zero bytes
    gbps: float  # fitted per-task streaming rate (GB/s); NaN when every task moves the same bytes
    predicted_us: float  # mean of task_time over the same tasks (the model in use)


def fit_run_line(nbytes: np.ndarray, run_us: np.ndarray, fair_bytes_per_us: float) -> tuple[float, float]:
    """(fixed µs, GB/s) of the least-squares line run ≈ fixed + bytes / rate through tasks of one
    opcode; where they all read the same bytes, their mean run less those bytes at the fair per-SM
    share ``fair_bytes_per_us`` (the rate unknown: NaN)."""
    if len(nbytes) > 1 and np.ptp(nbytes) > 0:
        slope, fixed = np.polyfit(nbytes, run_us, 1)
        return float(fixed), 1e-3 / slope if slope > 0 else float("inf")  # bytes per µs → GB/s
    return float(run_us.mean() - nbytes.mean() / fair_bytes_per_us), float("nan")


def fit_op_costs(tasks: list[Task], run_us, num_sms: int, c: Ceilings = H200) -> dict[str, OpFit]:
    """Per opcode, a least-squares line through (bytes, measured run time) of its tasks, beside
    the cost model's prediction: how to re-measure ``OP_FIXED_US`` from a profiled step
    (benchmarks/calibrate_cost.py). ``run_us[i]`` is task i's measured run time (µs)."""
    run = np.asarray(run_us, dtype=np.float64)
    by_op: dict[str, list[int]] = {}
    for t in tasks:
        by_op.setdefault(t.op.name, []).append(t.id)
    out = {}
    for op, ids in by_op.items():
        x = np.array([tasks[i].weight_bytes + tasks[i].act_bytes for i in ids], dtype=np.float64)
        y = run[ids]
        fixed, gbps = fit_run_line(x, y, c.read_bw / num_sms / 1e6)
        out[op] = OpFit(tasks=len(ids), mean_us=float(y.mean()), fixed_us=float(fixed), gbps=float(gbps),
                        predicted_us=float(np.mean([task_time(tasks[i], num_sms, c) for i in ids]) * 1e6))
    return out
