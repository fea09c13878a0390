"""saev's own trainer on CPU, fed by saev's shuffled loader and by shardcast
(`shardcast.compat.saev.install()`, the one-line switch), on the same shards.

    /usr/bin/python3 tests/bench/saev_trainer_bench.py [--rounds 6] [--steps 30]

Each run is a fresh child Python that calls saev.framework.train.train (the
training half of saev's worker_fn: loader, datapoint init, the step loop; no
evaluation or checkpoint) for a fixed number of steps, on CPU (saev's fused
Adam wrapped to drop `fused`, which torch 1.13 lacks for CPU tensors). The
shardcast child calls install() before it imports saev; nothing else
differs. Runs come in pairs, the order alternating (saev first in pairs
1, 3, ...), so drift on a shared machine falls on both.

Per run: steady steps/s (steps after the first --skip ones, over the time
they took: the startup, datapoint init and first steps excluded), the
vectors/s they carried, the time from the train() call to the end of the
first step (loader start, saev's datapoint init on up to 65,536 vectors,
first batch, first step), the import time, and the load average before it.
Summary: median steps/s of each, and shardcast/saev as the median of the
per-pair ratios [min-max].

The dataset is written by saev's own ShardWriter (saev's
make_saev_shards.py, ../shared/peers/saev) under --data-root, and reused
when one with the same shape is there (--fresh-data writes it anew;
--remove-data deletes it, and the folders above it left empty, at the
end), or named with --dataset. The daemon is started here with no --root
(the loaders attach the dataset by path) on a Unix socket under /tmp, given
to the children as $SHARDCAST_ADDRESS, and stopped at the end. saev's loader keeps its defaults (n_threads 4,
buffer_size 64, a manager process) unless --saev-threads says otherwise.
Binaries: $SHARDCASTD_BIN, else build/shardcastd.
"""

import argparse
import json
import os
import platform
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SAEV = REPO.parent / "shared" / "peers" / "saev"
SAEV_PATH = [SAEV / "shims", SAEV / "deps", SAEV / "src"]
PACKAGE = REPO / "client" / "python"

# argv: mode shards layer batch_size d_model d_sae n_prefixes steps runs_root saev_threads
CHILD = r"""
import json, os, pathlib, sys, time
t_start = time.perf_counter()
mode, shards, layer, batch, d_model, d_sae, prefixes, steps, runs, threads = sys.argv[1:11]
batch, d_model, d_sae, prefixes, steps = map(int, (batch, d_model, d_sae, prefixes, steps))
import torch

stamps = []


class Adam(torch.optim.Adam):  # torch 1.13 has no fused Adam for CPU tensors
    def __init__(self, *args, fused=None, **kwargs):
        super().__init__(*args, **kwargs)

    def step(self, *args, **kwargs):  # once per training step (one SAE)
        out = super().step(*args, **kwargs)
        stamps.append(time.perf_counter())
        return out


torch.optim.Adam = Adam
if mode == "shardcast":
    import shardcast.compat.saev
    shardcast.compat.saev.install()
import saev.data
import saev.utils.scheduling
from saev import nn
from saev.framework import train

passes = []  # each pass train() makes over its BatchLimiter: datapoint init, steps
limiter_iter = saev.utils.scheduling.BatchLimiter.__iter__


def counted(self):
    sizes = []
    passes.append({"begin": time.perf_counter(), "sizes": sizes})
    for b in limiter_iter(self):
        sizes.append(len(b["act"]))
        yield b


saev.utils.scheduling.BatchLimiter.__iter__ = counted
extra = {} if threads == "default" else {"n_threads": int(threads)}
data = saev.data.ShuffledConfig(shards=pathlib.Path(shards), layer=int(layer),
                                batch_size=batch, **extra)
cfg = train.Config(train_data=data, val_data=data, n_train=steps * batch,
                   sae=nn.SparseAutoencoderConfig(d_model=d_model, d_sae=d_sae),
                   objective=nn.objectives.Matryoshka(n_prefixes=prefixes),
                   track=False, device="cpu", runs_root=pathlib.Path(runs))
assert (saev.data.ShuffledDataLoader.__module__.startswith("shardcast")) == (mode == "shardcast")
t_train = time.perf_counter()
_, _, _, n_steps = train.train([cfg])
t_end = time.perf_counter()
print(json.dumps({"mode": mode, "loader": saev.data.ShuffledDataLoader.__module__,
                  "t_start": t_start, "t_train": t_train, "t_end": t_end, "steps": n_steps,
                  "stamps": stamps, "passes": passes, "torch_threads": torch.get_num_threads()}),
      flush=True)
"""


def median(xs):
    return statistics.median(xs) if xs else float("nan")


def cpu_model():
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def mem_gib():
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) / 2**20
    return float("nan")


def loadavg():
    return "%.2f %.2f %.2f" % os.getloadavg()


def saev_env(**extra):
    path = [str(p) for p in SAEV_PATH] + [str(PACKAGE)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path), **extra)
    return env


def find_dataset(root, a):
    """A dataset under root/saev/shards with a's shape and all its shards, or None."""
    layers = [int(x) for x in a.layers.split(",")]
    for md_path in sorted((Path(root) / "saev" / "shards").glob("*/metadata.json")):
        try:
            md = json.loads(md_path.read_text())
        except (OSError, ValueError):
            continue
        d = md_path.parent
        if (md.get("n_examples") == a.examples and md.get("d_model") == a.d_model
                and list(md.get("layers", [])) == layers
                and md.get("content_tokens_per_example") == a.tokens
                and bool(md.get("cls_token")) == a.cls
                and (d / "shards.json").exists() and any(d.glob("acts*.bin"))):
            return d
    return None


def make_dataset(a):
    root = Path(a.data_root)
    found = find_dataset(root, a)
    if found is not None and not a.fresh_data:
        return found, "reused"
    if found is not None:
        shutil.rmtree(found)
    args = [str(SAEV / "make_saev_shards.py"), str(root), "--examples", str(a.examples),
            "--tokens", str(a.tokens), "--d-model", str(a.d_model), "--layers", a.layers]
    if a.cls:
        args.append("--cls")
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable] + args, env=saev_env(), check=True,
                         stdout=subprocess.PIPE, text=True)
    return Path(out.stdout.split()[-1]), "written in %.1f s" % (time.perf_counter() - t0)


def du_mb(path):
    """MB the files in path take on disk (saev's trailing empty shard is sparse)."""
    return sum(f.stat().st_blocks * 512 for f in Path(path).iterdir() if f.is_file()) / 1e6


class Daemon:
    """shardcastd on a Unix socket under workdir, no --root."""

    def __init__(self, binary, workdir, extra):
        self.sock = Path(workdir) / "d.sock"
        self.address = f"unix:{self.sock}"
        self.log = Path(workdir) / "shardcastd.log"
        self.argv = [binary, "--listen", self.address] + extra
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT)
        sys.path.insert(0, str(PACKAGE))
        import shardcast
        self.client = None
        deadline = time.monotonic() + 30
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"shardcastd exited {self.proc.returncode}:\n"
                                   + self.log.read_text()[-3000:])
            if self.sock.exists():
                try:
                    self.client = shardcast.Client(self.address)
                    self.client.status()
                    break
                except Exception:  # not answering yet
                    pass
            if time.monotonic() > deadline:
                raise RuntimeError("shardcastd did not answer in 30 s:\n"
                                   + self.log.read_text()[-3000:])
            time.sleep(0.05)

    def delivered(self):
        return self.client.status().bytes_delivered

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def run_child(a, mode, dataset, d_model, runs, daemon):
    env = saev_env(SHARDCAST_ADDRESS=daemon.address)
    load = loadavg()
    before = daemon.delivered()
    t0 = time.perf_counter()
    # Its own session: on a timeout, saev's loader process goes with it.
    proc = subprocess.Popen([sys.executable, "-c", CHILD, mode, str(dataset), str(a.layer),
                             str(a.batch_size), str(d_model), str(a.d_sae), str(a.prefixes),
                             str(a.steps), str(runs), str(a.saev_threads)],
                            cwd=runs, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=a.timeout)
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{mode} child exited {proc.returncode}:\n{err[-4000:]}")
    r = json.loads(out.strip().splitlines()[-1])
    stamps, passes = r["stamps"], r["passes"]
    sizes = passes[-1]["sizes"]  # the step loop's pass; one before it: datapoint init
    if len(stamps) != r["steps"] or len(sizes) < len(stamps):
        raise RuntimeError(f"{mode}: {len(stamps)} optimizer steps, {r['steps']} trainer "
                           f"steps, {len(sizes)} batches")
    init_s = passes[-1]["begin"] - r["t_train"] if len(passes) > 1 else 0.0
    init_n = sum(passes[0]["sizes"]) if len(passes) > 1 else 0
    k = a.skip
    if len(stamps) <= k + 1:
        raise RuntimeError(f"{mode}: {len(stamps)} steps, not more than --skip {k} + 1")
    span = stamps[-1] - stamps[k - 1] if k > 0 else stamps[-1] - r["t_train"]
    steady = len(stamps) - k
    return dict(mode=mode, loader=r["loader"], steps=len(stamps), steady_steps=steady,
                steps_s=steady / span, vectors_s=sum(sizes[k:len(stamps)]) / span,
                steady_s=span, first_step_s=stamps[0] - r["t_train"], init_s=init_s,
                init_vectors_s=init_n / init_s if init_s else float("nan"),
                import_s=r["t_train"] - r["t_start"], train_s=r["t_end"] - r["t_train"],
                wall_s=wall, load=load, torch_threads=r["torch_threads"],
                delivered_mb=(daemon.delivered() - before) / 1e6,
                warnings=[ln for ln in err.splitlines()
                          if "WARNING" in ln or "Traceback" in ln][:5])


def main():
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 2)[2],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=6,
                    help="pairs of runs (saev, shardcast), order alternating (default 6)")
    ap.add_argument("--steps", type=int, default=30,
                    help="training steps per run: n_train = steps x batch size (default "
                         "30: ~16 s of steps after --skip at 1.5 steps/s)")
    ap.add_argument("--skip", type=int, default=5,
                    help="first steps left out of steps/s (default 5)")
    ap.add_argument("--batch-size", type=int, default=1024,
                    help="ShuffledConfig.batch_size (default 1024; saev's is 16384)")
    ap.add_argument("--d-sae", type=int, default=256,
                    help="SAE width (default 256; saev's is 16384); d_model is the data's")
    ap.add_argument("--prefixes", type=int, default=10,
                    help="Matryoshka n_prefixes (default 10, saev's; 1: a plain SAE loss)")
    ap.add_argument("--layer", type=int, default=6, help="layer trained on (default 6)")
    ap.add_argument("--saev-threads", default="default",
                    help="ShuffledConfig.n_threads for both loaders (default: saev's, 4)")
    ap.add_argument("--dataset", help="a saev shards directory to use instead of writing one")
    ap.add_argument("--data-root", default="/tmp/saev-trainer-bench",
                    help="where the dataset is written (ROOT/saev/shards/<hash>) and "
                         "looked for: one with the same shape there is reused "
                         "(default /tmp/saev-trainer-bench)")
    ap.add_argument("--fresh-data", action="store_true",
                    help="write the dataset anew even if one with its shape is there")
    ap.add_argument("--remove-data", action="store_true",
                    help="delete the dataset written or reused under --data-root at the end")
    ap.add_argument("--examples", type=int, default=1024, help="dataset examples (default 1024)")
    ap.add_argument("--tokens", type=int, default=64,
                    help="content tokens per example (default 64)")
    ap.add_argument("--no-cls", dest="cls", action="store_false",
                    help="no [CLS] token (default: one)")
    ap.add_argument("--d-model", type=int, default=768, help="default 768")
    ap.add_argument("--layers", default="0,6", help="recorded layers (default 0,6)")
    ap.add_argument("--daemon-arg", action="append", default=[],
                    help="extra shardcastd argument (repeat; default: none)")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per run (default 900)")
    a = ap.parse_args()

    command = "cd %s && %s" % (shlex.quote(os.getcwd()),
                               " ".join(shlex.quote(x) for x in [sys.executable] + sys.argv))
    binary = os.environ.get("SHARDCASTD_BIN", str(REPO / "build" / "shardcastd"))
    if a.dataset:
        dataset, how = Path(a.dataset).resolve(), "given"
    else:
        dataset, how = make_dataset(a)
    md = json.loads((dataset / "metadata.json").read_text())
    per_layer = md["n_examples"] * md["content_tokens_per_example"]
    print(f"dataset {dataset} ({how}): {du_mb(dataset):.0f} MB, {md['n_examples']} examples x "
          f"{md['content_tokens_per_example']} content tokens"
          f"{' + CLS' if md['cls_token'] else ''}, layers {md['layers']}, d_model "
          f"{md['d_model']}; one epoch of layer {a.layer}: {per_layer} vectors = "
          f"{per_layer / a.batch_size:.1f} batches of {a.batch_size}")
    print(f"trainer: saev.framework.train.train on CPU, SAE d_sae {a.d_sae}, Matryoshka "
          f"n_prefixes {a.prefixes} (saev's defaults otherwise: TopK 32, AuxK, reinit_blend "
          f"0.8, log_every 25), {a.steps} steps of {a.batch_size} (n_train "
          f"{a.steps * a.batch_size}; datapoint init reads min(65536, n_train) first), "
          f"steps/s over steps {a.skip + 1}-{a.steps}; saev loader n_threads "
          f"{a.saev_threads}")
    print(f"load average at start: {loadavg()}", flush=True)

    work = Path(tempfile.mkdtemp(prefix="saev-trainer-bench-run-", dir="/tmp"))
    daemon = None
    results = {"saev": [], "shardcast": []}
    pairs = []
    try:
        daemon = Daemon(binary, work, a.daemon_arg)
        print(f"daemon: {' '.join(daemon.argv)} (pid {daemon.proc.pid})")
        hdr = ("pair  mode       steps/s  vectors/s  first step s  init s  init vec/s  "
               "import s  train s  wall s  MB via daemon  load before")
        print(hdr, flush=True)
        for i in range(a.rounds):
            order = ("saev", "shardcast") if i % 2 == 0 else ("shardcast", "saev")
            pair = {}
            for mode in order:
                runs = work / f"runs-{i}-{mode}"
                runs.mkdir()
                r = run_child(a, mode, dataset, md["d_model"], runs, daemon)
                shutil.rmtree(runs, ignore_errors=True)
                pair[mode] = r
                results[mode].append(r)
                print(f"{i + 1:>4}  {mode:<9} {r['steps_s']:>8.3f} {r['vectors_s']:>10,.0f} "
                      f"{r['first_step_s']:>13.2f} {r['init_s']:>7.2f} "
                      f"{r['init_vectors_s']:>11,.0f} {r['import_s']:>9.2f} {r['train_s']:>8.1f} "
                      f"{r['wall_s']:>7.1f} {r['delivered_mb']:>14.0f}  {r['load']}", flush=True)
                for w in r["warnings"]:
                    print(f"      {mode} stderr: {w[:200]}")
            pairs.append(pair)
    finally:
        rc = daemon.stop() if daemon is not None else None
        if rc not in (None, 0):
            print(f"shardcastd exited {rc}; its log:\n{daemon.log.read_text()[-2000:]}")
        shutil.rmtree(work, ignore_errors=True)
        if a.remove_data and not a.dataset:
            shutil.rmtree(dataset, ignore_errors=True)
            for d in (dataset.parent, dataset.parent.parent, dataset.parent.parent.parent):
                try:
                    d.rmdir()  # saev/shards, saev, the root: when nothing else is there
                except OSError:
                    break

    ratios = [p["shardcast"]["steps_s"] / p["saev"]["steps_s"] for p in pairs]
    first = [p["shardcast"]["first_step_s"] / p["saev"]["first_step_s"] for p in pairs]
    print()
    for mode in ("saev", "shardcast"):
        rs = results[mode]
        print(f"{mode:<9}  median steps/s {median([r['steps_s'] for r in rs]):.3f} "
              f"[{min(r['steps_s'] for r in rs):.3f}-{max(r['steps_s'] for r in rs):.3f}], "
              f"vectors/s {median([r['vectors_s'] for r in rs]):,.0f}, first step "
              f"{median([r['first_step_s'] for r in rs]):.2f} s "
              f"[{min(r['first_step_s'] for r in rs):.2f}-"
              f"{max(r['first_step_s'] for r in rs):.2f}], datapoint init "
              f"{median([r['init_vectors_s'] for r in rs]):,.0f} vectors/s, "
              f"loader {rs[0]['loader']}, "
              f"torch threads {rs[0]['torch_threads']}")
    print(f"shardcast/saev steps/s: {median(ratios):.3f} [{min(ratios):.3f}-{max(ratios):.3f}] "
          f"(median of {len(ratios)} pairs: {' / '.join('%.3f' % x for x in ratios)})")
    init = [p["shardcast"]["init_vectors_s"] / p["saev"]["init_vectors_s"] for p in pairs]
    print(f"shardcast/saev time to first step: {median(first):.3f} "
          f"[{min(first):.3f}-{max(first):.3f}]; datapoint init vectors/s: "
          f"{median(init):.3f} [{min(init):.3f}-{max(init):.3f}]")
    print(f"machine: {os.cpu_count()} CPUs (nproc {len(os.sched_getaffinity(0))}), "
          f"{cpu_model()}, {mem_gib():.1f} GiB, kernel {platform.release()}; load average at "
          f"end {loadavg()}")
    print(f"command: {command}")


if __name__ == "__main__":
    main()
