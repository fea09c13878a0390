"""What the tests read off the system, independently of the code under test:
the kernel's count of bytes a process read from storage, the page cache, the
daemon's HTTP endpoint. No imports of the project's packages, so every test
module can use it (test_daemon_grpc's family loads its own generated stubs
and must not import the shardcast package)."""

import os
import urllib.error
import urllib.request
from pathlib import Path


def proc_read_bytes(pid):
    """read_bytes of /proc/PID/io: what the storage devices read for it."""
    for line in Path(f"/proc/{pid}/io").read_text().splitlines():
        key, _, value = line.partition(":")
        if key == "read_bytes":
            return int(value)
    raise AssertionError(f"/proc/{pid}/io has no read_bytes")


def evict(paths):
    """Drops the files' pages from the page cache (as vmtouch -e)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def http_get(port, path, timeout=5.0, host="127.0.0.1"):
    """(status, body) of GET http://host:port/path."""
    try:
        with urllib.request.urlopen(f"http://{host}:{port}{path}", timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def metric_samples(port, host="127.0.0.1"):
    """The daemon's /metrics as {series: value}, series as written
    ('name{label="v",...}')."""
    status, text = http_get(port, "/metrics", timeout=10, host=host)
    assert status == 200, f"/metrics answered {status}: {text[:500]}"
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


def free_ports(n):
    """`n` TCP ports on 127.0.0.1 that were free a moment ago (bound all at
    once, so they differ, then closed for the caller to listen on)."""
    import socket
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports
