"""Import and export MoE expert weights in the layouts public checkpoints use.

``E`` experts (global), ``F`` ffn size, ``H`` hidden size. Supported layouts:

- **stacked** (``load_stacked``): ``gate_up [E, 2F, H]`` with the gate half first and
  ``down [E, H, F]``; ``transposed=True`` reads ``gate_up [E, H, 2F]`` and
  ``down [E, F, H]``; ``interleaved=True`` reads gate and up as alternating columns
  (gate at even positions: the GPT-OSS layout is ``transposed=True, interleaved=True``).
  Biases ``gate_up_bias [E, 2F]`` (same gate/up order) and ``down_bias [E, H]``.
- **per expert** (``load_per_expert``): ``w1[e]`` gate ``[F, H]``, ``w3[e]`` up
  ``[F, H]``, ``w2[e]`` down ``[H, F]`` (Mixtral's ``w1/w3/w2``, or
  ``gate_proj/up_proj/down_proj``), given as mappings or sequences indexed by global
  expert id; ``load_per_expert_state_dict`` reads them from state-dict keys.
- **grouped keys** (``load_grouped_keys``): ``{prefix}0.weight{e}`` ``[2F, H]`` and
  ``{prefix}2.weight{e}`` ``[H, F]`` (and ``bias{e}``), one key per expert.

Non-gated activations (``srelu``) have no up projection: ``gate_up`` is ``[E, F, H]``
and ``w3`` is omitted. The target is an ``MoE`` or its ``experts`` Sequential; under
expert parallelism each rank reads only the experts it holds (``expert_range``).
Every ``load_*`` checks every tensor before writing anything (a failed load leaves the
parameters unchanged): the shape, a real floating-point dtype (no complex, integer or
bool), real data (no meta tensors) on the CPU or the parameters' device; keys and
experts with no place in the target (e.g. biases for bias-free experts, experts past
the model's count, per-group keys of ops other than the two grouped linears) are errors
too, and so is a target on the meta device (it holds no memory to load into: materialize
it first, e.g. ``to_empty``). Sources that share memory with the parameters are read
before anything is written. Values are cast to the parameters' dtype. ``export_*``
return fresh copies (never views of the parameters) of the experts this rank holds,
keyed or indexed by global expert id (stacked exports start at
``expert_range(target).start``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ..basic.grouped_linear import GroupedLinear, local_groups
from ..basic.scale import Scale
from ..fuser.sequential import Sequential
from ..kernels.activation import join_gate_linear, split_gate_linear
from .checkpoint_checks import (
    _check,
    _check_expert_ids,
    _check_no_unplaced_keys,
    _check_projection_names,
    _device_of,
    _fresh,
    _shares_memory,
)
from .routing import ExpertPlacement


@dataclass
class _Experts:
    """Canonical per-expert tensors for the local experts (biases may be None)."""

    gate: torch.Tensor  # [L, F, H]
    up: torch.Tensor | None  # [L, F, H]; None for non-gated activations
    down: torch.Tensor  # [L, H, F]
    gate_bias: torch.Tensor | None = None  # [L, F]
    up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None


# ---------------------------------------------------------------- target inspection


def _experts_of(target: nn.Module) -> nn.Module:
    """The experts Sequential of ``target`` (an MoE, or that Sequential itself), checked."""
    experts = getattr(target, "experts", target) if isinstance(target, nn.Module) else target
    # (GroupedLinear, act, GroupedLinear) or, routing weight after fc2, (..., Scale)
    shape_ok = isinstance(experts, Sequential) and (
        len(experts) == 3 or (len(experts) == 4 and isinstance(experts[3], Scale))
    )
    if not shape_ok or not all(isinstance(experts[i], GroupedLinear) for i in (0, 2)):
        found = (
            f"a {type(experts).__name__} of {[type(m).__name__ for m in experts]}"
            if isinstance(experts, Sequential)
            else f"a {type(target).__name__}"
        )
        raise TypeError(
            "checkpoint: target must be an fo.MoE or its experts Sequential (GroupedLinear, "
            f"scaled activation, GroupedLinear) or (GroupedLinear, activation, GroupedLinear, Scale); got {found}"
        )
    return experts


def _placement(target: nn.Module) -> ExpertPlacement:
    """Where ``target``'s experts sit among the global ones (all of them without EP)."""
    experts = _experts_of(target)
    num_local = local_groups(experts[0].weight).shape[0]
    return experts.expert_placement or ExpertPlacement(0, num_local, num_local)


def expert_range(target: nn.Module) -> range:
    """Global indices of the experts ``target`` holds (all of them without expert parallelism)."""
    return _placement(target).global_ids


def _num_global_experts(target: nn.Module) -> int:
    return _placement(target).num_global


def _interleave_of(experts: nn.Module) -> int | None:
    act = experts[1]
    size = getattr(act, "glu_interleave_size", None)
    if size is None and hasattr(act, "spec"):
        size = getattr(act.spec, "glu_interleave_size", None)
    return size


def _local_out_in(fc: GroupedLinear) -> torch.Tensor:
    """``fc``'s weight as ``[local groups, out, in]``: this rank's shard of a DTensor, as a view."""
    return fc.weight_out_in(local_groups(fc.weight))


def _dims(experts: nn.Module) -> tuple[int, int, int, bool]:
    """``(local experts, F, H, gated)``."""
    num_local, hidden, ffn = _local_out_in(experts[2]).shape
    fc1_out = _local_out_in(experts[0]).shape[1]
    if fc1_out not in (ffn, 2 * ffn):
        raise TypeError(
            f"checkpoint: fc1 has {fc1_out} outputs; expected {ffn} or {2 * ffn} (fc2 has {ffn} inputs)"
        )
    return num_local, ffn, hidden, fc1_out == 2 * ffn


# ---------------------------------------------------------------- canonical <-> parameters


def _write(target: nn.Module, canon: _Experts) -> None:
    experts = _experts_of(target)
    fc1, fc2 = experts[0], experts[2]
    _device_of(experts)
    # a source that aliases a parameter would be read after the first copies overwrote it
    params = [local_groups(p).detach() for fc in (fc1, fc2) for p in fc.parameters(recurse=False)]
    for field in ("gate", "up", "down", "gate_bias", "up_bias", "down_bias"):
        value = getattr(canon, field)
        if value is not None and _shares_memory(value, params):
            setattr(canon, field, value.clone())
    interleave = _interleave_of(experts)
    has_bias = getattr(fc1, "bias", None) is not None
    if has_bias != (canon.gate_bias is not None):
        raise ValueError(
            f"checkpoint: the experts {'have' if has_bias else 'have no'} biases but the checkpoint "
            f"{'has none' if has_bias else 'has them'}"
        )
    if canon.up is None:
        fc1_weight, fc1_bias = canon.gate, canon.gate_bias
    else:
        # gate/up live on dim -2 of the weight: move it last to reuse the activation layout helpers
        fc1_weight = join_gate_linear(canon.gate.transpose(-1, -2), canon.up.transpose(-1, -2), interleave)
        fc1_weight = fc1_weight.transpose(-1, -2)
        fc1_bias = (
            None if canon.gate_bias is None else join_gate_linear(canon.gate_bias, canon.up_bias, interleave)
        )
    with torch.no_grad():
        _local_out_in(fc1).copy_(fc1_weight)  # through the [G, out, in] view of this rank's groups
        _local_out_in(fc2).copy_(canon.down)
        if has_bias:
            local_groups(fc1.bias).copy_(fc1_bias)
            local_groups(fc2.bias).copy_(canon.down_bias)


def _read(target: nn.Module) -> _Experts:
    experts = _experts_of(target)
    fc1, fc2 = experts[0], experts[2]
    _, _, _, gated = _dims(experts)
    w1 = _local_out_in(fc1).detach()
    b1 = None if getattr(fc1, "bias", None) is None else local_groups(fc1.bias).detach()
    b2 = None if getattr(fc2, "bias", None) is None else local_groups(fc2.bias).detach()
    if not gated:
        return _Experts(w1, None, _local_out_in(fc2).detach(), b1, None, b2)
    gate, up = split_gate_linear(w1.transpose(-1, -2), _interleave_of(experts))
    gate_b = up_b = None
    if b1 is not None:
        gate_b, up_b = split_gate_linear(b1, _interleave_of(experts))
    return _Experts(
        gate.transpose(-1, -2), up.transpose(-1, -2), _local_out_in(fc2).detach(), gate_b, up_b, b2
    )


# ---------------------------------------------------------------- stacked 3-D layouts


def load_stacked(
    target: nn.Module,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    *,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    transposed: bool = False,
    interleaved: bool = False,
) -> None:
    """Load global stacked tensors (see the module docstring); each rank copies its slice."""
    experts = _experts_of(target)
    _, ffn, hidden, gated = _dims(experts)
    num_global = _num_global_experts(target)
    fc1_out = 2 * ffn if gated else ffn
    if interleaved and not gated:
        raise ValueError("checkpoint: interleaved=True needs a gated activation (gate and up columns)")
    device = _device_of(experts)
    gate_up_shape = (num_global, hidden, fc1_out) if transposed else (num_global, fc1_out, hidden)
    _check("gate_up", gate_up, gate_up_shape, device)
    _check("down", down, (num_global, ffn, hidden) if transposed else (num_global, hidden, ffn), device)
    if (gate_up_bias is None) != (down_bias is None):
        raise ValueError("checkpoint: give both gate_up_bias and down_bias, or neither")
    if gate_up_bias is not None:
        _check("gate_up_bias", gate_up_bias, (num_global, fc1_out), device)
        _check("down_bias", down_bias, (num_global, hidden), device)

    local = slice(expert_range(target).start, expert_range(target).stop)
    gate_up, down = gate_up[local], down[local]
    if not transposed:  # canonical split works on the last dim: [E, H, fc1_out]
        gate_up = gate_up.transpose(-1, -2)
    else:
        down = down.transpose(-1, -2)
    bias = None if gate_up_bias is None else gate_up_bias[local]
    down_b = None if down_bias is None else down_bias[local]
    if not gated:
        canon = _Experts(gate_up.transpose(-1, -2), None, down, bias, None, down_b)
    else:
        split = 1 if interleaved else None
        gate, up = split_gate_linear(gate_up, split)
        gate_b, up_b = split_gate_linear(bias, split) if bias is not None else (None, None)
        canon = _Experts(gate.transpose(-1, -2), up.transpose(-1, -2), down, gate_b, up_b, down_b)
    _write(target, canon)


def export_stacked(
    target: nn.Module, *, transposed: bool = False, interleaved: bool = False, gather: bool = False
) -> dict[str, torch.Tensor]:
    """This rank's experts as ``gate_up``, ``down`` (and ``gate_up_bias``, ``down_bias``).

    Inverse of :func:`load_stacked`; the leading dim covers ``expert_range(target)``.
    ``gather=True`` on an expert-parallel ``MoE`` all-gathers every rank's experts, so
    each rank returns the global tensors (a collective: call it on every rank).
    """
    result = _export_stacked_local(target, transposed, interleaved)
    expert_parallel = getattr(target, "expert_parallel", None)
    if gather and expert_parallel is not None:
        import torch.distributed as dist

        for key, local in result.items():
            parts = [torch.empty_like(local) for _ in range(expert_parallel.world_size)]
            dist.all_gather(parts, local, group=expert_parallel.group)
            result[key] = torch.cat(parts)
    return result


def _export_stacked_local(target: nn.Module, transposed: bool, interleaved: bool) -> dict[str, torch.Tensor]:
    canon = _read(target)
    if canon.up is None:
        if interleaved:
            raise ValueError("checkpoint: interleaved=True needs a gated activation (gate and up columns)")
        gate_up, bias = canon.gate.transpose(-1, -2), canon.gate_bias
    else:
        split = 1 if interleaved else None
        gate_up = join_gate_linear(canon.gate.transpose(-1, -2), canon.up.transpose(-1, -2), split)
        bias = None if canon.gate_bias is None else join_gate_linear(canon.gate_bias, canon.up_bias, split)
    down = canon.down.transpose(-1, -2) if transposed else canon.down
    if not transposed:
        gate_up = gate_up.transpose(-1, -2)
    # always copies: .contiguous() would return the parameter itself when its layout matches
    result = {"gate_up": _fresh(gate_up), "down": _fresh(down)}
    if bias is not None:
        result["gate_up_bias"] = _fresh(bias)
    if canon.down_bias is not None:
        result["down_bias"] = _fresh(canon.down_bias)
    return result


# ---------------------------------------------------------------- per-expert matrices


def _pick(name: str, source: Mapping[int, torch.Tensor] | Sequence[torch.Tensor], index: int) -> torch.Tensor:
    try:
        return source[index]
    except (KeyError, IndexError):
        raise ValueError(f"checkpoint: {name} has no entry for expert {index}") from None


def load_per_expert(
    target: nn.Module,
    w1: Mapping[int, torch.Tensor] | Sequence[torch.Tensor],
    w2: Mapping[int, torch.Tensor] | Sequence[torch.Tensor],
    w3: Mapping[int, torch.Tensor] | Sequence[torch.Tensor] | None = None,
    *,
    b1: Mapping[int, torch.Tensor] | Sequence[torch.Tensor] | None = None,
    b2: Mapping[int, torch.Tensor] | Sequence[torch.Tensor] | None = None,
    b3: Mapping[int, torch.Tensor] | Sequence[torch.Tensor] | None = None,
) -> None:
    """Load per-expert ``w1`` (gate ``[F, H]``), ``w3`` (up ``[F, H]``), ``w2`` (down ``[H, F]``).

    Indexed by global expert id; only this rank's experts are read, so a mapping may
    hold just those.
    """
    experts = _experts_of(target)
    _, ffn, hidden, gated = _dims(experts)
    if gated != (w3 is not None):
        raise ValueError(
            "checkpoint: a gated activation needs w3 (the up projection)"
            if gated
            else "checkpoint: a non-gated activation takes no w3"
        )
    if (b1 is None) != (b2 is None) or (gated and (b1 is None) != (b3 is None)):
        raise ValueError("checkpoint: give all of b1, b2" + (", b3" if gated else "") + " or none of them")
    device = _device_of(experts)
    num_global = _num_global_experts(target)
    for name, source in (("w1", w1), ("w2", w2), ("w3", w3), ("b1", b1), ("b2", b2), ("b3", b3)):
        if source is not None:
            _check_expert_ids(name, source, num_global)
    ids = list(expert_range(target))
    gate = [_pick("w1", w1, e) for e in ids]
    down = [_pick("w2", w2, e) for e in ids]
    up = None if w3 is None else [_pick("w3", w3, e) for e in ids]
    for e, g, d in zip(ids, gate, down):
        _check(f"w1[{e}]", g, (ffn, hidden), device)
        _check(f"w2[{e}]", d, (hidden, ffn), device)
    for e, u in zip(ids, up or []):
        _check(f"w3[{e}]", u, (ffn, hidden), device)
    biases: list[list[torch.Tensor] | None] = [None, None, None]
    for slot, (name, source, size) in enumerate((("b1", b1, ffn), ("b2", b2, hidden), ("b3", b3, ffn))):
        if source is not None:
            biases[slot] = [_pick(name, source, e) for e in ids]
            for e, b in zip(ids, biases[slot]):
                _check(f"{name}[{e}]", b, (size,), device)

    def stack(tensors: list[torch.Tensor] | None) -> torch.Tensor | None:
        # to(device): the checked tensors may mix the CPU and the parameters' device
        return None if tensors is None else torch.stack([t.to(device) for t in tensors])

    _write(
        target,
        _Experts(stack(gate), stack(up), stack(down), stack(biases[0]), stack(biases[2]), stack(biases[1])),
    )


def export_per_expert(target: nn.Module) -> dict[str, dict[int, torch.Tensor]]:
    """This rank's experts as ``{"w1": {e: gate}, "w3": {e: up}, "w2": {e: down}}`` (+ biases)."""
    canon = _read(target)
    ids = list(expert_range(target))
    result: dict[str, dict[int, torch.Tensor]] = {}
    for name, stacked in (
        ("w1", canon.gate),
        ("w3", canon.up),
        ("w2", canon.down),
        ("b1", canon.gate_bias),
        ("b3", canon.up_bias),
        ("b2", canon.down_bias),
    ):
        if stacked is not None:
            result[name] = {e: stacked[i].clone() for i, e in enumerate(ids)}
    return result


def load_per_expert_state_dict(
    target: nn.Module,
    state_dict: Mapping[str, torch.Tensor],
    prefix: str = "",
    names: tuple[str, str, str] = ("w1", "w3", "w2"),
) -> None:
    """Load keys ``{prefix}{e}.{name}.weight`` with ``names`` = (gate, up, down) projection names.

    Mixtral: ``prefix="block_sparse_moe.experts.", names=("w1", "w3", "w2")``;
    Qwen/DeepSeek style: ``names=("gate_proj", "up_proj", "down_proj")``. Biases are read
    from ``.bias`` keys when the experts have biases. A non-gated activation reads no up
    projection but still takes three names: keys under the up name are refused.
    """
    experts = _experts_of(target)
    gated = _dims(experts)[3]
    _check_projection_names(names, prefix, gated)
    has_bias = getattr(experts[0], "bias", None) is not None

    def collect(name: str, suffix: str) -> dict[int, torch.Tensor]:
        found = {}
        for e in expert_range(target):
            key = f"{prefix}{e}.{name}.{suffix}"
            if key not in state_dict:
                raise ValueError(f"checkpoint: missing key {key!r}")
            found[e] = state_dict[key]
        return found

    gate_name, up_name, down_name = names
    used = (gate_name, up_name, down_name) if gated else (gate_name, down_name)
    kinds = ("weight", "bias") if has_bias else ("weight",)
    allowed = {
        f"{prefix}{e}.{name}.{kind}"
        for e in range(_num_global_experts(target))
        for name in used
        for kind in kinds
    }
    names_re = "|".join(re.escape(name) for name in names)
    _check_no_unplaced_keys(state_dict, rf"{re.escape(prefix)}\d+\.(?:{names_re})\.(?:weight|bias)", allowed)
    load_per_expert(
        target,
        collect(gate_name, "weight"),
        collect(down_name, "weight"),
        collect(up_name, "weight") if gated else None,
        b1=collect(gate_name, "bias") if has_bias else None,
        b2=collect(down_name, "bias") if has_bias else None,
        b3=collect(up_name, "bias") if has_bias and gated else None,
    )


# ---------------------------------------------------------------- per-group weight{i} keys


def load_grouped_keys(
    target: nn.Module, state_dict: Mapping[str, torch.Tensor], prefix: str = "experts."
) -> None:
    """Load ``{prefix}0.weight{e}`` (fc1 ``[fc1_out, H]``, our gate/up order) and
    ``{prefix}2.weight{e}`` (fc2 ``[H, F]``), plus ``bias{e}`` keys when the experts have
    biases; ``e`` is the global expert id and only this rank's experts are read. The
    keys hold one group of the parameter as stored (``[H, fc1_out]`` for ``in_out``)."""
    experts = _experts_of(target)
    fc1, fc2 = experts[0], experts[2]
    has_bias = getattr(fc1, "bias", None) is not None
    ids = list(expert_range(target))
    kinds = ("weight", "bias") if has_bias else ("weight",)
    allowed = {
        f"{prefix}{op_index}.{kind}{e}"
        for e in range(_num_global_experts(target))
        for op_index in (0, 2)
        for kind in kinds
    }
    # any op index: keys of the activation (1) or the ops past fc2 have no place either
    _check_no_unplaced_keys(state_dict, rf"{re.escape(prefix)}\d+\.(?:weight|bias)\d+", allowed)
    _device_of(experts)
    # every tensor is checked first; then each GroupedLinear reads its per-group keys
    # ({kind}{local group}) itself, the one place that stacks them
    per_op: dict[GroupedLinear, dict[str, torch.Tensor]] = {fc1: {}, fc2: {}}
    for op_index, op in ((0, fc1), (2, fc2)):
        for kind in kinds:
            param = getattr(op, kind)
            for local, e in enumerate(ids):
                key = f"{prefix}{op_index}.{kind}{e}"
                if key not in state_dict:
                    raise ValueError(f"checkpoint: missing key {key!r}")
                _check(key, state_dict[key], tuple(param.shape[1:]), param.device)
                per_op[op][f"{kind}{local}"] = state_dict[key].to(param.device)
    for op, local_state in per_op.items():
        op.load_state_dict(local_state)


def export_grouped_keys(target: nn.Module, prefix: str = "experts.") -> dict[str, torch.Tensor]:
    """Inverse of :func:`load_grouped_keys` for this rank's experts."""
    experts = _experts_of(target)
    result = {}
    for op_index in (0, 2):
        op = experts[op_index]
        for kind in ("weight", "bias"):
            param = getattr(op, kind, None)
            if param is None:
                continue
            for i, e in enumerate(expert_range(target)):
                result[f"{prefix}{op_index}.{kind}{e}"] = local_groups(param).detach()[i].clone()
    return result
