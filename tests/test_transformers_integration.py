"""fusible_ops.integrations.transformers: HF MoE models' experts on fusible-ops, vs HF eager.

Tiny random models (2 layers, hidden 64, 8 experts) of every family in FAMILIES, in float64:
logits, loss and every parameter's gradient equal HF's eager experts (the same parameters
get none); the expert parameters stay the same objects; the fused plan ran. Plus training,
save/load, generate, the fallback and the expert-parallel sentinel.
"""

from __future__ import annotations

import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
fot = pytest.importorskip("fusible_ops.integrations.transformers")

from hf_tiny_models import FAMILIES, experts_modules, tiny_model  # noqa: E402

FAMILIES = list(FAMILIES)


def _model(family: str, dtype: torch.dtype = torch.float64, seed: int = 0):
    return tiny_model(family, dtype, seed).train()


_experts = experts_modules


def _run(model, ids):
    model.zero_grad()
    out = model(ids, labels=ids)
    out.loss.backward()
    # parameters without a gradient (ERNIE's e_score_correction_bias) are left out
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach(), out.loss.detach(), grads


def _rel(a, b) -> float:
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


@pytest.mark.parametrize("family", FAMILIES)
def test_family_matches_hf_eager_in_float64(family):
    model = _model(family)
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(1))
    experts = _experts(model)
    pointers = [(p.data_ptr(), id(p)) for e in experts for p in e.parameters()]
    keys = list(model.state_dict())
    model.set_experts_implementation("eager")
    logits, loss, grads = _run(model, ids)
    model.set_experts_implementation("fusible_ops")
    fo_logits, fo_loss, fo_grads = _run(model, ids)
    assert _rel(fo_logits, logits) < 1e-9 and abs(float(fo_loss - loss)) < 1e-9 * float(loss)
    assert list(fo_grads) == list(grads)
    for name, grad in grads.items():
        assert _rel(fo_grads[name], grad) < 1e-9, name
    # the parameters are shared, not copied, and the fused plan ran
    assert [(p.data_ptr(), id(p)) for e in experts for p in e.parameters()] == pointers
    assert list(model.state_dict()) == keys
    for e in experts:
        ops = fot.cached_ops(e)
        assert ops is not None and not any(m is ops for m in model.modules())
        assert ops.last_plan.fusion_plans[0].forward_op_types() == ["GroupedMLP"], ops.last_plan
        assert ops[0].weight is (e.gate_up_proj if e.has_gate else e.up_proj)
    # the experts' output alone, on random routing (an expert with no token included)
    e = experts[0]
    x = torch.randn(9, 64, dtype=torch.float64)
    top_k = torch.stack([torch.randperm(7)[:2] for _ in range(9)])  # expert 7 gets nothing
    weights = torch.rand(9, 2, dtype=torch.float64)
    got = fot.experts_forward(e, x, top_k, weights)
    model.set_experts_implementation("eager")
    assert _rel(got, e(x, top_k, weights)) < 1e-12


def test_parameters_replaced_rebuilds_the_ops():
    model = _model("mixtral")
    model.set_experts_implementation("fusible_ops")
    ids = torch.randint(0, 97, (1, 8))
    model(ids)
    e = _experts(model)[0]
    before = fot.cached_ops(e)
    e.gate_up_proj = torch.nn.Parameter(e.gate_up_proj.detach().clone() * 2)
    out = model(ids).logits
    assert fot.cached_ops(e) is not before and fot.cached_ops(e)[0].weight is e.gate_up_proj
    model.set_experts_implementation("eager")
    assert _rel(out, model(ids).logits) < 1e-9


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])
def test_training_losses_follow_hf_within_its_own_float32_noise(family):
    def train(implementation: str) -> list[float]:
        model = _model(family, torch.float32, seed=3)
        model.set_experts_implementation(implementation)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        gen = torch.Generator().manual_seed(4)
        losses = []
        for _ in range(20):
            ids = torch.randint(0, 97, (2, 16), generator=gen)
            loss = model(ids, labels=ids).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(float(loss))
        return losses

    eager, grouped, fused = train("eager"), train("grouped_mm"), train("fusible_ops")
    assert fused[-1] < fused[0]  # it trains
    noise = max(abs(a - b) for a, b in zip(grouped, eager))
    gap = max(abs(a - b) for a, b in zip(fused, eager))
    assert gap <= max(10 * noise, 1e-5), (gap, noise)


def test_save_pretrained_from_pretrained_and_generate(tmp_path):
    model = _model("qwen3_moe", torch.float32)
    model.save_pretrained(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = transformers.AutoModelForCausalLM.from_pretrained(
            tmp_path, experts_implementation="fusible_ops"
        )
    assert loaded.config._experts_implementation == "fusible_ops"
    for (name, a), b in zip(model.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), name
    prompt = torch.randint(0, 97, (1, 5), generator=torch.Generator().manual_seed(2))
    model.set_experts_implementation("eager")
    expected = model.generate(prompt, max_new_tokens=8, do_sample=False)
    got = loaded.generate(prompt, max_new_tokens=8, do_sample=False)
    assert torch.equal(got, expected)
    assert fot.cached_ops(_experts(loaded)[0]) is not None  # it ran on fusible-ops


def test_post_expert_norm_falls_back_with_one_warning():
    model = _model("mixtral", torch.float32)
    e = _experts(model)[0]
    e.has_post_expert_norm = True
    e.post_expert_norm = torch.nn.LayerNorm(64)
    x = torch.randn(6, 64)
    top_k = torch.randint(0, 8, (6, 2))
    weights = torch.rand(6, 2)
    fot._WARNED.clear()
    with pytest.warns(
        UserWarning, match=r"MixtralExperts runs on transformers' grouped_mm .*post-expert norm"
    ):
        got = fot.experts_forward(e, x, top_k, weights)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per class
        fot.experts_forward(e, x, top_k, weights)
    torch.testing.assert_close(
        got, transformers.integrations.moe.grouped_mm_experts_forward(e, x, top_k, weights)
    )
    assert fot.unsupported_reason(e) == "a post-expert norm (has_post_expert_norm=True)"
    with pytest.raises(ValueError, match="from_hf_experts: MixtralExperts cannot run on fusible-ops"):
        fot.from_hf_experts(e)


def test_unknown_gate_override_and_activation_are_reasons():
    model = _model("mixtral", torch.float32)
    e = _experts(model)[0]
    e.act_fn = torch.nn.GELU()  # exact-erf GELU: no fused kernel computes it
    assert "no fused gated activation for act_fn GELU" in fot.unsupported_reason(e)
    e.act_fn = torch.nn.SiLU()
    assert fot.unsupported_reason(e) is None

    class CustomExperts(type(e)):
        def _apply_gate(self, gate_up):
            return gate_up[..., :32] * 2

    e.__class__ = CustomExperts
    assert "unknown _apply_gate override" in fot.unsupported_reason(e)


def test_expert_parallel_sentinel_ids_are_dropped():
    model = _model("gpt_oss", torch.float32)
    e = _experts(model)[0]
    x = torch.randn(7, 64)
    top_k = torch.randint(0, 8, (7, 2))
    top_k[1, 0] = top_k[4, 1] = 8  # transformers' sentinel for experts on other ranks
    weights = torch.rand(7, 2)
    got = fot.experts_forward(e, x, top_k, weights)
    keep = (top_k < 8).to(weights.dtype)
    e._is_expert_parallel = True
    expected = transformers.integrations.moe.grouped_mm_experts_forward(e, x, top_k, weights)
    # float32, both rounding, hidden 64: rounding_rtol(float32, 64 + ffn + 2, condition=8) < 1e-4
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    # the same as routing the kept pairs only (a dropped pair's weight set to zero)
    torch.testing.assert_close(got, fot.experts_forward(e, x, top_k.clamp(max=7), weights * keep))


def test_from_hf_and_to_hf_experts_round_trip():
    from fusible_ops import MoE
    from fusible_ops.checkpoint import export_stacked

    model = _model("gpt_oss", torch.float64)
    e = _experts(model)[0]
    seq = fot.from_hf_experts(e)
    assert seq[0].weight is e.gate_up_proj and seq[0].weight_layout == "in_out" and len(seq) == 4
    moe = MoE(
        64, 32, 8, 2, activation="clamped_swiglu", bias=True, scale_after_fc2=True, dtype=torch.float64,
        activation_kwargs={"limit": e.limit, "alpha": e.alpha, "glu_interleave_size": 1},
    )  # fmt: skip
    fot.to_hf_experts(moe, e)
    for name, value in export_stacked(moe).items():
        torch.testing.assert_close(export_stacked(seq)[name], value)


def test_version_range_is_declared():
    low, high = fot.SUPPORTED_VERSIONS
    version = tuple(int(v) for v in transformers.__version__.split(".")[:2])
    assert low <= version < high


def test_gradient_checkpointing_gives_the_same_gradients():
    model = _model("olmoe")
    ids = torch.randint(0, 97, (2, 10), generator=torch.Generator().manual_seed(5))
    model.set_experts_implementation("eager")
    _, loss, grads = _run(model, ids)
    model.set_experts_implementation("fusible_ops")
    model.activation_checkpointing_enable()
    model.train()
    _, fo_loss, fo_grads = _run(model, ids)
    assert abs(float(fo_loss - loss)) < 1e-9 * float(loss)
    for name, grad in grads.items():
        assert _rel(fo_grads[name], grad) < 1e-9, name


def _eager_logits_then_fusible(seed: int):
    """A float32 tiny Mixtral, prompt ids, and HF eager's logits; the model left on fusible_ops."""
    model = _model("mixtral", torch.float32)
    ids = torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(seed))
    model.set_experts_implementation("eager")
    with torch.no_grad():
        expected = model(ids).logits
    model.set_experts_implementation("fusible_ops")
    return model, ids, expected


def test_inference_mode_forward_equals_eager():
    model, ids, expected = _eager_logits_then_fusible(6)
    with torch.inference_mode():
        got = model(ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_compiled_hf_model_with_fusible_experts_has_no_graph_break():
    model, ids, expected = _eager_logits_then_fusible(7)
    assert fot.prepare(model) == 2  # both layers' experts, built before tracing
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(model)(ids)
    assert explanation.graph_break_count == 0, [str(r.reason) for r in explanation.break_reasons]
    torch._dynamo.reset()
    with torch.no_grad():
        got = torch.compile(model, backend="aot_eager")(ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
