#!/usr/bin/env python3
"""Markdown tables from kvhost_cuda_transfer_bench --json-out files (docs/PERF.md).

  bench/cuda_bench_table.py FILE.json[:path,path...] ...

Per file (optionally only the listed paths): the ceiling and the workers'
compute alone, then

- schema 2 (issue 15 on): the headline table (per case the best path within
  the GEMM bounds, next to auto and the in-process anchor), the anchor table,
  one table per path (GB/s, ratio, mean host run, each worker's cost at each
  duty cycle, per direction);
- older files: one table per path (GB/s, ratio, FMA worker slowdown);

then duplex and time-to-first-layer lines.
"""
import json
import sys


def pct(x):
    return "—" if x is None else f"{x:+.1f} %"


def cost(costs, worker, duty):
    for c in costs:
        if c["worker"] == worker and abs(c["duty"] - duty) < 1e-9:
            return c["cost_pct"]
    return None


def old_table(cases, path):
    rows = {}
    for c in cases:
        if c["path"] != path:
            continue
        key = (c["kind"], c["layout"], c["page_size"])
        rows.setdefault(key, {})[c["direction"]] = c
    out = [f"| {path} | page | backup GB/s (ratio, worker) | load GB/s (ratio, worker) | ticket path |",
           "|---|---|---|---|---|"]
    for (kind, layout, ps), d in rows.items():
        cells = []
        for direction in ("backup", "load"):
            c = d.get(direction)
            cells.append("—" if c is None else
                         f"{c['engine_gb_per_s']:.1f} ({c['vs_ceiling']:.2f}, "
                         f"{c['worker_slowdown_pct']:+.1f} %)")
        paths = sorted({c["ticket_path"] for c in d.values()})
        out.append(f"| {kind} {layout} | {ps} | {cells[0]} | {cells[1]} | {', '.join(paths)} |")
    return "\n".join(out)


def path_table(d, path):
    workers = d["config"]["workers"]
    duties = [float(x) for x in d["config"]["duties"]]
    cols = [f"{w} @{x:g}" for w in workers for x in duties]
    out = [f"| {path} | page | dir | GB/s | ratio | host run | " + " | ".join(cols) + " | ticket path |",
           "|---|---|---|---|---|---|" + "---|" * len(cols) + "---|"]
    for c in d["cases"]:
        if c["path"] != path:
            continue
        cells = [pct(cost(c["costs"], w, x)) for w in workers for x in duties]
        slow = " (slow)" if c.get("slow") else ""
        out.append(f"| {c['kind']} {c['layout']} | {c['page_size']} | {c['direction']} | "
                   f"{c['engine_gb_per_s']:.1f} | {c['vs_ceiling']:.2f} | {c['host_run_pages']:.1f} | "
                   + " | ".join(cells) + f" | {c['ticket_path']}{slow} |")
    return "\n".join(out)


def anchor_table(d):
    workers = d["config"]["workers"]
    duties = [float(x) for x in d["config"]["duties"]]
    cols = [f"{w} @{x:g}" for w in workers for x in duties]
    out = ["| anchor (in-process, LAYER_FIRST page 1) | quota | dir | GB/s | ratio | " +
           " | ".join(cols) + " |",
           "|---|---|---|---|---|" + "---|" * len(cols)]
    for a in d["anchor"]:
        cells = [pct(cost(a["costs"], w, x)) for w in workers for x in duties]
        out.append(f"| {a['kind']} | {a['quota']} | {a['direction']} | {a['gb_per_s']:.1f} | "
                   f"{a['vs_ceiling']:.2f} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def headline_table(d, paths):
    quotas = d["config"]["anchor_quotas"]
    rows = d["headline"]
    if not rows:
        return ""
    w = rows[0]["worker"]
    out = [f"| case | page | dir | best path | GB/s | ratio | {w} @0.25 | {w} @1 | auto | " +
           " | ".join(f"anchor q{q} GB/s ({w} @0.25 / @1)" for q in quotas) + " |",
           "|---|---|---|---|---|---|---|---|---|" + "---|" * len(quotas)]
    for h in rows:
        if h["best_path"] not in paths:
            continue
        anchors = {a["quota"]: a for a in h["anchor"]}
        cells = []
        for q in quotas:
            a = anchors.get(q)
            cells.append("—" if a is None else
                         f"{a['gb_per_s']:.1f} ({pct(cost(a['costs'], w, 0.25))} / "
                         f"{pct(cost(a['costs'], w, 1))})")
        best = h["best_path"] + ("" if h["within_bounds"] else " (over bounds)")
        auto = (f"{h['auto_gb_per_s']:.1f} {h['auto_ticket_path']}" if "auto_gb_per_s" in h
                else "—")
        out.append(f"| {h['kind']} {h['layout']} | {h['page_size']} | {h['direction']} | {best} | "
                   f"{h['gb_per_s']:.1f} | {h['vs_ceiling']:.2f} | "
                   f"{pct(cost(h['costs'], w, 0.25))} | {pct(cost(h['costs'], w, 1))} | {auto} | "
                   + " | ".join(cells) + " |")
    return "\n".join(out)


def main():
    for arg in sys.argv[1:]:
        name, _, only = arg.partition(":")
        d = json.load(open(name))
        c = d["ceiling"]
        cfg = d["config"]
        new = d.get("schema", 1) >= 2
        extra = (f", workers {','.join(cfg['workers'])}, host slots {cfg['host_slots']}"
                 if new else "")
        # Files from before the gated-load mode was removed (docs/PERF.md, run S)
        # say whether it was on; later ones have no such field.
        gates = f", load_gates: {cfg['load_gates']}" if "load_gates" in cfg else ""
        print(f"**{name}** — complete: {d['complete']}, MPS: {d['mps']}, "
              f"staging: {cfg.get('staging_bytes') or 'default'}, sm_blocks: "
              f"{cfg.get('sm_blocks') or 'default'}{gates}, "
              f"tokens {cfg['tokens']}, layers {cfg['layers']}{extra}\n")
        if new:
            alone = "; ".join(f"{w['name']} {w['alone_ms']:.3f} ms alone "
                              f"(end {w['alone_end_ms']:.3f}, drift {w['drift_pct']:+.2f} %)"
                              for w in d["workers"])
        else:
            alone = f"Worker kernel alone: {d['worker_compute']['alone_ms_per_kernel']:.3f} ms"
        print(f"Ceiling (pinned cudaMemcpyAsync, {c['bytes'] >> 20} MiB): D2H {c['d2h_gb_per_s']:.1f}, "
              f"H2D {c['h2d_gb_per_s']:.1f}, both at once {c['duplex_gb_per_s']:.1f} GB/s. "
              f"{alone}.\n")
        paths = only.split(",") if only else list(dict.fromkeys(x["path"] for x in d["cases"]))
        if new:
            for table in (headline_table(d, paths), anchor_table(d) if d["anchor"] else ""):
                if table:
                    print(table)
                    print()
        for p in paths:
            print(path_table(d, p) if new else old_table(d["cases"], p))
            print()
        for x in d.get("duplex", []):
            if x["path"] in paths:
                print(f"- duplex {x['path']}: {x['aggregate_gb_per_s']:.1f} GB/s "
                      f"(backup {x['backup_gb_per_s']:.1f} + load {x['load_gb_per_s']:.1f}), "
                      f"{x['vs_one_direction']:.2f}x one direction, "
                      f"{x['vs_duplex_ceiling']:.2f} of the duplex ceiling")
        for x in d.get("ttfl", []):
            if x["path"] in paths:
                extra = ""
                if "daemon_first_layer_ms" in x:
                    extra = (f"; daemon side first {x['daemon_first_layer_ms']:.3f} of "
                             f"{x['daemon_total_ms']:.3f} ms, queued in {x['enqueue_ms']:.3f} ms")
                page = f" page {x['page_size']}" if new else ""
                call = x.get("call", "Load")
                if "fast_path" in x:
                    call += f" ({x['layout']}, {'fast path' if x['fast_path'] else 'gRPC'})"
                print(f"- first layer {x['path']}{page}: "
                      f"{x['first_layer_ms']:.3f} ms of "
                      f"{x['total_ms']:.3f} ms (target {x['target_ms']:.3f}, "
                      f"{'met' if x['met'] else 'missed'}; {call} call returned at "
                      f"{x['rpc_return_ms']:.3f} ms){extra}")
        for x in d.get("cache_cases", []):
            costs = ", ".join(f"{k['worker']} @{k['duty']:g} {k['cost_pct']:+.1f} %"
                              for k in x["costs"])
            print(f"- node cache {x['path']} {x['layout']} page {x['page_size']} "
                  f"{x['direction']}: {x['engine_gb_per_s']:.1f} GB/s "
                  f"({x['vs_ceiling']:.2f} of the ceiling); {costs}")
        print()


if __name__ == "__main__":
    main()
