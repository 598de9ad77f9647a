"""The tiling rule: how many tasks each op is split into.

One rule for every model, stated here and in docs/tiling.md:

* A weight-streaming op (all its instances in one layer together, e.g. the 8 routed expert slots
  at batch 1) is split into about ``num_sms`` tasks, so one wave of tasks covers every SM; but no
  task streams less than ``MIN_TASK_BYTES`` (a task costs ~1 µs of counter traffic, which must
  stay small next to its stream: 32 KiB at ~30 GB/s per SM is ~1 µs).
* Tile rows are a multiple of ``ROW_ALIGN`` (16: the swap-AB ``mma m16n8k16`` warp tile the GEMV
  device function uses) where the op has that many rows, and never straddle a natural boundary
  (a head for QKV), so that dependencies can be as fine as the math allows.
* Attention is split along the keys (flash-decoding) so that the attention tasks of one layer
  fill about one wave, with at least ``MIN_ATTN_KEYS`` keys per split.
* A GEMV whose reduction is wider than its staged activations can hold in shared memory
  (``gemv_max_k``) is split along k into equal parts of whole 64-column blocks (``k_splits``);
  its partial sums go to separate slabs that the task ending the layer adds up.
"""

from __future__ import annotations

import math

MIN_TASK_BYTES = 32 * 1024
ROW_ALIGN = 16
MIN_ATTN_KEYS = 64
KEY_ALIGN = 64
K_BLOCK = 64  # columns of one GEMV reduction block (four mma k-steps of 16)
SMEM_BYTES = 227 * 1024  # Hopper: opt-in dynamic shared memory per block
# Equal tiles (a divisor of the rows) are kept where they are at least this share of the tasks
# wanted: one SM streams at up to about twice its fair share of the read bandwidth when few others
# do, so half a wave of equal tiles still keeps it busy; fewer leave it idle (docs/tiling.md).
EQUAL_TILES_MIN = 0.5


def _align_for(rows: int, boundary: int) -> int:
    """Largest power-of-two alignment <= ROW_ALIGN that divides both rows and boundary."""
    a = ROW_ALIGN
    while a > 1 and (rows % a or boundary % a):
        a //= 2
    return a


def row_tile(rows: int, row_bytes: int, instances: int, num_sms: int, boundary: int | None = None) -> int:
    """Rows per task for an op of ``instances`` independent weight matrices of ``rows`` rows.

    The tile divides ``boundary`` (or is a multiple of it) so no task straddles a head. Without a
    boundary the tile grows to a divisor of ``rows`` (equal tiles) only where that keeps at least
    half the tasks wanted (``EQUAL_TILES_MIN``); else the last tile is shorter, so a row count with
    few divisors (a vocabulary of 151,936 = 2^7 x 1187) still spreads over every SM. Without a
    boundary, tiles are whole ROW_ALIGN blocks even where the rows are not (the weight is stored
    with zero rows up to the block: weight_tiles.padded_weights), so tile order holds.
    """
    natural = boundary is not None
    boundary = boundary or rows
    total = rows * row_bytes * instances
    wanted = max(1, min(num_sms, total // MIN_TASK_BYTES))
    per_instance = max(1, math.ceil(wanted / instances))
    tile = math.ceil(rows / per_instance)
    align = _align_for(rows, boundary) if natural else ROW_ALIGN
    tile = max(align, math.ceil(tile / align) * align)
    if tile >= boundary:
        return min(math.ceil(tile / boundary) * boundary, rows)
    ragged = tile
    while boundary % tile and tile < boundary:  # grow to a divisor of the boundary: never more tasks than wanted
        tile += align
    if boundary % tile or (not natural and math.ceil(rows / tile) * instances < wanted * EQUAL_TILES_MIN):
        return ragged
    return min(tile, rows)


def tiles(total: int, tile: int) -> list[tuple[int, int]]:
    """[lo, hi) ranges of size tile covering [0, total)."""
    return [(lo, min(lo + tile, total)) for lo in range(0, total, tile)]


def attention_split_keys(keys: int, key_bytes: int, streams: int, num_sms: int) -> int:
    """Keys per split for ``streams`` (sequence, KV head) pairs over ``keys`` keys each."""
    max_splits = max(1, num_sms // max(1, streams))
    per_split = max(MIN_ATTN_KEYS, math.ceil(keys / max_splits), math.ceil(MIN_TASK_BYTES / key_bytes))
    per_split = math.ceil(per_split / KEY_ALIGN) * KEY_ALIGN
    return min(per_split, math.ceil(keys / KEY_ALIGN) * KEY_ALIGN)


def combine_heads(group: int) -> int:
    """Query heads per attention-combine task: a quarter of a KV group (at least one, a divisor of
    the group), so a group's merge is spread over up to 4 SMs without a task per head."""
    h = max(1, group // 4)
    while group % h:
        h -= 1
    return h


def gemv_max_k(batch: int, hidden: int, warps: int = 8) -> int:
    """The widest reduction one GEMV task stages in shared memory (a multiple of K_BLOCK): its 8
    token rows of k + 32 bf16 beside the k-split reduction and the RMSNorm scratch (the f32
    residual stream and the norm weight). The same sums as mkc/codegen/render.py:
    KernelConfig.gemv_bytes, which the codegen checks."""
    red = warps * 2 * 4 * 32 * 4
    scratch = batch * hidden * 4 + hidden * 2
    room = SMEM_BYTES - red - _round_up(scratch, 128)
    return max(0, (room // (8 * 2) - 32) // K_BLOCK * K_BLOCK)


def k_splits(k: int, max_k: int) -> list[tuple[int, int]]:
    """(k0, columns) of each part of a reduction of ``k`` columns: one part when it fits ``max_k``,
    else the fewest equal parts of whole K_BLOCK blocks that fit (the last may be shorter)."""
    if k <= max_k:
        return [(0, k)]
    if max_k < K_BLOCK:
        raise ValueError(f"k_splits: at most {max_k} columns per part: expected at least {K_BLOCK}")
    parts = math.ceil(k / max_k)
    part = _round_up(math.ceil(k / parts), K_BLOCK)
    while part > max_k:  # rounding up to whole blocks overshot: one part more
        parts += 1
        part = _round_up(math.ceil(k / parts), K_BLOCK)
    return [(lo, hi - lo) for lo, hi in tiles(k, part)]


def _round_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a
