"""Every stream kind and transport ends with DATA_LOSS naming the file when
a shard shrinks under it (issue 42, defect 6): shuffled streams whose
shared scan reads with O_DIRECT, through the page cache, or from memory
maps of the shards, and ordered streams; each in shared memory and in gRPC
messages. A retryable code (UNAVAILABLE) or a message without the file
would send a trainer to retry what cannot succeed.

Each case writes its own dataset (d_model 1024: 4 KiB vectors, so that the
scan may read with O_DIRECT), reads a batch, cuts every shard to 16 bytes
and reads on.
"""

import shutil

import pytest

from package_fixtures import (datasets, package_logs, sockdir, start_daemon,  # noqa: F401
                              synth)

import shardcast

CASES = [("shuffled", "direct"), ("shuffled", "buffered"), ("shuffled", "mapped"),
         ("ordered", "auto")]


@pytest.mark.parametrize("shared_memory", [True, False], ids=["shm", "grpc"])
@pytest.mark.parametrize("order,read_mode", CASES, ids=[f"{o}-{m}" for o, m in CASES])
def test_a_shard_cut_under_a_stream_ends_it_with_data_loss_naming_the_file(
        start_daemon, tmp_path, order, read_mode, shared_memory):
    root = tmp_path / "root"
    root.mkdir()
    ds = synth(root, "--layers", "0,1", "--tokens", 8, "--d-model", 1024,
               "--examples", 48, "--budget", 8 * 2 * 8, "--seed", 23)
    shards = sorted(ds.glob("acts*.bin"))
    assert len(shards) >= 3
    # Small blocks and one stream's reservation: most of the pass is read
    # after the cut.
    d = start_daemon("--scan-start-delay-ms", "0", "--read-mode", read_mode,
                     "--reservoir-bytes", "64M", "--block-bytes", "64K",
                     "--lag-blocks", "2", "--shuffle-window", "2",
                     "--query-threads", "2", roots=[str(root)], small=False)
    with shardcast.Client(d.address) as c:
        with c.stream(ds.name, layer=1, order=order, batch_size=16, epochs=0, seed=4,
                      shared_memory=shared_memory) as s:
            assert s.shared_memory == shared_memory
            next(s)
            for shard in shards:
                with open(shard, "r+b") as f:
                    f.truncate(16)
            with pytest.raises(shardcast.Error) as e:
                for _ in range(100_000):
                    next(s)
    assert e.value.code == "DATA_LOSS", (e.value.code, e.value.message)
    assert "acts0000" in e.value.message, e.value.message
    assert str(root) in e.value.message, e.value.message
    with shardcast.Client(d.address) as c:
        assert c.status().datasets_ok == 1  # the daemon is up and answers
    shutil.rmtree(root)
