"""The serving engine over the megakernel (``CudaBackend``) on a real GPU, tiny model, bf16:
the PyTorch prefill writes the cache the kernel's decode steps would have written, idle rows
leave the other slots alone, and continuous batching with preemption runs every request to the
end. Skips cleanly without a CUDA driver or GPU.

Tolerance: bf16 storage, fp32 accumulation on both sides, but the tensor-core prefill
(runtime/prefill.py: FastPrefill) and the kernel round at different points (the prefill keeps q/k
in float32 through RoPE, sums the experts in its own order), each a 2^-9 relative difference,
compounding over the 5 layers: 3e-2 relative per cache position (the budget of
tests/test_prefill_gpu.py) and of the largest logit. One position of the prompt may be further off:
its top-k routing flipped by a near-tie (MoE routing is not continuous).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from conftest import check_idle_rows_untouched, check_prefill_matches_decode, record_preemptions, run_engine

from mkc.ir.spec import load_spec
from mkc.runtime.engine import Engine
from mkc.runtime.sampling import SamplingParams
from mkc.runtime.tokenizer import ByteTokenizer
from mkc.runtime.weights import random_weights

pytestmark = pytest.mark.gpu

TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml"
CONTEXT = 64
RTOL = 3e-2


def bf16_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """A cache [G, n, D]: the second largest relative error of a position (one may flip its
    routing); logits [V]: the max error over the largest logit."""
    a, b = a.float().cpu(), b.float().cpu()
    if a.dim() == 1:
        return float((a - b).abs().max() / b.abs().max())
    per_position = (a - b).norm(dim=(0, 2)) / b.norm(dim=(0, 2)).clamp_min(1e-30)
    return float(per_position.sort(descending=True).values[1])


@pytest.fixture(scope="module")
def backend_factory():
    try:
        from mkc.runtime.cuda_backend import cuda_available
    except ImportError as e:
        pytest.skip(f"cuda backend unavailable: {e}")
    if not cuda_available():
        pytest.skip("no CUDA driver or GPU (cuInit failed)")
    from mkc.runtime.backends import CudaBackend

    spec = load_spec(TINY)
    w = random_weights(spec, seed=7, dtype=torch.bfloat16)
    return spec, lambda max_batch, **layout: CudaBackend(spec, w, max_batch=max_batch, context=CONTEXT, **layout)


# the megakernel over a paged cache: 8-position pages, every slot's context (plus the scratch page)
PAGED = {"page_size": 8, "kv_pages": 4 * CONTEXT // 8}


@pytest.mark.parametrize("layout", [{}, PAGED], ids=["slab", "paged"])
def test_cuda_prefill_matches_kernel_decode(backend_factory, layout):
    _spec, make = backend_factory
    check_prefill_matches_decode(make(4, **layout), RTOL, bf16_err)


@pytest.mark.parametrize("layout", [{}, PAGED], ids=["slab", "paged"])
def test_cuda_idle_rows_leave_other_slots_alone(backend_factory, layout):
    _spec, make = backend_factory
    check_idle_rows_untouched(make(4, **layout), torch.equal)


def test_cuda_engine_batches_and_preempts(backend_factory):
    spec, make = backend_factory
    tok = ByteTokenizer(spec.vocab_size)
    prompts = [[(i * 13 + j * 7) % 256 for j in range(5 + 3 * i)] for i in range(12)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    eng = Engine(make(8), tok)
    t0 = time.perf_counter()
    together = run_engine(eng, prompts, params)
    dt = time.perf_counter() - t0
    print(f"\n12 requests x 24 tokens, batch 8: {eng.steps} decode steps in {dt * 1e3:.0f} ms "
          f"({12 * 24 / dt:.0f} tok/s, engine + Python included)")
    for outs in together:
        assert outs[-1].finish_reason == "length" and outs[-1].completion_tokens == 24
    # one request alone in the batch decodes the same tokens as beside the others
    alone = run_engine(Engine(make(8), tok), [prompts[5]], params)[0]
    assert [t for o in alone for t in o.token_ids] == [t for o in together[5] for t in o.token_ids]
    tight = Engine(make(8), tok, page_size=8, kv_pages=CONTEXT // 8)
    preempted = record_preemptions(tight)
    squeezed = run_engine(tight, prompts, params)
    assert preempted, "the pool was large enough: preemption was not exercised"
    for outs in squeezed:
        assert outs[-1].finish_reason == "length" and outs[-1].completion_tokens == 24
