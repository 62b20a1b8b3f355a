"""Each rank checks a remote function's results against what ``propagate`` declared (issue 26 item 5;
``worker/result_checks.py``): a result that is not a tensor of the declared dtype and shape fails that call only,
with a ``RemoteException`` on fetch naming the function, the output, and declared against returned; the session
and every other tensor stay usable."""

from __future__ import annotations

import pytest
import torch

import dask_monarch as dm

TIMEOUT = 60


def fetch(obj):
    return dm.fetch_shard(obj).result(timeout=TIMEOUT)


def _three(x):
    return torch.empty(3)


def _pair(x):
    return torch.empty(3), torch.empty(2, dtype=torch.int64)


def returns_int(x):
    return 5


def returns_none(x):
    return None


def returns_int64(x):
    return torch.arange(3)


def returns_wrong_shape(x):
    return torch.zeros(4)


def returns_three(x):
    return x[:3] * 2


def pair_wrong_second(x):
    return torch.zeros(3), torch.zeros(2)


int_result = dm.remote(returns_int, propagate=_three)
none_result = dm.remote(returns_none, propagate=_three)
int64_result = dm.remote(returns_int64, propagate=_three)
shape_result = dm.remote(returns_wrong_shape, propagate=_three)
good_result = dm.remote(returns_three, propagate=_three)
pair_result = dm.remote(pair_wrong_second, propagate=_pair)


@pytest.mark.parametrize("fn, returned", [
    (int_result, "returned int"),
    (none_result, "returned NoneType"),
    (int64_result, r"returned int64 \(3,\)"),
    (shape_result, r"returned float32 \(4,\)"),
])
def test_mismatch_fails_the_call(mesh1, fn, returned):
    with mesh1.activate():
        other = torch.ones(5)
        out = fn(other)
        assert out.dtype == torch.float32 and out.shape == (3,)
        with pytest.raises(dm.RemoteException, match=rf"result 0 of remote function .*{fn.__name__}.*"
                                                     rf"declared float32 \(3,\), {returned}"):
            fetch(out)
        # the same call again (its propagation is cached now) fails the same way
        with pytest.raises(dm.RemoteException, match=returned):
            fetch(fn(other))
        # an unrelated tensor and the session still work
        assert fetch(other + 1).tolist() == [2.0] * 5
        assert fetch(good_result(other)).tolist() == [2.0] * 3


def test_mismatch_names_the_output(mesh1):
    with mesh1.activate():
        a, b = pair_result(torch.ones(5))
        for t in (a, b):
            with pytest.raises(dm.RemoteException, match=r"result 1 .*declared int64 \(2,\), returned float32 \(2,\)"):
                fetch(t)


def test_matching_result(mesh1):
    with mesh1.activate():
        x = torch.arange(5, dtype=torch.float32)
        assert fetch(good_result(x)).tolist() == [0.0, 2.0, 4.0]
        assert fetch(good_result(x)).tolist() == [0.0, 2.0, 4.0]  # from the cached plan


def returns_object(x):
    return ValueError("an opaque value")


object_result = dm.remote(returns_object, propagate=_three)


def returns_scalar_tensor(x):
    return x.sum()


declared_one = dm.remote(returns_scalar_tensor, propagate=lambda x: torch.zeros(1))


def test_a_shape_that_differs_only_in_dimensions_of_size_1_is_accepted(mesh1):
    """Monarch's own tests declare ``torch.zeros(1)`` for a 0-d result; Monarch checks no shapes, so neither
    dimensions of size 1 fail the call here (the value is the worker's, as in Monarch)."""
    with mesh1.activate():
        value = fetch(declared_one(torch.ones(5)))
    assert value.item() == 5.0


def test_opaque_object_is_a_value(mesh1):
    """As in Monarch, a declared tensor may stand for an object that is not a plain value (a handle)."""
    with mesh1.activate():
        value = fetch(object_result(torch.ones(5)))
    assert type(value) is ValueError and str(value) == "an opaque value"
