"""lmprobe 2.0 directories (seed 003) served by shardcastd straight from
their safetensors shards: listed, random access, shuffled and ordered
streams (exact epochs), transforms, and the errors a bad directory gets.

The directories are written here with numpy + json (safetensors_reference,
from the formats' descriptions); every expected vector is the array that was
written. Mapping under test: example i = row i of each layer's tensors over
the shards in order, one token per example, layer value as recorded.
"""

import json
import math
import os
import subprocess

import numpy as np
import pytest

from package_fixtures import (SHARDCAST_BIN, assert_exact_epoch, datasets,  # noqa: F401
                              package_logs, sockdir, start_daemon, synth)
from safetensors_reference import lmprobe_name, write_lmprobe

import shardcast

ALONE = ("--scan-start-delay-ms", "0")
DIM = 64


class Probe:
    """An lmprobe directory and its vectors per layer, [rows, dim]."""

    def __init__(self, root, name, **kwargs):
        self.path = root / name
        self.id = name
        self.written = write_lmprobe(str(self.path), dim=DIM, **kwargs)
        self.layers = list(kwargs["layers"])
        nshards = len(kwargs["shards"])
        self.by_layer = {l: np.concatenate([self.written[(l, s)][0] for s in range(nshards)])
                         for l in self.layers}
        self.n = self.by_layer[self.layers[0]].shape[0]

    def selection(self, layer=None):
        layers = self.layers if layer is None else [layer]
        return [(e, l, 0) for e in range(self.n) for l in layers]

    def values(self, rows):
        return np.stack([self.by_layer[l][e] for e, l, _ in rows])


@pytest.fixture(scope="module")
def probes(tmp_path_factory):
    root = tmp_path_factory.mktemp("lmprobe-root")
    pooled = Probe(root, "probe-pooled", storage="pooled", layers=[3, 8, 15],
                   shards=[(40, 40), (0, 0), (27, 27)], seed=1)
    seq = Probe(root, "probe-fullseq", storage="full_sequence", layers=[0, 5],
                shards=[(6, 6), (6, 6), (0, 50), (0, 31)], last_token_shards=2, seed=2)
    noinfo = Probe(root, "probe-noinfo", storage="pooled", layers=[1, 2],
                   shards=[(9, 9), (4, 4)], with_info=False, seed=3)
    write_lmprobe(str(root / "probe-f16"), storage="pooled", layers=[0], dim=8,
                  shards=[(3, 3)], np_dtype="<f2")
    saev = synth(root, "--layers", "1", "--tokens", 4, "--d-model", 16, "--examples", 6,
                 "--budget", 24, "--seed", 5)
    return root, pooled, seq, noinfo, saev


def test_lmprobe_directories_are_listed_beside_saev_datasets(start_daemon, probes):
    root, pooled, seq, noinfo, saev = probes
    d = start_daemon(roots=[root])
    with shardcast.Client(d.address) as client:
        listed = {x.id: x for x in client.datasets()}
    assert set(listed) == {pooled.id, seq.id, noinfo.id, "probe-f16", saev.name}
    for p in (pooled, seq, noinfo):
        info = listed[p.id]
        assert info.ok, info.error
        assert info.variant == "lmprobe"
        assert list(info.layers) == p.layers
        assert info.d_model == DIM and info.tokens_per_example == 1
        assert info.content_tokens == 1 and not info.cls_token and not info.has_labels
        assert info.n_examples == p.n
        assert info.bytes == p.n * len(p.layers) * DIM * 4
        assert any("parquet index" in w for w in info.warnings), info.warnings
    assert listed[pooled.id].protocol == "lmprobe 2.0"
    assert any("full_sequence" in w for w in listed[seq.id].warnings)
    f16 = listed["probe-f16"]
    assert not f16.ok and "F16" in f16.error and "float32" in f16.error, f16.error
    assert listed[saev.name].ok


def test_random_access_reads_the_rows_written(start_daemon, probes):
    root, pooled, seq, _, _ = probes
    d = start_daemon(roots=[root])
    rng = np.random.default_rng(0)
    with shardcast.Client(d.address) as client:
        for p in (pooled, seq):
            coords = [(int(e), int(l), 0) for e, l in
                      zip(rng.integers(0, p.n, 50), rng.choice(p.layers, 50))]
            coords += [(p.n - 1, p.layers[-1], 0), (0, p.layers[0], 0)]
            got = client.get_vectors(p.id, coords)
            np.testing.assert_array_equal(got, p.values(coords))
            e = p.n // 2
            whole = client.get_example(p.id, e)
            assert whole.shape == (len(p.layers), 1, DIM)
            for li, l in enumerate(p.layers):
                np.testing.assert_array_equal(whole[li, 0], p.by_layer[l][e])
                one = client.get_example(p.id, e, layer=l)
                np.testing.assert_array_equal(one, p.by_layer[l][e][None])
        for bad, code in (([(0, pooled.layers[0], 1)], "OUT_OF_RANGE"),
                          ([(pooled.n, pooled.layers[0], 0)], "OUT_OF_RANGE"),
                          ([(0, 4, 0)], "INVALID_ARGUMENT")):
            with pytest.raises(shardcast.Error) as err:
                client.get_vectors(pooled.id, bad)
            assert err.value.code == code, (bad, err.value)


def test_single_vectors_read_directly_are_the_rows_written(start_daemon, probes):
    """One vector per call is read by the client itself from the tensor
    files (lmprobe's layer-major files, each tensor at its own offset, an
    empty shard between), for every row of every layer; the daemon handed
    over the descriptors and counted no call for them."""
    import re
    from sysprobe import metric_samples
    root, pooled, seq, _, _ = probes
    d = start_daemon("--http", "127.0.0.1:0", roots=[root])
    port = int(re.search(r"HTTP admin on 127\.0\.0\.1:(\d+)", d.log.read_text()).group(1))
    with shardcast.Client(d.address) as client:
        before = metric_samples(port)["shardcast_queries_local_total"]
        for p in (pooled, seq):
            for c in p.selection():
                got = client.get_vectors(p.id, [c])
                np.testing.assert_array_equal(got, p.values([c]), err_msg=f"{p.id} {c}")
        samples = metric_samples(port)
    assert samples["shardcast_queries_local_total"] == before
    assert samples["shardcast_direct_read_files_total"] >= 2


@pytest.mark.parametrize("shared_memory", [True, False], ids=["shm", "grpc"])
@pytest.mark.parametrize("order", ["shuffled", "ordered"])
@pytest.mark.parametrize("layer", [8, None], ids=["one-layer", "all-layers"])
def test_streams_deliver_every_row_once_per_epoch(start_daemon, probes, shared_memory,
                                                  order, layer):
    root, pooled, _, _, _ = probes
    d = start_daemon(*ALONE, roots=[root])
    with shardcast.Client(d.address, shared_memory=shared_memory) as client:
        s = client.stream(pooled.id, layer=layer, order=order, batch_size=13, epochs=2,
                          seed=4)
        epochs = {0: [], 1: []}
        for b in s:
            assert np.array_equal(b.token_idx, np.zeros(b.rows, np.int32))
            lay = b.layer if layer is None else np.full(b.rows, layer)
            rows = list(zip(b.example_idx.tolist(), lay.tolist(), [0] * b.rows))
            np.testing.assert_array_equal(b.vectors, pooled.values(rows))
            epochs[b.epoch].extend(rows)
    for e in (0, 1):
        assert_exact_epoch(epochs[e], pooled.selection(layer), f"epoch {e}")
    if order == "ordered":
        assert epochs[0] == sorted(epochs[0], key=lambda r: (r[0], pooled.layers.index(r[1])))


def test_two_ranks_split_a_full_sequence_dataset(start_daemon, probes):
    root, _, seq, _, _ = probes
    d = start_daemon(*ALONE, roots=[root])
    got = []
    with shardcast.Client(d.address) as client:
        for rank in (0, 1):
            for b in client.stream(seq.id, layer=5, batch_size=16, rank=rank, world_size=2,
                                   seed=7):
                rows = list(zip(b.example_idx.tolist(), [5] * b.rows, [0] * b.rows))
                np.testing.assert_array_equal(b.vectors, seq.values(rows))
                got.extend(rows)
    assert_exact_epoch(got, seq.selection(5), "ranks 0 and 1 together")


def test_scale_norm_over_an_lmprobe_layer(start_daemon, probes):
    root, _, _, noinfo, _ = probes
    d = start_daemon(*ALONE, roots=[root])
    with shardcast.Client(d.address) as client:
        s = client.stream(noinfo.id, layer=2, batch_size=5, scale_norm=True,
                          dtype="float16")
        got = np.concatenate([np.array(b.vectors, dtype=np.float64) for b in s])
    x = noinfo.by_layer[2].astype(np.float64)
    assert math.isclose(np.linalg.norm(got, axis=1).mean(), math.sqrt(DIM), rel_tol=2e-3)
    mean_norm = np.linalg.norm(x, axis=1).mean()
    assert math.isclose(np.linalg.norm(x * math.sqrt(DIM) / mean_norm, axis=1).mean(),
                        math.sqrt(DIM), rel_tol=1e-9)


def test_cli_stats_and_get_work_on_an_lmprobe_directory(probes):
    _, pooled, _, _, _ = probes
    out = subprocess.run([str(SHARDCAST_BIN), "get", str(pooled.path), "--example", "41",
                          "--layer", "15", "--token", "0", "--json"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=60)
    assert out.returncode == 0, out.stderr.decode(errors="replace")
    np.testing.assert_array_equal(np.array(json.loads(out.stdout), dtype=np.float32)
                                  .reshape(-1), pooled.by_layer[15][41])
    out = subprocess.run([str(SHARDCAST_BIN), "stats", str(pooled.path), "--json"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=60)
    assert out.returncode == 0, out.stderr.decode(errors="replace")
    stats = json.loads(out.stdout)["stats"]
    for entry in stats["layers"]:
        x = pooled.by_layer[entry["layer"]].astype(np.float64)
        g = entry["content"]
        assert g["count"] == pooled.n
        assert math.isclose(g["mean_norm"], np.linalg.norm(x, axis=1).mean(), rel_tol=1e-9)
        np.testing.assert_allclose(g["mean"], x.mean(axis=0), rtol=1e-9, atol=1e-12)


def test_a_truncated_tensor_file_rejects_only_that_dataset(start_daemon, tmp_path):
    root = tmp_path / "root"
    good = Probe(root, "good", storage="pooled", layers=[1], shards=[(5, 5)])
    bad = Probe(root, "bad", storage="pooled", layers=[1, 2], shards=[(5, 5), (4, 4)])
    victim = bad.path / lmprobe_name(2, 1)
    os.truncate(victim, os.path.getsize(victim) - DIM * 4)
    d = start_daemon(roots=[root])
    with shardcast.Client(d.address) as client:
        listed = {x.id: x for x in client.datasets()}
        assert listed[good.id].ok
        assert not listed[bad.id].ok and lmprobe_name(2, 1) in listed[bad.id].error
        with pytest.raises(shardcast.Error) as err:
            client.get_vectors(bad.id, [(0, 1, 0)])
        assert err.value.code == "FAILED_PRECONDITION"
        np.testing.assert_array_equal(client.get_vectors(good.id, [(4, 1, 0)])[0],
                                      good.by_layer[1][4])
