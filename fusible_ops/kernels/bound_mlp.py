"""The fused grouped MLP bound to one call signature: the backend's hooks, called directly.

A fuser call whose signature passed every argument check once (see
:mod:`.signature_checks`) hands the kernels arguments of the same metadata, and split
sizes its ops checked for this call. :class:`BoundMLP` is what such a call runs: the
math of :func:`~fusible_ops.kernels.library.mlp_forward` and
:func:`~fusible_ops.kernels.library.mlp_backward`, on :class:`CheckedHooks`, which makes
the decisions the public entry points make from metadata (whether the activation is
fused, the host split sizes the hooks take) once, when the signature is bound, and then
calls the protected hooks those entry points would reach.
"""

from __future__ import annotations

import torch

from .activation import ActivationSpec
from .base import GroupedGemmBackend
from .library import _mlp_backward_impl, _mlp_forward_impl

Tensor = torch.Tensor


def like_scales(grad_scales: Tensor | None, scales: Tensor) -> Tensor | None:
    """The scales' gradient in their dtype and shape (what ``fc2_dgrad_act`` returns)."""
    if grad_scales is not None and (grad_scales.dtype != scales.dtype or grad_scales.shape != scales.shape):
        return grad_scales.to(scales.dtype).reshape(scales.shape)
    return grad_scales


class CheckedHooks:
    """``backend``'s public GEMM methods for arguments that passed their checks for this
    signature: each goes straight to the hook it would reach."""

    __slots__ = ("backend", "fuses", "host_hooks")

    def __init__(self, backend: GroupedGemmBackend, spec: ActivationSpec, rows: Tensor) -> None:
        self.backend = backend
        device = torch.device("cpu") if rows.is_cpu else rows.device
        #: what fc1_fprop_act and fc2_dgrad_act decide from metadata (a signature fixes the rows)
        self.fuses = rows.shape[0] > 0 and backend.fused_activation_reason(spec, device) is None
        #: the hooks take the host split sizes as given, unless the backend needs them on the host
        self.host_hooks = backend.needs_host_splits

    def _sizes(self, host: list[int] | None, offsets: Tensor, rows: Tensor) -> list[int] | None:
        if not self.host_hooks or type(host) is list:
            return host
        return self.backend._hook_sizes("bound mlp", rows, host, offsets)

    def fc1_fprop_act(self, x, weight, bias, split_sizes, offsets, activation, scales):  # noqa: ANN001, ANN201
        sizes, backend = self._sizes(split_sizes, offsets, x), self.backend
        if self.fuses:
            return backend._fc1_fprop_act(x, weight, bias, sizes, offsets, activation, scales)
        return backend._composed_fc1_fprop_act(x, weight, bias, sizes, offsets, activation, scales)

    def fprop(self, x, weight, split_sizes, offsets, *, bias=None, out=None):  # noqa: ANN001, ANN201
        return self.backend._run_fprop(x, weight, self._sizes(split_sizes, offsets, x), offsets, bias, out)

    def fc2_dgrad_act(self, grad_y, weight, pre, split_sizes, offsets, activation, scales):  # noqa: ANN001, ANN201
        sizes, backend = self._sizes(split_sizes, offsets, grad_y), self.backend
        hook = backend._fc2_dgrad_act if self.fuses else backend._composed_fc2_dgrad_act
        grad_pre, grad_scales, act = hook(grad_y, weight, pre, sizes, offsets, activation, scales)
        return grad_pre, like_scales(grad_scales, scales), act

    def dgrad(self, grad_out, weight, split_sizes, offsets, *, out=None):  # noqa: ANN001, ANN201
        sizes = self._sizes(split_sizes, offsets, grad_out)
        return self.backend._run_dgrad(grad_out, weight, sizes, offsets, out)

    def wgrad(self, grad_out, x, split_sizes, offsets, *, out=None):  # noqa: ANN001, ANN201
        if x.shape[0] == 0:
            shape = (offsets.shape[0], grad_out.shape[1], x.shape[1])
            return out.zero_() if out is not None else x.new_zeros(shape)
        return self.backend._wgrad(grad_out, x, self._sizes(split_sizes, offsets, x), offsets, out)

    def bias_grad(self, grad_out, split_sizes, offsets, num_groups):  # noqa: ANN001, ANN201
        sizes = self._sizes(split_sizes, offsets, grad_out)
        return self.backend._bias_grad(grad_out, sizes, offsets, num_groups)


class BoundMLP:
    """fc1 -> (scaled) activation -> fc2 (-> scale) on ``backend`` for one signature.

    Args:
        backend: the plan's backend (its public methods' checks passed for this signature).
        spec: the activation.
        scale_after_fc2: routing weights applied after fc2 (and its bias) instead of
            to the activation.
        operands: the first call's ``(x, w1, b1, w2, b2)`` (``[M, K]`` rows, ``[G, N, K]``
            weights, ``[G, N]`` biases or None): every call of the signature has their metadata.
    """

    __slots__ = ("backend", "spec", "scale_after_fc2", "hooks")

    def __init__(
        self, backend: GroupedGemmBackend, spec: ActivationSpec, scale_after_fc2: bool, operands: tuple
    ) -> None:
        self.backend = backend
        self.spec = spec
        self.scale_after_fc2 = scale_after_fc2
        self.hooks = CheckedHooks(backend, spec, operands[0])

    def forward(self, x, w1, b1, w2, b2, scales, host, offsets) -> tuple[Tensor, Tensor]:  # noqa: ANN001
        """``(pre, y)``: fc1's output (kept for backward) and the block's output."""
        args = (x, w1, b1, w2, b2, scales, host, offsets, self.spec, self.scale_after_fc2, None)
        return _mlp_forward_impl(self.hooks, *args)

    def backward(self, dy, x, pre, w1, w2, b2, scales, host, offsets, needs) -> tuple:  # noqa: ANN001
        """``(grad_input, grad_w1, grad_b1, grad_w2, grad_b2, grad_scales)``, None where
        ``needs`` (input, w1, b1, w2, b2, scales) says no gradient is needed."""
        args = (dy, x, pre, w1, w2, b2, scales, host, offsets, self.spec, self.scale_after_fc2, needs, None)
        return _mlp_backward_impl(self.hooks, *args)
