"""The ``MoE`` layer's configuration: the activation table, and its attributes (fixed at
construction, or validated when assigned) with the ``repr`` they give."""

from __future__ import annotations

from typing import NamedTuple

from ..basic.activations import GEGLU, ClampedSwiGLU, SReLU, SwiGLU
from ..basic.scaled_activations import ScaledClampedSwiGLU, ScaledGEGLU, ScaledSReLU, ScaledSwiGLU
from ..core.op import fixed_at_construction as fixed
from ..kernels.activation import ACTIVATIONS, EXPERT_BLOCK_KINDS
from . import options as opt
from .options import per_call


class MoEActivation(NamedTuple):
    """The op classes of one activation kind of the expert block."""

    scaled: type  # the routing weight applied with the activation (before fc2)
    unscaled: type  # for ``scale_after_fc2`` and the shared experts
    fc1_factor: int  # fc1 outputs per ffn unit: 2 for gated kinds


#: activation name -> its op classes, for every kind of the fused expert block in the
#: activation table
MOE_ACTIVATIONS = {
    scaled.kind: MoEActivation(scaled, unscaled, 2 if ACTIVATIONS[scaled.kind].gated else 1)
    for scaled, unscaled in (
        (ScaledSwiGLU, SwiGLU),
        (ScaledGEGLU, GEGLU),
        (ScaledClampedSwiGLU, ClampedSwiGLU),
        (ScaledSReLU, SReLU),
    )
    if scaled.kind in EXPERT_BLOCK_KINDS
}


class MoEAttributes:
    """``MoE``'s configuration attributes (a mixin of :class:`~fusible_ops.MoE`)."""

    activation_kwargs = fixed(
        "activation_kwargs", "The activation's options (a read-only view).",
        lambda self: opt.read_only_kwargs(self._activation_kwargs),
    )  # fmt: skip
    score = fixed("score", "The router's score function.", lambda self: self.routing.score)
    renormalize = fixed(
        "renormalize", "Whether the top-k weights sum to 1 per token.", lambda self: self.routing.renormalize
    )
    ep_rank = fixed(
        "ep_rank", "This process's rank in the expert-parallel group (0 without one).",
        lambda self: 0 if self.expert_parallel is None else self.expert_parallel.rank,
    )  # fmt: skip
    ep_size = fixed(
        "ep_size", "Ranks in the expert-parallel group (1 without one).",
        lambda self: 1 if self.expert_parallel is None else self.expert_parallel.world_size,
    )  # fmt: skip

    router_jitter = per_call("router_jitter", lambda self, v: opt.check_jitter(v), "Router input jitter.")
    aux_loss_coeff = per_call(
        "aux_loss_coeff", lambda self, v: opt.check_coeff("aux_loss_coeff", v), "Balancing loss scale."
    )
    z_loss_coeff = per_call(
        "z_loss_coeff", lambda self, v: opt.check_coeff("z_loss_coeff", v), "z-loss scale."
    )
    bias_update_rate = per_call(
        "bias_update_rate", lambda self, v: opt.check_coeff("bias_update_rate", v), "aux_free bias step."
    )
    aux_loss_in_backward = per_call(
        "aux_loss_in_backward", lambda self, v: opt.check_flag("aux_loss_in_backward", v),
        "Whether the scaled losses reach the router in backward.",
    )  # fmt: skip
    capacity_factor = per_call(
        "capacity_factor", lambda self, v: opt.check_capacity(v, self.num_experts),
        "Per-expert capacity factor, or None (dropless).",
    )  # fmt: skip

    def extra_repr(self) -> str:
        parts = [
            f"hidden_size={self.hidden_size}, ffn_hidden_size={self.ffn_hidden_size}, "
            f"num_experts={self.num_experts}, top_k={self.top_k}, activation={self.activation!r}, "
            f"score={self.routing.score!r}, renormalize={self.routing.renormalize}, ep_size={self.ep_size}"
        ]
        if self.routing.expert_groups is not None:
            parts.append(
                f"expert_groups={self.routing.expert_groups}, topk_groups={self.routing.topk_groups}"
            )
        if self.routing.routed_scaling_factor != 1.0:
            parts.append(f"routed_scaling_factor={self.routing.routed_scaling_factor}")
        if self.scale_after_fc2:
            parts.append("scale_after_fc2=True")
        if self.load_balancing != "none":
            parts.append(f"load_balancing={self.load_balancing!r}")
        if self.capacity_factor is not None:
            parts.append(f"capacity_factor={self.capacity_factor}")
        return ", ".join(parts)


#: read-only attributes stored as ``_<name>``, with their docstrings
STORED_FIXED = {
    "hidden_size": "Input and output features.",
    "ffn_hidden_size": "Hidden features of each routed expert.",
    "num_experts": "Routed experts, over all expert-parallel ranks.",
    "num_local_experts": "Routed experts on this rank.",
    "top_k": "Experts per token.",
    "activation": "The experts' activation kind.",
    "scale_after_fc2": "Whether the routing weight scales fc2's output.",
    "load_balancing": "The balancing mode.",
    "balance_group": "The process group the balancing statistics are summed over.",
    "ep_mesh": "The expert-parallel DeviceMesh, or None.",
    "expert_parallel": "The ExpertParallel of ``ep_group``/``ep_mesh``, or None.",
    "routing": "The router's RoutingConfig.",
}
for _name, _doc in STORED_FIXED.items():
    setattr(MoEAttributes, _name, fixed(_name, _doc))
