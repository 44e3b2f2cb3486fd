"""Autocast follows torch's eligibility rule op for op: floating-point tensors other than
float64 are cast to autocast's dtype; float64 stays float64, as ``nn.Linear`` does."""

from __future__ import annotations

import pytest
import torch

import fusible_ops as fo


def _expert_block(dtype: torch.dtype) -> fo.Sequential:
    return fo.Sequential(
        fo.GroupedLinear(2, 4, 8, dtype=dtype), fo.ScaledSwiGLU(), fo.GroupedLinear(2, 4, 4, dtype=dtype)
    )


def test_nn_linear_keeps_float64_under_autocast():  # the rule we follow
    linear = torch.nn.Linear(4, 4, dtype=torch.float64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert linear(torch.randn(3, 4, dtype=torch.float64)).dtype == torch.float64


@pytest.mark.parametrize("build", ["grouped_linear", "expert_block", "linear_bias"])
def test_float64_modules_compute_in_float64_under_bf16_autocast(build):
    torch.manual_seed(0)
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    splits = torch.tensor([1, 2])
    probs = torch.rand(3, dtype=torch.float64)
    if build == "grouped_linear":
        module, args = fo.GroupedLinear(2, 4, 4, dtype=torch.float64), (splits,)
    elif build == "expert_block":
        module, args = _expert_block(torch.float64), (splits, probs, splits)
    else:
        module = fo.Sequential(fo.BasicLinear(4, 4, dtype=torch.float64), fo.Bias(4, dtype=torch.float64))
        args = ()
    want = module(x, *args)
    (want_grad,) = torch.autograd.grad(want.sum(), x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = module(x, *args)
    (got_grad,) = torch.autograd.grad(got.sum(), x)
    assert got.dtype == torch.float64
    assert torch.equal(got, want) and torch.equal(got_grad, want_grad)


def test_float32_module_still_computes_in_autocast_dtype():
    module = fo.GroupedLinear(2, 4, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert module(torch.randn(3, 4), torch.tensor([1, 2])).dtype == torch.bfloat16


def test_float64_input_into_float32_weights_under_autocast_is_refused():
    # torch casts the float32 weight but not the float64 input: nn.Linear fails on the mismatch
    module = fo.GroupedLinear(2, 4, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(ValueError, match="GroupedLinear.*dtype"):
        module(torch.randn(3, 4, dtype=torch.float64), torch.tensor([1, 2]))
