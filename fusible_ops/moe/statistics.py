"""The ``MoE`` layer's routing statistics (``last_expert_load``, ``last_dropped_load``,
``aux_losses``), kept in non-persistent buffers written in place.

A forward records them with in-place copies into buffers rather than by assigning
attributes: an attribute assignment is a Python side effect, which ``torch.compile``
cannot trace inside an activation-checkpointed region (``torch.utils.checkpoint`` under
compile is a higher-order op that refuses to mutate anything from outside its scope, a
graph break); a buffer write is an op in the graph. The attributes read the buffers back
as fresh tensors, so what a caller keeps is not changed by a later forward.
"""

from __future__ import annotations

import torch

#: the balancing losses that ``aux_losses`` may hold, in the order of their buffer slots
LOSS_NAMES = ("load_balancing", "z_loss")
# slots of the flags buffer: whether a forward recorded, and what it recorded
_RECORDED, _DROPPED, _LOSS0, _FLOAT64 = 0, 1, 2, 2 + len(LOSS_NAMES)
#: buffers whose dtype ``module.to(dtype)`` must keep (float64 holds any loss exactly)
KEEP_DTYPE_BUFFERS = ("_loss_stat",)
#: the flags of a forward that computed no balancing loss
_NO_LOSSES = tuple((_LOSS0 + slot, 0) for slot in range(len(LOSS_NAMES))) + ((_FLOAT64, 0),)


class MoEStatistics:
    """The routing statistics of a forward (a mixin of :class:`~fusible_ops.MoE`)."""

    def _init_statistics(self, num_experts: int, device: torch.device | str | None) -> None:
        for name, size, dtype in (
            ("_load_stat", num_experts, torch.long),
            ("_dropped_stat", num_experts, torch.long),
            ("_loss_stat", len(LOSS_NAMES), torch.float64),
            ("_stat_flags", _FLOAT64 + 1, torch.long),
        ):
            self.register_buffer(name, torch.zeros(size, dtype=dtype, device=device), persistent=False)

    def _record_load(self, load: torch.Tensor, dropped_load: torch.Tensor | None) -> None:
        """Record the rows routed to each expert and, with a capacity, the dropped ones."""
        buffers = self._buffers
        buffers["_load_stat"].copy_(load)
        if dropped_load is not None:
            buffers["_dropped_stat"].copy_(dropped_load)
        self._set_flags(((_RECORDED, 1), (_DROPPED, int(dropped_load is not None))))

    def _record_losses(self, losses: dict[str, torch.Tensor]) -> None:
        """Record the unscaled balancing losses of a training forward (detached)."""
        if not losses:
            self._set_flags(_NO_LOSSES)
            return
        for slot, name in enumerate(LOSS_NAMES):
            value = losses.get(name)
            if value is not None:
                self._buffers["_loss_stat"][slot].copy_(value.detach())
        float64 = any(value.dtype == torch.float64 for value in losses.values())
        flags = [(_LOSS0 + slot, int(name in losses)) for slot, name in enumerate(LOSS_NAMES)]
        self._set_flags((*flags, (_FLOAT64, int(float64))))

    def _set_flags(self, values: tuple[tuple[int, int], ...]) -> None:
        """Write ``(slot, value)`` pairs into the flags buffer. An eager call skips the pairs
        the buffer already holds: what this module last wrote, when it is the same buffer
        and nothing has written it since (its version counter)."""
        flags = self._buffers["_stat_flags"]
        if torch.compiler.is_compiling():
            for slot, value in values:
                flags[slot].fill_(value)
            return
        known = self.__dict__.get("_flags_written")
        held: frozenset = frozenset()
        if known is not None and known[0] is flags and known[1] == flags._version:
            held = known[2]
            if held.issuperset(values):
                return
        for slot, value in values:
            if (slot, value) not in held:
                flags[slot].fill_(value)
        slots = {slot for slot, _ in values}
        held = frozenset([pair for pair in held if pair[0] not in slots] + list(values))
        self.__dict__["_flags_written"] = (flags, flags._version, held)

    @property
    def last_expert_load(self) -> torch.Tensor | None:
        """``[E]`` int64: the rows the last forward routed to each expert (dropped ones
        included), or None before any forward. Reading it reads a small flag tensor on
        the host."""
        if not self._stat_flags[_RECORDED].item():
            return None
        return self._load_stat.clone()

    @property
    def last_dropped_load(self) -> torch.Tensor | None:
        """``[E]`` int64: the rows the last forward dropped per expert (``capacity_factor``),
        or None (no forward yet, or the last one had no capacity)."""
        recorded, dropped = self._stat_flags[: _DROPPED + 1].tolist()
        if not (recorded and dropped):
            return None
        return self._dropped_stat.clone()

    @property
    def aux_losses(self) -> dict[str, torch.Tensor]:
        """The unscaled balancing losses of the last training forward, detached scalars by
        name (``"load_balancing"``, ``"z_loss"``); empty before one, or when none is computed."""
        flags = self._stat_flags.tolist()
        dtype = torch.float64 if flags[_FLOAT64] else torch.float32
        return {
            name: self._loss_stat[slot].to(dtype, copy=True)
            for slot, name in enumerate(LOSS_NAMES)
            if flags[_LOSS0 + slot]
        }
