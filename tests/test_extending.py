"""docs/extending.md: its custom fused op (under 40 lines) runs verbatim; plan and numerics checked."""

from __future__ import annotations

import contextlib
import io

import pytest
import torch
from doc_blocks import python_blocks

import fusible_ops as fo


@pytest.fixture
def doc_namespace():
    """Executes the doc's blocks in order; unregisters the doc's rule afterwards."""
    blocks = python_blocks("docs/extending.md")
    assert len(blocks) >= 2, "docs/extending.md should hold the fused op and its usage"
    namespace: dict = {"__name__": "extending_doc"}
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            for i, block in enumerate(blocks):
                exec(compile(block, f"docs/extending.md:block{i}", "exec"), namespace)
        namespace["_printed"] = printed.getvalue()
        namespace["_blocks"] = blocks
        yield namespace
    finally:
        if "linear_relu_rule" in namespace:
            fo.unregister_fusion(namespace["linear_relu_rule"])


def test_fused_op_fits_in_under_40_lines(doc_namespace):
    definition = doc_namespace["_blocks"][0]
    assert "class LinearReLU(fo.FusedOperation)" in definition
    assert len(definition.strip().splitlines()) < 40
    assert "+ linear_relu (joint) fired on ops 0..1" in doc_namespace["_printed"]
    assert "float32/float64 only" in doc_namespace["_printed"]


def test_plan_and_numerics_match_plain_pytorch(doc_namespace):
    mlp = fo.Sequential(
        fo.BasicLinear(5, 7, dtype=torch.float64), fo.ReLU(), fo.BasicLinear(7, 3, dtype=torch.float64)
    )
    x = torch.randn(2, 4, 5, dtype=torch.float64, requires_grad=True)
    y = mlp(x)
    plan = mlp.last_plan.fusion_plans[0]
    assert plan.forward_op_types() == ["LinearReLU", "BasicLinear"]
    assert plan.backward_op_types() == ["LinearReLU", "BasicLinear"]
    assert [(d.rule, d.kind, d.indices, d.fired) for d in plan.decisions] == [
        ("linear_relu", "joint", (0, 1), True)
    ]

    w1, w2 = (m.weight.detach().clone().requires_grad_() for m in (mlp[0], mlp[2]))
    x_ref = x.detach().clone().requires_grad_()
    y_ref = torch.relu(x_ref @ w1.T) @ w2.T
    torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
    dy = torch.randn_like(y)
    y.backward(dy)
    y_ref.backward(dy)
    for actual, expected in (
        (x.grad, x_ref.grad),
        (mlp[0].weight.grad, w1.grad),
        (mlp[2].weight.grad, w2.grad),
    ):
        torch.testing.assert_close(actual, expected, rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(mlp, (x,))

    # a bool mask replaces the float pre-activation; fc2 still saves its own input [2, 4, 7]
    def saved_hidden(fusion: bool) -> list[torch.dtype]:
        saved = []
        with fo.settings(fusion=fusion):
            with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
                mlp(x)
        return sorted(str(t.dtype) for t in saved if t.shape == (2, 4, 7))

    assert saved_hidden(True) == ["torch.bool", "torch.float64"]
    assert saved_hidden(False) == ["torch.float64", "torch.float64"]

    with fo.settings(fusion=False):
        mlp(x)
        assert mlp.last_plan.fusion_plans[0].forward_op_types() == ["BasicLinear", "ReLU", "BasicLinear"]
    with torch.no_grad():
        mlp(x)  # no grad needed: the fused forward saves nothing
        assert mlp.last_plan.fusion_plans[0].forward_op_types() == ["LinearReLU", "BasicLinear"]


def test_declines_with_reason_and_falls_back(doc_namespace):
    mlp = fo.Sequential(fo.BasicLinear(5, 7, dtype=torch.bfloat16), fo.ReLU())
    x = torch.randn(3, 5, dtype=torch.bfloat16)
    y = mlp(x)
    plan = mlp.last_plan.fusion_plans[0]
    assert plan.forward_op_types() == ["BasicLinear", "ReLU"]
    assert plan.declined[0].reason == "LinearReLU handles float32/float64 only, got torch.bfloat16"
    torch.testing.assert_close(y, torch.relu(x @ mlp[0].weight.T))
