"""Weights in tile order (mkc/codegen/weight_tiles.py): the reordering, the addresses the kernel
computes into it, which buffers are reordered, and the checks that refuse what cannot be."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from mkc.codegen.render import CodegenError, CodegenOptions, kernel_config
from mkc.codegen.taskwords import DTYPE_CODES, buffer_table, encode
from mkc.codegen.weight_tiles import from_tiles, padded_weights, tile_offset, tiled_weights, to_tiles
from mkc.ir.lower import lower
from mkc.ir.ops import OP_INFO, Opcode
from mkc.ir.spec import load_spec
from mkc.schedule.scheduler import schedule

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.yaml"
NMC = ROOT / "configs" / "north_mini_code.yaml"


def test_round_trip_keeps_shape_and_values():
    w = torch.randn(3, 48, 192).to(torch.bfloat16)
    p = to_tiles(w)
    assert p.shape == w.shape and p.dtype == w.dtype and p.is_contiguous()
    assert not torch.equal(p, w)  # really reordered
    assert torch.equal(from_tiles(p), w)
    assert torch.equal(from_tiles(to_tiles(w[1])), w[1])


def test_reordering_moves_every_bit_pattern_as_the_element_order_does():
    """to_tiles / from_tiles move a bf16 or e4m3 weight in runs of 8 elements viewed as one wide
    element (weight_tiles._wide): every bit pattern, NaNs and subnormals included, lands where the
    element-by-element order (an int64 copy of the same values) puts it, and comes back unchanged."""
    from mkc.codegen.weight_tiles import from_tiles_fp8, to_tiles_fp8

    bits = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).reshape(2, 32, 1024)
    tiled = to_tiles(bits.view(torch.bfloat16)).view(torch.int16)
    assert torch.equal(tiled, to_tiles(bits.to(torch.int64)).to(torch.int16))
    assert torch.equal(from_tiles(tiled.view(torch.bfloat16)).view(torch.int16), bits)
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(64).reshape(16, 1024)
    tiled8 = to_tiles_fp8(codes.view(torch.float8_e4m3fn)).view(torch.uint8)
    assert torch.equal(tiled8, to_tiles_fp8(codes.to(torch.int64)).to(torch.uint8))
    assert torch.equal(from_tiles_fp8(tiled8.view(torch.float8_e4m3fn)).view(torch.uint8), codes)


def test_kernel_addresses_read_the_right_elements():
    """gemv.cuh's group_rows / block_stride / half_offset in tile order: lane l of group G reads
    piece j of block kb at G * 16 * K + kb * 1024 + l * 8 (+ 256 for the second 32 columns, + 512
    for rows g + 8): the row-major pieces W[16 G + g (+ 8), 64 kb + 8 q (+ 32) : + 8]."""
    R, K = 32, 192
    w = torch.arange(R * K, dtype=torch.int64).reshape(R, K)
    flat = to_tiles(w).reshape(-1)
    for G in range(R // 16):
        for kb in range(K // 64):
            for lane in range(32):
                g, q = divmod(lane, 4)
                w0 = G * 16 * K + lane * 8
                for hi in (0, 1):
                    for half in (0, 1):
                        at = w0 + 512 * hi + kb * 1024 + 256 * half
                        row, col = 16 * G + g + 8 * hi, 64 * kb + 32 * half + 8 * q
                        assert torch.equal(flat[at:at + 8], w[row, col:col + 8]), (G, kb, lane, hi, half)


def test_tile_offset_matches_the_reordering():
    """ops.cuh's tile_order_offset (the embedding lookup) is weight_tiles.tile_offset: both find
    every element (the kernel's every 8-element chunk; its expression read from the template and
    evaluated with C's integer division) where to_tiles put it."""
    import re

    from mkc.codegen.render import TEMPLATE_DIR

    src = (TEMPLATE_DIR / "ops.cuh").read_text()
    body = re.search(r"size_t tile_order_offset\(int row, int col, int k\) \{(.*?)\n\}", src, re.DOTALL).group(1)
    rr, cc = re.search(r"const int rr = (.+?), cc = (.+?);", body).groups()
    ret = re.search(r"return (.+?);", body, re.DOTALL).group(1)

    def c_expr(e: str) -> str:  # non-negative ints: C's / and % are Python's // and %
        return " ".join(e.replace("(size_t)", "").split()).replace("/", "//")

    kernel = eval(f"lambda row, col, k: (lambda rr, cc: {c_expr(ret)})({c_expr(rr)}, {c_expr(cc)})")
    R, K = 48, 128
    w = torch.arange(R * K, dtype=torch.int64).reshape(R, K)
    flat = to_tiles(w).reshape(-1)
    for r in range(R):
        for c in range(K):
            assert int(flat[tile_offset(r, c, K)]) == int(w[r, c]), (r, c)
            if c % 8 == 0:
                at = kernel(r, c, K)
                assert torch.equal(flat[at:at + 8], w[r, c:c + 8]), ("ops.cuh", r, c)


def test_the_gemv_weights_are_tiled_and_only_they():
    spec = load_spec(NMC)
    sc = schedule(lower(spec, 1, 8192, 132), spec.name)
    names = tiled_weights(sc)
    assert "embed" in names, "the embedding is tied to the LM head, a GEMV weight"
    assert any("expert" in n or "moe" in n for n in names), sorted(names)[:10]
    assert all(sc.buffers[n].kind == "weight" and len(sc.buffers[n].shape) >= 2 for n in names)
    assert not any(n.endswith("norm") for n in names)
    assert kernel_config(sc, spec, CodegenOptions(weight_layout="tiles")).weights_tiled
    assert kernel_config(sc, spec).weights_tiled, "the default ('auto') takes tile order where it can"
    assert not kernel_config(sc, spec, CodegenOptions(weight_layout="rows")).weights_tiled


def test_buffer_table_marks_tiled_weights():
    spec = load_spec(TINY)
    sc = schedule(lower(spec, 2, 16, 8), spec.name)
    words = encode(sc)
    tiled = tiled_weights(sc)
    table = buffer_table(sc, words.buffer_names, dict.fromkeys(words.buffer_names, 0), tiled)
    for i, n in enumerate(words.buffer_names):
        want = "bf16_tiles" if n in tiled else sc.buffers[n].dtype
        assert table[i]["dtype"] == DTYPE_CODES[want], n


def test_rows_off_the_blocks_are_padded_and_a_tile_off_a_block_is_refused():
    """A weight whose rows are not whole 16-row blocks (a tied LM head of 520 rows; Mixtral's router,
    8) is stored with zero rows, so tile order holds and the buffer table has the stored shape; a GEMV
    tile starting off a block cannot read tile order: asked for, an error naming the task; by
    default the kernel falls back to rows."""
    spec = load_spec(TINY)
    odd = dataclasses.replace(spec, vocab_size=520)  # the tied LM head: 520 rows
    sc = schedule(lower(odd, 2, 16, 8), odd.name)
    assert padded_weights(sc) == {"embed": (520, odd.hidden_size)}
    assert kernel_config(sc, odd).weights_tiled
    words = encode(sc)
    table = buffer_table(sc, words.buffer_names, dict.fromkeys(words.buffer_names, 0), tiled_weights(sc))
    assert tuple(table[words.buffer_names.index("embed")]["shape"][-2:]) == (528, odd.hidden_size)
    i = next(i for i, t in enumerate(sc.tasks) if t.op == Opcode.LINEAR)
    t = sc.tasks[i]
    args = list(t.args)
    args[OP_INFO[t.op].args.index("row0")] += 8
    sc.tasks[i] = dataclasses.replace(t, args=tuple(args))
    assert not kernel_config(sc, odd).weights_tiled
    with pytest.raises(CodegenError, match=r"row0 = \d+: tile-ordered weights need tiles starting at multiples of 16"):
        kernel_config(sc, odd, CodegenOptions(weight_layout="tiles"))
    with pytest.raises(CodegenError, match="weight_layout"):
        kernel_config(sc, odd, CodegenOptions(weight_layout="columns"))


def test_logical_weights_read_tiled_buffers_row_major():
    """What the CUDA backend's prefill reads: tile-ordered buffers reordered back on access (an
    expert stack one expert at a time), the others as they are."""
    from mkc.runtime.cuda_backend import LogicalWeights

    dense, stack, norm = torch.randn(32, 128), torch.randn(4, 16, 64), torch.randn(128)
    bufs = {"a": to_tiles(dense), "s": to_tiles(stack), "n": norm, "act": torch.zeros(3)}
    w = LogicalWeights(bufs, ["a", "s", "n"], frozenset({"a", "s"}))
    assert sorted(w) == ["a", "n", "s"] and len(w) == 3
    assert torch.equal(w["a"], dense) and w["n"] is norm
    assert all(torch.equal(w["s"][e], stack[e]) for e in range(4))
    with pytest.raises(KeyError):
        w["act"]


def test_tile_ordered_in_place_reorders_and_restores():
    """The bench's way to hold the weights once: reordered in their own storage inside the block
    (a decoder takes TiledWeights as they are), row-major again after it, also after an error."""
    from mkc.codegen.weight_tiles import TiledWeights, tile_ordered_in_place

    w = {"a": torch.randn(32, 128), "s": torch.randn(2, 16, 64), "n": torch.randn(128)}
    before = {k: v.clone() for k, v in w.items()}
    storage = w["a"].data_ptr()
    with tile_ordered_in_place(w, ["a", "s", "missing"]) as tw:
        assert isinstance(tw, TiledWeights) and tw.tiled == {"a", "s"}
        assert tw["a"].data_ptr() == storage and torch.equal(tw["a"], to_tiles(before["a"]))
        assert torch.equal(tw["s"], to_tiles(before["s"])) and torch.equal(tw["n"], before["n"])
    assert all(torch.equal(w[k], before[k]) for k in w)
    with pytest.raises(RuntimeError, match="boom"), tile_ordered_in_place(w, ["a"]):
        raise RuntimeError("boom")
    assert torch.equal(w["a"], before["a"])


def _odd_llama():
    """A tiny Llama whose reductions are not whole 64-column blocks (hidden size 96, intermediate 160)."""
    spec = load_spec(ROOT / "configs" / "llama_tiny.yaml")
    att = dataclasses.replace(spec.attention, num_heads=3, num_kv_heads=3, head_dim=32)
    return dataclasses.replace(spec, hidden_size=96, dense_intermediate=160, attention=att)


@pytest.mark.parametrize("tiled", [True, False])
def test_padded_weights_compute_what_the_logical_ones_do(tiled):
    """A weight whose K is not whole 64-column blocks is stored with zero columns up to them (in
    tile order or not): the GEMV over whole blocks, its input staged with zeros past k, gives the
    logical product exactly, and logical_weight recovers the weight. Rows off the 16-row blocks
    (Mixtral's router, 8 rows) are stored with zero rows: the first rows' products are the logical ones."""
    from mkc.codegen.weight_tiles import logical_weight, pad_to_blocks, stored_weight

    w, x = torch.randn(2, 48, 160), torch.randn(3, 160)
    stored = stored_weight(w, tiled=tiled, padded=True)
    assert stored.shape == (2, 48, 192)
    rows = from_tiles(stored) if tiled else stored
    assert torch.equal(rows[..., 160:], torch.zeros(2, 48, 32))
    xs = torch.nn.functional.pad(x, (0, 32))  # the staged input: zeros past k
    assert torch.equal(xs @ rows[1].T, x @ w[1].T)
    assert torch.equal(logical_weight(stored, tiled, (48, 160)), w)
    assert pad_to_blocks(w[..., :128]).data_ptr() == w[..., :128].data_ptr()  # whole blocks: as it is
    router = torch.randn(8, 128)
    stored = stored_weight(router, tiled=tiled, padded=True)
    rows = from_tiles(stored) if tiled else stored
    assert stored.shape == (16, 128) and torch.equal(rows[8:], torch.zeros(8, 128))
    assert torch.equal((x[:, :128] @ rows.T)[:, :8], x[:, :128] @ router.T)
    assert torch.equal(logical_weight(stored, tiled, (8, 128)), router)


def test_padded_weights_are_the_ragged_gemv_weights():
    """Which weights are padded (every GEMV weight whose K is off the blocks: hidden size 96 and
    intermediate 160), their padded shape in the kernel's buffer table, tile order still possible
    on the padded shapes, and the CUDA backend's logical view without the zero columns."""
    from mkc.codegen.weight_tiles import stored_weight
    from mkc.runtime.cuda_backend import LogicalWeights

    spec = _odd_llama()
    sc = schedule(lower(spec, 2, 16, 8), spec.name)
    padded = padded_weights(sc)
    assert padded == {"lm_head": tuple(sc.buffers["lm_head"].shape), **{
        f"L{i}.{n}": tuple(sc.buffers[f"L{i}.{n}"].shape) for i in range(3) for n in ("w_qkv", "w_o", "w_gate_up", "w_down")}}
    assert {k for _, k in padded.values()} == {96, 160}
    cfg = kernel_config(sc, spec)
    assert cfg.weights_tiled and cfg.k_padded and cfg.gemv_max_k == 192
    words = encode(sc)
    table = buffer_table(sc, words.buffer_names, dict.fromkeys(words.buffer_names, 0), tiled_weights(sc))
    for i, n in enumerate(words.buffer_names):
        want = (*sc.buffers[n].shape[:-1], 192 if padded[n][1] == 160 else 128) if n in padded else sc.buffers[n].shape
        assert tuple(table[i]["shape"][-len(want):]) == tuple(want), n
    head, down = torch.randn(512, 96), torch.randn(96, 160)
    bufs = {"lm_head": stored_weight(head, True, True), "L0.w_down": stored_weight(down, False, True)}
    lw = LogicalWeights(bufs, ["lm_head", "L0.w_down"], frozenset({"lm_head"}), padded)
    assert torch.equal(lw["lm_head"], head) and torch.equal(lw.matrix("L0.w_down"), down)
    ids = torch.tensor([3, 17, 500])
    assert torch.equal(lw.rows("lm_head", ids), head[ids])
