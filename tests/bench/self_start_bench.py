"""No setup, measured: a trainer's time from `import shardcast` to its first
batch when no daemon runs (the package starts the user's own, cold start
included) and when one already runs, interleaved; and the started daemon's
RSS while idle.

    /usr/bin/python3 tests/bench/self_start_bench.py [--rounds 7] [DATASET_DIR]

Each round uses a fresh XDG_RUNTIME_DIR (mode 0700) under /tmp, so the cold
case starts a daemon and the warm case, run right after in the same
directory, finds it. Binaries: $SHARDCASTD_BIN, else build/shardcastd.
Prints medians and [min-max].
"""

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PY = "/usr/bin/python3"

TRAINER = """
import time
t0 = time.perf_counter()
import shardcast
c = shardcast.Client()
info = c.attach(%r)
with c.stream(info.id, layer=info.layers[0], batch_size=4096, epochs=1) as s:
    next(iter(s))
print(time.perf_counter() - t0)
"""


def rss_mib(pid):
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dataset", nargs="?", help="dataset directory (default: a "
                    "synthetic one written under /tmp)")
    ap.add_argument("--rounds", type=int, default=7)
    a = ap.parse_args()
    daemon = os.environ.get("SHARDCASTD_BIN", str(REPO / "build" / "shardcastd"))
    cli = os.environ.get("SHARDCAST_BIN", str(REPO / "build" / "shardcast"))
    dataset = a.dataset
    if dataset is None:
        root = tempfile.mkdtemp(prefix="scstart-", dir="/tmp")
        out = subprocess.run([cli, "synth", root, "--examples", "256", "--layers", "6",
                              "--tokens", "64", "--d-model", "256", "--json"],
                             check=True, capture_output=True, text=True)
        dataset = json.loads(out.stdout)["path"]
    env = dict(os.environ, SHARDCASTD_BIN=daemon,
               PYTHONPATH=str(REPO / "client" / "python"))
    env.pop("SHARDCAST_ADDRESS", None)
    cold, warm, idle = [], [], []
    for _ in range(a.rounds):
        xdg = tempfile.mkdtemp(prefix="scxdg-", dir="/tmp")
        os.chmod(xdg, 0o700)
        env["XDG_RUNTIME_DIR"] = xdg
        for case in (cold, warm):
            out = subprocess.run([PY, "-c", TRAINER % dataset], env=env, check=True,
                                 capture_output=True, text=True)
            case.append(float(out.stdout))
        lock = Path(xdg) / "shardcast" / "shardcastd.sock.lock"
        pid = int(lock.read_text().split()[0])
        time.sleep(2)
        idle.append(rss_mib(pid))
        os.kill(pid, signal.SIGTERM)
        while lock.exists():
            time.sleep(0.02)
        subprocess.run(["rm", "-rf", xdg])

    def show(name, xs, unit):
        print(f"{name:48s} {statistics.median(xs):8.3f} {unit} "
              f"[{min(xs):.3f}-{max(xs):.3f}]")
    print(f"{a.rounds} rounds, dataset {dataset}, nproc {os.cpu_count()}")
    show("import -> first batch, daemon started (cold)", cold, "s")
    show("import -> first batch, daemon running (warm)", warm, "s")
    show("started daemon RSS, idle", idle, "MiB")


if __name__ == "__main__":
    sys.exit(main())
