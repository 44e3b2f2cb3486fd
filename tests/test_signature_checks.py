"""Backend argument checks once per call signature (``kernels/signature_checks.py``): later
calls of a signature skip them (and the fuser's result checks), stay exact, and still
check the values of every call."""

from __future__ import annotations

import pytest
import reference_ops as ref
import torch

import fusible_ops as fo
from fusible_ops import BasicOperation, GroupedLinear
from fusible_ops.fuser import function as fuser_function
from fusible_ops.kernels import base
from fusible_ops.kernels.signature_checks import arguments_checked

ROWS, HIDDEN, FFN, EXPERTS = 16, 8, 6, 4


def make_block(*ops: BasicOperation) -> fo.Sequential:
    return fo.Sequential(
        fo.GroupedLinear(EXPERTS, HIDDEN, 2 * FFN, dtype=torch.float64),
        *ops,
        fo.GroupedLinear(EXPERTS, FFN, HIDDEN, dtype=torch.float64),
    )


@pytest.fixture
def backend_checks(monkeypatch):
    """The names of the argument checks the public backend methods ran."""
    calls: list[str] = []
    names = [(base, "check_gemm"), (base, "check_fc2_dgrad_act"), (base, "check_operands")]
    names += [(base, "check_row_scales"), (fuser_function, "check_forward_result")]
    names += [(fuser_function, "check_backward_result")]
    for module, name in names:
        original = getattr(module, name)

        def counted(*args, _original=original, _name=name, **kwargs):
            calls.append(_name)
            return _original(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)
    return calls


def run(block, splits, rows=ROWS):
    x = torch.randn(rows, HIDDEN, dtype=torch.float64, requires_grad=True)
    probs = torch.rand(rows, dtype=torch.float64, requires_grad=True)
    given = torch.tensor(splits)
    y = block(x, given, probs, given)
    return x, probs, y


def check_exact(block, x, probs, y, splits):
    expected = ref.expert_block(x, block[0].weight, probs, block[-1].weight, splits)
    torch.testing.assert_close(y, expected, rtol=1e-12, atol=1e-12)
    leaves = [x, probs, block[0].weight, block[-1].weight]
    for got, want in zip(torch.autograd.grad(y.sum(), leaves), torch.autograd.grad(expected.sum(), leaves)):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_later_calls_of_a_signature_skip_the_backend_checks_and_stay_exact(backend_checks):
    block = make_block(fo.ScaledSwiGLU())
    for step, splits in enumerate(([5, 0, 7, 4], [0, 16, 0, 0], [4, 4, 4, 4])):
        backend_checks.clear()
        x, probs, y = run(block, splits)
        assert "GroupedMLP" in str(block.last_plan)
        forward_checks = list(backend_checks)
        check_exact(block, x, probs, y, splits)
        if step == 0:  # the signature's first call checks forward and backward
            assert {"check_gemm", "check_forward_result"} <= set(forward_checks)
            assert {"check_fc2_dgrad_act", "check_backward_result"} <= set(backend_checks)
        else:
            assert backend_checks == [], step
    backend_checks.clear()
    run(block, [8, 8, 8, 8], rows=32)  # a new signature (other rows) is checked again
    assert "check_gemm" in backend_checks


def test_a_first_call_that_fails_a_backend_check_leaves_the_signature_unchecked(backend_checks, monkeypatch):
    block = make_block(fo.ScaledSwiGLU())
    counted = base.check_gemm

    def refuse(*args, **kwargs):
        raise ValueError("refused by the test")

    monkeypatch.setattr(base, "check_gemm", refuse)
    with pytest.raises(ValueError, match="refused by the test"):
        run(block, [5, 0, 7, 4])
    monkeypatch.setattr(base, "check_gemm", counted)
    backend_checks.clear()
    x, probs, y = run(block, [5, 0, 7, 4])
    assert "check_gemm" in backend_checks
    check_exact(block, x, probs, y, [5, 0, 7, 4])


class UserIdentity(BasicOperation):
    """A user's op: it could compute kernel arguments from values, so it is not trusted."""

    def op_forward(self, ctx, input_):
        return input_

    def op_backward(self, ctx, grad_output):
        return grad_output, ()


class MyGroupedLinear(GroupedLinear):
    """A subclass of a library op is a user's op too (matched by exact type)."""


def test_plans_with_a_user_op_check_every_call(backend_checks):
    blocks = [
        make_block(fo.ScaledSwiGLU(), UserIdentity()),
        fo.Sequential(MyGroupedLinear(EXPERTS, HIDDEN, HIDDEN, dtype=torch.float64)),
    ]
    for block in blocks:
        for _ in range(3):
            backend_checks.clear()
            x = torch.randn(ROWS, HIDDEN, dtype=torch.float64, requires_grad=True)
            extra = (torch.tensor([5, 0, 7, 4]),) if len(block) == 1 else None
            if extra is None:
                given = torch.tensor([5, 0, 7, 4])
                y = block(x, given, torch.rand(ROWS, dtype=torch.float64), given)
            else:
                y = block(x, *extra)
            y.sum().backward()
            assert {"check_gemm", "check_forward_result", "check_backward_result"} <= set(backend_checks)


def test_the_flag_is_set_only_inside_a_checked_call(monkeypatch):
    block = make_block(fo.ScaledSwiGLU())
    seen = []
    original = base.GroupedGemmBackend.fc1_fprop_act

    def spy(self, *args, **kwargs):
        seen.append(arguments_checked())
        return original(self, *args, **kwargs)

    monkeypatch.setattr(base.GroupedGemmBackend, "fc1_fprop_act", spy)
    for _ in range(2):
        _, _, y = run(block, [5, 0, 7, 4])
        y.sum().backward()
        assert not arguments_checked()
    assert seen == [False, True]
    given = torch.tensor([5, 0, 7, 5])  # a later call with bad values: the op's value check refuses it
    with pytest.raises(ValueError, match="sum to 17"):
        block(
            torch.randn(ROWS, HIDDEN, dtype=torch.float64),
            given,
            torch.rand(ROWS, dtype=torch.float64),
            given,
        )
    assert not arguments_checked()
