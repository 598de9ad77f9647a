"""Paged KV cache (``--page-size``): the lowering's pool and page table, and the CPU executor
reading and appending through an arbitrary page table exactly as through contiguous slabs."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mkc.ir.kv_layout import identity_page_table, logical_view, pages_per_seq
from mkc.ir.lower import lower
from mkc.ir.ops import Opcode
from mkc.ir.spec import SpecError, load_spec
from mkc.runtime.weights import random_weights
from mkc.schedule.executor import CpuExecutor
from mkc.schedule.scheduler import schedule
from mkc.schedule.validator import validate

TINY = "configs/tiny.yaml"


@pytest.fixture(scope="module")
def spec():
    base = load_spec(TINY)  # a window of 8 positions: the sliding layers cross pages as they move
    return dataclasses.replace(base, attention=dataclasses.replace(base.attention, sliding_window=40))


@pytest.fixture(scope="module")
def weights(spec):
    return random_weights(spec, seed=3)


def test_pool_and_page_table_buffers(spec):
    prog = lower(spec, batch=2, context=100, num_sms=8, page_size=16)
    a = spec.attention
    assert prog.buffers["page_table"].shape == (2, pages_per_seq(100, 16)) == (2, 7)
    assert prog.buffers["L0.k_cache"].shape == (a.num_kv_heads, 14, 16, a.head_dim)
    for t in prog.tasks:
        if t.op in (Opcode.ROPE_APPEND, Opcode.ATTN_SPLIT):
            assert t.operand("page_table") == "page_table"
    contiguous = lower(spec, batch=2, context=100, num_sms=8)
    assert "page_table" not in contiguous.buffers
    assert contiguous.buffers["L0.k_cache"].shape == (2, a.num_kv_heads, 100, a.head_dim)


@pytest.mark.parametrize("page_size", [-1, 101])
def test_bad_page_size(spec, page_size):
    with pytest.raises(SpecError, match="--page-size"):
        lower(spec, batch=1, context=100, num_sms=8, page_size=page_size)


def test_paged_schedule_validates(spec):
    sc = schedule(lower(spec, batch=2, context=64, num_sms=8, page_size=8), spec.name)
    assert validate(sc) == []


def test_identity_view_is_the_pool():
    pool = torch.zeros(2, 6, 4, 3)  # kv_heads 2, 6 pages of 4 positions, head_dim 3: batch 2, context 10
    view = logical_view(pool, batch=2, context=10, page_size=4)
    assert view.shape == (2, 2, 10, 3)
    view[1, 0, 9] = 1.0  # sequence 1, position 9: its page 2 is page 3 + 2, row 1
    assert identity_page_table(2, 10, 4)[1, 2] == 5 and pool[0, 5, 1].eq(1.0).all()


@pytest.mark.parametrize("page_size", [8, 12])
def test_shuffled_pages_match_contiguous(spec, weights, page_size):
    """The same steps through slabs and through a shuffled page table (pages of both sequences
    interleaved, a last page part-used when the page size does not divide the context) give the
    same logits and tokens, bit for bit: every task reads and writes the same values."""
    batch, ctx, prefix = 2, 60, [21, 35]
    flat = CpuExecutor(schedule(lower(spec, batch, ctx, 8), spec.name), spec, weights)
    paged = CpuExecutor(schedule(lower(spec, batch, ctx, 8, page_size=page_size), spec.name), spec, weights)
    n = pages_per_seq(ctx, page_size)
    perm = torch.randperm(batch * n, generator=torch.Generator().manual_seed(0)).to(torch.int32)
    paged.bufs["page_table"].copy_(perm.view(batch, n))
    a = spec.attention
    gen = torch.Generator().manual_seed(1)
    for b, m in enumerate(prefix):
        for layer in range(spec.num_layers):
            k = torch.randn(m, a.num_kv_heads, a.head_dim, generator=gen)
            v = torch.randn(m, a.num_kv_heads, a.head_dim, generator=gen)
            flat.write_kv(b, layer, k, v)
            paged.write_kv(b, layer, k, v)
    tokens = torch.tensor([5, 9])
    for step in range(10):  # positions cross page boundaries of both sizes
        pos = [m + step for m in prefix]
        lf, tf = flat.step(tokens, pos, seed=step)
        lp, tp = paged.step(tokens, pos, seed=step + 100)
        assert torch.equal(lf, lp), f"step {step}: paged logits differ by {(lf - lp).abs().max():.3g}"
        assert torch.equal(tf, tp)
        tokens = tf
    # the appended keys landed where the table says
    for b, m in enumerate(prefix):
        last = m + 9
        page, row = int(paged.bufs["page_table"][b, last // page_size]), last % page_size
        assert torch.equal(paged.bufs["L1.k_cache"][:, page, row], flat.bufs["L1.k_cache"][b, :, last])


def test_identity_views_of_a_paged_cache(spec, weights):
    """The GPU tests fill a decoder's cache through its kv_cache() views (conftest.fill_random_kv);
    through the identity page table of a paged executor those views land where its steps read."""
    from conftest import fill_random_kv

    flat = CpuExecutor(schedule(lower(spec, 2, 40, 8), spec.name), spec, weights)
    paged = CpuExecutor(schedule(lower(spec, 2, 40, 8, page_size=16), spec.name), spec, weights)
    fill_random_kv(spec, torch.Generator().manual_seed(2), flat, paged)
    for layer in range(spec.num_layers):
        assert torch.equal(flat.kv_cache(layer)[0], paged.kv_cache(layer)[0].float())
    tokens, pos = torch.tensor([7, 8]), [33, 17]
    assert torch.equal(flat.step(tokens, pos)[0], paged.step(tokens, pos)[0])


@pytest.mark.gpu
def test_gpu_paged_step_matches_cpu_executor(spec, weights):
    """The megakernel with a paged cache under a shuffled page table against the CPU executor with
    the same table: steps whose positions cross page boundaries (pages of 8, context 40), so chunks
    of the attention splits end at pages. Tolerance as tests/test_gpu.py's REL_TOL (bf16 storage at
    the same points, fp32 accumulation: summation order only)."""
    from mkc.runtime.cuda_backend import CudaDecoder

    rel_tol = 1e-2
    batch, ctx, page = 2, 40, 8
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    sc = schedule(lower(spec, batch, ctx, min(sms, 16), page_size=page), spec.name)
    w = {k: v.float() for k, v in weights.items()}
    dec = CudaDecoder(sc, spec, w)
    ex = CpuExecutor(sc, spec, w, dtype=torch.bfloat16)
    n = pages_per_seq(ctx, page)
    table = torch.randperm(batch * n, generator=torch.Generator().manual_seed(5)).to(torch.int32).view(batch, n)
    ex.bufs["page_table"].copy_(table)
    dec.buffers["page_table"].copy_(table)
    a = spec.attention
    gen = torch.Generator().manual_seed(6)
    for layer in range(spec.num_layers):
        for b in range(batch):
            k = torch.randn(ctx, a.num_kv_heads, a.head_dim, generator=gen)
            v = torch.randn(ctx, a.num_kv_heads, a.head_dim, generator=gen)
            ex.write_kv(b, layer, k, v)
        for name in ("k_cache", "v_cache"):
            dec.buffers[f"L{layer}.{name}"].copy_(ex.bufs[f"L{layer}.{name}"])
    tokens = torch.tensor([3, 11], dtype=torch.int32)
    compared = 0
    for base in (6, 7, 8, 15, 16, 30, 39):
        positions = torch.tensor([base, max(0, base - 9)], dtype=torch.int32)
        lg, _ = dec.step(tokens, positions)
        lc, _ = ex.step(tokens, positions)
        if not all(torch.equal(dec.buffers[f"L{i}.moe_selected"].cpu().sort(-1).values,
                               ex.bufs[f"L{i}.moe_selected"].sort(-1).values)
                   for i, ls in enumerate(spec.layers) if ls.mlp == "moe"):
            continue  # a routing near-tie between bf16 runs: tests/test_gpu.py checks those
        err = float((lg.cpu().double() - lc.double()).norm() / lc.double().norm())
        assert err <= rel_tol, f"positions {positions.tolist()}: logits rel err {err:.3g} > {rel_tol}"
        for layer in range(spec.num_layers):
            for name in ("k_cache", "v_cache"):
                got, want = dec.buffers[f"L{layer}.{name}"].cpu().float(), ex.bufs[f"L{layer}.{name}"].float()
                e = float((got - want).norm() / want.norm())
                assert e <= rel_tol, f"positions {positions.tolist()}: layer {layer} {name} rel err {e:.3g}"
        compared += 1
    assert compared >= 4, f"only {compared} of 7 steps compared (routing near-ties)"
