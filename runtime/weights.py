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

FP8 checkpoints (``quantization_config`` in config.json) are dequantised on load, one tensor at a
time: transformers' FineGrainedFP8 (``quant_method: "fp8"``, ``weight_block_size``: an e4m3
``weight`` beside a float32 ``weight_scale_inv`` of one scale per block) and compressed-tensors
``float-quantized`` (``weight_scale`` per tensor, per output channel or per block). ``mkc quantize``
(``runtime/quantize.py``) writes both.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
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


# ----------------------------------------------------------------------------------------------
# FP8 (e4m3) checkpoints

E4M3_MAX = 448.0  # the largest finite float8_e4m3fn value
_FP8_DTYPES = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
                    if hasattr(torch, n))
_DEQUANT_CHUNK = 1 << 24  # elements dequantised at once: bounds the float32 temporaries (64 MB each)


@dataclass(frozen=True, slots=True)
class Fp8Format:
    """How an FP8 checkpoint stores its scales (read from config.json's ``quantization_config``).

    Every scheme is a block grid over the last two dims of a weight [..., out, in]: one scale per
    ``block[0]`` rows x ``block[1]`` columns, the edge blocks ragged. Per output channel is (1, in),
    per tensor a single scale. ``scale_suffix`` is appended to the weight's tensor name.
    """

    quant_method: str  # "fp8" (transformers FineGrainedFP8) or "compressed-tensors"
    strategy: str  # "block", "channel" or "tensor"
    block: tuple[int, int] | None  # rows x columns per scale, for strategy "block"
    scale_suffix: str  # "_scale_inv" (fp8) or "_scale" (compressed-tensors): weight -> weight_scale_inv

    def blocks(self, out: int, inp: int) -> tuple[int, int]:
        """Rows and columns one scale covers in a weight of ``out`` x ``inp``."""
        if self.strategy == "block":
            assert self.block is not None
            return self.block
        return (1, inp) if self.strategy == "channel" else (out, inp)

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The scale tensor's shape for a weight of ``shape`` [..., out, in] (per tensor: [1], or [])."""
        if self.strategy == "tensor":
            return (1,)
        out, inp = shape[-2:]
        bo, bi = self.blocks(out, inp)
        return (*shape[:-2], math.ceil(out / bo), math.ceil(inp / bi))


def fp8_format(config: dict, source: str) -> Fp8Format | None:
    """The FP8 layout a Hugging Face config.json declares; None when it declares no quantization.

    Raises ``CheckpointError`` for a quantization mkc cannot read (another method, e8m0 scales,
    compressed-tensors groups of several strategies)."""
    qc = config.get("quantization_config")
    if not qc:
        return None
    method = qc.get("quant_method")
    if method == "fp8":
        if qc.get("scale_fmt", "float") != "float":
            raise CheckpointError(f"{source}: quantization_config.scale_fmt = {qc['scale_fmt']!r}: expected 'float' "
                                  f"(float32 scales)")
        block = qc.get("weight_block_size")
        if block is None:
            return Fp8Format("fp8", "tensor", None, "_scale_inv")
        return Fp8Format("fp8", "block", _block_size(block, "weight_block_size", source), "_scale_inv")
    if method == "compressed-tensors":
        if qc.get("quantization_status", "compressed") != "compressed":
            return None  # "frozen" and earlier: the weights are stored unquantised, the scales are unused
        groups = (qc.get("config_groups") or {}).values()
        weights = [g.get("weights") or {} for g in groups]
        fmts = {g.get("format", qc.get("format")) for g in groups}
        if not weights or fmts != {"float-quantized"}:
            raise CheckpointError(f"{source}: compressed-tensors format {sorted(map(str, fmts)) or qc.get('format')}: "
                                  f"expected 'float-quantized' (FP8 weights) in every config group")
        bad = [w for w in weights if w.get("type") != "float" or w.get("num_bits") != 8]
        if bad:
            raise CheckpointError(f"{source}: compressed-tensors weights of type {bad[0].get('type')!r} with "
                                  f"{bad[0].get('num_bits')} bits: expected type 'float' with num_bits 8 (e4m3)")
        strategies = {w.get("strategy") for w in weights}
        if len(strategies) != 1 or not strategies <= {"tensor", "channel", "block"}:
            raise CheckpointError(f"{source}: compressed-tensors weight strategies {sorted(map(str, strategies))}: "
                                  f"expected one of 'tensor', 'channel' or 'block' for every group")
        strategy = strategies.pop()
        block = _block_size(weights[0].get("block_structure"), "block_structure", source) \
            if strategy == "block" else None
        return Fp8Format("compressed-tensors", strategy, block, "_scale")
    raise CheckpointError(f"{source}: quantization_config.quant_method = {method!r}: expected 'fp8' or "
                          f"'compressed-tensors' (FP8 e4m3 weights with scales)")


def _block_size(v, key: str, source: str) -> tuple[int, int]:
    if (not isinstance(v, (list, tuple)) or len(v) != 2
            or not all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in v)):
        raise CheckpointError(f"{source}: quantization_config {key} = {v!r}: expected two positive integers, "
                              f"e.g. [128, 128]")
    return int(v[0]), int(v[1])


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, fmt: Fp8Format, dtype: torch.dtype) -> torch.Tensor:
    """w = float(q) * scale, each scale broadcast over its block; the result in ``dtype``.

    q: [..., out, in] e4m3; scale: ``fmt.scale_shape(q.shape)``, already checked. Rows go in
    chunks of whole blocks so the float32 temporaries stay small next to the weight itself."""
    if fmt.strategy == "tensor":
        return (q.float() * scale.float().reshape(())).to(dtype)
    out_rows, inp = q.shape[-2:]
    bo, bi = fmt.blocks(out_rows, inp)
    lead = q.shape[:-2]
    q3, s3 = q.reshape(-1, out_rows, inp), scale.float().reshape(-1, *scale.shape[-2:])
    res = torch.empty(q3.shape, dtype=dtype)
    step = max(bo, (_DEQUANT_CHUNK // max(inp, 1)) // bo * bo)  # rows per chunk: whole blocks
    for n in range(q3.shape[0]):
        for r0 in range(0, out_rows, step):
            r1 = min(r0 + step, out_rows)
            s = s3[n, r0 // bo:math.ceil(r1 / bo)].repeat_interleave(bo, 0)[:r1 - r0]
            s = s.repeat_interleave(bi, 1)[:, :inp]
            res[n, r0:r1] = (q3[n, r0:r1].float() * s).to(dtype)
    return res.reshape(*lead, out_rows, inp)


class _Checkpoint:
    """All tensors of the ``*.safetensors`` files of a folder, opened lazily by name; FP8 weights
    (float8_e4m3fn beside a scale tensor, as config.json's quantization_config says) come back
    dequantised."""

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
        cfg = folder / "config.json"
        try:
            config = json.loads(cfg.read_text()) if cfg.is_file() else {}
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{cfg}: cannot read it as JSON ({e}): expected a Hugging Face config.json") from None
        self.fp8 = fp8_format(config, str(cfg)) if isinstance(config, dict) else None

    def has(self, name: str) -> bool:
        return name in self.where

    def _read(self, name: str) -> torch.Tensor:
        with safe_open(str(self.where[name]), framework="pt") as h:
            return h.get_tensor(name)

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, needed_for: str) -> torch.Tensor:
        f = self.where.get(name)
        if f is None:
            files = ", ".join(p.name for p in self.files)
            raise CheckpointError(f"{self.folder}: tensor '{name}' (needed for {needed_for}) is in none of the "
                                  f"checkpoint files ({files})")
        t = self._read(name)
        if tuple(t.shape) != tuple(shape):
            raise CheckpointError(f"{f}: tensor '{name}' has shape {list(t.shape)}: expected {list(shape)} "
                                  f"for {needed_for} (does the config match the checkpoint?)")
        scale_name = self._scale_name(name, t, f)
        if scale_name is None:
            return t.to(dtype)
        assert self.fp8 is not None
        return dequantize_fp8(t, self._scale(scale_name, t, f), self.fp8, dtype)

    def _scale_name(self, name: str, t: torch.Tensor, f: Path) -> str | None:
        """The scale tensor beside FP8 weight ``name``; None for a plain tensor. A float8 tensor
        without a quantization_config or a scale, or a scale beside a non-FP8 tensor, is an error."""
        is_fp8 = t.dtype in _FP8_DTYPES
        if self.fp8 is None:
            if is_fp8:
                raise CheckpointError(f"{f}: tensor '{name}' is {_dtype_name(t.dtype)} but config.json has no "
                                      f"quantization_config: expected quant_method 'fp8' or 'compressed-tensors'")
            return None
        scale_name = name + self.fp8.scale_suffix
        if not is_fp8:
            if scale_name in self.where:
                raise CheckpointError(f"{f}: tensor '{name}' is {_dtype_name(t.dtype)} beside its scale "
                                      f"'{scale_name}': expected float8_e4m3fn")
            return None  # a module left unquantised (router, embedding, ignored layers)
        if t.dtype != torch.float8_e4m3fn:
            raise CheckpointError(f"{f}: tensor '{name}' is {_dtype_name(t.dtype)}: expected float8_e4m3fn")
        if scale_name not in self.where:
            raise CheckpointError(f"{f}: FP8 tensor '{name}' has no scale '{scale_name}' in the checkpoint: "
                                  f"expected a float32 tensor of shape {list(self.fp8.scale_shape(tuple(t.shape)))}")
        return scale_name

    def _scale(self, scale_name: str, q: torch.Tensor, f: Path) -> torch.Tensor:
        """The scale tensor, checked: shape per the format, a float dtype, every value finite and >= 0."""
        assert self.fp8 is not None
        s = self._read(scale_name)
        want = self.fp8.scale_shape(tuple(q.shape))
        got = tuple(s.shape)
        fine = got in ((), (1,)) if self.fp8.strategy == "tensor" else got == want
        if not fine:
            what = {"block": f"one per {self.fp8.block[0]}x{self.fp8.block[1]} block" if self.fp8.block else "",
                    "channel": "one per output row", "tensor": "a single scale"}[self.fp8.strategy]
            raise CheckpointError(f"{self.where[scale_name]}: scale '{scale_name}' has shape {list(got)}: expected "
                                  f"{list(want)} ({what} of weight {list(q.shape)}, {self.fp8.quant_method} "
                                  f"{self.fp8.strategy} scales)")
        if not s.dtype.is_floating_point or s.dtype in _FP8_DTYPES:
            raise CheckpointError(f"{self.where[scale_name]}: scale '{scale_name}' is {_dtype_name(s.dtype)}: "
                                  f"expected float32 (or bfloat16/float16)")
        bad = ~torch.isfinite(s) | (s < 0)
        if bool(bad.any()):
            v = float(s[bad].flatten()[0])
            raise CheckpointError(f"{self.where[scale_name]}: scale '{scale_name}' holds {v} at "
                                  f"{[int(i) for i in bad.nonzero()[0]]}: expected finite, non-negative scales")
        return s


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


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
    the wrong shape, or an FP8 weight's scale is missing, misshapen or not finite and >= 0. FP8
    weights are dequantised to ``dtype`` one tensor at a time (``dequantize_fp8``). Expert weights may be stored per expert (what ``save_pretrained`` writes:
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
