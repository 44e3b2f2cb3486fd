"""Call signatures: what a fuser call's checks and plan depend on, so both run once per signature.

A call's signature holds the metadata of every tensor it receives (shape, dtype,
device, layout, whether it requires grad or was made under inference mode), the
lengths of list extra inputs, which extra inputs are equal and which arguments are
the same object, the parameters' metadata, the grad and inference modes, autocast,
the settings, the rule registry and the ops' training flags. Calls with the same
signature pass the same metadata checks (every op's preflight) and get the same plan,
so the fuser keeps both under the signature and runs only the ops' value checks
(:meth:`~fusible_ops.core.op.BasicOperation.check_values`) on later calls.

Only plain tensors take part: a tensor subclass (DTensor, FakeTensor, a functorch
wrapper), an extra input that is neither a tensor nor a list of ints, a call with op
kwargs (its buffers are checked against the call's tensors) or an op whose preflight
reads values (:func:`~fusible_ops.core.op.preflight_is_static`) runs every check on every
call, as does anything under ``torch.compile`` (traced once per graph anyway).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..core.op import TensorMeta
from ..core.settings import current_settings
from ..kernels.signature_checks import SignatureChecks
from .function import dedupe_args
from .plan import FusionPlan
from .rules import classify_extra_inputs, compares_by_value, registry_version

_PLAIN = (torch.Tensor, torch.nn.Parameter)


def autocast_state(device: torch.device | str) -> tuple:
    """``(enabled, dtype)`` of autocast on ``device`` (a device or a device type)."""
    device_type = device if type(device) is str else device.type
    if torch.is_autocast_enabled(device_type):
        return (True, torch.get_autocast_dtype(device_type))
    return (False, None)


def call_signature(
    ops: Sequence[Any],
    input_: Any,
    extra_inputs: Sequence[Any],
    param_dicts: list[dict[str, torch.Tensor | None]],
) -> tuple[tuple, list[Any], list[int]] | None:
    """``(signature, distinct arguments, slots)`` of a call, or None when it has no signature.

    ``extra_inputs`` are the call's, flat. The distinct arguments and slots are those of
    :func:`~fusible_ops.fuser.function.dedupe_args` over the extra inputs and the
    parameters that are not None, which the fuser's autograd Function receives.
    """
    if type(input_) not in _PLAIN:
        return None
    # one flat list, written inline: this runs on every call. A CPU tensor's device is
    # "cpu" (``tensor.device`` builds a device object, a large part of a tiny call)
    input_device = "cpu" if input_.is_cpu else input_.device
    parts: list[Any] = [
        input_.shape,
        input_.dtype,
        input_device,
        input_.layout,
        input_.requires_grad,
        input_.is_inference(),
    ]
    values = []
    for value in extra_inputs:
        kind = type(value)
        if kind in _PLAIN:
            parts += (
                value.shape,
                value.dtype,
                "cpu" if value.is_cpu else value.device,
                value.layout,
                value.requires_grad,
                value.is_inference(),
            )
        elif kind is list or kind is tuple:
            parts += (kind, len(value))
        else:
            return None
        values.append(value)
    for params in param_dicts:
        for tensor in params.values():
            if tensor is None:
                parts.append(None)
                continue
            kind = type(tensor)
            if kind not in _PLAIN:
                return None
            parts += (
                kind,
                tensor.shape,
                tensor.dtype,
                "cpu" if tensor.is_cpu else tensor.device,
                tensor.requires_grad,
                tensor.is_inference(),
            )
            values.append(tensor)
    unique, slots = dedupe_args(values)
    parts.append(tuple(slots))
    distinct_extra = unique[: len(set(slots[: len(extra_inputs)]))]
    if len(distinct_extra) > 1 and sum([compares_by_value(value) for value in distinct_extra]) > 1:
        # distinct objects that the plan compares by value (equal split sizes to fc1 and fc2)
        parts.append(classify_extra_inputs([tuple(extra_inputs)])[0])
    parts += (
        tuple([op.training for op in ops]),
        current_settings(),
        torch.is_grad_enabled(),
        torch.is_inference_mode_enabled(),
        autocast_state(input_device),
        registry_version(),
    )
    return tuple(parts), unique, slots


@dataclass(frozen=True)
class PreparedCall:
    """What a signature's first call worked out: its plan, the state its autograd Function
    receives (None when nothing needs a gradient), for each op that has value checks
    ``(op index, its input meta, its extra inputs' slice of the call's)``, and whether its
    backend calls passed their argument checks once
    (:class:`~fusible_ops.kernels.signature_checks.SignatureChecks`)."""

    plan: FusionPlan
    state: Any
    value_checks: tuple[tuple[int, TensorMeta, slice], ...]
    signature_checks: SignatureChecks | None = None


class BoundedCache:
    """A dict of at most ``size`` entries, the oldest dropped first (the fuser's plans and
    prepared calls)."""

    def __init__(self, size: int = 32) -> None:
        self.size = size
        self._entries: OrderedDict[tuple, Any] = OrderedDict()

    def get(self, key: tuple) -> Any:
        return self._entries.get(key)

    def put(self, key: tuple, value: Any) -> None:
        self._entries[key] = value
        if len(self._entries) > self.size:
            self._entries.popitem(last=False)
