"""Cost model: predicted time of a task on one SM, from bytes and FLOPs at measured H200 ceilings.

The ceilings are the measured numbers of DESIGN.md (H200, 132 SMs, 2026-11-29). When every SM
streams at once each gets an equal share of HBM bandwidth, so a task's streaming time is its bytes
over (bandwidth / num_sms). A task's weights are immutable, so up to ``PREFETCH_BYTES`` of them
are loaded before its wait completes ("prefetch before wait").
"""

from __future__ import annotations

from dataclasses import dataclass

from mkc.ir.graph import Task


@dataclass(frozen=True, slots=True)
class Ceilings:
    read_bw: float = 4.25e12  # bytes/s, torch sum over 4 GiB on an H200
    gemv_bw: float = 3.76e12  # bytes/s, torch batch-1 GEMV
    tensor_flops: float = 790e12  # bf16 dense FLOP/s
    sms: int = 132  # SMs the bandwidth was measured over
    task_overhead: float = 0.6e-6  # s: one counter hand-off (acquire + release)
    grid_barrier: float = 0.8e-6  # s: a grid-wide counter barrier
    launch_in_graph: float = 0.5e-6  # s: kernel launch inside a CUDA graph


H200 = Ceilings()
PREFETCH_BYTES = 96 * 1024  # shared-memory ring a task may fill before its inputs are ready


def task_time(t: Task, num_sms: int, c: Ceilings = H200) -> float:
    """Seconds for task t on one SM while all num_sms SMs stream."""
    per_sm_bw = c.read_bw / max(num_sms, 1)
    per_sm_flops = c.tensor_flops / c.sms
    return max((t.weight_bytes + t.act_bytes) / per_sm_bw, t.flops / per_sm_flops) + c.task_overhead


def prefetchable_time(t: Task, num_sms: int, c: Ceilings = H200) -> float:
    """The part of task_time that can run before the task's inputs are ready."""
    return min(t.weight_bytes, PREFETCH_BYTES) / (c.read_bw / max(num_sms, 1))
