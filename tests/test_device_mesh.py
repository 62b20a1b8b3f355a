"""The worker-side ``DeviceMesh`` (spec §6 "Worker DeviceMesh::new", ``get_ranks_for_dim_slice``; spec §9
device_mesh.rs **basic** and **get_ranks_for_dim_slice**)."""

from __future__ import annotations

import pytest

from dask_monarch.protocol import Slice
from dask_monarch.worker.device_mesh import DeviceMesh, MeshError, mesh_rank, rank_tensor


def test_basic_2x3_mesh_seen_from_rank_1():
    mesh = DeviceMesh(["x", "y"], Slice(0, [2, 3], [3, 1]), 1)
    x, y = mesh.dim("x"), mesh.dim("y")
    assert (x.rank, x.size, list(x.members)) == (0, 2, [1, 4])
    assert (y.rank, y.size, list(y.members)) == (1, 3, [0, 1, 2])
    assert mesh.ranks() == {"x": 0, "y": 1}
    assert mesh.sizes() == {"x": 2, "y": 3}
    assert mesh.all_ranks == [0, 1, 2, 3, 4, 5]


@pytest.fixture
def mesh_2x2x2():
    return DeviceMesh(["x", "y", "z"], Slice(0, [2, 2, 2], [4, 2, 1]), 1)


def test_2x2x2_members_of_each_dim(mesh_2x2x2):
    assert list(mesh_2x2x2.dim("x").members) == [1, 5]
    assert list(mesh_2x2x2.dim("y").members) == [1, 3]
    assert list(mesh_2x2x2.dim("z").members) == [0, 1]
    assert mesh_2x2x2.ranks() == {"x": 0, "y": 0, "z": 1}


@pytest.mark.parametrize(
    "names, expected",
    [
        ([], []),
        (["x"], [1, 5]),
        (["y"], [1, 3]),
        (["z"], [0, 1]),
        (["x", "y"], [1, 3, 5, 7]),
        (["x", "z"], [0, 1, 4, 5]),
        (["y", "z"], [0, 1, 2, 3]),
        (["x", "y", "z"], list(range(8))),
        # the last listed name varies fastest, so an unsorted order transposes the result
        (["y", "x"], [1, 5, 3, 7]),
        (["z", "y"], [0, 2, 1, 3]),
        (["z", "y", "x"], [0, 4, 2, 6, 1, 5, 3, 7]),
    ],
)
def test_2x2x2_ranks_for_every_dim_combination(mesh_2x2x2, names, expected):
    assert mesh_2x2x2.get_ranks_for_dim_slice(names) == expected


def test_ranks_for_a_dim_slice_through_a_corner_rank():
    mesh = DeviceMesh(["x", "y", "z"], Slice(0, [2, 2, 2], [4, 2, 1]), 6)
    assert mesh.get_ranks_for_dim_slice(["x"]) == [2, 6]
    assert mesh.get_ranks_for_dim_slice(["y", "z"]) == [4, 5, 6, 7]
    assert mesh.get_ranks_for_dim_slice(["x", "z"]) == [2, 3, 6, 7]


def test_mesh_with_offset_and_size_one_dim():
    mesh = DeviceMesh(["a", "b"], Slice(4, [1, 3], [3, 1]), 5)
    assert mesh.ranks() == {"a": 0, "b": 1}
    assert list(mesh.dim("a").members) == [5]
    assert list(mesh.dim("b").members) == [4, 5, 6]
    assert mesh.get_ranks_for_dim_slice(["a", "b"]) == [4, 5, 6]


def test_rank_not_in_the_mesh_is_an_error():
    with pytest.raises(MeshError, match="rank 2 is not in the mesh"):
        DeviceMesh(["x"], Slice(0, [2], [3]), 2)


def test_wrong_name_count_is_an_error():
    with pytest.raises(MeshError, match="1 names"):
        DeviceMesh(["x"], Slice(0, [2, 3], [3, 1]), 0)
    with pytest.raises(MeshError, match="3 names"):
        DeviceMesh(["x", "y", "z"], Slice(0, [2, 3], [3, 1]), 0)


def test_unknown_dim_is_an_error(mesh_2x2x2):
    with pytest.raises(MeshError, match="unknown mesh dimension 'w'"):
        mesh_2x2x2.dim("w")
    with pytest.raises(MeshError, match="'w'"):
        mesh_2x2x2.get_ranks_for_dim_slice(["x", "w"])


def test_mesh_rank_and_rank_tensor():
    # a 3x4 mesh seen from rank 9: coordinates a=2, b=1
    mesh = DeviceMesh(["a", "b"], Slice.new_row_major([3, 4]), 9)
    assert mesh_rank(mesh, "a") == 2
    assert mesh_rank(mesh, "b") == 1
    assert int(rank_tensor(mesh, ["a", "b"])) == 2 * 4 + 1
    assert int(rank_tensor(mesh, ["b"])) == 1
