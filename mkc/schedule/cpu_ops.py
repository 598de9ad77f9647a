"""One PyTorch function per Opcode: what a task computes, on its tile only.

Contract shared by every handler: ``run_task(task, bufs, weights, spec)`` reads its operands from
``bufs`` (activations, KV cache, inputs and outputs, by buffer name, at their full shapes) and
``weights`` (immutable, by buffer name), computes in float32, and writes its results into
``bufs`` cast to the destination's storage dtype. A handler touches only the elements its task
is meant to: the executor hands it scratch copies in which everything outside the declared read
regions is poisoned, and keeps only what lands inside the declared write regions.

Dispatch is a table built from ``Opcode``: importing this module fails if an opcode has no
handler, so a new opcode cannot be added to ``mkc/ir/ops.py`` and forgotten here.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from mkc.ir.graph import Task
from mkc.ir.kv_layout import gather_rows, row_index
from mkc.ir.ops import Opcode
from mkc.ir.spec import ModelSpec

Tensors = dict[str, torch.Tensor]
Handler = Callable[[Task, Tensors, Tensors, ModelSpec], None]


def _f(t: torch.Tensor) -> torch.Tensor:
    return t.float()


def _store(dst: torch.Tensor, value: torch.Tensor) -> None:
    dst.copy_(value.to(dst.dtype))


def _operand(task: Task, role: str, bufs: Tensors, weights: Tensors) -> torch.Tensor:
    name = task.operand(role)
    if name in bufs:
        return bufs[name]
    if name in weights:
        return weights[name]
    raise KeyError(f"task {task.name} ({task.op.name}): operand {role} = {name!r} was not given to it")


# ----------------------------------------------------------------------------------------------
# RoPE, shared by ROPE_APPEND (the reference in runtime/reference.py has its own copy, on purpose)


def rope_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    """[head_dim / 2] inverse frequencies, float32, computed as transformers does."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


def apply_rope(x: torch.Tensor, pos: int, theta: float, style: str) -> torch.Tensor:
    """Rotate ``x`` [..., head_dim] (float32) to position ``pos``.

    "interleaved" (GPT-J): pairs (2i, 2i+1) rotate by pos * inv_freq[i];
    "half" (NeoX): pairs (i, i + head_dim/2) rotate by pos * inv_freq[i].
    """
    d = x.shape[-1]
    ang = torch.tensor(float(pos), dtype=torch.float32) * rope_inv_freq(d, theta)  # [d/2]
    cos, sin = ang.cos(), ang.sin()
    if style == "interleaved":
        a, b = x[..., 0::2], x[..., 1::2]
        out = torch.empty_like(x)
        out[..., 0::2] = a * cos - b * sin
        out[..., 1::2] = b * cos + a * sin
        return out
    if style == "half":
        a, b = x[..., : d // 2], x[..., d // 2:]
        return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)
    raise ValueError(f"rope_style {style!r}: expected 'interleaved' or 'half'")


# ----------------------------------------------------------------------------------------------
# handlers


def _embed(t: Task, bufs: Tensors, w: Tensors, spec: ModelSpec) -> None:
    tokens = _operand(t, "tokens", bufs, w).long()  # [B]
    table = _operand(t, "embed", bufs, w)  # [vocab, hidden]
    _store(_operand(t, "out", bufs, w), _f(table[tokens]))


def gemv_input(t: Task, bufs: Tensors, w: Tensors, spec: ModelSpec) -> torch.Tensor:
    """A GEMV's input rows [B, k] in float32: x itself, or with a "norm" operand the RMSNorm of
    the float32 residual stream x times the norm weight, rounded to the weights' storage dtype
    (bfloat16 in a bf16 run, as a stored activation would be)."""
    x = _f(_operand(t, "x", bufs, w))  # [B, k] or, normed, [B, hidden]
    if t.operand("norm") == "-":
        return x
    weight = _operand(t, "norm", bufs, w)  # [hidden]
    normed = _f(weight) * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + spec.norm_eps))
    return normed.to(weight.dtype).float()


def _linear(t: Task, bufs: Tensors, w: Tensors, spec: ModelSpec) -> None:
    row0, rows, k0, k, col0, slab = (t.arg(a) for a in ("row0", "rows", "k0", "k", "col0", "slab"))
    x = gemv_input(t, bufs, w, spec)[:, k0:k0 + k]  # [B, k] (a norm is over the whole row first)
    weight = _f(_operand(t, "weight", bufs, w)[row0:row0 + rows, k0:k0 + k])  # [rows, k]
    out = _operand(t, "out", bufs, w)
    dst = out[slab, :, col0:col0 + rows] if out.dim() == 3 else out[:, col0:col0 + rows]
    y = x @ weight.T
    if t.operand("residual") != "-":  # a tile that ends its layer: x + this product + the MLP's terms
        y = _add_terms(_f(_operand(t, "residual", bufs, w)[:, col0:col0 + rows]) + y, t, bufs, w,
                       slice(col0, col0 + rows))
    _store(dst, y)


def _add_terms(acc: torch.Tensor, t: Task, bufs: Tensors, w: Tensors, c: slice) -> torch.Tensor:
    """acc [B, cols] + mlp[0, :, c], then + routed[j, :, c] for every slot j in ascending order
    (LINEAR's residual operands; an expert tile wrote zeros for the tokens it did not serve)."""
    if t.operand("mlp") != "-":
        acc = acc + _f(_operand(t, "mlp", bufs, w)[0, :, c])
    if t.operand("routed") != "-":
        for part in _operand(t, "routed", bufs, w)[:, :, c]:
            acc = acc + _f(part)
    return acc


def _swiglu_rows(x: torch.Tensor, weight: torch.Tensor, row0: int, rows: int, up_row0: int) -> torch.Tensor:
    gate = x @ _f(weight[row0:row0 + rows]).T
    up = x @ _f(weight[up_row0:up_row0 + rows]).T
    return F.silu(gate) * up


def _swiglu(t: Task, bufs: Tensors, w: Tensors, spec: ModelSpec) -> None:
    row0, rows, up_row0, col0 = (t.arg(a) for a in ("row0", "rows", "up_row0", "col0"))
    x = gemv_input(t, bufs, w, spec)  # [B, hidden]
    h = _swiglu_rows(x, _operand(t, "weight", bufs, w), row0, rows, up_row0)
    _store(_operand(t, "out", bufs, w)[:, col0:col0 + rows], h)


def head_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype) -> torch.Tensor:
    """qk-norm: RMSNorm of each head of ``x`` [..., head_dim] (float32) with ``weight`` [head_dim].

    As transformers' Qwen3RMSNorm: the normalisation in float32, rounded to the activation dtype
    ``dtype``, times the weight, rounded again (both no-ops in a float32 run). Float32 out.
    """
    normed = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    return (weight.to(dtype) * normed).float()


def rotated_qk(t: Task, bufs: Tensors, w: Tensors, spec: ModelSpec, b: int, g: int,
               with_q: bool) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(q [GS, D] or None, k [D]) of sequence b, KV group g from the task's qkv operand: qk-norm
    (with q_norm / k_norm operands), then RoPE (arg "rope") at positions[b]; float32, not rounded."""
    a = spec.attention
    D, QH, GS = a.head_dim, a.num_heads, spec.group_size
    qkv = _operand(t, "qkv", bufs, w)  # [B, (QH + 2G) * D]
    pos = int(_operand(t, "positions", bufs, w)[b])
    qk_norm = t.operand("q_norm") != "-"
    if qk_norm != a.qk_norm or qk_norm != (t.operand("k_norm") != "-"):
        raise ValueError(f"task {t.name}: q_norm/k_norm operands {t.operand('q_norm')}, {t.operand('k_norm')} "
                         f"disagree with attention.qk_norm = {a.qk_norm}")
    q = _f(qkv[b, g * GS * D:(g + 1) * GS * D]).view(GS, D) if with_q else None
    k = _f(qkv[b, QH * D + g * D:QH * D + (g + 1) * D])
    if qk_norm:
        qn, kn = _f(_operand(t, "q_norm", bufs, w)), _f(_operand(t, "k_norm", bufs, w))  # [D] each
        q = head_rms_norm(q, qn, spec.norm_eps, qkv.dtype) if with_q else None
        k = head_rms_norm(k, kn, spec.norm_eps, qkv.dtype)
    if t.arg("rope"):
        q = apply_rope(q, pos, a.rope_theta, a.rope_style) if with_q else None
        k = apply_rope(k, pos, a.rope_theta, a.rope_style)
    return q, k


def _value(t: Task, bufs: Tensors, w: Tensors, spec: ModelSpec, b: int, g: int) -> torch.Tensor:
    """v [D] of sequence b, KV group g from the task's qkv operand (float32)."""
    a = spec.attention
    D, G, QH = a.head_dim, a.num_kv_heads, a.num_heads
    return _f(_operand(t, "qkv", bufs, w)[b, (QH + G + g) * D:(QH + G + g + 1) * D])


def _rope_append(t: Task, bufs: Tensors, w: Tensors, spec: ModelSpec) -> None:
    g = t.arg("kv_head")
    D, GS = spec.attention.head_dim, spec.group_size
    positions = _operand(t, "positions", bufs, w)  # [B]
    kc, vc = _operand(t, "k_cache", bufs, w), _operand(t, "v_cache", bufs, w)
    with_q = t.operand("q") != "-"  # else the splits rotate q themselves (LowerOptions.rope_in_splits)
    table = _operand(t, "page_table", bufs, w) if t.operand("page_table") != "-" else None
    for b in range(positions.shape[0]):
        q, k = rotated_qk(t, bufs, w, spec, b, g, with_q)
        if with_q:
            _store(_operand(t, "q", bufs, w)[b, g * GS * D:(g + 1) * GS * D], q.reshape(-1))
        at = row_index(kc, None if table is None else table[b], g, int(positions[b]), seq=b)
        _store(kc[at], k)
        _store(vc[at], _value(t, bufs, w, spec, b, g))


def key_range(pos: int, window: int, split: int, split_keys: int) -> tuple[int, int]:
    """[lo, hi) of the keys one attention split covers (empty when lo >= hi)."""
    start = max(0, pos + 1 - window) if window else 0
    lo = start + split * split_keys
    hi = min(start + (split + 1) * split_keys, pos + 1)
    return lo, hi


def _attn_split(t: Task, bufs: Tensors, w: Tensors, spec: ModelSpec) -> None:
    b, g, sp, split_keys, window = (t.arg(x) for x in ("seq", "kv_head", "split", "split_keys", "window"))
    D, GS = spec.attention.head_dim, spec.group_size
    pos = int(_operand(t, "positions", bufs, w)[b])
    part_o = _operand(t, "part_o", bufs, w)[b, g, sp]  # [GS, D]
    part_ml = _operand(t, "part_ml", bufs, w)[b, g, sp]  # [GS, 2]
    lo, hi = key_range(pos, window, sp, split_keys)
    if lo >= hi:
        part_o.zero_()
        part_ml[:, 0] = -math.inf
        part_ml[:, 1] = 0.0
        return
    table = _operand(t, "page_table", bufs, w)[b] if t.operand("page_table") != "-" else None
    kc, vc = _operand(t, "k_cache", bufs, w), _operand(t, "v_cache", bufs, w)
    k = _f(gather_rows(kc, table, g, lo, hi, seq=b))  # [keys, D]
    v = _f(gather_rows(vc, table, g, lo, hi, seq=b))
    if t.operand("q") != "-":  # rotated by ROPE_APPEND, which appended this step's k and v before
        q = _f(_operand(t, "q", bufs, w)[b, g * GS * D:(g + 1) * GS * D]).view(GS, D)
    else:  # rotated here, rounded as stored; this step's key and value from qkv (appended after)
        qkv_dtype = _operand(t, "qkv", bufs, w).dtype
        q, k_new = rotated_qk(t, bufs, w, spec, b, g, True)
        q = q.to(qkv_dtype).float()
        if lo <= pos < hi:
            k, v = k.clone(), v.clone()  # gather_rows may return a view of the cache
            k[pos - lo] = k_new.to(kc.dtype).float()
            v[pos - lo] = _value(t, bufs, w, spec, b, g)
    s = (q @ k.T) * D ** -0.5  # [GS, keys]
    m = s.max(dim=-1).values  # [GS]
    p = torch.exp(s - m[:, None])
    _store(part_o, p @ v)
    _store(part_ml[:, 0], m)
    _store(part_ml[:, 1], p.sum(-1))


def _attn_combine(t: Task, bufs: Tensors, w: Tensors, spec: ModelSpec) -> None:
    g, h0, nh, splits = (t.arg(a) for a in ("kv_head", "head0", "heads", "splits"))
    D, GS = spec.attention.head_dim, spec.group_size
    heads = slice(h0, h0 + nh)
    part_o = _f(_operand(t, "part_o", bufs, w)[:, g, :splits, heads])  # [B, S, nh, D]
    part_ml = _f(_operand(t, "part_ml", bufs, w)[:, g, :splits, heads])  # [B, S, nh, 2]
    m, l = part_ml[..., 0], part_ml[..., 1]  # [B, S, nh]
    big = m.max(dim=1, keepdim=True).values  # [B, 1, nh], finite: the current key is always attended
    scale = torch.exp(m - big)  # empty splits (m = -inf) get 0
    o = (scale[..., None] * part_o).sum(1) / (scale * l).sum(1)[..., None]  # [B, nh, D]
    cols = slice((g * GS + h0) * D, (g * GS + h0 + nh) * D)
    _store(_operand(t, "out", bufs, w)[:, cols], o.reshape(o.shape[0], nh * D))


def _top_k(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) of the k largest ``scores`` [B, E] per row, ties to the lowest index
    (a stable sort: torch.topk leaves the order of ties unspecified)."""
    vals, idx = torch.sort(scores, dim=-1, descending=True, stable=True)
    return vals[:, :k], idx[:, :k]


def route(logits: torch.Tensor, top_k: int, scoring: str, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token: (expert ids [B, k], weights [B, k] float32) from router logits [B, E].

    "sigmoid": the top-k logits, weight sigmoid(logit). "softmax": probabilities = softmax over
    all experts, the top-k of those (as transformers' Qwen3-MoE / Mixtral routers). Then, if
    ``normalize``, the k weights are divided by their sum (softmax + normalize = softmax over the
    top-k logits). Ties go to the lowest expert index.
    """
    if scoring == "sigmoid":
        vals, idx = _top_k(logits, top_k)
        wts = torch.sigmoid(vals)
    elif scoring == "softmax":
        wts, idx = _top_k(torch.softmax(logits, dim=-1), top_k)
    else:
        raise ValueError(f"router scoring {scoring!r}: expected 'sigmoid' or 'softmax'")
    if normalize:
        wts = wts / wts.sum(-1, keepdim=True)
    return idx, wts


class Routing:
    """One step's routing of a MoE layer, derived from its router logits [B, E] by every task that
    needs it: ``experts`` [B, k] per token best first and their ``weights`` [B, k] (float32),
    ``distinct`` the ascending list of distinct routed experts (slot s runs expert distinct[s])."""

    def __init__(self, logits: torch.Tensor, spec: ModelSpec):
        m = spec.moe
        assert m is not None, "routing in a model without MoE"
        self.experts, self.weights = route(_f(logits), m.top_k, m.scoring, m.normalize_top_k)
        self.distinct = torch.unique(self.experts)  # sorted ascending

    def expert_of(self, slot: int) -> int | None:
        """The expert of a routing slot, or None past the live count (the task is a no-op)."""
        return int(self.distinct[slot]) if slot < self.distinct.numel() else None

    def weight(self, expert: int) -> torch.Tensor:
        """[B] routing weight of ``expert`` per token (0 where the token did not pick it)."""
        return (self.weights * (self.experts == expert)).sum(-1)

    def slot_of(self) -> torch.Tensor:
        """[B, k] the slot of each token's experts, in ascending expert order."""
        return torch.searchsorted(self.distinct, self.experts.sort(dim=-1).values)


def _routing(t: Task, bufs: Tensors, w: Tensors, spec: ModelSpec) -> Routing:
    logits = _operand(t, "logits", bufs, w)
    if torch.isnan(logits).any():  # the kernel would route NaN as -inf; here it means a bad read
        raise ValueError(f"task {t.name}: router logits {t.operand('logits')} contain NaN")
    return Routing(logits, spec)


def _expert_swiglu(t: Task, bufs: Tensors, w: Tensors, spec: ModelSpec) -> None:
    slot, row0, rows = t.arg("slot"), t.arg("row0"), t.arg("rows")
    e = _routing(t, bufs, w, spec).expert_of(slot)
    if e is None:
        return
    weight = _operand(t, "weight", bufs, w)[e]  # [2I, H]
    inter = weight.shape[0] // 2
    x = gemv_input(t, bufs, w, spec)
    _store(_operand(t, "out", bufs, w)[slot, :, row0:row0 + rows], _swiglu_rows(x, weight, row0, rows, inter + row0))


def _topk(t: Task, bufs: Tensors, w: Tensors, spec: ModelSpec) -> None:
    """token_slots[b]: the slots of b's experts in ascending expert order; selected[b]: b's
    experts, best first."""
    routing = _routing(t, bufs, w, spec)
    _store(_operand(t, "token_slots", bufs, w), routing.slot_of())
    _store(_operand(t, "selected", bufs, w), routing.experts)


def _expert_down(t: Task, bufs: Tensors, w: Tensors, spec: ModelSpec) -> None:
    slot, row0, rows = t.arg("slot"), t.arg("row0"), t.arg("rows")
    routing = _routing(t, bufs, w, spec)
    e = routing.expert_of(slot)
    out = _operand(t, "out", bufs, w)[slot, :, row0:row0 + rows]
    if e is None:  # a slot past the live count: zeros, so a sum over every slot stays right
        _store(out, torch.zeros(out.shape))
        return
    h = _f(_operand(t, "h", bufs, w)[slot])  # [B, I]
    weight = _f(_operand(t, "weight", bufs, w)[e, row0:row0 + rows])  # [rows, I]
    # tokens that did not pick e get exact zeros (weight 0), whatever their hidden states hold
    wt = routing.weight(e)[:, None]
    _store(out, torch.where(wt != 0, wt * (h @ weight.T), 0.0))


def _expert_down_split(t: Task, bufs: Tensors, w: Tensors, spec: ModelSpec) -> None:
    """_expert_down over the hidden state's columns [k0, k0 + k) only, into out[slab] (a split-K
    partial; zeros where a token did not pick the expert, or the slot is past the live count)."""
    slot, row0, rows, k0, k, slab = (t.arg(a) for a in ("slot", "row0", "rows", "k0", "k", "slab"))
    routing = _routing(t, bufs, w, spec)
    e = routing.expert_of(slot)
    out = _operand(t, "out", bufs, w)[slab, :, row0:row0 + rows]
    if e is None:
        _store(out, torch.zeros(out.shape))
        return
    h = _f(_operand(t, "h", bufs, w)[slot, :, k0:k0 + k])  # [B, k]
    weight = _f(_operand(t, "weight", bufs, w)[e, row0:row0 + rows, k0:k0 + k])  # [rows, k]
    wt = routing.weight(e)[:, None]
    _store(out, torch.where(wt != 0, wt * (h @ weight.T), 0.0))


def _expert_mlp(t: Task, bufs: Tensors, w: Tensors, spec: ModelSpec) -> None:
    """The SwiGLU rows [row0, row0 + rows) of the slot's expert, rounded as an expert-up tile stores
    them, then their share of its down projection, weighted per token (split-K
    partial ``part``; exact zeros for a token that did not pick the expert, or a slot past the
    live count)."""
    slot, row0, rows, part = t.arg("slot"), t.arg("row0"), t.arg("rows"), t.arg("part")
    routing = _routing(t, bufs, w, spec)
    e = routing.expert_of(slot)
    down = _operand(t, "down", bufs, w)  # [E, H, I]
    dst = _operand(t, "out", bufs, w)[slot * (down.shape[-1] // rows) + part]  # [B, H]: the slot's parts in order
    if e is None:
        _store(dst, torch.zeros(dst.shape))
        return
    weight = _operand(t, "weight", bufs, w)[e]  # [2I, H]
    inter = weight.shape[0] // 2
    # rounded as an expert-up tile stores h (the executor's activation dtype, that of its weights)
    h = _f(_swiglu_rows(gemv_input(t, bufs, w, spec), weight, row0, rows, inter + row0).to(weight.dtype))
    wt = routing.weight(e)[:, None]
    _store(dst, torch.where(wt != 0, wt * (h @ _f(down[e, :, row0:row0 + rows]).T), 0.0))


def _residual(t: Task, bufs: Tensors, w: Tensors, spec: ModelSpec) -> None:
    """out = x + attention + mlp, summed in the order transformers uses (each part first)."""
    c = slice(t.arg("col0"), t.arg("col0") + t.arg("cols"))
    acc = _f(_operand(t, "x", bufs, w)[:, c])  # [B, cols]
    if t.operand("o_part") != "-":
        acc = acc + _f(_operand(t, "o_part", bufs, w)[:, :, c]).sum(0)
    if t.operand("mlp") != "-":
        acc = acc + _f(_operand(t, "mlp", bufs, w)[:, :, c]).sum(0)
    if t.operand("routed") != "-":
        routed = _operand(t, "routed", bufs, w)  # [slots, B, H]
        slots = _operand(t, "token_slots", bufs, w).long()  # [B, k], ascending expert
        batch = torch.arange(slots.shape[0])[:, None]
        acc = acc + _f(routed[slots, batch, c]).sum(1)  # [B, k, cols] summed in ascending expert order
    _store(_operand(t, "out", bufs, w)[:, c], acc)


def _lm_head(t: Task, bufs: Tensors, w: Tensors, spec: ModelSpec) -> None:
    row0, rows, tile = t.arg("row0"), t.arg("rows"), t.arg("tile")
    x = gemv_input(t, bufs, w, spec)  # [B, H]
    weight = _f(_operand(t, "weight", bufs, w)[row0:row0 + rows])  # [rows, H]
    logits = (x @ weight.T) * spec.logit_scale  # [B, rows]
    _store(_operand(t, "logits", bufs, w)[:, row0:row0 + rows], logits)
    val, idx = logits.max(dim=-1)  # first maximum on ties
    _store(_operand(t, "best_val", bufs, w)[:, tile], val)
    _store(_operand(t, "best_idx", bufs, w)[:, tile], idx + row0)


def _argmax(t: Task, bufs: Tensors, w: Tensors, spec: ModelSpec) -> None:
    tiles = t.arg("tiles")
    val = _f(_operand(t, "best_val", bufs, w)[:, :tiles])  # [B, tiles]
    idx = _operand(t, "best_idx", bufs, w)[:, :tiles]
    best = val.argmax(dim=-1, keepdim=True)  # first (lowest) tile on ties
    _store(_operand(t, "out", bufs, w), idx.gather(1, best)[:, 0])


_HANDLERS: dict[str, Handler] = {
    "EMBED": _embed,
    "LINEAR": _linear,
    "SWIGLU": _swiglu,
    "ROPE_APPEND": _rope_append,
    "ATTN_SPLIT": _attn_split,
    "ATTN_COMBINE": _attn_combine,
    "TOPK": _topk,
    "EXPERT_SWIGLU": _expert_swiglu,
    "EXPERT_DOWN": _expert_down,
    "EXPERT_DOWN_SPLIT": _expert_down_split,
    "EXPERT_MLP": _expert_mlp,
    "RESIDUAL": _residual,
    "LM_HEAD": _lm_head,
    "ARGMAX": _argmax,
}


def _dispatch_table() -> dict[Opcode, Handler]:
    missing = [op.name for op in Opcode if op.name not in _HANDLERS]
    unknown = sorted(set(_HANDLERS) - {op.name for op in Opcode})
    if missing or unknown:
        raise ImportError(f"mkc.schedule.cpu_ops: no CPU handler for opcode(s) {missing}; "
                          f"handlers for unknown opcode(s) {unknown}: keep _HANDLERS in step with Opcode")
    return {op: _HANDLERS[op.name] for op in Opcode}


DISPATCH: dict[Opcode, Handler] = _dispatch_table()


def run_task(task: Task, bufs: Tensors, weights: Tensors, spec: ModelSpec) -> None:
    """Run one task on its tile: reads and writes tensors of ``bufs`` in place (see module doc)."""
    DISPATCH[task.op](task, bufs, weights, spec)
