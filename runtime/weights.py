"""Model weights under the lowering's logical buffer names.

The lowering (``mkc/ir/lower.py``) names each weight buffer and fixes its layout; this module is
the one place that maps a checkpoint onto those names, repacking once at load time. Two sources:
a transformers-layout safetensors folder (``load_checkpoint``) and a llama.cpp GGUF file
(``load_gguf``, dequantised to float).

=============================  =====================================  ==========================
logical name                   shape                                  transformers tensor(s)
=============================  =====================================  ==========================
``embed``                      [vocab, hidden]                        model.embed_tokens.weight
``L{i}.attn_norm``             [hidden]                               ...input_layernorm.weight
``L{i}.mlp_norm``              [hidden] (sequential blocks only)      ...post_attention_layernorm
``L{i}.w_qkv``                 [(heads + 2 kv) * head_dim, hidden]    cat(q_proj, k_proj, v_proj)
``L{i}.q_norm``, ``k_norm``    [head_dim] (qk-norm models only)       self_attn.{q,k}_norm.weight
``L{i}.w_o``                   [hidden, heads * head_dim]             self_attn.o_proj.weight
``L{i}.w_gate_up`` (dense)     [2 * inter, hidden]                    cat(mlp.gate_proj, mlp.up_proj)
``L{i}.w_down`` (dense)        [hidden, inter]                        mlp.down_proj.weight
``L{i}.w_router`` (moe)        [experts, hidden]                      mlp.gate.weight (Mixtral:
                                                                      block_sparse_moe.gate.weight)
``L{i}.w_experts_gate_up``     [experts, 2 * inter, hidden]           stack(cat(gate_e, up_e)) or
                                                                      fused mlp.experts.gate_up_proj
``L{i}.w_experts_down``        [experts, hidden, inter]               stack(down_e) or fused
                                                                      mlp.experts.down_proj
``final_norm``                 [hidden]                               model.norm.weight
``lm_head`` (untied only)      [vocab, hidden]                        lm_head.weight
=============================  =====================================  ==========================

Per-expert tensors are ``mlp.experts.{e}.{gate,up,down}_proj.weight`` (what ``save_pretrained``
writes for Cohere2-MoE and Qwen3-MoE) or Mixtral's ``block_sparse_moe.experts.{e}.{w1,w3,w2}``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
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
        if a.qk_norm:
            out[f"{P}.q_norm"] = (a.head_dim,)
            out[f"{P}.k_norm"] = (a.head_dim,)
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


def _moe_tensors(ck: _Checkpoint, spec: ModelSpec, i: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Router and experts of MoE layer i, from whichever layout the checkpoint uses."""
    m = spec.moe
    assert m is not None
    E, inter, H = m.num_experts, m.intermediate, spec.hidden_size
    P, T = f"L{i}", f"model.layers.{i}"
    gu, dn, rt = f"{P}.w_experts_gate_up", f"{P}.w_experts_down", f"{P}.w_router"

    def get(name: str, shape: tuple[int, ...], logical: str) -> torch.Tensor:
        return ck.get(name, shape, dtype, logical)

    def per_expert(prefix: str, gate: str, up: str, down: str) -> dict[str, torch.Tensor]:
        return {gu: torch.stack([torch.cat([get(f"{prefix}.{e}.{gate}.weight", (inter, H), gu),
                                            get(f"{prefix}.{e}.{up}.weight", (inter, H), gu)]) for e in range(E)]),
                dn: torch.stack([get(f"{prefix}.{e}.{down}.weight", (H, inter), dn) for e in range(E)])}

    if ck.has(f"{T}.block_sparse_moe.gate.weight"):  # Mixtral: w1 = gate, w3 = up, w2 = down
        X = f"{T}.block_sparse_moe"
        return {rt: get(f"{X}.gate.weight", (E, H), rt), **per_expert(f"{X}.experts", "w1", "w3", "w2")}
    out = {rt: get(f"{T}.mlp.gate.weight", (E, H), rt)}
    if ck.has(f"{T}.mlp.experts.gate_up_proj"):
        out[gu] = get(f"{T}.mlp.experts.gate_up_proj", (E, 2 * inter, H), gu)
        out[dn] = get(f"{T}.mlp.experts.down_proj", (E, H, inter), dn)
    else:
        out.update(per_expert(f"{T}.mlp.experts", "gate_proj", "up_proj", "down_proj"))
    return out


def load_checkpoint(folder: str | Path, spec: ModelSpec, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """Read a transformers-layout safetensors checkpoint into the lowering's logical weights
    (a ``.gguf`` file is handed to ``load_gguf``).

    Raises ``CheckpointError`` naming the tensor and the file when a tensor is missing or has
    the wrong shape. Expert weights may be stored per expert (what ``save_pretrained`` writes:
    ``mlp.experts.{e}.{gate,up,down}_proj.weight``, Mixtral's ``block_sparse_moe.experts.{e}.w1``
    ...) or fused (``mlp.experts.gate_up_proj`` [E, 2I, H], ``mlp.experts.down_proj`` [E, H, I]).
    """
    if Path(folder).suffix == ".gguf" and Path(folder).is_file():
        return load_gguf(folder, spec, dtype)
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
        if a.qk_norm:
            out[f"{P}.q_norm"] = get(f"{T}.self_attn.q_norm.weight", (D,), f"{P}.q_norm")
            out[f"{P}.k_norm"] = get(f"{T}.self_attn.k_norm.weight", (D,), f"{P}.k_norm")
        out[f"{P}.w_o"] = get(f"{T}.self_attn.o_proj.weight", (H, a.num_heads * D), f"{P}.w_o")
        if spec.block == "sequential":
            out[f"{P}.mlp_norm"] = get(f"{T}.post_attention_layernorm.weight", (H,), f"{P}.mlp_norm")
        if ls.mlp == "dense":
            inter = spec.dense_intermediate
            out[f"{P}.w_gate_up"] = torch.cat([get(f"{T}.mlp.gate_proj.weight", (inter, H), f"{P}.w_gate_up"),
                                               get(f"{T}.mlp.up_proj.weight", (inter, H), f"{P}.w_gate_up")])
            out[f"{P}.w_down"] = get(f"{T}.mlp.down_proj.weight", (H, inter), f"{P}.w_down")
        else:
            out.update(_moe_tensors(ck, spec, i, dtype))
    out["final_norm"] = get("model.norm.weight", (H,), "final_norm")
    if not spec.tie_word_embeddings:
        out["lm_head"] = get("lm_head.weight", (spec.vocab_size, H), "lm_head")
    return out


# ----------------------------------------------------------------------------------------------
# llama.cpp GGUF files

# logical name (per layer: "L{i}." + key) → GGUF tensor name (per layer: "blk.{i}." + value)
_GGUF_LAYER = {
    "attn_norm": "attn_norm.weight",
    "mlp_norm": "ffn_norm.weight",
    "q_norm": "attn_q_norm.weight",
    "k_norm": "attn_k_norm.weight",
    "w_o": "attn_output.weight",
    "w_down": "ffn_down.weight",
    "w_router": "ffn_gate_inp.weight",
    "w_experts_down": "ffn_down_exps.weight",
}


def unpermute_llama_qk(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation of llama-architecture GGUF files.

    Its converter reorders the rows of each head from Hugging Face's NeoX halves (i, i + d/2) to
    interleaved pairs (2i, 2i + 1) for its own RoPE kernel; put them back so ``rope_style: half``
    (transformers' ``rotate_half``) sees the original layout. ``w``: [heads * head_dim, hidden].
    """
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


class _GGUF:
    """The tensors of one GGUF file, dequantised on request (``gguf.quants.dequantize``)."""

    def __init__(self, path: Path):
        try:
            import gguf
        except ImportError:
            raise CheckpointError(f"{path}: reading a GGUF file needs the 'gguf' package: pip install gguf") from None
        self.path, self._gguf = path, gguf
        reader = gguf.GGUFReader(str(path))  # parses every metadata field: seconds for a vocabulary
        self.arch = reader.fields["general.architecture"].contents()
        self.tensors = {t.name: t for t in reader.tensors}

    def has(self, name: str) -> bool:
        return name in self.tensors

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, needed_for: str) -> torch.Tensor:
        t = self.tensors.get(name)
        if t is None:
            raise CheckpointError(f"{self.path}: tensor '{name}' (needed for {needed_for}) is not in the GGUF file")
        arr = self._gguf.quants.dequantize(t.data, t.tensor_type)  # float32, [rows, cols] order
        out = torch.from_numpy(np.array(arr, dtype=np.float32))  # a copy: GGUF data is a read-only mmap
        if tuple(out.shape) != tuple(shape):
            raise CheckpointError(f"{self.path}: tensor '{name}' ({t.tensor_type.name}) has shape "
                                  f"{list(out.shape)}: expected {list(shape)} for {needed_for} (does the spec "
                                  f"match the file?)")
        return out.to(dtype)


def load_gguf(path: str | Path, spec: ModelSpec, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """Read a llama.cpp GGUF file (llama, qwen3 or qwen3moe architecture) into the lowering's
    logical weights, dequantising every tensor (Q4_0, Q4_1, Q8_0, K-quants, F16, ...) to float
    and then to ``dtype``. The spec is usually ``load_spec(path)`` (its metadata).

    llama-architecture files have their Q/K rows permuted by llama.cpp's converter; they are
    un-permuted here (``unpermute_llama_qk``) so the spec's NeoX RoPE applies as in transformers.
    Raises ``CheckpointError`` naming the tensor when one is missing or misshapen.
    """
    g = _GGUF(Path(path))
    a, H = spec.attention, spec.hidden_size
    D, QH, G = a.head_dim, a.num_heads, a.num_kv_heads
    shapes = weight_shapes(spec)

    def get(name: str, logical: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        return g.get(name, shape or shapes[logical], dtype, logical)

    out = {"embed": get("token_embd.weight", "embed"), "final_norm": get("output_norm.weight", "final_norm")}
    if not spec.tie_word_embeddings:
        out["lm_head"] = get("output.weight", "lm_head")
    for i, ls in enumerate(spec.layers):
        P, B = f"L{i}", f"blk.{i}"
        q = get(f"{B}.attn_q.weight", f"{P}.w_qkv", (QH * D, H))
        k = get(f"{B}.attn_k.weight", f"{P}.w_qkv", (G * D, H))
        if g.arch == "llama":
            q, k = unpermute_llama_qk(q, QH), unpermute_llama_qk(k, G)
        out[f"{P}.w_qkv"] = torch.cat([q, k, get(f"{B}.attn_v.weight", f"{P}.w_qkv", (G * D, H))])
        if ls.mlp == "dense":
            out[f"{P}.w_gate_up"] = torch.cat([get(f"{B}.ffn_gate.weight", f"{P}.w_gate_up", (spec.dense_intermediate, H)),
                                               get(f"{B}.ffn_up.weight", f"{P}.w_gate_up", (spec.dense_intermediate, H))])
        else:
            m = spec.moe
            assert m is not None
            n = f"{P}.w_experts_gate_up"
            out[n] = torch.cat([get(f"{B}.ffn_gate_exps.weight", n, (m.num_experts, m.intermediate, H)),
                                get(f"{B}.ffn_up_exps.weight", n, (m.num_experts, m.intermediate, H))], dim=1)
        for key, gguf_name in _GGUF_LAYER.items():
            if f"{P}.{key}" in shapes:
                out[f"{P}.{key}"] = get(f"{B}.{gguf_name}", f"{P}.{key}")
    missing = shapes.keys() - out.keys()
    assert not missing, f"load_gguf does not map {sorted(missing)}"
    return {k: out[k] for k in shapes}
