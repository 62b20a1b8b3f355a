"""The waits of ``dask_monarch.data`` on Dask futures, through the mesh's own ``Client`` (never Dask's default
client: a mesh attached to a ``Client(..., set_as_default=False)`` works outside ``with mesh:``), bounded."""

from __future__ import annotations

from distributed.client import _wait

__all__ = ["wait_futures"]


def wait_futures(mesh, futures: list, timeout: float, what: str, names) -> None:
    """Wait at most ``timeout`` seconds until every one of ``futures`` (Dask futures of ``mesh.client``) is done
    (finished, failed or cancelled). ``names(pending)`` says what was not done and on whom, for the
    ``TimeoutError`` raised at ``timeout``."""
    if not futures:
        return
    try:
        mesh.client.sync(_wait, list(futures), timeout=timeout)
    except TimeoutError:
        pending = [f for f in futures if not f.done()]
        raise TimeoutError(f"{what}: {names(pending)} within {timeout} s") from None
