"""Every op's parameters are checked before any op of a call runs: a parameter replaced
after construction with the wrong shape, dtype or device is refused by name, and no caller
buffer is written."""

from __future__ import annotations

import pytest
import torch

import fusible_ops as fo

G, H, F, ROWS = 4, 8, 6, 10


def _block() -> fo.Sequential:
    torch.manual_seed(0)
    return fo.Sequential(
        fo.GroupedLinear(G, H, 2 * F), fo.ScaledSwiGLU(), fo.GroupedLinear(G, F, H, bias=True)
    )


def _call(seq, op_kwargs):
    x, splits, probs = torch.randn(ROWS, H, requires_grad=True), torch.tensor([3, 3, 0, 4]), torch.rand(ROWS)
    return seq(x, splits, probs, splits, op_kwargs=op_kwargs)


@pytest.mark.parametrize(
    "name, bad, match",
    [
        (
            "weight",
            torch.randn(G, H, F - 1),
            r"parameter 'weight' has shape \[4, 8, 5\]; expected \[4, 8, 6\]",
        ),
        ("weight", torch.randn(G + 1, H, F), r"parameter 'weight' has shape \[5, 8, 6\]"),
        ("bias", torch.randn(G, H + 1), r"parameter 'bias' has shape \[4, 9\]; expected \[4, 8\]"),
        ("bias", torch.randn(G, H, dtype=torch.float64), r"parameter 'bias' is torch.float64"),
    ],
)
def test_a_bad_fc2_parameter_is_refused_before_fc1_writes_its_buffer(name, bad, match):
    seq = _block()
    setattr(seq[2], name, torch.nn.Parameter(bad))  # as integrations replace parameters
    fc1_out = torch.zeros(ROWS, 2 * F)  # an output buffer on fc1: the ops run one by one
    grad_buf = torch.zeros(ROWS, H)
    with pytest.raises(ValueError, match=match) as error:
        _call(seq, {0: {fo.OUTPUT_BUFFER_KEY: fc1_out, fo.GRAD_INPUT_BUFFER_KEY: grad_buf}})
    assert "GroupedLinear" in str(error.value) and "op 2" in str(error.value)
    assert not fc1_out.any() and not grad_buf.any()


def test_fused_block_with_a_bad_fc2_weight_writes_nothing():
    seq = _block()
    seq[2].weight = torch.nn.Parameter(torch.randn(G, H, F + 1))
    out = torch.zeros(ROWS, H)
    with pytest.raises(ValueError, match="parameter 'weight'"):
        _call(seq, {2: {fo.OUTPUT_BUFFER_KEY: out}})
    assert not out.any()


def test_in_out_layout_expects_the_transposed_weight():
    op = fo.GroupedLinear(2, 4, 6, weight_layout="in_out")
    assert op(torch.randn(3, 4), torch.tensor([1, 2])).shape == (3, 6)
    op.weight = torch.nn.Parameter(torch.randn(2, 6, 4))
    with pytest.raises(ValueError, match=r"expected \[2, 4, 6\]"):
        op(torch.randn(3, 4), torch.tensor([1, 2]))


@pytest.mark.parametrize(
    "build, name, bad",
    [
        (lambda: fo.BasicLinear(4, 6), "weight", torch.randn(6, 5)),
        (lambda: fo.Bias(4), "bias", torch.randn(5)),
        (lambda: fo.RMSNorm(4), "weight", torch.randn(3)),
        (lambda: fo.LayerNorm(4), "bias", torch.randn(3)),
        (lambda: fo.GroupedLinear(2, 4, 4), "weight", torch.randint(0, 3, (2, 4, 4)).float().long()),
    ],
)
def test_other_ops_check_their_parameters(build, name, bad):
    op = build()
    first = fo.GroupedLinear(1, 4, 4)
    seq = fo.Sequential(first, op) if not isinstance(op, fo.GroupedLinear) else fo.Sequential(op)
    setattr(op, name, torch.nn.Parameter(bad, requires_grad=bad.is_floating_point()))
    extra = (torch.tensor([3]),) if seq[0] is first or isinstance(op, fo.GroupedLinear) else ()
    if isinstance(op, fo.GroupedLinear):
        extra = (torch.tensor([1, 2]),)
    out = torch.zeros(3, 4)
    kwargs = {0: {fo.OUTPUT_BUFFER_KEY: out}}
    with pytest.raises(ValueError, match=f"parameter '{name}'"):
        seq(torch.randn(3, 4), *extra, op_kwargs=kwargs)
    assert not out.any()
