# ruff: noqa: F401  (re-exports: __all__ extends the basic ops' own __all__)
"""fusible-ops: composable basic operations and an operation fuser for PyTorch.

>>> import fusible_ops as fo
>>> experts = fo.Sequential(fo.GroupedLinear(4, 64, 128), fo.ScaledSwiGLU(), fo.GroupedLinear(4, 64, 64))
"""

from __future__ import annotations

from . import basic as _basic
from . import fused as _fused  # noqa: F401  (registers the built-in fusion rules)
from .basic import (
    GEGLU,
    GELU,
    AddExtraInput,
    BasicLinear,
    Bias,
    ClampedSwiGLU,
    ConstantScale,
    Dropout,
    GroupedLinear,
    Identity,
    LayerNorm,
    MakeExtraOutput,
    ReGLU,
    ReLU,
    Reshape,
    RMSNorm,
    Scale,
    ScaledClampedSwiGLU,
    ScaledGEGLU,
    ScaledSReLU,
    ScaledSwiGLU,
    SiLU,
    SReLU,
    SwiGLU,
)
from .basic.composites import Linear
from .core.buffers import GRAD_INPUT_BUFFER_KEY, OUTPUT_BUFFER_KEY, validate_or_alloc_output
from .core.op import (
    BasicOperation,
    FusedBackward,
    FusedForward,
    FusedOperation,
    FusibleOperation,
    OpBackward,
    OperationContext,
)
from .core.settings import Settings, current_settings, settings
from .fused import GroupedMLP
from .fuser.operation_fuser import OperationFuser
from .fuser.plan import FusionDecision, FusionPlan, SequentialPlan
from .fuser.rules import FusionContext, register_fusion, unregister_fusion, window_rule
from .fuser.sequential import Sequential
from .kernels import BackendUnavailableError
from .moe.layer import MoE

__version__ = "0.1.0"

#: the basic ops (``fusible_ops.basic``) minus their abstract bases, then the rest
__all__ = [
    *(name for name in _basic.__all__ if name not in ("Activation", "ScaledActivation")),
    "GRAD_INPUT_BUFFER_KEY",
    "OUTPUT_BUFFER_KEY",
    "BackendUnavailableError",
    "BasicOperation",
    "FusedBackward",
    "FusedForward",
    "FusedOperation",
    "FusibleOperation",
    "FusionContext",
    "FusionDecision",
    "FusionPlan",
    "GroupedMLP",
    "Linear",
    "MoE",
    "OpBackward",
    "OperationContext",
    "OperationFuser",
    "Sequential",
    "SequentialPlan",
    "Settings",
    "current_settings",
    "register_fusion",
    "settings",
    "unregister_fusion",
    "validate_or_alloc_output",
    "window_rule",
]
