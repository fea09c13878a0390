"""The client's half of the local query socket (docs/local-clients.md, "Local queries").

A client on the daemon's node asks get_vectors on ``<unix socket path>.query``
(SOCK_SEQPACKET) instead of gRPC: each connection hands the daemon a memfd
region of its own (sealed against shrinking) with its first message; a call
writes the coordinates into the region, sends one small request, and reads
the vectors the daemon put there. The messages are fixed little-endian
layouts (common/local/query_protocol.h), the same as the C++ library speaks.

Single vectors are read here (direct reads, as the C++ library does): the
daemon hands over a dataset's layout (common/local/vector_layout.h) and read-only
descriptors of its files, and this process reads each vector with pread:
one wake-up per read instead of the daemon's and then this thread's.
"""

import bisect
import fcntl
import mmap
import os
import resource
import socket
import struct
import threading
import time

import numpy as np

from shardcast._shm import unix_socket_path

MAGIC = b"SCQ1"
SOCKET_SUFFIX = ".query"
OUT_ALIGN = 4096
COORD_BYTES = 24
_HELLO = struct.Struct("<4sIQ")  # magic, version, region_bytes
_HELLO_REPLY = struct.Struct("<4sIQ")  # magic, code, max_region_bytes
_REQUEST = struct.Struct("<4sIQQQQQ")  # magic, op, id, count, coords, out, serial
_REPLY = struct.Struct("<4sIQQQQQ")  # magic, code, id, rows, d_model, need, serial
_OP_VECTORS = 1
_OP_LAYOUT = 2
_OP_OPEN_FILES = 3
_MAX_FILES_PER_OPEN = 16
_ABORTED = 10
_UNIMPLEMENTED = 12
# magic, n_examples, tokens, d_model, layer_file_stride, example_stride,
# layer_stride, token_stride, then the sizes of the three tables
_LAYOUT = struct.Struct("<4sqqqqQQQQQQ")
_LAYOUT_SECONDS = 1.0  # a layout is asked for again after this long


def _max_open_files():
    """Dataset files kept open, all datasets together: a quarter of the
    descriptor limit, at most 256 (past it, the daemon reads the vectors of
    files not open yet)."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return 256 if soft == resource.RLIM_INFINITY else min(256, soft // 4)


_MAX_OPEN_FILES = _max_open_files()
_MAX_REPLY = 16 * 1024
# The longest dataset name a request carries (kMaxDatasetBytes).
_MAX_DATASET = 1024
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

    def request(self, op, dataset, count=0, out=0, serial=0, with_fds=False):
        """Sends one request: the reply's (code, rows, d_model, need, serial,
        message), and the descriptors it carried (with_fds: an open-files
        reply's). OSError when the connection broke; Refused(15) for a reply
        that does not answer the request."""
        request_id = self.next_id
        self.next_id += 1
        self.sock.send(_REQUEST.pack(MAGIC, op, request_id, count, 0, out, serial) +
                       dataset.encode())
        files = []
        if with_fds:
            data, fds, _, _ = socket.recv_fds(self.sock, _MAX_REPLY, _MAX_FILES_PER_OPEN)
            files = [_File(fd) for fd in fds]
            for f in files:  # recv_fds does not set close-on-exec
                os.set_inheritable(f.fd, False)
        else:
            data = self.sock.recv(_MAX_REPLY)
        if not data:
            raise ConnectionResetError("the daemon closed the local query socket")
        if len(data) < _REPLY.size or data[:4] != MAGIC:
            raise Refused(15, "the daemon's local query reply is malformed")
        _, code, got_id, rows, d_model, need, got_serial = _REPLY.unpack_from(data)
        if got_id != request_id:
            raise Refused(15, "the daemon's local query reply answers another request")
        message = data[_REPLY.size:].decode("utf-8", "replace")
        return (code, rows, d_model, need, got_serial, message), files

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
        (code, rows, d_model, need, _, message), _ = self.request(
            _OP_VECTORS, dataset, count=n, out=out)
        if code != 0:
            raise Refused(code, message, need)
        if rows != n or d_model == 0 or out + n * d_model * 4 > self.bytes:
            raise Refused(15, f"the daemon's local query reply has {rows} x "
                              f"{d_model} vectors for {n} coordinates")
        self.vector_bytes = d_model * 4
        return np.frombuffer(self.buffer, dtype="<f4", count=n * d_model,
                             offset=out).reshape(n, d_model).copy()


class _Layout:
    """Where a dataset's vectors lie (common/local/vector_layout.h, Find)."""

    def __init__(self, data):
        if len(data) < _LAYOUT.size or data[:4] != b"SCL1":
            raise ValueError("not a vector layout")
        (_, self.n, self.tokens, self.d_model, self.layer_file_stride,
         self.example_stride, self.layer_stride, self.token_stride,
         n_layers, n_shards, n_files) = _LAYOUT.unpack_from(data)
        if len(data) != _LAYOUT.size + 8 * (n_layers + n_shards + n_files):
            raise ValueError("a vector layout of the wrong size")
        tables = np.frombuffer(data, dtype="<i8", offset=_LAYOUT.size)
        self.layers = [int(v) for v in tables[:n_layers]]
        self.first = [int(v) for v in tables[n_layers:n_layers + n_shards]]
        self.base = [int(v) & 0xFFFFFFFFFFFFFFFF for v in tables[n_layers + n_shards:]]

    def find(self, example, layer, token):
        """(file, offset), or None where the daemon would refuse it."""
        if layer not in self.layers or not 0 <= example < self.n or \
                not 0 <= token < self.tokens:
            return None
        li = self.layers.index(layer)
        s = bisect.bisect_right(self.first, example) - 1
        f = s + li * self.layer_file_stride
        if s < 0 or not 0 <= f < len(self.base):
            return None
        return f, (self.base[f] + (example - self.first[s]) * self.example_stride +
                   li * self.layer_stride + token * self.token_stride)


class _File:
    """A descriptor the daemon handed over; closed when the last read using
    it lets it go."""

    def __init__(self, fd):
        self.fd = fd

    def __del__(self):
        os.close(self.fd)


class _Direct:
    """One dataset's layout as the daemon gave it at `fetched`, and the
    files opened so far."""

    def __init__(self, fetched, serial=0, layout=None):
        self.fetched = fetched
        self.serial = serial
        self.layout = layout  # None: the daemon reads this dataset's vectors
        self.files = {}


class LocalQueries:
    """A pool of connections: each thread calling at once has its own, so
    their calls are in flight together. Thread-safe."""

    def __init__(self, path, timeout, direct_reads=True):
        self.path = path
        self.timeout = timeout
        self.direct_reads = direct_reads
        self._lock = threading.Lock()
        self._idle = [_Conn(path, FIRST_REGION_BYTES, timeout)]  # raises
        self._direct = {}  # dataset -> _Direct
        self._refreshing = set()  # datasets whose layout a thread asks for
        self._unimplemented = False  # a daemon from before direct reads

    def _take(self):
        with self._lock:
            if self._idle:
                return self._idle.pop()
        return _Conn(self.path, FIRST_REGION_BYTES, self.timeout)

    def _give(self, conn):
        with self._lock:
            self._idle.append(conn)

    def _ask(self, op, dataset, files=(), serial=0):
        """A request that reads nothing on a pooled connection, with `files`
        (indices) in its region: (code, serial, descriptors, the layout's
        bytes when asked for one); None when the socket failed."""
        conn = None
        try:
            conn = self._take()
            if files:
                conn._touch(8 * len(files))
                conn.buffer[:8 * len(files)] = np.array(files, "<i8").tobytes()
            (code, rows, _, _, serial, _), fds = conn.request(
                op, dataset, count=len(files), serial=serial, with_fds=True)
        except (OSError, Refused):
            if conn is not None:
                conn.close()
            return None
        data = bytes(conn.buffer[:rows]) if op == _OP_LAYOUT and code == 0 and \
            rows <= conn.bytes else b""
        self._give(conn)
        return code, serial, fds, data

    def _layout(self, dataset):
        """The dataset's _Direct, asked for when older than a second."""
        now = time.monotonic()
        with self._lock:
            d = self._direct.get(dataset)
            if d is not None and now - d.fetched < _LAYOUT_SECONDS:
                return d
            if self._unimplemented or dataset in self._refreshing:
                # Another thread is asking: the daemon reads meanwhile.
                return _Direct(now)
            self._refreshing.add(dataset)
        try:
            return self._refresh(dataset, now, d)
        finally:
            with self._lock:
                self._refreshing.discard(dataset)

    def _refresh(self, dataset, now, d):
        """Asks for the layout; `d` is the previous one (or None)."""
        fresh = _Direct(now)
        asked = self._ask(_OP_LAYOUT, dataset)
        if asked is not None and asked[0] == _UNIMPLEMENTED:
            self._unimplemented = True
        if asked is not None and asked[0] == 0:
            try:
                fresh = _Direct(now, asked[1], _Layout(asked[3]))
            except ValueError:
                pass  # the daemon reads this dataset's vectors
        if d is not None and d.layout is not None and d.serial == fresh.serial:
            fresh.files = d.files  # the same files: keep those open
        with self._lock:
            if len(self._direct) >= 64:
                self._direct.clear()
            self._direct[dataset] = fresh
        return fresh

    def _read_direct(self, dataset, coords):
        """float32 [N, D] read here, or None (the daemon reads them, and says
        what is wrong)."""
        d = self._layout(dataset)
        if d.layout is None:
            return None
        places = [d.layout.find(int(e), int(l), int(t)) for e, l, t in coords]
        if None in places:
            return None
        files = {f: d.files.get(f) for f, _ in places}
        missing = [f for f, h in files.items() if h is None]
        if missing:
            with self._lock:
                held = sum(len(x.files) for x in self._direct.values())
            if len(missing) > _MAX_FILES_PER_OPEN or \
                    held + len(missing) > _MAX_OPEN_FILES:
                return None
            asked = self._ask(_OP_OPEN_FILES, dataset, missing, d.serial)
            if asked is None:
                return None
            code, _, got, _ = asked
            if code != 0 or len(got) != len(missing):
                if code == _ABORTED:  # the dataset changed: a new layout
                    with self._lock:
                        self._direct.pop(dataset, None)
                return None
            for f, h in zip(missing, got):
                d.files[f] = files[f] = h
        D = d.layout.d_model
        out = np.empty((len(places), D), dtype="<f4")
        rows = memoryview(out).cast("B")
        try:
            for i, (f, offset) in enumerate(places):
                if os.preadv(files[f].fd, [rows[i * 4 * D:(i + 1) * 4 * D]],
                             offset) != 4 * D:
                    return None
        except OSError:  # the daemon reads them, and says what is wrong
            with self._lock:
                self._direct.pop(dataset, None)
            return None
        return out

    def close(self):
        with self._lock:
            idle, self._idle = self._idle, []
            self._direct = {}  # their files close with the last read using them
        for c in idle:
            c.close()

    def get_vectors(self, dataset, coords):
        """float32 [N, D]; None when the socket cannot be used for this call
        (the daemon went away, restarted without it, or refuses another
        connection: ask over gRPC). Refused with the daemon's error
        otherwise."""
        if len(dataset.encode()) > _MAX_DATASET:
            return None  # no dataset is named so; gRPC says NOT_FOUND
        if self.direct_reads and len(coords) == 1:
            got = self._read_direct(dataset, coords)
            if got is not None:
                return got
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
