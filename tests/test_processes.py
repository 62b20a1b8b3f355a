"""``processes.sigstop``: it returns only once every thread of the process is stopped (a process merely sent
SIGSTOP may go on running some of its threads for a while: ``processes.py``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import psutil
import pytest

from processes import sigstop, thread_states

BUSY = textwrap.dedent("""
    import sys, threading
    def spin():
        while True:
            pass
    for _ in range(4):
        threading.Thread(target=spin, daemon=True).start()
    print("ready", flush=True)
    sys.stdin.read()
""")


def test_sigstop_returns_once_every_thread_is_stopped():
    proc = subprocess.Popen([sys.executable, "-c", BUSY], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().split() == ["ready"]
        assert len(thread_states(proc.pid)) == 5
        sigstop(proc.pid)
        states = thread_states(proc.pid)
        assert set(states.values()) == {psutil.STATUS_STOPPED}, states
        os.kill(proc.pid, signal.SIGCONT)
    finally:
        proc.kill()
        proc.wait()


def test_sigstop_of_no_such_process_raises():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    with pytest.raises((ProcessLookupError, psutil.NoSuchProcess)):
        sigstop(proc.pid)
