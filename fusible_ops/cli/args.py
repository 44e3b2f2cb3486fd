"""The checks of the ``python -m fusible_ops`` flags.

The flags themselves are declared in ``fusible_ops/__main__.py``; the checks here run
before any heavy work and raise :class:`UsageError` for a value that cannot work.
"""

from __future__ import annotations

import argparse
import importlib
import os
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import torch

from .options import (  # noqa: F401  (UsageError and positive_int are imported from here too)
    BENCH_DTYPES,
    BENCH_RECIPES,
    DEFAULT_REPEATS,
    DEFAULT_WARMUP,
    SMALL_REPEATS,
    SMALL_WARMUP,
    UsageError,
    positive_int,
)

if TYPE_CHECKING:
    from .options import Shape


def one_line(text: object) -> str:
    """The first non-empty line of ``text`` (error messages of other layers can span several)."""
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    return lines[0] if lines else ""


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


# ---------------------------------------------------------------- bench
@dataclass(frozen=True)
class BenchConfig:
    """The checked arguments of one ``bench`` run."""

    shape: Shape
    dtype: torch.dtype
    device: torch.device
    backend: str
    repeats: int
    warmup: int
    compile_variants: bool
    progress: bool
    #: ``--recipe``: a name of :data:`BENCH_RECIPES`, or None (the usual variants)
    recipe: str | None = None


def check_device(text: str) -> torch.device:
    """``--device``: cpu, or a CUDA device that exists here."""
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise UsageError(f"--device {text!r} is not a device; use cpu, cuda or cuda:N") from None
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise UsageError(f"--device {text}: the bench runs on cpu or cuda, not {device.type}")
    if not torch.cuda.is_available():
        why = "torch was built without CUDA" if torch.version.cuda is None else "no CUDA device is visible"
        raise UsageError(f"--device {text}: CUDA is not available ({why}, torch {torch.__version__})")
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        raise UsageError(f"--device {text}: there are only {count} CUDA device(s) (cuda:0..cuda:{count - 1})")
    return device


def check_backend(name: str, device: torch.device, dtype: torch.dtype) -> None:
    """``--backend``: auto, or a registered backend that can run on ``device``/``dtype``."""
    from ..kernels import backend_names, probe_backend

    if name == "auto":
        return
    names = backend_names()
    if name not in names:
        raise UsageError(
            f"--backend {name!r} is not a backend; choose auto or one of {', '.join(names)} "
            "(python -m fusible_ops info)"
        )
    reason = probe_backend(name, device, dtype)
    if reason is not None:
        raise UsageError(
            f"--backend {name} is unavailable on {device} {_dtype_name(dtype)}: {one_line(reason)}"
        )


def _check_alignment(shape: Shape, dtype: torch.dtype) -> None:
    """The grouped_mm variant calls ``torch._grouped_mm``, which refuses unaligned strides."""
    elems = 16 // dtype.itemsize
    for name in ("hidden", "ffn"):
        value = getattr(shape, name)
        if value % elems:
            raise UsageError(
                f"--{name} {value} must be a multiple of {elems} for {_dtype_name(dtype)}: the grouped_mm "
                "variant's torch._grouped_mm needs 16-byte aligned feature sizes"
            )


def _check_plan(config: BenchConfig) -> None:
    """Build the problem's plan (``explain``: nothing computed) under the chosen backend.

    It runs the same validation and backend selection as the timed calls do, on a copy of the
    problem cut to 2 experts and 64 rows (the plan depends on the feature sizes, dtype and
    device, not on those), so a backend that refuses this problem is reported before the run.
    """
    import fusible_ops as fo

    from .bench import Shape, make_problem

    s = config.shape
    small = Shape(experts=min(s.experts, 2), hidden=s.hidden, ffn=s.ffn, rows=min(s.rows, 64))
    try:
        with fo.settings(backend=config.backend):
            p = make_problem(small, config.dtype, config.device)
            p.experts.explain(p.x.detach().requires_grad_(), p.splits_tensor, p.probs, p.splits_tensor)
    except (ValueError, TypeError, RuntimeError) as error:  # BackendUnavailableError is a RuntimeError
        raise UsageError(
            f"this problem cannot run with --backend {config.backend}: {one_line(error)}"
        ) from None
    if config.recipe is not None:
        from .bench import make_recipe

        try:
            with fo.settings(backend=config.backend), fo.quantized(make_recipe(config.recipe)):
                p.experts.explain(p.x.detach().requires_grad_(), p.splits_tensor, p.probs, p.splits_tensor)
        except (ValueError, TypeError, RuntimeError) as error:
            raise UsageError(
                f"this problem cannot run under --recipe {config.recipe}: {one_line(error)}"
            ) from None


def check_output_path(flag: str, path: str | None) -> None:
    """An output file's folder must exist (found now, not after a long run)."""
    if path is None:
        return
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise UsageError(f"{flag} {path}: folder {folder} does not exist")


#: the ``bench`` flags ``--hf`` does not read, and how to tell that one was given
HF_REFUSED_FLAGS = {
    "--small": lambda a: a.small,
    "--device": lambda a: a.device is not None,
    "--backend": lambda a: a.backend is not None,
    "--experts": lambda a: a.experts is not None,
    "--hidden": lambda a: a.hidden is not None,
    "--ffn": lambda a: a.ffn is not None,
    "--rows": lambda a: a.rows is not None,
    "--compile": lambda a: a.compile is not None,
    "--plot": lambda a: a.plot is not None,
    "--moe-ep": lambda a: a.moe_ep,
    "--recipe": lambda a: getattr(a, "recipe", None) is not None,
}

#: the ``bench`` flags ``--recipe`` does not read (it times two eager variants)
RECIPE_REFUSED_FLAGS = {
    "--compile": lambda a: a.compile is not None,
    "--moe-ep": lambda a: a.moe_ep,
}


def check_hf_bench_args(args: argparse.Namespace) -> None:
    """``bench --hf``: refuse the flags it does not read, before transformers is imported."""
    given = [flag for flag, is_given in HF_REFUSED_FLAGS.items() if is_given(args)]
    if given:
        raise UsageError(
            f"--hf does not take {', '.join(given)}: it times one fixed shape on the CPU and reads only "
            "--dtype, --repeats, --progress and --json"
        )
    if args.repeats is not None and args.repeats < 1:
        raise UsageError(f"--repeats must be a positive integer (>= 1), got {args.repeats}")
    check_output_path("--json", args.json)


def check_bench_args(args: argparse.Namespace) -> BenchConfig:
    """Every ``bench`` argument checked before any heavy work; a bad one raises :class:`UsageError`."""
    from .options import DEFAULT_SHAPE, SMALL_SHAPE, Shape

    recipe = getattr(args, "recipe", None)
    if recipe is not None:
        if recipe not in BENCH_RECIPES:  # argparse's choices refuse it; bench.main() may be called directly
            raise UsageError(f"--recipe {recipe!r}: choose one of {', '.join(BENCH_RECIPES)}")
        given = [flag for flag, is_given in RECIPE_REFUSED_FLAGS.items() if is_given(args)]
        if given:
            raise UsageError(
                f"--recipe does not take {', '.join(given)}: it times the fused block eagerly, "
                "unquantized and under the recipe"
            )
    shape = SMALL_SHAPE if args.small else DEFAULT_SHAPE
    overrides = {}
    for name in ("experts", "hidden", "ffn", "rows"):
        value = getattr(args, name)
        if value is not None:
            if value < 1:  # argparse's type already refuses these; bench.main() may be called directly
                raise UsageError(f"--{name} must be a positive integer (>= 1), got {value}")
            overrides[name] = value
    shape = Shape(**{**asdict(shape), **overrides})
    repeats = args.repeats if args.repeats is not None else (SMALL_REPEATS if args.small else DEFAULT_REPEATS)
    if repeats < 1:
        raise UsageError(f"--repeats must be a positive integer (>= 1), got {repeats}")
    dtype_name = args.dtype if args.dtype is not None else "bfloat16"
    if dtype_name not in BENCH_DTYPES:
        raise UsageError(f"--dtype {dtype_name!r}: choose one of {', '.join(BENCH_DTYPES)}")
    dtype = getattr(torch, dtype_name)
    device = check_device(args.device if args.device is not None else "cpu")
    backend = args.backend if args.backend is not None else "auto"
    check_backend(backend, device, dtype)
    if recipe is None:  # --recipe runs no grouped_mm variant
        _check_alignment(shape, dtype)
    check_output_path("--json", args.json)
    check_output_path("--plot", args.plot)
    if args.plot is not None:
        try:
            importlib.import_module("matplotlib")
        except ImportError:
            raise UsageError(
                "--plot needs matplotlib, which is not installed (pip install 'fusible-ops[plot]')"
            ) from None
    config = BenchConfig(
        shape=shape,
        dtype=dtype,
        device=device,
        backend=backend,
        repeats=repeats,
        warmup=SMALL_WARMUP if args.small else DEFAULT_WARMUP,
        compile_variants=(args.small if args.compile is None else args.compile) and recipe is None,
        progress=True if args.progress is None else args.progress,
        recipe=recipe,
    )
    _check_plan(config)
    return config
