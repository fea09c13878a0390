"""Writing datasets from Python with the project's own crash-safe writer.

shardcast.write runs `shardcast write` (the C++ CLI), so a dataset written
from an extraction script is byte for byte what the CLI writes: protocol
"2.1", the Python-exact content hash, one pass into a temporary directory,
fsync, atomic rename (docs/cli.md). The arrays go to the CLI as .npy
files; arrays already saved as .npy are passed as they are.
"""

import json
import os
import shutil
import subprocess
import tempfile

import numpy as np

from shardcast._client import Error

BIN_VARIABLE = "SHARDCAST_BIN"


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


def write(root, acts, *, layers, cls_token, labels=None, budget=None,
          family=None, ckpt=None, dataset=None, data=None):
    """Writes a dataset under `root` and returns its directory.

    `acts`: float32 [N, L, T, D] (an array, or the path of a .npy file);
    `layers`: the L recorded layer values; `cls_token`: token 0 of every
    example is CLS; `labels`: optional uint8 [N, T - cls] per content token
    (array or .npy path); `budget`: tokens per shard (default the CLI's).
    A dataset that already exists with the same bytes is reused; one that
    differs is refused (Error ALREADY_EXISTS / FAILED_PRECONDITION).
    """
    with tempfile.TemporaryDirectory(prefix=".shardcast-input-",
                                     dir=root if os.path.isdir(root) else None) as tmp:
        def as_npy(value, name, dtype):
            if isinstance(value, (str, os.PathLike)):
                return os.fspath(value)
            array = np.ascontiguousarray(value, dtype=dtype)
            path = os.path.join(tmp, name)
            np.save(path, array)
            return path
        argv = [_cli(), "write", os.fspath(root), "--from",
                as_npy(acts, "acts.npy", np.float32),
                "--layers", ",".join(str(int(l)) for l in layers), "--json"]
        if cls_token:
            argv.append("--cls")
        if labels is not None:
            argv += ["--labels-from", as_npy(labels, "labels.npy", np.uint8)]
        for flag, value in (("--budget", budget), ("--family", family),
                            ("--ckpt", ckpt), ("--dataset", dataset),
                            ("--data", data)):
            if value is not None:
                argv += [flag, str(value)]
        proc = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    if proc.returncode != 0:
        message = proc.stderr.decode("utf-8", "replace").strip()
        raise Error("INVALID_ARGUMENT" if proc.returncode == 2 else "FAILED_PRECONDITION",
                    message)
    return json.loads(proc.stdout)["path"]
