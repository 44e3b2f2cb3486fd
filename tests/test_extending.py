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


# ---------------------------------------------------------------- fused ops that break the contract


class _BrokenLinearReLU(fo.FusedOperation):
    """``relu(x @ w.T)`` over (BasicLinear, ReLU), returning what ``breakage`` says."""

    breakage = ""

    def fuser_forward(self, basic_op_ctxs, input_, *, basic_op_extra_inputs, basic_op_kwargs):
        ctx = basic_op_ctxs[0]
        y = torch.relu(input_ @ ctx.params["weight"].T)
        ctx.save_for_backward(input=input_, mask=y > 0)
        if self.breakage == "forward_bare_tensor":
            return y
        if self.breakage == "forward_one_list_for_two_ops":
            return y, [()]
        return y, [(), ()]

    def fuser_backward(self, basic_op_ctxs, grad_output, *, basic_op_grad_extra_outputs):
        ctx = basic_op_ctxs[0]
        grad_pre = grad_output * ctx.saved["mask"]
        grad_input = grad_pre @ ctx.params["weight"]
        grad_weight = grad_pre.T @ ctx.saved["input"]
        return {
            "backward_two_items": lambda: (grad_input, [[grad_weight], []]),
            "backward_flat_param_grads": lambda: (grad_input, [grad_weight, None], [(), ()]),
            "backward_one_list_for_two_ops": lambda: (grad_input, [[grad_weight]], [(), ()]),
            "backward_wrong_grad_shape": lambda: (grad_input, [[grad_weight.T], []], [(), ()]),
            "backward_wrong_grad_input_shape": lambda: (grad_input[:, 1:], [[grad_weight], []], [(), ()]),
            "backward_grad_not_a_tensor": lambda: (grad_input, [[1.0], []], [(), ()]),
        }[self.breakage]()


_BREAKAGES = {
    "forward_bare_tensor": (
        TypeError,
        r"_BrokenLinearReLU.fuser_forward returned Tensor\[6, 3\]; expected \(output tensor, a list of 2 tuples",
    ),
    "forward_one_list_for_two_ops": (
        TypeError,
        r"_BrokenLinearReLU.fuser_forward returned list of 1 as extra outputs; expected .* 2 tuples",
    ),
    "backward_two_items": (
        TypeError,
        r"_BrokenLinearReLU.fuser_backward returned tuple of 2; expected \(grad_input, a list of 2 lists",
    ),
    "backward_flat_param_grads": (
        TypeError,
        r"fuser_backward: the parameter gradients of basic op 0 are Tensor\[3, 4\]; expected a list of 1",
    ),
    "backward_one_list_for_two_ops": (
        TypeError,
        r"fuser_backward returned list of 1 as parameter gradients; expected",
    ),
    "backward_wrong_grad_shape": (
        RuntimeError,
        r"fuser_backward: gradient 0 of basic op 0 has shape \[4, 3\]; the parameter has shape \[3, 4\]",
    ),
    "backward_wrong_grad_input_shape": (
        RuntimeError,
        r"fuser_backward returned a grad_input of shape \[6, 3\]; the input had shape \[6, 4\]",
    ),
    "backward_grad_not_a_tensor": (
        TypeError,
        r"gradient 0 of basic op 0 is float; expected a tensor or None",
    ),
}


@pytest.mark.parametrize("breakage", list(_BREAKAGES))
def test_fused_op_breaking_the_contract_gets_a_clear_error(breakage):
    error, message = _BREAKAGES[breakage]
    fused = type("_BrokenLinearReLU", (_BrokenLinearReLU,), {"breakage": breakage})
    rule = fo.window_rule("broken_linear_relu", (fo.BasicLinear, fo.ReLU), lambda ctx, ops, first: fused(ops))
    seq = fo.Sequential(fo.BasicLinear(4, 3), fo.ReLU())
    weight = seq[0].weight.detach().clone()
    x = torch.randn(6, 4, requires_grad=True)
    fo.register_fusion(rule, kind="joint")
    try:
        with pytest.raises(error, match=message):
            seq(x).sum().backward()
    finally:
        fo.unregister_fusion(rule)
    assert torch.equal(seq[0].weight, weight) and seq[0].weight.grad is None and x.grad is None
    seq(x).sum().backward()  # without the broken rule the same objects work
    torch.testing.assert_close(x.grad, ((x @ weight.T) > 0).float() @ weight)


def test_build_returning_none_is_an_error_naming_the_rule():
    rule = fo.window_rule("lazy", (fo.BasicLinear, fo.ReLU), lambda ctx, ops, first: None)
    seq = fo.Sequential(fo.BasicLinear(4, 3), fo.ReLU())
    fo.register_fusion(rule, kind="joint")
    try:
        with pytest.raises(
            TypeError,
            match=r"fusion rule 'lazy': build returned NoneType; it must return a FusedOperation, or a non-empty str",
        ):
            seq(torch.randn(6, 4))
    finally:
        fo.unregister_fusion(rule)
    seq(torch.randn(6, 4))


def test_op_backward_with_the_wrong_structure_names_the_op():
    class Doubler(fo.BasicOperation):
        def op_forward(self, ctx, input_):
            return 2 * input_

        def op_backward(self, ctx, grad_output):
            return 2 * grad_output  # missing the parameter-gradient list

    x = torch.randn(3, requires_grad=True)
    with pytest.raises(
        TypeError,
        match=r"Doubler.op_backward returned Tensor; expected OpBackward\(grad_input, grad_params, grad_extra_inputs\)",
    ):
        fo.Sequential(Doubler())(x).sum().backward()
