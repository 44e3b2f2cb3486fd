"""Activation math in plain PyTorch: the reference *kernel* for every activation.

Ops decide which activation runs; this module says how it is computed with torch ops.
Other backends (Triton, cuDNN) implement the same :class:`ActivationSpec` contract.

Gated convention: the first half of the last dim is the gate, the second half the
linear part. With ``glu_interleave_size=k`` the last dim holds alternating blocks of
``k`` gate columns and ``k`` linear columns (k=1 is the GPT-OSS layout).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ActivationKind:
    """One row of the activation table that ops, rules, the MoE layer and backends read."""

    #: the ``ActivationSpec.kind`` string
    name: str
    #: splits the last dim into gate and linear halves (the output has half the width)
    gated: bool
    #: the math, for docs and messages (the reference is :func:`activation_forward`)
    math: str
    #: the fused GroupedMLP (and so ``fo.MoE``) runs it; others decline with a reason
    expert_block: bool
    #: backends whose grouped-MLP kernels apply it fused with the GEMMs (a GEMM epilogue,
    #: or cpu's cache-blocked pass per row block); others run it as a separate pass
    epilogue_backends: tuple[str, ...]


ACTIVATIONS: dict[str, ActivationKind] = {
    k.name: k
    for k in (
        ActivationKind("relu", False, "max(x, 0)", False, ("triton", "cpu")),
        ActivationKind("gelu", False, "gelu_tanh(x)", False, ("triton", "cpu")),
        ActivationKind("silu", False, "x * sigmoid(x)", False, ("triton", "cpu")),
        ActivationKind("srelu", False, "relu(x) ** 2", True, ("triton", "cpu")),
        ActivationKind("swiglu", True, "silu(gate) * linear", True, ("triton", "cudnn", "cpu")),
        ActivationKind("geglu", True, "gelu_tanh(gate) * linear", True, ("triton", "cpu")),
        ActivationKind("reglu", True, "relu(gate) * linear", False, ("triton", "cpu")),
        ActivationKind(
            "clamped_swiglu",
            True,
            "min(gate, limit) * sigmoid(alpha * min(gate, limit)) * (clamp(linear, -limit, limit) + offset)",
            True,
            ("triton", "cudnn", "cpu"),
        ),
    )
}
ACTIVATION_KINDS = tuple(ACTIVATIONS)
GATED_KINDS = tuple(k for k, row in ACTIVATIONS.items() if row.gated)
#: the activations of the fused expert block (GroupedMLP, fo.MoE)
EXPERT_BLOCK_KINDS = tuple(k for k, row in ACTIVATIONS.items() if row.expert_block)

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


@dataclass(frozen=True)
class ActivationSpec:
    """What an activation computes; hashable so it can key plans and caches."""

    kind: str
    limit: float = 7.0
    alpha: float = 1.702
    glu_linear_offset: float = 1.0
    glu_interleave_size: int | None = None

    def facts(self) -> tuple[str, float, float, float, int | None]:
        """Every field, as a tuple of literals."""
        return (self.kind, self.limit, self.alpha, self.glu_linear_offset, self.glu_interleave_size)

    def __post_init__(self) -> None:
        if self.kind not in ACTIVATION_KINDS:
            raise ValueError(f"unknown activation kind {self.kind!r}; expected one of {ACTIVATION_KINDS}")
        for name in ("limit", "alpha", "glu_linear_offset"):
            value = getattr(self, name)
            finite = name != "limit"  # limit=inf: no clamping
            if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
                raise ValueError(f"{self.kind}: {name} must be a number, got {value!r}")
            if finite and not math.isfinite(value):
                raise ValueError(f"{self.kind}: {name} must be finite, got {value!r}")
        if self.limit <= 0:
            raise ValueError(f"{self.kind}: limit must be positive, got {self.limit!r}")
        size = self.glu_interleave_size
        if size is not None and (isinstance(size, bool) or not isinstance(size, int)):
            raise ValueError(f"{self.kind}: glu_interleave_size must be a positive int or None, got {size!r}")
        if self.glu_interleave_size is not None:
            if not self.gated:
                raise ValueError(
                    f"glu_interleave_size is only valid for gated activations, not {self.kind!r}"
                )
            if int(self.glu_interleave_size) < 1:
                raise ValueError(
                    f"glu_interleave_size must be a positive int, got {self.glu_interleave_size}"
                )

    @property
    def gated(self) -> bool:
        return self.kind in GATED_KINDS

    def output_features(self, in_features: int) -> int:
        return in_features // 2 if self.gated else in_features

    def check_width(self, where: str, width: int) -> None:
        """A gated kind needs whole gate/linear blocks in the last dim; raises ``ValueError``."""
        if not self.gated:
            return
        block = 2 * (self.glu_interleave_size or 1)
        if width % block:
            what = "even" if block == 2 else f"a multiple of {block} (2 x glu_interleave_size)"
            raise ValueError(
                f"{where}: {self.kind} needs the last dim ({width}) to be {what} "
                "to split into gate and linear parts"
            )


# ---------------------------------------------------------------- gate/linear split


def split_gate_linear(pre: torch.Tensor, interleave: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of the gate and linear parts of ``pre`` ``[..., 2n]`` (each ``[..., n]``)."""
    n2 = pre.shape[-1]
    n = n2 // 2
    if interleave is None:
        return pre[..., :n], pre[..., n:]
    k = interleave
    blocks = pre.reshape(*pre.shape[:-1], n2 // (2 * k), 2, k)
    gate = blocks[..., 0, :].reshape(*pre.shape[:-1], n)
    linear = blocks[..., 1, :].reshape(*pre.shape[:-1], n)
    return gate, linear


def join_gate_linear(gate: torch.Tensor, linear: torch.Tensor, interleave: int | None) -> torch.Tensor:
    """Inverse of :func:`split_gate_linear`."""
    if interleave is None:
        return torch.cat([gate, linear], dim=-1)
    k = interleave
    n = gate.shape[-1]
    g = gate.reshape(*gate.shape[:-1], n // k, 1, k)
    l = linear.reshape(*linear.shape[:-1], n // k, 1, k)  # noqa: E741
    return torch.cat([g, l], dim=-2).reshape(*gate.shape[:-1], 2 * n)


# ---------------------------------------------------------------- pointwise pieces


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.gelu(x, approximate="tanh")


def _gelu_tanh_grad(x: torch.Tensor) -> torch.Tensor:
    inner = _SQRT_2_OVER_PI * (x + 0.044715 * x * x * x)
    t = torch.tanh(inner)
    dinner = _SQRT_2_OVER_PI * (1.0 + 3.0 * 0.044715 * x * x)
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * dinner


def _silu_grad(x: torch.Tensor) -> torch.Tensor:
    s = torch.sigmoid(x)
    return s * (1.0 + x * (1.0 - s))


def _unary_forward(kind: str, x: torch.Tensor) -> torch.Tensor:
    if kind == "relu":
        return torch.relu(x)
    if kind == "gelu":
        return _gelu_tanh(x)
    if kind == "silu":
        return torch.nn.functional.silu(x)
    if kind == "srelu":
        r = torch.relu(x)
        return r * r
    raise AssertionError(kind)


def _unary_grad(kind: str, x: torch.Tensor) -> torch.Tensor:
    if kind == "relu":
        return (x > 0).to(x.dtype)
    if kind == "gelu":
        return _gelu_tanh_grad(x)
    if kind == "silu":
        return _silu_grad(x)
    if kind == "srelu":
        return 2.0 * torch.relu(x)
    raise AssertionError(kind)


_GATE_FN = {"swiglu": "silu", "geglu": "gelu", "reglu": "relu"}


def activation_forward(spec: ActivationSpec, pre: torch.Tensor) -> torch.Tensor:
    """``act(pre)``; gated kinds halve the last dim. Computed in ``pre``'s dtype."""
    if not spec.gated:
        return _unary_forward(spec.kind, pre)
    return gated_forward(spec, *split_gate_linear(pre, spec.glu_interleave_size))


def gated_forward(spec: ActivationSpec, gate: torch.Tensor, linear: torch.Tensor) -> torch.Tensor:
    """A gated activation of its two halves (``[M, F]`` each), e.g. ``silu(gate) * linear``."""
    if spec.kind == "clamped_swiglu":
        g = gate.clamp(max=spec.limit)
        lin = linear.clamp(-spec.limit, spec.limit)
        return g * torch.sigmoid(spec.alpha * g) * (lin + spec.glu_linear_offset)
    return _unary_forward(_GATE_FN[spec.kind], gate) * linear


def activation_backward(spec: ActivationSpec, pre: torch.Tensor, grad_act: torch.Tensor) -> torch.Tensor:
    """Gradient w.r.t. ``pre`` given the gradient w.r.t. ``activation_forward(spec, pre)``."""
    if not spec.gated:
        return grad_act * _unary_grad(spec.kind, pre)
    gate, linear = split_gate_linear(pre, spec.glu_interleave_size)
    grad_gate, grad_linear = gated_backward(spec, gate, linear, grad_act)
    return join_gate_linear(grad_gate, grad_linear, spec.glu_interleave_size)


def gated_backward(
    spec: ActivationSpec, gate: torch.Tensor, linear: torch.Tensor, grad_act: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(grad_gate, grad_linear)`` given the gradient w.r.t. ``gated_forward(spec, gate, linear)``."""
    if spec.kind == "clamped_swiglu":
        g = gate.clamp(max=spec.limit)
        lin = linear.clamp(-spec.limit, spec.limit)
        sig = torch.sigmoid(spec.alpha * g)
        glu = g * sig
        dglu = sig * (1.0 + spec.alpha * g * (1.0 - sig))
        grad_gate = grad_act * (lin + spec.glu_linear_offset) * dglu * (gate <= spec.limit)
        grad_linear = grad_act * glu * ((linear >= -spec.limit) & (linear <= spec.limit))
        return grad_gate, grad_linear
    fn = _GATE_FN[spec.kind]
    return grad_act * linear * _unary_grad(fn, gate), grad_act * _unary_forward(fn, gate)


def scaled_activation_forward(spec: ActivationSpec, pre: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``act(pre) * scales[:, None]`` in ``pre``'s dtype (scales may be fp32)."""
    act = activation_forward(spec, pre)
    return act * scales.to(act.dtype).unsqueeze(-1)


def scaled_activation_backward(
    spec: ActivationSpec, pre: torch.Tensor, scales: torch.Tensor, grad_out: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(grad_pre, grad_scales)``; ``grad_scales`` has ``scales``' dtype."""
    act = activation_forward(spec, pre)
    grad_scales = row_dot(act, grad_out, scales.dtype)
    grad_act = grad_out * scales.to(grad_out.dtype).unsqueeze(-1)
    return activation_backward(spec, pre, grad_act), grad_scales


def row_dot(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``sum(a * b, -1)`` accumulated in at least fp32 (fp64 stays fp64), cast to ``out_dtype``."""
    acc = torch.promote_types(torch.promote_types(a.dtype, b.dtype), torch.float32)
    return (a.to(acc) * b.to(acc)).sum(-1).to(out_dtype)
