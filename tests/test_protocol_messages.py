"""Worker messages (spec §2), ``WireValue`` (spec §8) and ``ResolvableFunction`` resolution (spec §2 "Function
paths"). Pure unit tests, no cluster."""

from __future__ import annotations

import dataclasses
import os
import pickle

import cloudpickle
import pytest
import torch

from dask_monarch.protocol import (
    WORKER_MESSAGES,
    ActorCallParams,
    ArgsKwargs,
    BackendNetworkInit,
    BackendNetworkPointToPointInit,
    BorrowCreate,
    BorrowDrop,
    BorrowFirstUse,
    BorrowLastUse,
    CallActorMethod,
    CallFunction,
    CallRecording,
    Cloudpickle,
    CommandGroup,
    CreateDeviceMesh,
    CreateRemoteProcessGroup,
    CreateStream,
    DefineRecording,
    DeleteRefs,
    Exit,
    Factory,
    FetchResult,
    FunctionPath,
    GetRefResult,
    GetRefUnitTestsOnly,
    PipeRecv,
    ProtocolError,
    RecordingFormal,
    RecordingResult,
    Reduce,
    Reduction,
    RemoteFunctionFailed,
    RequestStatus,
    SendResultOfActorCall,
    SendTensor,
    SendValue,
    SessionFailed,
    SetRefUnitTestsOnly,
    Slice,
    SplitComm,
    SplitCommForProcessGroup,
    Status,
    StreamCreationMode,
    StreamRef,
    Ref,
    WireValue,
    WorkerError,
    resolve_function,
    validate,
)

S0, S1 = StreamRef(0), StreamRef(1)
ADD = FunctionPath("torch.ops.aten.add.Tensor")
FACTORY = Factory((2, 3), torch.float32)
PARAMS = ActorCallParams(7, ("broker", 0), [Ref(1)], [Ref(2)], S0, "forward", ArgsKwargs((Ref(1),), {}))


def _samples() -> dict:
    """One valid instance of every worker message variant (and ``ActorCallParams``)."""
    return {
        BackendNetworkInit: BackendNetworkInit("session/net"),
        BackendNetworkPointToPointInit: BackendNetworkPointToPointInit(S0, S1),
        CallFunction: CallFunction(3, [Ref(1), None], [Ref(2)], ADD, ArgsKwargs((Ref(0), 1), {"alpha": 2}), S0, []),
        CommandGroup: CommandGroup([CreateStream(S1, StreamCreationMode.CreateNewStream), DeleteRefs([Ref(4)])]),
        CreateStream: CreateStream(S1, StreamCreationMode.UseDefaultStream),
        CreateDeviceMesh: CreateDeviceMesh(Ref(5), ["x", "y"], Slice(0, [2, 3], [3, 1])),
        CreateRemoteProcessGroup: CreateRemoteProcessGroup(Ref(6), Ref(5), ["x"]),
        BorrowCreate: BorrowCreate(Ref(7), 0, Ref(1), S0, S1),
        BorrowFirstUse: BorrowFirstUse(0),
        BorrowLastUse: BorrowLastUse(0),
        BorrowDrop: BorrowDrop(0),
        DeleteRefs: DeleteRefs([Ref(1), Ref(2)]),
        RequestStatus: RequestStatus(10, False),
        Reduce: Reduce(Ref(8), Ref(1), FACTORY, Ref(5), S0, ["x"], Reduction.Sum, False, False, None),
        SplitComm: SplitComm(["x", "y"], Ref(5), S0),
        SplitCommForProcessGroup: SplitCommForProcessGroup(Ref(6), S0),
        SendTensor: SendTensor(Ref(9), Slice(0, [1], [1]), Slice(1, [1], [1]), Ref(1), FACTORY, S0, S0),
        SendValue: SendValue(11, None, [], None, ArgsKwargs((Ref(1),)), S0),
        ActorCallParams: PARAMS,
        SendResultOfActorCall: SendResultOfActorCall(PARAMS),
        CallActorMethod: CallActorMethod([Ref(3), None], PARAMS),
        PipeRecv: PipeRecv(12, [Ref(3)], Ref(4), S0),
        Exit: Exit(),
        DefineRecording: DefineRecording(Ref(20), 1, 2, [RecordingFormal(Ref(21), 0, S0)], 1, 0),
        RecordingFormal: RecordingFormal(Ref(21), 0, S0),
        RecordingResult: RecordingResult(Ref(22), 0, S0),
        CallRecording: CallRecording(13, Ref(20), [Ref(23)], [Ref(1), Ref(2)]),
        SetRefUnitTestsOnly: SetRefUnitTestsOnly(Ref(1), WireValue("Int", 3), S0),
        GetRefUnitTestsOnly: GetRefUnitTestsOnly(Ref(1), S0),
    }


SAMPLES = _samples()
FIELDS = [(cls, f.name) for cls in SAMPLES for f in dataclasses.fields(cls)]


def test_every_worker_message_variant_has_a_sample():
    assert set(WORKER_MESSAGES) <= set(SAMPLES)
    assert len(WORKER_MESSAGES) == 28


@pytest.mark.parametrize("cls", list(SAMPLES), ids=lambda c: c.__name__)
def test_message_round_trips_through_pickle(cls):
    msg = SAMPLES[cls]
    for dumps in (pickle.dumps, cloudpickle.dumps):
        copy = pickle.loads(dumps(msg))
        assert type(copy) is cls
        assert copy == msg
        validate(copy)  # what the worker does on receipt


@pytest.mark.parametrize("cls, field", FIELDS, ids=[f"{c.__name__}.{f}" for c, f in FIELDS])
def test_a_bad_field_raises_protocol_error_naming_message_and_field(cls, field):
    kwargs = {f.name: getattr(SAMPLES[cls], f.name) for f in dataclasses.fields(cls)}
    kwargs[field] = object()
    with pytest.raises(ProtocolError, match=rf"^{cls.__name__}\.{field}: expected "):
        cls(**kwargs)


@pytest.mark.parametrize(
    "build, text",
    [
        (lambda: RequestStatus(-1, False), "RequestStatus.seq: expected a non-negative int, got -1"),
        (lambda: RequestStatus(True, False), "RequestStatus.seq: expected a non-negative int, got True (bool)"),
        (lambda: RequestStatus(1, 0), "RequestStatus.controller: expected a bool, got 0 (int)"),
        (lambda: RequestStatus(1 << 64, False), "RequestStatus.seq: expected a non-negative int"),
        (lambda: DeleteRefs([Ref(1), 2]), "DeleteRefs.refs[1]: expected a Ref, got 2 (int)"),
        (lambda: DeleteRefs(Ref(1)), "DeleteRefs.refs: expected a list"),
        (lambda: CreateStream(0, StreamCreationMode.UseDefaultStream), "CreateStream.id: expected a StreamRef"),
        (lambda: CreateStream(S0, "UseDefaultStream"), "CreateStream.stream_creation: expected a StreamCreationMode"),
        (lambda: CreateDeviceMesh(Ref(1), ["x", 2], Slice.new_row_major([2, 2])), "CreateDeviceMesh.names[1]"),
        (lambda: CallFunction(0, [None], [], "torch.ones", ArgsKwargs(), S0, []), "CallFunction.function: expected"),
        (lambda: Exit(("actor", 3)), "Exit.error: expected None or a (actor id or None, message) tuple"),
        (lambda: SendResultOfActorCall(ActorCallParams(1, ("b", -1), [], [], S0, "m", ArgsKwargs())), "ActorCallParams.broker_id"),
    ],
)
def test_protocol_error_texts(build, text):
    with pytest.raises(ProtocolError) as info:
        build()
    assert str(info.value).startswith(text)


def test_protocol_error_is_a_value_error():
    assert issubclass(ProtocolError, ValueError)


def test_nested_bad_message_is_named_by_its_position():
    inner = CreateStream(S1, StreamCreationMode.UseDefaultStream)
    inner.id = 1  # mutated after construction: no validation ran
    with pytest.raises(ProtocolError, match=r"^CommandGroup\.commands\[1\]\.id: expected a StreamRef"):
        CommandGroup([DeleteRefs([]), inner])
    with pytest.raises(ProtocolError, match=r"^DefineRecording\.commands\[0\]: expected a WorkerMessage"):
        DefineRecording(Ref(1), 0, 0, ["not a message"], 1, 0)


def test_validate_catches_what_bypasses_the_constructor():
    mutated = RequestStatus(1, False)
    mutated.seq = "1"
    with pytest.raises(ProtocolError, match=r"^RequestStatus\.seq: expected a non-negative int, got '1' \(str\)"):
        validate(mutated)
    unbuilt = object.__new__(GetRefUnitTestsOnly)
    with pytest.raises(ProtocolError, match=r"^GetRefUnitTestsOnly\.value: missing"):
        validate(unbuilt)
    with pytest.raises(ProtocolError, match="expected a WorkerMessage"):
        validate("CreateStream")


@pytest.mark.parametrize(
    "msg",
    [
        RemoteFunctionFailed(3, WorkerError("Traceback ...", "tcp://w:1/abc/rank0")),
        FetchResult(4, value=[1, 2]),
        FetchResult(5, error=WorkerError("boom", "w")),
        Status(101, "w", False),
        GetRefResult(Ref(3), WireValue("Bool", True), present=True),
        GetRefResult(Ref(4)),
        SessionFailed(WorkerError("fatal", "w")),
    ],
    ids=lambda m: type(m).__name__,
)
def test_controller_messages_round_trip_through_pickle(msg):
    assert pickle.loads(pickle.dumps(msg)) == msg


# ------------------------------------------------------------------------------------------------ WireValue
@pytest.mark.parametrize(
    "obj, kind",
    [
        (True, "Bool"),
        (False, "Bool"),
        (0, "Int"),
        (-5, "Int"),
        (1.5, "Double"),
        ("text", "String"),
        (None, "None"),
        (Ref(3), "Ref"),
        ([], "IntList"),
        ([1, 2, 3], "IntList"),
        ([Ref(1), Ref(2)], "RefList"),
        (torch.device("cpu"), "Device"),
        (torch.strided, "Layout"),
        (torch.float32, "ScalarType"),
        (torch.contiguous_format, "MemoryFormat"),
        ([1, "a"], "PyObject"),
        (["a", "b"], "PyObject"),
        ([Ref(1), 2], "PyObject"),
        ({"k": (1, 2)}, "PyObject"),
        ((1, 2), "PyObject"),
    ],
    ids=repr,
)
def test_wire_value_from_python_kind(obj, kind):
    assert WireValue.from_python(obj).kind == kind


@pytest.mark.parametrize(
    "obj",
    [True, 7, 2.5, "s", None, Ref(9), [], [4, 5], [Ref(1), Ref(2)], torch.device("cpu"), torch.int64,
     torch.channels_last, torch.strided, {"k": [1, "x"]}, [1, "a"]],
    ids=repr,
)
def test_wire_value_round_trips_to_python(obj):
    value = WireValue.from_python(obj)
    back = value.to_python()
    assert back == obj
    assert type(back) is type(obj)
    assert pickle.loads(pickle.dumps(value)) == value


def test_bool_is_never_an_int_wire_value():
    assert WireValue.from_python(True) != WireValue.from_python(1)
    with pytest.raises(ProtocolError, match="WireValue.value: True is not a valid Int"):
        WireValue("Int", True)


def test_wire_value_rejects_unknown_kind_and_mismatched_value():
    with pytest.raises(ProtocolError, match="WireValue.kind: unknown variant 'Float'"):
        WireValue("Float", 1.0)
    with pytest.raises(ProtocolError, match="not a valid IntList"):
        WireValue("IntList", [1, "2"])
    with pytest.raises(ProtocolError, match="not a valid PyObject"):
        WireValue("PyObject", {"not": "bytes"})


def test_args_kwargs_from_wire_values_converts_to_python():
    ak = ArgsKwargs.from_wire_values([WireValue("Int", 1), WireValue.from_python([Ref(2)])], {"x": WireValue("None")})
    assert ak.args == (1, [Ref(2)])
    assert ak.kwargs == {"x": None}


# ------------------------------------------------------------------------------------------ function paths
def _double(x):
    return 2 * x


def wrapper_with_remote_impl(x):
    raise AssertionError("the remote implementation should have been chosen")


wrapper_with_remote_impl._remote_impl = _double


def test_torch_path_is_a_getattr_chain_from_torch():
    # "torch.ops.aten.add" is not an importable module: only a getattr chain resolves this
    assert resolve_function(FunctionPath("torch.ops.aten.add.Tensor")) is torch.ops.aten.add.Tensor
    assert resolve_function(FunctionPath("torch.nn.functional.relu")) is torch.nn.functional.relu


def test_other_path_imports_the_module_and_takes_the_attribute():
    assert resolve_function(FunctionPath("os.path.split")) is os.path.split


def test_remote_impl_is_preferred():
    fn = resolve_function(FunctionPath(f"{__name__}.wrapper_with_remote_impl"))
    assert fn is _double


def test_path_without_a_dot_fails():
    with pytest.raises(ValueError, match="paths must be fully qualified"):
        resolve_function(FunctionPath("sorted"))


@pytest.mark.parametrize(
    "path, error",
    [("i.dont.exist", ModuleNotFoundError), ("os.path.no_such_function", AttributeError),
     ("torch.no_such_thing", AttributeError), ("math.pi", TypeError)],
)
def test_unresolvable_paths_raise(path, error):
    with pytest.raises(error):
        resolve_function(FunctionPath(path))


def test_cloudpickle_function_is_unpickled():
    offset = 5
    fn = resolve_function(Cloudpickle(cloudpickle.dumps(lambda x: x + offset)))
    assert fn(1) == 6


def test_function_reprs_name_the_function():
    assert repr(FunctionPath("i.dont.exist")) == '<function "i.dont.exist">'
    with pytest.raises(TypeError, match="FunctionPath.path must be a str"):
        FunctionPath(3)
    with pytest.raises(TypeError, match="Cloudpickle.bytes must be bytes"):
        Cloudpickle("not bytes")
