"""``History``'s progress: ``completed`` is the minimum of every rank's ``Status`` whatever order the answers come
in, one rank at a time (``status``) or a host's ranks at once (``status_many``, the relay's answer), and the call
that moves it says so (issue 23 item 6: the minimum is taken again only when the last rank at it moves)."""

import random

from dask_monarch.controller.history import History


def test_completed_is_the_minimum_of_every_ranks_status_and_the_advancing_call_says_so():
    rng = random.Random(23)
    for world, hosts in ((1, 1), (5, 1), (16, 4), (64, 8)):
        history = History(world)
        passed = [0] * world
        per_host = world // hosts
        for _ in range(2000):
            seq = rng.randrange(0, 40)
            before = min(passed)
            if rng.random() < 0.5:
                rank = rng.randrange(world)
                passed[rank] = max(passed[rank], seq)
                advanced = history.status(rank, seq)
            else:
                host = rng.randrange(hosts)
                ranks = range(host * per_host, (host + 1) * per_host)
                for r in ranks:
                    passed[r] = max(passed[r], seq)
                advanced = history.status_many(ranks, seq)
            assert history.completed == min(passed), (world, hosts)
            assert advanced == (min(passed) > before), (world, hosts)


def test_a_fetch_answered_host_by_host_advances_on_the_last_host_only():
    history = History(1024)
    hosts = [range(h * 8, h * 8 + 8) for h in range(128)]
    for seq in (1, 2, 3):
        results = [history.status_many(ranks, seq) for ranks in hosts]
        assert results == [False] * 127 + [True]
        assert history.completed == seq
