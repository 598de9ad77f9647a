"""Model weights under the lowering's logical buffer names.

The lowering (``mkc/ir/lower.py``) names each weight buffer and fixes its layout; this module is
the one place that maps a checkpoint onto those names, repacking once at load time:

=============================  =====================================  ==========================
logical name                   shape                                  transformers tensor(s)
=============================  =====================================  ==========================
``embed``                      [vocab, hidden]                        model.embed_tokens.weight
``L{i}.attn_norm``             [hidden]                               ...input_layernorm.weight
``L{i}.mlp_norm``              [hidden] (sequential blocks only)      ...post_attention_layernorm
``L{i}.w_qkv``                 [(heads + 2 kv) * head_dim, hidden]    cat(q_proj, k_proj, v_proj)
``L{i}.w_o``                   [hidden, heads * head_dim]             self_attn.o_proj.weight
``L{i}.w_gate_up`` (dense)     [2 * inter, hidden]                    cat(mlp.gate_proj, mlp.up_proj)
``L{i}.w_down`` (dense)        [hidden, inter]                        mlp.down_proj.weight
``L{i}.w_router`` (moe)        [experts, hidden]                      mlp.gate.weight
``L{i}.w_experts_gate_up``     [experts, 2 * inter, hidden]           stack(cat(gate_e, up_e)) or
                                                                      fused mlp.experts.gate_up_proj
``L{i}.w_experts_down``        [experts, hidden, inter]               stack(down_e) or fused
                                                                      mlp.experts.down_proj
``final_norm``                 [hidden]                               model.norm.weight
``lm_head`` (untied only)      [vocab, hidden]                        lm_head.weight
=============================  =====================================  ==========================
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from mkc.ir.spec import ModelSpec


class CheckpointError(ValueError):
    """A checkpoint does not match the model spec: names the tensor, the file and what was expected."""


def weight_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every logical weight name of the model and its shape, in lowering order."""
    H, a = spec.hidden_size, spec.attention
    out: dict[str, tuple[int, ...]] = {"embed": (spec.vocab_size, H)}
    for i, ls in enumerate(spec.layers):
        P = f"L{i}"
        out[f"{P}.attn_norm"] = (H,)
        out[f"{P}.w_qkv"] = ((a.num_heads + 2 * a.num_kv_heads) * a.head_dim, H)
        out[f"{P}.w_o"] = (H, a.num_heads * a.head_dim)
        if spec.block == "sequential":
            out[f"{P}.mlp_norm"] = (H,)
        if ls.mlp == "dense":
            out[f"{P}.w_gate_up"] = (2 * spec.dense_intermediate, H)
            out[f"{P}.w_down"] = (H, spec.dense_intermediate)
        else:
            m = spec.moe
            assert m is not None
            out[f"{P}.w_router"] = (m.num_experts, H)
            out[f"{P}.w_experts_gate_up"] = (m.num_experts, 2 * m.intermediate, H)
            out[f"{P}.w_experts_down"] = (m.num_experts, H, m.intermediate)
    out["final_norm"] = (H,)
    if not spec.tie_word_embeddings:
        out["lm_head"] = (spec.vocab_size, H)
    return out


def random_weights(spec: ModelSpec, seed: int, dtype: torch.dtype = torch.float32,
                   std: float = 0.02) -> dict[str, torch.Tensor]:
    """Random weights for every logical name: normal(0, std); norm weights 1 + normal(0, 0.05)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in weight_shapes(spec).items():
        x = torch.randn(shape, generator=g, dtype=torch.float32)
        out[name] = (1.0 + 0.05 * x if name.endswith("norm") else std * x).to(dtype)
    return out


class _Checkpoint:
    """All tensors of the ``*.safetensors`` files of a folder, opened lazily by name."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.files = sorted(folder.glob("*.safetensors"))
        if not self.files:
            raise CheckpointError(f"{folder}: no *.safetensors files: expected a Hugging Face checkpoint folder")
        self.where: dict[str, Path] = {}
        for f in self.files:
            with safe_open(str(f), framework="pt") as h:
                for k in h.keys():  # noqa: SIM118 - safe_open handles are not iterable
                    self.where[k] = f

    def has(self, name: str) -> bool:
        return name in self.where

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, needed_for: str) -> torch.Tensor:
        f = self.where.get(name)
        if f is None:
            files = ", ".join(p.name for p in self.files)
            raise CheckpointError(f"{self.folder}: tensor '{name}' (needed for {needed_for}) is in none of the "
                                  f"checkpoint files ({files})")
        with safe_open(str(f), framework="pt") as h:
            t = h.get_tensor(name)
        if tuple(t.shape) != tuple(shape):
            raise CheckpointError(f"{f}: tensor '{name}' has shape {list(t.shape)}: expected {list(shape)} "
                                  f"for {needed_for} (does the config match the checkpoint?)")
        return t.to(dtype)


def load_checkpoint(folder: str | Path, spec: ModelSpec, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """Read a transformers-layout safetensors checkpoint into the lowering's logical weights.

    Raises ``CheckpointError`` naming the tensor and the file when a tensor is missing or has
    the wrong shape. Expert weights may be stored per expert (what ``save_pretrained`` writes:
    ``mlp.experts.{e}.{gate,up,down}_proj.weight``) or fused (``mlp.experts.gate_up_proj``
    [E, 2I, H], ``mlp.experts.down_proj`` [E, H, I]).
    """
    ck = _Checkpoint(Path(folder))
    a, H = spec.attention, spec.hidden_size
    D = a.head_dim
    out: dict[str, torch.Tensor] = {}

    def get(name: str, shape: tuple[int, ...], logical: str) -> torch.Tensor:
        return ck.get(name, shape, dtype, logical)

    out["embed"] = get("model.embed_tokens.weight", (spec.vocab_size, H), "embed")
    for i, ls in enumerate(spec.layers):
        P, T = f"L{i}", f"model.layers.{i}"
        out[f"{P}.attn_norm"] = get(f"{T}.input_layernorm.weight", (H,), f"{P}.attn_norm")
        out[f"{P}.w_qkv"] = torch.cat([
            get(f"{T}.self_attn.q_proj.weight", (a.num_heads * D, H), f"{P}.w_qkv"),
            get(f"{T}.self_attn.k_proj.weight", (a.num_kv_heads * D, H), f"{P}.w_qkv"),
            get(f"{T}.self_attn.v_proj.weight", (a.num_kv_heads * D, H), f"{P}.w_qkv")])
        out[f"{P}.w_o"] = get(f"{T}.self_attn.o_proj.weight", (H, a.num_heads * D), f"{P}.w_o")
        if spec.block == "sequential":
            out[f"{P}.mlp_norm"] = get(f"{T}.post_attention_layernorm.weight", (H,), f"{P}.mlp_norm")
        if ls.mlp == "dense":
            inter = spec.dense_intermediate
            out[f"{P}.w_gate_up"] = torch.cat([get(f"{T}.mlp.gate_proj.weight", (inter, H), f"{P}.w_gate_up"),
                                               get(f"{T}.mlp.up_proj.weight", (inter, H), f"{P}.w_gate_up")])
            out[f"{P}.w_down"] = get(f"{T}.mlp.down_proj.weight", (H, inter), f"{P}.w_down")
        else:
            m = spec.moe
            assert m is not None
            E, inter = m.num_experts, m.intermediate
            out[f"{P}.w_router"] = get(f"{T}.mlp.gate.weight", (E, H), f"{P}.w_router")
            gu, dn = f"{P}.w_experts_gate_up", f"{P}.w_experts_down"
            if ck.has(f"{T}.mlp.experts.gate_up_proj"):
                out[gu] = get(f"{T}.mlp.experts.gate_up_proj", (E, 2 * inter, H), gu)
                out[dn] = get(f"{T}.mlp.experts.down_proj", (E, H, inter), dn)
            else:
                X = f"{T}.mlp.experts"
                out[gu] = torch.stack([torch.cat([get(f"{X}.{e}.gate_proj.weight", (inter, H), gu),
                                                  get(f"{X}.{e}.up_proj.weight", (inter, H), gu)])
                                       for e in range(E)])
                out[dn] = torch.stack([get(f"{X}.{e}.down_proj.weight", (H, inter), dn) for e in range(E)])
    out["final_norm"] = get("model.norm.weight", (H,), "final_norm")
    if not spec.tie_word_embeddings:
        out["lm_head"] = get("lm_head.weight", (spec.vocab_size, H), "lm_head")
    return out
