"""Cost model: predicted time of a task on one SM, from bytes and FLOPs at measured H200 ceilings.

The ceilings are the measured numbers of DESIGN.md (H200, 132 SMs, 2026-11-29). When every SM
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
# Re-measured 2026-11-29 22:20 UTC on the kernel with in-task RMSNorm and routing (batch 1: run time
# minus bytes at the per-SM bandwidth): an expert-up tile also derives the routing and normalises
# its input before its stream starts; a GEMV tile stages the f32 residual stream. The values fitted
# to the profile of 2026-11-30 09:37 UTC (expert-down 0, LINEAR 0.5, expert-up 4.5, TOP_K 4) placed
# worse: batch 1 +4.7% (benchmarks/schedule_variants.py --variants refit, BENCHMARKS.md), so these stay.
OP_FIXED_US: dict[str, float] = {
    "TOPK": 7.0,
    "ROPE_APPEND": 4.0,
    "ATTN_SPLIT": 5.0,
    "ATTN_COMBINE": 4.5,
    "LINEAR": 2.0,
    "EXPERT_SWIGLU": 6.0,
    "EXPERT_DOWN": 4.0,
    "EXPERT_MLP": 6.0,  # as EXPERT_SWIGLU's (not yet measured on its own)
    "RESIDUAL": 2.5,
}
DEFAULT_FIXED_US = 1.0
# Fixed µs per task before its bytes stream in the shared-bandwidth simulation (simulate.py), by
# opcode (others: DEFAULT_SIM_FIXED_US): the fits of a profiled step (benchmarks/calibrate_cost.py
# over North Mini Code at batch 1 and 8K on an H200, the profile of 2026-12-05 01:59 UTC: run ≈
# fixed + bytes / rate per opcode). EXPERT_DOWN and LM_HEAD fit below zero there (their tiles
# stream faster than the fair share the fit assumes): 1.5 and 3.0.
SIM_FIXED_US: dict[str, float] = {
    "EXPERT_SWIGLU": 2.9, "EXPERT_MLP": 2.9, "LINEAR": 3.4, "SWIGLU": 1.0, "EXPERT_DOWN": 1.5, "LM_HEAD": 3.0,
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
    # scheduler as overlap with the wait. A profiled step suggests the credit is optimistic, yet
    # schedules made without it were no faster (benchmarks/schedule_variants.py, 2026-11-30, with
    # the kernel's 128 KB L2 prefetch then on; BENCHMARKS.md). Since then the kernel asks L2 for one
    # row only (CodegenOptions.prefetch_bytes): the credit stands for the first weight batch, issued
    # before the staging finishes, and is to be re-measured against that kernel.
    prefetch_bytes: int = 96 * 1024
    # the rate (bytes/s) one attention split streams its K and V at (0: the fair per-SM share, like
    # every other task). Profiles on an H200 (2026-11-30, BENCHMARKS.md) measured 12-20 GB/s per
    # split against a 32 GB/s share: a chunk's loads wait for the softmax of the chunk before. At
    # the share, the scheduler stacked two splits of a layer on one SM at batch 4 and 8; at 16 GB/s
    # it does not, and the step measured -1.6% / -5.1% / +2.1% / -5.6% at batch 1 / 2 / 4 / 8
    # (benchmarks/schedule_variants.py, 03:57 UTC, attention splits rotating their own query).
    # The warp splits (CodegenOptions.attn_warp_stages) stream faster (fits of 26-30 GB/s), yet
    # 16 GB/s still places better: the share measured +2.5% / +2.2% / +0.3% / +10.8% at batch
    # 1 / 2 / 4 / 8 (schedule_variants.py, 06:29 UTC). The placement is what the rate tunes, not
    # a prediction of the split alone.
    # The planner ranks its attention-SM candidates at the share all the same (plan.py says why).
    split_bw: float = 16e9
    # fixed µs per task beyond its bytes, by opcode (others: DEFAULT_FIXED_US)
    op_fixed_us: dict[str, float] = field(default_factory=lambda: dict(OP_FIXED_US))
    # µs added to the priority (upward rank, not the predicted time) of the tasks that feed an
    # attention split (the QKV projection's tiles), so the list scheduler places them ahead of the
    # expert tiles that start with them on an SM: queued behind a long expert-up tile, one late QKV
    # tile holds back every split of its KV head. 0: rank by predicted time alone. Measured on an
    # H200 at 100 µs (benchmarks/schedule_variants.py, 2026-11-30 17:57-17:59 UTC, two rounds each,
    # µs against the default): batch 4 5719 / 5626 against 5906 / 5883 (-3.8%), batch 8 8972 / 9079
    # against 9036 / 9061 (a tie), batch 2 3619 / 3618 against 3565 / 3579 (+1.3%); batch 1's
    # schedule does not change. Off here; `mkc bench --tune` times it per point and records the
    # faster (mkc/schedule/plan.py applies a recorded one: configs/tuning/h200.json at batch 4 and 8).
    attention_inputs_first_us: float = 0.0
    # Spread a layer's tiles of one op over SMs (scheduler.py, rule 2): a tile whose SM already
    # holds a sibling goes to the first SM without one that can start it before it would end there.
    # Measured on an H200 (2026-12-01 00:23-00:24 UTC, BENCHMARKS.md; a scratch version of the same
    # rule): batch 4 -0.6% to -1.9% in five rounds, batch 2 -0.3%, batch 1 +1.7%, batch 8 mixed.
    # Off here; `mkc bench --tune` times it per point and records the faster (plan.py applies it).
    spread_siblings: bool = False
    # With attention_inputs_first_us, the attention splits themselves take the raise too, so the
    # list scheduler places each split (and, through the rank, its inputs) ahead of the expert tiles
    # instead of queueing it behind one. Measured on an H200 (benchmarks/schedule_variants.py,
    # 2026-12-01 05:05 UTC, two rounds, µs against the shipped schedule): batch 8 8584.8 / 8575.9
    # against 8738.8 / 8682.7 (-1.5%); batch 4 5422.7 / 5478.8 against 5390.4 / 5409.2 with the
    # shipped spread (+1.0%). Off here; `mkc bench --tune` times it per point and records the
    # faster (plan.py applies a recorded one).
    splits_first: bool = False
    # The shared-bandwidth simulation (simulate.py), by which the planner ranks attention-SM counts:
    # the most one SM streams at (bytes/s) when few others do, an attention split's most, the
    # time from a producer's end to its consumer's start, and the fixed µs per task by opcode.
    # Checked against North Mini Code's measured steps on an H200 (configs/tuning/h200.json, each
    # entry's time of every count; plan.py): caps of 60 / 40 GB/s pick the fastest count at 9 of 11
    # points, as 45 / 35, 80 / 40 and 60 / 60 do, and put the profiled batch-1 step at 8K (2374 µs
    # on 2026-12-05) at 2305 µs, where the list scheduler's prediction says 2805. Measured directly
    # on an H100 (benchmarks/sm_stream.py, 2026-12-05 19:10-19:36 UTC, BENCHMARKS.md): an SM among 8
    # to 32 that stream reads 45-57 GB/s, whatever its bytes in flight (32-128 KB), threads or GPC.
    # Together A SMs reach the read bandwidth more gradually than this rule shares it (1.6 TB/s at
    # 32 SMs, 2.5 at 64, against 1.92 and 3.04 here), but no saturation curve that follows that
    # measurement put the 15 measured steps nearer than this rule (mean 2.0%, worst 4.9%) in a grid
    # over the curve, the caps, the fixed times and the hop (BENCHMARKS.md): not adopted.
    sm_stream_cap: float = 60e9
    split_stream_cap: float = 40e9
    sim_hop: float = 0.8e-6
    sim_fixed_us: dict[str, float] = field(default_factory=lambda: dict(SIM_FIXED_US))


H200 = Ceilings()
# An H100 (80 GB HBM3, 132 SMs): its read bandwidth measured by mkc bench (torch sum over 4 GiB,
# 2.95-3.05 TB/s on 2026-12-05); the rest as the H200's, whose Hopper SMs it shares. With only the
# bandwidth changed, the simulation (simulate.py) of the schedules planned for the H200 put North
# Mini Code's step at 8K within 1.8% of the H100's measured ones at batch 1, 2, 4 and 8 (BENCHMARKS.md,
# 2026-12-05). Only the prediction uses it (mkc compile --gpu h100); placement and the tuning table
# stay the H200's, which a re-tune on the H100 kept at batch 8.
H100 = Ceilings(read_bw=3.05e12)
# the GPUs mkc compile predicts a step for, by the name --gpu takes
GPUS: dict[str, Ceilings] = {"h200": H200, "h100": H100}


def gpu_name(device_name: str) -> str:
    """The name in GPUS of a device as CUDA names it ("NVIDIA H100 80GB HBM3": h100); h200 otherwise."""
    return "h100" if "H100" in device_name.upper() else "h200"


# the opcodes whose tiles read the weights of their routing slot's expert (their "slot" argument):
# slot j runs the j-th distinct expert the step routed to, and nothing when it routed to j or fewer
SLOT_OPS = (Opcode.EXPERT_SWIGLU, Opcode.EXPERT_DOWN, Opcode.EXPERT_MLP)


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
        if len(ids) > 1 and np.ptp(x) > 0:
            slope, fixed = np.polyfit(x, y, 1)
            gbps = 1e-3 / slope if slope > 0 else float("inf")  # bytes per µs → GB/s
        else:  # one size: the fixed time assuming the fair per-SM share of bandwidth, rate unknown
            fixed, gbps = float(y.mean() - x.mean() / (c.read_bw / num_sms) * 1e6), float("nan")
        out[op] = OpFit(tasks=len(ids), mean_us=float(y.mean()), fixed_us=float(fixed), gbps=float(gbps),
                        predicted_us=float(np.mean([task_time(tasks[i], num_sms, c) for i in ids]) * 1e6))
    return out
