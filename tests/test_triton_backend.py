"""The Triton backend vs an independent float64 reference, forward and backward.

Without a GPU the kernels run in Triton's interpreter on CPU tensors (float32 and
float16). Triton decides interpreter-or-compiled when it is first imported, so this
module sets ``TRITON_INTERPRET=1`` before anything imports triton; if triton was already
imported without it (by an earlier test module), the in-process tests skip and one test
reruns this file in a fresh interpreter process instead. On a CUDA machine the same
tests run compiled, in bfloat16 and float16, plus the no-host-sync and CUDA-graph checks.

The reference expands every row's group weight (``weight[group_ids]``) instead of
looping over groups, reads the gate/linear columns with an index gather, and gets
every gradient from autograd.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None
HAS_CUDA = torch.cuda.is_available()
if HAS_TRITON and not HAS_CUDA and "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import reference_ops as ref  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from reference_ops import activation_of as ref_activation  # noqa: E402

from fusible_ops.kernels.activation import ActivationSpec  # noqa: E402
from fusible_ops.kernels.triton.backend import TritonBackend, autotune_enabled, set_autotune  # noqa: E402


def _mode() -> str:
    """Return "cuda", "interpreter", "subprocess" (triton compiled on a CPU box) or "none"."""
    if not HAS_TRITON:
        return "none"
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    interpreted = isinstance(tl.sigmoid, InterpretedFunction)
    if HAS_CUDA and not interpreted:
        return "cuda"
    return "interpreter" if interpreted else "subprocess"


MODE = _mode()
DEVICE = torch.device("cuda" if MODE == "cuda" else "cpu")
DTYPES = (torch.bfloat16, torch.float16) if MODE == "cuda" else (torch.float32, torch.float16)
TOL = {torch.float32: 2e-5, torch.float16: 2e-2, torch.bfloat16: 4e-2}  # relative to max |reference|

needs_kernels = pytest.mark.skipif(
    MODE in ("none", "subprocess"),
    reason="triton is not installed"
    if MODE == "none"
    else "triton was imported without TRITON_INTERPRET=1; see test_interpreter_suite_in_subprocess",
)
needs_cuda = pytest.mark.skipif(MODE != "cuda", reason="needs a CUDA GPU with compiled Triton kernels")

SPLITS = {
    "uneven_with_empty": [5, 0, 19, 9],  # rows not a multiple of the 16-row tile
    "all_in_one": [0, 37, 0],
    "zero_total": [0, 0, 0],
    "empty_last": [17, 3, 0],
}
ACTIVATIONS = {
    "swiglu": ActivationSpec("swiglu"),
    "swiglu_interleave2": ActivationSpec("swiglu", glu_interleave_size=2),
    "geglu": ActivationSpec("geglu"),
    "clamped_swiglu_gptoss": ActivationSpec("clamped_swiglu", limit=1.5, glu_interleave_size=1),
    "reglu_interleave4": ActivationSpec("reglu", glu_interleave_size=4),
    "srelu": ActivationSpec("srelu"),
    "gelu": ActivationSpec("gelu"),
    "silu": ActivationSpec("silu"),
}


# ---------------------------------------------------------------- reference

offsets_of = functools.partial(ref.offsets_of, device=DEVICE)
group_ids_of = functools.partial(ref.group_ids_of, device=DEVICE)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    scale = max(expected.abs().max().item(), 1e-3) if expected.numel() else 1.0
    err = (actual.double() - expected.double()).abs().max().item() if expected.numel() else 0.0
    assert err <= TOL[dtype] * scale, f"{what}: max error {err:.3g} > {TOL[dtype]:.0e} * {scale:.3g}"


def rand(*shape: int, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, dtype=torch.float64) * scale).to(dtype).to(DEVICE)


@pytest.fixture
def backend() -> TritonBackend:
    b = TritonBackend()
    reason = b.probe(DEVICE, DTYPES[0])
    assert reason is None, reason
    return b


# ---------------------------------------------------------------- availability


@needs_kernels
def test_probe_reasons() -> None:
    b = TritonBackend()
    assert b.package_status() is None
    for dtype in DTYPES:
        assert b.probe(DEVICE, dtype) is None
    assert "float64" in b.probe(DEVICE, torch.float64)
    assert "not meta" in b.probe(torch.device("meta"), DTYPES[0])
    if MODE == "interpreter":
        assert "bfloat16" in b.probe(DEVICE, torch.bfloat16)
        assert "interpreter" in b.probe(torch.device("cuda"), torch.bfloat16)
        assert "interpreter" in b.mode()
    assert b.name == "triton" and b.fused_activation and b.writes_in_place


def test_package_status_without_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a, **k: None)
    b = TritonBackend()
    assert "triton is not installed" in b.package_status()
    assert "triton is not installed" in b.probe(torch.device("cpu"), torch.float32)


def test_autotune_switches() -> None:
    from fusible_ops import Settings, settings

    assert autotune_enabled()
    set_autotune(False)
    try:
        assert not autotune_enabled()
    finally:
        set_autotune(True)
    if "triton_autotune" in Settings.__dataclass_fields__:
        with settings(triton_autotune=False):
            assert not autotune_enabled()
    assert autotune_enabled()


@pytest.mark.skipif(MODE != "subprocess", reason="triton runs in interpreter/compiled mode in this process")
def test_interpreter_suite_in_subprocess() -> None:
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", str(Path(__file__))],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_kernels_compile_for_hopper_and_ampere() -> None:
    """Ahead-of-time build for sm90 and sm80 (no GPU needed): catches what the interpreter accepts."""
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    script = Path(__file__).with_name("triton_aot_check.py")
    result = subprocess.run(
        [sys.executable, str(script)], cwd=root, env=env, capture_output=True, text=True, timeout=300
    )
    output = result.stdout[-4000:] + result.stderr[-2000:]
    if result.returncode == 3:
        pytest.skip(f"ahead-of-time compile not possible with this triton: {output.strip()[-300:]}")
    assert result.returncode == 0, output
    for kernel in ("_grouped_mm_kernel", "_fc1_act_kernel", "_fc2_dgrad_act_kernel", "_wgrad_kernel"):
        assert f"sm90 {kernel}: wgmma" in result.stdout, output
        assert f"sm80 {kernel}: mma.sync" in result.stdout, output


# ---------------------------------------------------------------- grouped GEMMs


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("split_name", list(SPLITS))
def test_fprop_dgrad_wgrad(backend: TritonBackend, dtype: torch.dtype, split_name: str) -> None:
    torch.manual_seed(0)
    split_sizes = SPLITS[split_name]
    groups, rows, k_in, n_out = len(split_sizes), sum(split_sizes) + 3, 24, 40  # 3 tail rows
    offsets = offsets_of(split_sizes)
    x = rand(rows, 2 * k_in, dtype=dtype)[:, ::2]  # non-contiguous rows
    weight = rand(groups, k_in, n_out, dtype=dtype, scale=0.3).transpose(1, 2)  # non-contiguous weight
    bias = rand(groups, n_out, dtype=dtype)
    grad_y = rand(rows, n_out, dtype=dtype)
    covered = sum(split_sizes)

    y = backend.fprop(x, weight, None, offsets, bias=bias)
    assert_close(y, ref.grouped_fprop(x, weight, split_sizes, bias, pad_rows=True), dtype, "fprop")
    assert torch.all(y[covered:] == 0), "allocated output: tail rows are zeros"

    dx = backend.dgrad(grad_y, weight, split_sizes, offsets)
    ref_dx = torch.einsum(
        "mn,mnk->mk", grad_y.double(), weight.double()[group_ids_of(split_sizes, rows).clamp(min=0)]
    )
    ref_dx[covered:] = 0
    assert_close(dx, ref_dx, dtype, "dgrad")

    dw = backend.wgrad(grad_y, x, None, offsets)
    ref_dw = torch.stack(
        [
            grad_y[s : s + n].double().T @ x[s : s + n].double()
            for s, n in zip(torch.tensor([0, *split_sizes[:-1]]).cumsum(0).tolist(), split_sizes)
        ]
    )
    assert_close(dw, ref_dw, dtype, "wgrad")
    for g, n in enumerate(split_sizes):
        if n == 0:
            assert torch.all(dw[g] == 0), "empty group: zero weight gradient"


def test_bias_grad_ignores_tail_rows() -> None:
    split_sizes = [3, 0, 4]
    grad = torch.randn(9, 5, dtype=torch.float64)  # two rows past the last group
    offsets = torch.tensor(split_sizes).cumsum(0).to(torch.int32)
    expected = torch.stack([grad[:3].sum(0), torch.zeros(5, dtype=torch.float64), grad[3:7].sum(0)])
    torch.testing.assert_close(TritonBackend().bias_grad(grad, None, offsets, 3), expected)


@needs_kernels
def test_out_buffers_padded_tail_and_bit_identical(backend: TritonBackend) -> None:
    torch.manual_seed(1)
    dtype = DTYPES[0]
    split_sizes = [7, 0, 21]
    groups, rows, k_in, n_out = 3, 30, 20, 36  # rows 28, 29 are past the last group
    offsets = offsets_of(split_sizes)
    x = rand(rows, k_in, dtype=dtype)
    weight = rand(groups, n_out, k_in, dtype=dtype)
    sentinel = -777.0

    buf = torch.full((rows + 5, n_out), sentinel, dtype=dtype, device=DEVICE)  # padded tail
    y = backend.fprop(x, weight, split_sizes, offsets, out=buf[:rows])
    assert y.data_ptr() == buf.data_ptr()
    assert torch.all(buf[28:] == sentinel), "rows past offsets[-1] and the padded tail are never written"
    assert torch.equal(y[:28], backend.fprop(x, weight, split_sizes, offsets)[:28]), (
        "bit-identical to no buffer"
    )

    grad_buf = torch.full((rows + 2, k_in), sentinel, dtype=dtype, device=DEVICE)
    dx = backend.dgrad(y.clone(), weight, None, offsets, out=grad_buf[:rows])
    assert dx.data_ptr() == grad_buf.data_ptr() and torch.all(grad_buf[28:] == sentinel)
    assert torch.equal(dx[:28], backend.dgrad(y.clone(), weight, None, offsets)[:28])

    wbuf = torch.full((groups, n_out, k_in), sentinel, dtype=dtype, device=DEVICE)
    dw = backend.wgrad(y, x, None, offsets, out=wbuf)
    assert dw.data_ptr() == wbuf.data_ptr() and torch.all(wbuf[1] == 0)


@needs_kernels
def test_malformed_offsets_stay_in_bounds(backend: TritonBackend) -> None:
    """Offsets past the row count or decreasing are clamped on device: no write outside ``out``."""
    dtype = DTYPES[0]
    rows, k_in, n_out = 10, 16, 16
    x = rand(rows, k_in, dtype=dtype)
    weight = rand(3, n_out, k_in, dtype=dtype)
    buf = torch.full((rows + 4, n_out), 5.0, dtype=dtype, device=DEVICE)
    offsets = torch.tensor([6, 3, 1000], dtype=torch.int32, device=DEVICE)
    backend.fprop(x, weight, None, offsets, out=buf[:rows])
    backend.wgrad(buf[:rows], x, None, offsets)
    assert torch.all(buf[rows:] == 5.0)


@needs_kernels
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    split_sizes=st.lists(st.integers(0, 20), min_size=1, max_size=4),
    tail=st.integers(0, 5),
    k_in=st.integers(1, 33),
    n_out=st.integers(1, 33),
)
def test_fprop_wgrad_hypothesis(
    backend: TritonBackend, split_sizes: list[int], tail: int, k_in: int, n_out: int
) -> None:
    dtype = DTYPES[0]
    rows = sum(split_sizes) + tail
    offsets = offsets_of(split_sizes)
    x = rand(rows, k_in, dtype=dtype)
    weight = rand(len(split_sizes), n_out, k_in, dtype=dtype)
    assert_close(
        backend.fprop(x, weight, None, offsets),
        ref.grouped_fprop(x, weight, split_sizes, None, pad_rows=True),
        dtype,
        "fprop",
    )
    grad_y = rand(rows, n_out, dtype=dtype)
    ids = group_ids_of(split_sizes, rows)
    ref_dw = torch.zeros(len(split_sizes), n_out, k_in, dtype=torch.float64, device=DEVICE)
    ref_dw.index_add_(0, ids[ids >= 0], torch.einsum("mn,mk->mnk", grad_y.double(), x.double())[ids >= 0])
    assert_close(backend.wgrad(grad_y, x, split_sizes, offsets), ref_dw, dtype, "wgrad")


# ---------------------------------------------------------------- fused MLP entry points


def mlp_reference(x, w1, b1, w2, scales, spec, split_sizes, grad_y):
    """float64 forward and autograd backward of fc1 -> scaled activation -> fc2."""
    leaves = [t.detach().double().requires_grad_() for t in (x, w1, w2, scales)]
    x64, w1_64, w2_64, s64 = leaves
    b64 = b1.double() if b1 is not None else None
    pre = ref.grouped_fprop(x64, w1_64, split_sizes, b64, pad_rows=True)
    pre.retain_grad()
    act = ref_activation(spec, pre) * s64.unsqueeze(-1)
    act.retain_grad()
    y = ref.grouped_fprop(act, w2_64, split_sizes, None, pad_rows=True)
    (y * grad_y.double()).sum().backward()
    return {
        "pre": pre.detach(),
        "act": act.detach(),
        "y": y.detach(),
        "grad_pre": pre.grad,
        "grad_act_input": act.grad,
        "dx": x64.grad,
        "dw1": w1_64.grad,
        "dw2": w2_64.grad,
        "dscales": s64.grad,
    }


@needs_kernels
@pytest.mark.parametrize("spec_name", list(ACTIVATIONS))
def test_fused_mlp_forward_backward(backend: TritonBackend, spec_name: str) -> None:
    """fc1_fprop_act -> fprop (into a padded combine buffer) -> fc2_dgrad_act -> wgrads -> dgrad."""
    torch.manual_seed(2)
    dtype = DTYPES[0]
    spec = ACTIVATIONS[spec_name]
    split_sizes = [9, 0, 22, 4]  # a zero-row expert; 35 rows, not a multiple of 16
    groups, rows, hidden, ffn = 4, 37, 24, 20  # two rows past the last expert
    n_pre = 2 * ffn if spec.gated else ffn
    offsets = offsets_of(split_sizes)
    x = rand(rows, hidden, dtype=dtype)
    w1 = rand(groups, n_pre, hidden, dtype=dtype, scale=0.4)
    b1 = rand(groups, n_pre, dtype=dtype, scale=0.3)
    w2 = rand(groups, hidden, ffn, dtype=dtype, scale=0.4)
    scales = torch.rand(rows, dtype=torch.float32, device=DEVICE)
    grad_y = rand(rows, hidden, dtype=dtype)
    ref = mlp_reference(x, w1, b1, w2, scales, spec, split_sizes, grad_y)
    covered = sum(split_sizes)

    pre, act = backend.fc1_fprop_act(x, w1, b1, None, offsets, spec, scales)
    assert_close(pre, ref["pre"], dtype, "pre")
    assert_close(act, ref["act"], dtype, "act * scales")
    combine = torch.full((rows + 3, hidden), -1.0, dtype=dtype, device=DEVICE)
    y = backend.fprop(act, w2, None, offsets, out=combine[:rows])
    assert_close(y[:covered], ref["y"][:covered], dtype, "fc2 output")
    assert torch.all(combine[covered:] == -1.0)

    grad_pre, grad_scales, act_again = backend.fc2_dgrad_act(grad_y, w2, pre, None, offsets, spec, scales)
    assert grad_scales.dtype == scales.dtype and grad_scales.shape == scales.shape
    assert torch.equal(act_again, act), "backward recomputes exactly the forward activation"
    assert_close(grad_pre, ref["grad_pre"], dtype, "grad pre")
    assert_close(grad_scales, ref["dscales"], dtype, "grad scales")
    assert_close(backend.wgrad(grad_y, act_again, None, offsets), ref["dw2"], dtype, "fc2 wgrad")
    assert_close(backend.wgrad(grad_pre, x, None, offsets), ref["dw1"], dtype, "fc1 wgrad")
    grad_in = torch.full((rows + 3, hidden), -1.0, dtype=dtype, device=DEVICE)
    dx = backend.dgrad(grad_pre, w1, None, offsets, out=grad_in[:rows])
    assert_close(dx[:covered], ref["dx"][:covered], dtype, "fc1 dgrad")
    assert torch.all(grad_in[covered:] == -1.0)


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fused_entry_points_without_scales_and_bias(backend: TritonBackend, dtype: torch.dtype) -> None:
    torch.manual_seed(3)
    spec = ActivationSpec("swiglu")
    split_sizes = [0, 13, 0]
    rows, hidden, ffn = 13, 16, 24
    offsets = offsets_of(split_sizes)
    x = rand(rows, hidden, dtype=dtype)
    w1 = rand(3, 2 * ffn, hidden, dtype=dtype, scale=0.4)
    w2 = rand(3, hidden, ffn, dtype=dtype, scale=0.4)
    grad_y = rand(rows, hidden, dtype=dtype)
    ones = torch.ones(rows, dtype=torch.float64, device=DEVICE)
    ref = mlp_reference(x, w1, None, w2, ones, spec, split_sizes, grad_y)
    pre, act = backend.fc1_fprop_act(x, w1, None, split_sizes, offsets, spec, None)
    assert_close(act, ref["act"], dtype, "act")
    grad_pre, grad_scales, _ = backend.fc2_dgrad_act(grad_y, w2, pre, split_sizes, offsets, spec, None)
    assert grad_scales is None
    assert_close(grad_pre, ref["grad_pre"], dtype, "grad pre")


@needs_kernels
def test_zero_rows(backend: TritonBackend) -> None:
    dtype = DTYPES[0]
    spec = ActivationSpec("swiglu")
    offsets = offsets_of([0, 0])
    x = rand(0, 16, dtype=dtype)
    w1 = rand(2, 32, 16, dtype=dtype)
    w2 = rand(2, 16, 16, dtype=dtype)
    pre, act = backend.fc1_fprop_act(x, w1, None, None, offsets, spec, torch.ones(0, device=DEVICE))
    assert pre.shape == (0, 32) and act.shape == (0, 16)
    grad_pre, grad_scales, _ = backend.fc2_dgrad_act(
        x, w2, pre, None, offsets, spec, torch.ones(0, device=DEVICE)
    )
    assert grad_pre.shape == (0, 32) and grad_scales.shape == (0,)
    dw = backend.wgrad(grad_pre, x, None, offsets)
    assert dw.shape == (2, 32, 16) and torch.all(dw == 0), "zero rows: zero weight gradients, not garbage"


# ---------------------------------------------------------------- bad input


@needs_kernels
def test_bad_input_raises_before_work(backend: TritonBackend) -> None:
    dtype = DTYPES[0]
    offsets = offsets_of([2, 2])
    x = rand(4, 16, dtype=dtype)
    w = rand(2, 32, 16, dtype=dtype)
    out = torch.full((4, 32), 3.0, dtype=dtype, device=DEVICE)
    with pytest.raises(ValueError, match="triton.fprop: x has 8 features"):
        backend.fprop(x[:, :8], w, None, offsets, out=out)
    with pytest.raises(ValueError, match="triton.fprop: out must have shape"):
        backend.fprop(x, w, None, offsets, out=out[:, :16])
    with pytest.raises(ValueError, match=r"weight must be \[3, out, in\]"):
        backend.fprop(x, w, None, offsets_of([1, 1, 2]), out=out)
    with pytest.raises(ValueError, match="split sizes sum to 9"):
        backend.fprop(x, w, [4, 5], offsets, out=out)
    with pytest.raises(TypeError, match="dtype"):
        backend.fprop(x, w.double(), None, offsets, out=out)
    with pytest.raises(RuntimeError, match="triton.fprop: cannot run on cpu torch.float64"):
        backend.fprop(x.double().cpu(), w.double().cpu(), None, offsets.cpu())
    with pytest.raises(ValueError, match=r"scales has 3 values.*\(4\)"):
        backend.fc1_fprop_act(
            x, w, None, None, offsets, ActivationSpec("swiglu"), torch.ones(3, device=DEVICE)
        )
    with pytest.raises(ValueError, match="multiple of 8"):
        backend.fc1_fprop_act(
            x, w[:, :28], None, None, offsets, ActivationSpec("swiglu", glu_interleave_size=4), None
        )
    with pytest.raises(ValueError, match="weight expects 16"):
        backend.fc2_dgrad_act(x, rand(2, 16, 16, dtype=dtype), rand(4, 64, dtype=dtype), None, offsets,
                              ActivationSpec("swiglu"), None)  # fmt: skip
    assert torch.all(out == 3.0), "a failed call writes nothing"


# ---------------------------------------------------------------- CUDA only


@needs_cuda
def test_no_host_sync_and_cuda_graph(backend: TritonBackend) -> None:
    """With autotuning off, every entry point launches without a host sync and replays in a graph."""
    dtype = torch.bfloat16
    spec = ActivationSpec("swiglu")
    rows, hidden, ffn, groups = 256, 128, 64, 4
    offsets = offsets_of([64, 0, 100, 92])
    x = rand(rows, hidden, dtype=dtype)
    w1 = rand(groups, 2 * ffn, hidden, dtype=dtype, scale=0.1)
    w2 = rand(groups, hidden, ffn, dtype=dtype, scale=0.1)
    scales = torch.rand(rows, device=DEVICE)
    out = torch.empty(rows, hidden, dtype=dtype, device=DEVICE)
    set_autotune(False)
    try:

        def step():
            pre, act = backend.fc1_fprop_act(x, w1, None, None, offsets, spec, scales)
            backend.fprop(act, w2, None, offsets, out=out)
            grad_pre, _, act2 = backend.fc2_dgrad_act(out, w2, pre, None, offsets, spec, scales)
            backend.wgrad(grad_pre, x, None, offsets)
            return backend.dgrad(grad_pre, w1, None, offsets)

        step()  # compile
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            graph_dx = step()
        offsets.copy_(offsets_of([10, 200, 0, 46]))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(graph_dx, step()), "the graph follows the new offsets on the device"
    finally:
        set_autotune(True)


@needs_cuda
def test_autotune_cached_per_shape(backend: TritonBackend) -> None:
    from fusible_ops.kernels.triton import launch as triton_launch

    dtype = torch.bfloat16
    w = rand(2, 256, 128, dtype=dtype)
    x = rand(300, 128, dtype=dtype)
    backend.fprop(x, w, None, offsets_of([100, 200]))
    before = triton_launch.autotune_cache_sizes()["mm"]
    backend.fprop(x[:290], w, None, offsets_of([90, 200]))  # same power-of-two row bucket
    assert triton_launch.autotune_cache_sizes()["mm"] == before
    backend.fprop(x, w[:, :128], None, offsets_of([100, 200]))  # new shape: tuned once more
    assert triton_launch.autotune_cache_sizes()["mm"] == before + 1


# ---------------------------------------------------------------- through the public API


@needs_kernels
def test_sequential_forced_triton_matches_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """``settings(backend="triton")`` on the GroupedLinear -> ScaledSwiGLU -> GroupedLinear block."""
    fo = pytest.importorskip("fusible_ops")
    needed = (
        "Sequential",
        "GroupedLinear",
        "ScaledSwiGLU",
        "settings",
        "OUTPUT_BUFFER_KEY",
        "GRAD_INPUT_BUFFER_KEY",
    )
    missing = [name for name in needed if not hasattr(fo, name)]
    if missing:
        pytest.skip(f"fusible_ops does not export {missing} yet")
    torch.manual_seed(4)
    dtype = DTYPES[0]
    groups, hidden, ffn = 3, 16, 24
    split_sizes = [11, 0, 20]
    rows = sum(split_sizes)
    experts = fo.Sequential(
        fo.GroupedLinear(groups, hidden, 2 * ffn, device=DEVICE, dtype=dtype),
        fo.ScaledSwiGLU(),
        fo.GroupedLinear(groups, ffn, hidden, device=DEVICE, dtype=dtype),
    )
    x = rand(rows, hidden, dtype=dtype).requires_grad_()
    probs = torch.rand(rows, device=DEVICE, dtype=dtype).requires_grad_()
    splits = torch.tensor(split_sizes, device=DEVICE)
    combine = torch.full((rows + 4, hidden), -1.0, dtype=dtype, device=DEVICE)
    grad_buf = torch.full((rows + 4, hidden), -1.0, dtype=dtype, device=DEVICE)
    grad_y = rand(rows, hidden, dtype=dtype)
    calls = []
    for method in ("fc1_fprop_act", "fc2_dgrad_act", "fprop", "dgrad", "wgrad"):
        original = getattr(TritonBackend, method)
        monkeypatch.setattr(
            TritonBackend,
            method,
            lambda self, *a, _f=original, _m=method, **k: calls.append(_m) or _f(self, *a, **k),
        )
    with fo.settings(backend="triton"):
        y = experts(
            x, splits, probs, splits,
            op_kwargs={2: {fo.OUTPUT_BUFFER_KEY: combine}, 0: {fo.GRAD_INPUT_BUFFER_KEY: grad_buf}},
        )  # fmt: skip
        y.backward(grad_y)
    assert {"fc1_fprop_act", "fc2_dgrad_act"} <= set(calls), f"fused Triton kernels not used: {calls}"
    assert y.data_ptr() == combine.data_ptr() and torch.all(combine[rows:] == -1.0)
    ref = mlp_reference(
        x, experts[0].weight, None, experts[2].weight, probs, ActivationSpec("swiglu"), split_sizes, grad_y
    )
    assert_close(y, ref["y"], dtype, "output")
    assert_close(grad_buf[:rows], ref["dx"], dtype, "grad input (in the caller's buffer)")
    assert_close(experts[0].weight.grad, ref["dw1"], dtype, "fc1 weight grad")
    assert_close(experts[2].weight.grad, ref["dw2"], dtype, "fc2 weight grad")
    assert_close(probs.grad, ref["dscales"], dtype, "probs grad")
