"""No setup: a Client given no address, with no SHARDCAST_ADDRESS and no
node daemon, starts the user's own shardcastd (shardcast._daemon), which the
user's later processes find and share, and which exits when idle.

Each case runs the package in child processes whose XDG_RUNTIME_DIR is a
fresh mode-0700 directory, so they never meet another test's daemon.
"""

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from package_fixtures import (CHILD_ENV, SHARDCASTD_BIN, datasets,  # noqa: F401
                              package_logs)

TRAINER = """
import sys, shardcast
c = shardcast.Client()
info = c.attach(sys.argv[1])
n = 0
with c.stream(info.id, layer=5, batch_size=8, epochs=1) as s:
    for b in s:
        n += b.rows
lock = c.address[len("unix:"):] + ".lock"
print(c.address, open(lock).read().strip(), n)
"""


@pytest.fixture
def runtime_dir():
    d = Path(tempfile.mkdtemp(prefix="scxdg-", dir="/tmp"))
    os.chmod(d, 0o700)
    yield d
    sock = d / "shardcast" / "shardcastd.sock"
    lock = Path(str(sock) + ".lock")
    if lock.exists():  # stop the daemon a case started
        try:
            os.kill(int(lock.read_text().split()[0]), signal.SIGTERM)
        except (ValueError, ProcessLookupError):
            pass
        deadline = time.monotonic() + 15
        while lock.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    subprocess.run(["rm", "-rf", str(d)])


def _env(runtime_dir, **extra):
    env = dict(CHILD_ENV, XDG_RUNTIME_DIR=str(runtime_dir),
               SHARDCASTD_BIN=str(SHARDCASTD_BIN))
    env.pop("SHARDCAST_ADDRESS", None)
    env.pop("SHARDCAST_NO_AUTOSTART", None)  # the suite sets it
    env.update(extra)
    return env


def _run(code, *args, env, timeout=60):
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_trainers_without_an_address_start_one_daemon_and_share_it(
        datasets, runtime_dir):
    """Three trainers started together with no address: one daemon is
    started (in the user's runtime directory, mode 0700), all three stream
    a whole epoch from it, and a later trainer finds the same daemon."""
    r = datasets.plain
    env = _env(runtime_dir)
    procs = [subprocess.Popen([sys.executable, "-c", TRAINER, str(r.path)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(3)]
    outs = [p.communicate(timeout=60) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
    want = r.N * 8  # one layer, 8 content tokens
    lines = {tuple(out.split()) for out, _ in outs}
    assert len(lines) == 1, lines  # one address, one daemon pid
    address, pid, n = lines.pop()
    assert address == f"unix:{runtime_dir}/shardcast/shardcastd.sock"
    assert int(n) == want
    assert os.stat(runtime_dir / "shardcast").st_mode & 0o777 == 0o700
    later = _run(TRAINER, r.path, env=env)
    assert later.returncode == 0, later.stderr
    assert later.stdout.split()[1] == pid, "a later trainer found the same daemon"
    cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    assert b"--exit-when-idle" in cmd and b"--root" not in cmd, cmd


def test_a_private_directory_open_to_others_is_refused(datasets, runtime_dir):
    """The daemon's directory must be the user's and closed to others: one
    that is not is named in the error, and no daemon is started in it."""
    d = runtime_dir / "shardcast"
    d.mkdir(mode=0o755)
    os.chmod(d, 0o755)
    out = _run(TRAINER, datasets.plain.path, env=_env(runtime_dir))
    assert out.returncode != 0
    assert "FAILED_PRECONDITION" in out.stderr and str(d) in out.stderr, out.stderr
    assert not (d / "shardcastd.sock").exists()


def test_no_daemon_binary_is_a_clear_error(runtime_dir, tmp_path):
    """Nothing running and no shardcastd to start (not in $SHARDCASTD_BIN,
    on PATH or beside the package): NOT_FOUND saying how to fix it."""
    import shardcast
    copy = tmp_path / "pkg"
    shutil.copytree(Path(shardcast.__file__).parent, copy / "shardcast")
    env = _env(runtime_dir, SHARDCASTD_BIN="/nonexistent/shardcastd",
               PATH="/usr/bin:/bin", PYTHONPATH=str(copy))
    code = ("import shardcast\n"
            "try:\n    shardcast.Client()\n"
            "except shardcast.Error as e:\n    print(e.code, e.message)\n")
    out = _run(code, env=env)
    assert out.stdout.startswith("NOT_FOUND") and "SHARDCASTD_BIN" in out.stdout, (
        out.stdout + out.stderr)


def test_the_daemon_exits_when_no_client_is_left(tmp_path):
    """--exit-when-idle S: with a client connected the daemon stays past S;
    S seconds after the last one leaves it exits 0 and removes its socket."""
    sock = tmp_path / "d.sock"
    log = open(tmp_path / "d.log", "wb")
    proc = subprocess.Popen([str(SHARDCASTD_BIN), "--listen", f"unix:{sock}",
                             "--exit-when-idle", "1", "--reservoir-bytes", "64M"],
                            stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 10
        while not sock.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        holder = subprocess.Popen(
            [sys.executable, "-c",
             "import sys, time, shardcast\n"
             "c = shardcast.Client(sys.argv[1]); print('up', flush=True)\n"
             "time.sleep(3)\n", f"unix:{sock}"],
            env=CHILD_ENV, stdout=subprocess.PIPE, text=True)
        assert holder.stdout.readline().strip() == "up"
        time.sleep(2)
        assert proc.poll() is None, "exited while a client was connected"
        holder.wait(timeout=30)
        assert proc.wait(timeout=10) == 0
        assert not sock.exists()
        assert "--exit-when-idle" in (tmp_path / "d.log").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()


def test_the_cli_without_an_address_starts_the_same_daemon_python_finds(
        datasets, runtime_dir):
    """`shardcast stream DIR --check` with no --server and no
    SHARDCAST_ADDRESS starts the user's daemon; a Python trainer then finds
    that one."""
    from package_fixtures import SHARDCAST_BIN
    r = datasets.plain
    env = _env(runtime_dir)
    out = subprocess.run([str(SHARDCAST_BIN), "stream", str(r.path), "--layer", "5",
                          "--epochs", "1", "--check"], env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "check: ok" in out.stdout + out.stderr
    lock = runtime_dir / "shardcast" / "shardcastd.sock.lock"
    pid = lock.read_text().split()[0]
    later = _run(TRAINER, r.path, env=env)
    assert later.returncode == 0, later.stderr
    assert later.stdout.split()[1] == pid


def test_no_autostart_fails_instead_of_starting_a_daemon(datasets, runtime_dir):
    """SHARDCAST_NO_AUTOSTART (sites that forbid per-user daemons; this
    test suite): no address and no daemon is UNAVAILABLE naming the
    variables, from the package and from the CLI, and nothing is started."""
    from package_fixtures import SHARDCAST_BIN
    env = _env(runtime_dir, SHARDCAST_NO_AUTOSTART="1")
    code = ("import shardcast\n"
            "try:\n    shardcast.Client()\n"
            "except shardcast.Error as e:\n    print(e.code, e.message)\n")
    out = _run(code, env=env)
    assert out.stdout.startswith("UNAVAILABLE") and "SHARDCAST_NO_AUTOSTART" in out.stdout, (
        out.stdout + out.stderr)
    cli = subprocess.run([str(SHARDCAST_BIN), "ls"], env=env, capture_output=True,
                         text=True, timeout=60)
    assert cli.returncode == 1 and "SHARDCAST_NO_AUTOSTART" in cli.stderr, cli.stderr
    assert not (runtime_dir / "shardcast" / "shardcastd.sock").exists()
