"""``dask_monarch.report(loss=...)``: values the program reports for the dashboard's progress row (issue 25 item 6).

The ``/monarch`` page shows the last value of each name and its history as a line, per session. A call costs the
program a dictionary update: the values go to the scheduler at most every ``INTERVAL`` seconds (the newest of
each name), without waiting (``Session.tell_dashboard``), so a training loop may report every step. A remote
tensor of one element is fetched from the first rank of its mesh without waiting either (``fetch_shard``; its
answer brings the value), at most one fetch per name in flight and one per ``INTERVAL``: the reports between are
samples left out.
"""

from __future__ import annotations

import math
import numbers
import threading
import time

import torch

from .at_exit import live_meshes
from .fetch import fetch_shard
from .mesh import DeviceMesh, get_active_mesh
from .tensor import Tensor

__all__ = ["report", "INTERVAL"]

#: seconds between two sends of a session's reports to the scheduler (the page samples every 0.5 s)
INTERVAL = 0.5


class _Reports:
    """What one session reported and has not yet sent, and the fetches of remote values under way."""

    def __init__(self, session):
        self.session = session
        self.lock = threading.Lock()
        self.pending: dict = {}  # name -> float, not yet sent
        self.sent_at = 0.0  # time.monotonic() of the last send
        self.timer = False  # a send is scheduled on the client's event loop
        self.fetching: dict = {}  # name -> time.monotonic() the fetch in flight began

    def put(self, values: dict) -> None:
        with self.lock:
            self.pending.update(values)
            wait = self.sent_at + INTERVAL - time.monotonic()
            if wait > 0:
                if not self.timer:  # called from any thread: the event loop schedules the send itself
                    self.timer = True
                    loop = self.session.client.loop
                    loop.add_callback(loop.call_later, wait, self._send_later)
                return
            self._send_locked()

    def _send_later(self) -> None:
        with self.lock:
            self.timer = False
            self._send_locked()

    def _send_locked(self) -> None:
        if not self.pending or self.session.closed:
            return
        values, self.pending = self.pending, {}
        self.sent_at = time.monotonic()
        self.session.tell_dashboard("monarch_session_report", values=values)

    def fetch(self, name: str, tensor: Tensor) -> None:
        """Fetch ``tensor`` (one element) and report it as ``name`` once it comes, unless a fetch of ``name`` is in
        flight or began less than ``INTERVAL`` ago."""
        now = time.monotonic()
        with self.lock:
            began = self.fetching.get(name)
            if began is not None and (began < 0 or now - began < INTERVAL):
                return
            self.fetching[name] = -1.0  # in flight
        try:
            answer = fetch_shard(tensor)
        except BaseException:
            with self.lock:
                self.fetching.pop(name, None)
            raise

        def arrived(future) -> None:  # on the thread that applies answers: no wait here
            with self.lock:
                self.fetching[name] = now
            if future.exception() is None:
                value = future.result()
                if isinstance(value, torch.Tensor) and value.numel() == 1:
                    self.put({name: float(value.item())})

        answer._future.add_done_callback(arrived)


_reports: dict = {}  # session id -> _Reports
_reports_lock = threading.Lock()


def _reports_of(session) -> _Reports:
    with _reports_lock:
        for sid in [sid for sid, r in _reports.items() if r.session.closed]:
            del _reports[sid]
        reports = _reports.get(session.id)
        if reports is None:
            reports = _reports[session.id] = _Reports(session)
        return reports


def _mesh_for(mesh) -> DeviceMesh:
    if mesh is not None:
        if not isinstance(mesh, DeviceMesh):
            raise TypeError(f"dask_monarch.report: mesh must be a DeviceMesh, got {type(mesh).__name__}")
        return mesh
    mesh = get_active_mesh()
    if mesh is not None:
        return mesh
    live = live_meshes()
    if len(live) == 1:
        return live[0]
    raise ValueError(
        "dask_monarch.report: which session? call it under `with mesh.activate():` or pass mesh=... "
        f"({len(live)} sessions are open in this program)"
    )


def report(mesh: DeviceMesh | None = None, **values) -> None:
    """Report values for the ``/monarch`` dashboard page's progress row, e.g. ``dm.report(loss=loss, step=i)``: per
    name its last value and a line of its history, for the session of ``mesh`` (default: the active mesh's, else
    the program's only open session).

    A value is a real number (``int``, ``float``, a numpy scalar), a local tensor of one element, or a remote
    ``dask_monarch.Tensor`` of one element, whose value is fetched from its mesh's first rank without waiting (at
    most one fetch per name in flight, one per 0.5 s). Nothing waits: values are sent to the scheduler at most
    every ``INTERVAL`` (0.5) seconds, the newest of each name. Not inside a compiled function (a remote value
    would be a fetch there: ``RuntimeError``).

    Raises ``TypeError`` naming a value that is none of these, or a tensor of more than one element, and
    ``ValueError`` for a non-finite number or when there is no session to report to."""
    session = _mesh_for(mesh)._session
    session.check_ok()
    numbers_, remote = {}, {}
    for name, value in values.items():
        if isinstance(value, Tensor):
            if math.prod(value.shape) != 1:
                raise TypeError(f"dask_monarch.report: {name} is a remote tensor of shape {tuple(value.shape)}; "
                                "report one element (e.g. loss.mean())")
            remote[name] = value
            continue
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise TypeError(f"dask_monarch.report: {name} is a tensor of shape {tuple(value.shape)}; report one "
                                "element")
            value = value.item()
        if not isinstance(value, numbers.Real):
            raise TypeError(f"dask_monarch.report: {name} must be a number or a one-element tensor, got "
                            f"{type(value).__name__}")
        value = float(value)
        if not math.isfinite(value):
            raise ValueError(f"dask_monarch.report: {name} is {value}: report finite numbers")
        numbers_[name] = value
    reports = _reports_of(session)
    for name, tensor in remote.items():
        reports.fetch(name, tensor)
    if numbers_:
        reports.put(numbers_)
