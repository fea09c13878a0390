"""The client's half of the shared-memory path (docs/local-clients.md, "Shared memory").

A local client connects to the daemon's shared-memory socket (``<unix socket
path>.shm``, SOCK_SEQPACKET), asks for a region of batch slots and receives it
as a sealed memfd over SCM_RIGHTS, with a token its SharedStream call presents.
The messages are fixed little-endian layouts (common/local/shm_protocol.h).
"""

import mmap
import os
import socket
import struct

MAGIC = b"SCM1"
SOCKET_SUFFIX = ".shm"
_REQUEST = struct.Struct("<4sIQ")  # magic, slots, slot_bytes
_REPLY = struct.Struct("<4sIIIQQ16s")  # magic, code, slots, pad, slot, region, token


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
    """The shared-memory socket of a daemon at gRPC `address`, or None."""
    path = unix_socket_path(address)
    return path + SOCKET_SUFFIX if path else None


class RegionRefused(Exception):
    """The daemon refused the region: `code` is a gRPC status code number."""

    def __init__(self, code, message):
        super().__init__(message)
        self.code = code
        self.message = message


class Region:
    """A region of `slots` slots of `slot_bytes`, mapped read-write here.

    The connection that asked for it stays open until close(), which keeps the
    region attachable by a SharedStream; the daemon frees its side once the
    connection is closed and no stream uses it. The mapping (`buffer`) stays
    valid as long as any array views it.
    """

    def __init__(self, path, slots, slot_bytes):
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._sock.connect(path)
            try:
                self._sock.sendall(_REQUEST.pack(MAGIC, slots, slot_bytes))
            except (BrokenPipeError, ConnectionResetError):
                pass  # refused at once (not allowed, busy): the reply says why
            data, ancdata, _, _ = self._sock.recvmsg(
                4096, socket.CMSG_SPACE(struct.calcsize("i")))
            fds = []
            for level, kind, payload in ancdata:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    n = len(payload) // struct.calcsize("i")
                    fds.extend(struct.unpack(f"{n}i", payload[:n * 4]))
            try:
                if len(data) < _REPLY.size or data[:4] != MAGIC:
                    raise RegionRefused(15, f"{path} answered something that "
                                            "is not a region reply")
                (_, code, got_slots, _, got_slot_bytes, region_bytes,
                 token) = _REPLY.unpack(data[:_REPLY.size])
                if code != 0:
                    raise RegionRefused(code, "shared memory: " +
                                        data[_REPLY.size:].decode("utf-8", "replace"))
                if (not fds or got_slots != slots or got_slot_bytes < slot_bytes or
                        region_bytes != got_slots * got_slot_bytes or
                        os.fstat(fds[0]).st_size < region_bytes):
                    raise RegionRefused(15, f"{path} handed over a region that "
                                            "does not match its reply")
                self.buffer = mmap.mmap(fds[0], region_bytes, flags=mmap.MAP_SHARED,
                                        prot=mmap.PROT_READ | mmap.PROT_WRITE)
            finally:
                for fd in fds:
                    os.close(fd)
        except BaseException:
            self._sock.close()
            raise
        self.slots = got_slots
        self.slot_bytes = got_slot_bytes
        self.token = token

    def close(self):
        """Lets the daemon free the region once no stream uses it."""
        self._sock.close()
