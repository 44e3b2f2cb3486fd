"""Hugging Face transformers: run a model's MoE experts on fusible-ops, sharing its parameters.

>>> import fusible_ops.integrations.transformers  # registers "fusible_ops"
>>> model.set_experts_implementation("fusible_ops")  # or from_pretrained(..., experts_implementation=...)

Every experts module decorated with transformers' ``@use_experts_implementation`` then
runs as a fusible-ops expert block (``GroupedLinear -> activation -> GroupedLinear``,
fused into one ``GroupedMLP``) built once per module from the module's own parameters
(no copy: ``state_dict``, optimizers, ``save_pretrained`` and ``generate`` are unchanged)
and rebuilt when they, the activation or the flags it was built from change. What it
cannot run exactly falls back to transformers' ``grouped_mm`` implementation (``eager``
for dtypes ``grouped_mm`` cannot run) with one warning per module class.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn

from .. import fused as _fused  # noqa: F401  (registers the built-in fusion rules)
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
    key: tuple  # what the ops were built from, see _key
    tensors: tuple  # the projections the ops hold (the module's own Parameters), or () on meta
    ops: Sequential | None  # None: the module falls back, for ``reason``
    scale_after_fc2: bool
    fallback: Callable | None = None
    reason: str | None = None


#: the instance attribute holding an experts module's _Built. On the instance (outside the
#: module tree and state_dict), so a compiled frame reaches it through its own module, not
#: through a position in a table other modules change
_STATE = "_fusible_ops_experts"
#: functional_call's names for the projections, in _projections' order
_OP_PARAMETERS = ("0.weight", "0.bias", "2.weight", "2.bias")
#: dtypes transformers' grouped_mm kernels run; other dtypes fall back to its eager forward
_GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_WARNED: set[tuple[type, str]] = set()


def _projections(module: nn.Module) -> tuple[torch.Tensor | None, ...]:
    """fc1's weight and bias, fc2's weight and bias, as the module's forward reads them now."""
    if module.has_gate:
        fc1, fc1_bias = module.gate_up_proj, ("gate_up_proj_bias" if module.has_bias else None)
    else:
        fc1, fc1_bias = module.up_proj, ("up_proj_bias" if module.has_bias else None)
    if fc1_bias is None:
        return fc1, None, module.down_proj, None
    return fc1, getattr(module, fc1_bias), module.down_proj, module.down_proj_bias


def _key(module: nn.Module, tensors: tuple) -> tuple:
    """Everything the built ops depend on besides the projections' identity.

    Read per call (cheap: dict lookups), so that replacing ``act_fn``, GPT-OSS's
    ``limit``/``alpha``, an instance ``_apply_gate`` or a flag rebuilds the ops.
    """
    state = module.__dict__
    return (
        type(module),
        module._modules.get("act_fn", state.get("act_fn")),
        state.get("_apply_gate"),
        getattr(type(module), "_apply_gate", None),
        state.get("limit"),
        state.get("alpha"),
        state.get("has_gate"),
        state.get("has_bias"),
        state.get("is_transposed"),
        state.get("has_post_expert_norm"),
        # a CPU tensor's device as "cpu": t.device builds a device object on every call
        *[None if t is None else (t.dtype, "cpu" if t.is_cpu else t.device, t.shape) for t in tensors],
    )


def _activation(module: nn.Module, scaled: bool) -> nn.Module | str:
    """The activation op that computes the module's gate/activation exactly, or why none does."""
    if not module.has_gate:
        if type(getattr(module, "act_fn", None)).__name__ == "ReLUSquaredActivation":
            return (ScaledSReLU if scaled else SReLU)()
        return f"no fused activation for a non-gated {type(module.act_fn).__name__}"
    apply_gate = _apply_gate_function(module)
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


def _apply_gate_function(module: nn.Module) -> object:
    """The function ``module._apply_gate`` runs: its class's, or what the instance set."""
    override = module.__dict__.get("_apply_gate")
    if override is None:
        return getattr(type(module), "_apply_gate", None)
    # a known gate bound to this very module computes the same; anything else is unknown
    return override.__func__ if getattr(override, "__self__", None) is module else override


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
    params = [t for t in _projections(module) if t is not None]
    if len(params) < 2:
        return "expert projections not found (gate_up_proj/up_proj and down_proj)"
    dtype = params[0].dtype
    if dtype not in _DTYPES or any(t.dtype != dtype for t in params):
        return f"unsupported or mixed parameter dtypes {sorted({str(t.dtype) for t in params})}"
    act = _activation(module, scaled=False)
    return act if isinstance(act, str) else None


def _build(module: nn.Module, tensors: tuple, share: bool) -> Sequential:
    """The expert block computing ``module``; ``share``: it holds ``tensors`` (Parameters), else meta."""
    w1, b1, w2, b2 = tensors
    layout = "in_out" if module.is_transposed else "out_in"
    num_experts = w1.shape[0]
    fc1_in, fc1_out = (w1.shape[1], w1.shape[2]) if module.is_transposed else (w1.shape[2], w1.shape[1])
    fc2_in, fc2_out = (w2.shape[1], w2.shape[2]) if module.is_transposed else (w2.shape[2], w2.shape[1])
    fc1, fc2 = (
        GroupedLinear(
            num_experts, k, n, bias=b is not None, weight_layout=layout, device="meta", dtype=w.dtype
        )
        for k, n, w, b in ((fc1_in, fc1_out, w1, b1), (fc2_in, fc2_out, w2, b2))
    )
    if share:
        for op, weight, bias in ((fc1, w1, b1), (fc2, w2, b2)):
            op.weight = weight  # the module's own Parameter: shared, not copied
            if bias is not None:
                op.bias = bias
    # HF applies the routing weight after fc2 and its bias; without biases it commutes
    # with fc2, so the probability-scaled activation (fewer passes) gives the same result
    scale_after_fc2 = b2 is not None
    act = _activation(module, scaled=not scale_after_fc2)
    return Sequential(fc1, act, fc2, *([Scale()] if scale_after_fc2 else []))


def _eager_forward(
    module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """The module class's own (eager) forward, under ``use_experts_implementation``'s dispatch."""
    return inspect.unwrap(type(module).forward)(module, hidden_states, top_k_index, top_k_weights)


def _fallback(module: nn.Module, tensors: tuple, key: tuple, reason: str) -> _Built:
    """The state of a module that runs on transformers' code, warned about once per class."""
    dtypes = {t.dtype for t in tensors if t is not None}
    if dtypes and dtypes <= set(_GROUPED_MM_DTYPES):
        name, forward = "grouped_mm", _hf_moe.grouped_mm_experts_forward
    else:
        name, forward = "eager", _eager_forward
    if (type(module), name) not in _WARNED:
        _WARNED.add((type(module), name))
        warnings.warn(
            f"fusible_ops: {type(module).__name__} runs on transformers' {name} experts "
            f"implementation instead: {reason}",
            stacklevel=4,
        )
    return _Built(key, (), None, False, forward, reason)


def _resolve(module: nn.Module) -> tuple[_Built, tuple | None]:
    """``module``'s state, (re)built when missing or stale, and the projections to call it with.

    Returns ``(built, None)`` when the ops hold the module's projections themselves, and
    ``(built, tensors)`` when the module's projections are other tensors than Parameters
    (``torch.func.functional_call``, ``torch.nn.utils.parametrize``): those are passed
    to the ops per call. Replaced Parameters (loading, assignment) rebuild the ops.
    """
    tensors = _projections(module)
    key = _key(module, tensors)
    built = module.__dict__.get(_STATE)
    if built is not None and built.key == key:
        held = built.tensors
        if built.ops is None or (
            held
            and held[0] is tensors[0]
            and held[1] is tensors[1]
            and held[2] is tensors[2]
            and held[3] is tensors[3]
        ):
            return built, None
        if not all(t is None or isinstance(t, nn.Parameter) for t in tensors):
            return built, tensors
    reason = unsupported_reason(module)
    if reason is not None:
        built = _fallback(module, tensors, key, reason)
    else:
        share = all(t is None or isinstance(t, nn.Parameter) for t in tensors)
        ops = _build(module, tensors, share)
        built = _Built(key, tensors if share else (), ops, tensors[3] is not None)
    module.__dict__[_STATE] = built
    return built, (None if built.tensors or built.ops is None else tensors)


def prepare(model: nn.Module) -> int:
    """Build the ops of every experts module in ``model`` now; returns how many run on fusible-ops.

    The first call of an experts module builds its ops, which creates modules: under
    ``torch.compile`` that is a graph break. Call this once before compiling (after
    loading) and the compiled model traces the experts as one graph with the rest.
    """
    count = 0
    for module in model.modules():
        if hasattr(module, "has_gate") and hasattr(module, "down_proj"):
            count += _resolve(module)[0].ops is not None
    return count


def cached_ops(module: nn.Module) -> Sequential | None:
    """The fusible-ops Sequential that runs ``module`` (built on its first call), or None.

    Its projections are the module's own Parameters; on the meta device while the module's
    projections are not Parameters (``parametrize``), which are then passed per call.
    """
    built = module.__dict__.get(_STATE)
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
    return _build(module, _projections(module), share=True)


def to_hf_experts(experts: nn.Module, module: nn.Module) -> None:
    """Copy a fusible-ops experts Sequential's (or ``fo.MoE``'s) weights into the HF ``module``."""
    load_stacked(from_hf_experts(module), **export_stacked(experts))


def experts_forward(
    self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """The registered experts implementation: ``[T, H]`` tokens, ``[T, k]`` expert ids and weights."""
    built, tensors = _resolve(self)
    if built.ops is None:
        return built.fallback(self, hidden_states, top_k_index, top_k_weights)
    num_tokens = hidden_states.shape[0]
    # ids >= num_experts (transformers' expert-parallel sentinel) are dropped rows
    perm = permute(hidden_states, top_k_index, self.num_experts, top_k_weights)
    probs, splits = perm.probs, perm.split_sizes
    args = (perm.rows, splits, splits, probs) if built.scale_after_fc2 else (perm.rows, splits, probs, splits)
    if tensors is None:
        y = built.ops(*args)
    else:
        params = {name: t for name, t in zip(_OP_PARAMETERS, tensors) if t is not None}
        y = torch.func.functional_call(built.ops, params, args)
    return unpermute(y, perm.token_index, num_tokens).to(hidden_states.dtype)


def register(name: str = NAME) -> None:
    """Add the fusible-ops experts implementation to transformers' ``ExpertsInterface``."""
    _hf_moe.ExpertsInterface.register(name, experts_forward)


register()
