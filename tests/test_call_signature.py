"""Calls keyed by their signature: the preflights and the plan run once per signature, the
value checks on every call, and anything the plan depends on makes a new signature."""

from __future__ import annotations

import pytest
import reference_ops as ref
import torch

import fusible_ops as fo
from fusible_ops import GroupedLinear
from fusible_ops.core.op import preflight_is_static

SPLITS = [5, 0, 7, 4]
ROWS, HIDDEN, FFN, EXPERTS = 16, 8, 6, 4


def make_block(dtype=torch.float64) -> fo.Sequential:
    return fo.Sequential(
        fo.GroupedLinear(EXPERTS, HIDDEN, 2 * FFN, dtype=dtype),
        fo.ScaledSwiGLU(),
        fo.GroupedLinear(EXPERTS, FFN, HIDDEN, dtype=dtype),
    )


def reference(block, x, probs, splits):
    return ref.expert_block(x, block[0].weight, probs, block[2].weight, splits)


@pytest.fixture
def preflight_calls(monkeypatch):
    """How often GroupedLinear.preflight ran."""
    calls = []
    original = GroupedLinear.preflight

    def counted(self, *args, **kwargs):
        calls.append(self)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(GroupedLinear, "preflight", counted)
    return calls


@pytest.mark.parametrize("as_tensor", [True, False])
def test_second_call_skips_preflight_and_stays_exact(preflight_calls, as_tensor):
    block = make_block()
    x = torch.randn(ROWS, HIDDEN, dtype=torch.float64, requires_grad=True)
    probs = torch.rand(ROWS, dtype=torch.float64, requires_grad=True)
    for step, splits in enumerate(([5, 0, 7, 4], [0, 16, 0, 0], [4, 4, 4, 4])):
        given = torch.tensor(splits) if as_tensor else list(splits)
        y = block(x, given, probs, given)
        assert "GroupedMLP" in str(block.last_plan)
        expected = reference(block, x, probs, splits)
        torch.testing.assert_close(y, expected, rtol=1e-12, atol=1e-12)
        grads = torch.autograd.grad(y.sum(), [x, probs, block[0].weight, block[2].weight])
        want = torch.autograd.grad(expected.sum(), [x, probs, block[0].weight, block[2].weight])
        for got, exp in zip(grads, want):
            torch.testing.assert_close(got, exp, rtol=1e-12, atol=1e-12)
        # the two GroupedLinear preflights ran on the first call only
        assert len(preflight_calls) == 2, step


@pytest.mark.parametrize("as_tensor", [True, False])
@pytest.mark.parametrize(
    "bad, message",
    [([5, 0, 7, 5], "sum to 17 but the input has 16 rows"), ([5, -1, 8, 4], "must be non-negative")],
)
def test_value_checks_run_on_every_call(preflight_calls, as_tensor, bad, message):
    block = make_block()
    x = torch.randn(ROWS, HIDDEN, dtype=torch.float64, requires_grad=True)
    probs = torch.rand(ROWS, dtype=torch.float64)
    good = torch.tensor(SPLITS) if as_tensor else list(SPLITS)
    block(x, good, probs, good)
    before = [p.detach().clone() for p in block.parameters()]
    given = torch.tensor(bad) if as_tensor else list(bad)
    with pytest.raises(ValueError, match=rf"GroupedLinear: split_sizes.*{message}.*op 0 of the Sequential"):
        block(x, given, probs, given)
    assert len(preflight_calls) == 2  # refused by the value check alone, before any work
    for p, b in zip(block.parameters(), before):
        assert torch.equal(p, b) and p.grad is None


def test_values_written_in_place_between_calls_are_checked():
    block = make_block()
    x = torch.randn(ROWS, HIDDEN, dtype=torch.float64)
    probs = torch.rand(ROWS, dtype=torch.float64)
    splits = torch.tensor(SPLITS)
    block(x, splits, probs, splits)
    splits[0] += 1
    with pytest.raises(ValueError, match="sum to 17"):
        block(x, splits, probs, splits)
    splits.copy_(torch.tensor([16, 0, 0, 0]))
    torch.testing.assert_close(
        block(x, splits, probs, splits), reference(block, x, probs, [16, 0, 0, 0]), rtol=1e-12, atol=1e-12
    )


def test_equal_then_different_split_lists_replan():
    """fc1 and fc2 fuse when their split sizes are equal by value; a later call whose sizes
    differ (same lengths, so the same tensor metadata) must not reuse the fused plan."""
    block = make_block()
    x = torch.randn(ROWS, HIDDEN, dtype=torch.float64)
    probs = torch.rand(ROWS, dtype=torch.float64)
    block(x, list(SPLITS), probs, list(SPLITS))
    assert "GroupedMLP" in str(block.last_plan)
    other = [16, 0, 0, 0]
    y = block(x, list(SPLITS), probs, other)
    assert "GroupedMLP" not in str(block.last_plan.groups[0].forward)
    hidden = ref.grouped_linear(x, block[0].weight, None, SPLITS)
    act = ref.activation("swiglu", hidden) * probs.unsqueeze(-1)
    expected = ref.grouped_linear(act, block[2].weight, None, other)
    torch.testing.assert_close(y, expected, rtol=1e-12, atol=1e-12)
    for first, second in (
        (torch.tensor(SPLITS), torch.tensor(SPLITS)),
        (torch.tensor(SPLITS), torch.tensor(other)),
    ):
        block(x, first, probs, second)
        fused = "GroupedMLP" in str(block.last_plan.groups[0].forward)
        assert fused == torch.equal(first, second)


def test_what_the_plan_depends_on_makes_a_new_signature(preflight_calls):
    block = make_block()
    x = torch.randn(ROWS, HIDDEN, dtype=torch.float64)
    probs = torch.rand(ROWS, dtype=torch.float64)
    with torch.no_grad():
        block(x, SPLITS, probs, SPLITS)
    assert not block.last_plan.groups[0].requires_grad
    block(x, SPLITS, probs, SPLITS)
    assert block.last_plan.groups[0].requires_grad
    with fo.settings(fusion=False):
        block(x, SPLITS, probs, SPLITS)
        assert "GroupedMLP" not in str(block.last_plan)
    block(x, SPLITS, probs, SPLITS)
    assert "GroupedMLP" in str(block.last_plan)
    block[0].weight.requires_grad_(False)
    block(x, SPLITS, probs, SPLITS).sum().backward()
    assert block[0].weight.grad is None and block[2].weight.grad is not None
    block(x[:12], [5, 0, 3, 4], probs[:12], [5, 0, 3, 4])  # a new shape: its own preflight
    # new signatures: no_grad, grad, fusion off, a frozen weight, a new shape (fusion on
    # again is the second signature's)
    assert len(preflight_calls) == 2 * 5


def test_replaced_parameter_and_late_hook_take_effect():
    block = make_block()
    x = torch.randn(ROWS, HIDDEN, dtype=torch.float64)
    probs = torch.rand(ROWS, dtype=torch.float64)
    block(x, SPLITS, probs, SPLITS)
    block[2].weight = torch.nn.Parameter(torch.randn_like(block[2].weight))
    torch.testing.assert_close(
        block(x, SPLITS, probs, SPLITS), reference(block, x, probs, SPLITS), rtol=1e-12, atol=1e-12
    )
    seen = []
    block[1].register_forward_hook(lambda module, args, out: seen.append(out.shape))
    block(x, SPLITS, probs, SPLITS)
    assert seen == [torch.Size([ROWS, FFN])]
    assert "forward hook on op 1" in str(block.last_plan)


def test_functional_call_on_a_known_signature_uses_the_given_weights():
    block = make_block()
    x = torch.randn(ROWS, HIDDEN, dtype=torch.float64)
    probs = torch.rand(ROWS, dtype=torch.float64)
    block(x, SPLITS, probs, SPLITS).sum().backward()
    new_w1 = torch.randn_like(block[0].weight, requires_grad=True)
    y = torch.func.functional_call(block, {"0.weight": new_w1}, (x, SPLITS, probs, SPLITS))
    expected = ref.expert_block(x, new_w1, probs, block[2].weight, SPLITS)
    torch.testing.assert_close(y, expected, rtol=1e-12, atol=1e-12)
    (got,) = torch.autograd.grad(y.sum(), [new_w1])
    (want,) = torch.autograd.grad(expected.sum(), [new_w1])
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


class NonStaticScale(fo.Scale):
    """A user op whose preflight reads values (and does not say it is static)."""

    def preflight(self, input_meta, extra_inputs, kwargs, *, guard):
        if bool((extra_inputs[0] < 0).any()):
            raise ValueError("NonStaticScale: scales must be non-negative")
        return super().preflight(input_meta, extra_inputs, kwargs, guard=guard)


def test_an_op_whose_preflight_reads_values_is_checked_on_every_call():
    assert preflight_is_static(fo.Scale()) and not preflight_is_static(NonStaticScale())
    op = fo.Sequential(fo.GroupedLinear(2, 4, 4), NonStaticScale())
    x = torch.randn(3, 4)
    op(x, [1, 2], torch.ones(3))
    with pytest.raises(ValueError, match="must be non-negative"):
        op(x, [1, 2], -torch.ones(3))


@pytest.mark.parametrize("as_tensor", [True, False])
def test_offsets_made_under_inference_mode_serve_a_training_call(as_tensor):
    """Host offsets are shared between calls with the same split sizes; ones first made
    under inference mode must still be savable for a later call's backward."""
    splits = [9, 0, 3, 13] if as_tensor else [2, 11, 0, 12]  # sizes no other test uses
    rows = sum(splits)
    block = make_block()
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(rows, HIDDEN, dtype=torch.float64, generator=gen)
    probs = torch.rand(rows, dtype=torch.float64, generator=gen)
    arg = torch.tensor(splits) if as_tensor else splits
    with torch.inference_mode():
        block(x, arg, probs, arg)
    x_, probs_ = x.clone().requires_grad_(), probs.clone().requires_grad_()
    out = block(x_, arg, probs_, arg)
    out.square().sum().backward()
    x_ref, probs_ref = x.clone().requires_grad_(), probs.clone().requires_grad_()
    reference(block, x_ref, probs_ref, splits).square().sum().backward()
    torch.testing.assert_close(x_.grad, x_ref.grad)
    torch.testing.assert_close(probs_.grad, probs_ref.grad)
