"""The shardcast Python package (client/python/shardcast) against a real
shardcastd: every API, one exact epoch over both transports, resume tokens,
shardcast.write, error codes, and the package's hygiene (version, stubs,
interop with a stock generated stub).

Expected values come from numpy reads of the dataset files
(saev_reference.py through package_fixtures.Reference), never from the
package or the daemon.
"""

import functools
import importlib.util
import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

from package_fixtures import (CLIENT_DIR, REPO_ROOT, SHARDCAST_BIN,  # noqa: F401
                              Reference, array_address, assert_exact_epoch,
                              datasets, in_memfd_mapping, memfd_mappings,
                              package_logs, ref, sockdir, start_daemon, synth,
                              wait_for)

import shardcast
from shardcast.v1 import shardcast_pb2 as pb
from shardcast.v1 import shardcast_pb2_grpc as pb_grpc

# One trainer alone: no need to wait for others before the first read.
ALONE = ("--scan-start-delay-ms", "0")


def _epoch(reference, stream, layer):
    """(rows, batches) of a whole stream, every batch checked against numpy."""
    rows, batches = [], []
    for b in stream:
        rows.extend(reference.batch_rows(b, layer))
        batches.append((b.epoch, b.index, b.rows))
    return rows, batches


# ---------------------------------------------------------------------------
# Protobuf versions: the package reads replies under protobuf 3.21 to 7.x.

PROTO = REPO_ROOT / "proto" / "shardcast" / "v1" / "shardcast.proto"


@functools.lru_cache(maxsize=None)
def repeated_in_proto(message_name):
    """Names of the fields declared `repeated` in MESSAGE_NAME, read from
    the .proto text (not from the generated code)."""
    text = PROTO.read_text()
    body = re.search(r"^message %s \{(.*?)^\}" % message_name, text, re.S | re.M)
    assert body, message_name
    return set(re.findall(r"^\s*repeated\s+\S+\s+(\w+)\s*=", body.group(1), re.M))


class Protobuf7Message:
    """A message as protobuf 7's upb runtime shows it to Python: field
    descriptors with `is_repeated` and no `label` (protobuf 7.36 removed it;
    the first run on the GPU machine failed on it)."""

    class Field:
        def __init__(self, field, repeated):
            self.name = field.name
            self.message_type = field.message_type
            self.is_repeated = field.name in repeated

    def __init__(self, message):
        self._message = message
        repeated = repeated_in_proto(message.DESCRIPTOR.name)
        self._fields = {f.name: self.Field(f, repeated) for f in message.DESCRIPTOR.fields}
        self.DESCRIPTOR = type("Descriptor", (), {"fields": list(self._fields.values())})

    def __getattr__(self, name):
        value = getattr(self._message, name)
        field = self._fields[name]
        if field.message_type is None:
            return value
        if field.is_repeated:
            return [Protobuf7Message(v) for v in value]
        return Protobuf7Message(value)


def test_replies_are_read_where_field_descriptors_have_no_label():
    from shardcast._client import _record
    reply = pb.ListDatasetsResponse(datasets=[
        pb.DatasetInfo(id="a", layers=[6, 12], warnings=["w"], d_model=64),
        pb.DatasetInfo(id="b", layers=[], d_model=16)])
    for message in (reply, Protobuf7Message(reply)):
        r = _record(message)
        assert [d.id for d in r.datasets] == ["a", "b"]
        assert r.datasets[0].layers == [6, 12] and r.datasets[1].layers == []
        assert r.datasets[0].warnings == ["w"] and r.datasets[0].d_model == 64
    assert not hasattr(Protobuf7Message(reply).DESCRIPTOR.fields[0], "label")


# ---------------------------------------------------------------------------
# Admin and Query calls.

def test_datasets_and_describe_match_the_metadata_files(start_daemon, datasets):
    """datasets() lists every dataset with the geometry numpy reads from its
    metadata.json/shards.json (and the rejected directory with its error);
    describe() by id and by an 8-character prefix returns the same record."""
    d = start_daemon()
    with shardcast.Client(d.address) as client:
        listed = {x.id: x for x in client.datasets()}
        assert set(listed) == {datasets.main.id, datasets.plain.id, datasets.v1.id,
                               datasets.saev.id, datasets.rejected_id}
        bad = listed[datasets.rejected_id]
        assert bad.ok is False and "metadata.json" in bad.error
        for name in ("main", "plain", "v1", "saev"):
            r = getattr(datasets, name)
            info = listed[r.id]
            g = r.geom
            assert info.ok and info.error == "", (name, info)
            assert info.variant == r.variant and info.protocol == r.md["protocol"], name
            assert info.layers == r.layers, name
            assert info.content_tokens == g.content_tokens, name
            assert info.cls_token == g.cls_token, name
            assert info.tokens_per_example == g.T, name
            assert info.d_model == g.D and info.n_examples == g.n_examples, name
            assert info.examples_per_shard == g.S, name
            assert info.num_shards == len(r.shards), name
            assert info.bytes == r.acts.nbytes, name
            assert info.has_labels == r.has_labels, name
            assert info.hash_matches_dir is True, name
            assert client.describe(r.id) == info, name
            assert client.describe(r.id[:8]) == info, name


def _http_port(d):
    """The port of the daemon's --http 127.0.0.1:0 endpoint, from its log."""
    return int(re.search(r"HTTP admin on 127\.0\.0\.1:(\d+)", d.log.read_text()).group(1))


@pytest.mark.parametrize("local", [True, False], ids=["local-socket", "grpc"])
def test_get_vectors_equal_numpy(start_daemon, datasets, local):
    """get_vectors returns float32 [N, D] equal to numpy at the protocol
    offsets, for a list of tuples and for an [N, 3] array (corners, both
    shards, negative layers, CLS and last token); [] gives [0, D]. On the
    local channel (the default on a Unix socket) and over gRPC."""
    d = start_daemon()
    rng = np.random.default_rng(11)
    with shardcast.Client(d.address, local_queries=local) as client:
        assert client.local_queries == local
        for name in ("main", "plain", "v1", "saev"):
            r = getattr(datasets, name)
            coords = [(0, r.layers[0], 0), (r.N - 1, r.layers[-1], r.T - 1),
                      (min(r.geom.S, r.N - 1), r.layers[0], r.T - 1)]
            coords += [(int(rng.integers(r.N)), r.layers[int(rng.integers(r.L))],
                        int(rng.integers(r.T))) for _ in range(60)]
            want = np.stack([r.vector(*c) for c in coords])
            got = client.get_vectors(r.id, coords)
            assert got.dtype == np.float32 and got.shape == (len(coords), r.D), name
            ref.assert_f32_equal(got, want, f"{name} get_vectors")
            got = client.get_vectors(r.id, np.array(coords, dtype=np.int64))
            ref.assert_f32_equal(got, want, f"{name} get_vectors(ndarray)")
            empty = client.get_vectors(r.id, [])
            assert empty.shape == (0, r.D) and empty.dtype == np.float32, name


def test_local_queries_skip_grpc_grow_their_region_and_serve_threads(
        start_daemon, datasets):
    """On the Unix socket get_vectors goes through the local channel
    (shardcast_queries_local_total counts each call, the daemon's log shows no
    gRPC query): cold and cached, from 8 threads at once, and a call larger
    than a connection's first region (the client reconnects with a larger
    one) all equal numpy; errors carry the daemon's code and message, as
    over gRPC."""
    import threading
    from sysprobe import evict, metric_samples
    d = start_daemon("--http", "127.0.0.1:0")
    port = _http_port(d)
    r = datasets.main
    files = sorted(str(p) for p in r.path.glob("acts*.bin"))
    rng = np.random.default_rng(31)

    def draw(n):
        return [(int(rng.integers(r.N)), r.layers[int(rng.integers(r.L))],
                 int(rng.integers(r.T))) for _ in range(n)]

    def local_calls():
        return metric_samples(port)["shardcast_queries_local_total"]

    with shardcast.Client(d.address) as client:
        assert client.local_queries
        coords = draw(40)
        want = np.stack([r.vector(*c) for c in coords])
        evict(files)
        before = local_calls()
        ref.assert_f32_equal(client.get_vectors(r.id, coords), want, "cold")
        ref.assert_f32_equal(client.get_vectors(r.id, coords), want, "cached")
        assert local_calls() == before + 2
        # More coordinates and vectors than the first region (1 MiB) holds.
        big = np.array(draw(60000), dtype=np.int64)
        got = client.get_vectors(r.id, big)
        assert got.shape == (60000, r.D)
        for i in range(0, 60000, 997):
            ref.assert_f32_equal(got[i], r.vector(*big[i]), f"row {i}")
        jobs = [draw(1 + i % 5) for i in range(8 * 30)]
        wrong = []

        def worker(k):
            for job in jobs[k::8]:
                want = np.stack([r.vector(*c) for c in job])
                if not np.array_equal(client.get_vectors(r.id, job).view(np.uint32),
                                      want.astype(np.float32).view(np.uint32)):
                    wrong.append(job)
        threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not wrong, wrong[:3]
        with pytest.raises(shardcast.Error) as e:
            client.get_vectors(r.id, coords[:3] + [(0, r.layers[0], r.T)])
        assert e.value.code == "OUT_OF_RANGE" and "coordinates[3]" in str(e.value), e.value
        with pytest.raises(shardcast.Error) as e:
            client.get_vectors("0123456789abcdef", coords[:1])
        assert e.value.code == "NOT_FOUND", e.value
    assert "call /shardcast.v1.Query/" not in d.log.read_text()


def test_single_vectors_are_read_by_the_client_itself(start_daemon, datasets):
    """A get_vectors of one vector is read by this process with the
    descriptor the daemon handed over (shardcast_queries_local_total does not
    count it) and equals numpy, for every dataset variant; two vectors, a
    coordinate outside the dataset, direct_reads=False and a daemon with
    --disable-direct-reads go to the daemon, which counts each call."""
    from sysprobe import metric_samples
    rng = np.random.default_rng(5)

    def singles(client, r, n):
        for _ in range(n):
            c = (int(rng.integers(r.N)), r.layers[int(rng.integers(r.L))],
                 int(rng.integers(r.T)))
            got = client.get_vectors(r.id, [c])
            assert got.shape == (1, r.D) and got.dtype == np.float32, c
            ref.assert_f32_equal(got[0], r.vector(*c), f"{r.id} {c}")

    d = start_daemon("--http", "127.0.0.1:0")
    port = _http_port(d)

    def local_calls():
        return metric_samples(port)["shardcast_queries_local_total"]

    def files_handed_over():
        return metric_samples(port)["shardcast_direct_read_files_total"]

    with shardcast.Client(d.address) as client:
        before = local_calls()
        for name in ("main", "plain", "v1", "saev"):
            singles(client, getattr(datasets, name), 30)
        assert local_calls() == before, "single vectors went to the daemon"
        # At least one file of each dataset, each once (30 reads each).
        assert 4 <= files_handed_over() <= sum(
            len(list(getattr(datasets, n).path.glob("acts*.bin")))
            for n in ("main", "plain", "v1", "saev"))
        r = datasets.main
        got = client.get_vectors(r.id, [(0, r.layers[0], 0), (r.N - 1, r.layers[-1], r.T - 1)])
        ref.assert_f32_equal(got[1], r.vector(r.N - 1, r.layers[-1], r.T - 1), "two")
        assert local_calls() == before + 1
        with pytest.raises(shardcast.Error) as e:
            client.get_vectors(r.id, [(r.N, r.layers[0], 0)])
        assert e.value.code == "OUT_OF_RANGE" and "coordinates[0]" in str(e.value), e.value
        assert local_calls() == before + 2
    with shardcast.Client(d.address, direct_reads=False) as client:
        before = local_calls()
        singles(client, datasets.main, 5)
        assert local_calls() == before + 5
    d.stop()
    d = start_daemon("--http", "127.0.0.1:0", "--disable-direct-reads")
    port = _http_port(d)
    with shardcast.Client(d.address) as client:
        before = local_calls()
        singles(client, datasets.main, 5)
        assert local_calls() == before + 5
        assert files_handed_over() == 0


def test_one_thread_asks_for_a_layout_again(start_daemon, datasets):
    """Threads reading single vectors of one dataset: the layout is asked
    for about once a second (shardcast_direct_read_layouts_total), by one
    thread while the others have the daemon read, and every vector equals
    numpy."""
    import threading
    from sysprobe import metric_samples
    d = start_daemon("--http", "127.0.0.1:0")
    port = _http_port(d)
    r = datasets.main
    wrong, reads = [], [0]
    with shardcast.Client(d.address) as client:
        start = time.monotonic()

        def read(t):
            i = t
            while time.monotonic() - start < 2.5:
                c = (i % r.N, r.layers[i % r.L], (i * 3) % r.T)
                got = client.get_vectors(r.id, [c])
                if not np.array_equal(got[0], r.vector(*c)):
                    wrong.append(c)
                reads[0] += 1
                i += 7

        threads = [threading.Thread(target=read, args=(t,)) for t in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        seconds = time.monotonic() - start
    assert not wrong, wrong[:5]
    assert reads[0] > 100
    layouts = metric_samples(port)["shardcast_direct_read_layouts_total"]
    # The first and one a second since, one more should the run end during
    # a refresh.
    assert 1 <= layouts <= int(seconds) + 2, (layouts, seconds)


def test_cached_get_vectors_are_answered_inline_and_cold_ones_by_a_worker(
        start_daemon, datasets):
    """A small GetVectors whose vectors are all in the page cache is answered
    on gRPC's thread (shardcast_queries_inline_total counts it); after the
    shards are evicted, or for more than 64 vectors, it goes to a worker. The
    values equal numpy on every path, and a bad coordinate is refused the
    same way on both."""
    from sysprobe import evict, metric_samples
    d = start_daemon("--http", "127.0.0.1:0")
    port = _http_port(d)
    r = datasets.main
    files = sorted(str(p) for p in r.path.glob("acts*.bin"))
    assert files, r.path
    rng = np.random.default_rng(5)
    coords = [(int(rng.integers(r.N)), r.layers[int(rng.integers(r.L))],
               int(rng.integers(r.T))) for _ in range(65)]
    want = np.stack([r.vector(*c) for c in coords])

    def inline():
        return metric_samples(port)["shardcast_queries_inline_total"]

    with shardcast.Client(d.address, local_queries=False) as client:  # gRPC paths
        evict(files)
        before = inline()
        ref.assert_f32_equal(client.get_vectors(r.id, coords[:8]), want[:8], "cold")
        assert inline() == before, "a cold call was answered inline"
        ref.assert_f32_equal(client.get_vectors(r.id, coords[:8]), want[:8], "cached")
        assert inline() == before + 1
        ref.assert_f32_equal(client.get_vectors(r.id, coords[:1]), want[:1], "one")
        assert inline() == before + 2
        client.get_vectors(r.id, coords)  # bring all 65 in
        before = inline()
        ref.assert_f32_equal(client.get_vectors(r.id, coords), want, "65 vectors")
        assert inline() == before, "65 vectors were answered inline"
        for bad in ([(r.N, r.layers[0], 0)], [(0, r.layers[0], r.T)]):
            with pytest.raises(shardcast.Error) as e:
                client.get_vectors(r.id, coords[:2] + bad)
            assert e.value.code in ("OUT_OF_RANGE", "INVALID_ARGUMENT"), e.value
            assert "coordinates[2]" in str(e.value), e.value


@pytest.mark.skipif(os.geteuid() != 0, reason="switching users needs root")
def test_a_daemon_the_kernel_hides_residency_from_reads_through_the_cache(
        start_daemon, datasets):
    """mincore() reports every page of a file as cached to a process that
    neither owns it, may write it, nor has CAP_FOWNER: here `nobody` serving
    root's 4 KiB-vector dataset. That daemon cannot tell cold vectors from
    cached ones without reading, so its queries read nothing with O_DIRECT
    (root's daemon over the same files does) and its inline answers and the
    scan's cache probe fall back to RWF_NOWAIT reads. Its results are still
    numpy's: GetVectors cold and cached (the cached call answered inline),
    and one shuffled epoch exactly."""
    import pwd
    from sysprobe import evict, metric_samples
    try:
        nobody = pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("no user `nobody`")
    root = Path(tempfile.mkdtemp(prefix="scnobody-", dir="/tmp"))
    try:
        os.chmod(root, 0o755)  # files root's (0644), readable by nobody
        r = Reference(synth(root, "--layers", "2,5", "--tokens", 8, "--cls",
                            "--d-model", 1024, "--examples", 24, "--budget", 200,
                            "--seed", 11))
        files = sorted(str(p) for p in r.path.glob("acts*.bin"))
        assert len(files) >= 2 and all(os.stat(f).st_uid == 0 for f in files)
        rng = np.random.default_rng(9)
        coords = [(int(rng.integers(r.N)), r.layers[int(rng.integers(r.L))],
                   int(rng.integers(r.T))) for _ in range(80)]  # > inline's 64
        want = np.stack([r.vector(*c) for c in coords])

        def direct_bytes(port):
            return metric_samples(port)["shardcast_query_direct_read_bytes_total"]

        as_root = start_daemon("--http", "127.0.0.1:0", *ALONE, roots=[root])
        as_nobody = start_daemon("--http", "127.0.0.1:0", *ALONE, roots=[root],
                                 user=nobody)
        uids = [line.split()[1:3] for line in
                Path(f"/proc/{as_nobody.pid}/status").read_text().splitlines()
                if line.startswith("Uid:")]
        assert uids == [[str(nobody.pw_uid)] * 2], uids
        for d, direct in ((as_root, True), (as_nobody, False)):
            port = _http_port(d)
            with shardcast.Client(d.address, local_queries=False) as client:
                evict(files)
                ref.assert_f32_equal(client.get_vectors(r.id, coords), want, "cold")
                assert (direct_bytes(port) > 0) is direct, d.describe()
                for f in files:  # all cached
                    Path(f).read_bytes()
                inline = metric_samples(port)["shardcast_queries_inline_total"]
                ref.assert_f32_equal(client.get_vectors(r.id, coords[:8]), want[:8],
                                     "cached")
                assert metric_samples(port)["shardcast_queries_inline_total"] == \
                    inline + 1, d.describe()
        log = as_nobody.log.read_text()
        assert "read every vector through the page cache" in log, as_nobody.describe()
        evict(files)
        with shardcast.Client(as_nobody.address) as client:
            with client.stream(r.id, layer=None, tokens="content", order="shuffled",
                               batch_size=97, seed=5, epochs=1) as stream:
                rows = [row for b in stream for row in r.batch_rows(b, None)]
        assert_exact_epoch(rows, r.selection(None, "content"))
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_large_get_vectors_go_on_one_session_and_equal_numpy(start_daemon, datasets):
    """get_vectors of SESSION_FROM coordinates or more goes as a message on
    the Client's one VectorsSession call (shardcast_session_requests_total
    counts it; no StreamVectors) and, cold or cached, equals numpy in request
    order; one fewer is a unary GetVectors call. A bad coordinate is refused
    the same way on both roads, and the session serves on."""
    from sysprobe import evict, metric_samples
    d = start_daemon("--http", "127.0.0.1:0")
    port = _http_port(d)
    r = datasets.main
    files = sorted(str(p) for p in r.path.glob("acts*.bin"))
    rng = np.random.default_rng(23)
    n = shardcast._client.SESSION_FROM
    coords = [(int(rng.integers(r.N)), r.layers[int(rng.integers(r.L))],
               int(rng.integers(r.T))) for _ in range(5 * n)]
    want = np.stack([r.vector(*c) for c in coords])

    def on_session():
        return metric_samples(port)["shardcast_session_requests_total"]

    with shardcast.Client(d.address, local_queries=False) as client:  # gRPC paths
        for label in ("cold", "cached"):
            if label == "cold":
                evict(files)
            before = on_session()
            got = client.get_vectors(r.id, coords)
            assert got.dtype == np.float32 and got.shape == (len(coords), r.D)
            ref.assert_f32_equal(got, want, f"{label}, {len(coords)} vectors")
            assert on_session() == before + 1, label
        before = on_session()
        ref.assert_f32_equal(client.get_vectors(r.id, coords[:n]), want[:n], "n")
        assert on_session() == before + 1
        ref.assert_f32_equal(client.get_vectors(r.id, coords[:n - 1]), want[:n - 1], "n - 1")
        assert on_session() == before + 1, "a call under the threshold went on the session"
        for bad in (coords[:100] + [(r.N, r.layers[0], 0)],
                    coords[:n - 2] + [(r.N, r.layers[0], 0)]):
            with pytest.raises(shardcast.Error) as e:
                client.get_vectors(r.id, bad)
            assert e.value.code == "OUT_OF_RANGE" and \
                f"coordinates[{len(bad) - 1}]" in str(e.value), e.value
        ref.assert_f32_equal(client.get_vectors(r.id, coords), want, "after the errors")
        assert metric_samples(port)["shardcast_query_sessions"] == 1
    assert metric_samples(port)["shardcast_queries_streamed_total"] == 0
    log = d.log.read_text()
    assert log.count("DEBUG call /shardcast.v1.Query/VectorsSession ") == 1, d.describe()
    assert "call /shardcast.v1.Query/StreamVectors" not in log


def test_get_example_equal_numpy(start_daemon, datasets):
    """get_example(e, layer) is [T, D] and get_example(e) is [L, T, D], equal
    to numpy's read of the example, for every example of every dataset."""
    d = start_daemon()
    with shardcast.Client(d.address) as client:
        for name in ("main", "plain", "v1", "saev"):
            r = getattr(datasets, name)
            for e in range(r.N):
                got = client.get_example(r.id, e)
                assert got.shape == (r.L, r.T, r.D) and got.dtype == np.float32
                ref.assert_f32_equal(got, r.acts[e], f"{name} example {e}")
                for li, layer in enumerate(r.layers):
                    got = client.get_example(r.id, e, layer=layer)
                    assert got.shape == (r.T, r.D)
                    ref.assert_f32_equal(
                        got, ref.read_example_layer(str(r.path), r.geom, e, layer),
                        f"{name} example {e} layer {layer}")


def test_get_labels_equal_labels_bin(start_daemon, datasets):
    """get_labels(e) is the uint8 row e of labels.bin [N, content tokens]."""
    d = start_daemon()
    with shardcast.Client(d.address) as client:
        for name in ("main", "v1"):
            r = getattr(datasets, name)
            for e in range(r.N):
                got = client.get_labels(r.id, e)
                assert got.dtype == np.uint8 and got.shape == (r.geom.content_tokens,)
                assert np.array_equal(got, r.labels[e]), f"{name} example {e}"


def test_status_reports_the_daemon_and_what_a_stream_moved(start_daemon, datasets):
    """status(): version, dataset counts, the reservoir size from the flag, no
    shared memory while idle; after one ordered epoch bytes_delivered grew by
    exactly the epoch's vector bytes and bytes_read_from_disk by at least
    them."""
    d = start_daemon(*ALONE)
    r = datasets.main
    with shardcast.Client(d.address) as client:
        before = client.status()
        assert before.version == shardcast.__version__
        assert before.datasets_ok == 4 and before.datasets_failed == 1
        assert before.reservoir_bytes == 64 << 20
        assert (before.shm_regions, before.shm_bytes, before.shm_streams) == (0, 0, 0)
        assert before.scans == [] and before.reservoir_bytes_in_use == 0
        with client.stream(r.id, layer=12, order="ordered", batch_size=100) as s:
            n = sum(b.rows for b in s)
        assert n == r.N * (r.T - 1)
        after = client.status()
        assert after.bytes_delivered - before.bytes_delivered == n * r.D * 4
        assert after.bytes_read_from_disk - before.bytes_read_from_disk >= n * r.D * 4
        assert after.calls_total > before.calls_total
        assert after.uptime_seconds >= before.uptime_seconds


# ---------------------------------------------------------------------------
# Streams: one exact epoch, fields, transports.

@pytest.mark.parametrize("transport", ["shm", "grpc"])
@pytest.mark.parametrize("layer", [12, None], ids=["layer12", "all_layers"])
@pytest.mark.parametrize("tokens", ["content", "all"])
@pytest.mark.parametrize("order", ["shuffled", "ordered"])
def test_one_epoch_is_exact_and_equal_to_numpy(start_daemon, datasets, order, tokens,
                                               layer, transport):
    """One epoch through the Python iterator delivers every selected
    (example, token, layer) exactly once with numpy's values, and the batch
    fields are as documented: vectors float32 [B, D], example_idx int64,
    token_idx int32 (-1 = CLS), a layer column only for all layers, labels
    (255 for CLS), epoch 0, index 0, 1, ..., full batches but the last, a
    resume token. Ordered is disk order; shuffled is not. The shm transport
    is really used (stream.shared_memory, batch.slot, vectors inside a memfd
    mapping of this process) and not used with shared_memory=False."""
    d = start_daemon(*ALONE)
    r = datasets.main
    want = r.selection(layer, tokens)
    bs = 97
    with shardcast.Client(d.address, shared_memory=(transport == "shm")) as client:
        with client.stream(r.id, layer=layer, tokens=tokens, order=order,
                           batch_size=bs, seed=5, epochs=1) as stream:
            rows, batches = [], []
            for b in stream:
                rows.extend(r.batch_rows(b, layer))
                batches.append((b.epoch, b.index, b.rows))
                inside = in_memfd_mapping(array_address(b.vectors))
                if transport == "shm":
                    assert b.slot is not None and inside, "shm batch not in a memfd slot"
                else:
                    assert b.slot is None and not inside, "gRPC batch in shared memory"
            assert stream.shared_memory is (transport == "shm")
    assert_exact_epoch(rows, want)
    n_batches = -(-len(want) // bs)
    assert batches == [(0, i, min(bs, len(want) - i * bs)) for i in range(n_batches)]
    if order == "ordered":
        assert rows == want, "ordered stream is not in disk order"
    else:
        assert rows != want, "shuffled stream came in disk order"


def test_special_tokens_and_a_dataset_without_labels(start_daemon, datasets):
    """tokens="special" streams the CLS vectors only (token_idx -1, label
    255); a dataset without labels.bin streams labels=None; saev's 2.1
    variant and protocol 1.0.0 stream like 2.1."""
    d = start_daemon(*ALONE)
    with shardcast.Client(d.address) as client:
        for name, layer, tokens in (("main", None, "special"), ("plain", 5, "content"),
                                    ("saev", 9, "all"), ("v1", None, "content")):
            r = getattr(datasets, name)
            for order in ("shuffled", "ordered"):
                with client.stream(r.id, layer=layer, tokens=tokens, order=order,
                                   batch_size=7, seed=2) as s:
                    rows, _ = _epoch(r, s, layer)
                assert_exact_epoch(rows, r.selection(layer, tokens), f"{name} {order}")
        with client.stream(datasets.main.id, tokens="special", batch_size=1000) as s:
            b = next(s)
            assert (b.token_idx == -1).all() and (b.labels == 255).all()


def test_two_shuffled_epochs_are_each_exact_and_differ(start_daemon, datasets):
    """epochs=2: the epoch field counts 0 then 1, each epoch is exact, and the
    two epochs come in different orders."""
    d = start_daemon(*ALONE)
    r = datasets.main
    with shardcast.Client(d.address) as client:
        with client.stream(r.id, layer=6, batch_size=64, seed=8, epochs=2) as s:
            per_epoch = {}
            for b in s:
                per_epoch.setdefault(b.epoch, []).extend(r.batch_rows(b, 6))
    assert sorted(per_epoch) == [0, 1]
    for epoch, rows in per_epoch.items():
        assert_exact_epoch(rows, r.selection(6), f"epoch {epoch}")
    assert per_epoch[0] != per_epoch[1]


def test_copy_true_owns_its_vectors_and_the_default_is_a_view(start_daemon, datasets):
    """With copy=True every batch owns its vectors (not in shared memory), so
    batches kept until the end of the stream still equal numpy; the default
    is a view of the daemon's slot (inside the memfd mapping, not owning its
    data), equal to numpy while it is the current batch."""
    d = start_daemon(*ALONE)
    r = datasets.main
    with shardcast.Client(d.address, slots=2) as client:
        kept = []
        with client.stream(r.id, layer=6, batch_size=40, seed=3, copy=True) as s:
            for b in s:
                assert not in_memfd_mapping(array_address(b.vectors))
                assert b.slot is None
                kept.append(b)
            assert s.shared_memory
        rows = []
        for b in kept:
            rows.extend(r.batch_rows(b, 6))
        assert_exact_epoch(rows, r.selection(6))

        with client.stream(r.id, layer=6, batch_size=40, seed=3) as s:
            first = next(s)
            assert first.slot is not None
            assert in_memfd_mapping(array_address(first.vectors))
            assert not first.vectors.flags.owndata
            r.batch_rows(first, 6)  # valid until the next batch
            snapshot = first.vectors.copy()
            rows = [row for b in s for row in r.batch_rows(b, 6)]
        assert_exact_epoch(r.rows(snapshot, first.example_idx, first.token_idx,
                                  np.full(first.rows, 6), first.labels) + rows,
                           r.selection(6))


def test_shm_is_used_by_default_and_not_when_disabled(start_daemon, datasets):
    """On the Unix socket a stream uses shared memory (the daemon counts one
    region and one shm stream, and maps a memfd) and gives it back at the
    end; Client(shared_memory=False) and a daemon started with
    --disable-shared-memory stream the same exact epoch over gRPC only."""
    r = datasets.main
    d = start_daemon(*ALONE)
    base = len(memfd_mappings(d.pid))
    with shardcast.Client(d.address) as client:
        with client.stream(r.id, layer=6, batch_size=50, seed=1) as s:
            rows = r.batch_rows(next(s), 6)
            st = client.status()
            assert s.shared_memory and st.shm_regions == 1 and st.shm_streams == 1
            assert st.shm_bytes >= 4 * 50 * r.D * 4
            assert len(memfd_mappings(d.pid)) == base + 1, "daemon maps no region"
            rows += [row for b in s for row in r.batch_rows(b, 6)]
        assert_exact_epoch(rows, r.selection(6))
        wait_for(lambda: client.status().shm_regions == 0, what="region freed")
        assert len(memfd_mappings(d.pid)) == base
    with shardcast.Client(d.address, shared_memory=False) as client:
        with client.stream(r.id, layer=6, batch_size=50, seed=1) as s:
            rows = r.batch_rows(next(s), 6)
            st = client.status()
            assert not s.shared_memory and (st.shm_regions, st.shm_streams) == (0, 0)
            rows += [row for b in s for row in r.batch_rows(b, 6)]
        assert_exact_epoch(rows, r.selection(6))
    off = start_daemon("--disable-shared-memory", *ALONE)
    # Its local channel serves queries only: a batch region is refused.
    from shardcast import _local
    with pytest.raises(_local.Refused) as refused:
        _local.BatchRegion(str(off.sock) + _local.SOCKET_SUFFIX, 2, 4096)
    assert refused.value.code == 12, refused.value.message  # UNIMPLEMENTED
    assert "--disable-shared-memory" in refused.value.message
    with shardcast.Client(off.address) as client:
        with client.stream(r.id, layer=6, batch_size=50, seed=1) as s:
            rows = [row for b in s for row in r.batch_rows(b, 6)]
            assert not s.shared_memory
        assert_exact_epoch(rows, r.selection(6))
        assert client.status().shm_regions == 0


def test_a_daemon_without_io_uring_serves_every_road(start_daemon, datasets):
    """--disable-io-uring (what a seccomp profile without io_uring does): the
    read engine and the local channel's threads run their ring loops on poll
    and pread, and the query workers read with pread. A shuffled epoch in
    shared memory and an ordered one in gRPC messages are exact and equal to
    numpy, and so are get_vectors on the local channel (read here, and read
    by the daemon) and over gRPC."""
    d = start_daemon("--disable-io-uring", *ALONE)
    log = d.log.read_text()
    assert "read engine: pread fallback" in log, log
    assert "with poll and pread" in log, log
    r = datasets.main
    for shm, order in ((True, "shuffled"), (False, "ordered")):
        with shardcast.Client(d.address, shared_memory=shm) as client:
            with client.stream(r.id, layer=12, tokens="content", order=order,
                               batch_size=97, seed=3, epochs=1) as s:
                rows = [row for b in s for row in r.batch_rows(b, 12)]
                assert s.shared_memory is shm
        assert_exact_epoch(rows, r.selection(12, "content"))
    rng = np.random.default_rng(4)
    coords = [(int(rng.integers(r.N)), r.layers[int(rng.integers(r.L))],
               int(rng.integers(r.T))) for _ in range(100)]
    want = np.stack([r.vector(*c) for c in coords])
    for road in (dict(), dict(direct_reads=False), dict(local_queries=False)):
        with shardcast.Client(d.address, **road) as client:
            assert client.local_queries is road.get("local_queries", True)
            for n in (1, 7, 100):
                ref.assert_f32_equal(client.get_vectors(r.id, coords[:n]), want[:n],
                                     f"get_vectors of {n} with {road}")


# ---------------------------------------------------------------------------
# Resume tokens.

@pytest.mark.parametrize("transport", ["shm", "grpc"])
@pytest.mark.parametrize("order", ["shuffled", "ordered"])
def test_resume_token_continues_the_epoch_exactly(start_daemon, datasets, order,
                                                  transport):
    """Stopping mid-epoch and opening a new stream with the last batch's
    resume_token delivers exactly the rest: before + after is one exact epoch
    (nothing lost, nothing twice); resuming from the final batch's token
    delivers nothing."""
    d = start_daemon(*ALONE)
    r = datasets.main
    args = dict(layer=None, tokens="all", order=order, batch_size=90, seed=21)
    with shardcast.Client(d.address, shared_memory=(transport == "shm")) as client:
        before = []
        with client.stream(r.id, **args) as s:
            for i, b in enumerate(s):
                before.extend(r.batch_rows(b, None))
                token = b.resume_token
                if i == 5:
                    break
        assert 0 < len(before) < len(r.selection(None, "all"))
        with client.stream(r.id, resume_token=token, **args) as s:
            after, _ = _epoch(r, s, None)
            last = s.resume_token
        assert_exact_epoch(before + after, r.selection(None, "all"))
        if order == "ordered":
            assert before + after == r.selection(None, "all")
        with client.stream(r.id, resume_token=last, **args) as s:
            assert list(s) == [], "resuming after the last batch delivered more"


# ---------------------------------------------------------------------------
# shardcast.write.

def test_write_is_read_back_by_numpy_and_served(start_daemon, tmp_path, monkeypatch):
    """shardcast.write(root, acts, layers=, cls_token=, labels=, budget=)
    writes a protocol 2.1 dataset in its content-hash directory that numpy
    reads back equal (acts, labels, metadata), over several shards; writing
    the same again reuses it; a daemon on that root serves the same values.
    Writing from .npy paths gives the same directory."""
    monkeypatch.setenv("SHARDCAST_BIN", str(SHARDCAST_BIN))
    root = tmp_path / "written"
    root.mkdir()
    rng = np.random.default_rng(5)
    acts = rng.standard_normal((11, 2, 6, 8)).astype(np.float32)  # CLS + 5 tokens
    labels = rng.integers(0, 6, size=(11, 5)).astype(np.uint8)
    path = Path(shardcast.write(root, acts, layers=[-1, 4], cls_token=True,
                                labels=labels, budget=48))
    assert path.parent == root
    md, shards, geom = ref.open_dataset(str(path))
    assert md["protocol"] == "2.1" and ref.detect_variant(md) == "2.1"
    assert md["layers"] == [-1, 4] and md["cls_token"] is True
    assert (md["patches_per_ex"], md["d_model"], md["n_examples"]) == (5, 8, 11)
    assert md["patches_per_shard"] == 48 and geom.S == 4 and len(shards) == 3
    assert path.name == ref.content_hash("2.1", md), "directory is not the content hash"
    ref.assert_f32_equal(ref.load_all(str(path)), acts, "written acts")
    assert np.array_equal(ref.load_labels(str(path), geom), labels)

    assert Path(shardcast.write(root, acts, layers=[-1, 4], cls_token=True,
                                labels=labels, budget=48)) == path
    np.save(tmp_path / "a.npy", acts)
    np.save(tmp_path / "l.npy", labels)
    assert Path(shardcast.write(root, tmp_path / "a.npy", layers=[-1, 4], cls_token=True,
                                labels=tmp_path / "l.npy", budget=48)) == path
    assert sorted(p.name for p in root.iterdir()) == [path.name], "leftovers in the root"

    d = start_daemon(*ALONE, roots=[root])
    r = Reference(path)
    with shardcast.Client(d.address) as client:
        info = client.describe(path.name)
        assert info.ok and info.layers == [-1, 4] and info.has_labels
        for e in range(11):
            ref.assert_f32_equal(client.get_example(path.name, e), acts[e], f"example {e}")
            assert np.array_equal(client.get_labels(path.name, e), labels[e])
        with client.stream(path.name, tokens="all", order="ordered", batch_size=13) as s:
            rows, _ = _epoch(r, s, None)
        assert rows == r.selection(None, "all")


def test_write_refuses_different_bytes_under_the_same_metadata(tmp_path, monkeypatch):
    """A dataset with the same metadata (so the same directory) but other
    values is refused with shardcast.Error, and the existing dataset is left
    as it was; mismatched shapes are refused with a message naming them."""
    monkeypatch.setenv("SHARDCAST_BIN", str(SHARDCAST_BIN))
    acts = np.arange(4 * 1 * 3 * 4, dtype=np.float32).reshape(4, 1, 3, 4)
    path = Path(shardcast.write(tmp_path, acts, layers=[2], cls_token=False))
    other = acts.copy()
    other[0, 0, 0, 0] = 99
    with pytest.raises(shardcast.Error) as e:
        shardcast.write(tmp_path, other, layers=[2], cls_token=False)
    assert "different bytes" in e.value.message
    ref.assert_f32_equal(ref.load_all(str(path)), acts, "existing dataset changed")
    with pytest.raises(shardcast.Error) as e:
        shardcast.write(tmp_path, acts, layers=[2, 3], cls_token=False)
    assert "layers" in e.value.message
    with pytest.raises(shardcast.Error) as e:
        shardcast.write(tmp_path, acts, layers=[2], cls_token=False,
                        labels=np.zeros((4, 2), np.uint8))
    assert "labels" in e.value.message


# ---------------------------------------------------------------------------
# Errors.

def _raw_details(fn, request):
    """(code name, details) of a raw call that must fail."""
    with pytest.raises(grpc.RpcError) as e:
        fn(request, timeout=10)
    return e.value.code().name, e.value.details()


def test_unknown_dataset_is_not_found_with_the_daemons_message(start_daemon, datasets):
    """Every call naming an unknown dataset raises shardcast.Error with code
    NOT_FOUND and, as its message, exactly what the daemon answers a raw
    gRPC call (the same for streams over shared memory and over gRPC)."""
    d = start_daemon(*ALONE)
    unknown = "0123456789abcdef"
    with grpc.insecure_channel(d.address) as ch:
        code, details = _raw_details(pb_grpc.AdminStub(ch).DescribeDataset,
                                     pb.DescribeDatasetRequest(dataset=unknown))
        q = pb_grpc.QueryStub(ch)
        raw_vec = _raw_details(q.GetVectors, pb.GetVectorsRequest(
            dataset=unknown, coordinates=[pb.Coordinate(example=0, layer=6, token=0)]))
    assert code == "NOT_FOUND" and unknown in details
    assert raw_vec == (code, details)
    for shm in (True, False):
        with shardcast.Client(d.address, shared_memory=shm) as client:
            calls = {"describe": lambda: client.describe(unknown),
                     "get_vectors": lambda: client.get_vectors(unknown, [(0, 6, 0)]),
                     "get_example": lambda: client.get_example(unknown, 0),
                     "get_labels": lambda: client.get_labels(unknown, 0),
                     "stream": lambda: next(client.stream(unknown, batch_size=8))}
            for name, call in calls.items():
                with pytest.raises(shardcast.Error) as e:
                    call()
                assert (e.value.code, e.value.message) == (code, details), (name, shm)
    with shardcast.Client(d.address) as client:
        with pytest.raises(shardcast.Error) as e:
            client.get_labels(datasets.plain.id, 0)
        assert e.value.code == "NOT_FOUND", "labels of a dataset without labels.bin"


@pytest.mark.parametrize("transport", ["shm", "grpc"])
def test_bad_arguments_are_invalid_argument(start_daemon, datasets, transport):
    """Bad arguments raise shardcast.Error INVALID_ARGUMENT (coordinates
    outside the dataset: OUT_OF_RANGE), and the client stays usable."""
    d = start_daemon(*ALONE)
    r, plain = datasets.main, datasets.plain
    with shardcast.Client(d.address, shared_memory=(transport == "shm")) as client:
        def stream(dataset=r.id, **kw):
            kw.setdefault("batch_size", 16)
            with client.stream(dataset, **kw) as s:
                return list(s)
        cases = {
            "get_vectors layer 7": (lambda: client.get_vectors(r.id, [(0, 7, 0)]),
                                    "INVALID_ARGUMENT"),
            "get_example layer 7": (lambda: client.get_example(r.id, 0, layer=7),
                                    "INVALID_ARGUMENT"),
            "describe 7-char prefix": (lambda: client.describe(r.id[:7]),
                                       "INVALID_ARGUMENT"),
            "stream layer 7": (lambda: stream(layer=7), "INVALID_ARGUMENT"),
            "stream batch_size 0": (lambda: stream(batch_size=0), "INVALID_ARGUMENT"),
            "stream batch_size -5": (lambda: stream(batch_size=-5), "INVALID_ARGUMENT"),
            "stream tokens": (lambda: stream(tokens="patches"), "INVALID_ARGUMENT"),
            "stream order": (lambda: stream(order="random"), "INVALID_ARGUMENT"),
            "stream rank 2 of 2": (lambda: stream(rank=2, world_size=2), "INVALID_ARGUMENT"),
            "stream epochs -1": (lambda: stream(epochs=-1), "INVALID_ARGUMENT"),
            "stream exclude 300": (lambda: stream(exclude_labels=[300]), "INVALID_ARGUMENT"),
            "stream exclude, no labels": (lambda: stream(plain.id, exclude_labels=[1]),
                                          "INVALID_ARGUMENT"),
            "stream resume garbage": (lambda: stream(resume_token=b"not a token"),
                                      "INVALID_ARGUMENT"),
            "stream batch too big": (lambda: stream(batch_size=10 ** 7), "INVALID_ARGUMENT"),
            "get_vectors example 40": (lambda: client.get_vectors(r.id, [(40, 6, 0)]),
                                       "OUT_OF_RANGE"),
            "get_vectors token 17": (lambda: client.get_vectors(r.id, [(0, 6, 17)]),
                                     "OUT_OF_RANGE"),
            "get_example -1": (lambda: client.get_example(r.id, -1), "OUT_OF_RANGE"),
        }
        wrong = []
        for name, (call, code) in cases.items():
            try:
                call()
                wrong.append(f"{name}: no error")
            except shardcast.Error as e:
                if e.code != code or not e.message:
                    wrong.append(f"{name}: {e.code} {e.message!r}, expected {code}")
        assert not wrong, "\n".join(wrong)
        got = client.get_vectors(r.id, [(1, 6, 1)])
        ref.assert_f32_equal(got[0], r.vector(1, 6, 1), "after the errors")
    with pytest.raises(shardcast.Error) as e:
        shardcast.Client("", timeout=1)
    assert e.value.code == "INVALID_ARGUMENT"


@pytest.mark.parametrize("transport", ["shm", "grpc"])
def test_rejected_dataset_is_failed_precondition(start_daemon, datasets, transport):
    """A dataset the daemon rejected at load is described with ok=False and
    its error; streaming or querying it raises FAILED_PRECONDITION with the
    daemon's reason, over either transport (not a shared-memory error about
    a slot of 0 bytes)."""
    d = start_daemon(*ALONE)
    with shardcast.Client(d.address, shared_memory=(transport == "shm")) as client:
        info = client.describe(datasets.rejected_id)
        assert info.ok is False and "metadata.json" in info.error
        with pytest.raises(shardcast.Error) as e:
            next(client.stream(datasets.rejected_id, batch_size=16))
        assert e.value.code == "FAILED_PRECONDITION", e.value
        assert "metadata.json" in e.value.message
        with pytest.raises(shardcast.Error) as e:
            client.get_example(datasets.rejected_id, 0)
        assert e.value.code == "FAILED_PRECONDITION", e.value


# ---------------------------------------------------------------------------
# Package hygiene.

def test_version_matches_cmake_and_pyproject():
    """shardcast.__version__ is the version of project(...) in CMakeLists.txt
    and of client/python/pyproject.toml."""
    cmake = (REPO_ROOT / "CMakeLists.txt").read_text()
    m = re.search(r"project\(\s*shardcast\b[^)]*?\bVERSION\s+([0-9][0-9.]*)", cmake)
    assert m, "no project(shardcast VERSION x.y.z) in CMakeLists.txt"
    pyproject = (CLIENT_DIR / "pyproject.toml").read_text()
    p = re.search(r'(?ms)^\[project\]\s*$.*?^version\s*=\s*"([^"]+)"', pyproject)
    assert p, "no version in pyproject.toml's [project] table"
    assert shardcast.__version__ == m.group(1) == p.group(1), (
        shardcast.__version__, m.group(1), p.group(1))


def _generate_stubs(out):
    """Generates Python stubs from proto/shardcast/v1/{shardcast,local}.proto into
    `out`; returns (generator, whether the grpc file was generated). The
    checked-in files name no generator version, but their pb2 layout is
    protoc 3.21's, the version of Debian's python3-protobuf, so Debian's
    protoc (with grpc_python_plugin) comes first, then grpc_tools."""
    proto_dir = REPO_ROOT / "proto"
    protoc = shutil.which("protoc")
    plugin = shutil.which("grpc_python_plugin") or "/usr/bin/grpc_python_plugin"
    if protoc:
        cmd = [protoc, f"-I{proto_dir}", f"--python_out={out}"]
        has_plugin = Path(plugin).exists()
        if has_plugin:
            cmd += [f"--grpc_python_out={out}", f"--plugin=protoc-gen-grpc_python={plugin}"]
        cmd += ["shardcast/v1/shardcast.proto", "shardcast/v1/local.proto"]
        gen = "protoc"
    else:
        if importlib.util.find_spec("grpc_tools") is None:
            pytest.skip("neither protoc nor grpc_tools is installed: the stubs cannot "
                        "be regenerated here")
        cmd = ["/usr/bin/python3", "-m", "grpc_tools.protoc", f"-I{proto_dir}",
               f"--python_out={out}", f"--grpc_python_out={out}",
               "shardcast/v1/shardcast.proto", "shardcast/v1/local.proto"]
        has_plugin, gen = True, "grpc_tools"
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=60)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stderr.decode(errors='replace')}"
    return gen, has_plugin


def test_checked_in_stubs_are_current():
    """client/python/shardcast/v1/shardcast_pb2.py, shardcast_pb2_grpc.py and
    local_pb2.py (the local channel's messages) are byte for byte what the generator makes of proto/ today (so a change
    to the .proto without regenerating fails here). When no gRPC plugin is
    installed the _grpc file cannot be regenerated: then every RPC of the
    .proto must appear in it with its path and message types instead."""
    checked_in = CLIENT_DIR / "shardcast" / "v1"
    with tempfile.TemporaryDirectory() as tmp:
        gen, has_plugin = _generate_stubs(tmp)
        fresh = Path(tmp) / "shardcast" / "v1"
        assert (fresh / "shardcast_pb2.py").read_bytes() == \
            (checked_in / "shardcast_pb2.py").read_bytes(), (
            f"shardcast_pb2.py is stale: regenerate it with {gen} (see the file's header)")
        assert (fresh / "local_pb2.py").read_bytes() == \
            (checked_in / "local_pb2.py").read_bytes(), (
            f"local_pb2.py is stale: regenerate it with {gen}")
        grpc_file = (checked_in / "shardcast_pb2_grpc.py").read_text()
        if has_plugin:
            assert (fresh / "shardcast_pb2_grpc.py").read_text() == grpc_file, (
                f"shardcast_pb2_grpc.py is stale: regenerate it with {gen}")
        else:
            # Structural check against the descriptor of the fresh pb2.
            for service in pb.DESCRIPTOR.services_by_name.values():
                assert f"class {service.name}Stub(object):" in grpc_file, service.name
                for method in service.methods:
                    assert f"'/shardcast.v1.{service.name}/{method.name}'" in grpc_file
                    for message in (method.input_type, method.output_type):
                        assert f"_pb2.{message.name}." in grpc_file, (method.name, message)
    assert grpc_file.startswith("# Generated by the gRPC Python protocol compiler plugin")
    assert (checked_in / "__init__.py").read_text().strip() == ""


def test_stock_generated_stub_streams_over_grpc(start_daemon, datasets):
    """The plain generated stub (shardcast_pb2_grpc.StreamStub.Stream, no
    package code) on a plain grpcio channel to the Unix socket streams one
    exact epoch with the vectors in the messages, equal to numpy (interop
    with the gRPC path the package's TCP clients use)."""
    d = start_daemon(*ALONE)
    r = datasets.main
    with grpc.insecure_channel(d.address) as ch:
        stub = pb_grpc.StreamStub(ch)
        for order in (pb.ORDER_SHUFFLED, pb.ORDER_ORDERED):
            rows = []
            req = pb.StreamRequest(dataset=r.id, tokens=pb.TOKENS_ALL, order=order,
                                   batch_size=77, seed=4, epochs=1)
            for m in stub.Stream(req, timeout=60):
                assert not m.HasField("slot") and m.d_model == r.D
                rows.extend(r.rows(np.frombuffer(m.vectors, "<f4").reshape(m.rows, r.D),
                                   np.frombuffer(m.example_idx, "<i8"),
                                   np.frombuffer(m.token_idx, "<i4"),
                                   np.frombuffer(m.layer, "<i8"),
                                   np.frombuffer(m.labels, np.uint8)))
            assert_exact_epoch(rows, r.selection(None, "all"), f"order {order}")
