"""GroupedGateUpLinear (fc1 with separate gate and up weights), alone and fused into GroupedMLP.

Compared with an independently written float64 reference (per-expert loop), forward and
backward, for the three block patterns (scaled activation, Scale after fc2, no routing
weights), with zero-row groups, zero tokens, non-contiguous inputs and caller buffers.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fusible_ops as fo

G, K, HID, H = 3, 8, 5, 7
ACTIVATIONS = {
    "swiglu": (fo.SwiGLU, fo.ScaledSwiGLU, lambda g, u: F.silu(g) * u),
    "geglu": (fo.GEGLU, fo.ScaledGEGLU, lambda g, u: F.gelu(g, approximate="tanh") * u),
}


def _block(pattern: str, kind: str, dtype=torch.float64) -> fo.Sequential:
    torch.manual_seed(0)
    plain, scaled, _ = ACTIVATIONS[kind]
    fc1 = fo.GroupedGateUpLinear(G, K, HID, dtype=dtype)
    fc2 = fo.GroupedLinear(G, HID, H, bias=True, dtype=dtype)
    if pattern == "scaled":
        return fo.Sequential(fc1, scaled(), fc2)
    if pattern == "scale_after":
        return fo.Sequential(fc1, plain(), fc2, fo.Scale())
    return fo.Sequential(fc1, plain(), fc2)


def _args(pattern: str, splits, scales) -> tuple:
    return {
        "scaled": (splits, scales, splits),
        "scale_after": (splits, splits, scales),
        "unscaled": (splits, splits),
    }[pattern]


def _reference(block: fo.Sequential, pattern: str, kind: str, x, sizes: list[int], scales):
    act = ACTIVATIONS[kind][2]
    fc1, fc2 = block[0], block[2]
    rows, start = [], 0
    for g, count in enumerate(sizes):
        xg = x[start : start + count].double()
        h = act(xg @ fc1.gate_weight[g].double().T, xg @ fc1.up_weight[g].double().T)
        s = scales[start : start + count].double().unsqueeze(-1)
        if pattern == "scaled":
            h = h * s
        y = h @ fc2.weight[g].double().T + fc2.bias[g].double()
        rows.append(y * s if pattern == "scale_after" else y)
        start += count
    return torch.cat(rows)


def _grads(block, x, scales, out, grad):
    tensors = [x, scales, *block.parameters()]
    return torch.autograd.grad(out, tensors, grad, allow_unused=True)


@pytest.mark.parametrize("kind", sorted(ACTIVATIONS))
@pytest.mark.parametrize("pattern", ["scaled", "scale_after", "unscaled"])
@pytest.mark.parametrize("sizes", [[4, 0, 6], [0, 0, 0]], ids=["uneven-empty-group", "zero-tokens"])
def test_fused_matches_float64_reference(pattern, kind, sizes):
    block = _block(pattern, kind)
    rows = sum(sizes)
    x = torch.randn(K, rows, dtype=torch.float64).T.requires_grad_(True)  # non-contiguous
    scales = torch.rand(rows, dtype=torch.float64, requires_grad=True)
    splits = torch.tensor(sizes)
    out = block(x, *_args(pattern, splits, scales))
    assert "GroupedMLP(ops 0.." in str(block.last_plan)
    expected = _reference(block, pattern, kind, x, sizes, scales)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    grad = torch.randn_like(out)
    got = _grads(block, x, scales, out, grad)
    want = _grads(block, x, scales, expected, grad)
    for g, w in zip(got, want, strict=True):
        if w is None:
            assert g is None or not g.abs().any()
        else:
            torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("pattern", ["scaled", "unscaled"])
def test_fused_equals_unfused_bf16(pattern):
    block = _block(pattern, "swiglu", dtype=torch.bfloat16)
    x = torch.randn(9, K, dtype=torch.bfloat16, requires_grad=True)
    scales = torch.rand(9, requires_grad=True)
    splits = [2, 0, 7]
    out = block(x, *_args(pattern, splits, scales))
    grads = _grads(block, x, scales, out, torch.ones_like(out))
    with fo.settings(fusion=False):
        unfused = block(x, *_args(pattern, splits, scales))
    unfused_grads = _grads(block, x, scales, unfused, torch.ones_like(out))
    # error model: bf16 rounding of sums over K (fc1) and HID (fc2) terms
    tol = 8 * 2.0**-8 * max(K, HID)
    torch.testing.assert_close(out, unfused, rtol=tol, atol=tol)
    for g, w in zip(grads, unfused_grads):
        if w is not None:
            torch.testing.assert_close(g, w, rtol=tol, atol=tol * max(1.0, w.abs().max().item()))


def test_buffers_are_written_in_place_and_bit_exact():
    block = _block("unscaled", "swiglu")
    x = torch.randn(10, K, dtype=torch.float64, requires_grad=True)
    splits = [4, 0, 6]
    plain = block(x, splits, splits)
    (plain_grad,) = torch.autograd.grad(plain.sum(), x)
    out_buf = torch.full((12, H), 7.0, dtype=torch.float64)  # a padded tail of 2 rows
    grad_buf = torch.full((12, K), 7.0, dtype=torch.float64)
    kwargs = {2: {fo.OUTPUT_BUFFER_KEY: out_buf}, 0: {fo.GRAD_INPUT_BUFFER_KEY: grad_buf}}
    out = block(x, splits, splits, op_kwargs=kwargs)
    assert out.data_ptr() == out_buf.data_ptr()
    (grad,) = torch.autograd.grad(out.sum(), x)
    assert grad.data_ptr() == grad_buf.data_ptr()
    assert torch.equal(out, plain) and torch.equal(grad, plain_grad)
    assert (out_buf[10:] == 7).all() and (grad_buf[10:] == 7).all()


def test_unfused_op_alone_and_parameter_names():
    op = fo.GroupedGateUpLinear(G, K, HID, dtype=torch.float64)
    assert [name for name, _ in op.named_parameters()] == ["gate_weight", "up_weight"]
    assert op.out_features == 2 * HID and "hidden_features=5" in repr(op)
    x = torch.randn(6, K, dtype=torch.float64)
    y = op(x, [1, 2, 3])
    starts = [0, 1, 3, 6]
    for g in range(G):
        rows = x[starts[g] : starts[g + 1]]
        torch.testing.assert_close(y[starts[g] : starts[g + 1], :HID], rows @ op.gate_weight[g].T)
        torch.testing.assert_close(y[starts[g] : starts[g + 1], HID:], rows @ op.up_weight[g].T)


def test_refusals_and_declines():
    op = fo.GroupedGateUpLinear(G, K, HID)
    with pytest.raises(ValueError, match="GroupedGateUpLinear: parameter 'up_weight' has shape"):
        op.up_weight = torch.nn.Parameter(torch.zeros(G, HID + 1, K))
        op(torch.randn(3, K), [1, 1, 1])
    op = fo.GroupedGateUpLinear(G, K, HID)
    with pytest.raises(TypeError, match="no single fc1 weight"):
        op.weight_out_in()
    with pytest.raises(ValueError, match="GroupedGateUpLinear: recipe .* quantizes bfloat16"):
        with fo.quantized(fo.recipes.Float8Tensorwise()):
            op.double()(torch.randn(3, K, dtype=torch.float64), [1, 1, 1])
    op.float()
    # an interleaved gated activation does not read [gate | up] halves: not fused, still right
    block = fo.Sequential(op, fo.SwiGLU(glu_interleave_size=1), fo.GroupedLinear(G, HID, H))
    x = torch.randn(3, K)
    block(x, [1, 1, 1], [1, 1, 1])
    assert "does not read fc1's output as [gate | up] halves" in str(block.last_plan)
