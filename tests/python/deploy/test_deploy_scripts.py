"""Static and semi-static checks of the deployment files:

- every shell script of deploy/, .ci/ and the test drivers (tests/run.sh,
  tests/fuzz/*.sh) passes shellcheck with no finding at all, and the Slurm
  scripts are executable (Slurm runs Prolog/Epilog/TaskProlog directly);
- deploy/systemd/shardcastd.service passes `systemd-analyze verify` (a copy
  whose ExecStart is the built daemon), keeps its hardening (`systemd-analyze
  security --offline=yes` exposure), protects the example config's roots, has
  memory limits sized from the example config's reservoir, and its system
  call filter and address families allow everything the real daemon does
  (the daemon run under strace through health, listing, both stream kinds,
  queries, status, /healthz, /metrics, SIGHUP and SIGTERM).

shellcheck and systemd-analyze come from Debian's `shellcheck` and `systemd`
packages (deploy/install-deps.sh); without them these tests skip, saying so.
Binaries: $SHARDCASTD_BIN and $SHARDCAST_BIN (set by ctest), else
<repo>/build/shardcastd and <repo>/build/shardcast.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parent.parent.parent
UNIT = REPO_ROOT / "deploy" / "systemd" / "shardcastd.service"
EXAMPLE_CONFIG = REPO_ROOT / "deploy" / "shardcastd.example.json"
MIB = 1 << 20


def _binary(variable, name):
    value = os.environ.get(variable)
    return (Path(value) if value else REPO_ROOT / "build" / name).resolve()


SHARDCASTD = _binary("SHARDCASTD_BIN", "shardcastd")
SHARDCAST = _binary("SHARDCAST_BIN", "shardcast")


def need(tool, package):
    path = shutil.which(tool)
    if path is None:
        pytest.skip(f"{tool} is not installed (Debian package `{package}`; "
                    "deploy/install-deps.sh installs it, CI has it)")
    return path


def need_binary(path):
    if not (path.is_file() and os.access(path, os.X_OK)):
        pytest.fail(f"{path} not found (set SHARDCASTD_BIN/SHARDCAST_BIN or build into "
                    f"{REPO_ROOT / 'build'})")
    return path


# ---------------------------------------------------------------------------
# Shell scripts.

SHELLS = re.compile(rb"^#!\s*(/usr)?/bin/(env\s+)?(ba|da|k)?sh\b")


def shell_scripts():
    """Every shell script of deploy/ and .ci/ (by name *.sh/*.sbatch or by a
    shebang), and the test drivers tests/run.sh and tests/fuzz/*.sh."""
    found = set()
    for top in ("deploy", ".ci"):
        for path in sorted((REPO_ROOT / top).rglob("*")):
            if not path.is_file() or path.is_symlink():
                continue
            if path.suffix in (".sh", ".sbatch"):
                found.add(path)
                continue
            with open(path, "rb") as f:
                if SHELLS.match(f.readline(200)):
                    found.add(path)
    found.add(REPO_ROOT / "tests" / "run.sh")
    found.update((REPO_ROOT / "tests" / "fuzz").glob("*.sh"))
    return sorted(found)


SCRIPTS = shell_scripts()


def test_the_script_list_is_complete():
    """The discovery above finds at least the scripts we know of (so that a
    broken search cannot pass vacuously)."""
    names = {str(p.relative_to(REPO_ROOT)) for p in SCRIPTS}
    for want in ("deploy/demo.sh", "deploy/install-deps.sh", ".ci/run", "tests/run.sh",
                 "tests/fuzz/run.sh", "deploy/slurm/shardcast-job.sh",
                 "deploy/slurm/prolog.sh", "deploy/slurm/epilog.sh",
                 "deploy/slurm/task-prolog.sh", "deploy/slurm/example.sbatch"):
        assert want in names, f"{want} not found among {sorted(names)}"


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_shellcheck_finds_nothing(script):
    """shellcheck at its default severity (style and up): no finding. -x
    follows the files a script sources (`# shellcheck source=` directives,
    relative to the script's directory)."""
    shellcheck = need("shellcheck", "shellcheck")
    proc = subprocess.run([shellcheck, "-x", "--format=gcc", str(script)], cwd=script.parent,
                          capture_output=True, timeout=120)
    out = (proc.stdout + proc.stderr).decode(errors="replace")
    assert proc.returncode == 0 and not out.strip(), out


@pytest.mark.parametrize("script", sorted(p for p in (REPO_ROOT / "deploy" / "slurm").glob("*.sh")
                                          if not p.name.endswith("-common.sh")),  # sourced
                         ids=lambda p: p.name)
def test_slurm_scripts_are_executable(script):
    assert os.access(script, os.X_OK), f"chmod +x {script} (slurmd executes it directly)"


# ---------------------------------------------------------------------------
# The systemd unit.

def parse_unit(text):
    """{section: [(key, value)]}; keys may repeat, as in systemd."""
    out, section = {}, None
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            out.setdefault(section, [])
            continue
        key, _, value = line.partition("=")
        out[section].append((key.strip(), value.strip()))
    return out


def values(unit, section, key):
    return [v for k, v in unit.get(section, []) if k == key]


def one(unit, section, key):
    found = values(unit, section, key)
    assert len(found) == 1, f"[{section}] {key}= appears {len(found)} times: {found}"
    return found[0]


def size(text):
    """A systemd size (K, M, G, T: powers of 1024) in bytes."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([KMGT]?)", text)
    assert m, f"not a size: {text}"
    return int(float(m.group(1)) * 1024 ** " KMGT".index(m.group(2) or " "))


@pytest.fixture(scope="module")
def unit():
    return parse_unit(UNIT.read_text())


@pytest.fixture(scope="module")
def example_config():
    return json.loads(EXAMPLE_CONFIG.read_text())


@pytest.fixture
def unit_copy(tmp_path):
    """A copy of the unit named shardcastd.service whose ExecStart runs the
    built daemon (verify checks that the binary exists); `edit` changes it."""
    daemon = need_binary(SHARDCASTD)
    text = UNIT.read_text()
    assert "ExecStart=/usr/local/bin/shardcastd " in text
    text = text.replace("ExecStart=/usr/local/bin/shardcastd ", f"ExecStart={daemon} ")

    def write(edit=lambda t: t):
        d = tempfile.mkdtemp(dir=tmp_path)
        path = Path(d) / "shardcastd.service"
        path.write_text(edit(text))
        return path
    return write


def verify(path):
    """(exit status, problems about our unit, other lines) of
    `systemd-analyze verify`.

    Strict about our unit: it exits 0 for a misspelt key ("Unknown key ...,
    ignoring"), so every line naming the unit is a problem. Tolerated: lines
    about other units that verify loads as dependencies (network-online.target,
    remote-fs.target and what they pull in): those depend on the machine's
    systemd installation (containers, CI images), not on this file. Not an
    issue either: User=shardcast need not exist here; systemd 252's verify
    does not resolve users (checked: a unit with a nonexistent user passes).
    """
    tool = need("systemd-analyze", "systemd")
    env = dict(os.environ, SYSTEMD_LOG_COLOR="0", SYSTEMD_PAGER="", SYSTEMD_LOG_LEVEL="info")
    proc = subprocess.run([tool, "verify", str(path)], cwd=path.parent, env=env,
                          capture_output=True, timeout=120)
    lines = [x for x in (proc.stdout + proc.stderr).decode(errors="replace").splitlines()
             if x.strip()]
    ours = [x for x in lines if "shardcastd" in x]
    return proc.returncode, ours, [x for x in lines if x not in ours]


def test_unit_passes_systemd_analyze_verify(unit_copy):
    status, ours, others = verify(unit_copy())
    assert status == 0 and not ours, "\n".join(ours + others)
    if others:
        print("systemd-analyze verify, about other units (tolerated):\n" + "\n".join(others))


def test_unit_verify_check_catches_mistakes(unit_copy):
    """The check above is strict: a misspelt key (exit 0, one warning) and a
    missing binary (exit 1) are both caught."""
    status, ours, _ = verify(unit_copy(lambda t: t.replace("ProtectSystem=", "ProtectSytem=")))
    assert any("Unknown key" in x and "ProtectSytem" in x for x in ours), ours
    status, ours, _ = verify(unit_copy(
        lambda t: re.sub(r"(?m)^ExecStart=\S+", "ExecStart=/nonexistent/shardcastd", t)))
    assert status != 0 and any("nonexistent" in x for x in ours), ours


def test_unit_security_exposure_stays_low(unit_copy):
    """`systemd-analyze security --offline=yes`: 1.9 ("OK") when written;
    anything above 2.0 means hardening was loosened."""
    tool = need("systemd-analyze", "systemd")
    path = unit_copy()
    proc = subprocess.run([tool, "security", "--offline=yes", "--no-pager", str(path)],
                          cwd=path.parent, capture_output=True, timeout=120,
                          env=dict(os.environ, SYSTEMD_LOG_COLOR="0"))
    out = proc.stdout.decode(errors="replace")
    m = re.search(r"Overall exposure level for shardcastd\.service: (\d+\.\d+)", out)
    if m is None and "--offline" in proc.stderr.decode(errors="replace"):
        pytest.skip("this systemd-analyze has no --offline (systemd < 250)")
    assert m, out + proc.stderr.decode(errors="replace")
    assert float(m.group(1)) <= 2.0, out


def test_unit_hardening_and_roots(unit, example_config):
    """A dedicated user, a read-only system with the socket directory as the
    only writable place, and every root of the example config read-only and
    waited for."""
    service = "Service"
    assert one(unit, service, "User") == "shardcast"
    assert one(unit, service, "Group") == "shardcast"
    assert one(unit, service, "NoNewPrivileges") == "yes"
    assert one(unit, service, "ProtectSystem") == "strict"
    assert one(unit, service, "ProtectHome") in ("yes", "read-only", "tmpfs")
    assert one(unit, service, "PrivateTmp") == "yes"
    assert one(unit, service, "CapabilityBoundingSet") == ""
    assert one(unit, service, "ExecStart").split() == [
        "/usr/local/bin/shardcastd", "--config", "/etc/shardcast/shardcastd.json"]
    runtime = one(unit, service, "RuntimeDirectory")
    listen = example_config["listen"]
    assert listen.startswith("unix:")
    assert Path(listen[len("unix:"):]).parent == Path("/run") / runtime
    assert values(unit, service, "ReadWritePaths") == [f"/run/{runtime}"]
    read_only = [p.lstrip("-") for v in values(unit, service, "ReadOnlyPaths")
                 for p in v.split()]
    mounts = [p for v in values(unit, "Unit", "RequiresMountsFor") for p in v.split()]
    for root in example_config["roots"]:
        assert root in read_only, f"ReadOnlyPaths= lacks the root {root}"
        assert root in mounts, f"RequiresMountsFor= lacks the root {root}"


def test_unit_memory_limits_follow_the_reservoir(unit, example_config):
    """The daemon's bound is reservoir_bytes + 10 % + 64 MiB (docs/benchmarks.md,
    "Targets"): MemoryHigh= sits at it (within 1 %), MemoryMax= above; a
    change of the example config's reservoir without the unit fails here."""
    bound = example_config["reservoir_bytes"] * 1.1 + 64 * MIB
    high = size(one(unit, "Service", "MemoryHigh"))
    limit = size(one(unit, "Service", "MemoryMax"))
    assert bound <= high <= bound * 1.01, (bound / MIB, high / MIB)
    assert high < limit <= high + 1024 * MIB, (high / MIB, limit / MIB)
    assert int(one(unit, "Service", "TasksMax")) >= 1024
    assert one(unit, "Service", "MemorySwapMax") == "0"


# ---------------------------------------------------------------------------
# The unit's filters against what the daemon does.

def syscall_groups():
    """{"@group": [syscall or @group, ...]} from systemd-analyze."""
    tool = need("systemd-analyze", "systemd")
    out = subprocess.run([tool, "syscall-filter", "--no-pager"], capture_output=True,
                         timeout=60).stdout.decode()
    groups, current = {}, None
    for line in out.splitlines():
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        if not line.startswith((" ", "\t")):
            current = text if text.startswith("@") else None
            if current:
                groups[current] = []
        elif current:
            groups[current].append(text)
    return groups


def expand(names, groups, seen=None):
    seen = set() if seen is None else seen
    out = set()
    for name in names:
        if name.startswith("@"):
            if name in seen:
                continue
            seen.add(name)
            assert name in groups, f"unknown syscall group {name}"
            out |= expand(groups[name], groups, seen)
        else:
            out.add(name)
    return out


def test_daemon_syscalls_and_socket_families_pass_the_units_filters(unit, tmp_path):
    """Runs the daemon under strace through everything a node service does
    and checks each system call against SystemCallFilter= (a call outside it
    would kill the daemon with SIGSYS under systemd), each socket family
    against RestrictAddressFamilies=, and that nothing maps memory writable
    and executable or makes it executable (MemoryDenyWriteExecute=)."""
    strace = need("strace", "strace")
    daemon, cli = need_binary(SHARDCASTD), need_binary(SHARDCAST)
    image = daemon.read_bytes()
    for runtime in (b"libasan.so", b"libtsan.so", b"libubsan.so", b"__asan_init",
                    b"__tsan_init"):
        if runtime in image:
            pytest.skip(f"{daemon} is a sanitizer build: LeakSanitizer fails under ptrace "
                        "(strace), and the filter is for the installed, normal build "
                        "(checked in the normal ctest run)")
    filters = values(unit, "Service", "SystemCallFilter")
    assert filters and not any(f.startswith("~") for f in filters), filters
    allowed = expand([n for f in filters for n in f.split()], syscall_groups())
    families = one(unit, "Service", "RestrictAddressFamilies").split()

    root = tmp_path / "root"
    proc = subprocess.run([str(cli), "synth", str(root), "--layers", "6", "--tokens", "16",
                           "--d-model", "32", "--examples", "40", "--json"],
                          capture_output=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    ident = Path(json.loads(proc.stdout)["path"]).name
    run = Path(tempfile.mkdtemp(prefix="sc", dir="/tmp"))
    sock = run / "d.sock"
    trace, log = tmp_path / "trace", tmp_path / "daemon.log"
    with open(log, "wb") as logf:
        tracer = subprocess.Popen(
            [strace, "-f", "-qq", "-o", str(trace), str(daemon), "--root", str(root),
             "--listen", f"unix:{sock}", "--http", "127.0.0.1:0", "--reservoir-bytes", "64M",
             "--block-bytes", "16K", "--shuffle-window", "4", "--lag-blocks", "8"],
            stdin=subprocess.DEVNULL, stdout=logf, stderr=logf, start_new_session=True)
    daemon_pid = None
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and tracer.poll() is None:
            children = Path(f"/proc/{tracer.pid}/task/{tracer.pid}/children")
            kids = children.read_text().split() if children.exists() else []
            if kids and sock.exists():
                daemon_pid = int(kids[0])
                if subprocess.run([str(cli), "--server", f"unix:{sock}", "ls"],
                                  capture_output=True, timeout=30).returncode == 0:
                    break
            time.sleep(0.1)
        else:
            text = log.read_text(errors="replace")
            if "ptrace" in text and "Operation not permitted" in text:
                pytest.skip(f"strace cannot trace here (no ptrace): {text[-500:]}")
            pytest.fail(f"the daemon under strace did not start\n{text}")

        def cli_ok(*args):
            p = subprocess.run([str(cli), "--server", f"unix:{sock}", *args],
                               capture_output=True, timeout=60)
            assert p.returncode == 0, (args, p.stderr.decode(errors="replace"))
        cli_help = subprocess.run([str(cli), "--help"], capture_output=True, timeout=30)
        if b"\n  health " in cli_help.stdout:
            cli_ok("health")
        cli_ok("stream", ident, "--order", "shuffled", "--check")
        cli_ok("--no-shared-memory", "stream", ident, "--order", "ordered", "--check")
        cli_ok("get", ident, "--example", "3", "--layer", "6", "--token", "2")
        cli_ok("status", "--json")
        m = re.search(rb"HTTP admin on 127\.0\.0\.1:(\d+)", log.read_bytes())
        assert m, log.read_text()
        for page in ("healthz", "metrics"):
            with urllib.request.urlopen(f"http://127.0.0.1:{int(m.group(1))}/{page}",
                                        timeout=30) as r:
                assert r.status == 200
        os.kill(daemon_pid, signal.SIGHUP)
        time.sleep(0.5)
        cli_ok("ls")
        os.kill(daemon_pid, signal.SIGTERM)
        assert tracer.wait(timeout=60) == 0, log.read_text()
    finally:
        if tracer.poll() is None:
            os.killpg(tracer.pid, signal.SIGKILL)
            tracer.wait(timeout=30)
        shutil.rmtree(run, ignore_errors=True)

    calls, socket_families, wx = set(), set(), []
    for line in trace.read_text(errors="replace").splitlines():
        m = re.match(r"^\d+\s+([a-z0-9_]+)\((.*)", line)
        if not m:
            continue
        name, args = m.groups()
        calls.add(name)
        if name in ("socket", "socketpair"):
            socket_families.add(args.split(",")[0])
        if name in ("mprotect", "pkey_mprotect") and "PROT_EXEC" in args:
            wx.append(line)
        if name == "mmap" and "PROT_WRITE|PROT_EXEC" in args:
            wx.append(line)
    assert {"io_uring_setup", "memfd_create", "accept4"} <= calls, sorted(calls)
    assert not calls - allowed, (
        f"system calls outside SystemCallFilter=: {sorted(calls - allowed)}")
    assert socket_families <= set(families), (socket_families, families)
    assert not wx, "\n".join(wx[:10])


# ---------------------------------------------------------------------------
# The example config.

def test_the_example_config_starts_the_real_daemon(example_config):
    """deploy/shardcastd.example.json, with its paths moved to a temporary
    directory (and its socket group to this user's group), is accepted by
    the real daemon: it starts, says SERVING, and exits 0 on SIGTERM. Every
    other key and value is the file's own."""
    daemon = need_binary(SHARDCASTD)
    cli = need_binary(SHARDCAST)
    tmp = Path(tempfile.mkdtemp(prefix="scex", dir="/tmp"))  # short socket path
    try:
        root = tmp / "roots"
        root.mkdir()
        config = dict(example_config)
        config["roots"] = [str(root)]
        config["listen"] = f"unix:{tmp}/run/shardcastd.sock"
        config["socket_group"] = str(os.getgid())
        config["http"] = "127.0.0.1:0"
        for key in ("tls_cert", "tls_key", "tls_client_ca", "listen_tcp", "token_key_file"):
            assert key not in config, f"the example sets {key}: give the test a file for it"
        path = tmp / "shardcastd.json"
        path.write_text(json.dumps(config))
        log = open(tmp / "daemon.log", "wb")
        proc = subprocess.Popen([str(daemon), "--config", str(path)], stdout=log, stderr=log)
        try:
            health = None
            for _ in range(100):
                if proc.poll() is not None:
                    break
                health = subprocess.run([str(cli), "--server", config["listen"], "health",
                                         "--timeout", "1"], capture_output=True, timeout=30)
                if health.returncode == 0:
                    break
                time.sleep(0.1)
            text = (tmp / "daemon.log").read_text(errors="replace")
            assert health is not None and health.returncode == 0, (
                f"the daemon did not become SERVING with the example config:\n{text}")
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            rc = proc.wait(timeout=30)
            log.close()
        assert rc == 0, (tmp / "daemon.log").read_text(errors="replace")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
