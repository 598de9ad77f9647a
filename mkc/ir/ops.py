"""The opcode table: the single source of truth for every task kind.

The C++ ``enum class Op`` in the kernel, the dispatch switch, the CPU executor's handlers and the
schedule file all come from ``Opcode`` and ``OP_INFO``; nothing keeps a second copy by hand.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum


class Opcode(IntEnum):
    EMBED = 1  # x[b, :] = embed[tokens[b], :]
    LINEAR = 3  # out[slab, b, col0 + i] = sum_k xn[b, k0 + k] * w[row0 + i, k0 + k] (+ the residual terms)
    SWIGLU = 4  # h[b, col0 + i] = silu(xn . w[row0 + i]) * (xn . w[up_row0 + i])
    ROPE_APPEND = 5  # [q,] k = rope(qk_norm(q, k)); k, v appended to the KV cache at positions[b]
    ATTN_SPLIT = 6  # partial softmax(q k^T) v over one key range of one (sequence, KV head)
    ATTN_COMBINE = 7  # merge the split partials of some query heads of one KV group into attn[b, heads]
    TOPK = 8  # routing per token: its experts (best first) and their slots (ascending expert)
    EXPERT_SWIGLU = 9  # SWIGLU of the expert in routing slot `slot` (no-op past the live count)
    EXPERT_DOWN = 10  # out[slot, b, rows] = weight[slot, b] * h[slot, b] . w_down[expert, rows] (0: not routed)
    RESIDUAL = 11  # x_out[:, cols] = x_in + sum(o_part) + mlp (dense or routed) over a column tile
    LM_HEAD = 12  # logits tile (scaled) of xn and its per-row argmax partial
    ARGMAX = 13  # next_token[b] = argmax over the LM-head partials
    # EXPERT_SWIGLU of rows [row0, row0 + rows) of the expert in routing slot `slot`, then those rows'
    # share of its down projection: out[slot * parts + part, b, :] = weight[slot, b] * h[b, rows] .
    # w_down[expert, :, rows] (split-K partials, summed by the tile that ends the layer; 0: not routed)
    EXPERT_MLP = 14
    # EXPERT_DOWN over the columns [k0, k0 + k) of the slot's hidden state only, into out[slab]: the K
    # split of an expert whose intermediate size does not fit the GEMV's shared memory (split-K
    # partials, summed by the tile that ends the layer; 0: not routed, or a slot past the live count)
    EXPERT_DOWN_SPLIT = 15


# Recomputed by consumers where a task of their own would cost a hop on a layer's critical path
# for a few KB of work:
# - RMSNorm: a GEMV with a "norm" operand reads the f32 residual stream x and stages
#   xn = bf16(x * rsqrt(mean(x^2) + eps) * norm) itself (without one, x is its bf16 input);
# - routing: EXPERT_SWIGLU, EXPERT_MLP and EXPERT_DOWN (_SPLIT) read the router logits and derive their slot's expert
#   (and weights) themselves, so neither waits for a routing task; the TOPK task writes the same
#   routing (the same code, so bit for bit) as token slots for RESIDUAL, which starts tens of µs
#   later, and as the experts of each token for the host.


@dataclass(frozen=True, slots=True)
class OpInfo:
    operands: tuple[str, ...]  # buffer roles, in the order tasks list them ("-" = absent)
    args: tuple[str, ...]  # integer arguments, in the order tasks list them


OP_INFO: dict[Opcode, OpInfo] = {
    Opcode.EMBED: OpInfo(("tokens", "embed", "out"), ()),
    # residual / mlp / routed: a tile that ends a layer (LowerOptions.residual_in_o_proj) adds to its
    # product the residual stream residual[b, col0 + i], then mlp[0, b, col0 + i] (a dense MLP's
    # output), then routed[j, b, col0 + i] for every routing slot j in ascending order (each expert
    # tile writes zeros for the tokens it did not serve, and a slot past the live count all zeros),
    # so no RESIDUAL task follows it; "-" where absent
    Opcode.LINEAR: OpInfo(("x", "norm", "weight", "out", "residual", "mlp", "routed"),
                          ("row0", "rows", "k0", "k", "col0", "slab")),
    Opcode.SWIGLU: OpInfo(("x", "norm", "weight", "out"), ("row0", "rows", "up_row0", "col0")),
    # q_norm / k_norm: per-head RMSNorm weights [head_dim] of qk-norm models ("-" without qk-norm)
    # page_table: [B, pages per sequence] of a paged KV cache ("-" with one slab per sequence)
    # q: the rotated query heads, written for the splits; "-" where the splits rotate them
    # themselves (LowerOptions.rope_in_splits): the task then appends k and v only
    Opcode.ROPE_APPEND: OpInfo(("qkv", "positions", "q", "k_cache", "v_cache", "q_norm", "k_norm", "page_table"),
                               ("kv_head", "rope")),
    # exactly one of q (rotated by ROPE_APPEND) and qkv: with qkv the split rotates (and qk-norms,
    # with q_norm / k_norm) its query heads itself, and takes the key and value at positions[seq]
    # from qkv instead of the cache, which ROPE_APPEND writes after the splits; rope: as ROPE_APPEND's
    Opcode.ATTN_SPLIT: OpInfo(("q", "k_cache", "v_cache", "positions", "part_o", "part_ml", "page_table",
                               "qkv", "q_norm", "k_norm"),
                              ("seq", "kv_head", "split", "split_keys", "window", "rope")),
    Opcode.ATTN_COMBINE: OpInfo(("part_o", "part_ml", "positions", "out"),
                                ("kv_head", "head0", "heads", "splits", "split_keys", "window")),
    # selected: [B, top_k] each token's experts, best first (for the host)
    Opcode.TOPK: OpInfo(("logits", "token_slots", "selected"), ()),
    Opcode.EXPERT_SWIGLU: OpInfo(("x", "norm", "weight", "logits", "out"), ("slot", "row0", "rows")),
    Opcode.EXPERT_DOWN: OpInfo(("h", "weight", "logits", "out"), ("slot", "row0", "rows")),
    # weight: [experts, 2 * inter, hidden] (gate; up), down: [experts, hidden, inter]; out: [slots *
    # parts, B, hidden], part = row0 / rows of the slot's tiles (LowerOptions.fused_experts)
    Opcode.EXPERT_MLP: OpInfo(("x", "norm", "weight", "down", "logits", "out"), ("slot", "row0", "rows", "part")),
    # out: [slabs, B, hidden], slab = the first of the layer's partials + slot * parts + part
    Opcode.EXPERT_DOWN_SPLIT: OpInfo(("h", "weight", "logits", "out"), ("slot", "row0", "rows", "k0", "k", "slab")),
    Opcode.RESIDUAL: OpInfo(("x", "o_part", "mlp", "routed", "token_slots", "out"), ("col0", "cols", "o_parts")),
    Opcode.LM_HEAD: OpInfo(("x", "norm", "weight", "logits", "best_val", "best_idx"), ("row0", "rows", "tile")),
    Opcode.ARGMAX: OpInfo(("best_val", "best_idx", "out"), ("tiles",)),
}
