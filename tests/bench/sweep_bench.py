#!/usr/bin/python3
"""Sweeps across nodes (issue 43, docs/sweeps.md): N simulated nodes, one
shardcastd each over one root, told of each other with --sweep-peer, T
trainers per node streaming one cold shuffled epoch each (every vector).

A simulated node is what a node has of its own, made with the kernel's
tools (needs root):
  - its CPU: a cpu cgroup with a quota of --node-cpus cores (default 2 /
    the paired node count) for its daemon and its trainers, each trainer a
    process of its own;
  - its network: a network namespace whose link (a veth into a bridge) is
    shaped with tc (tbf) to --link-ratio x the filesystem's rate each way;
    the daemons dial each other over mutual TLS (a test CA made here);
  - the filesystem is shared: every daemon is in one blkio cgroup whose
    reads are throttled to --fs-rate, the parallel filesystem's bandwidth
    that every node of a cluster shares (seed 001: ~800 MB/s for all of
    OSC's jobs).
Trainers reach their daemon over its Unix socket.

For each N it reports, from independent counts:
  - filesystem bytes / selected bytes: the daemons' /proc/<pid>/io
    read_bytes together (the kernel's count), the page cache evicted first;
  - the busiest node's network bytes (sent + received over its links) /
    selected bytes, from its /metrics (shardcast_peer_*_bytes_total);
  - each trainer's rate (vectors/s of its epoch).
and, interleaved with the sweeps of --pair-nodes nodes, the same T trainers
on one simulated node alone (no sweep; the same CPU quota and filesystem):
each sweep trainer's rate over the alone trainers' median, as pairs (median
and spread over --rounds).

    /usr/bin/python3 tests/bench/sweep_bench.py --nodes 2,4,8 --pair-nodes 4 \\
        --rounds 5 --out /tmp/sweep.json --plot /tmp/sweep.png

Datasets go under /tmp/shardcast-bench/sweep.
"""

import argparse
import atexit
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "client" / "python"), str(REPO / "tests" / "python")]
BUILD = Path(os.environ.get("BUILD_DIR", REPO / "build"))
SHARDCAST = Path(os.environ.get("SHARDCAST_BIN", BUILD / "shardcast"))
SHARDCASTD = Path(os.environ.get("SHARDCASTD_BIN", BUILD / "shardcastd"))
os.environ["SHARDCAST_NO_AUTOSTART"] = "1"

import shardcast  # noqa: E402
from sysprobe import evict, metric_samples, proc_read_bytes  # noqa: E402

LAYER = 12
# Each trainer and each peer's pass reserves window + lag blocks: with 8
# nodes, 2 trainers and 7 passes, 9 x 40 MiB. Memory is touched as used
# (--prefault off): 8 daemons zeroing their reservoirs would take the CPU.
DAEMON = ["--reservoir-bytes", "512M", "--block-bytes", "1M", "--shuffle-window", "8",
          "--lag-blocks", "32", "--scan-start-delay-ms", "1500", "--prefault", "off",
          "--log-level", "info"]
NET = "10.213.0"  # the simulated nodes' subnet: node n is NET.(n+1), the bridge NET.254
PORT = 7443
HTTP = 7080
CG = "shardcast-bench"

# A trainer: connects, says so, waits for the start line, streams one epoch.
TRAINER = r"""
import json, sys, time
import shardcast
address, dataset, layer, seed = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
with shardcast.Client(address) as c:
    c.status()
    print("ready", flush=True)
    sys.stdin.readline()
    t0 = time.monotonic()  # the epoch's wall time, the start delay included
    n = 0
    for b in c.stream(dataset, layer=layer, batch_size=4096, seed=seed, epochs=1):
        n += b.vectors.shape[0]
    print(json.dumps({"vectors": n, "seconds": time.monotonic() - t0}), flush=True)
"""


def sh(*cmd):
    subprocess.run([str(c) for c in cmd], check=True, stdout=subprocess.DEVNULL)


def make_dataset(root, examples):
    """Layers 6,12, 255 content tokens + CLS, d_model 1024: one layer's
    content tokens selected, examples x 255 x 4 KiB."""
    done = root / "done.json"
    if done.exists():
        return json.loads(done.read_text())
    root.mkdir(parents=True, exist_ok=True)
    out = subprocess.run([str(SHARDCAST), "synth", str(root / "data"), "--layers", "6,12",
                          "--tokens", "255", "--cls", "--d-model", "1024", "--examples",
                          str(examples), "--seed", "3", "--json"],
                         capture_output=True, text=True, check=True)
    info = json.loads(out.stdout)
    info["selected_bytes"] = examples * 255 * 1024 * 4
    done.write_text(json.dumps(info))
    return info


def make_certificates(d):
    """A CA and one certificate per node address (server and client use:
    a daemon shows its own certificate when it dials its peers)."""
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    sh("openssl", "req", "-x509", *ec, "-keyout", d / "ca.key", "-out", d / "ca.crt",
       "-days", "2", "-subj", "/CN=shardcast bench CA")
    (d / "node.ext").write_text("subjectAltName=" + ",".join(
        f"IP:{NET}.{n + 1}" for n in range(16)) + "\nextendedKeyUsage=serverAuth,clientAuth\n")
    sh("openssl", "req", *ec, "-keyout", d / "node.key", "-out", d / "node.csr",
       "-subj", "/CN=shardcast bench node")
    sh("openssl", "x509", "-req", "-in", d / "node.csr", "-CA", d / "ca.crt", "-CAkey",
       d / "ca.key", "-CAcreateserial", "-out", d / "node.crt", "-days", "2",
       "-extfile", d / "node.ext")


class Cluster:
    """The simulated nodes' namespaces, links and cgroups; removed on close."""

    def __init__(self, nodes, fs_bytes_s, link_bytes_s, node_cpus, data_path):
        self.nodes = nodes
        self.cpu = [Path(f"/sys/fs/cgroup/cpu/{CG}/node{n}") for n in range(nodes)]
        self.blkio = Path(f"/sys/fs/cgroup/blkio/{CG}")
        atexit.register(self.close)
        self.close()
        st = os.stat(data_path)
        dev = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
        disk = Path(f"/sys/dev/block/{dev}")
        if (disk / "partition").exists():  # throttles apply to the whole disk
            dev = (disk.resolve().parent / "dev").read_text().strip()
        self.blkio.mkdir()
        (self.blkio / "blkio.throttle.read_bps_device").write_text(f"{dev} {fs_bytes_s}\n")
        for cg in self.cpu:
            cg.mkdir(parents=True)
            (cg / "cpu.cfs_period_us").write_text("10000\n")
            (cg / "cpu.cfs_quota_us").write_text(f"{int(node_cpus * 10000)}\n")
        sh("ip", "link", "add", "scbr0", "type", "bridge")
        sh("ip", "addr", "add", f"{NET}.254/24", "dev", "scbr0")
        sh("ip", "link", "set", "scbr0", "up")
        # tbf: the burst holds 10 ms of the rate (at least 64 KiB).
        rate = ["rate", f"{int(link_bytes_s * 8)}bit",
                "burst", str(max(65536, link_bytes_s // 100)), "latency", "20ms"]
        for n in range(nodes):
            ns = f"scnode{n}"
            sh("ip", "netns", "add", ns)
            sh("ip", "link", "add", f"scv{n}", "type", "veth", "peer", "name", "eth0",
               "netns", ns)
            sh("ip", "link", "set", f"scv{n}", "master", "scbr0", "up")
            sh("ip", "-n", ns, "addr", "add", f"{NET}.{n + 1}/24", "dev", "eth0")
            sh("ip", "-n", ns, "link", "set", "eth0", "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
            # Egress both ways: the node's upload (in its namespace) and its
            # download (the bridge's port towards it).
            sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "eth0", "root",
               "tbf", *rate)
            sh("tc", "qdisc", "add", "dev", f"scv{n}", "root", "tbf", *rate)

    def run_in(self, n, cmd, net, **kw):
        """Starts `cmd` in node n's cgroups (and its namespace if `net`)."""
        enter = ['echo $$ > "$0/cgroup.procs"', 'echo $$ > "$1/cgroup.procs"']
        wrap = ["sh", "-c", " && ".join(enter) + ' && shift && exec "$@"',
                str(self.cpu[n]), str(self.blkio)]
        if net:
            wrap += ["ip", "netns", "exec", f"scnode{n}"]
        return subprocess.Popen(wrap + [str(c) for c in cmd], **kw)

    def close(self):
        for n in range(16):
            subprocess.run(["ip", "netns", "del", f"scnode{n}"], stderr=subprocess.DEVNULL)
        subprocess.run(["ip", "link", "del", "scbr0"], stderr=subprocess.DEVNULL)
        for top in (Path(f"/sys/fs/cgroup/cpu/{CG}"), self.blkio):
            if top.exists():
                for cg in sorted(top.glob("node*")):
                    cg.rmdir()
                top.rmdir()


class Node:
    def __init__(self, cluster, root, work, n, peers, tls):
        self.n = n
        self.host = f"{NET}.{n + 1}"
        self.sock = work / f"n{n}.sock"
        self.log = open(work / f"n{n}.log", "wb")
        extra = []
        if peers:
            extra = ["--listen-tcp", f"{self.host}:{PORT}", "--tls-cert", tls / "node.crt",
                     "--tls-key", tls / "node.key", "--tls-client-ca", tls / "ca.crt",
                     "--node-rank", n]
            for p in range(peers):
                extra += ["--sweep-peer", f"{NET}.{p + 1}:{PORT}"]
        self.proc = cluster.run_in(
            n, [SHARDCASTD, "--root", root, "--listen", f"unix:{self.sock}",
                "--http", f"{self.host}:{HTTP}", *DAEMON, *extra], net=True,
            stdout=self.log, stderr=self.log, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while True:
            try:
                with shardcast.Client(f"unix:{self.sock}") as c:
                    c.status()
                break
            except Exception:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError(f"node {n} did not start: see {self.log.name}")
                time.sleep(0.05)

    def pid(self):
        """The daemon's pid (the wrapper exec'd into it)."""
        return self.proc.pid

    def metrics(self):
        return metric_samples(HTTP, host=self.host)

    def stop(self):
        self.proc.terminate()
        self.proc.wait(timeout=30)
        self.log.close()


def run(cluster, root, work, tls, info, nodes, trainers, sweep):
    """One cold epoch of `trainers` trainers on each of `nodes` nodes."""
    daemons, procs = [], []
    try:
        for n in range(nodes):
            daemons.append(Node(cluster, root, work, n, nodes if sweep else 0, tls))
        for i, d in enumerate(daemons):
            for t in range(trainers):
                procs.append(cluster.run_in(
                    i, ["/usr/bin/python3", "-c", TRAINER, f"unix:{d.sock}", info["hash"],
                        LAYER, 100 * i + t], net=False, stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE, text=True,
                    env=os.environ | {"PYTHONPATH": str(REPO / "client" / "python")}))
        for p in procs:  # every trainer connected: they open their streams together
            if p.stdout.readline().strip() != "ready":
                raise RuntimeError("a trainer did not connect")
        evict(Path(info["path"]).glob("acts*.bin"))
        before = [proc_read_bytes(d.pid()) for d in daemons]
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        rates = []
        for p in procs:
            line = p.stdout.readline()
            if p.wait() != 0 or not line:
                raise RuntimeError("a trainer failed")
            r = json.loads(line)
            if r["vectors"] != info["selected_bytes"] // 4096:
                raise RuntimeError(f"a trainer's epoch had {r['vectors']} vectors")
            rates.append(r["vectors"] / r["seconds"])
        read = sum(proc_read_bytes(d.pid()) - b for d, b in zip(daemons, before))
        busiest = 0
        for d in daemons:
            m = d.metrics()
            net = sum(v for k, v in m.items()
                      if k.startswith(("shardcast_peer_sent_bytes_total",
                                       "shardcast_peer_received_bytes_total")))
            busiest = max(busiest, net)
        return {"fs_over_selected": read / info["selected_bytes"],
                "busiest_net_over_selected": busiest / info["selected_bytes"],
                "rates": rates}
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        for d in daemons:
            d.stop()


def rate_arg(text):
    """'100M' -> bytes/s (K, M, G: powers of 1000)."""
    scale = {"K": 1e3, "M": 1e6, "G": 1e9}.get(text[-1:].upper(), 1)
    return int(float(text.rstrip("KMGkmg")) * scale)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", default="2,4,8", help="simulated node counts (default 2,4,8)")
    ap.add_argument("--pair-nodes", type=int, default=4,
                    help="the node count paired with one node alone (default 4)")
    ap.add_argument("--trainers", type=int, default=2, help="trainers per node (default 2)")
    ap.add_argument("--rounds", type=int, default=5, help="alone/sweep pairs (default 5)")
    ap.add_argument("--examples", type=int, default=1024,
                    help="examples in the dataset (1024: 1.07 GB selected)")
    ap.add_argument("--fs-rate", type=rate_arg, default=rate_arg("100M"),
                    help="the shared filesystem's read bandwidth, bytes/s (default 100M)")
    ap.add_argument("--link-ratio", type=float, default=10,
                    help="each node's link, each way, as a multiple of --fs-rate "
                         "(default 10: a 10 Gb/s node on a 100 MB/s share of a "
                         "filesystem; OSC's ratio is 15-60)")
    ap.add_argument("--node-cpus", type=float,
                    help="each node's CPU quota in cores (default 2 / --pair-nodes)")
    ap.add_argument("--out", help="write the JSON summary here")
    ap.add_argument("--plot", help="write a PNG of the growth here")
    args = ap.parse_args()
    if os.geteuid() != 0:
        ap.error("simulating nodes needs root (network namespaces, tc, cgroups)")
    node_cpus = args.node_cpus or 2 / args.pair_nodes
    root = Path("/tmp/shardcast-bench/sweep")
    info = make_dataset(root, args.examples)
    sel = info["selected_bytes"]
    counts = [int(x) for x in args.nodes.split(",") if x]
    link = int(args.fs_rate * args.link_ratio)
    cluster = Cluster(max(counts + [args.pair_nodes]), args.fs_rate, link, node_cpus,
                      info["path"])
    work = Path(tempfile.mkdtemp(prefix="scsweep", dir="/tmp"))
    tls = work / "tls"
    tls.mkdir()
    make_certificates(tls)
    shaping = (f"filesystem {args.fs_rate / 1e6:.0f} MB/s shared; each node "
               f"{node_cpus:.2f} cores, a link of {link / 1e6:.0f} MB/s each way (tbf); "
               f"mutual TLS between daemons")
    print(f"dataset {info['hash'][:12]}: {sel / 1e9:.2f} GB selected; {shaping}", flush=True)
    growth = {}
    for n in counts:
        r = run(cluster, root / "data", work, tls, info, n, args.trainers, True)
        growth[n] = r
        print(f"{n} nodes x {args.trainers} trainers: filesystem {r['fs_over_selected']:.3f} "
              f"x selected, busiest node's links {r['busiest_net_over_selected']:.3f} x, "
              f"trainers {min(r['rates']) / 1e3:.0f}-{max(r['rates']) / 1e3:.0f} k vectors/s",
              flush=True)
    pairs = []
    for i in range(args.rounds):
        alone = run(cluster, root / "data", work, tls, info, 1, args.trainers, False)
        swept = run(cluster, root / "data", work, tls, info, args.pair_nodes, args.trainers,
                    True)
        base = statistics.median(alone["rates"])
        ratio = statistics.median(swept["rates"]) / base
        pairs.append(ratio)
        print(f"pair {i + 1}: alone {base / 1e3:.1f} k vectors/s per trainer "
              f"(filesystem {alone['fs_over_selected']:.3f} x), {args.pair_nodes}-node "
              f"sweep {statistics.median(swept['rates']) / 1e3:.1f} k "
              f"(slowest {min(swept['rates']) / 1e3:.1f} k): {ratio:.3f}; filesystem "
              f"{swept['fs_over_selected']:.3f} x", flush=True)
    cluster.close()
    shutil.rmtree(work, ignore_errors=True)
    summary = {
        "selected_bytes": sel,
        "trainers_per_node": args.trainers,
        "shaping": shaping,
        "growth": {str(n): {k: v for k, v in r.items() if k != "rates"} |
                   {"trainer_rate_min": min(r["rates"]), "trainer_rate_max": max(r["rates"])}
                   for n, r in growth.items()},
        "pair_nodes": args.pair_nodes,
    }
    if pairs:
        summary["sweep_over_alone"] = {"median": statistics.median(pairs), "min": min(pairs),
                                       "max": max(pairs), "pairs": len(pairs)}
    print(json.dumps(summary, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=1))
    if args.plot:
        sys.path.insert(0, str(REPO / "tests" / "bench"))
        import plot
        ns = sorted(growth)
        plot.write({"title": f"Sweep of N nodes, {args.trainers} trainers each, cold",
                    "panels": [{"title": "bytes / selected bytes per epoch",
                                "x_label": "nodes", "y_label": "x selected",
                                "series": [
                                    {"name": "filesystem (all nodes)",
                                     "points": [[n, growth[n]["fs_over_selected"]] for n in ns]},
                                    {"name": "busiest node's links (in + out)",
                                     "points": [[n, growth[n]["busiest_net_over_selected"]]
                                                for n in ns]},
                                    {"name": "without a sweep (N reads)",
                                     "points": [[n, n] for n in ns], "dashed": True}]}]},
                   args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
