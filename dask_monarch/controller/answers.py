"""``Answers``: the thread that collects a session's task results, so that no fault can wedge the controller
(DESIGN.md "Decisions": a failure never turns into a hang).

Dask runs every ``Future.add_done_callback`` callback of a process on one shared thread
(``Dask-Callback-Thread``). A callback that waits there stops every later answer in the process, of every session
and ``Client``: ``fut.result()`` on a task whose worker died after computing it never returns, because Dask
reschedules the lost key onto the pinned, dead worker ("Couldn't gather 1 keys, rescheduling ...") and waits for
it. So a session uses no such callback. ``distributed.as_completed`` tracks its tasks on the client's event loop,
and the session's own ``monarch-<tag>-answers`` thread takes each finished task and hands it to the session
(``Session._on_sync_done`` / ``_on_batch_done``), which reads the result through ``result``: ``Client.gather``
runs on the event loop and is awaited here in slices of ``SLICE`` seconds, and given up (``AnswerLost``) as soon
as the result is lost (the future's status leaves ``finished``: its worker died) or the session has failed or
stopped. Only that session fails; the thread ends with the session: ``stop`` wakes it (a gather it waits for
included) and joins it, so that ``mesh.exit()`` returns with the thread gone and nothing of the session held by
it.

The answer chunks that the session's answer channels bring (``channel.py``, ``put_chunk``) are applied on the
client's event loop as they arrive when that is cheap and cannot wait (``Session._chunk_inline``: a thread switch
less on every fetch), else by this thread; whoever applies a chunk, a rank's chunks are applied in their order,
under the session lock, with those that come in task results.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque

from distributed import as_completed

__all__ = ["Answers", "AnswerLost"]

logger = logging.getLogger("dask_monarch.controller")


class AnswerLost(Exception):
    """A finished task's result could not be collected: lost with its worker, or the session ended first."""


class Answers:
    """Collects the results of ``session``'s tasks on a thread of its own.

    ``add(future, sync)``: call ``session._on_sync_done(future)`` (``sync``) or ``session._on_batch_done(future)``
    once ``future`` is done (finished, errored, cancelled), in the order they finish. ``put_chunk(rank, blob)`` (on
    the event loop): apply it there (``session._chunk_inline``) or call ``session._on_chunk(rank, ...)`` on the
    thread. ``stop()`` cancels what is still pending and ends the thread."""

    #: seconds between checks of a result being gathered (lost? session over?)
    SLICE = 0.5
    #: seconds ``stop`` waits for the thread to end (it is woken at once; it ends unless applying an answer hangs)
    JOIN_TIMEOUT = 10.0

    def __init__(self, session, tag: str):
        self._session = session
        self._client = session.client
        self._done = as_completed(loop=self._client.loop)
        self._waiting: dict = {}  # key -> (future, whether its result is answers), until handed over
        self._chunks: deque = deque()  # (rank, pickled chunk) from the answer channels
        self._wake = self._done.thread_condition  # as_completed notifies it when a future is done
        self._stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"monarch-{tag}-answers", daemon=True)
        self.thread.start()

    def add(self, future, sync: bool) -> None:
        self._waiting[future.key] = (future, sync)
        self._done.add(future)

    def put_chunk(self, rank: int, blob: bytes) -> None:
        """An answer chunk of rank ``rank`` came on its channel (``channel.py``; on the event loop). Applied right
        here when that is cheap (``Session._chunk_inline``), else by this thread, in order after those queued."""
        if not self._chunks:
            try:
                blob = self._session._chunk_inline(rank, blob)
            except Exception:  # a bug here must not end the channel: later answers still count
                logger.exception("dask_monarch: could not apply an answer of rank %d", rank)
                return
            if blob is None:
                return
        self._chunks.append((rank, blob))
        with self._wake:
            self._wake.notify()

    def stop(self) -> None:
        """Stop collecting: cancel the tasks still pending (tasks pinned to a worker that left would otherwise stay
        ``no-worker`` on the scheduler for as long as this client lives) and end the thread. Called while the
        client is still open (``Session.stop``)."""
        self._stopped.set()
        self._done.clear()
        with self._wake:
            self._wake.notify()
        pending = [f for f, _ in list(self._waiting.values()) if not f.done()]
        self._waiting.clear()
        if pending and not self._session.scheduler_gone():  # a scheduler that died forgot them (and would not answer)
            try:
                self._client.cancel(pending)
            except Exception:  # the client is closing: its tasks go with it
                pass
        if threading.current_thread() is not self.thread:
            self.thread.join(self.JOIN_TIMEOUT)
            if self.thread.is_alive():
                logger.warning("dask_monarch: %s did not end within %s s of the session's end",
                               self.thread.name, self.JOIN_TIMEOUT)

    def _notify(self, _=None) -> None:
        with self._wake:
            self._wake.notify_all()

    def _run(self) -> None:
        done, chunks, wake = self._done, self._chunks, self._wake
        watch_every = self._session.SCHEDULER_WATCH
        watch_at = time.monotonic() + watch_every
        while not self._stopped.is_set():
            if time.monotonic() >= watch_at:  # the scheduler's death fails the session even if nobody waits
                watch_at = time.monotonic() + watch_every
                try:
                    self._session.watch_scheduler()
                except Exception:  # a bug here must not end the thread: later answers still count
                    logger.exception("dask_monarch: could not check the connection to the scheduler")
            while chunks:
                rank, blob = chunks.popleft()
                try:
                    self._session._on_chunk(rank, blob)
                except Exception:  # a bug here must not end the thread: later answers still count
                    logger.exception("dask_monarch: could not apply an answer of rank %d", rank)
                blob = None  # a fetched tensor is the program's now: not kept here until the next chunk
            if done.has_ready():
                for future in done.next_batch(block=False):
                    if self._stopped.is_set():
                        break
                    self._deliver(future)
                continue
            with wake:  # as_completed and put_chunk notify holding it: no notice is missed
                if not chunks and not done.has_ready() and not self._stopped.is_set():
                    wake.wait(0.1)

    def _deliver(self, future) -> None:
        entry = self._waiting.pop(future.key, None)
        if entry is None:
            return
        session = self._session
        try:
            if entry[1]:
                session._on_sync_done(future)
            else:
                session._on_batch_done(future)
        except Exception:  # a bug here must not end the thread: later answers still count
            logger.exception("dask_monarch: could not apply the answer of %s", future.key)

    # ------------------------------------------------------------------------------------------ results
    def result(self, future):
        """The result of done ``future``, gathered on the client's event loop. Raises the task's error,
        ``CancelledError``, or ``AnswerLost`` if the result is or becomes lost (its worker died before the controller
        collected it; the future is then cancelled, so that the scheduler forgets the key instead of waiting
        for the dead worker) or the session has failed or stopped meanwhile."""
        client = self._client
        status = future.status
        if status != "finished":  # lost since it finished (its worker died), or never finished
            future.cancel()
            raise AnswerLost(f"Dask future status {status!r}")

        async def gather():
            # errors="skip": a result Dask cannot fetch any more is this session's to report (AnswerLost, then the
            # session's own error naming the rank), so Dask logs its "Couldn't gather ... rescheduling" at DEBUG,
            # not as a warning on the program's stderr (seen when a program closes its Client under a session)
            got = await client.gather([future], errors="skip", asynchronous=True)
            if not got:
                raise AnswerLost(f"Dask future status {future.status!r}")
            return got[0]

        pending = asyncio.run_coroutine_threadsafe(gather(), client.loop.asyncio_loop)
        pending.add_done_callback(self._notify)  # wakes the wait below, as ``stop`` does
        while True:
            with self._wake:
                if not pending.done() and not self._stopped.is_set():
                    self._wake.wait(self.SLICE)
            if pending.done():
                return pending.result()
            status = future.status
            lost = status != "finished"
            if lost or self._stopped.is_set() or self._session.failure is not None:
                # the gather itself is left to end on its own: it may share one request with other gathers of
                # this client (Client._gather coalesces them), which cancelling it would fail too
                if lost:
                    future.cancel()  # ends the gather's wait for a recompute that never comes
                raise AnswerLost(f"Dask future status {status!r}" if lost else "the session ended")

    def exception(self, future) -> BaseException:
        """The error of errored ``future`` (already on the controller: no wait on a worker)."""
        try:
            return future.exception(timeout=self._session.PROBE_TIMEOUT)
        except Exception as e:
            return e
