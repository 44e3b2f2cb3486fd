"""Run torchtitan's MoE experts on fusible-ops (torchtitan 0.3).

torchtitan's ``GroupedExperts`` keeps ``w1_EFD`` (gate, ``[E, F, D]``), ``w3_EFD`` (up,
``[E, F, D]``) and ``w2_EDF`` (down, ``[E, D, F]``); its router, token dispatchers (EP
included), combine and auxiliary-loss-free balancing stay as they are. The experts' math
runs as ``fo.Sequential(GroupedGateUpLinear, SwiGLU, GroupedLinear)``, fused into one
``GroupedMLP`` that reads the gate and up weights where they are: no copy per call.

Two ways in, before the model is parallelized (as torchtitan's own converters)::

    from fusible_ops.integrations import torchtitan as fo_titan
    model_config = fo_titan.convert_config(model_config)  # before build()
    # or, on a built model:
    fo_titan.convert(model)

Parameters, their names, initialisation and sharding rules are torchtitan's (the class is
a subclass of ``GroupedExperts``); state dicts load either way. torchtitan's own experts
cast to bf16 for every GEMM; these compute in the dtype of the tokens they receive, or in
``compute_dtype`` when given (``torch.bfloat16`` reproduces torchtitan's own rounding).
Low precision: ``recipe=`` (a ``fusible_ops.recipes`` recipe, or a torchtitan / torchao
recipe name such as ``"rowwise"``, ``"rowwise_with_gw_hp"`` or ``"mxfp8_rceil"``) runs the
experts' GEMMs quantized by fusible-ops; with None they follow ``fo.quantized``. A model
config that torchtitan's float8 or MXFP8 experts converter already converted keeps that
converter's recipe (``Float8GroupedExperts``: rowwise FP8; ``MXFP8GroupedExperts``: its
``recipe_name``), computed by fusible-ops instead of torchao. A built model whose experts
such a converter made (torchao has rewritten their parameters) is refused, naming it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch

from ..basic import GroupedGateUpLinear, GroupedLinear, SwiGLU
from ..fuser.sequential import Sequential
from ..recipes import recipes as fo_recipes
from ..recipes.context import check_recipe

try:  # torchtitan is an optional extra
    from torchtitan.models.common.moe import GroupedExperts
except ImportError as error:  # pragma: no cover - exercised where torchtitan is absent
    raise ImportError(
        "fusible_ops.integrations.torchtitan needs torchtitan (pip install torchtitan==0.3.0)"
    ) from error

__all__ = ["FusibleGroupedExperts", "convert", "convert_config", "recipe_from_name"]

#: torchtitan's and torchao's recipe names, as fusible-ops recipes of the same semantics
RECIPE_NAMES: dict[str, fo_recipes.Recipe] = {
    "rowwise": fo_recipes.Float8Rowwise(),
    "rowwise_with_gw_hp": fo_recipes.Float8Rowwise(wgrad_high_precision=True),
    "tensorwise": fo_recipes.Float8Tensorwise(),
    "mxfp8_rceil": fo_recipes.MXFP8(scale_rounding="rceil"),
    "mxfp8_floor": fo_recipes.MXFP8(scale_rounding="floor"),
}


def recipe_from_name(recipe: fo_recipes.Recipe | str | None) -> fo_recipes.Recipe | None:
    """A fusible-ops recipe for ``recipe``: itself, or the recipe a torchtitan / torchao
    name stands for (see :data:`RECIPE_NAMES`); raises ``ValueError`` for another name."""
    if not isinstance(recipe, str):
        return check_recipe("fusible_ops.integrations.torchtitan", recipe)
    found = RECIPE_NAMES.get(recipe)
    if found is None:
        raise ValueError(
            f"fusible_ops.integrations.torchtitan: unknown recipe name {recipe!r}; "
            f"known: {', '.join(sorted(RECIPE_NAMES))} (or pass a fusible_ops.recipes recipe)"
        )
    return found


class FusibleGroupedExperts(GroupedExperts):
    """torchtitan's ``GroupedExperts`` computed by fusible-ops' fused expert block.

    Args (``Config``): torchtitan's ``dim``, ``hidden_dim``, ``num_experts``, plus
        ``compute_dtype``: the dtype of the GEMMs; None (default): the tokens' dtype;
        ``recipe``: the low-precision recipe of the GEMMs (a recipe or a torchtitan name,
        see :func:`recipe_from_name`); None (default): ``fo.quantized``'s, if any.

    Shape (``forward``): ``x_RD`` ``[R, D]`` token rows sorted by expert,
    ``num_tokens_per_expert_E`` ``[e]`` rows per (local) expert; returns ``[R, D]`` in
    ``x_RD``'s dtype, unscaled (torchtitan's combine applies the routing scores).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(GroupedExperts.Config):
        """torchtitan's experts config, plus ``compute_dtype`` (None: the tokens' dtype) and
        ``recipe`` (None: follow ``fo.quantized``)."""

        compute_dtype: torch.dtype | None = None
        recipe: Any = None

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self._setup_fusible(config.compute_dtype, config.recipe)

    def _setup_fusible(self, compute_dtype: torch.dtype | None, recipe: Any = None) -> None:
        self.compute_dtype = compute_dtype
        self.recipe = recipe_from_name(recipe)
        # blocks by local shapes (expert or tensor parallelism changes them); built on the meta
        # device and never registered: each call computes with this module's own parameters
        self._blocks: dict[tuple[int, int, int], Sequential] = {}
        self._add_block()

    def parallelize(self, parallel_dims: Any) -> None:
        """torchtitan's parallelization, then the block for this rank's parameter shapes
        (made here, not while a compiled forward is traced)."""
        super().parallelize(parallel_dims)
        self._add_block()

    def _add_block(self) -> None:
        """Make the block for the current local parameter shapes, if new."""
        shape = tuple(_local(self.w1_EFD).shape)
        if shape not in self._blocks:
            self._blocks[shape] = self.block(*shape)

    def block(self, num_local_experts: int, hidden: int, dim: int) -> Sequential:
        """The expert block computing ``[?, dim]`` rows with ``num_local_experts`` experts of
        width ``hidden``: ``GroupedGateUpLinear -> SwiGLU -> GroupedLinear``."""
        block = self._blocks.get((num_local_experts, hidden, dim))
        if block is None:
            block = Sequential(
                GroupedGateUpLinear(num_local_experts, dim, hidden, device="meta"),
                SwiGLU(),
                GroupedLinear(num_local_experts, hidden, dim, device="meta"),
                recipe=self.recipe,
            )
            self._blocks[(num_local_experts, hidden, dim)] = block
        return block

    def forward(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        """``x_RD`` ``[R, D]`` sorted by expert -> ``[R, D]`` in its dtype (see the class)."""
        block, args, params = self._call_parts(x_RD, num_tokens_per_expert_E)
        return torch.func.functional_call(block, params, args).to(x_RD.dtype)

    def explain(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> str:
        """The fusion plan a call with these tokens runs (see ``Sequential.explain``)."""
        block, args, params = self._call_parts(x_RD, num_tokens_per_expert_E)
        with torch.nn.utils.stateless._reparametrize_module(block, params):
            return str(block.explain(*args))

    def _call_parts(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> tuple:
        """The block, its arguments and the parameters it computes with (this rank's)."""
        w1_EFD, w2_EDF, w3_EFD = (_local(w) for w in (self.w1_EFD, self.w2_EDF, self.w3_EFD))
        if self.compute_dtype is not None:
            x_RD, w1_EFD, w2_EDF, w3_EFD = (t.to(self.compute_dtype) for t in (x_RD, w1_EFD, w2_EDF, w3_EFD))
        params = {"0.gate_weight": w1_EFD, "0.up_weight": w3_EFD, "2.weight": w2_EDF}
        splits = num_tokens_per_expert_E
        return self.block(*w1_EFD.shape), (x_RD, splits, splits), params

    def extra_repr(self) -> str:
        dtype = "" if self.compute_dtype is None else f", compute_dtype={self.compute_dtype}"
        recipe = "" if self.recipe is None else f", recipe={self.recipe!r}"
        return f"num_experts={self.num_experts}{dtype}{recipe}, fused by fusible-ops"


def _local(weight: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor parameter (as torchtitan's own experts take it)."""
    return weight.to_local() if type(weight).__name__ == "DTensor" else weight


def _refuse_converted(name: str) -> None:
    if name != "GroupedExperts" and name.startswith(("Float8", "MXFP8", "Mxfp8")):
        raise ValueError(
            f"fusible_ops.integrations.torchtitan: the experts are {name}, built by a torchtitan "
            "low-precision converter (torchao has rewritten their parameters); convert the model "
            "config instead (convert_config keeps the converter's recipe), or pass recipe= here"
        )


def _check_math(owner: type) -> None:
    """``GroupedExperts`` itself, or a low-precision converter's subclass of it: the math
    fusible-ops reproduces (a subclass with math of its own, gpt-oss's, is refused)."""
    low_precision = owner.__name__.startswith(("Float8", "MXFP8")) and owner.__bases__ == (GroupedExperts,)
    if owner is not GroupedExperts and not low_precision:
        raise TypeError(
            f"fusible_ops.integrations.torchtitan.convert_config: {owner.__name__} is a subclass of "
            "GroupedExperts with its own math; only GroupedExperts (or its float8 / MXFP8 "
            "converted form) is converted"
        )


def _converter_recipe(owner: type, config: Any) -> fo_recipes.Recipe | None:
    """The recipe of experts that torchtitan's float8 or MXFP8 experts converter made."""
    name = owner.__name__
    if name.startswith("MXFP8"):
        return recipe_from_name(getattr(config, "recipe_name", "mxfp8_rceil"))
    if name.startswith("Float8"):  # torchao's Float8TrainingOpConfig: dynamic rowwise FP8
        return RECIPE_NAMES["rowwise"]
    return None


def convert_config(model_config: Any, *, compute_dtype: torch.dtype | None = None, recipe: Any = None) -> Any:
    """Swap every ``GroupedExperts.Config`` in a torchtitan model config for
    :class:`FusibleGroupedExperts.Config` (the same fields); returns the config (the root
    itself may be replaced). ``recipe``: see :func:`recipe_from_name`; experts that a
    torchtitan float8 / MXFP8 converter converted keep that converter's recipe (an
    explicit ``recipe`` wins)."""
    recipe = recipe_from_name(recipe)
    for _fqn, config, parent, attr in list(model_config.traverse(GroupedExperts.Config)):
        owner = type(config)._owner
        if owner is FusibleGroupedExperts:
            continue
        _check_math(owner)
        base = {f.name: getattr(config, f.name) for f in fields(GroupedExperts.Config)}
        new_config = FusibleGroupedExperts.Config(
            **base,
            compute_dtype=compute_dtype,
            recipe=recipe if recipe is not None else _converter_recipe(owner, config),
        )
        if parent is None:
            model_config = new_config
        elif isinstance(parent, list):
            parent[attr] = new_config
        else:
            setattr(parent, attr, new_config)
    return model_config


def convert(model: torch.nn.Module, *, compute_dtype: torch.dtype | None = None, recipe: Any = None) -> int:
    """Make every torchtitan ``GroupedExperts`` in ``model`` (a built model) compute with
    fusible-ops, in place, keeping its parameters; returns how many were converted.
    ``recipe``: see :func:`recipe_from_name`. Call before ``fully_shard`` /
    parallelization, as torchtitan's converters run."""
    recipe = recipe_from_name(recipe)
    converted = 0
    for module in model.modules():
        if not isinstance(module, GroupedExperts) or isinstance(module, FusibleGroupedExperts):
            continue
        if type(module) is not GroupedExperts:
            _refuse_converted(type(module).__name__)
            raise TypeError(
                f"fusible_ops.integrations.torchtitan.convert: {type(module).__name__} is a subclass of "
                "GroupedExperts with its own math; only GroupedExperts itself is converted"
            )
        module.__class__ = FusibleGroupedExperts
        module._setup_fusible(compute_dtype, recipe)
        converted += 1
    return converted
