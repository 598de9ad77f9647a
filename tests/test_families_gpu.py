"""Every model family's tiny config on a real GPU: the megakernel against the CPU executor.

Both sides store activations in bf16 at the same points and accumulate in fp32, so one step
differs only by summation order: relative L2 error of the logits <= 1e-2 (as tests/test_gpu.py).
A round whose routing differs (a near-tie of router logits flipped by that rounding) is not
compared; every family must compare most rounds.
"""

import pytest
import torch
from conftest import ROOT, fill_random_kv

from mkc.ir.spec import load_spec
from mkc.schedule.plan import plan

FAMILIES = ["tiny", "qwen3_moe_tiny", "llama_tiny", "qwen3_tiny", "mixtral_tiny"]
REL_TOL = 1e-2  # bf16 storage at the same points, fp32 accumulation: summation order only


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def _routing(bufs, spec, i):
    return bufs[f"L{i}.moe_selected"].long().cpu().sort(-1).values


@pytest.mark.gpu
@pytest.mark.parametrize("fold", [False, True], ids=["residual-tiles", "residual-in-o-proj"])
@pytest.mark.parametrize("family", FAMILIES)
def test_family_step_matches_cpu_executor(family, fold):
    """The default lowering, and the O-projection tiles adding the residual (LowerOptions.
    residual_in_o_proj: a parallel block's whole residual, a sequential block's attention part)."""
    from mkc.runtime.cuda_backend import CudaDecoder
    from mkc.runtime.weights import random_weights
    from mkc.schedule.executor import CpuExecutor

    spec = load_spec(ROOT / "configs" / f"{family}.yaml")
    weights = random_weights(spec, seed=11, dtype=torch.float32, std=0.1)
    batch, context = 2, 24
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    sc = plan(spec, batch, context, sms, residual_in_o_proj=fold)
    dec = CudaDecoder(sc, spec, weights)
    ex = CpuExecutor(sc, spec, weights, dtype=torch.bfloat16, poison_weights=False)
    gen = torch.Generator().manual_seed(5)
    compared = 0
    rounds = [0, 5, 9, 23]
    for base in rounds:
        positions = torch.tensor([base, max(0, base - 4)], dtype=torch.int32)
        tokens = torch.randint(0, spec.vocab_size, (batch,), generator=gen, dtype=torch.int32)
        fill_random_kv(spec, gen, ex, dec)
        lg, _ = dec.step(tokens, positions)
        lc, _ = ex.step(tokens, positions)
        moe = [i for i, ls in enumerate(spec.layers) if ls.mlp == "moe"]
        if any(not torch.equal(_routing(dec.buffers, spec, i), _routing(ex.bufs, spec, i)) for i in moe):
            continue
        compared += 1
        err = _rel(lg.cpu(), lc)
        assert err <= REL_TOL, f"{family} positions {positions.tolist()}: logits rel err {err:.3g} > {REL_TOL}"
    assert compared >= len(rounds) - 1, f"{family}: only {compared} of {len(rounds)} rounds had the same routing"
    dec.close()
