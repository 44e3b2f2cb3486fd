"""An expert-block look-alike that no GroupedMLP pattern matches gets a declined
``grouped_mlp`` decision saying why, so the plan explains every non-fusion."""

from __future__ import annotations

import pytest
import torch

import fusible_ops as fo


@pytest.mark.parametrize(
    "act, fc1_factor, reason",
    [
        (fo.ReLU, 1, "ReLU is not an expert-block activation"),
        (fo.GELU, 1, "GELU is not an expert-block activation"),
        (fo.SiLU, 1, "SiLU is not an expert-block activation"),
        (fo.ReGLU, 2, "ReGLU is not an expert-block activation"),
        (fo.SwiGLU, 2, "SwiGLU has no routing scale"),
        (fo.SReLU, 1, "SReLU has no routing scale"),
    ],
)
def test_look_alike_gets_a_declined_line(act, fc1_factor, reason):
    seq = fo.Sequential(fo.GroupedLinear(2, 4, 4 * fc1_factor), act(), fo.GroupedLinear(2, 4, 4))
    splits = torch.tensor([1, 2])
    plan = seq.explain(torch.randn(3, 4), splits, splits)
    (decision,) = plan.decisions
    assert decision.rule == "grouped_mlp" and not decision.fired and reason in decision.reason
    assert decision.indices == (0, 1, 2)
    out = seq(torch.randn(3, 4), splits, splits)  # and it still runs, unfused
    assert out.shape == (3, 4) and seq.last_plan.decisions == plan.decisions


def test_real_patterns_get_exactly_their_own_line():
    block = fo.Sequential(fo.GroupedLinear(2, 4, 8), fo.ScaledSwiGLU(), fo.GroupedLinear(2, 4, 4))
    splits = torch.tensor([1, 2])
    (decision,) = block.explain(torch.randn(3, 4), splits, torch.rand(3), splits).decisions
    assert decision.rule == "grouped_mlp" and decision.fired
    after = fo.Sequential(fo.GroupedLinear(2, 4, 8), fo.SwiGLU(), fo.GroupedLinear(2, 4, 4), fo.Scale())
    (decision,) = after.explain(torch.randn(3, 4), splits, splits, torch.rand(3)).decisions
    assert decision.rule == "grouped_mlp_scale_after_fc2" and decision.fired
