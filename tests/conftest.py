"""Shared test set-up: a fixed seed per test (kept minimal on purpose).

Without a GPU, Triton's kernels can only run in its interpreter, and Triton reads
``TRITON_INTERPRET`` once, when it is first imported: set it before any test imports
triton so the Triton backend's tests run in-process (our library never reads it at import).
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

if not torch.cuda.is_available() and importlib.util.find_spec("triton") is not None:
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
