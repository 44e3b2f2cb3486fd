"""The ``MoE`` layer: router, routing, the fused expert block, shared experts, load balancing,
and optional expert parallelism."""

from __future__ import annotations

import torch
from torch import nn

from ..basic.grouped_linear import GroupedLinear
from ..basic.linear import BasicLinear
from ..basic.scale import Scale
from ..core.dtypes import compute_dtype
from ..core.state_dict_checks import CheckedLoadStateDict
from ..fuser.sequential import Sequential
from ..recipes.context import check_recipe
from ..recipes.recipes import Recipe
from . import balance
from . import options as opt
from .attributes import MOE_ACTIVATIONS, MoEActivation, MoEAttributes  # noqa: F401 (public here)
from .router import RoutingConfig, route
from .routing import ExpertPlacement, combine_sorted, permute, sort_by_expert, unpermute
from .statistics import KEEP_DTYPE_BUFFERS, MoEStatistics


class MoE(MoEAttributes, MoEStatistics, CheckedLoadStateDict, nn.Module):
    """Mixture-of-Experts MLP: a drop-in replacement for a transformer MLP.

    Per token ``x``, with routing weights ``p_e`` of the top-k experts (docs/moe.md)::

        y = sum_e (p_e * act(x @ W1_e.T + b1_e)) @ W2_e.T + b2_e            (default)
        y = sum_e p_e * (act(x @ W1_e.T + b1_e) @ W2_e.T + b2_e)            (scale_after_fc2)
        y += shared(x) [* sigmoid(x @ w_gate)]                    (shared_ffn_hidden_size > 0)

    Submodules: ``router`` (``nn.Linear(hidden, num_experts)``), ``experts``, a
    ``fusible_ops.Sequential`` of ``GroupedLinear`` (weight ``[local_experts, fc1_out,
    hidden]``, gate half first for gated activations unless ``glu_interleave_size`` says
    otherwise), the activation, ``GroupedLinear`` (``[local_experts, hidden, ffn]``) and,
    with ``scale_after_fc2``, ``Scale``; optionally ``shared_experts`` and
    ``shared_expert_gate``.

    Args:
        hidden_size: ``H``, the input and output features; a positive int.
        ffn_hidden_size: the hidden features of each routed expert; a positive int (fc1
            has ``2 * ffn_hidden_size`` outputs for gated activations).
        num_experts: ``E``, the routed experts over all expert-parallel ranks; a positive int.
        top_k: experts per token, an int in ``[1, num_experts]``.
        activation: the experts' activation: ``"swiglu"`` (default), ``"geglu"``,
            ``"clamped_swiglu"`` or ``"srelu"``.
        activation_kwargs: a mapping of options for the activation op, or None
            (default): ``limit`` (positive), ``alpha`` and ``glu_linear_offset``, all
            finite (``clamped_swiglu`` only); ``glu_interleave_size`` (gated kinds; a
            positive int dividing ``ffn_hidden_size`` and ``shared_ffn_hidden_size``).
            Keys the activation does not take are refused. Copied at construction.
        bias: per-expert biases on fc1 and fc2. Default: False.
        score: the router's score function, ``"softmax"`` (default) or ``"sigmoid"``.
        renormalize: divide the top-k weights by their sum per token. Default: True.
        scale_after_fc2: the routing weight scales the whole expert output, fc2's bias
            included (GPT-OSS), instead of the activation. Default: False.
        router_bias: a bias on the router's linear layer. Default: False.
        expert_groups: group-limited routing (DeepSeek-V3): the number of expert groups,
            a positive int dividing ``num_experts``; given with ``topk_groups``. Default: None.
        topk_groups: how many of the best groups a token may choose experts from, an int
            in ``[1, expert_groups]`` whose groups hold at least ``top_k`` experts;
            given with ``expert_groups``. Default: None.
        score_correction_bias: keep a buffer ``score_correction_bias`` ``[num_experts]``
            (zeros at start) added to the scores to select experts, not to weigh them
            (DeepSeek-V3). Always kept with ``load_balancing="aux_free"``. Default: False.
        routed_scaling_factor: multiplies the routing weights; a positive finite number.
            Default: 1.0.
        shared_ffn_hidden_size: an int ``>= 0``; when positive, ``shared_experts`` (a
            dense MLP with this hidden size and the same activation) runs on every
            token and its output is added. Default: 0.
        shared_expert_gate: scale the shared experts' output by ``sigmoid(x @ w_gate)``
            (Qwen2-MoE); needs ``shared_ffn_hidden_size > 0``. Default: False.
        router_jitter: in training, the router's input is multiplied by uniform noise in
            ``[1 - router_jitter, 1 + router_jitter]``; a number in ``[0, 1)``. Default: 0.0.
        load_balancing: ``"none"`` (default), ``"aux_loss"`` (Switch/GShard),
            ``"seq_aux_loss"`` (DeepSeek-V3, per sequence of an input ``[..., S, H]``)
            or ``"aux_free"`` (DeepSeek-V3: the correction bias, moved by
            :meth:`update_score_correction_bias`).
        aux_loss_coeff: the scale of the balancing loss; a finite number ``>= 0``.
            Default: 1e-2.
        z_loss_coeff: the scale of the router z-loss (computed only when positive); a
            finite number ``>= 0``. Default: 0.0.
        bias_update_rate: the step of :meth:`update_score_correction_bias`; a finite
            number ``>= 0``. Default: 1e-3.
        aux_loss_in_backward: in training, the scaled losses reach the router's gradient
            through the backward of the output; with False nothing is attached and
            ``aux_losses`` is for you to add to the loss. Default: True.
        balance_group: None (default), a ``torch.distributed`` process group or a 1-D
            ``DeviceMesh``: the balancing statistics are summed over its ranks.
        capacity_factor: None (default: dropless), or a number in ``(0, num_experts]``:
            of this rank's ``T`` tokens, each expert keeps at most
            ``ceil(capacity_factor * T * top_k / E)`` rows (every token's first choice
            before any second choice, then token order); the rest are dropped and add
            nothing.
        dtype: the parameters' dtype: None (torch's default), ``torch.float16``,
            ``torch.bfloat16``, ``torch.float32`` or ``torch.float64``.
        device: where the parameters are made. Default: torch's default device.
        ep_group: a ``torch.distributed`` process group of ``W`` ranks for expert
            parallelism (``num_experts`` divisible by ``W``), or None (default). Its
            expert parameters are local tensors, which ``torch.distributed.checkpoint``
            refuses; use ``ep_mesh`` for that.
        ep_mesh: a 1-D ``DeviceMesh`` for expert parallelism (e.g. ``world_mesh["ep"]``),
            of the parameters' device type, with ``num_experts`` divisible by its size;
            or None (default). Not together with ``ep_group``.
        recipe: the low-precision recipe of the experts and shared experts (a
            ``fusible_ops.recipes`` recipe), or None (default) to follow the
            :func:`fusible_ops.quantized` context.

    Shape:
        input: ``[..., hidden_size]``, a dense floating-point tensor of the parameters'
            dtype (any floating dtype under autocast), on their device.
        output: ``[..., hidden_size]``, the input's shape (and dtype, outside autocast).

    With ``ep_group`` or ``ep_mesh`` (``W`` ranks) rank ``r`` holds experts
    ``[r*L, (r+1)*L)``, ``L = num_experts / W``; tokens travel by all-to-all. With
    ``ep_mesh`` the expert weights and biases are DTensors ``Shard(0)`` of global shape
    ``[num_experts, ...]`` (the kernels compute on the local shards), so ``state_dict``,
    optimizers and ``torch.distributed.checkpoint`` see every expert once.
    The router and shared experts are replicated: reduce their gradients like any
    data-parallel parameter.

    After a training forward, ``aux_losses`` holds the unscaled balancing losses
    (``"load_balancing"``, ``"z_loss"``) as detached scalars. After every forward,
    ``last_expert_load`` (``[E]`` int64) holds the rows routed to each expert (dropped
    ones included) and, with ``capacity_factor``, ``last_dropped_load`` the dropped ones.
    They are kept in non-persistent buffers written in place, so that a compiled,
    activation-checkpointed forward records them too (fusible_ops/moe/statistics.py).

    The options the layer is built for are read-only attributes after construction;
    those read on every call (``router_jitter``, ``aux_loss_coeff``, ``z_loss_coeff``,
    ``bias_update_rate``, ``aux_loss_in_backward``, ``capacity_factor``) may be
    assigned, checked as in the constructor.

    Raises:
        ValueError: an argument outside the ranges above (the message names it).
        TypeError: ``recipe`` is not a recipe.
        RuntimeError: ``ep_group`` given while ``torch.distributed`` is not initialised.
    """

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        num_experts: int,
        top_k: int,
        *,
        activation: str = "swiglu",
        activation_kwargs: dict | None = None,
        bias: bool = False,
        score: str = "softmax",
        renormalize: bool = True,
        scale_after_fc2: bool = False,
        router_bias: bool = False,
        expert_groups: int | None = None,
        topk_groups: int | None = None,
        score_correction_bias: bool = False,
        routed_scaling_factor: float = 1.0,
        shared_ffn_hidden_size: int = 0,
        shared_expert_gate: bool = False,
        router_jitter: float = 0.0,
        load_balancing: str = "none",
        aux_loss_coeff: float = 1e-2,
        z_loss_coeff: float = 0.0,
        bias_update_rate: float = 1e-3,
        aux_loss_in_backward: bool = True,
        balance_group: object | None = None,
        capacity_factor: float | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        ep_group: object | None = None,
        ep_mesh: object | None = None,
        recipe: Recipe | None = None,
    ) -> None:
        super().__init__()
        check_recipe("MoE", recipe)
        for name, value in (("hidden_size", hidden_size), ("ffn_hidden_size", ffn_hidden_size)):
            if not opt.is_int(value) or value < 1:
                raise ValueError(f"MoE: {name} must be a positive int, got {value!r}")
        if not opt.is_int(num_experts) or num_experts < 1:
            raise ValueError(f"MoE: num_experts must be a positive int, got {num_experts!r}")
        if not opt.is_int(top_k) or not 1 <= top_k <= num_experts:
            raise ValueError(f"MoE: top_k must be an int in [1, num_experts={num_experts}], got {top_k!r}")
        if activation not in MOE_ACTIVATIONS:
            raise ValueError(f"MoE: activation must be one of {sorted(MOE_ACTIVATIONS)}, got {activation!r}")
        opt.check_options(shared_ffn_hidden_size, shared_expert_gate, routed_scaling_factor)
        self._routing = RoutingConfig(
            num_experts, top_k, score, renormalize, expert_groups, topk_groups, routed_scaling_factor
        )
        opt.check_balancing(load_balancing)
        opt.check_dtype(dtype)
        for name, flag in (
            ("bias", bias), ("scale_after_fc2", scale_after_fc2), ("router_bias", router_bias),
            ("score_correction_bias", score_correction_bias), ("shared_expert_gate", shared_expert_gate),
        ):  # fmt: skip
            opt.check_flag(name, flag)
        kinds = MOE_ACTIVATIONS[activation]
        act_class = kinds.unscaled if scale_after_fc2 else kinds.scaled
        self._activation_kwargs = opt.check_activation_kwargs(
            activation_kwargs, act_class, (ffn_hidden_size, shared_ffn_hidden_size or ffn_hidden_size)
        )
        self._num_experts = num_experts
        self.router_jitter = router_jitter
        self.aux_loss_coeff = aux_loss_coeff
        self.z_loss_coeff = z_loss_coeff
        self.bias_update_rate = bias_update_rate
        self.aux_loss_in_backward = aux_loss_in_backward
        self.capacity_factor = capacity_factor
        self._balance_group = opt.as_balance_group(balance_group)

        if ep_mesh is not None:
            if ep_group is not None:
                raise ValueError("MoE: give ep_group or ep_mesh, not both")
            ep_group = opt.ep_group_of(ep_mesh, num_experts, device)
        elif hasattr(ep_group, "get_group"):
            raise ValueError(
                "MoE: ep_group must be a torch.distributed process group; for a DeviceMesh "
                "(e.g. world_mesh['ep']) pass ep_mesh= instead, which also makes the experts DTensors"
            )
        self._ep_mesh = ep_mesh
        self._expert_parallel = None
        num_local_experts = num_experts
        if ep_group is not None:
            from .expert_parallel import ExpertParallel

            self._expert_parallel = ExpertParallel(num_experts, ep_group)
            num_local_experts = self.expert_parallel.num_local_experts

        fixed_values = {
            "hidden_size": hidden_size, "ffn_hidden_size": ffn_hidden_size, "top_k": top_k,
            "num_local_experts": num_local_experts, "activation": activation,
            "scale_after_fc2": scale_after_fc2, "load_balancing": load_balancing,
        }  # fmt: skip
        vars(self).update({f"_{name}": value for name, value in fixed_values.items()})
        self._init_statistics(num_experts, device)

        factory = {"dtype": dtype, "device": device}
        self.router = nn.Linear(hidden_size, num_experts, bias=router_bias, **factory)
        fc1_out = kinds.fc1_factor * ffn_hidden_size
        self.experts = Sequential(
            GroupedLinear(num_local_experts, hidden_size, fc1_out, bias=bias, **factory),
            opt.make_activation(act_class, self._activation_kwargs),
            GroupedLinear(num_local_experts, ffn_hidden_size, hidden_size, bias=bias, **factory),
            *([Scale()] if scale_after_fc2 else []),
            recipe=recipe,
        )
        # so that checkpoint helpers given only the experts Sequential map the right experts
        self.experts.expert_placement = ExpertPlacement(
            self.ep_rank * num_local_experts, num_local_experts, num_experts
        )
        if ep_mesh is not None:
            _shard_experts(self.experts, ep_mesh)
        elif ep_group is not None:
            from .ep_checkpoint import refuse_distributed_checkpoint

            refuse_distributed_checkpoint(self.experts)
        if score_correction_bias or load_balancing == "aux_free":
            self.register_buffer("score_correction_bias", torch.zeros(num_experts, device=device))
            # counted over forwards in training, consumed by update_score_correction_bias()
            self.register_buffer(
                "expert_load_since_update", torch.zeros(num_experts, dtype=torch.long, device=device),
                persistent=False,
            )  # fmt: skip
        else:
            self.score_correction_bias = None
        self.shared_experts = self.shared_expert_gate = None
        if shared_ffn_hidden_size:
            s = shared_ffn_hidden_size
            self.shared_experts = Sequential(
                BasicLinear(hidden_size, kinds.fc1_factor * s, **factory),
                opt.make_activation(kinds.unscaled, self._activation_kwargs),
                BasicLinear(s, hidden_size, **factory),
                recipe=recipe,
            )
            if shared_expert_gate:
                self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False, **factory)

    def _apply(self, fn, recurse: bool = True):  # noqa: ANN001, ANN202
        # moe.to(torch.bfloat16) moves the correction bias but keeps it float32: a dtype cast
        # would round away the small steps of update_score_correction_bias (and the recorded
        # losses stay float64, which holds any loss dtype exactly)
        names = ("score_correction_bias", *KEEP_DTYPE_BUFFERS)
        before = {name: self._buffers.get(name) for name in names}
        super()._apply(fn, recurse)
        for name, buffer in before.items():
            moved = self._buffers.get(name)
            if buffer is not None and moved.dtype != buffer.dtype:
                self._buffers[name] = buffer.to(moved.device)
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Route each token to its top-k experts and sum their outputs (plus the shared experts').

        In training, also records the balancing statistics and attaches the scaled
        losses to the backward (see the class docstring).

        Args:
            x: the tokens, ``[..., hidden_size]``.

        Returns:
            ``[..., hidden_size]``, the shape of ``x``.

        Raises:
            ValueError: ``x`` is not a dense floating-point ``[..., hidden_size]`` tensor
                of the parameters' dtype (any floating dtype under autocast).
        """
        # submodules and buffers read from their dicts once (this runs on every call)
        router = self._modules["router"]
        hidden_size, num_experts = self._hidden_size, self._num_experts
        opt.check_input(x, hidden_size, router.weight)
        tokens = x if x.dim() == 2 else x.reshape(-1, hidden_size)
        router_input = tokens
        training = self.training
        if training and self._router_jitter > 0:  # the per-call options' checked values
            noise = torch.empty_like(tokens).uniform_(1.0 - self.router_jitter, 1.0 + self.router_jitter)
            router_input = tokens * noise
        logits = router(router_input)
        routing = route(logits, self._routing, self._buffers.get("score_correction_bias"))
        expert_ids = routing.expert_ids
        # the router's ids lie in [0, E): the load is the rows per expert of the sorted rows
        load = balance.expert_load(expert_ids, num_experts, in_range=True)
        dropped = dropped_load = None
        if self._capacity_factor is not None:
            dropped = balance.capacity_dropped(expert_ids, num_experts, self.capacity_factor)
            dropped_load = balance.expert_load(torch.where(dropped, expert_ids, num_experts), num_experts)
        self._record_load(load, dropped_load)  # in place: traceable inside a checkpointed region

        weights = routing.weights
        if training:
            weights = self._balance(weights, logits, routing, load, x.shape)
        out = self._routed_experts(tokens, expert_ids, weights, dropped, load)
        if self.shared_experts is not None:
            shared = self.shared_experts(tokens)
            if self.shared_expert_gate is not None:
                shared = shared * torch.sigmoid(self.shared_expert_gate(tokens))
            out = out + shared
        return out if x.dim() == 2 else out.reshape(x.shape)

    def _routed_experts(
        self,
        tokens: torch.Tensor,
        expert_ids: torch.Tensor,
        weights: torch.Tensor,
        dropped: torch.Tensor | None,
        load: torch.Tensor,
    ) -> torch.Tensor:
        """``[T, H]``: the routed experts' outputs summed per token (dropped rows add nothing).
        ``load``: the rows routed to each expert (:func:`~fusible_ops.moe.balance.expert_load`)."""
        if self._expert_parallel is None:
            experts = self._modules["experts"]
            if dropped is None:  # nothing to drop: the router's choice sorted as it is
                perm = sort_by_expert(tokens, expert_ids, weights, load)
                y = experts(*self._expert_args(perm.rows, perm.split_sizes, perm.probs))
                return combine_sorted(y, perm.token_index, tokens.shape[0])
            perm = permute(tokens, expert_ids, self.num_experts, weights, dropped=dropped)
            y = experts(*self._expert_args(perm.rows, perm.split_sizes, perm.probs))
            return unpermute(y, perm.token_index, tokens.shape[0])
        from ..core.buffers import OUTPUT_BUFFER_KEY

        ep = self.expert_parallel
        rows, row_probs, state = ep.dispatch(tokens, expert_ids, weights, dropped=dropped)
        if torch.compiler.is_compiling():  # functional collectives: no caller buffer
            y = self.experts(*self._expert_args(rows, state.local_split_sizes, row_probs))
            return ep.combine(y, state)
        splits = state.local_split_sizes
        op_kwargs = None
        if not self.scale_after_fc2:
            # fc2 writes straight into what the return all-to-all sends (in its compute dtype)
            send_back = ep.output_buffer(
                state, self.hidden_size, compute_dtype(rows.dtype, rows.device), rows.device
            )
            op_kwargs = {2: {OUTPUT_BUFFER_KEY: send_back}}
        y = self.experts(*self._expert_args(rows, splits, row_probs), op_kwargs=op_kwargs)
        return ep.combine(y, state)

    def _expert_args(self, rows: torch.Tensor, splits: object, probs: torch.Tensor) -> tuple:
        if self.scale_after_fc2:  # GroupedLinear, act, GroupedLinear, Scale
            return rows, splits, splits, probs
        return rows, splits, probs, splits  # GroupedLinear, scaled act, GroupedLinear

    def _balance(
        self, weights: torch.Tensor, logits, routing, load: torch.Tensor, input_shape
    ) -> torch.Tensor:
        """Record the balancing statistics and losses; attach the scaled losses to the backward
        of the routing ``weights`` (Megatron's place: the layer's output stays an ordinary
        tensor that may be modified in place)."""
        group, mode = self.balance_group, self.load_balancing
        if mode == "none" and not self._z_loss_coeff > 0:
            self._record_losses({})
            return weights
        losses, scaled = {}, []
        if mode == "aux_loss":
            losses["load_balancing"] = balance.aux_loss(routing.normalized_scores, load, self.top_k, group)
        elif mode == "seq_aux_loss":
            batch, seq = _sequences(input_shape)
            losses["load_balancing"] = balance.seq_aux_loss(
                routing.normalized_scores.reshape(batch, seq, self.num_experts),
                routing.expert_ids.reshape(batch, seq, self.top_k),
                self.top_k,
                group,
            )
        elif mode == "aux_free" and not balance.is_recomputing():
            self.expert_load_since_update += load
        if "load_balancing" in losses:
            scaled.append(self.aux_loss_coeff * losses["load_balancing"])
        if self.z_loss_coeff > 0:
            losses["z_loss"] = balance.z_loss(logits, group)
            scaled.append(self.z_loss_coeff * losses["z_loss"])
        self._record_losses(losses)
        if self.aux_loss_in_backward and scaled and torch.is_grad_enabled():
            total = sum(scaled[1:], scaled[0])
            if total.requires_grad:
                weights = balance.attach_loss(weights, total)
        return weights

    @torch.no_grad()
    def scale_expert_gradients(self, factor: float | None = None) -> None:
        """Multiply the routed experts' gradients by ``factor`` (default ``1 / ep_size``).

        The gradient scaling rule of expert parallelism under data parallelism: an
        expert's gradient already sums the contributions of its EP group's tokens (the
        all-to-all brings them), so averaging it over the data-parallel ranks alone (what
        ``fully_shard`` over the dp mesh does) leaves it ``ep_size`` times the average
        over all ``dp * ep`` ranks that the replicated parameters get. Call after
        backward, before the optimizer step (on NCCL, ``set_gradient_divide_factor(dp *
        ep)`` on the experts' FSDP module does the same inside the reduce-scatter; gloo
        has no PREMUL_SUM).

        Args:
            factor: the multiplier, or None (default) for ``1 / ep_size``.
        """
        factor = 1.0 / self.ep_size if factor is None else factor
        for p in self.experts.parameters():
            if p.grad is not None:
                p.grad.mul_(factor)

    @torch.no_grad()
    def update_score_correction_bias(self, *, center: bool = False) -> None:
        """Auxiliary-loss-free balancing step (DeepSeek-V3); call after ``optimizer.step()``.

        Moves each expert's ``score_correction_bias`` by ``bias_update_rate * sign(mean
        load - load_e)`` over the tokens counted since the last call (summed over
        ``balance_group``), then resets the counts. E.g.
        ``optimizer.register_step_post_hook(lambda *_: moe.update_score_correction_bias())``.

        Args:
            center: subtract the step's mean over experts first, so the biases keep their
                sum (torchtitan's rule, for runs compared with torchtitan's).

        Raises:
            RuntimeError: ``load_balancing`` is not ``"aux_free"``.
        """
        if self.load_balancing != "aux_free":
            raise RuntimeError(
                f"MoE.update_score_correction_bias: load_balancing is {self.load_balancing!r}, not 'aux_free'"
            )
        load = balance.global_sum(self.expert_load_since_update.clone(), self.balance_group)
        self.score_correction_bias += balance.correction_bias_step(load, self.bias_update_rate, center).to(
            self.score_correction_bias.dtype
        )
        self.expert_load_since_update.zero_()


def _shard_experts(experts: Sequential, mesh: object) -> None:
    """Make every expert parameter a DTensor ``Shard(0)`` of global shape ``[num_experts, ...]``
    from this rank's local experts (no communication)."""
    from torch.distributed.tensor import DTensor, Shard

    for op in experts:
        if not isinstance(op, GroupedLinear):
            continue
        for name in ("weight", "bias"):
            local = getattr(op, name)
            if local is not None:
                sharded = DTensor.from_local(local.detach(), mesh, [Shard(0)], run_check=False)
                setattr(op, name, nn.Parameter(sharded, requires_grad=local.requires_grad))


def _sequences(input_shape: torch.Size) -> tuple[int, int]:
    """``(sequences, tokens per sequence)`` of an input ``[..., S, H]`` (a 2-D input is one sequence)."""
    if len(input_shape) < 3:
        return 1, torch.Size(input_shape[:-1]).numel()
    return torch.Size(input_shape[:-2]).numel(), input_shape[-2]
