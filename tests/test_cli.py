"""The command line: demo, bench and info run and report what they should."""

from __future__ import annotations

import json

import torch

from fusible_ops.__main__ import main
from fusible_ops.cli import bench, demo


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
