"""The GEMMs of an expert block whose fc1 keeps its gate and up weights apart, unquantized
or under a low-precision recipe: one interface, so that the block's math (activation,
scaling, what is saved) is written once.

Under a recipe each GEMM is quantized as :class:`~fusible_ops.GroupedLinear`'s (see
:mod:`fusible_ops.basic.quantized_linear`): fc1's input ``x`` is quantized once along
in-features for both the gate and the up GEMM; the input gradient is the sum of two dgrads,
each half of fc1's output gradient quantized along its own ``F`` features with its own
weight (what two separate quantized GEMMs compute, as torchtitan's float8 and MXFP8
experts run ``w1`` and ``w3``); weight gradients quantize along the token rows of each
group, or stay in high precision when the recipe says so. Weight copies come from the
per-parameter cache, keyed on the parameters (``params``), not on their casts or views.
"""

from __future__ import annotations

import torch

from ..core.op import OperationContext
from ..core.splits import SplitInfo
from ..kernels import library as kernel_ops
from ..kernels import quantized as qkernels
from ..kernels.quantized import QuantizedChoice
from ..recipes.quantize import check_quantizable, quantize_rows
from ..recipes.recipes import ALONG_COLUMNS, ALONG_ROWS
from ..recipes.weight_cache import quantized_weight
from .quantized_linear import grouped_wgrad, save_wgrad_input, saved_wgrad_input

Tensor = torch.Tensor


class PlainGemms:
    """The block's GEMMs in the compute dtype on the plan's grouped-GEMM backend."""

    def __init__(self, backend) -> None:
        self.backend = backend

    def fc1(self, x: Tensor, weights: tuple[Tensor, Tensor], splits: SplitInfo) -> list[Tensor]:
        """``[gate, up]``, each ``[M, F]``; ``weights``: gate and up ``[G, F, K]``."""
        return [kernel_ops.fprop(self.backend, x, w, splits) for w in weights]

    def fc1_dgrad(
        self, grads: list[Tensor], weights: tuple[Tensor, Tensor], splits: SplitInfo, out
    ) -> Tensor:
        """``grad_gate @ Wg + grad_up @ Wu`` per group, ``[M, K]`` (in ``out`` when given)."""
        grad_input = kernel_ops.dgrad(self.backend, grads[0], weights[0], splits, out=out)
        return grad_input.add_(kernel_ops.dgrad(self.backend, grads[1], weights[1], splits))

    def fc2(self, act: Tensor, w2: Tensor, splits: SplitInfo, bias, out) -> Tensor:
        return kernel_ops.fprop(self.backend, act, w2, splits, bias=bias, out=out)

    def fc2_dgrad(self, grad: Tensor, w2: Tensor, splits: SplitInfo) -> Tensor:
        return kernel_ops.dgrad(self.backend, grad, w2, splits)

    def wgrad(self, grad: Tensor, x, splits: SplitInfo) -> Tensor:
        """``[G, N, K]``: ``grad[rows_g]^T @ x[rows_g]``."""
        return kernel_ops.wgrad(self.backend, grad, x, splits)

    def save_input(self, ctx: OperationContext, x: Tensor, splits: SplitInfo) -> dict:
        """What the fc1 weight gradients need of ``x``, named for ``save_for_backward``."""
        return {"x": x}

    def saved_input(self, ctx: OperationContext):
        return ctx.saved["x"]


class QuantizedGemms(PlainGemms):
    """The block's GEMMs under ``choice.recipe``; ``params``: the gate, up and fc2 weight
    parameters the cached quantized copies are keyed on (``(gate, up)`` for fc1 alone)."""

    def __init__(self, choice: QuantizedChoice, params: tuple[Tensor, ...], op_name: str, dtype) -> None:
        super().__init__(choice.backend)
        check_quantizable(op_name, dtype, choice.recipe)
        self.choice, self.recipe, self.params = choice, choice.recipe, params
        self.dtype = dtype

    def _weight(self, index: int, weight: Tensor, along: str):
        return quantized_weight(self.params[index], weight, self.recipe, along)

    def _rows(self, grad: Tensor, along: str, splits: SplitInfo):
        return quantize_rows(grad, self.recipe, "grad", along, splits.offsets)

    def fc1(self, x: Tensor, weights: tuple[Tensor, Tensor], splits: SplitInfo) -> list[Tensor]:
        x_q = quantize_rows(x, self.recipe, "input", ALONG_COLUMNS, splits.offsets)  # once, for both
        return [
            qkernels.fprop(
                self.choice, x_q, self._weight(i, w, ALONG_COLUMNS), splits, None, None, self.dtype
            )
            for i, w in enumerate(weights)
        ]

    def fc1_dgrad(
        self, grads: list[Tensor], weights: tuple[Tensor, Tensor], splits: SplitInfo, out
    ) -> Tensor:
        parts = [
            qkernels.dgrad(
                self.choice,
                self._rows(g, ALONG_COLUMNS, splits),
                self._weight(i, w, ALONG_ROWS),
                splits,
                out if i == 0 else None,
                self.dtype,
            )  # fmt: skip
            for i, (g, w) in enumerate(zip(grads, weights))
        ]
        return parts[0].add_(parts[1])

    def fc2(self, act: Tensor, w2: Tensor, splits: SplitInfo, bias, out) -> Tensor:
        act_q = quantize_rows(act, self.recipe, "input", ALONG_COLUMNS, splits.offsets)  # quantized once
        return qkernels.fprop(
            self.choice, act_q, self._weight(2, w2, ALONG_COLUMNS), splits, bias, out, self.dtype
        )

    def fc2_dgrad(self, grad: Tensor, w2: Tensor, splits: SplitInfo) -> Tensor:
        grad_q = self._rows(grad, ALONG_COLUMNS, splits)
        return qkernels.dgrad(self.choice, grad_q, self._weight(2, w2, ALONG_ROWS), splits, None, self.dtype)

    def wgrad(self, grad: Tensor, x, splits: SplitInfo) -> Tensor:
        quantized = "wgrad" in self.recipe.quantized_gemms()
        return grouped_wgrad(self.choice, quantized, grad, x, splits)

    def save_input(self, ctx: OperationContext, x: Tensor, splits: SplitInfo) -> dict:
        return save_wgrad_input(ctx, self.choice, x, splits.offsets)

    def saved_input(self, ctx: OperationContext):
        return saved_wgrad_input(ctx)


def block_gemms(choice, params: tuple[Tensor, ...], op_name: str, dtype) -> PlainGemms:
    """:class:`QuantizedGemms` when ``choice`` is a recipe's, else :class:`PlainGemms`."""
    if type(choice) is QuantizedChoice:
        return QuantizedGemms(choice, params, op_name, dtype)
    return PlainGemms(choice.backend)


#: names save_input may use (every one given to save_for_backward, None when unused)
SAVED_INPUT_NAMES = ("x", "x_data", "x_scale", "x_tiles")
