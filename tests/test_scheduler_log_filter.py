"""The scheduler's filter for gathers of task copies that their controller released (scheduler/log_filter.py): a
program that closes its Client under an open session must not find Dask's "Couldn't gather keys" ERROR in its
stderr (seen on the embedded default under load), while every other such line stays."""

from __future__ import annotations

import logging

import pytest

from dask_monarch.scheduler.log_filter import ForgottenGathers


def _record(states) -> logging.LogRecord:
    return logging.LogRecord("distributed.scheduler", logging.ERROR, __file__, 1, "Couldn't gather keys: %s",
                             (states,), None)


def test_a_gather_of_released_monarch_task_copies_goes_to_debug(caplog):
    with caplog.at_level(logging.DEBUG, logger="dask_monarch.scheduler"):
        kept = ForgottenGathers().filter(_record({"monarch-thtkunko-fetch-0-1": "forgotten",
                                                  "monarch-thtkunko-batch-3-0": "forgotten"}))
    assert kept is False
    assert any("released by their controller" in r.getMessage() and r.levelno == logging.DEBUG
               for r in caplog.records)


@pytest.mark.parametrize("states", [
    {"monarch-thtkunko-fetch-0-1": "memory"},  # a state other than forgotten: something is wrong
    {"monarch-thtkunko-fetch-0-1": "forgotten", "inc-123": "forgotten"},  # a user's key among them
    {"inc-123": "forgotten"},
    {},
])
def test_every_other_couldnt_gather_line_stays(states):
    assert ForgottenGathers().filter(_record(states)) is True


def test_other_records_of_the_scheduler_pass():
    record = logging.LogRecord("distributed.scheduler", logging.ERROR, __file__, 1, "something else: %s",
                               ({"monarch-x": "forgotten"},), None)
    assert ForgottenGathers().filter(record) is True


def test_the_scheduler_plugin_installs_it(shared_client1):
    def installed(dask_scheduler):
        return [type(f).__name__ for f in logging.getLogger("distributed.scheduler").filters]

    import dask_monarch as dm

    with dm.attach(shared_client1, dims={"dp": 1}):
        assert "ForgottenGathers" in shared_client1.run_on_scheduler(installed)
