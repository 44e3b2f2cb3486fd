"""fusible-ops: composable basic operations and an operation fuser for PyTorch.

>>> import fusible_ops as fo
>>> experts = fo.Sequential(fo.GroupedLinear(4, 64, 128), fo.ScaledSwiGLU(), fo.GroupedLinear(4, 64, 64))

Public names load on first use (PEP 562): ``import fusible_ops`` alone imports neither
torch nor any op, so ``python -m fusible_ops --help`` answers at once. The built-in
fusion rules register when the first fuser is built (``fusible_ops.fuser.rules.load_builtin_rules``),
whichever module it was reached through.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

# torch-free, and bound here: the function ``settings`` must shadow the submodule of that
# name, whichever module imports the submodule first
from .core.settings import Settings, current_settings, settings

__version__ = "0.1.0"

_BASIC_OPS = (
    "GEGLU", "GELU", "AddExtraInput", "BasicLinear", "Bias", "ClampedSwiGLU", "ConstantScale",
    "Dropout", "GroupedGateUpLinear", "GroupedLinear", "Identity", "LayerNorm", "MakeExtraOutput", "RMSNorm", "ReGLU",
    "ReLU", "Reshape", "SReLU", "Scale", "ScaledClampedSwiGLU", "ScaledGEGLU", "ScaledSReLU",
    "ScaledSwiGLU", "SiLU", "SwiGLU",
)  # fmt: skip

#: public name -> the module that defines it (relative to this package)
_EXPORTS: dict[str, str] = {
    **dict.fromkeys(_BASIC_OPS, ".basic"),
    "GRAD_INPUT_BUFFER_KEY": ".core.buffers",
    "OUTPUT_BUFFER_KEY": ".core.buffers",
    "QUANTIZED_INPUT_KEY": ".recipes.quantize",
    "validate_or_alloc_output": ".core.buffers",
    "BackendUnavailableError": ".kernels",
    "BasicOperation": ".core.op",
    "FusedBackward": ".core.op",
    "FusedForward": ".core.op",
    "FusedOperation": ".core.op",
    "FusibleOperation": ".core.op",
    "OpBackward": ".core.op",
    "OperationContext": ".core.op",
    "FusionContext": ".fuser.rules",
    "register_fusion": ".fuser.rules",
    "unregister_fusion": ".fuser.rules",
    "window_rule": ".fuser.rules",
    "FusionDecision": ".fuser.plan",
    "FusionPlan": ".fuser.plan",
    "SequentialPlan": ".fuser.plan",
    "GroupedMLP": ".fused",
    "Linear": ".basic.composites",
    "MoE": ".moe.layer",
    "OperationFuser": ".fuser.operation_fuser",
    "Sequential": ".fuser.sequential",
    "quantized": ".recipes",
    "sac_policy": ".kernels.sac",
}

#: the basic ops (``fusible_ops.basic``) minus their abstract bases, then the rest
__all__ = [
    *_BASIC_OPS,
    "GRAD_INPUT_BUFFER_KEY",
    "OUTPUT_BUFFER_KEY",
    "QUANTIZED_INPUT_KEY",
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
    "quantized",
    "register_fusion",
    "sac_policy",
    "settings",
    "unregister_fusion",
    "validate_or_alloc_output",
    "window_rule",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is not None:
        importlib.import_module(".fused", __name__)  # registers the built-in fusion rules
        value = getattr(importlib.import_module(module, __name__), name)
    elif not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        value = importlib.import_module(f".{name}", __name__)  # a subpackage, as after `import` of it
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
