"""The fusion plan: what runs in forward and backward, and why each rule did or did not fire."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..core.op import BasicOperation, FusibleOperation


@dataclass(frozen=True)
class PlanEntry:
    """One op of a forward or backward list and the basic-op indices it covers."""

    op: FusibleOperation
    indices: tuple[int, ...]
    #: the ``BackendChoice`` a basic op runs with, handed to it for the call (fused ops
    #: carry their own); a name or None for ops without kernels
    backend: Any = None

    @property
    def backend_name(self) -> str | None:
        if not isinstance(self.op, BasicOperation):
            return getattr(self.op, "backend", None)
        return getattr(self.backend, "name", self.backend)

    def describe(self, names: list[str], first_index: int = 0) -> str:
        """``names``: the group's op names; ``first_index``: the group's first op in its
        Sequential (what the text shows)."""
        if isinstance(self.op, BasicOperation):
            text = names[self.indices[0]]
        else:
            first, last = self.indices[0] + first_index, self.indices[-1] + first_index
            text = f"{type(self.op).__name__}(ops {first}..{last})"
        backend = self.backend_name
        return text + (f" [backend={backend}]" if backend else "")


@dataclass(frozen=True)
class FusionDecision:
    """A rule that matched a window: ``fired`` or declined with ``reason``.

    ``indices`` are positions in the Sequential (the indices ``op_kwargs`` uses).
    """

    rule: str
    kind: str
    indices: tuple[int, ...]
    fired: bool
    reason: str = ""
    backend: str | None = None

    def __str__(self) -> str:
        span = f"ops {self.indices[0]}..{self.indices[-1]}"
        if self.fired:
            note = f" backend={self.backend}" if self.backend else ""
            return f"+ {self.rule} ({self.kind}) fired on {span}{note}" + (
                f": {self.reason}" if self.reason else ""
            )
        return f"- {self.rule} ({self.kind}) declined on {span}: {self.reason}"


@dataclass
class FusionPlan:
    """Structured plan for one fuser group.

    Entries' ``indices`` are positions within the group (``op_names``); the text and the
    decisions use positions in the Sequential, ``first_index`` onwards.
    """

    op_names: list[str]
    forward: list[PlanEntry]
    backward: list[PlanEntry]
    decisions: list[FusionDecision] = field(default_factory=list)
    fusion_enabled: bool = True
    dtype: object = None
    device: object = None
    requires_grad: bool = False
    #: position of the group's first op in its Sequential
    first_index: int = 0
    #: the low-precision recipe the group runs under, or None when unquantized
    recipe: object = None

    def quantized_gemms(self) -> list[str]:
        """One line per forward entry that runs quantized GEMMs: the op, the recipe, which
        GEMMs are quantized and which engine runs them (and why others could not)."""
        lines = []
        for entry in self.forward:
            choice = (
                entry.backend
                if isinstance(entry.op, BasicOperation)
                else getattr(entry.op, "quantized", None)
            )
            if choice is not None and hasattr(choice, "recipe"):
                lines.append(f"{entry.describe(self.op_names, self.first_index)}: {choice.explain()}")
        return lines

    @property
    def fired(self) -> list[FusionDecision]:
        """The decisions whose fusion was applied."""
        return [d for d in self.decisions if d.fired]

    @property
    def declined(self) -> list[FusionDecision]:
        """The decisions whose fusion was not applied, each with its reason."""
        return [d for d in self.decisions if not d.fired]

    def forward_op_types(self) -> list[str]:
        """Class names of the ops the forward runs, in order (fused ops included)."""
        return [type(e.op).__name__ for e in self.forward]

    def backward_op_types(self) -> list[str]:
        """Class names of the ops the backward runs, in the order they run."""
        return [type(e.op).__name__ for e in self.backward]

    def __str__(self) -> str:
        lines = [
            f"fusion plan: {len(self.op_names)} ops, dtype={self.dtype}, device={self.device}, "
            f"requires_grad={self.requires_grad}, fusion={'on' if self.fusion_enabled else 'off'}"
        ]
        first = self.first_index
        lines.append("  ops: " + ", ".join(f"{first + i}:{n}" for i, n in enumerate(self.op_names)))
        lines.append("  forward : " + " -> ".join(e.describe(self.op_names, first) for e in self.forward))
        if self.requires_grad:
            lines.append(
                "  backward: " + " -> ".join(e.describe(self.op_names, first) for e in self.backward)
            )
        else:
            lines.append("  backward: (not needed: nothing requires grad)")
        if self.recipe is not None:
            lines.append(f"  recipe: {self.recipe!r}")
            lines.extend("    " + line for line in self.quantized_gemms())
        for decision in self.decisions:
            lines.append("  " + str(decision))
        return "\n".join(lines)


@dataclass
class SequentialPlan:
    """Plans of every group of a Sequential; a plain module is a group of its own."""

    groups: list[FusionPlan | str]

    @property
    def fusion_plans(self) -> list[FusionPlan]:
        """The plans of the fuser groups (plain modules left out)."""
        return [g for g in self.groups if isinstance(g, FusionPlan)]

    @property
    def decisions(self) -> list[FusionDecision]:
        """Every fusion decision of every group, in order."""
        return [d for plan in self.fusion_plans for d in plan.decisions]

    def __str__(self) -> str:
        parts = []
        for i, group in enumerate(self.groups):
            if isinstance(group, FusionPlan):
                parts.append(f"group {i}: " + str(group))
            else:
                parts.append(f"group {i}: plain module {group}")
        return "\n".join(parts)
