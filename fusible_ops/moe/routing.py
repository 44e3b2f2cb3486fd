"""Routing helpers for Mixture-of-Experts: top-k router, permute, unpermute/combine.

Shapes: ``T`` tokens, ``H`` hidden size, ``E`` experts, ``k`` experts per token,
``N = T * k`` routed rows.

The usual pipeline::

    probs, expert_ids = topk_route(logits, k)                       # [T, k], [T, k]
    perm = permute(tokens, expert_ids, E, probs)                    # rows sorted by expert
    y = experts(perm.rows, perm.split_sizes, perm.probs, perm.split_sizes)
    out = unpermute(y, perm.token_index, T)                         # [T, H]

Nothing here reads device values on the host: split sizes stay on the tokens' device.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..core.buffers import validate_or_alloc_output
from ..core.placement import ExpertPlacement  # noqa: F401  (re-exported)
from ..kernels.activation import row_dot

SCORE_FUNCTIONS = ("softmax", "sigmoid")


# ---------------------------------------------------------------- router


def topk_route(
    logits: torch.Tensor, top_k: int, *, score: str = "softmax", renormalize: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick ``top_k`` experts per token from router ``logits`` ``[T, E]``.

    Returns ``(probs, expert_ids)``, both ``[T, top_k]``: the routing weights
    (differentiable w.r.t. ``logits``; computed in at least float32) and the int64
    expert indices, highest score first. ``score`` is ``"softmax"`` (over all experts)
    or ``"sigmoid"`` (per expert); ``renormalize`` divides the chosen weights by their sum.
    Where that sum is zero (every chosen sigmoid score underflowed, e.g. logits of
    ``-1e4``) the token gets equal weights ``1 / top_k`` instead of ``0 / 0``, so no NaN
    appears (in the weights or their gradient).
    """
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise ValueError(f"topk_route: logits must be a 2-D tensor [tokens, experts], got {shape}")
    if not logits.is_floating_point():
        raise ValueError(f"topk_route: logits must be floating point, got {logits.dtype}")
    num_experts = logits.shape[1]
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
        raise ValueError(f"topk_route: top_k must be an int in [1, {num_experts}], got {top_k!r}")
    if score not in SCORE_FUNCTIONS:
        raise ValueError(f"topk_route: score must be one of {SCORE_FUNCTIONS}, got {score!r}")

    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    scores = torch.softmax(logits, dim=-1) if score == "softmax" else torch.sigmoid(logits)
    probs, expert_ids = torch.topk(scores, top_k, dim=-1)
    if renormalize:
        probs = _renormalize(probs)
    return probs, expert_ids


def _renormalize(probs: torch.Tensor) -> torch.Tensor:
    """Divide each row by its sum; a row summing to exactly zero becomes equal weights.

    A NaN or Inf sum (a diverged router row, overflowed logits) gives NaN weights: the
    failure propagates to the output instead of turning into plausible equal weights.
    """
    total = probs.sum(dim=-1, keepdim=True)
    # A safe denominator keeps 0 / 0 (and its gradient) out of the unused branch; clamp_min
    # and the ``== 0`` test both let NaN through.
    safe_total = total.clamp_min(torch.finfo(probs.dtype).tiny)
    return torch.where(total == 0, 1.0 / probs.shape[-1], probs / safe_total)


# ---------------------------------------------------------------- permute


class Permutation(NamedTuple):
    """Routed rows sorted by expert, and what :func:`unpermute` needs to undo it."""

    #: ``[N, H]`` token rows, grouped by expert in ``expert_order``
    rows: torch.Tensor
    #: ``[N]`` routing weight of each row, or None
    probs: torch.Tensor | None
    #: ``[E]`` int64 rows per expert (in ``expert_order``), on the tokens' device
    split_sizes: torch.Tensor
    #: ``[N]`` int64 source token of each row
    token_index: torch.Tensor


def permute(
    tokens: torch.Tensor,
    expert_ids: torch.Tensor,
    num_experts: int,
    probs: torch.Tensor | None = None,
    *,
    expert_order: torch.Tensor | None = None,
    dropped: torch.Tensor | None = None,
) -> Permutation:
    """Gather ``tokens`` ``[T, H]`` into one row per (token, chosen expert), sorted by expert.

    ``expert_ids`` ``[T, k]`` (int) names the experts of each token; ``probs`` ``[T, k]``
    their weights. Rows of one expert keep token order. ``expert_order`` (an integer
    permutation of ``range(num_experts)``; anything else is refused) sets the order of
    the expert groups; by default 0..E-1.

    Dropped rows: an id ``>= num_experts`` (the sentinel some expert-parallel codes use)
    and the ``True`` entries of ``dropped`` (``[T, k]`` bool, e.g. over an expert's
    capacity) are rows whose result must not reach their token. They stay in the rows
    (sentinel rows in the last group, ``dropped`` rows in their expert's), so no shape
    depends on device values, and get ``token_index`` -1, which :func:`unpermute` skips:
    they contribute zero to the output and receive zero gradient.
    Differentiable w.r.t. ``tokens`` and ``probs``. Never syncs with the host.
    """
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2:
        raise ValueError(f"permute: tokens must be a 2-D tensor [tokens, hidden], got {_shape(tokens)}")
    if not isinstance(expert_ids, torch.Tensor) or expert_ids.dim() != 2:
        raise ValueError(
            f"permute: expert_ids must be a 2-D tensor [tokens, top_k], got {_shape(expert_ids)}"
        )
    if expert_ids.shape[0] != tokens.shape[0]:
        raise ValueError(
            f"permute: expert_ids has {expert_ids.shape[0]} rows but tokens has {tokens.shape[0]}"
        )
    if not _is_integer_dtype(expert_ids.dtype):
        raise ValueError(f"permute: expert_ids must be an integer tensor, got {expert_ids.dtype}")
    if _on_different_devices(expert_ids, tokens):
        raise ValueError(f"permute: expert_ids is on {expert_ids.device} but tokens on {tokens.device}")
    if probs is not None and (not isinstance(probs, torch.Tensor) or probs.shape != expert_ids.shape):
        raise ValueError(
            f"permute: probs must have the shape of expert_ids {tuple(expert_ids.shape)}, got {_shape(probs)}"
        )
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"permute: num_experts must be a positive int, got {num_experts!r}")
    if dropped is not None and (
        not isinstance(dropped, torch.Tensor)
        or dropped.dtype != torch.bool
        or dropped.shape != expert_ids.shape
    ):
        raise ValueError(
            f"permute: dropped must be a bool tensor of the shape of expert_ids {tuple(expert_ids.shape)}, "
            f"got {_shape(dropped)}"
        )
    _check_expert_range(expert_ids, num_experts)

    top_k = expert_ids.shape[1]
    flat_ids = expert_ids.reshape(-1).long()
    is_sentinel = flat_ids >= num_experts
    flat_ids = flat_ids.clamp(max=num_experts - 1)
    if expert_order is None:
        sort_key = flat_ids
    else:
        expert_order = _checked_expert_order(expert_order, num_experts).to(device=tokens.device)
        # argsort inverts a permutation and, unlike a scatter, never leaves a slot unset.
        position_of_expert = torch.argsort(expert_order)
        sort_key = position_of_expert[flat_ids]
    # sentinel rows go to the last group, whatever the order
    sort_key = torch.where(is_sentinel, num_experts - 1, sort_key)
    is_dropped = is_sentinel if dropped is None else is_sentinel | dropped.reshape(-1).to(tokens.device)

    order = torch.argsort(sort_key, stable=True)
    source_token = torch.div(order, top_k, rounding_mode="floor")
    rows = tokens.index_select(0, source_token)
    token_index = torch.where(is_dropped.index_select(0, order), -1, source_token)
    sorted_probs = None if probs is None else probs.reshape(-1).index_select(0, order)
    # scatter_add instead of bincount: bincount reads max() on the host.
    split_sizes = flat_ids.new_zeros(num_experts)  # long, on the tokens' device
    split_sizes.scatter_add_(0, sort_key, torch.ones_like(sort_key))
    return Permutation(rows, sorted_probs, split_sizes, token_index)


def sort_by_expert(
    tokens: torch.Tensor, expert_ids: torch.Tensor, probs: torch.Tensor, split_sizes: torch.Tensor
) -> Permutation:
    """:func:`permute` of a router's own choice: every id in ``[0, E)``, nothing dropped,
    the experts in order, and ``split_sizes`` (``[E]`` int64, the rows per expert) already
    counted. It computes what :func:`permute` computes for such a choice, without the
    checks and the dropped-row steps that cannot apply."""
    order = torch.argsort(expert_ids.reshape(-1), stable=True)
    source_token = torch.div(order, expert_ids.shape[1], rounding_mode="floor")
    rows = tokens.index_select(0, source_token)
    return Permutation(rows, probs.reshape(-1).index_select(0, order), split_sizes, source_token)


def combine_sorted(rows: torch.Tensor, token_index: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """:func:`unpermute` of :func:`sort_by_expert`'s rows (``token_index`` its int64 indices,
    every one in ``[0, num_tokens)``): ``[num_tokens, H]``, sums per token. float32 and
    float64 rows take autograd's own ``index_add``; half-precision rows accumulate in
    float32 as :func:`unpermute` does."""
    if rows.dtype in (torch.float16, torch.bfloat16):
        return unpermute(rows, token_index, num_tokens)
    out = torch.zeros(num_tokens, rows.shape[1], dtype=rows.dtype, device=rows.device)
    return out.index_add_(0, token_index, rows)


def _checked_expert_order(expert_order: object, num_experts: int) -> torch.Tensor:
    """``expert_order`` as int64 after checking it is a permutation of ``range(num_experts)``."""
    if not isinstance(expert_order, torch.Tensor) or expert_order.shape != (num_experts,):
        raise ValueError(
            f"permute: expert_order must be a tensor of shape ({num_experts},), got {_shape(expert_order)}"
        )
    if not _is_integer_dtype(expert_order.dtype):
        raise ValueError(f"permute: expert_order must be an integer tensor, got {expert_order.dtype}")
    order = expert_order.long()
    expected = torch.arange(num_experts, device=order.device)
    _require(
        (torch.sort(order).values == expected).all(),
        f"permute: expert_order must be a permutation of range({num_experts})",
    )
    return order


def _require(ok: torch.Tensor, message: str) -> None:
    """``ValueError(message)`` unless the 0-d bool ``ok`` holds, without a host read.

    Eager CPU tensors are read on the host; while tracing, or for other devices, the
    check becomes a device-side assert (asynchronous on GPUs).
    """
    if torch.compiler.is_compiling() or ok.device.type != "cpu":
        torch._assert_async(ok, message)
    elif not bool(ok):
        raise ValueError(message)


def _is_integer_dtype(dtype: torch.dtype) -> bool:
    return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


def _on_different_devices(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``a.device != b.device``, without building device objects when both are on the CPU
    (this runs on every call)."""
    return not (a.is_cpu and b.is_cpu) and a.device != b.device


def _check_expert_range(expert_ids: torch.Tensor, num_experts: int) -> None:
    """``ValueError`` for negative ids (ids ``>= num_experts`` are dropped rows); a device-side
    assert while tracing or off the CPU."""
    if torch.compiler.is_compiling() or not expert_ids.is_cpu:
        # No host read enters the graph: the check runs on device (asynchronously on GPUs).
        torch._assert_async((expert_ids >= 0).all(), "permute: expert_ids must be >= 0")
    elif expert_ids.numel() > 0:
        lo = int(expert_ids.min())
        if lo < 0:
            raise ValueError(
                f"permute: expert_ids must be >= 0 (ids >= num_experts={num_experts} are dropped rows), "
                f"got {lo}"
            )


# ---------------------------------------------------------------- unpermute / combine


def _combine(rows, probs, token_index, num_tokens, out_holder, may_drop):  # noqa: ANN001, ANN202
    """``_Combine``'s forward math: ``(out, the row index it used)``."""
    target, owned = out_holder
    # our own allocation is returned whole (not a view: the caller may modify it in place)
    out = target if owned else target[:num_tokens]
    src = rows if probs is None else rows * probs.to(rows.dtype).unsqueeze(-1)
    index = torch.where(token_index < 0, num_tokens, token_index) if may_drop else token_index
    low_precision = rows.dtype in (torch.float16, torch.bfloat16)
    if low_precision or may_drop:
        acc_dtype = torch.float32 if low_precision else rows.dtype
        acc = torch.zeros(num_tokens + int(may_drop), rows.shape[1], dtype=acc_dtype, device=rows.device)
        acc.index_add_(0, index, src.to(acc_dtype))
        out.copy_(acc[:num_tokens])
    else:
        out.zero_()
        out.index_add_(0, index, src)
    return out, index


class _Combine(torch.autograd.Function):
    """``out[token_index[i]] += rows[i] * probs[i]``, written into a caller buffer if given.

    Rows with ``token_index`` -1 (dropped) land in a scratch row that is thrown away, and
    get zero gradient.
    """

    @staticmethod
    def forward(ctx, rows, probs, token_index, num_tokens, out_holder, may_drop):  # noqa: ANN001, ANN205
        # The target travels in a list so autograd does not treat it as an input: the
        # caller's buffer must stay a plain tensor (no grad_fn), only the view we return
        # joins the graph.
        out, index = _combine(rows, probs, token_index, num_tokens, out_holder, may_drop)
        ctx.may_drop = may_drop
        ctx.save_for_backward(rows if probs is not None else None, probs, index)
        return out

    @staticmethod
    def backward(ctx, grad_out):  # noqa: ANN001, ANN205
        rows, probs, index = ctx.saved_tensors
        if ctx.may_drop:
            grad_out = torch.cat([grad_out, grad_out.new_zeros(1, grad_out.shape[1])])
        grad_per_row = grad_out.index_select(0, index)
        grad_rows = grad_probs = None
        if ctx.needs_input_grad[0]:
            grad_rows = (
                grad_per_row if probs is None else grad_per_row * probs.to(grad_per_row.dtype)[:, None]
            )
        if probs is not None and ctx.needs_input_grad[1]:
            grad_probs = row_dot(grad_per_row, rows, probs.dtype)
        return grad_rows, grad_probs, None, None, None, None


def unpermute(
    rows: torch.Tensor,
    token_index: torch.Tensor,
    num_tokens: int,
    *,
    probs: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sum expert rows ``[N, H]`` back into token order: ``[num_tokens, H]``.

    ``out[t] = sum(rows[i] * probs[i] for i with token_index[i] == t)`` (``probs`` None
    means weight 1, as when the experts already applied the routing weights).
    Every ``token_index`` (integer) must lie in ``[0, num_tokens)`` or be -1, a dropped
    row (see :func:`permute`) that adds nothing; this is checked before ``out`` is
    touched. Tokens routed nowhere get zeros. ``out`` (``[>= num_tokens, H]``, contiguous, no
    grad) receives the result, and a view of its first rows is returned. Half-precision
    rows are accumulated in float32. Differentiable w.r.t. ``rows`` and ``probs``.
    """
    if not isinstance(rows, torch.Tensor) or rows.dim() != 2:
        raise ValueError(f"unpermute: rows must be a 2-D tensor [rows, hidden], got {_shape(rows)}")
    if not isinstance(token_index, torch.Tensor) or token_index.shape != (rows.shape[0],):
        raise ValueError(
            f"unpermute: token_index must have shape ({rows.shape[0]},) (a row each), got {_shape(token_index)}"
        )
    if not _is_int(num_tokens) or num_tokens < 0:
        raise ValueError(f"unpermute: num_tokens must be a non-negative int, got {num_tokens!r}")
    if probs is not None and (not isinstance(probs, torch.Tensor) or probs.shape != (rows.shape[0],)):
        raise ValueError(f"unpermute: probs must have shape ({rows.shape[0]},), got {_shape(probs)}")
    if not _is_integer_dtype(token_index.dtype):
        raise ValueError(f"unpermute: token_index must be an integer tensor, got {token_index.dtype}")
    if _on_different_devices(token_index, rows):
        raise ValueError(f"unpermute: token_index is on {token_index.device} but rows on {rows.device}")
    may_drop = _check_token_range(token_index, num_tokens)
    if out is None:
        # Not via validate_or_alloc_output: it casts the shape to int, which would pin a
        # traced (symbolic) token count to one value.
        target = rows.new_empty((num_tokens, rows.shape[1]))
    else:
        target = validate_or_alloc_output(
            out,
            (num_tokens, rows.shape[1]),
            rows.dtype,
            rows.device,
            op_name="unpermute",
            no_overlap=[t for t in (rows, probs) if t is not None],
        )
    holder = [target, out is None]
    needs_grad = torch.is_grad_enabled() and (
        rows.requires_grad or (probs is not None and probs.requires_grad)
    )
    if not needs_grad and not torch.compiler.is_compiling():
        # nothing to differentiate: the math alone, without an autograd Function's call
        return _combine(rows, probs, token_index.long(), num_tokens, holder, may_drop)[0]
    return _Combine.apply(rows, probs, token_index.long(), num_tokens, holder, may_drop)


def _check_token_range(token_index: torch.Tensor, num_tokens: int) -> bool:
    """Every ``token_index`` in ``[0, num_tokens)`` or -1, checked before any output is written.

    Returns whether dropped rows (-1) may be present: known on an eager CPU tensor,
    assumed while tracing or on other devices (no host read).
    """
    if torch.compiler.is_compiling() or not token_index.is_cpu:
        # No host read, and no formatting of a possibly symbolic num_tokens.
        index = token_index.long()
        in_range = ((index >= -1) & (index < num_tokens)).all()
        torch._assert_async(in_range, "unpermute: token_index must lie in [0, num_tokens) or be -1 (dropped)")
        return True
    if token_index.numel() == 0:
        return False
    lo, hi = int(token_index.min()), int(token_index.max())
    if lo < -1 or hi >= num_tokens:
        raise ValueError(
            f"unpermute: token_index must lie in [0, num_tokens={num_tokens}), got values in [{lo}, {hi}] "
            "(-1 marks a dropped row)"
        )
    return lo == -1


def _is_int(value: object) -> bool:
    """A Python int (not a bool), or a symbolic one while tracing with dynamic shapes."""
    return isinstance(value, (int, torch.SymInt)) and not isinstance(value, bool)


def _shape(obj: object) -> object:
    return tuple(obj.shape) if isinstance(obj, torch.Tensor) else type(obj).__name__
