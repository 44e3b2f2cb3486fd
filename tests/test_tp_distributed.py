"""Numeric parity of the TP linear paths on a real 2-rank gloo group (CPU).

One pair of processes runs every case and writes one result per case; each case is then
its own test. The reference is plain float64 PyTorch on the gathered (full) tensors.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import time
import traceback
import zlib

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="torch.distributed with gloo is needed"
)

WORLD_SIZE = 2
TIMEOUT_S = 150
IN_FEATURES, OUT_FEATURES = 8, 6
PLACEMENTS = ("replicate", "shard0", "shard1", "shardminus1")
WEIGHT_STYLES = ("colwise", "rowwise")
INPUT_SHAPES = {2: (8, IN_FEATURES), 3: (4, 6, IN_FEATURES), 4: (2, 4, 2, IN_FEATURES)}


def _linear_cases() -> list[str]:
    """Eager: the full cross product. Compiled (the slow part): every (rank, placement) once
    per mode, with the weight style and bias alternating so that, over the two compiled
    modes, each (rank, placement) meets both styles and every rank meets both bias settings."""
    cases = []
    for mode in ("eager", "compiled", "compiled_async_tp"):
        for ndim in INPUT_SHAPES:
            for index, placement in enumerate(PLACEMENTS):
                for style in WEIGHT_STYLES:
                    for bias in (True, False):
                        if mode != "eager":
                            flip = mode == "compiled_async_tp"
                            if style != WEIGHT_STYLES[(ndim + index + flip) % 2]:
                                continue
                            if bias != ((index // 2 + ndim + flip) % 2 == 0):
                                continue
                        name = f"linear-{mode}-{ndim}d-{placement}-{style}-{'bias' if bias else 'nobias'}"
                        cases.append(name)
    return cases


MODULE_CASES = [
    f"{module}-{style}-{mode}"
    for module in ("tplinear", "lora")
    for style in WEIGHT_STYLES
    for mode in ("eager", "compiled")
]
LINEAR_CASES = _linear_cases()
SEQUENTIAL_CASES = [
    f"sequential-{style}-{mode}-{bias}"
    for style in WEIGHT_STYLES
    for mode in ("eager", "compiled")
    for bias in ("bias", "nobias")
]


# ----------------------------------------------------------------------------- worker side
def _reference(x, w, b, grad_out):
    """Plain float64 math: output and the gradients of ``sum(out * grad_out)``."""
    x, w, grad_out = x.double(), w.double(), grad_out.double()
    out = torch.einsum("...i,oi->...o", x, w)
    if b is not None:
        out = out + b.double()
    g2 = grad_out.reshape(-1, w.shape[0])
    grad_x = torch.einsum("...o,oi->...i", grad_out, w)
    grad_w = g2.t() @ x.reshape(-1, w.shape[1])
    grad_b = g2.sum(0) if b is not None else None
    return out, grad_x, grad_w, grad_b


def _placement(name: str):
    from torch.distributed.tensor import Replicate, Shard

    return {"replicate": Replicate(), "shard0": Shard(0), "shard1": Shard(1), "shardminus1": Shard(-1)}[name]


class _GraphRecorder:
    """A torch.compile backend that records the Dynamo graph's call targets and runs aot_eager."""

    def __init__(self) -> None:
        self.targets: list[str] = []

    def __call__(self, gm, example_inputs):
        self.targets += [str(node.target) for node in gm.graph.nodes if node.op == "call_function"]
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    def path(self) -> str:
        text = " ".join(self.targets)
        if "bmm" in text:
            return "bmm"
        if "built-in method mm" in text:
            return "mm"
        return "linear"


def _expected_path(mode: str, ndim: int, placement: str, mm_for_2d: bool) -> str:
    sharded_01 = ndim == 3 and placement in ("shard0", "shard1")
    if mode == "eager":
        return "bmm" if sharded_01 else "linear"
    if mode == "compiled_async_tp" and not sharded_01:
        return "linear"
    if ndim == 3:
        return "bmm"
    return "mm" if (ndim == 2 and mm_for_2d) else "linear"


def _observe_eager_path(forward, x, w, b, mm_for_2d):
    """Run ``forward`` eagerly with spies on each path's function; return (out, path that ran)."""
    from unittest import mock

    import fusible_ops.basic.linear_dispatch as tp

    ran = []

    def spy(name, fn):
        def wrapped(*args, **kwargs):
            ran.append(name)
            return fn(*args, **kwargs)

        return wrapped

    with (
        mock.patch.object(tp, "_bmm_linear", spy("bmm", tp._bmm_linear)),
        mock.patch.object(tp, "_mm_linear", spy("mm", tp._mm_linear)),
        mock.patch.object(tp, "_async_tp_linear", spy("async_tp", tp._async_tp_linear)),
        mock.patch.object(tp.F, "linear", spy("linear", tp.F.linear)),
        mock.patch.object(tp.torch, "bmm", spy("torch.bmm", torch.bmm)),
        mock.patch.object(tp.torch, "mm", spy("torch.mm", torch.mm)),
    ):
        out = forward(x, w, b, mm_for_2d)
    path = ran[0] if ran else "none"
    # the path's own matmul must really run (not, say, an F.linear inside _bmm_linear)
    if path in ("bmm", "mm"):
        assert ran[1:2] == [f"torch.{path}"], ran
    return out, path


def _run_linear_case(case: str, mesh) -> dict:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from fusible_ops.parallel import select_tp_linear_path, tp_linear_forward

    _, mode, ndim_name, placement, style, bias_name = case.split("-")
    ndim = int(ndim_name[0])
    has_bias = bias_name == "bias"
    mm_for_2d = style == "colwise"  # cover both settings of the 2-D compile switch

    gen = torch.Generator().manual_seed(zlib.crc32(case.encode()))  # same data on every rank
    x_full = torch.randn(INPUT_SHAPES[ndim], generator=gen, dtype=torch.float64)
    w_full = torch.randn(OUT_FEATURES, IN_FEATURES, generator=gen, dtype=torch.float64)
    b_full = torch.randn(OUT_FEATURES, generator=gen, dtype=torch.float64) if has_bias else None
    g_full = torch.randn(*INPUT_SHAPES[ndim][:-1], OUT_FEATURES, generator=gen, dtype=torch.float64)

    x = distribute_tensor(x_full, mesh, [_placement(placement)]).requires_grad_()
    w_place, b_place = (Shard(0), Shard(0)) if style == "colwise" else (Shard(1), Replicate())
    w = distribute_tensor(w_full, mesh, [w_place]).requires_grad_()
    b = distribute_tensor(b_full, mesh, [b_place]).requires_grad_() if has_bias else None

    recorder = None
    if mode == "eager":
        selected = select_tp_linear_path(x, mm_for_2d)
        out, observed = _observe_eager_path(tp_linear_forward, x, w, b, mm_for_2d)
        assert observed == selected, (observed, selected)
    else:
        torch._dynamo.reset()
        recorder = _GraphRecorder()
        compiled = torch.compile(lambda x, w, b: tp_linear_forward(x, w, b, mm_for_2d), backend=recorder)
        import torch._inductor.config as inductor_config

        with inductor_config.patch(_micro_pipeline_tp=mode == "compiled_async_tp"):
            out = compiled(x, w, b)
        observed = recorder.path()
    if observed == "async_tp":
        observed = "linear"
    (out.full_tensor() * g_full).sum().backward()

    ref_out, ref_gx, ref_gw, ref_gb = _reference(x_full, w_full, b_full, g_full)
    errors = {
        "out": (out.full_tensor() - ref_out).abs().max().item(),
        "grad_x": (x.grad.full_tensor() - ref_gx).abs().max().item(),
        "grad_w": (w.grad.full_tensor() - ref_gw).abs().max().item(),
    }
    if has_bias:
        errors["grad_b"] = (b.grad.full_tensor() - ref_gb).abs().max().item()
    return {
        "errors": errors,
        "path": observed,
        "expected_path": _expected_path(mode, ndim, placement, mm_for_2d),
        "out_shape": list(out.shape),
    }


def _run_module_case(case: str, mesh) -> dict:
    from torch.distributed.tensor import Shard, distribute_tensor

    from fusible_ops.parallel import LinearLoRA, TPLinear, shard_colwise, shard_rowwise

    module_name, style, mode = case.split("-")
    torch.manual_seed(0)  # same parameters on every rank
    if module_name == "tplinear":
        module = TPLinear(IN_FEATURES, OUT_FEATURES, dtype=torch.float64)
    else:
        module = LinearLoRA(IN_FEATURES, OUT_FEATURES, r=2, alpha=4, dtype=torch.float64)
        torch.nn.init.normal_(module.lora_B)  # a zero lora_B would hide a wrong adapter path
    full = {name: p.detach().clone() for name, p in module.named_parameters()}
    trainable = {name for name, p in module.named_parameters() if p.requires_grad}
    x_full = torch.randn(4, 6, IN_FEATURES, dtype=torch.float64)
    g_full = torch.randn(4, 6, OUT_FEATURES, dtype=torch.float64)

    if style == "colwise":
        shard_colwise(module, mesh, use_local_output=False)
        x = x_full.clone().requires_grad_()
        placements = {"weight": "S(0)", "lora_B": "S(0)", "lora_A": "R", "bias": "S(0)"}
    else:
        shard_rowwise(module, mesh, input_layouts=Shard(-1), use_local_output=False)
        x = distribute_tensor(x_full, mesh, [Shard(-1)]).to_local().requires_grad_()
        placements = {"weight": "S(1)", "lora_A": "S(1)", "lora_B": "R", "bias": "R"}
    fn = module if mode == "eager" else torch.compile(module, backend="aot_eager")
    torch._dynamo.reset()
    out = fn(x)
    (out.full_tensor() * g_full).sum().backward()

    lora_delta = 0.0
    if module_name == "lora":
        lora_delta = (full["lora_B"] @ full["lora_A"]) * module.scale
    weight_eff = full["weight"] + lora_delta
    ref_out, ref_gx, ref_gw_eff, _ = _reference(x_full, weight_eff, full["bias"], g_full)
    errors = {"out": (out.full_tensor() - ref_out).abs().max().item()}
    if style == "rowwise":  # x is this rank's slice of the last dim
        ref_gx = ref_gx.chunk(WORLD_SIZE, dim=-1)[dist.get_rank()]
    errors["grad_x"] = (x.grad - ref_gx).abs().max().item()
    for name, p in module.named_parameters():
        if name in trainable and p.grad is None:
            errors[f"missing grad {name}"] = float("inf")
        if name not in trainable and p.grad is not None:
            errors[f"unexpected grad {name}"] = float("inf")
    if module_name == "lora":
        # dL/dB = scale * dL/dW_eff @ A^T, dL/dA = scale * B^T @ dL/dW_eff
        ref_gb = module.scale * ref_gw_eff @ full["lora_A"].t()
        ref_ga = module.scale * full["lora_B"].t() @ ref_gw_eff
        errors["grad_lora_B"] = (module.lora_B.grad.full_tensor() - ref_gb).abs().max().item()
        errors["grad_lora_A"] = (module.lora_A.grad.full_tensor() - ref_ga).abs().max().item()
        with torch.no_grad():
            module.merge()
            merged = module(x).full_tensor()
            module.unmerge()
            unmerged = module(x).full_tensor()
        errors["merged_vs_ref"] = (merged - ref_out).abs().max().item()
        errors["unmerged_vs_ref"] = (unmerged - ref_out).abs().max().item()
    else:
        errors["grad_w"] = (module.weight.grad.full_tensor() - ref_gw_eff).abs().max().item()
    observed = {
        name: "R" if p.placements[0].is_replicate() else f"S({p.placements[0].dim})"
        for name, p in module.named_parameters()
    }
    expected = {name: placements[name] for name in observed}
    return {"errors": errors, "placements": observed, "expected_placements": expected}


def _run_sequential_case(case: str, mesh) -> dict:
    """``fusible_ops.Sequential(BasicLinear[, Bias])`` with DTensor parameters; compiled,
    side by side with ``nn.Linear`` under ``parallelize_module`` on the same weights."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import fusible_ops as fo

    _, style, mode, bias = case.split("-")
    with_bias = bias == "bias"
    torch.manual_seed(0)
    ops = [fo.BasicLinear(IN_FEATURES, OUT_FEATURES, dtype=torch.float64)]
    if with_bias:
        ops.append(fo.Bias(OUT_FEATURES, dtype=torch.float64))
    seq = fo.Sequential(*ops)
    b_full = torch.randn(OUT_FEATURES, dtype=torch.float64) if with_bias else None
    w_full = seq[0].weight.detach().clone()
    # colwise: a sequence-sharded input (the DTensor-safe bmm path); rowwise: feature-sharded
    w_place, b_place, x_place = (
        (Shard(0), Shard(0), Shard(1)) if style == "colwise" else (Shard(1), Replicate(), Shard(-1))
    )
    seq[0].weight = torch.nn.Parameter(distribute_tensor(w_full, mesh, [w_place]))
    if with_bias:
        seq[1].bias = torch.nn.Parameter(distribute_tensor(b_full, mesh, [b_place]))
    x_full = torch.randn(4, 6, IN_FEATURES, dtype=torch.float64)
    g_full = torch.randn(4, 6, OUT_FEATURES, dtype=torch.float64)
    x = distribute_tensor(x_full, mesh, [x_place]).requires_grad_()
    torch._dynamo.reset()
    # fullgraph: no graph break, like nn.Linear under parallelize_module
    fn = seq if mode == "eager" else torch.compile(seq, backend="aot_eager", fullgraph=True)
    out = fn(x)
    (out.full_tensor() * g_full).sum().backward()
    ref_out, ref_gx, ref_gw, ref_gb = _reference(x_full, w_full, b_full, g_full)
    errors = {
        "out": (out.full_tensor() - ref_out).abs().max().item(),
        "grad_x": (x.grad.full_tensor() - ref_gx).abs().max().item(),
        "grad_w": (seq[0].weight.grad.full_tensor() - ref_gw).abs().max().item(),
    }
    if with_bias:
        errors["grad_b"] = (seq[1].bias.grad.full_tensor() - ref_gb).abs().max().item()
    if mode == "compiled":
        errors.update(
            _plain_parallel_linear(style, w_full, b_full, x_full, g_full, x_place, mesh, out, ref_gw)
        )
    return {"errors": errors}


def _plain_parallel_linear(style, w_full, b_full, x_full, g_full, x_place, mesh, fused_out, ref_gw) -> dict:
    """The same layer as a plain ``nn.Linear`` under ``parallelize_module``, compiled fullgraph."""
    from torch.distributed.tensor import Replicate, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    linear = torch.nn.Linear(IN_FEATURES, OUT_FEATURES, bias=b_full is not None, dtype=torch.float64)
    with torch.no_grad():
        linear.weight.copy_(w_full)
        if b_full is not None:
            linear.bias.copy_(b_full)
    plan = (ColwiseParallel if style == "colwise" else RowwiseParallel)(
        input_layouts=x_place, output_layouts=Replicate(), use_local_output=False
    )
    parallelize_module(linear, mesh, plan)
    x_local = distribute_tensor(x_full, mesh, [x_place]).to_local().detach().requires_grad_()
    torch._dynamo.reset()
    out = torch.compile(linear, backend="aot_eager", fullgraph=True)(x_local)
    (out.full_tensor() * g_full).sum().backward()
    return {
        "plain_out_vs_fused": (out.full_tensor() - fused_out.full_tensor()).abs().max().item(),
        "plain_grad_w_vs_ref": (linear.weight.grad.full_tensor() - ref_gw).abs().max().item(),
    }


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
    runners = {"linear": _run_linear_case, "sequential": _run_sequential_case}
    for case in LINEAR_CASES + MODULE_CASES + SEQUENTIAL_CASES:
        start = time.perf_counter()
        try:
            results[case] = runners.get(case.split("-")[0], _run_module_case)(case, mesh)
        except Exception:  # reported per case by the parent's test
            results[case] = {"exception": traceback.format_exc()}
        results[case]["seconds"] = time.perf_counter() - start
    with open(os.path.join(result_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    result_dir = str(tmp_path_factory.mktemp("tp_gloo"))
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(rank, port, result_dir)) for rank in range(WORLD_SIZE)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(TIMEOUT_S)
    alive = [proc for proc in procs if proc.is_alive()]
    for proc in alive:
        proc.kill()
    if alive:
        pytest.fail(f"gloo workers did not finish within {TIMEOUT_S} s")
    per_rank = []
    for rank in range(WORLD_SIZE):
        path = os.path.join(result_dir, f"rank{rank}.json")
        if not os.path.exists(path):
            pytest.fail(f"gloo worker rank {rank} wrote no results (exit code {procs[rank].exitcode})")
        with open(path) as f:
            per_rank.append(json.load(f))
    return {"per_rank": per_rank}


def _check_case(results: dict, case: str) -> list[dict]:
    outcomes = [per_rank[case] for per_rank in results["per_rank"]]
    for rank, outcome in enumerate(outcomes):
        assert "exception" not in outcome, f"rank {rank}:\n{outcome['exception']}"
        bad = {name: err for name, err in outcome["errors"].items() if not err <= 1e-9}
        assert not bad, f"rank {rank}: errors against the float64 reference: {bad}"
    return outcomes


@pytest.mark.parametrize("case", LINEAR_CASES)
def test_tp_linear_forward_matches_reference(results, case):
    for outcome in _check_case(results, case):
        assert outcome["path"] == outcome["expected_path"]


@pytest.mark.parametrize("case", MODULE_CASES)
def test_sharded_module_matches_reference(results, case):
    for outcome in _check_case(results, case):
        assert outcome["placements"] == outcome["expected_placements"]


@pytest.mark.parametrize("case", SEQUENTIAL_CASES)
def test_fusible_sequential_with_dtensor_weights(results, case):
    _check_case(results, case)
