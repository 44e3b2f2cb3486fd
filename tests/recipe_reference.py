"""An independent float64 reference of the low-precision recipes, for the tests.

Written from the formulas (docs/low-precision.md), not from the library's code: FP8
rounding by hand (round half to even on the exponent's quantum, subnormals, saturation),
tiles by explicit loops over groups, GEMMs in float64.
"""

from __future__ import annotations

import math

import torch

FORMATS = {"e4m3": (448.0, 3, -6), "e5m2": (57344.0, 2, -14)}
FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def round_fp8(values: torch.Tensor, fmt: str) -> torch.Tensor:
    """float64 -> the nearest FP8 value (ties to even), saturated at ±fmax; NaN stays NaN."""
    fmax, mbits, emin = FORMATS[fmt]
    v = values.double()
    mag = v.abs().clamp(max=fmax)
    _, exp = torch.frexp(torch.where(mag > 0, mag, torch.ones_like(mag)))
    exponent = (exp - 1).clamp(min=emin)  # floor(log2(mag)), subnormals share emin's quantum
    quantum = torch.pow(2.0, (exponent - mbits).double())
    rounded = torch.round(mag / quantum) * quantum  # torch.round: half to even
    rounded = rounded.clamp(max=fmax)
    return torch.where(torch.isnan(v), v, torch.copysign(rounded, v))


def fp32(value: float) -> float:
    return float(torch.tensor(value, dtype=torch.float64).float())


def mx_exponent(amax: float, rounding: str) -> int:
    if amax == 0:
        return -127
    if rounding == "rceil":
        e = math.ceil(math.log2(amax / 448.0))
        while amax > 448.0 * 2.0**e:
            e += 1
        while amax <= 448.0 * 2.0 ** (e - 1):
            e -= 1
    else:
        e = math.floor(math.log2(amax))
        while 2.0**e > amax:
            e -= 1
        while 2.0 ** (e + 1) <= amax:
            e += 1
        e -= 8
    return max(-127, min(127, e))


def _scales(amax: float, recipe, fmt: str) -> tuple[float, float]:
    """(multiplier, dequantization scale) of a tile with this amax (finite)."""
    if recipe.name == "mxfp8":
        e = mx_exponent(amax, recipe.scale_rounding)
        return 2.0**-e, 2.0**e
    fmax = FORMATS[fmt][0]
    scale = 1.0 if amax == 0 else fp32(fmax / amax)
    if math.isinf(scale):
        scale = FLOAT32_MAX
    if getattr(recipe, "pow2_scales", False):
        _, exponent = math.frexp(scale)
        scale = 2.0 ** (exponent - 1)
    return scale, fp32(1.0 / scale)


def quantize_block(block: torch.Tensor, recipe, fmt: str, per_column: bool = False) -> torch.Tensor:
    """Dequantized float64 values of one tile, or (``per_column``) of one tile per column."""
    b = block.float().double()
    if b.numel() == 0:
        return b
    columns = b.t() if per_column else b.reshape(1, -1)
    multipliers, scale_invs = [], []
    for column in columns:
        if not torch.isfinite(column).all():
            multipliers.append(float("nan"))
            scale_invs.append(float("nan"))
        else:
            m, s = _scales(float(column.abs().max()), recipe, fmt)
            multipliers.append(m)
            scale_invs.append(s)
    shape = (1, -1) if per_column else (1, 1)
    mult = torch.tensor(multipliers, dtype=torch.float64).view(shape)
    inv = torch.tensor(scale_invs, dtype=torch.float64).view(shape)
    scaled = b * mult if recipe.name == "mxfp8" else (b * mult).float().double()  # the fp32 product
    out = round_fp8(scaled, fmt) * inv
    return out if recipe.name == "mxfp8" else out.float().double()  # dequantized in fp32


def formats(recipe, kind: str) -> str:
    if recipe.name == "tensorwise" and recipe.fp8_format == "hybrid" and kind == "grad":
        return "e5m2"
    return "e4m3"


def tile(recipe, kind: str, along: str) -> tuple:
    """(rows, cols) of a tile for contraction along "columns" or "rows" (None: all)."""
    name = recipe.name
    if name == "tensorwise":
        return (None, None)
    if name == "blockwise" and kind == "weight":
        return (128, 128)
    length = {"mxfp8": 32, "rowwise": None, "blockwise": 128}[name]
    return (1, length) if along == "columns" else (length, 1)


def quantize(x: torch.Tensor, recipe, kind: str, along: str, groups: list[int]) -> torch.Tensor:
    """Dequantized float64 ``[R, C]``; row tiles restart at each group's first row."""
    rows, cols = x.shape
    tile_rows, tile_cols = tile(recipe, kind, along)
    fmt = formats(recipe, kind)
    out = torch.empty(rows, cols, dtype=torch.float64)
    start = 0
    for size in [*groups, rows - sum(groups)]:
        step_r = size if tile_rows is None else tile_rows
        step_c = cols if tile_cols is None else tile_cols
        for r0 in range(start, start + size, max(step_r, 1)):
            r1 = min(r0 + step_r, start + size)
            if step_c == 1:  # one tile per column of the row range
                out[r0:r1] = quantize_block(x[r0:r1], recipe, fmt, per_column=True)
                continue
            for c0 in range(0, cols, step_c):
                c1 = min(c0 + step_c, cols)
                out[r0:r1, c0:c1] = quantize_block(x[r0:r1, c0:c1], recipe, fmt)
        start += size
    return out


def quantize_weight(w: torch.Tensor, recipe, along: str) -> torch.Tensor:
    """``[G, N, K]`` -> dequantized float64, each expert's rows a group."""
    g, n, k = w.shape
    return quantize(w.reshape(g * n, k), recipe, "weight", along, [n] * g).view(g, n, k)


def rd(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Round float64 values to ``dtype`` and back (a result stored in the input dtype)."""
    return t.to(dtype).double()


def grouped_gemms(x, dy, w, bias, groups, recipe, dtype, wgrad_rows_x=None):
    """Reference GroupedLinear: ``(y, dx, dw, db)`` in float64 (rounded to dtype where the
    semantics store), ``w`` ``[G, N, K]``."""
    xq = quantize(x, recipe, "input", "columns", groups)
    wq = quantize_weight(w, recipe, "columns")
    dyq = quantize(dy, recipe, "grad", "columns", groups)
    wq_rows = quantize_weight(w, recipe, "rows")
    hp = recipe.wgrad_high_precision
    x_rows = x.double() if hp else quantize(x, recipe, "input", "rows", groups)
    dy_rows = dy.double() if hp else quantize(dy, recipe, "grad", "rows", groups)
    y = torch.zeros(x.shape[0], w.shape[1], dtype=torch.float64)
    dx = torch.zeros(x.shape[0], w.shape[2], dtype=torch.float64)
    dw = torch.zeros(w.shape, dtype=torch.float64)
    db = torch.zeros(w.shape[0], w.shape[1], dtype=torch.float64)
    start = 0
    for e, size in enumerate(groups):
        rows = slice(start, start + size)
        y[rows] = xq[rows] @ wq[e].t() + (0 if bias is None else bias[e].double())
        dx[rows] = dyq[rows] @ wq_rows[e]
        dw[e] = dy_rows[rows].t() @ x_rows[rows]
        db[e] = dy[rows].double().sum(0)
        start += size
    return rd(y, dtype), rd(dx, dtype), dw, db


def activation(kind: str, pre: torch.Tensor, limit: float = 7.0, alpha: float = 1.702) -> torch.Tensor:
    """float64 activations, gate-first halves for the gated ones."""
    if kind == "srelu":
        return torch.relu(pre) ** 2
    gate, lin = pre.chunk(2, dim=-1)
    if kind == "swiglu":
        return gate * torch.sigmoid(gate) * lin
    if kind == "geglu":
        inner = math.sqrt(2 / math.pi) * (gate + 0.044715 * gate**3)
        return 0.5 * gate * (1 + torch.tanh(inner)) * lin
    if kind == "clamped_swiglu":
        g = gate.clamp(max=limit)
        return g * torch.sigmoid(alpha * g) * (lin.clamp(-limit, limit) + 1)
    raise ValueError(kind)


def mlp(x, w1, b1, w2, b2, probs, dy, groups, recipe, kind, dtype, scale_after=False):
    """Reference fused block: ``(y, dx, dw1, db1, dw2, db2, dprobs)`` (float64)."""
    s = probs.double().unsqueeze(-1)
    xq = quantize(x, recipe, "input", "columns", groups)
    w1q, w2q = quantize_weight(w1, recipe, "columns"), quantize_weight(w2, recipe, "columns")
    w1r, w2r = quantize_weight(w1, recipe, "rows"), quantize_weight(w2, recipe, "rows")
    hp = recipe.wgrad_high_precision

    def per_group(fn, rows_out):
        start = 0
        for e, size in enumerate(groups):
            fn(e, slice(start, start + size))
            start += size

    pre = torch.zeros(x.shape[0], w1.shape[1], dtype=torch.float64)
    per_group(
        lambda e, r: pre.__setitem__(r, xq[r] @ w1q[e].t() + (0 if b1 is None else b1[e].double())), None
    )
    pre = rd(pre, dtype)
    pre_leaf = pre.clone().requires_grad_(True)
    act_exact = activation(kind, pre_leaf)
    act = rd(act_exact.detach(), dtype)
    fc2_in = act if scale_after else rd(act * s, dtype)
    aq = quantize(fc2_in.to(dtype), recipe, "input", "columns", groups)
    z = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float64)
    per_group(lambda e, r: z.__setitem__(r, aq[r] @ w2q[e].t() + (0 if b2 is None else b2[e].double())), None)
    z = rd(z, dtype)
    y = rd(z * s, dtype) if scale_after else z
    d_z = rd(dy.double() * s, dtype) if scale_after else dy.double()
    dzq = quantize(d_z.to(dtype), recipe, "grad", "columns", groups)
    g_in = torch.zeros(x.shape[0], w2.shape[2], dtype=torch.float64)
    per_group(lambda e, r: g_in.__setitem__(r, dzq[r] @ w2r[e]), None)
    g_in = rd(g_in, dtype)
    if scale_after:
        dprobs = (dy.double() * z).sum(-1)
        grad_act = g_in
    else:
        dprobs = (act * g_in).sum(-1)
        grad_act = rd(g_in * s, dtype)
    (grad_pre,) = torch.autograd.grad(act_exact, pre_leaf, grad_act)
    grad_pre = rd(grad_pre, dtype)
    gpq = quantize(grad_pre.to(dtype), recipe, "grad", "columns", groups)
    dx = torch.zeros(x.shape, dtype=torch.float64)
    per_group(lambda e, r: dx.__setitem__(r, gpq[r] @ w1r[e]), None)
    rows_q = (
        (lambda t, k: t.double()) if hp else (lambda t, k: quantize(t.to(dtype), recipe, k, "rows", groups))
    )
    gp_r, x_r, dz_r, in_r = (
        rows_q(grad_pre, "grad"),
        rows_q(x, "input"),
        rows_q(d_z, "grad"),
        rows_q(fc2_in, "input"),
    )
    dw1, dw2 = torch.zeros(w1.shape, dtype=torch.float64), torch.zeros(w2.shape, dtype=torch.float64)
    db1 = torch.zeros(w1.shape[:2], dtype=torch.float64)
    db2 = torch.zeros(w2.shape[:2], dtype=torch.float64)

    def grads(e, r):
        dw1[e] = gp_r[r].t() @ x_r[r]
        dw2[e] = dz_r[r].t() @ in_r[r]
        db1[e] = grad_pre[r].sum(0)
        db2[e] = d_z[r].sum(0)

    per_group(grads, None)
    return y, rd(dx, dtype), dw1, db1, dw2, db2, dprobs
