"""Checks the checkpoint helpers run before they write: each tensor's shape, dtype and
device, keys and experts with no place in the target, a meta-device target, sources that
alias the parameters; and the copies exports return."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from ..basic.grouped_linear import local_groups


def _check(name: str, tensor: torch.Tensor | None, shape: tuple[int, ...], device: torch.device) -> None:
    """``ValueError`` unless ``tensor`` can be copied into a parameter of ``shape`` on ``device``."""
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(
            f"checkpoint: {name} must be a tensor of shape {list(shape)}, got {type(tensor).__name__}"
        )
    if tensor.is_meta:
        raise ValueError(f"checkpoint: {name} is a meta tensor (it holds no data)")
    if not tensor.is_floating_point():
        raise ValueError(
            f"checkpoint: {name} has dtype {tensor.dtype}; expected a real floating-point tensor"
        )
    if tensor.device.type != "cpu" and tensor.device != device:
        raise ValueError(f"checkpoint: {name} is on {tensor.device}; expected the CPU or {device}")
    if tuple(tensor.shape) != shape:
        raise ValueError(f"checkpoint: {name} has shape {list(tensor.shape)}; expected {list(shape)}")


def _device_of(experts: nn.Module) -> torch.device:
    """The parameters' device; ``ValueError`` for the meta device (nothing to load into)."""
    for i in (0, 2):
        if local_groups(experts[i].weight).is_meta:
            raise ValueError(
                "checkpoint: the experts' parameters are on the meta device and hold no memory to load "
                "into; materialize them first (e.g. module.to_empty(device=...)), then load"
            )
    return experts[0].weight.device


def _shares_memory(tensor: torch.Tensor, params: list[torch.Tensor]) -> bool:
    storage = tensor.untyped_storage()
    start = storage.data_ptr()
    end = start + storage.nbytes()
    for p in params:
        other = p.untyped_storage()
        if other.data_ptr() < end and start < other.data_ptr() + other.nbytes():
            return True
    return False


def _check_no_unplaced_keys(state_dict: Mapping[str, object], pattern: str, allowed: set[str]) -> None:
    """``ValueError`` for a key matching ``pattern`` (a regex) that is not in ``allowed``.

    ``allowed`` holds every key this target (on any rank) reads; a matching key outside
    it (an expert past the model's count, a bias for bias-free experts) has no place.
    """
    compiled = re.compile(pattern)
    for key in state_dict:
        if isinstance(key, str) and compiled.fullmatch(key) and key not in allowed:
            raise ValueError(f"checkpoint: key {key!r} has no place in the target ({_why_unplaced(key)})")


def _why_unplaced(key: str) -> str:
    return "the experts have no biases" if "bias" in key else "no such expert or projection"


def _check_expert_ids(name: str, source: Mapping[int, object] | Sequence[object], num_global: int) -> None:
    """``ValueError`` for entries of ``source`` past the model's ``num_global`` experts."""
    ids = list(source.keys()) if isinstance(source, Mapping) else range(len(source))
    extra = [e for e in ids if not (isinstance(e, int) and 0 <= e < num_global)]
    if extra:
        raise ValueError(
            f"checkpoint: {name} has entries for experts {extra} but the model has {num_global} experts"
        )


def _check_projection_names(names: object, prefix: object, gated: bool) -> None:
    """``ValueError`` unless ``names`` is three distinct non-empty strings (gate, up, down)
    and ``prefix`` a string (``load_per_expert_state_dict``'s arguments)."""
    if not isinstance(prefix, str):
        raise ValueError(f"load_per_expert_state_dict: prefix must be a str, got {type(prefix).__name__}")
    valid = (
        isinstance(names, (tuple, list))
        and len(names) == 3
        and all(isinstance(name, str) and name for name in names)
        and len(set(names)) == 3
    )
    if valid:
        return
    if gated:
        hint = 'e.g. ("w1", "w3", "w2") or ("gate_proj", "up_proj", "down_proj")'
    else:
        hint = (
            "the experts' activation is not gated, so the up name is not read (keys under it are "
            'refused), but it is still given: e.g. ("w1", "w3", "w2") for keys "{e}.w1.weight" '
            'and "{e}.w2.weight"'
        )
    raise ValueError(
        "load_per_expert_state_dict: names must be a tuple of three distinct non-empty strings, the "
        f"(gate, up, down) projection names; got {names!r}; {hint}"
    )


def _fresh(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.clone(memory_format=torch.contiguous_format)
