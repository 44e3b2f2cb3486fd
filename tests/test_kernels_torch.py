"""The torch grouped-GEMM backends (torch_loop, cpu, grouped_mm) vs an independent float64 reference.

The reference below does not loop over groups: it expands every row's group weight
(``weight[group_ids]``) and contracts with einsum, and gets the activation gradients
from autograd on formulas written here, so a wrong group boundary, a missing bias, a
swapped gate/linear half or a wrong derivative all show up as O(1) errors.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reference_ops import (
    activation_of,
    grouped_bias_grad,
    grouped_dgrad,
    grouped_fprop,
    grouped_wgrad,
    offsets_of,
)

from fusible_ops.kernels.activation import ActivationSpec
from fusible_ops.kernels.cpu.backend import TorchCpuBackend
from fusible_ops.kernels.cpu.buffer_pool import CpuBufferPool
from fusible_ops.kernels.pytorch.grouped_mm import TorchGroupedMMBackend
from fusible_ops.kernels.pytorch.loop import TorchLoopBackend


def _cpu_per_group() -> TorchCpuBackend:
    """The cpu backend with its one-dense-GEMM path for tiny problems turned off."""
    backend = TorchCpuBackend()
    backend.small_problem_macs = 0
    return backend


BACKENDS = {
    "torch_loop": TorchLoopBackend,
    "cpu": TorchCpuBackend,  # the test shapes are tiny: its one-dense-GEMM path
    "cpu_per_group": _cpu_per_group,
    "grouped_mm": TorchGroupedMMBackend,
}
DTYPES = (torch.float64, torch.float32, torch.bfloat16)
# relative to the largest reference magnitude
TOL = {torch.float64: 1e-10, torch.float32: 1e-4, torch.bfloat16: 3e-2}

SPLITS = {
    "uneven_with_empty": [5, 0, 11, 8],
    "all_in_one": [0, 24, 0, 0],
    "zero_total": [0, 0, 0, 0],
    "empty_last": [9, 7, 8, 0],
}


def make_backend(name: str, dtype: torch.dtype, row_block: int = 7):
    backend = BACKENDS[name]()
    reason = backend.probe(torch.device("cpu"), dtype)
    if reason is not None:
        pytest.skip(reason)
    if isinstance(backend, TorchCpuBackend):
        backend.row_block = row_block  # small blocks so a group spans several
    return backend


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    if expected.numel() == 0:
        return
    err = (actual.double() - expected.double()).abs().max().item()
    scale = max(expected.abs().max().item(), 1.0)
    assert err <= TOL[dtype] * scale, f"{what}: max abs error {err:.3g} > {TOL[dtype]} x {scale:.3g}"


def randn(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.float64).to(dtype)


# ---------------------------------------------------------------- reference math (float64)


ACTIVATIONS = [
    ActivationSpec("swiglu"),
    ActivationSpec("swiglu", glu_interleave_size=1),
    ActivationSpec("geglu"),
    ActivationSpec("reglu", glu_interleave_size=2),
    ActivationSpec("clamped_swiglu", limit=1.5),
    ActivationSpec("srelu"),
    ActivationSpec("gelu"),
]


# ---------------------------------------------------------------- GEMMs


@pytest.mark.parametrize("backend_name", list(BACKENDS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("split_name", list(SPLITS))
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
def test_fprop_dgrad_wgrad_bias_grad(backend_name, dtype, split_name, with_bias):
    backend = make_backend(backend_name, dtype)
    split_sizes = SPLITS[split_name]
    groups, rows, k_in, n_out = len(split_sizes), sum(split_sizes), 16, 24
    x = randn(rows, k_in, dtype=dtype)
    weight = randn(groups, n_out, k_in, dtype=dtype)
    bias = randn(groups, n_out, dtype=dtype) if with_bias else None
    grad_out = randn(rows, n_out, dtype=dtype)
    offsets = offsets_of(split_sizes)

    for sizes in (split_sizes, None):  # host splits, and offsets only
        y = backend.fprop(x, weight, sizes, offsets, bias=bias)
        assert y.dtype == dtype
        assert_close(y, grouped_fprop(x, weight, split_sizes, bias), dtype, "fprop")
        assert_close(
            backend.dgrad(grad_out, weight, sizes, offsets),
            grouped_dgrad(grad_out, weight, split_sizes),
            dtype,
            "dgrad",
        )
        assert_close(
            backend.wgrad(grad_out, x, sizes, offsets),
            grouped_wgrad(grad_out, x, split_sizes),
            dtype,
            "wgrad",
        )
        db = backend.bias_grad(grad_out, sizes, offsets, groups)
        assert db.dtype == dtype
        assert_close(db, grouped_bias_grad(grad_out, split_sizes), dtype, "bias_grad")


@pytest.mark.parametrize("backend_name", list(BACKENDS))
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_non_contiguous_operands(backend_name, dtype):
    backend = make_backend(backend_name, dtype)
    split_sizes = [6, 0, 10]
    rows, k_in, n_out = sum(split_sizes), 16, 8
    x = randn(rows, 2 * k_in, dtype=dtype)[:, ::2]  # column stride 2
    weight = randn(3, k_in, n_out, dtype=dtype).transpose(1, 2)  # [G, N, K] view, K-major
    grad_out = randn(n_out, rows, dtype=dtype).t()  # column-major
    offsets = offsets_of(split_sizes)
    assert not x.is_contiguous() and not weight.is_contiguous() and not grad_out.is_contiguous()
    assert_close(
        backend.fprop(x, weight, split_sizes, offsets), grouped_fprop(x, weight, split_sizes), dtype, "fprop"
    )
    assert_close(
        backend.dgrad(grad_out, weight, split_sizes, offsets),
        grouped_dgrad(grad_out, weight, split_sizes),
        dtype,
        "dgrad",
    )
    assert_close(
        backend.wgrad(grad_out, x, split_sizes, offsets),
        grouped_wgrad(grad_out, x, split_sizes),
        dtype,
        "wgrad",
    )


@pytest.mark.parametrize("backend_name", list(BACKENDS))
@pytest.mark.parametrize("known_splits", [True, False], ids=["host_splits", "offsets_only"])
def test_out_is_written_in_place_and_tail_rows_untouched(backend_name, known_splits):
    """``out`` is a view of the first rows of a bigger buffer; rows past the last group keep their values."""
    dtype = torch.float32
    backend = make_backend(backend_name, dtype)
    split_sizes = [3, 0, 5]
    covered, extra, k_in, n_out = sum(split_sizes), 2, 8, 12
    x = randn(covered + extra, k_in, dtype=dtype)  # x has 2 rows no group owns
    weight = randn(3, n_out, k_in, dtype=dtype)
    offsets = offsets_of(split_sizes)
    sizes = split_sizes if known_splits else None
    sentinel = 123.0

    buf = torch.full((covered + extra + 4, n_out), sentinel)
    out = buf[: covered + extra]
    y = backend.fprop(x, weight, sizes, offsets, out=out)
    assert y.data_ptr() == buf.data_ptr()
    assert_close(buf[:covered], grouped_fprop(x, weight, split_sizes), dtype, "fprop into out")
    assert (buf[covered:] == sentinel).all(), "fprop wrote rows past the last group"

    grad_out = randn(covered + extra, n_out, dtype=dtype)
    dbuf = torch.full((covered + extra + 4, k_in), sentinel)
    dx = backend.dgrad(grad_out, weight, sizes, offsets, out=dbuf[: covered + extra])
    assert dx.data_ptr() == dbuf.data_ptr()
    assert_close(dbuf[:covered], grouped_dgrad(grad_out, weight, split_sizes), dtype, "dgrad into out")
    assert (dbuf[covered:] == sentinel).all(), "dgrad wrote rows past the last group"

    wbuf = torch.full((3, n_out, k_in), sentinel)
    dw = backend.wgrad(grad_out, x, sizes, offsets, out=wbuf)
    assert dw.data_ptr() == wbuf.data_ptr()
    assert_close(wbuf, grouped_wgrad(grad_out, x, split_sizes), dtype, "wgrad into out (empty group zeroed)")


@pytest.mark.parametrize("backend_name", list(BACKENDS))
def test_bad_input_raises_before_writing(backend_name):
    backend = make_backend(backend_name, torch.float32)
    x = torch.randn(8, 16)
    weight = torch.randn(2, 8, 16)
    offsets = offsets_of([4, 4])
    out = torch.full((8, 8), 7.0)
    cases = [
        (TypeError, lambda: backend.fprop(x.double(), weight, [4, 4], offsets, out=out)),
        (ValueError, lambda: backend.fprop(x, weight, [4, 4, 0], offsets, out=out)),
        (ValueError, lambda: backend.fprop(x, weight, [4, 5], offsets, out=out)),
        (ValueError, lambda: backend.fprop(x, weight, [4, 4], offsets, out=out[:7])),
        (ValueError, lambda: backend.fprop(x, weight[:, :, :8], [4, 4], offsets, out=out)),
        (ValueError, lambda: backend.fprop(x, weight, [4, 4], offsets, bias=torch.zeros(2, 7), out=out)),
        (ValueError, lambda: backend.fprop(x, weight, [4, -1], offsets, out=out)),
        (ValueError, lambda: backend.dgrad(torch.randn(8, 7), weight, [4, 4], offsets, out=out)),
    ]
    for exc, call in cases:
        with pytest.raises(exc, match=backend.name):
            call()
        assert (out == 7.0).all()


def test_grouped_mm_probe_rules():
    backend = TorchGroupedMMBackend()
    assert "float64" in backend.probe(torch.device("cpu"), torch.float64)
    assert backend.probe(torch.device("cpu"), torch.bfloat16) is None  # torch 2.13 supports CPU
    assert TorchGroupedMMBackend.shape_problem(33, 16, torch.bfloat16) is not None
    assert TorchGroupedMMBackend.shape_problem(32, 16, torch.bfloat16) is None
    with pytest.raises(ValueError, match="torch_loop"):
        backend.fprop(torch.randn(4, 6), torch.randn(1, 4, 6), [4], offsets_of([4]))


def test_cpu_backend_refuses_other_devices():
    assert "CPU" in TorchCpuBackend().probe(torch.device("meta"), torch.float32)
    assert TorchLoopBackend().probe(torch.device("cpu"), torch.int32) is not None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_grouped_mm_on_cuda_matches_reference_without_host_sync():
    backend = TorchGroupedMMBackend()
    dev = torch.device("cuda")
    reason = backend.probe(dev, torch.bfloat16)
    if reason is not None:
        pytest.skip(reason)
    split_sizes = [5, 0, 11, 8]
    x = torch.randn(24, 32, device=dev).bfloat16()
    weight = torch.randn(4, 16, 32, device=dev).bfloat16()
    bias = torch.randn(4, 16, device=dev).bfloat16()
    grad_out = torch.randn(24, 16, device=dev).bfloat16()
    offsets = offsets_of(split_sizes).to(dev)
    out = torch.full((24, 16), 5.0, device=dev).bfloat16()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any host sync below raises
    try:
        y = backend.fprop(x, weight, None, offsets, bias=bias, out=out)
        dx = backend.dgrad(grad_out, weight, None, offsets)
        dw = backend.wgrad(grad_out, x, None, offsets)
        db = backend.bias_grad(grad_out, None, offsets, 4)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert y.data_ptr() == out.data_ptr()
    cpu = torch.device("cpu")
    assert_close(
        y.to(cpu), grouped_fprop(x.cpu(), weight.cpu(), split_sizes, bias.cpu()), torch.bfloat16, "fprop"
    )
    assert_close(
        dx.to(cpu), grouped_dgrad(grad_out.cpu(), weight.cpu(), split_sizes), torch.bfloat16, "dgrad"
    )
    assert_close(dw.to(cpu), grouped_wgrad(grad_out.cpu(), x.cpu(), split_sizes), torch.bfloat16, "wgrad")
    assert_close(db.to(cpu), grouped_bias_grad(grad_out.cpu(), split_sizes), torch.bfloat16, "bias_grad")


# ---------------------------------------------------------------- fused activation entry points


def ref_mlp_pieces(x, w1, b1, w2, split_sizes, spec, scales, grad_y):
    """Reference (pre, act, grad_pre, grad_scales) in float64 with autograd for the activation."""
    pre = grouped_fprop(x, w1, split_sizes, b1).requires_grad_(True)
    s = None if scales is None else scales.detach().double().clone().requires_grad_(True)
    act = activation_of(spec, pre)
    if s is not None:
        act = act * s[: pre.shape[0], None]
    grad_act = grouped_dgrad(grad_y, w2, split_sizes)
    act.backward(grad_act)
    grad_scales = None if s is None else s.grad
    return pre.detach(), act.detach(), pre.grad, grad_scales


@pytest.mark.parametrize("backend_name", list(BACKENDS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("spec", ACTIVATIONS, ids=lambda s: f"{s.kind}-k{s.glu_interleave_size}")
@pytest.mark.parametrize("scaled", [True, False], ids=["scaled", "unscaled"])
def test_fused_activation_entry_points(backend_name, dtype, spec, scaled):
    backend = make_backend(backend_name, dtype)
    split_sizes = [5, 0, 11, 8]
    _check_fused_entry_points(backend, dtype, spec, split_sizes, scaled, with_bias=True)


def _check_fused_entry_points(backend, dtype, spec, split_sizes, scaled, with_bias):
    groups, rows, hidden, ffn = len(split_sizes), sum(split_sizes), 16, 8
    fc1_out = 2 * ffn if spec.gated else ffn
    x = randn(rows, hidden, dtype=dtype)
    w1 = randn(groups, fc1_out, hidden, dtype=dtype)
    b1 = randn(groups, fc1_out, dtype=dtype) if with_bias else None
    w2 = randn(groups, hidden, ffn, dtype=dtype)
    scales_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    scales = torch.rand(rows, dtype=scales_dtype) if scaled else None
    grad_y = randn(rows, hidden, dtype=dtype)
    offsets = offsets_of(split_sizes)

    pre, act = backend.fc1_fprop_act(x, w1, b1, split_sizes, offsets, spec, scales)
    ref_pre, _, _, _ = ref_mlp_pieces(x, w1, b1, w2, split_sizes, spec, scales, grad_y)
    assert_close(pre, ref_pre, dtype, "fc1 pre")
    # the activation is judged from the backend's own (rounded) pre, so bf16 GEMM
    # rounding is not amplified through the nonlinearity
    _, ref_act, ref_grad_pre, ref_grad_scales = (
        ref_mlp_pieces(x, w1, b1, w2, split_sizes, spec, scales, grad_y)
        if dtype == torch.float64
        else _pieces_from_pre(pre, w2, split_sizes, spec, scales, grad_y)
    )
    assert_close(act, ref_act, dtype, "fc1 act")

    grad_pre, grad_scales, act2 = backend.fc2_dgrad_act(grad_y, w2, pre, split_sizes, offsets, spec, scales)
    assert_close(act2, ref_act, dtype, "recomputed act")
    assert_close(grad_pre, ref_grad_pre, dtype, "grad_pre")
    if scaled:
        assert grad_scales.dtype == scales.dtype
        assert_close(grad_scales, ref_grad_scales, dtype, "grad_scales")
    else:
        assert grad_scales is None


def _pieces_from_pre(pre, w2, split_sizes, spec, scales, grad_y):
    pre64 = pre.detach().double().clone().requires_grad_(True)
    s = None if scales is None else scales.detach().double().clone().requires_grad_(True)
    act = activation_of(spec, pre64)
    if s is not None:
        act = act * s[:, None]
    act.backward(grouped_dgrad(grad_y, w2, split_sizes))
    return None, act.detach(), pre64.grad, None if s is None else s.grad


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    split_sizes=st.lists(st.integers(0, 9), min_size=1, max_size=5),
    backend_name=st.sampled_from(list(BACKENDS)),
    row_block=st.integers(1, 8),
    kind=st.sampled_from(["swiglu", "clamped_swiglu", "srelu"]),
)
def test_random_splits_fp64(split_sizes, backend_name, row_block, kind):
    dtype = torch.float64 if backend_name != "grouped_mm" else torch.float32
    backend = BACKENDS[backend_name]()
    if isinstance(backend, TorchCpuBackend):
        backend.row_block = row_block
    _check_fused_entry_points(backend, dtype, ActivationSpec(kind), split_sizes, scaled=True, with_bias=True)


def test_cpu_default_blocking_spans_groups():
    """The byte-sized default blocks (16-row minimum here) cut groups in several blocks."""
    backend = TorchCpuBackend()
    backend.block_bytes = 1  # -> 16-row blocks
    assert backend.row_block is None
    _check_fused_entry_points(
        backend, torch.float64, ActivationSpec("swiglu"), [20, 0, 37], scaled=True, with_bias=True
    )


# ---------------------------------------------------------------- output buffer reuse (cpu backend)


def test_buffer_pool_reuses_only_unreferenced_storage():
    pool = CpuBufferPool(min_bytes=0, max_buffers=4)
    first = pool.empty((64, 32), torch.float32, torch.device("cpu"))
    ptr = first.data_ptr()
    held_view = first[3:]
    del first
    second = pool.empty((64, 32), torch.float32, torch.device("cpu"))
    assert second.data_ptr() != ptr, "a storage still referenced by a view was handed out again"
    del held_view, second
    third = pool.empty((64, 32), torch.float32, torch.device("cpu"))
    assert third.data_ptr() == ptr, "a free storage was not reused"
    assert third._base is None and third.is_contiguous() and third.shape == (64, 32)
    other = pool.empty((32, 64), torch.float32, torch.device("cpu"))  # other shape: new storage
    assert other.data_ptr() != ptr
    pool.clear()
    assert pool.kept_bytes() == 0


_CPU = torch.device("cpu")


def _escape_by_share_memory(t):
    """What a torch.multiprocessing queue does: shared memory, mapped again by the receiver
    (a separate mapping: no reference the pool could count)."""
    t.share_memory_()
    handle = t.untyped_storage()._share_filename_cpu_()
    mapping = torch.UntypedStorage._new_shared_filename_cpu(*handle)
    return torch.empty(0, dtype=t.dtype).set_(mapping, 0, t.shape, t.stride())


def _escape_by_dlpack(t):
    return torch.utils.dlpack.to_dlpack(t)


def _escape_by_numpy(t):
    return t.numpy()


def _escape_by_resize(t):
    t.untyped_storage().resize_(0)  # the storage no longer is the memory the pool handed out
    return None


def _read(holder) -> torch.Tensor:
    if isinstance(holder, torch.Tensor):
        return holder
    if type(holder).__name__ == "PyCapsule":
        return torch.utils.dlpack.from_dlpack(holder)
    return torch.from_numpy(holder)


@pytest.mark.parametrize(
    "escape", [_escape_by_share_memory, _escape_by_dlpack, _escape_by_numpy, _escape_by_resize],
    ids=lambda f: f.__name__.removeprefix("_escape_by_"),
)  # fmt: skip
def test_buffer_pool_never_reuses_storage_that_escaped(escape):
    pool = CpuBufferPool(min_bytes=0)
    first = pool.empty((64, 32), torch.float32, _CPU).fill_(3.0)
    holder = escape(first)
    view = None if holder is None else _read(holder)
    del first
    for _ in range(3):  # every later request: never the escaped memory
        again = pool.empty((64, 32), torch.float32, _CPU)
        assert again.shape == (64, 32)
        again.fill_(-1.0)
        if view is not None:
            assert torch.all(view == 3.0), f"memory that escaped by {escape.__name__} was handed out again"


def test_buffer_pool_reuses_storage_once_numpy_and_dlpack_references_are_gone():
    pool = CpuBufferPool(min_bytes=0)
    first = pool.empty((64, 32), torch.float32, _CPU)
    ptr = first.data_ptr()
    array, capsule = first.numpy(), torch.utils.dlpack.to_dlpack(first)
    del first
    assert pool.empty((64, 32), torch.float32, _CPU).data_ptr() != ptr
    del array
    assert pool.empty((64, 32), torch.float32, _CPU).data_ptr() != ptr  # the capsule still holds it
    del capsule
    assert pool.empty((64, 32), torch.float32, _CPU).data_ptr() == ptr


def _receive_and_compare(queue, replies) -> None:
    received = queue.get()
    first = received.clone()
    replies.put("received")
    queue.get()  # the sender has made more calls meanwhile
    replies.put(bool(torch.equal(received, first)))


def test_output_sent_to_another_process_never_changes_under_it():
    """A fused output put on a torch.multiprocessing queue, then more calls in the sender."""
    import fusible_ops as fo

    mp = torch.multiprocessing.get_context("spawn")
    queue, replies = mp.Queue(), mp.Queue()
    child = mp.Process(target=_receive_and_compare, args=(queue, replies))
    child.start()
    try:
        experts, hidden, ffn, rows = 2, 512, 256, 600  # y and pre are 1.2 MB each: pooled
        seq = fo.Sequential(
            fo.GroupedLinear(experts, hidden, 2 * ffn),
            fo.ScaledSwiGLU(),
            fo.GroupedLinear(experts, ffn, hidden),
        )
        splits = [rows // 2, rows - rows // 2]
        probs = torch.rand(rows)
        with torch.no_grad():
            y = seq(torch.randn(rows, hidden), splits, probs, splits)
            queue.put(y)
            del y
            assert replies.get(timeout=120) == "received"
            for _ in range(4):
                seq(torch.randn(rows, hidden), splits, probs, splits)
        queue.put("compare")
        assert replies.get(timeout=120) is True, "the receiver's tensor changed"
    finally:
        child.join(timeout=60)
        if child.is_alive():
            child.kill()


def test_buffer_pool_respects_autograd_saved_tensors():
    pool = CpuBufferPool(min_bytes=0)
    buf = pool.empty((8, 8), torch.float32, torch.device("cpu")).fill_(2.0)
    ptr = buf.data_ptr()
    w = torch.ones(8, 8, requires_grad=True)
    loss = (buf * w).sum()  # autograd saves buf for w's gradient
    del buf
    again = pool.empty((8, 8), torch.float32, torch.device("cpu"))
    assert again.data_ptr() != ptr
    again.fill_(-1.0)
    loss.backward()
    assert (w.grad == 2.0).all()


def test_cpu_backend_reused_outputs_never_alias_live_results():
    backend = TorchCpuBackend()
    backend.buffers = CpuBufferPool(min_bytes=0)
    backend.row_block = 5
    spec = ActivationSpec("swiglu")
    split_sizes = [7, 0, 9]
    x = randn(16, 8, dtype=torch.float64)
    w1 = randn(3, 16, 8, dtype=torch.float64)
    w2 = randn(3, 8, 8, dtype=torch.float64)
    grad_y = randn(16, 8, dtype=torch.float64)
    scales = torch.rand(16, dtype=torch.float64)
    offsets = offsets_of(split_sizes)

    pre, act = backend.fc1_fprop_act(x, w1, None, split_sizes, offsets, spec, scales)
    grad_pre, _, act_bwd = backend.fc2_dgrad_act(grad_y, w2, pre, split_sizes, offsets, spec, scales)
    kept = [t.clone() for t in (pre, act, grad_pre, act_bwd)]
    pre2, act2 = backend.fc1_fprop_act(2 * x, w1, None, split_sizes, offsets, spec, scales)
    ptrs = {t.data_ptr() for t in (pre, act, grad_pre, act_bwd)}
    assert pre2.data_ptr() not in ptrs and act2.data_ptr() not in ptrs
    for live, copy in zip((pre, act, grad_pre, act_bwd), kept):
        assert torch.equal(live, copy)
    freed = {pre.data_ptr(), pre2.data_ptr()}
    del pre, act, pre2, act2
    pre3, _ = backend.fc1_fprop_act(x, w1, None, split_sizes, offsets, spec, scales)
    assert pre3.data_ptr() in freed, "a freed output storage was not reused"
    assert torch.equal(pre3, kept[0])


def test_backend_selection_carries_the_mark_torch_compiler_sets():
    """Selection is marked constant for torch.compile without importing torch._dynamo at
    package import: the mark must be the one ``torch.compiler.assume_constant_result`` sets."""
    from fusible_ops.kernels import _selected_names

    def probe_fn():
        return None

    torch.compiler.assume_constant_result(probe_fn)
    marks = vars(probe_fn)
    assert marks, "torch.compiler.assume_constant_result no longer marks the function"
    assert all(getattr(_selected_names, key, None) == value for key, value in marks.items())
