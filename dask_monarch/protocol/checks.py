"""Field checks of the protocol's messages (``messages.py``): what each field annotation accepts, ``validate``, and
``message``, the decorator that makes a class a validating dataclass which pickles as a call of its constructor.

A check is a pair: a fast predicate (the hot path: every message a worker unpickles runs it) and a checker that
raises ``ProtocolError`` naming the message and the field (``Message.field: expected ..., got ...``).
"""

from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass

import torch

from .function import Cloudpickle, FunctionPath
from .refs import Ref, StreamRef
from .slice import Slice
from .types import ArgsKwargs, Factory, ProtocolError, Reduction, StreamCreationMode, WorkerError
from .wire_value import WireValue

__all__ = ["WORKER_TYPES", "Validated", "call_function_ok", "message", "nested", "validate"]


def _describe(value) -> str:
    text = repr(value)
    if len(text) > 80:
        text = text[:77] + "..."
    return f"{text} ({type(value).__name__})"


def _fail(where: str, expected: str, value) -> None:
    raise ProtocolError(f"{where}: expected {expected}, got {_describe(value)}")


def _is_u64(v) -> bool:
    return type(v) is int and 0 <= v < 1 << 64


def _u64(where, v):
    if not _is_u64(v):
        _fail(where, "a non-negative int", v)


def _bool(where, v):
    if type(v) is not bool:
        _fail(where, "a bool", v)


def _ref(where, v):
    if type(v) is not Ref:
        _fail(where, "a Ref", v)


def _opt_ref(where, v):
    if v is not None and type(v) is not Ref:
        _fail(where, "a Ref or None", v)


def _stream(where, v):
    if type(v) is not StreamRef:
        _fail(where, "a StreamRef", v)


def _list_of(check):
    def _check(where, v):
        if not isinstance(v, (list, tuple)):
            _fail(where, "a list", v)
        for i, item in enumerate(v):
            check(f"{where}[{i}]", item)

    return _check


def _str(where, v):
    if type(v) is not str:
        _fail(where, "a str", v)


def _instance(*types):
    names = " or ".join(t.__name__ for t in types)

    def _check(where, v):
        if not isinstance(v, types):
            _fail(where, f"a {names}", v)

    return _check


def _opt(check):
    def _check(where, v):
        if v is not None:
            check(where, v)

    return _check


def _any(where, v):
    pass


def _dims(where, v):
    _list_of(_str)(where, v)


def _exit_error(where, v):
    if v is None:
        return
    if not (isinstance(v, tuple) and len(v) == 2 and (v[0] is None or isinstance(v[0], str)) and isinstance(v[1], str)):
        _fail(where, "None or a (actor id or None, message) tuple of str", v)


def _commands(where, v):
    if not isinstance(v, (list, tuple)):
        _fail(where, "a list of WorkerMessage", v)
    for i, item in enumerate(v):
        if type(item) not in WORKER_TYPES:
            _fail(f"{where}[{i}]", "a WorkerMessage", item)
        validate(item, f"{where}[{i}]")


def _broker_id(where, v):
    if not (isinstance(v, tuple) and len(v) == 2 and isinstance(v[0], str) and _is_u64(v[1])):
        _fail(where, "a (str, int) broker id", v)


def _ok_declared(v) -> bool:
    if type(v) is not tuple:
        return False
    for d in v:
        if d is not None and not (type(d) is tuple and len(d) == 2 and type(d[0]) is torch.dtype
                                  and type(d[1]) is tuple and all(type(n) is int and n >= 0 for n in d[1])):
            return False
    return True


def _declared(where, v):
    if not _ok_declared(v):
        _fail(where, "None or a tuple of None or (torch.dtype, shape tuple of int) per result", v)


def nested(cls) -> None:
    """Let a field annotated with ``cls``'s name hold a validated ``cls`` (a message dataclass made by ``message``
    that travels inside another one, such as ``ActorCallParams``)."""

    def check(where, v):
        if type(v) is not cls:
            _fail(where, cls.__name__, v)
        validate(v, where)

    _CHECKS[cls.__name__] = (lambda v: type(v) is cls and _valid(v), check)


_FUNCTION = _instance(FunctionPath, Cloudpickle)
_FUNCTIONS = (FunctionPath, Cloudpickle)
_U64 = 1 << 64
_REFS = _list_of(_ref)
_OPT_REFS = _list_of(_opt_ref)
_LISTS = (list, tuple)


def _ok_list(item_ok):
    return lambda v: type(v) in _LISTS and all(item_ok(x) for x in v)


def _ok_instance(*types):
    return lambda v: isinstance(v, types)


def _ok_commands(v) -> bool:
    return type(v) in _LISTS and all(type(x) in WORKER_TYPES and _valid(x) for x in v)


def _ok_exit_error(v) -> bool:
    return v is None or (
        isinstance(v, tuple) and len(v) == 2 and (v[0] is None or isinstance(v[0], str)) and isinstance(v[1], str)
    )


_is_ref = lambda v: type(v) is Ref  # noqa: E731
_is_opt_ref = lambda v: v is None or type(v) is Ref  # noqa: E731

# field type annotation (as written below) -> (fast predicate, checker that raises a ProtocolError naming the field)
_CHECKS = {
    "Seq": (_is_u64, _u64),
    "int": (_is_u64, _u64),
    "bool": (lambda v: type(v) is bool, _bool),
    "Ref": (_is_ref, _ref),
    "Optional[Ref]": (_is_opt_ref, _opt_ref),
    "Optional[Seq]": (lambda v: v is None or _is_u64(v), _opt(_u64)),
    "list[Ref]": (_ok_list(_is_ref), _REFS),
    "list[Optional[Ref]]": (_ok_list(_is_opt_ref), _OPT_REFS),
    "StreamRef": (lambda v: type(v) is StreamRef, _stream),
    "list[str]": (_ok_list(lambda v: type(v) is str), _dims),
    "str": (lambda v: type(v) is str, _str),
    "Slice": (_ok_instance(Slice), _instance(Slice)),
    "Factory": (_ok_instance(Factory), _instance(Factory)),
    "Reduction": (_ok_instance(Reduction), _instance(Reduction)),
    "StreamCreationMode": (_ok_instance(StreamCreationMode), _instance(StreamCreationMode)),
    "ResolvableFunction": (_ok_instance(FunctionPath, Cloudpickle), _FUNCTION),
    "Optional[ResolvableFunction]": (lambda v: v is None or isinstance(v, (FunctionPath, Cloudpickle)), _opt(_FUNCTION)),
    "ArgsKwargs": (_ok_instance(ArgsKwargs), _instance(ArgsKwargs)),
    "WireValue": (_ok_instance(WireValue), _instance(WireValue)),
    "list[WorkerMessage]": (_ok_commands, _commands),
    "ExitError": (_ok_exit_error, _exit_error),
    "BrokerId": (lambda v: isinstance(v, tuple) and len(v) == 2 and isinstance(v[0], str) and _is_u64(v[1]), _broker_id),
    "WorkerError": (_ok_instance(WorkerError), _instance(WorkerError)),
    "Optional[Declared]": (lambda v: v is None or _ok_declared(v), _opt(_declared)),
}

_FIELD_CHECKS: dict[type, tuple] = {}
#: every WorkerMessage class (``messages.WORKER_MESSAGES``): what a ``list[WorkerMessage]`` field may hold
WORKER_TYPES: set = set()
_MISSING = object()


def _valid(msg) -> bool:
    for name, ok, _ in _FIELD_CHECKS[type(msg)]:
        if not ok(getattr(msg, name, _MISSING)):
            return False
    return True


def call_function_ok(m) -> bool:
    """The hot path's check of a ``CallFunction`` (every call a worker unpickles): all its fields at once, inline;
    ``validate`` names a bad one."""
    seq = m.seq
    if (type(seq) is int and 0 <= seq < _U64 and type(m.stream) is StreamRef and type(m.args_kwargs) is ArgsKwargs
            and type(m.function) in _FUNCTIONS):
        results, mutates, groups = m.results, m.mutates, m.remote_process_groups
        if type(results) in _LISTS and type(mutates) in _LISTS and type(groups) in _LISTS:
            for r in results:
                if r is not None and type(r) is not Ref:
                    return False
            for r in (*mutates, *groups):
                if type(r) is not Ref:
                    return False
            declared = m.declared
            return declared is None or (_ok_declared(declared) and len(declared) == len(results))
    return False


def validate(msg, where: str | None = None) -> None:
    """Check every field of ``msg`` (a message dataclass); raise ``ProtocolError`` naming the first bad one."""
    checks = _FIELD_CHECKS.get(type(msg))
    if checks is None:
        raise ProtocolError(f"{where or 'message'}: expected a WorkerMessage, got {_describe(msg)}")
    for name, ok, check in checks:
        value = getattr(msg, name, _MISSING)
        if not ok(value):
            prefix = where or type(msg).__name__
            if value is _MISSING:
                raise ProtocolError(f"{prefix}.{name}: missing")
            check(f"{prefix}.{name}", value)


def message(cls):
    """Make ``cls`` a slotted dataclass whose constructor validates its fields, and which pickles as a call of
    that constructor: the receiver validates every message while unpickling it."""
    cls = dataclass(slots=True)(cls)
    fields = dataclasses.fields(cls)
    _FIELD_CHECKS[cls] = tuple((f.name, *_CHECKS[f.type]) for f in fields)
    cls.__reduce__ = _constructor_call(cls, tuple(f.name for f in fields))
    return cls


def _constructor_call(cls, names: tuple):
    values = operator.attrgetter(*names)
    single = len(names) == 1

    def __reduce__(self):
        try:
            args = values(self)
        except AttributeError:  # built without its constructor: unpickling names the missing field
            return (_unbuilt, (cls, {name: getattr(self, name) for name in names if hasattr(self, name)}))
        return (cls, (args,) if single else args)

    return __reduce__


def _unbuilt(cls, fields: dict):
    """Unpickle a message that was built without its constructor: raises ``ProtocolError`` naming what is
    missing (``validate``)."""
    msg = object.__new__(cls)
    for name, value in fields.items():
        object.__setattr__(msg, name, value)
    validate(msg)
    return msg


class Validated:
    __slots__ = ()

    def __post_init__(self):
        validate(self)
