"""The answer channel's fast path (issue 13 item 1; ``controller/channel.py``, ``controller/answers.py``,
``worker/channel.py``): a chunk applied on the controller's event loop when that is cheap, by the answers thread
otherwise, always in the rank's chunk order; acknowledgements that travel with the next batch, or alone soon."""

from __future__ import annotations

import asyncio
import time

import torch

import dask_monarch as dm
from dask_monarch.worker.plugin import PLUGIN_NAME

TIMEOUT = 60


def _retained(session_id: str, dask_worker=None) -> int:
    """How many pushed answer chunks the worker still keeps for want of an acknowledgement (run with ``Client.run``)."""
    tw = dask_worker.plugins[PLUGIN_NAME].sessions.get(session_id)
    return -1 if tw is None else len(tw.outbox._retained)


def test_an_answer_that_comes_while_the_session_lock_is_held_waits_for_it_without_blocking_the_event_loop(client1):
    """A program thread holding the session lock (a send, a fetch being set up) must not stop the client's event
    loop, which reads the answer meanwhile: the answer is applied once the lock is free, and the fetch gets its
    value (spec §1 "Fetch")."""
    mesh = dm.attach(client1, dims={"workers": 1}, comm_timeout=60)
    try:
        session = mesh._session
        with mesh.activate():
            t = torch.arange(4.0) * 3
        with session.lock:  # a reentrant lock: taken before the fetch is sent, so its answer cannot come before
            fut = dm.fetch_shard(t)
            time.sleep(0.5)  # the answer comes meanwhile
            client1.sync(asyncio.sleep, 0.01, callback_timeout=10)  # the event loop still runs
            assert not fut.done(), "an answer was applied while the session lock was held elsewhere"
        assert torch.equal(fut.result(timeout=TIMEOUT), torch.arange(4.0) * 3)
    finally:
        mesh.exit()


def test_a_large_answer_and_small_ones_after_it_apply_in_order(client1):
    """A fetched value larger than ``INLINE_CHUNK`` is applied by the answers thread, the small answers after it
    possibly on the event loop: each fetch still gets its own value, and a sync after them resolves."""
    mesh = dm.attach(client1, dims={"workers": 1}, comm_timeout=60)
    try:
        session = mesh._session
        n = session.INLINE_CHUNK // 4 * 4  # float32: 4 times the inline limit in bytes
        with mesh.activate():
            big = torch.arange(float(n))
            small = [torch.full((2,), float(i)) for i in range(5)]
        futures = [dm.fetch_shard(big)] + [dm.fetch_shard(s) for s in small]
        done = session.sync("after the fetches")
        assert torch.equal(futures[0].result(timeout=TIMEOUT), torch.arange(float(n)))
        for i, fut in enumerate(futures[1:]):
            assert torch.equal(fut.result(timeout=TIMEOUT), torch.full((2,), float(i)))
        done.result(timeout=TIMEOUT)
    finally:
        mesh.exit()


def test_answer_chunks_are_acknowledged_when_no_batch_follows(client1):
    """The controller acknowledges a rank's answer chunks with its next batch, or alone a little later when no
    batch follows: the worker then keeps none of them (``Outbox.acked``)."""
    mesh = dm.attach(client1, dims={"workers": 1}, comm_timeout=60)
    try:
        session = mesh._session
        assert session.channels is not None and session.channels.comms[0] is not None
        with mesh.activate():
            t = torch.ones(3)
        for _ in range(3):
            assert torch.equal(dm.inspect(t), torch.ones(3))
        deadline = time.monotonic() + TIMEOUT
        while (left := client1.run(_retained, session.id)) and any(v != 0 for v in left.values()):
            assert time.monotonic() < deadline, f"the worker still keeps {left} unacknowledged answer chunks"
            time.sleep(0.05)
    finally:
        mesh.exit()
