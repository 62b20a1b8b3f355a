"""What the thread hand-offs of an answer channel cost (issue 13 item 1, option (c)): one small request and its answer
between a thread of one process and a thread of another, over loopback, two ways.

* ``comm`` (the baseline, today's channel design): a Dask comm; each side's thread hands what it sends to its
  event loop (``call_soon_threadsafe``), and each event loop hands what it reads to a thread, as the controller's
  program thread, the worker's dispatcher and stream threads and the two event loops do for a fetch.
* ``socket`` (the alternative): a blocking TCP socket per connection with a reader thread at each end; the thread
  that sends writes on the socket itself, no event loop in between.

Both carry the same payloads (a pickled dict with a 200-byte segment; a pickled answer) and both wake the same
number of threads on the answering side (reader, then the answering thread). Prints each way's p50 / p90 in us
over ``n`` round trips (after a warm-up), repeated ``--repeat`` times alternately, and the ratio socket / comm.

Usage: ``python bench/handoffs.py [-n 2000] [--repeat 3]``.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import multiprocessing as mp
import os
import pickle
import socket
import statistics
import struct
import sys
import threading
import time

SWITCH_INTERVAL = 0.0005  # dask_monarch's (interpreter.py)
WARMUP = 200


def _answer(msg: dict) -> dict:
    return {"d": pickle.dumps(("answer", msg["b"]))}


# ------------------------------------------------------------------------------------------------ Dask comm way
def _take(cond, inbox: list):
    """The next message ``_deliver`` put in ``inbox`` (None: the connection ended), waiting for it."""
    with cond:
        while not inbox:
            cond.wait()
        return inbox.pop(0)


def _deliver(cond, inbox: list, msg) -> None:
    """Hand ``msg`` (None: the connection ended) to the answering thread waiting on ``cond``."""
    with cond:
        inbox.append(msg)
        cond.notify()


def _serve_comm(ready) -> None:
    from distributed.comm import listen
    from distributed.utils import LoopRunner

    sys.setswitchinterval(SWITCH_INTERVAL)
    runner = LoopRunner(asynchronous=False)
    runner.start()
    loop = runner.loop.asyncio_loop
    inbox: list = []
    cond = threading.Condition()
    comms: list = []
    tasks: set = set()

    async def handle(comm):
        comms.append(comm)
        try:
            while True:
                _deliver(cond, inbox, await comm.read())
        except Exception:
            _deliver(cond, inbox, None)

    def write(answer):
        task = asyncio.ensure_future(comms[0].write(answer))
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    async def start():
        listener = listen("tcp://127.0.0.1:0", handle)
        await listener.start()
        return listener.contact_address

    ready.put(asyncio.run_coroutine_threadsafe(start(), loop).result())
    while (msg := _take(cond, inbox)) is not None:  # the answering thread
        loop.call_soon_threadsafe(write, _answer(msg))


def _ask_comm(address, n: int) -> list[float]:
    from distributed.comm import connect
    from distributed.utils import LoopRunner

    runner = LoopRunner(asynchronous=False)
    runner.start()
    loop = runner.loop.asyncio_loop
    box: dict = {}
    tasks: set = set()

    async def setup():
        comm = await connect(address)
        box["comm"] = comm

        async def read():
            try:
                while True:
                    msg = await comm.read()
                    pickle.loads(msg["d"])
                    box["future"].set_result(None)
            except Exception:
                pass

        tasks.add(asyncio.ensure_future(read()))

    asyncio.run_coroutine_threadsafe(setup(), loop).result()

    def write(msg):
        task = asyncio.ensure_future(box["comm"].write(msg))
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    times = []
    for i in range(n + WARMUP):
        t0 = time.perf_counter()
        box["future"] = concurrent.futures.Future()
        loop.call_soon_threadsafe(write, {"b": i, "s": [b"x" * 200]})
        box["future"].result(timeout=10)
        times.append(time.perf_counter() - t0)
    loop.call_soon_threadsafe(box["comm"].abort)
    time.sleep(0.1)
    runner.stop()
    return times[WARMUP:]


# --------------------------------------------------------------------------------------------- blocking socket way
def _send(sock, lock, obj) -> None:
    blob = pickle.dumps(obj)
    with lock:
        sock.sendall(struct.pack("<I", len(blob)) + blob)


def _recv_exact(sock, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        part = sock.recv(n - len(buf))
        if not part:
            raise EOFError
        buf += part
    return bytes(buf)


def _recv(sock):
    (size,) = struct.unpack("<I", _recv_exact(sock, 4))
    return pickle.loads(_recv_exact(sock, size))


def _serve_socket(ready) -> None:
    sys.setswitchinterval(SWITCH_INTERVAL)
    server = socket.create_server(("127.0.0.1", 0))
    ready.put(server.getsockname()[1])
    conn, _ = server.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    inbox: list = []
    cond = threading.Condition()
    lock = threading.Lock()

    def reader():
        try:
            while True:
                _deliver(cond, inbox, _recv(conn))
        except Exception:
            _deliver(cond, inbox, None)

    threading.Thread(target=reader, daemon=True).start()
    while (msg := _take(cond, inbox)) is not None:  # the answering thread
        _send(conn, lock, _answer(msg))


def _ask_socket(port, n: int) -> list[float]:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    box: dict = {}
    lock = threading.Lock()

    def reader():
        try:
            while True:
                msg = _recv(sock)
                pickle.loads(msg["d"])
                box["future"].set_result(None)
        except Exception:
            pass

    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    times = []
    for i in range(n + WARMUP):
        t0 = time.perf_counter()
        box["future"] = concurrent.futures.Future()
        _send(sock, lock, {"b": i, "s": [b"x" * 200]})
        box["future"].result(timeout=10)
        times.append(time.perf_counter() - t0)
    sock.shutdown(socket.SHUT_RDWR)
    sock.close()
    thread.join(10)
    return times[WARMUP:]


WAYS = {"comm": (_serve_comm, _ask_comm), "socket": (_serve_socket, _ask_socket)}


def measure(way: str, n: int) -> list[float]:
    serve, ask = WAYS[way]
    ctx = mp.get_context("spawn")
    ready = ctx.Queue()
    server = ctx.Process(target=serve, args=(ready,), daemon=True)
    server.start()
    try:
        return ask(ready.get(timeout=60), n)
    finally:
        server.join(10)
        if server.is_alive():
            server.kill()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", type=int, default=2000, help="round trips per measurement (default 2000)")
    parser.add_argument("--repeat", type=int, default=3, help="measurements of each way, alternately (default 3)")
    args = parser.parse_args(argv)
    sys.setswitchinterval(SWITCH_INTERVAL)
    p50: dict = {way: [] for way in WAYS}
    p90: dict = {way: [] for way in WAYS}
    for _ in range(args.repeat):
        for way in WAYS:
            us = sorted(t * 1e6 for t in measure(way, args.n))
            p50[way].append(statistics.median(us))
            p90[way].append(us[int(0.9 * len(us))])
    print(f"\nthread hand-offs of a request/answer ({os.cpu_count()} cores; load average {os.getloadavg()[0]:.1f}; "
          f"{args.n} round trips x {args.repeat})")
    for way in WAYS:
        print(f"  {way:<8} p50 " + " ".join(f"{v:7.0f}" for v in p50[way]) + " us   p90 "
              + " ".join(f"{v:7.0f}" for v in p90[way]) + " us")
    ratio = statistics.median(p50["socket"]) / statistics.median(p50["comm"])
    print(f"  ratio socket / comm (median of the p50s): {ratio:.2f}")


if __name__ == "__main__":
    main()
