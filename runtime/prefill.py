"""Prefill in plain PyTorch: a whole prompt (or the part after a cached prefix) in one batched
forward over its positions, writing its K/V straight into a slot's cache.

The arithmetic mirrors the decode tasks (``mkc/schedule/cpu_ops.py``) so the cache it writes is
what token-by-token decoding would have written: float32 compute, and every tensor the lowering
stores as "bf16" rounded to the activation dtype at the same points (normed input, qkv, q/k after
RoPE, the cache, attention output, SwiGLU hidden). Any backend whose KV cache is a torch tensor
[kv_heads, context, head_dim] per layer and slot can use it.
"""

from __future__ import annotations

from collections.abc import Sequence

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


class Prefill:
    """Runs prompts through ``spec`` with ``weights`` (logical names, see runtime/weights.py).

    ``act_dtype`` is the storage dtype of "bf16" activations in the decode path (bfloat16 on the
    GPU; float32 in an exact CPU run). ``chunk`` bounds the positions computed at once.
    """

    def __init__(self, spec: ModelSpec, weights: dict[str, torch.Tensor], *,
                 act_dtype: torch.dtype = torch.float32, chunk: int = 256):
        self.spec, self.w, self.act_dtype, self.chunk = spec, weights, act_dtype, chunk

    def _r(self, x: torch.Tensor) -> torch.Tensor:
        """Round to the activation storage dtype, as a store to a "bf16" buffer does."""
        return x if self.act_dtype == torch.float32 else x.to(self.act_dtype).float()

    def _mm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return matmul_f32(x, self.w[name])

    @torch.inference_mode()
    def run(self, token_ids: Sequence[int], start: int,
            kv: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Write K/V of ``token_ids`` at positions ``start..`` into ``kv[layer] = (k, v)``, each
        [kv_heads, context, head_dim] (positions below ``start`` already written); return the
        float32 logits [vocab] of the last token."""
        device = kv[0][0].device
        ids = torch.as_tensor(list(token_ids), dtype=torch.long, device=device)
        if ids.numel() == 0:
            raise ValueError("prefill: no tokens")
        ctx = kv[0][0].shape[1]
        if start + ids.numel() > ctx:
            raise ValueError(f"prefill: positions {start}..{start + ids.numel() - 1} exceed the context ({ctx})")
        x = None
        for lo in range(0, ids.numel(), self.chunk):
            x = self._chunk(ids[lo:lo + self.chunk], start + lo, kv)
        assert x is not None
        s = self.spec
        last = self._r(_rms_norm(x[-1:], self.w["final_norm"], s.norm_eps))
        return self._mm(last, "embed" if s.tie_word_embeddings else "lm_head")[0] * s.logit_scale

    def _chunk(self, ids: torch.Tensor, start: int, kv: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        s = self.spec
        x = self.w["embed"][ids].float()  # [T, H] residual stream, float32
        pos = torch.arange(start, start + ids.numel(), device=ids.device)
        for i, ls in enumerate(s.layers):
            P = f"L{i}"
            n = self._r(_rms_norm(x, self.w[f"{P}.attn_norm"], s.norm_eps))  # [T, H]
            attn = self._attention(i, n, pos, kv[i])
            if s.block == "parallel":
                x = x + attn + self._mlp(i, n)
            else:
                x = x + attn
                x = x + self._mlp(i, self._r(_rms_norm(x, self.w[f"{P}.mlp_norm"], s.norm_eps)))
        return x

    def _attention(self, layer: int, n: torch.Tensor, pos: torch.Tensor,
                   cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
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
        kc, vc = cache  # [G, ctx, D]
        p0, p1 = int(pos[0]), int(pos[-1]) + 1
        kc[:, p0:p1] = k.transpose(0, 1).to(kc.dtype)
        vc[:, p0:p1] = v.transpose(0, 1).to(vc.dtype)
        window = a.sliding_window if ls.attention == "sliding" else 0
        k0 = max(0, p0 + 1 - window) if window else 0  # first key any query of the chunk attends
        keys = kc[:, k0:p1].float()  # [G, S, D]
        vals = vc[:, k0:p1].float()
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
