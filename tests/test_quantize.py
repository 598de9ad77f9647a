"""``mkc quantize`` and FP8 checkpoints, against independent references.

Tiny random transformers checkpoints (Cohere2-MoE with a tied head, Qwen3-MoE with an untied one)
are quantised both ways (FineGrainedFP8 128x128 blocks, compressed-tensors per-channel) and read
back with ``load_checkpoint``. The references: a dequantisation written here from the format's
definition (w = float(fp8) * scale of the element's block), a float32 checkpoint of those values
that transformers runs as the oracle for greedy tokens, and transformers' own reader of the FP8
checkpoint where it has one on the CPU (FineGrainedFP8).
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from conftest import assert_one_line_error, run_main, save_checkpoint
from safetensors import safe_open
from safetensors.torch import save_file

from mkc.ir.spec import load_spec
from mkc.runtime.generate import greedy_generate
from mkc.runtime.quantize import fp8_format_for, quantize_checkpoint, quantize_weight
from mkc.runtime.weights import CheckpointError, dequantize_fp8, load_checkpoint

transformers = pytest.importorskip("transformers")
from test_families import build_checkpoint  # after the transformers check: these modules need it
from test_transformers_oracle import _hf_config

NEW_TOKENS = 10
PROMPT_LENGTHS = (4, 13)  # Cohere's sliding window is 8: the longer prompt decodes past it
SCHEMES = ("block", "channel")
FAMILIES = {"cohere2_moe": "Cohere2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}

# Rounding to e4m3 (3 mantissa bits), for x = w / scale with |x| <= 448: a normal value
# (|x| >= 2^-6) lies in [2^e, 2^(e+1)) where e4m3 values are 2^(e-3) apart, so round-to-nearest
# moves it by at most 2^(e-4) <= 2^-4 |x|; a subnormal one (|x| < 2^-6, values 2^-9 apart) by at
# most 2^-10. Times the scale: |w - dq| <= 2^-4 |w| + 2^-10 * scale, with scale the element's own
# block (or row) scale. The float32 roundings of w / scale and q * scale (2^-24 relative each) fit
# in the slack of the sum (each case alone is at most one of the two terms).
REL_STEP, SUBNORMAL_STEP = 2.0 ** -4, 2.0 ** -10


# ----------------------------------------------------------------------------------------------
# checkpoints

def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})  # noqa: SIM118
    return out


def _config(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())


def _rewrite(src: Path, dst: Path, tensors: dict[str, torch.Tensor], config: dict | None = None) -> Path:
    """A one-file checkpoint of ``tensors`` with src's config.json (or ``config``)."""
    dst.mkdir()
    (dst / "config.json").write_text(json.dumps(config if config is not None else _config(src)))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst / "model.safetensors"))
    return dst


class Checkpoints:
    """The tiny source checkpoints and their quantised and dequantised copies, built once each."""

    def __init__(self, root: Path):
        self.root, self.cache = root, {}

    def source(self, family: str) -> Path:
        key = ("source", family)
        if key not in self.cache:
            folder = self.root / family
            if family == "cohere2_moe":
                torch.manual_seed(2026)
                save_checkpoint(transformers.Cohere2MoeForCausalLM(_hf_config()), folder)
            else:
                build_checkpoint(family, folder)
            self.cache[key] = folder
        return self.cache[key]

    def fp8(self, family: str, scheme: str, block: int = 128) -> Path:
        key = ("fp8", family, scheme, block)
        if key not in self.cache:
            folder = self.root / f"{family}-{scheme}-{block}"
            quantize_checkpoint(self.source(family), folder, scheme=scheme, block=block)
            self.cache[key] = folder
        return self.cache[key]

    def dequantized(self, family: str, scheme: str) -> Path:
        """The FP8 checkpoint's values as a plain float32 checkpoint (reference_dequantize)."""
        key = ("dq", family, scheme)
        if key not in self.cache:
            src = self.fp8(family, scheme)
            cfg = _config(src)
            del cfg["quantization_config"]
            self.cache[key] = _rewrite(src, self.root / f"{family}-{scheme}-dq", reference_dequantize(src), cfg)
        return self.cache[key]


@pytest.fixture(scope="module")
def ck(tmp_path_factory) -> Checkpoints:
    return Checkpoints(tmp_path_factory.mktemp("fp8"))


def _grid(folder: Path) -> tuple[str, int | None, int | None]:
    """(scale suffix, rows, columns per scale) from config.json; None columns: the whole row,
    None rows and columns: one scale per tensor."""
    qc = _config(folder)["quantization_config"]
    if qc["quant_method"] == "fp8":
        b = qc["weight_block_size"]
        return "_scale_inv", *((b[0], b[1]) if b else (None, None))
    strategy = qc["config_groups"]["group_0"]["weights"]["strategy"]
    return "_scale", *{"channel": (1, None), "tensor": (None, None)}[strategy]


def _scale_per_element(scale: torch.Tensor, shape: torch.Size, rows: int | None, cols: int | None) -> torch.Tensor:
    """Each element's scale: element (i, j) reads scale[i // rows, j // cols]."""
    if rows is None:
        return scale.float().reshape(()).expand(shape)
    out, inp = shape[-2:]
    r = torch.arange(out) // rows
    c = torch.arange(inp) // (cols or inp)
    return scale.float()[..., r, :][..., c]


def reference_dequantize(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of an FP8 checkpoint, FP8 ones as float32 values, scale tensors dropped."""
    suffix, rows, cols = _grid(folder)
    t = _tensors(folder)
    out = {}
    for name, v in t.items():
        if name.endswith(suffix):
            continue
        if name + suffix in t:
            out[name] = v.float() * _scale_per_element(t[name + suffix], v.shape, rows, cols)
        else:
            out[name] = v
    return out


def _is_quantized_role(name: str, tied: bool) -> bool:
    """The matrices mkc quantize must store in FP8, by their role (written independently of
    quantize.py's pattern): attention, dense MLP, experts, an untied LM head."""
    if name == "lm_head.weight":
        return not tied
    parts = name.split(".")
    return name.endswith("_proj.weight") and ("self_attn" in parts or "mlp" in parts)


# ----------------------------------------------------------------------------------------------
# what is written

@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("family", FAMILIES)
def test_written_layout(ck, family, scheme):
    """Which tensors are FP8, their scales' dtype and shape, the config fields, scale = amax / 448
    (each nonzero block's largest |fp8| is 448), the kept tensors unchanged, other files copied."""
    src, dst = ck.source(family), ck.fp8(family, scheme)
    tied = load_spec(src).tie_word_embeddings
    before, after = _tensors(src), _tensors(dst)
    suffix, rows, cols = _grid(dst)
    quantized = sorted(n for n in before if _is_quantized_role(n, tied))
    assert quantized and any(".experts." in n for n in quantized) and ("lm_head.weight" in quantized) == (not tied)
    assert set(after) == set(before) | {n + suffix for n in quantized}
    for name in before:
        if name not in quantized:
            assert after[name].dtype == before[name].dtype and torch.equal(after[name], before[name]), name
            continue
        q, s = after[name], after[name + suffix]
        out, inp = q.shape
        want = (math.ceil(out / rows), math.ceil(inp / cols)) if cols else (out, 1)
        assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and tuple(s.shape) == want, name
        br, bc = rows, cols or inp  # max |q| per scale: zero-padded to whole blocks
        a = torch.nn.functional.pad(q.float().abs(), (0, want[1] * bc - inp, 0, want[0] * br - out))
        per_block = a.reshape(want[0], br, want[1], bc).amax(dim=(1, 3))
        assert torch.all(per_block == 448.0), f"{name}: block maxima {per_block.unique().tolist()} (expected 448)"

    qc = _config(dst)["quantization_config"]
    routers = sorted({n.removesuffix(".weight") for n in before if n.endswith("mlp.gate.weight")})
    assert routers
    keep = (["lm_head"] if tied else []) + routers
    if scheme == "block":
        assert qc == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                      "weight_block_size": [128, 128], "modules_to_not_convert": keep}
        parsed = transformers.FineGrainedFP8Config.from_dict(dict(qc))  # transformers' own parser takes it
        assert list(parsed.weight_block_size) == [128, 128] and parsed.modules_to_not_convert == keep
    else:  # compressed-tensors needs its own package to be parsed: the documented fields, checked here
        g = qc["config_groups"]["group_0"]
        assert (qc["quant_method"], qc["format"], qc["quantization_status"]) == \
            ("compressed-tensors", "float-quantized", "compressed")
        assert g["targets"] == ["Linear"] and g["input_activations"] is None and qc["ignore"] == keep
        w = g["weights"]
        assert (w["num_bits"], w["type"], w["strategy"], w["symmetric"], w["dynamic"]) == \
            (8, "float", "channel", True, False)
    assert (dst / "generation_config.json").read_bytes() == (src / "generation_config.json").read_bytes()
    assert {k: v for k, v in _config(dst).items() if k != "quantization_config"} == _config(src)


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("family", FAMILIES)
def test_dequantized_weights_within_e4m3_rounding(ck, family, scheme):
    """Every FP8 weight, dequantised, is within e4m3's rounding of the original (bound above)."""
    src, dst = ck.source(family), ck.fp8(family, scheme)
    before, after = _tensors(src), _tensors(dst)
    suffix, rows, cols = _grid(dst)
    worst, changed = 0.0, 0
    for name, w in before.items():
        if name + suffix not in after:
            continue
        s = _scale_per_element(after[name + suffix], w.shape, rows, cols)
        dq = after[name].float() * s
        err = (w.float() - dq).abs()
        bound = REL_STEP * w.float().abs() + SUBNORMAL_STEP * s
        ratio = float((err / bound).max())
        assert ratio <= 1.0, f"{name}: max |w - dq| / bound = {ratio:.3f} (max error {float(err.max()):.3g})"
        worst, changed = max(worst, ratio), changed + bool(err.max() > 0)
    assert changed > 0 and worst > 0.5, f"only {changed} tensors changed, worst {worst:.3f} of the bound: " \
                                         "is anything rounded to e4m3?"


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("family", FAMILIES)
def test_loader_dequantizes_like_the_reference(ck, family, scheme):
    """load_checkpoint on the FP8 folder equals load_checkpoint on the reference-dequantised
    float32 folder, exactly: float32 and, rounded once from the same products, bfloat16."""
    spec = load_spec(ck.source(family))
    for dtype in (torch.float32, torch.bfloat16):
        got = load_checkpoint(ck.fp8(family, scheme), spec, dtype)
        want = load_checkpoint(ck.dequantized(family, scheme), spec, dtype)
        assert got.keys() == want.keys()
        for k in want:
            assert got[k].dtype == dtype and torch.equal(got[k], want[k]), f"{k} ({dtype})"


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


@torch.no_grad()
def _hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """Greedy decoding with the whole sequence re-run each step (no KV cache)."""
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def _check_greedy(model, spec, weights, what: str) -> None:
    for i, prompt in enumerate(_prompts(spec.vocab_size)):
        want = _hf_greedy(model, prompt, NEW_TOKENS)
        got = greedy_generate(spec, weights, prompt, NEW_TOKENS, dtype=torch.float32, seed=i)
        assert got == want, f"{what}, prompt of {len(prompt)} tokens: mkc {got} vs transformers {want}"
        assert len(set(want)) > 1, "degenerate oracle: the model repeats one token"


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_match_transformers_on_dequantized_weights(ck, family, scheme):
    """mkc's CPU path (float32) on the FP8 checkpoint decodes transformers' greedy tokens, the
    transformers model holding the reference-dequantised values."""
    spec = load_spec(ck.fp8(family, scheme))
    model = getattr(transformers, FAMILIES[family]).from_pretrained(
        ck.dequantized(family, scheme), dtype=torch.float32, attn_implementation="eager").eval()
    _check_greedy(model, spec, load_checkpoint(ck.fp8(family, scheme), spec, torch.float32), f"{family} {scheme}")


@pytest.mark.parametrize("family", FAMILIES)
def test_transformers_reads_the_block_checkpoint(ck, family):
    """transformers loads the FineGrainedFP8 checkpoint on the CPU (it dequantises on load when
    there is no GPU) to the reference values, and decodes what mkc decodes from it.

    64 x 64 blocks here: transformers' CPU dequantisation splits the rows evenly among the scale
    rows, so a ragged edge block (192 rows under 128-row blocks: read as two of 96) comes out
    wrong there, while its GPU FP8Linear (scales ceil(out/128) x ceil(in/128)), vLLM and mkc
    read edge blocks as the format defines them. Every dimension of these models divides by 64."""
    fp8 = ck.fp8(family, "block", block=64)
    cls = getattr(transformers, FAMILIES[family])
    model = cls.from_pretrained(fp8, dtype=torch.float32, attn_implementation="eager").eval()
    cfg = _config(fp8)
    del cfg["quantization_config"]
    ref = cls.from_pretrained(_rewrite(fp8, ck.root / f"{family}-block64-dq", reference_dequantize(fp8), cfg),
                              dtype=torch.float32, attn_implementation="eager")
    theirs, want = model.state_dict(), ref.state_dict()
    assert theirs.keys() == want.keys()
    for k in want:
        assert torch.equal(theirs[k].float(), want[k]), k
    spec = load_spec(fp8)
    _check_greedy(model, spec, load_checkpoint(fp8, spec, torch.float32), f"{family} read by transformers")


# ----------------------------------------------------------------------------------------------
# quantize_weight and the scale layouts

@pytest.mark.parametrize("shape,scheme,scale_shape", [
    ((130, 200), "block", (2, 2)),  # ragged edge blocks
    ((3, 130, 200), "block", (3, 2, 2)),  # fused experts [E, out, in]
    ((130, 200), "channel", (130, 1)),
])
def test_quantize_weight_round_trip(shape, scheme, scale_shape):
    """Scales per block or row (ragged edges, leading expert dims), an all-zero block (scale 1,
    zeros kept exactly), an outlier (its block alone gets a large scale), tiny subnormal values."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(shape, generator=g) * 0.05
    w[..., :128, :128] = 0.0  # an all-zero block
    w[..., 0, :] = 0.0  # and an all-zero row (channel scales)
    w[..., 129, 199] = 30.0  # an outlier in the last (ragged) block
    w[..., 128, :3] = torch.tensor([1e-6, -3e-7, 2e-9])  # subnormal in e4m3 after scaling
    fmt = fp8_format_for(scheme, 128)
    q, s = quantize_weight(w, fmt)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and tuple(s.shape) == scale_shape
    assert torch.all(s[..., 0, 0] == 1.0) and torch.all(q[..., :128, :128].float() == 0)
    dq = dequantize_fp8(q, s, fmt, torch.float32)
    per_element = s.repeat_interleave(128 if scheme == "block" else 1, -2)[..., :shape[-2], :]
    per_element = per_element.repeat_interleave(128 if scheme == "block" else shape[-1], -1)[..., :shape[-1]]
    assert torch.equal(dq, q.float() * per_element)
    err, bound = (w - dq).abs(), REL_STEP * w.abs() + SUBNORMAL_STEP * per_element
    assert torch.all(err <= bound), f"max |w - dq| / bound = {float((err / bound).max()):.3f}"
    assert torch.all(q[..., 129, 199].float() == 448.0)  # the outlier is its block's amax: it maps to 448


def test_fused_expert_layout_quantizes_and_loads(ck, tmp_path):
    """Experts stored fused (mlp.experts.gate_up_proj [E, 2I, H], down_proj [E, H, I]): quantised
    with one block grid per expert ([E, ceil(2I/128), ceil(H/128)] scales beside the tensor) and
    loaded to the reference values; the same logical weights as the per-expert layout within
    e4m3's rounding."""
    src = ck.source("qwen3_moe")
    spec = load_spec(src)
    t = _tensors(src)
    m = spec.moe
    for i, ls in enumerate(spec.layers):
        if ls.mlp != "moe":
            continue
        X = f"model.layers.{i}.mlp.experts"
        gate, up, down = ([t.pop(f"{X}.{e}.{p}_proj.weight") for e in range(m.num_experts)]
                          for p in ("gate", "up", "down"))
        t[f"{X}.gate_up_proj"] = torch.stack([torch.cat([g, u]) for g, u in zip(gate, up, strict=True)])
        t[f"{X}.down_proj"] = torch.stack(down)
    fused = _rewrite(src, tmp_path / "fused", t)
    quantize_checkpoint(fused, tmp_path / "fp8", scheme="block")
    q = _tensors(tmp_path / "fp8")
    X = "model.layers.1.mlp.experts"
    assert q[f"{X}.gate_up_proj"].dtype == torch.float8_e4m3fn
    assert tuple(q[f"{X}.gate_up_proj_scale_inv"].shape) == (m.num_experts, 1, 1)  # 2I = 128, H = 128
    cfg = _config(tmp_path / "fp8")
    del cfg["quantization_config"]
    ref = _rewrite(src, tmp_path / "ref", reference_dequantize(tmp_path / "fp8"), cfg)
    got = load_checkpoint(tmp_path / "fp8", spec, torch.float32)
    want, orig = load_checkpoint(ref, spec, torch.float32), load_checkpoint(src, spec, torch.float32)
    for k in want:
        assert torch.equal(got[k], want[k]), k
        # the tensor-wide amax / 448 bounds every block scale of the logical tensor
        err, bound = (got[k] - orig[k]).abs(), REL_STEP * orig[k].abs() + SUBNORMAL_STEP * orig[k].abs().max() / 448
        assert torch.all(err <= bound), f"{k}: max error {float(err.max()):.3g}"


def test_compressed_tensors_block_scales_load(ck, tmp_path):
    """compressed-tensors strategy "block" (``weight_scale`` [ceil(out/128), ceil(in/128)],
    ``block_structure`` in the config) reads as the same blocks under FineGrainedFP8's names."""
    src = ck.fp8("qwen3_moe", "block")
    t = {k.removesuffix("_scale_inv") + "_scale" if k.endswith("_scale_inv") else k: v
         for k, v in _tensors(src).items()}
    qc = {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "block",
                                           "block_structure": [128, 128]}}}}
    folder = _rewrite(src, tmp_path / "ct", t, {**_config(src), "quantization_config": qc})
    spec = load_spec(src)
    got, want = load_checkpoint(folder, spec, torch.float32), load_checkpoint(src, spec, torch.float32)
    for k in want:
        assert torch.equal(got[k], want[k]), k


def test_frozen_compressed_tensors_checkpoint_loads_as_stored(ck, tmp_path):
    """quantization_status "frozen": the weights are stored unquantised beside unused scales."""
    src = ck.source("qwen3_moe")
    t = _tensors(src)
    t[W + "_scale"] = torch.ones(256, 1)
    qc = {**_config(ck.fp8("qwen3_moe", "channel"))["quantization_config"], "quantization_status": "frozen"}
    folder = _rewrite(src, tmp_path / "frozen", t, {**_config(src), "quantization_config": qc})
    spec = load_spec(src)
    got, want = load_checkpoint(folder, spec, torch.float32), load_checkpoint(src, spec, torch.float32)
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_bfloat16_scales_load(ck, tmp_path):
    """compressed-tensors checkpoints often store scales in the weights' dtype (bfloat16): read as
    float(fp8) * float(scale)."""
    src = ck.fp8("qwen3_moe", "channel")
    t = {k: v.bfloat16() if k.endswith("_scale") else v for k, v in _tensors(src).items()}
    folder = _rewrite(src, tmp_path / "bf16", t)
    spec = load_spec(src)
    got = load_checkpoint(folder, spec, torch.float32)
    cfg = _config(src)
    del cfg["quantization_config"]
    want = load_checkpoint(_rewrite(src, tmp_path / "ref", reference_dequantize(folder), cfg), spec, torch.float32)
    for k in want:
        assert torch.equal(got[k], want[k]), k


def test_per_tensor_scales_load(ck, tmp_path):
    """A single scale per tensor, as [] (FineGrainedFP8 without weight_block_size) or [1]
    (compressed-tensors strategy "tensor"), loads to float(fp8) * scale."""
    src = ck.source("qwen3_moe")
    spec = load_spec(src)
    before = _tensors(src)
    for scale_shape, qc in (((), {"quant_method": "fp8", "weight_block_size": None}),
                            ((1,), {"quant_method": "compressed-tensors", "format": "float-quantized",
                                    "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                                        "num_bits": 8, "type": "float", "strategy": "tensor"}}}})):
        suffix = "_scale_inv" if qc["quant_method"] == "fp8" else "_scale"
        t, ref = dict(before), dict(before)
        for name, w in before.items():
            if _is_quantized_role(name, spec.tie_word_embeddings):
                s = w.abs().max() / 448.0
                t[name] = (w / s).clamp(-448, 448).to(torch.float8_e4m3fn)
                t[name + suffix] = s.reshape(scale_shape).float()
                ref[name] = t[name].float() * s
        folder = _rewrite(src, tmp_path / f"tensor{len(scale_shape)}", t, {**_config(src), "quantization_config": qc})
        got = load_checkpoint(folder, spec, torch.float32)
        want = load_checkpoint(_rewrite(src, tmp_path / f"ref{len(scale_shape)}", ref), spec, torch.float32)
        for k in want:
            assert torch.equal(got[k], want[k]), f"{k} (scale shape {list(scale_shape)})"


# ----------------------------------------------------------------------------------------------
# bad checkpoints and bad input: one line naming the tensor

W = "model.layers.1.self_attn.q_proj.weight"  # [256, 128]: 2 x 1 blocks of 128 x 128


def _tamper(kind: str, t: dict[str, torch.Tensor], cfg: dict) -> str:
    """Break the block checkpoint's tensors or config in place; the expected error's needle."""
    s = W + "_scale_inv"
    if kind == "scale shape":
        t[s] = t[s][:1].clone()
        return f"scale '{s}' has shape [1, 1]: expected [2, 1] (one per 128x128 block of weight [256, 128]"
    if kind == "nan scale":
        t[s] = t[s].clone()
        t[s][1, 0] = float("nan")
        return f"scale '{s}' holds nan at [1, 0]: expected finite, non-negative scales"
    if kind == "negative scale":
        t[s] = -t[s]
        return f"scale '{s}' holds -"
    if kind == "infinite scale":
        t[s] = t[s].clone()
        t[s][0, 0] = float("inf")
        return f"scale '{s}' holds inf at [0, 0]"
    if kind == "missing scale":
        del t[s]
        return f"FP8 tensor '{W}' has no scale '{s}' in the checkpoint: expected a float32 tensor of shape [2, 1]"
    if kind == "weight not fp8":
        t[W] = t[W].float().bfloat16()
        return f"tensor '{W}' is bfloat16 beside its scale '{s}': expected float8_e4m3fn"
    if kind == "e5m2 weight":
        t[W] = t[W].float().to(torch.float8_e5m2)
        return f"tensor '{W}' is float8_e5m2: expected float8_e4m3fn"
    if kind == "integer scale":
        t[s] = t[s].to(torch.int32)
        return f"scale '{s}' is int32: expected float32"
    if kind == "no quantization_config":
        del cfg["quantization_config"]
        return "is float8_e4m3fn but config.json has no quantization_config"
    if kind == "other method":
        cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4}
        return "quantization_config.quant_method = 'gptq': expected 'fp8' or 'compressed-tensors'"
    if kind == "bad block size":
        cfg["quantization_config"]["weight_block_size"] = [128]
        return "weight_block_size = [128]: expected two positive integers"
    raise AssertionError(kind)


TAMPERINGS = ("scale shape", "nan scale", "negative scale", "infinite scale", "missing scale", "weight not fp8",
              "e5m2 weight", "integer scale", "no quantization_config", "other method", "bad block size")


@pytest.mark.parametrize("kind", TAMPERINGS)
def test_bad_fp8_checkpoint_is_one_clear_error(ck, tmp_path, kind):
    src = ck.fp8("qwen3_moe", "block")
    t, cfg = _tensors(src), _config(src)
    needle = _tamper(kind, t, cfg)
    folder = _rewrite(src, tmp_path / "bad", t, cfg)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(folder, load_spec(src), torch.float32)
    msg = str(e.value)
    assert needle in msg and "\n" not in msg, msg


def test_channel_scale_of_the_wrong_shape(ck, tmp_path):
    src = ck.fp8("qwen3_moe", "channel")
    t = _tensors(src)
    t[W + "_scale"] = t[W + "_scale"].reshape(-1)  # [256] instead of [256, 1]
    with pytest.raises(CheckpointError, match=r"scale '.*q_proj\.weight_scale' has shape \[256\]: expected "
                                              r"\[256, 1\] \(one per output row of weight \[256, 128\]"):
        load_checkpoint(_rewrite(src, tmp_path / "bad", t), load_spec(src), torch.float32)


def test_cli_quantize_writes_a_checkpoint_mkc_generates_from(ck, tmp_path, capsys):
    """mkc quantize on a two-shard checkpoint with tokenizer files: the same shards, an index
    naming every tensor's shard (scales included), the other files copied; mkc generate reads it
    and decodes what it decodes from the one-shard quantisation."""
    src = ck.source("qwen3_moe")
    t = _tensors(src)
    names = sorted(t)
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    shutil.copy(src / "config.json", sharded / "config.json")
    (sharded / "tokenizer_config.json").write_text('{"model_max_length": 64}')
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for f, ns in shards.items():
        save_file({n: t[n] for n in ns}, str(sharded / f))
    (sharded / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {n: f for f, ns in shards.items() for n in ns}}))

    out = tmp_path / "fp8"
    rc, stdout, err = run_main(capsys, "quantize", sharded, "-o", out)
    assert rc == 0, err
    assert "quantized" in stdout and "float8_e4m3fn" in stdout
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in sharded.iterdir())
    assert (out / "tokenizer_config.json").read_text() == '{"model_max_length": 64}'
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    for f in shards:
        with safe_open(str(out / f), framework="pt") as h:
            for k in h.keys():  # noqa: SIM118
                assert index.pop(k) == f, k
    assert not index, f"index names tensors that are in no shard: {sorted(index)[:3]}"
    spec = load_spec(out)
    one = load_checkpoint(ck.fp8("qwen3_moe", "block"), spec, torch.float32)
    two = load_checkpoint(out, spec, torch.float32)
    assert all(torch.equal(one[k], two[k]) for k in one)

    rc, stdout, err = run_main(capsys, "generate", "--config", out, "--checkpoint", out, "--prompt-ids", "1,2,3",
                               "--max-new-tokens", 3, "--json")
    assert rc == 0, err
    assert json.loads(stdout)["tokens"] == greedy_generate(spec, one, [1, 2, 3], 3, dtype=torch.float32)


def test_cli_quantize_bad_input(ck, tmp_path, capsys):
    rc, _, err = run_main(capsys, "quantize", tmp_path / "nowhere", "-o", tmp_path / "o")
    assert_one_line_error(rc, err, "nowhere: no such folder: expected a Hugging Face checkpoint folder")
    empty = tmp_path / "no_weights"
    empty.mkdir()
    shutil.copy(ck.source("qwen3_moe") / "config.json", empty / "config.json")
    rc, _, err = run_main(capsys, "quantize", empty, "-o", tmp_path / "o")
    assert_one_line_error(rc, err, "no_weights: no *.safetensors files: expected a Hugging Face checkpoint folder")
    rc, _, err = run_main(capsys, "quantize", ck.fp8("qwen3_moe", "block"), "-o", tmp_path / "o")
    assert_one_line_error(rc, err, "already quantized (quant_method 'fp8'): expected a bf16/fp32 checkpoint")
    rc, _, err = run_main(capsys, "quantize", ck.source("qwen3_moe"), "-o", ck.source("cohere2_moe"))
    assert_one_line_error(rc, err, "exists and is not an empty folder: expected a new or empty folder")
    assert not (tmp_path / "o").exists()


def test_cli_quantize_refuses_a_non_finite_weight(ck, tmp_path, capsys):
    src = ck.source("qwen3_moe")
    t = _tensors(src)
    t[W] = t[W].clone()
    t[W][3, 5] = float("inf")
    rc, _, err = run_main(capsys, "quantize", _rewrite(src, tmp_path / "inf", t), "-o", tmp_path / "o")
    assert_one_line_error(rc, err, f"tensor '{W}' holds inf or NaN values: expected finite weights")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["inf"], "a partial checkpoint was left behind"


def test_cli_generate_on_a_bad_scale_is_one_line(ck, tmp_path, capsys):
    src = ck.fp8("qwen3_moe", "block")
    t, cfg = _tensors(src), _config(src)
    needle = _tamper("nan scale", t, cfg)
    folder = _rewrite(src, tmp_path / "bad", t, cfg)
    rc, _, err = run_main(capsys, "generate", "--config", folder, "--checkpoint", folder, "--prompt-ids", "1",
                          "--max-new-tokens", 1)
    assert_one_line_error(rc, err, needle)
