"""Router math of the ``MoE`` layer: scores, group-limited top-k selection, routing weights.

Shapes: ``T`` tokens, ``E`` experts, ``k`` experts per token, ``G`` expert groups.
Everything here is differentiable w.r.t. the logits and reads no device value on the host.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from .routing import SCORE_FUNCTIONS, _renormalize


@dataclass(frozen=True)
class RoutingConfig:
    """How a router's logits become ``(weights, expert_ids)``; validated on construction."""

    num_experts: int
    top_k: int
    score: str = "softmax"
    renormalize: bool = True
    #: DeepSeek-V3 group-limited routing: experts ``[g*E/G, (g+1)*E/G)`` form group ``g``
    expert_groups: int | None = None
    #: how many of the best groups a token may choose experts from
    topk_groups: int | None = None
    routed_scaling_factor: float = 1.0

    def __post_init__(self) -> None:
        e, k = self.num_experts, self.top_k
        if self.score not in SCORE_FUNCTIONS:
            raise ValueError(f"MoE: score must be one of {SCORE_FUNCTIONS}, got {self.score!r}")
        if (self.expert_groups is None) != (self.topk_groups is None):
            raise ValueError("MoE: expert_groups and topk_groups go together (give both or neither)")
        if self.expert_groups is not None:
            g, tg = self.expert_groups, self.topk_groups
            if not _positive_int(g) or e % g:
                raise ValueError(f"MoE: expert_groups={g!r} must be a positive int dividing num_experts={e}")
            if not _positive_int(tg) or tg > g:
                raise ValueError(f"MoE: topk_groups={tg!r} must be an int in [1, expert_groups={g}]")
            if tg * (e // g) < k:
                raise ValueError(
                    f"MoE: topk_groups={tg} groups of {e // g} experts offer {tg * (e // g)} experts, "
                    f"fewer than top_k={k}"
                )
        factor = self.routed_scaling_factor
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0:
            raise ValueError(f"MoE: routed_scaling_factor must be a positive number, got {factor!r}")


class Routing(NamedTuple):
    """What the router chose for each token."""

    #: ``[T, k]`` routing weights (at least float32), differentiable w.r.t. the logits
    weights: torch.Tensor
    #: ``[T, k]`` int64 expert ids, best selection score first
    expert_ids: torch.Tensor
    #: ``[T, E]`` scores that sum to 1 per token (softmax, or normalised sigmoid), for the
    #: balancing losses
    normalized_scores: torch.Tensor


def route(
    logits: torch.Tensor, config: RoutingConfig, correction_bias: torch.Tensor | None = None
) -> Routing:
    """Route ``logits`` ``[T, E]``.

    ``scores = softmax(logits)`` or ``sigmoid(logits)``. Experts are selected by
    ``scores + correction_bias`` (when given; DeepSeek-V3), within the ``topk_groups``
    best groups when grouped (group score: the sum of its two best selection scores);
    weights are the uncorrected scores of the chosen experts, renormalised to sum to 1
    when ``renormalize``, times ``routed_scaling_factor``.
    """
    if logits.dtype in (torch.float16, torch.bfloat16):  # at least float32 (no op when it is)
        logits = logits.float()
    if config.score == "softmax":
        scores = torch.softmax(logits, dim=-1)
        normalized = scores
    else:
        scores = torch.sigmoid(logits)
        normalized = scores / scores.sum(-1, keepdim=True).clamp_min(torch.finfo(scores.dtype).tiny)
    if correction_bias is None and config.expert_groups is None:
        # selected by the scores themselves: topk's values are the weights (what gathering
        # them would give, with the same gradient)
        weights, expert_ids = torch.topk(scores, config.top_k, dim=-1)
    else:
        selection = (
            scores.detach() if correction_bias is None else scores.detach() + correction_bias.to(scores.dtype)
        )
        if config.expert_groups is not None:
            selection = _mask_to_best_groups(selection, config.expert_groups, config.topk_groups)
        expert_ids = torch.topk(selection, config.top_k, dim=-1).indices
        weights = scores.gather(-1, expert_ids)
    if config.renormalize:
        if config.score == "softmax":
            # the chosen softmax scores sum to at least the largest, >= 1 / E: never zero
            weights = weights / weights.sum(dim=-1, keepdim=True)
        else:
            weights = _renormalize(weights)
    if config.routed_scaling_factor != 1.0:
        weights = weights * config.routed_scaling_factor
    return Routing(weights, expert_ids, normalized)


def _mask_to_best_groups(selection: torch.Tensor, groups: int, topk_groups: int) -> torch.Tensor:
    """``selection`` ``[T, E]`` with the experts outside each token's best groups at -inf."""
    tokens, experts = selection.shape
    per_group = selection.reshape(tokens, groups, experts // groups)
    best_two = per_group.topk(min(2, experts // groups), dim=-1).values.sum(-1)  # [T, G]
    keep_groups = torch.zeros_like(best_two, dtype=torch.bool)
    keep_groups.scatter_(1, best_two.topk(topk_groups, dim=-1).indices, True)
    keep = keep_groups.unsqueeze(-1).expand_as(per_group).reshape(tokens, experts)
    return selection.masked_fill(~keep, float("-inf"))


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1
