# shellcheck shell=bash
# Shared by the scripts that run two shardcastd binaries against each other
# (run_warm_ab.sh, run_first_batch_ab.sh); sourced, not run. The caller sets
# REPO, BUILD_DIR, BENCH_DIR and defines die() first.

# ab_init USAGE OLD NEW: BIN[a]/BIN[b] are the two daemons, SC the CLI,
# ROOT and SOCK under BENCH_DIR; dies naming what is missing.
ab_init() {
  local usage=$1; shift
  [[ $# == 2 ]] || die "usage: $usage OLD_SHARDCASTD NEW_SHARDCASTD"
  declare -gA BIN=([a]=$1 [b]=$2)
  local v
  for v in a b; do [[ -x ${BIN[$v]} ]] || die "${BIN[$v]}: not an executable"; done
  SC=$BUILD_DIR/shardcast
  [[ -x $SC ]] || die "$SC missing: cmake --build build -j2"
  command -v vmtouch >/dev/null || die "needs vmtouch: bash deploy/install-deps.sh"
  case $BENCH_DIR in "$REPO"|"$REPO"/*) die "BENCH_DIR must be outside the repo" ;; esac
  ROOT=$BENCH_DIR/root
  SOCK=$BENCH_DIR/d.sock
  mkdir -p "$ROOT"
}

# ab_dataset LAYERS EXAMPLES: writes the dataset (256 content tokens + CLS,
# d_model 1024, 128 examples per shard) under ROOT unless one is there; DS
# is its directory.
ab_dataset() {
  local layers=$1 examples=$2
  if ! ls "$ROOT"/*/acts000000.bin >/dev/null 2>&1; then
    local n; n=$(tr ',' '\n' <<<"$layers" | wc -l)
    echo "== writing the dataset (layers $layers, $examples examples)"
    "$SC" synth "$ROOT" --layers "$layers" --tokens 256 --cls --d-model 1024 \
      --examples "$examples" --budget $((257 * n * 128)) --json > /dev/null
  fi
  # shellcheck disable=SC2012  # one hex-named directory
  DS=$(ls -d "$ROOT"/*/ | head -1); DS=${DS%/}
}

# ab_start_daemon BINARY LOG: DAEMON is its pid once it listens on SOCK.
ab_start_daemon() {
  rm -f "$SOCK"
  "$1" --root "$ROOT" --listen "unix:$SOCK" 2> "$2" &
  # shellcheck disable=SC2034  # the caller's
  DAEMON=$!
  for _ in $(seq 100); do [[ -S $SOCK ]] && break; sleep 0.1; done
  [[ -S $SOCK ]] || { cat "$2" >&2; die "$1 did not start"; }
}

# ab_start_both [NAME]: both daemons running throughout, BIN[v] listening on
# BENCH_DIR/[NAME-]v.sock and logging to BENCH_DIR/[NAME-]v.log; PID[v] are
# their pids, stopped when the script exits.
ab_start_both() {
  declare -gA PID=()
  trap ab_stop_both EXIT INT TERM
  local v
  for v in a b; do
    SOCK=$BENCH_DIR/${1:+$1-}$v.sock
    ab_start_daemon "${BIN[$v]}" "$BENCH_DIR/${1:+$1-}$v.log"
    PID[$v]=$DAEMON
  done
}

ab_stop_both() {
  local v
  for v in a b; do
    if [[ -n ${PID[$v]:-} ]]; then kill -TERM "${PID[$v]}" 2>/dev/null || true; fi
  done
  wait 2>/dev/null || true
}
