"""Load balancing of the ``MoE`` layer: balancing losses, router z-loss, capacity, bias updates.

Shapes: ``T`` tokens, ``E`` experts, ``k`` experts per token; ``B`` sequences of ``S``
tokens for the per-sequence loss. ``scores`` are the router's per-token scores that sum
to 1 over the experts (:attr:`fusible_ops.moe.router.Routing.normalized_scores`).

With a ``group`` the statistics are those of all ranks' tokens together: counts and
token totals are summed over the group, and so is every rank's share of the score sums.
Each rank back-propagates only the part of a loss that depends on its own tokens, so the
sum of the ranks' router gradients is the gradient of the global loss.
"""

from __future__ import annotations

import math

import torch

LOAD_BALANCING = ("none", "aux_loss", "seq_aux_loss", "aux_free")


def expert_load(expert_ids: torch.Tensor, num_experts: int, *, in_range: bool = False) -> torch.Tensor:
    """``[E]`` int64: how many (token, slot) pairs chose each expert; ids ``>= E`` are not counted.

    ``in_range``: every id is known to lie in ``[0, E)`` (a router's own choice), so
    none needs clamping."""
    flat = expert_ids.reshape(-1)
    if flat.dtype != torch.long:
        flat = flat.long()
    if in_range:
        counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device)
        return counts.scatter_add_(0, flat, torch.ones_like(flat))
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=flat.device)
    counts.scatter_add_(0, flat.clamp(max=num_experts), torch.ones_like(flat))
    return counts[:num_experts]


def is_recomputing() -> bool:
    """Whether this forward runs inside a backward pass: an activation-checkpointing
    recomputation (reentrant or not), whose statistics were already counted once."""
    if torch.compiler.is_compiling():
        return False  # a compiled region's forward is traced once, its recomputation is in the graph
    return torch._C._current_graph_task_id() != -1


def global_sum(value: torch.Tensor, group: object | None) -> torch.Tensor:
    """``value`` summed over ``group``; the gradient flows to this rank's ``value`` only."""
    if group is None:
        return value
    import torch.distributed as dist

    total = value.detach().clone()
    dist.all_reduce(total, group=group)
    return value + (total - value.detach())


def aux_loss(
    scores: torch.Tensor, load: torch.Tensor, top_k: int, group: object | None = None
) -> torch.Tensor:
    """Switch/GShard balancing loss ``E * sum_e f_e * P_e / k`` over all tokens.

    ``load``: :func:`expert_load` of the routing. ``f_e``: the fraction of tokens that
    chose expert ``e`` (summing to ``k``), ``P_e``: the mean score of ``e``. Perfectly
    balanced routing gives 1.0 (some libraries report ``k`` times this). Differentiable
    w.r.t. ``scores`` only.
    """
    num_experts = scores.shape[-1]
    counts = global_sum(load.to(scores.dtype), group)
    score_sums = global_sum(scores.sum(0), group)
    tokens = global_sum(_count(scores, scores.shape[0]), group).clamp_min(1.0)
    return num_experts / top_k * (counts / tokens * score_sums / tokens).sum()


def seq_aux_loss(
    scores: torch.Tensor, expert_ids: torch.Tensor, top_k: int, group: object | None = None
) -> torch.Tensor:
    """DeepSeek-V3's per-sequence balancing loss, averaged over sequences.

    ``scores`` ``[B, S, E]`` and ``expert_ids`` ``[B, S, k]``; per sequence
    ``sum_e (E / (k S)) * count_e * mean_t scores[t, e]`` (1.0 when balanced).
    """
    batch, seq, num_experts = scores.shape
    flat = expert_ids.reshape(batch, seq * expert_ids.shape[-1]).long()
    counts = torch.zeros(batch, num_experts + 1, dtype=scores.dtype, device=scores.device)
    counts.scatter_add_(1, flat.clamp(max=num_experts), torch.ones_like(flat, dtype=scores.dtype))
    f = counts[:, :num_experts] * (num_experts / (top_k * max(seq, 1)))
    per_seq = (f * scores.mean(1)).sum(-1) if seq else scores.new_zeros(batch)
    total = global_sum(per_seq.sum(), group)
    count = global_sum(_count(scores, batch), group).clamp_min(1.0)
    return total / count


def z_loss(logits: torch.Tensor, group: object | None = None) -> torch.Tensor:
    """ST-MoE router z-loss: the mean over tokens of ``logsumexp(logits) ** 2``."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    total = global_sum((torch.logsumexp(logits, dim=-1) ** 2).sum(), group)
    count = global_sum(_count(logits, logits.shape[0]), group).clamp_min(1.0)
    return total / count


def _count(like: torch.Tensor, n: int) -> torch.Tensor:
    """``n`` (a size, symbolic while tracing) as a 0-d tensor of ``like``'s dtype and device;
    ``float(n)`` would pin a dynamic size to its traced value."""
    return torch.full((), n, dtype=like.dtype, device=like.device)


def capacity_dropped(expert_ids: torch.Tensor, num_experts: int, capacity_factor: float) -> torch.Tensor:
    """``[T, k]`` bool: the (token, slot) pairs over their expert's capacity.

    Capacity per expert: ``ceil(capacity_factor * T * k / E)`` rows. Earlier slots win
    (every token's first choice before any second choice), then earlier tokens (GShard).
    """
    tokens, top_k = expert_ids.shape
    capacity = math.ceil(capacity_factor * tokens * top_k / num_experts)
    slot_major = expert_ids.t().reshape(-1).long()
    one_hot = torch.nn.functional.one_hot(slot_major, num_experts)
    position = (one_hot.cumsum(0) * one_hot).sum(-1) - 1  # rank of the row within its expert
    return (position >= capacity).reshape(top_k, tokens).t()


def attach_loss(output: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
    """:class:`AttachLoss` applied, refused while ``torch.export`` traces.

    An exported program keeps only the forward of an autograd Function, so the loss's
    gradient would be lost without a word.

    Raises:
        RuntimeError: under ``torch.export``.
    """
    if torch.compiler.is_exporting():
        raise RuntimeError(
            "MoE: torch.export cannot keep the balancing loss in backward (an exported program "
            "keeps only the forward of the autograd Function that attaches it): export in eval "
            "mode (moe.eval()), or build the layer with aux_loss_in_backward=False"
        )
    return AttachLoss.apply(output, loss)


class AttachLoss(torch.autograd.Function):
    """Return ``output`` unchanged; its backward also starts ``loss``'s backward with gradient 1.

    So that a scaled auxiliary loss reaches the router without the user adding it to the
    training loss (as Megatron's and DeepSeek's reference code do). The result is a view
    of ``output``: attach to a tensor nobody modifies in place (the routing weights).
    """

    @staticmethod
    def forward(ctx, output, loss):  # noqa: ANN001, ANN205
        ctx.loss_shape = loss.shape
        ctx.loss_dtype, ctx.loss_device = loss.dtype, loss.device
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad_output):  # noqa: ANN001, ANN205
        return grad_output, torch.ones(ctx.loss_shape, dtype=ctx.loss_dtype, device=ctx.loss_device)


def correction_bias_step(load: torch.Tensor, rate: float, center: bool = False) -> torch.Tensor:
    """DeepSeek-V3's auxiliary-loss-free update: ``rate * sign(mean(load) - load_e)`` per
    expert; ``center``: minus the step's mean over experts (torchtitan's rule)."""
    load = load.to(torch.float32)
    step = rate * torch.sign(load.mean() - load)
    return step - step.mean() if center else step
