"""ModelSpec: every hyper-parameter of a decoder-only architecture, loaded from YAML or from a
Hugging Face ``config.json``.

Contract: ``load_spec`` either returns a fully validated, frozen ``ModelSpec`` or raises
``SpecError`` whose message names the file, the key, the value and what was expected. No default
is hidden in code: every field must be present in the YAML (``import-hf`` writes them all).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml


class SpecError(ValueError):
    """A model description is wrong: the message names the key, the value and what was expected."""


ATTENTION_KINDS = ("global", "sliding")
MLP_KINDS = ("dense", "moe")
BLOCK_KINDS = ("parallel", "sequential")
ROPE_STYLES = ("interleaved", "half")
ROUTER_SCORINGS = ("sigmoid", "softmax")
ACTIVATIONS = ("silu",)


@dataclass(frozen=True, slots=True)
class LayerSpec:
    attention: str  # "global" (whole context) | "sliding" (last `sliding_window` keys)
    rope: bool  # rotary position encoding applied to q and k in this layer
    mlp: str  # "dense" (SwiGLU of `dense_intermediate`) | "moe" (routed experts)


@dataclass(frozen=True, slots=True)
class AttentionSpec:
    num_heads: int  # query heads
    num_kv_heads: int  # key/value heads (GQA groups); num_heads % num_kv_heads == 0
    head_dim: int  # elements per head
    sliding_window: int  # keys a sliding layer attends, the current token included
    rope_theta: float  # RoPE base
    rope_style: str  # "interleaved" (GPT-J pairs 2i, 2i+1) | "half" (NeoX pairs i, i + d/2)
    qk_norm: bool  # RMSNorm over head_dim on q and k before RoPE


@dataclass(frozen=True, slots=True)
class MoESpec:
    num_experts: int  # routed experts per MoE layer
    top_k: int  # experts selected per token
    intermediate: int  # expert SwiGLU width
    scoring: str  # "sigmoid": w = sigmoid(logit) | "softmax": w = softmax(logits over all experts)
    normalize_top_k: bool  # divide the selected top-k weights by their sum

    def slots(self, batch: int) -> int:
        """Distinct experts one step of ``batch`` tokens can route to (the routing slots)."""
        return min(self.num_experts, batch * self.top_k)


@dataclass(frozen=True, slots=True)
class ModelSpec:
    name: str  # used in artifact names, e.g. north_mini_code-b1-sm90a-<sha8>
    architecture: str  # Hugging Face model_type this spec mirrors (informational)
    vocab_size: int  # rows of the embedding / LM head
    hidden_size: int  # residual stream width
    num_layers: int  # decoder layers
    norm_eps: float  # RMSNorm epsilon
    block: str  # "parallel": x + attn(n) + mlp(n) | "sequential": post-attention norm before mlp
    tie_word_embeddings: bool  # LM head reuses the embedding matrix
    logit_scale: float  # logits are multiplied by this
    activation: str  # MLP activation (SwiGLU gate)
    dense_intermediate: int  # SwiGLU width of dense layers (0 when there are none)
    attention: AttentionSpec
    moe: MoESpec | None  # None for dense-only models
    layers: tuple[LayerSpec, ...]  # one per layer, resolved from pattern + overrides

    @property
    def q_width(self) -> int:
        return self.attention.num_heads * self.attention.head_dim

    @property
    def kv_width(self) -> int:
        return self.attention.num_kv_heads * self.attention.head_dim

    @property
    def group_size(self) -> int:
        """Query heads per KV head."""
        return self.attention.num_heads // self.attention.num_kv_heads

    def to_yaml_dict(self) -> dict[str, Any]:
        """The YAML form ``load_spec`` reads back (layers written as a pattern plus overrides)."""
        pattern, overrides = _compress_layers(self.layers)
        att = dataclasses.asdict(self.attention)
        out: dict[str, Any] = {
            "name": self.name,
            "architecture": self.architecture,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_layers": self.num_layers,
            "norm_eps": self.norm_eps,
            "block": self.block,
            "tie_word_embeddings": self.tie_word_embeddings,
            "logit_scale": self.logit_scale,
            "activation": self.activation,
            "dense_intermediate": self.dense_intermediate,
            "attention": att,
            "moe": dataclasses.asdict(self.moe) if self.moe else None,
            "layers": {"pattern": [dataclasses.asdict(x) for x in pattern],
                       "overrides": {i: dataclasses.asdict(x) for i, x in overrides.items()}},
        }
        return out


def _compress_layers(layers: tuple[LayerSpec, ...]) -> tuple[tuple[LayerSpec, ...], dict[int, LayerSpec]]:
    """Shortest repeating pattern with the fewest overrides."""
    best: tuple[tuple[LayerSpec, ...], dict[int, LayerSpec]] | None = None
    for period in range(1, len(layers) + 1):
        # the pattern takes, at each phase, the most common value
        pattern = []
        for phase in range(period):
            vals = [layers[i] for i in range(phase, len(layers), period)]
            pattern.append(max(vals, key=vals.count))
        overrides = {i: x for i, x in enumerate(layers) if x != pattern[i % period]}
        if best is None or len(overrides) + period < len(best[1]) + len(best[0]):
            best = (tuple(pattern), overrides)
    assert best is not None
    return best


# ----------------------------------------------------------------------------------------------
# YAML → ModelSpec


class _Reader:
    """Reads one mapping of the YAML, naming the full key path in every error. ``keys`` are the
    keys the mapping may hold: one it holds beyond them is reported first, with the expected key
    it most resembles, so a misspelt key is named rather than reported as the right one missing."""

    def __init__(self, data: Any, path: str, source: str, keys: tuple[str, ...]):
        if not isinstance(data, dict):
            raise SpecError(f"{source}: '{path or '<top level>'}' must be a mapping, got {_show(data)}")
        self.data, self.path, self.source = data, path, source
        unknown = sorted(set(map(str, data)) - set(keys))
        if unknown:
            absent = [k for k in keys if k not in data]
            close = difflib.get_close_matches(unknown[0], absent, n=1, cutoff=0.6)
            hint = f"did you mean '{close[0]}'? " if close else ""
            raise SpecError(f"{source}: unknown key '{self.key(unknown[0])}': {hint}expected one of the keys "
                            f"{', '.join(keys)}")

    def key(self, name: str) -> str:
        return f"{self.path}.{name}" if self.path else name

    def get(self, name: str, kind: type | tuple[type, ...], *, choices: tuple | None = None,
            positive: bool = False, nonneg: bool = False, optional_none: bool = False) -> Any:
        if name not in self.data:
            raise SpecError(f"{self.source}: missing key '{self.key(name)}' (expected {_kind_name(kind)})")
        v = self.data[name]
        if v is None and optional_none:
            return None
        if kind is float and isinstance(v, int) and not isinstance(v, bool):
            v = float(v)
        if isinstance(v, bool) and kind is not bool:
            ok = False
        else:
            ok = isinstance(v, kind)
        if not ok:
            raise SpecError(f"{self.source}: '{self.key(name)}' = {_show(v)}: expected {_kind_name(kind)}")
        if choices is not None and v not in choices:
            raise SpecError(f"{self.source}: '{self.key(name)}' = {_show(v)}: expected one of {list(choices)}")
        if positive and not v > 0:
            raise SpecError(f"{self.source}: '{self.key(name)}' = {_show(v)}: expected a positive number")
        if nonneg and not v >= 0:
            raise SpecError(f"{self.source}: '{self.key(name)}' = {_show(v)}: expected a number >= 0")
        return v

    def sub(self, name: str, keys: tuple[str, ...]) -> _Reader:
        if name not in self.data:
            raise SpecError(f"{self.source}: missing key '{self.key(name)}' (expected a mapping)")
        return _Reader(self.data[name], self.key(name), self.source, keys)


def _keys(cls: type) -> tuple[str, ...]:
    """The YAML keys of a spec mapping: its dataclass's fields, in order."""
    return tuple(f.name for f in dataclasses.fields(cls))


def _kind_name(kind: type | tuple[type, ...]) -> str:
    names = {int: "an integer", float: "a number", str: "a string", bool: "true or false",
             list: "a list", dict: "a mapping"}
    if isinstance(kind, tuple):
        return " or ".join(names.get(k, k.__name__) for k in kind)
    return names.get(kind, kind.__name__)


def _show(v: Any) -> str:
    s = repr(v)
    return s if len(s) <= 60 else s[:57] + "..."


def _layer(data: Any, path: str, source: str) -> LayerSpec:
    r = _Reader(data, path, source, _keys(LayerSpec))
    return LayerSpec(attention=r.get("attention", str, choices=ATTENTION_KINDS), rope=r.get("rope", bool),
                     mlp=r.get("mlp", str, choices=MLP_KINDS))


def spec_from_dict(data: Any, source: str = "<spec>") -> ModelSpec:
    """Validate a parsed YAML mapping into a ModelSpec (raises SpecError)."""
    r = _Reader(data, "", source, _keys(ModelSpec))
    a = r.sub("attention", _keys(AttentionSpec))
    attention = AttentionSpec(
        num_heads=a.get("num_heads", int, positive=True),
        num_kv_heads=a.get("num_kv_heads", int, positive=True),
        head_dim=a.get("head_dim", int, positive=True),
        sliding_window=a.get("sliding_window", int, positive=True),
        rope_theta=a.get("rope_theta", float, positive=True),
        rope_style=a.get("rope_style", str, choices=ROPE_STYLES),
        qk_norm=a.get("qk_norm", bool),
    )
    moe = None
    if r.data.get("moe") is not None:
        m = r.sub("moe", _keys(MoESpec))
        moe = MoESpec(
            num_experts=m.get("num_experts", int, positive=True),
            top_k=m.get("top_k", int, positive=True),
            intermediate=m.get("intermediate", int, positive=True),
            scoring=m.get("scoring", str, choices=ROUTER_SCORINGS),
            normalize_top_k=m.get("normalize_top_k", bool),
        )
    elif "moe" not in r.data:
        raise SpecError(f"{source}: missing key 'moe' (expected a mapping, or null for a dense-only model)")
    num_layers = r.get("num_layers", int, positive=True)
    lr = r.sub("layers", ("pattern", "overrides"))
    pat = lr.get("pattern", list)
    if not pat:
        raise SpecError(f"{source}: 'layers.pattern' is empty: expected at least one layer description")
    pattern = [_layer(p, f"layers.pattern[{i}]", source) for i, p in enumerate(pat)]
    ov = lr.get("overrides", dict)
    overrides: dict[int, LayerSpec] = {}
    for k, v in ov.items():
        if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k < num_layers:
            raise SpecError(f"{source}: 'layers.overrides' key {_show(k)}: expected a layer index in "
                            f"[0, {num_layers})")
        overrides[k] = _layer(v, f"layers.overrides.{k}", source)
    layers = tuple(overrides.get(i, pattern[i % len(pattern)]) for i in range(num_layers))
    spec = ModelSpec(
        name=r.get("name", str),
        architecture=r.get("architecture", str),
        vocab_size=r.get("vocab_size", int, positive=True),
        hidden_size=r.get("hidden_size", int, positive=True),
        num_layers=num_layers,
        norm_eps=r.get("norm_eps", float, positive=True),
        block=r.get("block", str, choices=BLOCK_KINDS),
        tie_word_embeddings=r.get("tie_word_embeddings", bool),
        logit_scale=r.get("logit_scale", float),
        activation=r.get("activation", str, choices=ACTIVATIONS),
        dense_intermediate=r.get("dense_intermediate", int, nonneg=True),
        attention=attention,
        moe=moe,
        layers=layers,
    )
    check_shapes(spec, source)
    return spec


def check_shapes(spec: ModelSpec, source: str = "<spec>") -> None:
    """Cross-field checks: shapes that cannot be lowered."""
    a = spec.attention
    if a.num_heads % a.num_kv_heads:
        raise SpecError(f"{source}: 'attention.num_heads' = {a.num_heads} is not a multiple of "
                        f"'attention.num_kv_heads' = {a.num_kv_heads}: expected whole GQA groups")
    if a.head_dim % 2:
        raise SpecError(f"{source}: 'attention.head_dim' = {a.head_dim}: expected an even number (RoPE pairs)")
    if any(x.mlp == "moe" for x in spec.layers) and spec.moe is None:
        raise SpecError(f"{source}: a layer has mlp: moe but 'moe' is null: expected a 'moe' mapping")
    if any(x.mlp == "dense" for x in spec.layers) and spec.dense_intermediate <= 0:
        raise SpecError(f"{source}: a layer has mlp: dense but 'dense_intermediate' = "
                        f"{spec.dense_intermediate}: expected a positive width")
    if spec.moe is not None and not spec.moe.top_k <= spec.moe.num_experts:
        raise SpecError(f"{source}: 'moe.top_k' = {spec.moe.top_k}: expected at most "
                        f"'moe.num_experts' = {spec.moe.num_experts}")
    if spec.hidden_size % 2:
        raise SpecError(f"{source}: 'hidden_size' = {spec.hidden_size}: expected an even number")


def load_spec(path: str | Path) -> ModelSpec:
    """Load a YAML model description, a Hugging Face ``config.json``, a checkpoint folder, or the
    metadata of a llama.cpp ``.gguf`` file."""
    p = Path(path)
    if p.is_dir():
        cfg = p / "config.json"
        if not cfg.is_file():
            raise SpecError(f"{p}: folder has no config.json: expected a YAML model file or a "
                            f"Hugging Face checkpoint folder")
        p = cfg
    if not p.exists():
        raise SpecError(f"{p}: no such file: expected a YAML model file, a Hugging Face config.json or checkpoint "
                        f"folder, or a .gguf file")
    if p.suffix == ".gguf":
        from mkc.ir.gguf_config import hf_config_from_gguf
        from mkc.ir.hf import spec_from_hf_config
        cfg = hf_config_from_gguf(p)
        return spec_from_hf_config(cfg, source=str(p), name=cfg.pop("_name"))
    text = p.read_text()
    if p.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise SpecError(f"{p}: not valid JSON ({e.msg} at line {e.lineno})") from None
        from mkc.ir.hf import spec_from_hf_config
        return spec_from_hf_config(data, source=str(p))
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise SpecError(f"{p}: not valid YAML{where}: expected a mapping of model keys") from None
    return spec_from_dict(data, source=str(p))
