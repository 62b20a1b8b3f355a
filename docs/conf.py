"""Sphinx configuration of dask_monarch's documentation site.

The pages are the Markdown files of this folder (MyST, ``myst-parser``); the API reference comes from the
docstrings (``sphinx.ext.autodoc``, which imports ``dask_monarch``). Build it with ``bash ci/docs.sh`` (warnings
are errors there); how to add a page: ``docs/README.md``.
"""

from __future__ import annotations

import inspect
import re

import dask_monarch

project = "dask_monarch"
author = "the dask_monarch authors"
copyright = "the dask_monarch authors (BSD-3-Clause)"
version = release = dask_monarch.__version__

extensions = ["myst_parser", "sphinx.ext.autodoc"]
source_suffix = {".md": "markdown"}
exclude_patterns = ["README.md"]  # how to build the site and add a page: for the repository, not the site

# Markdown: GitHub-style anchors for headings down to ###, so that [text](page.md#a-heading) links resolve (and a
# link to a heading that does not exist is a warning, hence an error in CI)
myst_heading_anchors = 3
myst_enable_extensions = ["deflist"]

autodoc_member_order = "bysource"
autodoc_default_options = {"members": True}
# annotations are shown in the signatures; the prose of the docstrings says the rest
autodoc_typehints = "signature"

html_theme = "furo"
html_title = f"dask_monarch {release}"
html_show_sourcelink = False


def _group_new_public_names(app, docname: str, source: list) -> None:
    """``api.md`` documents ``dask_monarch.__all__`` in groups, by hand. A public name added since, and not yet
    placed in a group, is documented at the end of the page under "Not yet grouped" instead of being left out."""
    if docname != "api":
        return
    documented = set(re.findall(r"^\.\. auto\w+:: dask_monarch\.(\w+)\s*$", source[0], re.MULTILINE))
    missing = [name for name in dask_monarch.__all__ if name not in documented]
    if not missing:
        return
    lines = ["", "## Not yet grouped", "", "Public names added since this page was arranged.", "", "```{eval-rst}"]
    for name in missing:
        obj = getattr(dask_monarch, name)
        kind = "class" if inspect.isclass(obj) else "function" if callable(obj) else "data"
        lines.append(f".. auto{kind}:: dask_monarch.{name}")
    source[0] += "\n".join(lines + ["```", ""])


def setup(app):
    app.connect("source-read", _group_new_public_names)
