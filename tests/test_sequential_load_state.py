"""``Sequential.load_state_dict`` changes nothing when it fails: every key, shape and value
is checked before anything is copied."""

from __future__ import annotations

import pytest
import torch

import fusible_ops as fo


def _block() -> fo.Sequential:
    return fo.Sequential(
        fo.GroupedLinear(3, 8, 12, bias=True), fo.ScaledSwiGLU(), fo.GroupedLinear(3, 6, 8), fo.RMSNorm(8)
    )


def _snapshot(module):
    return {k: v.clone() for k, v in module.state_dict().items()}


@pytest.mark.parametrize("fault", ["wrong_shape", "missing", "unexpected", "not_a_tensor", "wrong_group_key"])
def test_a_failed_load_leaves_the_sequential_unchanged(fault):
    torch.manual_seed(0)
    seq = _block()
    before = _snapshot(seq)
    source = {k: v + 1 for k, v in _block().state_dict().items()}
    if fault == "wrong_shape":
        source["2.weight"] = torch.randn(3, 8, 5)
    elif fault == "missing":
        del source["3.weight"]
    elif fault == "unexpected":
        source["4.weight"] = torch.randn(8)
    elif fault == "not_a_tensor":
        source["3.weight"] = [1.0] * 8
    else:  # per-group keys for fc2, one of the wrong shape
        weight = source.pop("2.weight")
        source.update({f"2.weight{g}": weight[g] for g in range(3)})
        source["2.weight1"] = torch.randn(8, 5)
    with pytest.raises(RuntimeError, match="Error\\(s\\) in loading state_dict for Sequential"):
        seq.load_state_dict(source)
    after = seq.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_good_loads_still_work_with_stacked_and_per_group_keys():
    seq, other = _block(), _block()
    source = other.state_dict()
    seq.load_state_dict(source)
    assert all(torch.equal(v, source[k]) for k, v in seq.state_dict().items())
    per_group = {k: v for k, v in source.items() if k != "2.weight"}
    per_group.update({f"2.weight{g}": source["2.weight"][g] + 1 for g in range(3)})
    seq.load_state_dict(per_group)
    torch.testing.assert_close(seq[2].weight, source["2.weight"] + 1, rtol=0, atol=0)
    missing = dict(source)
    del missing["3.weight"]
    result = seq.load_state_dict(missing, strict=False)  # as torch: reported, not raised
    assert result.missing_keys == ["3.weight"]


def test_a_failed_load_of_one_op_leaves_it_unchanged():
    op = fo.GroupedLinear(2, 4, 6, bias=True)
    before = _snapshot(op)
    with pytest.raises(RuntimeError, match="bias"):
        op.load_state_dict({"weight": torch.randn(2, 6, 4), "bias": torch.randn(2, 7)})
    assert all(torch.equal(before[k], v) for k, v in op.state_dict().items())
