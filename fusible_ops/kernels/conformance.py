"""The conformance probe :func:`~fusible_ops.kernels.register_backend` runs on a user's backend.

Every public method runs on a tiny problem: three groups of 3, 0 and 5 rows (one group
empty), two rows past the last group, ``out`` buffers pre-filled with NaN, host split
sizes and device offsets only. It runs on every device present here (the CPU, and CUDA
when available) in every dtype the backend's ``probe`` accepts there. The fused
activation entry points are probed for each expert-block activation the backend runs
fused (the composed ones are the base class's). Results are compared with plain PyTorch
in float64, written here from the formulas (nothing of the library's math is reused).

Tolerances are rounding-error bounds: a GEMM result may differ from the reference by
``(L + 2) * eps`` times the sum of absolute products (``L`` the reduction length, ``eps``
the dtype's machine epsilon, TF32's for float32 on CUDA); pointwise activation math by
``8 * eps`` times a magnitude of its operands. A backend that raises, returns the wrong
structure, shape or dtype, leaves ``out`` unwritten, writes rows past the last group or
computes values outside the bounds fails with :class:`BackendConformanceError`.
"""

from __future__ import annotations

import math

import torch

from .activation import ActivationSpec
from .base import GroupedGemmBackend

Tensor = torch.Tensor

#: the dtypes probed, each on the devices where the backend's ``probe`` accepts it
PROBE_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
#: rows per group (the middle group is empty) and rows past the last group
SPLITS = (3, 0, 5)
TAIL_ROWS = 2
#: GEMM feature sizes (multiples of 16 bytes in every probed dtype); the fused entry points
#: run ``[M, K_IN] -> pre [M, 2 * FFN] (FFN when not gated) -> act [M, FFN]`` and FC2 ``[K_IN, FFN]``
K_IN, N_OUT, FFN = 16, 32, 16
#: allowance for pointwise math, in units of eps
POINTWISE = 8.0
#: the activations the fused expert block runs; the clamp limit is no float16/bfloat16 value
PROBE_SPECS = (
    ActivationSpec("swiglu"),
    ActivationSpec("geglu"),
    ActivationSpec("srelu"),
    ActivationSpec("clamped_swiglu", limit=1.3, glu_interleave_size=1),
)
_GELU_C = math.sqrt(2.0 / math.pi)


class BackendConformanceError(ValueError):
    """A backend computed something other than its contract on the conformance probe."""


def probe_targets(name: str, backend: GroupedGemmBackend) -> list[tuple[torch.device, torch.dtype]]:
    """The ``(device, dtype)`` pairs present here that the backend's ``probe`` accepts."""
    devices = [torch.device("cpu")]
    if torch.cuda.is_available():
        devices.append(torch.device("cuda"))
    targets = []
    for device in devices:
        for dtype in PROBE_DTYPES:
            try:
                reason = backend.probe(device, dtype)
            except Exception as error:
                raise BackendConformanceError(
                    f"backend {name!r} failed the conformance probe: probe({device.type}, {dtype}) raised "
                    f"{type(error).__name__}: {error}"
                ) from error
            if reason is None:
                targets.append((device, dtype))
    return targets


def run_conformance_probe(name: str, backend: GroupedGemmBackend) -> list[tuple[torch.device, torch.dtype]]:
    """Probe ``backend`` (registered as ``name``); returns the ``(device, dtype)`` pairs probed.

    An empty list means none could run here (e.g. a CUDA-only backend on a machine
    without a GPU). Raises :class:`BackendConformanceError` naming the backend, the
    method and what was wrong.
    """
    targets = probe_targets(name, backend)
    probed = []
    for device, dtype in targets:
        sizes = ((K_IN, N_OUT), (K_IN, 2 * FFN), (FFN, K_IN))
        if any(backend.shape_problem(k, n, dtype) is not None for k, n in sizes):
            continue
        # plain eager math whatever the caller's modes (the references use autograd)
        with torch.inference_mode(False), torch.enable_grad(), torch.autocast(device.type, enabled=False):
            _Probe(name, backend, device, dtype).run()
        probed.append((device, dtype))
    if targets and not probed:
        raise BackendConformanceError(
            f"backend {name!r} cannot be probed: its shape_problem refuses the probe's feature sizes "
            f"{(K_IN, N_OUT, FFN)} in every dtype it accepts; register it with probe=False and test it "
            "yourself (tests/test_backend_conformance.py runs every registered backend)"
        )
    return probed


# ---------------------------------------------------------------- float64 references


def _grouped(lhs: Tensor, weight: Tensor, sizes: tuple[int, ...]) -> Tensor:
    """``lhs[rows_g] @ weight[g].T`` over the rows the groups own: ``[sum(sizes), weight.shape[1]]``."""
    parts, start = [], 0
    for group, rows in enumerate(sizes):
        parts.append(lhs[start : start + rows] @ weight[group].T)
        start += rows
    return torch.cat(parts)


def _per_group_rows(fn, sizes: tuple[int, ...], *tensors: Tensor) -> Tensor:
    """``fn(*each tensor's rows of group g)`` stacked over the groups."""
    parts, start = [], 0
    for rows in sizes:
        parts.append(fn(*(t[start : start + rows] for t in tensors)))
        start += rows
    return torch.stack(parts)


def _gate_linear_columns(width: int, interleave: int | None) -> tuple[Tensor, Tensor]:
    cols = torch.arange(width)
    is_gate = cols < width // 2 if interleave is None else (cols // interleave) % 2 == 0
    return cols[is_gate], cols[~is_gate]


def _activation(spec: ActivationSpec, pre: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(act, act magnitude, derivative magnitude)`` of float64 ``pre``: the unscaled activation,
    a bound on the magnitudes its rounding errors scale with (``act``'s shape), and a bound on
    ``|d act / d pre|`` (``pre``'s shape)."""
    if not spec.gated:  # srelu, the expert block's one unary kind
        act = torch.where(pre > 0, pre * pre, torch.zeros_like(pre))
        return act, 3.0 * pre * pre, 2.4 * pre.abs()
    gate_cols, linear_cols = _gate_linear_columns(pre.shape[-1], spec.glu_interleave_size)
    gate, linear = pre[:, gate_cols], pre[:, linear_cols]
    if spec.kind == "clamped_swiglu":
        g = torch.where(gate > spec.limit, torch.full_like(gate, spec.limit), gate)
        lin = linear.clamp(-spec.limit, spec.limit) + spec.glu_linear_offset
        phi, slope = g * torch.sigmoid(spec.alpha * g), spec.alpha
    elif spec.kind == "geglu":
        lin, slope = linear, 1.0
        phi = 0.5 * gate * (1.0 + torch.tanh(_GELU_C * (gate + 0.044715 * gate**3)))
    else:  # swiglu
        lin, slope = linear, 1.0
        phi = gate / (1.0 + torch.exp(-gate))
    g_abs = gate.abs()
    magnitude = (2.0 + slope * g_abs) * g_abs * lin.abs() + g_abs * linear.abs()
    derivative = torch.empty_like(pre)
    derivative[:, gate_cols] = 1.2 * (1.0 + slope * g_abs) * lin.abs()
    derivative[:, linear_cols] = 1.2 * g_abs
    return phi * lin, magnitude, derivative


def _to_pre_columns(spec: ActivationSpec, values: Tensor, width: int) -> Tensor:
    """``values`` ``[M, F]`` (one per activation column) on the ``width`` columns of ``pre``."""
    if not spec.gated:
        return values
    gate_cols, linear_cols = _gate_linear_columns(width, spec.glu_interleave_size)
    out = values.new_empty(values.shape[0], width)
    out[:, gate_cols] = values
    out[:, linear_cols] = values
    return out


# ---------------------------------------------------------------- the probe


class _Probe:
    """One backend on one device and dtype."""

    def __init__(
        self, name: str, backend: GroupedGemmBackend, device: torch.device, dtype: torch.dtype
    ) -> None:
        self.name, self.backend, self.device, self.dtype = name, backend, device, dtype
        tf32 = device.type == "cuda" and dtype == torch.float32  # GPU GEMMs may round inputs to TF32
        self.eps = 2.0**-10 if tf32 else torch.finfo(dtype).eps
        self.tiny = torch.finfo(dtype).tiny
        self.scales_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        self.generator = torch.Generator().manual_seed(0)

    # ------------------------------------------------------------ helpers
    def rand(self, *shape: int, low: float | None = None, high: float | None = None) -> Tensor:
        """Host float64 values exactly representable in the probed dtype."""
        if low is None:
            values = torch.randn(*shape, generator=self.generator, dtype=torch.float64)
        else:
            values = low + (high - low) * torch.rand(*shape, generator=self.generator, dtype=torch.float64)
        return values.to(self.dtype).double()

    def dev(self, host: Tensor | None, dtype: torch.dtype | None = None) -> Tensor | None:
        return None if host is None else host.to(self.device, dtype or self.dtype)

    def fail(self, method: str, case: str, problem: str) -> BackendConformanceError:
        return BackendConformanceError(
            f"backend {self.name!r} failed the conformance probe: {method} on {self.device.type} "
            f"{self.dtype} ({case}) {problem}"
        )

    def call(self, method: str, case: str, *args, **kwargs):
        try:
            return getattr(self.backend, method)(*args, **kwargs)
        except Exception as error:
            raise self.fail(method, case, f"raised {type(error).__name__}: {error}") from error

    def expect(
        self,
        method: str,
        case: str,
        what: str,
        actual: object,
        expected: Tensor,
        bound: Tensor,
        dtype: torch.dtype | None = None,
        *,
        from_nan: bool = False,
    ) -> None:
        """``actual`` has ``expected``'s shape, ``dtype`` and values within ``bound`` (NaN fails)."""
        if not isinstance(actual, Tensor):
            raise self.fail(method, case, f"returned {type(actual).__name__} as {what}; expected a tensor")
        if tuple(actual.shape) != tuple(expected.shape):
            raise self.fail(
                method,
                case,
                f"returned {what} of shape {list(actual.shape)}; expected {list(expected.shape)}",
            )
        dtype = dtype or self.dtype
        if actual.dtype != dtype:
            raise self.fail(method, case, f"returned {what} of dtype {actual.dtype}; expected {dtype}")
        got = actual.detach().to("cpu", torch.float64)
        bad = ~((got - expected).abs() <= bound + self.tiny)
        if not bool(bad.any()):
            return
        first = tuple(int(i) for i in bad.nonzero()[0])
        value, want = got[first].item(), expected[first].item()
        count = f"{int(bad.sum())} of {bad.numel()} elements"
        if from_nan and math.isnan(value):
            problem = (
                f"did not write {what}: {count} still hold the NaN it was filled with "
                f"(first at {list(first)}, expected {want:.6g})"
            )
        else:
            problem = (
                f"computed wrong values in {what}: {count} outside the rounding bound (first at "
                f"{list(first)}: got {value:.6g}, expected {want:.6g}, bound {bound[first].item():.3g})"
            )
        raise self.fail(method, case, problem)

    def expect_out(self, method: str, case: str, result: object, out: Tensor) -> None:
        if result is not out and not (
            isinstance(result, Tensor)
            and result.data_ptr() == out.data_ptr()
            and result.shape == out.shape
            and result.stride() == out.stride()
        ):
            raise self.fail(
                method,
                case,
                "did not return the out tensor it was given (it must write into out and return it)",
            )

    def expect_tail_untouched(self, method: str, case: str, buffer: Tensor, covered: int) -> None:
        if not bool(torch.isnan(buffer[covered:]).all()):
            raise self.fail(
                method, case, f"wrote rows {covered}.. of out, past the last group; they must stay untouched"
            )

    def gemm_bound(self, reduction: int, magnitude: Tensor) -> Tensor:
        return (reduction + 2) * self.eps * magnitude

    # ------------------------------------------------------------ grouped GEMMs
    def run(self) -> None:
        self.gemms()
        base = GroupedGemmBackend
        cls = type(self.backend)
        fc1_own, fc2_own = (
            cls._fc1_fprop_act is not base._fc1_fprop_act,
            cls._fc2_dgrad_act is not base._fc2_dgrad_act,
        )
        if fc1_own or fc2_own:
            for spec in PROBE_SPECS:
                if self.backend._fuses(spec, torch.empty(1, 1, device=self.device, dtype=self.dtype)):
                    for scaled in (True, False):
                        if fc1_own:
                            self.fc1(spec, scaled)
                        if fc2_own:
                            self.fc2(spec, scaled)

    def gemms(self) -> None:
        sizes, groups = SPLITS, len(SPLITS)
        covered = sum(sizes)
        rows = covered + TAIL_ROWS
        x, grad_out = self.rand(rows, K_IN), self.rand(rows, N_OUT)
        weight, bias = self.rand(groups, N_OUT, K_IN), self.rand(groups, N_OUT)
        offsets = torch.tensor(sizes).cumsum(0).to(self.device, torch.int32)
        x_d, w_d, b_d, gy_d = self.dev(x), self.dev(weight), self.dev(bias), self.dev(grad_out)
        bias_rows = bias.repeat_interleave(torch.tensor(sizes), dim=0)
        y_ref = _grouped(x, weight, sizes) + bias_rows
        y_bound = self.gemm_bound(K_IN, _grouped(x.abs(), weight.abs(), sizes) + bias_rows.abs())
        dx_ref = _grouped(grad_out, weight.transpose(1, 2), sizes)
        dx_bound = self.gemm_bound(N_OUT, _grouped(grad_out.abs(), weight.abs().transpose(1, 2), sizes))
        dw_ref = _per_group_rows(lambda g, a: g.T @ a, sizes, grad_out, x)
        dw_bound = self.gemm_bound(
            max(sizes), _per_group_rows(lambda g, a: g.T @ a, sizes, grad_out.abs(), x.abs())
        )
        db_ref = _per_group_rows(lambda g: g.sum(0), sizes, grad_out)
        db_bound = self.gemm_bound(max(sizes), _per_group_rows(lambda g: g.sum(0), sizes, grad_out.abs()))

        for method, lhs, features, ref, bound, extra in (
            ("fprop", x_d, N_OUT, y_ref, y_bound, {"bias": b_d}),
            ("dgrad", gy_d, K_IN, dx_ref, dx_bound, {}),
        ):
            case = "host split sizes, out given"
            buffer = torch.full((rows, features), math.nan, device=self.device, dtype=self.dtype)
            result = self.call(method, case, lhs, w_d, list(sizes), offsets, out=buffer, **extra)
            self.expect_out(method, case, result, buffer)
            self.expect(method, case, "out", buffer[:covered], ref, bound, from_nan=True)
            self.expect_tail_untouched(method, case, buffer, covered)
            case = "device offsets only, no out"
            result = self.call(method, case, lhs, w_d, None, offsets, **extra)
            if isinstance(result, Tensor) and result.shape[0] == rows:
                result = result[:covered]  # rows past the last group are unspecified in a fresh output
            self.expect(method, case, "its result", result, ref, bound)

        case = "host split sizes, out given (the empty group must come out as zeros)"
        buffer = torch.full((groups, N_OUT, K_IN), math.nan, device=self.device, dtype=self.dtype)
        result = self.call("wgrad", case, gy_d, x_d, list(sizes), offsets, out=buffer)
        self.expect_out("wgrad", case, result, buffer)
        self.expect("wgrad", case, "out", buffer, dw_ref, dw_bound, from_nan=True)
        case = "device offsets only, no out"
        result = self.call("wgrad", case, gy_d, x_d, None, offsets)
        self.expect("wgrad", case, "its result", result, dw_ref, dw_bound)
        for split_sizes, case in ((list(sizes), "host split sizes"), (None, "device offsets only")):
            result = self.call("bias_grad", case, gy_d, split_sizes, offsets, groups)
            self.expect("bias_grad", case, "its result", result, db_ref, db_bound)

    # ------------------------------------------------------------ fused activation entry points
    def fused_inputs(self, spec: ActivationSpec, scaled: bool):
        width = 2 * FFN if spec.gated else FFN
        rows = sum(SPLITS)
        scales = self.rand(rows, low=0.25, high=2.0).to(self.scales_dtype) if scaled else None
        offsets = torch.tensor(SPLITS).cumsum(0).to(self.device, torch.int32)
        split_sizes = list(SPLITS) if scaled else None
        case = f"{spec.kind}{'' if spec.glu_interleave_size is None else ' interleaved'}, " + (
            "scaled, host split sizes" if scaled else "unscaled, device offsets only"
        )
        return width, rows, scales, offsets, split_sizes, case

    def fc1(self, spec: ActivationSpec, scaled: bool) -> None:
        method = "fc1_fprop_act"
        width, rows, scales, offsets, split_sizes, case = self.fused_inputs(spec, scaled)
        x, weight = self.rand(rows, K_IN), self.rand(len(SPLITS), width, K_IN)
        bias = self.rand(len(SPLITS), width) if scaled else None
        result = self.call(
            method, case, self.dev(x), self.dev(weight), self.dev(bias), split_sizes, offsets, spec,
            self.dev(scales, self.scales_dtype),
        )  # fmt: skip
        if not isinstance(result, (tuple, list)) or len(result) != 2:
            raise self.fail(method, case, f"returned {type(result).__name__}; expected (pre, act)")
        pre, act = result
        magnitude = _grouped(x.abs(), weight.abs(), SPLITS)
        pre_ref = _grouped(x, weight, SPLITS)
        if bias is not None:
            bias_rows = bias.repeat_interleave(torch.tensor(SPLITS), dim=0)
            pre_ref, magnitude = pre_ref + bias_rows, magnitude + bias_rows.abs()
        self.expect(method, case, "pre", pre, pre_ref, self.gemm_bound(K_IN, magnitude))
        # the activation is judged from the backend's own pre (its rounding is not amplified)
        act_ref, act_magnitude, _ = _activation(spec, pre.detach().to("cpu", torch.float64))
        row_scales = torch.ones(rows, 1, dtype=torch.float64) if scales is None else scales.double()[:, None]
        bound = POINTWISE * self.eps * act_magnitude * row_scales
        self.expect(method, case, "act", act, act_ref * row_scales, bound)

    def fc2(self, spec: ActivationSpec, scaled: bool) -> None:
        method = "fc2_dgrad_act"
        width, rows, scales, offsets, split_sizes, case = self.fused_inputs(spec, scaled)
        grad_y, weight, pre = self.rand(rows, K_IN), self.rand(len(SPLITS), K_IN, FFN), self.rand(rows, width)
        result = self.call(
            method, case, self.dev(grad_y), self.dev(weight), self.dev(pre), split_sizes, offsets, spec,
            self.dev(scales, self.scales_dtype),
        )  # fmt: skip
        if not isinstance(result, (tuple, list)) or len(result) != 3:
            raise self.fail(
                method, case, f"returned {type(result).__name__}; expected (grad_pre, grad_scales, act)"
            )
        grad_pre, grad_scales, act = result
        grad_act = _grouped(grad_y, weight.transpose(1, 2), SPLITS)
        gemm_error = self.gemm_bound(K_IN, _grouped(grad_y.abs(), weight.abs().transpose(1, 2), SPLITS))
        pre_leaf = pre.clone().requires_grad_(True)
        act_ref, act_magnitude, derivative = _activation(spec, pre_leaf)
        row_scales = torch.ones(rows, 1, dtype=torch.float64) if scales is None else scales.double()[:, None]
        (grad_pre_ref,) = torch.autograd.grad(act_ref, pre_leaf, grad_act * row_scales)
        act_ref, act_magnitude = act_ref.detach(), act_magnitude.detach()
        self.expect(
            method, case, "act", act, act_ref * row_scales, POINTWISE * self.eps * act_magnitude * row_scales
        )
        grad_act_error = gemm_error + POINTWISE * self.eps * grad_act.abs()
        bound = derivative.detach() * _to_pre_columns(spec, grad_act_error * row_scales, width)
        self.expect(method, case, "grad_pre", grad_pre, grad_pre_ref, bound)
        if scales is None:
            if grad_scales is not None:
                raise self.fail(method, case, "returned grad_scales for a call without scales; expected None")
            return
        act_abs = act_ref.abs() + POINTWISE * self.eps * act_magnitude
        scales_bound = (act_abs * grad_act_error + (FFN + 2) * self.eps * act_ref.abs() * grad_act.abs()).sum(
            -1
        )
        scales_ref = (act_ref * grad_act).sum(-1)
        self.expect(method, case, "grad_scales", grad_scales, scales_ref, scales_bound, self.scales_dtype)
