"""CPU executor: the compiled task list, run tile by tile on poisoned scratch buffers in random
interleavings, computes what the dense reference computes; and the poisoning really catches
tasks that step outside their declared regions."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from mkc.ir.graph import Region
from mkc.ir.lower import lower
from mkc.ir.ops import Opcode
from mkc.ir.spec import SpecError, load_spec
from mkc.runtime.generate import greedy_generate, greedy_generate_batch
from mkc.runtime.reference import DenseReference
from mkc.runtime.weights import random_weights, weight_shapes
from mkc.schedule.cpu_ops import DISPATCH
from mkc.schedule.executor import CpuExecutor, ExecutorError
from mkc.schedule.scheduler import schedule

TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml"

# float32 executor vs float32 reference: the same math, summed in another order (row tiles,
# split-K o-proj, flash-decoding combine, per-tile matmuls vs one matvec). Each op differs by a few
# float32 ulps (~1e-7 relative); through 5 layers the logits (|x| ~ 2) differ by ~1e-6 in practice.
# The budget leaves ~50x headroom and is still far below any real bug (those give errors ~1e-2+).
F32_ATOL, F32_RTOL = 5e-5, 5e-5


@pytest.fixture(scope="module")
def spec():
    return load_spec(TINY)


@pytest.fixture(scope="module")
def weights(spec):
    # std 0.1 (not 0.02) so routing and logits are far from flat and every op matters
    return random_weights(spec, seed=7, dtype=torch.float32, std=0.1)


def _executor(spec, weights, batch, context=64, num_sms=8, **kw):
    return CpuExecutor(schedule(lower(spec, batch, context, num_sms), spec.name), spec, weights, **kw)


def _assert_close(got, want, what):
    err = (got - want).abs()
    budget = F32_ATOL + F32_RTOL * want.abs()
    assert bool((err <= budget).all()), (f"{what}: max error {err.max().item():.3g} exceeds the budget "
                                         f"(atol {F32_ATOL}, rtol {F32_RTOL}; max |ref| {want.abs().max().item():.3g})")


def _positions(step: int, batch: int) -> list[int]:
    """Sequence b waits at position 0 (rewriting it) for 2b steps, so positions differ in a batch."""
    return [max(0, step - 2 * b) for b in range(batch)]


@pytest.mark.parametrize("batch", [1, 2, 3])
def test_matches_reference_past_the_window(spec, weights, batch):
    """14 steps (the sliding window is 8), a random interleaving per step, positions differing per
    sequence and a rewritten position 0: logits match the dense reference at every step."""
    ex = _executor(spec, weights, batch)
    ref = DenseReference(spec, weights)
    g = torch.Generator().manual_seed(batch)
    for step in range(14):
        tokens = torch.randint(0, spec.vocab_size, (batch,), generator=g)
        pos = _positions(step, batch)
        logits, nxt = ex.step(tokens, pos, seed=100 * batch + step)
        _assert_close(logits, ref.step(tokens, pos), f"batch {batch} step {step} positions {pos}")
        assert nxt.tolist() == logits.argmax(-1).tolist(), "ARGMAX disagrees with the argmax of the logits"


def test_interleavings_are_bitwise_identical(spec, weights):
    """A correct schedule has no races: every interleaving gives exactly the same bits."""
    tokens = torch.randint(0, spec.vocab_size, (10, 2))
    runs = []
    for seed in (None, 1, 2, 3):
        ex = _executor(spec, weights, 2)
        runs.append(torch.stack([ex.step(tokens[s], _positions(s, 2), seed=None if seed is None else seed * 97 + s)[0]
                                 for s in range(10)]))
    for r in runs[1:]:
        assert torch.equal(r, runs[0]), f"interleavings differ: max {(r - runs[0]).abs().max().item():.3g}"


def test_long_context_multi_split_attention(spec, weights):
    """Flash-decoding with several splits per (sequence, KV head), for global layers and for a
    sliding window that spans two splits: a random KV prefix is loaded into both implementations,
    then three decode steps run from different positions per sequence."""
    spec = dataclasses.replace(spec, attention=dataclasses.replace(spec.attention, sliding_window=300))
    ctx, prefix = 1024, [400, 290]
    sc = schedule(lower(spec, 2, ctx, 8), spec.name)
    splits = {(t.layer, t.arg("window")) for t in sc.tasks if t.op == Opcode.ATTN_SPLIT and t.arg("split") > 0}
    assert {w for _, w in splits} == {0, 300}, f"expected global and sliding layers with > 1 split, got {splits}"
    ex = CpuExecutor(sc, spec, weights)
    ref = DenseReference(spec, weights)
    a = spec.attention
    for b, n in enumerate(prefix):
        for layer in range(spec.num_layers):
            k, v = torch.randn(n, a.num_kv_heads, a.head_dim), torch.randn(n, a.num_kv_heads, a.head_dim)
            ex.write_kv(b, layer, k, v)
            ref.set_kv(b, layer, k, v)
    for step in range(3):
        tokens = torch.randint(0, spec.vocab_size, (2,))
        pos = [n + step for n in prefix]
        logits, _ = ex.step(tokens, pos, seed=step)
        _assert_close(logits, ref.step(tokens, pos), f"step {step} positions {pos}")


@pytest.mark.parametrize("config, dtype", [("tiny.yaml", torch.float32), ("tiny.yaml", torch.bfloat16),
                                           ("qwen3_tiny.yaml", torch.bfloat16)])
def test_rope_in_splits_computes_what_the_rope_task_computes(config, dtype):
    """LowerOptions.rope_in_splits only moves work: the splits rotating their own query (and taking
    this step's key and value from qkv) give bitwise the logits of a ROPE_APPEND task that rotates
    q and appends first, in float32 and in bf16 (q rounded as the task stores it), with qk-norm
    (qwen3_tiny) and across sliding-window and global layers with several splits each."""
    spec = load_spec(Path(__file__).resolve().parents[1] / "configs" / config)
    if spec.attention.sliding_window:
        spec = dataclasses.replace(spec, attention=dataclasses.replace(spec.attention, sliding_window=300))
    w = random_weights(spec, seed=4, dtype=dtype, std=0.1)
    fused, unfused = (CpuExecutor(schedule(lower(spec, 2, 1024, 32, rope_in_splits=r), spec.name), spec, w, dtype=dtype)
                      for r in (True, False))
    assert any(t.op == Opcode.ATTN_SPLIT and t.arg("split") > 0 for t in fused.schedule.tasks)
    a, g = spec.attention, torch.Generator().manual_seed(3)
    prefix = [400, 290]  # past the window and over several splits
    for b, n in enumerate(prefix):
        for layer in range(spec.num_layers):
            k, v = (torch.randn(n, a.num_kv_heads, a.head_dim, generator=g) for _ in range(2))
            fused.write_kv(b, layer, k, v)
            unfused.write_kv(b, layer, k, v)
    for step in range(4):
        tokens = torch.randint(0, spec.vocab_size, (2,), generator=g)
        pos = [n + step for n in prefix]
        x, y = fused.step(tokens, pos, seed=step)[0], unfused.step(tokens, pos, seed=step)[0]
        assert torch.equal(x, y), f"step {step}: max difference {(x - y).abs().max().item():.3g}"


@pytest.mark.parametrize("batch", [1, 2])
def test_global_attention_sms_matches_reference(spec, weights, batch):
    """LowerOptions.global_attention_sms: the global layers' keys cut into twice as many splits
    (most of them past every sequence's position, so empty) merge to the same logits as the dense
    reference, in random interleavings, before and past the sliding window."""
    sc = schedule(lower(spec, batch, 1024, 8, attention_sms=4, global_attention_sms=32), spec.name)
    n = {ls.attention: sum(t.op == Opcode.ATTN_SPLIT and t.layer == i for t in sc.tasks)
         for i, ls in reversed(list(enumerate(spec.layers)))}
    assert n["global"] > n["sliding"]
    ex, ref = CpuExecutor(sc, spec, weights), DenseReference(spec, weights)
    for step in range(14):
        tokens = torch.randint(0, spec.vocab_size, (batch,), generator=torch.Generator().manual_seed(step))
        pos = _positions(step, batch)
        logits, _ = ex.step(tokens, pos, seed=31 * batch + step)
        _assert_close(logits, ref.step(tokens, pos), f"batch {batch} step {step}")


@pytest.mark.parametrize("config, batch", [("tiny.yaml", 1), ("tiny.yaml", 3), ("qwen3_moe_tiny.yaml", 2),
                                           ("llama_tiny.yaml", 2)])
def test_residual_in_o_proj_matches_reference(config, batch):
    """LowerOptions.residual_in_o_proj (the O-projection tiles add the residual stream and the
    MLP's output): the same logits as the dense reference, in random interleavings, for a parallel
    block with a dense layer and MoE layers, a sequential MoE block and a sequential dense one. At
    batch 3 the tiny model's 12 routing slots are not all live in some step, so the slots past the
    live count are read too: they hold zeros, and poison or a stale step's output would show."""
    spec = load_spec(Path(__file__).resolve().parents[1] / "configs" / config)
    w = random_weights(spec, seed=7, dtype=torch.float32, std=0.1)
    sc = schedule(lower(spec, batch, 64, 8, residual_in_o_proj=True), spec.name)
    assert any(t.op == Opcode.LINEAR and t.operand("residual") != "-" for t in sc.tasks)
    ex, ref = CpuExecutor(sc, spec, w), DenseReference(spec, w)
    g = torch.Generator().manual_seed(batch)
    dead = 0  # steps in which a MoE layer routed to fewer distinct experts than it has slots
    for step in range(12):
        tokens = torch.randint(0, spec.vocab_size, (batch,), generator=g)
        pos = _positions(step, batch)
        logits, _ = ex.step(tokens, pos, seed=step)
        _assert_close(logits, ref.step(tokens, pos), f"{config} batch {batch} step {step}")
        if spec.moe is not None:
            slots = min(spec.moe.num_experts, batch * spec.moe.top_k)
            dead += any(len(set(ex.bufs[f"L{i}.moe_selected"].flatten().tolist())) < slots
                        for i, ls in enumerate(spec.layers) if ls.mlp == "moe")
    if config == "tiny.yaml" and batch == 3:
        assert dead, "no step left a routing slot dead: the zeros of dead slots were not exercised"


def _matches_reference(sc, spec, w, batch: int, seed: int, what: str, steps: int = 8) -> None:
    """``steps`` steps of random tokens on the executor of ``sc`` (random interleavings), each
    with the dense reference's logits."""
    ex, ref = CpuExecutor(sc, spec, w), DenseReference(spec, w)
    g = torch.Generator().manual_seed(seed)
    for step in range(steps):
        tokens = torch.randint(0, spec.vocab_size, (batch,), generator=g)
        pos = _positions(step, batch)
        logits, _ = ex.step(tokens, pos, seed=step)
        _assert_close(logits, ref.step(tokens, pos), f"{what} batch {batch} step {step}")


@pytest.mark.parametrize("batch", [1, 3])
def test_fused_experts_match_reference(batch):
    """LowerOptions.fused_experts: each EXPERT_MLP tile computes its expert's intermediate rows and
    their split-K share of the down projection, and the O-projection tiles sum the parts. The same
    logits as the dense reference in random interleavings, with an expert intermediate of 256 cut
    into 2 parts per slot at batch 1 (one at batch 3, 12 slots); at batch 3 some slots are dead in some step and their parts (zeros) are
    summed too."""
    spec = load_spec(Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml")
    spec = dataclasses.replace(spec, moe=dataclasses.replace(spec.moe, intermediate=256))
    w = random_weights(spec, seed=11, dtype=torch.float32, std=0.1)
    sc = schedule(lower(spec, batch, 64, 8, residual_in_o_proj=True, fused_experts=True), spec.name)
    fused = [t for t in sc.tasks if t.op == Opcode.EXPERT_MLP]
    slots = min(spec.moe.num_experts, batch * spec.moe.top_k)
    assert fused and not any(t.op in (Opcode.EXPERT_SWIGLU, Opcode.EXPERT_DOWN) for t in sc.tasks)
    (rows,) = {t.arg("rows") for t in fused}
    assert sc.buffers["L1.moe_out"].shape == (slots * 256 // rows, batch, 128)
    assert rows == (128 if batch == 1 else 256)  # batch 1: two parts per slot
    _matches_reference(sc, spec, w, batch, 20 + batch, "fused experts")


def test_fused_experts_need_the_o_projection_to_end_the_layer():
    """The fused tiles' partials are summed only by O-projection tiles that end the layer: asked
    without residual_in_o_proj, or for a sequential block, or for an intermediate off the 64-wide
    blocks, lowering says so."""
    root = Path(__file__).resolve().parents[1] / "configs"
    tiny = load_spec(root / "tiny.yaml")
    with pytest.raises(SpecError, match="fused_experts.*residual_in_o_proj"):
        lower(tiny, 1, 64, 8, fused_experts=True)
    with pytest.raises(SpecError, match="fused_experts.*sequential block"):
        lower(load_spec(root / "qwen3_moe_tiny.yaml"), 1, 64, 8, residual_in_o_proj=True, fused_experts=True)
    odd = dataclasses.replace(tiny, moe=dataclasses.replace(tiny.moe, intermediate=96))
    with pytest.raises(SpecError, match="intermediate size 96.*multiple of 64"):
        lower(odd, 1, 64, 8, residual_in_o_proj=True, fused_experts=True)


@pytest.mark.parametrize("batch", [1, 3])
def test_expert_tiles_of_two_sizes_match_reference(batch):
    """LowerOptions.expert_up_rows: each slot's expert gate/up tiles of two sizes (an intermediate of
    256 as 80 + 80 + 48 + 48 rows). The same logits as the dense reference in random interleavings,
    the tiles as asked, and the larger ones placed first (their upward rank is the higher)."""
    spec = load_spec(Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml")
    spec = dataclasses.replace(spec, moe=dataclasses.replace(spec.moe, intermediate=256))
    w = random_weights(spec, seed=17, dtype=torch.float32, std=0.1)
    sc = schedule(lower(spec, batch, 64, 8, expert_up_rows=(80, 80, 48, 48)), spec.name)
    up = [t for t in sc.tasks if t.op == Opcode.EXPERT_SWIGLU and t.layer == 1]
    slots = min(spec.moe.num_experts, batch * spec.moe.top_k)
    assert sorted((t.arg("slot"), t.arg("row0"), t.arg("rows")) for t in up) == [
        (j, r0, r) for j in range(slots) for r0, r in ((0, 80), (80, 80), (160, 48), (208, 48))]
    start = sc.predicted["start_us"]
    assert min(start[t.id] for t in up if t.arg("rows") == 80) <= min(start[t.id] for t in up if t.arg("rows") == 48)
    _matches_reference(sc, spec, w, batch, 40 + batch, "expert tiles of two sizes")


def test_expert_up_rows_are_checked():
    """Tile rows that are not multiples of 16, that do not add up to the expert's intermediate size,
    that come with fused expert tiles, or for a model without experts: lowering says what it expected."""
    root = Path(__file__).resolve().parents[1] / "configs"
    tiny = load_spec(root / "tiny.yaml")  # expert intermediate 64
    with pytest.raises(SpecError, match="expert_up_rows = \\(40, 24\\): expected positive multiples of 16"):
        lower(tiny, 1, 64, 8, expert_up_rows=(40, 24))
    with pytest.raises(SpecError, match="add up to 80 rows: expected the expert intermediate size, 64"):
        lower(tiny, 1, 64, 8, expert_up_rows=(48, 32))
    with pytest.raises(SpecError, match="expert_up_rows with fused_experts"):
        lower(tiny, 1, 64, 8, residual_in_o_proj=True, fused_experts=True, expert_up_rows=(32, 32))
    with pytest.raises(SpecError, match="has no routed experts"):
        lower(load_spec(root / "llama_tiny.yaml"), 1, 64, 8, expert_up_rows=(32, 32))


def test_generate_cpu_equals_reference(spec, weights):
    prompt = [int(t) for t in torch.randint(0, spec.vocab_size, (11,))]  # longer than the window
    cpu = greedy_generate(spec, weights, prompt, 6, seed=5)
    assert cpu == greedy_generate(spec, weights, prompt, 6, backend="reference")


def test_generate_batch_equals_one_by_one(spec, weights):
    prompts = [[int(t) for t in torch.randint(0, spec.vocab_size, (n,))] for n in (3, 9, 5)]
    batch = greedy_generate_batch(spec, weights, prompts, 5, seed=9)
    assert batch == [greedy_generate(spec, weights, p, 5, backend="reference") for p in prompts]


def test_every_opcode_has_a_handler():
    assert set(DISPATCH) == set(Opcode)


def test_weight_shapes_match_the_lowering(spec):
    for s in (spec, load_spec(TINY.parent / "north_mini_code.yaml")):
        prog = lower(s, 1, 64, 8)
        lowered = {b.name: b.shape for b in prog.buffers.values() if b.kind == "weight"}
        assert lowered == weight_shapes(s)


# -- poisoning: the executor must catch a task that steps outside its declared regions ----------


def _patch(sc, pick, fix):
    """Replace the first task ``pick`` accepts by ``fix(task)``; returns the new task."""
    t = next(t for t in sc.tasks if pick(t))
    sc.tasks[t.id] = fix(t)
    return sc.tasks[t.id]


def _narrow(regions, buffer, dim, lo_hi):
    return tuple(Region(r.buffer, r.box[:dim] + (lo_hi,) + r.box[dim + 1:]) if r.buffer == buffer else r
                 for r in regions)


def _sched(spec, batch=1, context=64):
    return schedule(lower(spec, batch, context, 8), spec.name)


def test_too_small_read_region_is_caught(spec, weights):
    """A QKV tile that declares only half of its input row reads poison: NaN, caught at once."""
    sc = _sched(spec)
    H = spec.hidden_size
    bad = _patch(sc, lambda t: t.name.startswith("L1.qkv"),
                 lambda t: dataclasses.replace(t, reads=_narrow(t.reads, "L1.x", 1, (0, H // 2))))
    with pytest.raises(ExecutorError, match=rf"{bad.name.replace('[', '.').replace(']', '.')}.*wrote NaN"):
        CpuExecutor(sc, spec, weights).step([1], [0])
    # unchecked, the poison flows on until the next MoE layer's routing refuses NaN router logits
    with pytest.raises(ExecutorError, match=r"L2\.(expert_up|topk).*router logits L2\.router_logits contain NaN"):
        CpuExecutor(sc, spec, weights, check=False).step([1], [0])


def test_too_small_weight_region_is_caught(spec, weights):
    sc = _sched(spec)
    bad = _patch(sc, lambda t: t.op == Opcode.LM_HEAD,
                 lambda t: dataclasses.replace(t, reads=_narrow(t.reads, "embed", 0, (t.arg("row0"), t.arg("row0") + 1))))
    with pytest.raises(ExecutorError, match=r"lm_head.*wrote NaN"):
        CpuExecutor(sc, spec, weights).step([1], [0])
    assert bad.op == Opcode.LM_HEAD


def test_too_small_kv_region_is_caught_when_reached(spec, weights):
    """Attention of a global layer declaring keys [0, 4) only: fine until key 4 is read from the
    cache, at position 5 (at position 4 the split takes the step's own key from qkv)."""
    sc = _sched(spec)
    _patch(sc, lambda t: t.op == Opcode.ATTN_SPLIT and t.layer == 0,
           lambda t: dataclasses.replace(t, reads=_narrow(t.reads, "L0.k_cache", 2, (0, 4))))
    ex = CpuExecutor(sc, spec, weights)
    for pos in range(5):
        ex.step([pos + 1], [pos])
    with pytest.raises(ExecutorError, match=r"L0\.attn\[b0,kv0,s0\].*wrote NaN"):
        ex.step([9], [5])


def test_undeclared_writes_are_discarded(spec, weights):
    """A QKV tile declaring only half its output columns: the other half is never stored, so its
    consumer reads poison (caught there), and the real buffer still holds poison."""
    sc = _sched(spec)
    bad = _patch(sc, lambda t: t.name.startswith("L1.qkv"),
                 lambda t: dataclasses.replace(t, writes=_narrow(t.writes, "L1.qkv", 1,
                                                                 (t.arg("col0"), t.arg("col0") + t.arg("rows") // 2))))
    ex = CpuExecutor(sc, spec, weights, check=False)
    with pytest.raises(ExecutorError, match=r"router logits L2\.router_logits contain NaN"):
        ex.step([1], [0])  # unchecked, the poison flows on until the next layer's routing
    lo, rows = bad.arg("col0"), bad.arg("rows")
    assert torch.isnan(ex.bufs["L1.qkv"][:, lo + rows // 2:lo + rows]).all()
    assert not torch.isnan(ex.bufs["L1.qkv"][:, lo:lo + rows // 2]).any()
    with pytest.raises(ExecutorError, match=r"L1\.(rope_append|attn).*NaN"):
        CpuExecutor(sc, spec, weights).step([1], [0])


@pytest.mark.parametrize("op, buffer, error", [
    # a residual tile without its routing slots reads int poison: a bad index
    (Opcode.RESIDUAL, "token_slots", r"L1\.residual.*failed: IndexError"),
    # an expert-up tile without the router logits routes from float poison: refused
    (Opcode.EXPERT_SWIGLU, "router_logits", r"L1\.expert_up.*failed: ValueError: .*router logits .*NaN"),
])
def test_undeclared_routing_read_is_caught(spec, weights, op, buffer, error):
    sc = _sched(spec)
    _patch(sc, lambda t: t.op == op and t.layer == 1,
           lambda t: dataclasses.replace(t, reads=tuple(r for r in t.reads if not r.buffer.endswith(buffer))))
    with pytest.raises(ExecutorError, match=error):
        CpuExecutor(sc, spec, weights).step([1], [0])


def test_deadlock_names_the_blocked_tasks(spec, weights):
    sc = _sched(spec)
    t = next(t for t in sc.tasks if sc.waits[t.id])
    cid, target = sc.waits[t.id][0]
    sc.waits[t.id][0] = (cid, target + 1)  # a target no step can reach
    with pytest.raises(ExecutorError, match=rf"deadlock in step 1(.|\n)*task {t.id} {t.name.replace('[', '.').replace(']', '.')}"):
        CpuExecutor(sc, spec, weights).step([1], [0])


def test_dropped_wait_is_caught_by_random_interleavings(spec, weights):
    """Remove every wait of the layer-1 residual tiles: some interleaving runs one of them before
    its inputs exist, and the poison exposes it."""
    sc = _sched(spec)
    for t in sc.tasks:
        if t.op == Opcode.RESIDUAL and t.layer == 1:
            sc.waits[t.id] = []
    caught = 0
    for seed in range(8):
        try:
            CpuExecutor(sc, spec, weights).step([1], [0], seed=seed)
        except ExecutorError as e:
            assert "residual" in str(e) or "NaN" in str(e)
            caught += 1
    assert caught > 0, "no interleaving out of 8 exposed the missing wait"


def test_step_rejects_bad_inputs(spec, weights):
    ex = _executor(spec, weights, 2)
    with pytest.raises(ValueError, match="expected 2"):
        ex.step([1], [0])
    with pytest.raises(ValueError, match="context bucket"):
        ex.step([1, 2], [0, 64])
    with pytest.raises(ValueError, match="token ids"):
        ex.step([1, spec.vocab_size], [0, 0])


@pytest.mark.parametrize("batch, fold", [(1, True), (1, False), (3, True)])
def test_expert_down_rows_match_reference(batch, fold):
    """LowerOptions.expert_down_rows: expert-down tiles of 16 rows, and of 48 (the last of a slot
    shorter, since 48 does not divide the hidden size of 128: 48 + 48 + 32), with and without the
    O-projection ending the layer: the same logits as the dense reference in random interleavings."""
    spec = load_spec(Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml")
    w = random_weights(spec, seed=19, dtype=torch.float32, std=0.1)
    for rows in (16, 48):
        sc = schedule(lower(spec, batch, 64, 8, residual_in_o_proj=fold, expert_down_rows=rows), spec.name)
        down = [t for t in sc.tasks if t.op == Opcode.EXPERT_DOWN and t.layer == 1]
        assert {t.arg("rows") for t in down} == ({16} if rows == 16 else {48, 32})
        _matches_reference(sc, spec, w, batch, 50 + batch, f"expert-down tiles of {rows} rows")


def test_expert_down_rows_are_checked():
    tiny = load_spec(Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml")
    with pytest.raises(SpecError, match="expert_down_rows = 40: expected 0 \\(the tiling rule\\) or a positive multiple of 16"):
        lower(tiny, 1, 64, 8, expert_down_rows=40)


@pytest.mark.parametrize("config, batch, fold", [("tiny.yaml", 1, False), ("tiny.yaml", 3, False),
                                                 ("tiny.yaml", 2, True), ("qwen3_moe_tiny.yaml", 2, False),
                                                 ("llama_tiny.yaml", 1, False)])
def test_k_split_matches_reference(config, batch, fold):
    """LowerOptions.max_gemv_k = 64: every MLP down projection (dense and per expert) is split
    along k into 64-column parts whose partials the residual tiles (or the O-projection tiles that
    end the layer) sum, beside the O-projection's: the same logits as the dense reference in random
    interleavings, for a parallel block (dense and MoE layers), a sequential MoE block and a
    sequential dense one. At batch 3 some routing slots are dead in some step: their zeros are summed."""
    spec = load_spec(Path(__file__).resolve().parents[1] / "configs" / config)
    if spec.moe is not None:  # an expert intermediate of 4 blocks
        spec = dataclasses.replace(spec, moe=dataclasses.replace(spec.moe, intermediate=256))
    w = random_weights(spec, seed=23, dtype=torch.float32, std=0.1)
    sc = schedule(lower(spec, batch, 64, 8, residual_in_o_proj=fold, max_gemv_k=64), spec.name)
    down = [t for t in sc.tasks if t.op == Opcode.EXPERT_DOWN_SPLIT or t.name.startswith("L0.down")]
    assert down and {t.arg("k") for t in down} == {64}
    assert not any(t.op == Opcode.EXPERT_DOWN for t in sc.tasks)
    _matches_reference(sc, spec, w, batch, 60 + batch, f"{config}, k split")


def test_k_split_only_where_k_does_not_fit():
    """The K split engages only where the reduction does not fit the shared memory: North Mini
    Code's lowering is the same task for task with the rule's limit as without a split at all, and
    Mixtral-8x7B's expert down projection (k = 14336) is split in 2 parts at batch 1, 3 at batch 8."""
    root = Path(__file__).resolve().parents[1] / "configs"
    nmc = load_spec(root / "north_mini_code.yaml")
    plain = lower(nmc, 8, 8192, 132, max_gemv_k=1 << 20)
    ruled = lower(nmc, 8, 8192, 132)
    assert [(t.op, t.name, t.args) for t in plain.tasks] == [(t.op, t.name, t.args) for t in ruled.tasks]
    mixtral = load_spec(root / "mixtral_8x7b.yaml")
    for batch, parts in ((1, 2), (8, 3)):
        down = [t for t in lower(mixtral, batch, 4096, 132).tasks if t.op == Opcode.EXPERT_DOWN_SPLIT and t.layer == 0]
        assert len({t.arg("k0") for t in down}) == parts


def _odd_llama():
    """A tiny Llama whose reductions are not whole 64-column blocks: hidden size 96, 3 heads of 32
    with a KV head each (O-projection slices of 32 columns), intermediate 160."""
    spec = load_spec(Path(__file__).resolve().parents[1] / "configs" / "llama_tiny.yaml")
    att = dataclasses.replace(spec.attention, num_heads=3, num_kv_heads=3, head_dim=32)
    return dataclasses.replace(spec, hidden_size=96, dense_intermediate=160, attention=att)


@pytest.mark.parametrize("batch, max_k", [(1, 0), (3, 0), (2, 64)])
def test_ragged_k_matches_reference(batch, max_k):
    """Reductions off the 64-column blocks (hidden size 96, intermediate 160): the O-projection's
    slices start on whole blocks (two KV groups, then the last one), the kernel pads the rest
    (weights with zero columns, staged inputs with zeros); the logits are the dense reference's in
    random interleavings, and with the down projection also split along k (64 + 64 + 32 columns)."""
    spec = _odd_llama()
    w = random_weights(spec, seed=29, dtype=torch.float32, std=0.1)
    sc = schedule(lower(spec, batch, 64, 8, max_gemv_k=max_k), spec.name)
    o_proj = {(t.arg("k0"), t.arg("k")) for t in sc.tasks if "o_proj" in t.name and t.layer == 0}
    assert o_proj == {(0, 64), (64, 32)}
    if max_k:
        assert {(t.arg("k0"), t.arg("k")) for t in sc.tasks if t.name.startswith("L0.down")} == {
            (0, 64), (64, 64), (128, 32)}
    _matches_reference(sc, spec, w, batch, 70 + batch, f"ragged k, max_gemv_k {max_k}")
