"""Hugging Face ``config.json`` → ModelSpec, one function per ``model_type``.

Adding a family: write a ``_from_<model_type>`` function here and register it in ``IMPORTERS``;
the lowering needs no change as long as the family is expressible in ModelSpec (see
docs/adding_a_model.md). Anything the importer cannot express (biases, scaled RoPE, ...) raises
``SpecError`` naming the key rather than importing a model that would compute something else.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mkc.ir.spec import AttentionSpec, LayerSpec, ModelSpec, MoESpec, SpecError, check_shapes


def _need(cfg: dict[str, Any], key: str, source: str) -> Any:
    if key not in cfg or cfg[key] is None:
        raise SpecError(f"{source}: missing key '{key}' for model_type '{cfg.get('model_type')}'")
    return cfg[key]


def _rope_theta(cfg: dict[str, Any], source: str) -> float:
    """The RoPE base; scaled variants (llama3, yarn, ...) and partial rotary are refused."""
    params = cfg.get("rope_parameters") or {}
    legacy = cfg.get("rope_scaling") or {}  # config.json files written before transformers 5
    kind = params.get("rope_type", legacy.get("rope_type", legacy.get("type", "default")))
    if kind != "default":
        raise SpecError(f"{source}: rope_type = {kind!r}: expected 'default' (scaled RoPE variants are not "
                        f"supported yet)")
    if float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))) != 1.0:
        raise SpecError(f"{source}: 'partial_rotary_factor' = {cfg.get('partial_rotary_factor')}: expected 1.0 "
                        f"(RoPE over the whole head)")
    theta = params.get("rope_theta", cfg.get("rope_theta"))
    if theta is None:
        raise SpecError(f"{source}: missing key 'rope_theta'")
    return float(theta)


def _from_cohere2_moe(cfg: dict[str, Any], source: str) -> ModelSpec:
    n = _need(cfg, "num_hidden_layers", source)
    first_dense = cfg.get("first_k_dense_replace", 0)
    layer_types = cfg.get("layer_types")
    if layer_types is None:
        prefix_pat = cfg.get("prefix_dense_sliding_window_pattern", 1)
        pat = cfg.get("sliding_window_pattern", 4)
        layer_types = [("sliding_attention" if (i + 1) % prefix_pat else "full_attention")
                       for i in range(first_dense)]
        layer_types += [("sliding_attention" if (i + 1) % pat else "full_attention")
                        for i in range(n - first_dense)]
    mlp_types = cfg.get("mlp_layer_types") or ["dense" if i < first_dense else "sparse" for i in range(n)]
    if cfg.get("rms_norm_eps") is None:
        raise SpecError(f"{source}: 'rms_norm_eps' is null (LayerNorm variant): expected an RMSNorm model")
    if cfg.get("num_shared_experts", 0):
        raise SpecError(f"{source}: 'num_shared_experts' = {cfg['num_shared_experts']}: expected 0 "
                        f"(shared experts are not supported yet)")
    if cfg.get("attention_bias"):
        raise SpecError(f"{source}: 'attention_bias' = true: expected false")
    force_rope_dense = cfg.get("prefix_dense_sliding_window_pattern", 1) == 1
    layers = []
    for i in range(n):
        sliding = layer_types[i] == "sliding_attention"
        dense = mlp_types[i] == "dense"
        layers.append(LayerSpec(attention="sliding" if sliding else "global",
                                rope=sliding or (dense and force_rope_dense),
                                mlp="dense" if dense else "moe"))
    heads = _need(cfg, "num_attention_heads", source)
    hidden = _need(cfg, "hidden_size", source)
    spec = ModelSpec(
        name=str(cfg.get("_name", "cohere2_moe")),
        architecture="cohere2_moe",
        vocab_size=_need(cfg, "vocab_size", source),
        hidden_size=hidden,
        num_layers=n,
        norm_eps=float(cfg["rms_norm_eps"]),
        block="parallel",
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        logit_scale=float(cfg.get("logit_scale", 0.0625)),
        activation=_need(cfg, "hidden_act", source),
        dense_intermediate=int(cfg.get("prefix_dense_intermediate_size") or 0) if first_dense or
        "dense" in mlp_types else 0,
        attention=AttentionSpec(
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads,
            sliding_window=int(cfg.get("sliding_window") or 4096),
            rope_theta=_rope_theta(cfg, source),
            rope_style="interleaved",
            qk_norm=False,
        ),
        moe=MoESpec(
            num_experts=_need(cfg, "num_experts", source),
            top_k=_need(cfg, "num_experts_per_tok", source),
            intermediate=_need(cfg, "intermediate_size", source),
            scoring=cfg.get("expert_selection_fn", "softmax"),
            # cohere's softmax is over the top-k logits: softmax over all, renormalised over the top-k
            normalize_top_k=(cfg.get("expert_selection_fn", "softmax") == "softmax"
                             or bool(cfg.get("norm_topk_prob", True))),
        ) if "sparse" in mlp_types else None,
        layers=tuple(layers),
    )
    if spec.activation != "silu":
        raise SpecError(f"{source}: 'hidden_act' = {spec.activation!r}: expected 'silu'")
    return spec


def _attention(cfg: dict[str, Any], source: str, *, qk_norm: bool, window: int | None = None) -> AttentionSpec:
    """Attention with NeoX ("half") RoPE on every layer: the Llama / Qwen3 / Mixtral convention.
    ``window``: the sliding window of every layer (Mixtral), None for all-global attention."""
    if cfg.get("attention_bias"):
        raise SpecError(f"{source}: 'attention_bias' = true: expected false (q/k/v biases are not supported)")
    heads = _need(cfg, "num_attention_heads", source)
    return AttentionSpec(
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or _need(cfg, "hidden_size", source) // heads,
        # all-global models never read the window: the longest context keeps it meaningful
        sliding_window=int(window or _need(cfg, "max_position_embeddings", source)),
        rope_theta=_rope_theta(cfg, source),
        rope_style="half",
        qk_norm=qk_norm,
    )


def _no_sliding_window(cfg: dict[str, Any], source: str) -> None:
    """Qwen3 families: sliding attention exists in the config but is off in every published model."""
    if cfg.get("use_sliding_window"):
        raise SpecError(f"{source}: 'use_sliding_window' = true: expected false (not supported for "
                        f"model_type {cfg.get('model_type')!r} yet)")
    odd = [i for i, t in enumerate(cfg.get("layer_types") or []) if t != "full_attention"]
    if odd:
        raise SpecError(f"{source}: 'layer_types'[{odd[0]}] = {cfg['layer_types'][odd[0]]!r}: expected "
                        f"'full_attention' on every layer")


def _sequential(cfg: dict[str, Any], source: str, *, name: str, attention: AttentionSpec,
                moe: MoESpec | None, mlp_kinds: list[str], dense_inter: int, sliding: bool = False) -> ModelSpec:
    """A pre-norm sequential block: x += attn(norm(x)); x += mlp(post_attention_norm(x))."""
    if cfg.get("hidden_act", "silu") != "silu":
        raise SpecError(f"{source}: 'hidden_act' = {cfg.get('hidden_act')!r}: expected 'silu'")
    if cfg.get("mlp_bias"):
        raise SpecError(f"{source}: 'mlp_bias' = true: expected false")
    return ModelSpec(
        name=name,
        architecture=str(cfg.get("model_type")),
        vocab_size=_need(cfg, "vocab_size", source),
        hidden_size=_need(cfg, "hidden_size", source),
        num_layers=len(mlp_kinds),
        norm_eps=float(_need(cfg, "rms_norm_eps", source)),
        block="sequential",
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        logit_scale=1.0,
        activation="silu",
        dense_intermediate=dense_inter if "dense" in mlp_kinds else 0,
        attention=attention,
        moe=moe,
        layers=tuple(LayerSpec(attention="sliding" if sliding else "global", rope=True, mlp=k) for k in mlp_kinds),
    )


def _from_llama(cfg: dict[str, Any], source: str) -> ModelSpec:
    """Llama (SmolLM2, TinyLlama, ...) and Qwen3 dense (the same, plus qk-norm)."""
    n = _need(cfg, "num_hidden_layers", source)
    qwen3 = cfg.get("model_type") == "qwen3"
    if qwen3:
        _no_sliding_window(cfg, source)
    return _sequential(cfg, source, name=str(cfg.get("model_type")), attention=_attention(cfg, source, qk_norm=qwen3),
                       moe=None, mlp_kinds=["dense"] * n, dense_inter=_need(cfg, "intermediate_size", source))


def _from_qwen3_moe(cfg: dict[str, Any], source: str) -> ModelSpec:
    n = _need(cfg, "num_hidden_layers", source)
    _no_sliding_window(cfg, source)
    step = cfg.get("decoder_sparse_step", 1)
    only_mlp = set(cfg.get("mlp_only_layers") or [])
    experts = cfg.get("num_experts", cfg.get("num_local_experts"))  # save_pretrained writes the latter
    if experts is None:
        raise SpecError(f"{source}: missing key 'num_experts' (or 'num_local_experts')")
    kinds = ["moe" if i not in only_mlp and experts > 0 and (i + 1) % step == 0 else "dense" for i in range(n)]
    moe = MoESpec(num_experts=experts, top_k=_need(cfg, "num_experts_per_tok", source),
                  intermediate=_need(cfg, "moe_intermediate_size", source), scoring="softmax",
                  normalize_top_k=bool(cfg.get("norm_topk_prob", False))) if "moe" in kinds else None
    return _sequential(cfg, source, name="qwen3_moe", attention=_attention(cfg, source, qk_norm=True),
                       moe=moe, mlp_kinds=kinds, dense_inter=int(cfg.get("intermediate_size") or 0))


def _from_mixtral(cfg: dict[str, Any], source: str) -> ModelSpec:
    """Mixtral: every layer MoE, softmax over all experts renormalised over the top-k; a
    non-null ``sliding_window`` makes every layer sliding."""
    n = _need(cfg, "num_hidden_layers", source)
    window = cfg.get("sliding_window")
    moe = MoESpec(num_experts=_need(cfg, "num_local_experts", source), top_k=_need(cfg, "num_experts_per_tok", source),
                  intermediate=_need(cfg, "intermediate_size", source), scoring="softmax", normalize_top_k=True)
    return _sequential(cfg, source, name="mixtral", attention=_attention(cfg, source, qk_norm=False, window=window),
                       moe=moe, mlp_kinds=["moe"] * n, dense_inter=0, sliding=window is not None)


IMPORTERS: dict[str, Callable[[dict[str, Any], str], ModelSpec]] = {
    "cohere2_moe": _from_cohere2_moe,
    "llama": _from_llama,
    "mixtral": _from_mixtral,
    "qwen3": _from_llama,
    "qwen3_moe": _from_qwen3_moe,
}


def spec_from_hf_config(cfg: dict[str, Any], source: str = "config.json", name: str | None = None) -> ModelSpec:
    """Build a ModelSpec from a parsed Hugging Face config.json (raises SpecError)."""
    if not isinstance(cfg, dict):
        raise SpecError(f"{source}: expected a JSON object")
    mt = cfg.get("model_type")
    if mt not in IMPORTERS:
        raise SpecError(f"{source}: 'model_type' = {mt!r}: expected one of {sorted(IMPORTERS)}")
    spec = IMPORTERS[mt](cfg, source)
    if name:
        import dataclasses
        spec = dataclasses.replace(spec, name=name)
    check_shapes(spec, source)
    return spec
