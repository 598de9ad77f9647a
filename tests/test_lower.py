"""Lowering: the tile-task DAG, its region-derived edges, and the tiling rule."""

import dataclasses
from pathlib import Path

import networkx as nx
import pytest

from mkc.ir.graph import conflicting_pairs
from mkc.ir.lower import lower
from mkc.ir.ops import Opcode
from mkc.ir.spec import SpecError, load_spec
from mkc.ir.tiling import gemv_max_k, k_splits, row_tile


def by_name(prog, name):
    return next(t for t in prog.tasks if t.name == name)


def test_dag_is_acyclic_and_regions_in_bounds(tiny):
    prog = lower(tiny, batch=3, context=40, num_sms=8)
    assert nx.is_directed_acyclic_graph(prog.graph)
    for t in prog.tasks:
        for r in (*t.reads, *t.writes):
            shape = prog.buffers[r.buffer].shape
            assert len(r.box) == len(shape)
            assert all(0 <= lo < hi <= s for (lo, hi), s in zip(r.box, shape)), (t.name, str(r))


def test_edges_follow_program_order_and_conflicts(tiny):
    prog = lower(tiny, batch=2, context=16, num_sms=8)
    pairs = {(a, b) for a, b, _, _ in conflicting_pairs(prog.tasks, prog.buffers)}
    assert set(prog.graph.edges) == pairs
    assert all(a < b for a, b in pairs)


def _group0_qkv_tiles(prog):
    """The layer-1 QKV tiles that hold KV group 0's rows (its query heads, key and value), and all."""
    D, GS, QH = 32, 4, 8
    group0 = [(0, GS * D), (QH * D, (QH + 1) * D), ((QH + 2) * D, (QH + 3) * D)]
    qkv_tiles = [t for t in prog.tasks if t.name.startswith("L1.qkv[")]
    want = {t.id for t in qkv_tiles
            if any(t.arg("row0") < hi and lo < t.arg("row0") + t.arg("rows") for lo, hi in group0)}
    return want, qkv_tiles


def test_attention_of_a_head_waits_only_for_its_qkv(tiny):
    """Fine edges: KV head 0's attention splits (which rotate their own query) wait for exactly the
    QKV tiles that hold group 0's rows, and for nothing else of the layer."""
    prog = lower(tiny, batch=1, context=16, num_sms=132)
    want, qkv_tiles = _group0_qkv_tiles(prog)
    split = by_name(prog, "L1.attn[b0,kv0,s0]")
    preds = {prog.tasks[p].name.split("[")[0] for p in prog.graph.predecessors(split.id) if prog.tasks[p].layer == 1}
    got = {p for p in prog.graph.predecessors(split.id) if prog.tasks[p].name.startswith("L1.qkv[")}
    assert got == want and len(want) < len(qkv_tiles) and preds == {"L1.qkv"}


def test_unfused_rope_task_waits_only_for_its_qkv(tiny):
    """rope_in_splits=False: KV head 0's ROPE_APPEND waits for exactly group 0's QKV tiles, and
    the splits wait for it."""
    prog = lower(tiny, batch=1, context=16, num_sms=132, rope_in_splits=False)
    want, qkv_tiles = _group0_qkv_tiles(prog)
    rope0 = by_name(prog, "L1.rope_append[kv0]")
    got = {p for p in prog.graph.predecessors(rope0.id) if prog.tasks[p].name.startswith("L1.qkv[")}
    assert got == want and len(want) < len(qkv_tiles)
    assert rope0.id in set(prog.graph.predecessors(by_name(prog, "L1.attn[b0,kv0,s0]").id))


def test_fused_append_follows_the_splits_and_blocks_no_one(tiny):
    """With RoPE in the splits the append of a head runs after every split of that head has read
    the cache (they take this step's key and value from qkv), and no task of the step waits for it."""
    prog = lower(tiny, batch=2, context=64, num_sms=8)
    assert not any(n.endswith(".q") for n in prog.buffers), "no rotated-q buffer when the splits rotate q"
    for t in prog.tasks:
        if t.op != Opcode.ROPE_APPEND:
            continue
        g = t.arg("kv_head")
        splits = {s.id for s in prog.tasks if s.op == Opcode.ATTN_SPLIT and s.layer == t.layer and s.arg("kv_head") == g}
        assert splits <= nx.ancestors(prog.graph, t.id), t.name
        assert not list(prog.graph.successors(t.id)), f"{t.name} is waited for"
        assert t.operand("q") == "-"


def test_moe_does_not_wait_for_attention(tiny):
    prog = lower(tiny, batch=2, context=16, num_sms=8)
    first_expert = next(t for t in prog.tasks if t.name.startswith("L2.expert_up[slot0]"))
    anc = nx.ancestors(prog.graph, first_expert.id)
    assert not any(prog.tasks[a].layer == 2 and prog.tasks[a].op in (Opcode.ATTN_SPLIT, Opcode.ROPE_APPEND)
                   for a in anc)


def test_o_proj_slice_waits_only_for_its_group(tiny):
    prog = lower(tiny, batch=1, context=16, num_sms=8)
    o = next(t for t in prog.tasks if t.name.startswith("L1.o_proj[kv1]"))
    combines = [prog.tasks[p].name for p in prog.graph.predecessors(o.id)
                if prog.tasks[p].op == Opcode.ATTN_COMBINE]
    assert combines == [f"L1.combine[kv1,h{h}:{h + 1}]" for h in range(4, 8)]  # the 4 query heads of group 1


def test_residual_in_o_proj_ends_each_layer(tiny):
    """LowerOptions.residual_in_o_proj: no O-projection partials and no RESIDUAL tiles; the
    O-projection tiles cover the hidden rows once, read every head's attention, their rows of the
    residual stream and of every routing slot's output (the dense MLP's in layer 0), write the next
    layer's stream, and wait for the whole attention and for the expert-down tiles of their rows."""
    prog = lower(tiny, batch=3, context=40, num_sms=8, residual_in_o_proj=True)
    assert not any(t.op == Opcode.RESIDUAL for t in prog.tasks)
    assert not any(name.endswith(".o_part") for name in prog.buffers)
    H = tiny.hidden_size
    for layer in range(tiny.num_layers):
        tiles = [t for t in prog.tasks if t.name.startswith(f"L{layer}.o_proj[")]
        assert sorted((t.arg("row0"), t.arg("row0") + t.arg("rows")) for t in tiles) == \
            [(lo, lo + tiles[0].arg("rows")) for lo in range(0, H, tiles[0].arg("rows"))]
        mlp = "mlp" if tiny.layers[layer].mlp == "dense" else "routed"
        want = {"x": f"L{layer}.attn", "out": f"L{layer + 1}.x", "residual": f"L{layer}.x",
                mlp: f"L{layer}.mlp_out" if mlp == "mlp" else f"L{layer}.moe_out"}
        for t in tiles:
            assert {r: t.operand(r) for r in want} == want, t.name
            assert t.arg("k") == tiny.attention.num_heads * tiny.attention.head_dim
            before = nx.ancestors(prog.graph, t.id)
            assert all(c.id in before for c in prog.tasks if c.name.startswith(f"L{layer}.combine["))
            if mlp == "routed":
                lo, hi = t.arg("row0"), t.arg("row0") + t.arg("rows")
                down = [d for d in prog.tasks if d.name.startswith(f"L{layer}.expert_down[")
                        and d.arg("row0") < hi and lo < d.arg("row0") + d.arg("rows")]
                assert down and all(d.id in before for d in down), t.name
    # a sequential block adds the attention in its O-projection, the MLP in a RESIDUAL tile
    seq = load_spec(Path(__file__).resolve().parents[1] / "configs" / "qwen3_moe_tiny.yaml")
    prog = lower(seq, batch=2, context=40, num_sms=8, residual_in_o_proj=True)
    ends = {t.operand("out") for t in prog.tasks if ".o_proj[" in t.name}
    assert ends == {f"L{i}.x_mid" for i in range(seq.num_layers)}
    assert {t.name.split(".")[1].split("[")[0] for t in prog.tasks if t.op == Opcode.RESIDUAL} == {"residual"}
    # ... and a dense one adds the MLP in its down projection's tiles: no RESIDUAL tile at all
    dense = load_spec(Path(__file__).resolve().parents[1] / "configs" / "llama_tiny.yaml")
    prog = lower(dense, batch=2, context=40, num_sms=8, residual_in_o_proj=True)
    assert not any(t.op == Opcode.RESIDUAL for t in prog.tasks)
    for layer in range(dense.num_layers):
        down = [t for t in prog.tasks if t.name.startswith(f"L{layer}.down[")]
        assert down and {(t.operand("x"), t.operand("residual"), t.operand("out")) for t in down} == {
            (f"L{layer}.mlp_h", f"L{layer}.x_mid", f"L{layer + 1}.x")}
        rows = sorted((t.arg("row0"), t.arg("row0") + t.arg("rows")) for t in down)
        assert [lo for lo, _ in rows] == [0, *(hi for _, hi in rows[:-1])] and rows[-1][1] == dense.hidden_size


def test_attention_splits_scale_with_context(tiny):
    short = lower(tiny, batch=1, context=64, num_sms=132)
    long = lower(tiny, batch=1, context=4096, num_sms=132)
    n = lambda p: sum(t.op == Opcode.ATTN_SPLIT and t.layer == 0 for t in p.tasks)
    assert n(long) > n(short)
    # sliding layers stop growing at the window
    s = lambda p: sum(t.op == Opcode.ATTN_SPLIT and t.layer == 1 for t in p.tasks)
    assert s(long) == s(short)


def test_attention_splits_fill_one_wave_then_grow_in_keys(tiny):
    """The split count of a global layer grows with the context only up to one wave of the SMs
    (num_sms / (batch x kv_heads) splits per stream); past it each split takes more keys. So North
    Mini Code at batch 1 has 128 splits per global layer at 8K and 32K positions (132 at 128K), of
    256, 1024 and 4032 keys, and the splits always cover the context."""
    def global_layer(context):
        ts = [t for t in lower(tiny, batch=1, context=context, num_sms=16).tasks
              if t.op == Opcode.ATTN_SPLIT and t.layer == 0]
        assert len({t.arg("split") for t in ts}) * ts[0].arg("split_keys") >= context
        return len(ts), ts[0].arg("split_keys")

    (n1, k1), (n2, k2), (n3, k3), (n4, k4) = (global_layer(c) for c in (512, 2048, 8192, 32768))
    assert n1 < n2 == n3 == n4 == 16  # 2 KV heads x 8 splits: one wave of 16 SMs
    assert k1 == k2 < k3 < k4


def test_global_attention_sms_splits_only_the_global_layers_more(tiny):
    """LowerOptions.global_attention_sms: the layers of global attention get that many SMs' worth
    of splits (here 4 waves of 16 SMs: 32 per KV head instead of 4), the sliding-window layers keep
    attention_sms's; each global layer's splits still cover the context, and its combine tasks
    merge them all."""
    def splits(prog, layer):
        ts = [t for t in prog.tasks if t.op == Opcode.ATTN_SPLIT and t.layer == layer]
        assert len({t.arg("split") for t in ts}) * ts[0].arg("split_keys") >= min(16384, ts[0].arg("window") or 16384)
        return len(ts)

    same = lower(tiny, batch=1, context=16384, num_sms=16, attention_sms=8)
    wide = lower(tiny, batch=1, context=16384, num_sms=16, attention_sms=8, global_attention_sms=64)
    assert [tiny.layers[i].attention for i in (0, 1)] == ["global", "sliding"]
    assert splits(same, 0) == 8 and splits(wide, 0) == 64
    assert splits(same, 1) == splits(wide, 1)
    assert {t.arg("splits") for t in wide.tasks if t.op == Opcode.ATTN_COMBINE and t.layer == 0} == {32}
    # 0: as attention_sms
    assert [t.args for t in lower(tiny, 1, 16384, 16, attention_sms=8, global_attention_sms=0).tasks] == \
        [t.args for t in same.tasks]


@pytest.mark.parametrize("count", [-1, 4 * 16 + 1])
def test_global_attention_sms_out_of_range_is_refused(tiny, count):
    with pytest.raises(SpecError, match=r"--global-attention-sms .*expected 0 \(as --attention-sms\) or up to 4 waves"):
        lower(tiny, batch=1, context=64, num_sms=16, global_attention_sms=count)


def test_moe_slots_cover_batch_times_top_k(tiny):
    for b, slots in [(1, 4), (2, 8), (8, 16)]:
        prog = lower(tiny, batch=b, context=16, num_sms=8)
        assert prog.buffers["L1.moe_h"].shape[0] == slots
        assert len({t.arg("slot") for t in prog.tasks if t.op == Opcode.EXPERT_SWIGLU and t.layer == 1}) == slots


def test_tiling_rule():
    assert row_tile(6144, 4096, 1, 132, boundary=128) == 64  # QKV: one wave, inside one head
    assert row_tile(262144, 4096, 1, 132) % 16 == 0  # mma m16 rows
    assert row_tile(128, 4096, 1, 132) == 16  # the router: 8 tasks of 64 KiB, not 2 of 256 KiB
    assert row_tile(96, 256, 1, 8, 32) == 96  # tiny op: one task (min bytes per task)


def test_tiling_rule_spreads_rows_with_few_divisors_over_every_sm():
    """Without a natural boundary, equal tiles (a divisor of the rows) are kept where they are at
    least half the tasks wanted; a vocabulary of 151,936 rows (2^7 x 1187: its divisors that are
    multiples of 16 jump from 128 to 18,992 rows) takes 132 tiles, the last one shorter, not 8."""
    tile = row_tile(151936, 4096, 1, 132)
    assert tile % 16 == 0 and -(-151936 // tile) == 132
    assert row_tile(262144, 4096, 1, 132) == 2048  # 128 equal tiles: enough, kept
    assert row_tile(2048, 1536, 16, 132) == 256  # 8 expert-down tiles per slot of 16: kept
    assert row_tile(5120, 4096, 1, 132, boundary=128) == 64  # a head boundary still rules


def test_lm_head_of_a_large_vocabulary_fills_every_sm():
    """Qwen3-0.6B cut to one layer, at batch 1 on 132 SMs: its LM head (vocabulary 151,936) is cut
    into a tile per SM, and the scheduler puts each on an SM of its own."""
    from mkc.schedule.scheduler import schedule

    spec = load_spec(Path(__file__).resolve().parents[1] / "configs" / "qwen3_0_6b.yaml")
    spec = dataclasses.replace(spec, num_layers=1, layers=spec.layers[:1])
    sc = schedule(lower(spec, 1, 1024, 132), spec.name)
    head = [t.id for t in sc.tasks if t.op == Opcode.LM_HEAD]
    sm = sc.sm_of()
    assert len(head) == 132 and len({sm[t] for t in head}) == 132
    assert sum(sc.tasks[t].arg("rows") for t in head) == spec.vocab_size


@pytest.mark.parametrize("batch, hidden", [(1, 4096), (8, 4096), (8, 2048), (3, 128)])
def test_gemv_max_k_is_what_the_kernel_fits(batch, hidden):
    """tiling.gemv_max_k, the K split's limit, is the widest reduction whose GEMV shared memory
    (KernelConfig.gemv_bytes, which the codegen checks) fits: one block more does not."""
    import dataclasses

    from mkc.codegen.render import MAX_SMEM_BYTES, KernelConfig

    k = gemv_max_k(batch, hidden)
    cfg = KernelConfig(threads=256, batch=batch, hidden=hidden, head_dim=128, page_size=0, group=8, top_k=8,
                       norm_eps=1e-6, rope_theta=1e4, rope_interleaved=False, attn_scale=1.0, logit_scale=1.0,
                       router_sigmoid=False, normalize_top_k=False, gemv_unroll=8, gemv_max_k=k, max_splits=132,
                       num_experts=8, moe_slots=8, spin_limit=1, weights_tiled=True, attn_warp_request=2,
                       routing_rank=False, norm_beside_routing=False, profile_phases=False, tagged_logits=False)
    assert k % 64 == 0 and cfg.gemv_bytes <= MAX_SMEM_BYTES
    assert dataclasses.replace(cfg, gemv_max_k=k + 64).gemv_bytes > MAX_SMEM_BYTES


def test_k_splits():
    assert k_splits(4096, 12416) == [(0, 4096)]  # fits: one part
    assert k_splits(14336, 12416) == [(0, 7168), (7168, 7168)]  # the fewest equal parts
    assert k_splits(14336, 5248) == [(0, 4800), (4800, 4800), (9600, 4736)]  # whole blocks, the last shorter
    assert k_splits(256, 64) == [(0, 64), (64, 64), (128, 64), (192, 64)]


@pytest.mark.parametrize("kw", [{"batch": 0}, {"batch": 9}, {"context": 0}, {"num_sms": 0}])
def test_bad_options(tiny, kw):
    args = {"batch": 1, "context": 16, "num_sms": 8} | kw
    with pytest.raises(SpecError):
        lower(tiny, **args)


def test_north_mini_code_task_counts():
    spec = load_spec("configs/north_mini_code.yaml")
    prog = lower(spec, batch=1, context=8192, num_sms=132)
    ops = {op: sum(t.op == op for t in prog.tasks) for op in Opcode}
    assert ops[Opcode.EMBED] == 1 and ops[Opcode.ARGMAX] == 1 and ops[Opcode.ATTN_COMBINE] == 49 * 16
    # the norms are recomputed by their consumers: no task of their own
    assert not any(t.name.endswith(".norm") for t in prog.tasks) and ops[Opcode.TOPK] == 48
    # bytes one step must read at batch 1 (upper bound: every routed slot live) ≈ 7.1-7.3 GB (DESIGN.md)
    total = sum(t.weight_bytes + t.act_bytes for t in prog.tasks)
    assert 6.9e9 < total < 7.5e9
