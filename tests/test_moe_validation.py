"""fo.MoE refuses what it cannot honour, before it changes anything: bad options at
construction, inputs without dense data, assignments to options fixed at construction or
bad per-call values, and state dicts that would load only in part."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fusible_ops import MoE
from fusible_ops.core.state_dict_checks import check_state_dict

H, F, E, K = 8, 4, 4, 2


def _moe(**options) -> MoE:
    return MoE(H, F, E, K, **options)


def _snapshot(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer (persistent or not), cloned."""
    state = {f"param:{k}": v.detach().clone() for k, v in module.named_parameters()}
    state.update({f"buffer:{k}": v.clone() for k, v in module.named_buffers()})
    return state


def _assert_unchanged(module: nn.Module, before: dict[str, torch.Tensor]) -> None:
    after = _snapshot(module)
    assert after.keys() == before.keys()
    for key, value in before.items():
        assert after[key].dtype == value.dtype and torch.equal(after[key], value), key


# ---------------------------------------------------------------- construction


@pytest.mark.parametrize(
    "options, argument",
    [
        (dict(activation_kwargs="glu_interleave_size=2"), "activation_kwargs must be a mapping"),
        (dict(activation_kwargs=[("glu_interleave_size", 2)]), "activation_kwargs must be a mapping"),
        (dict(activation_kwargs={"glu_interleave_size": "2"}), r"activation_kwargs\['glu_interleave_size'\]"),
        (dict(activation_kwargs={"glu_interleave_size": 2.0}), r"activation_kwargs\['glu_interleave_size'\]"),
        (dict(activation_kwargs={"glu_interleave_size": 3}), r"glu_interleave_size'\]=3 must divide"),
        (
            dict(activation="clamped_swiglu", activation_kwargs={"limit": "7"}),
            r"activation_kwargs\['limit'\] must be a positive finite number",
        ),
        (
            dict(activation="clamped_swiglu", activation_kwargs={"alpha": float("nan")}),
            r"activation_kwargs\['alpha'\] must be a finite number",
        ),
        (dict(dtype=torch.int32), "dtype must be None or a real floating-point dtype"),
        (dict(dtype=torch.complex64), "dtype must be None or a real floating-point dtype"),
        (dict(dtype="float32"), "dtype must be None or a real floating-point dtype"),
        (dict(capacity_factor=float("inf")), "capacity_factor must be a positive number"),
        (dict(capacity_factor=float("nan")), "capacity_factor must be a positive number"),
        (dict(capacity_factor=1e300), "capacity_factor must be a positive number"),
        (dict(balance_group=object()), "balance_group must be None, a torch.distributed process group"),
        (dict(aux_loss_coeff=float("inf")), "aux_loss_coeff must be a number >= 0 and finite"),
        (dict(aux_loss_in_backward="no"), "aux_loss_in_backward must be a bool"),
        (dict(routed_scaling_factor=float("inf")), "routed_scaling_factor must be a positive number"),
    ],
)
def test_bad_options_raise_at_construction_naming_the_argument(options, argument):
    with pytest.raises(ValueError, match=f"^MoE: .*{argument}"):
        _moe(**options)


def test_a_large_capacity_factor_within_bounds_drops_nothing():
    moe = _moe(capacity_factor=float(E))
    moe(torch.randn(64, H))
    assert moe.last_dropped_load.sum().item() == 0


# ---------------------------------------------------------------- inputs


def _nested(layout: torch.layout) -> torch.Tensor:
    return torch.nested.nested_tensor([torch.randn(2, H), torch.randn(3, H)], layout=layout)


INPUTS_WITHOUT_DENSE_DATA = {
    "meta": (lambda: torch.randn(3, H, device="meta"), "meta tensor"),
    "sparse_coo": (lambda: torch.randn(3, H).to_sparse(), "layout torch.sparse_coo"),
    "sparse_csr": (lambda: torch.randn(3, H).to_sparse_csr(), "layout torch.sparse_csr"),
    "nested": (lambda: _nested(torch.strided), "nested tensor"),
    "nested_jagged": (lambda: _nested(torch.jagged), "nested tensor"),
}


@pytest.mark.filterwarnings("ignore:.*nested tensors is in prototype")
@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
@pytest.mark.parametrize("kind", sorted(INPUTS_WITHOUT_DENSE_DATA))
def test_inputs_without_dense_data_raise_before_any_state_changes(kind):
    make, match = INPUTS_WITHOUT_DENSE_DATA[kind]
    moe = _moe(load_balancing="aux_free", capacity_factor=1.0).train()
    before = _snapshot(moe)
    with pytest.raises(ValueError, match=f"^MoE: input .*{match}"):
        moe(make())
    _assert_unchanged(moe, before)
    assert moe.last_expert_load is None and moe.last_dropped_load is None and moe.aux_losses == {}


# ---------------------------------------------------------------- attributes

READ_ONLY = {
    "hidden_size": 16,
    "ffn_hidden_size": 16,
    "num_experts": 8,
    "num_local_experts": 8,
    "top_k": 3,
    "activation": "geglu",
    "activation_kwargs": {"glu_interleave_size": 2},
    "scale_after_fc2": True,
    "load_balancing": "aux_loss",
    "balance_group": None,
    "ep_mesh": None,
    "expert_parallel": None,
    "routing": None,
    "score": "sigmoid",
    "renormalize": False,
    "ep_rank": 1,
    "ep_size": 2,
}


@pytest.mark.parametrize("name", sorted(READ_ONLY))
def test_options_fixed_at_construction_are_read_only(name):
    moe = _moe(load_balancing="seq_aux_loss")
    before = getattr(moe, name)
    with pytest.raises(AttributeError, match=f"MoE.{name} is fixed at construction"):
        setattr(moe, name, READ_ONLY[name])
    assert getattr(moe, name) == before


def test_top_k_stays_what_routing_and_the_aux_loss_use():
    moe = _moe(load_balancing="aux_loss").train()
    with pytest.raises(AttributeError):
        moe.top_k = 3
    moe(torch.randn(5, H))
    assert moe.top_k == moe.routing.top_k == K
    assert int(moe.last_expert_load.sum()) == 5 * K


def test_activation_kwargs_cannot_be_edited_in_place():
    moe = _moe(activation="clamped_swiglu", activation_kwargs={"limit": 3.0})
    with pytest.raises(TypeError):
        moe.activation_kwargs["limit"] = 1.0
    assert moe.activation_kwargs == {"limit": 3.0} and moe.experts[1].spec.limit == 3.0


PER_CALL_BAD = {
    "router_jitter": [1.5, -0.1, float("nan"), "0.1", True],
    "aux_loss_coeff": [-1.0, float("inf"), float("nan"), "0.5", None],
    "z_loss_coeff": [-1.0, float("inf"), torch.tensor(0.5)],
    "bias_update_rate": [-1e-3, float("inf"), False],
    "aux_loss_in_backward": ["no", 0, None],
    "capacity_factor": [0, -1.0, float("inf"), float("nan"), 1e300, "1.0"],
}


@pytest.mark.parametrize("name", sorted(PER_CALL_BAD))
def test_per_call_options_are_checked_on_assignment(name):
    moe = _moe()
    before = getattr(moe, name)
    for bad in PER_CALL_BAD[name]:
        with pytest.raises(ValueError, match=f"^MoE: {name} must be"):
            setattr(moe, name, bad)
        assert getattr(moe, name) == before


def _router_grad(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    moe.zero_grad()
    moe(x).sum().backward()
    return moe.router.weight.grad.clone()


def test_assigned_per_call_options_are_honoured_by_the_next_forward():
    x = torch.randn(12, H)
    moe = _moe(load_balancing="aux_loss").train()
    want = _moe(load_balancing="aux_loss", aux_loss_coeff=0.5, z_loss_coeff=0.1, capacity_factor=0.5).train()
    want.load_state_dict(moe.state_dict())
    _router_grad(moe, x)
    moe.aux_loss_coeff, moe.z_loss_coeff, moe.capacity_factor = 0.5, 0.1, 0.5
    torch.testing.assert_close(_router_grad(moe, x), _router_grad(want, x), rtol=0, atol=0)
    torch.testing.assert_close(moe.last_dropped_load, want.last_dropped_load, rtol=0, atol=0)
    moe.capacity_factor = None
    moe(x)
    assert moe.last_dropped_load is None


def test_repr_copies_and_pickles_keep_the_options():
    moe = _moe(activation="clamped_swiglu", activation_kwargs={"limit": 3.0}, capacity_factor=1.0)
    moe.aux_loss_coeff = 0.25
    assert "capacity_factor=1.0" in repr(moe)
    for copied in (copy.deepcopy(moe), pickle.loads(pickle.dumps(moe))):
        assert copied.aux_loss_coeff == 0.25 and copied.top_k == K
        assert dict(copied.activation_kwargs) == {"limit": 3.0}
        with pytest.raises(AttributeError):
            copied.top_k = 1
        x = torch.randn(4, H)
        torch.testing.assert_close(copied(x), moe(x), rtol=0, atol=0)


# ---------------------------------------------------------------- load_state_dict


def _state_source(moe: MoE) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return {k: torch.randn(v.shape, generator=gen).to(v.dtype) for k, v in moe.state_dict().items()}


def _full_moe() -> MoE:
    return _moe(bias=True, load_balancing="aux_free", shared_ffn_hidden_size=4, shared_expert_gate=True)


def _bad_state_dicts(src: dict[str, torch.Tensor]) -> dict[str, tuple[dict, str]]:
    missing = {k: v for k, v in src.items() if k != "experts.2.bias"}
    return {
        "wrong_shape": (
            {**src, "experts.2.weight": torch.randn(E, H, F + 1)},
            "size mismatch for experts.2.weight",
        ),
        "missing": (missing, r'Missing key\(s\) in state_dict: "experts.2.bias"'),
        "unexpected": (
            {**src, "experts.5.weight": torch.zeros(1)},
            r'Unexpected key\(s\).*"experts.5.weight"',
        ),
        "not_a_tensor": ({**src, "experts.2.weight": [[0.0]]}, "expected torch.Tensor"),
        "complex": ({**src, "router.weight": src["router.weight"].to(torch.complex64)}, "imaginary part"),
        "sparse": ({**src, "router.weight": src["router.weight"].to_sparse()}, "sparse_coo"),
        "meta": ({**src, "router.weight": src["router.weight"].to("meta")}, "meta tensor"),
    }


@pytest.mark.parametrize(
    "case", ["wrong_shape", "missing", "unexpected", "not_a_tensor", "complex", "sparse", "meta"]
)
def test_a_failed_load_leaves_every_parameter_and_buffer_as_it_was(case):
    moe = _full_moe().train()
    moe(torch.randn(6, H))  # non-zero load counts
    bad, match = _bad_state_dicts(_state_source(moe))[case]
    before = _snapshot(moe)
    with pytest.raises(RuntimeError, match=f"Error\\(s\\) in loading state_dict for MoE:(.|\n)*{match}"):
        moe.load_state_dict(bad)
    _assert_unchanged(moe, before)


def test_good_loads_load_as_torch_does():
    moe = _full_moe()
    src = _state_source(moe)
    assert not moe.load_state_dict(src).missing_keys
    for key, value in moe.state_dict().items():
        assert torch.equal(value, src[key]), key
    # strict=False with a missing key: the rest loads, the key is reported, as plain torch does
    partial = {k: v * 2 for k, v in src.items() if k != "experts.2.bias"}
    twin = copy.deepcopy(moe)
    got = moe.load_state_dict(partial, strict=False)
    want = nn.Module.load_state_dict(twin, partial, strict=False)
    assert got.missing_keys == want.missing_keys == ["experts.2.bias"] and got.unexpected_keys == []
    for key, value in moe.state_dict().items():
        assert torch.equal(value, twin.state_dict()[key]), key
    # per-expert keys weight0..weight{E-1}, which GroupedLinear stacks while loading
    per_group = dict(src)
    stacked = per_group.pop("experts.0.weight")
    per_group.update({f"experts.0.weight{g}": -stacked[g] for g in range(E)})
    moe.load_state_dict(per_group)
    assert torch.equal(moe.experts[0].weight, -stacked)
    # assign=True takes the state dict's tensors
    moe.load_state_dict(src, assign=True)
    assert moe.router.weight.data_ptr() == src["router.weight"].data_ptr()


def test_a_wrong_per_group_key_fails_before_anything_loads():
    moe = _full_moe()
    before = _snapshot(moe)
    per_group = _state_source(moe)
    stacked = per_group.pop("experts.0.weight")
    per_group.update({f"experts.0.weight{g}": stacked[g] for g in range(E)})
    per_group["experts.0.weight3"] = torch.randn(2 * F, H + 1)
    with pytest.raises(RuntimeError):
        moe.load_state_dict(per_group)
    _assert_unchanged(moe, before)


class _WithExtraState(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(2, 2)
        self.extra, self.post_hook_calls = None, 0
        self.register_load_state_dict_post_hook(self._count)

    def get_extra_state(self) -> object:
        return {"step": 1}

    def set_extra_state(self, state: object) -> None:
        self.extra = state

    @staticmethod
    def _count(module: nn.Module, incompatible: object) -> None:
        module.post_hook_calls += 1


def test_check_state_dict_writes_nothing_and_calls_no_post_hook():
    module = _WithExtraState()
    src = {
        k: v if k.endswith("_extra_state") else torch.randn_like(v) for k, v in module.state_dict().items()
    }
    before = _snapshot(module)
    check_state_dict(module, src, strict=True)
    _assert_unchanged(module, before)
    assert module.extra is None and module.post_hook_calls == 0
    assert module._load_state_dict_post_hooks and "set_extra_state" not in vars(module)
    bad = {k: v for k, v in src.items() if not k.endswith("_extra_state")}
    with pytest.raises(RuntimeError, match="Missing key.*_extra_state"):
        check_state_dict(module, bad, strict=True)
    with pytest.raises(TypeError, match="dict-like"):
        check_state_dict(module, [("linear.weight", src["linear.weight"])], strict=True)


# ---------------------------------------------------------------- DTensor experts (ep_mesh)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _dtensor_worker(rank: int, world: int, port: int, _args: object) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))["ep"]
        moe = MoE(H, F, E, K, bias=True, ep_mesh=mesh)
        src = {k: torch.randn_like(v) for k, v in moe.state_dict().items()}  # DTensors stay DTensors
        before = _snapshot(moe)
        plain = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in src.items()}
        with pytest.raises(RuntimeError, match="mixed torch.Tensor and DTensor"):
            moe.load_state_dict(plain)  # the router would load, the experts not
        _assert_unchanged(moe, before)
        moe.load_state_dict(src)
        for key, value in moe.state_dict().items():
            assert torch.equal(_local(value), _local(src[key])), key
        # this rank's experts as per-group keys
        local = _local(src["experts.0.weight"])
        per_group = {k: v for k, v in src.items() if k != "experts.0.weight"}
        per_group.update({f"experts.0.weight{g}": -local[g] for g in range(local.shape[0])})
        moe.load_state_dict(per_group)
        assert torch.equal(_local(moe.experts[0].weight), -local)
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()),
    reason="torch.distributed with gloo is not available",
)
def test_dtensor_experts_load_all_or_nothing():
    from test_moe_ep import _spawn

    _spawn(2, None, worker=_dtensor_worker)
