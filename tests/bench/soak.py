#!/usr/bin/python3
"""Soak test for shardcastd (CI runs it for 1.5 minutes against
the ASan build: tests/run.sh --soak): minutes of mixed load and chaos
against one daemon, watching that its memory, file descriptors and threads
stay flat and that every answer stays right.

Usage (from the repository root; needs only /usr/bin/python3 with numpy and
grpcio, and the built binaries):

    /usr/bin/python3 tests/bench/soak.py                 # 10 minutes
    /usr/bin/python3 tests/bench/soak.py --minutes 1.5 --sample-seconds 5
    /usr/bin/python3 tests/bench/soak.py --json > soak.json

What it does
------------
Setup. In a scratch directory (--root, default a fresh /tmp/shardcast-soak-*)
`shardcast synth` writes three small datasets (tens of MiB each, three
metadata variants: 2.1 with CLS, 2.1-saev with labels, 1.0.0 with a trailing
empty shard and a padded last shard). shardcastd serves them on a Unix socket
in the scratch directory (shared memory on), with its HTTP admin port on a
free loopback port, a 256 MiB reservoir of 1 MiB blocks, shuffle window 8 and
lag bound 16 (so each shuffled stream reserves 24 MiB and about ten fit).

Load, all at once for --minutes:
  * --trainers processes (default 3) stream shuffled epochs endlessly, over
    shared memory and over gRPC messages, some as one rank of a partition
    (rank/world_size), two of them on the same shared scan. Every batch is
    checked: 4 of its rows against the synth formula (independent of the
    daemon's code), every vector id once per epoch, the rank's residue, and
    each complete epoch's exact vector count.
  * --queriers processes (default 2) call get_vectors, get_example and
    get_labels at random coordinates (every value checked against the synth
    formula), and about one call in seven is a bad request (unknown dataset,
    too-short id prefix, example/layer/token out of range, labels of a
    dataset without labels, a stream of an unknown layer) that must fail with
    shardcast.Error and a client-error code. They also query the damaged
    copies below, where DATA_LOSS, FAILED_PRECONDITION and NOT_FOUND are
    expected and any vector returned must still be right.
  * a chaos loop, every --chaos-seconds (jittered), does one of:
      sighup         SIGHUP the daemon (rescan)
      kill_trainer   SIGKILL a random trainer, start a new one (new seed)
      kill_querier   SIGKILL a random querier, start a new one
      pause_trainer  SIGSTOP a trainer for 3-8 s, then SIGCONT (lag bound)
      damage_load    copy a dataset to a new directory, damage the copy
                     (truncate a shard to half or to 0, garbage metadata.json,
                     wrong counts in metadata.json, delete shards.json, delete
                     a shard), SIGHUP: the copy must be listed as rejected;
                     later repair it + SIGHUP: it must be served; later
                     delete it + SIGHUP: it must be gone
      damage_live    copy a dataset intact, SIGHUP, start a stream on it,
                     truncate one of its shards under the stream (DATA_LOSS
                     or a complete, correct epoch are both fine), later
                     delete it + SIGHUP
      short_stream   a short-lived client: reads a few batches then closes,
                     cancels, exits without closing (os._exit), resumes from
                     a resume token, or reads one whole small epoch
    No FIFOs are used (a FIFO in a dataset directory is a known way to hang
    a rescan).

Sampling. Every --sample-seconds it records from /proc/<daemon pid>: VmRSS
(and its RssAnon/RssFile/RssShmem split), open fds, Threads, and from
GetStatus (with a 5 s deadline): calls in flight, shared-memory regions and
streams, shared scans, reservoir bytes in use / reserved, datasets ok /
rejected; plus /healthz and the line count of /metrics, and the workers'
batch/query/error counters. A sample line is printed to stderr as it goes.

End. Load stops (SIGTERM to the workers, SIGKILL after 5 s), the damaged
copies are deleted and the daemon rescans, --settle-seconds later a final
sample is taken, then the daemon gets SIGTERM and must exit 0. The report
(stdout; with --json, one JSON document instead) starts with the command
line and machine, then the table of samples, the counters and the verdict.

Verdict (exit 0 only if every line passes):
  rss       growth from the first sample after warm-up (1/5 of the run) to
            the last sample under load and to the final idle sample is at
            most max(--rss-tolerance x warm-up RSS, --rss-slack-mib)
  fds       final idle fds within --fd-slack of the baseline (idle daemon
            before any load), not counting up to --query-threads io_uring
            rings that query threads open on first use
  threads   final idle threads within --thread-slack of the baseline, and
            the maximum under load at most baseline + --thread-max-extra
  idle      the final status shows no shared-memory regions or streams, no
            scans, nothing reserved, all good datasets served, no rejects
  alive     the daemon stayed alive and answered every status call, and
            exited 0 on SIGTERM
  clean     no unexpected client-visible error: no wrong value, no bad
            request accepted, no unexpected status code, no worker crash or
            stall (no progress for --stall-seconds), no damaged copy served
If the daemon dies or stops answering, the run stops at once with the tail
of its log (and `gdb thread apply all bt` if gdb is there), exit 1.

Cleanup: every process it started and the scratch directory (unless --keep)
are removed on normal exit, failure and Ctrl-C (children run in their own
session, so Ctrl-C reaches only this script, which then cleans up).

Results: the report goes in tests/bench/results/HISTORY.md, the figure in
tests/bench/results/current.json (then tests/bench/results_table.py).
"""

import argparse
import collections
import ctypes
import datetime
import heapq
import json
import os
import platform
import random
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(REPO / "client" / "python"))

import numpy as np  # noqa: E402

MIB = 1 << 20

# The datasets: synth arguments (each tens of MiB; several shards each).
DATASETS = {
    # 256 ex x 2 layers x 65 tokens x 256 floats = 32.5 MiB, 8 shards.
    "A": dict(seed=1, args=["--layers", "6,12", "--tokens", "64", "--cls",
                            "--d-model", "256", "--examples", "256",
                            "--budget", "4160"]),
    # 320 ex x 1 layer x 32 tokens x 512 floats = 20 MiB, 8 shards, labels.
    "B": dict(seed=2, args=["--variant", "2.1-saev", "--layers", "3",
                            "--tokens", "32", "--d-model", "512",
                            "--examples", "320", "--budget", "1280",
                            "--labels"]),
    # 512 ex x 3 layers x 17 tokens x 128 floats = 12.75 MiB, 6 shards.
    "C": dict(seed=3, args=["--variant", "1.0.0", "--layers", "-2,4,8",
                            "--tokens", "16", "--cls", "--d-model", "128",
                            "--examples", "512", "--budget", "5100",
                            "--trailing-empty-shard", "--full-last-shard"]),
}

# Trainer slots: trainer i runs TRAINERS[i % len(TRAINERS)].
TRAINERS = [
    dict(ds="A", layer=12, tokens="content", shm=True, batch=1024, rank=0, world=1),
    dict(ds="A", layer=12, tokens="content", shm=False, batch=1024, rank=1, world=2),
    dict(ds="B", layer=None, tokens="all", shm=True, batch=512, rank=0, world=2),
    dict(ds="C", layer=None, tokens="all", shm=False, batch=2048, rank=0, world=1),
    dict(ds="A", layer=6, tokens="special", shm=True, batch=100, rank=0, world=1),
    dict(ds="C", layer=4, tokens="content", shm=True, batch=777, rank=2, world=3),
]

DAEMON_FLAGS = ["--reservoir-bytes", "256M", "--block-bytes", "1M",
                "--shuffle-window", "8", "--lag-blocks", "16",
                "--grace-seconds", "5"]

# Codes a bad request may fail with (anything else is a finding).
CLIENT_ERROR_CODES = {"NOT_FOUND", "INVALID_ARGUMENT", "OUT_OF_RANGE",
                      "FAILED_PRECONDITION"}
# Codes a request on a damaged copy may fail with.
DAMAGED_CODES = {"DATA_LOSS", "FAILED_PRECONDITION", "NOT_FOUND"}
# Codes a trainer may see without it being a finding (reported anyway).
TRAINER_TOLERATED = {"RESOURCE_EXHAUSTED"}

CRASH_MARKERS = ("terminate called", "Segmentation fault", "AddressSanitizer",
                 "runtime error:", "Assertion", "std::bad_alloc", "what():",
                 "FATAL", "Check failed")


# ---------------------------------------------------------------------------
# The synth oracle (contract of `shardcast synth`; common/format/synth.h), in numpy.

_M64 = (1 << 64) - 1


def _splitmix64(x):
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


class Oracle:
    """Expected values of a synth dataset, from its geometry and seed."""

    def __init__(self, meta):
        self.seed = meta["seed"]
        self.layers = list(meta["layers"])
        self.L = len(self.layers)
        self.T = meta["T"]
        self.D = meta["D"]
        self.cls = meta["cls"]
        self.content = meta["content_tokens"]
        self.n = meta["n"]
        self.has_labels = meta["labels"]
        self._mixed = np.uint64((self.seed * 0x100000001B3) & _M64)

    def vectors(self, examples, layer_idx, t_axis):
        """float32 [N, D] at (example, layer index, token-axis index)."""
        e = np.asarray(examples, dtype=np.uint64).reshape(-1, 1)
        li = np.asarray(layer_idx, dtype=np.uint64).reshape(-1, 1)
        t = np.asarray(t_axis, dtype=np.uint64).reshape(-1, 1)
        D = np.uint64(self.D)
        with np.errstate(over="ignore"):
            base = ((e * np.uint64(self.L) + li) * np.uint64(self.T) + t) * D
            idx = base + np.arange(self.D, dtype=np.uint64)[None, :]
        h = _splitmix64(idx ^ self._mixed)
        vals = (h >> np.uint64(40)).astype(np.float64) / float(1 << 24) * 2.0 - 1.0
        return vals.astype(np.float32)

    def labels(self, examples, content_idx):
        j = (np.asarray(examples, dtype=np.uint64) * np.uint64(self.content) +
             np.asarray(content_idx, dtype=np.uint64))
        with np.errstate(over="ignore"):
            jm = j * np.uint64(0x9E37)
        h = _splitmix64(np.uint64(~self.seed & _M64) ^ jm)
        return (h & np.uint64(7)).astype(np.uint8)


# ---------------------------------------------------------------------------
# Workers: separate processes (so they can be SIGKILLed), started as
# `soak.py --worker JSON`. Each writes its counters to a stats file.

class Stats:
    def __init__(self, cfg):
        self.path = cfg["stats"]
        self.d = {"name": cfg["name"], "role": cfg["role"], "pid": os.getpid(),
                  "started": time.time(), "progress_at": time.time(),
                  "counts": collections.Counter(), "errors": collections.Counter(),
                  "unexpected": collections.Counter(), "messages": [],
                  "done": False, "outcome": None}
        self._last = 0.0

    def count(self, key, n=1):
        self.d["counts"][key] += n

    def progress(self):
        self.d["progress_at"] = time.time()

    def error(self, key):
        self.d["errors"][key] += 1

    def unexpected(self, key, message):
        self.d["unexpected"][key] += 1
        if len(self.d["messages"]) < 10:
            self.d["messages"].append(f"{key}: {message}"[:600])
        print(f"UNEXPECTED {key}: {message}", file=sys.stderr, flush=True)

    def flush(self, force=False):
        now = time.time()
        if not force and now - self._last < 1.0:
            return
        self._last = now
        self.d["updated"] = now
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.d, f)
        os.replace(tmp, self.path)


_stop = False


def _on_term(signum, frame):
    global _stop
    _stop = True


def _die_with_parent(parent_pid):
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass
    if os.getppid() != parent_pid:
        os._exit(0)


def _pace(seconds):
    if seconds > 0:
        time.sleep(seconds)


class EpochChecker:
    """Every vector once per epoch, the rank's residue, exact epoch sizes."""

    def __init__(self, oracle, layer, tokens, rank, world, stats):
        self.o, self.stats = oracle, stats
        self.layer, self.tokens, self.rank, self.world = layer, tokens, rank, world
        if tokens == "content":
            self.k = oracle.content
        elif tokens == "special":
            self.k = 1
        else:
            self.k = oracle.T
        rows = oracle.n * (oracle.L if layer is None else 1)
        self.G = rows * self.k
        self.expected = len(range(rank, self.G, world))
        self.epoch = None
        self.whole = False  # saw this epoch's batch 0
        self.next_index = 0
        self.seen = np.zeros(self.G, dtype=bool)
        self.count = 0

    def _ids(self, b):
        e = b.example_idx.astype(np.int64)
        t = b.token_idx.astype(np.int64)
        if self.tokens == "content":
            j = t
        elif self.tokens == "special":
            j = np.zeros_like(t)
        else:
            j = t + (1 if self.o.cls else 0)
        if self.layer is None:
            li = np.searchsorted(self.o.layers_sorted, b.layer)
            li = self.o.layers_order[li]
            row = e * self.o.L + li
        else:
            li = np.full_like(e, self.o.layers.index(self.layer))
            row = e
        return row * self.k + j, li

    def batch(self, b):
        """Checks one batch; returns False if it found something wrong."""
        s = self.stats
        if self.epoch is None or b.epoch != self.epoch:
            if self.epoch is not None:
                if b.epoch != self.epoch + 1:
                    s.unexpected("epoch_jump", f"epoch {self.epoch} -> {b.epoch}")
                elif self.whole:
                    if self.count != self.expected:
                        s.unexpected("epoch_size", f"epoch {self.epoch}: {self.count} "
                                     f"vectors, expected {self.expected} (rank "
                                     f"{self.rank}/{self.world})")
                    else:
                        s.count("epochs_checked")
            self.epoch = b.epoch
            self.whole = b.index == 0
            self.next_index = b.index
            self.seen[:] = False
            self.count = 0
        if b.index != self.next_index:
            s.unexpected("batch_index", f"epoch {b.epoch}: batch {b.index}, "
                         f"expected {self.next_index}")
        self.next_index = b.index + 1
        rows = b.rows
        if b.vectors.shape != (rows, self.o.D) or b.example_idx.size != rows:
            s.unexpected("batch_shape", f"{b.vectors.shape} rows {rows}")
            return False
        ids, li = self._ids(b)
        ok = True
        if ids.size and (ids.min() < 0 or ids.max() >= self.G):
            s.unexpected("vector_id", f"ids out of [0, {self.G})")
            return False
        if np.any(ids % self.world != self.rank):
            s.unexpected("partition", f"rank {self.rank}/{self.world} got ids of "
                         "another rank")
            ok = False
        if np.any(self.seen[ids]) or np.unique(ids).size != ids.size:
            s.unexpected("duplicate", f"epoch {b.epoch} batch {b.index}: a vector "
                         "delivered twice in one epoch")
            ok = False
        self.seen[ids] = True
        self.count += rows
        # Values of 4 rows (all of them when the batch is tiny).
        pick = np.random.randint(0, rows, size=min(4, rows)) if rows else []
        if len(pick):
            t_axis = (b.token_idx[pick].astype(np.int64) + (1 if self.o.cls else 0))
            want = self.o.vectors(b.example_idx[pick], li[pick], t_axis)
            if not np.array_equal(b.vectors[pick], want):
                s.unexpected("wrong_values", f"epoch {b.epoch} batch {b.index}: "
                             f"rows {list(pick)} differ from the synth formula")
                ok = False
            if b.labels is not None and self.o.has_labels:
                tok = b.token_idx[pick].astype(np.int64)
                got = b.labels[pick]
                content = tok >= 0
                want_l = np.full(len(pick), 255, dtype=np.uint8)
                if content.any():
                    want_l[content] = self.o.labels(b.example_idx[pick][content],
                                                    tok[content])
                if not np.array_equal(got, want_l):
                    s.unexpected("wrong_labels", f"epoch {b.epoch} batch {b.index}")
                    ok = False
        return ok


def _oracle(meta):
    o = Oracle(meta)
    order = np.argsort(o.layers)
    o.layers_sorted = np.asarray(o.layers, dtype=np.int64)[order]
    o.layers_order = order
    return o


def worker_trainer(cfg, stats):
    import shardcast
    o = _oracle(cfg["meta"])
    client = None
    while not _stop:
        try:
            if client is None:
                client = shardcast.Client(cfg["address"], shared_memory=cfg["shm"])
            seed = random.randrange(1 << 31)
            checker = EpochChecker(o, cfg["layer"], cfg["tokens"], cfg["rank"],
                                   cfg["world"], stats)
            stream = client.stream(cfg["dataset"], layer=cfg["layer"],
                                   tokens=cfg["tokens"], batch_size=cfg["batch"],
                                   seed=seed, epochs=0, rank=cfg["rank"],
                                   world_size=cfg["world"])
            stats.count("streams_opened")
            if cfg["shm"] and not stream.shared_memory:
                stats.unexpected("no_shm", "asked for shared memory, got messages")
            with stream:
                for b in stream:
                    checker.batch(b)
                    stats.count("batches")
                    stats.count("vectors", b.rows)
                    stats.progress()
                    stats.flush()
                    if _stop:
                        break
                    _pace(cfg["pace"])
        except shardcast.Error as e:
            stats.error(f"stream:{e.code}")
            if e.code not in TRAINER_TOLERATED:
                stats.unexpected(f"stream:{e.code}", e.message)
            stats.flush()
            time.sleep(0.5)
        except Exception as e:  # noqa: BLE001 - a soak records everything
            traceback.print_exc()
            stats.unexpected(f"exception:{type(e).__name__}", str(e))
            stats.flush()
            time.sleep(1.0)
            client = None
    stats.d["done"] = True


def _expect_error(stats, name, fn, codes=CLIENT_ERROR_CODES):
    import shardcast
    try:
        fn()
    except shardcast.Error as e:
        stats.error(f"bad:{name}:{e.code}")
        if e.code not in codes:
            stats.unexpected(f"bad:{name}:{e.code}", e.message)
        else:
            stats.count("bad_requests_refused")
        return
    except Exception as e:  # noqa: BLE001
        stats.unexpected(f"bad:{name}:exception:{type(e).__name__}", str(e))
        return
    stats.unexpected(f"bad:{name}:accepted", "a bad request succeeded")


def worker_querier(cfg, stats):
    import shardcast
    metas = cfg["metas"]   # key -> meta
    ids = cfg["ids"]       # key -> dataset id
    oracles = {k: _oracle(m) for k, m in metas.items()}
    good_ids = set(ids.values())
    client = None
    copies = []
    copies_at = 0.0
    rng = random.Random()

    def check(o, got, e, li, t, what):
        want = o.vectors(e, li, t)
        if got.shape[-1] != o.D or not np.array_equal(got.reshape(-1, o.D), want):
            stats.unexpected(f"wrong_values:{what}", f"{got.shape} differs from "
                             "the synth formula")

    def random_coords(o, n):
        e = np.array([rng.randrange(o.n) for _ in range(n)])
        li = np.array([rng.randrange(o.L) for _ in range(n)])
        t = np.array([rng.randrange(o.T) for _ in range(n)])
        coords = np.stack([e, np.asarray(o.layers)[li], t], axis=1)
        return coords, e, li, t

    def good_query(key, dsid, expected_codes=None):
        o = oracles[key]
        op = rng.choices(["vectors", "example", "example_all", "labels"],
                         weights=[5, 2, 1, 1 if o.has_labels else 0])[0]
        try:
            if op == "vectors":
                coords, e, li, t = random_coords(o, rng.choice([1, 1, 4, 32, 128]))
                check(o, client.get_vectors(dsid, coords), e, li, t, "get_vectors")
            elif op == "example":
                e, li = rng.randrange(o.n), rng.randrange(o.L)
                got = client.get_example(dsid, e, layer=o.layers[li])
                check(o, got, [e] * o.T, [li] * o.T, range(o.T), "get_example")
            elif op == "example_all":
                e = rng.randrange(o.n)
                got = client.get_example(dsid, e)
                li = np.repeat(np.arange(o.L), o.T)
                check(o, got, [e] * (o.L * o.T), li, np.tile(np.arange(o.T), o.L),
                      "get_example_all")
            else:
                e = rng.randrange(o.n)
                got = client.get_labels(dsid, e)
                want = o.labels([e] * o.content, np.arange(o.content))
                if not np.array_equal(got, want):
                    stats.unexpected("wrong_labels", f"example {e}")
            stats.count("queries")
            stats.progress()
        except shardcast.Error as e:
            stats.error(f"{'copy' if expected_codes else 'query'}:{op}:{e.code}")
            if not expected_codes or e.code not in expected_codes:
                stats.unexpected(f"query:{op}:{e.code}", f"{dsid}: {e.message}")

    def bad_query():
        key = rng.choice(sorted(ids))
        o, dsid = oracles[key], ids[key]
        l0 = o.layers[0]
        cases = [
            ("unknown_dataset", lambda: client.get_vectors(
                "ffffffffdeadbeef", [(0, l0, 0)])),
            ("short_prefix", lambda: client.get_vectors(dsid[:4], [(0, l0, 0)])),
            ("empty_id", lambda: client.get_example("", 0)),
            ("example_out_of_range", lambda: client.get_example(
                dsid, o.n + rng.randrange(1000))),
            ("negative_example", lambda: client.get_vectors(dsid, [(-1, l0, 0)])),
            ("unknown_layer", lambda: client.get_vectors(dsid, [(0, 9999, 0)])),
            ("token_out_of_range", lambda: client.get_vectors(
                dsid, [(0, l0, o.T + rng.randrange(5))])),
            ("example_unknown_layer", lambda: client.get_example(dsid, 0, layer=-777)),
            ("stream_unknown_layer", lambda: next(iter(client.stream(
                dsid, layer=9999, batch_size=16, shared_memory=False)))),
            ("stream_unknown_dataset", lambda: next(iter(client.stream(
                "ffffffffdeadbeef", batch_size=16, shared_memory=False)))),
        ]
        if not o.has_labels:
            cases.append(("labels_without_labels", lambda: client.get_labels(dsid, 0)))
        name, fn = rng.choice(cases)
        _expect_error(stats, name, fn)
        stats.count("bad_requests")
        stats.progress()

    while not _stop:
        try:
            if client is None:
                client = shardcast.Client(cfg["address"])
            now = time.time()
            if now - copies_at > 2.0:
                copies_at = now
                copies = [d.id for d in client.datasets() if d.id not in good_ids
                          and d.id.startswith("copy-")]
            r = rng.random()
            if r < 0.15:
                bad_query()
            elif r < 0.27 and copies:
                dsid = rng.choice(copies)
                good_query(dsid.split("-")[1], dsid, expected_codes=DAMAGED_CODES)
                stats.count("copy_queries")
            else:
                key = rng.choice(sorted(ids))
                good_query(key, ids[key])
        except shardcast.Error as e:  # datasets() failing, connect failing
            stats.error(f"admin:{e.code}")
            stats.unexpected(f"admin:{e.code}", e.message)
            time.sleep(0.5)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            stats.unexpected(f"exception:{type(e).__name__}", str(e))
            time.sleep(1.0)
            client = None
        stats.flush()
        _pace(cfg["pace"])
    stats.d["done"] = True


def worker_short(cfg, stats):
    """One short-lived stream; cfg["mode"] says how it ends."""
    import shardcast
    o = _oracle(cfg["meta"])
    mode = cfg["mode"]
    damaged = cfg.get("damaged", False)
    client = shardcast.Client(cfg["address"], shared_memory=cfg["shm"])
    kw = dict(layer=cfg["layer"], tokens=cfg["tokens"], order=cfg["order"],
              batch_size=cfg["batch"], seed=random.randrange(1 << 31),
              epochs={"full": 1, "damaged": 3}.get(mode, 0))
    checker = EpochChecker(o, cfg["layer"], cfg["tokens"], 0, 1, stats)
    outcome = None
    try:
        stream = client.stream(cfg["dataset"], **kw)
        n = 0
        token = None
        for b in stream:
            if cfg["order"] == "shuffled" or mode != "resume":
                checker.batch(b)
            stats.count("batches")
            stats.progress()
            stats.flush()
            n += 1
            token = b.resume_token
            if mode in ("close", "cancel", "exit", "resume") and n >= cfg["k"]:
                break
            if _stop:
                stream.close()
                mode = "stopped"
                break
            if mode == "damaged":
                _pace(cfg["pace"])
        if mode == "close":
            stream.close()
            outcome = "closed"
        elif mode == "cancel":
            stream.cancel()
            try:
                next(stream)
                outcome = "cancel_ignored"
            except shardcast.Error as e:
                outcome = f"cancelled:{e.code}"
                if e.code != "CANCELLED":
                    stats.unexpected(f"cancel:{e.code}", e.message)
            except StopIteration:
                outcome = "cancel_then_end"
        elif mode == "exit":
            stats.d["outcome"] = "exit_without_close"
            stats.count("outcome:exit:exit_without_close")
            stats.d["done"] = True
            stats.flush(force=True)
            os._exit(0)
        elif mode == "resume":
            stream.close()
            kw["resume_token"] = token
            with client.stream(cfg["dataset"], **kw) as again:
                for i, b in enumerate(again):
                    stats.count("batches")
                    if i + 1 >= cfg["k"]:
                        break
            outcome = "resumed"
        elif mode == "stopped":
            outcome = "stopped_by_soak"
        else:  # full / damaged: whole epochs (the last one checked here)
            if checker.whole and checker.count != checker.expected:
                stats.unexpected("epoch_size", f"{checker.count} vectors, expected "
                                 f"{checker.expected}")
            outcome = "complete"
            if checker.count == checker.expected:
                stats.count("epochs_checked")
    except shardcast.Error as e:
        outcome = f"error:{e.code}"
        stats.error(f"short:{mode}:{e.code}")
        allowed = DAMAGED_CODES if damaged else TRAINER_TOLERATED
        if e.code not in allowed:
            stats.unexpected(f"short:{mode}:{e.code}", e.message)
    stats.d["outcome"] = outcome
    stats.count(f"outcome:{cfg['mode']}:{outcome}")
    client.close()
    stats.d["done"] = True


def worker_main(cfg_json):
    cfg = json.loads(cfg_json)
    _die_with_parent(cfg["parent"])
    signal.signal(signal.SIGTERM, _on_term)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    stats = Stats(cfg)
    stats.flush(force=True)
    try:
        {"trainer": worker_trainer, "querier": worker_querier,
         "short": worker_short}[cfg["role"]](cfg, stats)
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        stats.unexpected(f"crash:{type(e).__name__}", str(e))
    stats.flush(force=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip grpc's atexit work


# ---------------------------------------------------------------------------
# The conductor.

class DaemonDied(Exception):
    pass


def _fd_kind(target):
    """A class of an fd's /proc link: socket, pipe, anon_inode:[io_uring],
    memfd, data/acts*.bin, data/acts*.bin (deleted), ..."""
    deleted = target.endswith(" (deleted)")
    target = target[:-len(" (deleted)")] if deleted else target
    if target.startswith("/memfd:"):
        kind = "memfd"
    elif target.startswith("/dev/"):
        kind = target
    elif target.startswith("/"):
        kind = ("data/" if "/data/" in target else "") + re.sub(
            r"acts\d+\.bin", "acts*.bin", os.path.basename(target))
    else:
        kind = re.sub(r":\[\d+\]$", "", target)  # socket:[123] -> socket
    return kind + (" (deleted)" if deleted else "")


def _read_proc(pid):
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("VmRSS", "RssAnon", "RssFile", "RssShmem", "VmHWM"):
                out[k] = int(v.split()[0]) * 1024
            elif k == "Threads":
                out[k] = int(v)
    kinds = collections.Counter()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        kinds[_fd_kind(target)] += 1
    out["fds"] = sum(kinds.values())
    out["fd_kinds"] = dict(kinds)
    names = collections.Counter()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                names[re.sub(r"\d+$", "#", f.read().strip())] += 1
        except OSError:
            pass
    out["thread_names"] = dict(names)
    return out


def _free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def _default_bin(env, name):
    if os.environ.get(env):
        return os.environ[env]
    # build/ first, as documented; but a build/ binary older than build-srv/'s
    # is stale (another engineer builds there), so take the newer one.
    cands = [REPO / "build" / name, REPO / "build-srv" / name]
    cands = [c for c in cands if c.exists()]
    if not cands:
        return str(REPO / "build" / name)
    return str(max(cands, key=lambda c: (c.stat().st_mtime, c == cands[0])))


def _tail(path, lines=40):
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - (1 << 20)))
            text = f.read().decode("utf-8", "replace")
        return "\n".join(text.splitlines()[-lines:])
    except OSError as e:
        return f"(cannot read {path}: {e})"


def _daemon_tail(path):
    """The daemon log's last lines, and its last lines that are not the
    routine one-line-per-failed-call INFO messages the bad requests cause."""
    text = _tail(path, 4000)
    lines = text.splitlines()
    notable = [ln for ln in lines if not (" INFO call /" in ln or
                                          "ended: 0 batches" in ln)]
    return ("--- last 10 lines of its log ---\n" + "\n".join(lines[-10:]) +
            "\n--- last 25 other lines (no per-call INFO) ---\n" +
            "\n".join(ln[:400] for ln in notable[-25:]))


def _log(msg):
    print(f"[soak {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class Soak:
    def __init__(self, args):
        self.args = args
        self.rng = random.Random(args.seed)
        self.procs = {}          # name -> dict(proc, role, slot, cfg)
        self.daemon = None
        self.samples = []
        self.events = []         # heap of (time, seq, fn, label)
        self.seq = 0
        self.chaos = collections.Counter()
        self.findings = []       # conductor-side problems (strings)
        self.notes = []
        self.copies = {}         # name -> dict(source, damage, state)
        self.copy_seq = 0
        self.worker_seq = collections.Counter()
        self.paused = set()
        self.status_failures = 0
        self.created_root = False
        self.root = None
        self.t0 = None
        self.load_stopped = False
        self.daemon_exit = None

    # -- setup -------------------------------------------------------------
    def setup(self):
        a = self.args
        if a.root:
            self.root = Path(a.root).resolve()
            if self.root.exists() and any(self.root.iterdir()):
                raise SystemExit(f"soak: --root {self.root} exists and is not empty; "
                                 "give a new or empty directory")
            self.created_root = not self.root.exists()
            self.root.mkdir(parents=True, exist_ok=True)
        else:
            self.root = Path(tempfile.mkdtemp(prefix="shardcast-soak-"))
            self.created_root = True
        self.data = self.root / "data"
        self.logs = self.root / "logs"
        self.stats_dir = self.root / "stats"
        for d in (self.data, self.logs, self.stats_dir):
            d.mkdir()
        sock = self.root / "run" / "shardcastd.sock"
        if len(str(sock)) > 100:
            raise SystemExit(f"soak: socket path {sock} is too long for a Unix socket")
        self.address = f"unix:{sock}"
        for b in (a.daemon, a.cli):
            if not os.access(b, os.X_OK):
                raise SystemExit(f"soak: {b} is not an executable (build first, or "
                                 "pass --daemon/--cli)")
        self.ids = {}
        for key, spec in DATASETS.items():
            out = subprocess.run([a.cli, "synth", str(self.data), "--seed",
                                  str(spec["seed"]), "--json"] + spec["args"],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 timeout=120)
            if out.returncode != 0:
                raise SystemExit(f"soak: synth {key} failed: {out.stderr.decode()}")
            self.ids[key] = json.loads(out.stdout)["hash"]
        self.http_port = _free_port()
        self.daemon_cmd = [a.daemon, "--root", str(self.data), "--listen",
                           self.address, "--http", f"127.0.0.1:{self.http_port}"
                           ] + DAEMON_FLAGS + a.daemon_arg
        self.daemon_log = self.logs / "shardcastd.log"
        self._start_daemon()
        # The worker threads the daemon chose (--query-threads or its default
        # for the cores it may use): each may open one io_uring ring.
        self.query_threads = self._admin("GetStatus").query_threads
        if self.query_threads < 1:
            raise SystemExit("soak: shardcastd reports no query_threads in GetStatus "
                             "(a daemon older than this script?)")
        self.metas = {}
        for key, dsid in self.ids.items():
            d = self._admin("DescribeDataset", dsid)
            self.metas[key] = dict(seed=DATASETS[key]["seed"], layers=list(d.layers),
                                   T=d.tokens_per_example, D=d.d_model,
                                   cls=d.cls_token, content_tokens=d.content_tokens,
                                   n=d.n_examples, labels=d.has_labels,
                                   bytes=d.bytes, shards=d.num_shards)
        time.sleep(1.0)
        self.baseline = self.sample("baseline")

    def _start_daemon(self):
        import grpc
        from shardcast.v1 import shardcast_pb2 as pb
        from shardcast.v1 import shardcast_pb2_grpc as pb_grpc
        self.pb = pb
        log = open(self.daemon_log, "ab")

        def pdeathsig():  # runs in the child; no other thread exists yet
            ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)

        self.daemon = subprocess.Popen(self.daemon_cmd, stdout=log, stderr=log,
                                       stdin=subprocess.DEVNULL,
                                       start_new_session=True, preexec_fn=pdeathsig)
        log.close()
        self.channel = grpc.insecure_channel(self.address)
        try:
            grpc.channel_ready_future(self.channel).result(timeout=20)
        except grpc.FutureTimeoutError:
            self._check_daemon()
            raise DaemonDied("shardcastd did not answer on its socket within 20 s\n"
                             + _daemon_tail(self.daemon_log))
        self.admin_stub = pb_grpc.AdminStub(self.channel)

    def _admin(self, method, dataset=None, timeout=5.0):
        pb = self.pb
        if method == "GetStatus":
            return self.admin_stub.GetStatus(pb.GetStatusRequest(), timeout=timeout)
        if method == "ListDatasets":
            return self.admin_stub.ListDatasets(pb.ListDatasetsRequest(),
                                                timeout=timeout).datasets
        return self.admin_stub.DescribeDataset(
            pb.DescribeDatasetRequest(dataset=dataset), timeout=timeout)

    def _check_daemon(self):
        rc = self.daemon.poll()
        if rc is not None:
            raise DaemonDied(f"shardcastd exited with status {rc} "
                             f"({'signal ' + signal.Signals(-rc).name if rc < 0 else 'exit'})"
                             "\n" + _daemon_tail(self.daemon_log))

    # -- sampling ------------------------------------------------------------
    def sample(self, label):
        import grpc
        self._check_daemon()
        s = {"label": label, "t": round(time.time() - self.t0, 1) if self.t0 else 0.0,
             "wall": time.time()}
        s.update(_read_proc(self.daemon.pid))
        try:
            st = self._admin("GetStatus")
            self.status_failures = 0
            s.update(calls_in_flight=st.connected_clients, calls_total=st.calls_total,
                     calls_failed=st.calls_failed, shm_regions=st.shm_regions,
                     shm_bytes=st.shm_bytes, shm_streams=st.shm_streams,
                     scans=len(st.scans),
                     scan_clients=sum(len(x.clients) for x in st.scans),
                     res_in_use=st.reservoir_bytes_in_use,
                     res_reserved=st.reservoir_bytes_reserved,
                     ds_ok=st.datasets_ok, ds_failed=st.datasets_failed,
                     blocks_read=st.blocks_read)
        except grpc.RpcError as e:
            self.status_failures += 1
            s["status_error"] = f"{e.code().name}: {e.details()}"
            self._check_daemon()
            if self.status_failures >= 3:
                self._unresponsive(s["status_error"])
        try:
            with urllib.request.urlopen(
                    f"http://127.0.0.1:{self.http_port}/healthz", timeout=5) as r:
                s["healthz"] = r.status
            with urllib.request.urlopen(
                    f"http://127.0.0.1:{self.http_port}/metrics", timeout=5) as r:
                lines = r.read().decode("utf-8", "replace").splitlines()
                s["metrics_lines"] = len(lines)
                if label != "load":  # series present (names + labels, no values)
                    s["metrics_series"] = sorted(
                        ln.rsplit(" ", 1)[0] for ln in lines
                        if ln and not ln.startswith("#"))
        except Exception as e:  # noqa: BLE001
            s["healthz"] = f"error: {e}"
        agg = self.aggregate()
        s["batches"] = agg["counts"].get("batches", 0)
        s["queries"] = (agg["counts"].get("queries", 0) +
                        agg["counts"].get("bad_requests", 0))
        s["unexpected"] = sum(agg["unexpected"].values()) + len(self.findings)
        s["chaos"] = sum(self.chaos.values())
        self.samples.append(s)
        _log(self._row(s, len(self.samples) - 1))
        return s

    def _unresponsive(self, why):
        stacks = ""
        if shutil.which("gdb"):
            try:
                out = subprocess.run(["gdb", "-p", str(self.daemon.pid), "-batch",
                                      "-ex", "thread apply all bt"],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     timeout=120)
                stacks = out.stdout.decode("utf-8", "replace")
                (self.logs / "daemon-stacks.txt").write_text(stacks)
            except subprocess.TimeoutExpired:
                stacks = "(gdb timed out)"
        raise DaemonDied(f"shardcastd stopped answering GetStatus (3 samples in a row: "
                         f"{why})\n{_daemon_tail(self.daemon_log)}"
                         f"\n--- threads (gdb) ---\n{stacks[:100000]}")

    def aggregate(self):
        agg = {"counts": collections.Counter(), "errors": collections.Counter(),
               "unexpected": collections.Counter(), "messages": []}
        for p in self.stats_dir.glob("*.json"):
            try:
                d = json.loads(p.read_text())
            except (OSError, ValueError):
                continue
            agg["counts"].update(d["counts"])
            agg["errors"].update(d["errors"])
            agg["unexpected"].update(d["unexpected"])
            agg["messages"].extend(f"{d['name']}: {m}" for m in d["messages"])
        return agg

    # -- workers -------------------------------------------------------------
    def spawn(self, role, cfg, slot=None):
        self.worker_seq[role] += 1
        name = f"{role}-{slot if slot is not None else 'x'}-{self.worker_seq[role]}"
        cfg = dict(cfg, role=role, name=name, address=self.address,
                   parent=os.getpid(), stats=str(self.stats_dir / f"{name}.json"))
        log = open(self.logs / f"{name}.log", "ab")
        proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()),
                                 "--worker", json.dumps(cfg)],
                                stdout=log, stderr=log, stdin=subprocess.DEVNULL,
                                start_new_session=True)
        log.close()
        self.procs[name] = dict(proc=proc, role=role, slot=slot, cfg=cfg,
                                started=time.time(), killed=False)
        return name

    def spawn_trainer(self, slot):
        t = TRAINERS[slot % len(TRAINERS)]
        cfg = dict(dataset=self.ids[t["ds"]], meta=self.metas[t["ds"]], layer=t["layer"],
                   tokens=t["tokens"], shm=t["shm"], batch=t["batch"], rank=t["rank"],
                   world=t["world"], pace=self.args.trainer_pace)
        return self.spawn("trainer", cfg, slot)

    def spawn_querier(self, slot):
        return self.spawn("querier", dict(metas=self.metas, ids=self.ids,
                                          pace=self.args.query_pace), slot)

    def live(self, role):
        return [n for n, p in self.procs.items()
                if p["role"] == role and p["proc"].poll() is None and not p["killed"]]

    def reap(self):
        """Notices workers that ended by themselves; restarts load workers."""
        now = time.time()
        for name, p in list(self.procs.items()):
            rc = p["proc"].poll()
            if rc is None:
                limit = 90 if p["role"] == "short" else None
                if limit and now - p["started"] > limit:
                    self.findings.append(f"{name}: short stream still running after "
                                         f"{limit} s (stalled); killed. Log: "
                                         f"{_tail(self.logs / (name + '.log'), 5)}")
                    p["proc"].kill()
                    p["proc"].wait()
                    p["killed"] = True
                continue
            if p.get("reaped"):
                continue
            p["reaped"] = True
            if p["killed"] or (p.get("stopping") and rc == -signal.SIGTERM):
                continue
            if rc != 0:
                self.findings.append(f"{name} exited with status {rc}: "
                                     f"{_tail(self.logs / (name + '.log'), 8)}")
            if p["role"] in ("trainer", "querier") and not self.load_stopped:
                self.findings.append(f"{name} ended by itself (status {rc})")
                (self.spawn_trainer if p["role"] == "trainer"
                 else self.spawn_querier)(p["slot"])

    def check_stalls(self):
        now = time.time()
        for name in self.live("trainer") + self.live("querier"):
            if name in self.paused:
                continue
            p = self.procs[name]
            try:
                d = json.loads((self.stats_dir / f"{name}.json").read_text())
            except (OSError, ValueError):
                continue
            last = max(d["progress_at"], p.get("resumed_at", 0))
            if now - last > self.args.stall_seconds and not p.get("stall_reported"):
                p["stall_reported"] = True
                self.findings.append(
                    f"{name}: no progress for {now - last:.0f} s (stalled); errors "
                    f"{dict(d['errors'])}; log: {_tail(self.logs / (name + '.log'), 5)}")

    def kill_proc(self, name, sig=signal.SIGKILL):
        p = self.procs[name]
        p["killed"] = True
        try:
            p["proc"].send_signal(sig)
        except ProcessLookupError:
            pass

    # -- chaos ---------------------------------------------------------------
    def at(self, delay, fn, label):
        self.seq += 1
        heapq.heappush(self.events, (time.time() + delay, self.seq, fn, label))

    def sighup(self):
        self.daemon.send_signal(signal.SIGHUP)

    def chaos_step(self):
        actions = {"sighup": 3, "kill_trainer": 3, "kill_querier": 1,
                   "pause_trainer": 1, "short_stream": 3,
                   "damage_load": 2 if len(self.copies) < 3 else 0,
                   "damage_live": 1.5 if len(self.copies) < 3 else 0}
        if self.args.chaos_actions:
            actions = {k: (w if k in self.args.chaos_actions else 0)
                       for k, w in actions.items()}
        names = [k for k, w in actions.items() if w > 0]
        if not names:
            return
        action = self.rng.choices(names, weights=[actions[k] for k in names])[0]
        self.chaos[action] += 1
        getattr(self, "chaos_" + action)()

    def chaos_sighup(self):
        self.sighup()

    def chaos_kill_trainer(self):
        live = self.live("trainer")
        if not live:
            return
        name = self.rng.choice(live)
        slot = self.procs[name]["slot"]
        self.kill_proc(name)
        self.paused.discard(name)
        self.spawn_trainer(slot)

    def chaos_kill_querier(self):
        live = self.live("querier")
        if not live:
            return
        name = self.rng.choice(live)
        self.kill_proc(name)
        self.spawn_querier(self.procs[name]["slot"])

    def chaos_pause_trainer(self):
        live = [n for n in self.live("trainer") if n not in self.paused]
        if not live:
            return
        name = self.rng.choice(live)
        self.paused.add(name)
        self.procs[name]["proc"].send_signal(signal.SIGSTOP)

        def resume():
            if name in self.paused:
                self.paused.discard(name)
                self.procs[name]["resumed_at"] = time.time()
                try:
                    self.procs[name]["proc"].send_signal(signal.SIGCONT)
                except ProcessLookupError:
                    pass
        self.at(self.rng.uniform(3, 8), resume, "resume " + name)

    def chaos_short_stream(self, dataset_key=None):
        key = dataset_key or self.rng.choice(sorted(self.ids))
        m = self.metas[key]
        mode = self.rng.choice(["close", "cancel", "exit", "resume", "full"])
        layer = self.rng.choice(m["layers"] + [None])
        tokens = self.rng.choice(["content", "all", "special"] if m["cls"]
                                 else ["content", "all"])
        if mode == "full":  # a small whole epoch: the CLS tokens, or one layer
            layer = m["layers"][0]
            tokens = "special" if m["cls"] else "content"
        cfg = dict(dataset=self.ids[key], meta=m, layer=layer, tokens=tokens,
                   order=self.rng.choice(["shuffled", "ordered"]),
                   shm=self.rng.random() < 0.5, batch=self.rng.choice([64, 256, 1000]),
                   mode=mode, k=self.rng.randint(1, 6), pace=0.0)
        self.chaos["short:" + mode] += 1
        self.spawn("short", cfg)

    def _new_copy(self, key):
        self.copy_seq += 1
        name = f"copy-{key}-{self.copy_seq:04d}"
        stage = self.data / f".stage-{name}"
        shutil.copytree(self.data / self.ids[key], stage)
        return name, stage

    def _shards(self, d):
        return sorted(p.name for p in d.iterdir()
                      if p.name.startswith("acts") and p.name.endswith(".bin"))

    def _listed(self, name):
        for d in self._admin("ListDatasets"):
            if d.id == name:
                return d
        return None

    def chaos_damage_load(self):
        key = self.rng.choice(sorted(self.ids))
        name, stage = self._new_copy(key)
        kind = self.rng.choice(["truncate_half", "truncate_zero", "garbage_metadata",
                                "wrong_counts", "delete_shards_json", "delete_shard"])
        shards = self._shards(stage)
        victim = None
        if kind in ("truncate_half", "truncate_zero"):
            victim = shards[0]
            size = (stage / victim).stat().st_size
            os.truncate(stage / victim, size // 2 if kind == "truncate_half" else 0)
        elif kind == "garbage_metadata":
            victim = "metadata.json"
            (stage / victim).write_text('{"protocol": "2.1", "d_model": [oops')
        elif kind == "wrong_counts":
            victim = "metadata.json"
            md = json.loads((stage / victim).read_text())
            for k in ("n_examples", "n_imgs"):
                if k in md:
                    md[k] = md[k] * 2 + 1
            (stage / victim).write_text(json.dumps(md))
        elif kind == "delete_shards_json":
            victim = "shards.json"
            (stage / victim).unlink()
        else:
            victim = shards[len(shards) // 2]
            (stage / victim).unlink()
        os.rename(stage, self.data / name)
        self.copies[name] = dict(source=key, damage=kind, state="damaged")
        self.chaos["damage:" + kind] += 1
        self.sighup()

        def check_rejected():
            d = self._listed(name)
            if d is None:
                self.findings.append(f"{name} ({kind}): not listed after SIGHUP")
            elif d.ok:
                self.findings.append(f"{name} ({kind}): damaged copy is served "
                                     "(listed ok) instead of rejected")
            elif not d.error:
                self.findings.append(f"{name} ({kind}): rejected without a message")
            else:
                self.chaos["checked:rejected"] += 1

        def repair():
            if name not in self.copies:
                return
            src = self.data / self.ids[key]
            shutil.copy2(src / victim, self.data / name / victim)
            self.copies[name]["state"] = "repaired"
            self.sighup()
            self.at(2.0, check_served, f"check served {name}")

        def check_served():
            d = self._listed(name)
            if d is None or not d.ok:
                self.findings.append(f"{name} ({kind}): repaired copy not served: "
                                     f"{d.error if d is not None else 'not listed'}")
            else:
                self.chaos["checked:repaired"] += 1

        self.at(2.0, check_rejected, f"check rejected {name}")
        self.at(self.rng.uniform(6, 12), repair, f"repair {name}")
        self.at(self.rng.uniform(15, 25), lambda: self.remove_copy(name),
                f"remove {name}")

    def chaos_damage_live(self):
        key = self.rng.choice(sorted(self.ids))
        name, stage = self._new_copy(key)
        os.rename(stage, self.data / name)
        self.copies[name] = dict(source=key, damage="truncate_live", state="served")
        # Truncate a shard the daemon has validated, either before the stream
        # starts (its reads must fail: DATA_LOSS) or under it (the scan may
        # already hold every block in the reservoir: a complete, correct
        # epoch is then fine too).
        when = self.rng.choice(["before_stream", "under_stream"])
        self.chaos["damage:truncate_live:" + when] += 1
        self.sighup()
        m = self.metas[key]

        def start_stream():
            d = self._listed(name)
            if d is None or not d.ok:
                self.findings.append(f"{name}: intact copy not served after SIGHUP: "
                                     f"{d.error if d is not None else 'not listed'}")
                return
            if when == "before_stream":
                truncate()
            cfg = dict(dataset=name, meta=m, layer=None, tokens="all",
                       order=self.rng.choice(["shuffled", "ordered"]),
                       shm=self.rng.random() < 0.5, batch=128, mode="damaged",
                       damaged=True, k=0, pace=0.03)
            self.spawn("short", cfg)
            # The worker needs ~1 s to start; the stream then runs for 3 epochs
            # (seconds), so the truncation lands under it.
            if when == "under_stream":
                self.at(self.rng.uniform(1.2, 3.0), truncate, f"truncate {name}")

        def truncate():
            if name not in self.copies:
                return
            d = self.data / name
            victim = self.rng.choice(self._shards(d))
            size = (d / victim).stat().st_size
            os.truncate(d / victim, self.rng.choice([0, size // 3]))
            self.copies[name]["state"] = "truncated"

        self.at(1.0, start_stream, f"stream on {name}")
        self.at(self.rng.uniform(10, 20), lambda: self.remove_copy(name),
                f"remove {name}")

    def remove_copy(self, name):
        if name not in self.copies:
            return
        shutil.rmtree(self.data / name, ignore_errors=True)
        del self.copies[name]
        self.sighup()

        def check_gone():
            if self._listed(name) is not None:
                self.findings.append(f"{name}: still listed after delete + SIGHUP")
        self.at(2.0, check_gone, f"check gone {name}")

    def run_events(self, until=None):
        import grpc
        while self.events and self.events[0][0] <= (until or time.time()):
            _, _, fn, label = heapq.heappop(self.events)
            try:
                fn()
            except grpc.RpcError as e:
                self._check_daemon()
                self.findings.append(f"{label}: admin call failed: {e.code().name}: "
                                     f"{e.details()}")
            except OSError as e:
                self.findings.append(f"{label}: {e}")

    # -- the run -------------------------------------------------------------
    def run(self):
        a = self.args
        self.t0 = time.time()
        self.baseline["t"] = 0.0
        duration = a.minutes * 60.0
        self.warm_at = duration / 5.0
        for i in range(a.trainers):
            self.spawn_trainer(i)
        for i in range(a.queriers):
            self.spawn_querier(i)
        next_sample = self.t0 + a.sample_seconds
        next_chaos = self.t0 + a.chaos_seconds
        end = self.t0 + duration
        while True:
            now = time.time()
            if now >= end:
                break
            self._check_daemon()
            self.reap()
            self.run_events()
            if now >= next_chaos and a.chaos_seconds > 0:
                self.chaos_step()
                next_chaos = now + a.chaos_seconds * self.rng.uniform(0.5, 1.5)
            if now >= next_sample:
                self.sample("load")
                self.check_stalls()
                next_sample += a.sample_seconds
            time.sleep(0.1)

    def stop_load(self):
        self.load_stopped = True
        for name in list(self.paused):
            try:
                self.procs[name]["proc"].send_signal(signal.SIGCONT)
            except ProcessLookupError:
                pass
        self.paused.clear()
        for name, p in self.procs.items():
            if p["proc"].poll() is None:
                p["stopping"] = True
                p["proc"].send_signal(signal.SIGTERM)
        deadline = time.time() + 5
        for name, p in self.procs.items():
            try:
                p["proc"].wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                p["killed"] = True
                p["proc"].kill()
                p["proc"].wait()
                self.notes.append(f"{name} did not stop within 5 s of SIGTERM; killed")
        self.reap()
        self.events.clear()
        for name in list(self.copies):
            shutil.rmtree(self.data / name, ignore_errors=True)
            del self.copies[name]
        for p in self.data.glob(".stage-*"):
            shutil.rmtree(p, ignore_errors=True)
        self.sighup()

    def finish(self):
        a = self.args
        time.sleep(a.settle_seconds)
        final = self.sample("final")
        self.final = final
        # Clean shutdown.
        self.daemon.send_signal(signal.SIGTERM)
        try:
            self.daemon_exit = self.daemon.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.daemon_exit = "hung"
            self.daemon.kill()
            self.daemon.wait()
        return final

    def cleanup(self):
        for p in self.procs.values():
            if p["proc"].poll() is None:
                try:
                    p["proc"].send_signal(signal.SIGCONT)
                    p["proc"].kill()
                    p["proc"].wait(timeout=5)
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    pass
        if self.daemon is not None and self.daemon.poll() is None:
            self.daemon.terminate()
            try:
                self.daemon.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.daemon.kill()
                self.daemon.wait()
        if getattr(self, "channel", None) is not None:
            self.channel.close()
        if self.root is not None and not self.args.keep:
            if self.created_root:
                shutil.rmtree(self.root, ignore_errors=True)
            else:
                for d in ("data", "logs", "stats", "run"):
                    shutil.rmtree(self.root / d, ignore_errors=True)

    # -- the report ------------------------------------------------------------
    COLS = [("t_s", 7), ("rss_MiB", 8), ("anon", 7), ("shmem", 6), ("fds", 5),
            ("thr", 4), ("inflt", 5), ("shm_r", 5), ("shm_s", 5), ("scans", 5),
            ("res_use", 7), ("res_rsv", 7), ("ds_ok/bad", 9), ("metr", 5),
            ("batch/s", 8), ("query/s", 8), ("chaos", 5), ("unexp", 5)]

    def _row(self, s, i):
        prev = self.samples[i - 1] if i > 0 else None
        dt = (s["wall"] - prev["wall"]) if prev else 0

        def rate(k):
            if not prev or dt <= 0 or s["label"] != "load":
                return "-"
            return f"{(s[k] - prev[k]) / dt:.0f}"

        def g(k, scale=1, fmt="{:.0f}"):
            return fmt.format(s[k] / scale) if k in s else "?"
        vals = [f"{s['t']:.0f}" + ("*" if s["label"] != "load" else ""),
                g("VmRSS", MIB, "{:.1f}"), g("RssAnon", MIB, "{:.1f}"),
                g("RssShmem", MIB, "{:.1f}"), g("fds"), g("Threads"),
                g("calls_in_flight"), g("shm_regions"), g("shm_streams"), g("scans"),
                g("res_in_use", MIB), g("res_reserved", MIB),
                f"{s.get('ds_ok', '?')}/{s.get('ds_failed', '?')}",
                str(s.get("metrics_lines", "?")), rate("batches"), rate("queries"),
                str(s["chaos"]), str(s["unexpected"])]
        return " ".join(v.rjust(w) for v, (_, w) in zip(vals, self.COLS))

    def header(self):
        mem = "?"
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    mem = f"{int(line.split()[1]) / (1 << 20):.1f} GiB"
        try:
            commit = subprocess.run(["git", "-C", str(REPO), "describe", "--always",
                                     "--dirty"], stdout=subprocess.PIPE,
                                    stderr=subprocess.DEVNULL, timeout=10
                                    ).stdout.decode().strip()
        except (OSError, subprocess.TimeoutExpired):
            commit = "?"
        dstat = os.stat(self.args.daemon)
        return {
            "command": shlex.join([sys.executable] + sys.argv),
            "date_utc": datetime.datetime.utcnow().strftime("%Y-%m-%d %H:%M UTC"),
            "machine": f"nproc {os.cpu_count()}, MemTotal {mem}, kernel "
                       f"{platform.release()}, Python {platform.python_version()}",
            "load_average_start": self.load_start,
            "load_average_end": os.getloadavg(),
            "commit": commit,
            "daemon": f"{self.args.daemon} (built "
                      f"{time.strftime('%Y-%m-%d %H:%M', time.gmtime(dstat.st_mtime))} "
                      "UTC)",
            "daemon_command": shlex.join(self.daemon_cmd),
            "datasets": {k: f"{self.ids[k][:16]} ({self.metas[k]['bytes'] / MIB:.1f} MiB, "
                            f"{self.metas[k]['shards']} shards; synth "
                            f"{' '.join(DATASETS[k]['args'])})" for k in self.ids},
            "load": f"{self.args.trainers} trainers, {self.args.queriers} queriers, "
                    f"chaos every ~{self.args.chaos_seconds} s, for "
                    f"{self.args.minutes} min, samples every "
                    f"{self.args.sample_seconds} s",
        }

    def verdict(self):
        a = self.args
        b, f = self.baseline, self.final
        load = [s for s in self.samples if s["label"] == "load"]
        warm = next((s for s in load if s["t"] >= self.warm_at), load[-1] if load else b)
        last = load[-1] if load else f
        checks = []
        limit = max(a.rss_tolerance * warm["VmRSS"], a.rss_slack_mib * MIB)
        g_load = last["VmRSS"] - warm["VmRSS"]
        g_end = f["VmRSS"] - warm["VmRSS"]
        slope = None
        after = [s for s in load if s["t"] >= warm["t"]]
        if len(after) >= 3:
            t = np.array([s["t"] for s in after])
            r = np.array([s["VmRSS"] for s in after]) / MIB
            slope = float(np.polyfit(t / 60.0, r, 1)[0])
        checks.append(("rss", g_load <= limit and g_end <= limit,
                       f"warm-up (t={warm['t']:.0f} s) {warm['VmRSS'] / MIB:.1f} MiB -> "
                       f"last under load {last['VmRSS'] / MIB:.1f} MiB ({g_load / MIB:+.1f})"
                       f" -> final idle {f['VmRSS'] / MIB:.1f} MiB ({g_end / MIB:+.1f}); "
                       f"limit +{limit / MIB:.1f} MiB; peak (VmHWM) "
                       f"{f.get('VmHWM', 0) / MIB:.1f} MiB"
                       + (f"; slope after warm-up {slope:+.2f} MiB/min"
                          if slope is not None else "")))
        # Each query thread opens its io_uring on first use (docs/daemon.md: "batched
        # reads go through a per-thread io_uring"), so up to --query-threads
        # rings may appear after the baseline; everything else must return.
        max_fds = max(s["fds"] for s in self.samples)

        def rings(x):
            return x.get("fd_kinds", {}).get("anon_inode:[io_uring]", 0)
        other_b, other_f = b["fds"] - rings(b), f["fds"] - rings(f)
        qt = self.query_threads
        checks.append(("fds", abs(other_f - other_b) <= a.fd_slack and
                       rings(f) <= rings(b) + qt,
                       f"baseline {b['fds']}, final {f['fds']}, max under load "
                       f"{max_fds}; io_uring rings {rings(b)} -> {rings(f)} (at most "
                       f"+{qt}, one per query thread), other fds {other_b} -> "
                       f"{other_f} (slack {a.fd_slack})"))
        max_thr = max(s["Threads"] for s in self.samples)
        checks.append(("threads", f["Threads"] <= b["Threads"] + a.thread_slack and
                       max_thr <= b["Threads"] + a.thread_max_extra,
                       f"baseline {b['Threads']}, final {f['Threads']} (slack "
                       f"{a.thread_slack}), max under load {max_thr} (bound "
                       f"{b['Threads'] + a.thread_max_extra})"))
        idle_bad = []
        for k, want in (("shm_regions", 0), ("shm_streams", 0), ("scans", 0),
                        ("res_reserved", 0), ("ds_failed", 0),
                        ("ds_ok", len(self.ids))):
            if f.get(k) != want:
                idle_bad.append(f"{k}={f.get(k)} (want {want})")
        if f.get("calls_in_flight", 99) > 1:
            idle_bad.append(f"calls_in_flight={f.get('calls_in_flight')} (want <= 1)")
        checks.append(("idle", not idle_bad, "; ".join(idle_bad) or
                       "no shm regions/streams, no scans, nothing reserved, "
                       f"{len(self.ids)} datasets ok, 0 rejected"))
        log = Path(self.daemon_log).read_text(errors="replace")
        markers = [m for m in CRASH_MARKERS if m in log]
        failed = sum("status_error" in s for s in self.samples)
        alive_ok = self.daemon_exit == 0 and not markers and not failed
        checks.append(("alive", alive_ok,
                       f"answered {len(self.samples) - failed} of {len(self.samples)} "
                       f"status calls, exit on SIGTERM: {self.daemon_exit}"
                       + (f", log has {markers}" if markers else "")))
        agg = self.aggregate()
        n_unexp = sum(agg["unexpected"].values()) + len(self.findings)
        checks.append(("clean", n_unexp == 0,
                       f"{n_unexp} unexpected (clients: {dict(agg['unexpected'])}; "
                       f"conductor findings: {len(self.findings)})"))
        return checks, agg

    def differences(self):
        """What differs between the idle daemon before and after the load."""
        b, f = self.baseline, self.final
        out = []
        for what, key in (("fds", "fd_kinds"), ("threads", "thread_names")):
            keys = sorted(set(b.get(key, {})) | set(f.get(key, {})))
            diff = [f"{k} {b.get(key, {}).get(k, 0)}->{f.get(key, {}).get(k, 0)}"
                    for k in keys if b.get(key, {}).get(k, 0) != f.get(key, {}).get(k, 0)]
            out.append(f"Idle {what} before/after load: " +
                       (", ".join(diff) if diff else "same") + "  [final: " +
                       ", ".join(f"{k} {v}" for k, v in sorted(f.get(key, {}).items()))
                       + "]")
        bm, fm = set(b.get("metrics_series", [])), set(f.get("metrics_series", []))
        if bm != fm:
            out.append(f"/metrics series added by the run: {sorted(fm - bm)[:20]}; "
                       f"gone: {sorted(bm - fm)[:20]}")
        return out

    def partial_report(self, verdict, error, as_json):
        """The report of a run that did not reach its end."""
        out = sys.stdout
        agg = self.aggregate()
        if as_json:
            json.dump({"verdict": verdict, "error": error,
                       "command": shlex.join([sys.executable] + sys.argv),
                       "samples": self.samples, "findings": self.findings,
                       "errors": dict(agg["errors"]),
                       "unexpected": dict(agg["unexpected"]),
                       "chaos": dict(self.chaos)}, out, indent=1, default=str)
            out.write("\n")
            return
        print(f"command: {shlex.join([sys.executable] + sys.argv)}", file=out)
        print(f"{verdict.upper()}: {error}", file=out)
        print("samples so far:", file=out)
        print(" ".join(n.rjust(w) for n, w in self.COLS), file=out)
        for i, s in enumerate(self.samples):
            print(self._row(s, i), file=out)
        print("Chaos: " + ", ".join(f"{k} {v}" for k, v in sorted(self.chaos.items())),
              file=out)
        for k, v in sorted(agg["unexpected"].items()):
            print(f"UNEXPECTED: {k} {v}", file=out)
        for m in agg["messages"][:20]:
            print("  " + m, file=out)
        for fnd in self.findings:
            print("FINDING: " + fnd, file=out)
        print(f"VERDICT: {verdict}", file=out)

    def report(self, checks, agg, out):
        h = self.header()
        ok = all(c[1] for c in checks)
        if self.args.json:
            doc = dict(header=h, baseline=self.baseline, samples=self.samples,
                       final=self.final, counts=dict(agg["counts"]),
                       errors=dict(agg["errors"]), unexpected=dict(agg["unexpected"]),
                       messages=agg["messages"][:50], findings=self.findings,
                       notes=self.notes, differences=self.differences(),
                       chaos=dict(self.chaos),
                       checks=[dict(name=n, ok=o, detail=d) for n, o, d in checks],
                       verdict="flat" if ok else "NOT flat")
            json.dump(doc, out, indent=1, default=str)
            out.write("\n")
            return ok
        p = lambda *x: print(*x, file=out)  # noqa: E731
        p("shardcastd soak")
        for k, v in h.items():
            if isinstance(v, dict):
                p(f"  {k}:")
                for kk, vv in v.items():
                    p(f"    {kk}: {vv}")
            else:
                p(f"  {k}: {v}")
        p("")
        p("Samples (t* = baseline before load / final after load stopped; sizes in "
          "MiB; inflt = calls in flight; shm_r/shm_s = shared-memory regions/streams; "
          "res_use/res_rsv = reservoir in use/reserved; metr = /metrics lines; "
          "unexp = unexpected events so far):")
        p(" ".join(n.rjust(w) for n, w in self.COLS))
        for i, s in enumerate(self.samples):
            p(self._row(s, i))
        c = agg["counts"]
        p("")
        p(f"Work: {c.get('batches', 0)} stream batches ({c.get('vectors', 0)} vectors "
          f"in trainers), {c.get('epochs_checked', 0)} whole epochs checked exactly, "
          f"{c.get('queries', 0)} good queries, {c.get('bad_requests', 0)} bad requests "
          f"({c.get('bad_requests_refused', 0)} refused as expected), "
          f"{c.get('copy_queries', 0)} queries on damaged copies, "
          f"{c.get('streams_opened', 0)} trainer streams opened")
        p("Chaos: " + ", ".join(f"{k} {v}" for k, v in sorted(self.chaos.items())))
        outcomes = {k[8:]: v for k, v in c.items() if k.startswith("outcome:")}
        p("Short streams: " + ", ".join(f"{k} {v}" for k, v in sorted(outcomes.items())))
        p("Errors seen by clients (all classes; expected ones included): " +
          (", ".join(f"{k} {v}" for k, v in sorted(agg["errors"].items())) or "none"))
        if agg["unexpected"]:
            p("UNEXPECTED: " + ", ".join(f"{k} {v}" for k, v in
                                         sorted(agg["unexpected"].items())))
            for m in agg["messages"][:20]:
                p("  " + m)
        for fnd in self.findings:
            p("FINDING: " + fnd)
        for line in self.differences():
            p(line)
        for n in self.notes:
            p("note: " + n)
        p("")
        for name, good, detail in checks:
            p(f"  {'ok  ' if good else 'FAIL'} {name:8s} {detail}")
        p("")
        p(f"VERDICT: {'flat' if ok else 'NOT flat'}"
          + ("" if ok else " (" + ", ".join(n for n, g, _ in checks if not g) + ")"))
        return ok


def parse_args(argv):
    ap = argparse.ArgumentParser(
        prog="soak.py", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Soak test for shardcastd: trainers, random-access clients, "
                    "SIGHUP rescans, client kills and dataset damage for --minutes, "
                    "recording the daemon's RSS, fds and threads over time. Exit 0 "
                    "when they stay flat and nothing unexpected happened, 1 "
                    "otherwise. CI runs 1.5 minutes of it (tests/run.sh --soak).",
        epilog=__doc__.split("What it does", 1)[1].split("Results: the report")[0]
        if "What it does" in __doc__ else None)
    ap.add_argument("--minutes", type=float, default=10.0,
                    help="how long the load runs (default 10)")
    ap.add_argument("--root", help="scratch directory (new or empty; default a fresh "
                    "/tmp/shardcast-soak-*); removed at the end unless --keep")
    ap.add_argument("--keep", action="store_true",
                    help="keep the scratch directory (datasets, logs, worker stats)")
    ap.add_argument("--daemon", default=_default_bin("SHARDCASTD_BIN", "shardcastd"),
                    help="shardcastd binary (default $SHARDCASTD_BIN, else the newer "
                    "of build/shardcastd and build-srv/shardcastd; now %(default)s)")
    ap.add_argument("--cli", default=_default_bin("SHARDCAST_BIN", "shardcast"),
                    help="shardcast CLI binary, for synth (default $SHARDCAST_BIN, else "
                    "the newer of build/ and build-srv/; now %(default)s)")
    ap.add_argument("--daemon-arg", action="append", default=[], metavar="ARG",
                    help="extra argument for shardcastd (repeatable), e.g. "
                    "--daemon-arg=--read-mode=direct")
    ap.add_argument("--sample-seconds", type=float, default=10.0,
                    help="seconds between samples (default 10)")
    ap.add_argument("--trainers", type=int, default=3,
                    help=f"trainer processes (default 3; configurations cycle "
                    f"through {len(TRAINERS)})")
    ap.add_argument("--queriers", type=int, default=2,
                    help="random-access client processes (default 2)")
    ap.add_argument("--chaos-seconds", type=float, default=3.0,
                    help="mean seconds between chaos actions (default 3; 0 = none)")
    ap.add_argument("--chaos-actions", type=lambda v: v.split(","), default=None,
                    metavar="A,B", help="only these chaos actions (default all: "
                    "sighup, kill_trainer, kill_querier, pause_trainer, short_stream, "
                    "damage_load, damage_live)")
    ap.add_argument("--trainer-pace", type=float, default=0.002,
                    help="seconds a trainer sleeps after each batch (default 0.002; "
                    "keeps a 2-core machine usable)")
    ap.add_argument("--query-pace", type=float, default=0.005,
                    help="seconds a querier sleeps after each call (default 0.005)")
    ap.add_argument("--settle-seconds", type=float, default=5.0,
                    help="wait after stopping the load before the final sample "
                    "(default 5)")
    ap.add_argument("--stall-seconds", type=float, default=30.0,
                    help="a worker without progress this long is a finding (default 30)")
    ap.add_argument("--rss-tolerance", type=float, default=0.10,
                    help="allowed RSS growth after warm-up, fraction (default 0.10)")
    ap.add_argument("--rss-slack-mib", type=float, default=64.0,
                    help="allowed RSS growth after warm-up, MiB, if larger than the "
                    "fraction (default 64)")
    ap.add_argument("--fd-slack", type=int, default=2,
                    help="final fds other than the query threads' io_uring rings may "
                    "differ from the baseline by this (default 2)")
    ap.add_argument("--thread-slack", type=int, default=4,
                    help="final threads may exceed the baseline by this (default 4)")
    ap.add_argument("--thread-max-extra", type=int, default=64,
                    help="threads under load may exceed the baseline by this "
                    "(default 64)")
    ap.add_argument("--seed", type=int, default=None,
                    help="seed of the chaos schedule (default: random, printed)")
    ap.add_argument("--json", action="store_true",
                    help="print the report as one JSON document on stdout (progress "
                    "still goes to stderr)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.seed is None:
        args.seed = random.randrange(1 << 31)
    if args.minutes <= 0 or args.sample_seconds <= 0:
        ap.error("--minutes and --sample-seconds must be positive")
    return args


def main(argv):
    args = parse_args(argv)
    if args.worker:
        worker_main(args.worker)
        return 0
    args.daemon = os.path.abspath(args.daemon)
    args.cli = os.path.abspath(args.cli)
    if not any(x.startswith("--seed") for x in argv):
        sys.argv = sys.argv + ["--seed", str(args.seed)]  # printed: reproducible

    def on_term(signum, frame):
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)  # even if started with SIGINT ignored
    soak = Soak(args)
    soak.load_start = os.getloadavg()
    code = 1
    try:
        _log("setting up (synth datasets, start shardcastd)")
        soak.setup()
        _log(f"scratch {soak.root}; daemon pid {soak.daemon.pid}; load for "
             f"{args.minutes} min")
        _log(" ".join(n.rjust(w) for n, w in Soak.COLS))
        soak.run()
        _log("stopping the load")
        soak.stop_load()
        soak.finish()
        checks, agg = soak.verdict()
        code = 0 if soak.report(checks, agg, sys.stdout) else 1
    except DaemonDied as e:
        soak.partial_report("daemon failure", str(e), args.json)
        code = 1
    except KeyboardInterrupt:
        _log("interrupted; cleaning up")
        soak.partial_report("interrupted", "interrupted (SIGINT/SIGTERM)", args.json)
        code = 130
    finally:
        soak.cleanup()
        if args.keep and soak.root is not None:
            _log(f"kept {soak.root}")
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
