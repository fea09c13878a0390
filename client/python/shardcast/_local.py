"""The client's end of the daemon's local channel (docs/local-clients.md).

One Unix socket beside the gRPC one, ``<unix socket path>.local``
(SOCK_SEQPACKET): every packet is one protobuf message of
proto/shardcast/v1/local.proto (``shardcast.v1.local_pb2``, generated), its
descriptors as SCM_RIGHTS counted by the message's ``descriptors``; the
C++ library speaks the same (common/local/channel.h). The daemon makes every
shared memory region and hands its memfd over:

- a batch region (BatchRegion): slots a SharedStream writes batches into;
- a query region (LocalQueries): get_vectors writes the coordinates into it
  and sends one small request, and the daemon reads the vectors into it;
- datasets by path (attach): this process opens a dataset directory's files
  with its own credentials and hands the descriptors over.

Single vectors are read here (direct reads, as the C++ library does): the
daemon hands over a dataset's layout (common/local/vector_layout.h) and
read-only descriptors of its files, and this process reads each vector with
pread: one wake-up per read instead of the daemon's and then this thread's.
"""

import bisect
import errno
import mmap
import os
import re
import resource
import socket
import struct
import threading
import time

import numpy as np

from shardcast.v1 import local_pb2

SOCKET_SUFFIX = ".local"
OUT_ALIGN = 4096
COORD_BYTES = 24
_MAX_FILES_PER_OPEN = 16
_MAX_DESCRIPTORS = 64
ABORTED = 10
UNIMPLEMENTED = 12
DATA_LOSS = 15
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
# The longest packet either side sends (kMaxMessageBytes).
_MAX_MESSAGE = 16 * 1024
# The first region: 256 vectors of d_model 1024 and their coordinates (its
# pages are only touched as calls use them).
FIRST_REGION_BYTES = (1 << 20) + 2 * OUT_ALIGN


def unix_socket_path(address):
    """The path of gRPC `address` when it is a Unix socket ("unix:/path" or
    "unix:///path"), or None."""
    if not address.startswith("unix:"):
        return None
    path = address[len("unix:"):]
    if path.startswith("//"):
        path = path[2:]
    return path or None


def socket_path(address):
    """The local channel of a daemon at gRPC `address`, or None."""
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


class _File:
    """A descriptor the daemon handed over; closed when the last user of it
    lets it go."""

    def __init__(self, fd):
        self.fd = fd

    def __del__(self):
        os.close(self.fd)


class Connection:
    """One connection to the channel: one request at a time."""

    def __init__(self, path, timeout=None):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.sock.settimeout(timeout)
            self.sock.connect(path)
        except BaseException:
            self.sock.close()
            raise
        self.path = path
        self._next_id = 1  # never 0: an empty packet reads as a close

    def close(self):
        self.sock.close()

    def ask(self, request, timeout=None, fds=()):
        """Sends `request` (a LocalRequest; its id is set here) with `fds`
        and returns (reply, files): the LocalReply that answers it and the
        descriptors it carried, as _File. OSError when the connection broke
        or no reply came within `timeout` seconds; Refused(DATA_LOSS) for a
        reply that does not answer the request."""
        request.id = self._next_id
        self._next_id += 1
        request.descriptors = len(fds)
        self.sock.settimeout(timeout)
        try:
            if fds:
                socket.send_fds(self.sock, [request.SerializeToString()], list(fds))
            else:
                self.sock.send(request.SerializeToString())
        except (BrokenPipeError, ConnectionResetError):
            pass  # refused at once (not allowed, busy): the reply says why
        data, fds, flags, _ = socket.recv_fds(self.sock, _MAX_MESSAGE + 1,
                                              _MAX_DESCRIPTORS)
        files = [_File(fd) for fd in fds]
        for f in files:  # recv_fds does not set close-on-exec
            os.set_inheritable(f.fd, False)
        if not data and not files:
            raise ConnectionResetError(f"the daemon closed {self.path}")
        reply = local_pb2.LocalReply()
        try:
            if len(data) > _MAX_MESSAGE or flags & socket.MSG_CTRUNC:
                raise ValueError("too long")
            reply.ParseFromString(data)
        except Exception:  # DecodeError, or the length above
            raise Refused(DATA_LOSS, f"{self.path} answered something that "
                                      "is not a local channel reply") from None
        if reply.descriptors != len(files) or reply.id != request.id:
            raise Refused(DATA_LOSS, "the daemon's local channel reply does "
                                      "not answer the request")
        return reply, files


# The files of a dataset directory the daemon reads (common/format/dataset.h,
# the shard protocol): what attach opens and hands over.
_DATASET_FILE = re.compile(r"^(metadata\.json|shards\.json|labels\.bin|SHA256SUMS|"
                           r"samples\.json|shardcast_stats\.json|acts[^/]*\.bin)$")


def attach(socket_path, path, timeout=None):
    """Hands the daemon the dataset in directory `path`, opened here with
    this process's credentials (LocalRequest.Attach), and returns its id.
    OSError when `path` cannot be opened as a directory (as open(2) says);
    Refused with the daemon's code and message when it does not serve it."""
    display = os.fsencode(os.fspath(path))
    dir_fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        names = sorted(n for n in os.listdir(dir_fd) if _DATASET_FILE.match(n))
        dir_name = os.path.basename(os.path.realpath(path)) or "/"
        conn = Connection(socket_path, timeout)
        try:
            # A part at a time: never more than one message's descriptors
            # open here (a dataset may have thousands of shards).
            parts = [names[i:i + _MAX_DESCRIPTORS]
                     for i in range(0, len(names), _MAX_DESCRIPTORS)] or [[]]
            for k, part in enumerate(parts):
                req = local_pb2.LocalRequest()
                a = req.attach
                if k == 0:
                    a.path = display
                    a.dir_name = os.fsencode(dir_name)
                a.more = k + 1 < len(parts)
                fds = []
                try:
                    for name in part:
                        try:
                            fds.append(os.open(name, os.O_RDONLY | os.O_NONBLOCK |
                                               os.O_NOCTTY | os.O_CLOEXEC,
                                               dir_fd=dir_fd))
                            err = 0
                        except OSError as e:
                            err = e.errno or errno.EIO
                        a.names.append(os.fsencode(name))
                        a.errors.append(err)
                    reply, _ = conn.ask(req, timeout, fds)
                finally:
                    for fd in fds:
                        os.close(fd)
                if reply.code != 0:
                    raise Refused(reply.code, reply.message)
            return reply.attach.dataset.decode("utf-8", "replace")
        finally:
            conn.close()
    finally:
        os.close(dir_fd)


class BatchRegion:
    """A region of `slots` slots of `slot_bytes` for a SharedStream, mapped
    here (`buffer`).

    The connection that asked for it stays open until close(), which keeps
    the region attachable by a SharedStream; the daemon frees its side once
    the connection is closed and no stream uses it. The mapping stays valid
    as long as any array views it. Refused with the daemon's status
    (UNIMPLEMENTED: its shared memory is off); OSError when the channel
    cannot be reached.
    """

    def __init__(self, path, slots, slot_bytes):
        self._conn = Connection(path)
        try:
            request = local_pb2.LocalRequest()
            request.batch_region.slots = slots
            request.batch_region.slot_bytes = slot_bytes
            reply, files = self._conn.ask(request)
            if reply.code != 0:
                raise Refused(reply.code, "shared memory: " + reply.message)
            got = reply.batch_region
            if (len(files) != 1 or got.slots != slots or
                    got.slot_bytes < slot_bytes or
                    got.region_bytes != got.slots * got.slot_bytes or
                    not got.token or
                    os.fstat(files[0].fd).st_size < got.region_bytes):
                raise Refused(DATA_LOSS, f"{path} handed over a region that "
                                          "does not match its reply")
            self.buffer = mmap.mmap(files[0].fd, got.region_bytes,
                                    flags=mmap.MAP_SHARED,
                                    prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            self._conn.close()
            raise
        self.slots = got.slots
        self.slot_bytes = got.slot_bytes
        self.token = got.token

    def close(self):
        """Lets the daemon free the region once no stream uses it."""
        self._conn.close()


class _Conn:
    """One connection and its query region, mapped read-write here."""

    def __init__(self, path, region_bytes, timeout):
        self.channel = Connection(path, timeout)
        self.timeout = timeout
        self.buffer = None
        try:
            self.grow(region_bytes)
        except BaseException:
            self.channel.close()
            raise

    def grow(self, region_bytes):
        """A query region of at least `region_bytes` from the daemon, in
        place of the old one. Refused with the daemon's status; OSError."""
        request = local_pb2.LocalRequest()
        request.query_region.bytes = _round_up(region_bytes, OUT_ALIGN)
        reply, files = self.channel.ask(request, self.timeout)
        if reply.code != 0:
            raise Refused(reply.code, reply.message)
        got = reply.query_region.bytes
        if len(files) != 1 or got < region_bytes:
            raise Refused(DATA_LOSS, "the daemon's query region does not "
                                      "match its reply")
        buffer = mmap.mmap(files[0].fd, got, flags=mmap.MAP_SHARED,
                           prot=mmap.PROT_READ | mmap.PROT_WRITE)
        if self.buffer is not None:
            self.buffer.close()
        self.buffer = buffer
        self.bytes = got
        self.max_region_bytes = reply.query_region.max_region_bytes
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
        self.channel.close()
        if self.buffer is not None:
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
        request = local_pb2.LocalRequest()
        request.vectors.dataset = dataset.encode()
        request.vectors.count = n
        request.vectors.coords_offset = 0
        request.vectors.out_offset = out
        reply, _ = self.channel.ask(request)
        if reply.code != 0:
            raise Refused(reply.code, reply.message, reply.need_region_bytes)
        rows, d_model = reply.vectors.rows, reply.vectors.d_model
        if rows != n or d_model == 0 or out + n * d_model * 4 > self.bytes:
            raise Refused(DATA_LOSS, f"the daemon's local query reply has "
                                      f"{rows} x {d_model} vectors for {n} "
                                      "coordinates")
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

    def _ask(self, request):
        """A request that reads nothing, on a pooled connection: (reply,
        files, the layout's bytes when it asked for one); None when the
        channel failed."""
        conn = None
        try:
            conn = self._take()
            reply, files = conn.channel.ask(request)
        except (OSError, Refused):
            if conn is not None:
                conn.close()
            return None
        size = reply.layout.bytes
        data = bytes(conn.buffer[:size]) if request.HasField("layout") and \
            reply.code == 0 and size <= conn.bytes else b""
        self._give(conn)
        return reply, files, data

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
        request = local_pb2.LocalRequest()
        request.layout.dataset = dataset.encode()
        asked = self._ask(request)
        if asked is not None and asked[0].code == UNIMPLEMENTED:
            self._unimplemented = True
        if asked is not None and asked[0].code == 0:
            try:
                fresh = _Direct(now, asked[0].layout.serial, _Layout(asked[2]))
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
            request = local_pb2.LocalRequest()
            request.open_files.dataset = dataset.encode()
            request.open_files.serial = d.serial
            request.open_files.files.extend(missing)
            asked = self._ask(request)
            if asked is None:
                return None
            code, got = asked[0].code, asked[1]
            if code != 0 or len(got) != len(missing):
                if code == ABORTED:  # the dataset changed: a new layout
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
        if len(dataset.encode()) > _MAX_MESSAGE // 2:
            return None  # no dataset is named so; gRPC says NOT_FOUND
        if self.direct_reads and len(coords) == 1:
            got = self._read_direct(dataset, coords)
            if got is not None:
                return got
        with self._lock:
            conn = self._idle.pop() if self._idle else None
        replaced = False
        growths = 0
        while True:
            if conn is None:
                try:
                    conn = _Conn(self.path, FIRST_REGION_BYTES, self.timeout)
                except (OSError, Refused):
                    return None
            try:
                got = conn.call(dataset, coords)
            except Refused as e:
                if e.code == DATA_LOSS:  # out of step with the daemon: never reused
                    conn.close()
                    raise
                if e.need and growths < 2 and conn.bytes < e.need <= conn.max_region_bytes:
                    # A larger region on the same connection, for the
                    # coordinates or the vectors.
                    growths += 1
                    try:
                        conn.grow(min(conn.max_region_bytes,
                                      max(e.need, 2 * conn.bytes)))
                    except (OSError, Refused):
                        conn.close()
                        return None
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
