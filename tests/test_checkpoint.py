"""Expert checkpoint import/export against hand-built public layouts."""

from __future__ import annotations

import pytest
import torch

import fusible_ops as fo
from fusible_ops import MoE
from fusible_ops.checkpoint import (
    expert_range,
    export_grouped_keys,
    export_per_expert,
    export_stacked,
    load_grouped_keys,
    load_per_expert,
    load_per_expert_state_dict,
    load_stacked,
)
from fusible_ops.moe import ExpertPlacement

E, H, F = 4, 6, 3


@pytest.fixture
def public():
    """Per-expert gate/up/down matrices and biases: the ground truth every layout encodes."""
    gen = torch.Generator().manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, dtype=torch.float64, generator=gen)

    return {
        "gate": [rnd(F, H) for _ in range(E)],
        "up": [rnd(F, H) for _ in range(E)],
        "down": [rnd(H, F) for _ in range(E)],
        "gate_b": [rnd(F) for _ in range(E)],
        "up_b": [rnd(F) for _ in range(E)],
        "down_b": [rnd(H) for _ in range(E)],
    }


def _expected_fc1(public, e):
    """Our fc1 layout, built row by row: gate rows first, then up rows."""
    return torch.cat([public["gate"][e], public["up"][e]], dim=0)


def _assert_loaded(moe, public, bias):
    for e in range(E):
        torch.testing.assert_close(
            moe.experts[0].weight[e].detach(), _expected_fc1(public, e), rtol=0, atol=0
        )
        torch.testing.assert_close(moe.experts[2].weight[e].detach(), public["down"][e], rtol=0, atol=0)
        if bias:
            want = torch.cat([public["gate_b"][e], public["up_b"][e]])
            torch.testing.assert_close(moe.experts[0].bias[e].detach(), want, rtol=0, atol=0)
            torch.testing.assert_close(moe.experts[2].bias[e].detach(), public["down_b"][e], rtol=0, atol=0)


def _stacked_tensors(public, transposed, interleaved):
    """Build the public stacked layout directly from per-expert matrices (element by element)."""
    gate_up = torch.empty(E, 2 * F, H, dtype=torch.float64)
    gate_up_b = torch.empty(E, 2 * F, dtype=torch.float64)
    for e in range(E):
        for i in range(F):
            gi, ui = (2 * i, 2 * i + 1) if interleaved else (i, F + i)
            gate_up[e, gi], gate_up[e, ui] = public["gate"][e][i], public["up"][e][i]
            gate_up_b[e, gi], gate_up_b[e, ui] = public["gate_b"][e][i], public["up_b"][e][i]
    down = torch.stack(public["down"])
    if transposed:
        gate_up, down = gate_up.transpose(1, 2).contiguous(), down.transpose(1, 2).contiguous()
    return {
        "gate_up": gate_up,
        "down": down,
        "gate_up_bias": gate_up_b,
        "down_bias": torch.stack(public["down_b"]),
    }


@pytest.mark.parametrize(
    "transposed, interleaved", [(False, False), (True, False), (True, True), (False, True)]
)
@pytest.mark.parametrize("bias", [False, True])
def test_stacked_roundtrip(public, transposed, interleaved, bias):
    moe = MoE(H, F, E, 2, bias=bias, dtype=torch.float64)
    tensors = _stacked_tensors(public, transposed, interleaved)
    if not bias:
        tensors = {k: tensors[k] for k in ("gate_up", "down")}
    load_stacked(moe, **tensors, transposed=transposed, interleaved=interleaved)
    _assert_loaded(moe, public, bias)
    exported = export_stacked(moe, transposed=transposed, interleaved=interleaved)
    assert exported.keys() == tensors.keys()
    for k in tensors:
        assert torch.equal(exported[k], tensors[k]), k


def test_stacked_into_interleaved_activation(public):
    """A model whose activation reads GPT-OSS interleaved columns stores fc1 interleaved."""
    experts = fo.Sequential(
        fo.GroupedLinear(E, H, 2 * F, dtype=torch.float64),
        fo.ScaledSwiGLU(glu_interleave_size=1),
        fo.GroupedLinear(E, F, H, dtype=torch.float64),
    )
    tensors = _stacked_tensors(public, transposed=True, interleaved=True)
    load_stacked(experts, tensors["gate_up"], tensors["down"], transposed=True, interleaved=True)
    assert torch.equal(experts[0].weight.detach(), tensors["gate_up"].transpose(1, 2))
    # the experts compute the same function as with the plain layout
    plain = MoE(H, F, E, 1, dtype=torch.float64)
    load_stacked(plain, tensors["gate_up"], tensors["down"], transposed=True, interleaved=True)
    x = torch.randn(5, H, dtype=torch.float64)
    splits, probs = [2, 0, 3, 0], torch.rand(5, dtype=torch.float64)
    torch.testing.assert_close(experts(x, splits, probs, splits), plain.experts(x, splits, probs, splits))


@pytest.mark.parametrize("bias", [False, True])
def test_per_expert_roundtrip(public, bias):
    moe = MoE(H, F, E, 2, bias=bias, dtype=torch.float64)
    biases = {"b1": public["gate_b"], "b3": public["up_b"], "b2": public["down_b"]} if bias else {}
    load_per_expert(moe, public["gate"], public["down"], public["up"], **biases)
    _assert_loaded(moe, public, bias)
    exported = export_per_expert(moe)
    assert sorted(exported) == sorted(["w1", "w2", "w3", *biases])
    for name, source in (("w1", "gate"), ("w3", "up"), ("w2", "down")):
        for e in range(E):
            assert torch.equal(exported[name][e], public[source][e])


def test_per_expert_state_dict_mixtral_and_qwen_names(public):
    for names in (("w1", "w3", "w2"), ("gate_proj", "up_proj", "down_proj")):
        sd = {}
        for e in range(E):
            for name, source in zip(names, ("gate", "up", "down")):
                sd[f"block_sparse_moe.experts.{e}.{name}.weight"] = public[source][e].float()
        moe = MoE(H, F, E, 2, dtype=torch.float64)
        load_per_expert_state_dict(moe, sd, prefix="block_sparse_moe.experts.", names=names)
        for e in range(E):
            torch.testing.assert_close(
                moe.experts[0].weight[e].detach(), _expected_fc1(public, e).float().double()
            )


def test_grouped_keys_roundtrip(public):
    moe = MoE(H, F, E, 2, bias=True, dtype=torch.float64)
    sd = {}
    for e in range(E):
        sd[f"experts.0.weight{e}"] = _expected_fc1(public, e)
        sd[f"experts.2.weight{e}"] = public["down"][e]
        sd[f"experts.0.bias{e}"] = torch.cat([public["gate_b"][e], public["up_b"][e]])
        sd[f"experts.2.bias{e}"] = public["down_b"][e]
    load_grouped_keys(moe, sd)
    _assert_loaded(moe, public, bias=True)
    exported = export_grouped_keys(moe)
    assert exported.keys() == sd.keys()
    assert all(torch.equal(exported[k], sd[k]) for k in sd)


def test_non_gated_srelu_layouts():
    moe = MoE(H, F, E, 2, activation="srelu", dtype=torch.float64)
    up = torch.randn(E, F, H, dtype=torch.float64)
    down = torch.randn(E, H, F, dtype=torch.float64)
    load_stacked(moe, up, down)
    assert torch.equal(moe.experts[0].weight.detach(), up)
    assert torch.equal(export_stacked(moe)["gate_up"], up)
    with pytest.raises(ValueError, match="interleaved"):
        load_stacked(moe, up, down, interleaved=True)
    with pytest.raises(ValueError, match="no w3"):
        load_per_expert(moe, list(up), list(down), list(up))


class _FakeEPRank(torch.nn.Module):
    """An MoE-shaped module as rank 1 of 2 would see it: experts 2 and 3 only."""

    def __init__(self):
        super().__init__()
        self.experts = MoE(H, F, E // 2, 1, dtype=torch.float64).experts
        self.experts.expert_placement = ExpertPlacement(2, E // 2, E)  # what an EP MoE records


def test_under_expert_parallelism_only_local_experts_are_read(public):
    shard = _FakeEPRank()
    assert list(expert_range(shard)) == [2, 3]
    tensors = _stacked_tensors(public, transposed=False, interleaved=False)
    load_stacked(shard, tensors["gate_up"], tensors["down"])
    for i, e in enumerate((2, 3)):
        assert torch.equal(shard.experts[0].weight[i].detach(), _expected_fc1(public, e))
    # a mapping with only this rank's experts is enough
    only_mine = {e: public["gate"][e] for e in (2, 3)}
    load_per_expert(
        shard, only_mine, {e: public["down"][e] for e in (2, 3)}, {e: public["up"][e] for e in (2, 3)}
    )
    exported = export_per_expert(shard)
    assert sorted(exported["w1"]) == [2, 3]
    assert sorted(export_grouped_keys(shard)) == sorted(
        f"experts.{i}.weight{e}" for i in (0, 2) for e in (2, 3)
    )


def test_bad_checkpoints_raise_and_leave_weights_unchanged(public):
    moe = MoE(H, F, E, 2, dtype=torch.float64)
    before = {k: v.clone() for k, v in moe.state_dict().items()}
    tensors = _stacked_tensors(public, transposed=False, interleaved=False)
    with pytest.raises(ValueError, match="down has shape"):
        load_stacked(moe, tensors["gate_up"], tensors["down"].transpose(1, 2))
    with pytest.raises(ValueError, match="gate_up has shape"):
        load_stacked(moe, tensors["gate_up"][:3], tensors["down"])
    with pytest.raises(ValueError, match="have no biases"):
        load_stacked(moe, **tensors)
    with pytest.raises(ValueError, match="no entry for expert 3"):
        load_per_expert(moe, public["gate"][:3], public["down"], public["up"])
    with pytest.raises(ValueError, match=r"w3\[1\] has shape"):
        load_per_expert(
            moe, public["gate"], public["down"], [public["up"][0], public["down"][1], *public["up"][2:]]
        )
    with pytest.raises(ValueError, match="missing key"):
        load_grouped_keys(moe, {"experts.0.weight0": tensors["gate_up"][0]})
    for k, v in moe.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_a_bare_experts_sequential_knows_its_global_experts():
    experts = MoE(H, F, E // 2, 1, dtype=torch.float64).experts
    experts.expert_placement = ExpertPlacement(2, 2, E)  # as MoE records it on rank 1 of 2
    assert list(expert_range(experts)) == [2, 3]


# ---------------------------------------------------------------- failed loads write nothing


def _bad(kind, like):
    """A tensor shaped like ``like`` that no parameter may take."""
    if kind == "complex":
        return like.to(torch.complex128)
    if kind == "int":
        return like.round().long()
    if kind == "bool":
        return like > 0
    return torch.empty_like(like, device="meta")


_BAD = [
    ("complex", "dtype torch.complex128"),
    ("int", "dtype torch.int64"),
    ("bool", "dtype torch.bool"),
    ("meta", "meta tensor"),
]


def _assert_unchanged_then_loadable(moe, before, public, bias=False):
    for k, v in moe.state_dict().items():
        assert torch.equal(v, before[k]), k
    # the next valid call on the same module works
    biases = {"b1": public["gate_b"], "b3": public["up_b"], "b2": public["down_b"]} if bias else {}
    load_per_expert(moe, public["gate"], public["down"], public["up"], **biases)
    _assert_loaded(moe, public, bias)


@pytest.mark.parametrize("kind, match", _BAD)
def test_load_stacked_checks_dtype_and_data_before_writing(public, kind, match):
    moe = MoE(H, F, E, 2, bias=True, dtype=torch.float64)
    before = {k: v.clone() for k, v in moe.state_dict().items()}
    tensors = _stacked_tensors(public, transposed=False, interleaved=False)
    for name in ("down", "down_bias"):  # checked after gate_up, written after fc1
        bad = dict(tensors, **{name: _bad(kind, tensors[name])})
        with pytest.raises(ValueError, match=rf"checkpoint: {name} .*{match}"):
            load_stacked(moe, **bad)
    _assert_unchanged_then_loadable(moe, before, public, bias=True)


@pytest.mark.parametrize("kind, match", _BAD)
def test_load_per_expert_checks_dtype_and_data_before_writing(public, kind, match):
    moe = MoE(H, F, E, 2, dtype=torch.float64)
    before = {k: v.clone() for k, v in moe.state_dict().items()}
    down = [*public["down"][:3], _bad(kind, public["down"][3])]
    with pytest.raises(ValueError, match=rf"checkpoint: w2\[3\] .*{match}"):
        load_per_expert(moe, public["gate"], down, public["up"])
    _assert_unchanged_then_loadable(moe, before, public)


@pytest.mark.parametrize("kind, match", _BAD)
def test_load_grouped_keys_checks_dtype_and_data_before_writing(public, kind, match):
    moe = MoE(H, F, E, 2, dtype=torch.float64)
    before = {k: v.clone() for k, v in moe.state_dict().items()}
    sd = {f"experts.0.weight{e}": _expected_fc1(public, e) for e in range(E)}
    sd.update({f"experts.2.weight{e}": public["down"][e] for e in range(E)})
    sd["experts.2.weight3"] = _bad(kind, sd["experts.2.weight3"])
    with pytest.raises(ValueError, match=rf"checkpoint: experts\.2\.weight3 .*{match}"):
        load_grouped_keys(moe, sd)
    _assert_unchanged_then_loadable(moe, before, public)


def _per_expert_sd(public, bias):
    sd = {}
    for e in range(E):
        for name, source in (("w1", "gate"), ("w3", "up"), ("w2", "down")):
            sd[f"{e}.{name}.weight"] = public[source][e]
            if bias:
                sd[f"{e}.{name}.bias"] = public[{"gate": "gate_b", "up": "up_b", "down": "down_b"}[source]][e]
    return sd


def test_per_expert_state_dict_checks_dtype_before_writing(public):
    moe = MoE(H, F, E, 2, dtype=torch.float64)
    before = {k: v.clone() for k, v in moe.state_dict().items()}
    sd = _per_expert_sd(public, bias=False)
    sd["3.w2.weight"] = sd["3.w2.weight"].to(torch.complex128)
    with pytest.raises(ValueError, match=r"checkpoint: w2\[3\] has dtype torch.complex128"):
        load_per_expert_state_dict(moe, sd)
    _assert_unchanged_then_loadable(moe, before, public)


def test_bias_keys_for_bias_free_experts_are_an_error(public):
    moe = MoE(H, F, E, 2, dtype=torch.float64)
    before = {k: v.clone() for k, v in moe.state_dict().items()}
    grouped = export_grouped_keys(MoE(H, F, E, 2, bias=True, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"checkpoint: key 'experts.0.bias0' has no place .*no biases"):
        load_grouped_keys(moe, grouped)
    with pytest.raises(ValueError, match=r"checkpoint: key '0.w1.bias' has no place .*no biases"):
        load_per_expert_state_dict(moe, _per_expert_sd(public, bias=True))
    with pytest.raises(ValueError, match="have no biases"):
        load_per_expert(
            moe,
            public["gate"],
            public["down"],
            public["up"],
            b1=public["gate_b"],
            b2=public["down_b"],
            b3=public["up_b"],
        )
    _assert_unchanged_then_loadable(moe, before, public)
    # other keys of a whole-model state dict are not the loader's business
    sd = _per_expert_sd(public, bias=False)
    load_per_expert_state_dict(moe, {**sd, "router.weight": torch.zeros(E, H), "x.0.w1.bias": torch.zeros(1)})
    _assert_loaded(moe, public, bias=False)


def test_experts_past_the_models_count_are_an_error(public):
    """A checkpoint with more experts than the model must not load its first E silently."""
    moe = MoE(H, F, E, 2, dtype=torch.float64)
    before = {k: v.clone() for k, v in moe.state_dict().items()}
    grouped = export_grouped_keys(moe)
    grouped["experts.0.weight4"] = grouped["experts.0.weight0"]
    with pytest.raises(ValueError, match=r"checkpoint: key 'experts.0.weight4' has no place"):
        load_grouped_keys(moe, grouped)
    sd = _per_expert_sd(public, bias=False)
    sd["4.w2.weight"] = sd["0.w2.weight"]
    with pytest.raises(ValueError, match=r"checkpoint: key '4.w2.weight' has no place"):
        load_per_expert_state_dict(moe, sd)
    with pytest.raises(ValueError, match=r"checkpoint: w1 has entries for experts \[4\]"):
        load_per_expert(moe, [*public["gate"], public["gate"][0]], public["down"], public["up"])
    with pytest.raises(ValueError, match=r"checkpoint: w3 has entries for experts \[-1\]"):
        load_per_expert(
            moe, public["gate"], public["down"], {**dict(enumerate(public["up"])), -1: public["up"][0]}
        )
    _assert_unchanged_then_loadable(moe, before, public)


def test_non_gated_experts_refuse_up_projection_keys():
    moe = MoE(H, F, E, 2, activation="srelu", dtype=torch.float64)
    before = {k: v.clone() for k, v in moe.state_dict().items()}
    sd = {
        f"{e}.{n}.weight": torch.randn(*s, dtype=torch.float64)
        for e in range(E)
        for n, s in (("w1", (F, H)), ("w2", (H, F)))
    }
    with pytest.raises(ValueError, match=r"checkpoint: key '0.w3.weight' has no place"):
        load_per_expert_state_dict(moe, {**sd, "0.w3.weight": torch.randn(F, H, dtype=torch.float64)})
    for k, v in moe.state_dict().items():
        assert torch.equal(v, before[k]), k
    load_per_expert_state_dict(moe, sd)
    assert torch.equal(moe.experts[0].weight[1].detach(), sd["1.w1.weight"])


def test_loads_accept_other_float_dtypes_and_cast(public):
    moe = MoE(H, F, E, 2, dtype=torch.float64)
    load_per_expert(
        moe, [g.float() for g in public["gate"]], public["down"], [u.half() for u in public["up"]]
    )
    torch.testing.assert_close(moe.experts[0].weight[0].detach()[:F], public["gate"][0].float().double())


_WRONG_TARGETS = {
    "linear": lambda: torch.nn.Linear(8, 8),
    "grouped_linear": lambda: fo.GroupedLinear(4, 8, 12),
    "short_sequential": lambda: fo.Sequential(fo.GroupedLinear(4, 8, 12)),
    "dense_fc2": lambda: fo.Sequential(fo.GroupedLinear(4, 8, 12), fo.ScaledSwiGLU(), fo.BasicLinear(6, 8)),
    "torch_sequential": lambda: torch.nn.Sequential(
        torch.nn.Linear(8, 12), torch.nn.SiLU(), torch.nn.Linear(12, 8)
    ),
}
_HELPERS = {
    "load_stacked": lambda t: load_stacked(t, torch.zeros(4, 12, 8), torch.zeros(4, 8, 6)),
    "load_per_expert": lambda t: load_per_expert(
        t, [torch.zeros(6, 8)] * 4, [torch.zeros(8, 6)] * 4, [torch.zeros(6, 8)] * 4
    ),
    "load_grouped_keys": lambda t: load_grouped_keys(
        t,
        {f"experts.{i}.weight{e}": torch.zeros(s) for i, s in ((0, (12, 8)), (2, (8, 6))) for e in range(4)},
    ),
    "export_stacked": export_stacked,
    "export_per_expert": export_per_expert,
    "export_grouped_keys": export_grouped_keys,
    "expert_range": expert_range,
}


@pytest.mark.parametrize("helper", list(_HELPERS))
@pytest.mark.parametrize("target", list(_WRONG_TARGETS))
def test_helpers_refuse_a_module_of_the_wrong_kind(helper, target):
    module = _WRONG_TARGETS[target]()
    before = [p.detach().clone() for p in module.parameters()]
    with pytest.raises(
        TypeError, match=r"checkpoint: target must be an fo.MoE or its experts Sequential .* got a \w+"
    ):
        _HELPERS[helper](module)
    assert all(torch.equal(p, b) for p, b in zip(module.parameters(), before))
    # the same helper works on a module of the right kind
    _HELPERS[helper](fo.Sequential(fo.GroupedLinear(4, 8, 12), fo.ScaledSwiGLU(), fo.GroupedLinear(4, 6, 8)))
