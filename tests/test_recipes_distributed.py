"""Low-precision recipes under expert parallelism and FSDP2 (gloo, 2 CPU ranks).

One pair of spawned processes runs every case; each rank records per case either "ok" or
what differed (or the traceback), and the parent's tests report them one by one. Each
case compares with a single-process reference run in the same worker under the same
recipe on the same kernels (same per-expert rows, one thread), so the comparisons are
exact (``torch.equal``); only the router gradient, a sum over the ranks, gets a rounding
tolerance:

- ``fo.MoE(ep_group=..., recipe=...)`` and ``fo.MoE(ep_mesh=...)`` inside
  ``fo.quantized(...)``: outputs, input gradients, this rank's expert gradients and the
  router gradient summed over the ranks equal the single-process MoE's; after an
  optimizer step the next output equals a run with the quantized-weight cache cleared;
- ``fully_shard`` (FSDP2) over the fused expert block: a training step under the recipe
  gives the unsharded run's loss, gradients and weights; a DCP save of the sharded model
  and optimizer holds float32 weights under the unsharded model's keys only, and reloads
  into a fresh sharded model bit for bit, whose next loss under the recipe is the
  unsharded one's;
- several FSDP2 steps equal the unsharded run step for step (the reference clears the
  quantized-weight cache before every step).

Checks never raise between collectives: a mismatch on one rank must not leave the other
waiting in an all-to-all; each case raises once, after its last collective.
"""

from __future__ import annotations

import os
import traceback

import pytest
import torch
import torch.distributed as dist
from test_moe_ep import _init_weights, _spawn

import fusible_ops as fo
from fusible_ops import MoE
from fusible_ops.checkpoint import export_stacked, load_stacked
from fusible_ops.recipes import weight_cache

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()),
    reason="torch.distributed with gloo is not available",
)

R = fo.recipes
WORLD = 2
HIDDEN, FFN, NUM_EXPERTS = 32, 16, 4
COUNTS = [7, 4]  # tokens per rank (uneven)
RECIPES = {
    "mxfp8": R.MXFP8(),
    "tensorwise": R.Float8Tensorwise(),
    "rowwise": R.Float8Rowwise(),
    "blockwise": R.Float8Blockwise(),
}
EP_CASES = [f"ep_group-{name}" for name in RECIPES] + ["ep_mesh-mxfp8", "ep_mesh-rowwise"]
FSDP_CASES = ["fsdp2_step-mxfp8", "fsdp2_step-tensorwise"]
FSDP_TRAIN_CASES = ["fsdp2_train-mxfp8", "fsdp2_train-tensorwise"]


class Checks(list):
    """Collects what differed instead of raising (see the module docstring)."""

    def equal(self, got: torch.Tensor, want: torch.Tensor, what: str) -> None:
        got, want = got.detach(), want.detach()
        if got.dtype != want.dtype or got.shape != want.shape:
            self.append(f"{what}: {got.dtype} {tuple(got.shape)} vs {want.dtype} {tuple(want.shape)}")
        elif not torch.equal(got, want):
            self.append(f"{what}: max abs diff {float((got - want).abs().max()):.3g}")

    def that(self, condition: bool, what: str) -> None:
        if not condition:
            self.append(what)

    def verdict(self) -> None:
        assert not self, "\n".join(self)


def _tokens() -> torch.Tensor:
    """All ranks' tokens, float32 (recipes take bfloat16, float16 or float32)."""
    return torch.randn(sum(COUNTS), HIDDEN, generator=torch.Generator().manual_seed(123))


# ---------------------------------------------------------------- expert parallelism
def _check_ep(rank: int, mesh, kind: str, recipe: fo.recipes.Recipe) -> None:
    """EP=2 MoE under ``recipe`` vs the single-process MoE under it: exactly equal."""
    checks = Checks()
    x_all = _tokens()
    grad_all = torch.randn(x_all.shape, generator=torch.Generator().manual_seed(5))
    ref = MoE(HIDDEN, FFN, NUM_EXPERTS, 2, recipe=recipe)
    _init_weights(ref, seed=11)
    if kind == "ep_group":  # the module's own recipe
        moe = MoE(HIDDEN, FFN, NUM_EXPERTS, 2, recipe=recipe, ep_group=dist.group.WORLD)
        context = lambda: fo.quantized(None)  # noqa: E731
    else:  # DTensor experts, the recipe from the context
        moe = MoE(HIDDEN, FFN, NUM_EXPERTS, 2, ep_mesh=mesh)
        context = lambda: fo.quantized(recipe)  # noqa: E731
    moe.router.load_state_dict(ref.router.state_dict())
    load_stacked(moe, **export_stacked(ref))

    ref_x = x_all.clone().requires_grad_()
    ref_out = ref(ref_x)
    (ref_out * grad_all).sum().backward()
    with torch.no_grad():  # the recipe matters here: unquantized differs
        plain = MoE(HIDDEN, FFN, NUM_EXPERTS, 2)
        plain.load_state_dict(ref.state_dict())
        checks.that(not torch.equal(plain(x_all), ref_out), "the unquantized MoE gives the same output")

    mine = slice(sum(COUNTS[:rank]), sum(COUNTS[: rank + 1]))
    x = x_all[mine].clone().requires_grad_()
    with context():
        out = moe(x)
        (out * grad_all[mine]).sum().backward()
    plan = moe.experts.last_plan
    router_grad = moe.router.weight.grad.clone()
    dist.all_reduce(router_grad)
    expert_grads = [moe.experts[i].weight.grad for i in (0, 2)]
    if kind == "ep_mesh":
        expert_grads = [g.to_local() for g in expert_grads]
    # an optimizer step, then the next output: the same as with every quantized copy made afresh
    torch.optim.SGD(moe.parameters(), lr=0.1).step()
    with context(), torch.no_grad():
        after_step = moe(x)
        weight_cache.clear_weight_cache()
        fresh = moe(x)

    checks.that(f"recipe {type(recipe).__name__}" in str(plan), f"plan without the recipe:\n{plan}")
    checks.that(plan.fusion_plans[0].forward_op_types() == ["GroupedMLP"], f"not fused:\n{plan}")
    checks.equal(out, ref_out[mine], "output")
    checks.equal(x.grad, ref_x.grad[mine], "input gradient")
    per_rank = NUM_EXPERTS // WORLD
    local = slice(rank * per_rank, (rank + 1) * per_rank)
    for i, grad in zip((0, 2), expert_grads):
        checks.equal(grad, ref.experts[i].weight.grad[local], f"experts[{i}].weight.grad")
    # two ranks' partial sums added once vs one process's row reduction: rounding only
    if not torch.allclose(router_grad, ref.router.weight.grad, rtol=1e-6, atol=1e-7):
        checks.append(
            f"router gradient: max abs diff {float((router_grad - ref.router.weight.grad).abs().max())}"
        )
    checks.that(not torch.equal(after_step, out.detach()), "the optimizer step changed nothing")
    checks.equal(after_step, fresh, "output after an optimizer step vs quantized afresh")
    checks.verdict()


# ---------------------------------------------------------------- FSDP2
EXPERT_SIZES = ([3, 0, 5, 4], [1, 4, 0, 2])  # per rank: different rows and split sizes
TRAIN_STEPS = 5
LR = 1e-2


def _block() -> fo.Sequential:
    torch.manual_seed(0)
    return fo.Sequential(
        fo.GroupedLinear(NUM_EXPERTS, HIDDEN, 2 * FFN, bias=True),
        fo.ScaledSwiGLU(),
        fo.GroupedLinear(NUM_EXPERTS, FFN, HIDDEN, bias=True),
    )


def _loss(seq, rank: int, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 * step + rank)
    sizes = EXPERT_SIZES[rank]
    x = torch.randn(sum(sizes), HIDDEN, generator=gen)
    probs = torch.rand(sum(sizes), generator=gen)
    splits = torch.tensor(sizes)
    return seq(x, splits, probs, splits).square().sum()


def _reference(recipe, steps: int):
    """Unsharded, each step with the quantized copies made afresh: per step the ranks'
    losses and the gradient FSDP2 gives; the weights after the last Adam step."""
    seq = _block()
    opt = torch.optim.Adam(seq.parameters(), lr=LR)
    losses, step_grads = [], []
    for step in range(steps):
        weight_cache.clear_weight_cache()
        per_rank, grads = [], []
        with fo.quantized(recipe):
            for rank in range(WORLD):
                loss = _loss(seq, rank, step)
                grads.append(torch.autograd.grad(loss, list(seq.parameters())))
                per_rank.append(loss.detach())
        for p, g0, g1 in zip(seq.parameters(), *grads):
            p.grad = g0 / WORLD + g1 / WORLD  # FSDP2 on gloo: each divided by 2, then summed
        step_grads.append({name: p.grad.clone() for name, p in seq.named_parameters()})
        opt.step()
        losses.append(per_rank)
    return seq, losses, step_grads


def _full(seq) -> dict[str, torch.Tensor]:
    return {name: p.full_tensor().detach().clone() for name, p in seq.named_parameters()}


def _check_fsdp_step(rank: int, mesh, recipe, path: str) -> None:
    """One FSDP2 step equals unsharded; its DCP checkpoint is the float32 weights and reloads."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard

    checks = Checks()
    ref, want_losses, want_grads = _reference(recipe, steps=1)
    plain_keys = list(ref.state_dict())

    seq = _block()
    fully_shard(seq, mesh=mesh)
    opt = torch.optim.Adam(seq.parameters(), lr=LR)
    with fo.quantized(recipe):
        loss = _loss(seq, rank, 0)
        loss.backward()
    plan = str(seq.last_plan)
    grads = {name: p.grad.full_tensor() for name, p in seq.named_parameters()}
    opt.step()
    opt.zero_grad()
    weights = _full(seq)
    # DCP: float32 weights under the unsharded keys, nothing else
    model_sd, optim_sd = get_state_dict(seq, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    fresh = _block()
    fully_shard(fresh, mesh=mesh)
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=LR)
    fresh_model_sd, fresh_optim_sd = get_state_dict(fresh, fresh_opt)
    state = {"model": fresh_model_sd, "optim": fresh_optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(fresh, fresh_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    reloaded = _full(fresh)
    with fo.quantized(recipe):
        next_loss = _loss(fresh, rank, 1).detach()
    metadata = dcp.FileSystemReader(path).read_metadata().state_dict_metadata

    checks.that(f"recipe {type(recipe).__name__}" in plan and "GroupedMLP" in plan, f"plan:\n{plan}")
    checks.equal(loss.detach(), want_losses[0][rank], "loss")
    for name, want in want_grads[0].items():
        checks.equal(grads[name], want, f"{name}.grad")
    for name, value in ref.named_parameters():
        checks.equal(weights[name], value, f"{name} after the step")
    checks.that(list(model_sd) == plain_keys, f"state dict keys {list(model_sd)}")
    model_entries = {k.removeprefix("model."): v for k, v in metadata.items() if k.startswith("model.")}
    checks.that(sorted(model_entries) == sorted(plain_keys), f"checkpoint keys {sorted(model_entries)}")
    checks.that(
        all(k.startswith(("model.", "optim.")) for k in metadata), f"checkpoint keys {sorted(metadata)}"
    )
    for key, entry in model_entries.items():
        checks.that(entry.properties.dtype == torch.float32, f"{key} saved as {entry.properties.dtype}")
        checks.that(tuple(entry.size) == tuple(weights[key].shape), f"{key} saved as {tuple(entry.size)}")
    for name, value in reloaded.items():
        checks.equal(value, weights[name], f"reloaded {name}")
    weight_cache.clear_weight_cache()
    with fo.quantized(recipe):
        checks.equal(next_loss, _loss(ref, rank, 1).detach(), "next loss of the reloaded model")
    checks.verdict()


def _check_fsdp_train(rank: int, mesh, recipe) -> None:
    """TRAIN_STEPS FSDP2 steps under ``recipe``: each loss, and the final weights, unsharded's."""
    from torch.distributed.fsdp import fully_shard

    checks = Checks()
    ref, want_losses, _ = _reference(recipe, TRAIN_STEPS)
    seq = _block()
    fully_shard(seq, mesh=mesh)
    opt = torch.optim.Adam(seq.parameters(), lr=LR)
    for step in range(TRAIN_STEPS):
        with fo.quantized(recipe):
            loss = _loss(seq, rank, step)
            loss.backward()
        checks.equal(loss.detach(), want_losses[step][rank], f"loss of step {step}")
        opt.step()
        opt.zero_grad()
    weights = _full(seq)
    for name, value in ref.named_parameters():
        checks.equal(weights[name], value, f"{name} after {TRAIN_STEPS} steps")
    checks.verdict()


# ---------------------------------------------------------------- worker and parent
def _worker(rank: int, world: int, port: int, result_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))  # the EP mesh and FSDP2's
    results = {}
    try:
        for case in EP_CASES + FSDP_CASES + FSDP_TRAIN_CASES:
            kind, name = case.split("-")
            try:
                if kind == "fsdp2_step":
                    _check_fsdp_step(rank, mesh, RECIPES[name], os.path.join(result_dir, f"ckpt-{name}"))
                elif kind == "fsdp2_train":
                    _check_fsdp_train(rank, mesh, RECIPES[name])
                else:
                    _check_ep(rank, mesh, kind, RECIPES[name])
                results[case] = "ok"
            except Exception:  # reported per case by the parent's tests
                results[case] = traceback.format_exc()
            dist.barrier()
    finally:
        torch.save(results, os.path.join(result_dir, f"rank{rank}.pt"))
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> list[dict]:
    result_dir = str(tmp_path_factory.mktemp("recipes_gloo"))
    _spawn(WORLD, result_dir, worker=_worker)
    return [torch.load(os.path.join(result_dir, f"rank{rank}.pt")) for rank in range(WORLD)]


def _assert_ok(outcomes: list[dict], case: str) -> None:
    for rank, results in enumerate(outcomes):
        assert results.get(case) == "ok", f"rank {rank}:\n{results.get(case, 'not run')}"


@pytest.mark.numerics
@pytest.mark.parametrize("case", EP_CASES)
def test_expert_parallel_moe_under_a_recipe_equals_one_process(outcomes, case):
    _assert_ok(outcomes, case)


@pytest.mark.numerics
@pytest.mark.parametrize("case", FSDP_CASES)
def test_fsdp2_step_under_a_recipe_equals_unsharded_and_its_checkpoint_reloads(outcomes, case):
    _assert_ok(outcomes, case)


@pytest.mark.numerics
@pytest.mark.parametrize("case", FSDP_TRAIN_CASES)
def test_fsdp2_training_under_a_recipe_uses_no_stale_quantized_weights(outcomes, case):
    _assert_ok(outcomes, case)
