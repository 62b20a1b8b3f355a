"""Prometheus metrics of the tensor workers, served by the Dask worker's ``/metrics`` endpoint
(spec/dask-notes.md §2 "Prometheus").

That endpoint serves the process-global ``prometheus_client.REGISTRY``, so one collector registered there by the
``WorkerPlugin`` is exported with Dask's own metrics. Names follow Dask's worker metrics
(``distributed/http/worker/prometheus``): namespace ``distributed.dashboard.prometheus.namespace`` (``dask``),
subsystem ``monarch``, counters ending in ``_total``, sizes in ``_bytes``; labels ``session`` (the session id)
and ``rank``, plus ``stream`` for per-stream numbers::

    dask_monarch_sessions                         sessions live on this worker
    dask_monarch_messages_received_total          messages taken in by the dispatcher
    dask_monarch_messages_applied_total           messages run by the streams (status barriers included)
    dask_monarch_messages_queued                  messages queued on the streams, not yet run
    dask_monarch_inbox_batches                    batches delivered but not yet dispatched
    dask_monarch_stream_messages_queued           the same per stream
    dask_monarch_refs                             live refs in the session's ref tables
    dask_monarch_memory_bytes                     bytes held by the refs (CUDA: allocated on the device)
    dask_monarch_remote_errors_total              remote function failures (RemoteFunctionFailed)
    dask_monarch_sessions_ended                   sessions ended here, by outcome (label ``outcome``)

Several Dask workers in one process (``LocalCluster(processes=False)``) share the registry: the one collector
reports every tensor worker of the process, each series told apart by its session and rank. Without
``prometheus_client`` nothing is registered (Dask then serves no metrics either).
"""

from __future__ import annotations

import threading
import weakref

import dask.config

from .metrics import worker_snapshot

__all__ = ["MonarchCollector", "register", "unregister"]

_lock = threading.Lock()
_collector: "MonarchCollector | None" = None


class MonarchCollector:
    """A prometheus_client collector over the ``MonarchWorkerPlugin`` instances of this process."""

    def __init__(self):
        self.plugins: weakref.WeakSet = weakref.WeakSet()
        self.namespace = dask.config.get("distributed.dashboard.prometheus.namespace", "dask")

    def name(self, name: str) -> str:
        return "_".join(part for part in (self.namespace, "monarch", name) if part)

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        labels = ["session", "rank"]
        sessions = GaugeMetricFamily(self.name("sessions"), "Number of dask_monarch sessions on this worker")
        received = CounterMetricFamily(
            self.name("messages_received_total"), "Messages taken in by the session's dispatcher", labels=labels
        )
        applied = CounterMetricFamily(
            self.name("messages_applied_total"), "Messages run by the session's streams", labels=labels
        )
        queued = GaugeMetricFamily(
            self.name("messages_queued"), "Messages queued on the session's streams, not yet run", labels=labels
        )
        inbox = GaugeMetricFamily(
            self.name("inbox_batches"), "Message batches delivered but not yet dispatched", labels=labels
        )
        stream_queued = GaugeMetricFamily(
            self.name("stream_messages_queued"), "Messages queued on one stream, not yet run",
            labels=labels + ["stream"],
        )
        refs = GaugeMetricFamily(self.name("refs"), "Live refs in the session's ref tables", labels=labels)
        memory = GaugeMetricFamily(
            self.name("memory_bytes"), "Bytes held by the session's refs (CUDA: allocated on the device)",
            labels=labels + ["device"],
        )
        errors = CounterMetricFamily(
            self.name("remote_errors_total"), "Remote function failures reported to the controller", labels=labels
        )
        ended = GaugeMetricFamily(
            self.name("sessions_ended"), "Recently ended sessions on this worker, by outcome", labels=["outcome"]
        )
        n_sessions = 0
        outcomes = {"exited": 0, "failed": 0}
        for plugin in list(self.plugins):
            if not hasattr(plugin, "sessions"):
                continue
            snapshot = worker_snapshot(plugin, with_stacks=False)
            n_sessions += len(snapshot["sessions"])
            for failure in snapshot["closed"].values():
                outcomes["failed" if failure else "exited"] += 1
            for session_id, s in snapshot["sessions"].items():
                values = [session_id, str(s["rank"])]
                received.add_metric(values, s["received"])
                applied.add_metric(values, s["applied"])
                queued.add_metric(values, s["queued"])
                inbox.add_metric(values, s["inbox_batches"])
                for stream_id, stream in s["streams"].items():
                    stream_queued.add_metric(values + [stream_id], stream["queued"])
                refs.add_metric(values, s["refs"])
                memory.add_metric(values + [s["device"]], s["bytes"])
                errors.add_metric(values, s["errors"])
        sessions.add_metric([], n_sessions)
        for outcome, n in outcomes.items():
            ended.add_metric([outcome], n)
        return [sessions, received, applied, queued, inbox, stream_queued, refs, memory, errors, ended]


def register(plugin) -> MonarchCollector | None:
    """Report ``plugin``'s sessions on this process's Prometheus registry (registering the collector on first
    use). Returns the collector, or None without ``prometheus_client``."""
    global _collector
    try:
        import prometheus_client
    except ImportError:
        return None
    with _lock:
        if _collector is None:
            collector = MonarchCollector()
            prometheus_client.REGISTRY.register(collector)
            _collector = collector
        _collector.plugins.add(plugin)
        return _collector


def unregister(plugin) -> None:
    """Stop reporting ``plugin``'s sessions (the collector stays registered, reporting the others)."""
    with _lock:
        if _collector is not None:
            _collector.plugins.discard(plugin)
