"""fo.MoE(ep_mesh=...): expert weights as DTensor Shard(0), and distributed checkpoints
that keep every expert, across expert-parallel sizes (gloo, CPU, spawned processes).

Each distributed result is compared with a single-process MoE holding the same global
weights: outputs, input gradients, global expert gradients; DCP round trips of model and
Adam state must give bit-exact global weights and the uninterrupted run's next losses.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from error_model import AdamDrift, rounding_rtol
from test_moe_ep import FFN, HIDDEN, NUM_EXPERTS, _global_tokens, _init_weights, _spawn

from fusible_ops import MoE
from fusible_ops.checkpoint import export_grouped_keys, export_stacked, load_grouped_keys, load_stacked

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()),
    reason="torch.distributed with gloo is not available",
)

TOKENS = 16  # the global batch of the training checks, split evenly over the ranks
LR = 1e-2
# float32 training vs one process: the reductions a gradient passes through, in order:
# router logits (HIDDEN) and softmax (NUM_EXPERTS), fc1 (HIDDEN), fc2 (FFN), top-2 combine,
# then back: fc2 dgrad (HIDDEN), fc1 dgrad (2 FFN), combine (2), router dgrad (NUM_EXPERTS),
# weight gradients over the tokens (TOKENS, twice) and the reduce-scatter over 4 ranks.
_GRAD_TERMS = HIDDEN + NUM_EXPERTS + HIDDEN + FFN + 2 + HIDDEN + 2 * FFN + 2 + NUM_EXPERTS + 2 * TOKENS + 4
# Measured against the largest entry, random unit-scale data: condition <= 4.
GRAD_RTOL = rounding_rtol(torch.float32, _GRAD_TERMS, condition=4)
# The loss: the forward chain, twice (a square), plus its sum over TOKENS x HIDDEN and 4 ranks.
_FORWARD_TERMS = HIDDEN + NUM_EXPERTS + HIDDEN + FFN + 2
LOSS_RTOL = rounding_rtol(torch.float32, 2 * _FORWARD_TERMS + TOKENS * HIDDEN + 4, condition=4)


def _mesh(world: int):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))["ep"]


def _reference(bias: bool, seed: int = 11) -> MoE:
    ref = MoE(HIDDEN, FFN, NUM_EXPERTS, 2, bias=bias, dtype=torch.float64)
    _init_weights(ref, seed=seed)
    return ref


def _ep_moe(ref: MoE, mesh, bias: bool) -> MoE:
    moe = MoE(HIDDEN, FFN, NUM_EXPERTS, 2, bias=bias, dtype=torch.float64, ep_mesh=mesh)
    moe.router.load_state_dict(ref.router.state_dict())
    load_stacked(moe, **export_stacked(ref))  # every rank keeps only its experts
    return moe


def _check_dtensor_ep(rank, world, counts, offset, bias):
    from torch.distributed.tensor import DTensor, Shard

    ref = _reference(bias)
    moe = _ep_moe(ref, _mesh(world), bias)
    w = moe.experts[0].weight
    assert isinstance(w, DTensor) and w.placements == (Shard(0),) and w.shape[0] == NUM_EXPERTS
    assert w.to_local().shape[0] == NUM_EXPERTS // world
    x_all = _global_tokens(counts)
    grad_all = torch.randn(x_all.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    ref_x = x_all.clone().requires_grad_()
    (ref(ref_x) * grad_all).sum().backward()
    mine = slice(offset, offset + counts[rank])
    x = x_all[mine].clone().requires_grad_()
    out = moe(x)
    (out * grad_all[mine]).sum().backward()
    torch.testing.assert_close(x.grad, ref_x.grad[mine])
    for i in (0, 2):
        for name in ("weight", "bias") if bias else ("weight",):
            grad = getattr(moe.experts[i], name).grad
            assert isinstance(grad, DTensor) and grad.placements == (Shard(0),)
            torch.testing.assert_close(grad.full_tensor(), getattr(ref.experts[i], name).grad)
    assert moe.experts.last_plan.fusion_plans[0].forward_op_types() == ["GroupedMLP"]
    # checkpoint helpers on DTensor experts: a gathered export is the global experts, once
    global_weights = export_stacked(ref)
    gathered = export_stacked(moe, gather=True)
    assert gathered.keys() == global_weights.keys()
    assert all(torch.equal(gathered[k], global_weights[k]) for k in gathered)
    grouped = export_grouped_keys(ref)  # per-group keys by global id: each rank reads its own
    other = MoE(HIDDEN, FFN, NUM_EXPERTS, 2, bias=bias, dtype=torch.float64, ep_mesh=_mesh(world))
    load_grouped_keys(other, grouped)
    for i in (0, 2):
        torch.testing.assert_close(other.experts[i].weight.full_tensor(), ref.experts[i].weight)
    # outputs: this rank's rows of the reference
    with torch.no_grad():
        torch.testing.assert_close(moe(x_all[mine]), ref(x_all)[mine])


def _batch(step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 + step)
    x = torch.randn(TOKENS, HIDDEN, dtype=torch.float64, generator=gen)
    x[:, 0] = x[:, 0].abs() + 1.0
    return x


def _train_step(moe, opt, step: int, rank: int, world: int) -> float:
    """One Adam step on this rank's share of the global batch; returns the global loss."""
    rows = slice(rank * TOKENS // world, (rank + 1) * TOKENS // world)
    loss = moe(_batch(step)[rows].to(moe.router.weight.dtype)).square().sum()
    opt.zero_grad()
    loss.backward()
    if world > 1:  # the replicated router is data parallel: sum its gradient over the ranks
        dist.all_reduce(moe.router.weight.grad)
    opt.step()
    total = loss.detach().clone()
    if world > 1:
        dist.all_reduce(total)
    return float(total)


def _global_weights(moe) -> dict[str, torch.Tensor]:
    return {
        name: (p.full_tensor() if type(p).__name__ == "DTensor" else p).detach().clone()
        for name, p in moe.named_parameters()
    }


def _save(rank, world, path):
    """EP=``world``: one step, a DCP save of model and Adam state, then two more steps."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    ref = _reference(bias=True)
    moe = _ep_moe(ref, _mesh(world), bias=True)
    opt = torch.optim.Adam(moe.parameters(), lr=LR)
    _train_step(moe, opt, 0, rank, world)
    model_sd, optim_sd = get_state_dict(moe, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    weights = _global_weights(moe)
    losses = [_train_step(moe, opt, step, rank, world) for step in (1, 2)]
    if rank == 0:
        torch.save({"weights": weights, "losses": losses}, f"{path}/expected.pt")


def _load_and_continue(rank, world, path, dtype=torch.float64):
    """Load a save at EP=``world`` (1: a plain MoE): weights bit-exact, same next losses."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    expected = torch.load(f"{path}/expected.pt")
    if world == 1:
        moe = MoE(HIDDEN, FFN, NUM_EXPERTS, 2, bias=True, dtype=dtype)
    else:
        moe = MoE(HIDDEN, FFN, NUM_EXPERTS, 2, bias=True, dtype=dtype, ep_mesh=_mesh(world))
    opt = torch.optim.Adam(moe.parameters(), lr=LR)
    model_sd, optim_sd = get_state_dict(moe, opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(moe, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    for name, value in _global_weights(moe).items():
        assert torch.equal(value, expected["weights"][name]), name
    losses = [_train_step(moe, opt, step, rank, world) for step in (1, 2)]
    # bit-exact weights: each loss is off by its forward rounding plus, to first order, the
    # same again per earlier step (the Adam steps in between move with the rounding)
    for steps, (got, want) in enumerate(zip(losses, expected["losses"]), start=1):
        assert abs(got - want) <= steps * LOSS_RTOL * abs(want), (losses, expected["losses"])


def _worker(rank: int, world: int, port: int, args) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        task, payload = args
        if task == "ep":
            counts = payload
            offset = sum(counts[:rank])
            _check_dtensor_ep(rank, world, counts, offset, bias=False)
            _check_dtensor_ep(rank, world, counts, offset, bias=True)
            _check_bad_meshes(world)
        elif task == "save":
            _save(rank, world, payload)
        elif task == "fsdp_train":
            _fsdp_train_and_save(rank, world, payload)
        else:
            _load_and_continue(
                rank, world, payload, torch.float32 if task == "load_float32" else torch.float64
            )
    finally:
        dist.destroy_process_group()


def _check_bad_meshes(world: int) -> None:
    mesh = _mesh(world)
    with pytest.raises(ValueError, match=r"MoE: num_experts=9 is not divisible by the ep_mesh size"):
        MoE(HIDDEN, FFN, 9, 2, ep_mesh=mesh)
    with pytest.raises(ValueError, match=r"MoE: give ep_group or ep_mesh, not both"):
        MoE(HIDDEN, FFN, NUM_EXPERTS, 2, ep_mesh=mesh, ep_group=dist.group.WORLD)
    with pytest.raises(
        ValueError, match=r"MoE: ep_mesh is a 'cpu' mesh but the parameters are made on 'meta'"
    ):
        MoE(HIDDEN, FFN, NUM_EXPERTS, 2, ep_mesh=mesh, device="meta")
    if world == 4:
        from torch.distributed.device_mesh import init_device_mesh

        two_d = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
        with pytest.raises(ValueError, match=r"MoE: ep_mesh must be 1-D"):
            MoE(HIDDEN, FFN, NUM_EXPERTS, 2, ep_mesh=two_d)


@pytest.mark.parametrize(
    "world, counts", [(2, [9, 0]), (4, [3, 0, 7, 1])], ids=["2proc-rank1-empty", "4proc-uneven"]
)
def test_ep_mesh_dtensor_experts_match_single_process(world, counts):
    _spawn(world, ("ep", counts), worker=_worker)


def test_dcp_saves_every_expert_and_reloads_at_other_ep_sizes(tmp_path):
    import torch.distributed.checkpoint as dcp

    path = str(tmp_path / "ckpt")
    _spawn(2, ("save", path), worker=_worker)
    # the metadata holds every expert's rows: global shapes, chunks covering all experts
    metadata = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    for key, rows in (("model.experts.0.weight", 2 * FFN), ("model.experts.2.weight", HIDDEN)):
        entry = metadata[key]
        assert tuple(entry.size)[:2] == (NUM_EXPERTS, rows), (key, entry.size)
        covered = sorted((c.offsets[0], c.offsets[0] + c.sizes[0]) for c in entry.chunks)
        assert covered == [(0, NUM_EXPERTS // 2), (NUM_EXPERTS // 2, NUM_EXPERTS)], covered
    assert tuple(metadata["optim.state.experts.0.weight.exp_avg"].size)[0] == NUM_EXPERTS
    for world in (1, 2, 4):
        _spawn(world, ("load", path), worker=_worker)


# ---------------------------------------------------------------- EP=2 x FSDP2=2 (dp2ep)


def _dp2ep(ref: MoE):
    """4 ranks: experts sharded over ep (DTensor) and FSDP over dp, the rest FSDP over dp x ep."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    world_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
    moe = MoE(HIDDEN, FFN, NUM_EXPERTS, 2, bias=True, ep_mesh=world_mesh["ep"])
    moe.router.load_state_dict(ref.router.state_dict())
    load_stacked(moe, **export_stacked(ref))
    fully_shard(moe.experts, mesh=world_mesh["dp"])
    fully_shard(moe, mesh=world_mesh["dp", "ep"]._flatten("dp_ep"))
    return moe


def _fsdp_step(moe, opt, step: int, rank: int, world: int, expected_grads: dict | None = None) -> float:
    """As _train_step (a sum loss over the global batch), with FSDP's averaging undone:
    x world for every gradient, then the expert rule (x 1 / ep); the global gradients are
    compared with ``expected_grads`` before the step."""
    rows = slice(rank * TOKENS // world, (rank + 1) * TOKENS // world)
    loss = moe(_batch(step)[rows].float()).square().sum()
    opt.zero_grad()
    loss.backward()
    with torch.no_grad():
        for p in moe.parameters():
            p.grad.mul_(world)
    moe.scale_expert_gradients()
    for name, p in (expected_grads and moe.named_parameters()) or ():
        grad, want = p.grad.full_tensor(), expected_grads[name]
        assert float((grad - want).abs().max() / want.abs().max()) <= GRAD_RTOL, name
    opt.step()
    total = loss.detach().clone()
    dist.all_reduce(total)
    return float(total)


def _fsdp_train_and_save(rank, world, path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    ref = _reference(bias=True).float()
    moe = _dp2ep(ref)
    weight = moe.experts[0].weight
    # FSDP2 over dp on top of Shard(0) over ep: (_StridedShard(0), Shard(0)), which DCP reads
    assert weight.device_mesh.ndim == 2 and all(p.dim == 0 for p in weight.placements), weight.placements
    ref_opt = torch.optim.Adam(ref.parameters(), lr=LR)
    drift = AdamDrift(ref_opt)
    opt = torch.optim.Adam(moe.parameters(), lr=LR)
    for step in range(3):
        ref_loss = _train_step(ref, ref_opt, step, 0, 1)
        ref_grads = {name: p.grad.clone() for name, p in ref.named_parameters()}
        for p in ref.parameters():  # the gradients are checked to GRAD_RTOL below
            drift.update(p, GRAD_RTOL * float(p.grad.abs().max()))
        loss = _fsdp_step(moe, opt, step, rank, world, ref_grads)
        assert abs(loss - ref_loss) <= (1 + step) * LOSS_RTOL * abs(ref_loss), (step, loss, ref_loss)
        assert moe.experts.last_plan.fusion_plans[0].forward_op_types() == ["GroupedMLP"]
        if step == 0:
            model_sd, optim_sd = get_state_dict(moe, opt)
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
            weights = _global_weights(moe)
            later = []
        else:
            later.append(loss)
    # Adam amplifies gradient rounding where v_hat is small: the bound is per element
    for name, value in _global_weights(moe).items():
        param = dict(ref.named_parameters())[name]
        excess = (value - param.detach()).abs() - drift.bound(param)
        assert float(excess.max()) <= 0, (name, float(excess.max()))
    if rank == 0:
        torch.save({"weights": weights, "losses": later}, f"{path}/expected.pt")


@pytest.mark.numerics
def test_dp2ep_fsdp2_training_equals_one_process_and_its_checkpoint_reloads(tmp_path):
    path = str(tmp_path / "ckpt")
    _spawn(4, ("fsdp_train", path), worker=_worker)
    for world in (1, 2):  # EP=1, and EP=2 without FSDP
        _spawn(world, ("load_float32", path), worker=_worker)
