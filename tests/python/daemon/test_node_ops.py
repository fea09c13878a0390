"""What a sysadmin and a job script use on a node, against a real shardcastd:
`shardcast health`, `shardcast doctor` on a healthy and on broken setups,
$SHARDCAST_ADDRESS as the CLI's default daemon, JSON log lines (read with
Python's json module) naming each stream's client id, the same id in status
and /metrics, and the device-read counter next to the requested one.
"""

import json
import os
import re
import shutil
import socket
import subprocess
from pathlib import Path

import pytest

from package_fixtures import (proc_read_bytes, REJECTED_ID, SHARDCAST_BIN,  # noqa: F401
                              datasets, package_logs, sockdir, start_daemon, synth,
                              wait_for)

import shardcast
from sysprobe import evict, metric_samples


def cli(*args, env=None, timeout=60):
    cmd = [str(SHARDCAST_BIN)] + [str(a) for a in args]
    full_env = dict(os.environ)
    full_env.pop("SHARDCAST_ADDRESS", None)
    full_env.update(env or {})
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          timeout=timeout, env=full_env)
    proc.out = proc.stdout.decode(errors="replace")
    proc.err = proc.stderr.decode(errors="replace")
    proc.what = f"{' '.join(cmd)} -> {proc.returncode}\nstdout: {proc.out}\nstderr: {proc.err}"
    return proc


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------
# health and $SHARDCAST_ADDRESS

def test_health_is_serving_and_exit_0(start_daemon):
    d = start_daemon()
    proc = cli("--server", d.address, "health", "--json")
    assert proc.returncode == 0, proc.what
    assert json.loads(proc.out) == {"address": d.address, "status": "SERVING"}


def test_health_of_a_missing_daemon_fails_with_the_address(tmp_path):
    address = f"unix:{tmp_path}/none.sock"
    proc = cli("--server", address, "health", "--timeout", "1")
    assert proc.returncode == 1, proc.what
    assert "none.sock" in proc.err, proc.what
    bad = cli("--server", address, "health", "--timeout", "0")
    assert bad.returncode == 2 and "--timeout" in bad.err, bad.what


def test_daemon_commands_default_to_shardcast_address(start_daemon, datasets, tmp_path):
    d = start_daemon()
    env = {"SHARDCAST_ADDRESS": d.address}
    listing = cli("ls", "--json", env=env)
    assert listing.returncode == 0, listing.what
    ids = {entry["id"] for entry in json.loads(listing.out)}
    assert datasets.main.path.name in ids and REJECTED_ID in ids, ids
    assert cli("health", env=env).returncode == 0
    # info has a local meaning: without --server it reads the directory.
    local = cli("info", datasets.main.path, "--json", env=env)
    assert local.returncode == 0, local.what
    assert json.loads(local.out)["hash"] == datasets.main.path.name
    # Without the variable a daemon-only command goes to the user's own
    # daemon (test_package_self_start.py); one it cannot start says how to
    # name a daemon instead (here: no shardcastd beside the CLI or on PATH).
    lone = tmp_path / "lone"
    lone.mkdir()
    shutil.copy(SHARDCAST_BIN, lone / "shardcast")
    xdg = tmp_path / "xdg"
    xdg.mkdir(mode=0o700)
    proc = subprocess.run([str(lone / "shardcast"), "ls"], capture_output=True, text=True,
                          timeout=60, env={"PATH": "/usr/bin:/bin",
                                           "XDG_RUNTIME_DIR": str(xdg)})
    assert proc.returncode == 1, proc.stderr
    assert "SHARDCAST_ADDRESS" in proc.stderr and "--server" in proc.stderr, proc.stderr


def test_the_python_package_reads_shardcast_address(start_daemon, datasets, monkeypatch):
    d = start_daemon()
    monkeypatch.setenv("SHARDCAST_ADDRESS", d.address)
    with shardcast.Client() as client:
        assert client.status().version


# ---------------------------------------------------------------------------
# Logs, status and metrics name the same client

def test_json_logs_status_and_metrics_name_each_stream_by_its_client_id(
        start_daemon, datasets):
    port = free_port()
    d = start_daemon("--log-format", "json", "--http", f"127.0.0.1:{port}")
    main = datasets.main.path.name
    with shardcast.Client(d.address) as client:
        stream = client.stream(main, layer=6, order="shuffled", batch_size=32, epochs=0)
        it = iter(stream)
        for _ in range(3):
            next(it)
        status = cli("--server", d.address, "status", "--json")
        assert status.returncode == 0, status.what
        streams = json.loads(status.out)["streams"]
        [mine] = [s for s in streams if s["dataset"] == main]
        client_id = mine["client"]
        assert re.fullmatch(r"s[0-9]+", client_id), mine
        assert mine["order"] == "shuffled" and mine["transport"] == "shm", mine
        assert mine["batches"] >= 3 and mine["bytes"] >= 3 * 32 * 64 * 4, mine
        [scan] = json.loads(status.out)["scans"]
        assert [c["client"] for c in scan["clients"]] == [client_id], scan
        # Every field of the reply, by its proto name (Python's own
        # descriptor of shardcast.v1.ServerStatus), integers as numbers.
        from shardcast.v1 import shardcast_pb2
        fields = [f.name for f in shardcast_pb2.ServerStatus.DESCRIPTOR.fields]
        whole = json.loads(status.out)
        assert list(whole) == fields, (list(whole), fields)
        assert isinstance(whole["calls_total"], int) and whole["calls_total"] > 0
        text = cli("--server", d.address, "status")
        assert text.returncode == 0, text.what
        assert re.search(r"^calls_total +[1-9][0-9]*$", text.out, re.M), text.out
        assert re.search(rf"^stream {client_id} \(.*\): shuffled ", text.out,
                         re.M), text.out
        assert re.search(rf"^  client {client_id} ", text.out, re.M), text.out
        samples = metric_samples(port)
        sent = [v for k, v in samples.items()
                if k.startswith("shardcast_client_sent_bytes_total{")
                and f'client="{client_id}"' in k and 'transport="shm"' in k]
        assert sent and sent[0] >= 3 * 32 * 64 * 4, samples
        lag = [k for k in samples if k.startswith("shardcast_stream_lag_blocks{")]
        assert len(lag) == 1 and f'client="{client_id}"' in lag[0], lag
        stream.close()
    # The stream has ended: its series are gone.
    wait_for(lambda: not any(k.startswith("shardcast_client_sent_bytes_total{")
                             for k in metric_samples(port)), what="stream series to go")
    d.stop()
    lines = d.log.read_text().splitlines()
    events = [json.loads(line) for line in lines]  # every line is one object
    for e in events:
        assert set(e) >= {"ts", "level", "msg"}, e
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", e["ts"]), e
        assert e["level"] in ("debug", "info", "warning", "error"), e
    about = [e for e in events if e.get("client") == client_id]
    msgs = " | ".join(e["msg"] for e in about)
    assert any(e["msg"].startswith("stream opened") and e.get("dataset") == main
               for e in about), msgs
    assert any(e["msg"].startswith("stream ended") for e in about), msgs
    assert all("peer" in e for e in about), about


def test_text_logs_carry_the_client_id_as_a_field(start_daemon, datasets):
    d = start_daemon()
    with shardcast.Client(d.address) as client:
        batches = list(client.stream(datasets.plain.path.name, order="ordered",
                                     batch_size=16, copy=True))
        assert batches
    d.stop()
    text = d.log.read_text()
    opened = re.findall(r"INFO stream opened: .* client=(s[0-9]+) peer=\"pid ", text)
    ended = re.findall(r"INFO stream ended: .* client=(s[0-9]+) peer=\"pid ", text)
    assert opened and opened == ended, text[-3000:]


def test_device_read_bytes_follow_proc_io_next_to_requested_bytes(start_daemon, tmp_path):
    # A dataset of its own (8 MiB) evicted from the page cache, so its reads
    # reach the disk; /proc/<daemon>/io is read independently of the daemon.
    root = tmp_path / "cold"
    path = synth(root, "--layers", "3", "--tokens", 255, "--cls", "--d-model", 1024,
                 "--examples", 8, "--seed", 2)
    evict(path.glob("acts*.bin"))
    port = free_port()
    d = start_daemon("--http", f"127.0.0.1:{port}", roots=[root])
    before = proc_read_bytes(d.pid)
    with shardcast.Client(d.address) as client:
        n = sum(b.vectors.shape[0] for b in client.stream(
            path.name, order="ordered", batch_size=256, tokens="all", copy=True))
    assert n == 8 * 256
    samples = metric_samples(port)
    after = proc_read_bytes(d.pid)
    device = samples["shardcast_device_read_bytes_total"]
    assert samples["shardcast_read_requested_bytes_total"] == 8 * 256 * 1024 * 4, samples
    # The daemon reports what /proc says for it (sampled between two reads).
    assert before <= device <= after, (before, device, after)
    status = json.loads(cli("--server", d.address, "status", "--json").out)
    assert device <= status["device_read_bytes"] <= proc_read_bytes(d.pid), status


# ---------------------------------------------------------------------------
# doctor

def run_doctor(*args, env=None):
    proc = cli("doctor", *args, "--json", "--read-bytes", "1M", env=env)
    assert proc.returncode in (0, 1), proc.what
    report = json.loads(proc.out)
    verdicts = {c["check"]: c for c in report["checks"]}
    assert report["ok"] == (proc.returncode == 0), proc.what
    return proc, verdicts


def test_doctor_on_a_healthy_node_is_ready_and_names_the_rejected_dataset(
        start_daemon, datasets, tmp_path):
    d = start_daemon()
    config = tmp_path / "shardcastd.json"
    config.write_text(json.dumps({"roots": [str(datasets.root)], "listen": d.address,
                                  "reservoir_bytes": "64M"}))
    proc, v = run_doctor("--config", config)
    assert proc.returncode == 0, proc.what
    assert v["daemon"]["verdict"] == "warn", v  # it rejected one directory
    assert "SERVING" in v["daemon"]["detail"] and REJECTED_ID in v["daemon"]["detail"], v
    root = v[f"root {datasets.root}"]
    assert root["verdict"] == "warn" and REJECTED_ID in root["detail"], root
    assert "4 datasets sound, 1 rejected" in root["detail"], root
    for name in ("io_uring", "o_direct", "memory", "read"):
        assert v[name]["verdict"] in ("ok", "warn"), v[name]
    assert "MB/s" in v["read"]["detail"], v["read"]
    text = cli("doctor", "--config", config, "--read-bytes", "1M")
    assert text.returncode == 0 and "verdict: ready" in text.out, text.what


def test_doctor_fails_without_a_daemon_unless_told_none_is_expected(datasets, tmp_path):
    env = {"SHARDCAST_ADDRESS": f"unix:{tmp_path}/gone.sock"}
    proc, v = run_doctor("--root", datasets.root, env=env)
    assert proc.returncode == 1 and v["daemon"]["verdict"] == "FAIL", proc.what
    assert "gone.sock" in v["daemon"]["detail"], v["daemon"]
    proc, v = run_doctor("--root", datasets.root, "--no-daemon", env=env)
    assert proc.returncode == 0 and v["daemon"]["verdict"] == "warn", proc.what


def test_doctor_fails_on_an_unreadable_root_a_non_socket_and_too_little_memory(
        datasets, tmp_path):
    not_socket = tmp_path / "plain-file.sock"
    not_socket.write_text("")
    env = {"SHARDCAST_ADDRESS": f"unix:{not_socket}"}
    missing_root = tmp_path / "no-such-root"
    proc, v = run_doctor("--root", missing_root, "--root", datasets.root,
                         "--reservoir-bytes", "1000T", env=env)
    assert proc.returncode == 1, proc.what
    assert v["daemon"]["verdict"] == "FAIL" and "not a socket" in v["daemon"]["detail"], v
    bad_root = v[f"root {missing_root}"]
    assert bad_root["verdict"] == "FAIL" and "No such file" in bad_root["detail"], bad_root
    assert v[f"root {datasets.root}"]["verdict"] == "warn"  # the rejected one
    assert v["memory"]["verdict"] == "FAIL" and "too small" in v["memory"]["detail"], v
    usage = cli("doctor", "--reservoir-bytes", "lots")
    assert usage.returncode == 2 and "--reservoir-bytes" in usage.err, usage.what


def test_doctor_compares_the_socket_send_buffer_with_net_core_wmem_max(datasets, tmp_path):
    sysctl = Path("/proc/sys/net/core/wmem_max")
    if not sysctl.exists():
        pytest.skip("net.core.wmem_max is not visible in this network namespace")
    wmem_max = int(sysctl.read_text())
    env = {"SHARDCAST_ADDRESS": f"unix:{tmp_path}/none.sock"}

    def sockets(**config):
        path = tmp_path / "shardcastd.json"
        path.write_text(json.dumps({"roots": [str(datasets.root)], **config}))
        _, v = run_doctor("--config", path, "--no-daemon", env=env)
        return v["sockets"]

    # Asking for more than the cap: a warning that says how to lift it.
    above = sockets(socket_send_buffer=wmem_max + 4096)
    assert above["verdict"] == "warn", above
    assert f"sysctl -w net.core.wmem_max={wmem_max + 4096}" in above["detail"], above
    asked = wmem_max + 4096  # exact in the text, not rounded to MiB
    exact = f"{asked >> 20} MiB" if asked % (1 << 20) == 0 else f"{asked} bytes"
    assert f"asks {exact}" in above["detail"], above
    # Within the cap (written as the daemon's config accepts it), and 0.
    within = sockets(socket_send_buffer=f"{max(wmem_max // 1024, 1)}K")
    assert within["verdict"] == "ok" and "capped" not in within["detail"], within
    zero = sockets(socket_send_buffer=0)
    assert zero["verdict"] == "ok" and "kernel's default" in zero["detail"], zero
    assert "wmem_default" in zero["detail"], zero
    # Without the key: the daemon's default, 4 MiB.
    default = sockets()
    assert default["verdict"] == ("warn" if wmem_max < 4 << 20 else "ok"), default
    assert "asks 4 MiB" in default["detail"], default


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run doctor as another user")
def test_doctor_explains_a_socket_this_user_may_not_use(start_daemon, datasets):
    d = start_daemon()
    env = dict(os.environ, SHARDCAST_ADDRESS=d.address)

    def doctor_as_nobody():
        proc = subprocess.run(
            ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
             str(SHARDCAST_BIN), "doctor", "--no-daemon", "--json", "--read-bytes", "1M"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=60, env=env)
        assert proc.returncode == 1, proc.stderr.decode()
        return {c["check"]: c for c in json.loads(proc.stdout)["checks"]}["daemon"]

    # The socket's directory is private to root (mkdtemp: 0700).
    daemon = doctor_as_nobody()
    assert daemon["verdict"] == "FAIL", daemon
    assert "not searchable" in daemon["detail"], daemon
    # A searchable directory, a socket for its owner only.
    dir_mode = d.sock.parent.stat().st_mode & 0o7777
    try:
        os.chmod(d.sock.parent, 0o755)
        os.chmod(d.sock, 0o600)
        daemon = doctor_as_nobody()
    finally:
        os.chmod(d.sock, 0o660)
        os.chmod(d.sock.parent, dir_mode)
    assert daemon["verdict"] == "FAIL", daemon
    assert "no permission to connect" in daemon["detail"] and "mode 0600" in daemon["detail"], daemon
