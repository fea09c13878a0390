#!/usr/bin/python3
"""A node shared by many users, under attack (issue 42's soak).

Three unprivileged users (uids 23001-23003) each stream their own dataset,
a directory only they may read (mode 0700) under the daemon's root, while
a fourth (uid 23004) runs the attacks of issue 42 in a loop:

  - asks for the other users' datasets every way (describe, vectors through
    the local channel and over gRPC, streams in shared memory and in
    messages): each must be refused;
  - plants, in a root it may write to, a dataset whose shard is a link to
    another user's file, and has the daemon rescan: it must be rejected;
  - opens local channel connections past its per-user cap and holds them
    without asking, and asks for shared-memory regions past its byte cap;
  - sends oversized and malformed requests.

The run alternates windows without and with the attacker (the attacker
killed and started again), so each trainer's throughput under attack is
compared with the quiet window before it: pairs, median and spread. Every
trainer checks each batch's vectors against numpy reads of its own files
(the format's offset arithmetic). The daemon's RSS, descriptors and threads
are sampled every 5 s and must end where the first quiet window left them.

    /usr/bin/python3 tests/bench/multi_user_soak.py --minutes 10   # as root

Prints one line per window and a JSON summary; exit 1 when anything of one
user reached another, a trainer failed, or memory or descriptors grew.
"""

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BUILD = Path(os.environ.get("BUILD_DIR", REPO / "build"))
SHARDCAST = Path(os.environ.get("SHARDCAST_BIN", BUILD / "shardcast"))
SHARDCASTD = Path(os.environ.get("SHARDCASTD_BIN", BUILD / "shardcastd"))
TRAINERS = (23001, 23002, 23003)
ATTACKER = 23004
ENV = dict(os.environ, PYTHONPATH=f"{REPO / 'client' / 'python'}:{REPO / 'tests' / 'python'}",
           SHARDCAST_NO_AUTOSTART="1")

TRAINER = r"""
import json, sys, time
import numpy as np
import saev_reference as ref
import shardcast
address, ds, path = sys.argv[1], sys.argv[2], sys.argv[3]
md, shards, geom = ref.open_dataset(path)
layer = int(geom.layers[-1])
cls = 1 if geom.cls_token else 0
vectors, last = 0, time.monotonic()
with shardcast.Client(address, timeout=30) as c:
    with c.stream(ds, layer=layer, batch_size=1024, epochs=0, seed=7) as s:
        for b in s:
            i = vectors % b.rows  # one row a batch, read with numpy
            want = ref.read_vector(path, geom, int(b.example_idx[i]), layer,
                                   int(b.token_idx[i]) + cls)
            if not np.array_equal(b.vectors[i], want):
                print(json.dumps({"error": f"batch {b.index} row {i} differs"}), flush=True)
                sys.exit(1)
            vectors += b.rows
            now = time.monotonic()
            if now - last >= 1:
                print(json.dumps({"t": now, "vectors": vectors}), flush=True)
                last = now
"""

ATTACK = r"""
import json, os, socket, sys, time
import shardcast
from shardcast import _local
address, incoming, others = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
breaches, refusals = [], 0
def refused(what, fn):
    global refusals
    try:
        fn()
        breaches.append(what)
    except (shardcast.Error, _local.Refused, OSError):
        refusals += 1
path = _local.socket_path(address)
held = []
while True:
    for ds in others:
        with shardcast.Client(address, timeout=10) as c:
            refused(f"describe {ds}", lambda: c.describe(ds))
            refused(f"vectors {ds}", lambda: c.get_vectors(ds, [(0, 1, 0)]))
            refused(f"stream shm {ds}", lambda: next(iter(c.stream(ds, batch_size=8))))
            refused(f"stream grpc {ds}",
                    lambda: next(iter(c.stream(ds, batch_size=8, shared_memory=False))))
        with shardcast.Client(address, timeout=10, local_queries=False) as c:
            refused(f"grpc vectors {ds}", lambda: c.get_vectors(ds, [(0, 1, 0)]))
            refused(f"oversized {ds}", lambda: c.get_vectors(ds, [(0, 1, 0)] * 300_000))
        print(json.dumps({"breaches": breaches, "refusals": refusals}), flush=True)
    # Silent connections past the per-user cap, and regions past the byte cap.
    for _ in range(40):
        try:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            s.connect(path)
            held.append(s)
        except OSError:
            break
    for _ in range(8):
        try:
            held.append(_local.BatchRegion(path, 16, 4 << 20))
        except (_local.Refused, OSError):
            refusals += 1
    # Garbage on the channel.
    try:
        g = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        g.connect(path)
        g.send(os.urandom(512))
        g.close()
    except OSError:
        pass
    while len(held) > 300:
        h = held.pop(0)
        h.close()
    print(json.dumps({"breaches": breaches, "refusals": refusals}), flush=True)
    if breaches:
        sys.exit(1)
    time.sleep(0.2)
"""


def run_as(uid, code, args, **kw):
    def become():
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    return subprocess.Popen(["/usr/bin/python3", "-c", code, *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=ENV, preexec_fn=become, **kw)


def proc_sample(pid):
    status = Path(f"/proc/{pid}/status").read_text()
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    return {"rss_kb": int(fields["VmRSS"].split()[0]),
            "anon_kb": int(fields["RssAnon"].split()[0]),
            "threads": int(fields["Threads"]),
            "fds": len(os.listdir(f"/proc/{pid}/fd"))}


class Reader(threading.Thread):
    """Keeps a child's last JSON line."""

    def __init__(self, proc):
        super().__init__(daemon=True)
        self.proc, self.last, self.samples, self.errors = proc, None, [], []
        self.start()

    def run(self):
        for line in self.proc.stdout:
            try:
                j = json.loads(line)
            except ValueError:
                continue
            self.last = j
            if "vectors" in j:
                self.samples.append((time.monotonic(), j["vectors"]))
            if "error" in j:
                self.errors.append(j["error"])

    def vectors_at(self, t):
        before = [v for (ts, v) in self.samples if ts <= t]
        return before[-1] if before else 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=10,
                    help="minutes under attack, in windows (default 10)")
    ap.add_argument("--window", type=float, default=60,
                    help="seconds of each attack window; quiet ones are half (60)")
    args = ap.parse_args()
    if os.getuid() != 0:
        sys.exit("multi_user_soak.py: run as root (it acts as four users)")
    for b in (SHARDCAST, SHARDCASTD):
        if not b.is_file():
            sys.exit(f"multi_user_soak.py: {b} missing (cmake --build build -j2)")
    top = Path(tempfile.mkdtemp(prefix="mus-", dir="/tmp"))
    os.chmod(top, 0o755)
    root, incoming, run = top / "root", top / "incoming", top / "run"
    for d in (root, incoming, run):
        d.mkdir()
    os.chmod(root, 0o755)
    os.chmod(incoming, 0o1777)  # every user may write here
    os.chmod(run, 0o755)
    datasets = {}
    for uid in TRAINERS:
        out = subprocess.run([str(SHARDCAST), "synth", str(root / f"u{uid}"), "--layers", "3,7",
                              "--tokens", "64", "--cls", "--d-model", "256", "--examples",
                              "1200", "--budget", str(65 * 2 * 64), "--seed", str(uid),
                              "--json"], check=True, capture_output=True, text=True)
        info = json.loads(out.stdout)
        # The user's own directory (0700) holds their dataset; the daemon's
        # root lists it through a link.
        private = root / f"u{uid}"
        for p in [private, *private.rglob("*")]:
            os.chown(p, uid, uid)
        os.chmod(private, 0o700)
        os.symlink(private / info["hash"], root / info["hash"])
        datasets[uid] = (info["hash"], str(private / info["hash"]))
    # A planted dataset in `incoming`: its shard links to user 1's file.
    victim = datasets[TRAINERS[0]][1]
    planted = subprocess.run([str(SHARDCAST), "synth", str(incoming), "--layers", "3,7",
                              "--tokens", "64", "--cls", "--d-model", "256", "--examples",
                              "1200", "--budget", str(65 * 2 * 64), "--seed", "1", "--json"],
                             check=True, capture_output=True, text=True)
    planted_dir = incoming / json.loads(planted.stdout)["hash"]
    (planted_dir / "acts000000.bin").unlink()
    os.symlink(Path(victim) / "acts000000.bin", planted_dir / "acts000000.bin")
    sock = run / "d.sock"
    log = open(top / "shardcastd.log", "w")
    daemon = subprocess.Popen([str(SHARDCASTD), "--root", str(root), "--root", str(incoming),
                               "--listen", f"unix:{sock}",
                               "--reservoir-bytes", "1G", "--max-connections-per-user", "64",
                               "--socket-group", "nogroup"], stdout=log, stderr=log)
    for _ in range(100):
        if sock.exists():
            break
        time.sleep(0.1)
    for p in run.iterdir():
        os.chmod(p, 0o666)
    address = f"unix:{sock}"
    trainers = {uid: Reader(run_as(uid, TRAINER, [address, ds, path]))
                for uid, (ds, path) in datasets.items()}
    time.sleep(5)  # past the first batches
    samples, pairs = [], {uid: [] for uid in TRAINERS}
    breaches, failures = [], []
    windows = max(1, round(args.minutes * 60 / args.window))

    def sample():
        # Rescans in every window (the planted dataset is checked again;
        # a dataset under a running scan is held twice for a while, so the
        # quiet windows must see that too).
        daemon.send_signal(signal.SIGHUP)
        samples.append(proc_sample(daemon.pid))

    def rates(t0, t1):
        return {uid: (r.vectors_at(t1) - r.vectors_at(t0)) / (t1 - t0)
                for uid, r in trainers.items()}

    for w in range(windows):
        t0 = time.monotonic()
        while time.monotonic() - t0 < args.window / 2:
            time.sleep(5)
            sample()
        t1 = time.monotonic()
        quiet = rates(t0, t1)
        if w == 0:
            baseline = samples[-1]  # what the daemon holds before any attack
        attacker = Reader(run_as(ATTACKER, ATTACK, [address, str(incoming), json.dumps(
            [ds for ds, _ in datasets.values()])]))
        while time.monotonic() - t1 < args.window:
            time.sleep(5)
            sample()
        t2 = time.monotonic()
        loud = rates(t1, t2)
        attacker.proc.kill()
        attacker.proc.wait()
        attacker.join(timeout=5)
        last = attacker.last or {}
        if not last:
            failures.append("the attacker reported nothing: " +
                            attacker.proc.stderr.read()[-800:])
        breaches += last.get("breaches", [])
        for uid in TRAINERS:
            pairs[uid].append(loud[uid] / quiet[uid] if quiet[uid] else 0)
        print(f"window {w + 1}/{windows}: quiet {[round(quiet[u]) for u in TRAINERS]} vec/s, "
              f"attacked {[round(loud[u]) for u in TRAINERS]} vec/s, attacker refused "
              f"{last.get('refusals', 0)} times, breaches {len(last.get('breaches', []))}, "
              f"daemon rss {samples[-1]['rss_kb'] // 1024} MiB fds {samples[-1]['fds']}",
              flush=True)
    # A last quiet stretch: what the attacker held must be let go.
    t3 = time.monotonic()
    while time.monotonic() - t3 < args.window / 2:
        time.sleep(5)
        sample()
    for uid, r in trainers.items():
        if r.proc.poll() is not None:
            failures.append(f"uid {uid}: trainer exited {r.proc.returncode}: "
                            f"{r.proc.stderr.read()[-500:]}")
        failures += [f"uid {uid}: {e}" for e in r.errors]
        r.proc.kill()
    daemon.send_signal(signal.SIGTERM)
    daemon.wait(timeout=30)
    first, end = baseline, samples[-1]
    grown = {k: end[k] - first[k] for k in ("anon_kb", "fds", "threads")}
    ratios = [x for uid in TRAINERS for x in pairs[uid]]
    summary = {
        "minutes_attacked": windows * args.window / 60,
        "pairs": len(ratios),
        "throughput_attacked_over_quiet": {
            "median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)},
        "breaches": breaches, "trainer_failures": failures,
        "daemon_start": first, "daemon_end": end, "grown": grown,
        "planted_rejected": "outside its dataset root" in (top / "shardcastd.log").read_text(),
    }
    print(json.dumps(summary, indent=1))
    ok = (not breaches and not failures and summary["planted_rejected"] and
          grown["anon_kb"] < 64 * 1024 and grown["fds"] < 32 and grown["threads"] < 4)
    print("multi-user soak:", "held" if ok else "FAILED")
    shutil.rmtree(top, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
