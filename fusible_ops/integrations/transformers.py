"""Hugging Face transformers: run a model's MoE experts on fusible-ops, sharing its parameters.

>>> import fusible_ops.integrations.transformers  # registers "fusible_ops"
>>> model.set_experts_implementation("fusible_ops")  # or from_pretrained(..., experts_implementation=...)

Every experts module decorated with transformers' ``@use_experts_implementation`` then
runs as a fusible-ops expert block (``GroupedLinear -> activation -> GroupedLinear``,
fused into one ``GroupedMLP``) built once per module from the module's own parameters
(no copy: ``state_dict``, optimizers, ``save_pretrained`` and ``generate`` are unchanged)
and rebuilt when they are replaced. What it cannot run exactly falls back to
transformers' ``grouped_mm`` implementation with one warning per module class.
"""

from __future__ import annotations

import warnings
import weakref
from typing import NamedTuple

import torch
from torch import nn

from ..basic.activations import GEGLU, ClampedSwiGLU, SReLU, SwiGLU
from ..basic.grouped_linear import GroupedLinear
from ..basic.scale import Scale
from ..basic.scaled_activations import ScaledClampedSwiGLU, ScaledGEGLU, ScaledSReLU, ScaledSwiGLU
from ..fuser.sequential import Sequential
from ..moe.checkpoint import export_stacked, load_stacked
from ..moe.routing import permute, unpermute

#: the transformers versions this integration is tested with (ExpertsInterface and the
#: experts flags of ``use_experts_implementation``)
SUPPORTED_VERSIONS = ((5, 24), (6, 0))
NAME = "fusible_ops"
_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def _check_version() -> None:
    import transformers

    release = tuple(int(part) for part in transformers.__version__.split(".")[:2] if part.isdigit())
    low, high = SUPPORTED_VERSIONS
    if not low <= release < high:
        raise ImportError(
            f"fusible_ops.integrations.transformers supports transformers >= {low[0]}.{low[1]}, "
            f"< {high[0]}.{high[1]}; found {transformers.__version__}"
        )


_check_version()

from transformers.integrations import moe as _hf_moe  # noqa: E402


class _Built(NamedTuple):
    key: tuple
    ops: Sequential | None  # None: the module falls back, for ``reason``
    scale_after_fc2: bool
    reason: str | None = None


#: experts module -> its fusible-ops ops (kept out of the module tree)
_OPS: weakref.WeakKeyDictionary[nn.Module, _Built] = weakref.WeakKeyDictionary()
_WARNED: set[type] = set()


def _projections(module: nn.Module) -> list[tuple[str, torch.Tensor | None]]:
    first = "gate_up_proj" if module.has_gate else "up_proj"
    names = (first, f"{first}_bias", "down_proj", "down_proj_bias")
    return [
        (name, getattr(module, name, None) if module.has_bias or "bias" not in name else None)
        for name in names
    ]


def _activation(module: nn.Module, scaled: bool) -> nn.Module | str:
    """The activation op that computes the module's gate/activation exactly, or why none does."""
    if not module.has_gate:
        if type(getattr(module, "act_fn", None)).__name__ == "ReLUSquaredActivation":
            return (ScaledSReLU if scaled else SReLU)()
        return f"no fused activation for a non-gated {type(module.act_fn).__name__}"
    apply_gate = getattr(type(module), "_apply_gate", None)
    if apply_gate is _hf_moe._default_apply_gate:
        kind = type(getattr(module, "act_fn", None)).__name__
        if kind in ("SiLUActivation", "SiLU"):
            return (ScaledSwiGLU if scaled else SwiGLU)()
        if kind in ("GELUTanh", "NewGELUActivation", "PytorchGELUTanh"):
            return (ScaledGEGLU if scaled else GEGLU)()
        return f"no fused gated activation for act_fn {kind}"
    if _is_gpt_oss_gate(apply_gate):
        options = {"limit": float(module.limit), "alpha": float(module.alpha), "glu_interleave_size": 1}
        return (ScaledClampedSwiGLU if scaled else ClampedSwiGLU)(**options)
    return f"unknown _apply_gate override {getattr(apply_gate, '__qualname__', apply_gate)}"


def _is_gpt_oss_gate(apply_gate: object) -> bool:
    try:
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
    except ImportError:
        return False
    return apply_gate is GptOssExperts._apply_gate


def unsupported_reason(module: nn.Module) -> str | None:
    """Why ``module`` cannot run on fusible-ops exactly, or None."""
    if getattr(module, "has_post_expert_norm", False):
        return "a post-expert norm (has_post_expert_norm=True)"
    params = [t for _, t in _projections(module) if t is not None]
    if len(params) < 2:
        return "expert projections not found (gate_up_proj/up_proj and down_proj)"
    dtype = params[0].dtype
    if dtype not in _DTYPES or any(t.dtype != dtype for t in params):
        return f"unsupported or mixed parameter dtypes {sorted({str(t.dtype) for t in params})}"
    act = _activation(module, scaled=False)
    return act if isinstance(act, str) else None


def _build(module: nn.Module) -> _Built:
    (fc1_name, w1), (_, b1), (_, w2), (_, b2) = _projections(module)
    layout = "in_out" if module.is_transposed else "out_in"
    num_experts = w1.shape[0]
    fc1_in, fc1_out = (w1.shape[1], w1.shape[2]) if module.is_transposed else (w1.shape[2], w1.shape[1])
    fc2_in, fc2_out = (w2.shape[1], w2.shape[2]) if module.is_transposed else (w2.shape[2], w2.shape[1])
    # HF applies the routing weight after fc2 and its bias; without biases it commutes
    # with fc2, so the probability-scaled activation (fewer passes) gives the same result
    scale_after_fc2 = b2 is not None
    fc1, fc2 = (
        GroupedLinear(
            num_experts, k, n, bias=b is not None, weight_layout=layout, device="meta", dtype=w.dtype
        )
        for k, n, w, b in ((fc1_in, fc1_out, w1, b1), (fc2_in, fc2_out, w2, b2))
    )
    for op, weight, bias in ((fc1, w1, b1), (fc2, w2, b2)):
        op.weight = weight  # the module's own Parameter: shared, not copied
        if bias is not None:
            op.bias = bias
    act = _activation(module, scaled=not scale_after_fc2)
    ops = Sequential(fc1, act, fc2, *([Scale()] if scale_after_fc2 else []))
    return _Built(_key(module), ops, scale_after_fc2)


def _key(module: nn.Module) -> tuple:
    return tuple(
        None if t is None else (id(t), t.dtype, t.device, tuple(t.shape)) for _, t in _projections(module)
    )


def prepare(model: nn.Module) -> int:
    """Build the ops of every experts module in ``model`` now; returns how many run on fusible-ops.

    The first call of an experts module builds its ops, which creates modules: under
    ``torch.compile`` that is a graph break. Call this once before compiling (after
    loading) and the compiled model traces the experts as one graph with the rest.
    """
    count = 0
    for module in model.modules():
        if hasattr(module, "has_gate") and hasattr(module, "down_proj"):
            built = _ops_for(module)
            count += built.ops is not None
    return count


def _ops_for(module: nn.Module) -> _Built:
    """The cached ops of ``module``, built (or the fallback reason found) when missing or stale."""
    built = _OPS.get(module)
    if built is None or built.key != _key(module):  # first call, or parameters replaced
        reason = unsupported_reason(module)
        built = _OPS[module] = _build(module) if reason is None else _Built(_key(module), None, False, reason)
    return built


def cached_ops(module: nn.Module) -> Sequential | None:
    """The fusible-ops Sequential that runs ``module`` (built on its first call), or None."""
    built = _OPS.get(module)
    return None if built is None else built.ops


def from_hf_experts(module: nn.Module) -> Sequential:
    """A fusible-ops experts Sequential computing ``module``, sharing its parameters.

    Its inputs, in op order: the expert-sorted rows, split sizes, then (3 ops) the
    routing weights and split sizes, or (4 ops, ``... -> Scale`` for biased experts)
    split sizes and the routing weights. ``ValueError`` if ``module`` cannot run exactly.
    """
    reason = unsupported_reason(module)
    if reason is not None:
        raise ValueError(f"from_hf_experts: {type(module).__name__} cannot run on fusible-ops: {reason}")
    return _build(module).ops


def to_hf_experts(experts: nn.Module, module: nn.Module) -> None:
    """Copy a fusible-ops experts Sequential's (or ``fo.MoE``'s) weights into the HF ``module``."""
    load_stacked(from_hf_experts(module), **export_stacked(experts))


def experts_forward(
    self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """The registered experts implementation: ``[T, H]`` tokens, ``[T, k]`` expert ids and weights."""
    built = _ops_for(self)
    if built.ops is None:
        if type(self) not in _WARNED:
            _WARNED.add(type(self))
            warnings.warn(
                f"fusible_ops: {type(self).__name__} runs on transformers' grouped_mm experts "
                f"implementation instead: {built.reason}",
                stacklevel=2,
            )
        return _hf_moe.grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    num_tokens = hidden_states.shape[0]
    # ids >= num_experts (transformers' expert-parallel sentinel) are dropped rows
    perm = permute(hidden_states, top_k_index, self.num_experts, top_k_weights)
    probs, splits = perm.probs, perm.split_sizes
    args = (splits, splits, probs) if built.scale_after_fc2 else (splits, probs, splits)
    y = built.ops(perm.rows, *args)
    return unpermute(y, perm.token_index, num_tokens).to(hidden_states.dtype)


def register(name: str = NAME) -> None:
    """Add the fusible-ops experts implementation to transformers' ``ExpertsInterface``."""
    _hf_moe.ExpertsInterface.register(name, experts_forward)


register()
