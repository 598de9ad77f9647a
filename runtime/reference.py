"""A plain dense PyTorch implementation of a ModelSpec: the oracle for the task machinery.

It shares nothing with the lowering or the CPU executor (no tiles, no regions, no splits): one
token per sequence per step, each sequence with its own growing KV cache, float32 compute,
written in the shape of the transformers code (RoPE through ``rotate_half``, attention as a
masked softmax over the whole cache, experts token by token).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mkc.ir.spec import ModelSpec


def _rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope_cos_sin(pos: int, head_dim: int, theta: float, style: str) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    freqs = torch.tensor([float(pos)]) * inv_freq  # [head_dim / 2]
    emb = torch.repeat_interleave(freqs, 2) if style == "interleaved" else torch.cat([freqs, freqs])
    return emb.cos(), emb.sin()


def _rotate(x: torch.Tensor, style: str) -> torch.Tensor:
    if style == "interleaved":
        return torch.stack([-x[..., 1::2], x[..., ::2]], dim=-1).flatten(-2)
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


class DenseReference:
    """Decode one token per sequence at a time; ``step`` returns float32 logits [B, vocab].

    Sequence b of a step is the b-th entry of ``tokens`` / ``positions``; its KV cache grows as
    positions arrive (a position may be rewritten, later positions are then dropped).
    """

    def __init__(self, spec: ModelSpec, weights: dict[str, torch.Tensor]):
        self.spec = spec
        self.w = {k: v.detach().float() for k, v in weights.items()}
        # cache[b][layer] = (k [n, kv_heads, head_dim], v [n, kv_heads, head_dim])
        self.cache: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def step(self, tokens, positions) -> torch.Tensor:
        tokens = [int(t) for t in torch.as_tensor(tokens).reshape(-1)]
        positions = [int(p) for p in torch.as_tensor(positions).reshape(-1)]
        return torch.stack([self._token(b, t, p) for b, (t, p) in enumerate(zip(tokens, positions))])

    def _token(self, b: int, token: int, pos: int) -> torch.Tensor:
        s, w = self.spec, self.w
        x = w["embed"][token]  # [H]
        for i, ls in enumerate(s.layers):
            P = f"L{i}"
            n = _rms_norm(x, w[f"{P}.attn_norm"], s.norm_eps)
            attn = self._attention(b, i, n, pos)
            if s.block == "parallel":
                x = x + attn + self._mlp(i, n)
            else:
                x = x + attn
                x = x + self._mlp(i, _rms_norm(x, w[f"{P}.mlp_norm"], s.norm_eps))
        x = _rms_norm(x, w["final_norm"], s.norm_eps)
        head = w["embed"] if s.tie_word_embeddings else w["lm_head"]
        return (head @ x) * s.logit_scale

    def _attention(self, b: int, layer: int, n: torch.Tensor, pos: int) -> torch.Tensor:
        s, a = self.spec, self.spec.attention
        ls = s.layers[layer]
        D, G, QH = a.head_dim, a.num_kv_heads, a.num_heads
        qkv = self.w[f"L{layer}.w_qkv"] @ n
        q = qkv[:QH * D].view(QH, D)
        k = qkv[QH * D:(QH + G) * D].view(G, D)
        v = qkv[(QH + G) * D:].view(G, D)
        if a.qk_norm:  # per-head RMSNorm over head_dim, one weight for all heads
            q = _rms_norm(q, self.w[f"L{layer}.q_norm"], s.norm_eps)
            k = _rms_norm(k, self.w[f"L{layer}.k_norm"], s.norm_eps)
        if ls.rope:
            cos, sin = _rope_cos_sin(pos, D, a.rope_theta, a.rope_style)
            q = q * cos + _rotate(q, a.rope_style) * sin
            k = k * cos + _rotate(k, a.rope_style) * sin
        keys, vals = self._append(b, layer, pos, k, v)  # [pos + 1, G, D]
        lo = max(0, pos + 1 - a.sliding_window) if ls.attention == "sliding" else 0
        keys, vals = keys[lo:pos + 1], vals[lo:pos + 1]
        kk = keys.repeat_interleave(QH // G, dim=1)  # [n, QH, D]
        vv = vals.repeat_interleave(QH // G, dim=1)
        scores = torch.einsum("hd,nhd->hn", q, kk) * D ** -0.5
        out = torch.einsum("hn,nhd->hd", torch.softmax(scores, dim=-1), vv)
        return self.w[f"L{layer}.w_o"] @ out.reshape(-1)

    def _append(self, b: int, layer: int, pos: int, k: torch.Tensor, v: torch.Tensor):
        layers = self.cache.setdefault(b, [(torch.zeros(0, *k.shape), torch.zeros(0, *v.shape))
                                           for _ in self.spec.layers])
        kc, vc = layers[layer]
        if pos > kc.shape[0]:
            raise ValueError(f"DenseReference: sequence {b} jumps to position {pos} but holds only "
                             f"{kc.shape[0]} positions: feed every position in order")
        kc = torch.cat([kc[:pos], k[None]])
        vc = torch.cat([vc[:pos], v[None]])
        layers[layer] = (kc, vc)
        return kc, vc

    def _mlp(self, layer: int, n: torch.Tensor) -> torch.Tensor:
        s, w, P = self.spec, self.w, f"L{layer}"
        if s.layers[layer].mlp == "dense":
            gate, up = (w[f"{P}.w_gate_up"] @ n).chunk(2)
            return w[f"{P}.w_down"] @ (F.silu(gate) * up)
        m = s.moe
        assert m is not None
        logits = w[f"{P}.w_router"] @ n
        if m.scoring == "softmax":  # probabilities over all experts, then the top-k of them
            scores, experts = torch.topk(torch.softmax(logits, dim=-1), m.top_k)
        else:
            vals, experts = torch.topk(logits, m.top_k)
            scores = torch.sigmoid(vals)
        if m.normalize_top_k:
            scores = scores / scores.sum()
        out = torch.zeros_like(n)
        for e, sc in sorted(zip(experts.tolist(), scores)):
            gate, up = (w[f"{P}.w_experts_gate_up"][e] @ n).chunk(2)
            out = out + sc * (w[f"{P}.w_experts_down"][e] @ (F.silu(gate) * up))
        return out

    def set_kv(self, b: int, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Replace sequence b's cache of a layer (e.g. with a prefill): k, v [n, kv_heads, head_dim]."""
        layers = self.cache.setdefault(b, [(torch.zeros(0, *k.shape[1:]), torch.zeros(0, *v.shape[1:]))
                                           for _ in self.spec.layers])
        layers[layer] = (k.detach().float().clone(), v.detach().float().clone())

    def kv(self, b: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequence b's cache of a layer: (k, v), each [positions, kv_heads, head_dim], float32."""
        return self.cache[b][layer]
