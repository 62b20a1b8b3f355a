"""The worker's end of a session's answer channel (issue 13; DESIGN.md "Decisions"; spec/dask-notes.md §1.3, §7 A).

``MonarchWorkerPlugin.setup`` adds the handler ``monarch_channel`` to the worker's server. A controller opens one
connection per (session, worker) with its ``Client``'s connection arguments (its ``Security``: TLS when the
cluster uses it) and sends ``{"op": "monarch_channel", "params": <pickled SessionParams>}``; the handler answers
``{"ready": <actor id>}`` (or ``{"closed": <why>}`` if the session ended here) and then serves the connection
until either side closes it. With ``"sockets": True`` in the request, the answer also carries ``"sockets"``: the
offer of a pair of answer sockets (``worker/sockets.py``: a blocking socket each way, written by the thread that
sends, the fast path), or ``{"refused": <why>}``; once they are connected the outbox pushes on them, and this comm
takes over again if they break. The controller sends ``{"n": <why>}`` when it does not connect them. On the comm:

* controller -> worker: ``{"b": batch, "s": segments}``, a batch that also travels as a pinned Dask task (the
  inbox takes whichever copy comes first and ignores the other), with ``"a": [chunk, ...]``, the answer chunks
  received since the last batch, or ``{"a": [chunk, ...]}`` alone when no batch followed them soon;
* worker -> controller: ``{"c": chunk, "d": bytes}``, an answer chunk of the outbox (``worker/outbox.py``; one
  with large tensors is a ``tensor_bytes.OutOfBand``, which Dask writes as its frames, the tensors' memory out of
  band, and which arrives unpickled as ``(chunk, messages)``), pushed
  when a ``Status`` or ``SessionFailed`` is reported, and ``{"x": True}`` once the session has ended here (its
  threads joined, its memory freed), which ``mesh.exit()`` waits for.

The handler runs on the worker's event loop; the stream threads that report answers wake it with
``IOLoop.add_callback``.
"""

from __future__ import annotations

import logging
import pickle

from distributed.comm.addressing import get_address_host
from distributed.protocol import to_serialize

from ..protocol.frames import receivable
from .inbox import SocketInbox
from .sockets import SocketEnd

__all__ = ["CHANNEL_OP", "serve"]

logger = logging.getLogger("dask_monarch.worker")

#: the handler's name in ``Worker.handlers``
CHANNEL_OP = "monarch_channel"


class _Channel:
    """The pushing side of one channel: ``wake()`` (any thread) makes the event loop push the next chunk."""

    def __init__(self, comm, loop, outbox):
        self.comm = comm
        self.loop = loop
        self.outbox = outbox

    def wake(self, closed: bool = False) -> None:
        self.loop.add_callback(self._push, closed)

    async def _push(self, closed: bool) -> None:
        try:
            for chunk, blob in self.outbox.push():
                await self.comm.write({"c": chunk, "d": blob if type(blob) is bytes else to_serialize(blob)})
            if closed:
                await self.comm.write({"x": True})
        except Exception as e:  # closed: the chunk stays retained, for the next sync task
            logger.debug("dask_monarch: answer channel %s closed while pushing: %s", self.comm, e)
            self.outbox.detach(self)


def _segment(segment):
    return tuple(segment) if type(segment) is list else segment  # a stream segment, as msgpack gives it back


def _offer_sockets(plugin, tw, on_lost):
    """``(SocketEnd, its offer)`` for session ``tw`` on this worker, or ``(None, {"refused": why})``."""
    worker = plugin.worker
    try:
        host = get_address_host(worker.address)
        ssl_context = worker.security.get_listen_args("worker").get("ssl_context")
        limit = receivable(worker.memory_manager.memory_limit)
        tw.socket_inbox = SocketInbox(tw)
        end = SocketEnd(tw.session_id, tw.rank, tw.socket_inbox, tw.outbox, host, ssl_context, on_lost, limit)
    except Exception as e:  # an address without a host (inproc://), no port free, ...
        return None, {"refused": f"{type(e).__name__}: {e}"}
    return end, end.offer


async def serve(plugin, comm, params: bytes, sockets: bool = False) -> None:
    """Serve one answer channel for ``plugin`` (``MonarchWorkerPlugin``) on ``comm``; ``params`` is the pickled
    ``SessionParams`` of the session's rank on this worker; ``sockets``: offer the answer sockets too."""
    params = pickle.loads(params)
    tw = plugin.tensor_worker(params)
    if tw is None:
        why = plugin.closed.get(params[0]) or f"session {params[0]} already ended on this worker"
        await comm.write({"closed": why})
        return
    channel = _Channel(comm, plugin.worker.loop, tw.outbox)
    inbox, outbox = tw.inbox, tw.outbox
    serving = True

    def sockets_lost(error) -> None:  # on the socket's thread: the comm pushes again, if still open
        if serving:
            outbox.attach(channel)

    end, offer = _offer_sockets(plugin, tw, sockets_lost) if sockets else (None, None)
    answer = {"ready": tw.actor_id}
    if offer is not None:
        answer["sockets"] = offer
    del tw  # this coroutine lives as long as the channel: it must not keep the session's state alive
    try:
        await comm.write(answer)
        outbox.attach(channel)
        if end is not None:
            end.attach()
        while True:
            msg = await comm.read()
            if "b" in msg:
                inbox.put(msg["b"], [_segment(s) for s in msg["s"]])
            for chunk in msg.get("a", ()):
                outbox.acked(chunk)
            if "n" in msg and end is not None:
                logger.debug("dask_monarch: the controller did not connect the answer sockets: %s", msg["n"])
                end.close()
    except Exception:  # the controller closed it, or it broke: tasks carry everything from now on
        pass
    finally:
        serving = False
        if end is not None:
            end.close()
        outbox.detach(channel)
        comm.abort()
