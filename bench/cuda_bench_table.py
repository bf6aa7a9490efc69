#!/usr/bin/env python3
"""Markdown tables from kvhost_cuda_transfer_bench --json-out files (docs/PERF.md).

  bench/cuda_bench_table.py FILE.json[:path,path...] ...

Per file (optionally only the listed paths): the ceiling and the worker's
compute alone, one table per path (GB/s, ratio to the ceiling of the same
direction, worker slowdown, per direction), then duplex and time-to-first-layer
lines.
"""
import json
import sys


def table(cases, path):
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


def main():
    for arg in sys.argv[1:]:
        name, _, only = arg.partition(":")
        d = json.load(open(name))
        c = d["ceiling"]
        w = d["worker_compute"]
        cfg = d["config"]
        print(f"**{name}** — complete: {d['complete']}, MPS: {d['mps']}, "
              f"staging: {cfg.get('staging_bytes') or 'default'}, sm_blocks: "
              f"{cfg.get('sm_blocks') or 'default'}, load_gates: {cfg.get('load_gates', False)}, "
              f"tokens {cfg['tokens']}, layers {cfg['layers']}\n")
        print(f"Ceiling (pinned cudaMemcpyAsync, {c['bytes'] >> 20} MiB): D2H {c['d2h_gb_per_s']:.1f}, "
              f"H2D {c['h2d_gb_per_s']:.1f}, both at once {c['duplex_gb_per_s']:.1f} GB/s. "
              f"Worker kernel alone: {w['alone_ms_per_kernel']:.3f} ms.\n")
        paths = only.split(",") if only else list(dict.fromkeys(x["path"] for x in d["cases"]))
        for p in paths:
            print(table(d["cases"], p))
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
                print(f"- first layer {x['path']}: {x['first_layer_ms']:.3f} ms of "
                      f"{x['total_ms']:.3f} ms (target {x['target_ms']:.3f}, "
                      f"{'met' if x['met'] else 'missed'}; Load call returned at "
                      f"{x['rpc_return_ms']:.3f} ms){extra}")
        print()


if __name__ == "__main__":
    main()
