"""Codegen without a GPU: the kernel renders from the Opcode table, compiles with NVRTC to sm_90a,
has no local-memory traffic (no LDL/STL in SASS: no spills, no stack arrays) and runs its GEMVs on
the tensor cores; the cache is content-addressed; errors carry what a person needs."""

from __future__ import annotations

import dataclasses
import re
import subprocess
from functools import cache as cache_fn
from pathlib import Path

import jinja2
import numpy as np
import pytest
from conftest import ROOT, load_benchmark

from mkc.codegen import CodegenOptions, CompileError, build_kernel, write_kernel
from mkc.codegen import cvalues as cv
from mkc.codegen.nvrtc import compile_cubin, parse_resources
from mkc.codegen.render import (
    MAX_SMEM_BYTES,
    TEMPLATE_DIR,
    CodegenError,
    environment,
    kernel_config,
    render_source,
    template_context,
)
from mkc.codegen.sass import (
    KERNEL_LOOP,
    disassemble,
    find_cuobjdump,
    function_name,
    instruction_lines,
    instruction_owners,
    instructions_by_op,
    local_memory_ops,
    opcode_counts,
)
from mkc.codegen.taskwords import (
    BUF_DESC,
    DTYPE_CODES,
    INLINE_WAITS,
    MAX_OPERANDS,
    RECORD_WORDS,
    W_ARGS,
    W_ID,
    W_OP,
    W_OPERANDS,
    W_SIGNAL,
    W_WAIT_CNT,
    W_WAIT_OFF,
    W_WAITS,
    W_WARM,
    EncodeError,
    buffer_table,
    encode,
    l2_warm_hints,
    record_descriptors,
    routing_logits,
    tagged_words,
)
from mkc.codegen.weight_tiles import padded_weights
from mkc.ir.lower import lower
from mkc.ir.ops import OP_INFO, Opcode
from mkc.ir.spec import load_spec
from mkc.schedule.schedule import routing_edge
from mkc.schedule.scheduler import schedule

TINY = ROOT / "configs" / "tiny.yaml"
NMC = ROOT / "configs" / "north_mini_code.yaml"

pytest.importorskip("cuda.bindings.nvrtc", reason="NVRTC (cuda-bindings) is not installed")


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("mkc-cache")


@pytest.fixture(scope="module")
def tiny():
    spec = load_spec(TINY)
    return spec, schedule(lower(spec, 2, 16, 8), spec.name)


@pytest.mark.parametrize("batch", [1, 8])
def test_nmc_kernel_compiles_without_local_memory(cache, batch):
    """North Mini Code, context 8192, 132 SMs: a cubin with no LDL/STL, HMMA for the GEMVs, and
    the cp.async and bulk-prefetch instructions the templates use."""
    spec = load_spec(NMC)
    sc = schedule(lower(spec, batch, 8192, 132), spec.name)
    art = build_kernel(sc, spec, cache_dir=cache)
    assert re.fullmatch(rf"north_mini_code-b{batch}-sm90a-[0-9a-f]{{8}}", art.name), art.name
    assert art.spills == 0, f"{art.name}: ptxas reports {art.spills} bytes of spills\n{art.log}"
    assert art.regs > 0 and art.dynamic_smem > 0
    tool = find_cuobjdump()
    assert tool, "cuobjdump not found: install nvidia-cuda-cuobjdump (the 'cuda' extra) or set CUDA_HOME"
    sass = disassemble(art.cubin, tool)
    local = local_memory_ops(sass)
    assert not local, f"{art.name}: {len(local)} local-memory instructions, e.g.\n" + "\n".join(local[:10])
    ops = opcode_counts(sass)
    assert ops["HMMA"] > 0, "the GEMV tiles should run on the tensor cores (no HMMA in SASS)"
    # the asynchronous copies the templates ask for: cp.async (LDGSTS) for staged activations and
    # the task records, the TMA unit's bulk L2 prefetch (UBLKPF) for the next K/V chunk and weights
    assert ops["LDGSTS"] > 0, "no cp.async (LDGSTS) in SASS"
    assert ops["UBLKPF"] > 0, "no bulk L2 prefetch (cp.async.bulk.prefetch, UBLKPF) in SASS"
    # the routing's arg-max rounds on warp reductions (CodegenOptions.routing_argmax "auto": "redux"
    # at batch 8); at batch 1 its ranks, with no rounds, and the expert tiles' input normalised
    # beside the routing
    assert (ops["REDUX"] > 0) == (batch != 1), f"{ops['REDUX']} redux.sync (REDUX) in SASS at batch {batch}"
    assert art.config.routing_rank == art.config.norm_beside_routing == (batch == 1), art.config
    # the code size by op (sass.instructions_by_op): every instruction counted once, every GEMV op's
    # code found at its dispatch case, the routing's shared function under its own name, and the
    # kernel loop a small remainder (about 4,100 instructions at batch 2-8, 2,500 at batch 1)
    by_op = instructions_by_op(art.cubin, art.cu_source)
    assert sum(by_op.values()) == sum(ops.values()), (sum(by_op.values()), sum(ops.values()))
    assert all(by_op.get(op, 0) > 0 for op in ("LINEAR", "EXPERT_SWIGLU", "EXPERT_DOWN", "LM_HEAD", "ATTN_SPLIT",
                                               "route_tokens")), by_op
    assert by_op["TOPK"] < by_op["route_tokens"], by_op  # the routing task calls the shared copy
    assert by_op[KERNEL_LOOP] < 0.2 * sum(by_op.values()), by_op


# The kernels benchmarks/kernel_variants.py measures against the default, by its names ("+" joins
# those built as one kernel): the batches CI compiles each at, and its CodegenOptions fields. To keep
# CI short, options off by default compile together where that fits the registers (each alone
# compiled without spills on the device's runs). Not compiled here: the CTA-chunk attention at
# batch 8 (its batch-1 kernel is).
CODEGEN_VARIANTS: dict[str, tuple[tuple[int, ...], dict]] = {
    # attention splits in CTA-wide chunks; expert-up tiles wait for the router's counter; a normed
    # GEMV reuses the input staged before it; the routing's arg-max rounds with the expert tiles'
    # input normalised after them (batch 1's default before)
    "attn-cta+counter-logits+norm-reuse+redux-after": ((1,), {
        "attn_warp_stages": 0, "tagged_logits": "off", "reuse_staged_norm": True, "routing_argmax": "redux",
        "norm_beside_routing": "off"}),
    # warp splits with three ring stages; the routing's picks ranked at once, the input normalised
    # after them (batch 1's default normalises beside them)
    "attn-warps-3+rank-after": ((1,), {"attn_warp_stages": 3, "routing_argmax": "rank",
                                       "norm_beside_routing": "off"}),
    # ... at batch 8, with the expert-up tiles reading tagged logits (off by default at 8) and an
    # expert gate/up tile's input normalised by warps 1.. during the routing's rounds
    "attn-warps-3+tagged-logits+norm-beside-routing": ((8,), {"attn_warp_stages": 3, "tagged_logits": "on",
                                                              "norm_beside_routing": "on"}),
    "rank-after": ((8,), {"routing_argmax": "rank", "norm_beside_routing": "off"}),  # the ranks at batch 8
    "profile-phases": ((1,), {"profile_phases": True}),  # the phase-marking profile kernel
    # the default at batch 4: the O-projection warmed in L2 by the expert gate/up tiles, evict-first
    # streams (l2_warm and weights_evict_first "auto", on at batch 2-4)
    "default": ((4,), {}),
}


@cache_fn
def _nmc_schedule(batch: int):
    spec = load_spec(NMC)
    return spec, schedule(lower(spec, batch, 8192, 132), spec.name)


@pytest.mark.parametrize(("batch", "variant"), [(b, name) for name, (bs, _) in CODEGEN_VARIANTS.items() for b in bs])
def test_codegen_variant_compiles_without_local_memory(cache, batch, variant):
    """The kernels benchmarks/kernel_variants.py measures against the default must compile cleanly
    too (one test each, so pytest-xdist spreads the compiles over the workers), and each shows
    what it asks for: the ranked routing without redux.sync, the three ring stages' dynamic shared
    memory as render.py sizes it."""
    from mkc.codegen import CodegenOptions

    spec, sc = _nmc_schedule(batch)
    options = CodegenOptions(**CODEGEN_VARIANTS[variant][1])
    art = build_kernel(sc, spec, options, cache_dir=cache)
    assert art.spills == 0, f"{options}: ptxas reports {art.spills} bytes of spills\n{art.log}"
    sass = disassemble(art.cubin)
    assert not local_memory_ops(sass), options
    if art.config.routing_rank:  # no arg-max rounds: the routing's only redux.sync is gone
        assert "REDUX" not in sass, options
    assert art.config.routing_rank == (options.routing_argmax == "rank" or (options.routing_argmax == "auto"
                                                                           and batch == 1)), art.config
    assert art.config.norm_beside_routing == (options.norm_beside_routing == "on" or (
        options.norm_beside_routing == "auto" and batch == 1)), art.config
    if options.attn_warp_stages == 3:  # 8 warps x 3 blocks x (16 keys x 128 dims of K and V) in flight
        assert art.dynamic_smem == kernel_config(sc, spec, options).smem_bytes
        assert art.dynamic_smem >= 8 * 3 * 16 * 128 * 2 * 2
    assert art.config.tagged_logits == (options.tagged_logits == "on" or (options.tagged_logits == "auto"
                                                                          and batch <= 4))
    assert (art.config.l2_warm != "off") == art.config.weights_evict_first == (batch in (2, 3, 4)), art.config


def test_residual_in_o_proj_kernel_compiles_without_local_memory(cache):
    """North Mini Code at batch 8 with the residual added by the O-projection (LowerOptions.
    residual_in_o_proj): its reduction over every head (4096) sizes the staged activations, its
    residual terms (the stream and all 64 routing slots of its rows) the scratch, and the kernel
    compiles without local memory, the terms' adds inlined into the LINEAR GEMV or, asked for, out
    of line."""
    spec = load_spec(NMC)
    sc = schedule(lower(spec, 8, 8192, 132, residual_in_o_proj=True), spec.name)
    ends = [t for t in sc.tasks if t.op == Opcode.LINEAR and t.operand("residual") != "-"]
    cfg = kernel_config(sc, spec)
    assert cfg.gemv_max_k == 4096
    assert cfg.residual_stage_bytes == (1 + 64) * 8 * max(t.arg("rows") for t in ends) * 4
    art = build_kernel(sc, spec, cache_dir=cache)
    assert art.spills == 0, f"ptxas reports {art.spills} bytes of spills\n{art.log}"
    assert not local_memory_ops(disassemble(art.cubin))
    # the epilogue's adds inlined into the LINEAR GEMV ("auto": the schedule has such tiles), or
    # one out-of-line function
    assert art.config.residual_epilogue_inline
    assert "store_with_residual" not in instructions_by_op(art.cubin, art.cu_source)
    call = build_kernel(sc, spec, CodegenOptions(residual_epilogue="call"), cache_dir=cache)
    assert call.spills == 0 and not call.config.residual_epilogue_inline
    assert instructions_by_op(call.cubin, call.cu_source).get("store_with_residual", 0) > 0
    with pytest.raises(CodegenError, match="residual_epilogue"):
        kernel_config(sc, spec, CodegenOptions(residual_epilogue="outline"))
    # without tiles that end a layer "auto" keeps the call (the kernel's code as before)
    spec8, plain = _nmc_schedule(8)
    assert not kernel_config(plain, spec8).residual_epilogue_inline


def test_fused_experts_kernel_compiles_without_local_memory(cache):
    """North Mini Code at batch 1 with fused expert tiles (LowerOptions.fused_experts, off: measured
    slower): the kernel compiles the fused op for the tiles' one size (FUSED_DOWN_BLOCKS = rows / 64:
    1 at batch 1, 64-row tiles) without spills or local memory, the O-projection stages every
    part of every slot, and the routing's first wait is the router tiles' (tagged at batch 1). A
    kernel without fused tiles compiles the op to nothing."""
    spec = load_spec(NMC)
    for batch, blocks in ((1, 1),):  # batch 8 (6 blocks, 384-row tiles) compiled on the device's runs
        sc = schedule(lower(spec, batch, 8192, 132, attention_sms=32, residual_in_o_proj=True, fused_experts=True),
                      spec.name)
        fused = [t for t in sc.tasks if t.op == Opcode.EXPERT_MLP]
        cfg = kernel_config(sc, spec)
        assert cfg.fused_down_blocks == blocks and {t.arg("rows") for t in fused} == {64 * blocks}
        parts = spec.moe.intermediate // (64 * blocks)
        assert sc.buffers["L1.moe_out"].shape == (min(128, 8 * batch) * parts, batch, spec.hidden_size)
        art = build_kernel(sc, spec, cache_dir=cache)
        assert art.spills == 0, f"ptxas reports {art.spills} bytes of spills\n{art.log}"
        assert not local_memory_ops(disassemble(art.cubin))
        assert instructions_by_op(art.cubin, art.cu_source).get("EXPERT_MLP", 0) > 500
        words = encode(sc)
        t = fused[0]
        rec = next(r for r in words.records if r[W_ID] == t.id)
        assert all(routing_edge(sc.tasks[p], t) for p in sc.counters[words.waits[rec[W_WAIT_OFF]][0]].producers)
    spec1, plain = _nmc_schedule(1)
    assert kernel_config(plain, spec1).fused_down_blocks == 0


def _odd_moe():
    """A tiny Qwen3-MoE whose reductions are not whole 64-column blocks (hidden size 96, 3 heads of
    32, intermediates 160) and whose LM head is the embedding."""
    spec = load_spec(ROOT / "configs" / "qwen3_moe_tiny.yaml")
    att = dataclasses.replace(spec.attention, num_heads=3, num_kv_heads=3, head_dim=32)
    return dataclasses.replace(spec, hidden_size=96, dense_intermediate=160, attention=att, tie_word_embeddings=True,
                               moe=dataclasses.replace(spec.moe, intermediate=160))


def test_k_split_and_padded_k_kernel_compiles_without_local_memory(cache):
    """A model whose reductions are not whole 64-column blocks, with its down projections split
    along k (max_gemv_k = 64: 64 + 64 + 32 columns, as Mixtral-8x7B's experts split at k = 14336):
    the kernel pads the staged inputs (K_PADDED) and compiles the split expert op (EXPERT_DOWN_SPLIT);
    each split tile waits for the router tiles first; a kernel without either (North Mini Code)
    compiles neither. At 255 registers the padding tips ptxas into a spill of a few registers (24
    bytes; a split alone, as Mixtral-8x7B's, has none): bounded here, a cost of odd shapes only."""
    spec = _odd_moe()
    sc = schedule(lower(spec, 2, 64, 8, max_gemv_k=64), spec.name)
    split = [t for t in sc.tasks if t.op == Opcode.EXPERT_DOWN_SPLIT]
    assert {(t.arg("k0"), t.arg("k")) for t in split} == {(0, 64), (64, 64), (128, 32)}
    assert {n: k for n, (_, k) in padded_weights(sc).items()} == {
        "L0.w_down": 160, "L0.w_o": 96, "L0.w_qkv": 96, "L0.w_gate_up": 96, "L1.w_experts_down": 160,
        "L1.w_experts_gate_up": 96, "L1.w_o": 96, "L1.w_qkv": 96, "L1.w_router": 96, "L2.w_experts_down": 160,
        "L2.w_experts_gate_up": 96, "L2.w_o": 96, "L2.w_qkv": 96, "L2.w_router": 96, "embed": 96}
    art = build_kernel(sc, spec, cache_dir=cache)
    assert art.config.expert_down_split and art.config.k_padded and art.config.gemv_max_k == 128
    assert art.spills <= 64, f"ptxas reports {art.spills} bytes of spills\n{art.log}"
    assert instructions_by_op(art.cubin, art.cu_source).get("EXPERT_DOWN_SPLIT", 0) > 500
    words = encode(sc)
    rec = next(r for r in words.records if r[W_ID] == split[0].id)
    router = sc.counters[words.waits[rec[W_WAIT_OFF]][0]].producers
    assert all(sc.tasks[p].operand("out") == split[0].operand("logits") for p in router)
    spec1, plain = _nmc_schedule(1)
    cfg = kernel_config(plain, spec1)
    assert not cfg.expert_down_split and not cfg.k_padded


def test_a_residual_tile_off_the_copy_grain_is_refused(tiny):
    """The residual terms are copied 16 bytes at a time: a tile whose columns do not start on 4
    floats gets a CodegenError naming it, not a misaligned copy."""
    import dataclasses

    spec, _ = tiny
    sc = schedule(lower(spec, 2, 16, 8, residual_in_o_proj=True), spec.name)
    t = next(t for t in sc.tasks if t.op == Opcode.LINEAR and t.operand("residual") != "-")
    col0 = OP_INFO[Opcode.LINEAR].args.index("col0")
    sc.tasks[t.id] = dataclasses.replace(t, args=tuple(v + 2 if i == col0 else v for i, v in enumerate(t.args)))
    with pytest.raises(CodegenError, match=rf"task {t.id} \({re.escape(t.name)}\): residual terms .* multiples of 4"):
        kernel_config(sc, spec)


def test_warp_split_rings_fit_the_shared_memory(nmc, tiny):
    """CodegenOptions.attn_warp_stages is lowered to the rings that fit beside the rest of the
    attention's shared memory (8 warps x 8 KB per stage at head_dim 128: three fit, four do not),
    and is 0 (the CTA-wide chunks) for heads the tensor-core Q.K cannot take (head_dim 32)."""
    from mkc.codegen import CodegenOptions

    sc = schedule(lower(nmc, 1, 8192, 132), nmc.name)
    for asked, fitted in ((0, 0), (2, 2), (3, 3), (10, 3)):
        cfg = kernel_config(sc, nmc, CodegenOptions(attn_warp_stages=asked))
        assert cfg.attn_warp_stages == fitted, (asked, cfg.attn_warp_stages)
        assert cfg.smem_bytes <= MAX_SMEM_BYTES
        if fitted:
            assert cfg.smem_bytes >= cfg.attn_ring_offset + 8 * fitted * 32 * 16 * 16
    spec, tsc = tiny
    assert kernel_config(tsc, spec, CodegenOptions(attn_warp_stages=2)).attn_warp_stages == 0


def test_combine_shared_memory_holds_more_splits_than_sms():
    """LowerOptions.global_attention_sms beyond one wave: a global layer's combine merges more
    splits than there are SMs (the tiny model's 2 KV heads at 4 waves of 16 SMs: 32 per KV head),
    and the kernel's shared memory is sized for them, not for num_sms."""
    spec = load_spec(ROOT / "configs" / "tiny.yaml")
    sc = schedule(lower(spec, 1, 16384, 16, global_attention_sms=64), spec.name)
    most = max(t.arg("splits") for t in sc.tasks if t.op == Opcode.ATTN_COMBINE)
    assert most == 32
    cfg = kernel_config(sc, spec)
    assert cfg.max_splits == most
    assert cfg.smem_bytes >= cfg.batch * cfg.group * most * 4


def test_rendered_enum_and_dispatch_match_opcode(tiny):
    spec, sc = tiny
    src = render_source(kernel_config(sc, spec), "test")
    enum = dict(re.findall(r"^\s*OP_([A-Z_]+) = (\d+),$", src, flags=re.MULTILINE))
    assert enum == {op.name: str(int(op)) for op in Opcode}
    for op in Opcode:
        assert f"case OP_{op.name}: op_{op.name.lower()}(t, smem); break;" in src
        roles = " ".join(f"static constexpr int {r} = {i};" for i, r in enumerate(OP_INFO[op].operands))
        assert f"struct OPND_{op.name} {{ {roles}" in src


def test_render_with_a_missing_variable_fails(tiny):
    spec, sc = tiny
    ctx = template_context(kernel_config(sc, spec), "test")
    del ctx["head_dim"]
    with pytest.raises(jinja2.UndefinedError, match="head_dim"):
        environment().get_template("kernel.cu.j2").render(**ctx)


def test_templates_are_found():
    assert (TEMPLATE_DIR / "kernel.cu.j2").is_file()
    assert {p.name for p in TEMPLATE_DIR.glob("*.cuh")} >= {"common.cuh", "gemv.cuh", "attention.cuh", "ops.cuh"}


def test_cache_hit_and_files(tiny, tmp_path, monkeypatch):
    spec, sc = tiny
    monkeypatch.setenv("MKC_CACHE_DIR", str(tmp_path / "c"))
    a = build_kernel(sc, spec)
    entry = tmp_path / "c" / "kernels" / a.name
    assert {p.name for p in entry.iterdir()} == {"kernel.cu", "kernel.cubin", "kernel.json"}
    # served from the cache: NVRTC does not run again (an equal cubin alone would not show it: the
    # compile is deterministic)
    monkeypatch.setattr("mkc.codegen.nvrtc.compile_cubin", lambda *a, **kw: pytest.fail("compiled again"))
    b = build_kernel(sc, spec)
    assert b.name == a.name and b.cubin == a.cubin and b.regs == a.regs
    # the context bucket is data, not code: another context reuses the binary
    c = build_kernel(schedule(lower(spec, 2, 40, 8), spec.name), spec)
    assert c.name == a.name
    monkeypatch.setattr("mkc.codegen.nvrtc.compile_cubin", compile_cubin)  # another batch: compiled
    # another batch is another binary
    d = build_kernel(schedule(lower(spec, 3, 16, 8), spec.name), spec)
    assert d.name != a.name and "-b3-" in d.name
    files = write_kernel(sc, spec, tmp_path / "out")
    assert set(files) == {"kernel.cu", "kernel.cubin", "kernel.json"}
    assert files["kernel.cubin"].read_bytes() == a.cubin
    assert not list((tmp_path / "c" / "kernels").glob("**/*.tmp"))


def test_stalls_by_op_attributes_ncu_samples_to_ops(tiny, tmp_path, monkeypatch, capsys):
    """benchmarks/stalls_by_op.py: ncu's source page (one row per SASS instruction, in address
    order) summed by the op each instruction belongs to (sass.instruction_owners); a page of another
    kernel (another instruction count) is refused with a message, not a wrong table."""
    import csv
    import sys

    spec, sc = tiny
    monkeypatch.setenv("MKC_CACHE_DIR", str(tmp_path / "c"))
    files = write_kernel(sc, spec, tmp_path / "k")
    cubin = files["kernel.cubin"].read_bytes()
    owners = instruction_owners(cubin, files["kernel.cu"].read_text())
    assert len(owners) == sum(opcode_counts(disassemble(cubin)).values())  # every instruction, per cuobjdump
    first_linear = owners.index("LINEAR")
    page = tmp_path / "page.csv"
    with page.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["Kernel Name", "mkc_decode"])
        w.writerow(["Address", "Source", "Warp Stall Sampling (All Samples)", "stall_no_inst"])
        for i in range(len(owners)):  # 2 samples per instruction, the first LINEAR one stalled on fetch
            w.writerow([hex(16 * i), "NOP", 2, 2 if i == first_linear else 0])
    mod = load_benchmark("stalls_by_op")
    monkeypatch.setattr(sys, "argv", ["stalls_by_op.py", str(tmp_path / "k"), str(page)])
    mod.main()
    out = capsys.readouterr().out
    n_linear = owners.count("LINEAR")
    assert f"{2 * len(owners)} samples" in out
    assert re.search(rf"^LINEAR\s+{2 * n_linear}\s+\S+\s+2\s+{100 / n_linear:.1f}%", out, re.MULTILINE), out
    # --op: the same op's samples by source line; every LINEAR instruction sits on one line's row.
    # The listing of this cubin is nvdisasm's of the owners above: nvdisasm does not run again.
    runs = []
    real_run = subprocess.run
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: runs.append(a) or real_run(*a, **k))
    chains = instruction_lines(cubin)
    assert runs == []
    assert len(chains) == len(owners) and all(chains[i] for i in range(len(owners)) if owners[i] == "LINEAR")
    stalled = " < ".join(chains[first_linear][:1])
    same_line = sum(1 for o, c in zip(owners, chains) if o == "LINEAR" and c[:1] == chains[first_linear][:1])
    monkeypatch.setattr(sys, "argv", ["stalls_by_op.py", str(tmp_path / "k"), str(page), "--op", "LINEAR",
                                      "--depth", "1", "--top", "100000"])
    mod.main()
    out = capsys.readouterr().out.split("LINEAR by source line")[1]
    rows = re.findall(r"^\s+(\d+)\s+(\d+)\s+\S+\s+(\d+)\s+(\S+)$", out, re.MULTILINE)
    assert sum(int(r[1]) for r in rows) == 2 * n_linear and sum(int(r[0]) for r in rows) == n_linear, out
    assert (str(same_line), str(2 * same_line), "2", stalled) in rows, out
    monkeypatch.setattr(sys, "argv", ["stalls_by_op.py", str(tmp_path / "k"), str(page), "--op", "NO_SUCH_OP"])
    with pytest.raises(SystemExit, match="no op 'NO_SUCH_OP' in this kernel"):
        mod.main()
    with page.open("a", newline="") as f:
        csv.writer(f).writerow(["0xffff", "NOP", 1, 0])
    monkeypatch.setattr(sys, "argv", ["stalls_by_op.py", str(tmp_path / "k"), str(page)])
    with pytest.raises(SystemExit, match="expected the samples of this very kernel"):
        mod.main()


def test_compile_error_carries_log_source_and_options(tmp_path):
    opts = ["--gpu-architecture=sm_90a", "-std=c++17"]
    with pytest.raises(CompileError) as e:
        compile_cubin('extern "C" __global__ void k() { undefined_thing(); }', "broken", opts, tmp_path)
    err = e.value
    assert "undefined_thing" in err.log and err.options == opts
    assert err.source_path == tmp_path / "broken.failed.cu" and err.source_path.is_file()
    assert str(err.source_path) in str(err) and "sm_90a" in str(err)


def test_resources_parsed_from_ptxas_log():
    log = ("ptxas info    : Function properties for mkc_decode\n"
           "ptxas         .     16 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads\n"
           "ptxas info    : Used 200 registers, used 1 barriers, 128 bytes smem\n")
    r = parse_resources(log, "mkc_decode")
    assert (r.regs, r.smem, r.stack, r.spills) == (200, 128, 16, 12)


def test_codegen_rejects_shapes_it_cannot_take(tiny):
    import dataclasses


    spec, sc = tiny
    wide = dataclasses.replace(spec, attention=dataclasses.replace(spec.attention, num_heads=64, num_kv_heads=2))
    with pytest.raises(CodegenError, match="query heads per KV head"):
        kernel_config(sc, wide)


def test_variants_compile_without_local_memory(cache):
    """qk-norm, NeoX RoPE and softmax routing with renormalisation (the Qwen3-MoE family) take the
    other branches of the device code: they must compile cleanly too."""
    import dataclasses

    base = load_spec(TINY)
    spec = dataclasses.replace(
        base, name="tiny_variant",
        attention=dataclasses.replace(base.attention, qk_norm=True, rope_style="half"),
        moe=dataclasses.replace(base.moe, scoring="softmax", normalize_top_k=True))
    art = build_kernel(schedule(lower(spec, 4, 32, 16), spec.name), spec, cache_dir=cache)
    assert art.spills == 0
    assert not local_memory_ops(disassemble(art.cubin))


@pytest.mark.parametrize("page_size", [256, 200])
def test_paged_kernel_compiles_without_local_memory(cache, page_size):
    """North Mini Code at batch 4 with a paged KV cache (a page size the attention chunk divides,
    and one it does not): the paged addressing compiles cleanly too."""
    spec = load_spec(NMC)
    sc = schedule(lower(spec, 4, 8192, 132, page_size=page_size), spec.name)
    art = build_kernel(sc, spec, cache_dir=cache)
    assert "#define MKC_PAGED 1" in art.cu_source and f"PAGE_SIZE = {page_size};" in art.cu_source
    assert art.spills == 0
    assert not local_memory_ops(disassemble(art.cubin))


def test_contiguous_kernel_has_no_paging_code(tiny):
    """Without --page-size the rendered source defines no paging at all (attention.cuh's paged
    paths are preprocessed out)."""
    spec, sc = tiny
    src = render_source(kernel_config(sc, spec), "test")
    assert "MKC_PAGED" not in src and "PAGE_SIZE" not in src


def test_task_words_encode_the_schedule(tiny):
    _, sc = tiny
    w = encode(sc)
    assert w.records.shape == (len(sc.tasks), RECORD_WORDS)
    assert w.queue_start[0] == 0 and w.queue_start[-1] == len(sc.tasks)
    assert np.all(np.diff(w.queue_start) >= 0)
    row = 0
    for sm, queue in enumerate(sc.queues):
        assert w.queue_start[sm] == row
        for tid in queue:
            r, t = w.records[row], sc.tasks[tid]
            assert r[W_OP] == int(t.op) and r[W_SIGNAL] == sc.signals[tid]
            waits = [tuple(x) for x in w.waits[r[W_WAIT_OFF]:r[W_WAIT_OFF] + r[W_WAIT_CNT]].tolist()]
            want = [tuple(x) for x in sc.waits[tid]]
            if t.op in (Opcode.EXPERT_DOWN, Opcode.EXPERT_SWIGLU):  # the router tiles' counter first, then the rest
                router = sc.counters[waits[0][0]].producers
                assert {sc.tasks[p].name.split("[")[0].split(".")[-1] for p in router} == {"router"}, t.name
                assert waits[0][1] == len(router) and waits[1:] == [x for x in want if x != waits[0]]
            else:
                assert waits == want
            # the record's own copy of its first INLINE_WAITS waits (the kernel reads those there)
            n_inline = min(len(waits), INLINE_WAITS)
            inline = r[W_WAITS:W_WAITS + 2 * INLINE_WAITS].reshape(-1, 2)
            assert [tuple(x) for x in inline[:n_inline].tolist()] == waits[:n_inline]
            assert not inline[n_inline:].any()
            names = [w.buffer_names[i] if i >= 0 else "-" for i in r[W_OPERANDS:W_OPERANDS + len(t.operands)]]
            assert names == list(t.operands)
            assert list(r[W_ARGS:W_ARGS + len(t.args)]) == list(t.args)
            assert list(r[W_WARM:W_WARM + 3]) == [-1, 0, 0]  # no L2 warm-up hints unless asked
            row += 1


@pytest.mark.parametrize(("rule", "carrier", "target", "shift"), [
    ("o_proj:splits", Opcode.ATTN_SPLIT, "w_o", 0),
    ("o_proj:expert_up", Opcode.EXPERT_SWIGLU, "w_o", 0),
    ("next_router:combine", Opcode.ATTN_COMBINE, "w_router", 1),
    ("next_qkv:combine", Opcode.ATTN_COMBINE, "w_qkv", 1),
])
def test_l2_warm_hints_split_the_targets_weights_over_the_carriers(rule, carrier, target, shift):
    """CodegenOptions.l2_warm at North Mini Code's batch 4: each carrier of layer L carries one hint, on
    its target's weight buffer (layer L or L + 1), and the hints of a layer tile that buffer exactly,
    without overlap; the records carry them in task order, the other records none."""
    _, sc = _nmc_schedule(4)
    hints = l2_warm_hints(sc, rule)
    carriers = [t for t in sc.tasks if t.op == carrier and f"L{t.layer + shift}.{target}" in sc.buffers]
    assert carriers and set(hints) == {t.id for t in carriers}
    for layer in {t.layer for t in carriers}:
        name = f"L{layer + shift}.{target}"
        ranges = sorted((off, n) for tid, (b, off, n) in hints.items() if sc.tasks[tid].layer == layer and b == name)
        assert len(ranges) == sum(t.layer == layer for t in carriers)
        ends = [off + n for off, n in ranges]
        assert ranges[0][0] == 0 and all(e == o for e, (o, _) in zip(ends, ranges[1:]))
        assert 16 * ends[-1] == int(np.prod(sc.buffers[name].shape)) * 2
    w = encode(sc, rule)
    by_id = {int(r[W_ID]): r for r in w.records}
    for tid, r in by_id.items():
        want = (w.buffer_names.index(hints[tid][0]), *hints[tid][1:]) if tid in hints else (-1, 0, 0)
        assert tuple(r[W_WARM:W_WARM + 3]) == want


def test_l2_warm_rules_are_checked(tiny):
    spec, sc = tiny
    with pytest.raises(CodegenError, match="l2_warm rule 'o_proj:lm_head': expected TARGET:CARRIER"):
        kernel_config(sc, spec, CodegenOptions(l2_warm="o_proj:lm_head"))
    with pytest.raises(EncodeError, match="a carrier takes one rule"):
        encode(sc, "o_proj:splits,next_router:splits")
    with pytest.raises(CodegenError, match="weights_evict_first = 'yes': expected one of 'auto', 'on', 'off'"):
        kernel_config(sc, spec, CodegenOptions(weights_evict_first="yes"))
    assert kernel_config(sc, spec, CodegenOptions(l2_warm="off")).l2_warm == "off"
    auto = kernel_config(sc, spec)  # batch 2: the O-projection warmed by the expert gate/up tiles, evict-first streams
    assert sc.batch == 2 and auto.l2_warm == "o_proj:expert_up" and auto.weights_evict_first
    assert "constexpr bool WEIGHTS_EVICT_FIRST = true;" in render_source(auto, "t")
    b1, b8 = (schedule(lower(spec, b, 16, 8), spec.name) for b in (1, 8))
    for other in (kernel_config(b1, spec), kernel_config(b8, spec)):
        assert other.l2_warm == "off" and not other.weights_evict_first
    cfg = kernel_config(sc, spec, CodegenOptions(l2_warm="o_proj:expert_up"))
    assert cfg.l2_warm == "o_proj:expert_up" and "constexpr bool L2_WARM = true;" in render_source(cfg, "t")


def test_record_descriptors_are_the_table_rows_of_each_operand(tiny):
    """descriptors="record": each record's block holds the buffer table's row of each operand, zeros where the
    operand is absent (the kernel copies the block with the record)."""
    _, sc = tiny
    w = encode(sc)
    table = buffer_table(sc, w.buffer_names, {n: 4096 * (i + 1) for i, n in enumerate(w.buffer_names)})
    blocks = record_descriptors(w, table)
    assert blocks.shape == (len(sc.tasks), MAX_OPERANDS) and blocks.dtype == BUF_DESC
    for r, block in zip(w.records, blocks):
        for i in range(MAX_OPERANDS):
            b = r[W_OPERANDS + i]
            if b >= 0:
                assert block[i] == table[b]
            else:
                assert block[i]["ptr"] == 0 and not block[i]["shape"].any() and block[i]["dtype"] == 0
    assert (blocks["ptr"] != 0).sum() == (w.records[:, W_OPERANDS:W_OPERANDS + MAX_OPERANDS] >= 0).sum()


def test_tagged_logits_are_the_router_logits_after_their_values(tiny):
    """CodegenOptions.tagged_logits: the router logits the expert-up tiles read get a tagged copy
    (dtype f32_tagged in the buffer table: the kernel finds the copy after the values); the option
    is checked and "auto" turns it on up to batch 4."""
    spec, sc = tiny
    tagged = routing_logits(sc)
    moe = [i for i, ls in enumerate(spec.layers) if ls.mlp == "moe"]
    assert tagged == {f"L{i}.router_logits" for i in moe}
    w = encode(sc)
    table = buffer_table(sc, w.buffer_names, {n: 4096 * (i + 1) for i, n in enumerate(w.buffer_names)},
                         tagged=tagged)
    for i, n in enumerate(w.buffer_names):
        want = "f32_tagged" if n in tagged else sc.buffers[n].dtype
        assert table[i]["dtype"] == DTYPE_CODES[want], n
    bf16 = next(n for n, b in sc.buffers.items() if b.dtype == "bf16")
    with pytest.raises(EncodeError, match=f"buffer {re.escape(bf16)} is bf16: only an f32 buffer has a tagged copy"):
        buffer_table(sc, w.buffer_names, {n: 1 for n in w.buffer_names}, tagged=frozenset({bf16}))
    # the copy starts 8-byte aligned after the values: two words per element
    assert tagged_words(5) == (6, 10) and tagged_words(256) == (256, 512)
    with pytest.raises(CodegenError, match="tagged_logits = 'yes': expected one of 'auto', 'on', 'off'"):
        kernel_config(sc, spec, CodegenOptions(tagged_logits="yes"))
    for batch, on in ((1, True), (4, True), (5, False), (8, False)):
        sb = schedule(lower(spec, batch, 16, 8), spec.name)
        assert kernel_config(sb, spec).tagged_logits == on
        assert kernel_config(sb, spec, CodegenOptions(tagged_logits="on")).tagged_logits
        assert not kernel_config(sb, spec, CodegenOptions(tagged_logits="off")).tagged_logits


def test_a_routing_counter_shared_with_other_producers_is_refused(tiny):
    """An expert-up tile's first wait is the router tiles' counter, which a kernel with tagged
    logits skips: a counter that another task signals too cannot be skipped, so encoding refuses."""
    import dataclasses

    _, sc = tiny
    up = next(t for t in sc.tasks if t.op == Opcode.EXPERT_SWIGLU)
    router = next(c for c in sc.counters if all(routing_edge(sc.tasks[p], up) for p in c.producers))
    other = next(t.id for t in sc.tasks if t.op == Opcode.EMBED)
    signals = list(sc.signals)
    signals[other] = router.id
    counters = [dataclasses.replace(c, target=c.target + 1, producers=(*c.producers, other)) if c.id == router.id
                else c for c in sc.counters]
    with pytest.raises(EncodeError, match=f"counter {router.id} is also signalled by"):
        encode(dataclasses.replace(sc, signals=signals, counters=counters))


@pytest.mark.parametrize("batch", [1, 8])
def test_nmc_waits_fit_the_records(batch):
    """Every North Mini Code task reads its waits from its own record (docs/kernel.md: the waits
    table costs a round trip to device memory before the counters' loads)."""
    spec = load_spec(NMC)
    w = encode(schedule(lower(spec, batch, 8192, 132, attention_sms=32), spec.name))
    assert int(w.records[:, W_WAIT_CNT].max()) <= INLINE_WAITS


def test_out_of_line_functions_are_named_from_their_symbols():
    """sass.instructions_by_op counts a shared device function under its plain name."""
    assert function_name("$mkc_decode$_Z19route_tokens_sharedPKf") == "route_tokens_shared"
    assert function_name("$mkc_decode$_Z8wait_allPKiS0_PKjPijy") == "wait_all"
    assert function_name("$__internal_0_$__cuda_sm20_rcp_rn_f32_slowpath") == "__cuda_sm20_rcp_rn_f32_slowpath"


def test_cvalues():
    assert cv.c_float(1e-6) == "1e-06f" and cv.c_float(50000.0) == "50000.0f"
    assert cv.c_bool(True) == "true" and cv.c_uint(5) == "5u"
    with pytest.raises(ValueError):
        cv.c_int(2**31)
    with pytest.raises(ValueError):
        cv.c_float(float("inf"))
    with pytest.raises(ValueError):
        cv.c_ident("not an identifier")


def test_routing_options_are_checked(tiny):
    spec, sc = tiny
    with pytest.raises(CodegenError, match="routing_argmax = 'sort': expected one of 'auto', 'redux', 'rank'"):
        kernel_config(sc, spec, CodegenOptions(routing_argmax="sort"))
    with pytest.raises(CodegenError, match="norm_beside_routing = True: expected one of 'auto', 'on', 'off'"):
        kernel_config(sc, spec, CodegenOptions(norm_beside_routing=True))
    cfg = kernel_config(sc, spec)  # batch 2: "auto" is the rounds on redux.sync, the staging after them
    assert not cfg.routing_rank and not cfg.norm_beside_routing
    assert kernel_config(sc, spec, CodegenOptions(routing_argmax="rank")).routing_rank


def _sm_stream():
    return load_benchmark("sm_stream")


def test_sm_stream_kernels_compile_without_spills():
    """benchmarks/sm_stream.py (the per-SM read rate, run on a GPU): its kernels build for sm_90a with
    nothing spilled (a spill would add local-memory traffic to the bytes it times)."""
    from mkc.codegen.nvrtc import parse_resources

    mod = _sm_stream()
    cubin, log = mod.compile_kernels()
    assert cubin
    for kernel in ([f"stream_ldg_{d}" for d in mod.LDG_DEPTHS] + [f"stream_ldg512_{d}" for d in mod.LDG512_DEPTHS]
                   + [f"stream_ldgw_{d}" for d in mod.LDGW_DEPTHS]
                   + ["stream_bulk", "l2_read"]):
        res = parse_resources(log, kernel)
        assert res.regs > 0 and res.spills == 0, (kernel, res)


@pytest.mark.parametrize("text, why", [("ldg 3", "ldg D"), ("bulk 1000 4", "multiple of 16"),
                                       ("bulk 65536 8", "200 KiB"), ("tma 4", "expected")])
def test_sm_stream_rejects_bad_ways(text, why):
    with pytest.raises(ValueError, match=why):
        _sm_stream().parse_way(text)


def test_sm_stream_bytes_in_flight():
    mod = _sm_stream()
    assert mod.in_flight(mod.parse_way("ldg 8")) == 256 * 16 * 8 * 2  # two register batches
    assert mod.in_flight(mod.parse_way("bulk 16384 8")) == 128 * 1024
    assert mod.in_flight(mod.parse_way("ldg512 4")) == 512 * 16 * 4 * 2


def test_sm_stream_gpcs_and_picks():
    """SMs that ran one cluster share a GPC, transitively; "packed" fills GPCs in turn, "spread" takes
    one SM of each GPC in turn."""
    mod = _sm_stream()
    clusters = [[0, 1, 4, 5], [6, 7, 10, 11], [1, 2, 3, 0], [8, 9, 6, 7]]  # the SMs each cluster ran on
    gpcs = mod.gpcs_from_clusters(clusters)
    assert gpcs == [[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]]
    assert mod.pick_sms(gpcs, 3, "packed") == [0, 1, 2]
    assert mod.pick_sms(gpcs, 3, "spread") == [0, 6, 1]
    assert sorted(mod.pick_sms([[0, 1, 2], [3]], 9, "spread")) == [0, 1, 2, 3]  # as many as there are
    assert mod.pick_sms(gpcs, 3, "low") == [0, 1, 2]
    with pytest.raises(ValueError, match="packed"):
        mod.pick_sms(gpcs, 2, "random")
