"""The daemon's /metrics page against the real Prometheus tools (Debian's
prometheus package), not a hand-made parser: `promtool check metrics` lints
the page, and a Prometheus server scrapes a shardcastd with streams open
and evaluates every query of the Grafana dashboard
(deploy/grafana/shardcast-dashboard.json) through its HTTP API; each must
return series.

A real shardcastd (SHARDCASTD_BIN) serves a small synthetic dataset to two
endless shuffled streams (one over shared memory, one over gRPC messages)
that threads keep reading while Prometheus scrapes every 0.5 s, and one call
fails (an unknown dataset), so that the per-client, per-scan, per-connection
and error series exist. The dashboard's variables get the values Grafana
gives them: $instance its "All" value, $__rate_interval 10 s.
"""

import json
import re
import shutil
import socket
import subprocess
import threading
import time
import urllib.parse

import pytest

from sysprobe import http_get
from test_deploy_dashboard import daemon_with_http, load_dashboard, targets

import shardcast

PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")
DEADLINE = 90.0  # the module's daemon and Prometheus: killed after this
RATE_INTERVAL = "10s"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Reader(threading.Thread):
    """Reads an endless stream until told to stop, a little at a time."""

    def __init__(self, stream):
        super().__init__(daemon=True)
        self.stream, self.stop, self.error, self.batches = stream, threading.Event(), None, 0

    def run(self):
        try:
            for _ in self.stream:
                self.batches += 1
                if self.stop.wait(0.02):
                    return
        except BaseException as e:  # noqa: BLE001 - checked by the test
            self.error = e


@pytest.fixture(scope="module")
def daemon_with_streams(tmp_path_factory):
    """(daemon, HTTP admin port) while two endless streams are read."""
    with daemon_with_http(tmp_path_factory.mktemp("prom"), deadline=DEADLINE) as (
            daemon, port, dataset):
        readers = []
        try:
            with shardcast.Client(daemon.address) as client:
                with pytest.raises(shardcast.Error):  # the error series
                    client.get_vectors("no-such-dataset", [(0, 6, 0)])
                with client.stream(dataset.name, layer=6, batch_size=64, seed=1, epochs=0,
                                   copy=True) as shm_stream, \
                        client.stream(dataset.name, layer=6, batch_size=64, seed=2,
                                      epochs=0, copy=True,
                                      shared_memory=False) as grpc_stream:
                    readers = [Reader(shm_stream), Reader(grpc_stream)]
                    for r in readers:
                        r.start()
                    # Each stream has sent a batch (its series exist) before
                    # the page is read: opening a stream returns before the
                    # daemon has it (slow under ASan on 2 busy cores).
                    deadline = time.monotonic() + 60
                    while (any(r.batches == 0 and r.error is None for r in readers) and
                           time.monotonic() < deadline):
                        time.sleep(0.05)
                    yield daemon, port
                    for r in readers:
                        r.stop.set()
                    for r in readers:
                        r.join(timeout=10)
            for r in readers:
                assert r.error is None, f"a stream failed: {r.error!r}"
                assert r.batches > 0
        finally:
            for r in readers:
                r.stop.set()


@pytest.mark.skipif(PROMTOOL is None, reason="promtool is missing (bash deploy/install-deps.sh)")
def test_promtool_finds_nothing_to_lint_on_the_metrics_page(daemon_with_streams):
    _, port = daemon_with_streams
    status, text = http_get(port, "/metrics")
    assert status == 200, text[:500]
    assert "shardcast_client_sent_bytes_total{" in text, "no stream's series on the page"
    proc = subprocess.run([PROMTOOL, "check", "metrics"], input=text.encode(),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=60)
    assert proc.returncode == 0 and not proc.stdout.strip(), (
        f"promtool check metrics (exit {proc.returncode}):\n{proc.stdout.decode()}")


def prometheus_query(port, expr):
    """The result list of an instant query, or an AssertionError with the
    server's error."""
    url = "/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    status, body = http_get(port, url)
    reply = json.loads(body)
    assert status == 200 and reply.get("status") == "success", (
        f"{expr!r}: HTTP {status}: {body[:500]}")
    return reply["data"]["result"]


def grafana_expr(expr):
    """The query as Grafana sends it: $instance is the variable's "All"
    value (allValue ".+"), $__rate_interval a few scrape intervals."""
    return expr.replace("$__rate_interval", RATE_INTERVAL).replace("$instance", ".+")


@pytest.mark.skipif(PROMETHEUS is None, reason="prometheus is missing (bash deploy/install-deps.sh)")
def test_prometheus_scrapes_the_daemon_and_every_dashboard_query_returns_series(
        daemon_with_streams, tmp_path):
    _, daemon_port = daemon_with_streams
    port = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 500ms\n  evaluation_interval: 1s\n"
        "scrape_configs:\n  - job_name: shardcast\n    static_configs:\n"
        f"      - targets: ['127.0.0.1:{daemon_port}']\n")
    log = open(tmp_path / "prometheus.log", "wb")
    proc = subprocess.Popen(
        [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
        stdout=log, stderr=log, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        up = []
        while time.monotonic() < deadline:
            assert proc.poll() is None, (
                f"prometheus exited {proc.returncode}:\n"
                f"{(tmp_path / 'prometheus.log').read_text()[-3000:]}")
            try:
                up = prometheus_query(port, 'count_over_time(up{job="shardcast"}[1m])')
            except (OSError, ValueError, AssertionError):
                up = []
            if up and float(up[0]["value"][1]) >= 8:  # 4 s of scrapes
                break
            time.sleep(0.25)
        assert up, "Prometheus never scraped the daemon"
        health = prometheus_query(port, 'up{job="shardcast"}')
        assert health and health[0]["value"][1] == "1", f"the scrape failed: {health}"
        empty = []
        queries = [t["expr"] for _, t in targets(load_dashboard())]
        assert len(queries) >= 30, f"only {len(queries)} queries in the dashboard"
        for expr in queries:
            if not prometheus_query(port, grafana_expr(expr)):
                empty.append(expr)
        assert not empty, (f"{len(empty)} of {len(queries)} dashboard queries return no "
                           f"series from a daemon with streams open:\n  " + "\n  ".join(empty))
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def test_status_carries_the_same_figures_as_the_metrics_page(daemon_with_streams):
    """Admin.GetStatus's figures (read with the package, whose status() is a
    generic conversion of the reply) are the /metrics page's families: the
    same names, kinds, help and series, in the same order; the figures are
    declared once (server/transport/figures.cc)."""
    daemon, port = daemon_with_streams
    with shardcast.Client(daemon.address) as client:
        figures = [vars(f) for f in client.status().figures]
        for f in figures:
            f["samples"] = [vars(s) for s in f["samples"]]
    status, page = http_get(port, "/metrics")
    assert status == 200
    families = re.findall(r"^# TYPE (\S+) (\S+)$", page, re.M)
    assert [(f["name"], f["kind"]) for f in figures] == families
    helps = dict(re.findall(r"^# HELP (\S+) (.*)$", page, re.M))
    series = set(re.findall(r"^([a-z_]+(?:\{.*\})?) \S+$", page, re.M))
    for f in figures:
        assert helps[f["name"]] == f["help"], f["name"]
        assert f["unit"] in ("bytes", "seconds", ""), f
        if f["unit"]:
            assert f["name"].endswith(f["unit"]) or \
                f["name"].endswith(f["unit"] + "_total"), f["name"]
        for s in f["samples"]:
            labels = ",".join(f'{k}="{v}"' for k, v in zip(f["label_names"], s["labels"]))
            name = f'{f["name"]}{{{labels}}}' if labels else f["name"]
            if f["name"].startswith(("shardcast_client_", "shardcast_stream_lag",
                                     "shardcast_scan_", "process_")):
                continue  # moving while the streams run (the name is checked above)
            assert name in series, f"{name} is in the status, not on the page"
    assert any(f["name"] == "shardcast_client_sent_bytes_total" and f["samples"]
               for f in figures), "no open stream's figure in the status"
