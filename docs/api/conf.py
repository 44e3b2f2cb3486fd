"""Sphinx configuration of the API reference: ``sphinx-build -W -n docs/api OUT``."""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parents[1]), str(HERE)]

from public_names import MODULE_HOOKS, own_doc  # noqa: E402

project = "fusible-ops"
author = "fusible-ops contributors"
copyright = "2026, fusible-ops contributors"  # noqa: A001  (a Sphinx setting)
extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon"]
master_doc = "index"
exclude_patterns = ["_build"]
html_theme = "alabaster"

napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_custom_sections = [("Shape", "params_style")]
autodoc_default_options = {
    "members": True,
    "undoc-members": True,  # so that a member without a docstring reaches the check below
    "member-order": "bysource",
    "exclude-members": ",".join(sorted(MODULE_HOOKS)),
}
autodoc_typehints = "none"  # the signatures carry them; the docstrings say the shapes
autodoc_inherit_docstrings = True
autodoc_class_signature = "separated"

nitpicky = True
#: targets outside this reference (no intersphinx: the build runs offline)
nitpick_ignore_regex = [
    (r"py:.*", r"(torch|typing|collections|dataclasses|enum|transformers)(\..*)?"),
    (r"py:class", r"(int|float|str|bool|bytes|object|tuple|list|dict|set|type|None|Any|Callable)"),
]


def _warn_on_missing_docstring(app, what, name, obj, options, lines) -> None:
    """A public name or member without a docstring of its own fails the ``-W`` build."""
    from sphinx.util import logging

    if name.rsplit(".", 1)[-1].startswith("_") or what in ("attribute", "data", "module"):
        return
    if what in ("method", "property"):
        owner_name, member = name.rsplit(".", 1)
        module_name, _, class_path = owner_name.partition(".")
        owner = sys.modules.get(module_name)
        for part in owner_name.split(".")[1:]:
            owner = getattr(owner, part, None)
        if inspect.isclass(owner) and own_doc(owner, member) is None:
            logging.getLogger(__name__).warning(f"{name} has no docstring")
        return
    if not any(line.strip() for line in lines):
        logging.getLogger(__name__).warning(f"{name} has no docstring")


def setup(app) -> dict:
    app.connect("autodoc-process-docstring", _warn_on_missing_docstring)
    return {"parallel_read_safe": True}
