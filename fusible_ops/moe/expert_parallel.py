"""Expert parallelism: token dispatch and combine over ``torch.distributed`` all-to-all.

``W`` ranks each hold ``L`` experts; rank ``d`` owns global experts ``[d*L, (d+1)*L)``.

Transport layout. A sending rank orders its routed rows *local-expert-major*: first
the rows for local expert 0 of rank 0, 1, ..., W-1, then local expert 1 of every rank,
and so on. For each local expert index ``j`` one ``all_to_all_single`` moves that
chunk, so the receiving rank gets the rows of its expert ``j`` from every source rank
contiguously, already sorted by expert: the grouped GEMMs read the receive buffer as
is. The way back is the mirror image: fc2 writes (``OUTPUT_BUFFER_KEY``) straight into
the tensor that the return all-to-all sends, and the rows land on their source rank in
the order they left. No reordering copy on either side; the price is ``L`` collectives
per direction instead of one (issued asynchronously, waited together).

Per-expert row counts are exchanged first with one all-to-all and read on the host
once (``all_to_all_single`` needs host split sizes).

Every rank must call :meth:`ExpertParallel.dispatch` / :meth:`combine` the same number
of times, and backward must reach them on every rank (a rank with no tokens still
takes part with empty tensors), as for any collective.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .routing import permute, unpermute


@dataclass
class DispatchState:
    """What :meth:`ExpertParallel.combine` needs from the matching dispatch."""

    #: ``[N_send]`` source token of each row this rank sent
    token_index: torch.Tensor
    #: ``send_splits[j][d]``: rows this rank sends to rank ``d`` for its local expert ``j``
    send_splits: list[list[int]]
    #: ``recv_splits[j][s]``: rows this rank receives from rank ``s`` for local expert ``j``
    recv_splits: list[list[int]]
    #: rows per local expert (host ints) in the received, expert-sorted rows
    local_split_sizes: list[int]
    #: tokens on this rank
    num_tokens: int

    @property
    def num_local_rows(self) -> int:
        """Rows this rank received for its local experts."""
        return sum(self.local_split_sizes)


def _all_to_all_chunks(
    tensor: torch.Tensor,
    send_splits: list[list[int]],
    recv_splits: list[list[int]],
    group: dist.ProcessGroup | None,
    out: torch.Tensor,
) -> None:
    """One ``all_to_all_single`` per chunk ``j``: rows ``send_splits[j]`` out, ``recv_splits[j]`` in."""
    handles = []
    send_start = recv_start = 0
    for send_j, recv_j in zip(send_splits, recv_splits):
        send_end, recv_end = send_start + sum(send_j), recv_start + sum(recv_j)
        handles.append(
            dist.all_to_all_single(
                out[recv_start:recv_end],
                tensor[send_start:send_end],
                output_split_sizes=recv_j,
                input_split_sizes=send_j,
                group=group,
                async_op=True,
            )
        )
        send_start, recv_start = send_end, recv_end
    for handle in handles:
        handle.wait()


class _AllToAll(torch.autograd.Function):
    """Differentiable chunked all-to-all of ``rows`` (and, optionally, 1-D ``probs``).

    Backward is the same exchange with send and receive swapped. Rows and probs travel
    in one autograd node so that every rank issues the backward collectives in the
    same order.
    """

    @staticmethod
    def forward(ctx, rows, probs, send_splits, recv_splits, group, rows_out_holder, grad_anchor):  # noqa: ANN001, ANN205
        ctx.send_splits, ctx.recv_splits, ctx.group = send_splits, recv_splits, group
        ctx.num_send_rows = rows.shape[0]
        ctx.has_probs = probs is not None
        num_recv = sum(map(sum, recv_splits))
        rows_out = rows_out_holder[0]
        rows_out = rows.new_empty((num_recv, *rows.shape[1:])) if rows_out is None else rows_out[:num_recv]
        _all_to_all_chunks(rows.contiguous(), send_splits, recv_splits, group, rows_out)
        if probs is None:
            return rows_out, None
        probs_out = probs.new_empty((num_recv,))
        _all_to_all_chunks(probs.contiguous(), send_splits, recv_splits, group, probs_out)
        return rows_out, probs_out

    @staticmethod
    def backward(ctx, grad_rows, grad_probs):  # noqa: ANN001, ANN205
        n = ctx.num_send_rows
        grad_rows_in = grad_rows.new_empty((n, *grad_rows.shape[1:]))
        _all_to_all_chunks(grad_rows.contiguous(), ctx.recv_splits, ctx.send_splits, ctx.group, grad_rows_in)
        grad_probs_in = None
        if ctx.has_probs:
            grad_probs_in = grad_probs.new_empty((n,))
            _all_to_all_chunks(
                grad_probs.contiguous(), ctx.recv_splits, ctx.send_splits, ctx.group, grad_probs_in
            )
        return grad_rows_in, grad_probs_in, None, None, None, None, None


def all_to_all_rows(
    rows: torch.Tensor,
    probs: torch.Tensor | None,
    send_splits: list[list[int]],
    recv_splits: list[list[int]],
    group: dist.ProcessGroup | None = None,
    *,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Differentiable chunked all-to-all of ``rows`` ``[N, H]`` and ``probs`` ``[N]``.

    Chunk ``j`` sends ``send_splits[j][d]`` rows to rank ``d`` and receives
    ``recv_splits[j][s]`` rows from rank ``s``; chunks are consecutive on both sides.
    ``out`` (``[>= received rows, H]``, contiguous) receives the rows when given.
    """
    num_send = sum(map(sum, send_splits))
    if rows.shape[0] != num_send:
        raise ValueError(
            f"all_to_all_rows: rows has {rows.shape[0]} rows but the send splits total {num_send}"
        )
    if probs is not None and probs.shape != (num_send,):
        raise ValueError(f"all_to_all_rows: probs must have shape ({num_send},), got {tuple(probs.shape)}")
    # Every rank must issue the backward collectives, also a rank whose rows need no grad
    # (frozen router, input without grad) while another's do: an empty leaf that requires
    # grad puts this exchange in every rank's backward graph whenever grad is enabled.
    anchor = torch.empty(0, device=rows.device, requires_grad=True) if torch.is_grad_enabled() else None
    return _AllToAll.apply(rows, probs, send_splits, recv_splits, group, [out], anchor)


class ExpertParallel:
    """Dispatch routed tokens to the ranks owning their experts, and combine the results.

    ``num_experts`` is the global expert count; it must divide evenly by the group size.

    >>> ep = ExpertParallel(num_experts, group)
    >>> rows, probs, state = ep.dispatch(tokens, expert_ids, route_probs)
    >>> buf = ep.output_buffer(state, hidden, rows.dtype, rows.device)
    >>> y = experts(rows, state.local_split_sizes, probs, state.local_split_sizes,
    ...             op_kwargs={2: {OUTPUT_BUFFER_KEY: buf}})
    >>> out = ep.combine(y, state)          # [tokens, hidden], token order
    """

    def __init__(self, num_experts: int, group: dist.ProcessGroup | None = None) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "ExpertParallel: torch.distributed is not initialised (call init_process_group)"
            )
        # Hold no reference to the default group: a live reference keeps its gloo worker
        # threads running past destroy_process_group(), and a work object they free while
        # the interpreter shuts down aborts the process.
        self.group = None if group is dist.group.WORLD else group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
            raise ValueError(f"ExpertParallel: num_experts must be a positive int, got {num_experts!r}")
        if num_experts % self.world_size:
            raise ValueError(
                f"ExpertParallel: num_experts={num_experts} is not divisible by the expert-parallel "
                f"group size {self.world_size}"
            )
        self.num_experts = num_experts
        self.num_local_experts = num_experts // self.world_size
        #: an empty leaf that requires grad, made here because a traced region cannot make one
        self.grad_anchor = torch.zeros(0, requires_grad=True)

    @property
    def local_expert_range(self) -> range:
        """Global indices of the experts this rank holds."""
        return range(self.rank * self.num_local_experts, (self.rank + 1) * self.num_local_experts)

    def _send_order(self, device: torch.device) -> torch.Tensor:
        # global expert d*L + j sent in position j*W + d (local-expert-major)
        w, l = self.world_size, self.num_local_experts  # noqa: E741
        return torch.arange(self.num_experts, device=device).reshape(w, l).t().reshape(-1)

    def dispatch(
        self,
        tokens: torch.Tensor,
        expert_ids: torch.Tensor,
        probs: torch.Tensor | None = None,
        *,
        dropped: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, DispatchState]:
        """Send each (token, expert) row to the expert's rank.

        ``tokens`` ``[T, H]``, ``expert_ids`` and ``probs`` ``[T, k]`` (global expert
        ids). Returns the received rows ``[M, H]`` sorted by local expert, their probs
        ``[M]``, and the state for :meth:`combine`. One host sync (the counts).
        Dropped rows (ids ``>= num_experts``, ``dropped``; see :func:`~fusible_ops.moe.permute`)
        travel like the others and add nothing in :meth:`combine`.
        While ``torch.compile`` traces, the functional-collective path of
        ``ep_functional`` runs instead (its state holds device split sizes).
        """
        if torch.compiler.is_compiling():
            from .ep_functional import dispatch_functional

            return dispatch_functional(self, tokens, expert_ids, probs, dropped=dropped)
        perm = permute(
            tokens,
            expert_ids,
            self.num_experts,
            probs,
            expert_order=self._send_order(tokens.device),
            dropped=dropped,
        )
        w, l = self.world_size, self.num_local_experts  # noqa: E741
        # counts in global expert order: chunk d holds what this rank sends to rank d
        send_counts = perm.split_sizes.reshape(l, w).t().contiguous().reshape(-1)
        recv_counts = torch.empty_like(send_counts)
        if _backend_needs_cpu(self.group) and send_counts.device.type != "cpu":
            raise RuntimeError("ExpertParallel: a gloo group needs CPU tensors; use NCCL for CUDA tensors")
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        counts = torch.cat([send_counts, recv_counts]).tolist()
        send_global, recv_global = counts[: self.num_experts], counts[self.num_experts :]
        send_splits = [[send_global[d * l + j] for d in range(w)] for j in range(l)]
        recv_splits = [[recv_global[s * l + j] for s in range(w)] for j in range(l)]
        state = DispatchState(
            token_index=perm.token_index,
            send_splits=send_splits,
            recv_splits=recv_splits,
            local_split_sizes=[sum(r) for r in recv_splits],
            num_tokens=tokens.shape[0],
        )
        rows, local_probs = all_to_all_rows(perm.rows, perm.probs, send_splits, recv_splits, self.group)
        return rows, local_probs, state

    def output_buffer(
        self, state: DispatchState, hidden_size: int, dtype: torch.dtype, device: torch.device | str
    ) -> torch.Tensor:
        """A ``[M, hidden_size]`` tensor for fc2's output: the return all-to-all sends it as is."""
        return torch.empty(state.num_local_rows, hidden_size, dtype=dtype, device=device)

    def combine(
        self, expert_out: torch.Tensor, state: DispatchState, *, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Return expert rows ``[M, H]`` to their ranks and sum them per token: ``[T, H]``.

        Routing weights are assumed applied by the experts (the scaled activations).
        ``out`` receives the result as in :func:`fusible_ops.moe.unpermute`.
        """
        if not isinstance(state, DispatchState):
            from .ep_functional import combine_functional

            if out is not None:
                raise ValueError("ExpertParallel.combine: out= is not supported while tracing")
            return combine_functional(self, expert_out, state)
        if expert_out.dim() != 2 or expert_out.shape[0] != state.num_local_rows:
            raise ValueError(
                f"ExpertParallel.combine: expert_out must be [{state.num_local_rows}, hidden] "
                f"(the dispatched rows), got {tuple(expert_out.shape)}"
            )
        back, _ = all_to_all_rows(expert_out, None, state.recv_splits, state.send_splits, self.group)
        return unpermute(back, state.token_index, state.num_tokens, out=out)


def _backend_needs_cpu(group: dist.ProcessGroup | None) -> bool:
    return dist.get_backend(group) == "gloo"
