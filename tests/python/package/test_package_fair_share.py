"""Fair shares on the local channel (docs/security.md): one user cannot take
every connection or the reservoir through shared-memory regions, and a
client the shared-memory path refuses still gets its data, in gRPC
messages, saying so once.

Expected rows come from numpy reads of the files (package_fixtures
.Reference); the caps and counts from the flags the test gives.
"""

import logging
import os
import socket
import subprocess
import time

from package_fixtures import (Reference, assert_exact_epoch, datasets,  # noqa: F401
                              package_logs, sockdir, start_daemon)

import shardcast
from shardcast import _local

ALONE = ("--scan-start-delay-ms", "0")


def epoch(reference, stream, layer):
    rows = []
    for b in stream:
        rows.extend(reference.batch_rows(b, layer))
    return rows


def test_a_stream_past_the_users_region_cap_comes_in_messages(start_daemon, datasets,
                                                              caplog):
    """With --max-region-bytes-per-user below one region, the region is
    refused (naming the cap and what the user holds) and the stream is
    served in gRPC messages: an exact epoch, said once at info level."""
    r = datasets.main
    d = start_daemon(*ALONE, "--max-region-bytes-per-user", "64K")
    with shardcast.Client(d.address) as c:
        with caplog.at_level(logging.INFO, logger="shardcast"):
            for _ in range(2):
                with c.stream(r.id, layer=12, batch_size=512, epochs=1, seed=3) as s:
                    assert not s.shared_memory
                    assert_exact_epoch(epoch(r, s, 12), r.selection(12))
    said = [m for m in caplog.messages if "shared memory is not available" in m]
    assert len(said) == 1, caplog.messages
    assert "RESOURCE_EXHAUSTED" in said[0] and "one user may hold" in said[0], said[0]
    assert "--max-region-bytes-per-user" in said[0], said[0]


def test_the_cli_falls_back_to_messages_too(start_daemon, datasets):
    """`shardcast stream --check` (the C++ client) past the same cap: the
    check passes over gRPC messages, and stderr says why once."""
    from package_fixtures import SHARDCAST_BIN
    r = datasets.main
    d = start_daemon(*ALONE, "--max-region-bytes-per-user", "64K")
    out = subprocess.run([str(SHARDCAST_BIN), "--server", d.address, "stream", r.id,
                          "--layer", "6", "--batch-size", "512", "--epochs", "1",
                          "--check"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "check: ok" in out.stdout + out.stderr
    assert out.stderr.count("shared memory is not available") == 1, out.stderr


def test_one_users_connections_are_capped_and_a_silent_one_is_closed(start_daemon, datasets):
    """--max-connections-per-user 2: a third connection's first request is
    answered RESOURCE_EXHAUSTED naming the limit and the count; a stream
    opened meanwhile still runs, in messages. A connection that never
    asks is closed (the daemon's first-request deadline, 10 s)."""
    r = datasets.main
    d = start_daemon(*ALONE, "--max-connections-per-user", "2")
    path = _local.socket_path(d.address)
    held = [_local.BatchRegion(path, 2, 4096) for _ in range(2)]
    try:
        try:
            _local.BatchRegion(path, 2, 4096)
            raise AssertionError("a third connection was served")
        except _local.Refused as e:
            assert e.code == 8, (e.code, e.message)  # RESOURCE_EXHAUSTED
            assert f"uid {os.getuid()} has 2 local channel connections open" in e.message
            assert "--max-connections-per-user 2" in e.message, e.message
        with shardcast.Client(d.address) as c:
            with c.stream(r.id, layer=6, batch_size=64, epochs=1, seed=1) as s:
                assert not s.shared_memory
                assert_exact_epoch(epoch(r, s, 6), r.selection(6))
    finally:
        for region in held:
            region.close()
    silent = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    silent.connect(path)
    silent.settimeout(30)
    start = time.monotonic()
    assert silent.recv(1) == b"", "the daemon never closed a silent connection"
    assert 9 <= time.monotonic() - start < 20
    silent.close()


def test_one_users_streams_are_capped(start_daemon, datasets):
    """--max-streams-per-user 2: a third stream of the same user is refused
    RESOURCE_EXHAUSTED naming the cap and the user's count, and the two keep
    streaming exact epochs; once one has ended, a new one opens."""
    r = datasets.main
    d = start_daemon(*ALONE, "--max-streams-per-user", "2")
    with shardcast.Client(d.address) as c:
        first = c.stream(r.id, layer=6, batch_size=64, epochs=1, seed=1)
        second = c.stream(r.id, layer=6, batch_size=64, epochs=1, seed=2)
        rows = [[], []]
        for i, s in enumerate((first, second)):  # both open and streaming
            rows[i].extend(r.batch_rows(next(iter(s)), 6))
        try:
            with c.stream(r.id, layer=6, batch_size=64, epochs=1, seed=3) as third:
                next(iter(third))
            raise AssertionError("a third stream was served")
        except shardcast.Error as e:
            assert e.code == "RESOURCE_EXHAUSTED", (e.code, e.message)
            assert f"uid {os.getuid()} has 2 streams open" in e.message, e.message
            assert "--max-streams-per-user 2" in e.message, e.message
        for i, s in enumerate((first, second)):
            rows[i].extend(epoch(r, s, 6))
            assert_exact_epoch(rows[i], r.selection(6))
            s.close()
        with c.stream(r.id, layer=6, batch_size=64, epochs=1, seed=4) as again:
            assert_exact_epoch(epoch(r, again, 6), r.selection(6))
