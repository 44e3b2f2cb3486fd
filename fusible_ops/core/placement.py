"""Where experts live: which of the global experts one rank's expert block holds."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ExpertPlacement:
    """Which of ``num_global`` experts a rank holds: ``num_local`` of them from ``first``.

    Args:
        first: global index of the first expert held here.
        num_local: how many consecutive experts are held here.
        num_global: experts in the whole layer.
    """

    first: int
    num_local: int
    num_global: int

    @property
    def global_ids(self) -> range:
        """The global expert indices held here."""
        return range(self.first, self.first + self.num_local)
