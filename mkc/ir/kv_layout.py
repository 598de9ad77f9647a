"""The KV cache layout the lowering chose, and the views the runtime and the tests use.

Two layouts, per layer:

* contiguous (``page_size`` 0): ``k_cache``/``v_cache`` are ``[B, kv_heads, context, head_dim]``,
  one slab per sequence slot;
* paged (``page_size`` P > 0): a pool ``[kv_heads, pages, P, head_dim]`` per layer and one
  ``page_table [B, pages_per_seq]`` (int32, an input of every step, shared by all layers): position
  j of sequence b lives in row ``j % P`` of page ``page_table[b, j // P]``.

The pool holds ``B * pages_per_seq`` pages, so the identity table (sequence b's page j is page
``b * pages_per_seq + j``) always fits; a serving engine may map pages any way it likes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch


def pages_per_seq(context: int, page_size: int) -> int:
    """Pages one sequence needs for ``context`` positions."""
    return math.ceil(context / page_size)


def page_size_of(buffers: Mapping[str, Any]) -> int:
    """The page size of a lowered program's KV cache (0: contiguous), from its buffers."""
    if "page_table" not in buffers:
        return 0
    cache = next(b for name, b in buffers.items() if name.endswith(".k_cache"))
    return int(cache.shape[2])


def identity_page_table(batch: int, context: int, page_size: int, pool: int | None = None) -> torch.Tensor:
    """[B, pages_per_seq] int32: sequence b's page j is page b * pages_per_seq + j; all page 0
    when a ``pool`` smaller than that is given (its user maps the pages)."""
    n = pages_per_seq(context, page_size)
    if pool is not None and pool < batch * n:
        return torch.zeros(batch, n, dtype=torch.int32)
    return torch.arange(batch * n, dtype=torch.int32).view(batch, n)


def logical_view(cache: torch.Tensor, batch: int, context: int, page_size: int) -> torch.Tensor:
    """A layer's cache as ``[B, kv_heads, context, head_dim]``: the buffer itself when contiguous;
    for a pool under the identity page table, a strided view of it (writes go to the pool)."""
    if page_size == 0:
        return cache
    g, pool, p, d = cache.shape
    n = pages_per_seq(context, page_size)
    if pool < batch * n:
        raise ValueError(f"a pool of {pool} KV pages has no [batch, heads, context, dim] view ({batch} x {n} "
                         f"pages needed): read and write it through its page table")
    return cache[:, :batch * n].view(g, batch, n * p, d)[:, :, :context].permute(1, 0, 2, 3)


def gather_rows(cache: torch.Tensor, table_row: torch.Tensor | None, g: int, lo: int, hi: int,
                seq: int = 0) -> torch.Tensor:
    """Rows [lo, hi) of KV head g of one sequence, [hi - lo, head_dim]: ``cache[seq, g, lo:hi]``
    when contiguous (``table_row`` None), else through the sequence's page-table row."""
    if table_row is None:
        return cache[seq, g, lo:hi]
    p = cache.shape[2]
    pos = torch.arange(lo, hi)
    return cache[g, table_row.long()[pos // p], pos % p]


def row_index(cache: torch.Tensor, table_row: torch.Tensor | None, g: int, pos: int,
              seq: int = 0) -> tuple[int, ...]:
    """Index of position ``pos`` of KV head g of one sequence in the cache buffer."""
    if table_row is None:
        return (seq, g, pos)
    p = cache.shape[2]
    return (g, int(table_row[pos // p]), pos % p)
