"""Flattened wire forms of ``CallFunction`` and ``DeleteRefs``, the messages of every eager op (issue 27: the per-op
path is Python on both sides of torch's dispatcher).

Every other message pickles as a call of its constructor (``checks.message``), its ``Ref``/``StreamRef``/
``ArgsKwargs`` fields each one more such call, which the pickler makes through their Python ``__reduce__``. These
two pickle as one call of a decoder here with plain values: ref ids as ints, the stream's id, ``args`` and
``kwargs`` as they are. The decoder (on the worker, while unpickling) rebuilds the very message the controller had,
with ``Ref`` objects, so the handlers (``CallFunction`` -> ``call_function``, ``DeleteRefs`` -> ``delete_refs``)
are the same, and validates it as the constructor does: a bad field raises ``ProtocolError`` naming the message
and the field (``CallFunction.results[0]: expected a Ref or None, got 'x' (str)``). A message whose fields do not
fit the flat form (changed after construction, built without its constructor) pickles as its constructor call, and
is validated while unpickled as any other.

Measured (CPU time, ``time.process_time``, best of 9, in-process; 2-core machine at load 15-20, 2026-12-05):
``pickle.dumps`` of 4,096 ``CallFunction``s of ``x + x`` 1.76-1.89 us a message as constructor calls, 1.28-1.46
flattened (55 -> 43 bytes), ``pickle.loads`` 1.32-1.34 against 1.40-1.41 us; ``DeleteRefs`` of 30 refs 0.35 ->
0.05 us a ref to pickle, 0.24 -> 0.17 to unpickle. Top-level tensor arguments as ids (their positions beside)
were tried and measured slower both ways: the pickler's own calls of ``Tensor.__reduce_ex__`` cost less than
finding and replacing them in Python.
"""

from __future__ import annotations

from .checks import call_function_ok, validate
from .messages import CallFunction, DeleteRefs
from .refs import Ref, StreamRef
from .types import ArgsKwargs, ProtocolError

__all__ = ["call_function_from_wire", "delete_refs_from_wire", "flat_call_function", "flat_delete_refs"]

_new = object.__new__
_U64 = 1 << 64
#: what ``checks.message`` gave each class: the constructor-call form, for what does not fit the flat one
_CONSTRUCTOR_CALL = {cls: cls.__reduce__ for cls in (CallFunction, DeleteRefs)}


class _NotFlat(Exception):
    """A field that the flat form cannot carry: the message pickles as its constructor call."""


def _ids(refs, optional: bool = False):
    """The ids of a list (or tuple) of ``Ref`` (or None, if ``optional``), in a container of the same type."""
    t = type(refs)
    if t is tuple and not refs:
        return ()
    if t is not list and t is not tuple:
        raise _NotFlat
    ids = []
    for r in refs:
        if type(r) is Ref:
            ids.append(r.id)
        elif r is None and optional:
            ids.append(None)
        else:
            raise _NotFlat
    return ids if t is list else tuple(ids)


def flat_call_function(msg: CallFunction):
    """``CallFunction.__reduce__``: ``(call_function_from_wire, plain fields)``, or the constructor call for a
    message whose fields do not fit (see the module's docstring)."""
    try:
        ak, stream = msg.args_kwargs, msg.stream
        if type(ak) is not ArgsKwargs or type(stream) is not StreamRef or type(ak.args) is not tuple:
            raise _NotFlat
        mutates, groups = msg.mutates, msg.remote_process_groups
        return (call_function_from_wire, (
            msg.seq, _ids(msg.results, True), _ids(mutates) if mutates else mutates, msg.function, ak.args, ak.kwargs,
            stream.id, _ids(groups) if groups else groups, msg.declared,
        ))
    except (_NotFlat, AttributeError):
        return _CONSTRUCTOR_CALL[CallFunction](msg)


def _refs(ids, optional: bool = False):
    """``Ref``s of a list (or tuple) of ids, in a container of the same type; a value that is not a valid id (or
    None, if ``optional``) stays as it is, for ``validate`` to name. Anything but a list or tuple stays as it is."""
    t = type(ids)
    if t is not list and t is not tuple:
        return ids
    refs = []
    for i in ids:
        if type(i) is int and 0 <= i < _U64:
            r = _new(Ref)
            r.id = i
            refs.append(r)
        else:
            refs.append(i)  # None (where optional), or a bad value validate names
    return refs if t is list else tuple(refs)


def call_function_from_wire(seq, results, mutates, function, args, kwargs, stream, groups, declared):
    """The ``CallFunction`` that ``flat_call_function`` flattened, validated: ``ProtocolError`` naming the field if
    one is bad (``CallFunction.<field>: expected ..., got ...``)."""
    if type(args) is not tuple or type(kwargs) is not dict:
        raise ProtocolError(f"CallFunction.args_kwargs: expected a tuple of args and a dict of kwargs, got "
                            f"{type(args).__name__} and {type(kwargs).__name__}")
    ak = _new(ArgsKwargs)
    ak.args = args
    ak.kwargs = kwargs
    if type(stream) is int and 0 <= stream < _U64:
        s = _new(StreamRef)
        s.id = stream
        stream = s
    msg = _new(CallFunction)
    msg.seq = seq
    msg.results = _refs(results, True)
    msg.mutates = _refs(mutates) if mutates else mutates
    msg.function = function
    msg.args_kwargs = ak
    msg.stream = stream
    msg.remote_process_groups = _refs(groups) if groups else groups
    msg.declared = declared
    if not call_function_ok(msg):
        validate(msg)  # names the bad field
    return msg


def flat_delete_refs(msg: DeleteRefs):
    """``DeleteRefs.__reduce__``: ``(delete_refs_from_wire, (ids,))``, or the constructor call for a message whose
    ``refs`` are not a list of ``Ref``."""
    try:
        return (delete_refs_from_wire, (_ids(msg.refs),))
    except (_NotFlat, AttributeError):
        return _CONSTRUCTOR_CALL[DeleteRefs](msg)


def delete_refs_from_wire(ids) -> DeleteRefs:
    """The ``DeleteRefs`` of ``ids``, validated: ``ProtocolError`` naming a bad one (``DeleteRefs.refs[1]: expected a
    Ref, got -1 (int)``)."""
    msg = _new(DeleteRefs)
    msg.refs = refs = _refs(ids)
    if type(refs) not in (list, tuple) or not all(type(r) is Ref for r in refs):
        validate(msg)
    return msg


CallFunction.__reduce__ = flat_call_function
DeleteRefs.__reduce__ = flat_delete_refs
