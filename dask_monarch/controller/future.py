"""``MonarchFuture``: the answer to a fetch or a status request (spec §1 "Fetch", §3).

It resolves once every rank has answered ``Status`` past its seq (``Session.sync``), so a failure on any rank that
the value depends on is known by then. Its wait is bounded: every ``liveness_interval`` it checks that the mesh is
alive (``liveness.py``), and a ``timeout`` names the ranks that did not answer. While it waits, a rank stopped in
pdb is driven from here (``debugger.py``).
"""

from __future__ import annotations

import concurrent.futures
import time

from ..exceptions import SessionError

__all__ = ["MonarchFuture"]


class MonarchFuture:
    """The answer to a fetch or a status request: ``result(timeout=None)`` (also ``get(timeout=None)``, Monarch's
    name), ``done()``, ``exception()``. Every future dask_monarch returns is one (fetches, remote functions'
    ``call``, actor endpoints).

    ``result`` waits as long as the mesh is alive and working; it raises ``RemoteException`` if the value
    depends on a failed invocation, ``SessionError`` if a worker failed fatally or left, and ``TimeoutError``
    (naming the ranks that did not answer) after ``timeout`` seconds.
    """

    def __init__(self, session, status_seq: int, describe: str):
        self._session = session
        self._future: concurrent.futures.Future = concurrent.futures.Future()
        self.status_seq = status_seq
        self._describe = describe
        #: rank -> the Dask future of the task that carries this wait's ``RequestStatus`` there, once submitted
        self.tasks: dict = {}

    @property
    def futures(self) -> list:
        """The Dask futures of the tasks this answer waits for (one per rank), e.g. for ``distributed.progress``;
        tasks that wait to be submitted (``Session(task_interval=)``) are submitted now."""
        if len(self.tasks) < self._session.world_size:
            self._session.submit_tasks_of(self.status_seq)
        return list(self.tasks.values())

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout: float | None = None):
        try:
            return self._result(timeout)
        except SessionError:
            self._session._failure_seen = True  # reported here, so mesh.exit() need not raise it again
            raise

    def get(self, timeout: float | None = None):
        """``result(timeout)``, by Monarch's name (``Future.get``)."""
        return self.result(timeout)

    def _result(self, timeout: float | None, notice=None):
        """``result``; ``notice``: ``(seconds, fn)``, ``fn()`` is called once if no answer came in that long."""
        start = time.monotonic()
        deadline = None if timeout is None else start + timeout
        while True:
            wait = self._session.liveness_interval
            if deadline is not None:
                wait = max(0.0, min(wait, deadline - time.monotonic()))
            debugger = getattr(self._session, "debugger", None)
            if debugger is None:
                concurrent.futures.wait((self._future,), timeout=wait)
            else:  # a rank stopped in pdb wakes the wait too, and is driven from here (debugger.py)
                concurrent.futures.wait((self._future, debugger.wake), timeout=wait,
                                        return_when=concurrent.futures.FIRST_COMPLETED)
                if debugger.wake.done():
                    served = time.monotonic()
                    debugger.serve()
                    served = time.monotonic() - served  # time at the pdb prompt counts against no timeout
                    start += served
                    deadline = None if deadline is None else deadline + served
            if self._future.done():
                return self._future.result()
            self._session.check_alive()
            if notice is not None and time.monotonic() - start >= notice[0]:
                notice, tell = None, notice[1]
                tell()
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(
                    f"{self._describe} was not answered within {timeout:g} s: "
                    f"{self._session.describe_pending(self.status_seq, diagnose=True)}"
                )

    def exception(self, timeout: float | None = None):
        try:
            self.result(timeout)
        except Exception as e:
            return e
        return None

    # set by the session
    def _set(self, value=None, error: BaseException | None = None) -> None:
        if self._future.done():
            return
        if error is not None:
            self._future.set_exception(error)
        else:
            self._future.set_result(value)


