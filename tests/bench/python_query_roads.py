"""The roads the Python client's remote get_vectors can take, against each
other in one run on one daemon and one warm dataset (the Python side of
run_query_roads.sh; a road stays only where it wins by more than the
run-to-run spread):

  unary    the client's road before 0.1.0's VectorsSession: one GetVectors
           call per get_vectors, StreamVectors (parts as the reads complete,
           put back together here) from 64 coordinates on; kept here, as it
           was, to measure against
  session  every call a message on the Client's one VectorsSession call
  client   Client.get_vectors as it ships (local_queries=False): unary calls
           under shardcast._client.SESSION_FROM coordinates, the session from
           there on

All build their request the same way (the client's), so only the road
differs. Rows: single vectors from 1 thread (p50 latency), single vectors
from 8 threads (calls/s), 256 vectors per call from 1 thread (p50 latency)
and from 8 threads (calls/s). Runs go round-robin, the order alternating
each round, so the VM's drift falls on every road; prints each round and,
per row, each road's median and the medians of the per-round ratios
session/unary and client/unary with their min-max spread (latency: < 1 is
faster than unary; calls/s: > 1 is).

    /usr/bin/python3 tests/bench/python_query_roads.py [--rounds 5]

Starts build/shardcastd on unix:/tmp/shardcast-bench/pyroads/d.sock over
/tmp/shardcast-bench/query-ab/root (run_query_ab.sh makes that dataset:
d_model 1024, layers 6 and 12, 1024 examples, 257 tokens) and touches its
shards into the page cache (vmtouch) first.
"""

import argparse
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "client" / "python"))

import shardcast  # noqa: E402
from shardcast.v1 import shardcast_pb2 as pb  # noqa: E402

STREAM_VECTORS_FROM = 64  # the old road's threshold (the C++ client's then)


# ---------------------------------------------------------------------------
# The old road, as client/python/shardcast/_client.py had it.

def request_of(dataset, coords):
    """GetVectorsRequest as the client builds it (in its SessionRequest)."""
    request = pb.GetVectorsRequest(dataset=dataset)
    add = request.coordinates.add
    for e, l, t in coords.tolist():
        add(example=e, layer=l, token=t)
    return request


def assemble(parts, n):
    """StreamVectors' parts put back into the [n, D] result."""
    out, seen, received = None, None, 0
    for part in parts:
        shape = tuple(part.shape)
        if len(shape) != 2 or shape[0] != n or (out is not None and shape != out.shape):
            raise shardcast.Error("DATA_LOSS", f"part of shape {shape} for {n} vectors")
        d = shape[1]
        rows = np.asarray(part.rows, dtype=np.int64)
        if len(part.data) != rows.size * d * 4:
            raise shardcast.Error("DATA_LOSS", "part of the wrong size")
        if out is None:
            out = np.empty((n, d), dtype=np.float32)
            seen = np.zeros(n, dtype=bool)
        if rows.size and (rows.min() < 0 or rows.max() >= n or seen[rows].any() or
                          np.unique(rows).size != rows.size):
            raise shardcast.Error("DATA_LOSS", "row out of range or twice")
        seen[rows] = True
        received += rows.size
        out[rows] = np.frombuffer(part.data, dtype=np.float32).reshape(rows.size, d)
    if out is None or received != n:
        raise shardcast.Error("DATA_LOSS", "rows missing")
    out.setflags(write=False)
    return out


def unary_get_vectors(client, dataset, coords):
    coords = np.ascontiguousarray(np.asarray(coords, dtype=np.int64).reshape(-1, 3))
    request = request_of(dataset, coords)
    if len(coords) >= STREAM_VECTORS_FROM:
        call = client._query.StreamVectors(request)
        try:
            return assemble(call, len(coords))
        finally:
            call.cancel()
    return client._vectors(client._query.GetVectors(request))


def session_get_vectors(client, dataset, coords):
    coords = np.ascontiguousarray(np.asarray(coords, dtype=np.int64).reshape(-1, 3))
    return client._remote_vectors(dataset, coords, road="session")


def client_get_vectors(client, dataset, coords):
    return client.get_vectors(dataset, coords)


ROADS = {"unary": unary_get_vectors, "session": session_get_vectors,
         "client": client_get_vectors}


# ---------------------------------------------------------------------------
# Runs.

def random_coords(rng, info, n):
    return np.stack([rng.integers(0, info.n_examples, n),
                     rng.choice(np.asarray(info.layers, dtype=np.int64), n),
                     rng.integers(0, info.tokens_per_example, n)], axis=1).astype(np.int64)


def p50_us(fn, client, info, per_call, calls, rng):
    coords = random_coords(rng, info, per_call * calls).reshape(calls, per_call, 3)
    for c in coords[:min(50, calls)]:  # warm up the road
        fn(client, info.id, c)
    times = np.empty(calls)
    for i, c in enumerate(coords):
        t = time.perf_counter_ns()
        fn(client, info.id, c)
        times[i] = time.perf_counter_ns() - t
    return float(np.median(times)) / 1e3


def calls_per_s(fn, client, info, per_call, threads, calls_per_thread, rng):
    coords = [random_coords(rng, info, per_call * calls_per_thread).reshape(-1, per_call, 3)
              for _ in range(threads)]
    errors = []
    start = threading.Barrier(threads + 1)

    def worker(mine):
        try:
            for c in mine[:5]:  # warm up
                fn(client, info.id, c)
            start.wait()
            for c in mine:
                fn(client, info.id, c)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
            start.abort()
    workers = [threading.Thread(target=worker, args=(c,), daemon=True) for c in coords]
    for w in workers:
        w.start()
    start.wait()
    t = time.perf_counter()
    for w in workers:
        w.join()
    secs = time.perf_counter() - t
    if errors:
        raise errors[0]
    return threads * calls_per_thread / secs


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1,
                    help="rounds run first and not counted (the first runs of a "
                    "road pay for its threads and connections)")
    ap.add_argument("--calls", type=int, default=2000, help="single calls per 1-thread run")
    ap.add_argument("--thread-calls", type=int, default=500,
                    help="single calls per thread per 8-thread run")
    ap.add_argument("--big-calls", type=int, default=300, help="256-vector calls per run")
    ap.add_argument("--big-thread-calls", type=int, default=40,
                    help="256-vector calls per thread per 8-thread run")
    ap.add_argument("--root", default="/tmp/shardcast-bench/query-ab/root")
    ap.add_argument("--sock", default="/tmp/shardcast-bench/pyroads/d.sock")
    ap.add_argument("--daemon", default=str(REPO / "build" / "shardcastd"))
    args = ap.parse_args()

    sock = Path(args.sock)
    sock.parent.mkdir(parents=True, exist_ok=True)
    log = open(sock.parent / "shardcastd.log", "wb")
    daemon = subprocess.Popen([args.daemon, "--root", args.root, "--listen", f"unix:{sock}"],
                              stdout=log, stderr=log, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 20
        while not sock.exists():
            if daemon.poll() is not None or time.monotonic() > deadline:
                sys.exit(f"shardcastd did not start (see {log.name})")
            time.sleep(0.05)
        client = shardcast.Client(f"unix:{sock}", local_queries=False, timeout=20)
        assert not client.local_queries
        infos = [d for d in client.datasets() if d.ok]
        if len(infos) != 1:
            sys.exit(f"expected one dataset under {args.root}, found {len(infos)}")
        info = infos[0]
        files = sorted(str(p) for p in (Path(args.root) / info.id).glob("acts*.bin"))
        subprocess.run(["vmtouch", "-q", "-t"] + files, check=True)

        # Every road gives the same vectors.
        rng = np.random.default_rng(0)
        for n in (1, 7, 256):
            c = random_coords(rng, info, n)
            a, b, d = (np.asarray(fn(client, info.id, c)) for fn in ROADS.values())
            assert a.shape == b.shape == d.shape == (n, info.d_model), n
            assert np.array_equal(a, b) and np.array_equal(a, d), n

        rows = [  # name, unit, higher is better, run(fn, rng)
            ("single, 1 thread", "p50 us", False,
             lambda fn, rng: p50_us(fn, client, info, 1, args.calls, rng)),
            ("single, 8 threads", "calls/s", True,
             lambda fn, rng: calls_per_s(fn, client, info, 1, 8, args.thread_calls, rng)),
            ("256 per call, 1 thread", "p50 us", False,
             lambda fn, rng: p50_us(fn, client, info, 256, args.big_calls, rng)),
            ("256 per call, 8 threads", "calls/s", True,
             lambda fn, rng: calls_per_s(fn, client, info, 256, 8, args.big_thread_calls,
                                         rng)),
        ]
        print(f"== {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}, nproc "
              f"{os.cpu_count()}, python {sys.version.split()[0]}, dataset {info.id[:12]} "
              f"(d_model {info.d_model}), {args.rounds} rounds, local_queries=False")
        results = {name: {road: [] for road in ROADS} for name, *_ in rows}
        roads = list(ROADS)
        for rnd in range(-args.warmup, args.rounds):
            order = roads if rnd % 2 == 0 else roads[::-1]
            for name, unit, _, run in rows:
                got = {}
                for road in order:
                    got[road] = run(ROADS[road],
                                    np.random.default_rng(1000 * (rnd + args.warmup) + len(name)))
                    if rnd >= 0:
                        results[name][road].append(got[road])
                label = f"round {rnd + 1}" if rnd >= 0 else "warm-up"
                print(f"{label:7s} ({order[0]:7s} first) {name:23s} {unit:7s} " +
                      "  ".join(f"{r} {got[r]:7.1f}" for r in roads) +
                      f"  session/unary {got['session'] / got['unary']:.3f}"
                      f"  client/unary {got['client'] / got['unary']:.3f}", flush=True)
        print()
        print(f"{'row':23s} {'unit':7s} {'unary':>7s} {'session':>7s} {'client':>7s}  "
              "session/unary [min-max]  client/unary [min-max]  session vs unary")
        for name, unit, higher, _ in rows:
            u, s, c = (results[name][r] for r in roads)
            ratios = [b / a for a, b in zip(u, s)]
            client_ratios = [b / a for a, b in zip(u, c)]
            med = statistics.median(ratios)
            if min(ratios) <= 1 <= max(ratios):
                verdict = "tie (1 within the spread)"
            else:
                verdict = ("session" if (med > 1) == higher else "unary") + \
                    f" by {abs(med - 1) * 100:.0f}%"
            print(f"{name:23s} {unit:7s} {statistics.median(u):7.1f} "
                  f"{statistics.median(s):7.1f} {statistics.median(c):7.1f}  "
                  f"{med:.3f} [{min(ratios):.3f}-{max(ratios):.3f}]  "
                  f"{statistics.median(client_ratios):.3f} [{min(client_ratios):.3f}-"
                  f"{max(client_ratios):.3f}]  {verdict}")
        client.close()
    finally:
        daemon.terminate()
        try:
            daemon.wait(timeout=20)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait()
        log.close()


if __name__ == "__main__":
    main()
