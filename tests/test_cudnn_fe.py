"""cuDNN frontend backend on CPU: the adapter's preparation logic and the backend's calls,
checked against a fake of the frontend wrappers that implements their documented math,
plus the probe's "not installed" / "no GPU" / "GPU too old" answers.

Nothing here needs the real package or a GPU; the real kernels are unverified (docs/backend-cudnn.md).
"""

from __future__ import annotations

import types

import pytest
import torch
from error_model import dot_tolerance, rounding_rtol
from hypothesis import given, settings
from hypothesis import strategies as st
from mxfp8_reference import logical_scale_view, mx_scale_shape, mxfp8_dequantize, unpack_scales
from reference_ops import activation_of, grouped_fprop, offsets_of

from fusible_ops.kernels.activation import ActivationSpec, split_gate_linear
from fusible_ops.kernels.cudnn import adapter
from fusible_ops.kernels.cudnn import probe as probe_mod
from fusible_ops.kernels.cudnn.backend import CudnnFrontendBackend

# ---------------------------------------------------------------- the fake frontend


def _segments(ends: torch.Tensor) -> list[tuple[int, int]]:
    bounds = [0] + [int(e) for e in ends]
    return list(zip(bounds[:-1], bounds[1:]))


def _dequant(t: torch.Tensor, sf: torch.Tensor | None) -> torch.Tensor:
    """Documented MXFP8 decode: one E8M0 scale per 32 values along the last dim."""
    if sf is None:
        return t.float()
    rows, cols = t.shape[-2], t.shape[-1]
    exps = unpack_scales(sf.view(torch.uint8), rows, -(-cols // 32))
    exps = exps if t.dim() == 3 else exps[0]
    return t.float() * torch.exp2(exps.float() - 127).repeat_interleave(32, -1)[..., :cols]


def _gate_up(c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    blocks = c.view(c.shape[0], -1, 2, 32)  # alternating 32-wide gate / up blocks
    return blocks[:, :, 0].reshape(c.shape[0], -1), blocks[:, :, 1].reshape(c.shape[0], -1)


class FakeFrontend(types.ModuleType):
    """Implements the documented math of the five wrappers in float32 torch."""

    def __init__(self) -> None:
        super().__init__("cudnn")
        self.__version__ = "fake"
        self.calls: list[tuple[str, dict]] = []
        self.pointees: list[torch.Tensor] = []
        for name in probe_mod.BLACKWELL_WRAPPERS:
            fn = getattr(self, "_" + name)
            fn.__func__.supports_canonical_layouts = True
            fn.__func__.supports_bf16_canonical_layouts = True
            setattr(self, name, fn)

    def backend_version(self) -> int:
        return 91900

    def _expert(self, ptr: int, n: int, k: int, b_major: str) -> torch.Tensor:
        """Dereference a discrete-mode pointer into a known tensor: ``(n, k)`` float32."""
        for base in self.pointees:
            flat = base.reshape(-1)
            offset = (ptr - base.data_ptr()) // base.element_size()
            if 0 <= offset < flat.numel():
                mat = flat[offset : offset + n * k]
                return (mat.view(k, n).t() if b_major == "n" else mat.view(n, k)).float()
        raise AssertionError("pointer to an unknown tensor")

    def _weights(self, kw: dict, groups: int, k: int) -> list[torch.Tensor]:
        if kw.get("b_tensor") is not None:
            return list(_dequant(kw["b_tensor"], kw.get("sfb_tensor")))
        n, major = kw["n"], kw["b_major"]
        return [self._expert(int(p), n, k, major) for p in kw["b_ptrs"]]

    def _gemm(self, kw: dict) -> torch.Tensor:
        a = _dequant(kw["a_tensor"], kw.get("sfa_tensor"))
        ends = kw["padded_offsets"]
        weights = self._weights(kw, ends.numel(), a.shape[1])
        out = torch.zeros(a.shape[0], weights[0].shape[0])
        for g, (s, e) in enumerate(_segments(ends)):
            assert s % 256 == 0 and e % 256 == 0, "groups must be 256-row aligned"
            out[s:e] = kw["alpha_tensor"][g] * (a[s:e] @ weights[g].t())
            if kw.get("bias_tensor") is not None:
                out[s:e] += kw["bias_tensor"][:, g].float()
        return out

    def _write_d(self, kw: dict, value: torch.Tensor) -> torch.Tensor:
        d = kw.get("d_tensor")
        if d is None:
            d = torch.empty(value.shape, dtype=kw["d_dtype"])
        d.copy_(value)
        return d

    def _grouped_gemm_glu_wrapper_sm100(
        self, a_tensor, sfa_tensor, padded_offsets, alpha_tensor, b_tensor=None, sfb_tensor=None,
        bias_tensor=None, b_ptrs=None, sfb_ptrs=None, n=None, b_dtype=None, b_major="k",
        norm_const_tensor=None, prob_tensor=None, c_dtype=None, d_dtype=None, sf_vec_size=16,
        act_func="swiglu", linear_offset=None, geglu_alpha=1.702, glu_clamp_max=7.0, glu_clamp_min=-7.0,
        generate_c=False, current_stream=None,
    ):  # fmt: skip
        kw = dict(locals())
        kw.pop("self")
        self.calls.append(("glu", kw))
        c = self._gemm(kw)
        gate, up = _gate_up(c)
        if act_func == "swiglu":
            act = torch.nn.functional.silu(gate) * up
        else:
            g = gate.clamp(max=glu_clamp_max)
            act = (
                g * torch.sigmoid(geglu_alpha * g) * (up.clamp(glu_clamp_min, glu_clamp_max) + linear_offset)
            )
        d = act * prob_tensor.float()[:, None]
        return {"c_tensor": c.to(c_dtype), "d_tensor": d.to(d_dtype)}

    def _grouped_gemm_wrapper_sm100(
        self, a_tensor, padded_offsets, alpha_tensor, b_tensor=None, bias_tensor=None, b_ptrs=None,
        n=None, b_dtype=None, b_major="k", d_dtype=None, d_tensor=None, prob_tensor=None,
        current_stream=None,
    ):  # fmt: skip
        if prob_tensor is None:  # the real wrapper (frontend 1.32) raises "prob_tensor is required"
            raise ValueError("prob_tensor is required")
        kw = dict(locals())
        kw.pop("self")
        self.calls.append(("gemm", kw))
        return {"d_tensor": self._write_d(kw, self._gemm(kw) * prob_tensor.float()[:, None])}

    def _grouped_gemm_quant_wrapper_sm100(
        self, a_tensor, sfa_tensor, padded_offsets, alpha_tensor, b_tensor=None, sfb_tensor=None,
        bias_tensor=None, norm_const_tensor=None, d_dtype=None, d_tensor=None, sf_vec_size=16,
        current_stream=None,
    ):  # fmt: skip
        kw = dict(locals())
        kw.pop("self")
        assert sf_vec_size == 32 and a_tensor.dtype == torch.float8_e4m3fn
        self.calls.append(("quant", kw))
        return {"d_tensor": self._write_d(kw, self._gemm(kw))}

    def _grouped_gemm_dglu_wrapper_sm100(
        self, a_tensor, c_tensor, sfa_tensor, padded_offsets, alpha_tensor, beta_tensor, prob_tensor,
        dprob_tensor, b_ptrs=None, n=None, b_dtype=None, b_major="k", d_dtype=None, act_func="dswiglu",
        linear_offset=None, geglu_alpha=1.702, glu_clamp_max=7.0, glu_clamp_min=-7.0, current_stream=None,
    ):  # fmt: skip
        kw = dict(locals())
        kw.pop("self")
        self.calls.append(("dglu", kw))
        alpha = alpha_tensor
        ref = self._gemm(dict(kw, alpha_tensor=alpha * alpha, bias_tensor=None))
        rows = c_tensor.shape[0]
        beta = torch.ones(rows)
        for g, (s, e) in enumerate(_segments(padded_offsets)):
            beta[s:e] = beta_tensor[g]
        gate, up = _gate_up(c_tensor.float() * beta[:, None])
        prob = prob_tensor.float()[:, None]
        if act_func == "dswiglu":
            sig = torch.sigmoid(gate)
            act = gate * sig * up
            dgate = ref * prob * up * sig * (1 + gate * (1 - sig))
            dup = ref * prob * gate * sig
        else:
            gc, uc = gate.clamp(max=glu_clamp_max), up.clamp(glu_clamp_min, glu_clamp_max)
            s = torch.sigmoid(geglu_alpha * gc)
            act = gc * s * (uc + linear_offset)
            dgate = ref * prob * (uc + linear_offset) * s * (1 + geglu_alpha * gc * (1 - s))
            dgate = dgate * (gate <= glu_clamp_max)
            dup = ref * prob * gc * s * ((up >= glu_clamp_min) & (up <= glu_clamp_max))
        d = torch.stack([dgate.view(rows, -1, 32), dup.view(rows, -1, 32)], 2).reshape(rows, -1)
        dprob_tensor += (ref * act).sum(-1)
        return {"d_row_tensor": d.to(d_dtype), "dprob_tensor": dprob_tensor}

    def _grouped_gemm_wgrad_wrapper_sm100(
        self, a_tensor, b_tensor, sfa_tensor, sfb_tensor, offsets_tensor, wgrad_tensor=None,
        wgrad_dtype=None, current_stream=None,
    ):  # fmt: skip
        kw = dict(locals())
        kw.pop("self")
        self.calls.append(("wgrad", kw))
        for g, (s, e) in enumerate(_segments(offsets_tensor)):
            wgrad_tensor[g] = a_tensor[:, s:e].float() @ b_tensor[s:e].float()
        return {"wgrad_tensor": wgrad_tensor}


class FakeGraph:
    """Stands in for a built ``moe_grouped_matmul`` graph: documented math on the variant pack."""

    def __init__(self, log: list) -> None:
        self.log = log

    def get_workspace_size(self) -> int:
        return 16

    def execute(self, pack: dict, workspace: torch.Tensor, handle=None) -> None:
        self.log.append(pack)
        token, weight, bounds, out = pack[1][0], pack[2], pack[3].view(-1), pack[100][0]
        for g in range(weight.shape[0]):
            s, e = int(bounds[g]), int(bounds[g + 1])
            out[s:e] = token[s:e] @ weight[g]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def fake(monkeypatch):
    """Install the fake frontend on a pretend SM100 GPU; yields (fake module, set_capability)."""
    module = FakeFrontend()
    state = {"cc": (10, 0)}
    monkeypatch.setattr(probe_mod, "_import_cudnn", lambda: module)
    monkeypatch.setattr(probe_mod, "_cuda_available", lambda: True)
    monkeypatch.setattr(probe_mod, "_compute_capability", lambda index: state["cc"])
    probe_mod.clear_probe_cache()

    def set_cc(cc):
        state["cc"] = cc
        probe_mod.clear_probe_cache()

    yield module, set_cc
    probe_mod.clear_probe_cache()


# ---------------------------------------------------------------- independent references


SPLITS = [[3, 0, 300, 1], [256, 0, 512], [0, 0], [5]]
# float32 vs float64: the longest reduction of these tests is wgrad's over <= 512 rows
FP32_TOL = dot_tolerance(torch.float32, 512)


# ---------------------------------------------------------------- row padding


def test_pad_rows_uneven_hand_computed():
    layout = adapter.pad_rows([3, 0, 300, 1], offsets_of([3, 0, 300, 1]), 304)
    assert layout.padded_offsets.tolist() == [256, 256, 768, 1024]
    assert layout.capacity == 1024 and not layout.identity
    expected = [0, 1, 2] + list(range(256, 556)) + [768]
    assert layout.row_map.tolist() == expected


def test_pad_rows_identity_when_aligned():
    layout = adapter.pad_rows([256, 0, 512], offsets_of([256, 0, 512]), 768)
    assert layout.identity and layout.row_map is None and layout.capacity == 768
    assert layout.padded_offsets.tolist() == [256, 256, 768]
    x = torch.randn(768, 4)
    assert adapter.scatter_rows(x, layout).data_ptr() == x.data_ptr()


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(0, 600), min_size=1, max_size=5))
def test_pad_rows_device_path_matches_host_and_round_trips(splits):
    rows = sum(splits)
    host = adapter.pad_rows(splits, offsets_of(splits), rows)
    dev = adapter.pad_rows(None, offsets_of(splits), rows)
    assert torch.equal(host.padded_offsets, dev.padded_offsets)
    assert dev.capacity % 256 == 0 and dev.capacity >= int(dev.padded_offsets[-1])
    x = torch.randn(rows, 3)
    for layout in (host, dev):
        padded = adapter.scatter_rows(x, layout)
        assert torch.equal(adapter.gather_rows(padded, layout), x)
        mask = torch.ones(layout.capacity, dtype=torch.bool)
        if layout.row_map is not None:
            mask[layout.row_map] = False
            assert padded[mask].abs().sum() == 0  # padded rows are zero, never caller data
        for g, (s, e) in enumerate(_segments(layout.padded_offsets)):  # every group starts aligned
            assert s % 256 == 0 and e - s == -(-splits[g] // 256) * 256


def test_pad_rows_rejects_mismatched_split_sizes():
    with pytest.raises(ValueError, match="split_sizes"):
        adapter.pad_rows([1, 2], offsets_of([1, 2]), 4)


def test_output_target_in_place_only_when_identity():
    out = torch.empty(768, 8)
    aligned = adapter.pad_rows([256, 512], offsets_of([256, 512]), 768)
    target, in_place = adapter.output_target(aligned, out, 8, out.dtype, out.device)
    assert in_place and target is out
    uneven = adapter.pad_rows([1, 767], offsets_of([1, 767]), 768)
    target, in_place = adapter.output_target(uneven, out, 8, out.dtype, out.device)
    assert not in_place and target.shape == (uneven.capacity, 8)
    target.normal_()
    res = adapter.gather_rows(target, uneven, out)
    assert res.data_ptr() == out.data_ptr() and torch.equal(out, target[uneven.row_map])


# ---------------------------------------------------------------- GLU columns and activation args


@pytest.mark.parametrize("interleave", [None, 1, 8, 32, 64])
def test_glu_column_order_pairs_caller_gate_and_linear(interleave):
    two_n = 256
    perm = adapter.glu_kernel_column_order(two_n, interleave)
    assert sorted(perm.tolist()) == list(range(two_n))
    gate, lin = split_gate_linear(torch.arange(two_n), interleave)
    kernel_gate, kernel_lin = _gate_up(perm.view(1, -1))
    assert torch.equal(kernel_gate[0], gate) and torch.equal(kernel_lin[0], lin)
    assert adapter.is_identity_permutation(perm) == (interleave == 32)
    assert torch.equal(perm[adapter.inverse_permutation(perm)], torch.arange(two_n))


def test_glu_column_order_rejects_bad_width():
    with pytest.raises(ValueError, match="divisible by 64"):
        adapter.glu_kernel_column_order(96, None)


def test_activation_argument_mapping():
    assert adapter.glu_activation_kwargs(ActivationSpec("swiglu")) == {"act_func": "swiglu"}
    spec = ActivationSpec("clamped_swiglu", limit=5.0, alpha=1.5, glu_linear_offset=0.5)
    assert adapter.glu_activation_kwargs(spec, backward=True) == {
        "act_func": "dgeglu",
        "geglu_alpha": 1.5,
        "glu_clamp_max": 5.0,
        "glu_clamp_min": -5.0,
        "linear_offset": 0.5,
    }
    for kind in ("geglu", "reglu", "silu"):
        with pytest.raises(ValueError, match="cudnn backend"):
            adapter.glu_activation_kwargs(ActivationSpec(kind))


def test_bias_layout_and_expert_pointers():
    bias = torch.randn(3, 64)
    b = adapter.bias_kernel_layout(bias)
    assert b.shape == (64, 3) and b.stride() == (1, 64) and torch.equal(b, bias.t())
    w = torch.randn(3, 4, 5)
    ptrs = adapter.expert_pointers(w)
    assert ptrs.dtype == torch.int64 and ptrs.tolist() == [w[g].data_ptr() for g in range(3)]


# ---------------------------------------------------------------- MXFP8 layouts


def test_scale_shapes():
    assert mx_scale_shape(300, 200, groups=2) == (32, 4, 3, 4, 2, 2)
    assert adapter.mx_packed_shape(300, 200, groups=2) == (2, 3, 2, 32, 4, 4)
    exps = torch.randint(0, 255, (2, 300, 7), dtype=torch.uint8)
    packed = adapter.pack_scales(exps)
    assert packed.shape == (2, 3, 2, 32, 4, 4) and packed.is_contiguous()
    assert packed.numel() == 512 * 3 * 2 * 2
    assert logical_scale_view(packed).shape == mx_scale_shape(300, 200, groups=2)


def test_pack_scales_position_and_round_trip():
    exps = torch.zeros(1, 130, 6, dtype=torch.uint8)
    exps[0, 37, 5] = 9  # row 37 = tile 0, (37 % 32, 37 // 32) = (5, 1); col 5 = k-tile 1, slot 1
    exps[0, 129, 0] = 7  # row 129 = tile 1, (1, 0)
    packed = adapter.pack_scales(exps)
    assert packed[0, 0, 1, 5, 1, 1] == 9 and packed[0, 1, 0, 1, 0, 0] == 7
    assert (packed == 9).sum() == 1 and (packed == 7).sum() == 1
    assert torch.equal(unpack_scales(packed, 130, 6), exps)
    assert logical_scale_view(packed)[5, 1, 0, 1, 1, 0] == 9


def test_mxfp8_quantize_error_and_zero_blocks():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 96, generator=gen) * torch.logspace(-3, 3, 96)
    x[1, 32:64] = 0
    q, exps = adapter.mxfp8_quantize(x)
    assert q.dtype == torch.float8_e4m3fn and exps.shape == (4, 3) and exps.dtype == torch.uint8
    back = mxfp8_dequantize(q, exps)
    assert torch.all(back[1, 32:64] == 0)
    blocks_amax = x.abs().view(4, 3, 32).amax(-1, keepdim=True)
    err = ((back - x).abs().view(4, 3, 32) / blocks_amax.clamp_min(1e-30)).amax()
    # 3 mantissa bits, and block maxima in [448, 512) * scale clamp to 448 * scale: at most 1/8
    assert err <= 2**-3
    assert err > 0  # it really quantised


@pytest.mark.parametrize("rounding", ["floor", "rceil"])
def test_mxfp8_quantize_is_the_recipes_quantizer(rounding):
    """The adapter encodes what ``fo.recipes.MXFP8`` quantizes: same FP8 data, same scales."""
    from fusible_ops.recipes import MXFP8
    from fusible_ops.recipes.quantize import quantize_rows
    from fusible_ops.recipes.recipes import ALONG_COLUMNS

    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5, 80, generator=gen) * torch.logspace(-4, 4, 80)
    x[2, :32] = 0
    x[3, 40] = 448.0 * 2.0**3 * 1.01  # a block maximum just past fmax * 2**e: the roundings differ
    q, exps = adapter.mxfp8_quantize(x, rounding)
    operand = quantize_rows(x, MXFP8(scale_rounding=rounding), "input", ALONG_COLUMNS, None)
    assert torch.equal(q.view(torch.uint8), operand.data.view(torch.uint8))
    torch.testing.assert_close(mxfp8_dequantize(q, exps), operand.dequantize(), rtol=0, atol=0)
    if rounding == "floor":
        assert torch.equal(adapter.mxfp8_quantize(x)[1], exps)  # the default


# ---------------------------------------------------------------- backend (blackwell, fake wrappers)


@pytest.mark.parametrize("splits", SPLITS)
@pytest.mark.parametrize("with_bias", [False, True])
def test_blackwell_fprop_dgrad_wgrad(fake, splits, with_bias):
    module, _ = fake
    backend = CudnnFrontendBackend()
    g, m, k, n = len(splits), sum(splits), 32, 64
    x = torch.randn(m, 2 * k)[:, ::2]  # non-contiguous input
    w = torch.randn(g, n, k)
    module.pointees[:] = [w]
    bias = torch.randn(g, n) if with_bias else None
    off = offsets_of(splits)
    y = backend.fprop(x, w, splits, off, bias=bias)
    torch.testing.assert_close(y.double(), grouped_fprop(x, w, splits, bias), **FP32_TOL)
    gy = torch.randn(m, n)
    dx = backend.dgrad(gy, w, None, off)  # device offsets only
    ref_dx = torch.cat([gs.double() @ w[i].double() for i, gs in enumerate(gy.split(splits))])
    torch.testing.assert_close(dx.double(), ref_dx, **FP32_TOL)
    dw = backend.wgrad(gy, x, splits, off)
    ref_dw = torch.stack([gs.double().t() @ xs.double() for gs, xs in zip(gy.split(splits), x.split(splits))])
    torch.testing.assert_close(dw.double(), ref_dw, **FP32_TOL)
    if m:
        assert [c[0] for c in module.calls] == ["gemm", "gemm", "wgrad"]
        assert module.calls[1][1]["b_major"] == "n" and module.calls[1][1]["n"] == k


def test_blackwell_fprop_writes_caller_buffer_in_place_when_aligned(fake):
    module, _ = fake
    splits, k, n = [256, 0, 512], 16, 64
    x, w = torch.randn(768, k), torch.randn(3, n, k)
    buf = torch.full((768, n), float("nan"))
    y = CudnnFrontendBackend().fprop(x, w, splits, offsets_of(splits), out=buf)
    assert y.data_ptr() == buf.data_ptr() and module.calls[0][1]["d_tensor"] is buf
    torch.testing.assert_close(buf.double(), grouped_fprop(x, w, splits), **FP32_TOL)


def test_blackwell_fprop_copies_once_into_buffer_when_padding_needed(fake):
    module, _ = fake
    splits, k, n = [3, 0, 300], 16, 64
    x, w = torch.randn(303, k), torch.randn(3, n, k)
    buf = torch.full((303, n), float("nan"))
    backend = CudnnFrontendBackend()
    y = backend.fprop(x, w, splits, offsets_of(splits), out=buf)
    assert y.data_ptr() == buf.data_ptr() and module.calls[0][1]["d_tensor"] is not buf
    assert module.calls[0][1]["d_tensor"].shape == (768, n)
    torch.testing.assert_close(buf.double(), grouped_fprop(x, w, splits), **FP32_TOL)
    notes = backend.plan_notes(torch.device("cpu"), splits, with_output_buffer=True)
    assert any("one gather copy" in s for s in notes)
    assert backend.plan_notes(torch.device("cpu"), [256, 512], with_output_buffer=True) == []


SPECS = [
    ActivationSpec("swiglu"),
    ActivationSpec("swiglu", glu_interleave_size=32),
    ActivationSpec("clamped_swiglu", limit=1.5, alpha=1.702, glu_linear_offset=1.0, glu_interleave_size=1),
]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.kind}-{s.glu_interleave_size}")
@pytest.mark.parametrize("splits", [[3, 0, 300, 1], [256, 0]])
def test_blackwell_fused_glu_forward_and_backward(fake, spec, splits):
    module, _ = fake
    backend = CudnnFrontendBackend()
    g, m, k, hidden, ffn = len(splits), sum(splits), 32, 48, 64
    x, w1, b1 = torch.randn(m, k), torch.randn(g, 2 * ffn, k) * 0.3, torch.randn(g, 2 * ffn) * 0.3
    w2 = torch.randn(g, hidden, ffn) * 0.3
    module.pointees[:] = [w2]
    probs = torch.rand(m)
    off = offsets_of(splits)
    assert backend.fused_activation_reason(spec, x.device) is None

    pre, act = backend.fc1_fprop_act(x, w1, b1, splits, off, spec, probs)
    ref_pre = grouped_fprop(x, w1, splits, b1)
    torch.testing.assert_close(pre.double(), ref_pre, **FP32_TOL)
    torch.testing.assert_close(
        act.double(), activation_of(spec, ref_pre) * probs.double()[:, None], **FP32_TOL
    )
    assert module.calls[0][0] == "glu"

    # backward reference: float64 autograd through the independent activation
    pre64 = ref_pre.clone().requires_grad_(True)
    probs64 = probs.double().requires_grad_(True)
    gy = torch.randn(m, hidden)
    y = grouped_fprop(activation_of(spec, pre64) * probs64[:, None], w2, splits)
    y.backward(gy.double())
    grad_pre, grad_probs, act2 = backend.fc2_dgrad_act(gy, w2, pre, splits, off, spec, probs)
    # the backward adds fc2's dgrad (hidden) and the probabilities' row sums (ffn) to fc1's k
    back_tol = dot_tolerance(torch.float32, k + hidden + ffn)
    torch.testing.assert_close(grad_pre.double(), pre64.grad, **back_tol)
    torch.testing.assert_close(grad_probs.double(), probs64.grad, **back_tol)
    torch.testing.assert_close(act2, act, **dot_tolerance(torch.float32, k))  # the same GEMM, recomputed
    assert module.calls[-1][0] == "dglu" and module.calls[-1][1]["act_func"][0] == "d"


def test_blackwell_unsupported_activation_runs_composed(fake):
    module, _ = fake
    backend = CudnnFrontendBackend()
    spec, splits = ActivationSpec("geglu"), [2, 3]
    assert "tanh-GELU" in backend.fused_activation_reason(spec, torch.device("cpu"))
    x, w = torch.randn(5, 8), torch.randn(2, 128, 8)
    pre, _ = backend.fc1_fprop_act(x, w, None, splits, offsets_of(splits), spec, None)
    assert [c[0] for c in module.calls] == ["gemm"]  # plain GEMM, activation in torch
    torch.testing.assert_close(pre.double(), grouped_fprop(x, w, splits), **FP32_TOL)


def test_blackwell_bf16_glu(fake):
    splits = [7, 0, 260]
    x, w1 = torch.randn(267, 64).bfloat16(), (torch.randn(3, 128, 64) * 0.2).bfloat16()
    spec = ActivationSpec("swiglu")
    pre, act = CudnnFrontendBackend().fc1_fprop_act(x, w1, None, splits, offsets_of(splits), spec, None)
    assert pre.dtype == act.dtype == torch.bfloat16
    ref_pre = grouped_fprop(x, w1, splits)
    # bf16 results of float32-accumulating GEMMs over k = 64 (weights 0.2): the result
    # rounds once, the activation of the rounded result once more (condition 2 in silu)
    pre_tol = rounding_rtol(torch.bfloat16, 1) + dot_tolerance(torch.float32, 64, 0.45)["atol"]
    torch.testing.assert_close(pre.double(), ref_pre, rtol=pre_tol, atol=pre_tol)
    act_tol = rounding_rtol(torch.bfloat16, 2, condition=2) + pre_tol
    torch.testing.assert_close(act.double(), activation_of(spec, ref_pre), rtol=act_tol, atol=act_tol)


def test_blackwell_mxfp8_recipe(fake):
    module, _ = fake
    splits, k, n = [5, 0, 270], 64, 128
    x, w = torch.randn(275, k), torch.randn(3, n, k)
    backend = CudnnFrontendBackend(recipe="mxfp8")
    buf = torch.empty(275, n)
    y = backend.fprop(x, w, splits, offsets_of(splits), out=buf)
    call = module.calls[0][1]
    assert module.calls[0][0] == "quant" and y.data_ptr() == buf.data_ptr()
    assert call["sfa_tensor"].dtype == torch.float8_e8m0fnu
    assert call["sfa_tensor"].shape == adapter.mx_packed_shape(768, k)
    assert call["sfb_tensor"].shape == adapter.mx_packed_shape(n, k, groups=3)
    ref = grouped_fprop(x, w, splits)
    assert ((y.double() - ref).norm() / ref.norm()) < 0.08  # MXFP8 operands: ~2^-4 per element
    pre, _ = backend.fc1_fprop_act(x, torch.cat([w, w], 1), None, splits, offsets_of(splits), SPECS[0], None)
    assert module.calls[-1][0] == "glu" and module.calls[-1][1]["sf_vec_size"] == 32
    with pytest.raises(ValueError, match="recipe"):
        CudnnFrontendBackend(recipe="fp4")


# ---------------------------------------------------------------- backend (hopper, fake graph)


def test_hopper_binds_caller_buffer_as_graph_output(fake, monkeypatch):
    module, set_cc = fake
    set_cc((9, 0))
    module.moe_grouped_matmul_mode = types.SimpleNamespace(NONE=0)
    module.pygraph = type("pygraph", (), {"moe_grouped_matmul": lambda self: None})
    module.create_handle = lambda: "handle"
    log: list = []
    from fusible_ops.kernels.cudnn import backend as cudnn_fe

    monkeypatch.setattr(cudnn_fe, "_build_hopper_graph", lambda *a: FakeGraph(log))
    backend = CudnnFrontendBackend()
    assert backend.status().path == "hopper" and not backend.fused_activation
    splits, k, n = [3, 0, 5], 8, 16
    x, w, bias = torch.randn(8, k), torch.randn(3, n, k), torch.randn(3, n)
    buf = torch.empty(8, n)
    y = backend.fprop(x, w, splits, offsets_of(splits), bias=bias, out=buf)
    assert y.data_ptr() == buf.data_ptr() and log[0][100].data_ptr() == buf.data_ptr()
    assert log[0][3].view(-1).tolist() == [0, 3, 3, 8]
    torch.testing.assert_close(y.double(), grouped_fprop(x, w, splits, bias), **FP32_TOL)
    gy = torch.randn(8, n)
    dx = backend.dgrad(gy, w, splits, offsets_of(splits))
    ref_dx = torch.cat([gs.double() @ w[i].double() for i, gs in enumerate(gy.split(splits))])
    torch.testing.assert_close(dx.double(), ref_dx, **FP32_TOL)
    dw = backend.wgrad(gy, x, None, offsets_of(splits))
    assert torch.all(dw[1] == 0)
    torch.testing.assert_close(dw[2].double(), gy[3:].double().t() @ x[3:].double(), **FP32_TOL)


# ---------------------------------------------------------------- probe


def test_probe_not_installed(monkeypatch):
    def missing():
        raise ModuleNotFoundError("No module named 'cudnn'")

    monkeypatch.setattr(probe_mod, "_import_cudnn", missing)
    probe_mod.clear_probe_cache()
    backend = CudnnFrontendBackend()
    reason = backend.probe(torch.device("cuda"), torch.bfloat16)
    assert "nvidia-cudnn-frontend not installed" in reason
    assert "not installed" in backend.package_status()
    with pytest.raises(RuntimeError, match="forced but cannot run: package nvidia-cudnn-frontend"):
        backend.require(torch.device("cuda"), torch.bfloat16)
    probe_mod.clear_probe_cache()


def test_probe_no_gpu(fake, monkeypatch):
    monkeypatch.setattr(probe_mod, "_cuda_available", lambda: False)
    probe_mod.clear_probe_cache()
    assert CudnnFrontendBackend().probe(torch.device("cuda"), torch.bfloat16) == "no CUDA device available"


@pytest.mark.parametrize("cc", [(8, 0), (7, 5)])
def test_probe_gpu_too_old(fake, cc):
    _, set_cc = fake
    set_cc(cc)
    reason = CudnnFrontendBackend().probe(torch.device("cuda"), torch.bfloat16)
    assert reason.startswith(f"compute capability {cc[0]}.{cc[1]} too old")


def test_probe_hopper_cudnn_too_old(fake):
    module, set_cc = fake
    set_cc((9, 0))
    module.backend_version = lambda: 91000
    assert "cuDNN version 91000 too old" in CudnnFrontendBackend().probe(torch.device("cuda"), torch.bfloat16)


def test_probe_detects_wrapper_signature(fake):
    module, set_cc = fake

    def old_quant(a_tensor, sfa_tensor, padded_offsets, alpha_tensor, b_tensor=None):
        return None

    old_quant.supports_canonical_layouts = True
    module.grouped_gemm_quant_wrapper_sm100 = old_quant
    set_cc((10, 0))
    reason = CudnnFrontendBackend().probe(torch.device("cuda"), torch.bfloat16)
    assert "grouped_gemm_quant_wrapper_sm100 lacks argument(s)" in reason and "d_tensor" in reason
    module.grouped_gemm_quant_wrapper_sm100 = module._grouped_gemm_quant_wrapper_sm100
    del module.grouped_gemm_dglu_wrapper_sm100
    set_cc((10, 0))
    assert "grouped_gemm_dglu_wrapper_sm100 missing" in CudnnFrontendBackend().probe(
        torch.device("cuda"), torch.bfloat16
    )


def test_probe_available_paths_and_dtype(fake):
    _, set_cc = fake
    backend = CudnnFrontendBackend()
    assert backend.probe(torch.device("cuda"), torch.bfloat16) is None
    assert "bfloat16" in backend.probe(torch.device("cuda"), torch.float16)
    assert "CUDA tensors only" in backend.probe(torch.device("cpu"), torch.bfloat16)
    assert backend.info().startswith("cudnn: blackwell path")
    set_cc((12, 0))
    assert "12.0 not supported" in backend.probe(torch.device("cuda"), torch.bfloat16)


def test_info_on_this_machine_reports_reason():
    probe_mod.clear_probe_cache()
    line = CudnnFrontendBackend().info()
    probe_mod.clear_probe_cache()
    if torch.cuda.is_available():
        pytest.skip("a GPU is present; the unavailable line is checked on CPU-only machines")
    assert line.startswith("cudnn: unavailable (") and len(line) > len("cudnn: unavailable ()")


# ---------------------------------------------------------------- the base class's checks


def test_bad_inputs_refused_by_the_shared_checks_before_any_wrapper_call(fake):
    module, _ = fake
    backend = CudnnFrontendBackend()
    splits, off = [3, 5], offsets_of([3, 5])
    x, w = torch.randn(8, 32), torch.randn(2, 64, 32)
    out = torch.full((8, 64), 7.0)
    with pytest.raises(ValueError, match=r"cudnn\.fprop: x has 16 features but weight expects 32"):
        backend.fprop(x[:, :16], w, splits, off, out=out)
    with pytest.raises(ValueError, match=r"cudnn\.fprop: out must have shape"):
        backend.fprop(x, w, splits, off, out=out[:7])
    with pytest.raises(ValueError, match=r"cudnn\.dgrad: split sizes sum to 9"):
        backend.dgrad(out, w, [4, 5], off)
    with pytest.raises(TypeError, match=r"cudnn\.wgrad: grad_out dtype"):
        backend.wgrad(out.double(), x, splits, off)
    with pytest.raises(ValueError, match=r"cudnn\.fc1_fprop_act: scales has 3 values.*\(8\)"):
        backend.fc1_fprop_act(x, w, None, splits, off, ActivationSpec("swiglu"), torch.ones(3))
    with pytest.raises(ValueError, match=r"cudnn\.fc2_dgrad_act: pre must be \[8, N_pre\]"):
        backend.fc2_dgrad_act(x, torch.randn(2, 32, 32), out[:4], splits, off, ActivationSpec("swiglu"), None)
    assert module.calls == [] and (out == 7.0).all()


def test_zero_tokens_answered_without_a_wrapper_call(fake):
    module, _ = fake
    backend, off = CudnnFrontendBackend(), offsets_of([0, 0])
    x, w = torch.randn(0, 32), torch.randn(2, 128, 32)
    pre, act = backend.fc1_fprop_act(x, w, None, None, off, ActivationSpec("swiglu"), torch.ones(0))
    assert pre.shape == (0, 128) and act.shape == (0, 64)
    dw = backend.wgrad(pre, x, None, off)
    assert dw.shape == (2, 128, 32) and (dw == 0).all() and module.calls == []
