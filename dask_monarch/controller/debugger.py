"""The controller's half of Monarch's debugger: a rank stopped in pdb (``breakpoint()`` in a remote function,
``worker/debugger.py``) is driven from this process's terminal, or a notebook's input box, while the controller
waits for something (a fetch, ``mesh.exit()``), as Monarch's controller does.

The session subscribes to its Dask event topic ``monarch-debugger-<session id>``; the workers' events (what pdb
wrote, "pdb waits for a command", "pdb let go") wake any ``MonarchFuture`` waiting (``wake``), which calls
``serve``: it prints pdb's output on stdout, reads each command with ``input()`` and sends it to the rank's worker
(``Client.run`` of ``worker.debugger.feed``), until no rank is stopped. Ranks stopped at once are driven one after
the other, each until it lets its function go on (``continue``, ``quit``), with a header naming the rank. End of
input (``EOFError``: no terminal, a closed stdin) quits that rank's pdb, whose function then fails with
``BdbQuit``, as pdb does locally. While a rank is stopped, the wait for its next message checks the session's
liveness every ``liveness_interval``: a rank whose worker dies fails the session, not a hang.
"""

from __future__ import annotations

import concurrent.futures
import queue
import sys

from .topics import unsubscribe

__all__ = ["Debugger"]

#: what ``serve`` reads a command with (tests replace it)
read_line = input


class Debugger:
    """Session ``session``'s debugger messages (its ``client``, ``id``, ``workers``, ``liveness_interval`` and
    ``check_alive``): ``wake`` is a future done when a message waits; ``serve()`` drives the stopped ranks."""

    def __init__(self, session):
        from ..worker.debugger import feed, topic

        self._session = session
        self._feed = feed
        self.topic = topic(session.id)
        self._events: queue.Queue = queue.Queue()
        self.wake: concurrent.futures.Future = concurrent.futures.Future()
        session.client.subscribe_topic(self.topic, self._on_event)

    def _on_event(self, event) -> None:
        """Dask's handler (the client's event loop): keep the message, wake a waiting future."""
        _, msg = event
        self._events.put(msg)
        try:
            self.wake.set_result(None)
        except concurrent.futures.InvalidStateError:
            pass

    def close(self) -> None:
        """Stop listening (the session ended): the Client keeps no handler that reaches the session."""
        unsubscribe(self._session.client, self.topic)

    def serve(self) -> None:
        """Drive every rank stopped in pdb, one after the other, until none is stopped and no message waits.
        Raises what ``check_alive`` raises (``SessionError``) if the session fails meanwhile, and
        ``KeyboardInterrupt`` from the terminal after quitting the rank's pdb."""
        self.wake = concurrent.futures.Future()  # before reading: a message from now on wakes the next wait
        attached = None
        held: list = []  # other ranks' messages while one is driven
        while True:
            mine = next((i for i, m in enumerate(held) if attached is None or m["rank"] == attached), None)
            if mine is not None:
                msg = held.pop(mine)
            else:
                try:
                    msg = self._events.get(timeout=0 if attached is None else self._session.liveness_interval)
                except queue.Empty:
                    if attached is None:
                        return
                    self._session.check_alive()
                    continue
            rank = msg["rank"]
            if attached is not None and rank != attached:
                held.append(msg)
                continue
            if attached is None:
                attached = rank
                print(f"\n--- pdb on rank {rank} (worker {msg['worker']}) ---", flush=True)
            kind = msg["kind"]
            if kind == "write":
                sys.stdout.write(msg["text"])
                sys.stdout.flush()
            elif kind == "read":
                self._answer(rank, msg["worker"])
            elif kind == "detach":
                print(f"--- rank {rank} goes on ---", flush=True)
                attached = None

    def _answer(self, rank: int, worker: str) -> None:
        try:
            line = read_line()
        except EOFError:
            line = None
        except KeyboardInterrupt:
            self._send(rank, worker, "quit")
            raise
        self._send(rank, worker, "quit" if line is None else line)

    def _send(self, rank: int, worker: str, line: str) -> None:
        self._session.client.run(self._feed, self._session.id, rank, line, workers=[worker])
