"""The CPU serving backend on the tiny model: the PyTorch prefill writes the cache token-by-token
decoding would have written, idle rows leave every other slot alone, and the engine over it
generates what the executor alone generates, with or without preemption.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import (
    check_idle_rows_untouched,
    check_prefill_matches_decode,
    max_err,
    record_preemptions,
    rel_err,
    run_engine,
)

from mkc.ir.spec import load_spec
from mkc.runtime.backends import CpuBackend
from mkc.runtime.engine import Engine
from mkc.runtime.generate import greedy_generate
from mkc.runtime.sampling import SamplingParams
from mkc.runtime.tokenizer import ByteTokenizer
from mkc.runtime.weights import random_weights

TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml"
CONTEXT = 64
# float32 throughout; the prefill sums in a different order than the tiled decode (one matmul vs
# split-K partials), so caches and logits agree to float32 rounding, not bitwise
ATOL = 1e-5


@pytest.fixture(scope="module")
def model():
    spec = load_spec(TINY)
    return spec, random_weights(spec, seed=7)


# bf16: the prefill (one matmul over the prompt) and the tiled decode sum in different orders, so a
# stored K/V element may round to a neighbouring bf16 value, and layer by layer those ulps (2^-8
# relative) compound: on CPUs whose bf16 GEMMs round intermediate results (AVX512-BF16 / AMX) a
# single element of layer 3 differed by 6 ulps (2.3e-2, torch 2.11 on the H200 host). Compared as
# the GPU tests compare bf16 runs: relative error of the whole tensor, 1e-2 (tests/test_gpu.py).
BF16_RTOL = 1e-2


# a paged cache of 8-position pages: enough for every slot (the scratch page comes on top)
PAGED = {"page_size": 8, "kv_pages": 4 * CONTEXT // 8}


@pytest.mark.parametrize("layout", [{}, PAGED], ids=["slab", "paged"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_matches_token_by_token_decode(model, dtype, layout):
    spec, w = model
    tol, err_fn = (ATOL, max_err) if dtype == torch.float32 else (BF16_RTOL, rel_err)
    be = CpuBackend(spec, w, max_batch=4, context=CONTEXT, dtype=dtype, **layout)
    ids, logits_prefill = check_prefill_matches_decode(be, tol, err_fn)
    # a prefill that starts after a cached prefix gives the same logits
    be.prefill(3, ids[:16])
    err = err_fn(be.prefill(3, ids[16:], 16), logits_prefill)
    assert err < tol, f"prefix + rest: error {err:.2e} > {tol:.0e}"


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    # never-written cache positions hold NaN poison, and NaN != NaN: compare the bits
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.mark.parametrize("layout", [{}, PAGED], ids=["slab", "paged"])
def test_idle_rows_leave_other_slots_alone(model, layout):
    spec, w = model
    be = CpuBackend(spec, w, max_batch=4, context=CONTEXT, batches=[4], **layout)  # one step decoder
    alone = check_idle_rows_untouched(be, _same_bits)
    # the same row computed beside busy rows gives bit-identical logits
    together = be.decode([0, 1, 3], [4, 9, 5], [5, 6, 8])
    assert torch.equal(together[1], alone[0])


def test_idle_rows_position_zero_saved_and_restored_in_one_dense_copy(model, monkeypatch):
    """A slab step with idle rows saves their position-0 K/V before the step and puts it back after,
    one ``_foreach_copy_`` each way for all idle rows, over 1-D contiguous views on both sides (a
    [D] view per KV head): what CUDA's one-launch multi-tensor copy asks, where [G, D] views of
    position 0 are not dense and fall back to a copy per tensor. The step does write those
    positions (the dummy token at position 0); after it they hold exactly what they held."""
    spec, w = model
    be = CpuBackend(spec, w, max_batch=4, context=CONTEXT, batches=[4])
    for s in range(4):
        be.prefill(s, [s + 1] * (5 + s))
    idle = [0, 2, 3]

    def first() -> list[torch.Tensor]:  # position 0 of the idle rows, every layer's k and v
        return [t[row, :, 0].clone() for row in idle for kv in be._kv for t in kv]

    before = first()
    copies: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []
    real_copy, step = torch._foreach_copy_, be.decoder.step
    during: list[list[torch.Tensor]] = []  # position 0 right after the step, before it is put back

    def record_step(tokens, positions):
        out = step(tokens, positions)
        during.append(first())
        return out

    monkeypatch.setattr(torch, "_foreach_copy_", lambda dst, src: (copies.append((dst, src)), real_copy(dst, src)))
    monkeypatch.setattr(be.decoder, "step", record_step)
    be.decode([1], [9], [6])
    assert len(copies) == 2, f"{len(copies)} multi-tensor copies: expected one to save and one to restore"
    views = len(idle) * 2 * spec.num_layers * spec.attention.num_kv_heads
    for dst, src in copies:
        assert len(dst) == len(src) == views
        for t in (*dst, *src):
            assert t.dim() == 1 and t.is_contiguous() and t.numel() == spec.attention.head_dim
    assert any(not torch.equal(a, b) for a, b in zip(during[0], before, strict=True)), "the step wrote no position 0"
    for a, b in zip(first(), before, strict=True):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.mark.parametrize("layout", [{}, PAGED], ids=["slab", "paged"])
def test_steps_run_the_smallest_decoder_over_one_cache(model, layout):
    """Step decoders of batch 1, 2 and 4 share one KV cache: a step runs the smallest that holds
    its slots (a slab moves a slot's cache into a row of that batch when needed), other slots'
    caches stay as they were, and the logits are those of the batch-4 decoder alone (float32:
    the schedules split the sums differently, ATOL as above)."""
    spec, w = model
    be = CpuBackend(spec, w, max_batch=4, context=CONTEXT, **layout)
    ref = CpuBackend(spec, w, max_batch=4, context=CONTEXT, batches=[4], **layout)
    assert be.step_batches == [1, 2, 4] and ref.step_batches == [4]
    ran: list[int] = []
    for b, dec, _ in be._steppers:
        step = dec.step
        dec.step = lambda t, p, b=b, step=step: (ran.append(b), step(t, p))[1]  # type: ignore[method-assign]
    length = [5 + s for s in range(4)]  # positions each slot holds
    for x in (be, ref):
        for s in range(4):
            x.prefill(s, [s + 1] * length[s])
    for slots, want_batch in (([3], 1), ([2, 0], 2), ([1, 3, 2], 4), ([3], 1), ([1, 2], 2)):
        before = {s: be.read_kv(s, 0, length[s]) for s in range(4) if s not in slots}
        positions = [length[s] for s in slots]
        got = be.decode(slots, [7] * len(slots), positions)
        want = ref.decode(slots, [7] * len(slots), positions)
        for s in slots:
            length[s] += 1
        assert ran[-1] == want_batch, f"slots {slots}: ran batch {ran[-1]}, expected {want_batch}"
        assert max_err(got, want) < ATOL
        for s, kv in before.items():
            assert _same_bits(be.read_kv(s, 0, length[s]), kv), f"slot {s} changed by a step it was not in"
    for s in range(4):
        assert max_err(be.read_kv(s, 0, length[s]), ref.read_kv(s, 0, length[s])) < ATOL


def _engine_tokens(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    outs = run_engine(engine, prompts, params, max_steps=500)
    return [[t for o in out for t in o.token_ids] for out in outs]


def test_engine_matches_executor_and_survives_preemption(model):
    spec, w = model
    prompts = [[(i * 13 + j * 7) % 256 for j in range(5 + 3 * i)] for i in range(5)]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    tok = ByteTokenizer(spec.vocab_size)
    want = [greedy_generate(spec, w, p, 20, context=CONTEXT) for p in prompts]
    ample = Engine(CpuBackend(spec, w, max_batch=3, context=CONTEXT), tok)
    assert _engine_tokens(ample, prompts, params) == want
    # one context's worth of pages for three slots: requests must take turns
    tight = Engine(CpuBackend(spec, w, max_batch=3, context=CONTEXT), tok, page_size=8, kv_pages=CONTEXT // 8)
    preempted = record_preemptions(tight)
    assert _engine_tokens(tight, prompts, params) == want
    assert preempted, "the pool was large enough: preemption was not exercised"


def test_slab_prefix_cache_copies_give_the_same_tokens(model):
    """Slab layout: a prompt sharing two pages with an earlier one starts its prefill past them,
    from KV copied out of the earlier slot and written back into another (read_kv_pages /
    write_kv_pages), and decodes the same greedy tokens as alone."""
    spec, w = model
    shared = [(j * 11) % 256 for j in range(18)]
    prompts = [shared + [1, 2, 3], shared + [4, 5]]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    want = [greedy_generate(spec, w, p, 12, context=CONTEXT) for p in prompts]
    be = CpuBackend(spec, w, max_batch=2, context=CONTEXT)
    starts: list[int] = []
    layers = be.prefill_layers
    be.prefill_layers = lambda slot, ids, start, **kw: (starts.append(start), layers(slot, ids, start, **kw))[1]  # type: ignore[method-assign]
    eng = Engine(be, ByteTokenizer(spec.vocab_size), page_size=8)
    got = [_engine_tokens(eng, [p], params)[0] for p in prompts]
    assert starts == [0, 16]
    assert got == want


def test_a_prefill_in_flight_follows_its_slot_to_another_row(model):
    """Slab: a decode step between two layers of a prefill chunk may move the prefilling slot to
    another row (a smaller step batch needs the streams' rows below it). The rest of the chunk
    must follow the slot: it wrote into the row of the stream moved there, and both requests'
    tokens changed."""
    spec, w = model
    tok = ByteTokenizer(spec.vocab_size)
    prompts = {"a": list(range(10, 20)), "b": list(range(30, 40)), "d": list(range(50, 62)),
               "c": [(i * 37) % 500 for i in range(30)]}
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    want = {k: greedy_generate(spec, w, p, 30, context=CONTEXT) for k, p in prompts.items() if k != "b"}
    # a budget of no time: a prefill runs one layer a step while others decode
    eng = Engine(CpuBackend(spec, w, max_batch=4, context=CONTEXT), tok, prefill_chunk=8, prefill_budget=1e-9)
    got: dict[str, list[int]] = {k: [] for k in prompts}
    for k in "abd":
        eng.submit(prompts[k], params, lambda o, k=k: got[k].extend(o.token_ids), request_id=k)
    for _ in range(100):  # every prompt prefilled, a layer a step
        if len(eng._running) == 3:
            break
        eng.step()
    # b (slot 1, row 1) leaves and c takes its slot in the same step; the step's batch of two then
    # swaps d (row 2) into row 1, while c's first chunk is still in flight
    eng.abort("b")
    eng.submit(prompts["c"], params, lambda o: got["c"].extend(o.token_ids), request_id="c")
    eng.step()
    assert eng.backend._row[1] == 2 and any(r.id == "c" and r.steps is not None for r in eng._prefilling), \
        "the interleaving did not move the prefilling slot: the test does not exercise it"
    while eng.has_work():
        eng.step()
    assert {k: got[k] for k in want} == want


def test_engine_over_a_paged_cache_of_the_engines_size(model):
    """The backend's pool is exactly the engine's pages (plus the scratch page): the engine's
    accounting keeps the pool from running out; prefix-cache hits share pages by reference (never
    a copy); the tokens are those of the executor, through preemption; every page ends free or held
    by the prefix cache."""
    spec, w = model
    shared = [(j * 5) % 256 for j in range(17)]  # two full 8-position pages every prompt shares
    prompts = [shared + [(i * 13 + j * 7) % 256 for j in range(2 + 3 * i)] for i in range(5)]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    tok = ByteTokenizer(spec.vocab_size)
    want = [greedy_generate(spec, w, p, 20, context=CONTEXT) for p in prompts]
    pages = CONTEXT // 8 + 2
    be = CpuBackend(spec, w, max_batch=3, context=CONTEXT, page_size=8, kv_pages=pages)
    assert be.pages is not None and be.pages.scratch == pages and be.shares_pages
    eng = Engine(be, tok, page_size=8, kv_pages=pages)
    preempted = record_preemptions(eng)
    attached: list[int] = []  # prefix-cache pages given to a slot, by page index
    attach = be.attach_page
    be.attach_page = lambda slot, i, page: (attached.append(i), attach(slot, i, page))[1]  # type: ignore[method-assign]
    be.write_kv_pages = be.read_kv_pages = None  # type: ignore[assignment,method-assign]  # no copies
    assert _engine_tokens(eng, prompts, params) == want
    assert preempted, "the pool was large enough: preemption was not exercised"
    assert 1 in attached, "no request reused the shared prompt pages from the prefix cache"
    cached = list(eng.cache.pages.values()) if eng.cache is not None else []
    assert sorted(be.pages.free + cached) == list(range(pages)), "a page leaked or is held twice"
    assert all(be.pages.refs[p] == 1 for p in cached) and not any(be.pages.held)


def test_page_pool_exhaustion_is_a_clear_error(model):
    spec, w = model
    be = CpuBackend(spec, w, max_batch=2, context=CONTEXT, page_size=8, kv_pages=2)
    with pytest.raises(RuntimeError, match="KV page pool exhausted: slot 0 needs 3 more pages"):
        be.prefill(0, list(range(20)))
