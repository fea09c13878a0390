"""Transforms applied by shardcastd while it gathers a batch (issue 12):
bfloat16/float16 output, scale_norm and mean-centering, through the Python
package (shared memory and gRPC), the torch adapter and the CLI.

Oracles, none of them the project's code: torch's .to(torch.bfloat16) and
numpy's astype(float16) for the roundings; numpy (float64) over the dataset
files for the statistics; and the definition of scale_norm itself (the mean
L2 norm of what a trainer receives over an epoch is sqrt(d_model)).
"""

import json
import math
import subprocess

import grpc
import numpy as np
import pytest
import torch

from package_fixtures import (SHARDCAST_BIN, Reference, assert_exact_epoch,  # noqa: F401
                              datasets, package_logs, sockdir, start_daemon, synth)

import shardcast
from shardcast.v1 import shardcast_pb2 as pb
from shardcast.v1 import shardcast_pb2_grpc as pb_grpc

ALONE = ("--scan-start-delay-ms", "0")
LAYERS = (-2, 7)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Two datasets under one root: `with_stats` gets its sidecar from
    `shardcast stats`, `bare` has none (the daemon computes on first use)."""
    root = tmp_path_factory.mktemp("transforms")
    # Values far from zero-mean, so centering visibly matters.
    a = synth(root, "--layers", "-2,7", "--tokens", 15, "--cls", "--d-model", 64,
              "--examples", 24, "--budget", 16 * 2 * 10, "--labels", "--seed", 21)
    b = synth(root, "--layers", "-2,7", "--tokens", 15, "--cls", "--d-model", 64,
              "--examples", 12, "--budget", 16 * 2 * 10, "--seed", 22)
    proc = subprocess.run([str(SHARDCAST_BIN), "stats", str(a), "--json"],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=120)
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")
    assert (a / "shardcast_stats.json").is_file()
    return root, Reference(a), Reference(b)


def numpy_stats(ref, layer, tokens):
    """(mean vector, mean norm, mean norm of the centered vectors), float64,
    of one layer's token group, straight from the files."""
    li = ref.layers.index(layer)
    x = ref.acts[:, li, ref.token_axis(tokens), :].reshape(-1, ref.D).astype(np.float64)
    mean = x.mean(axis=0)
    return (mean, np.linalg.norm(x, axis=1).mean(),
            np.linalg.norm(x - mean, axis=1).mean())


def collect(stream, ref, layer):
    """Every batch of a stream: (rows [(e, l, t)], vectors stacked, dtypes,
    transforms); rows in delivery order."""
    rows, vectors, dtypes, transforms = [], [], set(), set()
    for b in stream:
        lay = b.layer if layer is None else np.full(b.rows, layer)
        t_axis = b.token_idx.astype(np.int64) + ref.cls
        rows.extend(zip(b.example_idx.tolist(), lay.tolist(), t_axis.tolist()))
        vectors.append(np.array(b.vectors, copy=True))
        dtypes.add(b.dtype)
        transforms.add(b.transform)
    return rows, np.concatenate(vectors), dtypes, transforms


def originals(ref, rows):
    ex = np.array([r[0] for r in rows])
    li = np.array([ref.layers.index(r[1]) for r in rows])
    t = np.array([r[2] for r in rows])
    return ref.acts[ex, li, t]


@pytest.mark.parametrize("shared_memory", [True, False], ids=["shm", "grpc"])
@pytest.mark.parametrize("order", ["shuffled", "ordered"])
def test_bfloat16_and_float16_round_like_torch_and_numpy(start_daemon, data, shared_memory,
                                                         order):
    root, ref, _ = data
    d = start_daemon(*ALONE, roots=[root])
    with shardcast.Client(d.address, shared_memory=shared_memory) as client:
        for dtype in ("bfloat16", "float16"):
            s = client.stream(ref.id, layer=7, tokens="all", order=order, batch_size=50,
                              seed=3, dtype=dtype)
            rows, got, dtypes, names = collect(s, ref, 7)
            assert s.shared_memory == shared_memory
            assert dtypes == {dtype} and names == {dtype}, (dtypes, names)
            assert_exact_epoch(rows, ref.selection(7, "all"), dtype)
            x = originals(ref, rows)
            if dtype == "bfloat16":
                assert got.dtype == np.uint16
                want = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy()
                assert np.array_equal(got.view(np.int16), want), "bfloat16 bits differ"
                widened = shardcast.bfloat16_to_float32(got)
                assert np.array_equal(widened, torch.from_numpy(x).to(torch.bfloat16)
                                      .float().numpy())
            else:
                assert got.dtype == np.float16
                assert np.array_equal(got.view(np.uint16), x.astype(np.float16).view(np.uint16))


def test_rounding_of_ties_overflow_and_subnormals_matches_torch_and_numpy(start_daemon,
                                                                         tmp_path):
    """A dataset written from hand-picked floats: ties at both parities,
    values past float16's range, float16 subnormals, infinities, -0."""
    root = tmp_path / "root"
    D = 16
    special = np.array([1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-11, 1 + 3 * 2**-11, 65504,
                        65519, 65520, 1e6, 2**-24, 2**-25, 3 * 2**-25, 2**-14, -0.0,
                        np.inf, -np.inf, 3.0e38], dtype=np.float32)
    rng = np.random.default_rng(5)
    acts = rng.standard_normal((4, 1, 3, D)).astype(np.float32) * np.float32(1000)
    acts[0, 0, 0] = special
    acts[1, 0, 1] = -special
    np.save(tmp_path / "acts.npy", acts)
    proc = subprocess.run([str(SHARDCAST_BIN), "write", str(root), "--from",
                           str(tmp_path / "acts.npy"),
                           "--layers", "3", "--json"], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, timeout=60)
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")
    dataset = json.loads(proc.stdout)["hash"]
    d = start_daemon(*ALONE, roots=[root])
    with shardcast.Client(d.address) as client:
        for dtype in ("bfloat16", "float16"):
            s = client.stream(dataset, layer=3, tokens="all", order="ordered",
                              batch_size=12, dtype=dtype)
            got = np.concatenate([np.array(b.vectors) for b in s])
            x = acts.reshape(-1, D)
            if dtype == "bfloat16":
                want = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy()
                assert np.array_equal(got.view(np.int16), want)
            else:
                with np.errstate(over="ignore"):
                    want = x.astype(np.float16)
                assert np.array_equal(got.view(np.uint16), want.view(np.uint16))


@pytest.mark.parametrize("center", [False, True], ids=["scale", "center+scale"])
@pytest.mark.parametrize("tokens", ["content", "all"])
def test_scale_norm_gives_a_mean_norm_of_sqrt_d(start_daemon, data, center, tokens):
    root, ref, _ = data
    d = start_daemon(*ALONE, roots=[root])
    layer = -2
    mean, mean_norm, centered_norm = numpy_stats(ref, layer, tokens)
    with shardcast.Client(d.address) as client:
        s = client.stream(ref.id, layer=layer, tokens=tokens, batch_size=64, seed=9,
                          scale_norm=True, center=center)
        rows, got, dtypes, names = collect(s, ref, layer)
    assert_exact_epoch(rows, ref.selection(layer, tokens), "scaled epoch")
    assert dtypes == {"float32"}
    (name,) = names
    assert name.startswith("center, scale_norm, float32" if center else "scale_norm, float32")
    assert "shardcast_stats.json" in name, name
    y = got.astype(np.float64)
    # The definition: mean L2 norm over the epoch is sqrt(D).
    assert math.isclose(np.linalg.norm(y, axis=1).mean(), math.sqrt(ref.D), rel_tol=1e-5)
    x = originals(ref, rows).astype(np.float64)
    if center:
        assert np.abs(y.mean(axis=0)).max() < 1e-4, "centered vectors do not average to 0"
        want = (x - mean) * (math.sqrt(ref.D) / centered_norm)
    else:
        want = x * (math.sqrt(ref.D) / mean_norm)
    np.testing.assert_allclose(y, want, rtol=2e-6, atol=1e-5)


def test_center_alone_over_all_layers_uses_each_layers_mean(start_daemon, data):
    root, ref, _ = data
    d = start_daemon(*ALONE, roots=[root])
    with shardcast.Client(d.address) as client:
        s = client.stream(ref.id, layer=None, tokens="content", order="ordered",
                          batch_size=100, center=True, dtype="float16")
        rows, got, dtypes, _ = collect(s, ref, None)
    assert_exact_epoch(rows, ref.selection(None, "content"))
    assert dtypes == {"float16"}
    x = originals(ref, rows)
    lay = np.array([r[1] for r in rows])
    for layer in LAYERS:
        mean, _, _ = numpy_stats(ref, layer, "content")
        sel = lay == layer
        want = (x[sel].astype(np.float64) - mean)
        np.testing.assert_allclose(got[sel].astype(np.float64), want, rtol=2e-3, atol=2e-3)


def test_statistics_are_computed_on_first_use_without_a_sidecar(start_daemon, data):
    root, _, bare = data
    assert not (bare.path / "shardcast_stats.json").exists()
    d = start_daemon(*ALONE, roots=[root])
    with shardcast.Client(d.address) as client:
        s = client.stream(bare.id, layer=7, batch_size=40, scale_norm=True)
        rows, got, _, names = collect(s, bare, 7)
    assert names == {"scale_norm, float32 (statistics computed on first use)"}, names
    assert math.isclose(np.linalg.norm(got.astype(np.float64), axis=1).mean(),
                        math.sqrt(bare.D), rel_tol=1e-5)
    log = d.log.read_text()
    assert "computing its statistics" in log and bare.id in log
    # The daemon never writes into its roots.
    assert not (bare.path / "shardcast_stats.json").exists()


def test_a_tampered_sidecar_fails_the_stream_naming_the_file(start_daemon, tmp_path):
    root = tmp_path / "root"
    path = synth(root, "--layers", "1", "--tokens", 4, "--d-model", 16, "--examples", 6,
                 "--budget", 24, "--seed", 2)
    proc = subprocess.run([str(SHARDCAST_BIN), "stats", str(path)], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, timeout=60)
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")
    sidecar = path / "shardcast_stats.json"
    doc = json.loads(sidecar.read_text())
    doc["layers"][0]["content"]["mean_norm"] *= 2  # checksum no longer matches
    sidecar.write_text(json.dumps(doc))
    d = start_daemon(*ALONE, roots=[root])
    with shardcast.Client(d.address) as client:
        with pytest.raises(shardcast.Error) as e:
            list(client.stream(path.name, layer=1, batch_size=8, scale_norm=True))
        assert e.value.code == "DATA_LOSS", e.value
        assert "shardcast_stats.json" in str(e.value)
        # Plain streams of the same dataset are unaffected.
        assert sum(b.rows for b in client.stream(path.name, layer=1, batch_size=8)) == 24


def test_bad_transform_requests_are_invalid_argument(start_daemon, data):
    root, ref, _ = data
    d = start_daemon(*ALONE, roots=[root])
    with shardcast.Client(d.address) as client:
        with pytest.raises(shardcast.Error) as e:
            client.stream(ref.id, layer=7, dtype="int8")
        assert e.value.code == "INVALID_ARGUMENT"
    with grpc.insecure_channel(d.address) as ch:
        stub = pb_grpc.StreamStub(ch)
        req = pb.StreamRequest(dataset=ref.id, layer=7, batch_size=4)
        req.dtype = 7  # an enum value the daemon does not know
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Stream(req))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "dtype" in e.value.details()


def test_stock_stub_receives_bfloat16_bytes(start_daemon, data):
    """The wire contract: Batch.dtype and Batch.vectors of 2-byte elements,
    readable by a client generated from the .proto alone."""
    root, ref, _ = data
    d = start_daemon(*ALONE, roots=[root])
    with grpc.insecure_channel(d.address) as ch:
        stub = pb_grpc.StreamStub(ch)
        req = pb.StreamRequest(dataset=ref.id, layer=-2, batch_size=30,
                               order=pb.ORDER_ORDERED, dtype=pb.DTYPE_BFLOAT16)
        first = next(iter(stub.Stream(req)))
    assert first.dtype == pb.DTYPE_BFLOAT16 and first.transform == "bfloat16"
    assert len(first.vectors) == first.rows * ref.D * 2
    x = originals(ref, [(e, -2, t + ref.cls) for e, t in
                        zip(np.frombuffer(first.example_idx, "<i8").tolist(),
                            np.frombuffer(first.token_idx, "<i4").tolist())])
    want = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy()
    assert np.array_equal(np.frombuffer(first.vectors, "<i2").reshape(want.shape), want)


def test_torch_adapter_yields_bfloat16_tensors(start_daemon, data):
    from shardcast.torch import ShardcastDataset
    root, ref, _ = data
    d = start_daemon(*ALONE, roots=[root])
    ds = ShardcastDataset(ref.id, address=d.address, layer=7, batch_size=64, seed=1,
                          dtype="bfloat16", scale_norm=True, copy=True)
    loader = torch.utils.data.DataLoader(ds, batch_size=None)
    rows, tensors = [], []
    for item in loader:
        assert item["vectors"].dtype == torch.bfloat16
        tensors.append(item["vectors"])
        rows.extend(zip(item["example_idx"].tolist(), [7] * len(item["example_idx"]),
                        (item["token_idx"] + ref.cls).tolist()))
    assert_exact_epoch(rows, ref.selection(7, "content"))
    y = torch.cat(tensors).float().numpy().astype(np.float64)
    _, mean_norm, _ = numpy_stats(ref, 7, "content")
    x = originals(ref, rows).astype(np.float64)
    # bfloat16 keeps 8 bits of mantissa: relative error <= 2^-8.
    np.testing.assert_allclose(y, x * (math.sqrt(ref.D) / mean_norm), rtol=2**-8, atol=1e-6)


def test_cli_stream_applies_the_transform_and_checks_membership(start_daemon, data):
    root, ref, _ = data
    d = start_daemon(*ALONE, roots=[root])
    proc = subprocess.run([str(SHARDCAST_BIN), "--server", d.address, "stream", ref.id,
                           "--layer", "7", "--order", "shuffled", "--batch-size", "32",
                           "--dtype", "bfloat16", "--scale-norm", "--center", "--check",
                           "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")
    out = json.loads(proc.stdout)
    n = len(ref.selection(7, "content"))
    assert out["vectors"] == n and out["bytes"] == n * ref.D * 2, out
    bad = subprocess.run([str(SHARDCAST_BIN), "--server", d.address, "stream", ref.id,
                          "--dtype", "float64"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, timeout=60)
    assert bad.returncode == 2 and b"--dtype" in bad.stderr


def test_a_bad_request_is_refused_before_any_statistics_are_computed(start_daemon, data):
    """Computing statistics reads the whole dataset: a request that is bad
    anyway (rank outside world_size, CLS of a dataset without one) must be
    refused at once, without that read."""
    root, _, bare = data
    d = start_daemon(*ALONE, roots=[root])
    with shardcast.Client(d.address) as client:
        with pytest.raises(shardcast.Error) as e:
            list(client.stream(bare.id, layer=7, batch_size=8, rank=3, world_size=2,
                               scale_norm=True))
        assert e.value.code == "INVALID_ARGUMENT" and "rank" in str(e.value)
        with pytest.raises(shardcast.Error) as e:
            list(client.stream(bare.id, layer=5, batch_size=8, center=True))
        assert e.value.code == "INVALID_ARGUMENT" and "layer" in str(e.value)
    assert "computing its statistics" not in d.log.read_text()
