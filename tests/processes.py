"""Stopping a process for the tests of stopped workers and schedulers (SIGSTOP): ``sigstop(pid)`` returns once the
process is stopped, not merely signalled.

``kill(2)`` returns once the signal is queued. For a multi-threaded process the kernel wakes one of its threads to
take a SIGSTOP, and that thread then stops the others (a *group stop*, signal(7), ptrace(2) "Group-stop"); until
it has been scheduled, the other threads go on running. On a loaded 2-core machine that took long enough for a
worker "stopped" this way to answer a fetch sent right after the kill: the fetch returned its value instead of
the ``TimeoutError`` the test expected (``test_failures.py::test_fetch_timeout_with_a_stopped_worker_...`` in a
loaded full run; reproduced on 2026-12-05 on the 2-core machine at load 14-18: the fetch returned at once, the
worker's /proc state read "R" after ``os.kill`` returned; in 5 of 8 more tries some of its 8 threads were still
``running`` or ``sleeping`` as ``os.kill`` returned).
"""

from __future__ import annotations

import os
import signal
import time

import psutil

__all__ = ["sigstop"]


def thread_states(pid: int) -> dict[int, str]:
    """The state of every thread of process ``pid`` (``psutil``'s names: ``"running"``, ``"sleeping"``,
    ``"stopped"``, ...), by thread id; a thread that ended meanwhile is left out."""
    states = {}
    for thread in psutil.Process(pid).threads():
        try:
            states[thread.id] = psutil.Process(thread.id).status()  # /proc/<tid>/stat: that thread's own state
        except psutil.NoSuchProcess:
            pass
    return states


def sigstop(pid: int, timeout: float = 30.0) -> None:
    """Send SIGSTOP to process ``pid`` and wait until every one of its threads is stopped, polling its threads'
    states every 10 ms for at most ``timeout`` seconds. Raises ``TimeoutError`` naming the threads not yet
    stopped and their states (after sending SIGCONT: the process is not left half stopped), ``psutil.NoSuchProcess``
    if there is no such process."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while True:
        running = {tid: state for tid, state in thread_states(pid).items() if state != psutil.STATUS_STOPPED}
        if not running:
            return
        if time.monotonic() >= deadline:
            os.kill(pid, signal.SIGCONT)
            raise TimeoutError(f"process {pid} was sent SIGSTOP {timeout:g} s ago and these of its threads are not "
                               f"stopped yet: {running}")
        time.sleep(0.01)
