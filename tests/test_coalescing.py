"""Monarch's test_coalescing.py basic/nested/no_coalescing cases on CPU workers (spec §9 "Python tests",
test_coalescing.py; spec §1 "Coalescing and compile").

Monarch counts the messages its recorder holds; here the test wraps ``session.send`` and sees both what a block
holds back (``send`` called inside a block) and what reaches the transport (``send`` called outside one: the
``CommandGroup``s at the outermost exit). The compile/recording cases belong to a later issue.
"""

from __future__ import annotations

import pytest
import torch

import dask_monarch as dm
from dask_monarch.controller.coalescing import held_messages, is_coalescing
from dask_monarch.protocol import CallFunction, CommandGroup

TIMEOUT = 60


class Sends:
    """Every ``session.send`` call as (message, targets, inside a coalescing block)."""

    def __init__(self, session):
        self.session = session
        self.calls = []
        send = session.send

        def recording(message, ranks=None):
            targets = session._all if ranks is None else tuple(ranks)
            self.calls.append((message, targets, is_coalescing()))
            return send(message, ranks)

        session.send = recording

    @property
    def held(self) -> list:
        """Messages a block held back."""
        return [m for m, _, inside in self.calls if inside]

    @property
    def transported(self) -> list:
        """(message, targets) that went to the transport."""
        return [(m, t) for m, t, inside in self.calls if not inside]

    def outstanding(self) -> int:
        """Messages held by the active block for this session (Monarch's ``num_outstanding_messages``)."""
        held = held_messages()
        return 0 if held is None else len(held.get(self.session, ()))


def groups_per_rank(transported, world: int) -> dict:
    """rank -> the CommandGroups sent to it."""
    per_rank = {r: [] for r in range(world)}
    for message, targets in transported:
        if isinstance(message, CommandGroup):
            for r in targets:
                per_rank[r].append(message)
    return per_rank


def test_basic_coalescing(mesh2x2):
    sends = Sends(mesh2x2._session)
    with mesh2x2.activate():
        with dm.coalescing():
            a = torch.zeros(3, 4)
            for _ in range(1, 10):
                a = a + torch.ones(3, 4)
            # nothing has been sent since coalescing is enabled
            assert sends.outstanding() >= 10
            assert sends.transported == []
            with pytest.raises(RuntimeError, match="coalescing"):
                dm.fetch_shard(a)
        # the block's end sent its messages: one CommandGroup per rank (all four ranks have the same ones)
        assert sends.outstanding() == 0
        assert len(sends.transported) == 1
        per_rank = groups_per_rank(sends.transported, 4)
        assert all(len(groups) == 1 for groups in per_rank.values())
        group = per_rank[0][0]
        assert list(group.commands) == sends.held
        assert len(group.commands) >= 19 and all(isinstance(c, CallFunction) for c in group.commands)
        local = dm.fetch_shard(a, host=1, gpu=1).result(timeout=TIMEOUT)
    assert torch.equal(local, torch.full((3, 4), 9.0))


def test_coalescing_per_rank_groups(mesh2x2):
    """Ranks that got different messages in a block get different groups, still one each."""
    sends = Sends(mesh2x2._session)
    host1 = mesh2x2.slice(host=1)
    with mesh2x2.activate():
        with dm.coalescing():
            a = torch.ones(2)
            with host1.activate():
                b = torch.full((2,), 5.0)
            c = a * 3
        assert sends.held and sends.outstanding() == 0
        per_rank = groups_per_rank(sends.transported, 4)
        assert all(len(groups) == 1 for groups in per_rank.values())
        assert [len(per_rank[r][0].commands) for r in range(4)] == [2, 2, 3, 3]
        la, lc = dm.fetch_shard((a, c), host=0, gpu=1).result(timeout=TIMEOUT)
    lb = dm.fetch_shard(b, gpu=1).result(timeout=TIMEOUT)
    assert torch.equal(la, torch.ones(2)) and torch.equal(lc, torch.full((2,), 3.0))
    assert torch.equal(lb, torch.full((2,), 5.0))


def test_nested_coalescing(mesh2x2):
    sends = Sends(mesh2x2._session)
    with mesh2x2.activate():
        with dm.coalescing():
            a = torch.zeros(3, 4)
            with dm.coalescing():
                for _ in range(1, 10):
                    a = a + torch.ones(3, 4)
                # messages are waiting to be sent
                assert sends.outstanding() >= 10
            # the inner block's end does not flush
            assert sends.outstanding() >= 10
            assert sends.transported == []
        # the outer block's end does: one CommandGroup per rank
        assert sends.outstanding() == 0
        per_rank = groups_per_rank(sends.transported, 4)
        assert all(len(groups) == 1 for groups in per_rank.values())
        assert list(per_rank[0][0].commands) == sends.held
        local = dm.fetch_shard(a).result(timeout=TIMEOUT)
    assert torch.equal(local, torch.full((3, 4), 9.0))


def test_no_coalescing(mesh2x2):
    sends = Sends(mesh2x2._session)
    with mesh2x2.activate():
        a = torch.zeros(3, 4)
        for _ in range(1, 10):
            a = a + torch.ones(3, 4)
        # without coalescing every message goes to the transport as it is made, nothing is held
        assert sends.outstanding() == 0
        assert sends.held == []
        kinds = [type(m) for m, _ in sends.transported]
        assert kinds == [CallFunction] * 19
        local = dm.fetch_shard(a).result(timeout=TIMEOUT)
    assert torch.equal(local, torch.full((3, 4), 9.0))
