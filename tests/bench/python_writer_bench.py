"""How fast does shardcast.Writer write, against `shardcast write --from`?

The same float32 data (seeded, [N, L, T, D], written once as a .npy file
under --dir) is written as a dataset two ways, in interleaved pairs, the
outputs removed after each run:

  cli     `shardcast write ROOT --from src.npy` (preads the .npy, 16 MiB at a
          time, into the C++ writer)
  writer  a child Python process that reads batches of --batch examples
          from the .npy into one reused buffer (not timed: an extraction
          loop has its batch in memory already) and appends them to a
          shardcast.Writer (timed: Writer(), every append, close())

Both hash and fsync every shard; page cache is warm for the source; the
machine is synced, then left alone for --settle seconds, before every run. Prints GB/s of activations per run, the
CPU seconds per GB (the CLI; the Writer's appends plus its CLI child), the median of each with its spread (min-max),
the median ratio writer / cli, the two outputs' equality (first pair), and
the peak RSS (VmHWM) of the Writer's Python process and of its
`shardcast write --stdin` child (before close()).

usage: /usr/bin/python3 tests/bench/python_writer_bench.py [--examples 1000]
           [--layers 2] [--tokens 256] [--cls] [--d-model 768] [--batch 64]
           [--shard-examples 200] [--pairs 5] [--settle 10]
           [--dir /tmp/shardcast-writer-bench]
           [--bin build/shardcast] [--json]
(client/python is put on PYTHONPATH for the child; SHARDCAST_BIN or --bin
names the CLI.)
"""

import argparse
import hashlib
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CHILD = r"""
import json, resource, sys, time
import numpy as np
import shardcast

def hwm_kib(pid="self"):  # peak RSS of the process's current image (VmHWM)
    with open(f"/proc/{pid}/status") as f:
        return int(next(l for l in f if l.startswith("VmHWM:")).split()[1])

cfg = json.loads(sys.argv[1])
shape = (cfg["examples"], cfg["layers"], cfg["tokens"] + cfg["cls"], cfg["d_model"])
per = int(np.prod(shape[1:])) * 4
buf = np.empty((cfg["batch"],) + shape[1:], np.float32)
f = open(cfg["src"], "rb", buffering=0)
f.seek(cfg["offset"])
before = hwm_kib()
timed = cpu = 0.0
t, c = time.perf_counter(), time.process_time()
w = shardcast.Writer(cfg["root"], layers=list(range(cfg["layers"])), tokens=cfg["tokens"],
                     cls_token=bool(cfg["cls"]), d_model=cfg["d_model"],
                     n_examples=cfg["examples"], budget=cfg["budget"])
timed += time.perf_counter() - t
cpu += time.process_time() - c
for i in range(0, cfg["examples"], cfg["batch"]):
    n = min(cfg["batch"], cfg["examples"] - i)
    view = memoryview(buf[:n]).cast("B")
    got = 0
    while got < n * per:
        got += f.readinto(view[got:])
    t, c = time.perf_counter(), time.process_time()
    w.append(buf[:n])
    timed += time.perf_counter() - t
    cpu += time.process_time() - c
cli = hwm_kib(w._proc.pid)  # before close(): every shard but the last written
t = time.perf_counter()
path = w.close()
timed += time.perf_counter() - t
ru = resource.getrusage(resource.RUSAGE_CHILDREN)  # the CLI, reaped by close()
print(json.dumps({"seconds": timed, "path": path, "maxrss_before_kib": before,
                  "maxrss_kib": hwm_kib(), "cli_maxrss_kib": cli,
                  "python_append_cpu": cpu, "cli_cpu": ru.ru_utime + ru.ru_stime}))
"""


def make_source(path, shape, seed=0):
    """A seeded float32 .npy of `shape`, written in slices."""
    if os.path.exists(path):
        return
    rng = np.random.default_rng(seed)
    out = np.lib.format.open_memmap(path + ".part", mode="w+", dtype=np.float32, shape=shape)
    for i in range(0, shape[0], 16):
        out[i:i + 16] = rng.standard_normal((min(16, shape[0] - i),) + shape[1:],
                                            dtype=np.float32)
    out.flush()
    del out
    os.rename(path + ".part", path)


def npy_data_offset(path):
    with open(path, "rb") as f:
        np.lib.format.read_magic(f)
        np.lib.format.read_array_header_1_0(f)
        return f.tell()


def files_digest(path):
    h = hashlib.sha256()
    for name in sorted(os.listdir(path)):
        h.update(name.encode())
        with open(os.path.join(path, name), "rb") as f:
            while chunk := f.read(16 << 20):
                h.update(chunk)
    return h.hexdigest()


def run_cli(args, src, root, budget):
    argv = [args.bin, "write", root, "--from", src, "--layers",
            ",".join(str(i) for i in range(args.layers)), "--budget", str(budget), "--json"]
    if args.cls:
        argv.append("--cls")
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    proc = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    seconds = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        sys.exit(f"shardcast write failed: {proc.stderr.decode()}")
    cpu = after.ru_utime + after.ru_stime - ru.ru_utime - ru.ru_stime
    return seconds, json.loads(proc.stdout)["path"], cpu


def run_writer(args, src, root, budget):
    cfg = dict(examples=args.examples, layers=args.layers, tokens=args.tokens,
               cls=int(args.cls), d_model=args.d_model, batch=args.batch, src=src,
               offset=npy_data_offset(src), root=root, budget=budget)
    env = dict(os.environ, SHARDCAST_BIN=args.bin, PYTHONPATH=os.pathsep.join(
        [os.path.join(REPO, "client", "python")] +
        ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])))
    proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(cfg)],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    if proc.returncode != 0:
        sys.exit(f"Writer failed: {proc.stderr.decode()}")
    out = json.loads(proc.stdout)
    return out["seconds"], out["path"], out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--examples", type=int, default=1000)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--cls", action="store_true")
    p.add_argument("--d-model", type=int, default=768)
    p.add_argument("--batch", type=int, default=64, help="examples per append")
    p.add_argument("--shard-examples", type=int, default=200)
    p.add_argument("--pairs", type=int, default=5)
    p.add_argument("--settle", type=float, default=10.0,
                   help="seconds of quiet after the sync before each run (the shared disk "
                        "of a VM keeps writing back after sync returns)")
    p.add_argument("--dir", default="/tmp/shardcast-writer-bench")
    p.add_argument("--bin", default=os.environ.get("SHARDCAST_BIN",
                                                   os.path.join(REPO, "build", "shardcast")))
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    args.bin = os.path.abspath(args.bin)

    t_total = args.tokens + int(args.cls)
    shape = (args.examples, args.layers, t_total, args.d_model)
    budget = args.shard_examples * t_total * args.layers
    nbytes = int(np.prod(shape)) * 4
    os.makedirs(args.dir, exist_ok=True)
    src = os.path.join(args.dir, "src-" + "x".join(map(str, shape)) + ".npy")
    make_source(src, shape)
    with open(src, "rb") as f:  # warm the page cache for both
        while f.read(64 << 20):
            pass

    runs = {"cli": [], "writer": []}
    cpu = {"cli": [], "writer": []}  # CPU seconds per GB
    rss = []
    same = None
    for k in range(args.pairs):
        order = ["cli", "writer"] if k % 2 == 0 else ["writer", "cli"]
        paths = {}
        for kind in order:
            root = os.path.join(args.dir, f"out-{kind}")
            shutil.rmtree(root, ignore_errors=True)
            os.sync()  # each run starts with no writeback of the one before
            time.sleep(args.settle)
            if kind == "cli":
                seconds, paths[kind], c = run_cli(args, src, root, budget)
            else:
                seconds, paths[kind], out = run_writer(args, src, root, budget)
                rss.append(out)
                c = out["python_append_cpu"] + out["cli_cpu"]
            runs[kind].append(nbytes / 1e9 / seconds)
            cpu[kind].append(c / (nbytes / 1e9))
            if not args.json:
                print(f"pair {k + 1}: {kind:6s} {nbytes / 1e9 / seconds:.3f} GB/s "
                      f"({seconds:.2f} s)", flush=True)
        if same is None:
            same = (os.path.basename(paths["cli"]) == os.path.basename(paths["writer"]) and
                    files_digest(paths["cli"]) == files_digest(paths["writer"]))
        for kind in paths:
            shutil.rmtree(os.path.dirname(paths[kind]), ignore_errors=True)

    med = {k: statistics.median(v) for k, v in runs.items()}
    ratios = [w / c for w, c in zip(runs["writer"], runs["cli"])]
    result = {
        "dataset_gb": nbytes / 1e9, "shape": list(shape), "batch": args.batch,
        "examples_per_shard": args.shard_examples,
        "shard_mb": args.shard_examples * nbytes / args.examples / 1e6,
        "pairs": args.pairs,
        "cli_gbps": runs["cli"], "writer_gbps": runs["writer"],
        "cli_median_gbps": med["cli"], "writer_median_gbps": med["writer"],
        "ratio_median": statistics.median(ratios), "ratio_min": min(ratios),
        "ratio_max": max(ratios), "identical_output": same,
        "writer_python_maxrss_mb": max(r["maxrss_kib"] for r in rss) / 1024,
        "writer_python_growth_mb": max(r["maxrss_kib"] - r["maxrss_before_kib"]
                                       for r in rss) / 1024,
        "writer_cli_maxrss_mb": max(r["cli_maxrss_kib"] for r in rss) / 1024,
        "cli_cpu_s_per_gb": statistics.median(cpu["cli"]),
        "writer_cpu_s_per_gb": statistics.median(cpu["writer"]),
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"\n{nbytes / 1e9:.2f} GB [{', '.join(map(str, shape))}] in shards of "
          f"{result['shard_mb']:.0f} MB, appends of {args.batch} examples, "
          f"{args.pairs} interleaved pairs")
    for kind in ("cli", "writer"):
        v = runs[kind]
        print(f"  {kind:6s} median {med[kind]:.3f} GB/s (min {min(v):.3f}, max {max(v):.3f})")
    print(f"  writer / cli: median {result['ratio_median']:.2f} "
          f"(pairs {result['ratio_min']:.2f}-{result['ratio_max']:.2f}); identical output: {same}")
    print(f"  CPU per GB (median): cli {result['cli_cpu_s_per_gb']:.2f} s, writer "
          f"{result['writer_cpu_s_per_gb']:.2f} s (its Python appends + shardcast write)")
    print(f"  peak RSS: Writer's Python process {result['writer_python_maxrss_mb']:.0f} MB "
          f"(+{result['writer_python_growth_mb']:.0f} MB while writing), its shardcast "
          f"write --stdin {result['writer_cli_maxrss_mb']:.0f} MB, for a "
          f"{nbytes / 1e6:.0f} MB dataset")


if __name__ == "__main__":
    main()
