"""Prefill: a prompt (or the part after a cached prefix) as batched forwards over its positions,
writing its K/V straight into a slot's cache.

Two implementations of one model:

* ``Prefill``, the reference and the CPU path: float32 arithmetic that mirrors the decode tasks
  (``mkc/schedule/cpu_ops.py``), so the cache it writes is what token-by-token decoding would
  have written; every tensor the lowering stores as "bf16" is rounded to the activation dtype at
  the same points (normed input, qkv, q/k after RoPE, the cache, attention output, SwiGLU hidden).
* ``FastPrefill``, the GPU path: bf16 GEMMs with float32 accumulation, the experts as grouped
  GEMMs over the tokens sorted by expert (no host synchronisation per expert or layer), attention
  through SDPA (the flash kernel for causal layers; sliding-window layers key-blocked with a band
  mask), never all [query, key] scores at once.

Both run layer by layer as a generator (``layers``): the engine can stop between two layers, run
a decode step for the other streams and go on. The cache is reached through ``SlotKV``: one slot's
slab (``SlabKV``) or its pages in a pool (``PagedKV``).
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from typing import Protocol

import torch
import torch.nn.functional as F

from mkc.ir.spec import ModelSpec
from mkc.schedule.cpu_ops import head_rms_norm, route


def _rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w.float() * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x: torch.Tensor, pos: torch.Tensor, theta: float, style: str) -> torch.Tensor:
    """Rotate ``x`` [T, heads, D] (float32) to positions ``pos`` [T]."""
    d = x.shape[-1]
    inv = (1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))).to(x.device)  # [D/2]
    ang = pos.float()[:, None, None] * inv  # [T, 1, D/2]
    cos, sin = ang.cos(), ang.sin()
    if style == "interleaved":
        a, b = x[..., 0::2], x[..., 1::2]
        return torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(-2)
    a, b = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


_F32_CHUNK = 1 << 24  # elements of a weight converted to float32 at once (64 MiB)


def matmul_f32(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x [T, K] @ w[N, K]^T`` with float32 accumulation and a float32 result, for any weight
    dtype, without a float32 copy of the whole weight (an LM head can be gigabytes)."""
    if w.dtype == torch.float32:
        return x.float() @ w.T
    if x.is_cuda:  # bf16 x bf16 -> fp32 out on the tensor cores, no rounding of the result
        try:
            return torch.mm(x.to(w.dtype), w.T, out_dtype=torch.float32)
        except (RuntimeError, TypeError):
            pass
    rows = max(1, _F32_CHUNK // max(1, w.shape[1]))
    x = x.float()
    return torch.cat([x @ w[r:r + rows].float().T for r in range(0, w.shape[0], rows)], dim=-1)


class SlotKV(Protocol):
    """One slot's KV cache, per layer, as the prefill reads and writes it."""

    context: int  # positions the slot may hold

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [T, kv_heads, head_dim] at positions start..start+T-1."""
        ...

    def read(self, layer: int, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v) of positions [lo, hi), each [kv_heads, hi - lo, head_dim] in the cache's dtype."""
        ...


class SlabKV:
    """A slot's slab: per layer (k, v) views [kv_heads, context, head_dim]."""

    def __init__(self, kv: Sequence[tuple[torch.Tensor, torch.Tensor]]):
        self.kv, self.context = kv, kv[0][0].shape[1]

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        kc, vc = self.kv[layer]
        kc[:, start:start + k.shape[0]] = k.transpose(0, 1).to(kc.dtype)
        vc[:, start:start + v.shape[0]] = v.transpose(0, 1).to(vc.dtype)

    def read(self, layer: int, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        kc, vc = self.kv[layer]
        return kc[:, lo:hi], vc[:, lo:hi]


class PagedKV:
    """A slot's positions in a page pool: per layer (k, v) pools [kv_heads, pages, page_size,
    head_dim]; position p lives in page ``pages[p // page_size]`` at offset ``p % page_size``."""

    def __init__(self, pools: Sequence[tuple[torch.Tensor, torch.Tensor]], pages: Sequence[int]):
        self.pools = pools
        self.page_size = pools[0][0].shape[2]
        self.context = len(pages) * self.page_size
        self._pages = torch.tensor(list(pages), dtype=torch.long, device=pools[0][0].device)

    def _where(self, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(lo, hi, device=self._pages.device)
        return self._pages[pos // self.page_size], pos % self.page_size

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        page, off = self._where(start, start + k.shape[0])
        kp, vp = self.pools[layer]
        kp[:, page, off] = k.transpose(0, 1).to(kp.dtype)
        vp[:, page, off] = v.transpose(0, 1).to(vp.dtype)

    def read(self, layer: int, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        page, off = self._where(lo, hi)
        kp, vp = self.pools[layer]
        return kp[:, page, off], vp[:, page, off]


def as_slot_kv(kv: SlotKV | Sequence[tuple[torch.Tensor, torch.Tensor]]) -> SlotKV:
    return kv if hasattr(kv, "read") else SlabKV(kv)  # type: ignore[arg-type,return-value]


PrefillSteps = Generator[None, None, "torch.Tensor | None"]


def run_to_end(steps: PrefillSteps) -> torch.Tensor | None:
    """Drive a ``layers`` generator to its end; its return value (the logits or None)."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


class Prefill:
    """Runs prompts through ``spec`` with ``weights`` (logical names, see runtime/weights.py).

    ``act_dtype`` is the storage dtype of "bf16" activations in the decode path (bfloat16 on the
    GPU; float32 in an exact CPU run). ``chunk`` bounds the positions computed at once.
    """

    def __init__(self, spec: ModelSpec, weights: dict[str, torch.Tensor], *,
                 act_dtype: torch.dtype = torch.float32, chunk: int = 256):
        self.spec, self.w, self.act_dtype, self.chunk = spec, weights, act_dtype, chunk

    def run(self, token_ids: Sequence[int], start: int,
            kv: SlotKV | Sequence[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Write K/V of ``token_ids`` at positions ``start..`` into the slot's cache (positions
        below ``start`` already written: ``kv`` is a SlotKV, or per layer (k, v) [kv_heads,
        context, head_dim]); return the float32 logits [vocab] of the last token."""
        logits = run_to_end(self.layers(token_ids, start, kv))
        assert logits is not None
        return logits

    def layers(self, token_ids: Sequence[int], start: int,
               kv: SlotKV | Sequence[tuple[torch.Tensor, torch.Tensor]], *, logits: bool = True) -> PrefillSteps:
        """``run`` as a generator that yields after each layer of each chunk and returns the
        logits (None when ``logits`` is False: a chunk before the prompt's last). Raises
        ValueError at once, before any work, on an empty prompt or one past the context."""
        kv = as_slot_kv(kv)
        if not len(token_ids):
            raise ValueError("prefill: no tokens")
        if start + len(token_ids) > kv.context:
            raise ValueError(f"prefill: positions {start}..{start + len(token_ids) - 1} exceed the context "
                             f"({kv.context})")
        return self._steps(list(token_ids), start, kv, logits)

    @torch.inference_mode()
    def _steps(self, token_ids: list[int], start: int, kv: SlotKV, logits: bool) -> PrefillSteps:
        device = self.w["final_norm"].device
        x = None
        for lo in range(0, len(token_ids), self.chunk):
            ids = torch.tensor(token_ids[lo:lo + self.chunk], dtype=torch.long, device=device)
            pos = torch.arange(start + lo, start + lo + ids.numel(), device=device)
            x = self._embed(ids)  # [T, H] residual stream, float32
            for i in range(self.spec.num_layers):
                x = self._layer(i, x, pos, start + lo, kv)
                yield
        assert x is not None
        return self._logits(x[-1:]) if logits else None

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.w["embed"][ids].float()

    def _logits(self, last: torch.Tensor) -> torch.Tensor:
        """float32 logits [vocab] of one position's residual ``last`` [1, H]."""
        s = self.spec
        n = self._r(_rms_norm(last, self.w["final_norm"], s.norm_eps))
        # an FP8 step has its own head even where the embedding is tied (mkc/ir/fp8.py)
        head = "lm_head" if not s.tie_word_embeddings or "lm_head" in self.w else "embed"
        return self._mm(n, head)[0] * s.logit_scale

    def _r(self, x: torch.Tensor) -> torch.Tensor:
        """Round to the activation storage dtype, as a store to a "bf16" buffer does."""
        return x if self.act_dtype == torch.float32 else x.to(self.act_dtype).float()

    def _mm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return matmul_f32(x, self.w[name])

    def _layer(self, i: int, x: torch.Tensor, pos: torch.Tensor, p0: int, kv: SlotKV) -> torch.Tensor:
        """Layer i over positions ``pos`` [T] (the first, ``p0``, also on the host)."""
        s, P = self.spec, f"L{i}"
        n = self._r(_rms_norm(x, self.w[f"{P}.attn_norm"], s.norm_eps))  # [T, H]
        attn = self._attention(i, n, pos, p0, kv)
        if s.block == "parallel":
            return x + attn + self._mlp(i, n)
        x = x + attn
        return x + self._mlp(i, self._r(_rms_norm(x, self.w[f"{P}.mlp_norm"], s.norm_eps)))

    def _attention(self, layer: int, n: torch.Tensor, pos: torch.Tensor, p0: int, kv: SlotKV) -> torch.Tensor:
        s, a = self.spec, self.spec.attention
        ls = s.layers[layer]
        D, G, QH, T = a.head_dim, a.num_kv_heads, a.num_heads, n.shape[0]
        GS = QH // G
        qkv = self._r(self._mm(n, f"L{layer}.w_qkv"))  # [T, (QH + 2G) * D]
        q = qkv[:, :QH * D].view(T, QH, D)
        k = qkv[:, QH * D:(QH + G) * D].view(T, G, D)
        v = qkv[:, (QH + G) * D:].view(T, G, D)
        if a.qk_norm:  # per-head RMSNorm, rounded as the ROPE_APPEND task rounds it
            q = head_rms_norm(q, self.w[f"L{layer}.q_norm"].float(), s.norm_eps, self.act_dtype)
            k = head_rms_norm(k, self.w[f"L{layer}.k_norm"].float(), s.norm_eps, self.act_dtype)
        if ls.rope:
            q = self._r(_rope(q, pos, a.rope_theta, a.rope_style))
            k = _rope(k, pos, a.rope_theta, a.rope_style)
        p1 = p0 + T
        kv.write(layer, p0, k, v)
        window = a.sliding_window if ls.attention == "sliding" else 0
        k0 = max(0, p0 + 1 - window) if window else 0  # first key any query of the chunk attends
        kc, vc = kv.read(layer, k0, p1)
        keys, vals = kc.float(), vc.float()  # [G, S, D]
        kpos = torch.arange(k0, p1, device=pos.device)
        allowed = kpos[None, :] <= pos[:, None]  # [T, S] causal
        if window:
            allowed &= kpos[None, :] > pos[:, None] - window
        qg = q.view(T, G, GS, D).permute(1, 2, 0, 3)  # [G, GS, T, D]
        scores = (qg @ keys[:, None].transpose(-1, -2)) * D ** -0.5  # [G, GS, T, S]
        scores = scores.masked_fill(~allowed, float("-inf"))
        out = torch.softmax(scores, dim=-1) @ vals[:, None]  # [G, GS, T, D]
        out = self._r(out.permute(2, 0, 1, 3).reshape(T, QH * D))
        return self._mm(out, f"L{layer}.w_o")

    def _mlp(self, layer: int, n: torch.Tensor) -> torch.Tensor:
        s, P = self.spec, f"L{layer}"
        if s.layers[layer].mlp == "dense":
            gate, up = self._mm(n, f"{P}.w_gate_up").chunk(2, dim=-1)
            return self._mm(self._r(F.silu(gate) * up), f"{P}.w_down")
        m = s.moe
        assert m is not None
        logits = self._mm(n, f"{P}.w_router")  # [T, E]
        experts, wts = route(logits, m.top_k, m.scoring, m.normalize_top_k)  # [T, k] each, as the TOPK task
        # each token sums its experts in ascending expert order, as the decode residual does
        order = experts.sort(dim=-1)
        experts, wts = order.values, wts.gather(1, order.indices)
        parts = torch.zeros(n.shape[0], m.top_k, n.shape[1], device=n.device)  # [T, k, H]
        for e in torch.unique(experts).tolist():
            tok, slot = (experts == e).nonzero(as_tuple=True)
            gate, up = matmul_f32(n[tok], self.w[f"{P}.w_experts_gate_up"][e]).chunk(2, dim=-1)
            h = self._r(F.silu(gate) * up)
            parts[tok, slot] = wts[tok, slot, None] * matmul_f32(h, self.w[f"{P}.w_experts_down"][e])
        return parts.sum(1)


SUB_CHUNK = 2048  # positions FastPrefill runs through a layer at a time (bounds the activations)


def _grouped_mm(x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """Rows ``x`` [M, K] sorted by group, group g's rows ending at ``ends[g]`` (int32), times
    ``w[g]`` [N, K] transposed: [M, N] in x's dtype, float32 accumulation."""
    mm = getattr(F, "grouped_mm", None) or torch._grouped_mm
    return mm(x, w.transpose(-2, -1), offs=ends)


class FastPrefill(Prefill):
    """The same model on the tensor cores (see the module docstring); K/V and logits equal the
    reference's within bf16 rounding (tests/test_prefill.py states the budget).

    Activations are stored in ``act_dtype`` (bf16 on the GPU) where the reference rounds to it;
    the residual stream and the router logits stay float32. ``weights`` may be tile-ordered
    behind a mapping with ``matrix(name)`` (a whole expert stack row-major) and ``rows(name,
    ids)`` (embedding rows), as ``LogicalWeights`` is. A call runs layer by layer over all its
    positions, ``chunk`` positions at a time within a layer (which bounds the activations): each
    layer's matrices are read back row-major once a call, one layer at a time, so the GPU never
    holds a second copy of the model; on a GPU the MLP's (the experts: nearly all of a layer's
    bytes) are read back on a second stream while the layer's attention runs.
    """

    def __init__(self, spec: ModelSpec, weights: dict[str, torch.Tensor], *,
                 act_dtype: torch.dtype = torch.bfloat16, chunk: int = SUB_CHUNK, query_block: int = 2048):
        super().__init__(spec, weights, act_dtype=act_dtype, chunk=chunk)
        self.query_block = query_block  # queries per SDPA call of a sliding layer (bounds its mask)
        self._held: dict[str, torch.Tensor] = {}  # the current layer's matrices, row-major
        self._ready: dict[str, torch.cuda.Event] = {}  # held matrices still being read back on _copies
        self._copies: torch.cuda.Stream | None = None  # the stream that reads the MLP's matrices back
        self._gpu = weights["final_norm"].device.type == "cuda"

    @torch.inference_mode()
    def _steps(self, token_ids: list[int], start: int, kv: SlotKV, logits: bool) -> PrefillSteps:
        """Layer-major: every position of the call through a layer, then the next layer (a
        position's keys in a layer are written before any later position of it attends). Within a
        layer, the attention of every ``chunk`` of positions runs before any of the MLP, which
        needs only its own positions' attention: meanwhile the MLP's matrices are read back from
        tile order on a second stream (``_read_back``)."""
        device = self.w["final_norm"].device
        ids = torch.tensor(token_ids, dtype=torch.long, device=device)
        pos = torch.arange(start, start + ids.numel(), device=device)
        spans = [(lo, min(lo + self.chunk, ids.numel())) for lo in range(0, ids.numel(), self.chunk)]
        x = self._embed(ids)  # [T, H] residual stream, float32
        try:
            for i in range(self.spec.num_layers):
                self._read_back(self._mlp_matrices(i))
                normed = [self._attend(i, x, lo, hi, pos[lo:hi], start + lo, kv) for lo, hi in spans]
                for (lo, hi), n in zip(spans, normed):
                    x[lo:hi] = x[lo:hi] + self._mlp(i, n if n is not None else self._mlp_input(i, x[lo:hi]))
                self._held.clear()
                self._ready.clear()
                yield
            return self._logits(x[-1:]) if logits else None
        finally:
            self._held.clear()
            self._ready.clear()

    def _attend(self, i: int, x: torch.Tensor, lo: int, hi: int, pos: torch.Tensor, p0: int,
                kv: SlotKV) -> torch.Tensor | None:
        """Positions [lo, hi) of layer i's attention, added to the residual ``x`` in place; returns
        the normed input a parallel block's MLP shares (None in a sequential block)."""
        n = _rms_norm(x[lo:hi], self.w[f"L{i}.attn_norm"], self.spec.norm_eps).to(self.act_dtype)  # [T, H]
        x[lo:hi] = x[lo:hi] + self._attention(i, n, pos, p0, kv)
        return n if self.spec.block == "parallel" else None

    def _mlp_input(self, i: int, x: torch.Tensor) -> torch.Tensor:
        return _rms_norm(x, self.w[f"L{i}.mlp_norm"], self.spec.norm_eps).to(self.act_dtype)

    def _mlp_matrices(self, i: int) -> tuple[str, ...]:
        P = f"L{i}"
        if self.spec.layers[i].mlp == "dense":
            return f"{P}.w_gate_up", f"{P}.w_down"
        return f"{P}.w_experts_gate_up", f"{P}.w_experts_down"

    def _read_back(self, names: Sequence[str]) -> None:
        """Start reading ``names`` back from tile order on a second CUDA stream, after the work
        queued so far (a decode step between layers keeps the read bandwidth to itself), beside
        the attention queued next; ``_weight`` makes the compute stream wait for each. Without
        tile order or a GPU, nothing: a matrix is read back when first used."""
        whole = getattr(self.w, "matrix", None)
        if whole is None or not self._gpu:
            return
        compute = torch.cuda.current_stream()
        if self._copies is None:
            self._copies = torch.cuda.Stream(device=compute.device)
        self._copies.wait_stream(compute)
        with torch.cuda.stream(self._copies):
            for name in names:
                self._held[name] = whole(name)
                self._ready[name] = self._copies.record_event()

    def _weight(self, name: str) -> torch.Tensor:
        """A matrix row-major: read back from tile order once per layer and call."""
        whole = getattr(self.w, "matrix", None)
        if whole is None:
            return self.w[name]
        if name not in self._held:
            self._held[name] = whole(name)
        copied = self._ready.pop(name, None)
        if copied is not None:  # read back on the copy stream: wait for it, and keep its memory until used
            compute = torch.cuda.current_stream()
            compute.wait_event(copied)
            self._held[name].record_stream(compute)
        return self._held[name]

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        rows = getattr(self.w, "rows", None)
        return (rows("embed", ids) if rows is not None else self.w["embed"][ids]).float()

    def _act_mm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """x @ w.T stored in the activation dtype (fp32 accumulation on the tensor cores)."""
        w = self._weight(name)
        return (x.to(w.dtype) @ w.T).to(self.act_dtype)

    def _mm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """x @ w.T in float32: the product of bf16 operands with a float32 result where torch
        offers it, else rounded to bf16 and widened (never a float32 copy of the weight)."""
        w = self._weight(name)
        if w.dtype == torch.float32:
            return x.float() @ w.T
        x = x.to(w.dtype)
        try:
            return torch.mm(x, w.T, out_dtype=torch.float32)
        except (RuntimeError, TypeError):
            return (x @ w.T).float()

    def _attention(self, layer: int, n: torch.Tensor, pos: torch.Tensor, p0: int, kv: SlotKV) -> torch.Tensor:
        s, a, act = self.spec, self.spec.attention, self.act_dtype
        D, G, QH, T = a.head_dim, a.num_kv_heads, a.num_heads, n.shape[0]
        qkv = self._act_mm(n, f"L{layer}.w_qkv")  # [T, (QH + 2G) * D]
        q = qkv[:, :QH * D].view(T, QH, D).float()
        k = qkv[:, QH * D:(QH + G) * D].view(T, G, D).float()
        v = qkv[:, (QH + G) * D:].view(T, G, D)
        if a.qk_norm:
            q = head_rms_norm(q, self.w[f"L{layer}.q_norm"].float(), s.norm_eps, act)
            k = head_rms_norm(k, self.w[f"L{layer}.k_norm"].float(), s.norm_eps, act)
        if s.layers[layer].rope:
            q = _rope(q, pos, a.rope_theta, a.rope_style)
            k = _rope(k, pos, a.rope_theta, a.rope_style)
        kv.write(layer, p0, k, v)
        window = a.sliding_window if s.layers[layer].attention == "sliding" else 0
        out = self._sdpa(layer, q.to(act).transpose(0, 1)[None], p0, kv, window)  # [1, QH, T, D]
        return self._mm(out[0].transpose(0, 1).reshape(T, QH * D), f"L{layer}.w_o")

    def _sdpa(self, layer: int, q: torch.Tensor, p0: int, kv: SlotKV, window: int) -> torch.Tensor:
        """Attention of queries q [1, QH, T, D] at positions p0.. over the slot's cache."""
        T = q.shape[2]
        p1 = p0 + T
        if not window or p1 <= window:  # every query sees every earlier key: causal, flash
            k, v = self._heads(kv.read(layer, 0, p1), q)
            if p0 == 0:
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)
            from torch.nn.attention.bias import causal_lower_right

            return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(T, p1))
        # sliding window: per block of queries, the keys its window reaches, under a band mask
        outs = []
        for b0 in range(0, T, self.query_block):
            q0, q1 = p0 + b0, min(p0 + b0 + self.query_block, p1)
            k0 = max(0, q0 + 1 - window)
            k, v = self._heads(kv.read(layer, k0, q1), q)
            qpos = torch.arange(q0, q1, device=q.device)[:, None]
            kpos = torch.arange(k0, q1, device=q.device)[None, :]
            allowed = (kpos <= qpos) & (kpos > qpos - window)  # [Tb, S]
            mask = torch.zeros(q1 - q0, -(-(q1 - k0) // 16) * 16, dtype=q.dtype, device=q.device)
            mask = mask[:, :q1 - k0].masked_fill_(~allowed, float("-inf"))  # rows 16-aligned (mem-efficient)
            outs.append(F.scaled_dot_product_attention(q[:, :, q0 - p0:q1 - p0], k, v, attn_mask=mask))
        return torch.cat(outs, dim=2)

    def _heads(self, kv: tuple[torch.Tensor, torch.Tensor], q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Cache (k, v) [G, S, D] as [1, QH, S, D] in q's dtype (each KV head for its query group)."""
        group = q.shape[1] // kv[0].shape[0]
        return tuple(t.to(q.dtype).repeat_interleave(group, dim=0)[None] for t in kv)  # type: ignore[return-value]

    def _mlp(self, layer: int, n: torch.Tensor) -> torch.Tensor:
        s, P = self.spec, f"L{layer}"
        if s.layers[layer].mlp == "dense":
            gate, up = self._mm(n, f"{P}.w_gate_up").chunk(2, dim=-1)
            return self._mm((F.silu(gate) * up).to(self.act_dtype), f"{P}.w_down")
        m = s.moe
        assert m is not None
        experts, wts = route(self._mm(n, f"{P}.w_router"), m.top_k, m.scoring, m.normalize_top_k)  # [T, k]
        # the (token, expert) pairs sorted by expert: each expert's rows are one group of the GEMMs
        by_expert, order = torch.sort(experts.reshape(-1), stable=True)
        ends = torch.searchsorted(by_expert, torch.arange(m.num_experts, device=n.device), right=True)
        ends = ends.to(torch.int32)
        gate, up = _grouped_mm(n[order // m.top_k], self._weight(f"{P}.w_experts_gate_up"), ends).chunk(2, dim=-1)
        # each row scaled by its routing weight before the down GEMM (linear), so the pairs come
        # back in token order as bf16 rows to sum: no float32 [T * k, H] tensor, no atomics
        h = F.silu(gate.float()).mul_(up).mul_(wts.reshape(-1)[order, None]).to(self.act_dtype)
        down = _grouped_mm(h, self._weight(f"{P}.w_experts_down"), ends)  # [T * k, H]
        back = torch.empty_like(order)
        back[order] = torch.arange(order.numel(), device=n.device)
        return down[back].view(n.shape[0], m.top_k, -1).sum(1, dtype=torch.float32)
