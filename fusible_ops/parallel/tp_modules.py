"""Tensor-parallel linear modules: ``TPLinear``, ``LinearLoRA`` and colwise/rowwise sharding helpers."""

from __future__ import annotations

import functools
import math

import torch
import torch.nn as nn

from ..basic.linear_dispatch import tp_linear_forward

__all__ = [
    "LinearLoRA",
    "lora_colwise_parallel",
    "lora_rowwise_parallel",
    "TPLinear",
    "shard_colwise",
    "shard_rowwise",
]


class TPLinear(nn.Linear):
    """An ``nn.Linear`` that computes through :func:`tp_linear_forward`.

    Input ``[..., in_features]``, output ``[..., out_features]``. Shard it with
    :func:`shard_colwise` / :func:`shard_rowwise` (or torch's ``ColwiseParallel`` /
    ``RowwiseParallel``, since it is an ``nn.Linear``).
    """

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """``y = x W^T + b``: ``input`` ``[*, in_features]`` -> ``[*, out_features]``."""
        return tp_linear_forward(input, self.weight, self.bias, mm_for_2d_compile=True)


class LinearLoRA(nn.Linear):
    """A linear layer with a low-rank adapter: ``y = x W^T + b + (alpha / r) * dropout(x) A^T B^T``.

    Args:
        in_features, out_features: as for ``nn.Linear``.
        r: adapter rank.
        alpha: adapter scale numerator; the adapter output is scaled by ``alpha / r``.
        dropout: dropout probability applied to the adapter's input.
        bias: whether the base layer has a bias.
        freeze_base: whether the base ``weight`` and ``bias`` are frozen (only the adapters train).

    Parameters: ``weight`` ``[out, in]``, ``bias`` ``[out]``, ``lora_A`` ``[r, in]``
    (Kaiming-uniform init), ``lora_B`` ``[out, r]`` (zeros, so a fresh adapter is a no-op).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        r: int = 8,
        alpha: float = 16,
        dropout: float = 0.0,
        bias: bool = True,
        freeze_base: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        if r <= 0:
            raise ValueError(f"LinearLoRA: rank r must be positive, got {r}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"LinearLoRA: dropout must be in [0, 1), got {dropout}")
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.r = r
        self.alpha = alpha
        self.scale = alpha / r
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.lora_A = nn.Parameter(torch.empty(r, in_features, device=device, dtype=dtype))
        self.lora_B = nn.Parameter(torch.empty(out_features, r, device=device, dtype=dtype))
        self.merged = False
        self.reset_lora_parameters()
        if freeze_base:
            self.freeze_base()

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        *,
        r: int = 8,
        alpha: float = 16,
        dropout: float = 0.0,
        freeze_base: bool = True,
    ) -> LinearLoRA:
        """Wrap an existing ``nn.Linear``: the new module shares its ``weight`` and ``bias`` parameters."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"LinearLoRA.from_linear: expected an nn.Linear, got {type(linear).__name__}")
        weight = linear.weight
        lora = cls(
            linear.in_features,
            linear.out_features,
            r=r,
            alpha=alpha,
            dropout=dropout,
            bias=linear.bias is not None,
            freeze_base=False,
            device="meta",
            dtype=weight.dtype,
        )
        lora.weight = weight
        lora.bias = linear.bias
        lora.lora_A = nn.Parameter(
            torch.empty(r, linear.in_features, device=weight.device, dtype=weight.dtype)
        )
        lora.lora_B = nn.Parameter(
            torch.empty(linear.out_features, r, device=weight.device, dtype=weight.dtype)
        )
        lora.reset_lora_parameters()
        if freeze_base:
            lora.freeze_base()
        return lora

    def reset_parameters(self) -> None:
        """Re-initialize the base layer as ``nn.Linear`` does, and the adapter."""
        # nn.Linear.__init__ calls this before the adapters exist.
        super().reset_parameters()
        if hasattr(self, "lora_A"):
            self.reset_lora_parameters()

    def reset_lora_parameters(self) -> None:
        """``lora_A`` Kaiming-uniform (as ``nn.Linear``), ``lora_B`` zeros."""
        if self.lora_A.is_meta:
            return
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B)

    def freeze_base(self) -> None:
        """Stop gradients to the base ``weight`` and ``bias``."""
        self.weight.requires_grad_(False)
        if self.bias is not None:
            self.bias.requires_grad_(False)

    def _lora_delta(self) -> torch.Tensor:
        """``scale * B @ A``: ``[out, in]``, placed like ``weight`` when the layer is sharded."""
        return (self.lora_B @ self.lora_A) * self.scale

    @torch.no_grad()
    def merge(self) -> None:
        """Fold the adapter into ``weight`` (inference); the forward then skips the adapter."""
        if self.merged:
            raise RuntimeError("LinearLoRA.merge: the adapter is already merged")
        self.weight.add_(self._lora_delta().to(self.weight.dtype))
        self.merged = True

    @torch.no_grad()
    def unmerge(self) -> None:
        """Undo :meth:`merge`."""
        if not self.merged:
            raise RuntimeError("LinearLoRA.unmerge: the adapter is not merged")
        self.weight.sub_(self._lora_delta().to(self.weight.dtype))
        self.merged = False

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """The base layer plus the adapter (the base alone once merged).

        Shape:
            ``input`` ``[*, in_features]`` -> ``[*, out_features]``.
        """
        out = tp_linear_forward(input, self.weight, self.bias, mm_for_2d_compile=False)
        if self.merged:
            return out
        hidden = tp_linear_forward(self.lora_dropout(input), self.lora_A, None, mm_for_2d_compile=False)
        return out + tp_linear_forward(hidden, self.lora_B, None, mm_for_2d_compile=False) * self.scale

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, r={self.r}, alpha={self.alpha}, merged={self.merged}"


def _distribute_param(module: nn.Module, name: str, device_mesh, placement, src_data_rank) -> None:
    from torch.distributed.tensor import distribute_tensor

    param = getattr(module, name)
    if param is None:
        return
    dist_param = nn.Parameter(
        distribute_tensor(param, device_mesh, [placement], src_data_rank=src_data_rank),
        requires_grad=param.requires_grad,
    )
    module.register_parameter(name, dist_param)


@functools.cache
def _lora_styles() -> tuple[type, type]:
    # torch.distributed.tensor.parallel is imported lazily: it is optional at package import.
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    class _LoRAColwiseParallel(ColwiseParallel):
        """``ColwiseParallel`` for :class:`LinearLoRA`: ``weight``, ``bias``, ``lora_B`` ``Shard(0)``;
        ``lora_A`` replicated (its output dim is the rank, which is not split)."""

        def _partition_linear_fn(self, name, module, device_mesh):
            if not isinstance(module, LinearLoRA):
                if type(module) is nn.Linear:  # a plain nn.Linear in the same plan: the usual style
                    return super()._partition_linear_fn(name, module, device_mesh)
                return  # the adapter's own submodules (dropout) hold no parameters
            for param_name, placement in (
                ("weight", Shard(0)),
                ("bias", Shard(0)),
                ("lora_A", Replicate()),
                ("lora_B", Shard(0)),
            ):
                _distribute_param(module, param_name, device_mesh, placement, self.src_data_rank)

    class _LoRARowwiseParallel(RowwiseParallel):
        """``RowwiseParallel`` for :class:`LinearLoRA`: ``weight``, ``lora_A`` ``Shard(1)``;
        ``bias``, ``lora_B`` replicated (the adapter output is partial, like the base output)."""

        def _partition_linear_fn(self, name, module, device_mesh):
            if not isinstance(module, LinearLoRA):
                if type(module) is nn.Linear:  # a plain nn.Linear in the same plan: the usual style
                    return super()._partition_linear_fn(name, module, device_mesh)
                return  # the adapter's own submodules (dropout) hold no parameters
            for param_name, placement in (
                ("weight", Shard(1)),
                ("bias", Replicate()),
                ("lora_A", Shard(1)),
                ("lora_B", Replicate()),
            ):
                _distribute_param(module, param_name, device_mesh, placement, self.src_data_rank)

    _LoRAColwiseParallel.__name__ = _LoRAColwiseParallel.__qualname__ = "LoRAColwiseParallel"
    _LoRARowwiseParallel.__name__ = _LoRARowwiseParallel.__qualname__ = "LoRARowwiseParallel"
    return _LoRAColwiseParallel, _LoRARowwiseParallel


def lora_colwise_parallel(**style_kwargs):
    """A ``ColwiseParallel`` style that also places :class:`LinearLoRA`'s adapters.

    ``style_kwargs`` as for ``ColwiseParallel``; usable in a ``parallelize_module`` plan.
    """
    return _lora_styles()[0](**style_kwargs)


def lora_rowwise_parallel(**style_kwargs):
    """A ``RowwiseParallel`` style that also places :class:`LinearLoRA`'s adapters.

    ``style_kwargs`` as for ``RowwiseParallel``; usable in a ``parallelize_module`` plan.
    """
    return _lora_styles()[1](**style_kwargs)


def _check_shardable(module: nn.Module, helper: str) -> None:
    if not isinstance(module, nn.Linear):
        raise TypeError(f"{helper}: expected TPLinear, LinearLoRA or nn.Linear, got {type(module).__name__}")
    if isinstance(module, LinearLoRA) and module.merged:
        raise ValueError(f"{helper}: unmerge the LinearLoRA adapter before sharding it")


def shard_colwise(module: nn.Linear, device_mesh, **style_kwargs) -> nn.Linear:
    """Shard a linear layer colwise (``weight`` ``Shard(0)``: each rank owns some output features).

    ``style_kwargs`` go to ``ColwiseParallel`` (``input_layouts``, ``output_layouts``,
    ``use_local_output``). Returns the module, sharded in place.
    """
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    _check_shardable(module, "shard_colwise")
    style = (
        lora_colwise_parallel(**style_kwargs)
        if isinstance(module, LinearLoRA)
        else ColwiseParallel(**style_kwargs)
    )
    return parallelize_module(module, device_mesh, style)


def shard_rowwise(module: nn.Linear, device_mesh, **style_kwargs) -> nn.Linear:
    """Shard a linear layer rowwise (``weight`` ``Shard(1)``: each rank owns some input features).

    ``style_kwargs`` go to ``RowwiseParallel``. The output is a partial sum that the style
    reduces to ``output_layouts`` (``Replicate()`` by default). Returns the module, sharded in place.
    """
    from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

    _check_shardable(module, "shard_rowwise")
    style = (
        lora_rowwise_parallel(**style_kwargs)
        if isinstance(module, LinearLoRA)
        else RowwiseParallel(**style_kwargs)
    )
    return parallelize_module(module, device_mesh, style)
