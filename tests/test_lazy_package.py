"""``import fusible_ops`` loads nothing heavy; every public name loads on first use, and a
fuser reached through any module plans with the built-in fusions."""

from __future__ import annotations

import subprocess
import sys

import fusible_ops as fo


def _run(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout


def test_importing_the_package_imports_no_torch():
    assert _run(
        "import sys, fusible_ops; print('torch' in sys.modules, fusible_ops.__version__)"
    ).split() == [
        "False",
        fo.__version__,
    ]


def test_every_public_name_resolves_and_is_listed():
    for name in fo.__all__:
        assert getattr(fo, name) is not None, name
    assert set(fo.__all__) <= set(dir(fo))
    assert fo.kernels.backend_names()  # a subpackage is an attribute, as after importing it
    try:
        fo.not_a_name  # noqa: B018
    except AttributeError as error:
        assert "not_a_name" in str(error)
    else:
        raise AssertionError("an unknown name must raise AttributeError")


def test_a_fuser_built_through_an_internal_module_fuses():
    """No public name touched: the built-in rules still register when the fuser is built."""
    code = (
        "import torch\n"
        "from fusible_ops.basic import GroupedLinear, ScaledSwiGLU\n"
        "from fusible_ops.fuser.sequential import Sequential\n"
        "s = Sequential(GroupedLinear(2, 8, 16), ScaledSwiGLU(), GroupedLinear(2, 8, 8))\n"
        "splits = torch.tensor([3, 1])\n"
        "s(torch.randn(4, 8), splits, torch.rand(4), splits)\n"
        "print(s.last_plan.fusion_plans[0].forward_op_types())\n"
    )
    assert "GroupedMLP" in _run(code)


def test_settings_check_backends_right_after_import():
    assert _run(
        "import fusible_ops as fo\nwith fo.settings(backend='torch_loop'): print('ok')\n"
        "with fo.settings(recipe=fo.recipes.MXFP8()): print('ok')"
    ).split() == ["ok", "ok"]
