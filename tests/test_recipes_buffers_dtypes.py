"""Recipes with caller buffers, low-precision inputs, torch.compile, saved bytes and E5M2.

- invalid ``grad_input`` buffers on the fused expert block, refused before any write,
  under every recipe; ``BasicLinear`` refuses buffers; ``GroupedLinear``'s ``output``
  buffer with a padded tail under every recipe;
- bfloat16 and float16 inputs under every recipe against the float64 emulation of
  tests/recipe_reference.py, tolerances from an error model (tests/error_model.py);
- ``Float8Tensorwise`` (both ``fp8_format`` values) compiled with ``fullgraph=True``;
- the bytes saved for backward under every recipe;
- E5M2 ties and saturation of ``Float8Tensorwise(fp8_format="hybrid")``'s gradient operand
  against an exact rational reference written here.
"""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import fusible_ops as fo
from fusible_ops.cli.bench import fused_forward, make_problem, saved_bytes
from fusible_ops.cli.options import Shape
from fusible_ops.cli.recipe_bench import quantized_forward
from fusible_ops.recipes.formats import cast_saturated
from tests import error_model as em
from tests import recipe_reference as ref
from tests.test_recipes_integration import GROUPS as BLOCK_GROUPS
from tests.test_recipes_integration import block, inputs, run
from tests.test_recipes_ops import _backward, _grads, rel, run_block

R = fo.recipes
RECIPES = [R.MXFP8(), R.Float8Tensorwise(), R.Float8Rowwise(), R.Float8Blockwise()]  # MXFP8: rceil
LOW_DTYPES = [torch.bfloat16, torch.float16]


class Untouched:
    """Bits and version counters of tensors, to check later that nothing wrote them (an
    in-place write bumps the version even when it writes the same bits)."""

    def __init__(self, **tensors: torch.Tensor | None) -> None:
        self.saved = {
            name: (t, t.detach().clone(), t._version) for name, t in tensors.items() if t is not None
        }

    def check(self) -> None:
        for name, (t, copy, version) in self.saved.items():
            same_bits = torch.equal(t.detach().view(torch.uint8), copy.view(torch.uint8))
            assert same_bits and t._version == version, f"{name} was written"


def _sentinel(*shape: int, dtype=torch.float32) -> torch.Tensor:
    """A buffer full of 7.0 with a NaN in it (compared bit for bit)."""
    t = torch.full(shape, 7.0, dtype=dtype)
    t.view(-1)[1] = float("nan")
    return t


# ---------------------------------------------------------------- 1. invalid grad_input on the fused block


@pytest.mark.parametrize("case", ["dtype", "rows", "overlap"])
@pytest.mark.parametrize("recipe", RECIPES, ids=repr)
def test_invalid_grad_input_buffer_refused_before_any_write(recipe, case):
    seq = block()
    m, hidden = sum(BLOCK_GROUPS), 64
    splits = torch.tensor(BLOCK_GROUPS)
    workspace = torch.randn(2 * m, hidden)
    x = workspace[:m].requires_grad_()  # a leaf view: a buffer may overlap it
    probs = torch.rand(m, requires_grad=True)
    valid = {0: {fo.GRAD_INPUT_BUFFER_KEY: torch.empty(m, hidden)}}
    with fo.quantized(recipe):  # with a valid buffer the block fuses (GroupedMLP takes fc1's grad_input)
        plan = seq.explain(x, splits, probs, splits, op_kwargs=valid)
    assert plan.fusion_plans[0].forward_op_types() == ["GroupedMLP"]
    for t in (x, probs, *seq.parameters()):  # gradients of an earlier step, to be kept
        t.grad = torch.randn_like(t)
    bad, message = {
        "dtype": (
            _sentinel(m, hidden, dtype=torch.bfloat16),
            "has dtype torch.bfloat16; expected torch.float32",
        ),
        "rows": (_sentinel(m - 1, hidden), f"has {m - 1} rows; at least {m} are needed"),
        "overlap": (workspace[m - 2 : 2 * m - 2], "overlaps the memory of an input"),  # x's last 2 rows
    }[case]
    out = _sentinel(m, hidden)  # a valid fc2 output buffer: the forward would write it first
    leaves = {"x": x, "probs": probs, **dict(seq.named_parameters())}
    state = Untouched(
        workspace=workspace,
        bad=bad,
        out=out,
        **leaves,
        **{f"{name}.grad": t.grad for name, t in leaves.items()},
    )
    kwargs = {0: {fo.GRAD_INPUT_BUFFER_KEY: bad}, 2: {fo.OUTPUT_BUFFER_KEY: out}}
    with (
        fo.quantized(recipe),
        pytest.raises(ValueError, match=f"GroupedLinear: buffer 'grad_input'.*{message}"),
    ):
        seq(x, splits, probs, splits, op_kwargs=kwargs)
    state.check()


# ---------------------------------------------------------------- 2. output buffers: BasicLinear, GroupedLinear


@pytest.mark.parametrize("recipe", RECIPES, ids=repr)
def test_basic_linear_refuses_output_buffers_before_any_write(recipe):
    """BasicLinear takes no caller buffers (docs/buffers.md: GroupedLinear's kwargs): under a
    recipe a padded or an invalid ``output`` buffer is refused, naming the op, before anything
    runs."""
    seq = fo.Sequential(fo.BasicLinear(48, 40), recipe=recipe)
    x = torch.randn(2, 7, 48, requires_grad=True)
    seq(x).sum().backward()
    weight = seq[0].weight
    for buffer in (_sentinel(14 + 3, 40), _sentinel(14, 40, dtype=torch.bfloat16), _sentinel(13, 40)):
        state = Untouched(buffer=buffer, weight=weight, weight_grad=weight.grad, x_grad=x.grad)
        with pytest.raises(TypeError, match=r"BasicLinear got unexpected kwarg\(s\) \['output'\]"):
            seq(x, op_kwargs={0: {fo.OUTPUT_BUFFER_KEY: buffer}})
        state.check()


@pytest.mark.parametrize("recipe", RECIPES, ids=repr)
def test_grouped_linear_output_buffer_padded_tail(recipe):
    """A dense-shaped input ``[2, 7, 48]`` through one GroupedLinear under a recipe: a flat
    ``output`` buffer with 3 rows of padding is written in place, bit-exact with the call
    without it (forward and gradients), its tail untouched; invalid ones are refused first."""
    splits = torch.tensor([4, 0, 10])
    seq = fo.Sequential(fo.GroupedLinear(3, 48, 40, bias=True), recipe=recipe)
    fc = seq[0]
    x = torch.randn(2, 7, 48, requires_grad=True)
    dy = torch.randn(2, 7, 40)
    leaves = [x, fc.weight, fc.bias]
    y = _backward(seq, (x, splits), dy)
    grads = _grads(leaves)
    out = _sentinel(14 + 3, 40)
    tail = out[14:].clone()
    y_buf = seq(x, splits, op_kwargs={0: {fo.OUTPUT_BUFFER_KEY: out}})
    y_buf.backward(dy)
    assert repr(recipe) in str(seq.last_plan)
    assert y_buf.data_ptr() == out.data_ptr() and y_buf.shape == (2, 7, 40) and not out.requires_grad
    assert torch.equal(y_buf, y) and torch.equal(out[:14].view(2, 7, 40), y)
    assert torch.equal(out[14:].view(torch.int32), tail.view(torch.int32))  # bits: the tail holds a NaN
    for a, b in zip(_grads(leaves), grads):
        assert torch.equal(a, b)
    workspace = torch.randn(40, 48)
    x_view = workspace[:14].view(2, 7, 48)
    invalid = {
        "has dtype torch.bfloat16": (x, _sentinel(14, 40, dtype=torch.bfloat16)),
        "has 13 rows; at least 14": (x, _sentinel(13, 40)),
        r"has shape \(14, 41\)": (x, _sentinel(14, 41)),
        "overlaps the memory of an input": (x_view, workspace[10:].view(-1, 40)[:16]),
        "overlaps the memory of an input, extra input, parameter": (x, fc.weight.detach().view(-1, 40)[:14]),
    }
    for message, (inp, buffer) in invalid.items():
        state = Untouched(workspace=workspace, buffer=buffer, weight=fc.weight, bias=fc.bias)
        with pytest.raises(ValueError, match=f"GroupedLinear: buffer 'output'.*{message}"):
            seq(inp, splits, op_kwargs={0: {fo.OUTPUT_BUFFER_KEY: buffer}})
        state.check()


# ---------------------------------------------------------------- 3. bfloat16 / float16 against the float64 emulation
#
# Error model (u = the dtype's unit roundoff, torch.finfo(dtype).eps / 2: 2**-8 for bfloat16,
# 2**-11 for float16). Both sides quantize the same values to the same FP8 operands; the
# library sums the products in fp32, the reference in float64 (off by at most
# gamma_n(fp32) * sum|a_i b_i|), and each side rounds a stored result to the dtype once
# (at most u relative). So a GEMM result stored by both sides (the reference rounds what
# the library stores) differs by at most 2u (em.BOTH_SIDES roundings) relative plus the
# fp32 sum's absolute error; a weight gradient (the reference keeps it unrounded) by u.

QUANTIZED_GROWTH = 1.25  # |FP8(v)| <= (1 + 2**-3) |v| (E5M2's relative half-quantum) < 1.25 |v|


def _row_norms(t: torch.Tensor) -> float:
    return float(t.detach().double().norm(dim=-1).max())


def _assert_gemm_close(actual, expected, dtype, roundings, fp32_terms, norm_a, norm_b, extra=0.0):
    """Each element within ``rtol |expected| + atol``: ``roundings`` roundings to ``dtype``
    and a ``fp32_terms``-term fp32 sum of products bounded by ``norm_a * norm_b``
    (Cauchy-Schwarz on the operands' rows, grown by quantization) plus ``extra`` (a bias)."""
    bound = norm_a * norm_b * QUANTIZED_GROWTH**2 + extra
    atol = (1 + em.unit_roundoff(dtype)) * em.rounding_rtol(torch.float32, fp32_terms) * bound
    atol += roundings * torch.finfo(dtype).smallest_normal * em.unit_roundoff(dtype)  # subnormal results
    rtol = em.rounding_rtol(dtype, roundings)
    error = (actual.detach().double() - expected).abs()
    allowed = atol + rtol * expected.abs()
    assert bool((error <= allowed).all()), float((error / allowed).max())
    return allowed


def _assert_not_close(unquantized, expected, allowed):
    """The unquantized result breaks the bound: the comparison sees the quantization."""
    assert bool(((unquantized.detach().double() - expected).abs() > allowed).any())


@pytest.mark.numerics
@pytest.mark.parametrize("dtype", LOW_DTYPES, ids=str)
@pytest.mark.parametrize("recipe", RECIPES, ids=repr)
def test_grouped_linear_low_precision_inputs(recipe, dtype):
    groups = [3, 0, 9, 4]  # a zero-row group, sizes not multiples of any tile
    fc = fo.GroupedLinear(4, 48, 40, bias=True, dtype=dtype)
    seq = fo.Sequential(fc)
    m = sum(groups)
    x = torch.randn(m, 48, dtype=dtype, requires_grad=True)
    dy = torch.randn(m, 40, dtype=dtype)
    splits = torch.tensor(groups)
    leaves = [x, fc.weight, fc.bias]
    y0 = _backward(seq, (x, splits), dy)
    g0 = _grads(leaves)
    with fo.quantized(recipe):
        y = _backward(seq, (x, splits), dy)
    g = _grads(leaves)
    assert y.dtype == dtype and all(t.dtype == dtype for t in g)
    w = fc.weight.detach()
    y_ref, dx_ref, dw_ref, db_ref = ref.grouped_gemms(
        x.detach(), dy, w, fc.bias.detach(), groups, recipe, dtype
    )
    # y = x W^T + b: 48 products summed; both sides round y
    bias = float(fc.bias.detach().abs().max())
    allowed = _assert_gemm_close(y, y_ref, dtype, em.BOTH_SIDES, 48 + 1, _row_norms(x), _row_norms(w), bias)
    _assert_not_close(y0, y_ref, allowed)
    # dx = dy W: 40 products
    wt = w.transpose(1, 2)
    allowed = _assert_gemm_close(g[0], dx_ref, dtype, em.BOTH_SIDES, 40, _row_norms(dy), _row_norms(wt))
    _assert_not_close(g0[0], dx_ref, allowed)
    # dW = dy^T x over a group's rows (at most 9): the library rounds once, the reference not
    rows = max(groups)
    allowed = _assert_gemm_close(g[1], dw_ref, dtype, 1, rows, _row_norms(dy.t()), _row_norms(x.detach().t()))
    _assert_not_close(g0[1], dw_ref, allowed)
    # db: a plain sum of the dtype's dy over a group's rows, in any order, then one rounding
    db_tol = em.rounding_rtol(dtype, rows + 1) * float(dy.double().abs().sum(0).max())
    assert float((g[2].double() - db_ref).abs().max()) <= db_tol


# The fused block's gated activation (and its derivative) runs in the input's dtype
# (fusible_ops/kernels/activation.py: silu(gate) rounded, then times linear, ...), where the
# reference rounds each stored result once: its intermediates differ from the reference's
# by a few u. Re-quantizing them to FP8 (relative quantum q = 2**-mantissa_bits: 2**-3 for
# E4M3, 2**-2 for E5M2) moves an element by one quantum with probability |delta| / q, so a
# perturbation of k u becomes a relative rms error of about sqrt(k u q), not k u. We allow
# k = em.EXPERT_BLOCK_ROUNDINGS: bfloat16 E4M3 ~0.058 (15 u), float16 E4M3 ~0.021 (42 u).
# Probabilities are passed already rounded to the dtype (as a bf16 router makes them):
# the library multiplies by them in the input's dtype.
#
# With ScaledSReLU and power-of-two probabilities the library's elementwise arithmetic
# rounds exactly where the reference does (relu(x) * relu(x) and 2 relu(x) * g: one
# rounding of an exact value; scaling by 2**-k is exact), so the intermediates agree and
# the tight model holds: 2u (both sides round) plus 2u of headroom for a rare bf16 tie that
# the fp32 and float64 sums break differently before a re-quantization.


BLOCK_DTYPE_GROUPS = [3, 0, 9, 4]


def _quantum(recipe, kind: str) -> float:
    return 2.0 ** -recipe.format_for(kind).mantissa_bits


def _block_case(kind: str, recipe, dtype):
    """The fused block (hidden 48: a partial MX tile; ffn 16) in ``dtype``, unquantized and
    under ``recipe``; returns (results, unquantized results, reference), by name."""
    m = sum(BLOCK_DTYPE_GROUPS)
    scaled, gated = {"swiglu": (fo.ScaledSwiGLU, True), "srelu": (fo.ScaledSReLU, False)}[kind]
    seq = fo.Sequential(
        fo.GroupedLinear(4, 48, 32 if gated else 16, bias=True, dtype=dtype),
        scaled(),
        fo.GroupedLinear(4, 16, 48, bias=True, dtype=dtype),
    )
    x = torch.randn(m, 48, dtype=dtype, requires_grad=True)
    if kind == "srelu":
        probs = 2.0 ** -torch.randint(0, 4, (m,)).float()
    else:
        probs = torch.rand(m).to(dtype).float()
    probs.requires_grad_()
    dy = torch.randn(m, 48, dtype=dtype)
    splits = torch.tensor(BLOCK_DTYPE_GROUPS)
    fc1, fc2 = seq[0], seq[2]
    leaves = [x, probs, fc1.weight, fc1.bias, fc2.weight, fc2.bias]
    y0, _ = run_block(seq, None, x, probs, splits, dy)
    g0 = _grads(leaves)
    y, plan = run_block(seq, recipe, x, probs, splits, dy)
    g = _grads(leaves)
    assert plan.fusion_plans[0].forward_op_types() == ["GroupedMLP"]
    assert y.dtype == dtype and g[0].dtype == dtype and g[1].dtype == torch.float32
    assert all(t.dtype == dtype for t in g[2:])
    weights = [t.detach() for t in (fc1.weight, fc1.bias, fc2.weight, fc2.bias)]
    expected = ref.mlp(x.detach(), *weights[:2], *weights[2:], probs.detach(), dy, BLOCK_DTYPE_GROUPS,
                       recipe, kind, dtype)  # fmt: skip
    y_ref, dx_ref, dw1_ref, db1_ref, dw2_ref, db2_ref, dp_ref = expected
    got = {"y": y, "dx": g[0], "dprobs": g[1], "dw1": g[2], "db1": g[3], "dw2": g[4], "db2": g[5]}
    unq = {"y": y0, "dx": g0[0], "dprobs": g0[1], "dw1": g0[2], "db1": g0[3], "dw2": g0[4], "db2": g0[5]}
    want = {"y": y_ref, "dx": dx_ref, "dprobs": dp_ref, "dw1": dw1_ref, "db1": db1_ref, "dw2": dw2_ref}
    want["db2"] = db2_ref
    return got, unq, want


@pytest.mark.numerics
@pytest.mark.parametrize("dtype", LOW_DTYPES, ids=str)
@pytest.mark.parametrize("recipe", RECIPES, ids=repr)
def test_fused_block_low_precision_inputs(recipe, dtype):
    """GroupedLinear -> ScaledSwiGLU -> GroupedLinear (fused) with bf16/fp16 inputs."""
    got, unq, want = _block_case("swiglu", recipe, dtype)
    u = em.unit_roundoff(dtype)
    k = em.EXPERT_BLOCK_ROUNDINGS
    for name in got:
        q = _quantum(recipe, "input" if name == "y" else "grad")
        tol = math.sqrt(k * u * q)
        assert rel(got[name], want[name]) <= tol, (name, rel(got[name], want[name]) / u)
        if name != "db2":  # fc2's bias gradient (a sum of dy) does not see the quantization
            assert rel(got[name], want[name]) < rel(unq[name], want[name]), name


@pytest.mark.numerics
@pytest.mark.parametrize("dtype", LOW_DTYPES, ids=str)
@pytest.mark.parametrize("recipe", RECIPES, ids=repr)
def test_fused_srelu_block_low_precision_inputs_tight(recipe, dtype):
    """GroupedLinear -> ScaledSReLU -> GroupedLinear (fused), power-of-two probabilities:
    the library rounds where the reference does, so every result is within 4 u."""
    got, unq, want = _block_case("srelu", recipe, dtype)
    tol = (em.BOTH_SIDES + 2) * em.unit_roundoff(dtype)
    for name in got:
        assert rel(got[name], want[name]) <= tol, (name, rel(got[name], want[name]) / em.unit_roundoff(dtype))
        if name != "db2":
            assert rel(unq[name], want[name]) > tol, f"{name}: quantization made no visible difference"


# ---------------------------------------------------------------- 4. Float8Tensorwise under torch.compile


@pytest.mark.numerics
def test_tensorwise_compiled_equals_eager_and_recompiles_only_on_a_new_format():
    seq = block()
    x, probs, splits = inputs()
    dy = torch.randn(x.shape[0], 64)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(seq, backend=counter, fullgraph=True)
    hybrid, e4m3 = R.Float8Tensorwise(), R.Float8Tensorwise(fp8_format="e4m3")
    grads = {}
    steps = ((hybrid, 1), (R.Float8Tensorwise(), 1), (e4m3, 2), (hybrid, 2), (e4m3, 2))
    for recipe, compilations in steps:  # an equal recipe (a new instance) reuses the graph
        with fo.quantized(recipe):
            eager = run(seq, x, probs, splits, dy=dy)
            got = run(compiled, x, probs, splits, dy=dy)
            assert "Float8Tensorwise" in str(seq.last_plan)
        assert torch.equal(got[0], eager[0])
        assert all(torch.equal(a, b) for a, b in zip(got[1], eager[1]))
        assert counter.frame_count == compilations, (recipe, counter.frame_count)
        grads.setdefault(recipe.fp8_format, got[1])
    # E5M2 and E4M3 gradients differ: a graph kept from the other format would be seen above
    assert not torch.equal(grads["hybrid"][0], grads["e4m3"][0])


# ---------------------------------------------------------------- 5. saved-for-backward bytes


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("recipe", RECIPES, ids=repr)
def test_saves_fewer_bytes_than_unquantized_every_recipe(recipe, dtype):
    """``bench --recipe``'s measure (distinct storages saved, parameters excluded): fewer
    bytes under the recipe, and fc1's high-precision input is not among them."""
    p = make_problem(Shape(experts=4, hidden=64, ffn=32, rows=32), dtype, torch.device("cpu"))
    plain = saved_bytes(fused_forward, p)
    R.clear_weight_cache()
    quantized = saved_bytes(quantized_forward(recipe), p)
    assert 0 < quantized < plain, (quantized, plain)

    def saves_input(forward) -> bool:
        x, probs = p.x.detach().requires_grad_(), p.probs.detach().requires_grad_()
        storages = []
        with torch.autograd.graph.saved_tensors_hooks(
            lambda t: storages.append(t.untyped_storage()) or t, lambda t: t
        ):
            forward(p, x, probs)
        return any(s.data_ptr() == x.untyped_storage().data_ptr() for s in storages)

    assert saves_input(fused_forward) and not saves_input(quantized_forward(recipe))


# ---------------------------------------------------------------- 6. E5M2 gradients of Float8Tensorwise(hybrid)
#
# An exact reference: rationals (fractions.Fraction), round to nearest with ties to even
# written out, E5M2 codes assembled from sign, exponent and mantissa bits. No torch float8
# cast is used at any step, so the reference cannot share a rounding bug with the
# library's cast (which is ``clamp(...).to(torch.float8_e5m2)``).

E5M2_MANTISSA_BITS, E5M2_MIN_EXPONENT, E5M2_MAX = 2, -14, Fraction(57344)
TWO = Fraction(2)


def _floor_log2(magnitude: Fraction) -> int:
    e = magnitude.numerator.bit_length() - magnitude.denominator.bit_length()
    while TWO**e > magnitude:
        e -= 1
    while TWO ** (e + 1) <= magnitude:
        e += 1
    return e


def _round_nearest_even(value: Fraction, mantissa_bits: int, min_exponent: int, fmax=None) -> Fraction:
    """``value`` on the grid of a binary format (subnormals below ``2**min_exponent``),
    ties to the even last bit, beyond ``fmax`` saturated to ``±fmax``."""
    if value == 0:
        return Fraction(0)
    magnitude = abs(value)
    quantum = TWO ** (max(_floor_log2(magnitude), min_exponent) - mantissa_bits)
    steps = magnitude / quantum
    n = math.floor(steps)
    if steps - n > Fraction(1, 2) or (steps - n == Fraction(1, 2) and n % 2 == 1):
        n += 1
    magnitude = n * quantum
    if fmax is not None:
        magnitude = min(magnitude, fmax)
    return magnitude if value > 0 else -magnitude


def _fp32(value: Fraction) -> Fraction:
    return _round_nearest_even(value, 23, -126)


def _e5m2(value: Fraction) -> Fraction:
    return _round_nearest_even(value, E5M2_MANTISSA_BITS, E5M2_MIN_EXPONENT, E5M2_MAX)


def _e5m2_code(value: Fraction) -> int:
    """The byte of an E5M2 value: sign, 5 exponent bits (bias 15; 0: subnormal), 2 mantissa bits."""
    sign = 0x80 if value < 0 else 0
    magnitude = abs(value)
    if magnitude < TWO**E5M2_MIN_EXPONENT:
        mantissa, exponent_field = magnitude / TWO ** (E5M2_MIN_EXPONENT - E5M2_MANTISSA_BITS), 0
    else:
        e = _floor_log2(magnitude)
        mantissa, exponent_field = (magnitude / TWO**e - 1) * 4, e + 15
    assert mantissa.denominator == 1 and 0 <= mantissa < 4 and exponent_field < 31
    return sign | exponent_field << 2 | int(mantissa)


def _tensorwise_grad_reference(values: list[float]):
    """One tensorwise tile: ``scale = fp32(57344 / amax)``, data ``E5M2(fp32(v * scale))``,
    ``scale_inv = fp32(1 / scale)``; returns (codes, scale_inv, dequantized values)."""
    exact = [Fraction(v) for v in values]
    amax = max(abs(v) for v in exact)
    scale = _fp32(E5M2_MAX / amax)
    data = [_e5m2(_fp32(v * scale)) for v in exact]
    scale_inv = _fp32(1 / scale)
    return [_e5m2_code(d) for d in data], scale_inv, [_fp32(d * scale_inv) for d in data]


S = 2.0**-3  # group A's amax 7168 gives the scale 57344 / 7168 = 8 exactly: v * 8 is exact
TIES = [
    (7168.0, 0x7B),  # amax -> +57344
    (-7168.0, 0xFB),  # -> -57344
    (1.125 * S, 0x3C),  # 1.125: tie of 1.0 (even) and 1.25 -> 1.0
    (1.375 * S, 0x3E),  # tie of 1.25 and 1.5 (even) -> 1.5
    (1.625 * S, 0x3E),  # tie of 1.5 (even) and 1.75 -> 1.5
    (1.875 * S, 0x40),  # tie of 1.75 and 2.0 (even) -> 2.0
    (-1.125 * S, 0xBC),  # -> -1.0
    (-1.875 * S, 0xC0),  # -> -2.0
    (53248.0 * S, 0x7A),  # tie of 49152 (even) and 57344 -> 49152
    (1.125 * S * (1 + 2.0**-20), 0x3D),  # just past the tie -> 1.25
    (2.0**-17 * S, 0x00),  # subnormal tie of 0 (even) and 2**-16 -> 0
    (3 * 2.0**-17 * S, 0x02),  # tie of 2**-16 and 2 * 2**-16 (even) -> 2**-15
    (5 * 2.0**-17 * S, 0x02),  # tie of 2 * 2**-16 (even) and 3 * 2**-16 -> 2**-15
    (7 * 2.0**-17 * S, 0x04),  # tie of the largest subnormal and 2**-14 (even) -> 2**-14
    (-3 * 2.0**-17 * S, 0x82),
    (0.0, 0x00),
]
SATURATING = [13.0, -13.0, 1.0, -2.5, 0.1, 7.77, -12.99, 3.0]  # fp32(57344 / 13) * 13 > 57344


def test_reference_encodes_known_e5m2_values():
    """The reference itself, on values whose codes are known."""
    known = {1.0: 0x3C, 1.5: 0x3E, 2.0: 0x40, 57344.0: 0x7B, 49152.0: 0x7A, 2.0**-14: 0x04, 2.0**-16: 0x01}
    for value, code in known.items():
        assert _e5m2_code(_e5m2(Fraction(value))) == code
        assert _e5m2_code(_e5m2(Fraction(-value))) == code | 0x80
    assert _e5m2(Fraction(61440)) == 57344 and _e5m2(Fraction(10**9)) == 57344  # saturated
    codes, scale_inv, _ = _tensorwise_grad_reference([v for v, _ in TIES])
    assert codes == [c for _, c in TIES] and scale_inv == Fraction(1, 8)


def test_tensorwise_hybrid_gradients_round_ties_to_even_and_saturate():
    recipe = R.Float8Tensorwise(fp8_format="hybrid")
    fmt = recipe.format_for("grad")
    assert fmt.dtype == torch.float8_e5m2 and fmt.fmax == 57344.0
    # two groups (experts): the ties (2 rows, scale 8), then one row whose amax times its
    # fp32 scale rounds to just past 57344 in fp32: it must land on ±57344, the largest
    # finite code (rounding and saturation agree there; the cast at the end tells them apart)
    dy = torch.tensor([v for v, _ in TIES] + SATURATING, dtype=torch.float32).view(3, 8)
    amax = torch.tensor(13.0)
    assert float((torch.tensor(57344.0) / amax) * amax) > 57344.0
    groups = ([v for v, _ in TIES], SATURATING)
    references = [_tensorwise_grad_reference(values) for values in groups]
    codes = torch.tensor([c for r in references for c in r[0]], dtype=torch.uint8).view(3, 8)
    dequantized = torch.tensor([float(v) for r in references for v in r[2]]).view(3, 8)
    assert int(codes[2, 0]) == 0x7B and int(codes[2, 1]) == 0xFB

    # the quantizer, as backward calls it for dgrad (along out-features, per group)
    q = R.quantize_rows(dy, recipe, "grad", R.ALONG_COLUMNS, torch.tensor([2, 3]))
    assert q.data.dtype == torch.float8_e5m2
    assert torch.equal(q.data.view(torch.uint8), codes)
    scale_inv = torch.tensor([float(references[0][1])] * 2 + [float(references[1][1])])
    assert torch.equal(q.element_scales()[:, 0], scale_inv)
    assert torch.equal(q.dequantize(), dequantized)

    # end to end: dgrad of a GroupedLinear whose experts are identities, dx = dequantized dy
    # times the dequantized identity (E4M3: 1 -> 448 with scale 448, times fp32(1 / 448))
    seq = fo.Sequential(fo.GroupedLinear(2, 8, 8, bias=False))
    with torch.no_grad():
        seq[0].weight.copy_(torch.eye(8).expand(2, 8, 8))
    w_scale = _fp32(Fraction(448))
    w_one = _fp32(Fraction(448) * _fp32(1 / w_scale))
    expected = torch.tensor(
        [[float(_fp32(Fraction(v) * w_one)) for v in row] for row in dequantized.tolist()]
    )
    x = torch.randn(3, 8, requires_grad=True)
    with fo.quantized(recipe):
        seq(x, torch.tensor([2, 1])).backward(dy)
    assert torch.equal(x.grad, expected)

    # the saturating cast of the gradient format: past fmax (61440 is the tie that rounding
    # alone would send to 65536, i.e. inf) every finite value lands on ±57344
    big = [57344.0 + 2.0**-8, 61439.99, 61440.0, 65536.0, 1e6, 3e38]
    values = torch.tensor(big + [-v for v in big], dtype=torch.float32)
    want = torch.tensor([_e5m2_code(_e5m2(Fraction(float(v)))) for v in values], dtype=torch.uint8)
    assert set(want.tolist()) == {0x7B, 0xFB}
    assert torch.equal(cast_saturated(values, fmt).view(torch.uint8), want)
