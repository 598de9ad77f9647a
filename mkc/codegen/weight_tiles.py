"""Weights in tile order: the layout the GEMV tiles stream (CodegenOptions.weight_layout = "tiles").

A weight matrix W [..., R, K] (R % 16 == 0, K % 64 == 0) keeps its shape, but its elements are
stored block by block, each block in the order the tensor-core fragments read it
(templates/gemv.cuh): block (G, kb) covers rows [16 G, 16 G + 16) and columns [64 kb, 64 kb + 64)
and sits at element (G * K / 64 + kb) * 1024. Inside a block, piece j (0..3) of lane l
(g = l / 4, q = l % 4) holds the 8 elements

    W[16 G + g + 8 (j // 2), 64 kb + 32 (j % 2) + 8 q : + 8]    at offset j * 256 + l * 8,

so each of a warp's four 16-byte loads of a block reads 512 contiguous bytes, and a tile of whole
16-row groups over whole 64-column blocks is one contiguous run per group (one run in all when the
tile spans every column). Leading dimensions (experts) are packed one matrix at a time.

Which buffers are stored this way: every weight a GEMV task reads as its ``weight`` operand
(``tiled_weights``). The embedding, when it is tied to the LM head, is read in tile order by the
embedding lookup as well (its descriptor says so: DT_BF16_TILES).

A GEMV reads whole 64-column blocks, so a weight whose K is not a multiple of 64 is stored with
zero columns up to the next multiple, and one whose rows are not a multiple of 16 (Mixtral's
router: 8 experts) with zero rows (``padded_weights``, ``pad_to_blocks``), in either layout; its
descriptor holds the padded shape, the kernel stages the input's columns past k as zeros, and a
tile reads and writes its own rows only.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from mkc.ir.ops import OP_INFO, Opcode

if TYPE_CHECKING:
    import torch

    from mkc.schedule.schedule import Schedule

TILE_ROWS = 16  # rows of one block (a tensor-core fragment's m)
TILE_COLS = 64  # columns of one block (four k-steps of 16)
GEMV_OPS = (Opcode.LINEAR, Opcode.SWIGLU, Opcode.EXPERT_SWIGLU, Opcode.EXPERT_DOWN, Opcode.EXPERT_MLP, Opcode.LM_HEAD,
            Opcode.EXPERT_DOWN_SPLIT)


class WeightLayoutError(ValueError):
    """A weight cannot be stored in tile order; the message names it and the rule."""


def tiled_weights(schedule: Schedule) -> frozenset[str]:
    """Names of the weight buffers stored in tile order: the ``weight`` operands of GEMV tasks (and
    the ``down`` operands of EXPERT_MLP tasks, their second GEMV's weights)."""
    return frozenset(t.operand(role) for t in schedule.tasks if t.op in GEMV_OPS
                     for role in ("weight", "down") if role in OP_INFO[t.op].operands)


def padded_k(k: int) -> int:
    """A weight's K as stored: whole TILE_COLS-wide blocks."""
    return -(-k // TILE_COLS) * TILE_COLS


def padded_rows(r: int) -> int:
    """A weight's rows as stored: whole TILE_ROWS-high blocks."""
    return -(-r // TILE_ROWS) * TILE_ROWS


def padded_weights(schedule: Schedule) -> dict[str, tuple[int, int]]:
    """The GEMV weights (tiled_weights' names, in either layout) whose K is not a multiple of
    TILE_COLS or whose rows are not a multiple of TILE_ROWS (Mixtral's router: 8 experts), with
    their logical (rows, K): each is stored with zero columns and rows up to whole blocks (a tile
    reads its own rows only)."""
    return {n: tuple(schedule.buffers[n].shape[-2:]) for n in sorted(tiled_weights(schedule))
            if schedule.buffers[n].shape[-1] % TILE_COLS or schedule.buffers[n].shape[-2] % TILE_ROWS}


def stored_shape(shape: tuple[int, ...], padded: bool) -> tuple[int, ...]:
    """The shape a weight is stored in: its rows and K padded to whole blocks where ``padded``."""
    return (*shape[:-2], padded_rows(shape[-2]), padded_k(shape[-1])) if padded else tuple(shape)


def pad_to_blocks(w: torch.Tensor) -> torch.Tensor:
    """``w`` [..., R, K] with zero rows and columns up to whole blocks (a copy; ``w`` itself where
    both are whole)."""
    r, k = w.shape[-2:]
    if r % TILE_ROWS == 0 and k % TILE_COLS == 0:
        return w
    out = w.new_zeros(stored_shape(tuple(w.shape), True))
    out[..., :r, :k] = w
    return out


def stored_weight(w: torch.Tensor, tiled: bool, padded: bool) -> torch.Tensor:
    """``w`` [..., R, K] as the kernel reads it: zero rows and columns up to whole blocks where
    ``padded``, then in tile order where ``tiled`` (a contiguous tensor)."""
    w = pad_to_blocks(w) if padded else w
    return to_tiles(w) if tiled else w.contiguous()


def logical_weight(t: torch.Tensor, tiled: bool, shape: tuple[int, int] | None) -> torch.Tensor:
    """The inverse of stored_weight: row-major, its first rows and columns ``shape`` = (rows, K)
    (None: every one)."""
    t = from_tiles(t) if tiled else t
    return t if shape is None else t[..., :shape[0], :shape[1]]


def check_tileable(name: str, shape: tuple[int, ...]) -> None:
    """Raise WeightLayoutError unless a [..., R, K] weight has R % 16 == 0 and K % 64 == 0."""
    if len(shape) < 2 or shape[-2] % TILE_ROWS or shape[-1] % TILE_COLS:
        raise WeightLayoutError(f"weight {name} {tuple(shape)}: tile order needs [..., rows, k] with rows a "
                                f"multiple of {TILE_ROWS} and k a multiple of {TILE_COLS}")


def _blocked(shape: tuple[int, ...]) -> tuple[int, ...]:
    """[..., R, K] as [..., G, 2 (row half), 8 (g), KB, 2 (column half), 4 (q), 8]."""
    *lead, r, k = shape
    return (*lead, r // TILE_ROWS, 2, 8, k // TILE_COLS, 2, 4, 8)


# The block axes of a [..., R, K] weight (_blocked): G, hi (row half), g, KB, half (column half),
# q, e. Each tile order lists them as it stores them.
_BF16_ORDER = (0, 3, 1, 4, 2, 5, 6)  # piece j = 2 hi + half at 256 j, lane 4 g + q at 8 per lane
_FP8_ORDER = (0, 3, 1, 2, 5, 4, 6)  # row half hi at 512 hi, lane 4 g + q at 16: its two pieces side by side


def _wide(t: torch.Tensor) -> torch.Tensor:
    """``t`` [..., 8 k] with each run of 8 elements (the tile orders' innermost axis, which no
    order moves) as one element of 8 or 16 bytes, so that a permuted copy moves whole runs, one
    index computation per run instead of per element. The bits are copied, never computed on."""
    import torch

    wide = {16: torch.complex128, 8: torch.int64}.get(8 * t.element_size())
    try:
        return t.view(wide) if wide is not None else t
    except RuntimeError:  # a view that is not aligned for the wide element: copy as it is
        return t


def _to_order(w: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
    check_tileable("tensor", tuple(w.shape))
    n = w.dim() - 2
    x = _wide(w.contiguous())
    blocked = (*_blocked(tuple(w.shape))[:-1], x.shape[-1] * 8 // w.shape[-1])
    out = x.reshape(blocked).permute((*range(n), *(n + a for a in order))).contiguous()
    return out.view(-1).view(w.dtype).reshape(w.shape)


def _from_order(p: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
    check_tileable("tensor", tuple(p.shape))
    n = p.dim() - 2
    x = _wide(p.contiguous())
    blocked = (*_blocked(tuple(p.shape))[:-1], x.shape[-1] * 8 // p.shape[-1])
    x = x.reshape(*blocked[:n], *(blocked[n + a] for a in order))
    out = x.permute((*range(n), *(n + order.index(a) for a in range(7)))).contiguous()
    return out.view(-1).view(p.dtype).reshape(p.shape)


def to_tiles(w: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of ``w`` [..., R, K] in tile order (same shape and dtype)."""
    return _to_order(w, _BF16_ORDER)


def from_tiles(p: torch.Tensor) -> torch.Tensor:
    """The inverse of to_tiles: ``p`` in tile order back to row-major [..., R, K]."""
    return _from_order(p, _BF16_ORDER)


def to_tiles_fp8(w: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of the FP8 weight ``w`` [..., R, K] (float8_e4m3fn, or its bytes as uint8)
    in the FP8 tile order: block (G, kb) at element (G * K / 64 + kb) * 1024 as in to_tiles, row
    half j of lane l at j * 512 + 16 l: W[16 G + g + 8 j, 64 kb + 8 q : + 8] then the 8 at
    64 kb + 32 + 8 q (g = l / 4, q = l % 4)."""
    return _to_order(w, _FP8_ORDER)


def from_tiles_fp8(p: torch.Tensor) -> torch.Tensor:
    """The inverse of to_tiles_fp8: ``p`` in FP8 tile order back to row-major [..., R, K]."""
    return _from_order(p, _FP8_ORDER)


def fp8_stored(q: torch.Tensor, scales: torch.Tensor, device) -> tuple[torch.Tensor, torch.Tensor]:
    """An FP8 weight as the kernel reads it, in one allocation on ``device``: its e4m3 elements
    ``q`` [..., R, K] in the FP8 tile order, then its float32 ``scales`` (mkc/ir/fp8.py:
    scales_offset). Returns the views (elements, scales)."""
    import torch

    from mkc.ir.fp8 import scales_offset

    numel = q.numel()
    off = scales_offset(numel)
    store = torch.empty(off + 4 * scales.numel(), dtype=torch.uint8, device=device)
    data = store[:numel].view(torch.float8_e4m3fn).view(q.shape)
    data.view(torch.uint8).copy_(to_tiles_fp8(q.to(device).view(torch.uint8)))
    placed = store[off:].view(torch.float32).view(scales.shape)
    placed.copy_(scales.to(device=device, dtype=torch.float32))
    return data, placed


def tile_offset(row: int, col: int, k: int) -> int:
    """Element offset of W[row, col] (one matrix, k columns) in tile order; the formula the
    kernel's embedding lookup uses for 8-element chunks (col % 8 == 0)."""
    g_blk, rr = divmod(row, TILE_ROWS)
    kb, cc = divmod(col, TILE_COLS)
    hi, g = divmod(rr, 8)
    half, c = divmod(cc, 32)
    q, e = divmod(c, 8)
    return (g_blk * (k // TILE_COLS) + kb) * 1024 + (2 * hi + half) * 256 + (4 * g + q) * 8 + e


class TiledWeights(dict):
    """Weights by name of which those in ``tiled`` are already in tile order: a CUDA decoder takes
    them as they are instead of reordering a copy (tile_ordered_in_place makes one)."""

    def __init__(self, weights: dict, tiled: Iterable[str]):
        super().__init__(weights)
        self.tiled = frozenset(tiled)


@contextmanager
def tile_ordered_in_place(weights: dict, names: Iterable[str]) -> Iterator[TiledWeights]:
    """Reorder the named weights into tile order in their own storage (one matrix stack of scratch
    at a time) for the duration of the block, and back after it: a decoder built inside the block
    holds the weights once, and code after it reads them row-major again."""
    # a weight whose K is not whole blocks is padded (a new shape) when the decoder uploads it
    names = [n for n in names if n in weights and weights[n].shape[-1] % TILE_COLS == 0]
    done: list[str] = []
    try:
        for n in names:
            weights[n].copy_(to_tiles(weights[n]))
            done.append(n)
        yield TiledWeights(weights, [*names, *getattr(weights, "tiled", ())])
    finally:
        for n in done:
            weights[n].copy_(from_tiles(weights[n]))
