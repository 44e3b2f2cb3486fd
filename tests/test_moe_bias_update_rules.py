"""The auxiliary-loss-free bias step: DeepSeek-V3's sign rule, and torchtitan's centred
variant (``center=True``), each against the formula written out."""

from __future__ import annotations

import pytest
import torch

import fusible_ops as fo


@pytest.mark.parametrize("center", [False, True])
def test_bias_step_follows_the_rule(center):
    torch.manual_seed(0)
    moe = fo.MoE(8, 6, 4, 2, load_balancing="aux_free", bias_update_rate=0.01, dtype=torch.float64)
    moe(torch.randn(13, 8, dtype=torch.float64))
    load = moe.expert_load_since_update.to(torch.float64)
    want = 0.01 * torch.sign(load.mean() - load)
    if center:  # torchtitan 0.3.0: delta - delta.mean()
        want = want - want.mean()
    before = moe.score_correction_bias.clone()
    moe.update_score_correction_bias(center=center)
    # float32 bias, steps of 0.01 (and their mean): a few float32 ulps of 0.01, far under 1e-7
    torch.testing.assert_close(moe.score_correction_bias - before, want.float(), rtol=0, atol=1e-7)
    assert int(moe.expert_load_since_update.sum()) == 0
    if center:
        assert abs(float(moe.score_correction_bias.sum())) < 1e-6  # the biases keep their sum
