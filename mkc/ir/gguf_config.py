"""llama.cpp GGUF metadata → the equivalent Hugging Face ``config.json`` dict.

A GGUF file carries its hyper-parameters as ``{arch}.*`` keys; this module renames them to the
transformers keys the importers of ``mkc/ir/hf.py`` already read, so a GGUF file is one more way
to reach the same importer (``load_spec("model.gguf")``). Only the metadata is read (the file is
memory-mapped; no tensor is touched). Needs the ``gguf`` package (``pip install gguf``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np

from mkc.ir.spec import SpecError

# GGUF general.architecture → Hugging Face model_type
ARCHITECTURES = {"llama": "llama", "qwen3": "qwen3", "qwen3moe": "qwen3_moe"}

# {arch}.<key> → config.json key
_KEYS = {
    "block_count": "num_hidden_layers",
    "embedding_length": "hidden_size",
    "feed_forward_length": "intermediate_size",
    "context_length": "max_position_embeddings",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.key_length": "head_dim",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "rope.freq_base": "rope_theta",
    "vocab_size": "vocab_size",
    "expert_count": "num_experts",
    "expert_used_count": "num_experts_per_tok",
    "expert_feed_forward_length": "moe_intermediate_size",
}

LLAMA_CPP_ROPE_THETA = 10000.0  # llama.cpp's default when a file has no rope.freq_base


def read_metadata(path: str | Path) -> tuple[dict[str, Any], dict[str, tuple[int, ...]]]:
    """(metadata key → value, tensor name → shape) of a GGUF file, shapes in PyTorch order
    ([rows, cols]; GGUF lists the fastest dimension first). Raises SpecError when unreadable."""
    try:
        import gguf
    except ImportError:
        raise SpecError(f"{path}: reading a GGUF file needs the 'gguf' package: pip install gguf") from None
    try:
        reader = gguf.GGUFReader(str(path))
    except (ValueError, OSError) as e:
        raise SpecError(f"{path}: not a readable GGUF file ({e})") from None
    meta = {}
    for key, field in reader.fields.items():
        if key.startswith("tokenizer.ggml.") and len(field.data) > 1:
            continue  # vocabularies and merges: large, and not hyper-parameters
        value = field.contents()
        if isinstance(value, float):  # stored as float32: keep its shortest decimal (1e-05, not 9.99...e-06)
            value = float(str(np.float32(value)))
        meta[key] = value
    return meta, {t.name: tuple(int(d) for d in reversed(t.shape)) for t in reader.tensors}


def _name(meta: dict[str, Any], arch: str) -> str:
    """e.g. "smollm2_135m" from general.basename and general.size_label."""
    parts = [str(meta[k]) for k in ("general.basename", "general.size_label") if meta.get(k)]
    name = "_".join(parts) or arch
    return re.sub(r"[^a-z0-9_]+", "_", name.lower()).strip("_")


def hf_config_from_gguf(path: str | Path) -> dict[str, Any]:
    """The config.json equivalent of a GGUF file's metadata (raises SpecError)."""
    meta, tensors = read_metadata(path)
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise SpecError(f"{path}: general.architecture = {arch!r}: expected one of {sorted(ARCHITECTURES)}")
    cfg: dict[str, Any] = {"model_type": ARCHITECTURES[arch], "hidden_act": "silu", "_name": _name(meta, arch)}
    for key, hf_key in _KEYS.items():
        if f"{arch}.{key}" in meta:
            cfg[hf_key] = meta[f"{arch}.{key}"]
    cfg.setdefault("rope_theta", LLAMA_CPP_ROPE_THETA)
    if "vocab_size" not in cfg and "token_embd.weight" in tensors:
        cfg["vocab_size"] = tensors["token_embd.weight"][0]
    heads, hidden = cfg.get("num_attention_heads"), cfg.get("hidden_size")
    head_dim = cfg.get("head_dim") or (hidden // heads if heads and hidden else None)
    rot = meta.get(f"{arch}.rope.dimension_count")
    if rot is not None and head_dim is not None and rot != head_dim:
        raise SpecError(f"{path}: {arch}.rope.dimension_count = {rot}: expected the head dim {head_dim} "
                        f"(partial rotary is not supported)")
    if meta.get(f"{arch}.rope.scaling.type", "none") not in ("none", "linear") or \
            meta.get(f"{arch}.rope.scaling.factor", 1.0) != 1.0:
        raise SpecError(f"{path}: {arch}.rope.scaling.type = {meta.get(f'{arch}.rope.scaling.type')!r}: "
                        f"expected no RoPE scaling")
    cfg["tie_word_embeddings"] = "output.weight" not in tensors  # llama.cpp omits a tied head
    if arch == "qwen3moe":
        # llama.cpp always renormalises Qwen3-MoE's top-k weights (norm_topk_prob: true)
        cfg["norm_topk_prob"] = bool(meta.get(f"{arch}.expert_weights_norm", True))
    return cfg
