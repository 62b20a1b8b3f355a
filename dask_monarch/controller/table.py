"""Tables of per-rank things for a terminal and a notebook: ``DeviceMesh.to_table()`` (which worker each rank is)
and ``dask_monarch.show`` (a value fetched from a rank, or a ``ValueMesh`` of every rank's).

A table is laid out over named dimensions: the last one across, the one before it down, and one section per
coordinate of any dimensions before those (Monarch's ``tensor_to_table`` layout, which stops at three dimensions;
this one does not). ``Table`` is a ``str`` (so ``print(mesh.to_table())`` prints it, as in Monarch) that a Jupyter
or IPython front end shows as HTML (``_repr_html_``). ``display`` shows one the way the place it runs in can: HTML
through IPython's display machinery inside a notebook kernel, plain text on stdout elsewhere.
"""

from __future__ import annotations

import html
import itertools
import math
import sys

import torch

__all__ = ["Table", "display", "grid", "tensor_table"]

#: tensors with more elements than this are shown as torch prints them (summarised), not cell by cell
MAX_CELLS = 1000


class Table(str):
    """The text of a table (a ``str``), with ``_repr_html_`` giving the same table as HTML for notebooks."""

    _html: str

    def __new__(cls, text: str, html_text: str):
        table = super().__new__(cls, text)
        table._html = html_text
        return table

    def _repr_html_(self) -> str:
        return self._html


def _coords(names, index) -> str:
    return ", ".join(f"{n}={i}" for n, i in zip(names, index))


def _text_section(row_name, col_name, rows: int, cols: int, cells: list) -> list:
    corner = f"{row_name} \\ {col_name}" if row_name and col_name else (row_name or col_name or "")
    header = [corner] + ([str(c) for c in range(cols)] if col_name else [""])
    body = [[str(r) if row_name else ""] + cells[r * cols:(r + 1) * cols] for r in range(rows)]
    widths = [max(len(line[i]) for line in [header] + body) for i in range(len(header))]
    out = [" | ".join(v.ljust(w) for v, w in zip(header, widths)).rstrip()]
    out.append("-+-".join("-" * w for w in widths))
    out.extend(" | ".join(v.ljust(w) for v, w in zip(line, widths)).rstrip() for line in body)
    return out


def _html_section(caption, row_name, col_name, rows: int, cols: int, cells: list) -> str:
    e = html.escape
    parts = ["<table>"]
    if caption:
        parts.append(f"<caption>{e(caption)}</caption>")
    corner = f"{row_name} \\ {col_name}" if row_name and col_name else (row_name or col_name or "")
    heads = [str(c) for c in range(cols)] if col_name else [""]
    parts.append("<tr><th>" + e(corner) + "</th>" + "".join(f"<th>{e(h)}</th>" for h in heads) + "</tr>")
    for r in range(rows):
        label = str(r) if row_name else ""
        tds = "".join(f"<td><code>{e(c)}</code></td>" for c in cells[r * cols:(r + 1) * cols])
        parts.append(f"<tr><th>{e(label)}</th>{tds}</tr>")
    parts.append("</table>")
    return "".join(parts)


def grid(names, sizes, cells, title: str | None = None) -> Table:
    """A ``Table`` of ``cells`` (strings, one per point, in row-major order over ``sizes``) laid out over the
    dimensions ``names``: the last across, the one before it down, a section per coordinate of the others. No
    dimensions: one cell. ``title`` heads it. Raises ``ValueError`` if the number of cells is not the product of
    ``sizes``."""
    names, sizes, cells = list(names), [int(s) for s in sizes], [str(c) for c in cells]
    if len(names) != len(sizes):
        raise ValueError(f"grid: {len(names)} names {names} for {len(sizes)} sizes {sizes}")
    if len(cells) != math.prod(sizes):
        raise ValueError(f"grid: {len(cells)} cells for sizes {sizes} ({math.prod(sizes)} points)")
    if not names:  # one point: the value alone
        return _single(cells[0], title)
    col_name = names[-1] if names else None
    row_name = names[-2] if len(names) > 1 else None
    cols = sizes[-1] if names else 1
    rows = sizes[-2] if len(names) > 1 else 1
    outer_names, outer_sizes = names[:-2], sizes[:-2]
    text = [title] if title else []
    blocks = [f"<p><b>{html.escape(title)}</b></p>"] if title else []
    per_section = rows * cols
    for n, index in enumerate(itertools.product(*(range(s) for s in outer_sizes))):
        caption = _coords(outer_names, index)
        section = cells[n * per_section:(n + 1) * per_section]
        if caption:
            text.append(("\n" if n else "") + caption)
        text.extend(_text_section(row_name, col_name, rows, cols, section))
        blocks.append(_html_section(caption, row_name, col_name, rows, cols, section))
    return Table("\n".join(text), "".join(blocks))


def _single(text: str, title: str | None) -> Table:
    head = f"{title}\n" if title else ""
    head_html = f"<p><b>{html.escape(title)}</b></p>" if title else ""
    return Table(f"{head}{text}", f"{head_html}<pre>{html.escape(text)}</pre>")


def _number(x) -> str:
    if isinstance(x, float):
        return f"{x:.4f}"
    return str(x)


def tensor_table(t: torch.Tensor, title: str) -> Table:
    """A local tensor as a ``Table`` of its values, its dimensions named ``dim0``, ``dim1``, ...: floats with four
    decimals, complex numbers and others as Python prints them. Tensors of more than ``MAX_CELLS`` elements are
    shown as torch prints them (summarised). ``title`` heads it, followed by the dtype and shape."""
    head = f"{title}: {str(t.dtype).removeprefix('torch.')} {list(t.shape)}"
    if t.numel() > MAX_CELLS or t.numel() == 0 or t.is_sparse:
        return _single(repr(t), head)
    values = t.detach().cpu().reshape(-1).tolist()
    return grid([f"dim{i}" for i in range(t.dim())], list(t.shape), [_number(v) for v in values], head)


def _ipython_kernel():
    """The running IPython shell if this process is a notebook kernel (or another front end that shows HTML),
    else None (a plain ``python`` process, or the IPython terminal, where printing is what shows)."""
    ipython = sys.modules.get("IPython")
    if ipython is None:
        return None
    shell = ipython.get_ipython()
    if shell is None or type(shell).__name__ == "TerminalInteractiveShell":
        return None
    return shell


def display(table: Table) -> None:
    """Show ``table``: through ``IPython.display.display`` (HTML) inside a notebook kernel, else printed on stdout."""
    if _ipython_kernel() is not None:
        from IPython.display import display as ipython_display

        ipython_display(table)
    else:
        print(table, flush=True)
