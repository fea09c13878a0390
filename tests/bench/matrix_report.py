"""The table and the plot of tests/bench/run_matrix.sh: reads what the run
left in --out (shardcast bench and grpc_stream_bench JSON) and in --query
(run_query_bench.sh's results.json and fio JSON), prints one table of ratios
against the same-run references with issue 11's targets, and writes the
figures as JSON and a PNG (tests/bench/plot.py, matplotlib)."""

import argparse
import glob
import json
import os
import statistics
import sys

MB = 1e6


def load(path):
    with open(path) as f:
        return json.load(f)


def finished(path):
    """Whether path holds a whole JSON result: a run cut off by a time limit
    leaves an empty or partial file, which is skipped with a note."""
    if not os.path.exists(path):
        return False
    try:
        load(path)
        return True
    except (OSError, ValueError):
        print(f"matrix_report: skipping {path}: not a whole JSON result (cut off?)",
              file=sys.stderr)
        return False


def per_trainer(bench):
    return [c["bytes_per_second"] for c in bench["clients"]]


def verdict(ok):
    return "met" if ok else "NOT met"


def paired_row(label, pairs, key="fio", target=True):
    """A report row for alternating pairs of a query phase and its fio
    reference (run_query_bench.sh PAIRS): the median of the pairs' ratios,
    against >= 0.8 when `target`; without, no rate and no verdict."""
    ratios = [p["shardcast"] / p[key] for p in pairs]
    pr = statistics.median(ratios)
    rate = f"{statistics.median(p['shardcast'] for p in pairs):.0f} vec/s" if target else ""
    return (label, rate, f"fio {statistics.median(p[key] for p in pairs):.0f} IOPS; pairs "
            + " / ".join(f"{r:.2f}" for r in ratios), pr,
            ">= 0.8" if target else "", verdict(pr >= 0.8) if target else "")


def cold_rows(out, trainers):
    names = [("l1of2", "1 layer of 2, content"), ("l1of4", "1 layer of 4, content"),
             ("all2", "all layers of 2, content"), ("l1of2-alltok", "1 layer of 2, all tokens")]
    rows, series, fio_points = [], {}, {}
    for key, label in names:
        for n in trainers:
            path = os.path.join(out, f"cold-{key}-{n}.json")
            if not finished(path):
                continue
            j = load(path)
            per = per_trainer(j)
            fio = j["fio"]["mean"]
            worst = min(per) / fio
            sel = j["selected_bytes_per_epoch"] * j["epochs"]
            io = j.get("proc_io_read_bytes")
            io_ratio = io / sel if io is not None else float("nan")
            target = 0.9 if n == 1 else 0.8
            rows.append((f"cold {label}", n, statistics.mean(per) / MB, fio / MB, worst,
                         f">= {target}", verdict(worst >= target), io_ratio,
                         verdict(io_ratio <= 1.05)))
            series.setdefault(label, []).append([n, statistics.mean(per) / MB])
            fio_points.setdefault(n, []).append(fio / MB)
    return rows, series, fio_points


def bare_rate(path):
    """Mean bytes/s per client of a grpc_stream_bench --json run."""
    return statistics.mean(c["bytes_per_second"] for c in load(path)["clients"])


def client_ns_per_byte(clients):
    """Mean CPU ns per received byte over the clients that report CPU time."""
    xs = [c["cpu_seconds"] * 1e9 / c["bytes"] for c in clients
          if c.get("cpu_seconds") is not None and c.get("bytes")]
    return statistics.mean(xs) if xs else None


def runs(out, prefix):
    """The run numbers r of the files PREFIX-r.json in `out`, in order (the
    warm step runs REPEAT pairs per row, WARM1_REPEAT for one trainer)."""
    found = []
    for p in glob.glob(os.path.join(glob.escape(out), f"{prefix}-*.json")):
        tail = os.path.basename(p)[len(prefix) + 1:-len(".json")]
        if tail.isdigit():
            found.append(int(tail))
    return sorted(found)


def cpu_rows(out, trainers):
    """CPU ns per byte delivered, serving side and receiving side, median over
    the runs: the daemon (shardcast bench --daemon-pid) against the bare
    loop's server (grpc_stream_bench --fork), from one buffer and from 1 GiB.
    Results written before these figures existed are skipped."""
    rows = []
    for n in trainers:
        cols = []
        for name, server_key in ((f"warm-grpc-{n}", "daemon_cpu_ns_per_byte"),
                                 (f"bare-{n}", "server_cpu_ns_per_byte"),
                                 (f"bare-mem-{n}", "server_cpu_ns_per_byte")):
            srv, cli = [], []
            for r in runs(out, f"warm-grpc-{n}"):
                p = os.path.join(out, f"{name}-{r}.json")
                if not finished(p):
                    continue
                j = load(p)
                if j.get(server_key) is not None:
                    srv.append(j[server_key])
                c = client_ns_per_byte(j["clients"])
                if c is not None:
                    cli.append(c)
            cols.append((statistics.median(srv) if srv else None,
                         statistics.median(cli) if cli else None))
        if any(x is not None for col in cols for x in col):
            rows.append((n, cols))
    return rows


def warm_rows(out, trainers):
    rows, ours, bare = [], [], []
    for n in trainers:
        ratios, mem_ratios, o, b = [], [], [], []
        for r in runs(out, f"warm-grpc-{n}"):
            jp = os.path.join(out, f"warm-grpc-{n}-{r}.json")
            bp = os.path.join(out, f"bare-{n}-{r}.json")
            mp = os.path.join(out, f"bare-mem-{n}-{r}.json")
            if not (finished(jp) and finished(bp)):
                continue
            mine = statistics.mean(per_trainer(load(jp)))
            ref = bare_rate(bp)
            ratios.append(mine / ref)
            if finished(mp):
                mem_ratios.append(mine / bare_rate(mp))
            o.append(mine)
            b.append(ref)
        if not ratios:
            continue
        med = statistics.median(ratios)
        mem_med = statistics.median(mem_ratios) if mem_ratios else None
        rows.append((n, statistics.median(o) / MB, statistics.median(b) / MB, med,
                     f"{len(ratios)}: " + " / ".join(f"{x:.2f}" for x in ratios),
                     verdict(med >= 0.8), mem_med))
        ours.append([n, statistics.median(o) / MB])
        bare.append([n, statistics.median(b) / MB])
    shm = []
    for n in trainers:
        p = os.path.join(out, f"warm-shm-{n}.json")
        if finished(p):
            shm.append([n, statistics.mean(per_trainer(load(p))) / MB])
    return rows, ours, bare, shm


def query_rows(out, query_dir, repeat):
    rts = []
    for r in range(1, repeat + 1):
        p = os.path.join(out, f"unary-{r}.json")
        if os.path.exists(p):
            rts.append(load(p)["p50_us"])
    res_path = os.path.join(query_dir, "results.json")
    if not rts or not os.path.exists(res_path):
        return [], rts
    rt = statistics.median(rts)
    res = load(res_path)
    fio_dir = os.path.join(query_dir, "out")

    def fio(name):
        j = load(os.path.join(fio_dir, f"fio_{name}.json"))["jobs"][0]["read"]
        return j["iops"], j["clat_ns"]["percentile"]["50.000000"] / 1e3

    # The deep and concurrent references read as many blocks as the query
    # phase they are compared with, without fio's RANDOM hint (see
    # run_query_bench.sh); results from before those jobs existed use the
    # whole-file references.
    qd, conc_n = res.get("fio_qd", 64), res.get("conc", 16)
    same = os.path.exists(os.path.join(fio_dir, f"fio_buffered_qd{qd}_nohint_same.json"))
    qd1_iops, qd1_p50 = fio("buffered_qd1")
    deep_iops, _ = fio(f"buffered_qd{qd}_nohint" + ("_same" if same else ""))
    # The daemon reads cold vectors of large calls with O_DIRECT: where fio
    # O_DIRECT on the same reads ran too, the faster of the two.
    direct_same = os.path.join(fio_dir, f"fio_direct_qd{qd}_same.json")
    deep_kind = "no hint"
    if same and os.path.exists(direct_same) and fio(f"direct_qd{qd}_same")[0] > deep_iops:
        deep_iops, deep_kind = fio(f"direct_qd{qd}_same")[0], "O_DIRECT"
    conc_iops, _ = fio(f"buffered_qd{conc_n}" + ("_nohint_same" if same else ""))
    ref = ", same reads" if same else ""
    warm = res["warm"]["single"]["p50_us"]
    cold = res["cold_single"]["single"]["p50_us"]
    batch = res["cold_batch_keep"]["batch"]["iops_4k_equiv"]
    # Pairs of the 256/call phase, each followed at once by fio on as many
    # reads (run_query_bench.sh PAIRS): the verdict is their median ratio.
    pairs = res.get("pairs") or []
    conc_pairs = res.get("conc_pairs") or []
    conc = res["cold_single_conc"]["single"]["iops_4k_equiv"]
    rows = [
        ("warm 1 vector, p50", f"{warm:.0f} us", f"unary round trip {rt:.0f} us",
         warm / rt, "<= 1.5", verdict(warm / rt <= 1.5)),
        ("cold 1 vector, p50", f"{cold:.0f} us",
         f"fio qd1 p50 {qd1_p50:.0f} + rt {rt:.0f} us", cold / (qd1_p50 + rt), "<= 1.2",
         verdict(cold / (qd1_p50 + rt) <= 1.2)),
        ("cold 256/call (--malloc-keep)", f"{batch:.0f} vec/s",
         f"fio qd{qd} {deep_kind}{ref} {deep_iops:.0f} IOPS", batch / deep_iops,
         ">= 0.8", "" if pairs else verdict(batch / deep_iops >= 0.8)),
        (f"cold 1 vector, {conc_n} threads", f"{conc:.0f} vec/s",
         f"fio qd{conc_n}{' no hint' if same else ''}{ref} {conc_iops:.0f} IOPS",
         conc / conc_iops, ">= 0.8", "" if conc_pairs else verdict(conc / conc_iops >= 0.8)),
    ]
    if conc_pairs:
        # As the 256/call pairs: each concurrent phase followed at once by
        # fio at its depth, buffered without the hint (the verdict) and
        # O_DIRECT (beside it).
        rows.append(paired_row(f"  paired: each phase then fio qd{conc_n} no hint at once, "
                               f"median of {len(conc_pairs)}", conc_pairs))
        if all(p.get("fio_direct") for p in conc_pairs):
            rows.append(paired_row(f"  the same pairs against fio qd{conc_n} O_DIRECT",
                                   conc_pairs, key="fio_direct", target=False))
    if pairs:
        # The unary bound below then uses the pairs' medians too.
        batch = statistics.median(p["shardcast"] for p in pairs)
        deep_iops = statistics.median(p["fio"] for p in pairs)
        rows.insert(3, paired_row(f"  paired: each phase then fio at once, median of {len(pairs)}",
                                  pairs))
    # What one call at a time could reach with one unary reply if the daemon
    # cost nothing beyond the bare loop: fio's time for the call's reads at
    # the same depth, then a bare unary round trip carrying the reply's bytes
    # (a unary reply cannot overlap its own reads). The client streams calls
    # this large (StreamVectors: parts leave as their reads complete), so
    # shardcast can pass it, and on the daemon's node the client library
    # uses the local channel, not gRPC, by default. Printed beside the
    # target, not instead.
    rt_batch = [load(p)["mean_us"] for p in
                (os.path.join(out, f"unary-batch-{r}.json") for r in range(1, repeat + 1))
                if os.path.exists(p)]
    if rt_batch:
        vectors = 256  # run_query_bench.sh --batch
        serial = vectors / (vectors / deep_iops + statistics.median(rt_batch) / 1e6)
        rows.insert(4 if pairs else 3, (f"  gRPC unary bound (local clients skip gRPC), one call at a time: fio's {vectors} reads, then a bare "
                     f"reply of {vectors} vectors ({statistics.median(rt_batch):.0f} us mean)",
                     f"{serial:.0f} vec/s", f"{serial / deep_iops:.2f} x fio",
                     batch / serial, "(shardcast x unary bound)", ""))
    return rows, rts


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", required=True)
    ap.add_argument("--query", required=True)
    ap.add_argument("--trainers", default="1 4 8")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--seconds", type=int, default=0)
    ap.add_argument("--json", required=True)
    ap.add_argument("--png", required=True)
    a = ap.parse_args()
    trainers = [int(x) for x in a.trainers.split()]

    cold, cold_series, fio_points = cold_rows(a.out, trainers)
    warm, ours, bare, shm = warm_rows(a.out, trainers)
    query, rts = query_rows(a.out, a.query, a.repeat)

    print()
    print("| cold shuffled stream | trainers | MB/s per trainer (mean) | fio MB/s | slowest x fio | target | | /proc io / selected | <= 1.05 |")
    print("|---|---:|---:|---:|---:|---|---|---:|---|")
    for r in cold:
        print(f"| {r[0]} | {r[1]} | {r[2]:,.0f} | {r[3]:,.0f} | {r[4]:.2f} | {r[5]} | {r[6]} | {r[7]:.3f} | {r[8]} |")
    print()
    print("| warm, gRPC messages | MB/s per trainer (median) | bare gRPC loop MB/s per client (median) | ratio (median of the runs) | runs (how many: ratios) | >= 0.8 | ratio vs bare from a 1 GiB source |")
    print("|---:|---:|---:|---:|---|---|---:|")
    for r in warm:
        print(f"| {r[0]} trainer(s) | {r[1]:,.0f} | {r[2]:,.0f} | {r[3]:.2f} | {r[4]} | {r[5]} | {'-' if r[6] is None else format(r[6], '.2f')} |")
    cpu = cpu_rows(a.out, trainers)
    if cpu:
        def ns(x):
            return "-" if x is None else f"{x:.3f}"
        print()
        print("| warm, CPU ns per byte delivered (median) | daemon | its trainers | bare loop server | its clients | bare from 1 GiB, server | its clients |")
        print("|---:|---:|---:|---:|---:|---:|---:|")
        for n, cols in cpu:
            print(f"| {n} trainer(s) | " + " | ".join(f"{ns(s)} | {ns(c)}" for s, c in cols) + " |")
    session_rts = [load(p)["p50_us"] for p in
                   (os.path.join(a.out, f"session-{r}.json") for r in range(1, a.repeat + 1))
                   if finished(p)]
    if query:
        print()
        print("| random access | shardcast | reference | ratio | target | |")
        print("|---|---:|---|---:|---|---|")
        for r in query:
            print(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]:.2f} | {r[4]} | {r[5]} |")
        print(f"bare unary round trips p50 (us): {', '.join(f'{x:.0f}' for x in rts)}")
        if session_rts:
            print("bare session round trips p50 (us, messages on one call, 4 KiB reply; "
                  "the transport of small GetVectors): "
                  f"{', '.join(f'{x:.0f}' for x in session_rts)}")
    if a.seconds:
        print(f"matrix run time: {a.seconds} s")

    figures = {"cold": cold, "warm": warm, "query": query, "unary_p50_us": rts,
               "session_p50_us": session_rts}
    with open(a.json, "w") as f:
        json.dump(figures, f, indent=1)

    fio_series = [[n, statistics.mean(v)] for n, v in sorted(fio_points.items())]
    spec = {
        "title": "shardcast vs same-run references (run_matrix.sh)",
        "panels": [
            {"title": "Cold shuffled streams", "x_label": "trainers",
             "y_label": "MB/s per trainer",
             "series": [{"name": k, "points": v} for k, v in cold_series.items()]
             + ([{"name": "fio sequential (reference)", "points": fio_series, "dashed": True}]
                if fio_series else [])},
            {"title": "Warm streams", "x_label": "trainers", "y_label": "MB/s per trainer",
             "series": [s for s in (
                 {"name": "gRPC messages", "points": ours},
                 {"name": "bare gRPC loop (reference)", "points": bare, "dashed": True},
                 {"name": "shared memory", "points": shm}) if s["points"]]},
        ],
    }
    # A run of some steps only (STEPS=warm) plots the panels it has.
    spec["panels"] = [p for p in spec["panels"] if p["series"]]
    if not spec["panels"]:
        print(f"plot: none (no streaming rows in this run); figures: {a.json}")
        return
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    try:
        import plot
        plot.write(spec, a.png)
        print(f"plot: {a.png}; figures: {a.json}")
    except Exception as e:  # the table stands without the plot
        print(f"plot not written: {e}", file=sys.stderr)


if __name__ == "__main__":
    main()
