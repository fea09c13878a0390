"""The Slurm integration (deploy/slurm/) end to end against the real daemon,
without Slurm: the scripts are run with the SLURM_* variables a job (or
slurmd) would give them.

- shardcast-job.sh, the per-job wrapper: a "job" of two trainers (the CLI
  and the Python package) streaming through SHARDCAST_ADDRESS; a failing
  command; SIGTERM to the wrapper (as scancel sends); SIGKILL to the wrapper
  (the daemon follows through --exit-with-parent, the next job removes the
  directory left); daemons that cannot start; usage errors.
- prolog.sh / task-prolog.sh / epilog.sh: the admin-installed per-job daemon
  (SHARDCAST_JOB_RUNDIR in a temporary directory, the job's user = the user
  running the tests; as root also a real switch to `nobody`).
- example.sbatch with a stand-in `srun` that runs the tasks on this node.

After every job: no shardcastd whose command line names the job's socket
directory, no trainer with the job's SHARDCAST_ADDRESS in its environment,
and no directory left (except after SIGKILL, as documented). Expected
vectors come from numpy (saev_reference.py via package_fixtures.Reference).

Binaries: $SHARDCASTD_BIN and $SHARDCAST_BIN (set by ctest), else
<repo>/build/shardcastd and <repo>/build/shardcast. What was not run here (a
real Slurm cluster) and how to try it: deploy/slurm/README.md.
"""

import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import types
from pathlib import Path

import numpy as np
import pytest

from package_fixtures import CLIENT_DIR, HERE, REPO_ROOT, Reference, assert_exact_epoch

SLURM_DIR = REPO_ROOT / "deploy" / "slurm"
WRAPPER = SLURM_DIR / "shardcast-job.sh"
PROLOG = SLURM_DIR / "prolog.sh"
EPILOG = SLURM_DIR / "epilog.sh"
TASK_PROLOG = SLURM_DIR / "task-prolog.sh"
SBATCH = SLURM_DIR / "example.sbatch"

LAYER = 6
JOB_TIMEOUT = 90      # one wrapper or script run, start to end
GONE_TIMEOUT = 10     # a daemon to exit after its parent was SIGKILLed
# A small per-job daemon: 16 KiB blocks (128 vectors of D = 32).
SMALL = ["--reservoir-bytes", "64M", "--block-bytes", "16K", "--shuffle-window", "4",
         "--lag-blocks", "16", "--query-threads", "2"]


def _binary(variable, name):
    value = os.environ.get(variable)
    return (Path(value) if value else REPO_ROOT / "build" / name).resolve()


SHARDCASTD = _binary("SHARDCASTD_BIN", "shardcastd")
SHARDCAST = _binary("SHARDCAST_BIN", "shardcast")


# ---------------------------------------------------------------------------
# Processes.

def _read(path):
    try:
        return Path(path).read_bytes()
    except OSError:
        return b""


def _pids():
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            yield int(entry)


def _session(pid):
    stat = _read(f"/proc/{pid}/stat")
    try:
        return int(stat[stat.rindex(b")") + 2:].split()[3])
    except (ValueError, IndexError):
        return None


def daemons_in(directory):
    """[(pid, argv)] of live shardcastd processes whose command line names
    `directory` (a zombie's cmdline is empty: it does not count)."""
    needle = str(directory).encode()
    out = []
    for pid in _pids():
        argv = _read(f"/proc/{pid}/cmdline").split(b"\0")
        if argv and b"shardcastd" in os.path.basename(argv[0]) and \
                any(needle in a for a in argv):
            out.append((pid, [a.decode(errors="replace") for a in argv if a]))
    return out


def processes_with_address(directory):
    """[(pid, argv)] of processes with SHARDCAST_ADDRESS=unix:<directory>...
    in their environment: the job's trainers."""
    needle = f"SHARDCAST_ADDRESS=unix:{directory}".encode()
    out = []
    for pid in _pids():
        if any(v.startswith(needle) for v in _read(f"/proc/{pid}/environ").split(b"\0")):
            out.append((pid, _read(f"/proc/{pid}/cmdline").replace(b"\0", b" ").decode(
                errors="replace")))
    return out


def wait_until(predicate, timeout, interval=0.05):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() >= deadline:
            return value
        time.sleep(interval)


def assert_nothing_left(jobdir, proc_out=""):
    daemons = daemons_in(jobdir)
    assert not daemons, f"shardcastd still running for {jobdir}: {daemons}\n{proc_out}"
    trainers = processes_with_address(jobdir)
    assert not trainers, f"trainers of {jobdir} still running: {trainers}\n{proc_out}"
    assert not Path(jobdir).exists(), (
        f"{jobdir} is left: {sorted(os.listdir(jobdir))}\n{proc_out}")


class Reaper:
    """Kills, at the end of a test, whatever its jobs left: every process
    naming one of its directories on its command line or in its environment
    (the jobs' environments hold TMPDIR), and the sessions of the processes it
    started that were not reaped yet (a session id cannot be reused while its
    leader is an unreaped child); then removes the directories."""

    def __init__(self):
        self.popens = []
        self.dirs = []
        self.count = 0

    def tmpdir(self):
        # Unix socket paths hold 107 bytes: a short directory in /tmp.
        d = Path(tempfile.mkdtemp(prefix="sc", dir="/tmp"))
        self.dirs.append(d)
        return d

    def popen(self, cmd, **kwargs):
        """Starts `cmd` in a session of its own, its output in files (an
        orphaned child keeps no pipe of ours open): p.out_path, p.err_path."""
        self.count += 1
        logs = self.dirs[0] if self.dirs else self.tmpdir()
        out_path = logs / f"p{self.count}.out"
        err_path = logs / f"p{self.count}.err"
        kwargs.setdefault("stdin", subprocess.DEVNULL)
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            p = subprocess.Popen([str(c) for c in cmd], start_new_session=True,
                                 stdout=out, stderr=err, **kwargs)
        self.popens.append(p)
        p.cmd, p.out_path, p.err_path = cmd, out_path, err_path
        return p

    def finish(self, p, timeout=JOB_TIMEOUT):
        """Waits for p (killing everything on timeout); sets p.out, p.err and
        p.describe."""
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            p.wait(timeout=10)
            raise AssertionError(f"{p.cmd} ran past {timeout} s\n"
                                 f"stderr: {_read(p.err_path)[-3000:].decode(errors='replace')}")
        p.out = _read(p.out_path).decode(errors="replace")
        p.err = _read(p.err_path).decode(errors="replace")
        p.describe = (f"command: {' '.join(map(str, p.cmd))}\nexit: {p.returncode}\n"
                      f"stdout: {p.out[-3000:]}\nstderr: {p.err[-3000:]}")
        return p

    def run(self, cmd, timeout=JOB_TIMEOUT, **kwargs):
        return self.finish(self.popen(cmd, **kwargs), timeout)

    def kill(self):
        needles = [str(d).encode() for d in self.dirs]
        sessions = {p.pid for p in self.popens if p.returncode is None}
        for pid in _pids():
            mine = _session(pid) in sessions
            if not mine and needles:
                blob = _read(f"/proc/{pid}/cmdline") + b"\0" + _read(f"/proc/{pid}/environ")
                mine = any(n in blob for n in needles)
            if mine:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass

    def close(self):
        self.kill()
        for p in self.popens:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for d in self.dirs:
            shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def reaper():
    r = Reaper()
    yield r
    r.close()


# ---------------------------------------------------------------------------
# The binaries, the dataset, the environment of a job.

@pytest.fixture(scope="session")
def binaries():
    """Skips when the binaries lack what the scripts use (an older build)."""
    for b in (SHARDCASTD, SHARDCAST):
        if not (b.is_file() and os.access(b, os.X_OK)):
            pytest.fail(f"{b} not found (set SHARDCASTD_BIN and SHARDCAST_BIN, or build "
                        f"into {REPO_ROOT / 'build'})")
    daemon_help = subprocess.run([str(SHARDCASTD), "--help"], capture_output=True,
                                 timeout=30).stdout.decode()
    cli_help = subprocess.run([str(SHARDCAST), "--help"], capture_output=True,
                              timeout=30).stdout.decode()
    missing = []
    if "--exit-with-parent" not in daemon_help:
        missing.append(f"{SHARDCASTD} has no --exit-with-parent")
    if not any(line.split()[:1] == ["health"] for line in cli_help.splitlines()):
        missing.append(f"{SHARDCAST} has no `health` command")
    if "SHARDCAST_ADDRESS" not in cli_help:
        missing.append(f"{SHARDCAST} does not read SHARDCAST_ADDRESS")
    if missing:
        pytest.skip("binaries older than the Slurm scripts: " + "; ".join(missing))
    return SHARDCASTD.parent


@pytest.fixture(scope="session")
def dataset(binaries):
    """40 examples x layer 6 x 16 tokens x D 32 (640 vectors), world-readable
    (the prolog test runs a daemon as `nobody`)."""
    top = Path(tempfile.mkdtemp(prefix="scds", dir="/tmp"))
    os.chmod(top, 0o755)
    root = top / "root"
    proc = subprocess.run([str(SHARDCAST), "synth", str(root), "--layers", str(LAYER),
                           "--tokens", "16", "--d-model", "32", "--examples", "40",
                           "--seed", "5", "--json"], capture_output=True, timeout=60)
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")
    path = root / Path(json.loads(proc.stdout)["path"]).name
    for d, _, files in os.walk(top):
        os.chmod(d, 0o755)
        for f in files:
            os.chmod(os.path.join(d, f), 0o644)
    ref = Reference(path)
    assert (ref.N, ref.L, ref.T, ref.D) == (40, 1, 16, 32)
    yield ref
    shutil.rmtree(top, ignore_errors=True)


TRAINER = textwrap.dedent("""\
    # One trainer through the Python package: shardcast.Client() reads
    # SHARDCAST_ADDRESS. argv: dataset, output .npz, epochs (0: endless),
    # seconds to sleep per batch, a file to create after the first batch.
    import os, sys, time
    import numpy as np
    import shardcast
    dataset, out, epochs, delay, started = sys.argv[1:6]
    epochs, delay = int(epochs), float(delay)
    client = shardcast.Client()
    ex, tok, vec = [], [], []
    seed = int(os.environ.get("SLURM_PROCID", "0")) + 11
    with client.stream(dataset, layer=%d, order="shuffled", epochs=epochs,
                       batch_size=64, seed=seed, copy=True) as stream:
        for i, b in enumerate(stream):
            if i == 0:
                open(started, "w").write(str(os.getpid()))
            if epochs:
                ex.append(b.example_idx); tok.append(b.token_idx)
                vec.append(np.asarray(b.vectors))
            time.sleep(delay)
    np.savez(out, example_idx=np.concatenate(ex), token_idx=np.concatenate(tok),
             vectors=np.concatenate(vec), address=np.array(client.address))
    """ % LAYER)


@pytest.fixture
def job(binaries, dataset, reaper):
    """A job's surroundings: a private TMPDIR, the trainer script, and the
    environment a Slurm job would give (binaries first on PATH)."""
    base = reaper.tmpdir()
    work = base / "work"
    work.mkdir()
    (work / "trainer.py").write_text(TRAINER)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "SHARDCAST")) and k not in ("TMPDIR",)}
    job_id = str(800000 + os.getpid() % 100000)
    env.update(
        PATH=os.pathsep.join([str(SHARDCASTD.parent), str(SHARDCAST.parent),
                              env.get("PATH", "/usr/bin:/bin")]),
        SHARDCASTD=str(SHARDCASTD),
        SHARDCAST=str(SHARDCAST),
        PYTHONPATH=os.pathsep.join([str(CLIENT_DIR), str(HERE)]),
        PYTHONDONTWRITEBYTECODE="1",
        TMPDIR=str(base),
        SLURM_JOB_ID=job_id,
        SHARDCAST_ROOTS=str(dataset.path.parent),
        SHARDCAST_STOP_TIMEOUT="15",
        SHARDCAST_LOG=str(work / "shardcastd.log"),  # kept for failure reports
    )
    jobdir = base / f"shardcast-{job_id}"
    return types.SimpleNamespace(base=base, work=work, env=env, id=job_id, dir=jobdir,
                                 address=f"unix:{jobdir}/shardcastd.sock",
                                 python=sys.executable, log=work / "shardcastd.log")


def check_python_epoch(dataset, npz, address):
    """The Python trainer's epoch: every vector of the selection once, each
    equal to numpy's read of the files, through the job's address."""
    with np.load(npz) as z:
        assert str(z["address"]) == address
        n = z["example_idx"].size
        rows = dataset.rows(z["vectors"], z["example_idx"], z["token_idx"],
                            np.full(n, LAYER), labels=None, what=str(npz))
    assert_exact_epoch(rows, dataset.selection(layer=LAYER), what=str(npz))


def check_cli_epoch(path):
    out = json.loads(Path(path).read_text())
    check = out["check"]
    assert check["ok"] and check["problem_count"] == 0, out
    assert [(e["vectors"], e["complete"]) for e in check["epochs"]] == [(640, True)], out


# ---------------------------------------------------------------------------
# shardcast-job.sh

def test_wrapper_job_of_two_trainers_streams_and_leaves_nothing(job, dataset, reaper):
    """Two trainers at once (the CLI and the Python package), both finding
    the daemon through SHARDCAST_ADDRESS alone, each get one exact shuffled
    epoch; the wrapper hands back the command's exit status; then no daemon,
    no trainer and no directory are left."""
    script = job.work / "job.sh"
    script.write_text(textwrap.dedent(f"""\
        set -u
        echo "$SHARDCAST_ADDRESS" > {job.work}/address
        stat -c %a "$(dirname "${{SHARDCAST_ADDRESS#unix:}}")" > {job.work}/mode
        shardcast stream {dataset.id} --order shuffled --layer {LAYER} --seed 1 \\
          --batch-size 64 --check --json > {job.work}/cli.json 2> {job.work}/cli.err &
        a=$!
        {job.python} {job.work}/trainer.py {dataset.id} {job.work}/py.npz 1 0 \\
          {job.work}/py.started > {job.work}/py.out 2>&1 &
        b=$!
        wait $a; ra=$?
        wait $b; rb=$?
        echo "$ra $rb" > {job.work}/status
        [ "$ra" = 0 ] && [ "$rb" = 0 ] && exit 5
        exit 1
        """))
    p = reaper.run([WRAPPER, *SMALL, "--", "bash", script], env=job.env)
    statuses = (job.work / "status").read_text() if (job.work / "status").exists() else "-"
    assert p.returncode == 5, (
        f"{p.describe}\ntrainer statuses {statuses}\n"
        f"cli: {_read(job.work / 'cli.err').decode()}\npy: {_read(job.work / 'py.out').decode()}")
    assert (job.work / "address").read_text().strip() == job.address
    assert (job.work / "mode").read_text().strip() == "700"
    check_cli_epoch(job.work / "cli.json")
    check_python_epoch(dataset, job.work / "py.npz", job.address)
    assert "ready at " + job.address in p.err and "exit status 0" in p.err, p.describe
    log = job.log.read_text()  # SHARDCAST_LOG: the daemon's log, kept
    assert f"listening on {job.address}" in log and "SIGTERM" in log, log
    assert_nothing_left(job.dir, p.describe)


def test_wrapper_returns_a_failing_commands_status(job, reaper):
    """The command fails after talking to the daemon: its status (42) comes
    back, and the daemon is stopped all the same."""
    p = reaper.run([WRAPPER, *SMALL, "--", "bash", "-c",
                    "shardcast health >/dev/null && exit 42; exit 1"], env=job.env)
    assert p.returncode == 42, p.describe
    assert "exited with status 42" in p.err, p.describe
    assert_nothing_left(job.dir, p.describe)


def test_wrapper_gives_the_command_its_standard_input(job, reaper):
    """The command reads the wrapper's standard input (a background command
    of a script would get /dev/null)."""
    data = job.work / "input"
    data.write_text("line one\nline two\n")
    with open(data, "rb") as stdin:
        p = reaper.run([WRAPPER, *SMALL, "--", "cat"], env=job.env, stdin=stdin)
    assert p.returncode == 0 and p.out == "line one\nline two\n", p.describe
    assert_nothing_left(job.dir, p.describe)


def test_wrapper_sigterm_mid_job_stops_trainers_and_daemon(job, dataset, reaper):
    """SIGTERM to the wrapper while two trainers stream endlessly (what
    scancel or a time limit sends): both trainers get it (the command's whole
    process group), the daemon is stopped, the directory removed, and the
    exit status is the command's (bash killed by SIGTERM: 143)."""
    script = job.work / "job.sh"
    trainer = (f"{job.python} {job.work}/trainer.py {dataset.id} {job.work}/x.npz 0 0.05")
    script.write_text(f"{trainer} {job.work}/a.started &\n"
                      f"{trainer} {job.work}/b.started &\n"
                      "wait\n")
    p = reaper.popen([WRAPPER, *SMALL, "--", "bash", script], env=job.env)
    started = wait_until(lambda: (job.work / "a.started").exists() and
                         (job.work / "b.started").exists() and p.poll() is None, 60)
    assert started, f"the trainers did not start (wrapper exit {p.poll()})\n" \
                    f"{_read(p.err_path).decode(errors='replace')}"
    assert len(processes_with_address(job.dir)) >= 3  # bash and two trainers
    assert len(daemons_in(job.dir)) == 1
    p.send_signal(signal.SIGTERM)
    reaper.finish(p)
    assert p.returncode == 143, p.describe
    assert "after SIGTERM" in p.err and "stopped with SIGTERM" in p.err and \
        "exit status 0" in p.err, p.describe
    assert_nothing_left(job.dir, p.describe)


def test_wrapper_sigkill_daemon_follows_and_next_job_cleans_up(job, dataset, reaper):
    """SIGKILL to the wrapper (no trap runs): the daemon, started with
    --exit-with-parent, gets SIGTERM from the kernel and exits within a few
    seconds although a trainer is streaming. The directory stays (README);
    the next wrapper of the same user and TMPDIR removes it."""
    started = job.work / "t.started"
    p = reaper.popen([WRAPPER, *SMALL, "--grace-seconds", "2", "--", job.python,
                      job.work / "trainer.py", dataset.id, job.work / "x.npz", "0", "0.05",
                      started], env=job.env)
    assert wait_until(lambda: started.exists() or p.poll() is not None, 60) and \
        p.poll() is None, _read(p.err_path).decode(errors="replace")
    daemons = daemons_in(job.dir)
    assert len(daemons) == 1, daemons
    assert "--exit-with-parent" in daemons[0][1], daemons
    p.kill()
    p.wait(timeout=10)
    t0 = time.monotonic()
    gone = wait_until(lambda: not daemons_in(job.dir), GONE_TIMEOUT)
    assert gone, f"shardcastd still running {GONE_TIMEOUT} s after its wrapper was " \
                 f"SIGKILLed: {daemons_in(job.dir)}\n{_read(job.dir / 'shardcastd.log')[-3000:]}"
    log = _read(job.dir / "shardcastd.log").decode(errors="replace")
    assert "SIGTERM" in log, log
    print(f"daemon gone {time.monotonic() - t0:.2f} s after the wrapper's SIGKILL")
    assert job.dir.is_dir()  # documented: left for the next job or the epilog
    # The orphaned trainer (Slurm would kill the job's cgroup) loses its daemon.
    for pid, _ in processes_with_address(job.dir):
        os.kill(pid, signal.SIGKILL)

    env = dict(job.env, SLURM_JOB_ID=str(int(job.id) + 1))
    q = reaper.run([WRAPPER, *SMALL, "--", "true"], env=env)
    assert q.returncode == 0, q.describe
    assert f"removed the stale job directory {job.dir}" in q.err, q.describe
    assert not job.dir.exists()
    assert_nothing_left(job.base / f"shardcast-{int(job.id) + 1}", q.describe)


def test_wrapper_sigterm_while_starting(job, reaper):
    """SIGTERM while the wrapper waits for the daemon: it stops, exits 143,
    the command never runs, nothing is left."""
    marker = job.work / "ran"
    env = dict(job.env, SHARDCAST="false", SHARDCAST_READY_TIMEOUT="60")
    p = reaper.popen([WRAPPER, *SMALL, "--", "touch", marker], env=env)
    assert wait_until(lambda: daemons_in(job.dir), 30), _read(p.err_path)
    time.sleep(0.3)
    p.send_signal(signal.SIGTERM)
    reaper.finish(p, timeout=30)
    assert p.returncode == 143 and "SIGTERM while starting" in p.err, p.describe
    assert not marker.exists()
    assert_nothing_left(job.dir, p.describe)


def test_wrapper_refuses_a_directory_of_a_running_job(job, reaper):
    """A second wrapper of the same job on the node (same directory) while
    the first runs is refused and leaves the first alone."""
    started = job.work / "first.started"
    first = reaper.popen([WRAPPER, *SMALL, "--", "bash", "-c",
                          f"touch {started}; sleep 60"], env=job.env)
    assert wait_until(lambda: started.exists() or first.poll() is not None, 60)
    second = reaper.run([WRAPPER, *SMALL, "--", "true"], env=job.env)
    assert second.returncode == 1, second.describe
    assert "is not a stale directory" in second.err, second.describe
    assert first.poll() is None and len(daemons_in(job.dir)) == 1
    first.send_signal(signal.SIGTERM)
    reaper.finish(first)
    assert first.returncode == 143, first.describe
    assert_nothing_left(job.dir, first.describe)


@pytest.mark.parametrize("case", ["missing-root", "bad-flag", "never-ready"])
def test_wrapper_daemon_that_cannot_start(case, job, reaper):
    """A daemon that cannot start: exit 1 with a message that says why (and
    the end of the daemon's log), the command never runs, nothing is left."""
    marker = job.work / "ran"
    env = dict(job.env)
    args = list(SMALL)
    if case == "missing-root":
        args += ["--root", str(job.base / "no-such-root")]
        want = f"dataset root {job.base / 'no-such-root'} is not a readable directory"
    elif case == "bad-flag":
        args += ["--no-such-flag"]
        want = "shardcastd exited with status 2 while starting"
    else:  # health never answers: the CLI is /bin/false
        env.update(SHARDCAST="false", SHARDCAST_READY_TIMEOUT="2")
        want = "not ready within 2 s"
    p = reaper.run([WRAPPER, *args, "--", "touch", marker], env=env)
    assert p.returncode == 1, p.describe
    assert want in p.err, p.describe
    if case == "bad-flag":
        assert "no-such-flag" in p.err and "last lines of the shardcastd log" in p.err, \
            p.describe
    assert not marker.exists()
    assert_nothing_left(job.dir, p.describe)


@pytest.mark.parametrize("args,status,want", [
    (["--help"], 0, "Usage: shardcast-job.sh"),
    (["--root", "/tmp"], 2, "usage: shardcast-job.sh"),
    (["--root", "/tmp", "--"], 2, "usage: shardcast-job.sh"),
    (["--listen", "unix:/tmp/x.sock", "--", "true"], 2, "--listen is set by this script"),
])
def test_wrapper_usage(args, status, want, job, reaper):
    env = dict(job.env, SHARDCAST_READY_TIMEOUT="5")
    p = reaper.run([WRAPPER, *args], env=env)
    assert p.returncode == status, p.describe
    assert want in (p.out + p.err), p.describe
    assert_nothing_left(job.dir, p.describe)


def test_wrapper_without_roots_is_a_usage_error(job, reaper):
    env = {k: v for k, v in job.env.items() if k != "SHARDCAST_ROOTS"}
    p = reaper.run([WRAPPER, "--", "true"], env=env)
    assert p.returncode == 2 and "no dataset root" in p.err, p.describe


# ---------------------------------------------------------------------------
# prolog.sh, task-prolog.sh, epilog.sh

@pytest.fixture
def slurmd(job, reaper):
    """What slurmd gives the prolog and epilog, with the run directory and
    the site settings file in the test's directory; the job's user is the
    current one (no user switch)."""
    run = job.base / "run"
    defaults = job.base / "slurm.env"
    # The settings file as an admin writes it (read by all three scripts).
    defaults.write_text(f"SHARDCAST_ROOTS={job.env['SHARDCAST_ROOTS']}\n"
                        f"SHARDCAST_DAEMON_ARGS='{' '.join(SMALL)}'\n")
    os.chmod(defaults, 0o644)
    env = {k: v for k, v in job.env.items() if k != "SHARDCAST_ROOTS"}
    env.update(
        SHARDCAST_SLURM_DEFAULTS=str(defaults),
        SHARDCAST_JOB_RUNDIR=str(run),
        SLURM_JOB_USER=pwd.getpwuid(os.getuid()).pw_name,
        SLURM_JOB_UID=str(os.getuid()),
        SLURM_JOB_GID=str(os.getgid()),
    )
    sock = run / f"job-{job.id}" / "shardcastd.sock"
    return types.SimpleNamespace(env=env, run=run, defaults=defaults, dir=sock.parent,
                                 sock=sock, pidfile=run / f"job-{job.id}.pid",
                                 address=f"unix:{sock}")


def _task_env(env):
    """The environment of a task: the job's, without SHARDCAST_ADDRESS."""
    return {k: v for k, v in env.items() if k != "SHARDCAST_ADDRESS"}


def test_prolog_task_prolog_epilog(job, dataset, slurmd, reaper):
    """prolog starts the job's daemon (and again: nothing happens); it lives
    on after the prolog's process group is killed (slurmd may do that);
    task-prolog prints `export SHARDCAST_ADDRESS=...` (nothing when the job
    set one); a trainer streams one exact epoch through it; epilog stops the
    daemon and removes everything; a second epilog is harmless."""
    p = reaper.run([PROLOG], env=slurmd.env)
    assert p.returncode == 0, p.describe
    daemons = daemons_in(slurmd.dir)
    assert len(daemons) == 1, f"{daemons}\n{p.describe}"
    pid = daemons[0][0]
    assert slurmd.pidfile.read_text().strip() == str(pid)
    assert "--exit-with-parent" not in daemons[0][1]
    assert oct(slurmd.dir.stat().st_mode & 0o777) == "0o700"
    assert slurmd.dir.stat().st_uid == os.getuid()
    # slurmd's clean-up of the prolog's process group does not reach it.
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    assert _session(pid) == pid, "the daemon is not in a session of its own"

    again = reaper.run([PROLOG], env=slurmd.env)
    assert again.returncode == 0 and "already runs" in again.err, again.describe
    assert [d[0] for d in daemons_in(slurmd.dir)] == [pid]

    task = reaper.run(["bash", TASK_PROLOG], env=_task_env(slurmd.env))
    assert task.returncode == 0 and task.err == "", task.describe
    assert task.out == f"export SHARDCAST_ADDRESS={slurmd.address}\n", task.describe
    own = reaper.run(["bash", TASK_PROLOG],
                     env=dict(slurmd.env, SHARDCAST_ADDRESS="unix:/elsewhere.sock"))
    assert own.returncode == 0 and own.out == "", own.describe

    # A trainer of the job, with what the task prolog exported.
    name, value = task.out.strip()[len("export "):].split("=", 1)
    trainer_env = dict(_task_env(job.env), **{name: value})
    t = reaper.run([job.python, job.work / "trainer.py", dataset.id, job.work / "p.npz", "1",
                    "0", job.work / "p.started"], env=trainer_env)
    assert t.returncode == 0, t.describe
    check_python_epoch(dataset, job.work / "p.npz", slurmd.address)

    e = reaper.run([EPILOG], env=slurmd.env)
    assert e.returncode == 0, e.describe
    assert f"stopped shardcastd {pid}" in e.err, e.describe
    assert not daemons_in(slurmd.dir) and not slurmd.dir.exists() and \
        not slurmd.pidfile.exists(), e.describe
    assert slurmd.run.is_dir()
    twice = reaper.run([EPILOG], env=slurmd.env)
    assert twice.returncode == 0 and twice.err == "", twice.describe
    after = reaper.run(["bash", TASK_PROLOG], env=_task_env(slurmd.env))
    assert after.returncode == 0 and after.out == "", after.describe


def test_epilog_finds_the_daemon_without_its_pid_file(slurmd, reaper):
    """The prolog was interrupted before writing the pid file (or it was
    lost): the epilog finds the daemon by its socket on the command line."""
    p = reaper.run([PROLOG], env=slurmd.env)
    assert p.returncode == 0, p.describe
    [(pid, _)] = daemons_in(slurmd.dir)
    slurmd.pidfile.unlink()
    e = reaper.run([EPILOG], env=slurmd.env)
    assert e.returncode == 0 and f"stopped shardcastd {pid}" in e.err, e.describe
    assert not daemons_in(slurmd.dir) and not slurmd.dir.exists()


def test_epilog_ignores_a_pid_file_naming_another_process(slurmd, reaper):
    """A pid file naming a process that is not the job's daemon (pid reuse)
    is not acted on: that process lives."""
    bystander = reaper.popen(["sleep", "60"])
    slurmd.run.mkdir(parents=True)
    slurmd.pidfile.write_text(f"{bystander.pid}\n")
    e = reaper.run([EPILOG], env=slurmd.env)
    assert e.returncode == 0, e.describe
    assert bystander.poll() is None, "the epilog killed a process that was not its daemon"
    assert not slurmd.pidfile.exists()


def test_epilog_without_prolog_is_harmless(slurmd, reaper):
    e = reaper.run([EPILOG], env=slurmd.env)
    assert e.returncode == 0 and e.err == "", e.describe


@pytest.mark.parametrize("strict", [False, True])
def test_prolog_daemon_that_cannot_start(strict, slurmd, reaper):
    """Not strict (default): the prolog succeeds (a failing prolog drains the
    node), the log stays in the job directory, the task prolog points to it,
    the epilog removes it. Strict: the prolog fails and leaves nothing."""
    slurmd.defaults.write_text(slurmd.defaults.read_text() +
                               "SHARDCAST_DAEMON_ARGS=--no-such-flag\n")
    env = dict(slurmd.env, SHARDCAST_PROLOG_STRICT="1" if strict else "0")
    p = reaper.run([PROLOG], env=env)
    assert "exited with status 2 while starting" in p.err, p.describe
    assert "no-such-flag" in p.err, p.describe
    assert not daemons_in(slurmd.run) and not slurmd.pidfile.exists()
    if strict:
        assert p.returncode == 1, p.describe
        assert not slurmd.dir.exists()
    else:
        assert p.returncode == 0, p.describe
        assert "no-such-flag" in (slurmd.dir / "shardcastd.log").read_text()
        task = reaper.run(["bash", TASK_PROLOG], env=_task_env(env))
        assert task.returncode == 0, task.describe
        assert task.out.startswith("print shardcast: the job's shardcastd is not running"), \
            task.describe
        assert "SHARDCAST_ADDRESS" not in task.out
    e = reaper.run([EPILOG], env=env)
    assert e.returncode == 0, e.describe
    assert not slurmd.dir.exists()


def test_prolog_only_for_jobs_with_the_feature(slurmd, reaper):
    """SHARDCAST_PROLOG_FEATURE: only jobs whose constraint names it get a
    daemon."""
    env = dict(slurmd.env, SHARDCAST_PROLOG_FEATURE="shardcast",
               SLURM_JOB_CONSTRAINTS="gpu&a100")
    p = reaper.run([PROLOG], env=env)
    assert p.returncode == 0 and not slurmd.dir.exists(), p.describe
    env["SLURM_JOB_CONSTRAINTS"] = "gpu&[shardcast|other]"
    p = reaper.run([PROLOG], env=env)
    assert p.returncode == 0 and len(daemons_in(slurmd.dir)) == 1, p.describe
    e = reaper.run([EPILOG], env=env)
    assert e.returncode == 0 and not daemons_in(slurmd.dir), e.describe


@pytest.mark.skipif(os.geteuid() != 0, reason="switching users needs root")
def test_prolog_as_root_runs_the_daemon_as_the_jobs_user(job, dataset, slurmd, reaper):
    """As root (slurmd's prolog), for a job of `nobody`: the daemon runs as
    nobody with no new privileges and a clean environment, in a directory
    nobody owns (mode 0700), with the pid file root's; the user reaches it
    through the task prolog's address; the epilog stops it."""
    try:
        nobody = pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("no user `nobody`")
    os.chmod(job.base, 0o755)  # the run directory must be reachable by nobody
    env = dict(slurmd.env, SLURM_JOB_USER="nobody", SLURM_JOB_UID=str(nobody.pw_uid),
               SLURM_JOB_GID=str(nobody.pw_gid))
    p = reaper.run([PROLOG], env=env)
    assert p.returncode == 0, p.describe
    [(pid, _)] = daemons_in(slurmd.dir)
    status = dict(line.split(":", 1) for line in
                  Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    assert status["Uid"].split()[:2] == [str(nobody.pw_uid)] * 2, status["Uid"]
    assert status["Gid"].split()[:2] == [str(nobody.pw_gid)] * 2, status["Gid"]
    assert status["NoNewPrivs"].strip() == "1"
    environ = _read(f"/proc/{pid}/environ").split(b"\0")
    assert not any(v.startswith(b"SLURM_") for v in environ), environ
    st = slurmd.dir.stat()
    assert (st.st_uid, st.st_mode & 0o777) == (nobody.pw_uid, 0o700)
    assert slurmd.sock.stat().st_uid == nobody.pw_uid
    assert slurmd.pidfile.stat().st_uid == 0

    # The task prolog and a trainer, as nobody.
    as_nobody = ["setpriv", f"--reuid={nobody.pw_uid}", f"--regid={nobody.pw_gid}",
                 "--clear-groups", "--"]
    task = reaper.run(as_nobody + ["bash", TASK_PROLOG], env=_task_env(env))
    assert task.out == f"export SHARDCAST_ADDRESS={slurmd.address}\n", task.describe
    listed = reaper.run(as_nobody + [SHARDCAST, "ls"],
                        env=dict(_task_env(job.env), SHARDCAST_ADDRESS=slurmd.address))
    assert listed.returncode == 0 and dataset.id in listed.out, listed.describe

    e = reaper.run([EPILOG], env=env)
    assert e.returncode == 0, e.describe
    assert not daemons_in(slurmd.dir) and not slurmd.dir.exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="the ownership checks apply to root")
def test_prolog_as_root_ignores_a_settings_file_others_can_write(slurmd, reaper):
    """Root sources the settings file only when root alone can write it."""
    os.chmod(slurmd.defaults, 0o666)
    p = reaper.run([PROLOG], env=slurmd.env)
    assert "ignoring" in p.err and "no dataset root" in p.err, p.describe
    assert not slurmd.dir.exists()


# ---------------------------------------------------------------------------
# example.sbatch

SRUN = """\
#!/usr/bin/env bash
# Stand-in for srun: runs COMMAND --ntasks times on this node, with
# SLURM_PROCID and SLURM_LOCALID, and returns the first failure.
n=1
while [[ $# -gt 0 && $1 == -* ]]; do
  case $1 in --ntasks=*) n=${1#*=} ;; esac
  shift
done
pids=()
for ((i = 0; i < n; i++)); do
  SLURM_PROCID=$i SLURM_LOCALID=$i "$@" > "$SRUN_OUT/task$i.out" 2>&1 &
  pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || { r=$?; [[ $rc -ne 0 ]] || rc=$r; }; done
exit "$rc"
"""


def test_example_sbatch_runs_its_trainers_through_the_wrapper(job, dataset, reaper):
    """example.sbatch, run as sbatch would (with a stand-in srun): its
    default trainers (the CLI, checking one epoch each) all pass through the
    per-job daemon, and nothing is left."""
    bindir = job.base / "bin"
    bindir.mkdir()
    (bindir / "srun").write_text(SRUN)
    os.chmod(bindir / "srun", 0o755)
    os.symlink(WRAPPER, bindir / "shardcast-job.sh")
    env = dict(job.env, PATH=f"{bindir}{os.pathsep}{job.env['PATH']}", SLURM_NTASKS="3",
               SHARDCAST_RESERVOIR="1G", SRUN_OUT=str(job.work))
    p = reaper.run(["bash", SBATCH, dataset.id], env=env, cwd=job.work)
    assert p.returncode == 0, p.describe
    for i in range(3):
        out = (job.work / f"task{i}.out").read_text()
        assert "check: ok" in out and "complete" in out, f"task {i}: {out}\n{p.describe}"
    assert_nothing_left(job.dir, p.describe)


def test_wrapper_sweep_port_makes_the_nodes_daemons_a_sweep(job, dataset, reaper):
    """--sweep-port on two "nodes" (two wrappers here, their node list given
    by SHARDCAST_SWEEP_PEERS and SHARDCAST_NODE_RANK in place of Slurm's):
    each daemon is told the other and reads one share, the wrapper checks
    that they answer each other and agree before its command starts, and
    each node's trainer gets one exact epoch of every vector."""
    from sysprobe import free_ports
    peers = ",".join(f"127.0.0.1:{p}" for p in free_ports(2))
    procs = []
    for rank in range(2):
        base = reaper.tmpdir()
        env = dict(job.env, TMPDIR=str(base), SLURM_JOB_ID=f"{job.id}{rank}",
                   SHARDCAST_SWEEP_PEERS=peers, SHARDCAST_NODE_RANK=str(rank),
                   SHARDCAST_LOG=str(job.work / f"shardcastd-{rank}.log"))
        procs.append(reaper.popen(
            [WRAPPER, *SMALL, "--insecure-tcp", "--sweep-port", "7000", "--",
             job.python, job.work / "trainer.py", dataset.id, job.work / f"py{rank}.npz",
             "1", "0", job.work / f"py{rank}.started"], env=env))
    for rank, p in enumerate(procs):
        reaper.finish(p)
        assert p.returncode == 0, p.describe
        assert f"sweep: node {rank} of 2" in p.err, p.describe
        # Before the trainer: the doctor's check that the peers answer and agree.
        assert (f"sweep check: node {rank} of 2: every peer answers and agrees (node order, "
                "--block-bytes, the content hash of 1 dataset)") in p.err, p.describe
    for rank in range(2):
        with np.load(job.work / f"py{rank}.npz") as z:
            n = z["example_idx"].size
            rows = dataset.rows(z["vectors"], z["example_idx"], z["token_idx"],
                                np.full(n, LAYER), labels=None, what=f"node {rank}")
        assert_exact_epoch(rows, dataset.selection(layer=LAYER), what=f"node {rank}")
        log = (job.work / f"shardcastd-{rank}.log").read_text()
        assert f"sweep: node {rank} of 2; peers {peers.replace(',', ', ')}" in log, log


@pytest.mark.parametrize("args,env,want", [
    (["--sweep-port", "0"], {}, "--sweep-port needs a TCP port"),
    (["--sweep-port", "7000"], {}, "needs the job's node list"),
    (["--sweep-port", "7000"], {"SHARDCAST_SWEEP_PEERS": "a:1,b:1", "SHARDCAST_NODE_RANK": "2"},
     "is not one of the 2 nodes"),
])
def test_wrapper_sweep_usage(args, env, want, job, reaper):
    p = reaper.run([WRAPPER, *args, "--", "true"], env=dict(job.env, **env))
    assert p.returncode == 2 and want in p.err, p.describe
    assert_nothing_left(job.dir, p.describe)
