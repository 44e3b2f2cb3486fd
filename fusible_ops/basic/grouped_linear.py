"""GroupedLinear: one linear layer per group of token rows (the MoE experts' GEMM)."""

from __future__ import annotations

import math
from typing import Any

import torch

from ..core.buffers import GRAD_INPUT_BUFFER_KEY, OUTPUT_BUFFER_KEY, buffer_rows, validate_or_alloc_rows
from ..core.dtypes import cast, compute_dtype, compute_dtype_of
from ..core.op import (
    BasicOperation,
    OpBackward,
    OperationContext,
    TensorMeta,
    check_sizes,
    fixed_at_construction,
)
from ..core.settings import current_settings
from ..core.shapes import as_rows
from ..core.splits import (
    SplitInfo,
    check_split_sizes,
    check_split_values,
    read_host_splits,
    to_split_info,
)
from ..kernels import BackendChoice, GroupedGemmBackend, select_backend
from ..kernels import library as kernel_ops
from ..kernels.quantized import QuantizedChoice, select_quantized
from ..kernels.signature_checks import signature_fixes_kernel_args
from ..recipes.quantize import QUANTIZED_INPUT_KEY, check_quantized_input
from . import quantized_linear


def check_float_input(op_name: str, meta: TensorMeta, param: torch.Tensor, in_features: int) -> None:
    """Shared input checks of the linear ops: feature count, dtype and device match.

    Under autocast the dtypes may differ when neither is float64: both are cast to
    autocast's dtype.
    """
    if len(meta.shape) < 1 or meta.shape[-1] != in_features:
        raise ValueError(f"{op_name}: input has shape {list(meta.shape)}; expected [..., {in_features}]")
    if not meta.dtype.is_floating_point:
        raise ValueError(f"{op_name}: input must be floating point, got {meta.dtype}")
    # torch's autocast casts floating-point tensors other than float64: a float64 operand
    # stays float64, so the other one must match it as it would have to without autocast
    autocast_casts_both = torch.is_autocast_enabled(meta.device.type) and torch.float64 not in (
        meta.dtype,
        param.dtype,
    )
    if meta.dtype != param.dtype and not autocast_casts_both:
        raise ValueError(
            f"{op_name}: input dtype {meta.dtype} does not match the weight dtype {param.dtype}; "
            "convert one of them (e.g. module.to(dtype))"
        )
    if meta.device != param.device:
        raise ValueError(f"{op_name}: input is on {meta.device} but the weight is on {param.device}")


def check_params(
    op_name: str,
    params: dict[str, torch.Tensor | None],
    shapes: dict[str, tuple[int, ...]],
    *,
    grouped: bool = False,
) -> None:
    """Each parameter present has its expected shape, a floating-point dtype, and the first
    parameter's dtype and device (``ValueError`` naming the op and the parameter). A
    parameter replaced after construction (``op.weight = Parameter(...)``, as integrations
    do) is checked here, before any op of the call runs.

    DTensors are checked by their global shape; with ``grouped`` (a leading group dim that
    expert parallelism or FSDP2 may shard) only their trailing dims are.
    """
    first = None
    for name, expected in shapes.items():
        tensor = params.get(name)
        if tensor is None:
            continue
        shape = tuple(tensor.shape)
        if grouped and type(tensor).__name__ == "DTensor":
            shape, expected = shape[1:], expected[1:]
        if shape != expected:
            raise ValueError(
                f"{op_name}: parameter {name!r} has shape {list(tensor.shape)}; expected {list(expected)}"
            )
        if not tensor.dtype.is_floating_point:
            raise ValueError(
                f"{op_name}: parameter {name!r} has dtype {tensor.dtype}; expected floating point"
            )
        if first is None:
            first = (name, tensor)
        elif tensor.dtype != first[1].dtype or tensor.device != first[1].device:
            raise ValueError(
                f"{op_name}: parameter {name!r} is {tensor.dtype} on {tensor.device} but {first[0]!r} is "
                f"{first[1].dtype} on {first[1].device}; parameters of one op must match"
            )


def check_feature_op(
    op_name: str, meta: TensorMeta, features: int, params: dict[str, torch.Tensor | None]
) -> None:
    """An op over the last dim (``Bias``, the norms): the input is ``[..., features]`` and
    each parameter ``[features]``."""
    if not meta.shape or meta.shape[-1] != features:
        raise ValueError(f"{op_name}: input has shape {list(meta.shape)}; expected [..., {features}]")
    check_params(op_name, params, dict.fromkeys(params, (features,)))


WEIGHT_LAYOUTS = ("out_in", "in_out")


def is_group_sharded(tensor: object) -> bool:
    """A DTensor split over ranks along the group dim only (every placement ``Shard(0)``, or
    FSDP2's ``_StridedShard(0)`` over an expert-parallel one)."""
    placements = getattr(tensor, "placements", None) if type(tensor).__name__ == "DTensor" else None
    if not placements:
        return False
    return all(type(p).__name__ in ("Shard", "_StridedShard") and p.dim == 0 for p in placements)


def local_groups(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """This rank's groups of a group-sharded DTensor (differentiable); anything else as is."""
    return tensor.to_local() if is_group_sharded(tensor) else tensor


@signature_fixes_kernel_args
class GroupedLinear(BasicOperation):
    """``y[rows of group g] = x[rows of group g] @ weight[g].T (+ bias[g])``.

    Args:
        num_groups: number of groups (experts) ``G``.
        in_features: ``K``, the size of each input row.
        out_features: ``N``, the size of each output row.
        bias: add a per-group bias ``[G, N]``.
        weight_layout: ``"out_in"``: ``weight`` is ``[G, N, K]`` (``[experts, out, in]``,
            as ``nn.Linear``, torchtitan's ``GroupedExperts`` and most checkpoints);
            ``"in_out"``: ``[G, K, N]`` (as GPT-OSS stores it; ``y = x @ weight[g]``). The kernels read either
            layout in place; :meth:`weight_out_in` is the ``[G, N, K]`` view.

    Shape:
        input: ``[..., K]``, the leading dims are token rows, sorted by group.
        split_sizes: extra input, ``[G]`` int tensor on any device, or a list of ints.
        output: ``[..., N]``.

    ``op_kwargs``: ``output`` (buffer for the result, ``[>= rows, N]``), ``grad_input``
    (buffer for the input gradient, ``[>= rows, K]``) and, under a recipe,
    ``quantized_input``: the input already quantized (``fusible_ops.recipes.quantize_input``,
    e.g. FP8 rows an expert-parallel dispatch sent), used by the forward GEMM instead of
    quantizing ``input``; ``input`` (the high-precision rows, or the operand's
    ``dequantize()``) is what backward's copies are made from.
    """

    num_extra_inputs = 1
    param_names = ("weight", "bias")
    num_groups = fixed_at_construction("num_groups", "``G``, the number of groups.")
    in_features = fixed_at_construction("in_features", "``K``, the size of each input row.")
    out_features = fixed_at_construction("out_features", "``N``, the size of each output row.")
    weight_layout = fixed_at_construction("weight_layout", '``"out_in"`` or ``"in_out"``.')
    accepted_kwargs = frozenset({OUTPUT_BUFFER_KEY, GRAD_INPUT_BUFFER_KEY, QUANTIZED_INPUT_KEY})
    buffer_kwargs = (OUTPUT_BUFFER_KEY, GRAD_INPUT_BUFFER_KEY)

    def __init__(
        self,
        num_groups: int,
        in_features: int,
        out_features: int,
        *,
        bias: bool = False,
        weight_layout: str = "out_in",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        check_sizes(
            "GroupedLinear", num_groups=num_groups, in_features=in_features, out_features=out_features
        )
        if weight_layout not in WEIGHT_LAYOUTS:
            raise ValueError(
                f"GroupedLinear: weight_layout must be one of {WEIGHT_LAYOUTS}, got {weight_layout!r}"
            )
        self.num_groups = num_groups
        self.in_features = in_features
        self.out_features = out_features
        self.weight_layout = weight_layout
        factory = {"device": device, "dtype": dtype}
        shape = (out_features, in_features) if weight_layout == "out_in" else (in_features, out_features)
        self.weight = torch.nn.Parameter(torch.empty(num_groups, *shape, **factory))
        if bias:
            self.bias = torch.nn.Parameter(torch.empty(num_groups, out_features, **factory))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def compile_facts(self) -> tuple:
        return (self.num_groups, self.in_features, self.out_features, self.weight_layout)

    def reset_parameters(self) -> None:
        """Per group, the initialisation ``torch.nn.Linear`` uses."""
        bound = 1.0 / math.sqrt(self.in_features)
        with torch.no_grad():
            weight = self.weight_out_in()
            for g in range(self.num_groups):
                torch.nn.init.kaiming_uniform_(weight[g], a=math.sqrt(5))
            if self.bias is not None:
                torch.nn.init.uniform_(self.bias, -bound, bound)

    def param_tensors(self) -> dict[str, torch.Tensor | None]:
        """As the base class, with expert-sharded DTensors (every placement ``Shard(0)``, as
        ``fo.MoE(ep_mesh=...)`` makes them) as their local shards: the kernels compute on
        this rank's groups, and ``to_local``'s backward turns the gradients back into DTensors."""
        params = super().param_tensors()
        for name, tensor in params.items():
            if tensor is not None and type(tensor).__name__ == "DTensor":
                params[name] = local_groups(tensor)
        return params

    def weight_out_in(self, weight: torch.Tensor | None = None) -> torch.Tensor:
        """``weight`` (by default the parameter) as ``[G, N, K]``: itself, or a transposed view."""
        weight = self.weight if weight is None else weight
        return weight if self.weight_layout == "out_in" else weight.transpose(-2, -1)

    def extra_repr(self) -> str:
        layout = "" if self.weight_layout == "out_in" else f", weight_layout={self.weight_layout!r}"
        return (
            f"num_groups={self.num_groups}, in_features={self.in_features}, "
            f"out_features={self.out_features}, bias={self.bias is not None}{layout}"
        )

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected, errors
    ):
        # Accept per-group keys weight0..weight{G-1} (and bias0..) as well as the stacked tensors.
        # On group-sharded DTensor parameters the per-group keys are this rank's local groups.
        for name in ("weight", "bias"):
            param = getattr(self, name)
            local_count = self.num_groups if param is None else local_groups(param).shape[0]
            per_group = [f"{prefix}{name}{g}" for g in range(local_count)]
            if prefix + name not in state_dict and all(k in state_dict for k in per_group):
                want = tuple(local_groups(param).shape[1:]) if param is not None else None
                bad = [
                    f"size mismatch for {k}: copying a param with shape {list(getattr(state_dict[k], 'shape', []))} "
                    f"from checkpoint, the shape of one group of {prefix + name} is {list(want)}"
                    for k in per_group
                    if want is not None
                    and (not isinstance(state_dict[k], torch.Tensor) or tuple(state_dict[k].shape) != want)
                ]
                if bad:
                    errors.extend(bad)
                    continue
                stacked = torch.stack([state_dict.pop(k) for k in per_group])
                if is_group_sharded(param):
                    from torch.distributed.tensor import DTensor

                    stacked = DTensor.from_local(
                        stacked, param.device_mesh, param.placements, run_check=False
                    )
                state_dict[prefix + name] = stacked
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected, errors
        )

    # ------------------------------------------------------------ planning / checks
    def plan_backend(self, device: torch.device, dtype: torch.dtype) -> BackendChoice:
        features = ((self.in_features, self.out_features),)
        forced = current_settings().backend
        return select_backend(device, dtype, purpose="gemm", forced=forced, features=features)

    def plan_quantized(self, device: torch.device, dtype: torch.dtype, settings) -> QuantizedChoice:
        """How this op's GEMMs run under ``settings.recipe`` (see ``fusible_ops.recipes``)."""
        features = ((self.in_features, self.out_features),)
        return select_quantized(
            settings.recipe, device, dtype, grouped=True, forced_backend=settings.backend,
            engine=settings.recipe_backend, features=features,
        )  # fmt: skip

    static_preflight = True  # value checks, if any, are in check_values

    def preflight(self, input_meta: TensorMeta, extra_inputs, kwargs, *, guard) -> TensorMeta:
        name = self.op_name()
        weight_shape = (self.out_features, self.in_features)
        if self.weight_layout == "in_out":
            weight_shape = weight_shape[::-1]
        check_params(
            name,
            {"weight": self.weight, "bias": self.bias},
            {"weight": (self.num_groups, *weight_shape), "bias": (self.num_groups, self.out_features)},
            grouped=True,
        )
        check_float_input(name, input_meta, self.weight, self.in_features)
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

    def check_values(self, input_meta: TensorMeta, extra_inputs) -> None:
        rows = math.prod(input_meta.shape[:-1])
        check_split_sizes(self.op_name(), extra_inputs[0], self.num_groups, rows)

    def bind_value_check(self, input_meta: TensorMeta):
        rows, name, groups = math.prod(input_meta.shape[:-1]), self.op_name(), self.num_groups

        def check(extra_inputs: tuple) -> None:
            split_sizes = extra_inputs[0]
            if type(split_sizes) is torch.Tensor and split_sizes.is_cpu:
                # dtype and shape are the signature's (checked by preflight): only the values
                check_split_values(name, read_host_splits(split_sizes), rows)
            else:
                check_split_sizes(name, split_sizes, groups, rows)

        return check

    def value_check_key(self, input_meta: TensorMeta) -> tuple:
        # the checks read only the group count and the rows (the op's name is in the message)
        return ("split_sizes", self.num_groups, math.prod(input_meta.shape[:-1]))

    # ------------------------------------------------------------ math
    def op_forward(
        self,
        ctx: OperationContext,
        input_: torch.Tensor,
        split_sizes: Any,
        output: torch.Tensor | None = None,
        grad_input: torch.Tensor | None = None,  # reaches backward as ctx.grad_input_buffer
        quantized_input: Any = None,
    ) -> torch.Tensor:
        dtype = compute_dtype_of(input_)
        weight_param = ctx.params["weight"]
        x = cast(as_rows(input_, self.in_features), dtype)
        weight, bias = cast(self.weight_out_in(weight_param), dtype), cast(ctx.params["bias"], dtype)
        splits = to_split_info(split_sizes, x.shape[0], x)
        out_shape = (*input_.shape[:-1], self.out_features)
        out2d = buffer_rows(output, x.shape[0], self.out_features)  # checked in preflight
        if type(ctx.backend_choice) is QuantizedChoice:
            y = quantized_linear.grouped_forward(
                self, ctx, ctx.backend_choice, x, weight_param, weight, bias, splits, out2d, quantized_input
            )
            ctx.input_shape = input_.shape
            return y if y.shape == out_shape else y.view(out_shape)
        if quantized_input is not None:
            check_quantized_input(self.op_name(), quantized_input, None, x, splits.offsets)
        backend: GroupedGemmBackend = ctx.backend_choice.backend  # the plan's choice
        y = kernel_ops.fprop(backend, x, weight, splits, bias=bias, out=out2d)
        if ctx.requires_grad:
            # The weight itself is saved by the fuser (with every parameter of the call).
            ctx.save_for_backward(
                x=x if ctx.needs_param_grad("weight") else None,
                offsets=splits.offsets,
                host_sizes=splits.host_sizes,
            )
            ctx.backend = backend
            ctx.host_splits = splits.host
            ctx.input_shape = input_.shape
            ctx.compute_dtype = dtype
        return y if y.shape == out_shape else y.view(out_shape)

    def op_backward(self, ctx: OperationContext, grad_output: torch.Tensor) -> OpBackward:
        if getattr(ctx, "quantized", None) is not None:
            return quantized_linear.grouped_backward(self, ctx, grad_output)
        saved = ctx.saved
        backend: GroupedGemmBackend = ctx.backend
        weight_param, bias_param = ctx.params["weight"], ctx.params["bias"]
        splits = SplitInfo(ctx.host_splits, saved["offsets"], saved["host_sizes"])
        dy = cast(as_rows(grad_output, self.out_features), ctx.compute_dtype)
        if not dy.is_contiguous():
            dy = dy.contiguous()
        grad_input = None
        if ctx.input_requires_grad:
            out = buffer_rows(ctx.grad_input_buffer, dy.shape[0], self.in_features)
            weight = cast(self.weight_out_in(weight_param), ctx.compute_dtype)
            grad_input = kernel_ops.dgrad(backend, dy, weight, splits, out=out).view(ctx.input_shape)
        grad_weight = grad_bias = None
        if ctx.needs_param_grad("weight"):
            # in_out: x^T @ dy per group is [K, N] already, the parameter's layout (no transpose)
            lhs, rhs = (dy, saved["x"]) if self.weight_layout == "out_in" else (saved["x"], dy)
            grad_weight = cast(kernel_ops.wgrad(backend, lhs, rhs, splits), weight_param.dtype)
        if ctx.needs_param_grad("bias"):
            grad_bias = cast(kernel_ops.bias_grad(backend, dy, splits, self.num_groups), bias_param.dtype)
        params = [grad_weight] if bias_param is None else [grad_weight, grad_bias]
        return OpBackward(grad_input, params, (None,))
