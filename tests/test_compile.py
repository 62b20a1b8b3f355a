"""``dm.compile`` (spec §7 "Client"; Monarch's ``compile``): Monarch's compile cases of test_coalescing.py
(spec §9) on CPU workers, with ``Compiled.recordings`` and a patched ``_record_and_define`` (Monarch's name) counting
recordings, plus errors inside replays, refused waits, and recordings across sub-meshes."""

from __future__ import annotations

from unittest.mock import patch

import pytest
import torch

import dask_monarch as dm
from dp_steps import dp_step, twin_mlps
from dask_monarch.controller.compile import _record_and_define
from dask_monarch.protocol import CallRecording, DefineRecording

TIMEOUT = 60


def inspect(x):
    return dm.fetch_shard(x).result(timeout=TIMEOUT)


def local():
    """Local torch again (checks on fetched values), also under ``mesh.activate()``."""
    return dm.no_mesh.activate()


def storage(t) -> int:
    return t._fake.untyped_storage()._cdata


def alias_pattern(tensors) -> list:
    """Monarch's ``assertAliases``: each tensor's storage numbered in order of first appearance."""
    seen: dict = {}
    return [seen.setdefault(storage(t), len(seen)) for t in tensors]


def _bogus(x, y):
    return x @ y  # 0-d tensors: "both arguments to matmul need to be at least 1D"


bogus = dm.remote(_bogus, propagate=lambda x, y: x + y)


# ---------------------------------------------------------------------------------------------- repeats
def test_repeat_simple(mesh1):
    with mesh1.activate():
        a = torch.zeros(())

        @dm.compile(verify=False)
        def fn():
            z = torch.ones(())
            a.add_(z)
            return z

        for _ in range(3):
            z = fn()
        assert inspect(a).item() == 3
        assert inspect(z).item() == 1
        assert fn.recordings == 1


def test_repeat_formals(mesh1):
    with mesh1.activate():
        a = torch.rand(3, 4)

        @dm.compile(verify=False)
        def fn(a, b):
            return 2 * a + b

        for _ in range(3):
            b = torch.rand(3, 4)
            z = fn(a, b)
            lz, la, lb = inspect((z, a, b))
            with local():
                assert torch.allclose(lz, 2 * la + lb)

        @dm.compile(verify=False)
        def captured(b):
            return 2 * a + b

        for _ in range(3):
            b = torch.rand(3, 4)
            z = captured(b)
            lz, la, lb = inspect((z, a, b))
            with local():
                assert torch.allclose(lz, 2 * la + lb)
        assert fn.recordings == captured.recordings == 1


def test_repeat_error_inside(mesh1):
    with mesh1.activate():
        a = torch.zeros(())

        @dm.compile(verify=False)
        def fn():
            z = torch.ones(())
            a.add_(z)
            bogus(z, z)
            return z

        z = fn()
        with pytest.raises(dm.RemoteException, match="both arguments to matmul") as info:
            inspect(z)
        # the error names the compiled function, the failing operation (position and what it called) and the rank
        text = str(info.value)
        assert "compiled function" in text and "fn" in text and "_bogus" in text
        assert "operation 2 of 3" in text and "rank 0" in text
        with pytest.raises(dm.RemoteException, match="both arguments to matmul"):  # a, mutated, carries it too
            inspect(a)


def test_repeat_inner_borrow(mesh1):
    with mesh1.activate():
        a = torch.zeros(())
        other = dm.Stream("other")
        with other.activate():
            b = torch.ones(())

        @dm.compile(verify=False)
        def fn():
            c, borrow = dm.get_active_stream().borrow(b)
            with borrow:
                a.add_(c)

        for _ in range(3):
            fn()
        assert inspect(a).item() == 3


def test_repeat_outer_borrow(mesh1):
    with mesh1.activate():
        a = torch.zeros(())
        other = dm.Stream("other")
        with other.activate():
            b = torch.ones(())
        c, borrow = dm.get_active_stream().borrow(b)

        @dm.compile(verify=False)
        def fn():
            nonlocal c
            a.add_(c)
            z = torch.rand(3, 4)
            del c  # the Python runs once: later calls replay the recording
            return z

        with borrow:
            for _ in range(3):
                z = fn()
        assert inspect(a).item() == 3
        inspect(z)


def test_outer_borrow_cannot_be_dropped_inside(mesh1):
    with mesh1.activate():
        other = dm.Stream("other")
        with other.activate():
            b = torch.ones(())
        c, borrow = dm.get_active_stream().borrow(b)

        @dm.compile
        def fn():
            d = c + 1
            borrow.drop()
            return d

        with pytest.raises(RuntimeError, match="made outside"):
            fn()
        borrow.drop()
        assert inspect(b).item() == 1  # nothing of the failed recording was sent


def test_undropped_inner_borrow(mesh1):
    with mesh1.activate():
        x = torch.ones(2)
        keep = []

        @dm.compile
        def fn():
            keep.append(dm.Stream("side").borrow(x))

        with pytest.raises(RuntimeError, match="must be dropped inside"):
            fn()
        x.add_(1)  # the borrow made inside was forgotten: x is writable again
        assert inspect(x).tolist() == [2.0, 2.0]


# ----------------------------------------------------------------------------------------------- aliasing
def test_compile_aliasing(mesh1):
    with mesh1.activate():

        @dm.compile(verify=False)
        def add(a, b):
            return a + b

        @dm.compile(verify=False)
        def return_cond(a, b, c):
            return a if c else b

        a = torch.rand(3, 4)
        b = torch.rand(3, 4)
        r = add(a, b)
        assert r.size() == (3, 4)
        r2 = add(b, a)
        assert add.recordings == 1
        assert alias_pattern([a, b, r2, r]) == [0, 1, 2, 3]

        c = torch.rand(4)
        d = torch.rand(4, 4)
        e = add(c, d)
        assert e.size() == (4, 4)
        e = add(c, torch.rand(4, 4))
        assert e.size() == (4, 4)
        assert add.recordings == 2

        r = add(a, 4)
        assert add.recordings == 3 and alias_pattern([r, a]) == [0, 1]

        r0 = return_cond(a, b, True)
        assert alias_pattern([a, b, r0]) == [0, 1, 0]
        r1 = return_cond(b, a, True)
        assert alias_pattern([a, b, r1]) == [0, 1, 1]
        assert return_cond.recordings == 1
        r0 = return_cond(a, b, False)
        assert alias_pattern([a, b, r0]) == [0, 1, 1]
        r1 = return_cond(a, b, False)
        assert alias_pattern([b, a, r1]) == [0, 1, 0]
        assert return_cond.recordings == 2
        lr0, lb = inspect((r0, b))
        with local():
            assert torch.equal(lr0, lb)

        @dm.compile(verify=False)
        def captured(b):
            return a + b

        r = captured(b)
        assert alias_pattern([a, b, r]) == [0, 1, 2]
        assert captured(torch.rand(3, 4)).size() == (3, 4)
        assert captured.recordings == 1
        captured(a)  # an input that aliases a capture: a recording of its own
        captured(a)
        assert captured.recordings == 2

        @dm.compile(verify=False)
        def weird(f, g):
            o = f + g
            return o, o[0], f[0], g[0], a[0]

        r0, r1, r2, r3, r4 = weird(c, d)
        assert alias_pattern([c, d, a, r0, r1, r2, r3, r4]) == [0, 1, 2, 3, 3, 0, 1, 2]
        lc, ld, la, l0, l1, l2, l3, l4 = inspect((c, d, a, r0, r1, r2, r3, r4))
        with local():
            assert torch.equal(l0, lc + ld) and torch.equal(l1, l0[0]) and torch.equal(l2, lc[0])
            assert torch.equal(l3, ld[0]) and torch.equal(l4, la[0])


def test_compile_input_permissions(mesh1):
    with mesh1.activate():
        a = torch.rand(3, 4)

        @dm.compile(verify=False)
        def add(b):
            return a + b

        add(torch.rand(3, 4))
        other = dm.Stream("other")
        ab, borrow = other.borrow(a, mutable=True)
        with borrow:
            with pytest.raises(TypeError, match="BORROWED"):
                add(torch.rand(3, 4))
        add(torch.rand(3, 4))  # readable again
        ab, borrow = other.borrow(a)
        with borrow:
            add(torch.rand(3, 4))
        with other.activate():
            c = torch.rand(3, 4)
        c, borrow = dm.get_active_stream().borrow(c)
        with borrow:
            inspect(add(c))
        assert add.recordings == 1
        a.drop()
        with pytest.raises(TypeError, match="DROPPED"):
            add(torch.rand(3, 4))


def test_compile_verify(mesh1):
    with mesh1.activate():
        a = torch.rand(3, 4)

        @dm.compile(verify=True)
        def add(b):
            return a + b

        with patch("dask_monarch.controller.compile._record_and_define", side_effect=_record_and_define) as rec:
            for _ in range(3):
                add(torch.rand(3, 4))
        assert add.recordings == 2  # recorded, then recorded again once to verify
        assert rec.call_count == 2  # both through Monarch's _record_and_define; the third call replayed

        c = False

        @dm.compile(verify=True)
        def add_broken(b):
            x = torch.zeros(3, 4) if c else torch.rand(3, 4)
            return x.add(b)

        add_broken(torch.rand(3, 4))
        c = True
        with pytest.raises(RuntimeError, match="diverges at operation"):
            add_broken(torch.rand(3, 4))


def test_dropped(mesh1):
    with mesh1.activate():
        a = torch.rand(3, 4)
        b = None

        @dm.compile(verify=False)
        def foo():
            nonlocal b
            b = a + a

        foo()
        with pytest.raises(TypeError, match="(?s)DROPPED.*compiled function"):
            b.add(4)


def test_arguments_that_require_grad_are_refused(mesh1):
    with mesh1.activate():

        @dm.compile
        def foo(x):
            return x

        with pytest.raises(TypeError, match="REQUIRES_GRAD"):
            foo(torch.rand(3, requires_grad=True))
        y = torch.rand(3, requires_grad=True)

        @dm.compile
        def returnit():
            return y * 2

        out = returnit()  # unlike Monarch, a result that requires grad is returned detached
        assert not out.requires_grad
        lo, ly = inspect((out, y.detach()))
        with local():
            assert torch.allclose(lo, ly * 2)


def test_mutate_inputs(mesh1):
    """CallRecording defines the outputs and every alias of the mutated inputs; it uses the inputs."""
    session = mesh1._session
    with mesh1.activate():
        stream = dm.Stream("borrow")

        @dm.compile(verify=False)
        def foo(x_not_mutated, w_not_mutated, y, y_alias, z, z_alias):
            u = x_not_mutated.mul(2.0) + w_not_mutated + z_alias.unsqueeze(0).repeat(3, 1)
            v = y.add(5.0)
            borrowed, y_alias_borrow = stream.borrow(y_alias, mutable=True)
            with stream.activate():
                borrowed.add_(1.0)
            y_alias_borrow.drop()
            z.add_(1.0)
            return u, v

        x = torch.rand(3, 3)
        w = torch.rand(3, 3)
        y = torch.rand(3, 3)
        y_alias = y.reshape(-1)
        z = torch.rand(3, 3)
        z_alias = z[0, :]
        ly, lz = inspect((y, z))
        record = session.record
        calls = []

        def spy(seq, defs, uses, what=""):
            calls.append((defs, uses, what))
            return record(seq, defs, uses, what)

        session.record = spy
        try:
            for k in range(2):
                calls.clear()
                u, v = foo(x, w, y, y_alias, z, z_alias)
                defs, uses, what = [c for c in calls if "compiled function" in str(c[2])][0]
                mutated = {t.ref.id for t in session.aliases_of([y, y_alias, z, z_alias])}
                assert {t.ref.id for t in defs} == mutated | {u.ref.id, v.ref.id}
                assert {t.ref.id for t in uses} == {t.ref.id for t in (x, w, y, y_alias, z, z_alias)}
        finally:
            session.record = record
        ly2, lz2, lu, lv = inspect((y, z, u, v))
        with local():
            assert torch.allclose(ly2, ly + 2) and torch.allclose(lz2, lz + 2)
            assert torch.allclose(lv, ly + 6)  # v read y after the first call's increment


# ---------------------------------------------------------------------------------------- waits and blocks
def test_fetch_inside_is_refused(mesh1):
    with mesh1.activate():
        x = torch.ones(2)

        @dm.compile
        def fetches(t):
            return dm.inspect(t + 1)

        with pytest.raises(RuntimeError, match="inside compiled function"):
            fetches(x)

        @dm.compile
        def coalesces(t):
            with dm.coalescing():
                return t + 1

        with pytest.raises(RuntimeError, match="coalescing\\(\\) inside compiled function"):
            coalesces(x)
        assert inspect(x + 1).tolist() == [2.0, 2.0]  # the session works on


def test_compiled_inside_coalescing_runs_eagerly(mesh1):
    with mesh1.activate():
        x = torch.ones(2)
        add = dm.compile(lambda t: t + 1)
        with dm.coalescing():
            y = add(x)
        assert add.recordings == 0
        assert inspect(y).tolist() == [2.0, 2.0]


def test_bad_arguments(mesh1):
    with mesh1.activate():
        f = dm.compile(lambda t, opts: t)
        with pytest.raises(TypeError, match="not hashable"):
            f(torch.ones(2), bytearray(b"options"))
        with dm.no_mesh.activate():
            local = torch.ones(2)
        with pytest.raises(TypeError, match="LOCAL_TENSOR"):
            f(local, 1)
    with pytest.raises(TypeError, match="verify must be a bool"):
        dm.compile(lambda: None, verify="yes")
    with pytest.raises(ValueError, match="warmup"):
        dm.compile(lambda: None, warmup=-1)


def test_one_message_per_rank_per_call(mesh2x2):
    """A replay is one CallRecording per rank, whatever the recording's length; the definition is sent once,
    in chunks of at most 1,000 commands."""
    session = mesh2x2._session
    sent = []
    send = session.send

    def spy(message, ranks=None):
        sent.append((type(message), tuple(ranks) if ranks is not None else session._all, message))
        return send(message, ranks)

    session.send = spy
    try:
        with mesh2x2.activate():
            x = torch.ones(4)
            step = dm.compile(lambda t: [t := t * 1.0001 + 0.5 for _ in range(600)][-1], verify=False)
            step(x)
            defines = [(ranks, m) for kind, ranks, m in sent if kind is DefineRecording]
            assert all(len(m.commands) <= 1000 for _, m in defines)
            assert {m.index for _, m in defines} == {0, 1} and {m.ntotal_messages for _, m in defines} == {2}
            sent.clear()
            y = step(x)
            assert [kind for kind, _, _ in sent] == [CallRecording]
            assert sent[0][1] == (0, 1, 2, 3)
    finally:
        session.send = send
    lx, ly = inspect((x, y))
    expected = lx.clone()
    for _ in range(600):
        expected = expected * 1.0001 + 0.5
    assert torch.equal(ly, expected)


def test_across_mesh(mesh2x2):
    m0 = mesh2x2.slice(host=0)
    m1 = mesh2x2.slice(host=1)

    @dm.compile
    def foo(a, b):
        with m0.activate():
            r0 = a + a
        with m1.activate():
            r1 = b + b
        return r0, r1

    with m0.activate():
        a = torch.rand(3, 4)
    with m1.activate():
        b = torch.rand(3, 4)
    for _ in range(3):
        r0, r1 = foo(a, b)
    la, l0 = inspect((a, r0))
    lb, l1 = dm.fetch_shard((b, r1)).result(timeout=TIMEOUT)
    assert torch.equal(l0, la + la) and torch.equal(l1, lb + lb)
    assert foo.recordings == 2


def test_replay_reduce(mesh2x2):
    """A recording with a collective: each rank's value summed over "gpu", replayed."""
    with mesh2x2.activate():
        x = torch.ones(2) + mesh2x2.rank("gpu")

        @dm.compile
        def total(t):
            return (t * 2).reduce("gpu", "sum")

        for _ in range(3):
            out = total(x)
        assert dm.fetch_shard(out, host=1, gpu=1).result(timeout=TIMEOUT).tolist() == [6.0, 6.0]


# ------------------------------------------------------------------------------------------ training steps
def test_compiled_training_step_matches_eager(client2):
    """Beyond Monarch: a whole data-parallel step of an nn.Module (forward, backward, reduce_ of the gradients,
    SGD with momentum, zero_grad) compiled gives the same parameters, bit for bit, as the same step run eagerly on
    the mesh."""
    with dm.attach(client2, dims={"dp": 2}, comm_timeout=60) as mesh, mesh.activate():
        dm.remote(torch.manual_seed, propagate="inspect")(0)
        models = twin_mlps()
        optimizers = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in models]
        x = torch.randn(64, 16) + mesh.rank("dp")  # each rank its own data
        y = torch.randint(0, 4, (64,))
        eager = dp_step(models[0], optimizers[0], "dp")
        compiled = dm.compile(dp_step(models[1], optimizers[1], "dp"), warmup=1)
        losses = []
        for i in range(6):
            rows = slice(8 * i, 8 * i + 8)
            xb, yb = x[rows], y[rows]
            losses.append((eager(xb, yb).detach(), compiled(xb, yb)))
        assert compiled.recordings == 2  # call 0 eager (warm-up), 1 recorded, 2 verified, 3-5 replayed
        for dp in (0, 1):
            got = dm.fetch_shard(([list(m.parameters()) for m in models], losses), dp=dp).result(timeout=TIMEOUT)
            (eager_params, compiled_params), step_losses = got
            with local():
                for a, b in zip(eager_params, compiled_params):
                    assert torch.equal(a, b)
                for a, b in step_losses:
                    assert torch.equal(a, b)
                assert not torch.equal(eager_params[0], got[0][0][0] * 0)  # the parameters did move


def test_batches_sliced_at_other_rows_share_a_recording(mesh1):
    """Storage offsets count only relative to the other arguments: x[0:4], x[4:8], ... replay one recording, and a
    result that views its argument views the right rows."""
    with mesh1.activate():
        x = torch.arange(16.0)
        first = dm.compile(lambda t: (t * 2, t[1:]), verify=False)
        outs = [first(x[4 * k:4 * k + 4]) for k in range(4)]
        assert first.recordings == 1
        values = inspect(outs)
        with local():
            for k, (doubled, tail) in enumerate(values):
                rows = torch.arange(4.0 * k, 4.0 * k + 4)
                assert torch.equal(doubled, rows * 2) and torch.equal(tail, rows[1:])
        assert [o[1]._fake.storage_offset() for o in outs] == [1, 5, 9, 13]


def test_the_active_mesh_is_part_of_the_key(client2):
    """A function without tensor arguments records once per active mesh: its factories run there."""
    make = dm.compile(lambda: torch.ones(2) * 3, verify=False)
    with dm.attach(client2, dims={"a": 2}) as mesh_a, dm.attach(client2, dims={"b": 2}) as mesh_b:
        with mesh_a.activate():
            ra = make()
        with mesh_b.activate():
            rb = make()
        assert ra.mesh is mesh_a and rb.mesh is mesh_b and make.recordings == 2
        assert inspect(ra).tolist() == inspect(rb).tolist() == [3.0, 3.0]


def test_argument_structure_is_part_of_the_key(mesh1):
    """Calls whose leaves coincide but whose structure differs (keyword order, a list instead of two arguments)
    are different recordings."""
    with mesh1.activate():
        x = torch.full((2,), 3.0)
        f = dm.compile(lambda t, p=0, q=0: t * p + q)
        for _ in range(3):
            f(x, p=2, q=5)
        r = f(x, q=2, p=5)
        g = dm.compile(lambda t, *rest: t * len(rest))
        g(x, 1, 2)
        r2 = g(x, [1, 2])
        assert f.recordings == 3 and g.recordings == 2
        assert inspect(r).tolist() == [17.0, 17.0] and inspect(r2).tolist() == [3.0, 3.0]


def test_verify_ignores_which_outside_aliases_are_alive(mesh1):
    """A function that updates a captured tensor and returns it: the previous result (an alias of the capture) is
    alive at the verifying call, which is not a divergence."""
    with mesh1.activate():
        count = torch.zeros(())

        @dm.compile
        def tick():
            count.add_(1)
            return count

        results = [tick() for _ in range(3)]
        assert [inspect(r).item() for r in results] == [3.0, 3.0, 3.0]  # each result aliases count
        assert inspect(count).item() == 3.0


def test_other_threads_are_not_recorded(mesh1):
    """While one thread records a compiled function, another thread's operations on the session go out as usual
    (they were captured into the recording: replayed on every call, and a fetch failed the session)."""
    import threading

    with mesh1.activate():
        b = torch.zeros(2)
        x = torch.ones(2)
    inside, done = threading.Event(), threading.Event()

    def slow(t):
        inside.set()
        done.wait(30)
        return t * 2

    step = dm.compile(slow, verify=False)
    other_result = {}

    def other():
        inside.wait(30)
        with mesh1.activate():
            b.add_(1)
            other_result["value"] = dm.inspect(b + 0)
        done.set()

    thread = threading.Thread(target=other)
    thread.start()
    with mesh1.activate():
        y = step(x)
        thread.join(60)
        for _ in range(2):
            y = step(x)
    assert other_result["value"].tolist() == [1.0, 1.0]
    assert inspect(b).tolist() == [1.0, 1.0] and inspect(y).tolist() == [2.0, 2.0]


def test_grad_mode_is_part_of_the_key(mesh1):
    with mesh1.activate():
        w = torch.ones(3, requires_grad=True)
        f = dm.compile(lambda t: (w * t).sum(), verify=False)
        with torch.no_grad():
            f(torch.ones(3))
        out = f(torch.ones(3))
        assert f.recordings == 2 and not out.requires_grad


def test_verify_compares_non_tensor_results(mesh1):
    with mesh1.activate():
        calls = {"n": 0}

        @dm.compile
        def counted(t):
            calls["n"] += 1
            return t + 1, calls["n"]

        counted(torch.ones(2))
        with pytest.raises(RuntimeError, match="diverges in its non-tensor results"):
            counted(torch.ones(2))


def test_dropped_tensors_are_refused_by_reduce_and_fetch(mesh1):
    with mesh1.activate():
        keep = {}

        @dm.compile
        def f(t):
            keep["y"] = t * 5
            return t + 1

        f(torch.ones(2))
        with pytest.raises(TypeError, match="DROPPED"):
            keep["y"].reduce("workers")
        with pytest.raises(TypeError, match="DROPPED"):
            dm.fetch_shard(keep["y"])
        x = torch.ones(2)
        x.drop()
        with pytest.raises(TypeError, match="DROPPED"):
            dm.inspect(x)
        with pytest.raises(TypeError, match="DROPPED"):
            x.reduce_("workers")


def test_many_recordings_warn(mesh1):
    with mesh1.activate():
        f = dm.compile(lambda t, lr: t * lr, verify=False)
        f.MANY_RECORDINGS = 3
        x = torch.ones(2)
        with pytest.warns(RuntimeWarning, match="4 recordings"):
            for k in range(4):
                f(x, 0.1 * k)
