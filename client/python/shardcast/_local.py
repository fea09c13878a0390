"""The client's half of the local query socket (README.md, "Local queries").

A client on the daemon's node asks get_vectors on ``<unix socket path>.query``
(SOCK_SEQPACKET) instead of gRPC: each connection hands the daemon a memfd
region of its own (sealed against shrinking) with its first message; a call
writes the coordinates into the region, sends one small request, and reads
the vectors the daemon put there. The messages are fixed little-endian
layouts (common/query_protocol.h), the same as the C++ library speaks.
"""

import fcntl
import mmap
import os
import socket
import struct
import threading

import numpy as np

from shardcast._shm import unix_socket_path

MAGIC = b"SCQ1"
SOCKET_SUFFIX = ".query"
OUT_ALIGN = 4096
COORD_BYTES = 24
_HELLO = struct.Struct("<4sIQ")  # magic, version, region_bytes
_HELLO_REPLY = struct.Struct("<4sIQ")  # magic, code, max_region_bytes
_REQUEST = struct.Struct("<4sIQQQQ8x")  # magic, op, id, count, coords, out
_REPLY = struct.Struct("<4sIQQQQ8x")  # magic, code, id, rows, d_model, need
_OP_VECTORS = 1
_MAX_REPLY = 16 * 1024
# The first region: 256 vectors of d_model 1024 and their coordinates (its
# pages are only touched as calls use them).
FIRST_REGION_BYTES = (1 << 20) + 2 * OUT_ALIGN


def socket_path(address):
    """The local query socket of a daemon at gRPC `address`, or None."""
    path = unix_socket_path(address)
    return path + SOCKET_SUFFIX if path else None


def _round_up(v, to):
    return (v + to - 1) // to * to


class Refused(Exception):
    """The daemon answered with status `code` (a gRPC code number)."""

    def __init__(self, code, message, need=0):
        super().__init__(message)
        self.code = code
        self.message = message
        self.need = need


class _Conn:
    """One connection and its region, mapped read-write here."""

    def __init__(self, path, region_bytes, timeout):
        region_bytes = _round_up(region_bytes, OUT_ALIGN)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        fd = -1
        try:
            self.sock.settimeout(timeout)
            self.sock.connect(path)
            fd = os.memfd_create("shardcast-queries",
                                 os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
            os.ftruncate(fd, region_bytes)
            # The daemon maps only regions that cannot shrink under its writes.
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK |
                        fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
            self.buffer = mmap.mmap(fd, region_bytes, flags=mmap.MAP_SHARED,
                                    prot=mmap.PROT_READ | mmap.PROT_WRITE)
            socket.send_fds(self.sock, [_HELLO.pack(MAGIC, 1, region_bytes)], [fd])
            data = self.sock.recv(_MAX_REPLY)
            if len(data) < _HELLO_REPLY.size or data[:4] != MAGIC:
                raise Refused(15, f"{path} answered something that is not a "
                                  "local query hello reply")
            _, code, self.max_region_bytes = _HELLO_REPLY.unpack_from(data)
            if code != 0:
                raise Refused(code, data[_HELLO_REPLY.size:].decode("utf-8", "replace"))
            self.sock.settimeout(None)  # calls take as long as their reads
        except BaseException:
            self.sock.close()
            raise
        finally:
            if fd >= 0:
                os.close(fd)  # the mapping keeps the memory
        self.bytes = region_bytes
        self.next_id = 1
        # The region's pages below this were written here first, so the
        # memory is this process's (a page the daemon's read faults in first
        # would be charged to the daemon's memory cgroup).
        self.touched = 0
        self.vector_bytes = 4096  # of the last reply: the guess for the next

    def _touch(self, end):
        end = min(end, self.bytes)
        if end > self.touched:
            self.buffer[self.touched:end:OUT_ALIGN] = bytes(
                len(range(self.touched, end, OUT_ALIGN)))
            self.touched = _round_up(end, OUT_ALIGN)

    def close(self):
        self.sock.close()
        self.buffer.close()

    def call(self, dataset, coords):
        """float32 [N, D] copied out of the region; Refused with the daemon's
        status (and `need` > 0 when the region is too small); OSError when
        the connection broke."""
        n = len(coords)
        out = _round_up(n * COORD_BYTES, OUT_ALIGN)
        if out >= self.bytes:
            raise Refused(8, "the coordinates need a larger region",
                          need=out + OUT_ALIGN)
        self._touch(out + n * self.vector_bytes)
        self.buffer[:n * COORD_BYTES] = coords.tobytes()
        request_id = self.next_id
        self.next_id += 1
        name = dataset.encode()
        self.sock.send(_REQUEST.pack(MAGIC, _OP_VECTORS, request_id, n, 0, out) + name)
        data = self.sock.recv(_MAX_REPLY)
        if not data:
            raise ConnectionResetError("the daemon closed the local query socket")
        if len(data) < _REPLY.size or data[:4] != MAGIC:
            raise Refused(15, "the daemon's local query reply is malformed")
        _, code, got_id, rows, d_model, need = _REPLY.unpack_from(data)
        if got_id != request_id:
            raise Refused(15, "the daemon's local query reply answers another request")
        if code != 0:
            raise Refused(code, data[_REPLY.size:].decode("utf-8", "replace"), need)
        if rows != n or d_model == 0 or out + n * d_model * 4 > self.bytes:
            raise Refused(15, f"the daemon's local query reply has {rows} x "
                              f"{d_model} vectors for {n} coordinates")
        self.vector_bytes = d_model * 4
        return np.frombuffer(self.buffer, dtype="<f4", count=n * d_model,
                             offset=out).reshape(n, d_model).copy()


class LocalQueries:
    """A pool of connections: each thread calling at once has its own, so
    their calls are in flight together. Thread-safe."""

    def __init__(self, path, timeout):
        self.path = path
        self.timeout = timeout
        self._lock = threading.Lock()
        self._idle = [_Conn(path, FIRST_REGION_BYTES, timeout)]  # raises

    def close(self):
        with self._lock:
            idle, self._idle = self._idle, []
        for c in idle:
            c.close()

    def get_vectors(self, dataset, coords):
        """float32 [N, D]; None when the socket cannot be used for this call
        (the daemon went away, restarted without it, or refuses another
        connection: ask over gRPC). Refused with the daemon's error
        otherwise."""
        with self._lock:
            conn = self._idle.pop() if self._idle else None
        region = FIRST_REGION_BYTES
        replaced = False
        growths = 0
        while True:
            if conn is None:
                try:
                    conn = _Conn(self.path, region, self.timeout)
                except (OSError, Refused):
                    return None
            try:
                got = conn.call(dataset, coords)
            except Refused as e:
                if e.code == 15:  # out of step with the daemon: never reused
                    conn.close()
                    raise
                if e.need and growths < 2 and conn.bytes < e.need <= conn.max_region_bytes:
                    # A larger region, for the coordinates or the vectors.
                    growths += 1
                    region = max(e.need, 2 * conn.bytes)
                    conn.close()
                    conn = None
                    continue
                with self._lock:
                    self._idle.append(conn)
                raise
            except OSError:  # the connection broke: one new try
                conn.close()
                conn = None
                if replaced:
                    return None
                replaced = True
                continue
            with self._lock:
                self._idle.append(conn)
            return got
