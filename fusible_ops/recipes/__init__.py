"""Low-precision recipes: quantizers, scales, the quantized-weight cache, ``quantized()``.

>>> import fusible_ops as fo
>>> with fo.quantized(fo.recipes.MXFP8()):
...     pass  # every fusible GEMM in here runs in MXFP8

May import: torch, :mod:`fusible_ops.settings`. The kernels consume what this package
makes; ops ask it for quantized operands.
"""

from ..core.settings import set_recipe_types
from .context import current_recipe, quantized
from .formats import E4M3, E5M2, Fp8Format
from .quantize import QUANTIZED_INPUT_KEY, QuantizedOperand, quantize_input, quantize_rows, quantize_weight
from .recipes import (
    ALONG_COLUMNS,
    ALONG_ROWS,
    MXFP8,
    RECIPE_BACKENDS,
    RECIPES_BY_NAME,
    Float8Blockwise,
    Float8Rowwise,
    Float8Tensorwise,
    Recipe,
)
from .weight_cache import clear_weight_cache, quantized_weight

set_recipe_types(Recipe, RECIPE_BACKENDS)  # fusible_ops.settings(recipe=...) checks against these

__all__ = [
    "ALONG_COLUMNS",
    "ALONG_ROWS",
    "E4M3",
    "E5M2",
    "MXFP8",
    "QUANTIZED_INPUT_KEY",
    "RECIPES_BY_NAME",
    "Float8Blockwise",
    "Float8Rowwise",
    "Float8Tensorwise",
    "Fp8Format",
    "QuantizedOperand",
    "Recipe",
    "clear_weight_cache",
    "current_recipe",
    "quantize_input",
    "quantize_rows",
    "quantize_weight",
    "quantized",
    "quantized_weight",
]
