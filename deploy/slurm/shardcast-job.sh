#!/usr/bin/env bash
# shardcast-job.sh: run a command (the trainers of a job) next to a private
# shardcastd whose lifetime is bound to it.
#
# Usage: shardcast-job.sh [DAEMON OPTIONS...] -- COMMAND [ARGS...]
#
# Starts shardcastd on a Unix socket in a job-private directory (mode 0700)
#   ${SLURM_TMPDIR:-${TMPDIR:-/tmp}}/shardcast-${SLURM_JOB_ID:-$$}/shardcastd.sock
# waits until it answers `shardcast health`, exports
# SHARDCAST_ADDRESS=unix:<that socket> (read by the shardcast CLI, the C++
# client and the Python package), runs COMMAND, then stops the daemon
# (SIGTERM, SIGKILL after SHARDCAST_STOP_TIMEOUT seconds), removes the
# directory and exits with COMMAND's status. SIGTERM, SIGINT and SIGHUP (from
# scancel, a time limit or Ctrl-C) are passed on to COMMAND (to its whole
# process group when there is no terminal), and the same clean-up follows.
# The daemon runs with --exit-with-parent: should this script be SIGKILLed,
# the daemon gets SIGTERM and exits; the directory it leaves is removed by
# the next shardcast-job.sh of the same user with the same TMPDIR.
#
# DAEMON OPTIONS go to shardcastd as they are (--root DIR, --config FILE,
# --reservoir-bytes 8G, --http 127.0.0.1:0, ...; see `shardcastd --help`),
# except --listen, which this script sets. Without --root and --config the
# roots come from SHARDCAST_ROOTS.
#
# A sweep across the job's nodes (docs/sweeps.md): with --sweep-port PORT,
# run one wrapper per node (srun --ntasks-per-node=1); each daemon listens
# on PORT (--listen-tcp 0.0.0.0:PORT) and is told every node's daemon, in
# the job's node order (scontrol show hostnames "$SLURM_JOB_NODELIST", each
# HOST:PORT), its own being the SLURM_NODEID-th. Then every trainer on every
# node gets every vector and the nodes read the filesystem once. Give the
# TCP listener its TLS among the DAEMON OPTIONS (--tls-cert, --tls-key,
# --tls-client-ca for mutual TLS between the daemons), or --insecure-tcp on
# a trusted network. SHARDCAST_SWEEP_PEERS (HOST:PORT,...) and
# SHARDCAST_NODE_RANK replace the node list and SLURM_NODEID (this daemon
# then listens on the port of its own entry).
#
# Environment:
#   SHARDCAST_ROOTS          dataset roots, colon-separated (used when no
#                            --root/--config option is given)
#   SHARDCASTD               daemon binary (default: shardcastd on PATH)
#   SHARDCAST                CLI binary for the readiness check (default:
#                            shardcast on PATH)
#   SHARDCAST_READY_TIMEOUT  seconds to wait for the daemon (default 120)
#   SHARDCAST_STOP_TIMEOUT   seconds the daemon (and COMMAND, after a
#                            signal) get before SIGKILL (default 20; keep it
#                            below Slurm's KillWait, 30 s by default)
#   SHARDCAST_LOG            also copy the daemon's log here at the end (the
#                            job directory and the log in it are removed)
#
# Exit status: COMMAND's; 2 for a usage error; 1 when the daemon cannot be
# started (the reason and the end of its log on stderr), nothing left behind.
#
# Example (a job script; see example.sbatch):
#   shardcast-job.sh --root /fs/scratch/activations --reservoir-bytes 8G -- \
#     srun --ntasks=4 --kill-on-bad-exit=1 python3 train_sae.py
set -euo pipefail

prog=shardcast-job

usage() {
  sed -n '2,/^set -euo/{/^set -euo/d; s/^# \{0,1\}//; p}' "$0"
}

say() { printf '%s: %s\n' "$prog" "$*" >&2; }

# fail STATUS MESSAGE...: the message on stderr, then exit (the EXIT trap
# stops the daemon and removes the directory).
fail() {
  local status=$1
  shift
  say "$*"
  exit "$status"
}

# The length of $1 in bytes, not characters.
byte_length() {
  local LC_ALL=C
  printf '%s' "${#1}"
}

# log_tail: the last lines of the daemon's log, indented, on stderr.
log_tail() {
  if [[ -s ${log:-} ]]; then
    say "last lines of the shardcastd log ($log):"
    tail -n 20 -- "$log" | sed 's/^/    /' >&2
  fi
}

# is_daemon PID SOCKET: true when PID is alive and was started with
# --listen unix:SOCKET (a zombie's cmdline is empty: not alive).
is_daemon() {
  local pid=$1 want="unix:$2" arg
  local -a args=()
  [[ $pid =~ ^[0-9]+$ && -r /proc/$pid/cmdline ]] || return 1
  mapfile -d '' -t args 2>/dev/null </proc/"$pid"/cmdline || return 1
  for arg in "${args[@]}"; do
    [[ $arg == "$want" ]] && return 0
  done
  return 1
}

# is_alive PID: true when PID is a live process (not a zombie). A recorded
# wrapper pid that is alive keeps its directory: pid reuse can only delay a
# clean-up, never remove a running job's directory.
is_alive() {
  local pid=$1 stat
  [[ $pid =~ ^[0-9]+$ ]] || return 1
  stat=$(cat /proc/"$pid"/stat 2>/dev/null) || return 1
  stat=${stat##*) }
  [[ ${stat:0:1} != Z ]]
}

# stale DIR: true when DIR is a job directory of this script, owned by us,
# whose wrapper and daemon are both gone.
stale() {
  local dir=$1 pid
  [[ -d $dir && ! -L $dir && -O $dir && -f $dir/wrapper.pid ]] || return 1
  pid=$(cat -- "$dir/wrapper.pid" 2>/dev/null) || return 1
  # An empty or partly written file: a wrapper is starting; leave it.
  [[ $pid =~ ^[0-9]+$ ]] || return 1
  if is_alive "$pid"; then return 1; fi
  if [[ -f $dir/shardcastd.pid ]]; then
    pid=$(cat -- "$dir/shardcastd.pid" 2>/dev/null) || pid=""
    if [[ -n $pid ]] && is_daemon "$pid" "$dir/shardcastd.sock"; then return 1; fi
  fi
  return 0
}

# wait_gone PID SECONDS: polls until PID (a child) has exited; false on
# timeout. Bash reaps children as they exit, so `kill -0` fails then.
wait_gone() {
  local pid=$1 tenths=$(($2 * 10)) i
  for ((i = 0; i < tenths; i++)); do
    kill -0 "$pid" 2>/dev/null || return 0
    sleep 0.1
  done
  ! kill -0 "$pid" 2>/dev/null
}

# ---------------------------------------------------------------------------
# Arguments.

daemon_args=()
sweep_port=""
roots=()
have_config=0
separator=0
while [[ $# -gt 0 ]]; do
  case $1 in
    --)
      separator=1
      shift
      break
      ;;
    -h | --help)
      usage
      exit 0
      ;;
    --listen | --listen=*)
      fail 2 "--listen is set by this script (the socket goes in the job directory); see --help"
      ;;
    --sweep-port)
      [[ $# -ge 2 && $2 =~ ^[0-9]+$ && $2 -ge 1 && $2 -le 65535 ]] ||
        fail 2 "--sweep-port needs a TCP port (1-65535); see --help"
      sweep_port=$2
      shift 2
      ;;
    --root)
      [[ $# -ge 2 ]] || fail 2 "--root needs a directory; see --help"
      roots+=("$2")
      shift 2
      ;;
    --root=*)
      roots+=("${1#--root=}")
      shift
      ;;
    --config | --config=*)
      have_config=1
      daemon_args+=("$1")
      shift
      ;;
    *)
      daemon_args+=("$1")
      shift
      ;;
  esac
done
if [[ $separator -eq 0 || $# -eq 0 ]]; then
  say "usage: shardcast-job.sh [DAEMON OPTIONS...] -- COMMAND [ARGS...] (see --help)"
  exit 2
fi
if [[ ${#roots[@]} -eq 0 && $have_config -eq 0 && -n ${SHARDCAST_ROOTS:-} ]]; then
  IFS=: read -r -a from_env <<<"$SHARDCAST_ROOTS"
  for root in "${from_env[@]}"; do
    if [[ -n $root ]]; then roots+=("$root"); fi
  done
fi
if [[ ${#roots[@]} -eq 0 && $have_config -eq 0 ]]; then
  fail 2 "no dataset root: pass --root DIR (or --config FILE) or set SHARDCAST_ROOTS"
fi
root_args=()
for root in "${roots[@]}"; do
  [[ -d $root && -r $root && -x $root ]] ||
    fail 1 "dataset root $root is not a readable directory"
  root_args+=(--root "$root")
done

# The sweep's peers: every node's daemon, in the job's node order.
sweep_args=()
if [[ -n $sweep_port ]]; then
  peers=()
  if [[ -n ${SHARDCAST_SWEEP_PEERS:-} ]]; then
    IFS=, read -r -a peers <<<"$SHARDCAST_SWEEP_PEERS"
  else
    [[ -n ${SLURM_JOB_NODELIST:-} ]] ||
      fail 2 "--sweep-port needs the job's node list (SLURM_JOB_NODELIST) or SHARDCAST_SWEEP_PEERS"
    hosts=$(scontrol show hostnames "$SLURM_JOB_NODELIST") ||
      fail 1 "scontrol show hostnames $SLURM_JOB_NODELIST failed"
    for host in $hosts; do peers+=("$host:$sweep_port"); done
  fi
  rank=${SHARDCAST_NODE_RANK:-${SLURM_NODEID:-}}
  [[ $rank =~ ^[0-9]+$ && $rank -lt ${#peers[@]} ]] ||
    fail 2 "--sweep-port: this node's rank (SLURM_NODEID or SHARDCAST_NODE_RANK, '${rank}') is not one of the ${#peers[@]} nodes"
  if [[ ${#peers[@]} -lt 2 ]]; then
    say "a sweep of one node: --sweep-port ignored"
  else
    # This node's daemon listens on its own entry's port (PORT, unless
    # SHARDCAST_SWEEP_PEERS says otherwise).
    sweep_args=(--listen-tcp "0.0.0.0:${peers[rank]##*:}" --node-rank "$rank")
    for peer in "${peers[@]}"; do sweep_args+=(--sweep-peer "$peer"); done
    say "sweep: node $rank of ${#peers[@]} (${peers[*]})"
  fi
fi

for var in SHARDCAST_READY_TIMEOUT SHARDCAST_STOP_TIMEOUT; do
  if [[ -n ${!var:-} && ! ${!var} =~ ^[0-9]+$ ]]; then
    fail 2 "$var must be a whole number of seconds, got '${!var}'"
  fi
done
ready_timeout=${SHARDCAST_READY_TIMEOUT:-120}
stop_timeout=${SHARDCAST_STOP_TIMEOUT:-20}

daemon_bin=$(command -v -- "${SHARDCASTD:-shardcastd}") ||
  fail 1 "shardcastd not found: put it on PATH or set SHARDCASTD=/path/to/shardcastd"
cli_bin=$(command -v -- "${SHARDCAST:-shardcast}") ||
  fail 1 "the shardcast CLI not found: put it on PATH or set SHARDCAST=/path/to/shardcast"

# ---------------------------------------------------------------------------
# The job directory.

base=${SLURM_TMPDIR:-${TMPDIR:-/tmp}}
base=${base%/}
jobdir=$base/shardcast-${SLURM_JOB_ID:-$$}
sock=$jobdir/shardcastd.sock
log=$jobdir/shardcastd.log
# sun_path holds 107 bytes and a NUL; the local channel is "<socket>.local".
if [[ $(byte_length "$sock.local") -gt 107 ]]; then
  fail 1 "socket path $sock.local is longer than a Unix socket allows (107 bytes): set TMPDIR to a shorter node-local directory"
fi
[[ -d $base ]] || fail 1 "$base (SLURM_TMPDIR/TMPDIR) is not a directory"

# Directories left by wrappers that were SIGKILLed (their daemons exited
# with them): ours, with neither wrapper nor daemon alive.
for dir in "$base"/shardcast-*; do
  if [[ $dir != "$jobdir" ]] && stale "$dir"; then
    rm -rf -- "$dir" && say "removed the stale job directory $dir"
  fi
done
if [[ -e $jobdir || -L $jobdir ]]; then
  stale "$jobdir" ||
    fail 1 "$jobdir exists and is not a stale directory of ours (is another shardcast-job.sh of this job running on this node?)"
  rm -rf -- "$jobdir"
fi

daemon_pid=""
cmd_pid=""
made_dir=0
own_group=0
signal_name=""
interrupted=0
start=$SECONDS

# Runs on every exit: stops the daemon, removes the directory, keeps the
# exit status. (SC2317: shellcheck 0.9 does not see calls from traps.)
# shellcheck disable=SC2317
cleanup() {
  local status=$?
  trap '' INT TERM HUP
  if [[ -n $daemon_pid ]]; then
    local how="had already exited" daemon_status=0
    if kill -0 "$daemon_pid" 2>/dev/null; then
      how="stopped with SIGTERM"
      kill -TERM "$daemon_pid" 2>/dev/null || true
      if ! wait_gone "$daemon_pid" "$stop_timeout"; then
        how="killed with SIGKILL ${stop_timeout} s after SIGTERM"
        kill -KILL "$daemon_pid" 2>/dev/null || true
        wait_gone "$daemon_pid" 5 || true
      fi
    fi
    wait "$daemon_pid" 2>/dev/null || daemon_status=$?
    say "shardcastd (pid $daemon_pid) $how after $((SECONDS - start)) s, exit status $daemon_status"
    if [[ $daemon_status -ne 0 ]]; then log_tail; fi
    if [[ -n ${SHARDCAST_LOG:-} && -f $log ]]; then
      cp -- "$log" "$SHARDCAST_LOG" 2>/dev/null || say "could not copy the log to $SHARDCAST_LOG"
    fi
  fi
  if [[ $made_dir -eq 1 ]]; then rm -rf -- "$jobdir"; fi
  exit "$status"
}

# A signal before COMMAND runs ends the script (the clean-up follows); after,
# it is passed on and the script waits for COMMAND.
# shellcheck disable=SC2317
on_signal() {
  local name=$1 number=$2
  if [[ -z $cmd_pid ]]; then
    say "SIG$name while starting: stopping"
    exit $((128 + number))
  fi
  signal_name=$name
  interrupted=1
  if [[ $own_group -eq 1 ]]; then
    kill -s "$name" -- "-$cmd_pid" 2>/dev/null || true
  elif [[ $name != INT ]]; then
    # With a terminal, COMMAND shares our process group and got Ctrl-C's
    # SIGINT itself; other signals were sent to this script alone.
    kill -s "$name" "$cmd_pid" 2>/dev/null || true
  fi
}

trap cleanup EXIT
trap 'on_signal TERM 15' TERM
trap 'on_signal INT 2' INT
trap 'on_signal HUP 1' HUP

mkdir -m 0700 -- "$jobdir" || fail 1 "cannot create $jobdir"
made_dir=1
echo "$$" >"$jobdir/wrapper.pid"

# ---------------------------------------------------------------------------
# The daemon, in its own process group (a Ctrl-C meant for COMMAND does not
# reach it), stopped by the kernel if this script dies (--exit-with-parent).

set -m
"$daemon_bin" --listen "unix:$sock" --exit-with-parent "${root_args[@]}" \
  "${sweep_args[@]}" "${daemon_args[@]}" </dev/null >"$log" 2>&1 &
daemon_pid=$!
set +m
echo "$daemon_pid" >"$jobdir/shardcastd.pid"

deadline=$((SECONDS + ready_timeout))
last=""
while :; do
  if ! kill -0 "$daemon_pid" 2>/dev/null; then
    status=0
    wait "$daemon_pid" || status=$?
    daemon_pid=""
    log_tail
    fail 1 "shardcastd exited with status $status while starting ($daemon_bin)"
  fi
  if [[ -S $sock ]]; then
    if last=$(timeout 10 "$cli_bin" --server "unix:$sock" health 2>&1 >/dev/null); then
      break
    fi
  fi
  if [[ $SECONDS -ge $deadline ]]; then
    log_tail
    fail 1 "shardcastd (pid $daemon_pid) not ready within ${ready_timeout} s${last:+ (last health check: ${last//$'\n'/ })}"
  fi
  sleep 0.1
done

export SHARDCAST_ADDRESS="unix:$sock"
say "shardcastd (pid $daemon_pid) ready at $SHARDCAST_ADDRESS after $((SECONDS - start)) s; log $log"

# A sweep, before COMMAND's first epoch: every other node's daemon answers
# (they start together: waited for up to the ready timeout) and has the same
# node order, --block-bytes and datasets (content hashes). If not, the job
# still runs: this node reads those peers' shares itself (slower, exact).
if [[ ${#sweep_args[@]} -gt 0 ]]; then
  check=$(timeout --foreground $((ready_timeout + 30)) "$cli_bin" --server "unix:$sock" \
    doctor --only sweep --sweep-wait "$ready_timeout") && ok=1 || ok=0
  check=${check%%$'\n'verdict:*}
  if [[ $ok -eq 1 ]]; then
    read -r _ _ detail <<<"$check"  # "ok sweep DETAIL", one line
    say "sweep check: $detail"
  else
    say "WARNING: sweep check failed; shares of the peers named are read on this node: ${check//$'\n'/ }"
  fi
fi

# ---------------------------------------------------------------------------
# COMMAND, with our standard input (a background command's would otherwise
# be /dev/null). Without a terminal (batch jobs) it gets its own process
# group, so a signal reaches all its processes; with one it stays in ours,
# so it can read the terminal and gets Ctrl-C directly.

if [[ ! -t 0 ]]; then own_group=1; fi
if [[ $own_group -eq 1 ]]; then set -m; fi
"$@" <&0 &
cmd_pid=$!
set +m
while :; do
  interrupted=0
  cmd_status=0
  wait "$cmd_pid" || cmd_status=$?
  [[ $interrupted -eq 1 ]] || break
  # A signal was passed on: COMMAND gets stop_timeout seconds to finish.
  if ! wait_gone "$cmd_pid" "$stop_timeout"; then
    say "command ${1##*/} still running ${stop_timeout} s after SIG$signal_name: SIGKILL"
    if [[ $own_group -eq 1 ]]; then
      kill -KILL -- "-$cmd_pid" 2>/dev/null || true
    else
      kill -KILL "$cmd_pid" 2>/dev/null || true
    fi
  fi
done
say "command ${1##*/} exited with status $cmd_status${signal_name:+ (after SIG$signal_name)}"
exit "$cmd_status"
