"""No silent loss: train-mode torch.export with balancing losses, dynamic-shape export of
every balancing mode, and DCP of an ``ep_group`` layer (2 gloo processes)."""

from __future__ import annotations

import io
import shutil

import pytest
import torch
import torch.distributed as dist
from test_moe_ep import _spawn

from fusible_ops import MoE

BALANCING = ("none", "aux_loss", "seq_aux_loss", "aux_free")


def _moe(**options) -> MoE:
    torch.manual_seed(0)
    return MoE(8, 6, 4, 2, **options)


@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize(
    "options",
    [dict(load_balancing="aux_loss"), dict(load_balancing="seq_aux_loss"), dict(z_loss_coeff=0.1)],
    ids=["aux_loss", "seq_aux_loss", "z_loss"],
)
def test_train_mode_export_refuses_to_drop_the_balancing_gradient(options, strict):
    moe = _moe(**options).train()
    with pytest.raises(RuntimeError, match="torch.export cannot keep the balancing loss in backward"):
        torch.export.export(moe, (torch.randn(2, 5, 8),), strict=strict)


@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize("mode", BALANCING)
def test_every_balancing_mode_exports_with_a_dynamic_sequence(mode, strict):
    """In training (losses not attached) and in eval mode; the program equals eager on a
    sequence length it was not traced with."""
    seq = torch.export.Dim("seq", min=2, max=64)
    for train in (True, False):
        moe = _moe(load_balancing=mode, z_loss_coeff=0.1, aux_loss_in_backward=False).train(train)
        program = torch.export.export(moe, (torch.randn(2, 5, 8),), dynamic_shapes=({1: seq},), strict=strict)
        x = torch.randn(2, 9, 8)
        with torch.no_grad():
            torch.testing.assert_close(program.module()(x), moe(x))


def test_dynamic_sequence_keeps_the_balancing_loss_under_compile():
    """The token counts of the losses are traced sizes, not constants: the loss and the
    router gradient equal eager at a second sequence length."""
    moe = _moe(load_balancing="seq_aux_loss", z_loss_coeff=0.1)
    compiled = torch.compile(moe, backend="aot_eager", dynamic=True, fullgraph=True)
    for seq in (5, 9):
        x = torch.randn(2, seq, 8)
        moe.zero_grad()
        moe(x).sum().backward()
        want_loss, want_grad = dict(moe.aux_losses), moe.router.weight.grad.clone()
        moe.zero_grad()
        compiled(x).sum().backward()
        for name, value in want_loss.items():
            torch.testing.assert_close(moe.aux_losses[name], value)
        torch.testing.assert_close(moe.router.weight.grad, want_grad)


def _dcp_worker(rank: int, world: int, port: int, counts: list[int]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))["ep"]
        with pytest.raises(ValueError, match="pass ep_mesh= instead"):
            MoE(8, 6, 4, 2, ep_group=mesh)
        moe = MoE(8, 6, 4, 2, ep_group=dist.group.WORLD)
        path = f"/tmp/fo-dcp-refusal-{port}"
        for state in (moe.state_dict(), get_state_dict(moe, [])[0]):
            with pytest.raises(dcp.api.CheckpointException) as info:
                dcp.save(state, checkpoint_id=path)
            _assert_names_ep_mesh(info.value)
        dcp.save(MoE(8, 6, 4, 2, ep_mesh=mesh).state_dict(), checkpoint_id=path)  # the same keys
        with pytest.raises(dcp.api.CheckpointException, match="Size mismatch"):  # local [2, ...] vs global [4, ...]
            dcp.load(moe.state_dict(), checkpoint_id=path)
        dist.barrier()
        if rank == 0:
            shutil.rmtree(path)
        # a checkpoint of the same local shapes (unmarked copies, which DCP takes for
        # replicated tensors): loading it into the layer is refused, the layer untouched
        dcp.save({k: v.detach().clone() for k, v in moe.state_dict().items()}, checkpoint_id=path)
        state = moe.state_dict()
        before = {k: v.clone() for k, v in state.items()}
        with pytest.raises(dcp.api.CheckpointException) as info:
            dcp.load(state, checkpoint_id=path)
        _assert_names_ep_mesh(info.value)
        for name, value in state.items():
            assert torch.equal(value, before[name]), name
        dist.barrier()
        if rank == 0:
            shutil.rmtree(path)
        # a per-rank torch.save round trip stays as before
        buffer = io.BytesIO()
        torch.save(moe.state_dict(), buffer)
        buffer.seek(0)
        copy = MoE(8, 6, 4, 2, ep_group=dist.group.WORLD)
        copy.load_state_dict(torch.load(buffer))
        for a, b in zip(copy.parameters(), moe.parameters()):
            assert torch.equal(a, b)
    finally:
        dist.destroy_process_group()


def _assert_names_ep_mesh(error) -> None:
    """Every rank's failure is the refusal that points at ep_mesh=."""
    messages = [str(failure) for failure in error.failures.values()]
    assert messages and all("build the layer with ep_mesh=" in m for m in messages), messages


@pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs gloo")
def test_dcp_refuses_the_local_experts_of_an_ep_group_layer():
    _spawn(2, [0, 0], worker=_dcp_worker)
