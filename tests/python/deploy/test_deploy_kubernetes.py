"""The Kubernetes manifests (deploy/kubernetes/) and the container image
(deploy/container/Dockerfile): parsed and checked for what the deployment
promises (read-only roots, the socket directory trainers share, probes on
/healthz and grpc.health.v1, a locked-down securityContext, memory sized from
the reservoir, the TLS Service and its Secret, Prometheus scraping), and the
ConfigMap's config run by the real shardcastd.

No cluster and no Docker engine are needed (nor used): what a real cluster
or `docker build` would show is left to deploy/kubernetes/README.md
("Trying it"). Binaries: $SHARDCAST_BIN and $SHARDCASTD_BIN (set by ctest).
"""

import grp
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from sysprobe import http_get
from package_fixtures import (REPO_ROOT, SHARDCAST_BIN, SHARDCASTD_BIN,  # noqa: F401
                              Daemon, package_logs, synth, tail)

K8S_DIR = REPO_ROOT / "deploy" / "kubernetes"
DOCKERFILE = REPO_ROOT / "deploy" / "container" / "Dockerfile"
NAMESPACE = "shardcast"
MIB = 1 << 20

# Every key a shardcastd config file may hold (server/options.cc, Table()).
# The daemon itself is the final judge: test_configmap_config_starts_the_daemon.
DAEMON_CONFIG_KEYS = {
    "roots", "listen", "socket_group", "disable_shared_memory", "disable_local_queries",
    "disable_direct_reads",
    "listen_tcp", "tls_cert",
    "tls_key", "tls_client_ca", "token_key_file", "max_connections", "allow_users",
    "allow_groups", "insecure_tcp", "http", "query_threads", "local_query_spin_us", "local_query_threads",
    "max_vectors_per_call",
    "max_bytes_per_call", "shutdown_grace_seconds", "log_level", "log_format",
    "reservoir_bytes", "block_bytes", "shuffle_window", "lag_blocks", "queue_depth",
    "read_bytes", "read_mode", "register_buffers", "prefault", "scan_start_delay_ms",
}
DEFAULT_SHUTDOWN_GRACE_SECONDS = 10  # server/options.h

# Field names the Kubernetes API knows at the levels checked here, so that a
# misspelt field (which `kubectl apply --validate=false` and some tools pass
# silently) fails the test.
CONTAINER_FIELDS = {
    "name", "image", "imagePullPolicy", "command", "args", "workingDir", "ports", "env",
    "envFrom", "resources", "resizePolicy", "restartPolicy", "volumeMounts", "volumeDevices",
    "livenessProbe", "readinessProbe", "startupProbe", "lifecycle", "terminationMessagePath",
    "terminationMessagePolicy", "securityContext", "stdin", "stdinOnce", "tty"}
MOUNT_FIELDS = {"name", "mountPath", "readOnly", "subPath", "subPathExpr", "mountPropagation",
                "recursiveReadOnly"}
PROBE_FIELDS = {"exec", "httpGet", "tcpSocket", "grpc", "initialDelaySeconds", "timeoutSeconds",
                "periodSeconds", "successThreshold", "failureThreshold",
                "terminationGracePeriodSeconds"}
SECURITY_CONTEXT_FIELDS = {
    "runAsUser", "runAsGroup", "runAsNonRoot", "readOnlyRootFilesystem",
    "allowPrivilegeEscalation", "capabilities", "privileged", "procMount", "seccompProfile",
    "seLinuxOptions", "appArmorProfile", "windowsOptions"}
POD_SECURITY_CONTEXT_FIELDS = {
    "runAsUser", "runAsGroup", "runAsNonRoot", "fsGroup", "fsGroupChangePolicy",
    "supplementalGroups", "supplementalGroupsPolicy", "seccompProfile", "seLinuxOptions",
    "appArmorProfile", "sysctls", "windowsOptions", "seLinuxChangePolicy"}


# ---------------------------------------------------------------------------
# Loading.

def load_manifests():
    """{(kind, name): (file name, document)} of every YAML document."""
    files = sorted(K8S_DIR.glob("*.yaml"))
    assert files, f"no manifests in {K8S_DIR}"
    out = {}
    for path in files:
        try:
            docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
        except yaml.YAMLError as e:
            raise AssertionError(f"{path.name}: not valid YAML: {e}")
        assert docs, f"{path.name}: no YAML document"
        for i, d in enumerate(docs):
            where = f"{path.name} document {i + 1}"
            assert isinstance(d, dict), f"{where}: a {type(d).__name__}, not a mapping"
            for field in ("apiVersion", "kind", "metadata"):
                assert field in d, f"{where}: no {field}"
            name = d["metadata"].get("name")
            assert name, f"{where}: no metadata.name"
            key = (d["kind"], name)
            assert key not in out, f"{where}: {key} is defined twice (also in {out[key][0]})"
            out[key] = (path.name, d)
    return out


@pytest.fixture(scope="module")
def manifests():
    return load_manifests()


def get(manifests, kind, name):
    assert (kind, name) in manifests, (
        f"no {kind} named {name!r} in {K8S_DIR}; found {sorted(manifests)}")
    return manifests[(kind, name)][1]


@pytest.fixture(scope="module")
def config(manifests):
    """The daemon config embedded in the ConfigMap, parsed."""
    cm = get(manifests, "ConfigMap", "shardcastd-config")
    data = cm.get("data") or {}
    assert "shardcastd.json" in data, (
        f"ConfigMap shardcastd-config has no data key shardcastd.json: {sorted(data)}")
    try:
        cfg = json.loads(data["shardcastd.json"])
    except ValueError as e:
        raise AssertionError(f"ConfigMap shardcastd-config: shardcastd.json is not JSON: {e}")
    assert isinstance(cfg, dict), "shardcastd.json must hold a JSON object"
    return cfg


@pytest.fixture(scope="module")
def daemonset(manifests):
    return get(manifests, "DaemonSet", "shardcastd")


@pytest.fixture(scope="module")
def pod_spec(daemonset):
    return daemonset["spec"]["template"]["spec"]


@pytest.fixture(scope="module")
def container(pod_spec):
    containers = {c["name"]: c for c in pod_spec.get("containers", [])}
    assert "shardcastd" in containers, (
        f"DaemonSet shardcastd has no container named shardcastd: {sorted(containers)}")
    return containers["shardcastd"]


def config_bytes(value):
    """A config byte count: an integer, or text like "4G" (binary units)."""
    if isinstance(value, bool):
        raise AssertionError(f"byte count {value!r} is a boolean")
    if isinstance(value, int):
        return value
    m = re.fullmatch(r"(\d+)([KkMmGgTt]?)", str(value))
    assert m, f"byte count {value!r} is neither an integer nor like 4G"
    shift = {"": 0, "k": 10, "m": 20, "g": 30, "t": 40}[m.group(2).lower()]
    return int(m.group(1)) << shift


def quantity(value):
    """A Kubernetes resource quantity ("5Gi", "4.5G", "2", "500m") in units."""
    m = re.fullmatch(r"([0-9]+(?:\.[0-9]*)?)(?:[eE]([-+]?[0-9]+))?"
                     r"(Ki|Mi|Gi|Ti|Pi|Ei|m|k|M|G|T|P|E)?", str(value))
    assert m, f"{value!r} is not a Kubernetes quantity"
    number = float(m.group(1)) * (10 ** int(m.group(2)) if m.group(2) else 1)
    factor = {None: 1, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15,
              "E": 1e18, "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40,
              "Pi": 1 << 50, "Ei": 1 << 60}[m.group(3)]
    return number * factor


def host_port(address):
    host, _, port = address.rpartition(":")
    assert host and port.isdigit(), f"{address!r} is not HOST:PORT"
    return host.strip("[]"), int(port)


def unix_path(address):
    assert address.startswith("unix:/"), f"{address!r} is not unix:/absolute/path"
    return address[len("unix:"):]


def container_port(container, port):
    """A probe's or Service's port (a number or a port name) as a number."""
    if isinstance(port, int):
        return port
    ports = {p["name"]: p["containerPort"] for p in container.get("ports", []) if "name" in p}
    assert port in ports, (f"port {port!r} is not a named port of container "
                           f"{container['name']} ({ports})")
    return ports[port]


def mounts_by_volume(container):
    return {m["name"]: m for m in container.get("volumeMounts", [])}


def volumes(pod_spec):
    return {v["name"]: v for v in pod_spec.get("volumes", [])}


def covers(directory, path):
    """True when `path` lies inside `directory`."""
    return os.path.commonpath([os.path.normpath(directory), os.path.normpath(path)]) == \
        os.path.normpath(directory)


def check_fields(obj, allowed, where):
    unknown = set(obj) - allowed
    assert not unknown, f"{where}: unknown field(s) {sorted(unknown)} (misspelt?)"


# ---------------------------------------------------------------------------
# Manifests.

def test_every_manifest_parses_and_sits_in_the_shardcast_namespace(manifests):
    """Every YAML document parses, and every namespaced object is in the
    shardcast namespace, which one of the files creates."""
    assert ("Namespace", NAMESPACE) in manifests, (
        f"no Namespace {NAMESPACE!r} in {K8S_DIR}: `kubectl apply` of the files would fail")
    for (kind, name), (file, d) in manifests.items():
        if kind == "Namespace":
            continue
        assert d["metadata"].get("namespace") == NAMESPACE, (
            f"{file}: {kind} {name} is in namespace {d['metadata'].get('namespace')!r}, "
            f"expected {NAMESPACE!r}")
    for kind in ("ConfigMap", "DaemonSet", "Service", "ServiceMonitor", "Pod"):
        assert any(k == kind for k, _ in manifests), f"no {kind} in {K8S_DIR}"


def test_configmap_holds_a_daemon_config(config):
    """The embedded JSON uses only keys shardcastd knows, with the values the
    rest of the manifests rely on (socket in /run/shardcast, admin HTTP on
    all addresses, TCP only with TLS, JSON logs)."""
    unknown = set(config) - DAEMON_CONFIG_KEYS
    assert not unknown, f"shardcastd.json: keys shardcastd does not know: {sorted(unknown)}"
    for key in ("roots", "listen", "http", "reservoir_bytes", "listen_tcp", "tls_cert",
                "tls_key", "socket_group", "log_format"):
        assert key in config, f"shardcastd.json: no {key!r}"
    assert isinstance(config["roots"], list) and config["roots"], "roots: a non-empty list"
    assert all(isinstance(r, str) and r.startswith("/") for r in config["roots"]), (
        f"roots must be absolute paths: {config['roots']}")
    sock = unix_path(config["listen"])
    assert os.path.dirname(sock) == "/run/shardcast", (
        f"listen: the socket {sock} must be in /run/shardcast (the hostPath trainers mount)")
    host, port = host_port(config["http"])
    assert host in ("0.0.0.0", "::"), (
        f"http {config['http']}: the kubelet and Prometheus reach the pod's IP, not "
        "its loopback: listen on 0.0.0.0")
    assert port == 9464, f"http port {port}, expected 9464 (the manifests' admin port)"
    assert not config.get("insecure_tcp", False), "insecure_tcp: the TCP port must use TLS"
    assert config_bytes(config["reservoir_bytes"]) >= 64 * MIB, "reservoir_bytes is tiny"
    assert config["log_format"] == "json", f"log_format {config['log_format']!r}, expected json"


def test_daemonset_mounts_roots_read_only_and_shares_the_socket_directory(
        config, pod_spec, container):
    """Roots: hostPath (or a PVC) mounted readOnly where the config's roots
    are. Socket directory: hostPath /run/shardcast, DirectoryOrCreate,
    mounted read-write where the config's socket is. Config: the ConfigMap
    at /etc/shardcast, named by --config."""
    check_fields(container, CONTAINER_FIELDS, "container shardcastd")
    vols = volumes(pod_spec)
    mounts = mounts_by_volume(container)
    for name, m in mounts.items():
        check_fields(m, MOUNT_FIELDS, f"volumeMount {name}")
        assert name in vols, f"volumeMount {name} names no volume of the pod"

    for root in config["roots"]:
        found = [m for m in mounts.values() if covers(m["mountPath"], root)]
        assert found, f"no volumeMount holds the dataset root {root}"
        m = max(found, key=lambda m: len(m["mountPath"]))
        assert m.get("readOnly") is True, (
            f"the root {root} is mounted from volume {m['name']} without readOnly: true")
        v = vols[m["name"]]
        if "hostPath" in v:
            assert v["hostPath"].get("type") == "Directory", (
                f"volume {v['name']}: hostPath type {v['hostPath'].get('type')!r}, expected "
                "Directory (no pod on a node without the filesystem)")
        else:
            assert v.get("persistentVolumeClaim", {}).get("readOnly") is True, (
                f"volume {v['name']}: neither a hostPath nor a read-only PVC: {v}")

    sock_dir = os.path.dirname(unix_path(config["listen"]))
    found = [m for m in mounts.values() if os.path.normpath(m["mountPath"]) == sock_dir]
    assert found, f"no volumeMount at the socket directory {sock_dir}"
    m = found[0]
    assert not m.get("readOnly", False), f"the socket directory {sock_dir} must be writable"
    hp = vols[m["name"]].get("hostPath")
    assert hp, f"volume {m['name']} (the socket directory) is not a hostPath: trainers " \
               "in other pods could not reach the socket"
    assert hp["path"] == "/run/shardcast" and hp.get("type") == "DirectoryOrCreate", (
        f"socket hostPath {hp}: expected path /run/shardcast, type DirectoryOrCreate")

    cfg_mount = [m for m in mounts.values() if m["mountPath"] == "/etc/shardcast"]
    assert cfg_mount, "the ConfigMap is not mounted at /etc/shardcast"
    assert cfg_mount[0].get("readOnly") is True, "/etc/shardcast must be mounted readOnly"
    assert vols[cfg_mount[0]["name"]].get("configMap", {}).get("name") == "shardcastd-config", (
        "/etc/shardcast is not the ConfigMap shardcastd-config")
    argv = (container.get("command") or []) + (container.get("args") or [])
    assert "--config" in argv and \
        argv[argv.index("--config") + 1] == "/etc/shardcast/shardcastd.json", (
            f"the container does not start with --config /etc/shardcast/shardcastd.json: {argv}")

    for field in ("hostPID", "hostIPC", "hostNetwork"):
        assert not pod_spec.get(field, False), f"{field} is set; the daemon needs none of them"


def test_daemonset_probes_healthz_and_grpc_health(config, container):
    """Liveness: httpGet /healthz on the admin port. Readiness: an exec of
    `shardcast --server unix:<socket> health` (grpc.health.v1 over the Unix
    socket: the kubelet's grpc probe cannot speak TLS)."""
    _, admin_port = host_port(config["http"])
    live = container.get("livenessProbe")
    assert live, "no livenessProbe"
    check_fields(live, PROBE_FIELDS, "livenessProbe")
    assert "httpGet" in live, f"livenessProbe is not an httpGet: {live}"
    assert live["httpGet"].get("path") == "/healthz", f"livenessProbe path: {live['httpGet']}"
    assert container_port(container, live["httpGet"]["port"]) == admin_port, (
        f"livenessProbe port {live['httpGet']['port']} is not the admin port {admin_port}")

    ready = container.get("readinessProbe")
    assert ready, "no readinessProbe"
    check_fields(ready, PROBE_FIELDS, "readinessProbe")
    assert "exec" in ready, f"readinessProbe is not an exec probe: {ready}"
    cmd = ready["exec"]["command"]
    assert os.path.basename(cmd[0]) == "shardcast", f"readinessProbe runs {cmd[0]}, not shardcast"
    assert cmd[-1] == "health", f"readinessProbe's command does not end in `health`: {cmd}"
    assert "--server" in cmd and cmd[cmd.index("--server") + 1] == config["listen"], (
        f"readinessProbe does not ask the config's socket {config['listen']}: {cmd}")

    startup = container.get("startupProbe")
    if startup:
        check_fields(startup, PROBE_FIELDS, "startupProbe")
        budget = startup.get("periodSeconds", 10) * startup.get("failureThreshold", 3)
        assert budget >= 30, f"startupProbe gives the daemon only {budget} s to start"


def test_daemonset_security_context(pod_spec, container):
    """Non-root uid/gid 10001, read-only root filesystem, no privilege
    escalation, every capability dropped; fsGroup for the mounted Secret."""
    sc = container.get("securityContext") or {}
    check_fields(sc, SECURITY_CONTEXT_FIELDS, "container securityContext")
    want = {"runAsNonRoot": True, "runAsUser": 10001, "runAsGroup": 10001,
            "readOnlyRootFilesystem": True, "allowPrivilegeEscalation": False}
    for field, value in want.items():
        assert sc.get(field) == value, (
            f"container securityContext.{field} = {sc.get(field)!r}, expected {value!r}")
    assert sc.get("capabilities", {}).get("drop") == ["ALL"], (
        f"capabilities.drop = {sc.get('capabilities', {}).get('drop')!r}, expected ['ALL']")
    assert not sc.get("capabilities", {}).get("add"), "the daemon adds capabilities"
    assert not sc.get("privileged", False), "the daemon container is privileged"

    psc = pod_spec.get("securityContext") or {}
    check_fields(psc, POD_SECURITY_CONTEXT_FIELDS, "pod securityContext")
    assert psc.get("fsGroup") == 10001, f"pod fsGroup = {psc.get('fsGroup')!r}, expected 10001"
    for init in pod_spec.get("initContainers", []):
        check_fields(init, CONTAINER_FIELDS, f"initContainer {init['name']}")
        isc = init.get("securityContext") or {}
        assert isc.get("allowPrivilegeEscalation") is False, (
            f"initContainer {init['name']}: allowPrivilegeEscalation must be false")
        assert isc.get("capabilities", {}).get("drop") == ["ALL"], (
            f"initContainer {init['name']}: drop ALL capabilities (add back what it needs)")
        assert not isc.get("privileged", False), f"initContainer {init['name']} is privileged"


def test_daemonset_resources_cover_the_memory_bound(config, pod_spec, container):
    """requests.memory and limits.memory >= reservoir_bytes * 1.1 + 64 MiB
    (docs/benchmarks.md, "Targets") for the ConfigMap's reservoir; a CPU request; a grace
    period longer than shutdown_grace_seconds."""
    reservoir = config_bytes(config["reservoir_bytes"])
    bound = reservoir * 1.1 + 64 * MIB
    res = container.get("resources") or {}
    for kind in ("requests", "limits"):
        mem = (res.get(kind) or {}).get("memory")
        assert mem is not None, f"resources.{kind}.memory is not set"
        assert quantity(mem) >= bound, (
            f"resources.{kind}.memory {mem} = {quantity(mem) / MIB:.1f} MiB is below the "
            f"daemon's bound reservoir_bytes * 1.1 + 64 MiB = {reservoir / MIB:.0f} * 1.1 + "
            f"64 = {bound / MIB:.1f} MiB")
    cpu = (res.get("requests") or {}).get("cpu")
    assert cpu is not None and quantity(cpu) >= 1, f"resources.requests.cpu = {cpu!r}, want >= 1"

    grace = config.get("shutdown_grace_seconds", DEFAULT_SHUTDOWN_GRACE_SECONDS)
    period = pod_spec.get("terminationGracePeriodSeconds", 30)
    assert period > grace, (f"terminationGracePeriodSeconds {period} <= shutdown_grace_seconds "
                            f"{grace}: the kubelet would SIGKILL a draining daemon")


def test_tls_service_targets_the_tls_port_and_the_secret_is_mounted(
        manifests, config, pod_spec, container):
    """The Service's port goes to the container port of listen_tcp, and the
    TLS files the config names come from a Secret mounted read-only."""
    _, tls_port = host_port(config["listen_tcp"])
    svc = get(manifests, "Service", "shardcastd")
    labels = get(manifests, "DaemonSet", "shardcastd")["spec"]["template"]["metadata"]["labels"]
    selector = svc["spec"].get("selector") or {}
    assert selector and all(labels.get(k) == v for k, v in selector.items()), (
        f"Service shardcastd selects {selector}, which the pods ({labels}) do not carry")
    targets = [container_port(container, p.get("targetPort", p["port"]))
               for p in svc["spec"]["ports"]]
    assert tls_port in targets, (
        f"Service shardcastd targets ports {targets}, not listen_tcp's {tls_port}")

    mounts = mounts_by_volume(container)
    vols = volumes(pod_spec)
    for key in ("tls_cert", "tls_key", "tls_client_ca"):
        if key not in config:
            continue
        path = config[key]
        found = [m for m in mounts.values() if covers(m["mountPath"], path)]
        assert found, f"{key} {path}: no volumeMount holds it"
        m = max(found, key=lambda m: len(m["mountPath"]))
        assert m.get("readOnly") is True, f"{key} {path}: mount {m['name']} is not readOnly"
        secret = vols[m["name"]].get("secret")
        assert secret and secret.get("secretName"), (
            f"{key} {path} comes from volume {m['name']}, which is not a Secret")
        mode = secret.get("defaultMode", 0o644)
        assert mode & 0o007 == 0, f"Secret volume {m['name']}: defaultMode {mode:o} is " \
                                  "world-readable"


def test_prometheus_scrapes_the_admin_port(manifests, config, daemonset, container):
    """A ServiceMonitor scrapes /metrics through a Service of the admin
    port, and the pod template carries prometheus.io annotations."""
    _, admin_port = host_port(config["http"])
    sms = [d for (kind, _), (_, d) in manifests.items() if kind == "ServiceMonitor"]
    assert sms, "no ServiceMonitor"
    sm = sms[0]
    assert sm["apiVersion"] == "monitoring.coreos.com/v1", sm["apiVersion"]
    services = [d for (kind, _), (_, d) in manifests.items() if kind == "Service"]
    selected = [s for s in services
                if all(s["metadata"].get("labels", {}).get(k) == v
                       for k, v in sm["spec"]["selector"]["matchLabels"].items())]
    assert selected, (f"ServiceMonitor selects {sm['spec']['selector']}: no Service here "
                      "carries those labels")
    for ep in sm["spec"]["endpoints"]:
        assert ep.get("path", "/metrics") == "/metrics", f"ServiceMonitor path {ep.get('path')}"
        ports = [p for s in selected for p in s["spec"]["ports"] if p.get("name") == ep["port"]]
        assert ports, f"ServiceMonitor port {ep['port']!r} is no port name of {selected}"
        for p in ports:
            assert container_port(container, p.get("targetPort", p["port"])) == admin_port, (
                f"ServiceMonitor port {ep['port']} leads to {p}, not the admin port {admin_port}")

    ann = daemonset["spec"]["template"]["metadata"].get("annotations") or {}
    assert ann.get("prometheus.io/scrape") == "true", f"pod annotations: {ann}"
    assert ann.get("prometheus.io/port") == str(admin_port), f"pod annotations: {ann}"
    assert ann.get("prometheus.io/path", "/metrics") == "/metrics", f"pod annotations: {ann}"


def test_trainer_pod_mounts_the_socket_directory(manifests, config):
    """The example trainer mounts the node's /run/shardcast where the socket
    is, sets SHARDCAST_ADDRESS to it, and joins the socket's group."""
    pods = [d for (kind, _), (_, d) in manifests.items() if kind == "Pod"]
    assert pods, "no trainer Pod example"
    pod = pods[0]["spec"]
    sock = unix_path(config["listen"])
    vols = volumes(pod)
    ok = False
    for c in pod["containers"]:
        check_fields(c, CONTAINER_FIELDS, f"trainer container {c['name']}")
        env = {e["name"]: e.get("value") for e in c.get("env", [])}
        if env.get("SHARDCAST_ADDRESS") != config["listen"]:
            continue
        for m in c.get("volumeMounts", []):
            hp = vols.get(m["name"], {}).get("hostPath") or {}
            if covers(m["mountPath"], sock) and hp.get("path") == os.path.dirname(sock) and \
                    m["mountPath"] == os.path.dirname(sock):
                ok = True
    assert ok, (f"no trainer container sets SHARDCAST_ADDRESS={config['listen']} and mounts "
                f"the hostPath {os.path.dirname(sock)} at the same path")
    groups = (pod.get("securityContext") or {}).get("supplementalGroups") or []
    assert 10001 in groups, (f"trainer supplementalGroups {groups}: without 10001 (the "
                             "socket's group) a non-root trainer cannot connect")


# ---------------------------------------------------------------------------
# The Dockerfile.

def dockerfile_instructions():
    """[(INSTRUCTION, arguments)] with continuation lines joined."""
    out, current = [], ""
    for line in DOCKERFILE.read_text().splitlines():
        stripped = line.strip()
        if stripped.startswith("#") or (not stripped and not current):
            continue
        if stripped.endswith("\\"):
            current += stripped[:-1] + " "
            continue
        current += stripped
        word, _, rest = current.partition(" ")
        out.append((word.upper(), rest.strip()))
        current = ""
    assert not current, "the Dockerfile ends inside a continued line"
    return out


def apt_packages(run):
    """Packages named by `apt-get install` in one RUN's shell text."""
    out = []
    for m in re.finditer(r"apt-get\s+install\s+(.*?)(?:&&|;|\|\||$)", run):
        out += [t for t in shlex.split(m.group(1)) if not t.startswith("-")]
    return out


def stages():
    """[(FROM argument, [instructions])] of each build stage."""
    out = []
    for word, rest in dockerfile_instructions():
        if word == "FROM":
            out.append((rest, []))
        else:
            assert out, f"{word} before the first FROM"
            out[-1][1].append((word, rest))
    return out


def test_dockerfile_is_a_multistage_bookworm_build_running_as_non_root():
    st = stages()
    assert len(st) >= 2, f"{len(st)} FROM line(s): expected a build stage and a runtime stage"
    for image, _ in st:
        base = image.split()[0]
        assert re.fullmatch(r"debian:bookworm(-slim)?", base), (
            f"FROM {image}: every stage must be debian:bookworm or debian:bookworm-slim")
    final = dict()
    for word, rest in st[-1][1]:
        final.setdefault(word, []).append(rest)
    users = final.get("USER", [])
    assert users, "the runtime stage has no USER: the daemon would run as root"
    user = users[-1].split(":")[0]
    assert user.isdigit() and int(user) != 0, (
        f"USER {users[-1]}: a numeric non-root uid (runAsNonRoot can check only numbers)")
    runs = " ".join(final.get("RUN", []))
    assert re.search(rf"useradd\b.*--uid {user}\b", runs), f"no useradd of uid {user}"
    assert re.search(r"groupadd\b.*\bshardcast\b", runs), (
        "no group `shardcast` in the image (configmap.yaml's socket_group)")
    copies = " ".join(final.get("COPY", []))
    for binary in ("shardcastd", "shardcast"):
        assert re.search(rf"--from=\S+ .*/{binary}(\s|$)", copies), (
            f"the runtime stage copies no {binary} from the build stage: COPY {copies}")
    entry = json.loads(final.get("ENTRYPOINT", ["[]"])[-1])
    assert entry and os.path.basename(entry[0]) == "shardcastd", f"ENTRYPOINT {entry}"
    cmd = json.loads(final.get("CMD", ["[]"])[-1])
    assert cmd == ["--config", "/etc/shardcast/shardcastd.json"], f"CMD {cmd}"
    exposed = " ".join(final.get("EXPOSE", [])).split()
    for port in ("7443", "9464"):
        assert port in exposed, f"EXPOSE {exposed}: port {port} missing"
    build_runs = " ".join(r for w, r in st[0][1] if w == "RUN")
    assert "--target shardcastd shardcast" in build_runs or \
        re.search(r"--target\s+shardcast\s+shardcastd", build_runs), (
            "the build stage does not build the shardcastd and shardcast targets")


def test_dockerfile_user_matches_the_manifests(pod_spec, container):
    final = stages()[-1][1]
    user = [r for w, r in final if w == "USER"][-1].split(":")[0]
    assert container["securityContext"]["runAsUser"] == int(user), (
        f"DaemonSet runAsUser {container['securityContext']['runAsUser']} != Dockerfile "
        f"USER {user}")


def _apt_cache_works():
    if shutil.which("apt-cache") is None:
        return "apt-cache is not installed"
    probe = subprocess.run(["apt-cache", "show", "--no-all-versions", "libc6"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=60)
    if probe.returncode != 0:
        return "apt-cache knows no packages here (run apt-get update)"
    return None


def apt_candidates(packages):
    """{package: candidate version} for those of `packages` apt knows (one
    `apt-cache policy` call)."""
    proc = subprocess.run(["apt-cache", "policy"] + list(packages), stdout=subprocess.PIPE,
                          stderr=subprocess.DEVNULL, timeout=120, text=True)
    out, current = {}, None
    for line in proc.stdout.splitlines():
        if line and not line.startswith(" ") and line.endswith(":"):
            current = line[:-1]
        elif current and line.strip().startswith("Candidate:"):
            candidate = line.split(":", 1)[1].strip()
            if candidate != "(none)":
                out[current] = candidate
    return out


def test_dockerfile_apt_packages_exist_in_debian():
    """Every package an `apt-get install` names has an installable candidate
    in apt (this machine is Debian bookworm, as the image is)."""
    why = _apt_cache_works()
    if why:
        pytest.skip(why)
    for image, instructions in stages():
        pkgs = [p for w, r in instructions if w == "RUN" for p in apt_packages(r)]
        assert pkgs, f"stage FROM {image} installs no packages"
        known = apt_candidates(pkgs)
        missing = [p for p in pkgs if p not in known]
        assert not missing, f"stage FROM {image}: apt has no candidate for {missing}"


def owning_packages(paths):
    """{path: Debian package} for the paths dpkg knows (one `dpkg -S`)."""
    proc = subprocess.run(["dpkg", "-S"] + sorted(set(paths)), stdout=subprocess.PIPE,
                          stderr=subprocess.DEVNULL, timeout=120, text=True)
    out = {}
    for line in proc.stdout.splitlines():
        m = re.match(r"^([^:]+(?::[a-z0-9]+)?(?:, [^:]+(?::[a-z0-9]+)?)*): (/.*)$", line)
        if m and not line.startswith("diversion "):
            out[m.group(2)] = m.group(1).split(",")[0].split(":")[0].strip()
    return out


def test_runtime_stage_provides_every_shared_library_of_the_binaries():
    """ldd of the built binaries: each library's Debian package is one the
    runtime stage installs, or one of their dependencies (so the image's
    binaries start)."""
    why = _apt_cache_works()
    if why:
        pytest.skip(why)
    for tool in ("ldd", "dpkg"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed")
    binaries = [b for b in (SHARDCASTD_BIN, SHARDCAST_BIN) if b.is_file()]
    assert binaries, f"neither {SHARDCASTD_BIN} nor {SHARDCAST_BIN} exists (build them)"
    runtime = [p for w, r in stages()[-1][1] if w == "RUN" for p in apt_packages(r)]
    deps = subprocess.run(["apt-cache", "depends", "--recurse", "--important"] + runtime,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=120,
                          text=True)
    assert deps.returncode == 0, deps.stderr
    provided = {line.strip() for line in deps.stdout.splitlines()
                if line and not line.startswith(" ") and not line.startswith("<")}
    libs = {}  # library path -> [binary names]
    for binary in binaries:
        out = subprocess.run(["ldd", str(binary)], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, timeout=60, text=True).stdout
        assert "not found" not in out, f"ldd {binary}: a library is missing here:\n{out}"
        if re.search(r"lib(asan|tsan|ubsan)\.so", out):
            pytest.skip(f"{binary.name} is a sanitizer build; the image is built without")
        for lib in re.findall(r"=>\s+(/\S+)", out):
            libs.setdefault(lib, []).append(binary.name)

    def spellings(lib):
        # The same file under /lib and /usr/lib (merged /usr): dpkg knows one.
        real = os.path.realpath(lib)
        out = {lib, real}
        for p in (lib, real):
            if p.startswith("/usr/lib/"):
                out.add(p[len("/usr"):])
            elif p.startswith("/lib/"):
                out.add("/usr" + p)
        return out

    owners = owning_packages(p for lib in libs for p in spellings(lib))
    problems = []
    for lib, users in sorted(libs.items()):
        owner = next((owners[p] for p in sorted(spellings(lib)) if p in owners), None)
        if owner is None:
            problems.append(f"{'/'.join(users)}: {lib} belongs to no Debian package")
        elif owner not in provided:
            problems.append(f"{'/'.join(users)}: {lib} is in {owner}, which the runtime "
                            f"stage does not install (nor anything it depends on)")
    assert not problems, "\n".join(problems)


# ---------------------------------------------------------------------------
# The ConfigMap's config, run by the real daemon.

def _openssl(*args, cwd):
    proc = subprocess.run(["openssl"] + list(args), cwd=cwd, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, timeout=60)
    assert proc.returncode == 0, f"openssl {' '.join(args)}: {proc.stderr.decode()}"


def make_certificates(d):
    """A CA, a server certificate for 127.0.0.1/localhost and a client
    certificate, all signed by the CA (EC keys: fast)."""
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", "2",
             "-subj", "/CN=shardcast test CA", cwd=d)
    for name, ext in (("server", "subjectAltName=IP:127.0.0.1,DNS:localhost"),
                      ("client", "extendedKeyUsage=clientAuth")):
        _openssl("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr",
                 "-subj", f"/CN=shardcast test {name}", cwd=d)
        (Path(d) / f"{name}.ext").write_text(ext + "\n")
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
                 "-CAcreateserial", "-out", f"{name}.crt", "-days", "2",
                 "-extfile", f"{name}.ext", cwd=d)


def log_value(log, pattern, what, timeout=10.0):
    """The first group of `pattern` in the daemon's log, waiting for it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = re.search(pattern, tail(log, 200000))
        if m:
            return m
        time.sleep(0.05)
    raise AssertionError(f"{what}: no line matching {pattern!r} in the daemon log:\n{tail(log)}")


def test_configmap_config_starts_the_daemon(request, tmp_path, config, container,
                                            package_logs):
    """shardcastd runs with the ConfigMap's JSON, its paths moved to a
    temporary directory (roots, socket, TLS files from a test CA) and its
    ports to free ones: it starts, logs JSON lines, /healthz answers 200, a
    client with a certificate of the CA lists the datasets over TLS and one
    without is refused, the readiness probe's own command exits 0, and
    SIGTERM ends it with exit 0 within the grace period."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is not installed (needed for test certificates)")
    for b in (SHARDCASTD_BIN, SHARDCAST_BIN):
        assert b.is_file(), f"{b} not found (set SHARDCASTD_BIN / SHARDCAST_BIN)"
    import shardcast

    # Unix socket paths are limited to 108 bytes: a short directory in /tmp.
    sock_dir = Path(tempfile.mkdtemp(prefix="sck8s-", dir="/tmp"))
    daemon = None
    try:
        root = tmp_path / "root"
        root.mkdir()
        dataset = synth(root, "--layers", "6", "--tokens", 16, "--d-model", 32,
                        "--examples", 40, "--seed", 5)
        tls = tmp_path / "tls"
        tls.mkdir()
        make_certificates(tls)
        sock = sock_dir / "shardcastd.sock"
        cfg = dict(config)
        cfg["roots"] = [str(root)]
        cfg["listen"] = f"unix:{sock}"
        cfg["http"] = "127.0.0.1:0"
        cfg["listen_tcp"] = "127.0.0.1:0"
        tls_dir = os.path.dirname(config["tls_cert"])
        for key in ("tls_cert", "tls_key", "tls_client_ca"):
            if key in cfg:
                # The Secret's file names (tls.crt, tls.key, ca.crt) -> ours.
                name = {"tls.crt": "server.crt", "tls.key": "server.key",
                        "ca.crt": "ca.crt"}.get(os.path.basename(cfg[key]))
                assert name and os.path.dirname(cfg[key]) == tls_dir, (
                    f"{key} {cfg[key]}: expected tls.crt, tls.key or ca.crt in {tls_dir}")
                cfg[key] = str(tls / name)
        # The image's group; here the test user's own.
        cfg["socket_group"] = grp.getgrgid(os.getgid()).gr_name
        cfg_path = tmp_path / "shardcastd.json"
        cfg_path.write_text(json.dumps(cfg, indent=2))

        log = tmp_path / "shardcastd.log"
        package_logs.logs[request.node.nodeid].append(str(log))
        daemon = Daemon([], sock, log)
        daemon.cmd = [str(SHARDCASTD_BIN), "--config", str(cfg_path)]
        daemon.start().wait_ready(timeout=15)

        m = log_value(log, r"HTTP admin on [^ \"]*:(\d+)", "admin port")
        if cfg.get("log_format") == "json":
            line = next(l for l in tail(log, 200000).splitlines() if "HTTP admin on" in l)
            try:
                record = json.loads(line)
            except ValueError:
                raise AssertionError(f"log_format json, but the log line is not JSON: {line!r}")
            assert isinstance(record, dict) and "msg" in record and "level" in record, (
                f"JSON log line without msg/level: {line!r}")
        status, body = http_get(int(m.group(1)), "/healthz")
        assert status == 200, f"/healthz -> {status} {body!r}"

        tcp = int(log_value(log, r"listening on 127\.0\.0\.1:(\d+)", "TCP port").group(1))
        with shardcast.Client(f"127.0.0.1:{tcp}", tls_ca=str(tls / "ca.crt"),
                              tls_cert=str(tls / "client.crt"),
                              tls_key=str(tls / "client.key"), timeout=5) as client:
            ids = [d.id for d in client.datasets()]
        assert dataset.name in ids, f"over TLS: datasets {ids}, expected {dataset.name}"
        if "tls_client_ca" in cfg:
            with pytest.raises(shardcast.Error):
                with shardcast.Client(f"127.0.0.1:{tcp}", tls_ca=str(tls / "ca.crt"),
                                      timeout=2) as client:
                    client.datasets()

        # The readiness probe, exactly as the DaemonSet runs it, on our socket.
        probe = list(container["readinessProbe"]["exec"]["command"])
        probe[0] = str(SHARDCAST_BIN)
        probe = [f"unix:{sock}" if a == config["listen"] else a for a in probe]
        proc = subprocess.run(probe, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              timeout=container["readinessProbe"].get("timeoutSeconds", 10) + 5)
        assert proc.returncode == 0, (
            f"readiness probe {' '.join(probe)} -> exit {proc.returncode}\n"
            f"stdout: {proc.stdout.decode(errors='replace')}\n"
            f"stderr: {proc.stderr.decode(errors='replace')}")

        daemon.proc.send_signal(signal.SIGTERM)
        grace = float(config.get("shutdown_grace_seconds", DEFAULT_SHUTDOWN_GRACE_SECONDS))
        rc = daemon.proc.wait(timeout=grace + 10)
        assert rc == 0, f"SIGTERM -> exit {rc}\n{daemon.describe()}"
    finally:
        if daemon is not None:
            daemon.stop()
        shutil.rmtree(sock_dir, ignore_errors=True)


# ---------------------------------------------------------------------------
# sweep.yaml: a sweep across nodes (docs/sweeps.md)

def test_sweep_statefulset_names_every_peer_through_its_headless_service(
        manifests, config, tmp_path):
    """One daemon per node (anti-affinity), as many as SWEEP_NODES; the
    headless Service publishes them before they are ready; the container's
    script, run here with a stand-in shardcastd, gives the daemon its rank
    from the pod's ordinal and every peer's DNS name in ordinal order, on
    the TLS port the config listens on, with mutual TLS configured."""
    svc = get(manifests, "Service", "shardcastd-sweep")
    sts = get(manifests, "StatefulSet", "shardcastd-sweep")
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["publishNotReadyAddresses"] is True
    labels = sts["spec"]["template"]["metadata"]["labels"]
    assert all(labels.get(k) == v for k, v in svc["spec"]["selector"].items())
    assert sts["spec"]["serviceName"] == "shardcastd-sweep"
    pod = sts["spec"]["template"]["spec"]
    anti = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert anti[0]["topologyKey"] == "kubernetes.io/hostname"
    assert anti[0]["labelSelector"]["matchLabels"] == svc["spec"]["selector"]
    c = {c["name"]: c for c in pod["containers"]}["shardcastd"]
    check_fields(c, CONTAINER_FIELDS, "StatefulSet shardcastd-sweep container")
    env = {e["name"]: e["value"] for e in c["env"]}
    nodes = int(env["SWEEP_NODES"])
    assert nodes == sts["spec"]["replicas"], "SWEEP_NODES must equal replicas"
    port = int(config["listen_tcp"].rsplit(":", 1)[1])
    assert {p["name"]: p["containerPort"] for p in c["ports"]}["tls"] == port
    assert config.get("tls_client_ca"), "peers authenticate each other: mutual TLS"
    # The script, with a stand-in that prints its arguments.
    fake = tmp_path / "shardcastd"
    fake.write_text('#!/bin/sh\nfor a in "$@"; do echo "$a"; done\n')
    fake.chmod(0o755)
    script = c["args"][0].replace("/usr/local/bin/shardcastd", str(fake))
    assert c["command"] == ["/bin/sh", "-c"]
    out = subprocess.run(["/bin/sh", "-c", script], capture_output=True, text=True,
                         env={"HOSTNAME": "shardcastd-sweep-2", "SWEEP_NODES": str(nodes),
                              "PATH": "/usr/bin:/bin"}, timeout=10)
    assert out.returncode == 0, out.stderr
    args = out.stdout.split("\n")[:-1]
    assert args[args.index("--node-rank") + 1] == "2"
    assert args[args.index("--listen") + 1] == "unix:/run/shardcast-sweep/shardcastd.sock"
    peers = [args[i + 1] for i, a in enumerate(args) if a == "--sweep-peer"]
    assert peers == [f"shardcastd-sweep-{i}.shardcastd-sweep.{NAMESPACE}.svc.cluster.local:{port}"
                     for i in range(nodes)], peers
    mounts = {m["mountPath"] for m in c["volumeMounts"]}
    assert "/run/shardcast-sweep" in mounts and "/etc/shardcast-tls" in mounts
