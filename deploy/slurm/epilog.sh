#!/usr/bin/env bash
# Slurm Epilog: stops the job's shardcastd on this node (started by
# prolog.sh) and removes its directory. Runs as root at the end of the job,
# after its processes are gone; also safe when the prolog did not run, ran
# only in part, or the daemon already exited, and when run twice.
#
# The daemon is found by the pid file $SHARDCAST_JOB_RUNDIR/job-$ID.pid
# (root's: a user cannot point it at another process) and, failing that, by
# its command line (--listen unix:<the job's socket>). It gets SIGTERM, then
# SIGKILL after SHARDCAST_STOP_TIMEOUT seconds (default 20). Exit status 0,
# or 1 when a daemon survives SIGKILL (stuck in the kernel: Slurm drains the
# node, which then needs a look). Settings as in prolog.sh
# (SHARDCAST_SLURM_DEFAULTS, SHARDCAST_JOB_RUNDIR).
set -euo pipefail

prog=shardcast-epilog

# say, load_defaults, is_daemon: shared with prolog.sh.
# shellcheck source=prolog-common.sh
. "$(dirname -- "$(readlink -f -- "${BASH_SOURCE[0]}")")/prolog-common.sh"

# alive PID...: those still running.
alive() {
  local pid
  for pid in "$@"; do
    if is_daemon "$pid" "$sock"; then printf '%s\n' "$pid"; fi
  done
}

load_defaults

job=${SLURM_JOB_ID:-}
[[ $job =~ ^[0-9]+$ ]] || { say "SLURM_JOB_ID is not set to a job id ('$job')"; exit 1; }
base=${SHARDCAST_JOB_RUNDIR:-/run/shardcast-jobs}
base=${base%/}
dir=$base/job-$job
sock=$dir/shardcastd.sock
pidfile=$base/job-$job.pid
timeout_s=${SHARDCAST_STOP_TIMEOUT:-20}
[[ $timeout_s =~ ^[0-9]+$ ]] || timeout_s=20

pids=()
if [[ -f $pidfile ]]; then
  pid=$(cat -- "$pidfile" 2>/dev/null || true)
  if is_daemon "$pid" "$sock"; then pids+=("$pid"); fi
fi
if [[ ${#pids[@]} -eq 0 ]]; then
  # No pid file (the prolog was interrupted) or a stale one: look for the
  # socket on command lines. grep lists itself too; alive() drops it, as it
  # has exited by then.
  mapfile -t found < <(grep -lsFxz -- "unix:$sock" /proc/[0-9]*/cmdline || true)
  for file in "${found[@]}"; do
    pid=${file#/proc/}
    pid=${pid%/cmdline}
    if [[ $pid != "$$" ]] && is_daemon "$pid" "$sock"; then pids+=("$pid"); fi
  done
fi

status=0
if [[ ${#pids[@]} -gt 0 ]]; then
  kill -TERM "${pids[@]}" 2>/dev/null || true
  for ((i = 0; i < timeout_s * 10; i++)); do
    mapfile -t left < <(alive "${pids[@]}")
    [[ ${#left[@]} -gt 0 ]] || break
    sleep 0.1
  done
  mapfile -t left < <(alive "${pids[@]}")
  if [[ ${#left[@]} -gt 0 ]]; then
    say "shardcastd ${left[*]} still running ${timeout_s} s after SIGTERM: SIGKILL"
    kill -KILL "${left[@]}" 2>/dev/null || true
    for ((i = 0; i < 50; i++)); do
      mapfile -t left < <(alive "${left[@]}")
      [[ ${#left[@]} -gt 0 ]] || break
      sleep 0.1
    done
    if [[ ${#left[@]} -gt 0 ]]; then
      say "shardcastd ${left[*]} survived SIGKILL (stuck in the kernel?)"
      status=1
    fi
  fi
  say "stopped shardcastd ${pids[*]} (unix:$sock)"
fi
rm -f -- "$pidfile" "$pidfile.tmp"
rm -rf -- "$dir"
exit "$status"
