"""The contract every grouped-GEMM backend implements.

Shapes (``G`` groups, ``M`` token rows, ``K`` in features, ``N`` out features):

- ``x``: ``[M, K]``, rows sorted by group; group ``g`` owns rows
  ``offsets[g-1]:offsets[g]`` (``offsets[-1]`` is implicitly 0).
- ``weight``: ``[G, N, K]`` (the ``[experts, out, in]`` checkpoint layout).
- ``split_sizes``: the row counts as a host ``list[int]``, or ``None`` when only the
  device-resident ``offsets`` (int32 ``[G]`` inclusive cumulative sum) are known and
  reading them would force a host sync (CUDA backends must work from ``offsets``).

Every GEMM writes into ``out`` when it is given (a tensor of exactly the result shape,
possibly a view of a caller's buffer) and returns it; otherwise it allocates. Rows of
``out`` beyond ``offsets[-1]`` are never written.

The public methods belong to :class:`GroupedGemmBackend`: :meth:`~GroupedGemmBackend.fprop`,
:meth:`~GroupedGemmBackend.dgrad`, :meth:`~GroupedGemmBackend.wgrad`,
:meth:`~GroupedGemmBackend.bias_grad`, :meth:`~GroupedGemmBackend.fc1_fprop_act` and
:meth:`~GroupedGemmBackend.fc2_dgrad_act` each run the checks of :mod:`.grouped_checks`
once (not at all in a later call of a fuser call signature that passed them, see
:mod:`.signature_checks`), answer zero-token calls themselves, and then call one
protected hook with validated arguments. A backend is one file with a subclass that implements
:meth:`~GroupedGemmBackend.probe` and the three GEMM hooks ``_fprop``, ``_dgrad`` and
``_wgrad`` (optionally ``_bias_grad``, and ``_fc1_fprop_act`` / ``_fc2_dgrad_act`` with
``fused_activation = True``), plus one line in the registry::

    class MyBackend(GroupedGemmBackend):
        name = "mine"

        def probe(self, device, dtype): ...
        def _fprop(self, x, weight, split_sizes, offsets, bias, out): ...
        def _dgrad(self, grad_out, weight, split_sizes, offsets, out): ...
        def _wgrad(self, grad_out, x, split_sizes, offsets, out): ...

    register_backend("mine", MyBackend)  # fusible_ops.kernels.register_backend
"""

from __future__ import annotations

import torch

from ..core.shapes import as_flat
from .activation import (
    ActivationSpec,
    activation_backward,
    activation_forward,
    row_dot,
    scaled_activation_forward,
)
from .grouped_checks import (
    check_fc2_dgrad_act,
    check_gemm,
    check_operands,
    check_row_scales,
    host_split_sizes,
)
from .signature_checks import arguments_checked

Tensor = torch.Tensor
#: modules whose backend classes are trusted (run by the conformance suite, not checked per call)
_LIBRARY_PREFIX = "fusible_ops.kernels."


class GroupedGemmBackend:
    """Base class: a named way to run the grouped GEMMs on some devices.

    Subclasses implement :meth:`probe` and the hooks ``_fprop``, ``_dgrad`` and ``_wgrad``.
    The hooks get arguments the public methods have checked, at least one row, and
    ``split_sizes`` as a host list when :attr:`needs_host_splits` is set. The fused
    activation entry points run composed (the GEMM hook, then the activation in torch)
    unless :meth:`fused_activation_reason` is None, when they call the backend's
    ``_fc1_fprop_act`` / ``_fc2_dgrad_act``.
    """

    name: str = "base"
    description: str = ""
    #: whether fc1_fprop_act / fc2_dgrad_act run as one fused kernel (see fused_activation_reason)
    fused_activation: bool = False
    #: whether the backend writes into a caller's ``out`` without an extra copy
    writes_in_place: bool = True
    #: whether the hooks need ``split_sizes`` on the host: they then always get a list,
    #: read from ``offsets`` when the caller had none (a host sync on CUDA)
    needs_host_splits: bool = False
    #: check every hook result (a tensor of the result's shape and dtype, ``out`` itself
    #: when given); off for the library's own backends (classes of ``fusible_ops.kernels``)
    check_hook_results: bool = True

    def __init_subclass__(cls, **kwargs) -> None:
        """A subclass checks its hook results unless it is the library's own (or says so)."""
        super().__init_subclass__(**kwargs)
        if "check_hook_results" not in vars(cls):
            cls.check_hook_results = not cls.__module__.startswith(_LIBRARY_PREFIX)

    # ------------------------------------------------------------ availability and capabilities
    def probe(self, device: torch.device, dtype: torch.dtype) -> str | None:
        """``None`` when usable for tensors on ``device`` of ``dtype``, else the reason."""
        raise NotImplementedError

    def auto_probe(self, device: torch.device, dtype: torch.dtype) -> str | None:
        """Like :meth:`probe`, for automatic selection (a backend may be opt-in only)."""
        return self.probe(device, dtype)

    def package_status(self) -> str | None:
        """``None`` when the backend's software is present, else why not (for ``info``)."""
        return None

    def shape_problem(self, in_features: int, out_features: int, dtype: torch.dtype) -> str | None:
        """``None`` when a GEMM with these feature sizes can run, else why not (checked per call,
        and by backend selection for the layers it plans)."""
        return None

    def fused_activation_reason(self, spec: ActivationSpec, device: torch.device) -> str | None:
        """Why fc1_fprop_act / fc2_dgrad_act would run composed instead of fused (None if fused)."""
        return None if self.fused_activation else f"{self.name} has no fused activation kernel"

    def plan_notes(
        self, device: torch.device, split_sizes: list[int] | None, with_output_buffer: bool
    ) -> list[str]:
        """Copies and composed steps this backend will perform, for the fusion plan."""
        return []

    def bind_mlp(self, spec: ActivationSpec, scale_after_fc2: bool, operands: tuple):
        """The fused grouped MLP bound to one call signature (a ``BoundMLP``; ``operands``:
        the first call's ``(x, w1, b1, w2, b2)``): what a fuser's fast path runs once the
        public methods' checks passed for it. A backend may return a subclass that makes
        more of its per-call decisions once."""
        from .bound_mlp import BoundMLP

        return BoundMLP(self, spec, scale_after_fc2, operands)

    def _check_runnable(self, where: str, rows: Tensor) -> None:
        """Raise when the kernels cannot run on ``rows``' device and dtype (after the argument checks)."""

    # ------------------------------------------------------------ grouped GEMMs
    def fprop(
        self,
        x: Tensor,
        weight: Tensor,
        split_sizes: list[int] | None,
        offsets: Tensor,
        *,
        bias: Tensor | None = None,
        out: Tensor | None = None,
    ) -> Tensor:
        """``out[rows_g] = x[rows_g] @ weight[g].T (+ bias[g])``: ``[M, K] -> [M, N]``."""
        where = f"{self.name}.fprop"
        if arguments_checked():
            sizes = self._hook_sizes(where, x, split_sizes, offsets)
        else:
            _, n_out, k_in = check_gemm(where, "fprop", x, weight, split_sizes, offsets, out, bias=bias)
            sizes = self._ready(where, x, k_in, n_out, split_sizes, offsets)
        return self._run_fprop(x, weight, sizes, offsets, bias, out)

    def dgrad(
        self,
        grad_out: Tensor,
        weight: Tensor,
        split_sizes: list[int] | None,
        offsets: Tensor,
        *,
        out: Tensor | None = None,
    ) -> Tensor:
        """``out[rows_g] = grad_out[rows_g] @ weight[g]``: ``[M, N] -> [M, K]``."""
        where = f"{self.name}.dgrad"
        if arguments_checked():
            sizes = self._hook_sizes(where, grad_out, split_sizes, offsets)
        else:
            _, n_out, k_in = check_gemm(where, "dgrad", grad_out, weight, split_sizes, offsets, out)
            sizes = self._ready(where, grad_out, k_in, n_out, split_sizes, offsets)
        return self._run_dgrad(grad_out, weight, sizes, offsets, out)

    def wgrad(
        self,
        grad_out: Tensor,
        x: Tensor,
        split_sizes: list[int] | None,
        offsets: Tensor,
        *,
        out: Tensor | None = None,
    ) -> Tensor:
        """``out[g] = grad_out[rows_g].T @ x[rows_g]``: ``[G, N, K]``, zeros for empty groups."""
        where = f"{self.name}.wgrad"
        if arguments_checked():
            shape = (offsets.shape[0], grad_out.shape[1], x.shape[1])  # what check_gemm returns
            sizes = self._hook_sizes(where, x, split_sizes, offsets)
        else:
            shape = check_gemm(where, "wgrad", grad_out, x, split_sizes, offsets, out)
            sizes = self._ready(where, x, shape[2], shape[1], split_sizes, offsets)
        if x.shape[0] == 0:
            return out.zero_() if out is not None else x.new_zeros(shape)
        result = self._wgrad(grad_out, x, sizes, offsets, out)
        if self.check_hook_results:
            check_hook_result(self, "_wgrad", result, out, shape, x.dtype)
        return result

    def bias_grad(
        self, grad_out: Tensor, split_sizes: list[int] | None, offsets: Tensor, num_groups: int
    ) -> Tensor:
        """``[G, N]`` per-group column sums of ``grad_out`` (fp32 accumulation, fp64 stays fp64)."""
        where = f"{self.name}.bias_grad"
        if not arguments_checked():
            check_operands(
                where, grad_out, None, split_sizes, offsets, lhs_name="grad_out", num_groups=num_groups
            )
        sizes = self._hook_sizes(where, grad_out, split_sizes, offsets)
        result = self._bias_grad(grad_out, sizes, offsets, num_groups)
        if self.check_hook_results:
            check_hook_result(
                self, "_bias_grad", result, None, (num_groups, grad_out.shape[-1]), grad_out.dtype
            )
        return result

    # ------------------------------------------------------------ fused entry points
    def fc1_fprop_act(
        self,
        x: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        split_sizes: list[int] | None,
        offsets: Tensor,
        activation: ActivationSpec,
        scales: Tensor | None,
    ) -> tuple[Tensor, Tensor]:
        """FC1 then ``act(pre) * scales``: ``x [M, K] -> (pre [M, N], act_scaled [M, N or N/2])``.

        ``scales`` (``[M]`` or ``[M, 1]``) None means unscaled. ``pre`` is kept by the
        caller for backward.
        """
        where = f"{self.name}.fc1_fprop_act"
        if arguments_checked():
            scales = None if scales is None else as_flat(scales)
            sizes = self._hook_sizes(where, x, split_sizes, offsets)
        else:
            _, n_pre, k_in = check_gemm(where, "fprop", x, weight, split_sizes, offsets, None, bias=bias)
            activation.check_width(where, n_pre)
            scales = None if scales is None else check_row_scales(where, scales, x.shape[0], x.device)
            sizes = self._ready(where, x, k_in, n_pre, split_sizes, offsets)
        if not self._fuses(activation, x):
            return self._composed_fc1_fprop_act(x, weight, bias, sizes, offsets, activation, scales)
        result = self._fc1_fprop_act(x, weight, bias, sizes, offsets, activation, scales)
        if self.check_hook_results:
            rows, width = x.shape[0], weight.shape[1]
            check_fused_result(
                self,
                "_fc1_fprop_act",
                result,
                ((rows, width), (rows, activation.output_features(width))),
                x.dtype,
            )
        return result

    def fc2_dgrad_act(
        self,
        grad_y: Tensor,
        weight: Tensor,
        pre: Tensor,
        split_sizes: list[int] | None,
        offsets: Tensor,
        activation: ActivationSpec,
        scales: Tensor | None,
    ) -> tuple[Tensor, Tensor | None, Tensor]:
        """FC2 dgrad fused with the activation backward.

        ``grad_y [M, H]``, FC2 ``weight [G, H, F]``, ``pre [M, N]``. Returns
        ``(grad_pre, grad_scales, act_scaled)``: ``grad_scales`` has ``scales``' dtype and
        shape (None when unscaled), ``act_scaled`` is the recomputed FC2 input (needed for
        FC2's weight gradient).
        """
        where = f"{self.name}.fc2_dgrad_act"
        if arguments_checked():
            flat_scales = None if scales is None else as_flat(scales)
            sizes = self._hook_sizes(where, grad_y, split_sizes, offsets)
        else:
            _, h_out, n_act = check_fc2_dgrad_act(
                where, grad_y, weight, pre, split_sizes, offsets, activation
            )
            flat_scales = (
                None if scales is None else check_row_scales(where, scales, grad_y.shape[0], grad_y.device)
            )
            sizes = self._ready(where, grad_y, n_act, h_out, split_sizes, offsets)
        if self._fuses(activation, grad_y):
            result = self._fc2_dgrad_act(grad_y, weight, pre, sizes, offsets, activation, flat_scales)
            if self.check_hook_results:
                shapes = (
                    tuple(pre.shape),
                    None if scales is None else (grad_y.shape[0],),
                    (pre.shape[0], weight.shape[2]),
                )
                check_fused_result(self, "_fc2_dgrad_act", result, shapes, grad_y.dtype)
        else:
            result = self._composed_fc2_dgrad_act(
                grad_y, weight, pre, sizes, offsets, activation, flat_scales
            )
        grad_pre, grad_scales, act = result
        if grad_scales is not None and (
            grad_scales.dtype != scales.dtype or grad_scales.shape != scales.shape
        ):
            grad_scales = grad_scales.to(scales.dtype).reshape(scales.shape)
        return grad_pre, grad_scales, act

    # ------------------------------------------------------------ hooks (arguments checked)
    def _fprop(self, x, weight, split_sizes, offsets, bias, out) -> Tensor:
        """:meth:`fprop` for at least one row; ``out`` may be None."""
        raise NotImplementedError

    def _dgrad(self, grad_out, weight, split_sizes, offsets, out) -> Tensor:
        """:meth:`dgrad` for at least one row; ``out`` may be None."""
        raise NotImplementedError

    def _wgrad(self, grad_out, x, split_sizes, offsets, out) -> Tensor:
        """:meth:`wgrad` for at least one row; empty groups must come out as zeros."""
        raise NotImplementedError

    def _bias_grad(self, grad_out, split_sizes, offsets, num_groups) -> Tensor:
        """:meth:`bias_grad` from the device offsets (no host sync)."""
        # rows past offsets[-1] get group id G: they land in an extra bin that is dropped
        group_ids = group_ids_from_offsets(offsets, grad_out.shape[0])
        acc_dtype = torch.promote_types(grad_out.dtype, torch.float32)
        acc = torch.zeros(num_groups + 1, grad_out.shape[-1], dtype=acc_dtype, device=grad_out.device)
        acc.index_add_(0, group_ids, grad_out.to(acc_dtype))
        return acc[:num_groups].to(grad_out.dtype)

    def _fc1_fprop_act(self, x, weight, bias, split_sizes, offsets, activation, scales):
        """The fused FC1 kernel (``scales`` is ``[M]`` or None); composed unless overridden."""
        return self._composed_fc1_fprop_act(x, weight, bias, split_sizes, offsets, activation, scales)

    def _fc2_dgrad_act(self, grad_y, weight, pre, split_sizes, offsets, activation, scales):
        """The fused FC2 dgrad kernel (``scales`` is ``[M]`` or None); composed unless overridden."""
        return self._composed_fc2_dgrad_act(grad_y, weight, pre, split_sizes, offsets, activation, scales)

    # ------------------------------------------------------------ composed entry points
    def _composed_fc1_fprop_act(self, x, weight, bias, split_sizes, offsets, activation, scales):
        pre = self._run_fprop(x, weight, split_sizes, offsets, bias, None)
        if scales is None:
            return pre, activation_forward(activation, pre)
        return pre, scaled_activation_forward(activation, pre, scales)

    def _composed_fc2_dgrad_act(self, grad_y, weight, pre, split_sizes, offsets, activation, scales):
        grad_act = self._run_dgrad(grad_y, weight, split_sizes, offsets, None)
        act = activation_forward(activation, pre)  # recomputed once, used three times
        if scales is None:
            return activation_backward(activation, pre, grad_act), None, act
        row_scales = scales.to(act.dtype).unsqueeze(-1)
        grad_scales = row_dot(act, grad_act, scales.dtype)
        grad_pre = activation_backward(activation, pre, grad_act * row_scales)
        return grad_pre, grad_scales, act.mul_(row_scales)

    # ------------------------------------------------------------ shared steps
    def _ready(
        self, where: str, rows: Tensor, in_features: int, out_features: int, split_sizes, offsets: Tensor
    ) -> list[int] | None:
        """The checks that depend on the backend; returns the ``split_sizes`` the hooks get."""
        cls = type(self)
        if cls.shape_problem is not GroupedGemmBackend.shape_problem:
            problem = self.shape_problem(in_features, out_features, rows.dtype)
            if problem is not None:
                raise ValueError(f"{where}: {problem}; use the torch_loop backend for this shape")
        if cls._check_runnable is not GroupedGemmBackend._check_runnable:
            self._check_runnable(where, rows)
        return self._hook_sizes(where, rows, split_sizes, offsets)

    def _hook_sizes(self, where: str, rows: Tensor, split_sizes, offsets: Tensor) -> list[int] | None:
        if not self.needs_host_splits or type(split_sizes) is list:
            return split_sizes  # a host list was checked with the operands
        sizes = host_split_sizes(split_sizes, offsets)
        if split_sizes is None and sum(sizes) > rows.shape[0]:
            raise ValueError(f"{where}: offsets end at {sum(sizes)} but the input has {rows.shape[0]} rows")
        return sizes

    def _fuses(self, activation: ActivationSpec, rows: Tensor) -> bool:
        if rows.shape[0] == 0:
            return False
        if type(self).fused_activation_reason is GroupedGemmBackend.fused_activation_reason:
            return self.fused_activation  # what the base method reads (no device object per call)
        return self.fused_activation_reason(activation, rows.device) is None

    def _run_fprop(self, x, weight, split_sizes, offsets, bias, out) -> Tensor:
        if x.shape[0] == 0:
            return out if out is not None else x.new_empty(0, weight.shape[1])
        result = self._fprop(x, weight, split_sizes, offsets, bias, out)
        if self.check_hook_results:
            check_hook_result(self, "_fprop", result, out, (x.shape[0], weight.shape[1]), x.dtype)
        return result

    def _run_dgrad(self, grad_out, weight, split_sizes, offsets, out) -> Tensor:
        if grad_out.shape[0] == 0:
            return out if out is not None else grad_out.new_empty(0, weight.shape[2])
        result = self._dgrad(grad_out, weight, split_sizes, offsets, out)
        if self.check_hook_results:
            check_hook_result(
                self, "_dgrad", result, out, (grad_out.shape[0], weight.shape[2]), grad_out.dtype
            )
        return result


def check_hook_result(
    backend: GroupedGemmBackend,
    hook: str,
    result: object,
    out: Tensor | None,
    shape: tuple[int, ...],
    dtype: torch.dtype,
) -> None:
    """``RuntimeError`` naming the backend and hook unless ``result`` is ``out`` (when given) or
    a tensor of ``shape`` and ``dtype``: a structural check (identity, shape, dtype), no data read."""
    if out is not None:
        if result is out:
            return
        if (
            isinstance(result, Tensor)
            and result.data_ptr() == out.data_ptr()
            and result.shape == out.shape
            and result.stride() == out.stride()
        ):
            return  # a new tensor object for the same memory
        raise RuntimeError(
            f"{backend.name}.{hook}: was given out= of shape {list(out.shape)} but returned "
            f"{'another tensor, ' if isinstance(result, Tensor) else ''}{_described(result)}; a backend "
            "writes into out and returns that tensor"
        )
    if not isinstance(result, Tensor) or result.shape != shape or result.dtype != dtype:
        raise RuntimeError(
            f"{backend.name}.{hook}: returned {_described(result)}; expected a {dtype} tensor of shape {list(shape)}"
        )


def check_fused_result(
    backend: GroupedGemmBackend,
    hook: str,
    result: object,
    shapes: tuple[tuple[int, ...] | None, ...],
    dtype: torch.dtype,
) -> None:
    """``RuntimeError`` unless ``result`` is a tuple of one ``dtype`` tensor of each of ``shapes``
    (None where the shape is None). Item 1 of ``_fc2_dgrad_act``, grad_scales, needs only one
    value per row: the caller casts and reshapes it to the scales' dtype and shape."""
    if not isinstance(result, (tuple, list)) or len(result) != len(shapes):
        raise RuntimeError(
            f"{backend.name}.{hook}: returned {_described(result)}; expected a tuple of {len(shapes)} items"
        )
    for index, (value, shape) in enumerate(zip(result, shapes)):
        if shape is None:
            if value is not None:
                raise RuntimeError(f"{backend.name}.{hook}: returned a tensor as item {index}; expected None")
            continue
        scales_grad = hook == "_fc2_dgrad_act" and index == 1
        if not isinstance(value, Tensor) or (
            value.numel() != shape[0] if scales_grad else value.shape != shape or value.dtype != dtype
        ):
            wanted = f"{shape[0]} values" if scales_grad else f"a {dtype} tensor of shape {list(shape)}"
            raise RuntimeError(
                f"{backend.name}.{hook}: returned {_described(value)} as item {index}; expected {wanted}"
            )


def _described(value: object) -> str:
    if isinstance(value, Tensor):
        return f"a {value.dtype} tensor of shape {list(value.shape)}"
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)}"
    return type(value).__name__


def group_ids_from_offsets(offsets: Tensor, num_rows: int) -> Tensor:
    """Group index of every row, ``[num_rows]`` int64, computed on device (no sync)."""
    rows = torch.arange(num_rows, device=offsets.device, dtype=offsets.dtype)
    return torch.searchsorted(offsets, rows, right=True).long()
