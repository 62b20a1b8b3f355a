"""ndslice ``Slice`` (spec §6): validation, location/index/get/coordinates, iteration and membership."""

from __future__ import annotations

import pickle

import pytest

from dask_monarch.protocol import Slice, SliceError


# ---------------------------------------------------------------------------------------------- validation
def test_size_and_stride_counts_must_match():
    with pytest.raises(SliceError, match="2 sizes but 1 strides"):
        Slice(0, [2, 3], [1])


def test_nonrectangular_shape_is_rejected():
    # sorted by stride: 2 then 3, and 3 is not a multiple of 2
    with pytest.raises(SliceError, match="nonrectangular shape"):
        Slice(0, [2, 2], [2, 3])


def test_nonunique_strides_are_rejected():
    with pytest.raises(SliceError, match="nonunique strides"):
        Slice(0, [2, 2], [1, 1])


def test_repeated_stride_is_allowed_for_a_size_one_dim():
    s = Slice(0, [1, 3], [1, 1])
    assert list(s) == [0, 1, 2]


def test_stride_smaller_than_the_previous_space_is_rejected():
    # the dim of stride 1 spans 3 ranks, so the next stride must be at least 3
    with pytest.raises(SliceError, match="must be larger than size of previous space"):
        Slice(0, [3, 2], [1, 2])


@pytest.mark.parametrize(
    "offset, sizes, strides",
    [(-1, [2], [1]), (0, [-2], [1]), (0, [2], [-1]), (0, [2.0], [1]), ("0", [2], [1])],
)
def test_negative_or_non_int_fields_are_rejected(offset, sizes, strides):
    with pytest.raises(SliceError):
        Slice(offset, sizes, strides)


def test_slice_error_is_a_value_error():
    assert issubclass(SliceError, ValueError)


# ---------------------------------------------------------------------------------------------- addressing
def test_location_is_offset_plus_coordinates_times_strides():
    s = Slice(5, [2, 3], [10, 2])
    assert s.location([0, 0]) == 5
    assert s.location([1, 2]) == 5 + 10 + 4
    assert s.nditem([0, 1]) == 7


def test_location_rejects_out_of_range_or_wrong_length_coordinates():
    s = Slice(0, [2, 3], [3, 1])
    with pytest.raises(SliceError):
        s.location([2, 0])
    with pytest.raises(SliceError):
        s.location([0])


def test_len_and_iteration_are_row_major():
    s = Slice(1, [2, 3], [6, 2])
    assert len(s) == 6
    assert list(s) == [1, 3, 5, 7, 9, 11]


def test_iteration_follows_coordinates_not_strides():
    # the first dim has the smaller stride: row-major order over coordinates, not ascending ranks
    s = Slice(0, [2, 3], [1, 2])
    assert list(s) == [0, 2, 4, 1, 3, 5]


def test_empty_sizes_hold_only_the_offset():
    s = Slice(7, [], [])
    assert len(s) == 1
    assert list(s) == [7]
    assert s == Slice.single(7)
    assert s.coordinates(7) == []
    assert 7 in s and 6 not in s


def test_coordinates_decompose_from_the_largest_stride():
    s = Slice(2, [2, 3], [6, 2])
    assert s.coordinates(2) == [0, 0]
    assert s.coordinates(2 + 6 + 4) == [1, 2]
    s2 = Slice(0, [2, 3], [1, 2])
    assert s2.coordinates(5) == [1, 2]


@pytest.mark.parametrize("value", [1, 3, 14, 20])
def test_coordinates_of_a_rank_outside_the_slice_fail(value):
    # ranks 2, 4, 6, 8, 10, 12: odd values leave a remainder; 14 and 20 are out of range; 1 is below the offset
    s = Slice(2, [2, 3], [6, 2])
    with pytest.raises(SliceError, match=f"value {value} not in slice"):
        s.coordinates(value)


def test_size_one_dims_get_coordinate_zero():
    s = Slice(0, [1, 4], [4, 1])
    assert s.coordinates(3) == [0, 3]


def test_index_and_get_are_inverse():
    s = Slice(3, [2, 2, 3], [1, 6, 2])
    ranks = list(s)
    assert len(set(ranks)) == len(s)
    for i, rank in enumerate(ranks):
        assert s.get(i) == rank
        assert s.index(rank) == i


def test_index_of_missing_rank_is_a_value_error():
    with pytest.raises(ValueError, match="not in slice"):
        Slice(0, [2], [2]).index(1)


@pytest.mark.parametrize("index", [-1, 4])
def test_get_out_of_range_is_an_index_error(index):
    with pytest.raises(IndexError, match=f"index {index} out of range 4"):
        Slice(0, [2, 2], [2, 1]).get(index)


def test_membership():
    s = Slice(1, [2, 2], [4, 2])  # ranks 1, 3, 5, 7
    assert [r for r in range(10) if r in s] == [1, 3, 5, 7]


# ---------------------------------------------------------------------------------------------- constructors
def test_new_row_major():
    s = Slice.new_row_major([2, 3, 4])
    assert (s.offset, s.sizes, s.strides) == (0, [2, 3, 4], [12, 4, 1])
    assert list(s) == list(range(24))


def test_new_row_major_with_offset():
    s = Slice.new_row_major([2, 2], offset=4)
    assert list(s) == [4, 5, 6, 7]


def test_equality_hash_and_pickle():
    s = Slice(1, [2, 3], [6, 2])
    assert s == Slice(1, [2, 3], [6, 2])
    assert s != Slice(0, [2, 3], [6, 2])
    assert hash(s) == hash(Slice(1, (2, 3), (6, 2)))
    assert pickle.loads(pickle.dumps(s)) == s
