"""GroupedGateUpLinear: the fc1 of a gated expert block with its gate and up weights kept apart."""

from __future__ import annotations

import math
from typing import Any

import torch

from ..core.buffers import GRAD_INPUT_BUFFER_KEY, OUTPUT_BUFFER_KEY, buffer_rows, validate_or_alloc_rows
from ..core.dtypes import cast, compute_dtype, compute_dtype_of
from ..core.op import BasicOperation, OpBackward, OperationContext, TensorMeta, check_sizes
from ..core.shapes import as_rows
from ..core.splits import SplitInfo, to_split_info
from .gate_up_gemms import SAVED_INPUT_NAMES, block_gemms
from .grouped_linear import GroupedLinear, check_float_input, check_params


class GroupedGateUpLinear(GroupedLinear):
    """``y[rows of g] = [x @ gate_weight[g].T | x @ up_weight[g].T]``: a gated block's fc1
    from two ``[G, F, K]`` weights, as torchtitan and Megatron keep them (``w1``/``w3``),
    so that no concatenated copy of the weights is made per call.

    The output is the concatenation ``[gate | up]`` that :class:`~fusible_ops.SwiGLU` and
    the other gated activations read (halves, not interleaved). In the fused expert block
    (``GroupedMLP``) the two halves are never concatenated: each is its own GEMM.

    Args:
        num_groups: number of groups (experts) ``G``.
        in_features: ``K``, the size of each input row.
        hidden_features: ``F``, the width of each half; ``out_features`` is ``2 * F``.

    Shape:
        input: ``[..., K]``, token rows sorted by group.
        split_sizes: extra input, ``[G]`` int tensor or a list of ints.
        output: ``[..., 2 * F]``.

    ``op_kwargs``: ``output`` (``[>= rows, 2 * F]``) and ``grad_input`` (``[>= rows, K]``).
    Under a low-precision recipe the gate and up GEMMs are quantized as two GroupedLinear
    GEMMs sharing one quantized input (see ``fusible_ops.basic.gate_up_gemms``).
    """

    param_names = ("gate_weight", "up_weight")
    accepted_kwargs = frozenset({OUTPUT_BUFFER_KEY, GRAD_INPUT_BUFFER_KEY})
    static_preflight = True  # value checks are in check_values

    def __init__(
        self,
        num_groups: int,
        in_features: int,
        hidden_features: int,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        BasicOperation.__init__(self)
        check_sizes(
            "GroupedGateUpLinear",
            num_groups=num_groups,
            in_features=in_features,
            hidden_features=hidden_features,
        )
        self.num_groups = num_groups
        self.in_features = in_features
        self.out_features = 2 * hidden_features
        self.weight_layout = "out_in"
        factory = {"device": device, "dtype": dtype}
        shape = (num_groups, hidden_features, in_features)
        self.gate_weight = torch.nn.Parameter(torch.empty(shape, **factory))
        self.up_weight = torch.nn.Parameter(torch.empty(shape, **factory))
        self.bias = None
        self.reset_parameters()

    @property
    def hidden_features(self) -> int:
        """``F``, the width of each half."""
        return self.out_features // 2

    @property
    def weight(self) -> torch.Tensor:
        """The gate weight, which checks of the fc1 weight's dtype and device read."""
        return self.gate_weight

    def reset_parameters(self) -> None:
        """Per group and half, the initialisation ``torch.nn.Linear`` uses."""
        with torch.no_grad():
            for weight in (self.gate_weight, self.up_weight):
                for g in range(self.num_groups):
                    torch.nn.init.kaiming_uniform_(weight[g], a=math.sqrt(5))

    def weight_out_in(self, weight: torch.Tensor | None = None) -> torch.Tensor:
        raise TypeError(
            "GroupedGateUpLinear: the gate and up weights are separate parameters "
            "(gate_weight, up_weight); there is no single fc1 weight"
        )

    def extra_repr(self) -> str:
        return (
            f"num_groups={self.num_groups}, in_features={self.in_features}, "
            f"hidden_features={self.hidden_features}"
        )

    def _load_from_state_dict(self, *args: Any) -> None:
        BasicOperation._load_from_state_dict(self, *args)

    def preflight(self, input_meta: TensorMeta, extra_inputs, kwargs, *, guard) -> TensorMeta:
        name = self.op_name()
        shape = (self.num_groups, self.hidden_features, self.in_features)
        check_params(
            name,
            {"gate_weight": self.gate_weight, "up_weight": self.up_weight},
            {"gate_weight": shape, "up_weight": shape},
            grouped=True,
        )
        check_float_input(name, input_meta, self.gate_weight, self.in_features)
        dtype = compute_dtype(input_meta.dtype, input_meta.device)
        self.check_values(input_meta, extra_inputs)
        out_shape = (*input_meta.shape[:-1], self.out_features)
        for key, shape in ((OUTPUT_BUFFER_KEY, out_shape), (GRAD_INPUT_BUFFER_KEY, input_meta.shape)):
            buffer = kwargs.get(key)
            if buffer is not None:
                validate_or_alloc_rows(
                    buffer, shape, dtype, input_meta.device, op_name=name, key=key, no_overlap=guard
                )
        return TensorMeta(out_shape, dtype, input_meta.device)

    def op_forward(
        self,
        ctx: OperationContext,
        input_: torch.Tensor,
        split_sizes: Any,
        output: torch.Tensor | None = None,
        grad_input: torch.Tensor | None = None,  # reaches backward as ctx.grad_input_buffer
    ) -> torch.Tensor:
        dtype = compute_dtype_of(input_)
        x = cast(as_rows(input_, self.in_features), dtype)
        params = (ctx.params["gate_weight"], ctx.params["up_weight"])
        weights = (cast(params[0], dtype), cast(params[1], dtype))
        splits = to_split_info(split_sizes, x.shape[0], x)
        gemms = block_gemms(ctx.backend_choice, params, self.op_name(), dtype)
        halves = gemms.fc1(x, weights, splits)
        out2d = buffer_rows(output, x.shape[0], self.out_features)  # checked in preflight
        y = torch.cat(halves, dim=-1) if out2d is None else torch.cat(halves, dim=-1, out=out2d)
        if ctx.requires_grad:
            saved_x = dict.fromkeys(SAVED_INPUT_NAMES)
            if ctx.needs_param_grad("gate_weight") or ctx.needs_param_grad("up_weight"):
                saved_x.update(gemms.save_input(ctx, x, splits))
            ctx.save_for_backward(**saved_x, offsets=splits.offsets, host_sizes=splits.host_sizes)
            ctx.gemms = gemms
            ctx.host_splits = splits.host
            ctx.input_shape = input_.shape
            ctx.compute_dtype = dtype
        out_shape = (*input_.shape[:-1], self.out_features)
        return y if y.shape == out_shape else y.view(out_shape)

    def op_backward(self, ctx: OperationContext, grad_output: torch.Tensor) -> OpBackward:
        saved, gemms, dtype = ctx.saved, ctx.gemms, ctx.compute_dtype
        splits = SplitInfo(ctx.host_splits, saved["offsets"], saved["host_sizes"])
        dy = cast(as_rows(grad_output, self.out_features), dtype)
        grads_out = [half.contiguous() for half in dy.split(self.hidden_features, dim=-1)]
        names = ("gate_weight", "up_weight")
        grad_input = None
        if ctx.input_requires_grad:
            out = buffer_rows(ctx.grad_input_buffer, dy.shape[0], self.in_features)
            weights = (cast(ctx.params[names[0]], dtype), cast(ctx.params[names[1]], dtype))
            grad_input = gemms.fc1_dgrad(grads_out, weights, splits, out).view(ctx.input_shape)
        x = gemms.saved_input(ctx) if any(ctx.needs_param_grad(n) for n in names) else None
        grad_params = [
            cast(gemms.wgrad(g, x, splits), ctx.params[n].dtype) if ctx.needs_param_grad(n) else None
            for g, n in zip(grads_out, names)
        ]
        return OpBackward(grad_input, grad_params, (None,))
