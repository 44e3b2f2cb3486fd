"""Cheap, cached probe for the cuDNN frontend backend (``nvidia-cudnn-frontend``, module ``cudnn``).

Nothing here imports ``cudnn`` at package import: :func:`probe_cudnn_frontend` imports it
on first call and caches the answer per device. Wrappers are feature-detected by
signature (``inspect.signature``) and by the layout flags the frontend sets on them,
never by version string. The answer names the first missing piece, in the order
package -> CUDA -> compute capability -> cuDNN version / wrapper functions.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

#: cuDNN library version (``cudnn.backend_version()``) that added the graph-API MoE grouped matmul.
HOPPER_MIN_CUDNN_VERSION = 91800

#: Blackwell wrappers this backend calls, with the keyword arguments it passes
#: and the layout flag it relies on (2-D A, ``(G, N, K)`` B, 1-D prob).
BLACKWELL_WRAPPERS: dict[str, tuple[tuple[str, ...], str]] = {
    "grouped_gemm_glu_wrapper_sm100": (
        (
            "a_tensor",
            "sfa_tensor",
            "padded_offsets",
            "alpha_tensor",
            "b_tensor",
            "sfb_tensor",
            "bias_tensor",
            "prob_tensor",
            "c_dtype",
            "d_dtype",
            "sf_vec_size",
            "act_func",
            "linear_offset",
            "geglu_alpha",
            "glu_clamp_max",
            "glu_clamp_min",
            "generate_c",
        ),
        "supports_bf16_canonical_layouts",
    ),
    "grouped_gemm_wrapper_sm100": (
        ("a_tensor", "padded_offsets", "alpha_tensor", "b_tensor", "bias_tensor", "b_ptrs", "n", "b_dtype")
        + ("b_major", "d_dtype", "d_tensor", "prob_tensor"),
        "supports_bf16_canonical_layouts",
    ),
    "grouped_gemm_quant_wrapper_sm100": (
        ("a_tensor", "sfa_tensor", "padded_offsets", "alpha_tensor", "b_tensor", "sfb_tensor", "bias_tensor")
        + ("norm_const_tensor", "d_dtype", "d_tensor", "sf_vec_size"),
        "supports_canonical_layouts",
    ),
    "grouped_gemm_dglu_wrapper_sm100": (
        ("a_tensor", "c_tensor", "sfa_tensor", "padded_offsets", "alpha_tensor", "beta_tensor", "prob_tensor")
        + ("dprob_tensor", "b_ptrs", "n", "b_dtype", "b_major", "d_dtype", "act_func", "linear_offset")
        + ("geglu_alpha", "glu_clamp_max", "glu_clamp_min"),
        "supports_bf16_canonical_layouts",
    ),
    "grouped_gemm_wgrad_wrapper_sm100": (
        ("a_tensor", "b_tensor", "sfa_tensor", "sfb_tensor", "offsets_tensor", "wgrad_tensor", "wgrad_dtype"),
        "supports_bf16_canonical_layouts",
    ),
}


@dataclass(frozen=True)
class CudnnFrontendStatus:
    """What the probe found. ``reason`` is None when ``path`` can run."""

    path: str | None  # "blackwell", "hopper" or None
    reason: str | None
    frontend_version: str | None = None
    cudnn_version: int | None = None
    compute_capability: tuple[int, int] | None = None

    @property
    def available(self) -> bool:
        return self.reason is None

    def summary(self) -> str:
        """One line for ``info`` and the fusion plan."""
        if self.reason is not None:
            return f"cudnn: unavailable ({self.reason})"
        cc = self.compute_capability
        return (
            f"cudnn: {self.path} path (frontend {self.frontend_version}, cuDNN {self.cudnn_version}, "
            f"SM{cc[0]}{cc[1]})"
        )


# ---------------------------------------------------------------- seams (patched in tests)


def _import_cudnn() -> Any:
    return importlib.import_module("cudnn")


def _cuda_available() -> bool:
    return torch.cuda.is_available()


def _compute_capability(device_index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


# ---------------------------------------------------------------- helpers


def missing_arguments(fn: Callable[..., Any], required: tuple[str, ...]) -> list[str]:
    """Names in ``required`` that ``fn`` does not accept as keywords (``**kwargs`` accepts all)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return []  # builtins without a signature: cannot tell, the call itself will say
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return []
    accepted = {n for n, p in params.items() if p.kind is not inspect.Parameter.POSITIONAL_ONLY}
    return [name for name in required if name not in accepted]


def _wrapper_problem(module: Any, name: str, required: tuple[str, ...], layout_flag: str) -> str | None:
    try:
        fn = getattr(module, name)
    except (AttributeError, ImportError) as exc:  # the frontend imports wrappers lazily
        return f"wrapper cudnn.{name} missing ({type(exc).__name__}: {exc})"
    missing = missing_arguments(fn, required)
    if missing:
        return f"wrapper cudnn.{name} lacks argument(s) {', '.join(missing)}"
    if not getattr(fn, layout_flag, False):
        return f"wrapper cudnn.{name} lacks the canonical-layout support flag {layout_flag!r}"
    return None


def _hopper_problem(module: Any, cudnn_version: int | None) -> str | None:
    if cudnn_version is None:
        return "cudnn.backend_version() unavailable"
    if cudnn_version < HOPPER_MIN_CUDNN_VERSION:
        return (
            f"cuDNN version {cudnn_version} too old: the graph-API MoE grouped matmul needs >= "
            f"{HOPPER_MIN_CUDNN_VERSION}"
        )
    if not hasattr(module, "moe_grouped_matmul_mode"):
        return "cudnn.moe_grouped_matmul_mode missing (cuDNN build without MoE grouped matmul)"
    graph_cls = getattr(module, "pygraph", None)
    if graph_cls is None or not hasattr(graph_cls, "moe_grouped_matmul"):
        return "cudnn.pygraph.moe_grouped_matmul missing"
    return None


# ---------------------------------------------------------------- the probe


@functools.cache
def probe_cudnn_frontend(device_index: int = 0) -> CudnnFrontendStatus:
    """Probe once per device index; see the module docstring for the order of checks."""
    try:
        module = _import_cudnn()
    except Exception as exc:  # ImportError, or a broken install raising anything else
        return CudnnFrontendStatus(
            None,
            f"package nvidia-cudnn-frontend not installed (import cudnn failed: {type(exc).__name__}: "
            f"{exc}); install the 'cudnn' extra",
        )
    version = getattr(module, "__version__", None)
    try:
        cudnn_version = int(module.backend_version())
    except Exception:
        cudnn_version = None
    if not _cuda_available():
        return CudnnFrontendStatus(None, "no CUDA device available", version, cudnn_version)
    cc = tuple(_compute_capability(device_index))
    if cc[0] == 10:
        for name, (required, flag) in BLACKWELL_WRAPPERS.items():
            problem = _wrapper_problem(module, name, required, flag)
            if problem is not None:
                return CudnnFrontendStatus(None, problem, version, cudnn_version, cc)
        return CudnnFrontendStatus("blackwell", None, version, cudnn_version, cc)
    if cc == (9, 0):
        problem = _hopper_problem(module, cudnn_version)
        return CudnnFrontendStatus("hopper" if problem is None else None, problem, version, cudnn_version, cc)
    verdict = "too old" if cc < (9, 0) else "not supported"
    return CudnnFrontendStatus(
        None,
        f"compute capability {cc[0]}.{cc[1]} {verdict}: the fused grouped-MLP kernels need SM100/SM103 "
        f"(Blackwell) and the graph-API grouped matmul needs SM90 (Hopper) with cuDNN >= "
        f"{HOPPER_MIN_CUDNN_VERSION}",
        version,
        cudnn_version,
        cc,
    )


def clear_probe_cache() -> None:
    """Forget cached probe results (tests; after installing the package)."""
    probe_cudnn_frontend.cache_clear()
