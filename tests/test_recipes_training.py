"""The demo's toy MoE regression trained 300 steps under each recipe ends within 5% of
the unquantized loss, either way (figures in docs/low-precision.md).

Why the mean over five seeds: top-k routing makes one run chaotic. The quantized and
unquantized runs of one seed part ways within a few steps, and the rounding order of
the CPU's kernels (AVX2 or AVX-512) changes where: one seed's change moves by several
percent with the machine (seed 1 under Float8Blockwise: -1.6% on one CPU, -5.4% on
another). Per seed the change spreads with a standard deviation of up to about 4%
(docs/low-precision.md); the mean of five shrinks that by sqrt(5) to under 2%, so the 5%
bound on the mean is more than 2.5 standard deviations: a recipe that trains clearly
worse fails, and the machine's kernels do not decide the outcome.
"""

from __future__ import annotations

import statistics

import pytest

import fusible_ops as fo
from fusible_ops.cli.recipe_training import train_toy_moe

R = fo.recipes
SEEDS = (1, 2, 3, 4, 5)


@pytest.fixture(scope="module")
def unquantized_losses() -> dict[int, float]:
    return {seed: train_toy_moe(None, seed=seed) for seed in SEEDS}


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
def test_training_matches_unquantized(recipe, unquantized_losses):
    losses = {seed: train_toy_moe(recipe, seed=seed) for seed in SEEDS}
    mean_change = statistics.mean(losses[s] / unquantized_losses[s] - 1 for s in SEEDS)
    assert abs(mean_change) <= 0.05, (mean_change, losses, unquantized_losses)
    assert all(losses[s] != unquantized_losses[s] for s in SEEDS)  # the recipe was in force
