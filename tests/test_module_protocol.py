"""What a plain nn.Module supports, our ops support: functional_call, parametrizations,
weight_norm, and forward / pre-forward / backward hooks on ops inside a Sequential."""

from __future__ import annotations

import pytest
import torch
from reference_ops import grouped_linear as grouped_linear_ref

import fusible_ops as fo

EXPERTS, HIDDEN, FFN = 3, 6, 5
SIZES = [2, 0, 3]
ROWS = sum(SIZES)


def expert_block(bias: bool = True) -> fo.Sequential:
    torch.manual_seed(0)
    return fo.Sequential(
        fo.GroupedLinear(EXPERTS, HIDDEN, 2 * FFN, bias=bias, dtype=torch.float64),
        fo.ScaledSwiGLU(),
        fo.GroupedLinear(EXPERTS, FFN, HIDDEN, bias=bias, dtype=torch.float64),
    )


def reference(x, probs, w1, b1, w2, b2):
    """Independent float64 expert block: per-expert loop of plain torch ops."""
    pre = grouped_linear_ref(x, w1, b1, SIZES)
    gate, up = pre.chunk(2, dim=-1)
    act = torch.nn.functional.silu(gate) * up * probs.unsqueeze(-1)
    return grouped_linear_ref(act, w2, b2, SIZES)


def block_inputs():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(ROWS, HIDDEN, dtype=torch.float64, generator=gen).requires_grad_()
    probs = torch.rand(ROWS, dtype=torch.float64, generator=gen).requires_grad_()
    return x, probs


def new_params():
    gen = torch.Generator().manual_seed(7)
    shapes = {
        "0.weight": (EXPERTS, 2 * FFN, HIDDEN),
        "0.bias": (EXPERTS, 2 * FFN),
        "2.weight": (EXPERTS, HIDDEN, FFN),
        "2.bias": (EXPERTS, HIDDEN),
    }
    return {k: torch.randn(s, dtype=torch.float64, generator=gen).requires_grad_() for k, s in shapes.items()}


@pytest.mark.parametrize("fusion", [True, False])
def test_functional_call_gradients_reach_the_given_tensors(fusion):
    seq = expert_block()
    x, probs = block_inputs()
    params = new_params()
    originals = {k: v.detach().clone() for k, v in seq.state_dict().items()}
    with fo.settings(fusion=fusion):
        out = torch.func.functional_call(seq, params, (x, SIZES, probs, SIZES))
    names = ["0.weight", "0.bias", "2.weight", "2.bias"]
    got = torch.autograd.grad(out.square().sum(), [x, probs, *(params[n] for n in names)])
    ref_params = {k: v.detach().clone().requires_grad_() for k, v in params.items()}
    x_ref, probs_ref = x.detach().clone().requires_grad_(), probs.detach().clone().requires_grad_()
    want_out = reference(x_ref, probs_ref, *(ref_params[n] for n in names))
    want = torch.autograd.grad(want_out.square().sum(), [x_ref, probs_ref, *(ref_params[n] for n in names)])
    torch.testing.assert_close(out, want_out)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    # the module's own parameters were neither used nor touched
    assert all(p.grad is None for p in seq.parameters())
    assert all(torch.equal(originals[k], v) for k, v in seq.state_dict().items())


class Doubled(torch.nn.Module):
    def forward(self, weight):
        return 2.0 * weight


@pytest.mark.parametrize("fusion", [True, False])
def test_parametrized_weight_gets_the_chain_rule_gradient(fusion):
    seq = expert_block()
    torch.nn.utils.parametrize.register_parametrization(seq[0], "weight", Doubled())
    original = seq[0].parametrizations.weight.original
    x, probs = block_inputs()
    with fo.settings(fusion=fusion):
        out = seq(x, SIZES, probs, SIZES)
    out.square().sum().backward()
    w1 = (2.0 * original.detach()).requires_grad_()
    b1, w2, b2 = (t.detach().clone().requires_grad_() for t in (seq[0].bias, seq[2].weight, seq[2].bias))
    want_out = reference(x.detach(), probs.detach(), w1, b1, w2, b2)
    (grad_w1,) = torch.autograd.grad(want_out.square().sum(), [w1])
    torch.testing.assert_close(out, want_out)
    torch.testing.assert_close(original.grad, 2.0 * grad_w1)


def test_weight_norm_on_a_grouped_linear():
    seq = expert_block(bias=False)
    torch.nn.utils.weight_norm(seq[0], name="weight", dim=0)
    g, v = seq[0].weight_g, seq[0].weight_v
    x, probs = block_inputs()
    out = seq(x, SIZES, probs, SIZES)
    out.square().sum().backward()
    assert "module_hooks" in str(seq.last_plan)  # weight_norm is a forward pre-hook

    g_ref, v_ref = g.detach().clone().requires_grad_(), v.detach().clone().requires_grad_()
    w1 = torch._weight_norm(v_ref, g_ref, 0)
    want_out = reference(x.detach(), probs.detach(), w1, None, seq[2].weight.detach(), None)
    grad_g, grad_v = torch.autograd.grad(want_out.square().sum(), [g_ref, v_ref])
    torch.testing.assert_close(out, want_out)
    torch.testing.assert_close(g.grad, grad_g)
    torch.testing.assert_close(v.grad, grad_v)


def test_hooks_on_inner_ops_fire_in_op_order_and_decline_fusion():
    seq = expert_block()
    x, probs = block_inputs()
    want = seq(x, SIZES, probs, SIZES)
    want_grads = torch.autograd.grad(want.square().sum(), [x, probs, *seq.parameters()])
    events = []
    seen = {}

    def pre_hook(module, args):
        events.append(("pre", module.op_name()))
        seen["pre_input"] = args[0]

    def fwd_hook(module, args, output):
        events.append(("fwd", module.op_name()))
        seen["fc1_output"] = output

    def bwd_hook(module, grad_input, grad_output):
        events.append(("bwd", module.op_name()))
        seen["grad_output"] = grad_output[0]

    handles = [
        seq[0].register_forward_pre_hook(pre_hook),
        seq[0].register_forward_hook(fwd_hook),
        seq[2].register_full_backward_hook(bwd_hook),
    ]
    out = seq(x, SIZES, probs, SIZES)
    plan = str(seq.last_plan)
    assert "forward pre-hook and forward hook on op 0 (GroupedLinear)" in plan
    assert "backward hook on op 2 (GroupedLinear)" in plan
    assert "GroupedMLP" not in plan
    grads = torch.autograd.grad(out.square().sum(), [x, probs, *seq.parameters()])
    assert events == [("pre", "GroupedLinear"), ("fwd", "GroupedLinear"), ("bwd", "GroupedLinear")]
    assert seen["pre_input"] is x
    torch.testing.assert_close(seen["fc1_output"], grouped_linear_ref(x, seq[0].weight, seq[0].bias, SIZES))
    torch.testing.assert_close(seen["grad_output"], 2 * out.detach())
    torch.testing.assert_close(out, want)
    for a, b in zip(grads, want_grads):
        torch.testing.assert_close(a, b)

    for handle in handles:
        handle.remove()
    seq(x, SIZES, probs, SIZES)
    assert seq.last_plan.fusion_plans[0].forward_op_types() == ["GroupedMLP"]


def test_forward_hook_can_replace_the_output():
    seq = expert_block()
    x, probs = block_inputs()
    seq[2].register_forward_hook(lambda module, args, output: output * 0.0)
    out = seq(x, SIZES, probs, SIZES)
    assert torch.count_nonzero(out) == 0


def test_sharded_dtensor_parameter_never_reaches_a_kernel():
    class FakeDTensor(torch.Tensor):
        pass

    FakeDTensor.__name__ = "DTensor"
    seq = expert_block()
    seq[0].weight = torch.nn.Parameter(seq[0].weight.detach().as_subclass(FakeDTensor))
    x, probs = block_inputs()
    with pytest.raises(ValueError, match=r"GroupedLinear: parameter 'weight' is a DTensor.*fully_shard"):
        seq(x, SIZES, probs, SIZES)
