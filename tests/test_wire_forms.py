"""The flattened wire forms of ``CallFunction`` and ``DeleteRefs`` (``protocol/wire_forms.py``): every field
round-trips through pickle and cloudpickle, the message is rebuilt with ``Ref`` objects, and a bad field that
arrives on the wire raises ``ProtocolError`` naming the message and the field, as the constructor does."""

from __future__ import annotations

import pickle

import cloudpickle
import pytest
import torch

from dask_monarch.protocol import (
    ArgsKwargs,
    CallFunction,
    Cloudpickle,
    DeleteRefs,
    FunctionPath,
    ProtocolError,
    Ref,
    StreamRef,
    validate,
)
from dask_monarch.protocol.wire_forms import call_function_from_wire, delete_refs_from_wire

ADD = FunctionPath("torch.ops.aten.add.Tensor")
S3 = StreamRef(3)


def _full_call() -> CallFunction:
    """A call with every field set to something other than its default."""
    return CallFunction(
        7, [Ref(10), None, Ref(11)], [Ref(12), Ref(13)], ADD,
        ArgsKwargs((Ref(1), 2.5, [Ref(2), 3], "s", None), {"alpha": 2, "out": Ref(4)}), S3, [Ref(20)],
        ((torch.float32, (2, 3)), None, (torch.int64, ())),
    )


@pytest.mark.parametrize("dumps", [pickle.dumps, cloudpickle.dumps], ids=["pickle", "cloudpickle"])
@pytest.mark.parametrize("build", [
    _full_call,
    lambda: CallFunction(0, [Ref(1)], (), ADD, ArgsKwargs((Ref(0), Ref(0)), {}), StreamRef(0), ()),  # x + x
    lambda: CallFunction(1, (), [], Cloudpickle(cloudpickle.dumps(len)), ArgsKwargs(), StreamRef(0), []),
], ids=["every-field", "eager-op", "empty"])
def test_call_function_round_trips_every_field(build, dumps):
    msg = build()
    reduced = msg.__reduce__()
    assert reduced[0] is call_function_from_wire  # the flat form, not the constructor call
    copy = pickle.loads(dumps(msg))
    assert type(copy) is CallFunction and copy == msg
    for name in ("results", "mutates", "remote_process_groups"):  # the container types survive too
        assert type(getattr(copy, name)) is type(getattr(msg, name))
        assert all(r is None or type(r) is Ref for r in getattr(copy, name))
    assert type(copy.stream) is StreamRef and copy.stream.id == msg.stream.id
    assert type(copy.args_kwargs) is ArgsKwargs and copy.args_kwargs.args == msg.args_kwargs.args
    assert copy.args_kwargs.kwargs == msg.args_kwargs.kwargs and copy.declared == msg.declared
    validate(copy)


def test_delete_refs_round_trips_as_ids():
    for refs in ([Ref(1), Ref(2), Ref((1 << 64) - 1)], [], (Ref(5),)):
        msg = DeleteRefs(refs)
        assert msg.__reduce__() == (delete_refs_from_wire, ([r.id for r in refs] if type(refs) is list
                                                            else tuple(r.id for r in refs),))
        for dumps in (pickle.dumps, cloudpickle.dumps):
            copy = pickle.loads(dumps(msg))
            assert type(copy) is DeleteRefs and copy == msg and all(type(r) is Ref for r in copy.refs)


_GOOD = dict(seq=7, results=[10, None], mutates=[12], function=ADD, args=(1, 2), kwargs={}, stream=3, groups=[20],
             declared=None)


@pytest.mark.parametrize("field, value, text", [
    ("seq", -1, "CallFunction.seq: expected a non-negative int, got -1"),
    ("seq", "7", "CallFunction.seq: expected a non-negative int, got '7' (str)"),
    ("results", [10, "x"], "CallFunction.results[1]: expected a Ref or None, got 'x' (str)"),
    ("results", [1 << 64], "CallFunction.results[0]: expected a Ref or None, got 18446744073709551616"),
    ("results", "r10", "CallFunction.results: expected a list"),
    ("mutates", [None], "CallFunction.mutates[0]: expected a Ref, got None"),
    ("mutates", [-3], "CallFunction.mutates[0]: expected a Ref, got -3 (int)"),
    ("groups", [1.5], "CallFunction.remote_process_groups[0]: expected a Ref, got 1.5 (float)"),
    ("function", "torch.ones", "CallFunction.function: expected a FunctionPath or Cloudpickle"),
    ("stream", -1, "CallFunction.stream: expected a StreamRef, got -1 (int)"),
    ("stream", "0", "CallFunction.stream: expected a StreamRef, got '0' (str)"),
    ("args", [1, 2], "CallFunction.args_kwargs: expected a tuple of args and a dict of kwargs, got list and dict"),
    ("kwargs", None, "CallFunction.args_kwargs: expected a tuple of args and a dict of kwargs, got tuple and NoneType"),
    ("declared", ("float32",), "CallFunction.declared: expected None or a tuple"),
])
def test_a_bad_field_on_the_wire_raises_protocol_error_naming_it(field, value, text):
    fields = dict(_GOOD, **{field: value})
    with pytest.raises(ProtocolError) as info:
        call_function_from_wire(*fields.values())
    assert str(info.value).startswith(text)


@pytest.mark.parametrize("ids, text", [
    ([1, -1], "DeleteRefs.refs[1]: expected a Ref, got -1 (int)"),
    ([1, "2"], "DeleteRefs.refs[1]: expected a Ref, got '2' (str)"),
    (5, "DeleteRefs.refs: expected a list"),
])
def test_bad_delete_refs_on_the_wire_raise_protocol_error_naming_the_ref(ids, text):
    with pytest.raises(ProtocolError) as info:
        delete_refs_from_wire(ids)
    assert str(info.value).startswith(text)


def test_a_message_changed_after_construction_travels_as_its_constructor_call_and_fails_there():
    """A field the flat form cannot carry (here: ``results`` changed to hold a str, ``stream`` to an int) makes the
    message pickle as its constructor call, whose validation on the worker names the field."""
    call = _full_call()
    call.results = [Ref(1), "r2"]
    assert call.__reduce__()[0] is CallFunction
    with pytest.raises(ProtocolError, match=r"^CallFunction\.results\[1\]: expected a Ref or None, got 'r2'"):
        pickle.loads(pickle.dumps(call))
    call = _full_call()
    call.stream = 0
    with pytest.raises(ProtocolError, match=r"^CallFunction\.stream: expected a StreamRef, got 0 \(int\)"):
        pickle.loads(pickle.dumps(call))
    deletes = DeleteRefs([Ref(1)])
    deletes.refs = [Ref(1), 2]
    with pytest.raises(ProtocolError, match=r"^DeleteRefs\.refs\[1\]: expected a Ref, got 2 \(int\)"):
        pickle.loads(pickle.dumps(deletes))
    unbuilt = object.__new__(DeleteRefs)
    with pytest.raises(ProtocolError, match=r"^DeleteRefs\.refs: missing"):
        pickle.loads(pickle.dumps(unbuilt))
