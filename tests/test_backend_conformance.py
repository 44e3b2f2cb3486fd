"""Every registered grouped-GEMM backend against one contract and a float64 reference.

The backends are read from the registry when the tests are collected
(:func:`pytest_generate_tests`), so a backend registered with the registry's one line,
like :class:`ThinLoopBackend` below, is covered with no other change. A backend that
cannot run here (no GPU, package missing, dtype refused) is skipped with its probe's reason.

The reference is plain PyTorch in float64 (``reference_ops.grouped_linear`` and
``reference_ops.activation``, gradients from autograd); nothing of the library's math is
reused. Edge cases: zero-row groups, zero tokens, rows past the last group, uneven
splits, host split sizes and device offsets only, non-contiguous inputs, ``out=``
buffers, per-row scales ``[M]`` and ``[M, 1]``, and refusals of bad inputs.
"""

from __future__ import annotations

import pytest
import reference_ops as ref
import torch

import fusible_ops as fo
from fusible_ops.kernels import (
    GroupedGemmBackend,
    backend_names,
    get_backend,
    probe_backend,
    register_backend,
    select_backend,
    unregister_backend,
)
from fusible_ops.kernels.activation import ActivationSpec
from fusible_ops.kernels.pytorch.loop import TorchLoopBackend

CPU = torch.device("cpu")


class ThinLoopBackend(GroupedGemmBackend):
    """A new backend as its author writes it: a probe and one hook per GEMM kind.

    The hooks are the torch loop backend's; checks, zero tokens, bias gradients and the
    composed activation entry points all come from the base class.
    """

    name = "thin_loop"
    description = "test backend: the torch loop's hooks behind the base class"
    needs_host_splits = True
    _loop = TorchLoopBackend()

    def probe(self, device, dtype):
        return None if dtype.is_floating_point else f"{self.name}: {dtype} is not floating point"

    def _fprop(self, x, weight, split_sizes, offsets, bias, out):
        return self._loop._fprop(x, weight, split_sizes, offsets, bias, out)

    def _dgrad(self, grad_out, weight, split_sizes, offsets, out):
        return self._loop._dgrad(grad_out, weight, split_sizes, offsets, out)

    def _wgrad(self, grad_out, x, split_sizes, offsets, out):
        return self._loop._wgrad(grad_out, x, split_sizes, offsets, out)


register_backend(ThinLoopBackend.name, ThinLoopBackend)  # the one registry line a new backend needs


@pytest.fixture(scope="module", autouse=True)
def _registry_as_before_after_this_module():
    yield
    unregister_backend(ThinLoopBackend.name)


#: the backend names the conformance tests were parametrised with
PARAMETRISED: set[str] = set()


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Parametrise over the registry as it is at collection time."""
    if "backend_name" in metafunc.fixturenames:
        names = backend_names()
        PARAMETRISED.update(names)
        metafunc.parametrize("backend_name", names)


DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
#: relative to the largest reference magnitude
TOL = {torch.float64: 1e-10, torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 1e-2}
SPLITS = {
    "uneven_with_empty": [5, 0, 11, 8],
    "one_group": [0, 24, 0],
    "zero_tokens": [0, 0, 0],
    "tail_rows": [3, 0, 5],  # the input has 2 rows no group owns
}
TAIL = {"tail_rows": 2}
K_IN, N_OUT = 16, 24  # multiples of 16 bytes in every dtype (grouped_mm's rule)
SPECS = [  # gated halves, gated interleaved (GPT-OSS), unary
    ActivationSpec("swiglu"),
    ActivationSpec("clamped_swiglu", limit=1.5, glu_interleave_size=1),
    ActivationSpec("gelu"),
]


#: what the Triton interpreter (CPU, seconds per call) runs here; the rest of its parity,
#: float16 and every activation, is in tests/test_triton_backend.py
_INTERPRETER_CASES = {"dtype": torch.float32, "split_name": "tail_rows", "spec": SPECS[0]}


@pytest.fixture
def backend(request: pytest.FixtureRequest, backend_name: str, dtype: torch.dtype) -> GroupedGemmBackend:
    reason = probe_backend(backend_name, CPU, dtype)
    if reason is not None:
        pytest.skip(f"{backend_name} on cpu {dtype}: {reason}")
    backend = get_backend(backend_name)
    if backend_name == "triton":  # on CPU tensors: the interpreter
        params = request.node.callspec.params
        if any(key in params and params[key] != value for key, value in _INTERPRETER_CASES.items()):
            pytest.skip("Triton interpreter (slow): this case is covered by tests/test_triton_backend.py")
    return backend


def offsets_of(split_sizes: list[int]) -> torch.Tensor:
    return torch.tensor(split_sizes, dtype=torch.int64).cumsum(0).to(torch.int32)


def randn(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.float64).to(dtype)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert ref.max_rel_err(actual, expected) <= TOL[dtype], f"{what}: {ref.max_rel_err(actual, expected):.3g}"


def reference_gemms(x, weight, bias, grad_out, split_sizes):
    """float64 ``(y, dx, dw, db)`` of the grouped linear over the rows the groups own."""
    rows = sum(split_sizes)
    x64, w64, b64 = ref.leaf(x[:rows]), ref.leaf(weight), ref.leaf(bias)
    y = ref.grouped_linear(x64, w64, b64, split_sizes)
    y.backward(grad_out[:rows].double())
    grads = [t.grad if t.grad is not None else torch.zeros_like(t) for t in (x64, w64, b64)]
    return (y.detach(), *grads)


# ---------------------------------------------------------------- grouped GEMMs


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("split_name", list(SPLITS))
def test_gemms_match_reference(backend, dtype, split_name):
    split_sizes = SPLITS[split_name]
    groups, rows = len(split_sizes), sum(split_sizes) + TAIL.get(split_name, 0)
    covered = sum(split_sizes)
    x, grad_out = randn(rows, K_IN, dtype=dtype), randn(rows, N_OUT, dtype=dtype)
    weight, bias = randn(groups, N_OUT, K_IN, dtype=dtype), randn(groups, N_OUT, dtype=dtype)
    offsets = offsets_of(split_sizes)
    ref_y, ref_dx, ref_dw, ref_db = reference_gemms(x, weight, bias, grad_out, split_sizes)

    for sizes in (split_sizes, None):  # host split sizes, and device offsets only
        y = backend.fprop(x, weight, sizes, offsets, bias=bias)
        assert y.shape == (rows, N_OUT) and y.dtype == dtype
        assert_close(y[:covered], ref_y, dtype, "fprop")
        y_nobias = backend.fprop(x, weight, sizes, offsets)
        assert_close(y_nobias[:covered], ref_y - _bias_rows(bias, split_sizes), dtype, "fprop without bias")
        dx = backend.dgrad(grad_out, weight, sizes, offsets)
        assert dx.shape == (rows, K_IN) and dx.dtype == dtype
        assert_close(dx[:covered], ref_dx, dtype, "dgrad")
        assert_close(backend.wgrad(grad_out, x, sizes, offsets), ref_dw, dtype, "wgrad (empty groups zero)")
        db = backend.bias_grad(grad_out, sizes, offsets, groups)
        assert db.dtype == dtype
        assert_close(db, ref_db, dtype, "bias_grad")


def _bias_rows(bias: torch.Tensor, split_sizes: list[int]) -> torch.Tensor:
    return bias.double().repeat_interleave(torch.tensor(split_sizes), dim=0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_non_contiguous_inputs(backend, dtype):
    split_sizes = [6, 0, 10]
    rows = sum(split_sizes)
    x = randn(rows, 2 * K_IN, dtype=dtype)[:, ::2]  # column stride 2
    weight = randn(3, K_IN, N_OUT, dtype=dtype).transpose(1, 2)  # a [G, N, K] view, K-major
    bias = randn(N_OUT, 3, dtype=dtype).t()
    grad_out = randn(N_OUT, rows, dtype=dtype).t()  # column-major
    assert not any(t.is_contiguous() for t in (x, weight, bias, grad_out))
    offsets = offsets_of(split_sizes)
    ref_y, ref_dx, ref_dw, ref_db = reference_gemms(x, weight, bias, grad_out, split_sizes)
    assert_close(backend.fprop(x, weight, split_sizes, offsets, bias=bias), ref_y, dtype, "fprop")
    assert_close(backend.dgrad(grad_out, weight, None, offsets), ref_dx, dtype, "dgrad")
    assert_close(backend.wgrad(grad_out, x, split_sizes, offsets), ref_dw, dtype, "wgrad")
    assert_close(backend.bias_grad(grad_out, None, offsets, 3), ref_db, dtype, "bias_grad")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("known_splits", [True, False], ids=["host_splits", "offsets_only"])
def test_out_buffers_written_in_place_tail_untouched(backend, dtype, known_splits):
    """``out`` views of larger buffers: returned as is, rows past the last group keep their values."""
    split_sizes, extra = [3, 0, 5], 2
    covered = sum(split_sizes)
    rows = covered + extra
    x, grad_out = randn(rows, K_IN, dtype=dtype), randn(rows, N_OUT, dtype=dtype)
    weight, bias = randn(3, N_OUT, K_IN, dtype=dtype), randn(3, N_OUT, dtype=dtype)
    offsets = offsets_of(split_sizes)
    sizes = split_sizes if known_splits else None
    ref_y, ref_dx, ref_dw, _ = reference_gemms(x, weight, bias, grad_out, split_sizes)
    sentinel = 123.0

    buf = torch.full((rows + 4, N_OUT), sentinel, dtype=dtype)
    y = backend.fprop(x, weight, sizes, offsets, bias=bias, out=buf[:rows])
    assert y.data_ptr() == buf.data_ptr() and y.shape == (rows, N_OUT)
    assert_close(buf[:covered], ref_y, dtype, "fprop into out")
    assert (buf[covered:] == sentinel).all(), "fprop wrote rows past the last group"

    dbuf = torch.full((rows + 4, K_IN), sentinel, dtype=dtype)
    dx = backend.dgrad(grad_out, weight, sizes, offsets, out=dbuf[:rows])
    assert dx.data_ptr() == dbuf.data_ptr()
    assert_close(dbuf[:covered], ref_dx, dtype, "dgrad into out")
    assert (dbuf[covered:] == sentinel).all(), "dgrad wrote rows past the last group"

    wbuf = torch.full((3, N_OUT, K_IN), sentinel, dtype=dtype)
    dw = backend.wgrad(grad_out, x, sizes, offsets, out=wbuf)
    assert dw.data_ptr() == wbuf.data_ptr()
    assert_close(wbuf, ref_dw, dtype, "wgrad into out (the empty group zeroed)")


# ---------------------------------------------------------------- fused activation entry points


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    ("spec", "scales_shape"),
    [(SPECS[0], "none"), (SPECS[0], "rows"), (SPECS[0], "rows_by_1"), (SPECS[1], "rows"), (SPECS[2], "none")],
    ids=lambda v: f"{v.kind}-k{v.glu_interleave_size}" if isinstance(v, ActivationSpec) else v,
)
def test_fused_entry_points_match_reference(backend, dtype, spec, scales_shape):
    split_sizes = [5, 0, 11, 8]
    groups, rows, hidden, ffn = len(split_sizes), sum(split_sizes), 16, 8
    n_pre = 2 * ffn if spec.gated else ffn
    x, grad_y = randn(rows, hidden, dtype=dtype), randn(rows, hidden, dtype=dtype)
    w1, b1 = randn(groups, n_pre, hidden, dtype=dtype), randn(groups, n_pre, dtype=dtype)
    w2 = randn(groups, hidden, ffn, dtype=dtype)
    scales_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    scales = {
        "none": None,
        "rows": torch.rand(rows, dtype=scales_dtype),
        "rows_by_1": torch.rand(rows, 1, dtype=scales_dtype),
    }[scales_shape]
    offsets = offsets_of(split_sizes)

    pre, act = backend.fc1_fprop_act(x, w1, b1, split_sizes, offsets, spec, scales)
    assert pre.dtype == act.dtype == dtype
    ref_pre = ref.grouped_linear(x.double(), w1.double(), b1.double(), split_sizes)
    assert_close(pre, ref_pre, dtype, "fc1 pre")
    # the activation is judged from the backend's own (rounded) pre, so low-precision
    # GEMM rounding is not amplified through the nonlinearity
    pre64 = pre.detach().double().requires_grad_(True)
    s64 = None if scales is None else scales.detach().double().reshape(rows, 1).requires_grad_(True)
    ref_act = ref.activation_of(spec, pre64)
    if s64 is not None:
        ref_act = ref_act * s64
    assert_close(act, ref_act.detach(), dtype, "fc1 act")
    ref.grouped_linear(ref_act, w2.double(), None, split_sizes).backward(grad_y.double())

    grad_pre, grad_scales, act2 = backend.fc2_dgrad_act(grad_y, w2, pre, split_sizes, offsets, spec, scales)
    assert_close(act2, ref_act.detach(), dtype, "recomputed act")
    assert_close(grad_pre, pre64.grad, dtype, "grad_pre")
    if scales is None:
        assert grad_scales is None
    else:
        assert grad_scales.dtype == scales.dtype and grad_scales.shape == scales.shape
        assert_close(grad_scales, s64.grad.reshape(scales.shape), dtype, "grad_scales")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_zero_tokens(backend, dtype):
    spec, offsets = ActivationSpec("swiglu"), offsets_of([0, 0])
    x = randn(0, 16, dtype=dtype)
    w1, w2 = randn(2, 32, 16, dtype=dtype), randn(2, 16, 16, dtype=dtype)
    scales = torch.ones(0)
    for sizes in ([0, 0], None):
        pre, act = backend.fc1_fprop_act(x, w1, None, sizes, offsets, spec, scales)
        assert pre.shape == (0, 32) and act.shape == (0, 16)
        grad_pre, grad_scales, act2 = backend.fc2_dgrad_act(x, w2, pre, sizes, offsets, spec, scales)
        assert grad_pre.shape == (0, 32) and grad_scales.shape == (0,) and act2.shape == (0, 16)
        dw = backend.wgrad(grad_pre, x, sizes, offsets)
        assert dw.shape == (2, 32, 16) and (dw == 0).all(), "zero tokens: zero weight gradients"
        wbuf = torch.full((2, 32, 16), 5.0, dtype=dtype)
        assert backend.wgrad(grad_pre, x, sizes, offsets, out=wbuf).data_ptr() == wbuf.data_ptr()
        assert (wbuf == 0).all()
        assert backend.fprop(x, w1, sizes, offsets).shape == (0, 32)
        assert backend.dgrad(pre, w1, sizes, offsets).shape == (0, 16)
        db = backend.bias_grad(pre, sizes, offsets, 2)
        assert db.shape == (2, 32) and (db == 0).all()


# ---------------------------------------------------------------- refusals


@pytest.mark.parametrize("dtype", [torch.float32], ids=str)
def test_bad_inputs_refused_before_any_write(backend, dtype):
    x, weight = torch.randn(8, 16), torch.randn(2, 32, 16)
    offsets, spec = offsets_of([4, 4]), ActivationSpec("swiglu")
    out = torch.full((8, 32), 7.0)
    pre, w2 = torch.randn(8, 32), torch.randn(2, 16, 16)
    value_errors = {
        "fprop x features": lambda: backend.fprop(x[:, :8], weight, [4, 4], offsets, out=out),
        "fprop groups": lambda: backend.fprop(x, weight, [4, 2, 2], offsets_of([4, 2, 2]), out=out),
        "fprop split count": lambda: backend.fprop(x, weight, [4, 4, 0], offsets, out=out),
        "fprop split sum": lambda: backend.fprop(x, weight, [4, 5], offsets, out=out),
        "fprop negative split": lambda: backend.fprop(x, weight, [9, -1], offsets, out=out),
        "fprop out shape": lambda: backend.fprop(x, weight, [4, 4], offsets, out=out[:7]),
        "fprop bias shape": lambda: backend.fprop(
            x, weight, [4, 4], offsets, bias=torch.zeros(2, 7), out=out
        ),
        "fprop 3-D x": lambda: backend.fprop(x.view(2, 4, 16), weight, None, offsets),
        "dgrad features": lambda: backend.dgrad(torch.randn(8, 7), weight, [4, 4], offsets),
        "dgrad out shape": lambda: backend.dgrad(out, weight, [4, 4], offsets, out=torch.empty(8, 15)),
        "wgrad rows": lambda: backend.wgrad(out, x[:6], [4, 4], offsets),
        "bias_grad 3-D": lambda: backend.bias_grad(out.view(2, 4, 32), [4, 4], offsets, 2),
        "bias_grad groups": lambda: backend.bias_grad(out, [4, 4], offsets, 3),
        "fc1 scales rows": lambda: backend.fc1_fprop_act(x, weight, None, None, offsets, spec, torch.ones(3)),
        "fc1 gated width": lambda: backend.fc1_fprop_act(
            x, weight[:, :30], None, None, offsets, ActivationSpec("swiglu", glu_interleave_size=4), None
        ),
        "fc2 pre rows": lambda: backend.fc2_dgrad_act(x, w2, pre[:7], [4, 4], offsets, spec, None),
        "fc2 act width": lambda: backend.fc2_dgrad_act(x, w2, pre[:, :16], [4, 4], offsets, spec, None),
    }
    type_errors = {
        "fprop dtype": lambda: backend.fprop(x.double(), weight, [4, 4], offsets, out=out),
        "fprop out dtype": lambda: backend.fprop(x, weight, [4, 4], offsets, out=out.double()),
        "fc2 pre dtype": lambda: backend.fc2_dgrad_act(x, w2, pre.double(), [4, 4], offsets, spec, None),
    }
    for error, cases in ((ValueError, value_errors), (TypeError, type_errors)):
        for what, call in cases.items():
            with pytest.raises(error, match=rf"^{backend.name}\.\w+: "):
                call()
            assert (out == 7.0).all(), f"{what}: a refused call wrote its output"


# ---------------------------------------------------------------- a new backend: one file, hooks, one line


def test_new_backend_needs_only_hooks_and_one_registration():
    own = {name for name, value in vars(ThinLoopBackend).items() if callable(value)}
    assert own == {"probe", "_fprop", "_dgrad", "_wgrad"}
    assert ThinLoopBackend.name in backend_names()
    assert isinstance(get_backend(ThinLoopBackend.name), ThinLoopBackend)
    # the conformance tests above were collected for it, like for the built-in backends
    assert {ThinLoopBackend.name, "torch_loop", "cpu"} <= PARAMETRISED


def test_new_backend_runs_forced_through_the_public_api():
    torch.manual_seed(0)
    experts = fo.Sequential(fo.GroupedLinear(3, 16, 32), fo.ScaledSwiGLU(), fo.GroupedLinear(3, 16, 16))
    split_sizes, rows = [5, 0, 7], 12
    x, probs = torch.randn(rows, 16), torch.rand(rows)
    results = {}
    for name in (ThinLoopBackend.name, "torch_loop"):
        experts.zero_grad()
        x_leaf = x.clone().requires_grad_(True)
        with fo.settings(backend=name):
            y = experts(x_leaf, split_sizes, probs, split_sizes)
            y.sum().backward()
        assert name in str(experts.last_plan)
        results[name] = (y.detach(), x_leaf.grad, experts[0].weight.grad.clone())
    for new, old in zip(results[ThinLoopBackend.name], results["torch_loop"]):
        torch.testing.assert_close(new, old)


class _Preferred(ThinLoopBackend):
    name = "preferred_probe"


def test_register_prefer_on_and_unregister_restore_selection():
    assert select_backend(CPU, torch.float32, purpose="gemm").name == "cpu"
    register_backend(_Preferred.name, _Preferred, prefer_on=("cpu",))
    try:
        assert select_backend(CPU, torch.float32, purpose="gemm").name == _Preferred.name
        assert select_backend(CPU, torch.float32, purpose="mlp").name == _Preferred.name
    finally:
        unregister_backend(_Preferred.name)
    assert select_backend(CPU, torch.float32, purpose="mlp").name == "cpu"
    assert _Preferred.name not in backend_names()
    register_backend("loop_by_path", "fusible_ops.kernels.pytorch.loop", "TorchLoopBackend")
    try:
        assert isinstance(get_backend("loop_by_path"), TorchLoopBackend)
    finally:
        unregister_backend("loop_by_path")
    with pytest.raises(ValueError, match="unknown backend"):
        unregister_backend("loop_by_path")
