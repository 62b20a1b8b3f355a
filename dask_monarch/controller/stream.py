"""Streams and borrows on the controller (spec §1 "Streams and borrows", §4; Monarch's ``Stream`` and
``Borrow``).

A ``Stream`` is a logical stream: on every rank its own thread and, on GPU workers, its own CUDA stream, whose work
runs concurrently with other streams'. Operations run on the active stream (``stream.activate()``; the default is
``main_stream``). A tensor belongs to the stream it was made on; using it on another stream needs a borrow:
``t2, b = stream.borrow(t, mutable=False)`` gives ``t2``, the same memory on ``stream``, until ``b.drop()``.

Permissions while a borrow is live (spec §1): a read-only borrow lets both sides read and neither write
(``TypeError`` "MUTATING_BORROW ... would be mutated"); a mutable borrow gives the borrower read and write and
the origin nothing (``TypeError`` "BORROWED"); mutably borrowing a tensor that is already borrowed is a
``RuntimeError``. Using a tensor on a stream other than its own is ``TypeError`` "WRONG_STREAM".
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
import traceback
import warnings

from ..protocol import BorrowCreate, BorrowDrop, BorrowFirstUse, BorrowLastUse, CreateStream, StreamCreationMode
from ..protocol import StreamRef
from .local import propagating
from .session import DEFAULT_STREAM
from .tensor import Tensor
from .dynamo_skip import skip_dynamo

__all__ = ["Stream", "Borrow", "main_stream", "get_active_stream", "check_access"]

_active: contextvars.ContextVar = contextvars.ContextVar("dask_monarch_active_stream", default=None)


class Stream:
    """Logical stream ``name`` (Monarch's ``Stream(name)``). On first use in a session it sends
    ``CreateStream(ref, CreateNewStream)`` to every rank of that session (``main_stream`` is each session's
    default stream, ``StreamRef(0)``, on the device's current CUDA stream)."""

    def __init__(self, name: str, _default: bool = False):
        if not isinstance(name, str) or not name:
            raise TypeError(f"Stream: name must be a non-empty str, got {name!r}")
        self.name = name
        self.default = bool(_default)

    def __repr__(self) -> str:
        return f"Stream({self.name!r}{', _default=True' if self.default else ''})"

    def ref_for(self, session) -> StreamRef:
        """This stream's ``StreamRef`` in ``session``, created there (``CreateStream`` to all ranks) on first use."""
        if self.default:
            return DEFAULT_STREAM
        with session.lock:
            ref = session.streams.get(self)
            if ref is None:
                session.check_ok()
                ref = session.streams[self] = StreamRef(len(session.streams) + 1)
                session.send(CreateStream(ref, StreamCreationMode.CreateNewStream))
                # the /monarch page's stream backlog column shows it by name (s<id> until this arrives)
                session.tell_dashboard("monarch_session_stream", stream=ref.id, name=self.name)
            return ref

    @contextlib.contextmanager
    def activate(self):
        """Run operations (torch ops, remote functions, reduces, fetches) on this stream inside the block."""
        token = _active.set(self)
        try:
            yield self
        finally:
            _active.reset(token)

    def borrow(self, t, mutable: bool = False):
        """Borrow remote tensor ``t`` (of another stream, or this one) for use on this stream: returns ``(t2,
        borrow)``, where ``t2`` has ``t``'s shape, dtype and memory on this stream. Sends ``BorrowCreate`` now;
        ``BorrowFirstUse`` precedes the first operation on ``t2``; ``borrow.drop()`` (or leaving ``with
        borrow:``) ends it. Raises ``TypeError`` for a non-remote or dropped ``t`` or a non-bool ``mutable``,
        ``RuntimeError`` for a mutable borrow of a tensor already borrowed (spec §1)."""
        if not isinstance(t, Tensor):
            raise TypeError(f"Stream.borrow: t must be a remote dask_monarch.Tensor, got {type(t).__name__}")
        if not isinstance(mutable, bool):
            raise TypeError(f"Stream.borrow: mutable must be a bool, got {mutable!r}")
        t.check_usable()
        return Borrow(t, self, mutable)._start()


#: each session's default stream (Monarch's ``Stream("main", _default=True)``)
main_stream = Stream("main", _default=True)


def get_active_stream() -> Stream:
    """The stream of the innermost ``stream.activate()``, else ``main_stream``."""
    return _active.get() or main_stream


_borrow_ids = itertools.count()


class Borrow:
    """A live borrow of ``origin`` onto ``stream`` (Monarch's ``Borrow``): ``tensor`` is the borrowed alias.
    ``drop()`` ends it (also as a context manager); an undropped borrow warns and drops itself when it is
    garbage-collected."""

    def __init__(self, origin, stream: Stream, mutable: bool):
        self.origin = origin
        self.stream = stream
        self.mutable = mutable
        self.id = next(_borrow_ids)
        self.tensor = None
        self.first_use_sent = False
        self.dropped = False
        self._session = origin.mesh._session

    def __repr__(self) -> str:
        kind = "mutable" if self.mutable else "read-only"
        return f"<{kind} borrow {self.id} of {self.origin.ref!r} onto {self.stream!r}>"

    def _start(self):
        origin, session = self.origin, self._session
        mesh = origin.mesh
        with session.lock:
            session.check_ok()
            live = session.borrows_of(origin)
            if live and (self.mutable or any(b.mutable for b in live)):
                raise RuntimeError(
                    f"cannot borrow {origin.ref!r} {'mutably' if self.mutable else 'again'}: it is already "
                    f"borrowed ({', '.join(map(repr, live))}); drop that borrow first"
                )
            # lending on a borrowed tensor uses it on its stream: its BorrowFirstUse must precede this
            # BorrowCreate, and a mutable borrow writes it (refused if it was borrowed read-only)
            check_access(origin.stream, [origin], [origin] if self.mutable else [])
            to_ref = self.stream.ref_for(session)
            with propagating(), session.fake_mode:  # the same shape and strides, its own fake storage: the borrower's side
                fake = origin._fake.new_empty_strided(origin._fake.size(), origin._fake.stride())
            self.tensor = Tensor(session.new_ref(), fake, mesh, self.stream)
            recorder = session.recording()
            if recorder is not None:  # made inside a compiled function: it must be dropped there too
                recorder.borrows[self.id] = self
            session.lend(origin, self)
            session.record(session.new_seq(), defs=[self.tensor], uses=[origin], what=repr(self))
            session.send(
                BorrowCreate(self.tensor.ref, self.id, origin.ref, origin.stream.ref_for(session), to_ref),
                mesh._rank_list,
            )
        return self.tensor, self

    def use(self) -> None:
        """The first use of the borrowed tensor: send ``BorrowFirstUse`` (called under the session lock)."""
        if not self.first_use_sent:
            self.first_use_sent = True
            self._session.send(BorrowFirstUse(self.id), self.origin.mesh._rank_list)

    def drop(self) -> None:
        """End the borrow: drop every alias of the borrowed tensor (using one afterwards raises ``DROPPED``), then
        send ``BorrowLastUse`` and ``BorrowDrop``. After a mutable borrow the origin depends on what the borrower
        did (a failure there is raised by a fetch of the origin). Borrows of the borrowed tensor (lent on) are
        dropped first. Idempotent."""
        session = self._session
        ranks = self.origin.mesh._rank_list
        where = "".join(traceback.format_stack(limit=8)[:-1])
        with session.lock:  # a drop by the user and the collector's deferred one may race: one of them sends
            if self.dropped:
                return
            recorder = session.recording()
            if recorder is not None:
                if self.id not in recorder.borrows:
                    raise RuntimeError(
                        f"cannot drop {self!r} inside compiled function {recorder.name}: it was made outside, and "
                        "every call of the function would drop it again; drop it after the call"
                    )
                del recorder.borrows[self.id]
            self.dropped = True
            for nested in session.borrows_of(self.tensor):  # lent on: it shares the memory, so it ends first
                nested.drop()
            borrowed = session.aliases_of([self.tensor])
            session.unlend(self.origin, self)
            if session.failure is not None or session.closed:
                return
            if not self.first_use_sent:
                self.use()
            session.send(BorrowLastUse(self.id), ranks)
            if self.mutable:
                origins = session.aliases_of([self.origin])
                session.record(session.new_seq(), defs=origins, uses=borrowed + origins, what=repr(self))
            session.send(BorrowDrop(self.id), ranks)
            for alias in borrowed:  # their DeleteRefs go out after BorrowLastUse (deletes follow the buffer)
                if alias._dropped_at is None:
                    alias._dropped_at = where
                    session.drop_ref(alias.ref.id, alias.mesh._rank_list)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.drop()

    @skip_dynamo  # the collector may run it inside a torch.compile'd function (dynamo_skip.py)
    def __del__(self):
        if not self.dropped and self.tensor is not None:
            # a UserWarning, not a ResourceWarning: Python's default filters hide those, and this one is the spec's
            warnings.warn(f"{self!r} was not dropped; it is dropped now", UserWarning, stacklevel=2)
            self._session.defer(self.drop)  # the collector may run anywhere: drop before the next message


def check_access(stream: Stream, reads, writes) -> None:
    """Spec §1's stream and borrow checks for an operation on ``stream`` that reads ``reads`` and writes
    ``writes`` (remote ``Tensor``s), then ``BorrowFirstUse`` for borrowed tensors used for the first time. Call
    under the session lock, before the operation's message is sent."""
    session = None
    for t in reads:
        if t.stream is not stream:
            raise TypeError(
                f"WRONG_STREAM: tensor {t.ref!r} is on {t.stream!r} but the operation runs on {stream!r}; borrow it "
                f"onto that stream (stream.borrow(t)) or run the operation under its stream's activate()"
            )
        session = t.mesh._session
    # ``_borrowed.data``: the WeakValueDictionary's dict (its own len() is a Python call on every op)
    if session is None or not (session._lent or session._borrowed.data or session._deferred):
        return  # no borrow is live (nor one waiting to be dropped): nothing more to check
    written = {id(t) for t in writes}
    used = []  # borrows whose tensors this operation uses: their first use goes out once every check passed
    for t in reads:
        borrow = session.borrow_by_alias(t)
        if borrow is not None:
            if id(t) in written and not borrow.mutable:
                raise TypeError(
                    f"MUTATING_BORROW: tensor {t.ref!r} would be mutated, but it was borrowed read-only "
                    f"({borrow!r}); borrow it with mutable=True to write to it"
                )
            used.append(borrow)
        for lent in session.borrows_of(t):  # a borrowed tensor may be lent on in turn
            if lent.mutable:
                raise TypeError(
                    f"BORROWED: tensor {t.ref!r} is mutably borrowed ({lent!r}) and cannot be used until that "
                    f"borrow is dropped"
                )
            if id(t) in written:
                raise TypeError(
                    f"MUTATING_BORROW: tensor {t.ref!r} would be mutated while it is borrowed read-only ({lent!r}); "
                    f"drop the borrow first"
                )
    for borrow in used:
        borrow.use()
