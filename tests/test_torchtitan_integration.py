"""torchtitan 0.3's MoE with its experts on fusible-ops (``fusible_ops.integrations.torchtitan``).

Side by side with torchtitan's own layer: the converted layer keeps torchtitan's
parameters, state-dict keys, router, dispatcher, combine and expert-bias statistics. In
fp32 it equals torchtitan's layer whose experts are an independent float64 per-expert
loop; with ``compute_dtype=torch.bfloat16`` it equals torchtitan's own experts (which
cast to bf16). Also: ``torch.compile(fullgraph=True)``, and expert parallelism over 2
gloo ranks with torchtitan's all-to-all dispatcher, eager and compiled.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("torchtitan.models.common.moe", reason="torchtitan is not installed")

from test_moe_ep import _spawn  # noqa: E402
from torchtitan.models.common.linear import Linear  # noqa: E402
from torchtitan.models.common.moe import (  # noqa: E402
    GroupedExperts,
    MoE,
    RoutedExperts,
    TokenChoiceTopKRouter,
)
from torchtitan.models.common.token_dispatcher import (  # noqa: E402
    AllToAllTokenDispatcher,
    LocalTokenDispatcher,
)

import fusible_ops as fo  # noqa: E402
from fusible_ops.integrations import torchtitan as fo_titan  # noqa: E402

# torch._grouped_mm (torchtitan's own experts) needs rows of a multiple of 16 bytes in bf16
DIM, HIDDEN, EXPERTS, TOP_K = 16, 24, 4, 2
FP32_EPS, BF16_EPS = 2.0**-24, 2.0**-8

pytestmark = pytest.mark.filterwarnings("ignore:In CPU autocast:UserWarning")


def _config(ep: bool = False) -> MoE.Config:
    dispatcher = AllToAllTokenDispatcher if ep else LocalTokenDispatcher
    return MoE.Config(
        num_experts=EXPERTS,
        routed_experts=RoutedExperts.Config(
            inner_experts=GroupedExperts.Config(dim=DIM, hidden_dim=HIDDEN, num_experts=EXPERTS),
            token_dispatcher=dispatcher.Config(num_experts=EXPERTS, top_k=TOP_K),
        ),
        router=TokenChoiceTopKRouter.Config(
            num_experts=EXPERTS,
            gate=Linear.Config(in_features=DIM, out_features=EXPERTS),
            top_k=TOP_K,
            score_func="softmax",
        ),
        load_balance_coeff=1e-3,
    )


def _titan_layer(seed: int = 0, ep: bool = False) -> MoE:
    torch.manual_seed(seed)
    layer = _config(ep).build()
    with torch.no_grad():
        for param in layer.parameters():
            param.normal_(0.0, 0.3)
    return layer


def _float64_experts(experts: GroupedExperts):
    """An independent reference of torchtitan's expert math: a float64 loop over experts."""

    def forward(x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        rows, start = [], 0
        for e, count in enumerate(num_tokens_per_expert_E.tolist()):
            x = x_RD[start : start + count].double()
            w1, w2, w3 = (w[e].double() for w in (experts.w1_EFD, experts.w2_EDF, experts.w3_EFD))
            rows.append((torch.nn.functional.silu(x @ w1.T) * (x @ w3.T)) @ w2.T)
            start += count
        return torch.cat(rows).to(x_RD.dtype)

    return forward


def _reference_layer(state: dict, ep: bool = False) -> MoE:
    layer = _config(ep).build()
    layer.load_state_dict(state)
    layer.routed_experts.inner_experts.forward = _float64_experts(layer.routed_experts.inner_experts)
    return layer


def _run(layer: torch.nn.Module, x: torch.Tensor, grad: torch.Tensor, call=None) -> list[torch.Tensor]:
    """Output, input gradient and every parameter's gradient of ``(layer(x) * grad).sum()``."""
    x = x.clone().requires_grad_(True)
    for param in layer.parameters():
        param.grad = None
    out = (layer if call is None else call)(x)
    (out * grad).sum().backward()
    return [out.detach(), x.grad, *(p.grad for p in layer.parameters())]


def _close(actual: list, expected: list, eps: float, length: int) -> None:
    for a, e in zip(actual, expected, strict=True):
        # error model: each GEMM result is a sum of `length` terms, rounded per term
        atol = 8 * eps * length * max(1.0, e.abs().max().item())
        torch.testing.assert_close(a, e, rtol=0, atol=atol)


def test_convert_keeps_parameters_and_state_dict_keys():
    layer = _titan_layer()
    params = dict(layer.named_parameters())
    keys = sorted(layer.state_dict())
    assert fo_titan.convert(layer) == 1
    assert fo_titan.convert(layer) == 0  # already converted
    experts = layer.routed_experts.inner_experts
    assert isinstance(experts, fo_titan.FusibleGroupedExperts) and isinstance(experts, GroupedExperts)
    assert all(p is params[name] for name, p in layer.named_parameters())
    assert sorted(layer.state_dict()) == keys
    # from a config: same keys, and a torchtitan state dict loads strictly
    built = fo_titan.convert_config(_config()).build()
    assert isinstance(built.routed_experts.inner_experts, fo_titan.FusibleGroupedExperts)
    built.load_state_dict(layer.state_dict())
    assert sorted(built.state_dict()) == keys


@pytest.mark.numerics
def test_fp32_equals_torchtitan_math_and_bias_statistics():
    titan = _titan_layer()
    reference = _reference_layer(titan.state_dict())
    ours = fo_titan.convert_config(_config()).build()
    ours.load_state_dict(titan.state_dict())
    x, grad = torch.randn(3, 7, DIM), torch.randn(3, 7, DIM)
    _close(_run(ours, x, grad), _run(reference, x, grad), FP32_EPS, max(DIM, HIDDEN, 21))
    # torchtitan's expert-bias statistics (accumulated in forward) and its update rule
    torch.testing.assert_close(ours.tokens_per_expert_E, reference.tokens_per_expert_E, rtol=0, atol=0)
    for layer in (ours, reference):
        counts = layer.tokens_per_expert_E
        delta = layer.load_balance_coeff * torch.sign(counts.mean() - counts)
        layer.expert_bias_E.add_(delta - delta.mean())
    torch.testing.assert_close(ours.expert_bias_E, reference.expert_bias_E, rtol=0, atol=0)
    assert ours.expert_bias_E.abs().sum() > 0
    # the next forward routes with the updated bias in both
    _close(_run(ours, x, grad), _run(reference, x, grad), FP32_EPS, max(DIM, HIDDEN, 21))


@pytest.mark.numerics
def test_bf16_compute_equals_torchtitan_own_experts():
    titan = _titan_layer()
    ours = _titan_layer()
    fo_titan.convert(ours, compute_dtype=torch.bfloat16)
    x, grad = torch.randn(2, 9, DIM), torch.randn(2, 9, DIM)
    _close(_run(ours, x, grad), _run(titan, x, grad), BF16_EPS, max(DIM, HIDDEN, 18))


def test_plan_says_gate_and_up_are_never_concatenated():
    layer = _titan_layer()
    fo_titan.convert(layer)
    plan = layer.routed_experts.inner_experts.explain(torch.randn(5, DIM), torch.tensor([2, 0, 3, 0]))
    assert "GroupedMLP(ops 0..2)" in plan and "never concatenated" in plan
    assert "grouped_mlp_gate_up_unscaled (joint) fired" in plan


def test_compile_fullgraph_equals_eager():
    layer = _titan_layer()
    fo_titan.convert(layer)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    for seed in range(2):
        torch.manual_seed(100 + seed)
        x, grad = torch.randn(2, 6, DIM), torch.randn(2, 6, DIM)
        _close(_run(layer, x, grad, compiled), _run(layer, x, grad), FP32_EPS, max(DIM, HIDDEN, 12))


def test_refuses_experts_converted_to_low_precision():
    class Float8GroupedExperts(GroupedExperts):
        pass

    layer = _titan_layer()
    layer.routed_experts.inner_experts.__class__ = Float8GroupedExperts
    with pytest.raises(ValueError, match="Float8GroupedExperts.*low-precision converter"):
        fo_titan.convert(layer)


def _quantized_experts(experts: GroupedExperts, recipe):
    """An independent float64 emulation of the experts' forward under ``recipe``: each of
    the three GEMMs' operands quantized along the contraction (tests/recipe_reference.py)."""
    from tests import recipe_reference as ref

    def forward(x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        groups = num_tokens_per_expert_E.tolist()
        w1, w2, w3 = (ref.quantize_weight(w.detach(), recipe, "columns") for w in
                      (experts.w1_EFD, experts.w2_EDF, experts.w3_EFD))  # fmt: skip
        x_q = ref.quantize(x_RD.detach(), recipe, "input", "columns", groups)
        act, start = torch.zeros(x_RD.shape[0], w1.shape[1], dtype=torch.float64), 0
        for e, count in enumerate(groups):
            rows = slice(start, start + count)
            gate, up = ref.rd(x_q[rows] @ w1[e].T, torch.float32), ref.rd(x_q[rows] @ w3[e].T, torch.float32)
            act[rows] = ref.rd(torch.nn.functional.silu(gate) * up, torch.float32)
            start += count
        act_q, out, start = ref.quantize(act.float(), recipe, "input", "columns", groups), [], 0
        for e, count in enumerate(groups):
            out.append(act_q[start : start + count] @ w2[e].T)
            start += count
        return torch.cat(out).to(x_RD.dtype)

    return forward


@pytest.mark.parametrize("name", ["mxfp8_rceil", "rowwise", "tensorwise"])
def test_recipe_matches_quantized_emulation(name):
    """``recipe=`` (a torchtitan name) quantizes the experts' GEMMs: the forward equals an
    independent emulation, differs visibly from fp32, and compiled equals eager."""
    state = _titan_layer().state_dict()
    layer = fo_titan.convert_config(_config(), recipe=name).build()
    layer.load_state_dict(state)
    reference = _config().build()
    reference.load_state_dict(state)
    experts = reference.routed_experts.inner_experts
    recipe = fo_titan.RECIPE_NAMES[name]
    assert layer.routed_experts.inner_experts.recipe == recipe
    torch.manual_seed(3)
    x, grad = torch.randn(2, 40, DIM), torch.randn(2, 40, DIM)
    plain = _run(reference, x, grad)
    experts.forward = _quantized_experts(experts, recipe)
    expected = reference(x).detach()
    got = _run(layer, x, grad)
    rel = lambda a, b: float((a.double() - b.double()).norm() / b.double().norm())  # noqa: E731
    assert rel(got[0], expected) <= 2e-3 < rel(plain[0], expected) / 3
    assert 2e-3 < rel(got[1], plain[1]) < 0.2  # quantized gradients, near the fp32 ones
    assert repr(recipe) in layer.routed_experts.inner_experts.explain(
        torch.randn(12, DIM), torch.tensor([3, 0, 4, 5])
    )
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    for a, b in zip(_run(layer, x, grad, compiled), got):
        assert rel(a, b) <= 1e-6


def test_recipes_of_torchtitan_converters_are_kept():
    """A config converted by torchtitan's float8 / MXFP8 experts converters (their convert()
    alone: the converters' constructors need a GPU and torchao) keeps its recipe."""
    from types import SimpleNamespace

    from torchtitan.components.quantization.float8 import Float8GroupedExpertsConverter
    from torchtitan.components.quantization.mx import MXFP8GroupedExpertsConverter

    float8 = Float8GroupedExpertsConverter.convert(SimpleNamespace(PAD_MULTIPLE=16), _config(ep=True))
    mx_converter = SimpleNamespace(config=SimpleNamespace(pad_multiple=32, recipe_name="mxfp8_rceil"))
    mxfp8 = MXFP8GroupedExpertsConverter.convert(mx_converter, _config(ep=True))
    for config, want in ((float8, fo.recipes.Float8Rowwise()), (mxfp8, fo.recipes.MXFP8())):
        converted = fo_titan.convert_config(config).routed_experts.inner_experts
        assert type(converted) is fo_titan.FusibleGroupedExperts.Config and converted.recipe == want
    float8 = Float8GroupedExpertsConverter.convert(SimpleNamespace(PAD_MULTIPLE=16), _config(ep=True))
    explicit = fo_titan.convert_config(float8, recipe=fo.recipes.MXFP8(scale_rounding="floor"))
    assert explicit.routed_experts.inner_experts.recipe == fo.recipes.MXFP8(scale_rounding="floor")
    with pytest.raises(ValueError, match="unknown recipe name 'fp4'"):
        fo_titan.convert_config(_config(), recipe="fp4")


def test_refuses_experts_with_their_own_math():
    from dataclasses import dataclass

    class GptOssLikeExperts(GroupedExperts):  # math of its own, as gpt-oss's experts
        @dataclass(kw_only=True, slots=True)
        class Config(GroupedExperts.Config):
            swiglu_limit: float = 7.0

    config = _config()
    config.routed_experts.inner_experts = GptOssLikeExperts.Config(
        dim=DIM, hidden_dim=HIDDEN, num_experts=EXPERTS
    )
    with pytest.raises(
        TypeError, match="GptOssLikeExperts is a subclass of GroupedExperts with its own math"
    ):
        fo_titan.convert_config(config)


def _ep_worker(rank: int, world: int, port: int, counts: list[int]) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.distributed import utils as titan_dist

    titan_dist.set_spmd_backend("partial_dtensor")  # torchtitan's DTensor path (no trainer mesh)

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        torch._dynamo.config.capture_scalar_outputs = True  # the dispatcher's split sizes
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
        state = _titan_layer().state_dict()
        reference = _reference_layer(state)
        layer = fo_titan.convert_config(_config(ep=True)).build()
        layer.load_state_dict(state)
        experts, local = layer.routed_experts.inner_experts, EXPERTS // world
        for name in ("w1_EFD", "w2_EDF", "w3_EFD"):
            part = getattr(experts, name).detach()[rank * local : (rank + 1) * local].clone()
            setattr(experts, name, torch.nn.Parameter(part))
        layer.routed_experts.token_dispatcher.wire_meshes(ep_mesh=mesh)
        compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
        for step, call in enumerate((None, compiled, compiled)):
            torch.manual_seed(10 * step + rank)
            x, grad = torch.randn(1, counts[rank], DIM), torch.randn(1, counts[rank], DIM)
            out, x_grad, *grads = _run(layer, x, grad, call)
            ref_out, ref_x_grad, *ref_grads = _run(reference, x, grad)
            names = [name for name, _ in reference.named_parameters()]
            expected = []
            for name, ref in zip(names, ref_grads):
                if "inner_experts" in name:  # an expert's gradient sums every rank's tokens
                    dist.all_reduce(ref)
                    ref = ref[rank * local : (rank + 1) * local]
                expected.append(ref)
            _close([out, x_grad, *grads], [ref_out, ref_x_grad, *expected], FP32_EPS, 4 * HIDDEN)
    finally:
        dist.destroy_process_group()


@pytest.mark.numerics
def test_expert_parallel_two_ranks_eager_and_compiled():
    _spawn(2, [7, 5], worker=_ep_worker)
