"""dp2ep in one FSDP2 unit: a ``shard_placement_fn`` that puts the routed experts of every
``MoE`` on their own data-parallel mesh.

With expert parallelism over ``ep`` and FSDP2 over ``dp``, the experts are sharded over
``dp`` and every other parameter over the flattened ``(dp, ep)`` mesh. Calling
``fully_shard`` on the experts and again on the block that holds them does that eagerly,
but leaves the inner unit's FSDP hooks inside the block: compiling the block then breaks
the graph at them (``torch.compile`` does not trace FSDP2's hooks). One ``fully_shard``
of the block whose ``shard_placement_fn`` gives the experts their own mesh keeps every
FSDP hook at the block's boundary (torchtitan shards its MoE blocks this way).
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from .layer import MoE


def expert_shard_placement(module: nn.Module, dp_mesh: object) -> Callable[[nn.Parameter], object]:
    """A ``shard_placement_fn`` for ``fully_shard`` that shards the routed experts of every
    :class:`~fusible_ops.MoE` in ``module`` (itself included) over ``dp_mesh``.

    Use it with ``fully_shard(module, mesh=world_mesh["dp", "ep"]._flatten("dp_ep"),
    shard_placement_fn=expert_shard_placement(module, world_mesh["dp"]))``: the expert
    weights and biases (DTensors ``Shard(0)`` over the ``ep`` mesh) are sharded on dim 0
    over ``dp``, ending up ``(_StridedShard(0), Shard(0))`` on the ``(dp, ep)`` mesh;
    every other parameter gets ``fully_shard``'s own mesh and placement. FSDP averages
    expert gradients over ``dp`` only: call ``MoE.scale_expert_gradients()`` after
    backward, as with nested ``fully_shard`` (docs/moe.md, "Gradient scaling rule").

    Args:
        module: the module ``fully_shard`` is given (a transformer block, or the ``MoE``);
            every ``MoE`` in it must have an ``ep_mesh``.
        dp_mesh: the 1-D data-parallel ``DeviceMesh`` of the experts (``world_mesh["dp"]``).

    Returns:
        The ``shard_placement_fn``, which gives an expert parameter FSDP's placement
        on ``dp_mesh`` and any other parameter None (``fully_shard``'s default).

    Raises:
        ValueError: ``module`` holds no ``MoE``, one without ``ep_mesh``, or ``dp_mesh``
            is not a 1-D ``DeviceMesh``.
        RuntimeError: this torch's ``fully_shard`` takes no per-parameter mesh
            (``ShardPlacementResult``, torch 2.13 has it).
    """
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard

    name = "expert_shard_placement"
    if not isinstance(dp_mesh, DeviceMesh) or dp_mesh.ndim != 1:
        raise ValueError(f"{name}: dp_mesh must be a 1-D DeviceMesh (e.g. world_mesh['dp']), got {dp_mesh!r}")
    layers = [(path, m) for path, m in module.named_modules() if isinstance(m, MoE)]
    if not layers:
        raise ValueError(f"{name}: {type(module).__name__} holds no fusible_ops.MoE")
    for path, layer in layers:
        if layer.ep_mesh is None:
            raise ValueError(
                f"{name}: the MoE {path or '(the module itself)'!r} has no ep_mesh; build it with "
                "MoE(..., ep_mesh=world_mesh['ep']) so that its experts are DTensors over ep"
            )
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, ShardPlacementResult
    except ImportError:
        raise RuntimeError(
            f"{name}: this torch's fully_shard takes no per-parameter mesh (ShardPlacementResult); "
            "shard the experts with their own fully_shard(moe.experts, mesh=world_mesh['dp']) "
            "instead (eager; compiling such a block breaks the graph at the inner FSDP hooks)"
        ) from None
    placement = ShardPlacementResult(placement=Shard(0), mesh_info=FSDPMeshInfo(dp_mesh, shard_mesh_dim=0))
    experts = {id(p) for _, layer in layers for p in layer.experts.parameters()}

    def shard_placement_fn(param: nn.Parameter) -> object:
        return placement if id(param) in experts else None

    return shard_placement_fn
