"""Traceable expert-parallel dispatch and combine: torch's functional collectives.

The path :class:`~fusible_ops.moe.expert_parallel.ExpertParallel` takes while
``torch.compile`` traces (callable in eager too). Dynamo and AOTAutograd trace it into
one graph: the collectives are ``torch.distributed._functional_collectives`` ops
(autograd-aware all-to-all; no ``async_op`` handles), and no Python ``if`` reads a value
that depends on the routing.

Layout. Rows leave in global expert order, so one all-to-all moves everything: rank
``d`` gets its experts' rows from each source rank ``s`` in blocks ``[s][j]`` (``j``
local expert). A stable sort by ``j`` gathers them expert-major for the grouped GEMMs
(and the inverse gather sends the results back in ``[s][j]`` order); with one local
expert there is nothing to reorder. Split sizes are exchanged first, with one
all-to-all of the per-expert counts, and read on the host once (``.tolist()``, as in
torchtitan's dispatcher): under ``torch.compile`` they become unbacked sizes, so
``torch._dynamo.config.capture_scalar_outputs = True`` must be set for a full graph.
The sent rows total ``T * k`` by construction (the last rank's split is the remainder),
so the returned rows need no size check.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from .routing import permute, unpermute


@dataclass
class FunctionalDispatchState:
    """What :func:`combine_functional` needs from the matching :func:`dispatch_functional`."""

    #: ``[N]`` source token of each row this rank sent (-1: dropped)
    token_index: torch.Tensor
    #: rows this rank sends to each rank (host ints, or unbacked sizes while tracing)
    input_splits: list
    #: rows this rank receives from each rank
    output_splits: list
    #: ``[M]`` received position of each expert-major row, or None (one local expert)
    order: torch.Tensor | None
    #: ``[L]`` int64 rows per local expert, on the rows' device
    local_split_sizes: torch.Tensor
    #: tokens on this rank
    num_tokens: int


def _group_of(ep: object) -> dist.ProcessGroup:
    return dist.group.WORLD if ep.group is None else ep.group


def _wait(tensor: torch.Tensor) -> torch.Tensor:
    return funcol.wait_tensor(tensor) if isinstance(tensor, funcol.AsyncCollectiveTensor) else tensor


def _exchange_counts(ep: object, send_counts: torch.Tensor) -> tuple[torch.Tensor, list, list]:
    """``recv_counts`` ``[W, L]`` (from rank ``s``, local expert ``j``) and the host splits."""
    w, l = ep.world_size, ep.num_local_experts  # noqa: E741
    group = _group_of(ep)
    with torch.no_grad():
        recv_counts = _wait(funcol.all_to_all_single(send_counts, None, None, group)).reshape(w, l)
        # one host read of both: rows to each rank, rows from each rank
        per_rank = torch.cat([send_counts.reshape(w, l).sum(1), recv_counts.sum(1)])
        counts = per_rank.tolist()
    for count in counts:
        torch._check(count >= 0)
    return recv_counts, counts[:w], counts[w:]


def _grad_anchor(ep: object, rows: torch.Tensor) -> torch.Tensor:
    """``rows`` in the autograd graph even when they need no gradient (a frozen layer, an
    input without grad): every rank must issue the same backward all-to-alls, in the same
    order, when any rank does, so rows and probs are both in the graph whenever grad is on."""
    if not torch.is_grad_enabled() or rows.requires_grad:
        return rows
    anchor = ep.grad_anchor.to(rows.device)
    return rows + anchor.sum()


def _expert_major_order(recv_counts: torch.Tensor, num_rows: object) -> torch.Tensor:
    """``[M]``: for each expert-major row, its position among the received ``[s][j]`` rows."""
    w, l = recv_counts.shape  # noqa: E741
    local_expert = torch.arange(l, device=recv_counts.device).repeat(w)
    key = torch.repeat_interleave(local_expert, recv_counts.reshape(-1), output_size=num_rows)
    return torch.argsort(key, stable=True)


def dispatch_functional(
    ep: object,
    tokens: torch.Tensor,
    expert_ids: torch.Tensor,
    probs: torch.Tensor | None = None,
    *,
    dropped: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, FunctionalDispatchState]:
    """Send each (token, expert) row of ``tokens`` ``[T, H]`` to its expert's rank.

    ``ep``: an :class:`~fusible_ops.moe.expert_parallel.ExpertParallel`.
    ``expert_ids``, ``probs``, ``dropped``: ``[T, k]`` as for
    :meth:`ExpertParallel.dispatch`. Returns the received rows ``[M, H]`` sorted by
    local expert, their probs ``[M]`` and the state for :func:`combine_functional`
    (whose ``local_split_sizes`` is a device tensor).
    """
    perm = permute(tokens, expert_ids, ep.num_experts, probs, dropped=dropped)
    recv_counts, input_splits, output_splits = _exchange_counts(ep, perm.split_sizes)
    num_sent = perm.rows.shape[0]
    # the remainder: the splits then sum to the sent rows by construction
    input_splits[-1] = num_sent - sum(input_splits[:-1])
    torch._check(input_splits[-1] >= 0)
    group = _group_of(ep)
    rows = funcol.all_to_all_single_autograd(
        _grad_anchor(ep, perm.rows.contiguous()), output_splits, input_splits, group
    )
    row_probs = None
    if perm.probs is not None:
        row_probs = funcol.all_to_all_single_autograd(
            _grad_anchor(ep, perm.probs.contiguous()), output_splits, input_splits, group
        )
    order = None
    if ep.num_local_experts > 1:
        order = _expert_major_order(recv_counts, rows.shape[0])
        rows = rows.index_select(0, order)
        row_probs = None if row_probs is None else row_probs.index_select(0, order)
    state = FunctionalDispatchState(
        token_index=perm.token_index,
        input_splits=input_splits,
        output_splits=output_splits,
        order=order,
        local_split_sizes=recv_counts.sum(0),
        num_tokens=tokens.shape[0],
    )
    return rows, row_probs, state


def combine_functional(ep: object, expert_out: torch.Tensor, state: FunctionalDispatchState) -> torch.Tensor:
    """Return expert rows ``[M, H]`` (routing weights applied) to their ranks and sum them
    per token: ``[T, H]`` in token order."""
    if expert_out.dim() != 2:
        raise ValueError(
            f"ExpertParallel.combine: expert_out must be [rows, hidden], got {tuple(expert_out.shape)}"
        )
    if state.order is not None:
        inverse = torch.empty_like(state.order)
        inverse[state.order] = torch.arange(state.order.shape[0], device=state.order.device)
        expert_out = expert_out.index_select(0, inverse)
    back = funcol.all_to_all_single_autograd(
        expert_out.contiguous(), state.input_splits, state.output_splits, _group_of(ep)
    )
    return unpermute(back, state.token_index, state.num_tokens)
