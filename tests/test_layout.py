"""The controller's imports run one way (DESIGN.md "Layout"; issue 13): frontend (tensor, stream, remote, dispatch,
reduce, to_mesh, fetch, recording, compile) -> mesh -> session -> the session's parts and helpers -> protocol. Every
import is counted, those inside functions too, so no module reaches a module above it, and no module is over about
500 lines."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

CONTROLLER = Path(__file__).resolve().parents[1] / "dask_monarch" / "controller"

#: bottom to top: a module imports only modules before it
ORDER = [
    # helpers of the session, and the session's concerns
    "local", "dynamo_skip", "table", "topics", "debugger", "storage", "coalescing", "history", "task_keys", "propagation", "answers", "sockets", "tree", "channel", "future",
    "security",
    "at_exit",
    "bookkeeping", "liveness", "transport",
    "session",
    "process_group",
    "mesh",
    "value_mesh",
    # the frontend
    "tensor", "stream", "functions", "issue", "remote", "dispatch", "reduce", "to_mesh", "fetch", "cached_propagation", "actors",
    "recording", "compile_notices", "compile", "gradients", "report",
    # the public entry points
    "attach", "__init__",
]
SESSION_LAYER = ORDER[: ORDER.index("session") + 1]


def controller_imports(path: Path) -> set:
    """The controller modules that ``path`` imports (``from .x import ...``, ``from . import x``), anywhere in it."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                found.add(node.module.split(".")[0])
            else:
                found.update(alias.name for alias in node.names)
    return found


def test_every_controller_module_has_a_place_in_the_order():
    modules = {p.stem for p in CONTROLLER.glob("*.py")}
    assert modules == set(ORDER), f"place these in ORDER: {sorted(modules - set(ORDER))}; gone: {sorted(set(ORDER) - modules)}"


@pytest.mark.parametrize("module", ORDER)
def test_imports_run_one_way(module):
    below = set(ORDER[: ORDER.index(module)])
    upward = sorted(controller_imports(CONTROLLER / f"{module}.py") - below)
    assert not upward, f"controller/{module}.py imports {upward}, which sit above it (or beside it) in {ORDER}"


@pytest.mark.parametrize("module", SESSION_LAYER)
def test_the_session_imports_neither_the_mesh_nor_the_frontend(module):
    imported = controller_imports(CONTROLLER / f"{module}.py")
    assert not imported - set(SESSION_LAYER), f"controller/{module}.py imports {sorted(imported - set(SESSION_LAYER))}"


@pytest.mark.parametrize("path", sorted(CONTROLLER.parent.rglob("*.py")), ids=lambda p: str(p.relative_to(CONTROLLER.parent)))
def test_no_module_is_over_about_500_lines(path):
    assert len(path.read_text().splitlines()) <= 520, f"{path.name} is {len(path.read_text().splitlines())} lines"


def test_importing_dask_monarch_fills_in_every_frontend_operation():
    import dask_monarch  # noqa: F401
    from dask_monarch.controller.mesh import Frontend, frontend

    missing = [name for name in vars(Frontend) if not name.startswith("_") and getattr(frontend, name) is None]
    assert not missing, f"no frontend module registered {missing}"
