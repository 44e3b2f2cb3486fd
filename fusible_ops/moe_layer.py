"""The ``MoE`` layer: router, routing, the fused expert block, and optional expert parallelism."""

from __future__ import annotations

import torch
from torch import nn

from .basic.grouped_linear import GroupedLinear
from .basic.scaled_activations import ScaledClampedSwiGLU, ScaledGEGLU, ScaledSReLU, ScaledSwiGLU
from .dtypes import compute_dtype
from .kernels.activation import ACTIVATIONS, EXPERT_BLOCK_KINDS
from .moe import SCORE_FUNCTIONS, ExpertPlacement, permute, topk_route, unpermute
from .sequential import Sequential

#: activation name -> (scaled activation class, fc1 outputs per ffn unit), for every
#: kind of the fused expert block in the activation table
MOE_ACTIVATIONS = {
    cls.kind: (cls, 2 if ACTIVATIONS[cls.kind].gated else 1)
    for cls in (ScaledSwiGLU, ScaledGEGLU, ScaledClampedSwiGLU, ScaledSReLU)
    if cls.kind in EXPERT_BLOCK_KINDS
}


class MoE(nn.Module):
    """Mixture-of-Experts MLP: a drop-in replacement for a transformer MLP.

    ``y = sum_{e in topk(x)} (p_e * act(x @ W1_e.T + b1_e)) @ W2_e.T + b2_e`` per token:
    the routing weight ``p_e`` scales the activation, so fc2's bias is added unscaled.

    Submodules: ``router`` (``nn.Linear``, weight ``[num_experts, hidden]``, no bias) and
    ``experts``, a ``fusible_ops.Sequential`` of ``GroupedLinear`` (weight
    ``[local_experts, fc1_out, hidden]``, gate half first for gated activations),
    the probability-scaled activation, and ``GroupedLinear`` (weight
    ``[local_experts, hidden, ffn]``).

    With ``ep_group`` (a ``torch.distributed`` group of ``W`` ranks) rank ``r`` holds
    experts ``[r*L, (r+1)*L)``, ``L = num_experts / W``; tokens travel by all-to-all.
    The router is replicated: reduce its gradient like any data-parallel parameter.

    Input ``[..., hidden]``; output the same shape and dtype.
    """

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        num_experts: int,
        top_k: int,
        *,
        activation: str = "swiglu",
        bias: bool = False,
        score: str = "softmax",
        renormalize: bool = True,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        ep_group: object | None = None,
    ) -> None:
        super().__init__()
        for name, value in (("hidden_size", hidden_size), ("ffn_hidden_size", ffn_hidden_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"MoE: {name} must be a positive int, got {value!r}")
        if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
            raise ValueError(f"MoE: num_experts must be a positive int, got {num_experts!r}")
        if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
            raise ValueError(f"MoE: top_k must be an int in [1, num_experts={num_experts}], got {top_k!r}")
        if activation not in MOE_ACTIVATIONS:
            raise ValueError(f"MoE: activation must be one of {sorted(MOE_ACTIVATIONS)}, got {activation!r}")
        if score not in SCORE_FUNCTIONS:
            raise ValueError(f"MoE: score must be one of {SCORE_FUNCTIONS}, got {score!r}")

        self.expert_parallel = None
        num_local_experts = num_experts
        if ep_group is not None:
            from .parallel.expert_parallel import ExpertParallel

            self.expert_parallel = ExpertParallel(num_experts, ep_group)
            num_local_experts = self.expert_parallel.num_local_experts

        self.hidden_size = hidden_size
        self.ffn_hidden_size = ffn_hidden_size
        self.num_experts = num_experts
        self.num_local_experts = num_local_experts
        self.top_k = top_k
        self.activation = activation
        self.score = score
        self.renormalize = renormalize

        act_class, fc1_factor = MOE_ACTIVATIONS[activation]
        factory = {"dtype": dtype, "device": device}
        self.router = nn.Linear(hidden_size, num_experts, bias=False, **factory)
        self.experts = Sequential(
            GroupedLinear(num_local_experts, hidden_size, fc1_factor * ffn_hidden_size, bias=bias, **factory),
            act_class(),
            GroupedLinear(num_local_experts, ffn_hidden_size, hidden_size, bias=bias, **factory),
        )
        # so that checkpoint helpers given only the experts Sequential map the right experts
        self.experts.expert_placement = ExpertPlacement(
            self.ep_rank * num_local_experts, num_local_experts, num_experts
        )

    @property
    def ep_rank(self) -> int:
        return 0 if self.expert_parallel is None else self.expert_parallel.rank

    @property
    def ep_size(self) -> int:
        return 1 if self.expert_parallel is None else self.expert_parallel.world_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[..., hidden]`` -> ``[..., hidden]``."""
        if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[-1] != self.hidden_size:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"MoE: input must be [..., {self.hidden_size}], got {shape}")
        weight = self.router.weight
        if x.dtype != weight.dtype and not torch.is_autocast_enabled(x.device.type):
            raise ValueError(
                f"MoE: input dtype {x.dtype} does not match the parameters' dtype {weight.dtype}; "
                "convert one of them (e.g. moe.to(dtype)) or run under torch.autocast"
            )
        tokens = x.reshape(-1, self.hidden_size)
        probs, expert_ids = topk_route(
            self.router(tokens), self.top_k, score=self.score, renormalize=self.renormalize
        )
        if self.expert_parallel is None:
            perm = permute(tokens, expert_ids, self.num_experts, probs)
            y = self.experts(perm.rows, perm.split_sizes, perm.probs, perm.split_sizes)
            out = unpermute(y, perm.token_index, tokens.shape[0])
        else:
            from .buffers import OUTPUT_BUFFER_KEY

            ep = self.expert_parallel
            rows, row_probs, state = ep.dispatch(tokens, expert_ids, probs)
            # fc2 writes in its compute dtype (autocast's dtype under autocast)
            send_back = ep.output_buffer(
                state, self.hidden_size, compute_dtype(rows.dtype, rows.device), rows.device
            )
            splits = state.local_split_sizes
            y = self.experts(rows, splits, row_probs, splits, op_kwargs={2: {OUTPUT_BUFFER_KEY: send_back}})
            out = ep.combine(y, state)
        return out.reshape(x.shape)

    def extra_repr(self) -> str:
        return (
            f"hidden_size={self.hidden_size}, ffn_hidden_size={self.ffn_hidden_size}, "
            f"num_experts={self.num_experts}, top_k={self.top_k}, activation={self.activation!r}, "
            f"score={self.score!r}, renormalize={self.renormalize}, ep_size={self.ep_size}"
        )
