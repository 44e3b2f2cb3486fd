"""Tensor-parallel ``fo.Sequential(BasicLinear, Bias)`` (DTensor weights, 2 gloo ranks)
under a recipe: each rank quantizes its shards. With MXFP8 and shards of a multiple of
32 features that is the unsharded quantized result (forward and backward, colwise and
rowwise); with Float8Rowwise the colwise forward (whole rows on every rank) is; eager
equals ``torch.compile(fullgraph=True)``."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from test_moe_ep import _spawn

import fusible_ops as fo

IN, OUT = 128, 64
R = fo.recipes


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _block() -> fo.Sequential:
    torch.manual_seed(0)
    seq = fo.Sequential(fo.BasicLinear(IN, OUT), fo.Bias(OUT))
    with torch.no_grad():
        seq[1].bias.normal_()
    return seq


def _run(seq, x, grad, recipe, compiled=False):
    x = x.detach().clone().requires_grad_(True)
    for p in seq.parameters():
        p.grad = None
    fn = torch.compile(seq, backend="aot_eager", fullgraph=True) if compiled else seq
    with fo.quantized(recipe):
        out = fn(x)
    full = out.full_tensor() if hasattr(out, "full_tensor") else out
    (full * grad).sum().backward()

    def whole(t):
        return t.full_tensor() if hasattr(t, "full_tensor") else t

    return [whole(full.detach()), whole(x.grad), whole(seq[0].weight.grad), whole(seq[1].bias.grad)]


def _worker(rank: int, world: int, port: int, _counts) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        torch.manual_seed(1)
        x_full, grad = torch.randn(3, 10, IN), torch.randn(3, 10, OUT)
        for recipe, style, check_backward in (
            (R.MXFP8(), "colwise", True),
            (R.MXFP8(scale_rounding="floor"), "rowwise", True),
            (R.Float8Rowwise(), "colwise", False),
        ):
            reference = _run(_block(), x_full, grad, recipe)
            unquantized = _run(_block(), x_full, grad, None)
            seq = _block()
            w_place, b_place, x_place = (
                (Shard(0), Shard(0), Replicate()) if style == "colwise" else (Shard(1), Replicate(), Shard(-1))
            )
            seq[0].weight = torch.nn.Parameter(distribute_tensor(seq[0].weight.detach(), mesh, [w_place]))
            seq[1].bias = torch.nn.Parameter(distribute_tensor(seq[1].bias.detach(), mesh, [b_place]))
            x = distribute_tensor(x_full, mesh, [x_place])
            for compiled in (False, True):
                torch._dynamo.reset()
                got = _run(seq, x, grad, recipe, compiled)
                assert "recipe" in str(seq.last_plan) or compiled
                names = ("out", "grad_x", "grad_w", "grad_b")
                for name, a, b, u in zip(names, got, reference, unquantized):
                    if not check_backward and name != "out":
                        continue
                    assert _rel(a, b) <= 1e-5, (recipe, style, compiled, name, _rel(a, b))
                    if name != "grad_b":  # the bias gradient is not a GEMM
                        assert _rel(u, b) > 1e-3, (recipe, style, name)
    finally:
        dist.destroy_process_group()


@pytest.mark.numerics
def test_tensor_parallel_linear_under_recipes():
    _spawn(2, [0, 0], worker=_worker)


def test_dtensor_weight_sharded_otherwise_is_refused():
    """A replicated DTensor weight under a recipe raises, naming the op, before any write."""
    pytest.importorskip("torch.distributed.tensor")
    _spawn(1, [0], worker=_refusal_worker)


def _refusal_worker(rank: int, world: int, port: int, _counts) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        seq = _block()
        seq[0].weight = torch.nn.Parameter(distribute_tensor(seq[0].weight.detach(), mesh, [Replicate()]))
        x = distribute_tensor(torch.randn(4, IN), mesh, [Replicate()])
        with pytest.raises(ValueError, match=r"BasicLinear.*colwise \(Shard\(0\)\) or rowwise"):
            with fo.quantized(R.MXFP8()):
                seq(x)
    finally:
        dist.destroy_process_group()
