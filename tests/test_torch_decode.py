"""The PyTorch baseline decode step (bench baseline, GPU reference) and the SOL byte count."""

import pytest
import torch

from mkc.ir.spec import load_spec
from mkc.runtime.bench import step_bytes
from mkc.runtime.reference import DenseReference
from mkc.runtime.torch_decode import TorchDecoder
from mkc.runtime.weights import random_weights


def test_baseline_matches_dense_reference():
    spec = load_spec("configs/tiny.yaml")
    w = random_weights(spec, 0, torch.float32)
    ref, dec = DenseReference(spec, w), TorchDecoder(spec, w, batch=2, context=32, dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    for pos in range(20):  # past the window of 8
        tokens = torch.randint(0, spec.vocab_size, (2,), generator=g)
        positions = torch.tensor([pos, max(0, pos - 3)])  # sequence 1 rewrites position 0 at first
        a, b = ref.step(tokens, positions), dec.step(tokens, positions)
        # float32 both sides, same math in a different order: rounding only (~1e-7 relative)
        err = (a - b).abs().max().item()
        assert err < 1e-5, f"step {pos}: max error {err:.3g} > budget 1e-5"


def test_sol_bytes_north_mini_code_batch1_8k():
    spec = load_spec("configs/north_mini_code.yaml")
    routed = [torch.arange(8)[None] for _ in range(48)]  # 8 distinct experts per MoE layer
    nbytes = step_bytes(spec, 1, 8192, routed)
    assert nbytes == pytest.approx(7.13e9, rel=0.01)  # docs/design.md: ≈ 7.13 GB
    # batch 8 with fully distinct experts reads far more
    many = [torch.arange(64).view(8, 8) for _ in range(48)]
    assert step_bytes(spec, 8, 8192, many) > 3 * nbytes


def test_grouped_experts_equal_gathered():
    """The baseline's grouped-GEMM MoE (weights read in place) equals the gather fallback."""
    spec = load_spec("configs/tiny.yaml")
    w = random_weights(spec, 2, torch.float32, std=0.1)
    grouped, gathered = (TorchDecoder(spec, w, batch=3, context=16, dtype=torch.float32) for _ in range(2))
    gathered.grouped = False
    assert grouped.grouped, "torch._grouped_mm is missing: the baseline would fall back to gathering"
    g = torch.Generator().manual_seed(4)
    for pos in range(6):
        tokens = torch.randint(0, spec.vocab_size, (3,), generator=g)
        positions = torch.tensor([pos, pos + 1, pos + 2])
        a, b = grouped.step(tokens, positions), gathered.step(tokens, positions)
        assert grouped.grouped  # did not fall back
        err = (a - b).abs().max().item()
        assert err < 1e-5, f"step {pos}: grouped vs gathered max error {err:.3g} > 1e-5 (float32 rounding)"
