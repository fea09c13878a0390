"""The client: a connection to one shardcastd, in pure Python over grpcio.

Why pure Python (docs/python.md): the payload never passes through
Python. On a Unix socket the daemon writes each batch's vectors straight into
a shared-memory slot this process maps, and a batch is a numpy view of that
slot; only a small protobuf message (the batch's columns and the slot number)
crosses gRPC. Over TCP the vectors arrive in the message and are viewed in
place (one copy, by protobuf's parser). A compiled extension would save
nothing per byte and would have to be built for every Python a cluster runs.
"""

import atexit
import json
import logging
import math
import os
import queue
import types
import weakref

import grpc
import numpy as np

from shardcast import _daemon
from shardcast import _local
from shardcast import _session
from shardcast.v1 import shardcast_pb2 as pb
from shardcast.v1 import shardcast_pb2_grpc as pb_grpc

_MAX_MESSAGE = 80 << 20  # the daemon's: > 64 MiB payload + header

# grpcio's core does not survive fork() once it has opened a channel: a
# forked child (a DataLoader worker under the default start method) then
# hangs or aborts inside grpc. Remember which process opened channels, so a
# forked child gets a clear error instead.
_IMPORT_PID = os.getpid()
_channel_opened = False
_TOKENS = {"content": pb.TOKENS_CONTENT, "special": pb.TOKENS_SPECIAL,
           "all": pb.TOKENS_ALL}
_ORDERS = {"shuffled": pb.ORDER_SHUFFLED, "ordered": pb.ORDER_ORDERED}
_DTYPES = {"float32": pb.DTYPE_FLOAT32, "bfloat16": pb.DTYPE_BFLOAT16,
           "float16": pb.DTYPE_FLOAT16}
# wire code -> (name, numpy dtype of Batch.vectors, bytes per element)
_DTYPES_BY_CODE = {pb.DTYPE_FLOAT32: ("float32", np.dtype("<f4"), 4),
                   pb.DTYPE_BFLOAT16: ("bfloat16", np.dtype("<u2"), 2),
                   pb.DTYPE_FLOAT16: ("float16", np.dtype("<f2"), 2)}


def bfloat16_to_float32(bits):
    """float32 numpy array of the bfloat16 bit patterns `bits` (uint16), as a
    Batch of a dtype="bfloat16" stream holds them (exact: bfloat16 is the
    upper half of float32)."""
    bits = np.asarray(bits, dtype=np.uint16)
    return (bits.astype(np.uint32) << 16).view(np.float32)
ADDRESS_VARIABLE = "SHARDCAST_ADDRESS"

# Remote get_vectors of this many coordinates or more are messages on the
# Client's one VectorsSession call; fewer, unary GetVectors calls. The C++
# client sends every call on its session, but in Python each message of a
# session passes through grpcio's one sending thread and one reader, thread
# hops under the GIL, while a unary call runs in its caller's thread.
# tests/bench/python_query_roads.py, 2 cores, warm, session/unary (median of
# 7 rounds [min-max]): single vectors from 1 thread 1.06x the latency
# [0.76-1.21], from 8 threads 0.83x the rate [0.75-0.95]; 256 per call
# (against StreamVectors) 0.84x the latency [0.80-0.92], 1.23x the rate from
# 8 threads [1.08-1.30]. From 8 threads the session lost up to 48 per call
# and won from 63 (once, 4 rounds), and it lost as much with only one
# caller at a time on it, the others' calls unary (0.85x, once).
SESSION_FROM = 64


class Error(Exception):
    """A failed call: `code` is the gRPC status code's name ("NOT_FOUND",
    "INVALID_ARGUMENT", "RESOURCE_EXHAUSTED", "DATA_LOSS", ...) and `message`
    the daemon's explanation."""

    def __init__(self, code, message):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message

    @classmethod
    def _from_rpc(cls, e):
        code = e.code() if callable(getattr(e, "code", None)) else None
        details = e.details() if callable(getattr(e, "details", None)) else str(e)
        return cls(code.name if code is not None else "UNKNOWN", details or "")


_LOG = logging.getLogger("shardcast")
_SAID = set()


# Clients still open when the interpreter exits are closed first, so that
# gRPC's own shutdown never waits on a channel a script did not close.
_OPEN_CLIENTS = weakref.WeakSet()


@atexit.register
def _close_open_clients():
    for client in list(_OPEN_CLIENTS):
        try:
            client.close()
        except Exception:  # noqa: BLE001 (exiting: nothing to report to)
            pass


def _say_once(topic, message):
    """Logs `message` at info level, once per process and topic."""
    if topic not in _SAID:
        _SAID.add(topic)
        _LOG.info(message)


def _describe_refusal(e):
    if isinstance(e, _local.Refused):
        return f"{_code_name(e.code)}: {e.message}"
    return f"{type(e).__name__}: {e}"


def _repeated(field):
    """Whether a field is repeated: protobuf 7 has `is_repeated` and no
    longer `label`; 3.21 has only `label`."""
    if hasattr(field, "is_repeated"):
        return field.is_repeated
    return field.label == field.LABEL_REPEATED


def _record(message):
    """A protobuf message as a plain object with the same field names."""
    out = {}
    for field in message.DESCRIPTOR.fields:
        value = getattr(message, field.name)
        if field.message_type is not None:
            if _repeated(field):
                value = [_record(v) for v in value]
            else:
                value = _record(value)
        elif _repeated(field):
            value = list(value)
        out[field.name] = value
    return types.SimpleNamespace(**out)


def _code_name(code):
    """The name of gRPC status code number `code` ("UNKNOWN" if none)."""
    for c in grpc.StatusCode:
        if c.value[0] == code:
            return c.name
    return "UNKNOWN"


def _call(fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except grpc.RpcError as e:
        raise Error._from_rpc(e) from None


class Batch:
    """One batch of a stream.

    `vectors` is a numpy array [rows, d_model]: on the shared-memory
    path a view of the daemon's slot, valid until the next batch is requested
    from the stream (use ``copy=True`` on the stream, or ``vectors.copy()``,
    to keep it longer); over gRPC a view of the received message. Its numpy
    dtype follows the stream's `dtype`: float32, float16, or for "bfloat16"
    (which numpy lacks) uint16 holding the bfloat16 bit patterns
    (``shardcast.torch`` hands out torch.bfloat16 tensors; ``bfloat16_to_float32``
    widens them in numpy). `dtype` names the element type and `transform`
    what the daemon applied ("float32", "scale_norm, bfloat16 (...)").
    `example_idx` (int64), `token_idx` (int32, -1 for CLS), `layer` (int64,
    when all layers are streamed, else None) and `labels` (uint8, 255 for CLS,
    None without labels.bin) have one entry per row. `resume_token` reopens
    the stream right after this batch.
    """

    __slots__ = ("vectors", "example_idx", "token_idx", "layer", "labels",
                 "epoch", "index", "rows", "resume_token", "slot", "dtype",
                 "transform")

    def __repr__(self):
        return (f"Batch(epoch={self.epoch}, index={self.index}, rows={self.rows}, "
                f"d_model={self.vectors.shape[1] if self.vectors.ndim == 2 else 0})")


class Stream:
    """An iterator of Batch objects; see Client.stream. Use it as a context
    manager, or call close(), to end it early (the daemon frees its slots)."""

    def __init__(self, client, request, shared_memory, slots, copy):
        self._copy = copy
        self._region = None
        self._requests = None
        self._held = None  # the slot the last batch views
        self._done = False
        self.resume_token = request.resume_token
        self.shared_memory = False
        path = _local.socket_path(client.address) if shared_memory else None
        slot_bytes = 0
        if path is not None and os.path.exists(path) and request.batch_size > 0:
            slot_bytes = (request.batch_size * client.describe(request.dataset).d_model *
                          _DTYPES_BY_CODE.get(request.dtype, ("", None, 4))[2])
        # A slot size no region can have: the daemon's answer to the request
        # (INVALID_ARGUMENT, with the limit) comes through the message path.
        if 0 < slot_bytes < 1 << 63:
            try:
                self._region = _local.BatchRegion(path, slots, slot_bytes)
            except (_local.Refused, OSError) as e:
                # Shared memory refused (off, a per-user cap, the channel
                # busy) or the connection reset: the batches come in gRPC
                # messages instead, said once; a request the daemon refuses
                # altogether is refused there too, with its reason.
                if not (isinstance(e, _local.Refused) and e.code == _local.UNIMPLEMENTED):
                    _say_once("shared memory", "shardcast: shared memory is not available "
                              f"({_describe_refusal(e)}); this process's streams get their "
                              "batches in gRPC messages")
        if self._region is not None:
            self.shared_memory = True
            self._requests = queue.SimpleQueue()
            self._requests.put(pb.SharedStreamMessage(request=request,
                                                      region=self._region.token))
            # The request iterator holds the queue, not the Stream: gRPC
            # keeps it until the call ends, and through it the Stream would
            # stay alive too, so that one dropped unfinished (a trainer that
            # breaks out of its loop) was never closed and kept its call,
            # region and slots in the daemon until the process exited.
            self._call = client._stream.SharedStream(_outgoing(self._requests))
        else:
            self._call = client._stream.Stream(request)

    def _release(self):
        if self._held is not None:
            self._requests.put(pb.SharedStreamMessage(release=[self._held]))
            self._held = None

    def __iter__(self):
        return self

    def __next__(self):
        if self._done:
            raise StopIteration
        self._release()
        try:
            m = next(self._call)
        except StopIteration:
            self._end()
            raise
        except grpc.RpcError as e:
            self._end()
            raise Error._from_rpc(e) from None
        b = Batch()
        b.epoch, b.index, b.rows = m.epoch, m.index, m.rows
        b.resume_token = self.resume_token = m.resume_token
        rows, d = m.rows, m.d_model
        b.example_idx = np.frombuffer(m.example_idx, dtype="<i8")
        b.token_idx = np.frombuffer(m.token_idx, dtype="<i4")
        b.layer = np.frombuffer(m.layer, dtype="<i8") if m.layer else None
        b.labels = np.frombuffer(m.labels, dtype=np.uint8) if m.labels else None
        b.slot = None
        if m.dtype not in _DTYPES_BY_CODE:
            self.close()
            raise Error("DATA_LOSS", f"batch {m.epoch}/{m.index} has unknown dtype {m.dtype}")
        b.dtype, np_dtype, size = _DTYPES_BY_CODE[m.dtype]
        b.transform = m.transform or "float32"
        if self._region is not None:
            if (not m.HasField("slot") or m.slot >= self._region.slots or
                    rows * d * size > self._region.slot_bytes or m.vectors):
                self.close()
                raise Error("DATA_LOSS", f"batch {m.epoch}/{m.index} names slot "
                            f"{m.slot} of {self._region.slots} for {rows} x {d} "
                            "floats: not a valid slot")
            vectors = np.frombuffer(self._region.buffer, dtype=np_dtype,
                                    count=rows * d,
                                    offset=m.slot * self._region.slot_bytes)
            if self._copy:
                vectors = vectors.copy()
                self._requests.put(pb.SharedStreamMessage(release=[m.slot]))
            else:
                self._held = b.slot = m.slot
        else:
            vectors = np.frombuffer(m.vectors, dtype=np_dtype)
            if self._copy:
                vectors = vectors.copy()
        if vectors.size != rows * d or b.example_idx.size != rows:
            self.close()
            raise Error("DATA_LOSS", f"batch {m.epoch}/{m.index} is malformed: "
                        f"{rows} rows of {d} floats, {vectors.size} floats, "
                        f"{b.example_idx.size} example indices")
        b.vectors = vectors.reshape(rows, d)
        return b

    def _end(self):
        self._done = True
        if self._requests is not None:
            self._requests.put(None)
        if self._region is not None:
            self._region.close()

    def cancel(self):
        """Asks the daemon to stop; iteration then raises Error("CANCELLED")."""
        self._call.cancel()

    def close(self):
        """Ends the stream now (cancelling it if it is still running)."""
        if not self._done:
            self._call.cancel()
            self._end()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown
            pass


def _outgoing(requests):
    """A shared-memory stream's messages to the daemon, until None."""
    while True:
        message = requests.get()
        if message is None:
            return
        yield message


class Client:
    """A connection to one shardcastd.

    `address` is "unix:/path/to.sock" or "host:port". Without one: the
    SHARDCAST_ADDRESS environment variable, else the node's daemon at
    /run/shardcast/shardcastd.sock, else the user's own daemon, started now
    when it is not running (shardcast._daemon: no setup, exits when idle).
    `tls_ca` (PEM file) turns on TLS
    for TCP; `tls_cert`/`tls_key` add a client certificate (mutual TLS).
    On a Unix socket, streams get their batches in shared memory unless
    `shared_memory=False`; `slots` is how many batches the daemon may have
    ready for one stream (2 to 16); get_vectors goes through the daemon's
    local channel (no gRPC: docs/local-clients.md, "Local queries") unless
    `local_queries=False` or the daemon has none; there a single vector is
    read by this process itself, with a descriptor of the dataset's file the
    daemon hands over, unless `direct_reads=False` or the daemon offers none.
    Over gRPC, get_vectors of SESSION_FROM coordinates or more are messages
    on one Query.VectorsSession call, opened on first use and again (each
    request retried once) when it breaks; smaller ones are GetVectors calls.
    Every method raises Error on failure.
    Thread-safe (grpcio channels are); a Stream belongs to one thread.
    """

    def __init__(self, address=None, *, tls_ca=None, tls_cert=None, tls_key=None,
                 tls_server_name=None, shared_memory=True, slots=4, timeout=5.0,
                 local_queries=True, direct_reads=True):
        try:
            address = _daemon.resolve(address)
        except _daemon.StartError as e:
            raise Error(e.code, e.message) from None
        global _channel_opened
        if _channel_opened and os.getpid() != _IMPORT_PID and \
                os.environ.get("GRPC_ENABLE_FORK_SUPPORT") not in ("1", "true"):
            raise Error("FAILED_PRECONDITION", (
                "this process was forked from one that had already opened a gRPC "
                "channel, and grpcio does not survive that (it hangs or aborts); "
                "use DataLoader(..., multiprocessing_context='spawn'), or create "
                "the first shardcast.Client only inside the workers"))
        _channel_opened = True
        self.address = address
        self.timeout = timeout
        self._attached = {}  # path -> id (Client._id)
        self.shared_memory = shared_memory
        self.slots = max(2, min(16, int(slots)))
        options = [("grpc.max_receive_message_length", _MAX_MESSAGE),
                   ("grpc.max_send_message_length", _MAX_MESSAGE)]
        if tls_ca and not address.startswith("unix:"):
            def read(path):
                with open(path, "rb") as f:
                    return f.read()
            creds = grpc.ssl_channel_credentials(
                read(tls_ca), read(tls_key) if tls_key else None,
                read(tls_cert) if tls_cert else None)
            if tls_server_name:
                options.append(("grpc.ssl_target_name_override", tls_server_name))
            self._channel = grpc.secure_channel(address, creds, options=options)
        else:
            self._channel = grpc.insecure_channel(address, options=options)
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            self._channel.close()
            private = _daemon.private_log(address)
            raise Error("UNAVAILABLE", f"cannot connect to shardcastd at {address} "
                        f"within {timeout} s " + (f"(see its log {private})" if private else
                                                   "(is it running? right address/TLS?)")
                        ) from None
        _OPEN_CLIENTS.add(self)
        self._admin = pb_grpc.AdminStub(self._channel)
        self._query = pb_grpc.QueryStub(self._channel)
        self._stream = pb_grpc.StreamStub(self._channel)
        # get_vectors over gRPC: one VectorsSession call, opened on first use.
        self._session = _session.Session(self._query.VectorsSession)
        self._local = None  # get_vectors over gRPC
        path = _local.socket_path(address) if local_queries else None
        if path is not None and os.path.exists(path):
            try:
                self._local = _local.LocalQueries(path, timeout, direct_reads)
            except (OSError, _local.Refused):
                pass  # an older daemon, a refusal: gRPC answers the same

    @property
    def local_queries(self):
        """Whether get_vectors uses the local channel."""
        return self._local is not None

    def close(self):
        if self._local is not None:
            self._local.close()
        self._session.close()
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def datasets(self):
        """Every dataset the daemon found, rejected ones too (ok=False, error)."""
        reply = _call(self._admin.ListDatasets, pb.ListDatasetsRequest())
        return [_record(d) for d in reply.datasets]

    def describe(self, dataset):
        """One dataset by id or unique prefix (>= 8 characters), or by its
        directory (attach)."""
        return _record(_call(self._admin.DescribeDataset,
                             pb.DescribeDatasetRequest(dataset=self._id(dataset))))

    def _id(self, dataset):
        """A dataset argument as the daemon's id: a path (an os.PathLike, or
        a string with a '/') is attached once per client, an id is kept."""
        if isinstance(dataset, os.PathLike) or (isinstance(dataset, str) and
                                                 "/" in dataset):
            path = os.fspath(dataset)
            if path not in self._attached:
                self._attached[path] = self.attach(path).id
            return self._attached[path]
        return dataset

    def attach(self, path):
        """The dataset in directory `path`, named by its path: returns its
        record (the fields of describe(); `.id` names it in every other
        call). This process opens the directory's files with its own
        permissions and hands them to the daemon over the local channel
        (docs/local-clients.md, "Datasets by path"): no root to configure,
        and the daemon reads only what this user could open. The same files
        reached by any path are one dataset with one shared scan.

        Error NOT_FOUND / PERMISSION_DENIED / FAILED_PRECONDITION naming
        `path` when it cannot be opened or is not a dataset; needs a daemon
        on this node (a unix: address).
        """
        path = os.fspath(path)
        sock = _local.socket_path(self.address)
        if sock is None:
            raise Error("FAILED_PRECONDITION", f"{path}: datasets are named by path "
                        "only on the daemon's node (a unix: address); name a "
                        "catalog dataset by its id over TCP")
        if not os.path.exists(sock):
            raise Error("UNAVAILABLE", f"{path}: the daemon at {self.address} has "
                        f"no local channel ({sock}), so it takes no datasets by path")
        try:
            dataset = _local.attach(sock, path, self.timeout)
        except _local.Refused as e:
            raise Error(_code_name(e.code), e.message) from None
        except FileNotFoundError:
            raise Error("NOT_FOUND", f"{path}: no such directory") from None
        except NotADirectoryError:
            raise Error("FAILED_PRECONDITION", f"{path}: not a directory") from None
        except PermissionError:
            raise Error("PERMISSION_DENIED", f"{path}: permission denied") from None
        except OSError as e:
            raise Error("UNAVAILABLE", f"attaching {path}: {e}") from None
        return self.describe(dataset)

    def status(self):
        """The daemon's counters, shared scans and shared-memory regions."""
        return _record(_call(self._admin.GetStatus, pb.GetStatusRequest()))

    def get_vectors(self, dataset, coords):
        """float32 [N, D]: the vectors at `coords`, a sequence (or [N, 3]
        array) of (example, layer value, token index on the token axis)."""
        dataset = self._id(dataset)
        coords = np.ascontiguousarray(np.asarray(coords, dtype=np.int64).reshape(-1, 3))
        if self._local is not None:
            try:
                got = self._local.get_vectors(dataset, coords)
            except _local.Refused as e:
                raise Error(_code_name(e.code), e.message) from None
            if got is not None:
                return got
        return self._remote_vectors(dataset, coords)

    def _remote_vectors(self, dataset, coords, road=None):
        """get_vectors over gRPC of `coords` (int64 [N, 3]): on the session
        from SESSION_FROM coordinates, else unary; `road` "session" or
        "unary" forces one (tests/bench/python_query_roads.py)."""
        message = pb.SessionRequest()
        request = message.vectors
        request.dataset = dataset
        add = request.coordinates.add
        for e, l, t in coords.tolist():
            add(example=e, layer=l, token=t)
        n = len(coords)
        if road == "unary" or (road is None and n < SESSION_FROM):
            reply = _call(self._query.GetVectors, request)
        else:
            # One message too large for the channel would end the session
            # (every request on it), not this request alone: refused here, as
            # gRPC refuses a unary call that large.
            if n * 35 + len(dataset) * 4 > _MAX_MESSAGE and \
                    message.ByteSize() > _MAX_MESSAGE:
                raise Error("RESOURCE_EXHAUSTED", "Sent message larger than max "
                            f"({message.ByteSize()} vs. {_MAX_MESSAGE})")
            try:
                reply = self._session.call(message)
            except _session.Broken as e:
                raise Error(e.code, e.message) from None
            if reply.code != 0:
                raise Error(_code_name(reply.code), reply.message)
        if len(reply.shape) != 2 or reply.shape[0] != n:
            raise Error("DATA_LOSS", f"reply of shape {tuple(reply.shape)} for a request "
                        f"of {n} vectors")
        return self._vectors(reply)

    def get_example(self, dataset, example, layer=None):
        """float32 [T, D] of one layer of an example, or [L, T, D]."""
        request = pb.GetExampleRequest(dataset=self._id(dataset), example=example)
        if layer is not None:
            request.layer = layer
        return self._vectors(_call(self._query.GetExample, request))

    def get_labels(self, dataset, example):
        """uint8 [content tokens]: the example's labels (NOT_FOUND without)."""
        reply = _call(self._query.GetLabels,
                      pb.GetLabelsRequest(dataset=self._id(dataset), example=example))
        return np.frombuffer(reply.labels, dtype=np.uint8)

    def get_example_info(self, dataset, example):
        """dict: what `shardcast import` kept of the example's source record
        (samples.json: sample_idx, dataset_idx, seq_len, text_preview,
        metadata); NOT_FOUND when the dataset has none."""
        reply = _call(self._query.GetExampleInfo,
                      pb.GetExampleInfoRequest(dataset=self._id(dataset), example=example))
        return json.loads(reply.json)

    @staticmethod
    def _vectors(reply):
        values = np.frombuffer(reply.data, dtype=np.float32)
        shape = tuple(reply.shape)
        if math.prod(shape) != values.size:
            raise Error("DATA_LOSS", f"reply shape {shape} holds {math.prod(shape)} "
                        f"floats but carries {values.size}")
        return values.reshape(shape)

    def stream(self, dataset, *, layer=None, tokens="content", order="shuffled",
               batch_size=4096, seed=0, epochs=1, rank=0, world_size=1,
               drop_last=False, exclude_labels=(), resume_token=b"", copy=False,
               shared_memory=None, dtype="float32", scale_norm=False, center=False,
               node_rank=0, node_count=0):
        """A Stream of Batch objects (docs/daemon.md, Stream).

        `dataset`: an id, or the dataset's directory (a path: attached, see
        attach). `layer`: a recorded layer value, or None for all layers; `tokens`:
        "content", "special" (CLS) or "all"; `order`: "shuffled" (trainers:
        one shared disk pass) or "ordered" (disk order); `epochs`: 0 streams
        for ever; `rank`/`world_size`: this client's partition;
        `exclude_labels`: drop content tokens with these labels;
        `resume_token`: a Batch's token, to continue right after it. With
        `copy=True` each batch owns its vectors (the slot goes back at once).
        `node_rank`/`node_count`: the node group whose share of the data this
        stream reads (node_count 0: the daemon's --node-rank/--node-count).
        Transforms, applied by the daemon while it gathers each batch:
        `center` subtracts the layer's mean vector, `scale_norm` scales to a
        mean L2 norm of sqrt(d_model) (statistics from `shardcast stats`, or
        computed by the daemon on first use), `dtype` "float32",
        "bfloat16" or "float16" (rounded to nearest even; half the bytes).
        """
        if dtype not in _DTYPES:
            raise Error("INVALID_ARGUMENT", f"dtype={dtype!r}: float32, bfloat16 or float16")
        if tokens not in _TOKENS:
            raise Error("INVALID_ARGUMENT", f"tokens={tokens!r}: content, special or all")
        if order not in _ORDERS:
            raise Error("INVALID_ARGUMENT", f"order={order!r}: shuffled or ordered")
        request = pb.StreamRequest(
            dataset=self._id(dataset), tokens=_TOKENS[tokens], order=_ORDERS[order],
            batch_size=batch_size, seed=seed, epochs=epochs, rank=rank,
            world_size=world_size, drop_last=drop_last,
            exclude_labels=[int(x) for x in exclude_labels],
            resume_token=bytes(resume_token), dtype=_DTYPES[dtype],
            scale_norm=bool(scale_norm), center=bool(center), node_rank=node_rank,
            node_count=node_count)
        if layer is not None:
            request.layer = layer
        use_shm = self.shared_memory if shared_memory is None else shared_memory
        return Stream(self, request, use_shm, self.slots, copy)
