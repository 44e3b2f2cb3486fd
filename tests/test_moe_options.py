"""fo.MoE's routing, shared-expert, capacity and load-balancing options vs a per-token float64 reference.

The reference below routes one token at a time with Python loops over experts and groups
(written from the formulas in docs/moe.md, not from fusible_ops.moe.router), and gets
every gradient from autograd on that loop.
"""

from __future__ import annotations

import math

import pytest
import reference_ops as ref
import torch
from error_model import rounding_rtol

from fusible_ops import MoE

H, F, S = 6, 5, 4  # hidden, expert ffn, shared ffn

# the configurations public models use (small), each with an expert that gets no token
MODELS = {
    "mixtral": dict(num_experts=4, top_k=2),
    "qwen3_moe": dict(num_experts=8, top_k=2),
    "qwen2_moe": dict(
        num_experts=6, top_k=2, renormalize=False, shared_ffn_hidden_size=S, shared_expert_gate=True
    ),
    "deepseek_v3": dict(
        num_experts=8,
        top_k=3,
        score="sigmoid",
        expert_groups=4,
        topk_groups=2,
        score_correction_bias=True,
        routed_scaling_factor=2.5,
        shared_ffn_hidden_size=S,
    ),
    "gpt_oss": dict(
        num_experts=4,
        top_k=2,
        router_bias=True,
        activation="clamped_swiglu",
        activation_kwargs={"limit": 1.5, "alpha": 1.702, "glu_interleave_size": 1},
        bias=True,
        scale_after_fc2=True,
    ),
    "capacity": dict(num_experts=4, top_k=2, capacity_factor=0.6, bias=True),
    "srelu_shared": dict(
        num_experts=4, top_k=1, activation="srelu", shared_ffn_hidden_size=S, score="sigmoid"
    ),
}


# ---------------------------------------------------------------- the reference


def ref_route(logits, cfg, correction_bias):
    """One token's ``[(expert, weight)]``, written from the formulas."""
    num_experts, top_k = len(logits), cfg.get("top_k")
    if cfg.get("score", "softmax") == "softmax":
        exps = [torch.exp(v - logits.max()) for v in logits]
        scores = [v / sum(exps) for v in exps]
    else:
        scores = [1 / (1 + torch.exp(-v)) for v in logits]
    selection = [
        float(s.detach()) + (float(correction_bias[e]) if correction_bias is not None else 0.0)
        for e, s in enumerate(scores)
    ]
    allowed = list(range(num_experts))
    if cfg.get("expert_groups"):
        size = num_experts // cfg["expert_groups"]
        group_score = [
            sum(sorted(selection[g * size : (g + 1) * size], reverse=True)[:2])
            for g in range(cfg["expert_groups"])
        ]
        best = sorted(range(cfg["expert_groups"]), key=lambda g: -group_score[g])[: cfg["topk_groups"]]
        allowed = [e for e in allowed if e // size in best]
    chosen = sorted(allowed, key=lambda e: -selection[e])[:top_k]
    weights = [scores[e] for e in chosen]
    if cfg.get("renormalize", True):
        total = sum(weights)
        weights = [w / total for w in weights]
    return [(e, w * cfg.get("routed_scaling_factor", 1.0)) for e, w in zip(chosen, weights)]


def ref_dropped(routes, num_experts, capacity_factor):
    """The (token, slot) pairs over capacity: slot-major, then token order."""
    capacity = math.ceil(capacity_factor * len(routes) * len(routes[0]) / num_experts)
    used, dropped = [0] * num_experts, set()
    for slot in range(len(routes[0])):
        for t, route in enumerate(routes):
            e = route[slot][0]
            if used[e] >= capacity:
                dropped.add((t, slot))
            used[e] += 1
    return dropped


def act(cfg, h):
    kind = cfg.get("activation", "swiglu")
    options = dict(cfg.get("activation_kwargs", {}))
    interleave = options.pop("glu_interleave_size", None)
    if kind == "clamped_swiglu":
        options = {"limit": options.get("limit", 7.0), "alpha": options.get("alpha", 1.702), "offset": 1.0}
    return ref.activation(kind, h, interleave, **options)


def ref_moe(x, p, cfg, correction_bias, router_input=None):
    """Per-token loop; ``p`` holds float64 leaves named like the module's parameters."""
    router_input = x if router_input is None else router_input
    logits_all = router_input @ p["router.weight"].T + (p["router.bias"] if "router.bias" in p else 0)
    routes = [ref_route(logits_all[t], cfg, correction_bias) for t in range(x.shape[0])]
    dropped = (
        ref_dropped(routes, cfg["num_experts"], cfg["capacity_factor"])
        if cfg.get("capacity_factor")
        else set()
    )
    outs = []
    for t in range(x.shape[0]):
        y = torch.zeros(H, dtype=torch.float64)
        for slot, (e, w) in enumerate(routes[t]):
            if (t, slot) in dropped:
                continue
            h = p["experts.0.weight"][e] @ x[t] + (p["experts.0.bias"][e] if "experts.0.bias" in p else 0)
            b2 = p["experts.2.bias"][e] if "experts.2.bias" in p else 0
            if cfg.get("scale_after_fc2"):
                y = y + w * (p["experts.2.weight"][e] @ act(cfg, h) + b2)
            else:
                y = y + p["experts.2.weight"][e] @ (w * act(cfg, h)) + b2
        if cfg.get("shared_ffn_hidden_size"):
            shared = p["shared_experts.2.weight"] @ act(cfg, p["shared_experts.0.weight"] @ x[t])
            if cfg.get("shared_expert_gate"):
                shared = shared * torch.sigmoid(p["shared_expert_gate.weight"] @ x[t])
            y = y + shared
        outs.append(y)
    return torch.stack(outs), routes, dropped


# ---------------------------------------------------------------- helpers


def make_moe(cfg, seed=0, **extra):
    torch.manual_seed(seed)
    moe = MoE(H, F, cfg["num_experts"], cfg["top_k"], dtype=torch.float64, **_kwargs(cfg, extra))
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.5)
        # the last expert never makes the top-k: its router row is very negative on x[:, 0] >= 1
        moe.router.weight[-1].zero_()
        moe.router.weight[-1, 0] = -30.0
        if moe.router.bias is not None:
            moe.router.bias[-1] = -30.0
        if moe.score_correction_bias is not None:
            moe.score_correction_bias.copy_(torch.randn(cfg["num_experts"]) * 0.1)
    return moe


def _kwargs(cfg, extra):
    return {k: v for k, v in {**cfg, **extra}.items() if k not in ("num_experts", "top_k")}


def tokens(n=12, seed=1):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, H, dtype=torch.float64, generator=gen)
    x[:, 0] = x[:, 0].abs() + 1.0
    return x


def check_against_reference(moe, cfg, x, grad, atol=1e-10):
    x = x.clone().requires_grad_()
    out = moe(x)
    out.backward(grad)
    params = dict(moe.named_parameters())
    leaves = {name: ref.leaf(t) for name, t in params.items()}
    ref_x = ref.leaf(x)
    bias = moe.score_correction_bias
    expected, routes, dropped = ref_moe(ref_x, leaves, cfg, None if bias is None else bias.double())
    torch.testing.assert_close(out, expected, atol=atol, rtol=1e-9)
    expected.backward(grad)
    torch.testing.assert_close(x.grad, ref_x.grad, atol=atol, rtol=1e-9)
    for name, p in params.items():
        expected_grad = leaves[name].grad
        expected_grad = torch.zeros_like(p) if expected_grad is None else expected_grad
        torch.testing.assert_close(
            p.grad, expected_grad, atol=atol, rtol=1e-9, msg=lambda m, n=name: f"{n}: {m}"
        )
    return routes, dropped


# ---------------------------------------------------------------- forward and backward


@pytest.mark.parametrize("model", list(MODELS))
def test_model_configuration_matches_per_token_reference(model):
    cfg = MODELS[model]
    moe = make_moe(cfg)
    x = tokens()
    grad = torch.randn(x.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    routes, dropped = check_against_reference(moe, cfg, x, grad)
    assert moe.last_expert_load[-1] == 0  # an expert with no token
    assert int(moe.last_expert_load.sum()) == x.shape[0] * cfg["top_k"]
    assert moe.experts[0].weight.grad[-1].abs().max() == 0
    if cfg.get("capacity_factor"):
        assert dropped  # the case drops rows
    # the fused expert block ran, 3-op and GPT-OSS's 4-op pattern alike
    plan = moe.experts.last_plan.fusion_plans[0]
    assert plan.forward_op_types() == ["GroupedMLP"], plan


def test_moe_bf16_configuration_runs_fused_and_matches_float64():
    cfg = MODELS["gpt_oss"]
    moe64 = make_moe(cfg)
    moe = make_moe(cfg).to(torch.bfloat16)
    x = tokens()
    out = moe(x.to(torch.bfloat16))
    assert out.dtype == torch.bfloat16
    # the rounded logits, fc1, activation, fc2 and combine results (seeded: no top-k ties)
    assert ref.max_rel_err(out, moe64(x)) < rounding_rtol(torch.bfloat16, 5, condition=2)


def test_router_jitter_only_in_training_and_only_on_the_router_input():
    cfg = MODELS["mixtral"]
    moe = make_moe(cfg, router_jitter=0.2)
    x = tokens()
    leaves = {name: t.detach() for name, t in moe.named_parameters()}
    moe.eval()
    torch.testing.assert_close(moe(x), ref_moe(x, leaves, cfg, None)[0])
    moe.train()
    torch.manual_seed(5)
    jittered = moe(x)
    torch.manual_seed(5)
    noise = torch.empty_like(x).uniform_(0.8, 1.2)
    expected, routes, _ = ref_moe(x, leaves, cfg, None, router_input=x * noise)
    torch.testing.assert_close(jittered, expected)
    assert routes != ref_moe(x, leaves, cfg, None)[1]  # the jitter changed some routing weights


# ---------------------------------------------------------------- load balancing


def ref_aux_loss(x, router_weight, cfg):
    """``E / k * sum_e f_e P_e`` with ``f_e`` = tokens choosing e / T and ``P_e`` the mean normalised score."""
    num_experts, top_k = cfg["num_experts"], cfg["top_k"]
    logits = x @ router_weight.T
    counts = [0] * num_experts
    score_sums = [0.0] * num_experts
    for t in range(x.shape[0]):
        for e, _ in ref_route(logits[t], cfg, None):
            counts[e] += 1
        scores = (
            torch.softmax(logits[t], -1)
            if cfg.get("score", "softmax") == "softmax"
            else torch.sigmoid(logits[t])
        )
        scores = scores / scores.sum()
        for e in range(num_experts):
            score_sums[e] = score_sums[e] + scores[e]
    n = x.shape[0]
    return num_experts / top_k * sum(counts[e] / n * score_sums[e] / n for e in range(num_experts))


def ref_seq_aux_loss(x_bsh, router_weight, cfg):
    """DeepSeek-V3: per sequence ``sum_e (E / (k S)) count_e * mean_t s'_te``, averaged."""
    return sum(ref_aux_loss(seq, router_weight, cfg) for seq in x_bsh) / x_bsh.shape[0]


def ref_z_loss(x, router_weight):
    logits = x @ router_weight.T
    return sum(torch.log(torch.exp(logits[t]).sum()) ** 2 for t in range(x.shape[0])) / x.shape[0]


@pytest.mark.parametrize("mode", ["aux_loss", "seq_aux_loss"])
@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_balancing_losses_equal_their_formulas_and_reach_the_router(mode, score):
    cfg = dict(num_experts=4, top_k=2, score=score)
    coeff, z_coeff = 0.3, 0.05
    moe = make_moe(cfg, load_balancing=mode, aux_loss_coeff=coeff, z_loss_coeff=z_coeff)
    x = tokens(12).reshape(3, 4, H)  # 3 sequences of 4 tokens
    out = moe(x)
    rw = ref.leaf(moe.router.weight)
    flat = x.reshape(-1, H)
    lb = ref_aux_loss(flat, rw, cfg) if mode == "aux_loss" else ref_seq_aux_loss(x, rw, cfg)
    z = ref_z_loss(flat, rw)
    torch.testing.assert_close(moe.aux_losses["load_balancing"], lb.detach(), rtol=1e-12, atol=0)
    torch.testing.assert_close(moe.aux_losses["z_loss"], z.detach(), rtol=1e-12, atol=0)
    assert not moe.aux_losses["load_balancing"].requires_grad
    out.sum().backward()
    # the router's gradient is that of out.sum() + coeff * loss + z_coeff * z
    leaves = {name: ref.leaf(t) for name, t in moe.named_parameters()}
    leaves["router.weight"] = rw
    expected, _, _ = ref_moe(flat, leaves, cfg, None)
    flat_lb = ref_aux_loss(flat, rw, cfg) if mode == "aux_loss" else ref_seq_aux_loss(x, rw, cfg)
    (expected.sum() + coeff * flat_lb + z_coeff * ref_z_loss(flat, rw)).backward()
    torch.testing.assert_close(moe.router.weight.grad, rw.grad, rtol=1e-9, atol=1e-12)


def test_output_with_attached_losses_may_be_modified_in_place():
    """The losses ride on the routing weights' backward: the output is an ordinary tensor."""
    cfg = dict(num_experts=4, top_k=2)
    moe = make_moe(cfg, load_balancing="aux_loss", aux_loss_coeff=0.5, z_loss_coeff=0.1)
    plain = make_moe(cfg, load_balancing="aux_loss", aux_loss_coeff=0.5, z_loss_coeff=0.1)
    x = tokens()
    out = moe(x)
    out.add_(1.0)  # e.g. a residual added in place
    out.sum().backward()
    plain(x).sum().backward()
    torch.testing.assert_close(moe.router.weight.grad, plain.router.weight.grad)


def test_aux_loss_in_backward_false_leaves_the_router_gradient_to_the_user():
    cfg = dict(num_experts=4, top_k=2)
    on = make_moe(cfg, load_balancing="aux_loss", aux_loss_coeff=0.5)
    off = make_moe(cfg, load_balancing="aux_loss", aux_loss_coeff=0.5, aux_loss_in_backward=False)
    x = tokens()
    on(x).sum().backward()
    out = off(x)
    assert off.aux_losses["load_balancing"].requires_grad is False
    out.sum().backward()
    assert not torch.allclose(on.router.weight.grad, off.router.weight.grad)
    # balanced routing gives 1.0: perfectly uniform scores and counts
    uniform = make_moe(dict(num_experts=4, top_k=2), load_balancing="aux_loss")
    with torch.no_grad():
        uniform.router.weight.zero_()
    uniform(tokens(8))
    # zero logits: softmax 1/4 each, top-2 by index picks experts 0 and 1: f = (1, 1, 0, 0)
    torch.testing.assert_close(uniform.aux_losses["load_balancing"], torch.tensor(1.0, dtype=torch.float64))


def test_eval_forward_adds_no_loss_and_counts_nothing():
    moe = make_moe(dict(num_experts=4, top_k=2), load_balancing="aux_free")
    moe.eval()
    moe(tokens())
    assert moe.expert_load_since_update.sum() == 0 and moe.aux_losses == {}


def test_aux_free_moves_overloaded_expert_down_and_idle_up():
    moe = make_moe(
        dict(num_experts=4, top_k=1, score="sigmoid"), load_balancing="aux_free", bias_update_rate=0.01
    )
    with torch.no_grad():
        moe.score_correction_bias.zero_()
    for _ in range(3):  # counts accumulate over micro-batches
        moe(tokens())
    load = moe.expert_load_since_update.clone()
    assert load.sum() == 36 and load[-1] == 0
    moe.update_score_correction_bias()
    bias = moe.score_correction_bias
    busiest = int(load.argmax())
    assert bias[busiest] == pytest.approx(-0.01) and bias[-1] == pytest.approx(0.01)
    assert moe.expert_load_since_update.sum() == 0
    moe.update_score_correction_bias()  # nothing counted since: no change
    assert bias[-1] == pytest.approx(0.01)
    with pytest.raises(RuntimeError, match="not 'aux_free'"):
        make_moe(dict(num_experts=4, top_k=1)).update_score_correction_bias()
    assert "score_correction_bias" in moe.state_dict() and "expert_load_since_update" not in moe.state_dict()


def _train(load_balancing: str, steps: int = 200, window: int = 20, **options) -> float:
    """max/mean expert load over the last ``window`` steps of a task where the router
    starts collapsed onto expert 0 and the task loss gives it no reason to leave."""
    torch.manual_seed(0)
    moe = MoE(8, 8, 4, 1, load_balancing=load_balancing, **options)
    with torch.no_grad():
        moe.router.weight.normal_(0, 0.1)
        moe.router.weight[0, 0] = 4.0
    opt = torch.optim.Adam(moe.parameters(), lr=1e-2)
    load = torch.zeros(4, dtype=torch.float64)
    for step in range(steps):
        x = torch.randn(64, 8)
        x[:, 0] = x[:, 0].abs() + 1.0
        loss = (moe(x) - x.flip(-1)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if load_balancing == "aux_free":
            moe.update_score_correction_bias()
        if step >= steps - window:
            load += moe.last_expert_load
    return float(load.max() / load.mean())


def test_training_with_balancing_keeps_experts_balanced_where_none_collapses():
    assert _train("none") > 3.0  # collapsed: nearly every token on one expert
    assert _train("aux_loss", aux_loss_coeff=0.1) < 1.5
    assert _train("aux_free", score="sigmoid", bias_update_rate=0.01) < 1.5


# ---------------------------------------------------------------- capacity and sentinels


def test_capacity_drops_rows_and_counts_them():
    cfg = MODELS["capacity"]
    moe = make_moe(cfg)
    x = tokens()
    moe(x)
    # demand (including the dropped rows) is what last_expert_load reports
    assert int(moe.last_expert_load.sum()) == x.shape[0] * cfg["top_k"]
    capacity = math.ceil(cfg["capacity_factor"] * x.shape[0] * cfg["top_k"] / cfg["num_experts"])
    kept = moe.last_expert_load - moe.last_dropped_load
    assert kept.max() == capacity and (kept <= capacity).all()
    assert torch.equal(moe.last_dropped_load, (moe.last_expert_load - capacity).clamp(min=0))


def test_correction_bias_stays_float32_under_a_dtype_cast():
    moe = make_moe(MODELS["deepseek_v3"]).to(torch.bfloat16)
    assert moe.router.weight.dtype == torch.bfloat16 and moe.score_correction_bias.dtype == torch.float32


def test_permute_sentinel_and_dropped_rows_add_nothing_and_get_no_gradient():
    from fusible_ops.moe import permute, unpermute

    gen = torch.Generator().manual_seed(0)
    tokens_ = torch.randn(5, 3, dtype=torch.float64, generator=gen, requires_grad=True)
    ids = torch.tensor([[0, 4], [1, 0], [7, 2], [2, 1], [0, 3]])  # 4 and 7 are sentinels (E = 4)
    dropped = torch.zeros(5, 2, dtype=torch.bool)
    dropped[3, 0] = True
    probs = torch.rand(5, 2, dtype=torch.float64, generator=gen, requires_grad=True)
    perm = permute(tokens_, ids, 4, probs, dropped=dropped)
    assert int(perm.split_sizes.sum()) == 10 and perm.split_sizes[-1] >= 3  # sentinels sit in the last group
    assert (perm.token_index == -1).sum() == 3
    out = unpermute(perm.rows * 2.0, perm.token_index, 5, probs=perm.probs)
    keep = (ids < 4) & ~dropped
    expected = torch.stack(
        [sum(2.0 * tokens_[t] * probs[t, j] for j in range(2) if keep[t, j]) for t in range(5)]
    )
    torch.testing.assert_close(out, expected)
    grads = torch.autograd.grad(out.sum(), (tokens_, probs))
    expected_grads = torch.autograd.grad(expected.sum(), (tokens_, probs))
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want)
    assert (grads[1][~keep] == 0).all()


# ---------------------------------------------------------------- bad options


@pytest.mark.parametrize(
    "options, match",
    [
        (
            dict(expert_groups=3, topk_groups=1),
            "expert_groups=3 must be a positive int dividing num_experts=8",
        ),
        (dict(expert_groups=4, topk_groups=1, top_k=3), "offer 2 experts, fewer than top_k=3"),
        (dict(expert_groups=4), "go together"),
        (dict(expert_groups=4, topk_groups=5), r"topk_groups=5 must be an int in \[1, expert_groups=4\]"),
        (dict(load_balancing="switch"), "load_balancing must be one of"),
        (dict(aux_loss_coeff=-1.0), "aux_loss_coeff must be a number >= 0"),
        (dict(routed_scaling_factor=0), "routed_scaling_factor must be a positive number"),
        (dict(shared_expert_gate=True), "shared_expert_gate needs shared experts"),
        (dict(router_jitter=1.5), r"router_jitter must be a number in \[0, 1\)"),
        (dict(capacity_factor=0), "capacity_factor must be a positive number or None"),
        (dict(activation_kwargs={"limit": 3.0}), "activation_kwargs .* do not fit ScaledSwiGLU"),
        (dict(shared_ffn_hidden_size=-1), "shared_ffn_hidden_size must be an int >= 0"),
    ],
)
def test_incompatible_options_raise_at_construction(options, match):
    kwargs = {"top_k": 2, **options}
    top_k = kwargs.pop("top_k")
    with pytest.raises(ValueError, match=f"MoE: .*{match}"):
        MoE(H, F, 8, top_k, **kwargs)


def test_checkpoint_helpers_load_the_gpt_oss_configuration():
    """A GPT-OSS-layout checkpoint (transposed, interleaved gate/up, biases) into the 4-op experts."""
    from fusible_ops.checkpoint import export_stacked, load_stacked

    cfg = MODELS["gpt_oss"]
    moe = make_moe(cfg)
    E, gen = cfg["num_experts"], torch.Generator().manual_seed(9)
    gate_up = torch.randn(E, H, 2 * F, dtype=torch.float64, generator=gen)  # [E, H, 2F], interleaved
    down = torch.randn(E, F, H, dtype=torch.float64, generator=gen)
    gate_up_bias = torch.randn(E, 2 * F, dtype=torch.float64, generator=gen)
    down_bias = torch.randn(E, H, dtype=torch.float64, generator=gen)
    load_stacked(
        moe, gate_up, down, gate_up_bias=gate_up_bias, down_bias=down_bias, transposed=True, interleaved=True
    )
    # the interleaved layout is what the activation reads: fc1 holds gate_up as is, transposed
    torch.testing.assert_close(moe.experts[0].weight, gate_up.transpose(1, 2))
    torch.testing.assert_close(moe.experts[2].bias, down_bias)
    back = export_stacked(moe, transposed=True, interleaved=True)
    for name, value in (("gate_up", gate_up), ("down", down), ("gate_up_bias", gate_up_bias)):
        torch.testing.assert_close(back[name], value)


@pytest.mark.parametrize("model", ["deepseek_v3", "gpt_oss", "qwen2_moe", "capacity"])
def test_options_compile_fullgraph_and_match_eager(model):
    """Routing, shared experts, capacity and the losses attached to backward trace as one graph."""
    moe = make_moe(MODELS[model], load_balancing="aux_loss", z_loss_coeff=0.1)
    x = tokens()
    eager = moe(x)
    eager.sum().backward()
    eager_grads = {name: p.grad.clone() for name, p in moe.named_parameters()}
    eager_losses = dict(moe.aux_losses)
    moe.zero_grad()
    torch._dynamo.reset()
    compiled = torch.compile(moe, fullgraph=True, backend="aot_eager")
    out = compiled(x)
    out.sum().backward()
    torch.testing.assert_close(out, eager)
    for name, p in moe.named_parameters():
        torch.testing.assert_close(p.grad, eager_grads[name], msg=lambda m, n=name: f"{n}: {m}")
    for name, value in eager_losses.items():
        torch.testing.assert_close(moe.aux_losses[name], value)


@pytest.mark.parametrize("model", list(MODELS))
def test_zero_tokens_with_every_balancing_mode(model):
    """No token at all (2-D, and 3-D with no sequence or no batch): empty output, finite losses."""
    for mode in ("none", "aux_loss", "seq_aux_loss", "aux_free"):
        moe = make_moe(MODELS[model], load_balancing=mode, z_loss_coeff=0.1)
        for shape in ((0, H), (2, 0, H), (0, 3, H)):
            x = torch.zeros(*shape, dtype=torch.float64, requires_grad=True)
            out = moe(x)
            out.sum().backward()
            assert out.shape == shape and x.grad.shape == shape
            assert all(torch.isfinite(v) for v in moe.aux_losses.values()), (mode, shape, moe.aux_losses)
            assert int(moe.last_expert_load.sum()) == 0
