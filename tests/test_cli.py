"""The command line: demo, bench and info run and report what they should."""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import pytest
import torch
from error_model import BOTH_SIDES, rounding_rtol

from fusible_ops.__main__ import build_parser, main
from fusible_ops.cli import bench, demo
from fusible_ops.cli.args import UsageError, check_bench_args


def test_info_lists_every_backend(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    for name in ("cpu", "torch_loop", "grouped_mm", "triton", "cudnn"):
        assert f"  {name}: " in out
    assert "cudnn" in out and "unavailable" in out


def test_bench_small_json_and_table(tmp_path, capsys):
    path = tmp_path / "bench.json"
    assert main(["bench", "--small", "--repeats", "2", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert (
        "GroupedMLP" in out and "x dense" in out and "compiled: fused_compiled / grouped_mm_compiled" in out
    )
    results = json.loads(path.read_text())
    assert set(results["modes"]) == {"forward", "forward+backward"}
    for rows in results["modes"].values():
        assert set(rows) == {
            "fused",
            "unfused",
            "grouped_mm",
            "loop",
            "dense",
            "fused_compiled",
            "grouped_mm_compiled",
        }
        assert all(r["median_ms"] > 0 for r in rows.values())
    saved = results["saved_bytes"]
    assert saved["fused"] < saved["unfused"] < saved["grouped_mm"]


def test_bench_problem_matches_the_demo_reference():
    problem = bench.make_problem(
        bench.Shape(experts=3, hidden=16, ffn=8, rows=20), torch.float64, torch.device("cpu")
    )
    x, probs, splits = problem.x, problem.probs.double(), problem.split_sizes
    reference = demo.reference_expert_block(x, splits, probs, problem.w1, problem.w2)
    fused = problem.experts(x, problem.splits_tensor, problem.probs.double(), problem.splits_tensor)
    torch.testing.assert_close(fused, reference)
    assert sum(splits) == 20 and splits[1] == 0  # uneven, with an empty expert


def test_demo_pieces_run(capsys):
    demo.check_against_reference(torch.float32)
    demo.train_small_moe(steps=6)
    out = capsys.readouterr().out
    assert "FAIL" not in out and "GroupedMLP" in out and "loss went down" in out


# ---------------------------------------------------------------- bad flags: one line, exit 2
def _usage_error(capsys, argv: list[str]) -> str:
    """Run the CLI in-process; it must exit 2 with one ``... error: ...`` line and no traceback."""
    with pytest.raises(SystemExit) as raised:
        main(argv)
    assert raised.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "Traceback" not in captured.err
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith(f"python -m fusible_ops {argv[0]}: error: ")
    return lines[0]


def test_bench_refuses_zero_repeats(capsys):
    line = _usage_error(capsys, ["bench", "--small", "--repeats", "0"])
    assert "--repeats" in line and "positive integer" in line and "got 0" in line


def test_bench_refuses_zero_repeats_when_main_is_called_directly(capsys):
    args = build_parser().parse_args(["bench", "--small"])
    args.repeats = 0
    with pytest.raises(UsageError, match="--repeats must be a positive integer"):
        bench.main(args)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_bench_refuses_cuda_without_cuda(capsys):
    line = _usage_error(capsys, ["bench", "--small", "--device", "cuda"])
    assert "--device cuda: CUDA is not available" in line


def test_bench_refuses_a_device_that_is_not_one(capsys):
    line = _usage_error(capsys, ["bench", "--device", "gpu0"])
    assert "--device 'gpu0' is not a device" in line


def test_bench_refuses_an_unknown_backend(capsys):
    line = _usage_error(capsys, ["bench", "--small", "--backend", "nope"])
    assert "--backend 'nope' is not a backend" in line
    assert "cpu, grouped_mm, triton, cudnn, torch_loop" in line


def test_bench_refuses_an_unavailable_backend(capsys):
    line = _usage_error(capsys, ["bench", "--small", "--backend", "cudnn", "--device", "cpu"])
    assert "--backend cudnn is unavailable on cpu bfloat16: " in line


def test_bench_refuses_negative_sizes(capsys):
    line = _usage_error(capsys, ["bench", "--small", "--hidden", "-64"])
    assert "argument --hidden: must be a positive integer (>= 1), got -64" in line
    line = _usage_error(capsys, ["bench", "--small", "--experts", "0"])
    assert "argument --experts" in line


def test_bench_refuses_misaligned_sizes(capsys):
    line = _usage_error(capsys, ["bench", "--small", "--hidden", "60"])
    assert "--hidden 60 must be a multiple of 8 for bfloat16" in line and "torch._grouped_mm" in line
    line = _usage_error(capsys, ["bench", "--small", "--dtype", "float32", "--ffn", "62"])
    assert "--ffn 62 must be a multiple of 4 for float32" in line


def test_bench_reports_a_backend_that_refuses_the_problem(capsys, monkeypatch):
    """What the flags' own checks miss, building the plan (``explain``) catches before the run."""
    from fusible_ops.kernels import clear_backend_cache
    from fusible_ops.kernels.pytorch.loop import TorchLoopBackend

    clear_backend_cache()
    monkeypatch.setattr(
        TorchLoopBackend,
        "shape_problem",
        staticmethod(lambda i, o, dtype: f"test: refuses {i} -> {o}"),
        raising=False,
    )
    try:
        line = _usage_error(capsys, ["bench", "--small", "--backend", "torch_loop"])
    finally:
        clear_backend_cache()
    assert "this problem cannot run with --backend torch_loop: " in line and "test: refuses 64 -> 128" in line


def test_bench_refuses_plot_without_matplotlib_before_the_run(capsys, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    monkeypatch.setattr(bench, "run_bench", lambda *a, **k: pytest.fail("the bench ran"))
    line = _usage_error(capsys, ["bench", "--small", "--plot", str(tmp_path / "bench.png")])
    assert "--plot needs matplotlib, which is not installed" in line
    assert not (tmp_path / "bench.png").exists()


def test_bench_refuses_an_output_folder_that_does_not_exist(capsys, tmp_path):
    line = _usage_error(capsys, ["bench", "--small", "--json", str(tmp_path / "missing" / "b.json")])
    assert "--json" in line and "does not exist" in line


def test_argparse_errors_are_one_line_too(capsys):
    line = _usage_error(capsys, ["bench", "--dtype", "int8"])
    assert "argument --dtype: invalid choice: 'int8'" in line


def test_bench_progress_per_variant_and_round_goes_to_stderr(capsys):
    assert main(["bench", "--small", "--no-compile", "--repeats", "2", "--progress"]) == 0
    captured = capsys.readouterr()
    assert "[bench]" not in captured.out and "GroupedMLP" in captured.out
    progress = captured.err.splitlines()
    assert all(line.startswith("[bench] ") for line in progress)
    for mode in ("forward", "forward+backward"):
        for name in ("fused", "unfused", "grouped_mm", "loop", "dense"):
            for which in ("warm-up 1/3", "warm-up 3/3", "round 1/2", "round 2/2"):
                assert any(line.startswith(f"[bench] {mode}: {name}: {which} (") for line in progress)


def test_bench_prints_progress_by_default_also_with_small():
    parser = build_parser()
    assert check_bench_args(parser.parse_args(["bench", "--rows", "64"])).progress
    assert check_bench_args(parser.parse_args(["bench", "--small"])).progress
    assert not check_bench_args(parser.parse_args(["bench", "--small", "--no-progress"])).progress


def test_small_bench_defaults_are_the_ones_its_help_states():
    from fusible_ops.cli.options import SMALL_REPEATS

    config = check_bench_args(build_parser().parse_args(["bench", "--small"]))
    assert config.repeats == SMALL_REPEATS == 300 and config.compile_variants


def test_progress_of_many_rounds_reports_at_most_ten_of_them():
    """300 rounds of 7 variants must not print 4200 lines: every warm-up round, then at most
    PROGRESS_ROUNDS timed rounds spread over the run, the last one included."""
    lines: list[str] = []
    variants = {name: (lambda p, backward: None) for name in "abc"}
    problem = SimpleNamespace(experts=torch.nn.Linear(1, 1), device=torch.device("cpu"))
    bench.time_interleaved(variants, problem, False, repeats=25, warmup=2, progress=lines.append)
    rounds = sorted({line.split(": ")[2].split(" (")[0] for line in lines})
    timed = [r for r in rounds if r.startswith("round")]
    assert {"warm-up 1/2", "warm-up 2/2", "round 25/25"} <= set(rounds)
    assert 2 <= len(timed) <= bench.PROGRESS_ROUNDS
    assert len(lines) == 3 * (2 + len(timed))


# ---------------------------------------------------------------- demo --steps
def test_demo_runs_for_one_and_two_steps(capsys, monkeypatch):
    run_bench = demo.run_bench
    monkeypatch.setattr(demo, "run_bench", lambda *a, **k: run_bench(*a, **{**k, "repeats": 1}))
    monkeypatch.setattr(demo, "DEMO_SHAPE", bench.SMALL_SHAPE)  # the table's content is not under test
    assert main(["demo", "--steps", "1"]) == 0
    out = capsys.readouterr().out
    assert "1 step)" in out and "loss went down" in out and "FAIL" not in out and "UP" not in out
    # the printed losses are the ones the verdict compares: the evaluation batch's
    before = next(line for line in out.splitlines() if "before training:" in line).split()[-1]
    after = next(line for line in out.splitlines() if "after step   1:" in line).split()[-1]
    assert f"{before} -> {after}" in out and "training loss" not in out
    assert f"{demo.DEMO_SHAPE.rows} rows" in out and "x dense" in out
    # the same again for 2 steps (loss and verdict agree for any step count)
    assert main(["demo", "--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "2 steps)" in out and "loss went down" in out and "FAIL" not in out and "UP" not in out


def test_demo_refuses_zero_or_negative_steps(capsys):
    for steps in ("0", "-3"):
        line = _usage_error(capsys, ["demo", "--steps", steps])
        assert f"argument --steps: must be a positive integer (>= 1), got {steps}" in line


def test_demo_training_check_catches_a_real_regression(capsys, monkeypatch):
    """The verdict is not a formality: an optimizer climbing the loss fails it."""
    adam = torch.optim.Adam
    monkeypatch.setattr(torch.optim, "Adam", lambda *a, **k: adam(*a, maximize=True, **k))
    with pytest.raises(SystemExit, match="did not reduce the loss"):
        demo.train_small_moe(steps=1)
    assert "loss went UP" in capsys.readouterr().out


# ---------------------------------------------------------------- --help
def test_help_is_plain_text_and_shows_every_bench_default(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    with pytest.raises(SystemExit) as raised:
        main(["bench", "--help"])
    assert raised.value.code == 0
    out = capsys.readouterr().out
    assert "``" not in out and ":class:" not in out
    for flag, default in {
        "--small": "off, the full shape",
        "--device": "cpu",
        "--dtype": "bfloat16; with --hf: bfloat16 and float32",
        "--backend": "auto",
        "--experts": "8, or 4 with --small",
        "--hidden": "1024, or 64 with --small",
        "--ffn": "1408, or 64 with --small",
        "--rows": "8192, or 64 with --small",
        "--repeats": "10, or 300 with --small, 3 with --hf",
        "--compile": "on with --small, else off",
        "--progress": "on",
        "--json": "none",
        "--plot": "none",
        "--moe-ep": "off",
    }.items():
        lines = out.splitlines()
        start = next(i for i, line in enumerate(lines) if line.strip().startswith(flag))
        block = [lines[start]]  # the flag's line and its continuation lines (a long metavar wraps)
        block += [line for line in lines[start + 1 : start + 3] if line.startswith(" " * 8)]
        assert f"(default: {default})" in " ".join(block), block
    with pytest.raises(SystemExit):
        main(["--help"])
    top = capsys.readouterr().out
    assert "``" not in top and "demo" in top and "bench" in top and "info" in top
    assert "300 rounds" in out and "50 rounds" not in out  # --small's own line says the real rounds


_HELP_PROBE = """
import runpy, sys, time
sys.argv = ["fusible_ops", *sys.argv[1:]]
start = time.perf_counter()
try:
    runpy.run_module("fusible_ops", run_name="__main__", alter_sys=True)
except SystemExit as done:
    code = done.code
print("EXIT", code, "TORCH", "torch" in sys.modules, "SECONDS", time.perf_counter() - start)
"""


@pytest.mark.parametrize("argv", [["--help"], ["bench", "--help"], ["demo", "--help"], ["info", "--help"]])
def test_help_answers_without_importing_torch(argv):
    """In a fresh interpreter: --help exits 0, torch never loads, and it takes well under half a
    second past the interpreter's own start (the best of three runs, on a shared machine)."""
    import subprocess

    runs = [
        subprocess.run([sys.executable, "-c", _HELP_PROBE, *argv], capture_output=True, text=True, check=True)
        for _ in range(3)
    ]
    reports = [run.stdout.splitlines()[-1].split() for run in runs]
    assert all(r[:4] == ["EXIT", "0", "TORCH", "False"] for r in reports), reports
    assert "usage: python -m fusible_ops" in runs[0].stdout
    assert min(float(r[5]) for r in reports) < 0.5, reports


# ---------------------------------------------------------------- unknown and abbreviated flags
@pytest.mark.parametrize(
    "argv, named",
    [
        (["bench", "--smal"], "--smal"),  # a prefix of --small is not --small
        (["bench", "--rep", "3"], "--rep 3"),
        (["demo", "--step", "2"], "--step 2"),
        (["info", "--verbose"], "--verbose"),
    ],
)
def test_an_unknown_flag_is_named_with_its_command(capsys, argv, named):
    line = _usage_error(capsys, argv)
    assert "unrecognized argument" in line and named in line and f"{argv[0]} --help" in line


# ---------------------------------------------------------------- bench --hf reads only what it uses
@pytest.mark.parametrize(
    "flags",
    [["--small"], ["--device", "cpu"], ["--backend", "auto"], ["--hidden", "64"], ["--rows", "64"],
     ["--compile"], ["--no-compile"], ["--moe-ep"], ["--plot", "x.png"], ["--experts", "2", "--ffn", "8"]],
)  # fmt: skip
def test_bench_hf_refuses_the_flags_it_does_not_read(capsys, monkeypatch, flags):
    from fusible_ops.cli import hf_bench

    monkeypatch.setattr(hf_bench, "run_hf_bench", lambda *a, **k: pytest.fail("the bench ran"))
    line = _usage_error(capsys, ["bench", "--hf", "mixtral", *flags])
    assert "--hf does not take" in line
    for flag in flags:
        if flag.startswith("--"):
            assert (flag if flag != "--no-compile" else "--compile") in line


def test_bench_hf_honours_dtype_repeats_progress_and_json(capsys, monkeypatch, tmp_path):
    pytest.importorskip("transformers")
    from fusible_ops.cli import hf_bench

    real = hf_bench.run_hf_bench
    tiny = hf_bench.HfShape(tokens=32, hidden=32, experts=4, ffn=16, top_k=2)
    monkeypatch.setattr(hf_bench, "run_hf_bench", lambda family, **k: real(family, shape=tiny, **k))
    path = tmp_path / "hf.json"
    argv = ["bench", "--hf", "mixtral", "--dtype", "float32", "--repeats", "2", "--json", str(path)]
    assert main(argv) == 0
    captured = capsys.readouterr()
    results = json.loads(path.read_text())
    assert list(results["medians_ms"]) == ["float32"] and results["repeats"] == 2
    assert "| float32 |" in captured.out and "| bfloat16 |" not in captured.out
    assert f"wrote {path}" in captured.out
    assert "[bench] mixtral float32: round 2/2" in captured.err  # progress on by default
    assert main([*argv, "--no-progress"]) == 0
    assert "[bench]" not in capsys.readouterr().err


# ---------------------------------------------------------------- EP bench
def test_ep_bench_warns_when_its_numbers_cannot_be_trusted():
    from fusible_ops.cli.moe_ep_bench import trust_warnings

    assert trust_warnings(threads=2, cores=2, world=2) == []
    assert "2 ranks share 1 core(s)" in trust_warnings(threads=2, cores=1, world=2)[0]
    assert "1 thread(s) for 2 ranks" in trust_warnings(threads=1, cores=4, world=2)[0]
    assert "oversubscribe" in trust_warnings(threads=8, cores=2, world=2)[0]


def test_ep_bench_uses_the_threads_it_is_given():
    from fusible_ops.cli.moe_ep_bench import format_moe_ep, run_moe_ep_bench

    r = run_moe_ep_bench(tokens=16, hidden=16, ffn=16, experts=2, top_k=1, warmup=1, iters=1, threads=2)
    assert r["threads"] == r["single_threads_used"] == 2
    assert r["threads_per_rank"] == r["rank0_threads_used"] == r["rank1_threads_used"] == 1
    assert r["single_ms"] > 0 and r["ep2_ms"] > 0
    text = "\n".join(format_moe_ep(r))
    assert "single process (2 threads)" in text and "1 thread(s) per rank" in text
    assert ("warning: not trustworthy" in text) == bool(r["warnings"])


# ---------------------------------------------------------------- numpy
def test_no_numpy_warning_without_numpy():
    """torch warns at import when numpy is missing; the command line keeps that quiet."""
    import subprocess

    probe = (
        "import sys, runpy; sys.modules['numpy'] = None; sys.argv = ['fusible_ops', 'info']\n"
        "runpy.run_module('fusible_ops', run_name='__main__', alter_sys=True)"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert "backends" in done.stdout, done.stderr[-2000:]
    assert "NumPy" not in done.stderr, done.stderr[-2000:]


def test_bench_hf_refuses_an_unknown_family(capsys):
    line = _usage_error(capsys, ["bench", "--hf", "llama"])
    assert "--hf" in line and "invalid choice: 'llama'" in line


def test_bench_hf_without_transformers_is_one_clear_line(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "transformers" else real(name, *a)
    )
    args = build_parser().parse_args(["bench", "--hf", "mixtral"])
    with pytest.raises(UsageError, match=r"--hf needs transformers"):
        bench.main(args)


def test_hf_bench_times_three_implementations_that_agree():
    pytest.importorskip("transformers")
    from fusible_ops.cli.hf_bench import HfShape, format_hf_table, run_hf_bench

    shape = HfShape(tokens=64, hidden=64, experts=4, ffn=32, top_k=2)
    for family in ("mixtral", "gpt_oss"):
        results = run_hf_bench(family, dtypes=("float32",), shape=shape, repeats=1)
        medians = results["medians_ms"]["float32"]
        assert set(medians) == {"eager", "grouped_mm", "fusible_ops"} and all(v > 0 for v in medians.values())
        # float32, both rounding: fc1 over hidden (64), fc2 over ffn (32), the top-2 sum
        assert results["max_rel_diff"]["float32"]["fusible_ops"] < rounding_rtol(
            torch.float32, 64 + 32 + 2, 4 * BOTH_SIDES
        )
        assert "| float32 |" in format_hf_table(results)


def test_small_overhead_benchmark_runs_and_checks_its_variants(capsys):
    """benchmarks/small_overhead.py: its three variants agree before it times them."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "small_overhead.py"
    spec = importlib.util.spec_from_file_location("small_overhead", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--dtype", "float32", "--rounds", "2"]) == 0
    out = capsys.readouterr().out
    assert "kernels only" in out and "[forward+backward]" in out


def test_interleaved_rounds_vary_the_order_of_the_variants():
    """A fixed order hands the slow slot (after the cache-thrashing variant) to one variant
    every round; each round runs them in a new order, every variant once."""
    calls: list[str] = []
    variants = {name: (lambda p, backward, name=name: calls.append(name)) for name in "abcd"}
    problem = SimpleNamespace(experts=torch.nn.Linear(1, 1), device=torch.device("cpu"))
    times = bench.time_interleaved(variants, problem, False, repeats=40, warmup=2)
    assert {name: len(samples) for name, samples in times.items()} == dict.fromkeys("abcd", 40)
    rounds = [calls[i : i + 4] for i in range(0, len(calls), 4)]
    assert all(sorted(r) == list("abcd") for r in rounds)
    for name in "abcd":  # every variant follows several different ones (rounds wrap around)
        before = {calls[i - 1] for i in range(1, len(calls)) if calls[i] == name}
        assert len(before) >= 3, (name, before)


def test_in_process_ab_benchmark_runs():
    """benchmarks/ab_in_process.py imports a revision's package under another name next to
    the working tree's and times both (HEAD against the working tree, two rounds; in its
    own process, so that the second copy's custom ops stay out of this one)."""
    import shutil
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    if shutil.which("git") is None or subprocess.run(["git", "rev-parse", "HEAD"], cwd=root).returncode:
        pytest.skip("needs a git checkout")
    script = root / "benchmarks" / "ab_in_process.py"
    done = subprocess.run(
        [sys.executable, str(script), "HEAD", "--rounds", "2"], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "work / base" in done.stdout and done.stdout.count("us, composition") == 2


def test_table_ratio_columns_and_words_say_the_same():
    rows = {
        name: {"median_ms": ms, "tflops": 1.0}
        for name, ms in (("fused", 2.0), ("unfused", 4.0), ("grouped_mm", 1.6), ("dense", 1.0))
    }
    results = {"shape": {"experts": 2, "hidden": 8, "ffn": 8, "rows": 8}, "split_sizes": [4, 4],
               "dtype": "float32", "device": "cpu", "torch": "x", "threads": 1, "repeats": 1,
               "modes": {"fwd+bwd": rows}, "saved_bytes": {}}  # fmt: skip
    table = bench.format_table(results)
    fused_line = next(line for line in table.splitlines() if line.startswith("fused "))
    assert fused_line.split()[-2:] == ["0.50", "1.25"]  # fused/unfused, fused/grouped_mm
    assert "50% faster than unfused" in table and "25% slower than grouped_mm" in table
    assert "speed-up" not in table


# ---------------------------------------------------------------- bench --recipe
def test_bench_recipe_small_times_both_and_names_the_recipe_and_saved_bytes(capsys, monkeypatch, tmp_path):
    real = bench.run_recipe_bench
    monkeypatch.setattr(
        bench, "run_recipe_bench", lambda *a, **k: real(*a, **{**k, "repeats": 2, "warmup": 1})
    )
    path = tmp_path / "recipe.json"
    assert main(["bench", "--recipe", "mxfp8", "--small", "--no-progress", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "recipe MXFP8(" in out  # the plan, under the recipe
    assert "recipe mxfp8: MXFP8(" in out and "fused = unquantized bfloat16" in out
    assert "note: on cpu the quantization is emulated" in out and "slower" in out
    lines = out.splitlines()
    for mode in ("[forward]", "[forward+backward]"):
        start = lines.index(mode)
        assert lines[start + 1].split() == ["variant", "median", "ms", "TFLOP/s", "x", "fused"]
        assert {line.split()[0] for line in lines[start + 2 : start + 4]} == {"fused", "fused_mxfp8"}
    saved = lines[
        lines.index("bytes saved for backward (activations, via saved-tensor hooks; parameters excluded):") :
    ]
    assert saved[1].split()[0] == "fused" and "MiB" in saved[1]
    assert saved[2].split()[0] == "fused_mxfp8" and "MiB" in saved[2] and "x fused)" in saved[2]
    results = json.loads(path.read_text())
    assert results["recipe"] == "mxfp8" and results["emulated"] and results["repeats"] == 2
    for rows in results["modes"].values():
        assert set(rows) == {"fused", "fused_mxfp8"} and all(r["median_ms"] > 0 for r in rows.values())
    # fc1's input is saved as FP8 data and E8M0 scales instead of bfloat16
    assert 0 < results["saved_bytes"]["fused_mxfp8"] < results["saved_bytes"]["fused"]


@pytest.mark.parametrize("flags", [["--compile"], ["--no-compile"], ["--moe-ep"]])
def test_bench_recipe_refuses_the_flags_it_does_not_read(capsys, monkeypatch, flags):
    monkeypatch.setattr(bench, "run_recipe_bench", lambda *a, **k: pytest.fail("the bench ran"))
    line = _usage_error(capsys, ["bench", "--recipe", "rowwise", "--small", *flags])
    assert "--recipe does not take" in line
    assert (flags[0] if flags[0] != "--no-compile" else "--compile") in line


def test_bench_recipe_refuses_unknown_recipes_and_hf(capsys, monkeypatch):
    from fusible_ops.cli import hf_bench

    line = _usage_error(capsys, ["bench", "--recipe", "fp4"])
    assert "argument --recipe: invalid choice: 'fp4'" in line and "mxfp8" in line
    monkeypatch.setattr(hf_bench, "run_hf_bench", lambda *a, **k: pytest.fail("the bench ran"))
    line = _usage_error(capsys, ["bench", "--hf", "mixtral", "--recipe", "mxfp8"])
    assert "--hf does not take --recipe" in line
    args = build_parser().parse_args(["bench", "--small"])
    args.recipe = "fp4"  # bench.main() called directly
    with pytest.raises(
        UsageError, match=r"--recipe 'fp4': choose one of mxfp8, tensorwise, rowwise, blockwise"
    ):
        bench.main(args)


def test_bench_recipe_help_states_its_default_and_the_emulation(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--recipe {mxfp8,tensorwise,rowwise,blockwise}" in out
    assert "the quantization is emulated" in out and "refuses --compile and --moe-ep (default: none)" in out
