"""Where the controller's time per eager op goes (issue 27 item 3): ``x + x`` under ``activate()`` on a 1-worker
cluster, the loop of ``bench/per_op_min.py`` case (d).

Prints, in microseconds per call (min of 7 repeats of ``timeit``, in-process, no cluster for the first four):

* torch alone: ``x + x`` on a local 4x4 tensor;
* the same under a trivial ``TorchDispatchMode`` (``func(*args, **kwargs)``): torch's dispatch into a Python mode;
* ``torch.Tensor._make_wrapper_subclass`` of a 4x4 float32 wrapper (what ``Tensor.viewing`` makes per result);
* the python-side operator of a trivial wrapper subclass with the mode above returning a new wrapper;
* the loop itself (median and min of 5 rounds of ``--ops`` calls, synced after each round), and the CPU time of
  the loop's thread alone (``time.thread_time``); where dask_monarch has ``dispatch.operator_call`` (the operators'
  shortcut past torch's dispatcher), its rounds alternate with rounds that go torch's way, in the same session.

With ``--cprofile FILE`` the loop runs one more round of ``--ops`` calls under cProfile, writes the stats to
``FILE`` (``pstats``) and prints the top 35 functions by own time. With ``--loop N`` it only runs ``N`` ops in the
loop (for ``py-spy record -- python bench/per_op_profile.py --loop 200000``).

Usage::

    python bench/per_op_profile.py [--ops 20000] [--cprofile out.pstats] [--loop N]
"""

from __future__ import annotations

import argparse
import cProfile
import platform
import pstats
import statistics
import sys
import time
import timeit

import torch
from distributed import Client
from torch.utils._python_dispatch import TorchDispatchMode

import dask_monarch as dm
from dask_monarch.cluster import start_local_cluster
from dask_monarch.controller.mesh import frontend


def _torch_way(op, tensor, other):
    """``frontend.operator_call`` that never takes the shortcut: every ``x + x`` goes through torch's dispatcher."""
    return None


class _Trivial(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class _Wrapper(torch.Tensor):
    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls):
        return torch.Tensor._make_wrapper_subclass(cls, (4, 4), strides=(4, 1), storage_offset=0,
                                                   dtype=torch.float32, device=torch.device("cpu"))

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return _Wrapper()


class _WrapperMode(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return _Wrapper()


def _us(stmt, number: int = 20000) -> float:
    return min(timeit.repeat(stmt, number=number, repeat=7)) / number * 1e6


def micro() -> None:
    x = torch.ones(4, 4)
    plain = _us(lambda: x + x)
    with _Trivial():
        moded = _us(lambda: x + x)
    device = torch.device("cpu")
    make = _us(lambda: torch.Tensor._make_wrapper_subclass(_Wrapper, (4, 4), strides=(4, 1), storage_offset=0,
                                                          dtype=torch.float32, device=device))
    w = _Wrapper()
    sub = _us(lambda: w + w)
    with _WrapperMode():
        sub_mode = _us(lambda: w + w)
    print(f"torch {torch.__version__} Python {platform.python_version()} {platform.processor() or platform.machine()}")
    print(f"micro (us/call): x + x {plain:.2f}; under a trivial mode {moded:.2f}; _make_wrapper_subclass {make:.2f}; "
          f"wrapper subclass w + w {sub:.2f}; w + w under a mode returning a wrapper {sub_mode:.2f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=20000)
    parser.add_argument("--cprofile", default=None)
    parser.add_argument("--loop", type=int, default=0)
    args = parser.parse_args()
    if not args.loop:
        micro()
    cluster = start_local_cluster(1, silence_logs=40)
    client = Client(cluster, set_as_default=False)
    try:
        with dm.attach(client, dims={"w": 1}) as one, one.activate():
            x = torch.ones(4, 4)
            for _ in range(500):
                x + x
            dm.inspect(x + x)
            if args.loop:
                t0 = time.perf_counter()
                for _ in range(args.loop):
                    x + x
                one._session.sync("loop").result()
                print(f"loop: {(time.perf_counter() - t0) / args.loop * 1e6:.1f} us/op", flush=True)
                return
            shortcut = getattr(frontend, "operator_call", None)
            # a tree without the shortcut (main before it): its own way only
            ways = {"shortcut": shortcut, "torch's way": _torch_way} if shortcut else {"no shortcut": None}
            figures: dict = {way: ([], []) for way in ways}
            for _ in range(5):
                for way, fn in ways.items():  # alternating, the same session
                    if shortcut:
                        frontend.operator_call = fn
                    t0, c0 = time.perf_counter(), time.thread_time()
                    for _ in range(args.ops):
                        x + x
                    figures[way][0].append((time.perf_counter() - t0) / args.ops * 1e6)
                    figures[way][1].append((time.thread_time() - c0) / args.ops * 1e6)
                    one._session.sync("r").result()
            if shortcut:
                frontend.operator_call = shortcut
            for way, (rounds, cpu) in figures.items():
                print(f"loop, {way} (us/op): median {statistics.median(rounds):.1f} min {min(rounds):.1f}; the loop's "
                      f"thread's CPU time median {statistics.median(cpu):.1f} min {min(cpu):.1f}", flush=True)
            if args.cprofile:
                prof = cProfile.Profile()
                prof.enable()
                for _ in range(args.ops):
                    x + x
                prof.disable()
                one._session.sync("p").result()
                prof.dump_stats(args.cprofile)
                pstats.Stats(prof, stream=sys.stdout).sort_stats("tottime").print_stats(35)
    finally:
        client.close()
        cluster.close()


if __name__ == "__main__":
    main()
