"""GroupedLinear, BasicLinear and the fused GroupedMLP under every recipe, forward and
backward, against the float64 emulation of tests/recipe_reference.py."""

from __future__ import annotations

import pytest
import torch

import fusible_ops as fo
from tests import recipe_reference as ref

R = fo.recipes
GROUPS = [5, 0, 43, 21]  # a zero-row group; sizes not multiples of 32
ACCEPTANCE = [
    R.MXFP8(),
    R.MXFP8(scale_rounding="floor"),
    R.Float8Rowwise(),
    R.Float8Tensorwise(),
    R.Float8Blockwise(),
]
OTHERS = [
    R.Float8Tensorwise(fp8_format="e4m3", pow2_scales=True),
    R.Float8Blockwise(pow2_scales=True),
    R.MXFP8(wgrad_high_precision=True),
    R.Float8Rowwise(wgrad_high_precision=True),
]
OUT_TOL, GRAD_TOL = 2e-3, 5e-3


def rel(actual: torch.Tensor, expected: torch.Tensor) -> float:
    expected = expected.detach()
    return float((actual.detach().double() - expected).norm() / expected.norm())


def check(actual, expected, unquantized, tol):
    """Within ``tol`` of the quantized emulation, and visibly not the unquantized result."""
    assert rel(actual, expected) <= tol, rel(actual, expected)
    assert rel(unquantized, expected) > 3 * tol, "quantization made no visible difference"


def _backward(seq, args, dy):
    out = seq(*args)
    out.backward(dy)
    return out


def _grads(tensors):
    grads = [t.grad.clone() for t in tensors]
    for t in tensors:
        t.grad = None
    return grads


LINEAR_CASES = [(r, "out_in") for r in ACCEPTANCE + OTHERS] + [
    (r, "in_out") for r in (R.MXFP8(), R.Float8Rowwise(), R.Float8Tensorwise())
]


@pytest.mark.parametrize("recipe, layout", LINEAR_CASES, ids=str)
def test_grouped_linear(recipe, layout):
    fc = fo.GroupedLinear(4, 80, 72, bias=True, weight_layout=layout)
    seq = fo.Sequential(fc)
    m = sum(GROUPS)
    x = torch.randn(m, 80, requires_grad=True)
    dy = torch.randn(m, 72)
    splits = torch.tensor(GROUPS)
    params = [x, fc.weight, fc.bias]
    y0 = _backward(seq, (x, splits), dy)
    g0 = _grads(params)
    with fo.quantized(recipe):
        y = _backward(seq, (x, splits), dy)
    g = _grads(params)
    w = fc.weight_out_in().detach()
    y_ref, dx_ref, dw_ref, db_ref = ref.grouped_gemms(
        x.detach(), dy, w, fc.bias.detach(), GROUPS, recipe, torch.float32
    )
    check(y, y_ref, y0, OUT_TOL)
    check(g[0], dx_ref, g0[0], GRAD_TOL)
    dw = fc.weight_out_in(g[1])
    if recipe.wgrad_high_precision:
        assert rel(dw, dw_ref) <= 1e-6
    else:
        check(dw, dw_ref, fc.weight_out_in(g0[1]), GRAD_TOL)
    assert rel(g[2], db_ref) <= 1e-6  # the bias gradient is not a GEMM
    assert y.dtype == x.dtype and g[1].dtype == fc.weight.dtype


@pytest.mark.parametrize("recipe", ACCEPTANCE, ids=repr)
def test_basic_linear(recipe):
    lin = fo.BasicLinear(96, 40)
    seq = fo.Sequential(lin)
    x = torch.randn(2, 19, 96, requires_grad=True)
    dy = torch.randn(2, 19, 40)
    y0 = _backward(seq, (x,), dy)
    g0 = _grads([x, lin.weight])
    with fo.quantized(recipe):
        y = _backward(seq, (x,), dy)
    g = _grads([x, lin.weight])
    y_ref, dx_ref, dw_ref, _ = ref.grouped_gemms(
        x.detach().reshape(38, 96),
        dy.reshape(38, 40),
        lin.weight.detach().unsqueeze(0),
        None,
        [38],
        recipe,
        torch.float32,
    )
    check(y.reshape(38, 40), y_ref, y0.reshape(38, 40), OUT_TOL)
    check(g[0].reshape(38, 96), dx_ref, g0[0].reshape(38, 96), GRAD_TOL)
    check(g[1], dw_ref[0], g0[1], GRAD_TOL)


ACTIVATIONS = {
    "swiglu": (fo.ScaledSwiGLU, fo.SwiGLU, True),
    "geglu": (fo.ScaledGEGLU, fo.GEGLU, True),
    "clamped_swiglu": (fo.ScaledClampedSwiGLU, fo.ClampedSwiGLU, True),
    "srelu": (fo.ScaledSReLU, fo.SReLU, False),
}


def expert_block(kind: str, scale_after: bool, layout: str = "out_in", bias: bool = True):
    scaled, unscaled, gated = ACTIVATIONS[kind]
    ffn = 48
    ops = [
        fo.GroupedLinear(4, 64, 2 * ffn if gated else ffn, bias=bias, weight_layout=layout),
        unscaled() if scale_after else scaled(),
        fo.GroupedLinear(4, ffn, 64, bias=bias, weight_layout=layout),
    ]
    if scale_after:
        ops.append(fo.Scale())
    return fo.Sequential(*ops)


def run_block(seq, recipe, x, probs, splits, dy, op_kwargs=None):
    scale_after = len(seq) == 4
    args = (x, splits, splits, probs) if scale_after else (x, splits, probs, splits)
    with fo.quantized(recipe):
        y = seq(*args, op_kwargs=op_kwargs)
        y.backward(dy)
        plan = seq.last_plan
    return y, plan


BLOCK_CASES = (
    [(r, "swiglu", False, "out_in") for r in ACCEPTANCE]
    + [(R.MXFP8(), kind, False, "out_in") for kind in ("geglu", "clamped_swiglu", "srelu")]
    + [(r, "swiglu", True, "out_in") for r in (R.MXFP8(), R.Float8Rowwise())]
    + [(R.Float8Tensorwise(), "srelu", True, "out_in")]
    + [(r, "swiglu", False, "in_out") for r in (R.MXFP8(scale_rounding="floor"), R.Float8Rowwise())]
    + [(R.Float8Blockwise(wgrad_high_precision=True), "geglu", False, "out_in")]
)


@pytest.mark.parametrize("recipe, kind, scale_after, layout", BLOCK_CASES, ids=str)
def test_fused_block(recipe, kind, scale_after, layout):
    seq = expert_block(kind, scale_after, layout)
    fc1, act, fc2 = seq[0], seq[1], seq[2]
    m = sum(GROUPS)
    x = torch.randn(m, 64, requires_grad=True)
    probs = torch.rand(m, requires_grad=True)
    dy = torch.randn(m, 64)
    splits = torch.tensor(GROUPS)
    leaves = [x, probs, fc1.weight, fc1.bias, fc2.weight, fc2.bias]
    y0, _ = run_block(seq, None, x, probs, splits, dy)
    g0 = _grads(leaves)
    y, plan = run_block(seq, recipe, x, probs, splits, dy)
    g = _grads(leaves)
    assert plan.fusion_plans[0].forward_op_types() == ["GroupedMLP"]
    assert repr(recipe) in str(plan) and "quantized once" in str(plan)
    spec = act.spec
    expected = ref.mlp(
        x.detach(), fc1.weight_out_in().detach(), fc1.bias.detach(), fc2.weight_out_in().detach(),
        fc2.bias.detach(), probs.detach(), dy, GROUPS, recipe, kind, torch.float32, scale_after=scale_after,
    )  # fmt: skip
    if kind == "clamped_swiglu":
        assert spec.limit == 7.0 and spec.alpha == 1.702 and spec.glu_linear_offset == 1.0
    y_ref, dx_ref, dw1_ref, db1_ref, dw2_ref, db2_ref, dp_ref = expected
    check(y, y_ref, y0, OUT_TOL)
    check(g[0], dx_ref, g0[0], GRAD_TOL)
    check(g[1], dp_ref, g0[1], GRAD_TOL)
    for index, want in ((2, dw1_ref), (4, dw2_ref)):
        fc = fc1 if index == 2 else fc2
        got, unq = fc.weight_out_in(g[index]), fc.weight_out_in(g0[index])
        if recipe.wgrad_high_precision:
            assert rel(got, want) <= 1e-5
        else:
            check(got, want, unq, GRAD_TOL)
    assert rel(g[3], db1_ref) <= GRAD_TOL and rel(g[5], db2_ref) <= GRAD_TOL


@pytest.mark.parametrize("recipe", [R.MXFP8(), R.Float8Tensorwise()], ids=repr)
def test_fused_equals_unfused(recipe):
    seq = expert_block("swiglu", False)
    m = sum(GROUPS)
    x = torch.randn(m, 64, requires_grad=True)
    probs = torch.rand(m, requires_grad=True)
    dy = torch.randn(m, 64)
    splits = torch.tensor(GROUPS)
    y, _ = run_block(seq, recipe, x, probs, splits, dy)
    g = _grads([x, probs, seq[0].weight, seq[2].weight])
    with fo.settings(fusion=False):
        y2, plan = run_block(seq, recipe, x, probs, splits, dy)
    g2 = _grads([x, probs, seq[0].weight, seq[2].weight])
    assert "GroupedMLP" not in plan.fusion_plans[0].forward_op_types()
    assert rel(y, y2.double()) <= 1e-6
    for a, b in zip(g, g2):
        assert rel(a, b.double()) <= 1e-6


def gate_up_reference(x, w_gate, w_up, w2, dy, recipe):
    """Separate gate and up GEMMs -> SwiGLU -> fc2, each GEMM quantized as GroupedLinear's:
    ``(y, dx, d_gate_w, d_up_w, dw2)`` in float64 (rounded where fp32 results are stored)."""
    dtype, none = torch.float32, torch.zeros(x.shape[0], w_gate.shape[1])
    gate = ref.grouped_gemms(x, none, w_gate, None, GROUPS, recipe, dtype)[0]
    up = ref.grouped_gemms(x, none, w_up, None, GROUPS, recipe, dtype)[0]
    gate_leaf, up_leaf = gate.clone().requires_grad_(True), up.clone().requires_grad_(True)
    act_exact = gate_leaf * torch.sigmoid(gate_leaf) * up_leaf
    act = ref.rd(act_exact.detach(), dtype)
    y, d_act, dw2, _ = ref.grouped_gemms(act.float(), dy, w2, None, GROUPS, recipe, dtype)
    grad_gate, grad_up = (
        ref.rd(g, dtype) for g in torch.autograd.grad(act_exact, (gate_leaf, up_leaf), d_act)
    )
    _, dx_gate, d_gate_w, _ = ref.grouped_gemms(x, grad_gate.float(), w_gate, None, GROUPS, recipe, dtype)
    _, dx_up, d_up_w, _ = ref.grouped_gemms(x, grad_up.float(), w_up, None, GROUPS, recipe, dtype)
    return y, ref.rd(dx_gate + dx_up, dtype), d_gate_w, d_up_w, dw2


GATE_UP_RECIPES = [R.MXFP8(), R.MXFP8(scale_rounding="floor"), R.Float8Rowwise(), R.Float8Tensorwise()]


@pytest.mark.parametrize("recipe", [*GATE_UP_RECIPES, R.Float8Rowwise(wgrad_high_precision=True)], ids=repr)
@pytest.mark.parametrize("fusion", [True, False], ids=["fused", "unfused"])
def test_gate_up_block(recipe, fusion):
    """fc1 with separate gate and up weights (torchtitan's w1/w3) under a recipe: two
    quantized fc1 GEMMs sharing one quantized input, fused or not."""
    torch.manual_seed(0)
    seq = fo.Sequential(fo.GroupedGateUpLinear(4, 64, 48), fo.SwiGLU(), fo.GroupedLinear(4, 48, 64))
    m = sum(GROUPS)
    x = torch.randn(m, 64, requires_grad=True)
    dy = torch.randn(m, 64)
    splits = torch.tensor(GROUPS)
    leaves = [x, seq[0].gate_weight, seq[0].up_weight, seq[2].weight]
    with fo.settings(fusion=fusion):
        y0 = _backward(seq, (x, splits, splits), dy)
        g0 = _grads(leaves)
        with fo.quantized(recipe):
            y = _backward(seq, (x, splits, splits), dy)
            plan = str(seq.last_plan)
        g = _grads(leaves)
    assert ("GroupedMLP" in plan) == fusion and repr(recipe) in plan
    weights = [t.detach() for t in leaves[1:]]
    y_ref, dx_ref, dg_ref, du_ref, dw2_ref = gate_up_reference(x.detach(), *weights, dy, recipe)
    check(y, y_ref, y0, OUT_TOL)
    check(g[0], dx_ref, g0[0], GRAD_TOL)
    for got, want, unq in zip(g[1:], (dg_ref, du_ref, dw2_ref), g0[1:]):
        if recipe.wgrad_high_precision:
            assert rel(got, want) <= 1e-5
        else:
            check(got, want, unq, GRAD_TOL)


@pytest.mark.parametrize("pattern", ["scaled", "scale_after"])
def test_gate_up_scaled_patterns_fused_equal_unfused(pattern):
    torch.manual_seed(0)
    fc1, fc2 = fo.GroupedGateUpLinear(4, 64, 48), fo.GroupedLinear(4, 48, 64, bias=True)
    if pattern == "scaled":
        seq = fo.Sequential(fc1, fo.ScaledSwiGLU(), fc2)
    else:
        seq = fo.Sequential(fc1, fo.SwiGLU(), fc2, fo.Scale())
    m = sum(GROUPS)
    x, probs = torch.randn(m, 64, requires_grad=True), torch.rand(m, requires_grad=True)
    splits = torch.tensor(GROUPS)
    args = (x, splits, probs, splits) if pattern == "scaled" else (x, splits, splits, probs)
    dy = torch.randn(m, 64)
    leaves = [x, probs, *seq.parameters()]
    results = []
    for fusion in (True, False):
        with fo.settings(fusion=fusion), fo.quantized(R.MXFP8()):
            y = _backward(seq, args, dy)
            assert ("GroupedMLP" in str(seq.last_plan)) == fusion
        results.append([y, *_grads(leaves)])
    for fused, unfused in zip(*results):
        assert rel(fused, unfused.double()) <= 1e-6


@pytest.mark.parametrize("recipe", [R.MXFP8(), R.Float8Rowwise(), R.Float8Tensorwise(), R.Float8Blockwise()], ids=repr)
@pytest.mark.parametrize("fusion", [True, False], ids=["fused", "unfused"])
def test_pre_quantized_fc1_input(recipe, fusion):
    """fc1's input already quantized (an EP dispatch that sent FP8 rows and scales): the
    same output and gradients, bit for bit, as quantizing in the call; the operand given
    is the one the GEMM reads; a caller output buffer is still written in place."""
    seq = expert_block("swiglu", False)
    m = sum(GROUPS)
    x = torch.randn(m, 64, requires_grad=True)
    probs = torch.rand(m, requires_grad=True)
    dy = torch.randn(m, 64)
    splits = torch.tensor(GROUPS)
    leaves = [x, probs, seq[0].weight, seq[2].weight]
    with fo.settings(fusion=fusion):
        y, _ = run_block(seq, recipe, x, probs, splits, dy)
        g = _grads(leaves)
        x_q = R.quantize_input(x.detach(), recipe, GROUPS)
        out = torch.full((m + 3, 64), 7.0)
        kwargs = {0: {fo.QUANTIZED_INPUT_KEY: x_q}, 2: {fo.OUTPUT_BUFFER_KEY: out}}
        y2, plan = run_block(seq, recipe, x, probs, splits, dy, op_kwargs=kwargs)
        g2 = _grads(leaves)
        assert ("GroupedMLP" in str(plan)) == fusion
        assert torch.equal(y, y2) and torch.equal(out[:m], y) and bool((out[m:] == 7.0).all())
        for a, b in zip(g, g2):
            assert torch.equal(a, b)
        # another operand is what the forward GEMM reads
        other = R.quantize_input(2 * x.detach(), recipe, GROUPS)
        y3, _ = run_block(seq, recipe, x, probs, splits, dy, op_kwargs={0: {fo.QUANTIZED_INPUT_KEY: other}})
        _grads(leaves)
        assert not torch.equal(y3, y)


def test_pre_quantized_input_is_validated_before_any_write():
    seq = expert_block("swiglu", False)
    m = sum(GROUPS)
    x, probs, splits = torch.randn(m, 64), torch.rand(m), torch.tensor(GROUPS)
    mx = R.quantize_input(x, R.MXFP8(), GROUPS)
    other_splits = R.quantize_input(x, R.Float8Tensorwise(), [m, 0, 0, 0])
    cases = [
        (R.Float8Rowwise(), mx, "column tiles of 32"),
        (R.MXFP8(), R.quantize_input(x[:-1], R.MXFP8(), [5, 0, 43, 20]), "shape"),
        (R.Float8Tensorwise(), other_splits, "row tiles that do not follow"),
        (None, mx, "no low-precision recipe is in force"),
        (R.MXFP8(), x, "must be a fusible_ops.recipes.QuantizedOperand"),
    ]
    for fusion in (True, False):
        for recipe, operand, message in cases:
            out = torch.full((m, 64), 7.0)
            kwargs = {0: {fo.QUANTIZED_INPUT_KEY: operand}, 2: {fo.OUTPUT_BUFFER_KEY: out}}
            with fo.settings(fusion=fusion), fo.quantized(recipe):
                with pytest.raises((ValueError, TypeError), match=f"GroupedLinear.*quantized_input.*{message}"):
                    seq(x, splits, probs, splits, op_kwargs=kwargs)
            assert bool((out == 7.0).all())
