"""Shared test set-up: a fixed seed per test (kept minimal on purpose)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
