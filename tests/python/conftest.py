"""Shared fixtures: run the `shardcast` CLI and parse its --json output.

The binary is $SHARDCAST_BIN (set by ctest), else <repo>/build/shardcast.
Expected values never come from the project's code: see saev_reference.py.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parent.parent
# The tests sit in subfolders of HERE (pytest.ini); the helper modules they
# import (saev_reference, package_fixtures, ...) sit in HERE.
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

DEFAULT_BIN = REPO_ROOT / "build" / "shardcast"

# Signs that a process crashed or leaked a runtime failure instead of
# reporting a clean error.
CRASH_MARKERS = ("Traceback (most recent call last)", "terminate called", "Segmentation fault",
                 "core dumped", "AddressSanitizer", "UndefinedBehaviorSanitizer",
                 "runtime error:", "Assertion", "std::bad_alloc", "what():")


class Cli:
    """Runs the shardcast binary; every call has a timeout and captures bytes."""

    def __init__(self, binary):
        self.binary = str(binary)

    def run(self, *args, timeout=60, cwd=None):
        cmd = [self.binary] + [str(a) for a in args]
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              timeout=timeout, cwd=cwd)
        proc.cmd = cmd
        proc.out = proc.stdout.decode("utf-8", errors="replace")
        proc.err = proc.stderr.decode("utf-8", errors="replace")
        return proc

    @staticmethod
    def describe(proc):
        return (f"command: {' '.join(proc.cmd)}\nexit: {proc.returncode}\n"
                f"stdout: {proc.out[:2000]}\nstderr: {proc.err[:2000]}")

    def ok(self, *args, timeout=60, cwd=None):
        proc = self.run(*args, timeout=timeout, cwd=cwd)
        assert proc.returncode == 0, self.describe(proc)
        assert_no_crash(proc)
        return proc

    def json(self, *args, timeout=60, floats=False, cwd=None):
        """Runs with --json appended, expects exit 0, returns parsed stdout.

        floats=True reads every JSON number as a float (so "-0" is -0.0, as
        the JSON number denotes); plain json.loads reads "-0" as the int 0.
        """
        proc = self.ok(*args, "--json", timeout=timeout, cwd=cwd)
        try:
            return json.loads(proc.out, parse_int=float) if floats else json.loads(proc.out)
        except ValueError as e:
            raise AssertionError(f"stdout is not JSON ({e})\n{self.describe(proc)}")

    def fails(self, *args, code=1, stderr_required=True, timeout=60):
        """Expects a clean failure: exit `code` exactly, a message, no crash."""
        proc = self.run(*args, timeout=timeout)
        assert proc.returncode == code, f"expected exit {code}\n{self.describe(proc)}"
        assert_no_crash(proc)
        if stderr_required:
            assert proc.err.strip(), f"stderr is empty\n{self.describe(proc)}"
        return proc


def assert_no_crash(proc):
    assert proc.returncode >= 0, f"killed by signal {-proc.returncode}\n{Cli.describe(proc)}"
    for marker in CRASH_MARKERS:
        assert marker not in proc.err and marker not in proc.out, (
            f"crash marker {marker!r}\n{Cli.describe(proc)}")


# How much of a log's end a failure's message shows.
LOG_TAIL = 12000


def tail(path, limit=LOG_TAIL):
    """The last `limit` bytes of the file at `path`, as text (or why not)."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        return f"<cannot read {path}: {e}>"
    return data[-limit:].decode("utf-8", errors="replace")


@pytest.fixture(scope="session")
def shardcast_bin():
    binary = Path(os.environ.get("SHARDCAST_BIN") or DEFAULT_BIN)
    if not (binary.is_file() and os.access(binary, os.X_OK)):
        pytest.fail(f"shardcast binary not found at {binary} (set SHARDCAST_BIN or build "
                    f"the `shardcast` target into {DEFAULT_BIN.parent})")
    return binary


@pytest.fixture(scope="session")
def cli(shardcast_bin):
    return Cli(shardcast_bin)
