"""Writing datasets from Python with the project's own crash-safe writer.

Both `shardcast.write` (a whole array) and `shardcast.Writer` (batch by
batch, for extraction loops) drive `shardcast write` (the C++ CLI, on
common/format/writer.h), so a dataset written from Python is byte for byte
what the CLI writes: protocol "2.1", the Python-exact content hash, one pass
into a temporary directory, fsync, atomic rename (docs/cli.md). A Writer
streams its batches to `shardcast write --stdin` through a pipe, framed (4
bytes of kind, a little-endian uint64 length, the payload), so memory stays
at one batch on this side and one 16 MiB buffer on the other. .npy files are
passed to `--from` as they are.
"""

import collections
import fcntl
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import warnings

import numpy as np

from shardcast._client import Error

BIN_VARIABLE = "SHARDCAST_BIN"

# How often progress=True prints a line.
PROGRESS_INTERVAL = 5.0
# write() hands an in-memory array to its Writer in slices of about this.
_WRITE_SLICE_BYTES = 64 << 20
# Pipe buffer asked for (the default unprivileged maximum,
# /proc/sys/fs/pipe-max-size): fewer wake-ups than the default 64 KiB.
_PIPE_BYTES = 1 << 20

WriteProgress = collections.namedtuple(
    "WriteProgress", "examples_written n_examples bytes_written seconds")
WriteProgress.__doc__ = """What a Writer has done: examples written in all
(resumed ones included) of n_examples, bytes (activations and labels)
appended through this Writer, seconds since it started."""


def _cli():
    """The `shardcast` binary: $SHARDCAST_BIN, then PATH, then the build tree
    beside this package (client/python/../../build/shardcast)."""
    candidates = [os.environ.get(BIN_VARIABLE), shutil.which("shardcast"),
                  os.path.join(os.path.dirname(__file__), "..", "..", "..",
                               "build", "shardcast")]
    for c in candidates:
        if c and os.access(c, os.X_OK):
            return c
    raise Error("NOT_FOUND", "the shardcast CLI was not found: set "
                f"{BIN_VARIABLE} or put it on PATH")


def _metadata_args(layers, cls_token, budget, family, ckpt, dataset, data,
                   variant, pixel_agg, full_last_shard):
    """The `shardcast write` options both modes share."""
    argv = ["--layers", ",".join(str(int(l)) for l in layers)]
    if cls_token:
        argv.append("--cls")
    saev = variant == "2.1-saev"
    if saev:
        # What saev's own ShardWriter writes, so that saev's Metadata.load
        # and loaders read it (they map every shard at full size).
        pixel_agg = "majority" if pixel_agg is None else pixel_agg
        full_last_shard = True if full_last_shard is None else full_last_shard
    for flag, value in (("--budget", budget), ("--family", family),
                        ("--ckpt", ckpt), ("--dataset", dataset),
                        ("--data", data), ("--variant", variant),
                        ("--pixel-agg", pixel_agg)):
        if value is not None:
            argv += [flag, os.fspath(value) if isinstance(value, os.PathLike)
                     else str(value)]
    if full_last_shard:
        argv.append("--full-last-shard")
    return argv


def _shape(shape):
    return "[" + ", ".join(str(int(x)) for x in shape) + "]"


def _as_numpy(value):
    """numpy view of an array or a (CPU or GPU) torch tensor."""
    if type(value).__module__.split(".")[0] == "torch":
        value = value.detach().cpu().numpy()
    return np.asarray(value)


class Writer:
    """Writes one dataset under `root` batch by batch; `close()` returns its
    directory.

        with shardcast.Writer(root, layers=[6, 12], tokens=256, cls_token=True,
                              d_model=1024, n_examples=n, resume=True) as w:
            for start in range(w.examples_written, n, 64):
                w.append(extract(start, 64))   # float32 [64, 2, 257, 1024]
        path = w.path

    `tokens` are the content tokens per example (without CLS); appended
    activations are float32 `[n, len(layers), tokens + cls_token, d_model]`
    (numpy arrays or torch tensors), any n; `labels=True` makes every append
    bring uint8 labels `[n, tokens]`. `budget`, `family`, `ckpt`, `dataset`,
    `data` are `shardcast.write`'s; `variant="2.1-saev"` writes saev's field
    names (with `pixel_agg="majority"` and full-size last shard unless told
    otherwise), which saev's own Metadata.load and loaders read.

    Nothing looks like a dataset until close() has renamed the complete,
    fsynced directory into place. A write that is killed, or whose input
    ends (the Python process dies), keeps its complete shards in a
    `.shardcast-tmp-*` directory; `Writer(..., resume=True)` with the same
    options adopts it after re-hashing them, and `examples_written` says
    where to continue (the next example after the last complete shard; a
    dataset that is already complete gives n_examples). An exception inside
    `with` removes everything, or with resume=True keeps the complete shards
    for the next run. `abort()` always removes everything.

    `progress=True` prints examples/s and GB written to stderr every
    PROGRESS_INTERVAL seconds and at close; a callable gets a WriteProgress
    after every append and at close. Errors raise shardcast.Error
    (INVALID_ARGUMENT for arrays of the wrong shape or dtype, OUT_OF_RANGE
    past n_examples, FAILED_PRECONDITION for close() before every example,
    the CLI's code otherwise). Not thread-safe.
    """

    def __init__(self, root, *, layers, tokens, cls_token, d_model, n_examples,
                 labels=False, budget=None, family=None, ckpt=None, dataset=None,
                 data=None, variant=None, pixel_agg=None, full_last_shard=None,
                 resume=False, progress=False):
        self.layers = [int(l) for l in layers]
        self.tokens = int(tokens)
        self.cls_token = bool(cls_token)
        self.d_model = int(d_model)
        self.n_examples = int(n_examples)
        self.labels = bool(labels)
        self.resume = bool(resume)
        self._example_shape = (len(self.layers), self.tokens + int(self.cls_token),
                               self.d_model)
        self._progress = progress
        self._bytes = 0
        self._session_examples = 0
        self._last_print = self._start = time.monotonic()
        self._failure = None
        self._torn = False
        self._proc = None
        self.path = None
        self.temp_dir = None

        argv = [_cli(), "write", os.fspath(root), "--stdin", "--json",
                "--tokens", str(self.tokens), "--d-model", str(self.d_model),
                "--examples", str(self.n_examples)]
        argv += _metadata_args(self.layers, self.cls_token, budget, family, ckpt,
                               dataset, data, variant, pixel_agg, full_last_shard)
        if self.labels:
            argv.append("--labels")
        if self.resume:
            argv.append("--resume")
        self._stderr = tempfile.TemporaryFile()
        # A session of its own: Ctrl-C reaches only this process, which then
        # ends the write as an exception inside `with` would.
        self._proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=self._stderr, bufsize=0,
                                      start_new_session=True)
        self._fd = self._proc.stdin.fileno()
        try:
            fcntl.fcntl(self._fd, fcntl.F_SETPIPE_SZ, _PIPE_BYTES)
        except (OSError, AttributeError):
            pass  # a smaller pipe only costs wake-ups
        ready = self._read_event()
        if ready.get("event") != "ready":
            self._finish_process()
            raise self._error(ready)
        self.hash = ready["hash"]
        self.temp_dir = ready["temp_dir"] or None
        self.resumed = ready["resumed"]
        self.examples_written = int(ready["examples_written"])
        self.notes = list(ready["notes"])
        for note in self.notes:
            warnings.warn(f"shardcast.Writer: {note}", stacklevel=2)

    # -- the child process --------------------------------------------------

    def _read_event(self):
        """The next JSON line on the CLI's stdout ({} at its end)."""
        line = self._proc.stdout.readline()
        if not line:
            return {}
        try:
            return json.loads(line)
        except ValueError:
            return {"event": "error", "code": "INTERNAL",
                    "message": f"unexpected output of shardcast write: {line[:200]!r}"}

    def _finish_process(self):
        """Waits for the CLI; its last event (an empty dict when none)."""
        last = {}
        try:
            self._proc.stdin.close()
        except OSError:
            pass
        while True:
            event = self._read_event()
            if not event:
                break
            last = event
        self._proc.stdout.close()
        self._proc.wait()
        return last

    def _error(self, event):
        """shardcast.Error from the CLI's error event, or from how it ended."""
        if event.get("event") == "error":
            return Error(event.get("code") or "UNKNOWN", event.get("message", ""))
        self._stderr.seek(0)
        text = self._stderr.read()[-4000:].decode("utf-8", "replace").strip()
        rc = self._proc.returncode
        how = f"was killed by signal {-rc}" if rc is not None and rc < 0 else f"exited with {rc}"
        where = (f"; its complete shards stay in {self.temp_dir} for resume=True"
                 if self.temp_dir else "")
        code = "INVALID_ARGUMENT" if rc == 2 else "ABORTED"  # 2: a usage error
        return Error(code, f"shardcast write {how}{where}" + (f": {text}" if text else ""))

    def _send(self, kind, payload=b""):
        view = memoryview(payload).cast("B")
        # Until the whole frame is out, the stream must not get another one
        # (its bytes would be read as this frame's payload): see abort().
        self._torn = True
        try:
            os.write(self._fd, kind + struct.pack("<Q", view.nbytes))
            while view.nbytes:
                view = view[os.write(self._fd, view):]
        except OSError as e:  # EPIPE: the CLI failed or was killed
            self._failure = self._error(self._finish_process())
            raise self._failure from e
        self._torn = False

    def _check_open(self):
        if self._failure is not None:
            raise Error("FAILED_PRECONDITION", f"the writer has failed: {self._failure}")
        if self._proc.stdin.closed:
            raise Error("FAILED_PRECONDITION", "the writer is closed")
        if self._torn:
            raise Error("FAILED_PRECONDITION", "an append was interrupted midway, so "
                        "nothing more can follow it: abort(), or end the writer and "
                        "continue with resume=True")

    # -- the API --------------------------------------------------------------

    def append(self, acts, labels=None):
        """Appends float32 activations [n, L, T, D] (and, for labels=True,
        uint8 labels [n, tokens]) as the next n examples. Arrays that do not
        fit are refused before anything is written, and the writer stays
        usable; n = 0 does nothing."""
        self._check_open()
        acts = _as_numpy(acts)
        want = "[n, " + ", ".join(str(x) for x in self._example_shape) + \
            "] (n, layers, tokens + cls_token, d_model)"
        if acts.ndim != 4 or acts.shape[1:] != self._example_shape:
            raise Error("INVALID_ARGUMENT",
                        f"append: acts shaped {_shape(acts.shape)}, expected {want}")
        if acts.dtype != np.float32:
            raise Error("INVALID_ARGUMENT",
                        f"append: acts are {acts.dtype}, expected float32 "
                        "(convert with .astype(np.float32))")
        n = acts.shape[0]
        if self.labels:
            if labels is None:
                raise Error("INVALID_ARGUMENT", "append: this writer was created with "
                            "labels=True, so every append needs labels [n, tokens]")
            labels = _as_numpy(labels)
            if labels.shape != (n, self.tokens):
                raise Error("INVALID_ARGUMENT", f"append: labels shaped {_shape(labels.shape)}, "
                            f"expected [{n}, {self.tokens}] (n, tokens)")
            if labels.dtype != np.uint8:
                raise Error("INVALID_ARGUMENT",
                            f"append: labels are {labels.dtype}, expected uint8")
        elif labels is not None:
            raise Error("INVALID_ARGUMENT",
                        "append: labels given but the writer was created without labels=True")
        if self.examples_written + n > self.n_examples:
            raise Error("OUT_OF_RANGE", f"append: {n} more examples would make "
                        f"{self.examples_written + n}, past n_examples = {self.n_examples}")
        if n == 0:
            return
        acts = np.ascontiguousarray(acts)
        self._send(b"ACTS", acts)
        self._bytes += acts.nbytes
        if self.labels:
            labels = np.ascontiguousarray(labels)
            self._send(b"LABL", labels)
            self._bytes += labels.nbytes
        self.examples_written += n
        self._session_examples += n
        self._report(final=False)

    def close(self):
        """Finishes the dataset and returns its directory (<root>/<hash>).
        FAILED_PRECONDITION, with the writer left open, before every example
        was appended; on other failures the writer is closed with its
        complete shards kept (a different dataset under the same name:
        ALREADY_EXISTS, the new data kept for inspection)."""
        if self.path is not None:
            return self.path
        self._check_open()
        if self.examples_written != self.n_examples:
            raise Error("FAILED_PRECONDITION", f"close: {self.examples_written} of "
                        f"n_examples = {self.n_examples} examples were appended; append "
                        f"the other {self.n_examples - self.examples_written} first "
                        "(or abort())")
        self._send(b"DONE")
        event = self._finish_process()
        if event.get("event") != "done":
            self._failure = self._error(event)
            raise self._failure
        self.path = event["path"]
        self._report(final=True)
        return self.path

    def abort(self):
        """Gives up: the temporary directory is removed and nothing is
        written. Does nothing once closed or failed."""
        if self._proc is None or self._proc.stdin.closed or self._failure is not None:
            return
        if self._torn:
            # Interrupted inside a frame (Ctrl-C in append): no ABRT can be
            # framed any more, so the CLI is stopped and its directory removed
            # here.
            self._proc.kill()
            self._finish_process()
            if self.temp_dir:
                shutil.rmtree(self.temp_dir, ignore_errors=True)
        else:
            try:
                self._send(b"ABRT")
            except Error:
                pass
            self._finish_process()
        self._failure = Error("ABORTED", "aborted")

    def _interrupt(self):
        """Ends the CLI's input without DONE: it keeps the complete shards."""
        if self._proc is None or self._proc.stdin.closed:
            return
        self._finish_process()
        self._failure = Error("ABORTED", "interrupted; the complete shards are kept "
                              f"in {self.temp_dir} for resume=True")

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            try:
                self.close()
            except BaseException:
                self._end_after_error()
                raise
        else:
            self._end_after_error()
        return False

    def _end_after_error(self):
        if self.resume:
            self._interrupt()
        else:
            self.abort()

    def _report(self, final):
        p = self._progress
        if not p:
            return
        seconds = time.monotonic() - self._start
        if callable(p):
            p(WriteProgress(self.examples_written, self.n_examples, self._bytes, seconds))
            return
        now = time.monotonic()
        if not final and now - self._last_print < PROGRESS_INTERVAL:
            return
        self._last_print = now
        rate = self._session_examples / seconds if seconds > 0 else 0.0
        gbps = self._bytes / 1e9 / seconds if seconds > 0 else 0.0
        print(f"shardcast.Writer: {self.examples_written}/{self.n_examples} examples "
              f"({100.0 * self.examples_written / max(self.n_examples, 1):.0f}%), "
              f"{self._bytes / 1e9:.2f} GB written, {rate:.0f} examples/s, "
              f"{gbps:.2f} GB/s{' (done)' if final else ''}", file=sys.stderr, flush=True)


def write(root, acts, *, layers, cls_token, labels=None, budget=None,
          family=None, ckpt=None, dataset=None, data=None, variant=None,
          pixel_agg=None, full_last_shard=None):
    """Writes a dataset under `root` and returns its directory.

    `acts`: float32 [N, L, T, D] (an array, or the path of a .npy file);
    `layers`: the L recorded layer values; `cls_token`: token 0 of every
    example is CLS; `labels`: optional uint8 [N, T - cls] per content token
    (array or .npy path); `budget`: tokens per shard (default the CLI's);
    `variant`, `pixel_agg`, `full_last_shard`: as for Writer. An array goes
    through a Writer (converted to float32 / uint8 slice by slice, never
    copied whole); a .npy path is read by the CLI itself. A dataset that
    already exists with the same bytes is reused; one that differs is refused
    (Error ALREADY_EXISTS / FAILED_PRECONDITION).
    """
    options = dict(budget=budget, family=family, ckpt=ckpt, dataset=dataset, data=data,
                   variant=variant, pixel_agg=pixel_agg, full_last_shard=full_last_shard)
    if not isinstance(acts, (str, os.PathLike)):
        acts = _as_numpy(acts)
        if acts.ndim != 4 or (cls_token and acts.shape[2] < 1):
            raise Error("INVALID_ARGUMENT", f"acts shaped {_shape(acts.shape)}, expected "
                        "[N, L, T, D] (T with the CLS token when cls_token)")
        if isinstance(labels, (str, os.PathLike)):
            labels = np.load(os.fspath(labels), mmap_mode="r")
        n = acts.shape[0]
        per_example = max(1, int(np.prod(acts.shape[1:])) * 4)
        step = max(1, _WRITE_SLICE_BYTES // per_example)
        with Writer(root, layers=layers, tokens=acts.shape[2] - int(bool(cls_token)),
                    cls_token=cls_token, d_model=acts.shape[3], n_examples=n,
                    labels=labels is not None, **options) as w:
            if labels is not None:
                labels = _as_numpy(labels)
                if labels.ndim != 2 or labels.shape[0] != n:
                    raise Error("INVALID_ARGUMENT", f"labels shaped {_shape(labels.shape)}, "
                                f"expected [{n}, {w.tokens}] (N, tokens)")
            for i in range(0, n, step):
                w.append(np.ascontiguousarray(acts[i:i + step], dtype=np.float32),
                         None if labels is None else
                         np.ascontiguousarray(labels[i:i + step], dtype=np.uint8))
        return w.path

    with tempfile.TemporaryDirectory(prefix=".shardcast-input-",
                                     dir=root if os.path.isdir(root) else None) as tmp:
        argv = [_cli(), "write", os.fspath(root), "--from", os.fspath(acts), "--json"]
        argv += _metadata_args(layers, cls_token, **options)
        if labels is not None:
            if not isinstance(labels, (str, os.PathLike)):
                path = os.path.join(tmp, "labels.npy")
                np.save(path, np.ascontiguousarray(_as_numpy(labels), dtype=np.uint8))
                labels = path
            argv += ["--labels-from", os.fspath(labels)]
        proc = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    if proc.returncode != 0:
        message = proc.stderr.decode("utf-8", "replace").strip()
        raise Error("INVALID_ARGUMENT" if proc.returncode == 2 else "FAILED_PRECONDITION",
                    message)
    return json.loads(proc.stdout)["path"]
