"""What a controller keeps across attach / op loop / fetch / exit cycles on a 4-worker LocalCluster (the loop of
the session-cycles measurement: 200 eager ops per cycle, a borrow + reduce on a side stream, fetches): RSS,
threads, fds after the warm cycle 0 and every 10 cycles; at the end, the growth of every object type and of
dask_monarch's between cycle SNAP1 and the last, the fds opened since the warm cycle, the threads. With TM=1,
tracemalloc (25 frames) and its top growth by traceback and by file as well (slow: 10x under load).

usage: python bench/session_cycles.py CYCLES SNAP1 [ITER]   e.g. 30 10 (about 2 min on an idle 2-core machine)

Note: LocalCluster's scheduler runs in this process: its bounded Dask histories (BatchedSend logs of the tasks'
SessionParams, computations, events) and the dashboard's ENDED_KEPT sessions count here too.
"""
import collections, gc, os, sys, threading, time, tracemalloc
import torch
from distributed import Client, LocalCluster
import dask_monarch as dm

CYCLES = int(sys.argv[1]); SNAP1 = int(sys.argv[2]); ITER = int(sys.argv[3]) if len(sys.argv) > 3 else 200

def rss():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmRSS")) / 1024

def fds():
    out = {}
    for n in os.listdir("/proc/self/fd"):
        try: out[n] = os.readlink(f"/proc/self/fd/{n}")
        except OSError: pass
    return out

def all_objects():
    return collections.Counter(type(o).__module__ + "." + type(o).__qualname__ if isinstance(type(o).__module__, str) else type(o).__qualname__ for o in gc.get_objects())

def dm_objects():
    c = collections.Counter()
    for o in gc.get_objects():
        m = type(o).__dict__.get("__module__") if isinstance(type(o).__dict__.get("__module__"), str) else ""
        if m.startswith("dask_monarch"):
            c[m + "." + type(o).__qualname__] += 1
    return c

def cycle(client, c):
    mesh = dm.attach(client, dims={"dp": 4})
    side = dm.Stream("side")
    with mesh.activate():
        rk = mesh.rank("dp").to(torch.float64)
        x = torch.zeros(1000, dtype=torch.float64)
        want = [0.0] * 4
        for i in range(ITER):
            x = x + rk + i
            for r in range(4):
                want[r] += r + i
            y = x * 2
            del y
            if i % 25 == 0:
                xs, b = side.borrow(x)
                with side.activate():
                    s = xs.reduce("dp", "sum")
                b.drop()
                got = dm.fetch_shard(s, dp=i % 4).result(timeout=120)
                assert float(got.tolist()[0]) == sum(want), (c, i)
                del s, xs
            if i % 20 == 0:
                got = dm.fetch_shard(x, dp=i % 4).result(timeout=120)
                assert float(got.tolist()[0]) == want[i % 4], (c, i)
    mesh.exit()

def main():
    cluster = LocalCluster(n_workers=4, threads_per_worker=1, processes=True, dashboard_address=":0", silence_logs=40)
    client = Client(cluster)
    t0 = time.time()
    snap1 = None; objs1 = None; fds1 = None; base = None
    cycle(client, 0)
    gc.collect()
    objs0 = dm_objects(); fds0 = fds()
    print("after cycle 0 (warm): rss", round(rss(), 1), "threads", threading.active_count(), "fds", len(fds0), flush=True)
    tracemalloc.start(25) if os.environ.get("TM") else None
    for c in range(1, CYCLES + 1):
        cycle(client, c)
        if c == SNAP1 or c == CYCLES or c % 10 == 0:
            gc.collect(); time.sleep(0.5); gc.collect()
            f = fds(); o = dm_objects()
            cur, peak = tracemalloc.get_traced_memory()
            print(f"cycle {c} t={time.time()-t0:.0f}s rss {rss():.1f} traced {cur/1e6:.2f}MB threads {threading.active_count()} fds {len(f)} dm-objects {sum(o.values())}", flush=True)
            if c == SNAP1:
                objs1 = o; fds1 = f; all1 = all_objects()
                snap1 = tracemalloc.take_snapshot() if tracemalloc.is_tracing() else None
    all2 = all_objects()
    print("=== all objects growth", SNAP1, "->", CYCLES)
    for k, v in sorted(((k, all2[k] - all1[k]) for k in all2), key=lambda kv: -kv[1])[:30]:
        print(f"   {k}: +{v} ({all1[k]} -> {all2[k]})")
    if not tracemalloc.is_tracing():
        snap1 = snap2 = None
    snap2 = tracemalloc.take_snapshot() if snap1 is not None else None
    if snap2 is None:
        client.close(); cluster.close(); return
    filt = [tracemalloc.Filter(False, tracemalloc.__file__)]
    stats = snap2.filter_traces(filt).compare_to(snap1.filter_traces(filt), "traceback")
    print("=== top tracemalloc growth (traceback) between cycle", SNAP1, "and", CYCLES)
    for s in stats[:25]:
        print(f"+{s.size_diff/1024:.1f} KiB count+{s.count_diff}")
        for line in s.traceback.format()[-16:]:
            print("   ", line)
    stats = snap2.filter_traces(filt).compare_to(snap1.filter_traces(filt), "filename")
    print("=== by file")
    for s in stats[:25]:
        print(s)
    print("=== dm objects: after warm, snap1, end (diff)")
    o = dm_objects()
    for k in sorted(set(o) | set(objs1) | set(objs0)):
        if o[k] != objs0[k] or o[k] != objs1[k]:
            print(f"  {k}: {objs0[k]} {objs1[k]} {o[k]}")
    print("=== fds new since warm")
    f = fds()
    for k in sorted(set(f) - set(fds0), key=int):
        print("  ", k, f[k])
    print("=== fds gone since warm", [fds0[k] for k in set(fds0) - set(f)])
    print("=== threads", sorted(t.name for t in threading.enumerate()))
    client.close(); cluster.close()

if __name__ == "__main__":
    main()
