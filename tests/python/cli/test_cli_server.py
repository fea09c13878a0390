"""The CLI's daemon commands (`shardcast --server ADDRESS ...`) against a real
shardcastd: ls / info / get / status, checked against numpy reads of the same
files (saev_reference) and against the local `get` output."""

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

import saev_reference as ref

REPO = Path(__file__).resolve().parents[3]
DAEMON_BIN = Path(os.environ.get("SHARDCASTD_BIN") or REPO / "build" / "shardcastd")


@pytest.fixture(scope="module")
def served(cli, tmp_path_factory):
    """A daemon serving one synthetic dataset; yields (address, dataset dir)."""
    base = tmp_path_factory.mktemp("cli_server")
    root = base / "root"
    out = cli.json("synth", root, "--layers=-2,6", "--tokens", "12", "--cls",
                   "--d-model", "24", "--examples", "30", "--budget", "600",
                   "--seed", "5")
    sock = base / "run" / "sd.sock"
    log = open(base / "daemon.log", "wb")
    proc = subprocess.Popen([str(DAEMON_BIN), "--root", str(root), "--listen",
                             f"unix:{sock}"], stderr=log, stdout=log)
    for _ in range(500):
        if sock.exists():
            break
        time.sleep(0.01)
    assert sock.exists(), (base / "daemon.log").read_text()
    yield f"unix:{sock}", Path(out["path"])
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=15) == 0


def test_ls_lists_the_dataset_with_its_shape(cli, served):
    address, path = served
    listing = cli.json("--server", address, "ls")
    md, shards, geom = ref.open_dataset(path)
    [entry] = [d for d in listing if d["id"] == path.name]
    assert entry["ok"] is True
    assert entry["layers"] == md["layers"]
    assert entry["tokens_per_example"] == geom.T
    assert entry["d_model"] == geom.D
    assert entry["n_examples"] == geom.n_examples
    assert entry["examples_per_shard"] == geom.S
    assert entry["num_shards"] == sum(1 for s in shards if s["n_examples"] > 0)


def test_info_by_prefix_names_the_full_id(cli, served):
    address, path = served
    info = cli.json("--server", address, "info", path.name[:10])
    assert info["id"] == path.name
    assert info["hash_matches_dir"] is True


@pytest.mark.parametrize("example,layer,token", [(0, -2, 0), (29, 6, 12), (17, -2, 5)])
def test_get_equals_numpy_and_the_local_get(cli, served, example, layer, token):
    address, path = served
    _, _, geom = ref.open_dataset(path)
    args = ["get", "--example", example, "--layer", layer, "--token", token]
    remote = cli.json("--server", address, args[0], path.name, *args[1:], floats=True)
    expected = ref.read_vector(str(path), geom, example, layer, token)
    ref.assert_f32_equal(ref.json_floats_to_f32(remote), expected, "remote get")
    local = cli.ok(args[0], path, *args[1:], "--json")
    remote_text = cli.ok("--server", address, args[0], path.name, *args[1:], "--json")
    assert remote_text.out == local.out


def test_get_all_tokens_raw_equals_the_layer_slice_bytes(cli, served):
    address, path = served
    _, _, geom = ref.open_dataset(path)
    proc = cli.ok("--server", address, "get", path.name, "--example", "11",
                  "--layer", "6", "--all-tokens", "--raw")
    expected = ref.read_example_layer(str(path), geom, 11, 6)
    assert proc.stdout == expected.astype("<f4").tobytes()


def test_status_counts_calls_and_bytes(cli, served):
    address, path = served
    cli.ok("--server", address, "get", path.name, "--example", "1", "--layer", "6",
           "--token", "1")
    status = cli.json("--server", address, "status")
    assert status["calls_total"] >= 1
    assert status["bytes_served"] >= geom_vector_bytes(path)
    assert status["datasets_ok"] == 1


def geom_vector_bytes(path):
    return ref.open_dataset(path)[2].D * 4


def test_bad_requests_fail_cleanly_with_the_daemons_message(cli, served):
    address, path = served
    proc = cli.fails("--server", address, "get", path.name, "--example", "30",
                     "--layer", "6", "--token", "0")
    assert "example 30" in proc.err
    proc = cli.fails("--server", address, "get", path.name, "--example", "0",
                     "--layer", "7", "--token", "0")
    assert "layer 7" in proc.err
    proc = cli.fails("--server", address, "info", "ffffffffffffffff")
    assert "not found" in proc.err


def test_unreachable_daemon_is_a_clear_error(cli, tmp_path):
    proc = cli.fails("--server", f"unix:{tmp_path}/nothing.sock", "ls")
    assert "cannot connect" in proc.err


def test_local_commands_with_server_are_usage_errors(cli, served):
    address, _ = served
    proc = cli.fails("--server", address, "synth", "/tmp/x", code=2)
    assert "local files" in proc.err
    # Without --server or SHARDCAST_ADDRESS a daemon command goes to the
    # user's own daemon (started when needed: test_package_self_start.py);
    # where its directory is not the user's alone, it says so and fails.
    import tempfile
    with tempfile.TemporaryDirectory(prefix="scxdg-", dir="/tmp") as xdg:
        os.chmod(xdg, 0o700)
        os.mkdir(os.path.join(xdg, "shardcast"), 0o755)
        os.chmod(os.path.join(xdg, "shardcast"), 0o755)
        env = {k: v for k, v in os.environ.items()
               if k not in ("SHARDCAST_ADDRESS", "SHARDCAST_NO_AUTOSTART")}
        env["XDG_RUNTIME_DIR"] = xdg
        proc = subprocess.run([cli.binary, "ls"], capture_output=True, text=True,
                              env=env, timeout=60)
        assert proc.returncode == 1, proc.stderr
        assert os.path.join(xdg, "shardcast") in proc.stderr, proc.stderr
        assert "not a directory of yours closed to others" in proc.stderr
