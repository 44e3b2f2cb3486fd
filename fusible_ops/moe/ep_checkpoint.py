"""``torch.distributed.checkpoint`` (DCP) refuses the local experts of an ``ep_group`` layer.

With ``MoE(..., ep_group=group)`` each rank's expert weights are plain tensors of shape
``[local_experts, ...]`` under the global names: DCP would take them for replicated
copies, keep one rank's and lose the others' experts without a word. ``ep_mesh=`` makes
them DTensors that DCP saves and reshards. Marked state-dict entries (plain tensors, still
fine for ``torch.save``, which does not store the marks, and ``load_state_dict``) make DCP's planners raise instead.
"""

from __future__ import annotations

from typing import Any

from torch import nn

DCP_REFUSAL = (
    "{fqn}: torch.distributed.checkpoint cannot save or load the experts of an MoE built with "
    "ep_group= (each rank holds only its experts, under the global names, so all but one "
    "rank's would be lost); build the layer with ep_mesh= (a 1-D DeviceMesh, e.g. "
    "init_device_mesh(device, (ep,), mesh_dim_names=('ep',))['ep']): its experts are DTensors "
    "that DCP saves and reshards"
)


class _RefuseCheckpoint:
    """Stands in for DCP's checkpoint hooks on a tensor."""

    def __init__(self, fqn: str) -> None:
        self.fqn = fqn

    def __call__(self, *args: Any) -> Any:
        raise RuntimeError(DCP_REFUSAL.format(fqn=self.fqn))


def _mark_entries(module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    for name, param in module.named_parameters(recurse=False):
        tensor = state_dict.get(prefix + name)
        if tensor is not None and tensor is not param:
            refuse = _RefuseCheckpoint(prefix + name)
            # what DCP's save and load planners call on a tensor that shards itself
            tensor.__create_write_items__ = refuse
            tensor.__create_chunk_list__ = refuse
            # torch.save pickles a tensor's Python attributes unless its state is empty:
            # the marks stay out of files (weights_only loading included)
            tensor.__getstate__ = _no_python_state


def _no_python_state() -> dict:
    return {}


def refuse_distributed_checkpoint(experts: nn.Module) -> None:
    """Make DCP raise on the expert parameters of ``experts`` (the layer's ``Sequential``)."""
    for op in experts.modules():
        if any(True for _ in op.parameters(recurse=False)):
            op.register_state_dict_post_hook(_mark_entries)
