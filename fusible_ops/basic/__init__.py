"""Basic operations: each owns its parameters and says what it computes and saves.

One op (or one small family) per file, plus composites such as :class:`Linear` built as a
``Sequential`` of basic ops. Ops decide what is computed and saved for backward and ask
``kernels`` how; they import ``core``, ``fuser`` and ``kernels``, never ``fused`` or the
layers above.
"""

from __future__ import annotations

from .activations import GEGLU, GELU, Activation, ClampedSwiGLU, ReGLU, ReLU, SiLU, SReLU, SwiGLU
from .dropout import Dropout
from .extra_io import AddExtraInput, MakeExtraOutput
from .grouped_gate_up import GroupedGateUpLinear
from .grouped_linear import GroupedLinear
from .linear import BasicLinear, Bias
from .norms import LayerNorm, RMSNorm
from .scale import ConstantScale, Scale
from .scaled_activations import (
    ScaledActivation,
    ScaledClampedSwiGLU,
    ScaledGEGLU,
    ScaledSReLU,
    ScaledSwiGLU,
)
from .shape import Identity, Reshape

__all__ = [
    "GEGLU",
    "GELU",
    "Activation",
    "AddExtraInput",
    "BasicLinear",
    "Bias",
    "ClampedSwiGLU",
    "ConstantScale",
    "Dropout",
    "GroupedGateUpLinear",
    "GroupedLinear",
    "Identity",
    "LayerNorm",
    "MakeExtraOutput",
    "RMSNorm",
    "ReGLU",
    "ReLU",
    "Reshape",
    "SReLU",
    "Scale",
    "ScaledActivation",
    "ScaledClampedSwiGLU",
    "ScaledGEGLU",
    "ScaledSReLU",
    "ScaledSwiGLU",
    "SiLU",
    "SwiGLU",
]
