"""The CUDA engine (torch.nn.functional.scaled_grouped_mm, rowwise) against the emulation.
Skipped without a CUDA GPU of SM90 or newer (run by benchmarks/gpu_check.sh)."""

from __future__ import annotations

import pytest
import torch

import fusible_ops as fo

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
    reason="needs a CUDA GPU of SM90 or newer",
)


def test_scaled_grouped_mm_agrees_with_emulation():
    seq = fo.Sequential(
        fo.GroupedLinear(4, 128, 256, device="cuda", dtype=torch.bfloat16),
        fo.ScaledSwiGLU(),
        fo.GroupedLinear(4, 128, 128, device="cuda", dtype=torch.bfloat16),
    )
    x = torch.randn(256, 128, device="cuda", dtype=torch.bfloat16)
    probs = torch.rand(256, device="cuda")
    splits = torch.tensor([64, 0, 128, 64], device="cuda")
    recipe = fo.recipes.Float8Rowwise()
    with fo.quantized(recipe, backend="emulation"):
        expected = seq(x, splits, probs, splits).float()
    with fo.quantized(recipe, backend="scaled_grouped_mm"):
        got = seq(x, splits, probs, splits).float()
        assert "engine scaled_grouped_mm" in str(seq.last_plan)
    assert ((got - expected).norm() / expected.norm()).item() < 1e-2
