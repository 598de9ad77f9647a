"""FP8 weights in the compiler (issue 61): the lowering counts their real bytes, the CPU executor on
FP8 weights computes what a float32 reference computes over the dequantised weights, greedy
decoding matches transformers run on the same dequantised weights, bad tensors give one line
naming them, and the kernel for each format builds for sm_90a with the dequantisation in
registers.

Tolerances. Executor against the dense reference: both run in float32 over exactly the same
dequantised weights (the executor dequantises the e4m3 values and scales itself, the reference
is given w = float(q) * scale), so they differ only in summation order: the float32 budget of
tests/test_executor.py (5e-5 absolute and relative). Against transformers: greedy tokens equal.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch

from mkc.codegen.weight_tiles import from_tiles_fp8, to_tiles_fp8
from mkc.ir import fp8
from mkc.ir.lower import lower
from mkc.ir.spec import SpecError, load_spec
from mkc.runtime.generate import greedy_generate
from mkc.runtime.quantize import fp8_weights
from mkc.runtime.reference import DenseReference
from mkc.runtime.weights import random_weights
from mkc.schedule.executor import CpuExecutor
from mkc.schedule.plan import plan
from mkc.schedule.scheduler import schedule

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
F32_ATOL, F32_RTOL = 5e-5, 5e-5  # tests/test_executor.py: the same math summed in another order


def _dequantised(weights: dict, buffers: dict, spec) -> tuple[dict, object]:
    """The float32 weights the executor computes with, for the dense reference: every FP8 matrix
    dequantised; a tied LM head becomes an untied one (the FP8 head is a quantised copy of the
    embedding, while the lookup reads the bf16 rows)."""
    out = {n: w for n, w in weights.items() if not n.endswith(fp8.SCALE_SUFFIX)}
    for name, b in buffers.items():
        if b.dtype == "fp8":
            out[name] = fp8.dequantize(weights[name], weights[name + fp8.SCALE_SUFFIX])
    if spec.tie_word_embeddings:
        spec = dataclasses.replace(spec, tie_word_embeddings=False)
    return out, spec


@pytest.mark.parametrize("fmt", ["fp8", "fp8-block"])
@pytest.mark.parametrize("config, batch", [("tiny.yaml", 1), ("tiny.yaml", 3), ("qwen3_moe_tiny.yaml", 2),
                                           ("qwen3_tiny.yaml", 1), ("mixtral_tiny.yaml", 2)])
def test_executor_on_fp8_weights_matches_reference_over_dequantised(config, batch, fmt):
    """Parallel and sequential blocks, MoE and dense, a tied head (qwen3_tiny), ragged 128-blocks
    (expert widths of 64): logits of 6 steps in random interleavings equal the float32 reference
    over the dequantised weights."""
    spec = load_spec(CONFIGS / config)
    sc = schedule(lower(spec, batch, 32, 8, weights=fmt), spec.name)
    assert any(b.dtype == "fp8" for b in sc.buffers.values())
    w = fp8_weights(random_weights(spec, seed=7, dtype=torch.float32, std=0.1), sc.buffers, fmt)
    ref_w, ref_spec = _dequantised(w, sc.buffers, spec)
    ex, ref = CpuExecutor(sc, spec, w), DenseReference(ref_spec, ref_w)
    g = torch.Generator().manual_seed(batch)
    for step in range(6):
        tokens = torch.randint(0, spec.vocab_size, (batch,), generator=g)
        pos = [max(0, step - 2 * b) for b in range(batch)]
        got, _ = ex.step(tokens, pos, seed=step)
        want = ref.step(tokens, pos)
        err, budget = (got - want).abs(), F32_ATOL + F32_RTOL * want.abs()
        assert bool((err <= budget).all()), f"{config} {fmt} b{batch} step {step}: max error {err.max():.3g}"


@pytest.mark.parametrize("fmt", ["fp8", "fp8-block"])
@pytest.mark.parametrize("config, batch", [("tiny.yaml", 3), ("qwen3_moe_tiny.yaml", 2)])
def test_fp8_down_projections_split_along_k_match_reference(config, batch, fmt):
    """Mixtral-8x7B's experts split their down projection along k (14336 columns do not fit the
    shared memory): with FP8 weights every part reads its own columns' e4m3 values and scales (a
    part of 64 columns starts inside a 128 x 128 scale block), and the summed partials equal the
    float32 reference over the dequantised weights."""
    spec = load_spec(CONFIGS / config)
    spec = dataclasses.replace(spec, moe=dataclasses.replace(spec.moe, intermediate=256))  # 4 blocks of 64
    sc = schedule(lower(spec, batch, 32, 8, weights=fmt, max_gemv_k=64), spec.name)
    split = [t for t in sc.tasks if t.op.name == "EXPERT_DOWN_SPLIT"]
    assert split and {t.arg("k0") for t in split} == {0, 64, 128, 192}
    w = fp8_weights(random_weights(spec, seed=7, dtype=torch.float32, std=0.1), sc.buffers, fmt)
    ref_w, ref_spec = _dequantised(w, sc.buffers, spec)
    ex, ref = CpuExecutor(sc, spec, w), DenseReference(ref_spec, ref_w)
    for step in range(4):
        tokens = torch.randint(0, spec.vocab_size, (batch,), generator=torch.Generator().manual_seed(step))
        pos = [step] * batch
        got, want = ex.step(tokens, pos, seed=step)[0], ref.step(tokens, pos)
        err, budget = (got - want).abs(), F32_ATOL + F32_RTOL * want.abs()
        assert bool((err <= budget).all()), f"{config} {fmt} step {step}: max error {err.max():.3g}"


def test_fp8_changes_the_logits_against_bf16():
    """The check above can fail: the same model on its bf16 weights gives other logits (by about
    e4m3's rounding), so equal logits mean the executor really read the FP8 values."""
    spec = load_spec(CONFIGS / "tiny.yaml")
    w32 = random_weights(spec, seed=7, dtype=torch.float32, std=0.1)
    sc = schedule(lower(spec, 1, 32, 8, weights="fp8"), spec.name)
    w = fp8_weights(w32, sc.buffers, "fp8")
    got, _ = CpuExecutor(sc, spec, w).step([5], [0], seed=0)
    plain = DenseReference(spec, w32).step(torch.tensor([5]), [0])
    rel = float((got - plain).norm() / plain.norm())
    assert 1e-3 < rel < 0.2, f"FP8 against bf16 logits: relative L2 {rel:.3g}"


@pytest.mark.parametrize("fmt", ["fp8", "fp8-block"])
def test_lowering_counts_the_real_bytes(fmt):
    """Every task that streams an FP8 matrix counts one byte per element plus its scales (4 bytes
    per row, or per 128 x 128 block); routers and embeddings stay bf16; the step reads about half
    the weight bytes of the bf16 lowering."""
    spec = load_spec(CONFIGS / "qwen3_moe_tiny.yaml")
    bf, q = lower(spec, 2, 32, 8), lower(spec, 2, 32, 8, weights=fmt)
    assert q.options["weights"] == fmt
    fp8_names = {n for n, b in q.buffers.items() if b.dtype == "fp8"}
    assert fp8_names and not any("router" in n or n == "embed" or "norm" in n for n in fp8_names)
    assert "lm_head" in fp8_names
    for t in q.tasks:
        mats = [r for r in t.reads if r.buffer in fp8_names]
        if not mats or t.op.name.startswith("EXPERT"):
            continue
        (r0, r1), (k0, k1) = mats[0].box[-2:]
        others = sum(2 * r.numel for r in t.reads if q.buffers[r.buffer].kind == "weight" and r not in mats)
        assert t.weight_bytes == others + sum(r.numel + fp8.scale_bytes(fmt, r1 - r0, k1 - k0) for r in mats), t.name
    for t in q.tasks:
        if t.op.name == "EXPERT_DOWN":
            rows, k = t.arg("rows"), spec.moe.intermediate
            assert t.weight_bytes == rows * k + fp8.scale_bytes(fmt, rows, k), t.name
    total = {n: sum(t.weight_bytes for t in p.tasks if t.op.name != "EMBED") for n, p in (("bf16", bf), ("fp8", q))}
    routers = sum(t.weight_bytes for t in bf.tasks if "router" in t.name)
    # half, plus the scales: 4 bytes per row of 128 to 256 columns here (3.7% more), or per 128 x 128 block (0.1%)
    assert total["fp8"] - routers == pytest.approx((total["bf16"] - routers) / 2, rel=0.04)


def test_fp8_tile_order():
    """The documented position of a lane's 16 bytes (templates/gemv.cuh), and the round trip."""
    w = torch.arange(2 * 32 * 192).reshape(2, 32, 192)
    t = to_tiles_fp8(w)
    assert torch.equal(from_tiles_fp8(t), w)
    m, flat = w[1], t[1].flatten()
    # group 1, block kb = 2 (of 3), row half 1, lane 13 (g 3, q 1)
    at = (1 * 3 + 2) * 1024 + 512 + 13 * 16
    assert flat[at:at + 16].tolist() == m[16 + 3 + 8, 128 + 8:128 + 16].tolist() + m[27, 160 + 8:160 + 16].tolist()
    q = torch.randn(16, 64).to(torch.float8_e4m3fn)
    assert torch.equal(from_tiles_fp8(to_tiles_fp8(q.view(torch.uint8))), q.view(torch.uint8))


@pytest.mark.parametrize("fmt", ["fp8", "fp8-block"])
def test_dequantise_matches_quantiser(fmt):
    """fp8.dequantize reads both scale layouts back as runtime/quantize.py wrote them (ragged
    blocks included) to within e4m3's rounding (relative 2^-4 of each block's largest value)."""
    w = torch.randn(3, 200, 320)
    sc = schedule(lower(load_spec(CONFIGS / "tiny.yaml"), 1, 32, 8), "tiny")
    buffers = {"m": dataclasses.replace(next(iter(sc.buffers.values())), name="m", shape=(3, 200, 320),
                                        dtype="fp8", kind="weight")}
    q = fp8_weights({"m": w}, buffers, fmt)
    assert tuple(q["m.scale"].shape) == fp8.scale_shape(fmt, (3, 200, 320))
    back = fp8.given("m", (3, 200, 320), fmt, q)
    assert float((back - w).abs().max()) <= w.abs().max() / 16


@pytest.mark.parametrize("breakage, message", [
    (lambda w: w.pop("L0.w_qkv.scale"), "weight L0.w_qkv.scale is missing"),
    (lambda w: w.__setitem__("L0.w_o.scale", w["L0.w_o.scale"][:-1]), "weight L0.w_o.scale is torch.float32"),
    (lambda w: w.__setitem__("L1.w_experts_down.scale", -w["L1.w_experts_down.scale"]), "not finite and positive"),
    (lambda w: w.__setitem__("lm_head", w["lm_head"].float()), "weight lm_head is torch.float32"),
])
def test_bad_fp8_tensors_name_the_tensor(breakage, message):
    spec = load_spec(CONFIGS / "tiny.yaml")
    sc = schedule(lower(spec, 1, 32, 8, weights="fp8"), spec.name)
    w = fp8_weights(random_weights(spec, seed=7, dtype=torch.float32, std=0.1), sc.buffers, "fp8")
    breakage(w)
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        CpuExecutor(sc, spec, w)


def test_weight_format_is_checked():
    spec = load_spec(CONFIGS / "tiny.yaml")
    with pytest.raises(SpecError, match="--weights int4: expected one of bf16, fp8, fp8-block"):
        lower(spec, 1, 32, 8, weights="int4")
    with pytest.raises(SpecError, match="fused_experts with --weights fp8"):
        lower(spec, 1, 32, 8, weights="fp8", fused_experts=True, residual_in_o_proj=True)


def test_plan_records_the_weight_format():
    spec = load_spec(CONFIGS / "tiny.yaml")
    sc = plan(spec, 1, 32, 8, weights="fp8-block")
    assert sc.meta["weights"] == "fp8-block"
    assert sc.buffers["L0.w_qkv"].dtype == "fp8" and sc.buffers["embed"].dtype == "bf16"


def test_cpu_backend_with_fp8_weights_serves_what_the_executor_decodes():
    """mkc serve --backend cpu --weights fp8: the prefill (over the dequantised weights, its own FP8
    head included) writes the cache token-by-token decoding writes, and the engine generates the
    executor's greedy tokens on the same FP8 weights."""
    from conftest import check_prefill_matches_decode, max_err, run_engine

    from mkc.runtime.backends import CpuBackend
    from mkc.runtime.engine import Engine
    from mkc.runtime.sampling import SamplingParams
    from mkc.runtime.tokenizer import ByteTokenizer

    spec = load_spec(CONFIGS / "qwen3_tiny.yaml")  # a tied embedding: the FP8 head is its own copy
    w = random_weights(spec, seed=7, dtype=torch.float32, std=0.1)
    be = CpuBackend(spec, w, max_batch=4, context=64, weights_format="fp8")
    check_prefill_matches_decode(be, 1e-5, max_err)
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6, 5, 3, 5, 8, 9]]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    engine = Engine(CpuBackend(spec, w, max_batch=2, context=64, weights_format="fp8"), ByteTokenizer(spec.vocab_size))
    got = [[t for o in out for t in o.token_ids] for out in run_engine(engine, prompts, params, max_steps=200)]
    want = [greedy_generate(spec, w, p, 8, context=64, weights_format="fp8") for p in prompts]
    assert got == want


def _oracle_checkpoint(family: str, folder: Path) -> Path:
    transformers = pytest.importorskip("transformers")
    from conftest import save_checkpoint

    if family == "cohere2_moe":
        from test_transformers_oracle import _hf_config

        if not hasattr(transformers, "Cohere2MoeForCausalLM"):
            pytest.skip(f"transformers {transformers.__version__} has no Cohere2MoeForCausalLM")
        torch.manual_seed(2026)
        save_checkpoint(transformers.Cohere2MoeForCausalLM(_hf_config()), folder)
        return folder
    from test_families import build_checkpoint

    return build_checkpoint(family, folder)


@torch.no_grad()
def _dequantised_hf_model(folder: Path):
    """transformers' model of the checkpoint with every matrix mkc stores in FP8 (per output row)
    replaced by its dequantised FP8 value: the attention, MLP and expert projections, and the LM
    head (a tied one untied first, as mkc's FP8 head is a copy of the embedding)."""
    import transformers

    from mkc.runtime.quantize import _QUANTIZED, quantize_weight
    from mkc.runtime.weights import Fp8Format

    channel = Fp8Format("compressed-tensors", "channel", None, "_scale")
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    if model.config.tie_word_embeddings:
        model.lm_head.weight = torch.nn.Parameter(model.get_input_embeddings().weight.detach().clone())
    done = 0
    for name, p in model.named_parameters():
        if _QUANTIZED.match(name) or name == "lm_head.weight":
            q, s = quantize_weight(p.detach(), channel)
            p.copy_(fp8.dequantize(q, s))
            done += 1
    assert done and model.lm_head.weight.data_ptr() != model.get_input_embeddings().weight.data_ptr()
    return model


@pytest.mark.parametrize("family", ["cohere2_moe", "qwen3_moe"])
def test_fp8_greedy_tokens_match_transformers_on_dequantised_weights(family, tmp_path):
    """The oracle: transformers on the dequantised FP8 weights and the CPU executor on the FP8
    weights themselves (quantised by mkc from the float32 checkpoint, per output row) decode the
    same greedy tokens."""
    from mkc.runtime.weights import load_checkpoint

    folder = _oracle_checkpoint(family, tmp_path / family)
    spec = load_spec(folder)
    weights = load_checkpoint(folder, spec, torch.float32)
    model = _dequantised_hf_model(folder)
    g = torch.Generator().manual_seed(11)
    for n in (4, 13):
        prompt = torch.randint(0, spec.vocab_size, (n,), generator=g).tolist()
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(10):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        got = greedy_generate(spec, weights, prompt, 10, context=64, weights_format="fp8")
        assert got == ids[n:], f"{family}, prompt of {n}: mkc {got} vs transformers {ids[n:]}"


@pytest.mark.parametrize("fmt", ["fp8", "fp8-block"])
def test_fp8_kernel_builds_with_the_dequantisation_in_registers(fmt, tmp_path):
    """The tiny model's FP8 kernel compiles for sm_90a with no local memory; its GEMVs turn e4m3
    into bf16 with byte permutes and bf16x2 multiplies (HMUL2), not the conversion unit, and
    keep the bf16 tensor-core MMAs; the descriptors name the FP8 matrices."""
    pytest.importorskip("cuda.bindings.nvrtc", reason="NVRTC (cuda-bindings) is not installed")
    from mkc.codegen import build_kernel
    from mkc.codegen.sass import disassemble, local_memory_ops, opcode_counts
    from mkc.codegen.taskwords import DTYPE_CODES, buffer_table, encode
    from mkc.codegen.weight_tiles import tiled_weights

    spec = load_spec(CONFIGS / "tiny.yaml")
    sc = plan(spec, 2, 32, 8, weights=fmt)
    art = build_kernel(sc, spec, cache_dir=tmp_path)
    assert f"WEIGHT_FORMAT = {1 if fmt == 'fp8' else 2};" in art.cu_source
    sass = disassemble(art.cubin)
    assert not local_memory_ops(sass) and art.spills == 0
    ops = opcode_counts(sass)
    assert ops.get("HMUL2", 0) > 0 and ops.get("PRMT", 0) > 0 and ops.get("HMMA", 0) > 0, ops
    words = encode(sc)
    table = buffer_table(sc, words.buffer_names, {n: 0 for n in words.buffer_names}, tiled_weights(sc))
    codes = dict(zip(words.buffer_names, table["dtype"].tolist()))
    assert codes["L0.w_qkv"] == DTYPE_CODES["fp8_tiles"] and codes["L1.w_router"] == DTYPE_CODES["bf16_tiles"]


def test_fp8_kernel_with_expert_down_split_along_k_builds(tmp_path):
    """The split expert-down op (EXPERT_DOWN_SPLIT, as Mixtral-8x7B's experts need) compiles on FP8
    block-scaled weights with no spills; a reduction off the 64-column blocks is still refused for
    FP8, in one line. At 246-248 registers ptxas keeps a few kernel-wide values in a stack frame
    (24 bytes, reloaded from L1) instead: bounded here, a cost of FP8 kernels with the split only."""
    pytest.importorskip("cuda.bindings.nvrtc", reason="NVRTC (cuda-bindings) is not installed")
    from mkc.codegen import CodegenError, build_kernel
    from mkc.codegen.render import kernel_config
    from mkc.codegen.sass import instructions_by_op

    spec = load_spec(CONFIGS / "qwen3_moe_tiny.yaml")
    spec = dataclasses.replace(spec, moe=dataclasses.replace(spec.moe, intermediate=256))
    sc = schedule(lower(spec, 2, 32, 8, weights="fp8-block", max_gemv_k=64), spec.name)
    art = build_kernel(sc, spec, cache_dir=tmp_path)
    assert art.config.expert_down_split and art.config.weight_format == "fp8-block"
    frame = re.search(r"(\d+) bytes stack frame", art.log.split("Function properties for mkc_decode")[1])
    assert art.spills == 0 and int(frame.group(1)) <= 32, art.log
    assert instructions_by_op(art.cubin, art.cu_source).get("EXPERT_DOWN_SPLIT", 0) > 500
    odd = dataclasses.replace(spec, moe=dataclasses.replace(spec.moe, intermediate=160))
    with pytest.raises(CodegenError, match="a reduction off the 64-column blocks reads bf16 weights only"):
        kernel_config(schedule(lower(odd, 2, 32, 8, weights="fp8"), odd.name), odd)


def test_fp8_needs_tile_order():
    from mkc.codegen import CodegenError, CodegenOptions
    from mkc.codegen.render import kernel_config

    spec = load_spec(CONFIGS / "tiny.yaml")
    sc = plan(spec, 1, 32, 8, weights="fp8")
    with pytest.raises(CodegenError, match="FP8 weights are read in tile order only"):
        kernel_config(sc, spec, CodegenOptions(weight_layout="rows"))


def test_a_model_too_big_for_the_gpu_says_so_in_one_line():
    """mkc generate --backend cuda (and bench, serve) check the memory before loading anything:
    Mixtral-8x7B in bf16 does not fit an 80 GB H100 and the line names what it needs and what is
    free; in FP8 its weights fit. North Mini Code at batch 8 and 32K fits in FP8, not in bf16."""
    from mkc.ir.fp8 import stored_bytes
    from mkc.runtime.generate import gpu_memory_problem
    from mkc.runtime.weights import weight_shapes

    free, gpu = 79_000_000_000, "NVIDIA H100 80GB HBM3"
    mixtral = load_spec(CONFIGS / "mixtral_8x7b.yaml")
    line = gpu_memory_problem(mixtral, 1, 8192, "bf16", free, gpu)
    assert line is not None and "\n" not in line
    assert line.startswith("mixtral_8x7b needs 95.") and "weights 93.4 GB in bf16" in line and "79.0 GB are free" in line
    assert gpu_memory_problem(mixtral, 1, 8192, "fp8", free, gpu) is None
    nmc = load_spec(CONFIGS / "north_mini_code.yaml")
    assert gpu_memory_problem(nmc, 8, 32768, "bf16", free, gpu) is not None
    assert gpu_memory_problem(nmc, 8, 32768, "fp8", free, gpu) is None
    shapes = weight_shapes(nmc)
    bf16, q = stored_bytes(shapes, "bf16", nmc.tie_word_embeddings), stored_bytes(shapes, "fp8", True)
    assert 0.5 < q / bf16 < 0.53  # the matrices halve; embeddings, norms, routers and the FP8 head copy


def test_the_kernels_e4m3_to_bf16_bit_placement_is_exact():
    """templates/common.cuh: e4m3x4_to_bf16 places an e4m3 byte's sign, exponent and mantissa into
    bf16 bits ((b & 0x80) << 8 | (b & 0x7f) << 4) and multiplies by 2^120: for every finite e4m3
    value (subnormals and zeros included) that is the value itself, so the kernel's products are
    those of the dequantised weights. Checked here on the bits, as the kernel forms them: the byte
    permutes, masks, shift and bf16x2 multiplier are read from the template and replayed on every
    byte in each of the four positions of a word."""
    import numpy as np

    from mkc.codegen.render import TEMPLATE_DIR

    src = (TEMPLATE_DIR / "common.cuh").read_text()
    body = re.search(r"void e4m3x4_to_bf16\(u32 w, u32& lo, u32& hi\) \{(.*?)\n\}", src, re.DOTALL).group(1)
    perm = dict(re.findall(r"(p[01]) = __byte_perm\(w, 0u, (0x[0-9a-f]+)\)", body))
    place = re.findall(r"(lo|hi) = \((p[01]) & (0x[0-9a-f]+)u\) \| \(\((p[01]) >> (\d+)\) & (0x[0-9a-f]+)u\);", body)
    scale = re.findall(r'"\+r"\((lo|hi)\) : "r"\((0x[0-9a-f]+)u\)', body)
    assert set(perm) == {"p0", "p1"} and len(place) == len(scale) == 2, body

    def byte_perm(x: np.ndarray, selector: int) -> np.ndarray:  # __byte_perm(x, 0u, selector)
        out = np.zeros_like(x)
        for i in range(4):
            k = (selector >> 4 * i) & 7
            if k < 4:
                out |= ((x >> np.uint32(8 * k)) & np.uint32(0xFF)) << np.uint32(8 * i)
        return out

    def bf16(bits: np.ndarray) -> torch.Tensor:
        return torch.from_numpy((bits & np.uint32(0xFFFF)).astype(np.uint16).view(np.int16)).view(torch.bfloat16)

    b = np.arange(256, dtype=np.uint32)
    elements = [b, b ^ 0x5A, b ^ 0xA5, 255 - b]  # every byte in every position of the word
    w = elements[0] | elements[1] << np.uint32(8) | elements[2] << np.uint32(16) | elements[3] << np.uint32(24)
    p = {name: byte_perm(w, int(sel, 16)) for name, sel in perm.items()}
    words = {dst: (p[a] & np.uint32(int(m1, 16))) | ((p[b_] >> np.uint32(int(sh))) & np.uint32(int(m2, 16)))
             for dst, a, m1, b_, sh, m2 in place}
    c = dict(scale)
    for i, (dst, half) in enumerate((("lo", 0), ("lo", 16), ("hi", 0), ("hi", 16))):
        placed = bf16(words[dst] >> np.uint32(half))
        value = (placed * bf16(np.full(256, int(c[dst], 16) >> half, dtype=np.uint32))).double()  # mul.rn.bf16x2
        byte = torch.from_numpy(elements[i].astype(np.uint8))
        want = byte.view(torch.float8_e4m3fn).double()
        finite = (byte & 0x7F) != 0x7F  # e4m3fn's NaNs: 0x7f, 0xff
        assert torch.equal(value[finite], want[finite]), f"element {i} of the word"
        assert int((want[finite].abs() < 2.0 ** -6).sum()) == 16  # the 14 subnormals and both zeros covered


@pytest.mark.parametrize("config", ["north_mini_code.yaml", "qwen3_0_6b.yaml", "qwen3_tiny.yaml", "mixtral_tiny.yaml"])
def test_fp8_matrices_are_the_lowerings_fp8_buffers(config):
    """The runtime names the FP8 matrices without lowering (mkc/ir/fp8.py: fp8_matrices, used to
    quantise weights as they are made): exactly the fp8 buffers of the lowering, a tied model's
    FP8 head included."""
    from mkc.runtime.weights import weight_shapes

    spec = load_spec(CONFIGS / config)
    lowered = {n for n, b in lower(spec, 1, 64, 8, weights="fp8").buffers.items() if b.dtype == "fp8"}
    assert set(fp8.fp8_matrices(weight_shapes(spec), spec.tie_word_embeddings)) == lowered
