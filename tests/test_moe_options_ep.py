"""fo.MoE's options under expert parallelism and with a balance_group: 2 gloo processes on CPU.

Each rank holds different tokens (uneven counts). The distributed layer, loaded with the
same global weights, must equal the single-process layer on all ranks' tokens: this
rank's outputs and input gradients, its experts' gradients, the replicated parameters'
gradients summed over ranks, and the balancing statistics.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from test_moe_ep import _spawn
from test_moe_options import MODELS, make_moe

from fusible_ops.basic.grouped_linear import local_groups

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()),
    reason="torch.distributed with gloo is not available",
)

COUNTS = [9, 4]
H = 6


def _tokens() -> torch.Tensor:
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(sum(COUNTS), H, dtype=torch.float64, generator=gen)
    x[:, 0] = x[:, 0].abs() + 1.0
    return x


def _copy_weights(dst, src, local: slice) -> None:
    with torch.no_grad():
        for name, p in dst.named_parameters():
            value = dict(src.named_parameters())[name]
            local_groups(p).copy_(value[local] if name.startswith("experts.") else value)
        if src.score_correction_bias is not None:
            dst.score_correction_bias.copy_(src.score_correction_bias)


def _run(moe, x, grad):
    x = x.clone().requires_grad_()
    out = moe(x)
    out.backward(grad)
    return out.detach(), x.grad


def _summed(t: torch.Tensor) -> torch.Tensor:
    t = t.clone()
    dist.all_reduce(t)
    return t


def _check_ep(rank: int, cfg: dict, *, local_reference: bool, mesh: bool = False) -> None:
    """EP=2 equals one process: on all tokens, or (capacity is per rank) on this rank's tokens;
    with ``mesh`` the experts are DTensors on an ``ep_mesh``."""
    x_all = _tokens()
    grad_all = torch.randn(x_all.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    mine = slice(sum(COUNTS[:rank]), sum(COUNTS[: rank + 1]))
    ref = make_moe(cfg)
    if mesh:
        from torch.distributed.device_mesh import init_device_mesh

        ep_moe = make_moe(cfg, ep_mesh=init_device_mesh("cpu", (2,), mesh_dim_names=("ep",))["ep"])
    else:
        ep_moe = make_moe(cfg, ep_group=dist.group.WORLD)
    local = slice(ep_moe.ep_rank * ep_moe.num_local_experts, (ep_moe.ep_rank + 1) * ep_moe.num_local_experts)
    _copy_weights(ep_moe, ref, local)
    ref_x, ref_grad = (x_all[mine], grad_all[mine]) if local_reference else (x_all, grad_all)
    ref_out, ref_dx = _run(ref, ref_x, ref_grad)
    out, dx = _run(ep_moe, x_all[mine], grad_all[mine])
    rows = slice(None) if local_reference else mine
    torch.testing.assert_close(out, ref_out[rows])
    torch.testing.assert_close(dx, ref_dx[rows])
    ref_params = dict(ref.named_parameters())
    for name, p in ep_moe.named_parameters():
        expected = ref_params[name].grad
        if name.startswith("experts."):
            if local_reference:  # this rank's experts also computed the other rank's rows
                continue
            got, expected = local_groups(p.grad), expected[local]
        else:
            got = p.grad if local_reference else _summed(p.grad)
        torch.testing.assert_close(got, expected, msg=lambda m, n=name: f"{cfg}: {n}: {m}")
    assert ref.experts.last_plan.fusion_plans[0].forward_op_types() == ["GroupedMLP"]
    assert ep_moe.experts.last_plan.fusion_plans[0].forward_op_types() == ["GroupedMLP"]


def _check_balance_group(rank: int) -> None:
    """Balancing statistics over 2 ranks equal those of one process on the concatenated batch."""
    x_all = _tokens()
    mine = slice(sum(COUNTS[:rank]), sum(COUNTS[: rank + 1]))
    for mode in ("aux_loss", "seq_aux_loss"):
        cfg = dict(num_experts=4, top_k=2, score="sigmoid")
        options = dict(load_balancing=mode, aux_loss_coeff=0.3, z_loss_coeff=0.1)
        ref, dist_moe = make_moe(cfg, **options), make_moe(cfg, balance_group=dist.group.WORLD, **options)
        # sequences of one token each for seq_aux_loss: a [T, 1, H] input
        ref_x, x = (x_all.unsqueeze(1), x_all[mine].unsqueeze(1))
        ref(ref_x).sum().backward()
        dist_moe(x).sum().backward()
        for name in ("load_balancing", "z_loss"):
            torch.testing.assert_close(dist_moe.aux_losses[name], ref.aux_losses[name])
        torch.testing.assert_close(_summed(dist_moe.router.weight.grad), ref.router.weight.grad)
    cfg = dict(num_experts=4, top_k=1, score="sigmoid")
    ref = make_moe(cfg, load_balancing="aux_free", bias_update_rate=0.01)
    dist_moe = make_moe(cfg, load_balancing="aux_free", bias_update_rate=0.01, balance_group=dist.group.WORLD)
    ref(x_all)
    dist_moe(x_all[mine])
    ref.update_score_correction_bias()
    dist_moe.update_score_correction_bias()
    torch.testing.assert_close(dist_moe.score_correction_bias, ref.score_correction_bias)


def _worker(rank: int, world: int, port: int, counts: list[int]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        for model in ("deepseek_v3", "gpt_oss", "qwen2_moe", "mixtral"):
            _check_ep(rank, MODELS[model], local_reference=False)
            _check_ep(rank, MODELS[model], local_reference=False, mesh=True)
        _check_ep(rank, MODELS["capacity"], local_reference=True)
        _check_balance_group(rank)
    finally:
        dist.destroy_process_group()


def test_moe_options_under_expert_parallelism_and_balance_group():
    _spawn(2, COUNTS, worker=_worker)
