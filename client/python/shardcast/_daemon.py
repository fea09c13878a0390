"""Which daemon a Client talks to when it is given no address, and starting
one for the user when the node has none (docs/python.md, "No setup").

In order: $SHARDCAST_ADDRESS; the node's daemon at the documented socket
(NODE_SOCKET, where a sysadmin runs one); the user's own daemon, at
``$XDG_RUNTIME_DIR/shardcast/shardcastd.sock`` (or ``/tmp/shardcast-<uid>/``,
a mode-0700 directory of the user's), started here when it is not running.
That private daemon serves datasets by path only (no --root), sizes its
reservoir to the machine and touches only what streams use, logs to
``shardcastd.log`` beside its socket, and exits after IDLE_SECONDS without a
client; the user's later trainers find it and share its scans.
"""

import os
import shutil
import socket
import stat
import subprocess
import time

ADDRESS_VARIABLE = "SHARDCAST_ADDRESS"
DAEMON_VARIABLE = "SHARDCASTD_BIN"
# Set (to anything but "" or "0"): never start a daemon, fail instead
# (sites that forbid per-user daemons; the test suite, so that a test that
# forgets its address cannot leave one behind).
NO_START_VARIABLE = "SHARDCAST_NO_AUTOSTART"
NODE_SOCKET = "/run/shardcast/shardcastd.sock"
IDLE_SECONDS = 300
READY_SECONDS = 10.0


class StartError(Exception):
    """No daemon could be found or started: `code` is a gRPC code name."""

    def __init__(self, code, message):
        super().__init__(message)
        self.code = code
        self.message = message


def _answers(path):
    """Whether a process accepts connections on the Unix socket `path`."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.settimeout(1.0)
        s.connect(path)
        return True
    except OSError:
        return False
    finally:
        s.close()


def private_dir():
    """The user's directory for their own daemon: created mode 0700, and
    refused unless it is theirs and closed to others."""
    uid = os.getuid()
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime) and os.stat(runtime).st_uid == uid:
        path = os.path.join(runtime, "shardcast")
    else:
        path = f"/tmp/shardcast-{uid}"
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid or st.st_mode & 0o077:
        raise StartError("FAILED_PRECONDITION", (
            f"{path} is not a directory of yours closed to others (mode "
            f"{stat.S_IMODE(st.st_mode):o}, owner {st.st_uid}): remove it, or set "
            f"{ADDRESS_VARIABLE}"))
    return path


def daemon_binary():
    """shardcastd: $SHARDCASTD_BIN, then PATH, then the build tree beside
    this package (client/python/../../build/shardcastd)."""
    here = os.path.dirname(os.path.abspath(__file__))
    candidates = [os.environ.get(DAEMON_VARIABLE), shutil.which("shardcastd"),
                  os.path.join(here, "..", "..", "..", "build", "shardcastd")]
    for c in candidates:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return os.path.realpath(c)
    raise StartError("NOT_FOUND", (
        "no shardcast daemon is running for you and shardcastd was not found to "
        f"start one: put it on PATH, set {DAEMON_VARIABLE}, or set "
        f"{ADDRESS_VARIABLE} to a running daemon"))


def reservoir_bytes():
    """The private daemon's reservoir: an eighth of the memory available
    now, between 64 MiB and 2 GiB (pages are touched only as streams use
    them)."""
    available = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    if available is None:
        return 512 << 20
    return max(64 << 20, min(2 << 30, available // 8)) >> 20 << 20


def _start(directory, sock):
    log = os.path.join(directory, "shardcastd.log")
    binary = daemon_binary()
    try:
        if os.path.getsize(log) > 16 << 20:
            os.replace(log, log + ".1")  # one old log kept
    except OSError:
        pass
    cmd = [binary, "--listen", f"unix:{sock}", "--exit-when-idle", str(IDLE_SECONDS),
           "--prefault", "off", "--reservoir-bytes", str(reservoir_bytes())]
    with open(log, "ab") as out:
        out.write(f"--- started by pid {os.getpid()}: {' '.join(cmd)}\n".encode())
        out.flush()
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                start_new_session=True, close_fds=True)
    deadline = time.monotonic() + READY_SECONDS
    while time.monotonic() < deadline:
        if os.path.exists(sock) and _answers(sock) and \
                os.path.exists(sock + ".local"):
            return
        if proc.poll() is not None:
            # Another process of this user started one at the same time (it
            # holds the socket's lock): wait for that one.
            if os.path.exists(sock + ".lock") and _answers(sock):
                return
            if proc.returncode != 1 or not os.path.exists(sock + ".lock"):
                break
        time.sleep(0.01)
    raise StartError("UNAVAILABLE", (
        f"could not start shardcastd for you ({' '.join(cmd)}): see its log {log}"))


def private_log(address):
    """The log of the user's own daemon when `address` is its socket."""
    if address.startswith("unix:") and os.path.basename(address) == "shardcastd.sock":
        directory = os.path.dirname(address[5:])
        log = os.path.join(directory, "shardcastd.log")
        if os.path.basename(directory) in ("shardcast", f"shardcast-{os.getuid()}") \
                and os.path.exists(log):
            return log
    return None


def resolve(address=None):
    """The address a Client uses: `address`, $SHARDCAST_ADDRESS, the node's
    daemon, or the user's own daemon (started now if need be)."""
    if address is not None:
        if not address:
            raise StartError("INVALID_ARGUMENT", "an empty daemon address: give "
                             "one, or none (None) to find or start a daemon")
        return address
    if os.environ.get(ADDRESS_VARIABLE):
        return os.environ[ADDRESS_VARIABLE]
    if os.path.exists(NODE_SOCKET) and _answers(NODE_SOCKET):
        return f"unix:{NODE_SOCKET}"
    directory = private_dir()
    sock = os.path.join(directory, "shardcastd.sock")
    if not (os.path.exists(sock) and _answers(sock)):
        if os.environ.get(NO_START_VARIABLE, "") not in ("", "0"):
            raise StartError("UNAVAILABLE", (
                f"no shardcast daemon: set {ADDRESS_VARIABLE}, or unset "
                f"{NO_START_VARIABLE} to let the package start your own"))
        _start(directory, sock)
    return f"unix:{sock}"
