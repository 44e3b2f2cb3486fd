"""Independent plain-PyTorch references for the basic ops, written from the formulas.

Nothing here imports ``fusible_ops``: gradients come from autograd on these formulas.
Gated ops pick gate/linear columns by index arithmetic (not by reshaping), so a wrong
split in the library shows up as an O(1) mismatch.
"""

from __future__ import annotations

import math

import torch

GELU_C = math.sqrt(2.0 / math.pi)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.tanh(GELU_C * (x + 0.044715 * x**3)))


def silu(x: torch.Tensor) -> torch.Tensor:
    return x / (1.0 + torch.exp(-x))


UNARY = {
    "relu": lambda x: torch.where(x > 0, x, torch.zeros_like(x)),
    "gelu": gelu_tanh,
    "silu": silu,
    "srelu": lambda x: torch.where(x > 0, x * x, torch.zeros_like(x)),
}


def gate_linear_columns(width: int, interleave: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Column indices of the gate and linear parts of a ``[..., width]`` GLU input."""
    cols = torch.arange(width)
    if interleave is None:
        is_gate = cols < width // 2
    else:
        is_gate = (cols // interleave) % 2 == 0
    return cols[is_gate], cols[~is_gate]


def clamp_inclusive(x: torch.Tensor, low: float | None, high: float) -> torch.Tensor:
    """``x`` limited to ``[low, high]``; the gradient passes where ``x`` equals a bound (as ``torch.clamp``'s)."""
    bound = torch.full_like(x, high)
    x = torch.where(x > high, bound, x)
    return x if low is None else torch.where(x < low, torch.full_like(x, low), x)


def clamped_swiglu(gate, linear, limit=7.0, alpha=1.702, offset=1.0):
    g = clamp_inclusive(gate, None, limit)
    l = clamp_inclusive(linear, -limit, limit)  # noqa: E741
    return g * torch.sigmoid(alpha * g) * (l + offset)


def activation(kind: str, x: torch.Tensor, interleave: int | None = None, **options: float) -> torch.Tensor:
    """Reference of every activation kind; gated kinds halve the last dim."""
    if kind in UNARY:
        return UNARY[kind](x)
    gate_cols, linear_cols = gate_linear_columns(x.shape[-1], interleave)
    gate, linear = x[..., gate_cols], x[..., linear_cols]
    if kind == "clamped_swiglu":
        return clamped_swiglu(gate, linear, **options)
    gate_fn = {"swiglu": silu, "geglu": gelu_tanh, "reglu": UNARY["relu"]}[kind]
    return gate_fn(gate) * linear


def grouped_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, split_sizes
) -> torch.Tensor:
    """``x`` ``[..., K]``, ``weight`` ``[G, N, K]``: each row times its group's weight (no loop)."""
    sizes = torch.as_tensor(list(split_sizes) if not isinstance(split_sizes, torch.Tensor) else split_sizes)
    device = weight.device
    group_of_row = torch.repeat_interleave(
        torch.arange(weight.shape[0], device=device), sizes.to(device, torch.int64)
    )
    x2d = x.reshape(-1, x.shape[-1])
    y = torch.einsum("rk,rnk->rn", x2d, weight[group_of_row])
    if bias is not None:
        y = y + bias[group_of_row]
    return y.reshape(*x.shape[:-1], weight.shape[1])


def grouped_fprop(x, weight, split_sizes, bias=None, *, pad_rows: bool = False) -> torch.Tensor:
    """float64 ``y`` over the rows the groups own; rows past the last group are left out,
    or with ``pad_rows`` given as zeros (``y`` then has ``x``'s rows)."""
    rows = int(sum(split_sizes))
    y = grouped_linear(
        x[:rows].double(), weight.double(), None if bias is None else bias.double(), split_sizes
    )
    if pad_rows:
        y = torch.cat([y, y.new_zeros(x.shape[0] - rows, y.shape[1])])
    return y


def grouped_dgrad(grad_out, weight, split_sizes) -> torch.Tensor:
    """float64 ``dx = grad_out[rows_g] @ weight[g]`` over the owned rows."""
    return grouped_fprop(grad_out, weight.transpose(1, 2), split_sizes)


def grouped_wgrad(grad_out, x, split_sizes) -> torch.Tensor:
    """float64 ``dw[g] = grad_out[rows_g].T @ x[rows_g]`` (zero for an empty group)."""
    gid = group_ids_of(split_sizes)
    onehot = torch.nn.functional.one_hot(gid, len(split_sizes)).double()
    rows = gid.numel()
    return torch.einsum("mg,mn,mk->gnk", onehot, grad_out[:rows].double(), x[:rows].double())


def grouped_bias_grad(grad_out, split_sizes) -> torch.Tensor:
    """float64 ``db[g] = sum of grad_out[rows_g]``."""
    gid = group_ids_of(split_sizes)
    return torch.nn.functional.one_hot(gid, len(split_sizes)).double().t() @ grad_out[: gid.numel()].double()


def leaf(t: torch.Tensor, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """A float64 (by default) leaf copy of ``t`` that requires grad."""
    return t.detach().to(dtype).requires_grad_(True)


def max_rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest absolute error relative to the largest reference magnitude."""
    expected = expected.to(torch.float64)
    scale = expected.abs().max().item() if expected.numel() else 1.0
    return (
        (actual.to(torch.float64) - expected).abs().max().item() / max(scale, 1e-12)
        if expected.numel()
        else 0.0
    )


def expert_block(x, fc1_weight, probs, fc2_weight, split_sizes, kind="swiglu", fc1_bias=None, fc2_bias=None):
    """fc1 -> act * probs -> fc2, the MoE expert block, from the pieces above."""
    hidden = grouped_linear(x, fc1_weight, fc1_bias, split_sizes)
    act = activation(kind, hidden) * probs.reshape(*hidden.shape[:-1], 1)
    return grouped_linear(act, fc2_weight, fc2_bias, split_sizes)


def activation_of(spec, pre: torch.Tensor) -> torch.Tensor:
    """:func:`activation` for an ``ActivationSpec``-like object (kind, interleave, clamp options), in float64."""
    options = {}
    if spec.kind == "clamped_swiglu":
        options = {"limit": spec.limit, "alpha": spec.alpha, "offset": spec.glu_linear_offset}
    return activation(spec.kind, pre.double(), spec.glu_interleave_size, **options)


def offsets_of(split_sizes, device: torch.device | str | None = None) -> torch.Tensor:
    """int32 inclusive cumulative row counts ``[G]`` (what the kernels take as ``offsets``)."""
    return torch.tensor(list(split_sizes), dtype=torch.int64).cumsum(0).to(torch.int32).to(device)


def group_ids_of(
    split_sizes, rows: int | None = None, device: torch.device | str | None = None
) -> torch.Tensor:
    """The group of every row; with ``rows``, rows past the last group get -1."""
    ids = torch.repeat_interleave(
        torch.arange(len(split_sizes)), torch.tensor(list(split_sizes), dtype=torch.int64)
    )
    if rows is not None:
        ids = torch.cat([ids, torch.full((rows - ids.numel(),), -1, dtype=torch.int64)])
    return ids.to(device)
