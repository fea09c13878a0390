"""grpc_stream_bench, the bare gRPC loop the warm-stream figures are ratios
against (tests/bench/run_matrix.sh): it moves the bytes it says it moved, and
with --fork it reports the server's CPU time apart from the clients'.

The binary is $GRPC_STREAM_BENCH_BIN (set by ctest), else
<repo>/build/grpc_stream_bench.
"""

import json
import os
import subprocess
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[3]
BENCH = Path(os.environ.get("GRPC_STREAM_BENCH_BIN",
                            REPO_ROOT / "build" / "grpc_stream_bench"))


def run(tmp_path, *args):
    if not BENCH.is_file():
        pytest.fail(f"{BENCH} is missing: cmake --build build -j2")
    proc = subprocess.run([str(BENCH), "--socket", str(tmp_path / "bare.sock"), *args, "--json"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.mark.parametrize("parse", [False, True])
def test_forked_clients_get_every_byte_and_the_server_cpu_is_its_own(tmp_path, parse):
    mib = 1 << 20
    extra = ["--parse-protobuf"] if parse else []
    r = run(tmp_path, "--message-bytes", "1M", "--messages", "24", "--clients", "2",
            "--fork", "--source-bytes", "4M", *extra)
    assert r["mode"] == ("protobuf" if parse else "raw") and r["processes"] is True
    assert r["source_bytes"] == 4 * mib
    assert len(r["clients"]) == 2
    for c in r["clients"]:
        assert c["messages"] == 24 and c["bytes"] == 24 * mib
        assert "error" not in c
        # Each client process's own CPU time: it read 24 MiB.
        assert 0 < c["cpu_seconds"] <= c["seconds"] * os.cpu_count() + 1
    total = 2 * 24 * mib
    assert r["server_cpu_seconds"] > 0
    assert r["server_cpu_ns_per_byte"] == pytest.approx(r["server_cpu_seconds"] * 1e9 / total)


def test_client_threads_report_no_cpu_split(tmp_path):
    # Clients as threads share the server's process: no CPU figure is given
    # rather than one that mixes both sides.
    r = run(tmp_path, "--message-bytes", "64K", "--messages", "10", "--clients", "2")
    assert r["processes"] is False
    assert [c["bytes"] for c in r["clients"]] == [10 * 65536] * 2
    assert all(c["cpu_seconds"] is None for c in r["clients"])
    assert r["server_cpu_seconds"] is None and r["server_cpu_ns_per_byte"] is None
