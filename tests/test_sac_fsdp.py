"""Selective activation checkpointing (SAC) and per-op FSDP2 over the fused expert block.

SAC: ``torch.utils.checkpoint.checkpoint(..., context_fn=create_selective_checkpoint_contexts)``
puts a TorchDispatchMode on the stack, so the fused block computes through the
``fusible_ops::grouped_mlp_forward`` custom op and the policy sees it. Gradients are
compared in float64 against a run without checkpointing; the forward kernel is counted
to check that MUST_SAVE keeps it from running again in backward and PREFER_RECOMPUTE
does not.

FSDP2: two gloo ranks on CPU run every case in one pair of processes; the parent
compares each rank's results with a single-process reference (FSDP2 averages the
parameter gradients over the ranks).
"""

from __future__ import annotations

import datetime
import functools
import os
import socket
import time
import traceback
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import fusible_ops as fo
from fusible_ops.kernels import library

EXPERTS, HIDDEN, FFN = 4, 16, 24
DTYPE = torch.float64
TOL = {"rtol": 1e-12, "atol": 1e-12}
SIZES = [3, 0, 5, 4]
MLP_FORWARD = torch.ops.fusible_ops.grouped_mlp_forward.default


def expert_block(bias: bool = True) -> fo.Sequential:
    torch.manual_seed(0)
    return fo.Sequential(
        fo.GroupedLinear(EXPERTS, HIDDEN, 2 * FFN, bias=bias, dtype=DTYPE),
        fo.ScaledSwiGLU(),
        fo.GroupedLinear(EXPERTS, FFN, HIDDEN, bias=bias, dtype=DTYPE),
    )


def inputs(sizes: list[int], seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    rows = sum(sizes)
    x = torch.randn(rows, HIDDEN, generator=gen, dtype=DTYPE).requires_grad_()
    probs = torch.rand(rows, generator=gen, dtype=DTYPE).requires_grad_()
    return x, probs, torch.tensor(sizes)


def grads_of(out: torch.Tensor, seq: fo.Sequential, x, probs) -> tuple[torch.Tensor, ...]:
    return torch.autograd.grad(out.square().sum(), [x, probs, *seq.parameters()])


class Policy:
    """A SAC policy that records every call; MUST_SAVE for ``save`` funcs, else PREFER_RECOMPUTE."""

    def __init__(self, save=()) -> None:
        self.save = set(save)
        self.calls: list[tuple[object, bool]] = []

    def __call__(self, ctx, func, *args, **kwargs):
        self.calls.append((func, ctx.is_recompute))
        return CheckpointPolicy.MUST_SAVE if func in self.save else CheckpointPolicy.PREFER_RECOMPUTE

    def context_fn(self):
        return functools.partial(create_selective_checkpoint_contexts, self)

    def forward_funcs(self) -> list[object]:
        """Funcs the policy saw in forward (``is_recompute`` is always False from torch 2.5 on)."""
        return [func for func, is_recompute in self.calls if not is_recompute]


@pytest.fixture
def mlp_kernel_calls():
    """Counts executions of the fused forward kernel (eager path and custom op alike)."""
    calls = []
    original = library._mlp_forward_impl

    def counting(*args, **kwargs):
        calls.append(torch.is_grad_enabled())
        return original(*args, **kwargs)

    with mock.patch.object(library, "_mlp_forward_impl", counting):
        yield calls


POLICIES = {"must_save_mlp_forward": (MLP_FORWARD,), "prefer_recompute_all": ()}


# ----------------------------------------------------------------------------- SAC
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("policy_name", list(POLICIES))
def test_sac_grads_match_and_policy_controls_recompute(policy_name, bias, mlp_kernel_calls):
    seq = expert_block(bias)
    x, probs, splits = inputs(SIZES)
    ref_out = seq(x, splits, probs, splits)
    ref_grads = grads_of(ref_out, seq, x, probs)
    assert seq.last_plan.fusion_plans[0].forward_op_types() == ["GroupedMLP"]
    mlp_kernel_calls.clear()

    policy = Policy(POLICIES[policy_name])
    out = checkpoint(seq, x, splits, probs, splits, use_reentrant=False, context_fn=policy.context_fn())
    assert seq.last_plan.fusion_plans[0].forward_op_types() == ["GroupedMLP"]
    assert len(mlp_kernel_calls) == 1
    # the dispatch mode routed the fused block through its custom op, which the policy saw once
    assert policy.forward_funcs().count(MLP_FORWARD) == 1, policy.forward_funcs()
    torch.testing.assert_close(out, ref_out, **TOL)

    grads = grads_of(out, seq, x, probs)
    recomputed = len(mlp_kernel_calls) - 1
    assert recomputed == (0 if policy_name == "must_save_mlp_forward" else 1), mlp_kernel_calls
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("policy_name", list(POLICIES))
def test_sac_with_output_buffer(policy_name, mlp_kernel_calls):
    seq = expert_block()
    x, probs, splits = inputs(SIZES)
    rows = sum(SIZES)
    ref_out = seq(x, splits, probs, splits)
    ref_grads = grads_of(ref_out, seq, x, probs)
    mlp_kernel_calls.clear()

    buf = torch.full((rows + 3, HIDDEN), 7.0, dtype=DTYPE)
    policy = Policy(POLICIES[policy_name])

    def block(x, splits, probs):
        return seq(x, splits, probs, splits, op_kwargs={2: {fo.OUTPUT_BUFFER_KEY: buf}})

    out = checkpoint(block, x, splits, probs, use_reentrant=False, context_fn=policy.context_fn())
    assert "fc2 writes the caller's output buffer in place" in str(seq.last_plan)
    assert policy.forward_funcs().count(MLP_FORWARD) == 1
    assert out.data_ptr() == buf.data_ptr()  # the output is the caller's memory, not a copy
    torch.testing.assert_close(out, ref_out, **TOL)
    after_forward = buf.clone()

    grads = grads_of(out, seq, x, probs)
    assert len(mlp_kernel_calls) == (1 if policy_name == "must_save_mlp_forward" else 2)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, **TOL)
    assert torch.all(buf[rows:] == 7.0)  # padding never written, in forward or in a recompute
    # Unchanged values; under PREFER_RECOMPUTE the recompute wrote the same values again
    # (see docs/compile-sac-fsdp-notes.md about in-place changes to the output).
    torch.testing.assert_close(buf, after_forward, rtol=0, atol=0)


# Regression: checkpointing caches what an op returns, not what it writes; a saved op
# whose result only reached the caller through a mutated ``out`` gave garbage on recompute.


class Keep(torch.nn.Module):
    """Holds every tensor it passes on, so that no freed block still holding the right values
    can come back from the allocator as the recompute's uninitialised tensor (which would
    make the tests below pass by chance)."""

    def __init__(self) -> None:
        super().__init__()
        self.kept: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.kept.append(x)
        return x


def _poison_freed_blocks(like: torch.Tensor, count: int = 16) -> None:
    """Free NaN-filled blocks of ``like``'s size: the allocator hands them out first."""
    blocks = [torch.full_like(like, float("nan")) for _ in range(count)]
    del blocks


def test_sac_saved_mlp_forward_feeds_later_ops_of_the_region():
    """The checkpointed region holds more than the expert block: tanh saves its output,
    which the recompute derives from the block's output ``y``."""
    seq, keep = expert_block(), Keep()
    x, probs, splits = inputs(SIZES, seed=101)  # data no other test computes with

    def region(x, splits, probs):
        return torch.tanh(keep(seq(x, splits, probs, splits)))

    ref_grads = torch.autograd.grad(region(x, splits, probs).sum(), [x, probs, *seq.parameters()])
    policy = Policy([MLP_FORWARD])
    out = checkpoint(region, x, splits, probs, use_reentrant=False, context_fn=policy.context_fn())
    assert policy.forward_funcs().count(MLP_FORWARD) == 1
    _poison_freed_blocks(keep.kept[-1])
    grads = torch.autograd.grad(out.sum(), [x, probs, *seq.parameters()])
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, **TOL)


def test_sac_saved_grouped_fprop_feeds_the_activation():
    """fc1 runs alone (a plain module after it splits the fuser group) and ScaledSwiGLU saves
    fc1's output: a policy that saves the GEMMs, as one saves aten.mm, must give the same
    gradients as no checkpointing."""
    fprop = torch.ops.fusible_ops.grouped_fprop.default
    block, keep = expert_block(), Keep()
    fc1, act, fc2 = block
    seq = fo.Sequential(fc1, keep, act, fc2)
    x, probs, splits = inputs(SIZES, seed=102)  # data no other test computes with
    ref_grads = grads_of(seq(x, splits, probs, splits), seq, x, probs)
    policy = Policy([fprop])
    out = checkpoint(seq, x, splits, probs, splits, use_reentrant=False, context_fn=policy.context_fn())
    assert policy.forward_funcs().count(fprop) == 2
    _poison_freed_blocks(keep.kept[-1])
    grads = grads_of(out, seq, x, probs)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, **TOL)


# ----------------------------------------------------------------------------- hooks, no FSDP
def test_explain_agrees_with_call_when_an_op_has_hooks():
    seq = expert_block()
    seq[0].register_forward_hook(lambda module, args, output: None)
    x, probs, splits = inputs(SIZES)
    explained = seq.explain(x, splits, probs, splits)
    seq(x, splits, probs, splits)
    assert "module_hooks" in str(seq.last_plan)
    assert explained.fusion_plans[0].forward_op_types() == seq.last_plan.fusion_plans[0].forward_op_types()


# ----------------------------------------------------------------------------- FSDP2, worker side
WORLD_SIZE = 2
TIMEOUT_S = 120
RANK_SIZES = ([3, 0, 5, 4], [1, 4, 0, 2])  # different rows and split sizes per rank
STEPS = 2  # two forward+backward steps: gradients accumulate, plans are reused
FSDP_CASES = ("per_op", "per_op_and_root", "whole", "per_op_sac", "whole_sac")


def _rank_inputs(rank: int):
    return inputs(list(RANK_SIZES[rank]), seed=10 + rank)


def _run_fsdp_case(case: str, mesh) -> dict:
    from torch.distributed.fsdp import fully_shard

    seq = expert_block()
    if case.startswith("per_op"):
        fully_shard(seq[0], mesh=mesh)
        fully_shard(seq[2], mesh=mesh)
        if case == "per_op_and_root":
            fully_shard(seq, mesh=mesh)
    else:
        fully_shard(seq, mesh=mesh)
    result: dict = {"hook_reasons": [op.hook_reason() for op in seq]}
    x, probs, splits = _rank_inputs(dist.get_rank())
    try:
        result["explain"] = str(seq.explain(x, splits, probs, splits))
    except Exception as exc:  # reported by its own test
        result["explain_error"] = f"{type(exc).__name__}: {exc}"
    policy = Policy([MLP_FORWARD])
    for _ in range(STEPS):
        if case.endswith("_sac"):
            out = checkpoint(
                seq, x, splits, probs, splits, use_reentrant=False, context_fn=policy.context_fn()
            )
        else:
            out = seq(x, splits, probs, splits)
        out.square().sum().backward()
    result["seen"] = sorted({str(func) for func in policy.forward_funcs()})
    result["plan"] = str(seq.last_plan)
    result["forward_op_types"] = seq.last_plan.fusion_plans[0].forward_op_types()
    result["out"] = out.detach().clone()
    result["x_grad"] = x.grad.clone()
    result["probs_grad"] = probs.grad.clone()
    result["param_types"] = {name: type(p).__name__ for name, p in seq.named_parameters()}
    # full_tensor is a collective: every rank gathers every gradient, in the same order
    result["param_grads"] = {name: p.grad.full_tensor().clone() for name, p in seq.named_parameters()}
    return result


def _worker(rank: int, port: int, result_dir: str) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", rank=rank, world_size=WORLD_SIZE, timeout=datetime.timedelta(seconds=TIMEOUT_S)
    )
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (WORLD_SIZE,))
    results = {}
    for case in FSDP_CASES:
        start = time.perf_counter()
        try:
            results[case] = _run_fsdp_case(case, mesh)
        except Exception:  # reported per case by the parent's test
            results[case] = {"exception": traceback.format_exc()}
        results[case]["seconds"] = time.perf_counter() - start
        dist.barrier()  # a failed case must not leave the other rank inside a collective of the next
    torch.save(results, os.path.join(result_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ----------------------------------------------------------------------------- FSDP2, parent side
needs_gloo = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="torch.distributed with gloo is needed"
)


@pytest.fixture(scope="module")
def fsdp_results(tmp_path_factory) -> list[dict]:
    result_dir = str(tmp_path_factory.mktemp("fsdp_gloo"))
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(rank, port, result_dir)) for rank in range(WORLD_SIZE)]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + TIMEOUT_S
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    alive = [proc for proc in procs if proc.is_alive()]
    for proc in alive:
        proc.kill()
    if alive:
        pytest.fail(f"gloo workers did not finish within {TIMEOUT_S} s")
    per_rank = []
    for rank in range(WORLD_SIZE):
        path = os.path.join(result_dir, f"rank{rank}.pt")
        if not os.path.exists(path):
            pytest.fail(f"gloo worker rank {rank} wrote no results (exit code {procs[rank].exitcode})")
        per_rank.append(torch.load(path))
    return per_rank


@pytest.fixture(scope="module")
def fsdp_reference() -> dict:
    """Single process: each rank's output and input grads, and the parameter grads FSDP2
    should produce (the mean over ranks of each rank's loss gradient), for one step."""
    seq = expert_block()
    names = [name for name, _ in seq.named_parameters()]
    outs, x_grads, probs_grads, param_grads = [], [], [], []
    for rank in range(WORLD_SIZE):
        x, probs, splits = _rank_inputs(rank)
        out = seq(x, splits, probs, splits)
        grads = grads_of(out, seq, x, probs)
        outs.append(out.detach())
        x_grads.append(grads[0])
        probs_grads.append(grads[1])
        param_grads.append(grads[2:])
    mean = {name: sum(g[i] for g in param_grads) / WORLD_SIZE for i, name in enumerate(names)}
    return {"out": outs, "x_grad": x_grads, "probs_grad": probs_grads, "param_grads": mean}


def _case(fsdp_results: list[dict], case: str) -> list[dict]:
    outcomes = [per_rank[case] for per_rank in fsdp_results]
    for rank, outcome in enumerate(outcomes):
        assert "exception" not in outcome, f"rank {rank}:\n{outcome['exception']}"
    return outcomes


@needs_gloo
@pytest.mark.parametrize("case", FSDP_CASES)
def test_fsdp2_grads_match_single_process_reference(fsdp_results, fsdp_reference, case):
    for rank, outcome in enumerate(_case(fsdp_results, case)):
        assert set(outcome["param_types"].values()) == {"DTensor"}, outcome["param_types"]
        torch.testing.assert_close(outcome["out"], fsdp_reference["out"][rank], **TOL)
        for key in ("x_grad", "probs_grad"):  # input gradients are per rank, not averaged
            torch.testing.assert_close(outcome[key], STEPS * fsdp_reference[key][rank], **TOL, msg=key)
        assert outcome["param_grads"].keys() == fsdp_reference["param_grads"].keys()
        for name, want in fsdp_reference["param_grads"].items():
            got = outcome["param_grads"][name]
            torch.testing.assert_close(got, STEPS * want, **TOL, msg=f"rank {rank} {name}")


@needs_gloo
@pytest.mark.parametrize("case", FSDP_CASES)
def test_fsdp2_plan_says_why_ops_ran_alone(fsdp_results, case):
    for outcome in _case(fsdp_results, case):
        plan = outcome["plan"]
        if case.startswith("per_op"):
            # FSDP2's pre-forward and post-forward hooks sit on each GroupedLinear
            reason = "forward pre-hook and forward hook"
            assert outcome["hook_reasons"] == [reason, None, reason]
            for index in (0, 2):
                assert f"module_hooks (joint) declined on ops {index}..{index}" in plan, plan
                assert f"forward pre-hook and forward hook on op {index}" in plan, plan
                assert "runs alone, unfused, through nn.Module.__call__" in plan, plan
            assert "GroupedMLP" not in plan, plan
            assert outcome["forward_op_types"] == ["FSDPGroupedLinear", "ScaledSwiGLU", "FSDPGroupedLinear"]
        else:
            # the hooks are on the Sequential: the ops see unsharded tensors and fuse
            assert outcome["hook_reasons"] == [None, None, None]
            assert "module_hooks" not in plan, plan
            assert outcome["forward_op_types"] == ["GroupedMLP"], plan


@needs_gloo
@pytest.mark.parametrize("case", ["per_op_sac", "whole_sac"])
def test_fsdp2_under_sac_policy_sees_the_custom_ops(fsdp_results, case):
    for outcome in _case(fsdp_results, case):
        seen = outcome["seen"]
        if case == "whole_sac":
            assert "fusible_ops.grouped_mlp_forward.default" in seen, seen
        else:  # the ops run alone: each GEMM is its own custom op
            assert "fusible_ops.grouped_fprop.default" in seen, seen
            assert "fusible_ops.grouped_mlp_forward.default" not in seen, seen


@needs_gloo
@pytest.mark.parametrize("case", ["per_op", "whole"])
def test_fsdp2_explain_agrees_with_the_call(fsdp_results, case):
    for outcome in _case(fsdp_results, case):
        assert "explain_error" not in outcome, outcome["explain_error"]
        assert ("module_hooks" in outcome["explain"]) == case.startswith("per_op"), outcome["explain"]
        assert ("GroupedMLP" in outcome["explain"]) == (case == "whole"), outcome["explain"]
