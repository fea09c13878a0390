"""The Grafana dashboard (deploy/grafana/shardcast-dashboard.json) against
the metrics a real shardcastd exports.

The dashboard is read with the json module and every PromQL `expr` taken
apart: the metric names it uses, the labels it groups, filters and labels
its legends by. A real shardcastd (SHARDCASTD_BIN) serves a small synthetic
dataset to two open shuffled streams (one over shared memory, one over gRPC
messages), so that the per-client, per-scan and per-connection series exist,
and its /metrics page is scraped and parsed (HELP, TYPE, samples). Then:
every metric and label the dashboard names is exported, rate() is only taken
of counters, the exported names follow Prometheus' conventions, and the
panels cover what operators look for (throughput per client, disk bytes vs
selected bytes, reservoir, lag, errors, RSS). Grafana itself is not run.
"""

import contextlib
import json
import math
import re
import shutil
import tempfile
import threading
import time
from pathlib import Path

import pytest

from sysprobe import http_get
from package_fixtures import REPO_ROOT, Daemon, synth, tail

import shardcast

DASHBOARD = REPO_ROOT / "deploy" / "grafana" / "shardcast-dashboard.json"
METRIC = re.compile(r"\b(?:shardcast|process)_[a-z0-9_]+\b")
RATE_FUNCTIONS = ("rate", "irate", "increase")
# Labels Prometheus adds to every scraped series (servicemonitor.yaml adds
# "node"), so they are on no series of the daemon's own page.
TARGET_LABELS = {"instance", "job", "node"}
DEADLINE = 45.0  # the whole module's daemon: killed after this


# ---------------------------------------------------------------------------
# The dashboard.

def load_dashboard():
    try:
        return json.loads(DASHBOARD.read_text())
    except ValueError as e:
        raise AssertionError(f"{DASHBOARD.name} is not JSON: {e}")


def all_panels(dashboard):
    """Every panel, those inside (collapsed) rows too."""
    out = []
    for p in dashboard.get("panels", []):
        out.append(p)
        out.extend(p.get("panels", []))
    return out


def targets(dashboard):
    """[(panel, target)] of every PromQL query."""
    return [(p, t) for p in all_panels(dashboard) for t in p.get("targets", [])
            if t.get("expr")]


def metric_uses(expr):
    """[(name, start offset, under rate/irate/increase, matcher text)] of each
    metric selector in `expr`."""
    out = []
    for m in METRIC.finditer(expr):
        before = expr[:m.start()]
        wrapped = re.search(r"\b(" + "|".join(RATE_FUNCTIONS) + r")\s*\(\s*$", before)
        rest = expr[m.end():]
        matchers = ""
        if rest.startswith("{"):
            end = rest.find("}")
            assert end > 0, f"unclosed label matchers after {m.group(0)} in {expr!r}"
            matchers = rest[1:end]
        out.append((m.group(0), m.start(), bool(wrapped), matchers))
    return out


def labels_used(target):
    """Labels a target groups by, filters on, or prints in its legend."""
    expr = target["expr"]
    out = set()
    for group in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", expr):
        out |= {x.strip() for x in group.split(",") if x.strip()}
    for _, _, _, matchers in metric_uses(expr):
        out |= set(re.findall(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)\s*\"", matchers))
    out |= set(re.findall(r"\{\{\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*\}\}",
                          target.get("legendFormat", "")))
    return out


def dashboard_metrics(dashboard):
    return {name for _, t in targets(dashboard) for name, *_ in metric_uses(t["expr"])}


def test_dashboard_is_a_grafana_dashboard_with_datasource_and_instance_variables():
    """Schema ~38, a Prometheus datasource variable every panel and query
    uses, an instance variable every selector filters on, unique panel ids
    and refIds, panels inside the 24-column grid and not overlapping."""
    d = load_dashboard()
    assert isinstance(d.get("schemaVersion"), int) and d["schemaVersion"] >= 36, (
        f"schemaVersion {d.get('schemaVersion')!r}: expected >= 36 (Grafana 9/10)")
    for field in ("title", "uid", "panels", "templating"):
        assert d.get(field), f"the dashboard has no {field}"
    variables = {v["name"]: v for v in d["templating"]["list"]}
    ds = [v for v in variables.values() if v.get("type") == "datasource"]
    assert ds and ds[0].get("query") == "prometheus", (
        f"no Prometheus datasource variable: {sorted(variables)}")
    ds_ref = "${" + ds[0]["name"] + "}"
    inst = variables.get("instance")
    assert inst and inst.get("type") == "query", "no query variable named instance"
    inst_query = inst.get("query")
    inst_query = inst_query.get("query") if isinstance(inst_query, dict) else inst_query
    assert re.search(r"label_values\(\s*(shardcast|process)_[a-z0-9_]+\s*,\s*instance\s*\)",
                     inst_query or ""), f"instance variable query {inst_query!r}"

    ids = set()
    boxes = []
    for p in all_panels(d):
        where = f"panel {p.get('id')} {p.get('title')!r}"
        assert isinstance(p.get("id"), int) and p["id"] not in ids, f"{where}: id not unique"
        ids.add(p["id"])
        g = p.get("gridPos") or {}
        assert all(isinstance(g.get(k), int) for k in "xywh"), f"{where}: gridPos {g}"
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24, f"{where}: outside the 24 columns: {g}"
        for other, og in boxes:
            overlap = (g["x"] < og["x"] + og["w"] and og["x"] < g["x"] + g["w"] and
                       g["y"] < og["y"] + og["h"] and og["y"] < g["y"] + g["h"])
            assert not overlap, f"{where} overlaps {other}: {g} / {og}"
        boxes.append((where, g))
        if p.get("type") == "row":
            continue
        assert p.get("targets"), f"{where}: no queries"
        assert (p.get("datasource") or {}).get("uid") == ds_ref, (
            f"{where}: datasource {p.get('datasource')}, expected uid {ds_ref}")
        refs = [t.get("refId") for t in p["targets"]]
        assert all(refs) and len(set(refs)) == len(refs), f"{where}: refIds {refs}"
        for t in p["targets"]:
            assert (t.get("datasource") or {}).get("uid") == ds_ref, (
                f"{where} {t.get('refId')}: datasource {t.get('datasource')}")
            assert t.get("expr"), f"{where} {t.get('refId')}: no expr"
            uses = metric_uses(t["expr"])
            assert uses, f"{where}: {t['expr']!r} names no shardcast_/process_ metric"
            for name, _, _, matchers in uses:
                assert re.search(r'\binstance=~"\$instance"', matchers), (
                    f"{where}: {name} in {t['expr']!r} is not filtered by "
                    'instance=~"$instance"')


def test_dashboard_rates_only_counters():
    """rate()/irate()/increase() over counters (names ending _total) only,
    and every counter under one of them: a raw counter or a rated gauge is a
    meaningless chart."""
    for p, t in targets(load_dashboard()):
        for name, _, wrapped, _ in metric_uses(t["expr"]):
            if name.endswith("_total"):
                assert wrapped, (f"panel {p['title']!r}: counter {name} is charted raw in "
                                 f"{t['expr']!r}; use rate()")
            else:
                assert not wrapped, (f"panel {p['title']!r}: {name} is not a counter (no "
                                     f"_total) but is rated in {t['expr']!r}")


def panel_named(dashboard, *metrics, label=None, matcher=None):
    """The titles of panels that use all `metrics` (and group or legend by
    `label`, and filter with `matcher`)."""
    out = []
    for p in all_panels(dashboard):
        ts = [t for t in p.get("targets", []) if t.get("expr")]
        names = {n for t in ts for n, *_ in metric_uses(t["expr"])}
        if not set(metrics) <= names:
            continue
        if label and not any(label in labels_used(t) and
                             metrics[0] in t["expr"] for t in ts):
            continue
        if matcher and not any(matcher in t["expr"] for t in ts):
            continue
        out.append(p["title"])
    return out


def test_dashboard_covers_what_operators_watch():
    """Panels for throughput per client, disk bytes vs selected bytes,
    reservoir use, lag per client, errors by code and RSS; and streams,
    local connections, shared memory and rejected datasets."""
    d = load_dashboard()
    subjects = {
        "throughput per client": panel_named(d, "shardcast_client_sent_bytes_total",
                                             label="client"),
        "disk bytes vs selected bytes": panel_named(
            d, "shardcast_device_read_bytes_total", "shardcast_read_requested_bytes_total",
            "shardcast_stream_delivered_bytes_total"),
        "reservoir use": panel_named(d, "shardcast_reservoir_used_bytes",
                                     "shardcast_reservoir_reserved_bytes",
                                     "shardcast_reservoir_capacity_bytes"),
        "lag per client": panel_named(d, "shardcast_stream_lag_blocks", label="client"),
        "errors by code": panel_named(d, "shardcast_call_results_total", label="code",
                                      matcher='code!="OK"'),
        "RSS": panel_named(d, "process_resident_memory_bytes"),
        "streams active": panel_named(d, "shardcast_streams_active"),
        "local connections": panel_named(d, "shardcast_local_connections"),
        "shared memory mapped": panel_named(d, "shardcast_shm_mapped_bytes"),
        "datasets rejected": panel_named(d, "shardcast_datasets_rejected"),
    }
    missing = [s for s, panels in subjects.items() if not panels]
    assert not missing, f"no panel shows: {missing}"


# ---------------------------------------------------------------------------
# A real daemon's /metrics.

def parse_exposition(text):
    """{family: {"type", "help", "samples": [(labels dict, value)]}} of a
    Prometheus text-format page, checking its syntax on the way."""
    families = {}
    seen = set()
    label_re = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"\s*(,|$)')
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        if line.startswith("#"):
            m = re.match(r"# (HELP|TYPE) ([a-zA-Z_:][a-zA-Z0-9_:]*) ?(.*)$", line)
            if not m:
                continue  # a plain comment
            kind, name, rest = m.groups()
            f = families.setdefault(name, {"type": None, "help": None, "samples": []})
            key = "type" if kind == "TYPE" else "help"
            assert f[key] is None, f"line {n}: second # {kind} for {name}"
            assert not (kind == "TYPE" and f["samples"]), (
                f"line {n}: # TYPE {name} after its samples")
            f[key] = rest.strip()
            continue
        m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)(\s+-?\d+)?$", line)
        assert m, f"line {n} is not a sample: {line!r}"
        name, _, label_text, value = m.group(1), m.group(2), m.group(3), m.group(4)
        labels = {}
        rest = label_text or ""
        while rest.strip():
            lm = label_re.match(rest)
            assert lm, f"line {n}: bad labels {label_text!r}"
            assert lm.group(1) not in labels, f"line {n}: label {lm.group(1)} twice"
            labels[lm.group(1)] = lm.group(2)
            rest = rest[lm.end():]
        try:
            v = float(value)
        except ValueError:
            raise AssertionError(f"line {n}: value {value!r} is not a number")
        assert name in families and families[name]["type"], (
            f"line {n}: sample of {name} without a # TYPE line before it")
        series = (name, tuple(sorted(labels.items())))
        assert series not in seen, f"line {n}: series {series} twice"
        seen.add(series)
        families[name]["samples"].append((labels, v))
    return families


# Series that exist only while a stream, scan or local connection does: the
# scrape waits until they appear (a stream's first batch comes after the
# scan's start delay).
PER_STREAM = ("shardcast_client_sent_bytes_total", "shardcast_client_batches_total",
              "shardcast_stream_lag_blocks", "shardcast_scan_subscribers",
              "shardcast_scan_read_bytes_total", "shardcast_local_client_connections")


@contextlib.contextmanager
def daemon_with_http(tmp, *extra, deadline=DEADLINE):
    """(daemon, HTTP admin port, dataset) of a shardcastd serving a small
    synthetic dataset with its admin endpoint on a free loopback port;
    stopped (SIGTERM, exit 0 asserted) on the way out. A stream that stalls
    would block the module for ever: the daemon is killed past `deadline`,
    so the client's call fails and the test reports it."""
    root = tmp / "root"
    root.mkdir()
    dataset = synth(root, "--layers", "6", "--tokens", 16, "--d-model", 32,
                    "--examples", 40, "--seed", 11)
    sock_dir = Path(tempfile.mkdtemp(prefix="scdash-", dir="/tmp"))
    daemon = Daemon([root], sock_dir / "d.sock", tmp / "shardcastd.log",
                    ("--http", "127.0.0.1:0", "--reservoir-bytes", "64M",
                     "--block-bytes", "16K", "--shuffle-window", "4", "--lag-blocks", "64",
                     "--scan-start-delay-ms", "0") + extra)
    timer = threading.Timer(deadline, lambda: daemon.proc and daemon.proc.kill())
    timer.daemon = True
    timer.start()
    try:
        daemon.start().wait_ready()
        until = time.monotonic() + 10
        m = None
        while m is None and time.monotonic() < until:
            m = re.search(r"HTTP admin on [^ \"]*:(\d+)", tail(daemon.log, 200000))
            time.sleep(0.02)
        assert m, f"no 'HTTP admin on HOST:PORT' line in the log\n{daemon.describe()}"
        yield daemon, int(m.group(1)), dataset
    finally:
        timer.cancel()
        rc = daemon.stop()
        shutil.rmtree(sock_dir, ignore_errors=True)
    assert rc == 0, f"shardcastd: SIGTERM -> exit {rc}\n{tail(daemon.log)}"


@pytest.fixture(scope="module")
def scraped(tmp_path_factory):
    """(families, raw text, dataset id) of /metrics while two shuffled
    streams of one dataset are open (one in shared memory, one in gRPC
    messages) and unfinished."""
    with daemon_with_http(tmp_path_factory.mktemp("dash"), "--query-threads", "2") as (
            daemon, port, dataset):
        with shardcast.Client(daemon.address) as client:
            with client.stream(dataset.name, layer=6, batch_size=64, seed=1, epochs=0,
                               copy=True) as shm_stream, \
                    client.stream(dataset.name, layer=6, batch_size=64, seed=2, epochs=0,
                                  copy=True, shared_memory=False) as grpc_stream:
                next(iter(shm_stream))
                next(iter(grpc_stream))
                families, text = {}, ""
                deadline = time.monotonic() + 10
                while time.monotonic() < deadline:
                    status, text = http_get(port, "/metrics")
                    assert status == 200, f"/metrics -> {status}: {text[:500]}"
                    families = parse_exposition(text)
                    if all(families.get(n, {}).get("samples") for n in PER_STREAM):
                        break
                    time.sleep(0.1)
        yield families, text, dataset.name


def test_every_metric_the_dashboard_names_is_exported(scraped):
    """Each metric in a dashboard query is on the daemon's /metrics page
    with at least one sample while streams are open, with the type its use
    implies (rate() of counters)."""
    families, _, _ = scraped
    d = load_dashboard()
    names = dashboard_metrics(d)
    missing = sorted(n for n in names if n not in families)
    assert not missing, (f"the dashboard names {len(missing)} metric(s) /metrics does not "
                         f"export: {missing}\nexported: {sorted(families)}")
    empty = sorted(n for n in names if not families[n]["samples"])
    assert not empty, f"declared but without samples while two streams are open: {empty}"
    for p, t in targets(d):
        for name, _, wrapped, _ in metric_uses(t["expr"]):
            typ = families[name]["type"]
            assert (typ == "counter") == wrapped, (
                f"panel {p['title']!r}: {name} is a {typ} but is "
                f"{'rated' if wrapped else 'charted raw'} in {t['expr']!r}")


def test_every_label_the_dashboard_uses_is_exported(scraped):
    """Labels in by(...), matchers and legends ({{client}}) are on the
    series of the metrics the query names (or are added by Prometheus)."""
    families, _, _ = scraped
    problems = []
    for p, t in targets(load_dashboard()):
        names = {n for n, *_ in metric_uses(t["expr"])}
        have = set(TARGET_LABELS)
        for n in names:
            for labels, _ in families.get(n, {}).get("samples", []):
                have |= set(labels)
        for label in labels_used(t) - have:
            problems.append(f"panel {p['title']!r} {t['refId']}: label {label!r} is on no "
                            f"series of {sorted(names)}")
    assert not problems, "\n".join(problems)


def test_per_client_series_describe_the_open_streams(scraped):
    """Both open streams have their throughput and lag series, labelled
    with their client id, peer, dataset and transport."""
    families, _, dataset = scraped
    for name in ("shardcast_client_sent_bytes_total", "shardcast_stream_lag_blocks"):
        assert name in families, f"/metrics has no {name}: {sorted(families)}"
    sent = families["shardcast_client_sent_bytes_total"]["samples"]
    assert len(sent) >= 2, f"two streams open, {len(sent)} per-client series: {sent}"
    for labels, value in sent:
        for label in ("client", "peer", "dataset", "transport"):
            assert labels.get(label), f"shardcast_client_sent_bytes_total {labels}: no {label}"
        assert labels["dataset"] == dataset, f"dataset label {labels['dataset']!r}"
        assert value > 0, f"stream {labels['client']} took a batch but was sent {value} bytes"
    assert len({l["client"] for l, _ in sent}) == len(sent), f"client ids repeat: {sent}"
    assert len({l["transport"] for l, _ in sent}) == 2, (
        f"one stream in shared memory, one in gRPC messages, but transports are "
        f"{[l['transport'] for l, _ in sent]}")
    lag_clients = {l.get("client") for l, _ in families["shardcast_stream_lag_blocks"]["samples"]}
    assert {l["client"] for l, _ in sent} <= lag_clients, (
        f"lag series for {lag_clients}, streams {[l['client'] for l, _ in sent]}")


def unit_problems(name):
    """What is wrong with where `name` puts its unit (Prometheus naming:
    base units, the unit last, then _total for counters)."""
    parts = name.split("_")
    out = []
    for bad in ("ms", "milliseconds", "us", "microseconds", "minutes", "hours", "kb", "mb",
                "gb", "kib", "mib", "gib", "kilobytes", "megabytes", "percent"):
        if bad in parts:
            out.append(f"non-base unit {bad!r} (use seconds, bytes, ratios)")
    core = parts[:-1] if parts[-1] == "total" else parts
    for unit in ("bytes", "seconds"):
        if unit in core[1:] and core[-1] != unit:
            out.append(f"unit {unit!r} in the middle; it goes last (before _total)")
    return out


def test_exported_metrics_follow_prometheus_conventions(scraped):
    """Every family has HELP and TYPE; counters (and only counters) end in
    _total; units are base units and come last (_bytes, _seconds,
    _bytes_total, _seconds_total); _info gauges are 1."""
    families, text, _ = scraped
    problems = []
    for name, f in sorted(families.items()):
        if not (name.startswith("shardcast_") or name.startswith("process_")):
            problems.append(f"{name}: not in the shardcast_ (or process_) namespace")
        if not f["help"]:
            problems.append(f"{name}: no # HELP text")
        if f["type"] not in ("counter", "gauge", "histogram", "summary", "untyped"):
            problems.append(f"{name}: # TYPE {f['type']!r}")
        if (f["type"] == "counter") != name.endswith("_total"):
            problems.append(f"{name}: a {f['type']}; counters, and only counters, end "
                            "in _total")
        if re.search(r"_(count|sum|bucket)$", name) and f["type"] not in ("histogram",
                                                                       "summary"):
            problems.append(f"{name}: _count/_sum/_bucket are reserved for histograms")
        problems += [f"{name}: {p}" for p in unit_problems(name)]
        if name.endswith("_info"):
            if f["type"] != "gauge" or any(v != 1 for _, v in f["samples"]):
                problems.append(f"{name}: an _info metric is a gauge of value 1")
            if not all(labels for labels, _ in f["samples"]):
                problems.append(f"{name}: an _info metric carries its facts as labels")
        for labels, v in f["samples"]:
            if math.isnan(v) or (f["type"] == "counter" and v < 0):
                problems.append(f"{name}{labels}: value {v}")
    assert not problems, "\n".join(problems) + f"\n\n/metrics:\n{text[:6000]}"


def test_process_metrics_are_the_standard_ones_with_full_precision(scraped):
    """process_cpu_seconds_total, process_resident_memory_bytes,
    process_start_time_seconds and process_open_fds have the types and
    meanings of the Prometheus client libraries' process collector: the
    start time is Unix seconds, now - shardcast_uptime_seconds, to the
    second (printed with 6 significant digits, as 1.79545e+09, it would be
    off by up to 5000 s)."""
    families, _, _ = scraped
    standard = {"process_cpu_seconds_total": "counter", "process_resident_memory_bytes": "gauge",
                "process_start_time_seconds": "gauge", "process_open_fds": "gauge"}
    for name, typ in standard.items():
        assert name in families and families[name]["type"] == typ, (
            f"{name}: expected the standard {typ}, got {families.get(name, {}).get('type')}")
    value = {n: families[n]["samples"][0][1] for n in standard}
    assert value["process_resident_memory_bytes"] > 1 << 20, value
    assert value["process_open_fds"] > 0, value
    if "shardcast_uptime_seconds" in families:
        uptime = families["shardcast_uptime_seconds"]["samples"][0][1]
        started = time.time() - uptime
        assert abs(value["process_start_time_seconds"] - started) < 5, (
            f"process_start_time_seconds {value['process_start_time_seconds']} is not "
            f"now - uptime = {started:.0f} (Unix seconds)")
