"""``MonarchSchedulerPlugin``: what dask_monarch keeps in the Dask scheduler (DESIGN.md "The picture").

It holds the rendezvous key-value store that workers' ``SchedulerStore`` reaches through the ``monarch_kv_*``
RPC handlers, and the table of live sessions (controller, mesh dims, ranks). When it starts it adds the
``/monarch`` page to the scheduler's dashboard (``dask_monarch.dashboard``). The controller registers it when
it attaches (``Client.register_plugin``), so the scheduler must be able to import dask_monarch.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time

from distributed.diagnostics.plugin import SchedulerPlugin
from distributed.metrics import time as dask_time
from distributed.scheduler import heartbeat_interval

from ..worker.plugin import END_SESSION_OP
from . import log_filter
from .kv import KeyValueStore

__all__ = ["MonarchSchedulerPlugin", "PLUGIN_NAME"]

logger = logging.getLogger("dask_monarch.scheduler")

PLUGIN_NAME = "dask-monarch"
#: ended sessions kept for the dashboard (the newest), with their end time and reason
ENDED_KEPT = 8
#: reported values kept per (session, name) until the dashboard's sampler takes them (``session_report``)
REPORTS_KEPT = 64


class MonarchSchedulerPlugin(SchedulerPlugin):
    """Scheduler side of dask_monarch: rendezvous store, session table and dashboard page. Idempotent:
    registering it again (a second controller) keeps the running instance."""

    name = PLUGIN_NAME
    idempotent = True

    def __init__(self):
        self.kv: KeyValueStore | None = None
        self.sessions: dict[str, dict] = {}
        #: the last ``ENDED_KEPT`` sessions that ended: their table entry plus ``ended`` (time) and ``reason`` (why
        #: the controller ended it, None after a clean exit), for the dashboard
        self.ended: dict[str, dict] = {}
        self.scheduler = None
        #: the ``/monarch`` page's rows and rate history, sampled from the plugin's start (every page shares it)
        self.dashboard = None
        self._sampler = None

    async def start(self, scheduler) -> None:
        self.scheduler = scheduler
        log_filter.install()  # gathers of task copies their controller released: DEBUG, not ERROR
        self.kv = KeyValueStore()
        scheduler.handlers.update(
            {
                "monarch_kv_set": self.kv_set,
                "monarch_kv_get": self.kv_get,
                "monarch_kv_add": self.kv_add,
                "monarch_kv_compare_set": self.kv_compare_set,
                "monarch_kv_wait": self.kv_wait,
                "monarch_kv_check": self.kv_check,
                "monarch_kv_delete": self.kv_delete,
                "monarch_kv_num_keys": self.kv_num_keys,
                "monarch_session_open": self.session_open,
                "monarch_session_close": self.session_close,
                "monarch_session_stream": self.session_stream,
                "monarch_session_recording": self.session_recording,
                "monarch_session_report": self.session_report,
                "monarch_sessions": self.list_sessions,
                "monarch_worker_ages": self.worker_ages,
            }
        )
        try:
            from ..dashboard import install_page, start_sampling

            if install_page(scheduler):
                self.dashboard, self._sampler = start_sampling(scheduler)
        except Exception:  # the page is a convenience: never keep the rendezvous store from starting
            logger.warning("dask_monarch: could not add the /monarch dashboard page", exc_info=True)

    async def close(self) -> None:
        if self._sampler is not None:
            self._sampler.stop()
        if self.scheduler is not None:
            from ..dashboard import uninstall_page

            uninstall_page(self.scheduler)

    # ----------------------------------------------------------------------------------------- rendezvous store
    async def kv_set(self, key: str, value: bytes) -> None:
        await self.kv.set(key, value)

    async def kv_get(self, key: str, timeout: float) -> bytes:
        return await self.kv.get(key, timeout)

    async def kv_add(self, key: str, amount: int) -> int:
        return await self.kv.add(key, amount)

    async def kv_compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        return await self.kv.compare_set(key, expected, desired)

    async def kv_wait(self, keys: list, timeout: float) -> None:
        await self.kv.wait(keys, timeout)

    def kv_check(self, keys: list) -> bool:
        return self.kv.check(keys)

    def kv_delete(self, key: str) -> bool:
        return self.kv.delete(key)

    def kv_num_keys(self) -> int:
        return self.kv.num_keys()

    # ------------------------------------------------------------------------------------------------ sessions
    def session_open(self, session_id: str, client: str, dims: dict, workers: list) -> None:
        """Record a session: its controller's client id, mesh ``dims`` (name -> size) and worker per rank."""
        self.sessions[session_id] = {
            "client": client,
            "dims": dict(dims),
            "workers": list(workers),
            "started": time.time(),
        }

    def session_stream(self, session_id: str, stream: int, name: str) -> None:
        """Name stream ``stream`` of a session, for the dashboard (stream 0 is ``main``)."""
        info = self.sessions.get(session_id)
        if info is not None:
            info.setdefault("streams", {})[str(stream)] = str(name)

    def session_recording(self, session_id: str, recording: int, name: str) -> None:
        """Name recording ``recording`` of a session by its compiled function, for the dashboard's compiled calls
        per second."""
        info = self.sessions.get(session_id)
        if info is not None:
            info.setdefault("recordings", {})[str(recording)] = str(name)

    def session_report(self, session_id: str, values: dict) -> None:
        """Values a session's program reported (``dask_monarch.report``: name -> number), stamped with the
        scheduler's clock; the newest ``REPORTS_KEPT`` per name wait for the dashboard."""
        info = self.sessions.get(session_id)
        if info is None:
            return
        reports = info.setdefault("reports", {})
        now = time.time()
        for name, value in dict(values).items():
            try:
                point = (now, float(value))
            except (TypeError, ValueError):
                continue
            reports.setdefault(str(name), collections.deque(maxlen=REPORTS_KEPT)).append(point)

    async def session_close(self, session_id: str, reason: str | None = None, owner_left: bool = False,
                            clean: bool = False) -> int:
        """Forget a session, delete its rendezvous keys and fail any rendezvous still waiting in it (so a rank
        blocked building a communicator with a lost peer stops now), and end it on its workers where it is
        still open (after a clean exit it is not: nothing happens there). Ending goes around the session's
        inbox, which a rank blocked in comm setup does not read. ``owner_left``: the session ends because its
        controller's Client disconnected (the workers log that as an end, not as a failure of theirs). ``clean``: the
        controller's exit drained every rank (a rank still closing on that clean ``Exit`` is left to end cleanly).
        Returns the number of keys deleted."""
        info = self.sessions.pop(session_id, None)
        if info is not None:
            self.ended[session_id] = {**info, "ended": time.time(), "reason": reason}
            while len(self.ended) > ENDED_KEPT:
                self.ended.pop(next(iter(self.ended)))
            self._end_on_workers(session_id, info, reason or "the controller ended the session", owner_left,
                                 clean=clean and reason is None and not owner_left)
        return await self.kv.abort(f"{session_id}/")

    def _end_on_workers(self, session_id: str, info: dict, reason: str, owner_left: bool = False,
                        clean: bool = False) -> None:
        """Send ``END_SESSION_OP`` to the session's workers still in the cluster; ``clean``: the controller closed the
        session after its exit, with no failure (a rank still finishing that clean ``Exit`` is left to finish it)."""
        for address in info["workers"]:
            if address in self.scheduler.workers:
                self.scheduler.worker_send(
                    address, {"op": END_SESSION_OP, "session_id": session_id, "reason": reason,
                              "owner_left": owner_left, "clean": clean}
                )

    def worker_ages(self, workers: list) -> dict:
        """Liveness of ``workers`` as the scheduler sees it: ``ages`` maps each address to the seconds since its
        last heartbeat (None if it is not in the cluster), ``ids`` to the id of the worker process there (a
        worker restarted at the same address has a new one), ``status`` to its status (``"running"``,
        ``"closing"`` while it shuts down or restarts, ...); ``interval`` is the heartbeat interval the
        scheduler asks of its workers now. Measured on the scheduler's clock, so the controller's does not
        matter."""
        now = dask_time()  # the clock of WorkerState.last_seen
        ages, ids, status = {}, {}, {}
        for address in workers:
            ws = self.scheduler.workers.get(address)
            ages[address] = None if ws is None else max(0.0, now - ws.last_seen)
            ids[address] = None if ws is None else ws.server_id
            status[address] = None if ws is None else ws.status.name
        return {"ages": ages, "ids": ids, "status": status,
                "interval": heartbeat_interval(len(self.scheduler.workers))}

    def remove_worker(self, scheduler, worker: str, *, stimulus_id: str | None = None, **kwargs) -> None:
        """A worker left the cluster (it died, closed, restarted or was retired): each session it served ends now
        on its other workers, naming it, and the session's rendezvous waits fail, whether or not its
        controller is waiting for an answer at the time."""
        for session_id, info in list(self.sessions.items()):
            if worker in info["workers"] and not info.get("lost"):
                rank = info["workers"].index(worker)
                info["lost"] = reason = f"rank {rank} ({worker}) left the cluster"
                self._end_on_workers(session_id, info, f"the session cannot continue: {reason}")
                asyncio.ensure_future(self.kv.abort(f"{session_id}/"))

    def list_sessions(self) -> dict:
        return {k: dict(v) for k, v in self.sessions.items()}

    def remove_client(self, scheduler, client: str) -> None:
        """A controller disconnected without ``mesh.exit()``: end its sessions on their workers, so nothing
        they held (threads, tensors, communicators) outlives it, and drop their rendezvous keys."""
        for session_id, info in list(self.sessions.items()):
            if info["client"] == client:
                asyncio.ensure_future(self.session_close(session_id, f"the controller ({client}) disconnected",
                                                         owner_left=True))
