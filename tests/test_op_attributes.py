"""Op configuration that plans and kernels read is fixed at construction: assigning it
raises instead of being silently ignored (or, for ``weight_layout``, silently transposing
a square weight); constructor arguments of the wrong type are refused by name."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

import fusible_ops as fo


@pytest.mark.parametrize("cls", [fo.ClampedSwiGLU, fo.ScaledClampedSwiGLU])
@pytest.mark.parametrize("name", ["limit", "alpha", "glu_linear_offset", "glu_interleave_size", "spec"])
def test_activation_options_are_read_only(cls, name):
    op = cls(limit=5.0)
    before = getattr(op, name)
    with pytest.raises(AttributeError, match=f"{cls.__name__}.{name} is fixed at construction"):
        setattr(op, name, 0.5)
    assert getattr(op, name) == before and op.limit == 5.0


@pytest.mark.parametrize("name", ["num_groups", "in_features", "out_features", "weight_layout"])
def test_grouped_linear_configuration_is_read_only(name):
    op = fo.GroupedLinear(2, 4, 4)
    with pytest.raises(AttributeError, match=f"GroupedLinear.{name} is fixed at construction"):
        setattr(op, name, "in_out" if name == "weight_layout" else 3)
    x, splits = torch.randn(3, 4), torch.tensor([1, 2])
    torch.testing.assert_close(op(x, splits)[:1], x[:1] @ op.weight[0].T)


def test_read_only_ops_copy_and_pickle():
    seq = fo.Sequential(
        fo.GroupedLinear(2, 4, 8), fo.ScaledClampedSwiGLU(limit=3.0), fo.GroupedLinear(2, 4, 4)
    )
    for other in (copy.deepcopy(seq), pickle.loads(pickle.dumps(seq))):
        assert other[1].limit == 3.0 and other[0].in_features == 4
        x, splits, probs = torch.randn(3, 4), torch.tensor([1, 2]), torch.rand(3)
        torch.testing.assert_close(other(x, splits, probs, splits), seq(x, splits, probs, splits))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"glu_interleave_size": "2"}, "glu_interleave_size must be a positive int"),
        ({"glu_interleave_size": 2.0}, "glu_interleave_size must be a positive int"),
        ({"limit": "7"}, "limit must be a number"),
        ({"limit": float("nan")}, "limit must be a number"),
        ({"limit": -1.0}, "limit must be positive"),
        ({"alpha": float("inf")}, "alpha must be finite"),
    ],
)
def test_activation_arguments_of_the_wrong_type_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        fo.ClampedSwiGLU(**kwargs)


def test_limit_inf_means_no_clamping():
    op = fo.ClampedSwiGLU(limit=float("inf"))
    x = torch.tensor([[30.0, -40.0]], dtype=torch.float64)
    gate, linear = x[:, :1], x[:, 1:]
    want = gate * torch.sigmoid(1.702 * gate) * (linear + 1)
    torch.testing.assert_close(op(x), want)
