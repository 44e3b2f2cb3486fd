"""A NaN or Inf in routing propagates to the output: a diverged router row or overflowed
logits never turn into plausible equal weights (only an exact zero weight sum does)."""

from __future__ import annotations

import pytest
import torch

from fusible_ops import MoE
from fusible_ops.moe import topk_route


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_topk_route_non_finite_logits_give_non_finite_weights(score, bad):
    logits = torch.randn(3, 5, dtype=torch.float64)
    logits[1] = bad
    probs, _ = topk_route(logits, 2, score=score, renormalize=True)
    if score == "sigmoid" and bad == float("inf"):  # sigmoid(inf) = 1 exactly: a valid score
        torch.testing.assert_close(probs[1], torch.full((2,), 0.5, dtype=torch.float64))
    elif score == "sigmoid" and bad == float("-inf"):  # every score exactly 0: equal weights
        torch.testing.assert_close(probs[1], torch.full((2,), 0.5, dtype=torch.float64))
    else:
        assert probs[1].isnan().all(), probs
    assert probs[[0, 2]].isfinite().all()


def test_topk_route_one_nan_score_makes_its_row_nan():
    logits = torch.randn(2, 6, dtype=torch.float64)
    logits[0, 3] = float("nan")
    probs, _ = topk_route(logits, 2, score="sigmoid", renormalize=True)
    assert probs[0].isnan().any() and probs[1].isfinite().all()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_moe_with_overflowed_softmax_logits_gives_non_finite_output(dtype):
    torch.manual_seed(0)
    moe = MoE(8, 6, 4, 2, dtype=dtype)
    x = torch.randn(5, 8, dtype=dtype)
    with torch.no_grad():  # every token's logits overflow to +-inf: softmax is NaN
        moe.router.weight[:2, 0] = torch.finfo(dtype).max
        moe.router.weight[2:, 0] = -torch.finfo(dtype).max
        x[:, 0] = 4.0
    assert not moe.router(x).isfinite().all()
    out = moe(x)
    assert out.isnan().any(dim=-1).all(), out


def test_moe_router_weight_nan_row_never_gives_finite_weights():
    torch.manual_seed(0)
    moe = MoE(8, 6, 4, 2, dtype=torch.float64)
    x = torch.randn(5, 8, dtype=torch.float64)
    with torch.no_grad():
        moe.router.weight[2, 1] = float("nan")  # one expert's score is NaN for every token
    out = moe(x)
    assert out.isnan().all(dim=-1).all(), out
