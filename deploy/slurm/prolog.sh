#!/usr/bin/env bash
# Slurm Prolog: starts a private shardcastd for the job on this node, as the
# job's user. slurm.conf (see README.md in this directory):
#   Prolog=/usr/local/libexec/shardcast/prolog.sh
#   Epilog=/usr/local/libexec/shardcast/epilog.sh
#   TaskProlog=/usr/local/libexec/shardcast/task-prolog.sh
#   PrologFlags=Alloc     # run it on every node when the job is allocated
#
# Slurm runs it as root with SLURM_JOB_ID, SLURM_JOB_USER, SLURM_JOB_UID
# (and SLURM_JOB_GID, SLURM_JOB_CONSTRAINTS) set. It creates
#   $SHARDCAST_JOB_RUNDIR/job-$SLURM_JOB_ID/          owner the user, mode 0700
#       shardcastd.sock (+ .lock, .local)              the daemon's socket
#       shardcastd.log                                 its log
#   $SHARDCAST_JOB_RUNDIR/job-$SLURM_JOB_ID.pid        the daemon's pid (root's)
# starts shardcastd there with setpriv (no new privileges, the user's groups,
# a clean environment) in its own session, and waits until it answers
# `shardcast health`. task-prolog.sh tells the job's tasks the address;
# epilog.sh stops the daemon and removes both. Running it again while the
# daemon runs does nothing; a directory left from an earlier run is replaced.
# When already running as the job's user (tests) there is no user switch.
#
# Settings: environment variables, or lines VAR=value in the file
# $SHARDCAST_SLURM_DEFAULTS (default /etc/shardcast/slurm.env, owned by root,
# not group- or world-writable; read by all three scripts, its values win):
#   SHARDCAST_ROOTS            dataset roots, colon-separated
#   SHARDCAST_JOB_CONFIG       a shardcastd --config file (roots, reservoir...;
#                              without listen, socket_group and a fixed http)
#   SHARDCAST_DAEMON_ARGS      more shardcastd flags, split on white space
#                              (e.g. "--reservoir-bytes 8G")
#   SHARDCAST_JOB_RUNDIR       base directory (default /run/shardcast-jobs;
#                              not /run/shardcast, which the node service's
#                              unit owns and removes when it stops)
#   SHARDCASTD, SHARDCAST      binaries (default: /usr/local/bin, then PATH)
#   SHARDCAST_PROLOG_FEATURE   only for jobs that ask for this node feature
#                              (sbatch --constraint=FEATURE); default: all jobs
#   SHARDCAST_READY_TIMEOUT    seconds to wait for the daemon (default 60)
#   SHARDCAST_PROLOG_STRICT    1: a daemon that fails to start fails the
#                              prolog (Slurm then drains the node and requeues
#                              the job); default 0: the job runs without it,
#                              task-prolog.sh says so, the log stays in the
#                              job directory until the epilog
# Messages go to stderr and, when /dev/log exists, to syslog.
set -euo pipefail

prog=shardcast-prolog

# say, load_defaults, is_daemon: shared with epilog.sh.
# shellcheck source=prolog-common.sh
. "$(dirname -- "$(readlink -f -- "${BASH_SOURCE[0]}")")/prolog-common.sh"

# stop PID: SIGTERM, 10 s, SIGKILL.
stop() {
  local pid=$1 i
  kill -TERM "$pid" 2>/dev/null || return 0
  for ((i = 0; i < 100; i++)); do
    is_daemon "$pid" "$sock" || return 0
    sleep 0.1
  done
  kill -KILL "$pid" 2>/dev/null || true
}

# give_up MESSAGE: the daemon could not be started.
give_up() {
  say "$*"
  if [[ -s ${log:-} ]]; then
    say "last lines of $log: $(tail -n 5 -- "$log" | tr '\n' '|')"
  fi
  rm -f -- "$pidfile"
  if [[ ${SHARDCAST_PROLOG_STRICT:-0} == 1 ]]; then
    rm -rf -- "$dir"
    exit 1
  fi
  exit 0
}

load_defaults

job=${SLURM_JOB_ID:-}
[[ $job =~ ^[0-9]+$ ]] || { say "SLURM_JOB_ID is not set to a job id ('$job')"; exit 1; }
user=${SLURM_JOB_USER:-}
uid=${SLURM_JOB_UID:-}
if [[ -z $uid && -n $user ]]; then uid=$(id -u -- "$user" 2>/dev/null || true); fi
[[ $uid =~ ^[0-9]+$ ]] || { say "SLURM_JOB_UID/SLURM_JOB_USER do not name a user"; exit 1; }
if [[ -z $user ]]; then user=$(id -nu -- "$uid" 2>/dev/null || echo "$uid"); fi
gid=${SLURM_JOB_GID:-}
if [[ -z $gid ]]; then gid=$(id -g -- "$uid" 2>/dev/null || true); fi
[[ $gid =~ ^[0-9]+$ ]] || { say "no primary group for uid $uid"; exit 1; }

if [[ -n ${SHARDCAST_PROLOG_FEATURE:-} ]]; then
  # A whole word of the constraint expression (a&b, [a|b], a*2 ...).
  features=" $(tr -c 'A-Za-z0-9_.-' ' ' <<<"${SLURM_JOB_CONSTRAINTS:-}") "
  [[ $features == *" $SHARDCAST_PROLOG_FEATURE "* ]] || exit 0
fi

base=${SHARDCAST_JOB_RUNDIR:-/run/shardcast-jobs}
base=${base%/}
dir=$base/job-$job
sock=$dir/shardcastd.sock
log=$dir/shardcastd.log
pidfile=$base/job-$job.pid

me=$(id -u)
switch=0
if [[ $me != "$uid" ]]; then
  [[ $me -eq 0 ]] || { say "running as uid $me: cannot start a daemon as uid $uid"; exit 1; }
  switch=1
fi

# The base directory: as root, ours alone to write (we create files in it).
if [[ ! -d $base ]]; then
  mkdir -p -- "$(dirname -- "$base")"
  # Another job's prolog may create it at the same moment.
  mkdir -m 0755 -- "$base" 2>/dev/null || [[ -d $base ]]
fi
if [[ -L $base || ! -d $base ]]; then
  say "$base is not a directory"; exit 1
fi
if [[ $me -eq 0 ]]; then
  read -r owner mode < <(stat -c '%u %a' -- "$base")
  if [[ $owner != 0 || $((8#$mode & 8#022)) -ne 0 ]]; then
    say "$base must be owned by root and not group- or world-writable"; exit 1
  fi
fi

# Idempotent: the daemon of this job already runs.
if [[ -f $pidfile ]]; then
  pid=$(cat -- "$pidfile" 2>/dev/null || true)
  if is_daemon "$pid" "$sock"; then
    say "shardcastd (pid $pid) already runs at unix:$sock"
    exit 0
  fi
fi
# Left by an earlier run (a failed start, an epilog that did not run).
rm -f -- "$pidfile"
rm -rf -- "$dir"

# The sources of the daemon's settings.
daemon_args=()
if [[ -n ${SHARDCAST_JOB_CONFIG:-} ]]; then
  daemon_args+=(--config "$SHARDCAST_JOB_CONFIG")
fi
IFS=: read -r -a roots <<<"${SHARDCAST_ROOTS:-}"
for root in "${roots[@]}"; do
  if [[ -n $root ]]; then daemon_args+=(--root "$root"); fi
done
if [[ ${#daemon_args[@]} -eq 0 ]]; then
  say "no dataset root: set SHARDCAST_ROOTS or SHARDCAST_JOB_CONFIG (in ${SHARDCAST_SLURM_DEFAULTS:-/etc/shardcast/slurm.env})"
  [[ ${SHARDCAST_PROLOG_STRICT:-0} == 1 ]] && exit 1
  exit 0
fi
read -r -a extra <<<"${SHARDCAST_DAEMON_ARGS:-}"
daemon_args+=("${extra[@]}")

find_bin() {  # find_bin VARIABLE-VALUE NAME -> an absolute path
  local want=$1 name=$2 found
  if [[ -z $want ]]; then
    if [[ -x /usr/local/bin/$name ]]; then want=/usr/local/bin/$name; else want=$name; fi
  fi
  found=$(command -v -- "$want") || return 1
  readlink -f -- "$found"
}
daemon_bin=$(find_bin "${SHARDCASTD:-}" shardcastd) ||
  { say "shardcastd not found (set SHARDCASTD)"; [[ ${SHARDCAST_PROLOG_STRICT:-0} == 1 ]] && exit 1; exit 0; }
cli_bin=$(find_bin "${SHARDCAST:-}" shardcast) ||
  { say "the shardcast CLI not found (set SHARDCAST)"; [[ ${SHARDCAST_PROLOG_STRICT:-0} == 1 ]] && exit 1; exit 0; }

if [[ $(LC_ALL=C; printf '%s' "${#sock}") -gt 101 ]]; then
  say "socket path $sock is too long for a Unix socket (with .local: 107 bytes)"; exit 1
fi

# The directory is root's until the log is open, then the user's: nothing
# is ever opened by root in a directory the user can write.
mkdir -m 0700 -- "$dir"
exec 3>>"$log"
if [[ $switch -eq 1 ]]; then
  chown -- "$uid:$gid" "$log" "$dir"
fi

cmd=("$daemon_bin" --listen "unix:$sock" "${daemon_args[@]}")
if [[ $switch -eq 1 ]]; then
  cmd=(setpriv --reuid="$uid" --regid="$gid" --init-groups --no-new-privs --reset-env
       -- "${cmd[@]}")
fi
# Its own session: it outlives this script and slurmd's clean-up of the
# script's process group. (setsid does not fork: a child of a shell without
# job control is no process group leader, so $! is the daemon's pid.)
setsid "${cmd[@]}" </dev/null >&3 2>&3 3>&- &
pid=$!
exec 3>&-
echo "$pid" >"$pidfile.tmp"
mv -f -- "$pidfile.tmp" "$pidfile"

timeout_s=${SHARDCAST_READY_TIMEOUT:-60}
[[ $timeout_s =~ ^[0-9]+$ ]] || timeout_s=60
deadline=$((SECONDS + timeout_s))
last=""
while :; do
  if ! kill -0 "$pid" 2>/dev/null; then
    status=0
    wait "$pid" || status=$?
    give_up "shardcastd exited with status $status while starting as $user ($daemon_bin)"
  fi
  if [[ -S $sock ]]; then
    # Root passes the daemon's peer check; so does the user itself.
    if last=$(timeout 10 "$cli_bin" --server "unix:$sock" health 2>&1 >/dev/null); then
      break
    fi
  fi
  if [[ $SECONDS -ge $deadline ]]; then
    stop "$pid"
    give_up "shardcastd (pid $pid) not ready within ${timeout_s} s${last:+ (${last//$'\n'/ })}"
  fi
  sleep 0.1
done
say "shardcastd (pid $pid) for $user ready at unix:$sock"
exit 0
