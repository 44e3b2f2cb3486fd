"""Quantizers against the independent reference of tests/recipe_reference.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import fusible_ops as fo
from fusible_ops.recipes import quantize_rows, quantize_weight
from tests import recipe_reference as ref

R = fo.recipes
RECIPES = [
    R.MXFP8(),
    R.MXFP8(scale_rounding="floor"),
    R.Float8Tensorwise(),
    R.Float8Tensorwise(fp8_format="e4m3", pow2_scales=True),
    R.Float8Rowwise(),
    R.Float8Rowwise(pow2_scales=True),
    R.Float8Blockwise(),
    R.Float8Blockwise(pow2_scales=True),
]
GROUPS = [5, 0, 37, 33]  # a zero-row group, sizes not multiples of 32 or 128


def _rows(dtype=torch.float32) -> torch.Tensor:
    x = torch.randn(sum(GROUPS) + 3, 70, dtype=torch.float64)  # 3 rows past the last group
    x = x * torch.logspace(-3, 3, x.shape[0], dtype=torch.float64).unsqueeze(1)  # magnitudes differ by row
    return x.to(dtype)


def _ends(groups=GROUPS) -> torch.Tensor:
    return torch.tensor(groups).cumsum(0).to(torch.int32)


def _assert_same(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual.double(), expected, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("recipe", RECIPES, ids=repr)
@pytest.mark.parametrize("kind", ["input", "grad"])
@pytest.mark.parametrize("along", ["columns", "rows"])
def test_rows_match_reference(recipe, kind, along):
    x = _rows(torch.bfloat16 if kind == "grad" else torch.float32)
    q = quantize_rows(x, recipe, kind, along, _ends())
    assert q.data.dtype == (torch.float8_e5m2 if ref.formats(recipe, kind) == "e5m2" else torch.float8_e4m3fn)
    _assert_same(q.dequantize(), ref.quantize(x, recipe, kind, along, GROUPS))


@pytest.mark.parametrize("recipe", RECIPES, ids=repr)
@pytest.mark.parametrize("along", ["columns", "rows"])
def test_weight_matches_reference(recipe, along):
    w = torch.randn(3, 40, 130) * torch.tensor([1e-4, 1.0, 1e4]).view(3, 1, 1)
    _assert_same(quantize_weight(w, recipe, along).dequantize(), ref.quantize_weight(w, recipe, along))


def test_reference_rounding_known_values():
    """The reference itself on values whose FP8 encodings are known."""
    values = torch.tensor([1.0625, 1.1875, 3 * 2.0**-10, 2.0**-10, 500.0, -1e9, 17.0, 18.0])
    expected = torch.tensor([1.0, 1.25, 2.0**-8, 0.0, 448.0, -448.0, 16.0, 18.0])
    _assert_same(ref.round_fp8(values.double(), "e4m3"), expected.double())
    assert float(ref.round_fp8(torch.tensor([61440.0], dtype=torch.float64), "e5m2")) == 57344.0
    assert ref.mx_exponent(448.0, "rceil") == 0 and ref.mx_exponent(449.0, "rceil") == 1
    assert ref.mx_exponent(500.0, "floor") == 0 and ref.mx_exponent(0.0, "floor") == -127


def test_ties_to_even_and_subnormals_mx():
    """A block whose amax is 448 has e = 0: its values are rounded as they are."""
    block = torch.tensor([[448.0, 1.0625, 1.1875, 3 * 2.0**-10, 2.0**-10, -2.5 * 2.0**-9] + [0.0] * 26])
    q = quantize_rows(block, R.MXFP8(), "input", "columns", None)
    assert float(q.scale_inv[0, 0]) == 1.0
    expected = [448.0, 1.0, 1.25, 2.0**-8, 0.0, -2.0 * 2.0**-9]
    assert q.data.float()[0, :6].tolist() == expected


@pytest.mark.parametrize("rounding, exponent, data", [("rceil", 1, 256.0), ("floor", 0, 448.0)])
def test_mx_roundings(rounding, exponent, data):
    """amax 500: rceil picks e = 1 (500 / 2 = 250 rounds to 256, no saturation); floor picks
    e = floor(log2(500)) - 8 = 0 and 500 saturates to 448."""
    block = torch.zeros(1, 32)
    block[0, 0] = 500.0
    q = quantize_rows(block, R.MXFP8(scale_rounding=rounding), "input", "columns", None)
    assert float(q.scale_inv[0, 0]) == 2.0**exponent
    assert float(q.data.float()[0, 0]) == data


@pytest.mark.parametrize("recipe", RECIPES, ids=repr)
def test_zero_tiny_huge_amax(recipe):
    x = torch.zeros(3, 128)
    x[1, :] = torch.linspace(-1, 1, 128) * 1e-40  # fp32 subnormals
    x[2, :] = torch.linspace(-1, 1, 128) * 3e38
    for row in range(3):
        q = quantize_rows(x[row : row + 1], recipe, "input", "columns", None)
        expected = ref.quantize(x[row : row + 1], recipe, "input", "columns", [1])
        _assert_same(q.dequantize(), expected)
        assert torch.isfinite(q.dequantize()).all()
    zero = quantize_rows(x[:1], recipe, "input", "columns", None)
    assert (zero.data.float() == 0).all()
    assert float(zero.scale_inv.flatten()[0]) == (2.0**-127 if recipe.name == "mxfp8" else 1.0)


@pytest.mark.parametrize("recipe", RECIPES, ids=repr)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_propagates(recipe, bad):
    """Policy: a NaN or Inf makes its whole tile NaN (never clamped to a finite value);
    other tiles are untouched."""
    x = torch.randn(8, 256)
    x[2, 5] = bad
    q = quantize_rows(x, recipe, "input", "columns", None)
    deq = q.dequantize()
    _assert_same(deq, ref.quantize(x, recipe, "input", "columns", [8]))
    assert torch.isnan(deq[2, 5])
    assert torch.isfinite(deq).sum() > 0 if recipe.name != "tensorwise" else torch.isnan(deq).all()


def test_tiles_never_straddle_groups():
    """MX rows along rows: a group of 33 rows starting at row 5 has tiles [5, 37) and [37, 38)."""
    x = torch.ones(40, 4)
    x[37] = 1000.0  # first row of the second tile of group 0
    q = quantize_rows(x, R.MXFP8(), "input", "rows", torch.tensor([0, 38], dtype=torch.int32) + 0)
    deq = q.dequantize()
    assert torch.equal(deq[:37], torch.ones(37, 4))  # untouched by the 1000 in the next tile
    q2 = quantize_rows(x, R.MXFP8(), "input", "rows", torch.tensor([5, 38], dtype=torch.int32))
    assert int(q2.row_tiles[4]) != int(q2.row_tiles[5])  # a group's tiles start at its first row


def test_recipes_are_frozen_and_checked():
    recipe = R.MXFP8()
    with pytest.raises(dataclasses.FrozenInstanceError):
        recipe.scale_rounding = "floor"
    assert repr(recipe) == "MXFP8(wgrad_high_precision=False, scale_rounding='rceil')"
    with pytest.raises(ValueError, match="scale_rounding"):
        R.MXFP8(scale_rounding="up")
    with pytest.raises(ValueError, match="fp8_format"):
        R.Float8Tensorwise(fp8_format="e5m2")
    with pytest.raises(TypeError, match="pow2_scales"):
        R.Float8Rowwise(pow2_scales=1)
    assert R.Float8Tensorwise(wgrad_high_precision=True).quantized_gemms() == ("fprop", "dgrad")
