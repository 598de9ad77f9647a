"""A whole-batch PyTorch mirror of one decode step, buffer by buffer, on any device.

It computes what the lowering's tasks compute (mkc/ir/lower.py, ops.py), with float32 math on
bf16-valued operands and a bf16 rounding exactly where the lowering stores a bf16 buffer (normed
input, QKV, q after RoPE, attention output, SwiGLU hidden states, final norm). The kernel does
the same dot products in a different summation order, so the two agree to float32 rounding
except where a bf16 rounding flips; that is why the test tolerances can be tight.

At full size (North Mini Code, 61 GB of weights) this runs on the GPU in seconds, where the CPU
executor would take far too long; for the tiny model the tests also use the CPU executor.

Routing can be *teacher-forced*: ``forced`` gives the experts the kernel chose per layer, the
mirror checks that its own top-k agrees up to near-ties and then uses the kernel's choice, so one
near-tie flip does not make every later layer incomparable.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from mkc.ir.spec import ModelSpec


@dataclass
class MirrorResult:
    logits: torch.Tensor  # [B, vocab] float32
    next_token: torch.Tensor  # [B] int64
    x: list[torch.Tensor] = field(default_factory=list)  # residual stream into layer i+1, [B, H] f32
    router_logits: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [B, E] f32
    topk: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [B, k] own choice
    attn: list[torch.Tensor] = field(default_factory=list)  # [B, heads * head_dim] bf16 per layer
    route_flips: list[tuple[int, int, float]] = field(default_factory=list)  # (layer, token, logit gap)
    kv_new: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # [B, G, D] appended k, v


def _bf(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).float()


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """[B, H] f32 → bf16-valued f32, as the RMSNORM task stores it."""
    return _bf(x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.float())


def head_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """qk-norm of each head of x [B, heads, D]: normalised, rounded, times the weight, rounded."""
    return _bf(_bf(x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)) * w.float())


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float, style: str) -> torch.Tensor:
    """x [B, heads, D] (bf16-valued f32) rotated at positions [B]; bf16-valued result."""
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64, device=x.device).float() / d))
    ang = positions.float()[:, None] * inv_freq[None]  # [B, D/2] float32, as transformers
    cos, sin = ang.cos()[:, None], ang.sin()[:, None]
    if style == "interleaved":
        a, b = x[..., 0::2], x[..., 1::2]
        out = torch.empty_like(x)
        out[..., 0::2] = a * cos - b * sin
        out[..., 1::2] = b * cos + a * sin
    else:
        a, b = x[..., : d // 2], x[..., d // 2:]
        out = torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)
    return _bf(out)


def _mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [B, k] f32 @ w[rows, k]^T in float32 (w converted in chunks to bound memory)."""
    rows = w.shape[0]
    step = max(1, (1 << 28) // max(1, w.shape[1]))  # 1 GiB of float32 at a time
    return torch.cat([x @ w[i:i + step].float().T for i in range(0, rows, step)], dim=-1)


@torch.no_grad()
def mirror_step(spec: ModelSpec, weights: dict[str, torch.Tensor], kv: list[tuple[torch.Tensor, torch.Tensor]],
                tokens: torch.Tensor, positions: torch.Tensor, *,
                forced: dict[int, torch.Tensor] | None = None,
                layer_inputs: list[torch.Tensor] | None = None) -> MirrorResult:
    """One decode step. ``kv[layer] = (k_cache, v_cache)`` [B, G, ctx, D] hold the keys of the
    positions below ``positions`` (read only: the current key/value are used from registers).
    ``forced[layer]`` = [B, k] experts to use instead of the mirror's own top-k (see module doc);
    every disagreement is recorded in ``route_flips`` with how far below the mirror's k-th logit
    the kernel's extra expert lies (a near-tie when small).
    ``layer_inputs`` (num_layers + 1 tensors [B, H]): teacher-force the residual stream, layer i
    starting from ``layer_inputs[i]`` (the kernel's) and the head from the last one, so each
    layer is compared on its own, without the bf16 noise of the layers before it.
    """
    a = spec.attention
    D, G, QH = a.head_dim, a.num_kv_heads, a.num_heads
    GS = QH // G
    B = tokens.numel()
    dev = weights["embed"].device
    tokens, positions = tokens.to(dev).long(), positions.to(dev).long()
    x = weights["embed"][tokens].float()  # [B, H]
    res = MirrorResult(logits=torch.empty(0), next_token=torch.empty(0))
    for i, ls in enumerate(spec.layers):
        P = f"L{i}"
        if layer_inputs is not None:
            x = layer_inputs[i].to(dev).float()
        n = rms_norm(x, weights[f"{P}.attn_norm"], spec.norm_eps)
        qkv = _bf(_mm(n, weights[f"{P}.w_qkv"]))
        q = qkv[:, : QH * D].view(B, QH, D)
        k = qkv[:, QH * D:(QH + G) * D].view(B, G, D)
        v = qkv[:, (QH + G) * D:].view(B, G, D)
        if a.qk_norm:
            q = head_rms_norm(q, weights[f"{P}.q_norm"], spec.norm_eps)
            k = head_rms_norm(k, weights[f"{P}.k_norm"], spec.norm_eps)
        if ls.rope:
            q, k = rope(q, positions, a.rope_theta, a.rope_style), rope(k, positions, a.rope_theta, a.rope_style)
        res.kv_new.append((k, v))
        kc, vc = kv[i]
        attn = torch.empty(B, QH * D, device=dev)
        for b in range(B):
            p = int(positions[b])
            lo = max(0, p - a.sliding_window + 1) if ls.attention == "sliding" else 0
            kk = torch.cat([kc[b, :, lo:p].float(), k[b, :, None]], dim=1)  # [G, keys, D]
            vv = torch.cat([vc[b, :, lo:p].float(), v[b, :, None]], dim=1)
            qg = q[b].view(G, GS, D)
            s = torch.einsum("gqd,gkd->gqk", qg, kk) * D ** -0.5
            o = torch.einsum("gqk,gkd->gqd", torch.softmax(s, dim=-1), vv)  # [G, GS, D]
            attn[b] = _bf(o.reshape(-1))
        res.attn.append(attn)
        wo = weights[f"{P}.w_o"]
        o_part = [_mm(attn[:, g * GS * D:(g + 1) * GS * D], wo[:, g * GS * D:(g + 1) * GS * D]) for g in range(G)]
        out = x.clone()
        for op in o_part:
            out = out + op
        if ls.mlp == "dense":
            inter = spec.dense_intermediate
            gu = _mm(n, weights[f"{P}.w_gate_up"])
            h = _bf(F.silu(gu[:, :inter]) * gu[:, inter:])
            out = out + _mm(h, weights[f"{P}.w_down"])
        else:
            out = out + _moe(spec, weights, i, n, res, forced)
        x = out
        res.x.append(x)
    if layer_inputs is not None:
        x = layer_inputs[len(spec.layers)].to(dev).float()
    fn = rms_norm(x, weights["final_norm"], spec.norm_eps)
    head = weights["embed"] if spec.tie_word_embeddings else weights["lm_head"]
    res.logits = _mm(fn, head) * spec.logit_scale
    res.next_token = res.logits.argmax(-1)
    return res


def _moe(spec: ModelSpec, weights: dict[str, torch.Tensor], i: int, n: torch.Tensor, res: MirrorResult,
         forced: dict[int, torch.Tensor] | None) -> torch.Tensor:
    m = spec.moe
    assert m is not None
    P, B, inter = f"L{i}", n.shape[0], m.intermediate
    logits = _mm(n, weights[f"{P}.w_router"])  # [B, E]
    res.router_logits[i] = logits
    vals, idx = torch.topk(logits, m.top_k, dim=-1)
    res.topk[i] = idx
    if forced is not None and i in forced:
        chosen = forced[i].to(idx.device).long()
        kth = vals[:, -1]
        for b in range(B):
            extra = sorted(set(chosen[b].tolist()) - set(idx[b].tolist()))
            if extra:  # the kernel picked experts the mirror ranks below its k-th: how far below?
                gap = float((kth[b] - logits[b, extra]).max())
                res.route_flips.append((i, b, gap))
        idx = chosen
    lv = torch.gather(logits, 1, idx)
    if m.scoring == "sigmoid":
        wts = torch.sigmoid(lv)
        if m.normalize_top_k:
            wts = wts / wts.sum(-1, keepdim=True)
    else:
        wts = torch.softmax(lv, dim=-1)
    total = torch.zeros(B, spec.hidden_size, device=n.device)
    wgu, wd = weights[f"{P}.w_experts_gate_up"], weights[f"{P}.w_experts_down"]
    for e in torch.unique(idx).tolist():
        gu = _mm(n, wgu[e])
        h = _bf(F.silu(gu[:, :inter]) * gu[:, inter:])
        y = _mm(h, wd[e])  # [B, H]
        w_e = (wts * (idx == e)).sum(-1)  # [B], 0 where not routed
        total = total + w_e[:, None] * y
    return total
