"""Checks of the ``MoE`` layer's options and inputs, and its option attributes: read-only
ones fixed at construction and per-call ones checked on every assignment."""

from __future__ import annotations

import math
import types
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from . import balance

#: the parameter dtypes the layer computes in
PARAM_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
#: ``activation_kwargs`` that are plain numbers (``limit`` must also be positive)
_NUMBER_KWARGS = ("limit", "alpha", "glu_linear_offset")


def per_call(name: str, check: Callable[[Any, object], object], doc: str) -> property:
    """An attribute read on every call, stored as ``_<name>``: each assignment is checked by
    ``check(moe, value)`` (which returns the value to store) before it is stored."""
    slot = "_" + name

    def getter(self: Any) -> Any:
        return getattr(self, slot)

    def setter(self: Any, value: object) -> None:
        setattr(self, slot, check(self, value))

    getter.__doc__ = doc  # what help() and the API reference show
    return property(getter, setter, doc=doc)


def is_int(value: object) -> bool:
    """An int, not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    """A real Python number, not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_finite(value: object) -> bool:
    """A real Python number (not a bool) that is finite as a float."""
    try:
        return _is_number(value) and math.isfinite(value)
    except OverflowError:  # an int beyond float's range
        return False


def check_flag(name: str, value: object) -> bool:
    """A bool (a truthy string or number would build or run something else)."""
    if not isinstance(value, bool):
        raise ValueError(f"MoE: {name} must be a bool, got {value!r}")
    return value


def check_coeff(name: str, value: object) -> float:
    """A finite number >= 0 (a loss coefficient or the bias update rate)."""
    if not _is_finite(value) or not value >= 0:
        raise ValueError(f"MoE: {name} must be a number >= 0 and finite, got {value!r}")
    return float(value)


def check_jitter(value: object) -> float:
    """A number in ``[0, 1)``: the router input is scaled by ``U(1 - j, 1 + j)``."""
    if not _is_number(value) or not 0 <= value < 1:
        raise ValueError(f"MoE: router_jitter must be a number in [0, 1), got {value!r}")
    return float(value)


def check_capacity(value: object, num_experts: int) -> float | None:
    """``None`` or a number in ``(0, num_experts]``: a larger factor cannot drop a row (an
    expert gets at most one row per token) and would overflow the capacity."""
    if value is None:
        return None
    if not _is_number(value) or not 0 < value <= num_experts:
        raise ValueError(
            f"MoE: capacity_factor must be a positive number or None, at most num_experts={num_experts} "
            f"(a larger factor drops nothing: use None), got {value!r}"
        )
    return float(value)


def check_balancing(mode: object) -> None:
    """One of :data:`~fusible_ops.moe.balance.LOAD_BALANCING`."""
    if mode not in balance.LOAD_BALANCING:
        raise ValueError(f"MoE: load_balancing must be one of {balance.LOAD_BALANCING}, got {mode!r}")


def check_options(shared_size: object, shared_gate: bool, routed_scaling_factor: object) -> None:
    """The shared experts' options; a finite ``routed_scaling_factor`` (its other checks are
    :class:`~fusible_ops.moe.router.RoutingConfig`'s)."""
    if not is_int(shared_size) or shared_size < 0:
        raise ValueError(f"MoE: shared_ffn_hidden_size must be an int >= 0, got {shared_size!r}")
    if shared_gate and not shared_size:
        raise ValueError("MoE: shared_expert_gate needs shared experts (shared_ffn_hidden_size > 0)")
    if _is_number(routed_scaling_factor) and not _is_finite(routed_scaling_factor):
        raise ValueError(
            f"MoE: routed_scaling_factor must be a positive number, got {routed_scaling_factor!r}"
        )


def check_dtype(dtype: object) -> None:
    """``None`` or one of :data:`PARAM_DTYPES`."""
    if dtype is not None and dtype not in PARAM_DTYPES:
        raise ValueError(
            f"MoE: dtype must be None or a real floating-point dtype ({', '.join(map(str, PARAM_DTYPES))}), "
            f"got {dtype!r}"
        )


def check_activation_kwargs(kwargs: object, cls: type, ffn_sizes: tuple[int, ...]) -> dict[str, Any]:
    """A copy of ``activation_kwargs`` (a mapping or None), checked: its keys fit ``cls``, its
    values have their types, ``glu_interleave_size`` divides each of ``ffn_sizes``."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, Mapping):
        raise ValueError(
            f"MoE: activation_kwargs must be a mapping (e.g. a dict) or None, got {type(kwargs).__name__}"
        )
    kwargs = dict(kwargs)
    size = kwargs.get("glu_interleave_size")
    if size is not None and (not is_int(size) or size < 1):
        raise ValueError(
            f"MoE: activation_kwargs['glu_interleave_size'] must be a positive int, got {size!r}"
        )
    for ffn in ffn_sizes:
        if size is not None and ffn % size:
            raise ValueError(
                f"MoE: activation_kwargs['glu_interleave_size']={size} must divide the ffn hidden size {ffn}"
            )
    for key in _NUMBER_KWARGS:
        value = kwargs.get(key, 1.0)
        if not _is_finite(value) or (key == "limit" and not value > 0):
            what = "a positive finite number" if key == "limit" else "a finite number"
            raise ValueError(f"MoE: activation_kwargs[{key!r}] must be {what}, got {value!r}")
    make_activation(cls, kwargs)  # unknown keys
    return kwargs


def read_only_kwargs(kwargs: dict[str, Any]) -> Mapping[str, Any]:
    """A read-only view: editing it could not change the ops built from it."""
    return types.MappingProxyType(kwargs)


def make_activation(cls: type, kwargs: dict[str, Any]) -> nn.Module:
    """``cls(**kwargs)``; ``ValueError`` naming ``activation_kwargs`` if they do not fit."""
    try:
        return cls(**kwargs)
    except TypeError as err:
        raise ValueError(f"MoE: activation_kwargs {kwargs} do not fit {cls.__name__}: {err}") from None


def as_balance_group(group: object) -> object | None:
    """``None``, a process group, or the group of a 1-D ``DeviceMesh``."""
    if group is None:
        return None
    import torch.distributed as dist

    if dist.is_available():
        from torch.distributed.device_mesh import DeviceMesh

        if isinstance(group, dist.ProcessGroup):
            return group
        if isinstance(group, DeviceMesh):
            if group.ndim != 1:
                raise ValueError(
                    f"MoE: balance_group must be a process group or a 1-D DeviceMesh, got {group.ndim}-D"
                )
            return group.get_group()
    raise ValueError(
        "MoE: balance_group must be None, a torch.distributed process group or a 1-D DeviceMesh, "
        f"got {type(group).__name__}"
    )


def ep_group_of(mesh: object, num_experts: int, device: torch.device | str | None) -> object:
    """The process group of a 1-D expert-parallel ``DeviceMesh``, after checking it."""
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(mesh, DeviceMesh):
        raise ValueError(f"MoE: ep_mesh must be a DeviceMesh, got {type(mesh).__name__}")
    if mesh.ndim != 1:
        raise ValueError(
            f"MoE: ep_mesh must be 1-D (a named dimension such as world_mesh['ep']), got {mesh.ndim}-D "
            f"with dims {mesh.mesh_dim_names}"
        )
    if num_experts % mesh.size():
        raise ValueError(f"MoE: num_experts={num_experts} is not divisible by the ep_mesh size {mesh.size()}")
    wanted = torch.device(device).type if device is not None else torch.get_default_device().type
    if mesh.device_type != wanted:
        raise ValueError(
            f"MoE: ep_mesh is a {mesh.device_type!r} mesh but the parameters are made on {wanted!r}; "
            "use a mesh of the parameters' device type"
        )
    return mesh.get_group()


def check_input(x: object, hidden_size: int, weight: torch.Tensor) -> None:
    """``ValueError`` unless ``x`` is a dense ``[..., hidden]`` tensor with data that the
    parameters can take (their dtype, or any floating dtype under autocast)."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"MoE: input must be a tensor [..., {hidden_size}], got {type(x).__name__}")
    if x.is_nested:
        raise ValueError("MoE: input is a nested tensor; pass a dense [..., hidden] tensor (e.g. padded)")
    if x.layout != torch.strided:
        raise ValueError(f"MoE: input has layout {x.layout}; pass a dense tensor (e.g. x.to_dense())")
    if x.is_meta:
        raise ValueError("MoE: input is a meta tensor (it holds no data to route)")
    if x.dim() < 1 or x.shape[-1] != hidden_size:
        raise ValueError(f"MoE: input must be [..., {hidden_size}], got {tuple(x.shape)}")
    if x.dtype != weight.dtype and not torch.is_autocast_enabled(x.device.type):
        raise ValueError(
            f"MoE: input dtype {x.dtype} does not match the parameters' dtype {weight.dtype}; "
            "convert one of them (e.g. moe.to(dtype)) or run under torch.autocast"
        )
    if not x.dtype.is_floating_point:
        raise ValueError(f"MoE: input must be floating point, got {x.dtype}")
