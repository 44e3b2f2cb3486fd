"""Backend on ``torch._grouped_mm`` with device-resident int32 offsets (no host sync).

``torch._grouped_mm(a, b, offs=...)`` runs all groups in one call. Its rules (torch 2.13,
checked by the error messages it raises):

- dtypes bfloat16, float16 and float32 (float64 is rejected);
- the innermost stride of each operand is 1 and every other stride is a multiple of
  16 bytes, so ``in_features`` and ``out_features`` must be multiples of
  ``16 / element_size`` (8 for bf16); other layouts are made contiguous (one copy), and
  misaligned feature sizes raise: use the ``torch_loop`` backend for those;
- offsets are int32 (int64 offsets are converted on device);
- no ``bias`` argument (``"Bias not supported yet"``): bias is added in a second pass;
- no ``out=`` argument: the result is copied into a caller's ``out``
  (``writes_in_place = False``).

CPU support exists in torch 2.13 (a per-group loop inside ATen); whether a device and
dtype work is decided by one tiny trial call per ``(device, dtype)``, cached.
"""

from __future__ import annotations

import torch

from ..base import GroupedGemmBackend, group_ids_from_offsets

_SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_ALIGN_BYTES = 16


def _dense(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` ``[G, N, K]`` if it is row-major or column-major per group, else a contiguous copy."""
    if weight.is_contiguous() or weight.transpose(-2, -1).is_contiguous():
        return weight
    return weight.contiguous()


def _aligned_2d(t: torch.Tensor) -> torch.Tensor:
    """``t`` if ``_grouped_mm`` accepts its strides as a row-major 2-D operand, else a contiguous copy."""
    if t.numel() == 0:
        return t.new_empty(t.shape)  # an expanded empty gradient has strides (0, 0)
    if t.stride(-1) == 1 and (t.stride(0) * t.element_size()) % _ALIGN_BYTES == 0:
        return t
    return t.contiguous()


class TorchGroupedMMBackend(GroupedGemmBackend):
    """All groups in one ``torch._grouped_mm`` call; never syncs with the device."""

    name = "grouped_mm"
    description = (
        "torch._grouped_mm with device-resident int32 offsets; bf16/fp16/fp32, 16-byte aligned features"
    )
    fused_activation = False
    writes_in_place = False

    def __init__(self) -> None:
        self._probe_cache: dict[tuple[str, int | None, torch.dtype], str | None] = {}

    # ------------------------------------------------------------ availability
    def package_status(self) -> str | None:
        if not hasattr(torch, "_grouped_mm"):
            return f"torch {torch.__version__} has no torch._grouped_mm"
        return None

    def probe(self, device: torch.device, dtype: torch.dtype) -> str | None:
        missing = self.package_status()
        if missing is not None:
            return missing
        if dtype not in _SUPPORTED_DTYPES:
            return f"torch._grouped_mm does not accept {dtype} (only bfloat16, float16, float32)"
        device = torch.device(device)
        key = (device.type, device.index, dtype)
        if key not in self._probe_cache:
            self._probe_cache[key] = self._trial_call(device, dtype)
        return self._probe_cache[key]

    def auto_probe(self, device: torch.device, dtype: torch.dtype) -> str | None:
        """Automatic selection on CUDA only where ``_grouped_mm`` has a grouped kernel (SM90+).

        Below SM90 PyTorch runs it as a per-group loop that reads the offsets on the
        host; it stays available when forced with ``settings(backend="grouped_mm")``.
        """
        reason = self.probe(device, dtype)
        device = torch.device(device)
        if reason is None and device.type == "cuda":
            major, minor = torch.cuda.get_device_capability(device)
            if major < 9:
                return (
                    f"torch._grouped_mm has no grouped kernel on sm_{major}{minor} (a per-group loop with a "
                    "host sync); opt in with settings(backend='grouped_mm')"
                )
        return reason

    @staticmethod
    def _trial_call(device: torch.device, dtype: torch.dtype) -> str | None:
        """One 2-group 16x16x16 call: cheap, and raises on the host for unsupported devices/arches."""
        try:
            a = torch.zeros(16, 16, dtype=dtype, device=device)
            b = torch.zeros(2, 16, 16, dtype=dtype, device=device)
            offs = torch.tensor([8, 16], dtype=torch.int32, device=device)
            torch._grouped_mm(a, b.transpose(-2, -1), offs=offs)
        except (RuntimeError, NotImplementedError, TypeError) as exc:
            first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            return f"torch._grouped_mm fails on {device} for {dtype}: {first_line}"
        return None

    @staticmethod
    def shape_problem(in_features: int, out_features: int, dtype: torch.dtype) -> str | None:
        """``None`` when ``_grouped_mm`` accepts these feature sizes, else why not."""
        elems = _ALIGN_BYTES // dtype.itemsize
        for name, size in (("in_features", in_features), ("out_features", out_features)):
            if size % elems:
                return f"torch._grouped_mm needs {name} ({size}) to be a multiple of {elems} for {dtype}"
        return None

    # ------------------------------------------------------------ hooks (arguments checked)
    def _fprop(self, x, weight, split_sizes, offsets, bias, out) -> torch.Tensor:
        # weight[g].T as a [K, N] operand: column-major for an out_in weight, row-major
        # for the transposed view of an in_out one; no copy either way
        result = torch._grouped_mm(_aligned_2d(x), _dense(weight).transpose(-2, -1), offs=self._offs(offsets))
        if bias is not None:
            self._add_bias(result, bias, split_sizes, offsets)
        return self._deliver(result, out, split_sizes, offsets)

    def _dgrad(self, grad_out, weight, split_sizes, offsets, out) -> torch.Tensor:
        result = torch._grouped_mm(_aligned_2d(grad_out), _dense(weight), offs=self._offs(offsets))
        return self._deliver(result, out, split_sizes, offsets)

    def _wgrad(self, grad_out, x, split_sizes, offsets, out) -> torch.Tensor:
        # grad_out.T of a row-major [M, N] is the column-major [N, M] operand _grouped_mm wants.
        result = torch._grouped_mm(_aligned_2d(grad_out).t(), _aligned_2d(x), offs=self._offs(offsets))
        # empty groups must get zeros; some _grouped_mm builds leave them unwritten (pytorch#172439)
        offs = offsets.long()
        sizes = torch.diff(offs, prepend=offs.new_zeros(1))
        result.masked_fill_((sizes == 0).view(-1, 1, 1), 0)
        if out is None:
            return result
        return out.copy_(result)

    # ------------------------------------------------------------ helpers
    @staticmethod
    def _offs(offsets: torch.Tensor) -> torch.Tensor:
        return offsets if offsets.dtype == torch.int32 else offsets.to(torch.int32)

    @staticmethod
    def _add_bias(
        result: torch.Tensor, bias: torch.Tensor, split_sizes: list[int] | None, offsets: torch.Tensor
    ) -> None:
        if split_sizes is not None:
            start = 0
            for g, size in enumerate(split_sizes):
                if size:
                    result[start : start + size].add_(bias[g])
                start += size
            return
        rows = result.shape[0]
        group_ids = group_ids_from_offsets(offsets, rows)
        # Rows past offsets[-1] get group id G; clamp them to a valid row and mask them out.
        covered = (group_ids < bias.shape[0]).unsqueeze(-1)
        gathered = bias.index_select(0, group_ids.clamp(max=bias.shape[0] - 1))
        result.add_(gathered * covered)

    @staticmethod
    def _deliver(
        result: torch.Tensor, out: torch.Tensor | None, split_sizes: list[int] | None, offsets: torch.Tensor
    ) -> torch.Tensor:
        """Copy ``result`` into ``out`` without touching rows past the last group."""
        if out is None:
            return result
        rows = result.shape[0]
        if split_sizes is not None:
            covered = sum(int(s) for s in split_sizes)
            out[:covered].copy_(result[:covered])
            return out
        if rows == 0:
            return out
        # No host sync: keep out's own values in rows past offsets[-1].
        row_ids = torch.arange(rows, device=out.device, dtype=offsets.dtype)
        in_group = (row_ids < offsets[-1]).unsqueeze(-1)
        torch.where(in_group, result, out, out=out)
        return out
