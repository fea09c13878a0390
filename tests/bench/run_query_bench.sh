#!/usr/bin/env bash
# Random-access benchmark of shardcastd's Query service against fio 4 KiB
# random reads of the same shard files, measured in the same run (docs/benchmarks.md,
# "Targets": cold >= 0.8 x fio 4 KiB random-read IOPS; warm p50 for one vector < 1 ms).
#
#   bash tests/bench/run_query_bench.sh          # from the repo root; ~3 minutes
#
# Expects built binaries in $BUILD_DIR (default build/): shardcast, shardcastd,
# query_bench. Needs fio and vmtouch (bash deploy/install-deps.sh). Writes
# nothing in the repo: the dataset, socket, logs and JSON go to $BENCH_DIR.
#
# Environment:
#   BUILD_DIR      binaries (default: <repo>/build)
#   BENCH_DIR      scratch directory (default: /tmp/shardcast-bench)
#   BENCH_EXAMPLES examples in the dataset; with 2 layers x 257 tokens x 1024
#                  floats each example is 2 MiB: 1024 -> ~2.0 GiB (default),
#                  512 -> ~1 GiB. Reused across runs when the size matches.
#   FIO_SECONDS    runtime cap of each fio job and each timed phase (default 10)
#   FIO_QD         "deep" queue depth, matching the daemon's io_uring depth per
#                  batched call (default 256: a 256-vector call has all its
#                  reads in flight; on the 2-core VM fio qd256 is 3-6 % above
#                  qd64 on the same reads)
#   CONC           client threads of the concurrent cold run (default 16)
#   PAIRS          alternating pairs of the 256/call phase and its fio
#                  reference, and of the $CONC-thread phase and its own
#                  (default 3; 0: none)
#   QUERY_ARGS     more query_bench flags for every phase, e.g. --no-local
#                  (GetVectors over gRPC instead of the local channel)
#   COLD_SHARE     a cold phase reads at most 1/COLD_SHARE of the dataset's
#                  vectors, each once (default 4): fio's reference, on as many
#                  reads, then also reads blocks whose neighbours are mostly
#                  not cached (see step 4)
#
# What runs, in order (every cold step starts with `vmtouch -e` of the shards):
#   fio randread bs=4k, buffered (like the daemon) and O_DIRECT, at iodepth 1
#   (psync) and $FIO_QD (io_uring), buffered at $CONC (io_uring), buffered at
#   $FIO_QD without fio's default fadvise(RANDOM) hint (the daemon gives none,
#   and the hint changes buffered io_uring IOPS here by 10-50 %); query_bench
#   cold: 1 vector per call; 256 per call, with the client library as is and
#   with --malloc-keep (see query_bench --help); 1 per call from $CONC
#   threads sharing calls (the client library's default) and with one call
#   per request; fio again, no hint, at $FIO_QD and $CONC reading as many
#   blocks as the batched and the concurrent phase (the references with the
#   targets); the bare gRPC unary loop from $CONC threads (grpc_stream_bench,
#   the ceiling of one call per request); $PAIRS pairs of the 256/call phase
#   (--malloc-keep) each followed at once by fio on as many reads, buffered
#   without the hint and O_DIRECT (the daemon reads the vectors of a large
#   call that are not cached with O_DIRECT: the faster of the two is the
#   reference; the disk's speed drifts by +-20 % over minutes here: the
#   256/call verdict is the median of the pairs' ratios); then `vmtouch -t` and query_bench
#   warm (1 and 256 per call, 256 with --malloc-keep). Prints a table of
#   ratios and leaves the raw JSON in $BENCH_DIR/results.json.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
BUILD_DIR=${BUILD_DIR:-$REPO/build}
BENCH_DIR=${BENCH_DIR:-/tmp/shardcast-bench}
BENCH_EXAMPLES=${BENCH_EXAMPLES:-1024}
FIO_SECONDS=${FIO_SECONDS:-10}
FIO_QD=${FIO_QD:-256}
CONC=${CONC:-16}
QUERY_ARGS=${QUERY_ARGS:-}
PAIRS=${PAIRS:-3}
COLD_SHARE=${COLD_SHARE:-4}

die() { echo "run_query_bench: $*" >&2; exit 1; }

for b in shardcast shardcastd query_bench; do
  [[ -x $BUILD_DIR/$b ]] || die "$BUILD_DIR/$b missing: build first (cmake --build build; query_bench needs add_subdirectory(bench) in tests/CMakeLists.txt)"
done
command -v fio >/dev/null && command -v vmtouch >/dev/null \
  || die "needs fio and vmtouch: run 'bash deploy/install-deps.sh' as root"
PY=/usr/bin/python3
[[ -x $PY ]] || PY=$(command -v python3) || die "needs python3 for the report"
case $BENCH_DIR in "$REPO"|"$REPO"/*) die "BENCH_DIR must be outside the repo" ;; esac

mkdir -p "$BENCH_DIR"
DATA=$BENCH_DIR/data
SOCK=$BENCH_DIR/shardcastd.sock
OUT=$BENCH_DIR/out
rm -rf "$OUT"; mkdir -p "$OUT"
start_s=$SECONDS
echo "== $(date -u +%FT%TZ), nproc $(nproc), load average $(cut -d' ' -f1-3 /proc/loadavg)"

# 1. Dataset (deterministic, so an existing one with the same parameters is reused).
params="--layers 6,12 --tokens 256 --cls --d-model 1024 --examples $BENCH_EXAMPLES --budget 2400000 --seed 0"
if [[ -f $BENCH_DIR/params && $(cat "$BENCH_DIR/params") == "$params" ]] \
   && ls "$DATA"/*/acts000000.bin >/dev/null 2>&1; then
  echo "== dataset: reusing $DATA ($params)"
else
  echo "== dataset: shardcast synth $params"
  rm -rf "$DATA" "$BENCH_DIR/params"
  # shellcheck disable=SC2086
  "$BUILD_DIR/shardcast" synth "$DATA" $params --json > "$OUT/synth.json"
  echo "$params" > "$BENCH_DIR/params"
fi
DSDIR=$(ls -d "$DATA"/*/ | head -1); DSDIR=${DSDIR%/}
SHARDS=("$DSDIR"/acts*.bin)
# fio takes the names relative to --directory (':' escaped); one option value
# may not exceed 4095 characters.
FIO_DIR=${DSDIR//:/\\:}
FIO_FILES=$(IFS=:; echo "${SHARDS[*]##*/}")
(( ${#FIO_FILES} < 4096 )) || die "${#SHARDS[@]} shard names are too long a list for fio's --filename"
echo "   $(du -sh "$DSDIR" | cut -f1) in ${#SHARDS[@]} shard file(s) under $DSDIR"

# 2. Daemon on a private socket; killed on any exit.
DPID=""
cleanup() {
  if [[ -n $DPID ]] && kill -0 "$DPID" 2>/dev/null; then
    kill -TERM "$DPID" 2>/dev/null || true
    wait "$DPID" 2>/dev/null || true
  fi
}
trap cleanup EXIT INT TERM
rm -f "$SOCK"
"$BUILD_DIR/shardcastd" --root "$DATA" --listen "unix:$SOCK" --log-level warning \
  > "$BENCH_DIR/shardcastd.log" 2>&1 &
DPID=$!
for _ in $(seq 100); do [[ -S $SOCK ]] && break; sleep 0.1; done
[[ -S $SOCK ]] || die "shardcastd did not create $SOCK (see $BENCH_DIR/shardcastd.log)"

evict() { vmtouch -q -e "${SHARDS[@]}"; }
# Bytes the block device really read during a step (readahead shows up here).
DEV=$(basename "$(df --output=source "$DSDIR" | tail -1)")
disk_bytes() { awk '{printf "%.0f\n", $3 * 512}' "/sys/class/block/$DEV/stat" 2>/dev/null || echo 0; }
measure() {  # NAME CMD...: runs CMD, records the device bytes read in $OUT/disk_NAME
  local name=$1 b0; shift
  b0=$(disk_bytes)
  "$@"
  echo $(( $(disk_bytes) - b0 )) > "$OUT/disk_$name"
}

# 3. fio on the same files, cold each time. No --time_based: a job stops at
# the runtime or when every block has been read once (fio's random map), so
# it never re-reads pages it cached itself.
# fio's default for random jobs is fadvise(RANDOM) (fadvise_hint=1); the
# daemon gives no hint, so the deep buffered job also runs with hint 0.
run_fio() {  # name direct iodepth engine [fadvise_hint [io_size]]
  evict
  local size=()
  [[ -n ${6:-} ]] && size=(--io_size="$6")
  measure "fio_$1" fio --name="$1" --directory="$FIO_DIR" --filename="$FIO_FILES" --rw=randread --bs=4k --direct="$2" \
      --iodepth="$3" --ioengine="$4" --fadvise_hint="${5:-1}" --runtime="$FIO_SECONDS" \
      "${size[@]}" \
      --numjobs=1 --group_reporting --output-format=json --output="$OUT/fio_$1.json"
  "$PY" - "$OUT/fio_$1.json" <<'EOF'
import json, sys
j = json.load(open(sys.argv[1]))["jobs"][0]["read"]
print(f"   {sys.argv[1].rsplit('/',1)[1][4:-5]:<22} {j['iops']:>10.0f} IOPS  "
      f"p50 {j['clat_ns']['percentile']['50.000000']/1e3:8.1f} us")
EOF
}
echo "== fio randread 4k (cold, ${FIO_SECONDS}s cap each)"
run_fio buffered_qd1 0 1 psync
run_fio direct_qd1 1 1 psync
run_fio "buffered_qd$CONC" 0 "$CONC" io_uring
run_fio "buffered_qd$FIO_QD" 0 "$FIO_QD" io_uring
run_fio "buffered_qd${FIO_QD}_nohint" 0 "$FIO_QD" io_uring 0
run_fio "direct_qd$FIO_QD" 1 "$FIO_QD" io_uring

# 4. Query bench, cold: evict right before each run.
QB=("$BUILD_DIR/query_bench" --address "unix:$SOCK" --seconds "$FIO_SECONDS"
    --verify-synth-seed 0 --seed 1 $QUERY_ARGS)
echo "== query_bench cold"
cold() {  # NAME ARGS...: evict, run query_bench, keep its JSON and disk bytes
  local name=$1; shift
  evict
  measure "$name" "${QB[@]}" --label cold "$@" > "$OUT/$name.json"
}
# A cold phase draws distinct coordinates from a quarter of the dataset's
# vectors (COLD_SHARE): every read misses, for the daemon and for fio's
# reference on as many reads. Reading most of the file instead favours
# buffered fio (its readahead and its later reads find neighbours cached: on
# the 2-core VM, qd256 no hint, 101 K IOPS over 15 % of the file against 118 K
# over 78 %, O_DIRECT 106 K and 103 K, same minutes) and gives the daemon's
# repeated coordinates cache hits.
# (query_bench draws distinct coordinates only up to half the vectors.)
(( COLD_SHARE >= 2 )) || die "COLD_SHARE must be >= 2 (got $COLD_SHARE)"
# The vectors of the dataset as its metadata.json counts them.
VECTORS=$("$PY" -c 'import json,sys; m=json.load(open(sys.argv[1]))
print(m["n_examples"] * len(m["layers"]) * (m["patches_per_ex"] + int(m["cls_token"])))' \
  "$DSDIR/metadata.json") || die "cannot count the vectors of $DSDIR/metadata.json"
COLD_VECTORS=$(( VECTORS / COLD_SHARE ))
BATCH_CALLS=$(( COLD_VECTORS / 256 ))
(( BATCH_CALLS >= 50 )) || die "BENCH_EXAMPLES=$BENCH_EXAMPLES gives $BATCH_CALLS cold 256-vector calls; use more examples"
cold cold_single --mode single --calls "$COLD_VECTORS"
cold cold_batch --mode batch --batch 256 --batch-calls "$BATCH_CALLS"
cold cold_batch_keep --mode batch --batch 256 --batch-calls "$BATCH_CALLS" --malloc-keep
cold cold_single_conc --mode single --calls "$COLD_VECTORS" --threads "$CONC"
cold cold_single_conc_alone --mode single --calls "$COLD_VECTORS" --threads "$CONC" --calls-in-flight 0

# fio again, reading as many blocks as the query phase it is compared with
# (io_size = that phase's payload bytes). Over the whole file fio is
# favoured: without the RANDOM hint its reads start readahead, and towards
# the end of the file most blocks it has left are already cached (measured
# on the 2-core VM, qd64: 79 K IOPS over 400 MiB, 137 K over 800 MiB, 157 K
# over all 1.1 GiB).
payload() {  # JSON PHASE: the payload bytes query_bench read in that phase
  local b
  b=$("$PY" -c 'import json,sys; j=json.load(open(sys.argv[1])); print(j[sys.argv[2]]["payload_bytes"])' "$1" "$2") \
    && [[ $b -gt 0 ]] || die "no payload_bytes in $1 ($2)"
  echo "$b"
}
[[ $CONC != "$FIO_QD" ]] || die "CONC and FIO_QD must differ (their fio jobs share names)"
echo "== fio randread 4k, no fadvise hint, as many reads as the query phase"
deep_bytes=$(payload "$OUT/cold_batch_keep.json" batch)
conc_bytes=$(payload "$OUT/cold_single_conc.json" single)
run_fio "buffered_qd${FIO_QD}_nohint_same" 0 "$FIO_QD" io_uring 0 "$deep_bytes"
run_fio "direct_qd${FIO_QD}_same" 1 "$FIO_QD" io_uring 0 "$deep_bytes"
run_fio "buffered_qd${CONC}_nohint_same" 0 "$CONC" io_uring 0 "$conc_bytes"

# The 256/call and the $CONC-thread phases again, each time followed at once
# by its fio reference: measured minutes apart, the two see different disks
# (on the 2-core VM the 16-thread row read 0.75-0.92 over six runs in 10
# minutes against one fio run each, as fio qd16 went 49-93 K).
if (( PAIRS > 0 )); then
  echo "== cold 256/call, then fio qd$FIO_QD no hint on as many reads;" \
       "cold 1 vector from $CONC threads, then fio qd$CONC: $PAIRS pairs"
  for p in $(seq "$PAIRS"); do
    cold "pair${p}_batch_keep" --mode batch --batch 256 --batch-calls "$BATCH_CALLS" --malloc-keep
    # Not inside run_fio's arguments: a failed payload must stop the script,
    # not leave fio reading the whole file.
    pair_bytes=$(payload "$OUT/pair${p}_batch_keep.json" batch)
    run_fio "buffered_qd${FIO_QD}_nohint_pair$p" 0 "$FIO_QD" io_uring 0 "$pair_bytes"
    run_fio "direct_qd${FIO_QD}_pair$p" 1 "$FIO_QD" io_uring 0 "$pair_bytes"
    cold "pair${p}_conc" --mode single --calls "$COLD_VECTORS" --threads "$CONC"
    pair_bytes=$(payload "$OUT/pair${p}_conc.json" single)
    run_fio "buffered_qd${CONC}_nohint_pair$p" 0 "$CONC" io_uring 0 "$pair_bytes"
    run_fio "direct_qd${CONC}_pair$p" 1 "$CONC" io_uring 0 "$pair_bytes"
  done
fi

# The most unary calls $CONC threads get through gRPC here with an empty
# handler (no disk, no data): the ceiling of one call per request.
if [[ -x $BUILD_DIR/grpc_stream_bench ]]; then
  echo "== bare gRPC unary calls from $CONC threads"
  "$BUILD_DIR/grpc_stream_bench" --socket "$BENCH_DIR/bare.sock" --unary 40000 \
    --threads "$CONC" --json > "$OUT/unary_conc.json" \
    || { echo "   (failed; the report goes on without it)"; rm -f "$OUT/unary_conc.json"; }
fi

# 5. Query bench, warm: read every shard byte, then measure at once (pages
# idle for ~30 s get evicted on these VMs).
echo "== query_bench warm (vmtouch -t first)"
vmtouch -q -t "${SHARDS[@]}"
"${QB[@]}" --label warm --mode both --calls 20000 --batch 256 --batch-calls 400 \
  > "$OUT/warm.json"
"${QB[@]}" --label warm --mode batch --batch 256 --batch-calls 800 --malloc-keep \
  > "$OUT/warm_batch_keep.json"

cleanup; DPID=""

# 6. Report.
"$PY" - "$OUT" "$FIO_QD" "$CONC" "$((SECONDS - start_s))" "$PAIRS" <<'EOF'
import json, os, statistics, sys, datetime
out, qd, conc, secs, npairs = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
def load(n): return json.load(open(os.path.join(out, n)))
fio_jobs = {n[4:-5]: load(n)["jobs"][0]["read"] for n in os.listdir(out) if n.startswith("fio_")}
fio = {k: v["iops"] for k, v in fio_jobs.items()}
fio_p50 = {k: v["clat_ns"]["percentile"]["50.000000"] / 1e3 for k, v in fio_jobs.items()}
cs, cb, ck, cc, ca, w, wk = (load(n + ".json") for n in (
    "cold_single", "cold_batch", "cold_batch_keep", "cold_single_conc",
    "cold_single_conc_alone", "warm", "warm_batch_keep"))
unary = load("unary_conc.json") if os.path.exists(os.path.join(out, "unary_conc.json")) else None
B = lambda x: x["batch"]["iops_4k_equiv"]
# The 256/call references: the faster of buffered (no hint) and O_DIRECT on
# as many reads (the daemon reads cold vectors of large calls with O_DIRECT).
def faster(*jobs):
    have = [j for j in jobs if j in fio]
    return max(have, key=lambda j: fio[j])
deep_same = faster(f"buffered_qd{qd}_nohint_same", f"direct_qd{qd}_same")
rows = [
 ("cold 1 vec/call, 1 thread", cs["single"]["iops_4k_equiv"], "buffered_qd1", 0.8),
 ("  same vs O_DIRECT qd1", cs["single"]["iops_4k_equiv"], "direct_qd1", None),
 ("cold 256 vec/call, client lib as is", B(cb), deep_same, 0.8),
 ("  same vs buffered qd1", B(cb), "buffered_qd1", None),
 ("  same vs fio with the RANDOM hint", B(cb), f"buffered_qd{qd}", None),
 ("  same vs no hint, whole file", B(cb), f"buffered_qd{qd}_nohint", None),
 ("  same vs O_DIRECT qd" + qd, B(cb), f"direct_qd{qd}", None),
 ("cold 256 vec/call, --malloc-keep", B(ck), deep_same, 0.8),
 ("  same vs buffered, no hint, same reads", B(ck), f"buffered_qd{qd}_nohint_same", None),
 (f"cold 1 vec/call, {conc} threads, shared calls", cc["single"]["iops_4k_equiv"], f"buffered_qd{conc}_nohint_same", 0.8),
 ("  same vs fio with the RANDOM hint", cc["single"]["iops_4k_equiv"], f"buffered_qd{conc}", None),
 ("  one call per request (in flight 0)", ca["single"]["iops_4k_equiv"], f"buffered_qd{conc}_nohint_same", None),
]
print()
print(f"{'cold: 4 KiB vectors/s vs fio randread IOPS':<40}{'shardcast':>10}{'fio job':>28}{'fio IOPS':>10}{'ratio':>7}  target")
for name, v, ref, tgt in rows:
    r = v / fio[ref]
    t = "" if tgt is None else (f">= {tgt}: " + ("met" if r >= tgt else "NOT met"))
    print(f"{name:<40}{v:>10.0f}{ref:>28}{fio[ref]:>10.0f}{r:>7.2f}  {t}")
pairs = []
for p in range(1, npairs + 1):
    ref = faster(f"buffered_qd{qd}_nohint_pair{p}", f"direct_qd{qd}_pair{p}")
    pairs.append({"shardcast": B(load(f"pair{p}_batch_keep.json")), "fio": fio[ref], "fio_job": ref,
                  "fio_buffered": fio.get(f"buffered_qd{qd}_nohint_pair{p}"),
                  "fio_direct": fio.get(f"direct_qd{qd}_pair{p}")})
# The concurrent pairs: the reference is buffered without the hint (the
# issue's "no fadvise hint"); O_DIRECT on the same reads is printed beside.
conc_pairs = []
for p in range(1, npairs + 1):
    if not os.path.exists(os.path.join(out, f"pair{p}_conc.json")):
        continue
    conc_pairs.append({"shardcast": load(f"pair{p}_conc.json")["single"]["iops_4k_equiv"],
                       "fio": fio[f"buffered_qd{conc}_nohint_pair{p}"],
                       "fio_direct": fio.get(f"direct_qd{conc}_pair{p}")})
def print_paired(label, pairs, ref, key="fio", target=0.8):
    """One row for alternating pairs: the medians, and the median of the
    pairs' ratios (the verdict when `target`)."""
    ratios = [x["shardcast"] / x[key] for x in pairs]
    r = statistics.median(ratios)
    t = f">= {target}: {'met' if r >= target else 'NOT met'} " if target else ""
    print(f"{label:<40}{statistics.median(x['shardcast'] for x in pairs):>10.0f}"
          f"{ref:>28}{statistics.median(x[key] for x in pairs):>10.0f}"
          f"{r:>7.2f}  {t}(median of " + " / ".join(f"{x:.2f}" for x in ratios) + ")")
if pairs:
    print_paired("cold 256 vec/call, --malloc-keep, paired", pairs, f"faster of qd{qd} pair*")
if conc_pairs:
    print_paired(f"cold 1 vec/call, {conc} threads, paired", conc_pairs,
                 f"buffered_qd{conc}_nohint_pair*")
    if all(x["fio_direct"] for x in conc_pairs):
        print_paired("  same vs O_DIRECT, same reads", conc_pairs, f"direct_qd{conc}_pair*",
                     key="fio_direct", target=None)
print()
print(f"fio jobs named *_same read as many blocks as the --malloc-keep 256/call phase (qd{qd}) "
      f"and the {conc}-thread phase (qd{conc})")
if pairs:
    print("pairs' fio, buffered no hint / O_DIRECT: " + ", ".join(
        f"{x['fio_buffered']:.0f} / {x['fio_direct']:.0f}" for x in pairs))
for name, x, k, ref in (("256/call as is", cb, "batch", ck), ("one call per request", ca, "single", cc)):
    if x[k]["payload_bytes"] != ref[k]["payload_bytes"]:
        print(f"  note: the {name} phase read {x[k]['payload_bytes']} bytes, its reference "
              f"{ref[k]['payload_bytes']} (a phase stopped at the time cap)")
if unary:
    c = cc["single"]["calls_per_s"]
    print(f"bare gRPC unary, {conc} threads, empty handler: {unary['calls_per_second']:.0f} calls/s "
          f"(p50 {unary['p50_us']:.0f} us); {conc} query threads sharing calls: {c:.0f} requests/s "
          f"({c / unary['calls_per_second']:.2f} x), one call each: "
          f"{ca['single']['calls_per_s']:.0f} ({ca['single']['calls_per_s'] / unary['calls_per_second']:.2f} x)")
print(f"cold 1 vec/call:   p50 {cs['single']['p50_us']:.0f} us, p99 {cs['single']['p99_us']:.0f} us "
      f"(fio buffered qd1 p50 {fio_p50['buffered_qd1']:.0f} us)")
print(f"cold 256 vec/call: p50 {cb['batch']['p50_us']/1e3:.1f} ms/call, {cb['batch']['mb_per_s']:.0f} MB/s; "
      f"--malloc-keep: p50 {ck['batch']['p50_us']/1e3:.1f} ms/call, {ck['batch']['mb_per_s']:.0f} MB/s")
ws, wb, wkb = w["single"], w["batch"], wk["batch"]
print(f"warm 1 vec/call:   {ws['calls_per_s']:.0f} calls/s, p50 {ws['p50_us']:.0f} us, "
      f"p99 {ws['p99_us']:.0f} us  (target p50 < 1000 us: {'met' if ws['p50_us'] < 1000 else 'NOT met'})")
for name, x in (("warm 256 vec/call:", wb), ("  --malloc-keep:  ", wkb)):
    print(f"{name} {x['vectors_per_s']:.0f} vectors/s, {x['calls_per_s']:.0f} calls/s, "
          f"{x['mb_per_s']:.0f} MB/s, p50 {x['p50_us']:.0f} us, p99 {x['p99_us']:.0f} us")
bad = sum(x[k]["bad_vectors"] + x[k]["errors"] for x, k in
          ((cs, "single"), (cb, "batch"), (ck, "batch"), (cc, "single"), (ca, "single"), (w, "single"),
           (w, "batch"), (wk, "batch")))
def disk(n):
    try: return int(open(os.path.join(out, "disk_" + n)).read())
    except (OSError, ValueError): return 0
amp = [(f"fio {k}", disk("fio_" + k), v["io_bytes"]) for k, v in sorted(fio_jobs.items())]
amp += [(n, disk(n), x[k]["payload_bytes"]) for n, x, k in (
    ("cold_single", cs, "single"), ("cold_batch", cb, "batch"),
    ("cold_batch_keep", ck, "batch"), ("cold_single_conc", cc, "single"),
    ("cold_single_conc_alone", ca, "single"))]
print("device bytes read / bytes requested (readahead amplification): " +
      ", ".join(f"{n} {d / r:.2f}" if r else f"{n} -" for n, d, r in amp))
print(f"values checked against the synth formula: {'all equal' if bad == 0 else f'{bad} BAD'}")
print(f"total time {secs} s; load average at the end: {open('/proc/loadavg').read().split()[:3]}")
json.dump({"date": datetime.datetime.now().isoformat(timespec="seconds"),
           "fio_qd": int(qd), "conc": int(conc), "fio_iops": fio, "cold_single": cs, "cold_batch": cb,
           "cold_batch_keep": ck, "pairs": pairs, "conc_pairs": conc_pairs, "cold_single_conc": cc,
           "cold_single_conc_alone": ca, "unary_conc": unary, "warm": w,
           "warm_batch_keep": wk},
          open(os.path.join(os.path.dirname(out), "results.json"), "w"), indent=1)
EOF
echo "raw JSON: $BENCH_DIR/results.json"
