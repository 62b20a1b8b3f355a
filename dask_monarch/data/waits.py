"""The waits of ``dask_monarch.data`` on Dask futures, through the mesh's own ``Client`` (never Dask's default
client: a mesh attached to a ``Client(..., set_as_default=False)`` works outside ``with mesh:``), bounded."""

from __future__ import annotations

import time

from distributed.client import _wait

__all__ = ["wait_futures"]


def wait_futures(mesh, futures: list, timeout: float, what: str, names) -> None:
    """Wait at most ``timeout`` seconds until every one of ``futures`` (Dask futures of ``mesh.client``) is done
    (finished, failed or cancelled). ``names(pending)`` says what was not done and on whom, for the
    ``TimeoutError`` raised at ``timeout``.

    It waits in slices of the session's ``liveness_interval``: after each, a session that failed (or whose worker
    left the cluster, ``check_alive``) ends the wait with the session's ``SessionError`` (naming the rank and its
    worker), not the whole ``timeout``."""
    session = mesh._session
    deadline = time.monotonic() + timeout
    pending = [f for f in futures if not f.done()]
    while pending:
        if session.failure is not None:
            raise session.failure
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"{what}: {names(pending)} within {timeout} s")
        try:
            mesh.client.sync(_wait, pending, timeout=min(left, session.liveness_interval))
        except TimeoutError:
            if not session.closed:
                session.check_alive()  # raises the session's error when a rank's worker is gone
        pending = [f for f in pending if not f.done()]
