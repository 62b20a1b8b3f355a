"""Notebook and debugging helpers (issue 24 item 5), as a Monarch program uses them: ``print(mesh.to_table())`` and
``dm.show(t, gpu=1)`` (a table on a terminal, HTML in a notebook); ``dask_monarch.random`` (``make_deterministic``,
``get_state``/``set_state``/``new_state``); the builtins ``log_remote``, ``set_logging_level_remote`` and the
random ones; ``breakpoint()`` in a remote function (a clear error, the session going on)."""

from __future__ import annotations

import logging
import re
import time

import pytest
import torch

import dask_monarch as dm
from dask_monarch.builtins.cuda import device_count, empty_cache, is_available, memory_allocated, memory_reserved
from dask_monarch.builtins.log import log_remote, set_logging_level_remote
from dask_monarch.builtins.misc import get_default_dtype_remote, set_default_dtype_remote
from dask_monarch.builtins.random import (
    get_rng_state_all_cuda_remote,
    get_rng_state_remote,
    manual_seed_all_cuda_remote,
    manual_seed_cuda_remote,
    random_seed_remote,
    seed_remote,
    set_manual_seed_remote,
    set_rng_state_all_cuda_remote,
    set_rng_state_remote,
)
from dask_monarch.controller import debugger, table
from test_remote_values import TIMEOUT, fetch, mesh  # noqa: F401 (mesh: a module-scoped 2x2 mesh of client4)


def rows(text: str) -> list:
    """The cells of each line of a text table below its rule, stripped."""
    lines = text.splitlines()
    rule = next(i for i, line in enumerate(lines) if set(line) <= set("-+") and line)
    return [[c.strip() for c in line.split("|")] for line in lines[rule + 1:]]


# ---------------------------------------------------------------------------------------------------- tables
def test_to_table_lays_each_ranks_worker_over_the_mesh_dims(mesh):
    text = mesh.to_table()
    assert isinstance(text, str)
    assert text.splitlines()[0].split("|")[0].strip() == "host \\ gpu"
    workers = mesh.workers
    expected = [[str(h)] + [f"{2 * h + g}: {workers[2 * h + g].removeprefix('tcp://')}" for g in range(2)]
                for h in range(2)]
    assert rows(text) == expected
    page = text._repr_html_()  # what a notebook shows
    assert page.startswith("<table>") and page.count("<tr>") == 3
    assert f"<td><code>3: {workers[3].removeprefix('tcp://')}</code></td>" in page


def test_to_table_of_a_reshaped_mesh_has_a_section_per_outer_coordinate(mesh):
    split = mesh.flatten("all").split(all=("dp", "pp", "tp"), pp=2, tp=1)
    text = split.to_table()
    assert re.findall(r"^dp=\d$", text, re.MULTILINE) == ["dp=0", "dp=1"]
    assert [r[1].split(":")[0] for r in rows(text.split("dp=1")[1])] == ["2", "3"]
    one = mesh.slice(host=1, gpu=0).to_table()  # no dimensions left: the one rank
    assert one.strip() == f"2: {mesh.workers[2].removeprefix('tcp://')}"


def test_show_prints_the_ranks_value_as_a_table(mesh, capsys):
    with mesh.activate():
        t = torch.arange(6.0).reshape(2, 3) + 10 * mesh.rank("host") + 100 * mesh.rank("gpu")
        dm.show(t)
        dm.show(t, host=1, gpu=1)
        out = capsys.readouterr().out
        dm.show({"sum": t.sum(), "n": 3}, gpu=1, host=0)
        tree = capsys.readouterr().out
    first, second = out.split("rank 3 (host=1, gpu=1): float32 [2, 3]")
    assert first.startswith("rank 0 (host=0, gpu=0): float32 [2, 3]")
    assert rows(first) == [["0", "0.0000", "1.0000", "2.0000"], ["1", "3.0000", "4.0000", "5.0000"]]
    assert rows(second) == [["0", "110.0000", "111.0000", "112.0000"], ["1", "113.0000", "114.0000", "115.0000"]]
    assert "rank 1 (host=0, gpu=1)['sum']: float32 []\n615.0000" in tree  # 6 * 100 + 15
    assert "rank 1 (host=0, gpu=1)['n']\n3" in tree


def test_show_of_a_value_mesh_tables_every_ranks_value(mesh, capsys):
    def coords(m):
        return f"h{m.dims['host'].rank}g{m.dims['gpu'].rank}"

    with mesh.activate():
        values = dm.remote(coords, propagate="inspect").call(mesh).get(timeout=TIMEOUT)
    dm.show(values)
    assert rows(capsys.readouterr().out) == [["0", "h0g0", "h0g1"], ["1", "h1g0", "h1g1"]]


def test_show_in_a_notebook_kernel_displays_html(mesh, monkeypatch, capsys):
    ipython_display = pytest.importorskip("IPython.display")
    shown = []
    monkeypatch.setattr(table, "_ipython_kernel", lambda: object())  # as inside a Jupyter kernel
    monkeypatch.setattr(ipython_display, "display", shown.append)
    with mesh.activate():
        dm.show(torch.ones(2) * mesh.rank("gpu"), host=0, gpu=1)
    (obj,) = shown
    assert "<td><code>1.0000</code></td>" in obj._repr_html_() and "rank 1 (host=0, gpu=1)" in obj
    assert capsys.readouterr().out == ""  # displayed, not printed


def test_large_tensors_are_shown_as_torch_prints_them():
    big = table.tensor_table(torch.zeros(40, 40), "local")
    assert "..." in big and big.startswith("local: float32 [40, 40]\ntensor(")
    assert table.tensor_table(torch.zeros(2, 2, 2), "x").count("dim1 \\ dim2") == 2


# ----------------------------------------------------------------------------------------- dask_monarch.random
def test_get_state_and_set_state_repeat_the_draws(mesh):
    with mesh.activate():
        dm.random.make_deterministic()
        state = dm.random.get_state()
        first = torch.rand(4)
        dm.random.set_state(state)
        second = torch.rand(4)
        seeded = dm.random.new_state(mesh.rank(("host", "gpu")) + 4)  # a seed per rank
        again = dm.random.new_state(mesh.rank(("host", "gpu")) + 4)
        dm.random.set_state(seeded)
        a = torch.rand(3).reduce("host", "stack").reduce("gpu", "stack")
        dm.random.set_state(again)
        b = torch.rand(3).reduce("host", "stack").reduce("gpu", "stack")
        dm.random.set_state(state)  # back where it started: new_state did not move the generator
        third = torch.rand(4)
        cpu, cuda = fetch(state, host=1, gpu=1)
        f, s, t, a, b = fetch((first, second, third, a, b))
        deterministic = dm.remote(torch.are_deterministic_algorithms_enabled, propagate="inspect").call().get(
            timeout=TIMEOUT)
    assert torch.equal(f, s) and torch.equal(f, t)
    assert torch.equal(a, b)
    assert len({tuple(row.tolist()) for row in a.reshape(4, 3)}) == 4  # each rank drew from its own seed
    with dm.no_mesh.activate():
        torch.manual_seed(6)
        assert torch.equal(a[0][1], torch.rand(3))  # a[gpu][host]: (host=1, gpu=0) is global rank 2, seed 6
    assert cpu.dtype == torch.uint8 and cpu.shape == torch.get_rng_state().shape
    assert cuda.numel() == 0  # CPU workers: no CUDA generator
    assert list(deterministic.values()) == [True] * 4
    with mesh.activate():  # put the workers back as other tests of this cluster expect them
        dm.remote(torch.use_deterministic_algorithms, propagate="inspect")(False)


# ------------------------------------------------------------------------------------------------- builtins
def test_builtin_seeds_and_states(mesh):
    with mesh.activate():
        set_manual_seed_remote(12345)
        t1 = torch.rand(5)
        set_manual_seed_remote(12345)
        t2 = torch.rand(5)
        set_manual_seed_remote(12345, process_idx=1)
        t3 = torch.rand(5)
        set_manual_seed_remote(12345, process_idx=mesh.rank("gpu"))  # a seed per rank
        per_rank = torch.rand(2).reduce("gpu", "stack")
        state = get_rng_state_remote()
        t4 = torch.rand(5)
        set_rng_state_remote(state)
        t5 = torch.rand(5)
        seed_remote()
        t6 = torch.rand(5)
        random_seed_remote()
        t7 = torch.rand(5)
        manual_seed_cuda_remote(1)
        manual_seed_all_cuda_remote(1)
        cuda_states = get_rng_state_all_cuda_remote()
        set_rng_state_all_cuda_remote(cuda_states)
        values = fetch((t1, t2, t3, per_rank, t4, t5, t6, t7, cuda_states, state), host=1, gpu=0)
    t1, t2, t3, per_rank, t4, t5, t6, t7, cuda_states, state = values
    with dm.no_mesh.activate():
        torch.manual_seed(12345)
        assert torch.equal(t1, torch.rand(5))
        torch.manual_seed(12345 ^ 1)
        assert torch.equal(t3, torch.rand(5))
        torch.manual_seed(12345 ^ 1)
        assert torch.equal(per_rank[1], torch.rand(2))  # gpu=1's seed is 12345 ^ 1
    assert torch.equal(t1, t2) and not torch.equal(t1, t3)
    assert torch.equal(t4, t5) and state.dtype == torch.uint8
    assert not torch.equal(t6, t7)
    assert cuda_states == []  # CPU workers


def test_builtin_default_dtype_and_cuda_queries(mesh):
    """Monarch's ``python/tests/builtins/test_misc.py`` (the default dtype set on the ranks and the controller, read
    back as values) and ``test_cuda.py`` on CPU workers (no device: counts 0, ``empty_cache`` does nothing)."""
    before = torch.get_default_dtype()
    try:
        with mesh.activate():
            original = get_default_dtype_remote()
            set_default_dtype_remote(torch.float64)
            t1 = torch.tensor([1.0])
            middle = get_default_dtype_remote()
            set_default_dtype_remote(torch.float32)
            t2 = torch.tensor([1.0])
            final = get_default_dtype_remote()
            empty_cache()
            counts = (device_count(), is_available(), memory_allocated(), memory_reserved())
            values = fetch((t1, t2, original, middle, final, counts), host=1, gpu=1)
    finally:
        torch.set_default_dtype(before)
    t1, t2, original, middle, final, counts = values
    assert (t1.dtype, t2.dtype) == (torch.float64, torch.float32)
    assert (original, middle, final) == (torch.float32, torch.float64, torch.float32)
    assert [c.item() for c in counts] == [0, 0, 0, 0] and counts[0].dtype == torch.int64


def test_log_remote_logs_on_every_rank_at_the_level_set(mesh, caplog):
    mesh.client.forward_logging("dask_monarch.builtins.log")  # Dask forwards the ranks' records to this process
    caplog.set_level(logging.DEBUG, logger="dask_monarch.builtins.log")
    with mesh.activate():
        set_logging_level_remote(logging.ERROR)
        log_remote("ignored info %s", "message", level=logging.INFO)
        log_remote("seen error %s %d", "message", 42, level=logging.ERROR)
        set_logging_level_remote(logging.INFO)
        log_remote("seen info message", level=logging.INFO)
        log_remote("a warning by default")
        dm.inspect(mesh.rank("gpu"))  # every call above has run on the rank the fetch waited for

    def seen():
        return [(r.levelno, r.getMessage(), r.worker) for r in caplog.records if r.name == "dask_monarch.builtins.log"]

    deadline = time.monotonic() + TIMEOUT
    while len(seen()) < 12 and time.monotonic() < deadline:  # forwarded records arrive as Dask events
        time.sleep(0.1)
    records = seen()
    assert sorted({w for _, _, w in records}) == sorted(mesh.workers.values())
    assert sorted({(level, text) for level, text, _ in records}) == [
        (logging.INFO, "seen info message"), (logging.WARNING, "a warning by default"),
        (logging.ERROR, "seen error message 42")]
    assert len(records) == 12


# ----------------------------------------------------------------------------------------------- breakpoint()
def stops_here(x):
    breakpoint()
    y = x * 10
    return y


def sets_a_trace(x):
    import pdb

    pdb.set_trace()
    return x + 1


def test_breakpoint_on_every_rank_is_driven_from_the_controller(mesh, monkeypatch, capsys):
    typed = []

    def terminal():  # what the user types at each prompt: look at x, step over a line, look at y, continue
        commands = ["p x.tolist()", "n", "p y.tolist()", "c"]
        line = commands[len(typed) % len(commands)]
        typed.append(line)
        return line

    monkeypatch.setattr(debugger, "read_line", terminal)
    with mesh.activate():
        x = torch.ones(2) * mesh.rank(("host", "gpu"))
        y = dm.remote(stops_here, propagate=lambda x: x.new_empty(x.shape))(x)
        values = fetch(y.reduce("host", "stack").reduce("gpu", "stack"))  # waits: every rank's pdb is driven here
    out = capsys.readouterr().out
    assert values.tolist() == [[[0.0, 0.0], [20.0, 20.0]], [[10.0, 10.0], [30.0, 30.0]]]  # [gpu][host]
    assert len(typed) == 16
    for rank in range(4):
        session = out.split(f"--- pdb on rank {rank} (worker {mesh.workers[rank]}) ---")[1].split("goes on ---")[0]
        assert f"(Pdb rank {rank}) " in session and "-> y = x * 10" in session and "stops_here()" in session
        assert f"[{float(rank)}, {float(rank)}]" in session  # p x.tolist()
        assert f"[{10.0 * rank}, {10.0 * rank}]" in session  # p y.tolist(), after n
    assert out.count("--- rank ") == 4


def test_end_of_input_quits_pdb_on_the_rank_and_the_session_goes_on(mesh, monkeypatch, capsys):
    def closed_stdin():
        raise EOFError

    monkeypatch.setattr(debugger, "read_line", closed_stdin)
    with mesh.activate():
        x = torch.ones(2)
        z = dm.remote(sets_a_trace, propagate=lambda x: x.new_empty(x.shape))(x)
        with pytest.raises(dm.RemoteException, match="BdbQuit"):
            fetch(z, host=1, gpu=1)
        doubled = fetch(x * 2, host=1, gpu=1)
    assert torch.equal(doubled, torch.full((2,), 2.0))  # the session goes on
    assert "-> return x + 1" in capsys.readouterr().out
