"""A batched decode step in plain PyTorch with a static KV cache: the benchmark baseline.

Static shapes throughout (tokens and positions are device tensors, masks are computed from them),
so one step can be captured in a CUDA graph — this is the "plain PyTorch decode step, captured in
a CUDA graph" that ``mkc bench`` measures beside the megakernel, and a GPU reference for tests at
full size. It follows the math of transformers' ``Cohere2MoeForCausalLM`` (and the other families
ModelSpec describes); it does not share code with the lowering or the CPU executor.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mkc.ir.spec import ModelSpec


class TorchDecoder:
    """``step(tokens [B], positions [B]) -> logits [B, vocab]`` (float32), one token per sequence.

    ``routed`` holds, after each step, the [B, top_k] expert ids of every MoE layer (for the
    speed-of-light bytes, which count the distinct experts actually routed).
    """

    def __init__(self, spec: ModelSpec, weights: dict[str, torch.Tensor], batch: int, context: int,
                 device: str | torch.device = "cpu", dtype: torch.dtype = torch.bfloat16):
        self.spec, self.batch, self.context = spec, batch, context
        self.device, self.dtype = torch.device(device), dtype
        self.w = {k: v.to(device=self.device, dtype=dtype) for k, v in weights.items()}
        a = spec.attention
        shape = (batch, a.num_kv_heads, context, a.head_dim)
        self.k_cache = [torch.zeros(shape, device=self.device, dtype=dtype) for _ in spec.layers]
        self.v_cache = [torch.zeros(shape, device=self.device, dtype=dtype) for _ in spec.layers]
        half = torch.arange(0, a.head_dim, 2, dtype=torch.float32, device=self.device)
        self.inv_freq = 1.0 / (a.rope_theta ** (half / a.head_dim))  # [head_dim / 2]
        self.key_pos = torch.arange(context, device=self.device)  # [ctx]
        self.rows = torch.arange(batch, device=self.device)
        self.routed: list[torch.Tensor] = []
        self.grouped = hasattr(torch, "_grouped_mm")  # grouped GEMM over routed experts, else gather

    # -- pieces ----------------------------------------------------------------------------------
    def _norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """RMSNorm in float32, scaled by the weight in the storage dtype (as transformers does)."""
        xf = x.float()
        y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.spec.norm_eps)).to(self.dtype)
        return w * y

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [B, heads, head_dim] rotated at positions [B] (float32 math, storage dtype out)."""
        freqs = positions.float()[:, None] * self.inv_freq[None]  # [B, head_dim / 2]
        xf = x.float()
        if self.spec.attention.rope_style == "interleaved":
            emb = torch.repeat_interleave(freqs, 2, dim=-1)
            rot = torch.stack([-xf[..., 1::2], xf[..., ::2]], dim=-1).flatten(-2)
        else:
            emb = torch.cat([freqs, freqs], dim=-1)
            h = xf.shape[-1] // 2
            rot = torch.cat([-xf[..., h:], xf[..., :h]], dim=-1)
        cos, sin = emb.cos()[:, None], emb.sin()[:, None]
        return (xf * cos + rot * sin).to(self.dtype)

    def _attention(self, i: int, n: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        s, a = self.spec, self.spec.attention
        B, D, G, QH = self.batch, a.head_dim, a.num_kv_heads, a.num_heads
        P = f"L{i}"
        qkv = n @ self.w[f"{P}.w_qkv"].T  # [B, (QH + 2G) * D]
        q = qkv[:, : QH * D].view(B, QH, D)
        k = qkv[:, QH * D:(QH + G) * D].view(B, G, D)
        v = qkv[:, (QH + G) * D:].view(B, G, D)
        if a.qk_norm:
            q = self._norm(q, self.w[f"{P}.q_norm"])
            k = self._norm(k, self.w[f"{P}.k_norm"])
        if s.layers[i].rope:
            q, k = self._rope(q, positions), self._rope(k, positions)
        self.k_cache[i][self.rows, :, positions] = k
        self.v_cache[i][self.rows, :, positions] = v
        visible = self.key_pos[None] <= positions[:, None]  # [B, ctx]
        if s.layers[i].attention == "sliding":
            visible &= self.key_pos[None] > positions[:, None] - a.sliding_window
        # one query per sequence; GQA without repeating K/V; fp32 softmax inside the fused kernel
        out = F.scaled_dot_product_attention(q[:, :, None], self.k_cache[i], self.v_cache[i],
                                             attn_mask=visible[:, None, None], enable_gqa=True)
        return out.reshape(B, QH * D).to(self.dtype) @ self.w[f"{P}.w_o"].T

    def _dense_mlp(self, i: int, n: torch.Tensor) -> torch.Tensor:
        inter = self.spec.dense_intermediate
        gu = n @ self.w[f"L{i}.w_gate_up"].T
        h = (F.silu(gu[:, :inter].float()) * gu[:, inter:].float()).to(self.dtype)
        return h @ self.w[f"L{i}.w_down"].T

    def _moe(self, i: int, n: torch.Tensor) -> torch.Tensor:
        m = self.spec.moe
        assert m is not None
        P, B, K = f"L{i}", self.batch, m.top_k
        logits = (n @ self.w[f"{P}.w_router"].T).float()  # [B, E]
        if m.scoring == "sigmoid":
            top, idx = torch.topk(logits, K, dim=-1)
            wts = torch.sigmoid(top)
        else:
            probs = torch.softmax(logits, dim=-1)
            wts, idx = torch.topk(probs, K, dim=-1)
        if m.normalize_top_k:
            wts = wts / wts.sum(-1, keepdim=True)
        self.routed.append(idx)
        if self.grouped:
            try:
                y = self._experts_grouped(i, n, idx)
            except (RuntimeError, NotImplementedError):  # no grouped GEMM here: gather instead
                self.grouped = False
        if not self.grouped:
            y = self._experts_gathered(i, n, idx)
        return (y.float().view(B, K, -1) * wts[..., None]).sum(1)

    def _experts_grouped(self, i: int, n: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """[B*K, H] expert outputs by one grouped GEMM per matrix over the routed experts: the
        (token, k) rows are sorted by expert and every expert's weights are read in place, once."""
        m = self.spec.moe
        P, E, inter = f"L{i}", m.num_experts, m.intermediate
        flat = idx.reshape(-1)  # [B*K]
        order = torch.argsort(flat, stable=True)
        counts = torch.zeros(E, dtype=torch.int32, device=flat.device).scatter_add_(
            0, flat, torch.ones_like(flat, dtype=torch.int32))
        offs = torch.cumsum(counts, 0, dtype=torch.int32)  # end row of each expert's group
        xin = n.repeat_interleave(m.top_k, dim=0)[order]  # [B*K, H], sorted by expert
        gu = torch._grouped_mm(xin, self.w[f"{P}.w_experts_gate_up"].transpose(-2, -1), offs=offs).float()
        h = (F.silu(gu[:, :inter]) * gu[:, inter:]).to(self.dtype)
        y = torch._grouped_mm(h, self.w[f"{P}.w_experts_down"].transpose(-2, -1), offs=offs)
        return torch.empty_like(y).index_copy_(0, order, y)  # back to (token, k) order

    def _experts_gathered(self, i: int, n: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """The same by gathering each routed expert's weights (a copy per (token, k))."""
        m = self.spec.moe
        P, inter = f"L{i}", m.intermediate
        flat = idx.reshape(-1)
        wgu = self.w[f"{P}.w_experts_gate_up"][flat]  # [B*K, 2I, H]
        wd = self.w[f"{P}.w_experts_down"][flat]  # [B*K, H, I]
        xin = n.repeat_interleave(m.top_k, dim=0)[:, :, None]  # [B*K, H, 1]
        gu = torch.bmm(wgu, xin)[..., 0].float()
        h = (F.silu(gu[:, :inter]) * gu[:, inter:]).to(self.dtype)
        return torch.bmm(wd, h[:, :, None])[..., 0]

    # -- the step --------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        s = self.spec
        self.routed = []
        x = self.w["embed"][tokens].float()  # [B, H] residual stream in float32
        for i, ls in enumerate(s.layers):
            n = self._norm(x, self.w[f"L{i}.attn_norm"])
            attn = self._attention(i, n, positions).float()
            if s.block == "sequential":
                x = x + attn
                n = self._norm(x, self.w[f"L{i}.mlp_norm"])
                attn = 0.0
            mlp = self._dense_mlp(i, n) if ls.mlp == "dense" else self._moe(i, n)
            x = x + attn + mlp.float()
        n = self._norm(x, self.w["final_norm"])
        head = self.w["embed"] if s.tie_word_embeddings else self.w["lm_head"]
        return (n @ head.T).float() * s.logit_scale
