"""What a task's stage is: the op it runs within its layer, as the scheduler, the simulation and
the profile group tasks (a layer's sibling tiles, its tail, the SMs' idle time)."""

from __future__ import annotations

from mkc.ir.graph import Task


def stage(task: Task) -> str:
    """A task's stage within its layer: its name without the layer and the tile ("L10.o_proj[kv0][0:64]"
    → "o_proj"), so the tiles of one op that a layer runs in several roles (LINEAR: qkv, router,
    o_proj) count apart."""
    return task.name.split("[")[0].split(".")[-1]
