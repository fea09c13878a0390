# Functions prolog.sh and epilog.sh share; sourced by both (install it
# beside them, root-owned). Expects $prog (the name messages carry).
# shellcheck shell=bash
# shellcheck disable=SC2154  # $prog is set by the script that sources this

say() {
  printf '%s: %s\n' "$prog" "$*" >&2
  if [[ -S /dev/log ]] && command -v logger >/dev/null; then
    logger -t "$prog" -- "job ${SLURM_JOB_ID:-?}: $*" 2>/dev/null || true
  fi
}

# Reads the site's settings file; as root only one that root alone can write.
load_defaults() {
  local file=${SHARDCAST_SLURM_DEFAULTS:-/etc/shardcast/slurm.env} owner mode
  [[ -f $file ]] || return 0
  if [[ $(id -u) -eq 0 ]]; then
    read -r owner mode < <(stat -L -c '%u %a' -- "$file")
    if [[ $owner != 0 || $((8#$mode & 8#022)) -ne 0 ]]; then
      say "ignoring $file: not owned by root or writable by others"
      return 0
    fi
  fi
  # shellcheck source=/dev/null
  . "$file"
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

