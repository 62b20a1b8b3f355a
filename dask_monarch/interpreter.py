"""Interpreter settings that dask_monarch holds in a process while its sessions run there, and gives back after the
last one (DESIGN.md "Performance design": the per-message cost is the budget).

* The GIL switch interval, Dask config ``monarch.switch-interval`` (seconds, default 0.0005; Python's own is
  0.005), in the controller and in the workers. A thread that waits for the GIL gets it after at most this long.
  Dask's event-loop thread carries every batch and takes the GIL again at each step of sending or receiving one;
  beside a busy thread (the controller's program, a worker's stream thread) each step waited up to Python's
  5 ms, and the first batch of a controller sending 200,000 messages reached its worker after up to 1.2 s
  instead of 0.03 s (``bench/dispatch.py --device cuda`` on 2 x H200).
* Gen-0 of the cyclic garbage collector's thresholds, Dask config ``monarch.gc-threshold`` (allocations, default
  20,000; Python's own is 700), in the workers and the controller: at 700, collections promote the messages in
  flight between the dispatcher and stream threads and cost a worker more than half its time per message
  (``bench/dispatch.py --profile``); on the controller each eager op makes a few tracked objects (its ``Tensor``,
  message, lists), so a gen-0 collection ran every few dozen ops.

A value of 0 (or None) leaves Python's setting alone. ``hold``/``release`` count holders, so sessions may open
and close in any order, and a controller and a worker in one process share the settings.
"""

from __future__ import annotations

import gc
import sys
import threading

import dask

__all__ = ["hold", "release", "SWITCH_INTERVAL", "GC_THRESHOLD"]

#: default of Dask config ``monarch.switch-interval`` (seconds)
SWITCH_INTERVAL = 0.0005
#: default of Dask config ``monarch.gc-threshold`` (allocations)
GC_THRESHOLD = 20_000

_lock = threading.Lock()
_holders = {"switch": 0, "gc": 0}
_saved: dict = {}  # setting -> Python's value while ours is in force


def _configured(setting: str):
    """The configured value of ``setting`` (0 leaves Python's alone); ``ValueError`` naming the Dask config key
    if it is not a number."""
    key, default, kind = (
        ("monarch.switch-interval", SWITCH_INTERVAL, float) if setting == "switch"
        else ("monarch.gc-threshold", GC_THRESHOLD, int)
    )
    value = dask.config.get(key, default)
    try:
        return kind(value or 0)
    except (TypeError, ValueError):
        raise ValueError(f"Dask config {key} must be a number ({kind.__name__}), got {value!r}") from None


def _apply(setting: str, value) -> None:
    if setting == "switch":
        current = sys.getswitchinterval()
        if 0 < value < current:
            _saved["switch"] = current
            sys.setswitchinterval(value)
    else:
        current = gc.get_threshold()
        if value > current[0]:
            _saved["gc"] = current
            gc.set_threshold(value, *current[1:])


def _restore(setting: str) -> None:
    if setting not in _saved:
        return
    value = _saved.pop(setting)
    if setting == "switch":
        sys.setswitchinterval(value)
    else:
        gc.set_threshold(*value)


def hold(gc_threshold: bool = False) -> None:
    """A session starts in this process: the switch interval (and, with ``gc_threshold``, the GC threshold) is
    set from Dask config if nobody holds it yet. All or nothing: a configured value that is not a number raises
    ``ValueError`` naming it, and then nothing is held or changed."""
    settings = ("switch", "gc") if gc_threshold else ("switch",)
    with _lock:
        values = {setting: _configured(setting) for setting in settings if _holders[setting] == 0}
        for setting in settings:
            if setting in values:
                _apply(setting, values[setting])
            _holders[setting] += 1


def release(gc_threshold: bool = False) -> None:
    """A session ended: the last holder of a setting gives Python its value back."""
    with _lock:
        for setting in ("switch", "gc") if gc_threshold else ("switch",):
            if _holders[setting] == 0:
                continue
            _holders[setting] -= 1
            if _holders[setting] == 0:
                _restore(setting)
