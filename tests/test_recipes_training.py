"""The demo's toy MoE regression trained 300 steps under each recipe ends within 5% of
the unquantized loss, either way (figures in docs/low-precision.md)."""

from __future__ import annotations

import pytest

import fusible_ops as fo
from fusible_ops.cli.recipe_training import train_toy_moe

R = fo.recipes


@pytest.fixture(scope="module")
def unquantized_loss() -> float:
    return train_toy_moe(None)


@pytest.mark.parametrize(
    "recipe",
    [
        R.MXFP8(),
        R.MXFP8(scale_rounding="floor"),
        R.Float8Tensorwise(),
        R.Float8Rowwise(),
        R.Float8Blockwise(),
    ],
    ids=repr,
)
def test_training_matches_unquantized(recipe, unquantized_loss):
    loss = train_toy_moe(recipe)
    assert abs(loss / unquantized_loss - 1) <= 0.05, (loss, unquantized_loss)
    assert loss != unquantized_loss  # the recipe was in force
