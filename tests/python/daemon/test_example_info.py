"""Query.GetExampleInfo: the records `shardcast import pkl` keeps in
samples.json, served by shardcastd one example at a time (issue 12). The
source is written by Python (pkl_reference.make_source); the expected
records are the fields that fixture pickled, never the project's output.
"""

import json
import subprocess

import grpc
import numpy as np
import pytest

from package_fixtures import (SHARDCAST_BIN, datasets, package_logs, sockdir,  # noqa: F401
                              start_daemon, synth)
from pkl_reference import make_source

import shardcast
from shardcast.v1 import shardcast_pb2 as pb
from shardcast.v1 import shardcast_pb2_grpc as pb_grpc


@pytest.fixture
def imported(tmp_path):
    src = make_source(tmp_path / "src", seq_lens=((5, 3, 8), (2, 6), (4,)))
    root = tmp_path / "root"
    root.mkdir()
    proc = subprocess.run([str(SHARDCAST_BIN), "import", "pkl", src.path, str(root), "--json"],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=120)
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")
    out = json.loads(proc.stdout)
    plain = synth(root, "--layers", "1", "--tokens", 4, "--d-model", 8, "--examples", 3,
                  "--budget", 12, "--seed", 1)
    return src, root, out["hash"], plain


def test_every_example_has_the_record_it_was_imported_from(start_daemon, imported):
    src, root, dataset, plain = imported
    d = start_daemon(roots=[root])
    with shardcast.Client(d.address) as client:
        assert client.describe(dataset).has_example_info
        assert not client.describe(plain.name).has_example_info
        for e, sample in enumerate(src.samples):
            got = client.get_example_info(dataset, e)
            assert got["example"] == e
            assert got["sample_idx"] == sample["sample_idx"]
            assert got["dataset_idx"] == sample["dataset_idx"]
            assert got["seq_len"] == sample["seq_len"]
            assert got["shard"] == sample["shard"]
            assert got["text_preview"] == sample["text_preview"]
            assert got["metadata"]["token_count"] == sample["seq_len"]
        for bad in (-1, len(src.samples)):
            with pytest.raises(shardcast.Error) as err:
                client.get_example_info(dataset, bad)
            assert err.value.code == "OUT_OF_RANGE", err.value
        with pytest.raises(shardcast.Error) as err:
            client.get_example_info(plain.name, 0)
        assert err.value.code == "NOT_FOUND" and "samples.json" in str(err.value)


def test_a_stock_stub_reads_the_record(start_daemon, imported):
    src, root, dataset, _ = imported
    d = start_daemon(roots=[root])
    with grpc.insecure_channel(d.address) as ch:
        reply = pb_grpc.QueryStub(ch).GetExampleInfo(
            pb.GetExampleInfoRequest(dataset=dataset, example=4))
    assert reply.example == 4
    assert json.loads(reply.json)["sample_idx"] == src.samples[4]["sample_idx"]


def test_a_damaged_samples_file_is_data_loss_naming_it(start_daemon, imported):
    src, root, dataset, _ = imported
    path = root / dataset / "samples.json"
    lines = path.read_text().split("\n")
    path.write_text("\n".join(lines[:3] + lines[4:]))  # one record gone
    d = start_daemon(roots=[root])
    with shardcast.Client(d.address) as client:
        with pytest.raises(shardcast.Error) as err:
            client.get_example_info(dataset, 0)
        assert err.value.code == "DATA_LOSS" and "samples.json" in str(err.value)
        # The vectors are still served.
        assert client.get_vectors(dataset, [(0, src.layers[0], 0)]).shape == (1, src.hidden)


def test_a_record_edited_out_of_place_is_data_loss(start_daemon, imported):
    src, root, dataset, _ = imported
    path = root / dataset / "samples.json"
    lines = path.read_text().split("\n")
    lines[2], lines[3] = lines[3].rstrip(",") + ",", lines[2]  # examples 1 and 2 swapped
    path.write_text("\n".join(lines))
    d = start_daemon(roots=[root])
    with shardcast.Client(d.address) as client:
        assert client.get_example_info(dataset, 0)["example"] == 0
        with pytest.raises(shardcast.Error) as err:
            client.get_example_info(dataset, 1)
        assert err.value.code == "DATA_LOSS", err.value


def test_crlf_line_ends_are_read_too(start_daemon, imported):
    """A samples.json that went through a tool writing CRLF still serves."""
    src, root, dataset, _ = imported
    path = root / dataset / "samples.json"
    path.write_bytes(path.read_bytes().replace(b"\n", b"\r\n"))
    d = start_daemon(roots=[root])
    with shardcast.Client(d.address) as client:
        for e, sample in enumerate(src.samples):
            assert client.get_example_info(dataset, e)["sample_idx"] == sample["sample_idx"]


@pytest.mark.parametrize("shared_memory", [True, False], ids=["shm", "grpc"])
def test_an_imported_dataset_streams_its_real_tokens(start_daemon, imported, shared_memory):
    """Seed 002 through the daemon: a shuffled epoch with the padding label
    excluded delivers exactly each sample's real tokens, with the values the
    fixture pickled (and its record says the sequence length)."""
    src, root, dataset, _ = imported
    d = start_daemon("--scan-start-delay-ms", "0", roots=[root])
    layer = src.layers[1]
    want = {(e, t): s["acts"][layer][t] for e, s in enumerate(src.samples)
            for t in range(s["seq_len"])}
    got = {}
    with shardcast.Client(d.address, shared_memory=shared_memory) as client:
        for b in client.stream(dataset, layer=layer, tokens="all", batch_size=5, seed=2,
                               exclude_labels=[255]):
            assert set(b.labels.tolist()) <= {0}
            for e, t, v in zip(b.example_idx.tolist(), b.token_idx.tolist(), b.vectors):
                assert (e, t) not in got, f"({e}, {t}) twice"
                got[(e, t)] = np.array(v)
        for e, s in enumerate(src.samples):
            assert client.get_example_info(dataset, e)["seq_len"] == s["seq_len"]
    assert set(got) == set(want)
    for key, v in want.items():
        np.testing.assert_array_equal(got[key], v)
