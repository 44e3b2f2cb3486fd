"""``python -m fusible_ops bench``: the MoE expert block, fused vs its peers, in one process.

Variants, timed interleaved (one iteration of each per round) so that machine drift
hits all of them alike; medians are reported:

- ``fused``: ``fo.Sequential(GroupedLinear, ScaledSwiGLU, GroupedLinear)``, fusion on;
- ``unfused``: the same Sequential under ``fo.settings(fusion=False)``;
- ``grouped_mm``: a torchtitan-style composition (int32 offsets from the split-size
  tensor by ``torch.cumsum``, ``torch._grouped_mm``, ``silu(gate) * up * probs``,
  ``torch._grouped_mm``) differentiated by autograd; like the fused variant it gets the
  split sizes, not precomputed offsets (as torchtitan's ``_run_experts_grouped_mm``);
- ``loop``: a per-expert eager loop of ``F.linear``;
- ``dense``: the bound, the same GEMMs as plain ``torch.mm`` on contiguous operands
  (2 in forward, 6 in forward+backward), nothing else;
- ``fused_compiled`` / ``grouped_mm_compiled`` (``--compile``, on by default with
  ``--small``): ``fused`` and ``grouped_mm`` under ``torch.compile(fullgraph=True)``
  with the inductor backend, compiled before timing.

``--recipe NAME`` (:func:`run_recipe_bench`) times instead ``fused`` unquantized and
``fused_NAME`` under that low-precision recipe, side by side, with their saved bytes.
"""

from __future__ import annotations

import random
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F

import fusible_ops as fo

from .bench_report import format_table, plot, write_json  # noqa: F401  (bench's API)
from .options import BENCH_RECIPES, DEFAULT_SHAPE, SMALL_SHAPE, Shape  # noqa: F401  (imported from here too)


def uneven_splits(rows: int, experts: int, *, seed: int = 0) -> list[int]:
    """Uneven split sizes summing to ``rows`` with expert 1 (when there are 2+) empty."""
    gen = torch.Generator().manual_seed(seed)
    weights = torch.rand(experts, generator=gen) + 0.25
    if experts > 1:
        weights[1] = 0.0
    sizes = (weights / weights.sum() * rows).floor().long()
    sizes[0] += rows - int(sizes.sum())
    return [int(s) for s in sizes]


@dataclass
class Problem:
    """Weights and inputs shared by every variant."""

    shape: Shape
    dtype: torch.dtype
    device: torch.device
    split_sizes: list[int]
    experts: fo.Sequential
    x: torch.Tensor
    probs: torch.Tensor
    grad_y: torch.Tensor
    splits_tensor: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        self.splits_tensor = torch.tensor(self.split_sizes, device=self.device)

    @property
    def w1(self) -> torch.Tensor:
        return self.experts[0].weight

    @property
    def w2(self) -> torch.Tensor:
        return self.experts[2].weight


def make_problem(shape: Shape, dtype: torch.dtype, device: torch.device, *, seed: int = 0) -> Problem:
    torch.manual_seed(seed)
    experts = fo.Sequential(
        fo.GroupedLinear(shape.experts, shape.hidden, 2 * shape.ffn, device=device, dtype=dtype),
        fo.ScaledSwiGLU(),
        fo.GroupedLinear(shape.experts, shape.ffn, shape.hidden, device=device, dtype=dtype),
    )
    x = torch.randn(shape.rows, shape.hidden, device=device, dtype=dtype)
    probs = torch.rand(shape.rows, device=device, dtype=torch.float32)
    grad_y = torch.randn(shape.rows, shape.hidden, device=device, dtype=dtype)
    return Problem(shape, dtype, device, uneven_splits(shape.rows, shape.experts), experts, x, probs, grad_y)


# ---------------------------------------------------------------- variants
# Each variant is a forward ``fn(problem, x, probs) -> y``; ``timed_call`` makes fresh
# input leaves per call so that graphs do not accumulate.


def _leaves(p: Problem, backward: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return p.x.detach().requires_grad_(backward), p.probs.detach().requires_grad_(backward)


def fused_forward(p: Problem, x: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    return p.experts(x, p.splits_tensor, probs, p.splits_tensor)


def unfused_forward(p: Problem, x: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    with fo.settings(fusion=False):
        return fused_forward(p, x, probs)


def _swiglu_scaled(h: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up * probs.to(h.dtype).unsqueeze(-1)


def grouped_mm_forward(p: Problem, x: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    offsets = torch.cumsum(p.splits_tensor, 0, dtype=torch.int32)
    h = torch._grouped_mm(x, p.w1.transpose(-2, -1), offs=offsets)
    return torch._grouped_mm(_swiglu_scaled(h, probs), p.w2.transpose(-2, -1), offs=offsets)


def loop_forward(p: Problem, x: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    outs = []
    for e, (xe, pe) in enumerate(zip(x.split(p.split_sizes), probs.split(p.split_sizes))):
        outs.append(F.linear(_swiglu_scaled(F.linear(xe, p.w1[e]), pe), p.w2[e]))
    return torch.cat(outs)


Forward = Callable[[Problem, torch.Tensor, torch.Tensor], torch.Tensor]


def compiled(forward: Forward) -> Forward:
    """``forward`` under ``torch.compile(fullgraph=True)`` (inductor), compiled on first call."""
    return torch.compile(forward, fullgraph=True, dynamic=False)


def timed_call(forward: Forward) -> Callable[[Problem, bool], None]:
    """``run(problem, backward)``: one forward (and backward) on fresh input leaves."""

    def run(p: Problem, backward: bool) -> None:
        x, probs = _leaves(p, backward)
        with torch.set_grad_enabled(backward):
            y = forward(p, x, probs)
        if backward:
            y.backward(p.grad_y)

    return run


class DenseBound:
    """The GEMMs alone, as plain ``torch.mm`` on contiguous, pre-laid-out operands."""

    def __init__(self, p: Problem) -> None:
        s, dt, dev = p.shape, p.dtype, p.device
        m, h, f = s.rows, s.hidden, s.ffn
        r = lambda *shape: torch.randn(*shape, dtype=dt, device=dev)  # noqa: E731
        self.x, self.w1t, self.act, self.w2t = r(m, h), r(h, 2 * f), r(m, f), r(f, h)
        self.dy, self.w2, self.dyt = r(m, h), r(h, f), r(h, m)
        self.dpre, self.w1, self.dpret = r(m, 2 * f), r(2 * f, h), r(2 * f, m)
        self.out_pre, self.out_y = r(m, 2 * f), r(m, h)
        self.out_dact, self.out_dw2, self.out_dx, self.out_dw1 = r(m, f), r(h, f), r(m, h), r(2 * f, h)

    def __call__(self, p: Problem, backward: bool) -> None:
        torch.mm(self.x, self.w1t, out=self.out_pre)  # fc1 fprop
        torch.mm(self.act, self.w2t, out=self.out_y)  # fc2 fprop
        if backward:
            torch.mm(self.dy, self.w2, out=self.out_dact)  # fc2 dgrad
            torch.mm(self.dyt, self.act, out=self.out_dw2)  # fc2 wgrad
            torch.mm(self.dpre, self.w1, out=self.out_dx)  # fc1 dgrad
            torch.mm(self.dpret, self.x, out=self.out_dw1)  # fc1 wgrad


def flops(shape: Shape, backward: bool) -> float:
    forward = 2.0 * shape.rows * shape.hidden * (2 * shape.ffn) + 2.0 * shape.rows * shape.ffn * shape.hidden
    return forward * (3 if backward else 1)


def saved_bytes(forward: Forward, p: Problem) -> int:
    """Bytes of distinct activation storage saved for backward (parameters excluded)."""
    param_ptrs = {t.untyped_storage().data_ptr() for t in p.experts.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in param_ptrs:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    x, probs = _leaves(p, True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = forward(p, x, probs)
    del y
    return sum(seen.values())


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


Progress = Callable[[str], None]


def print_progress(message: str) -> None:
    """The CLI's progress reporter: one ``[bench] ...`` line on stderr (stdout stays clean)."""
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def shuffled_rounds(names: list[str], rounds: int, seed: int = 0) -> Iterator[list[str]]:
    """``rounds`` orders of ``names``, each a fresh random permutation (seeded, reproducible):
    over the rounds every name runs after every other about equally often."""
    order, shuffle = list(names), random.Random(seed).shuffle
    for _ in range(rounds):
        shuffle(order)
        yield list(order)


#: timed rounds per mode that report progress, at most
PROGRESS_ROUNDS = 10


def time_interleaved(
    variants: dict[str, Callable[[Problem, bool], None]],
    p: Problem,
    backward: bool,
    repeats: int,
    warmup: int,
    progress: Progress | None = None,
) -> dict[str, list[float]]:
    """Seconds per call of every variant, one call of each per round.

    Each round runs the variants in a fresh (seeded) random order. What ran just before a
    call, and what it left in the caches, changes a tiny call's time by 10-30% on a CPU
    (measured: the variant after ``dense`` is the slow one); a fixed order would hand
    that to the same variant every round. ``progress``, when given, gets one line per
    variant of every warm-up round and of at most :data:`PROGRESS_ROUNDS` timed rounds
    spread over the run (the last one included).
    """
    mode = "forward+backward" if backward else "forward"
    times: dict[str, list[float]] = {name: [] for name in variants}
    every = -(-repeats // PROGRESS_ROUNDS)
    for round_index, order in enumerate(shuffled_rounds(list(variants), warmup + repeats)):
        timed_round = round_index - warmup + 1
        report = progress is not None and (
            timed_round < 1 or timed_round % every == 0 or timed_round == repeats
        )
        for name in order:
            fn = variants[name]
            for param in p.experts.parameters():
                param.grad = None
            _sync(p.device)
            start = time.perf_counter()
            fn(p, backward)
            _sync(p.device)
            elapsed = time.perf_counter() - start
            if round_index >= warmup:
                times[name].append(elapsed)
            if report:
                which = (
                    f"warm-up {round_index + 1}/{warmup}"
                    if timed_round < 1
                    else f"round {timed_round}/{repeats}"
                )
                progress(f"{mode}: {name}: {which} ({elapsed * 1e3:.1f} ms)")
    return times


FORWARDS: dict[str, Forward] = {
    "fused": fused_forward,
    "unfused": unfused_forward,
    "grouped_mm": grouped_mm_forward,
    "loop": loop_forward,
}


def _error_summary(error: Exception) -> str:
    """The line of a compiler error that says what went wrong (Dynamo wraps the cause)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()] or [type(error).__name__]
    cause = next((line for line in lines if "got RuntimeError" in line), lines[0])
    return cause[cause.find("got RuntimeError") :][:300] if "got RuntimeError" in cause else cause[:300]


def results_header(shape: Shape, p: Problem, dtype: torch.dtype, dev: object, repeats: int) -> dict:
    """What every bench result records first: the problem, the dtype, device, versions, rounds."""
    return {
        "shape": asdict(shape),
        "split_sizes": p.split_sizes,
        "dtype": str(dtype).replace("torch.", ""),
        "device": str(dev),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "repeats": repeats,
    }


def run_bench(
    shape: Shape,
    dtype: torch.dtype = torch.bfloat16,
    device: str = "cpu",
    repeats: int = 10,
    warmup: int = 2,
    include: tuple[str, ...] = ("fused", "unfused", "grouped_mm", "loop", "dense"),
    compile_variants: bool = False,
    progress: Progress | None = None,
) -> dict:
    """Run the benchmark; returns a JSON-ready dict of the results.

    ``progress``, when given, is called with a line per stage and per variant and round.
    """
    say = progress or (lambda message: None)
    if repeats < 1:
        raise ValueError(f"run_bench: repeats must be >= 1, got {repeats}")
    dev = torch.device(device)
    say(f"building the problem: {shape}, {str(dtype).replace('torch.', '')} on {dev}")
    p = make_problem(shape, dtype, dev)
    variants = {name: timed_call(fn) for name, fn in FORWARDS.items() if name in include}
    notes = []
    if compile_variants:
        for name in ("fused", "grouped_mm"):
            say(f"compiling {name} with torch.compile (inductor)")
            run = timed_call(compiled(FORWARDS[name]))
            try:  # compile now, outside the timing; a variant that cannot compile is reported
                run(p, True)
                run(p, False)
            except Exception as error:  # noqa: BLE001 - any compiler failure is reported, not raised
                notes.append(f"{name}_compiled left out: torch.compile failed: {_error_summary(error)}")
                continue
            variants[f"{name}_compiled"] = run
    if "dense" in include:
        variants["dense"] = DenseBound(p)
    plan = p.experts.explain(p.x.detach().requires_grad_(), p.splits_tensor, p.probs, p.splits_tensor)
    results: dict = {
        **results_header(shape, p, dtype, dev, repeats),
        "plan": str(plan),
        "notes": notes,
        "modes": {},
        "saved_bytes": {},
    }
    say("measuring the bytes saved for backward")
    for name, forward in FORWARDS.items():
        if name in include:
            results["saved_bytes"][name] = saved_bytes(forward, p)
    for mode, backward in (("forward", False), ("forward+backward", True)):
        say(f"timing {mode}: {len(variants)} variants, {warmup} warm-up + {repeats} rounds")
        times = time_interleaved(variants, p, backward, repeats, warmup, progress)
        rows = {}
        for name, samples in times.items():
            median = statistics.median(samples)
            rows[name] = {
                "median_ms": median * 1e3,
                "min_ms": min(samples) * 1e3,
                "max_ms": max(samples) * 1e3,
                "tflops": flops(shape, backward) / median / 1e12,
            }
        results["modes"][mode] = rows
    return results


def run_recipe_bench(*args, **kwargs) -> dict:
    """``bench --recipe``: see :func:`fusible_ops.cli.recipe_bench.run_recipe_bench`."""
    from .recipe_bench import run_recipe_bench as run

    return run(*args, **kwargs)


def make_recipe(name: str) -> fo.recipes.Recipe:
    """The recipe ``bench --recipe NAME`` runs (:func:`fusible_ops.cli.recipe_bench.make_recipe`)."""
    from .recipe_bench import make_recipe as make

    return make(name)


def main(args) -> int:
    """``python -m fusible_ops bench``: every flag is checked (:func:`check_bench_args`) first."""
    from .args import UsageError, check_bench_args, check_hf_bench_args

    if getattr(args, "hf", None):
        from importlib.util import find_spec

        check_hf_bench_args(args)
        if find_spec("transformers") is None:
            raise UsageError("--hf needs transformers (pip install 'fusible-ops[transformers]')")
        from .hf_bench import main as hf_main
        from .options import HF_REPEATS

        return hf_main(
            args.hf,
            args.repeats or HF_REPEATS,
            args.progress is not False,
            dtypes=(args.dtype,) if args.dtype else ("bfloat16", "float32"),
            json_path=args.json,
        )
    config = check_bench_args(args)
    if config.recipe is not None:
        with fo.settings(backend=config.backend):
            results = run_recipe_bench(
                config.shape,
                config.recipe,
                config.dtype,
                str(config.device),
                repeats=config.repeats,
                warmup=config.warmup,
                progress=print_progress if config.progress else None,
            )
        results["backend_setting"] = config.backend
        return _report(results, args)
    with fo.settings(backend=config.backend):
        results = run_bench(
            config.shape,
            config.dtype,
            str(config.device),
            repeats=config.repeats,
            warmup=config.warmup,
            compile_variants=config.compile_variants,
            progress=print_progress if config.progress else None,
        )
    results["backend_setting"] = config.backend
    if args.moe_ep:
        from .moe_ep_bench import run_moe_ep_bench

        if config.progress:
            print_progress("MoE layer: single process vs EP=2")
        results["moe_ep"] = run_moe_ep_bench(threads=torch.get_num_threads())
    return _report(results, args)


def _report(results: dict, args) -> int:
    """Print the plan and the table; write the JSON and the plot when asked."""
    print(results["plan"])
    print()
    print(format_table(results))
    if args.json:
        write_json(results, args.json)
    if args.plot:
        plot(results, args.plot)
        print(f"wrote {args.plot}")
    return 0
