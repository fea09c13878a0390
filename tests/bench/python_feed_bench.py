"""How fast do Python trainers receive batches from shardcastd?

Starts N trainer processes together; each iterates the shardcast package's
stream (shared memory or gRPC messages) for a number of epochs, turning every
batch into a torch CPU tensor (torch.from_numpy, as shardcast.torch does) and
reading one value of it, and reports its bytes/s. The reference is a bare
single-core memcpy (numpy copy of 256 MiB between warm buffers) measured in
the same run; every figure is printed as a ratio to it.

usage: python_feed_bench.py --server unix:PATH --dataset ID [--layer 12]
           [--tokens all] [--batch-size 4096] [--epochs 2] [--clients 1,4]
           [--transports shm,grpc] [--json]
"""

import argparse
import json
import multiprocessing as mp
import os
import sys
import time

import numpy as np


def memcpy_bandwidth(size=256 << 20, reps=5):
    """Best bytes/s of a single-core copy between two warm buffers."""
    src = np.ones(size, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # touch both
    best = 0.0
    for _ in range(reps):
        t = time.perf_counter()
        np.copyto(dst, src)
        best = max(best, size / (time.perf_counter() - t))
    return best


def trainer(args, shm, start, out):
    import torch  # noqa: F401  (as a trainer would)
    import shardcast
    client = shardcast.Client(args.server, shared_memory=shm)
    stream = client.stream(args.dataset, layer=args.layer, tokens=args.tokens,
                           batch_size=args.batch_size, epochs=args.epochs,
                           seed=args.seed)
    start.wait()
    t = time.perf_counter()
    n = 0
    check = 0.0
    used_shm = stream.shared_memory
    for b in stream:
        x = torch.from_numpy(b.vectors)
        check += float(x[-1, -1])  # the trainer reads it
        n += x.numel() * 4
    secs = time.perf_counter() - t
    out.put({"bytes": n, "seconds": secs, "bytes_per_second": n / secs,
             "shared_memory": used_shm})


def run(args, clients, shm):
    ctx = mp.get_context("spawn")
    start = ctx.Barrier(clients + 1)
    out = ctx.Queue()
    procs = [ctx.Process(target=trainer, args=(args, shm, start, out))
             for _ in range(clients)]
    for p in procs:
        p.start()
    start.wait()
    results = [out.get(timeout=600) for _ in procs]
    for p in procs:
        p.join()
    return results


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--server", required=True)
    p.add_argument("--dataset", required=True)
    p.add_argument("--layer", type=int, default=None)
    p.add_argument("--tokens", default="all")
    p.add_argument("--batch-size", type=int, default=4096)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--clients", default="1,4")
    p.add_argument("--transports", default="shm,grpc")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    memcpy = memcpy_bandwidth()
    report = {"memcpy_bytes_per_second": memcpy, "runs": []}
    if not args.json:
        print(f"single-core memcpy: {memcpy / 2**20:.0f} MiB/s")
    for transport in args.transports.split(","):
        for clients in (int(c) for c in args.clients.split(",")):
            results = run(args, clients, transport == "shm")
            per = [r["bytes_per_second"] for r in results]
            total = sum(r["bytes"] for r in results) / max(r["seconds"] for r in results)
            run_report = {"transport": transport, "clients": clients,
                          "shared_memory": [r["shared_memory"] for r in results],
                          "per_client_bytes_per_second": per,
                          "per_client_x_memcpy": [x / memcpy for x in per],
                          "total_bytes_per_second": total,
                          "total_x_memcpy": total / memcpy}
            report["runs"].append(run_report)
            if not args.json:
                print(f"{transport:4} {clients} trainer(s): per trainer "
                      + ", ".join(f"{x / 2**20:.0f} MiB/s ({x / memcpy:.2f} x)"
                                  for x in per)
                      + f"; together {total / 2**20:.0f} MiB/s "
                        f"({total / memcpy:.2f} x memcpy)", flush=True)
    if args.json:
        print(json.dumps(report, indent=2))


if __name__ == "__main__":
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..",
                                    "client", "python"))
    main()
