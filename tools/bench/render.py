"""Rendering of a ``kvbridge bench`` report: the table, markdown, per-path details, a plot.

Owns: how a report (:func:`.suite.run_suite`'s dict, or one saved with
``--json``) is shown: :func:`format_table`, :func:`format_markdown` (the
README's table) and :func:`slim_report` (what it reads), each path's own
detail table (:func:`format_details`) and :func:`plot` (matplotlib, imported
when called). Pure: reads the report, returns text or writes the one image
file asked for. May not touch: running a path, the report's contents, the
exit code (:func:`.suite.suite_ok`).
"""

from __future__ import annotations

import json
from typing import Any

from kvbridge.tools.bench.rows import size_label


def _num(value: float | None) -> str:
    if value is None:
        return "-"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:.3f}" if abs(value) < 10 else f"{value:.2f}"


def format_table(report: dict[str, Any]) -> str:
    head = ("path", "case", "op", "unit", "kvbridge", "raw", "ratio", "limit", "vs", "ok")
    lines_rows = [head]
    for r in report["rows"]:
        lines_rows.append((r["path"], r["case"], r["op"], r["unit"], _num(r["kvbridge"]),
                           _num(r["raw"]), f"{r['ratio']:.2f}", _num(r["limit"]),
                           r["raw_name"], "yes" if r["verified"] else "NO"))
    widths = [max(len(str(x[i])) for x in lines_rows) for i in range(len(head))]
    numeric = {4, 5, 6, 7}
    lines = ["  ".join(str(c).rjust(w) if i in numeric else str(c).ljust(w)
                       for i, (c, w) in enumerate(zip(x, widths, strict=True))).rstrip()
             for x in lines_rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    for name, entry in report["paths"].items():
        if entry["status"] != "ok":
            lines.append(f"{name}: {entry['status']}: {entry['reason']}")
        elif entry.get("note"):  # e.g. which rows a path could not measure here, and why
            lines.append(f"{name}: {entry['note']}")
    lines.append("ratio = kvbridge / raw (latency rows: raw / kvbridge); limit = memory copy of "
                 "the same bytes, in the row's unit; every number from this run")
    return "\n".join(lines)


def format_markdown(report: dict[str, Any]) -> str:
    """The suite's table as markdown, headed by the machine and the date it ran on (the
    README's performance table is this, rendered from a saved ``--json`` report)."""
    machine = report.get("machine", {})
    lines = [f"Measured {str(machine.get('time', '?'))[:10]} on {machine.get('cpus', '?')} CPUs, "
             f"{machine.get('platform', '?')}, Python {machine.get('python', '?')}"
             + (" (`--quick`: smoke sizes)" if report.get("quick") else "") + ":", "",
             "| path | case | op | unit | kvbridge | raw | ratio | limit | raw is |",
             "| --- | --- | --- | --- | ---: | ---: | ---: | ---: | --- |"]
    for r in report["rows"]:
        lines.append(f"| {r['path']} | {r['case']} | {r['op']} | {r['unit']} | "
                     f"{_num(r['kvbridge'])} | {_num(r['raw'])} | {r['ratio']:.2f} | "
                     f"{_num(r['limit'])} | {r['raw_name']}"
                     + ("" if r["verified"] else " (NOT verified)") + " |")
    for name, entry in report["paths"].items():
        if entry["status"] != "ok":
            lines.append(f"\n{name}: {entry['status']}: {entry.get('reason', '')}")
    return "\n".join(lines)


def slim_report(report: dict[str, Any]) -> dict[str, Any]:
    """What :func:`format_markdown` reads: the machine, each path's status, the rows."""
    return {"machine": report.get("machine", {}), "quick": report.get("quick", False),
            "paths": {name: {key: entry[key] for key in ("status", "reason") if key in entry}
                      for name, entry in report["paths"].items()},
            "rows": report["rows"]}


def format_nixl_detail(detail: dict[str, Any]) -> str:
    """The nixl path's own columns (raw READ into a fresh buffer and into the KV cache)."""
    head = (f"{'pattern':>16} {'raw NIXL':>9} {'raw->KV':>9} {'raw lanes':>9} {'kvbridge':>9} "
            f"{'torch cp':>9} {'kvb/raw':>8} {'paired':>6} {'kvb/rawKV':>9} {'kvb/rawL':>8} "
            f"{'raw/mcpy':>9} {'kvb/mcpy':>8} {'descs':>6} {'runs':>5}"
            f"  (GB/s, READ)")
    lines = [head]
    for p in detail["patterns"]:
        label = f"{p['num_blocks']}x{size_label(p['block_bytes'])}"
        lines.append(f"{label:>16} {p['raw_nixl_gbps']:9.3f} "
                     f"{p['raw_nixl_into_kv_cache_gbps']:9.3f} "
                     f"{p.get('raw_nixl_lanes_gbps', 0.0):9.3f} {p['kvbridge_gbps']:9.3f} "
                     f"{p['torch_copy_gbps']:9.3f} {p['kvbridge_over_raw']:8.3f} "
                     f"{p.get('kvbridge_over_raw_paired', 0.0):6.3f} "
                     f"{p['kvbridge_over_raw_same_destination']:9.3f} "
                     f"{p.get('kvbridge_over_raw_lanes', 0.0):8.3f} "
                     f"{p['raw_over_memcpy']:9.3f} {p.get('kvbridge_over_memcpy', 0.0):8.3f} "
                     f"{p.get('kvbridge_descriptors', 0):6d} "
                     f"{p.get('kvbridge_descriptor_runs', 0):5d}")
    lanes = {p.get("lanes") for p in detail["patterns"]}
    lines.append(f"block order: {detail.get('block_order', 'sorted')}; raw NIXL: its defaults "
                 f"(one agent); raw lanes: raw NIXL with kvbridge's setting ({lanes.pop()} "
                 f"agents reading parts at once); paired: median of the per-iteration kvb/raw "
                 f"ratios; runs: the descriptors NIXL merged the connector's into")
    lines.append("")
    lines.append(f"{'pattern':>16} {'verify off':>10} {'sample':>9} {'full':>9} "
                 f"{'sample/off':>10} {'full/off':>9} {'checked':>8} {'check':>8} {'take':>8}"
                 f"  (GB/s, READ; */off: paired)")
    for p in detail["patterns"]:
        if "verify_full_over_off" not in p:
            continue
        label = f"{p['num_blocks']}x{size_label(p['block_bytes'])}"
        lines.append(f"{label:>16} {p['kvbridge_verify_off_gbps']:10.3f} "
                     f"{p['kvbridge_gbps']:9.3f} {p['kvbridge_verify_full_gbps']:9.3f} "
                     f"{p['verify_sample_over_off']:10.3f} {p['verify_full_over_off']:9.3f} "
                     f"{p['blocks_verified']:8d} {_num(p['consumer_digest_gbps']):>8} "
                     f"{_num(p['producer_digest_gbps']):>8}")
    lines.append("sample: the default (the kvbridge column above); checked: blocks the "
                 "consumer verified; check / take: digest GB/s on the consumer / the producer "
                 "(its digests are taken as a hold starts)")
    return "\n".join(lines)


def format_cost_detail(detail: dict[str, Any]) -> str:
    """The nixl-cost path: per pattern and op, GB/s and one-descriptor µs of each way."""
    lines = [f"{'pattern':>22} {'op':>5} {'reused':>8} {'per req':>8} {'kvbridge':>8} "
             f"{'kvb/req':>7} {'kvb/reu':>7} {'1d reused':>9} {'1d perreq':>9} "
             f"{'1d kvb':>7} {'1d +kvb':>7} {'make us':>8} {'descs':>7} {'desc B':>7}"]
    for p in detail["patterns"]:
        for op, o in p["ops"].items():
            g, us = o["gbps"], o["one_desc_us"]
            lines.append(f"{p['pattern']:>22} {op:>5} {g['raw_reused_handle']:8.3f} "
                         f"{g['raw_per_request']:8.3f} {g['kvbridge']:8.3f} "
                         f"{o['kvbridge_over_raw_per_request']:7.3f} "
                         f"{o['kvbridge_over_raw_reused_handle']:7.3f} "
                         f"{us['raw_reused_handle']:9.2f} {us['raw_per_request']:9.2f} "
                         f"{us['kvbridge']:7.2f} {o['kvbridge_one_desc_excess_us']:7.2f} "
                         f"{o['raw_make_release_us']:8.1f} "
                         f"{p['num_descs']:7d} {p['desc_bytes']:7d}")
    lines.append("GB/s of raw NIXL re-posting one handle (reused), raw NIXL making and "
                 "releasing a handle per transfer (per req, what a request does) and kvbridge; "
                 "kvb/*: paired medians; 1d: µs of a one-descriptor transfer, +kvb: kvbridge's "
                 "paired excess over per req; make us: NIXL making and releasing the "
                 "pattern's handle (what a reused handle skips); torch copy: "
                 + ", ".join(f"{p['pattern']} {p['torch_copy_gbps']:.3f}"
                             for p in detail["patterns"]) + " GB/s")
    return "\n".join(lines)


def format_scale_detail(detail: dict[str, Any]) -> str:
    """Per step: ms and peak MiB of each side (and of per-block lists if they ran)."""
    lines = []
    for rep in detail["scale"]:
        sides = [k for k in ("kvbridge", "raw_nixl", "kvbridge_per_block") if k in rep]
        lines.append(f"{rep['num_layers']} layers x {rep['num_blocks']} blocks x "
                     f"{rep['block_bytes']} B per rank; first transfer: "
                     f"{rep['request_blocks']} blocks of every layer")
        lines.append(f"{'step':>16} " + " ".join(f"{s + ' ms':>22} {'peak MiB':>9}"
                                                 for s in sides))
        for step in ("register", "handshake_doc", "prepare_lists", "first_transfer"):
            cells = []
            for side in sides:
                peak = rep[side]["peak_mib"][step]
                cells.append(f"{rep[side]['ms'][step]:22.2f} "
                             f"{'-' if peak is None else f'{peak:.1f}':>9}")
            lines.append(f"{step:>16} " + " ".join(cells))
        for side in sides:
            extra = ""
            if "list_rows" in rep[side]:
                extra = (f", {rep[side]['list_rows']} list rows for "
                         f"{rep[side]['descriptors']} descriptors, handshake document "
                         f"{rep[side]['handshake_doc_bytes']} B")
            lines.append(f"{side}: agent metadata {rep[side]['agent_metadata_bytes']} B{extra}; "
                         f"verified {rep[side]['verified']}")
    lines.append("peak MiB: resident memory above the step's start (VmHWM), NIXL's own "
                 "allocations included")
    return "\n".join(lines)



def format_offload_verify(details: list[dict[str, Any]]) -> str:
    """The offload path's verification table: each path's GB/s per verify mode, over off."""
    lines = [f"{'pattern':>16} {'path':<10} {'off':>8} {'sample':>8} {'full':>8} "
             f"{'sample/off':>10} {'full/off':>9}  (GB/s; lookup: us per block checked)"]
    for d in details:
        v = d.get("verify")
        if not isinstance(v, dict):
            continue
        label = f"{v['num_blocks']}x{size_label(v['block_bytes'])}"
        for path in ("fs_store", "fs_load", "cpu_store", "cpu_load"):
            g, r = v["gbps"], v["ratio_of_off"]
            lines.append(f"{label:>16} {path:<10} {g['off'][path]:8.3f} {g['sample'][path]:8.3f}"
                         f" {g['full'][path]:8.3f} {r['sample'][path]:10.3f} "
                         f"{r['full'][path]:9.3f}")
        us = v["cpu_lookup_us_per_block"]
        lines.append(f"{label:>16} {'lookup':<10} {us['off']:8.2f} {us['sample']:8.2f} "
                     f"{us['full']:8.2f}")
    lines.append(f"fs I/O: {details[0]['verify']['io_mode'] if details else '-'}; "
                 f"{details[0]['verify']['num_layers'] if details else '-'} layer digests per "
                 f"block; lookup: scheduler-thread time of a CPU-tier lookup that checks slots")
    return "\n".join(lines)


def format_details(report: dict[str, Any]) -> str | None:
    """A path's own table after the suite's, when exactly one path ran (or None)."""
    if len(report["paths"]) != 1:
        return None
    name, entry = next(iter(report["paths"].items()))
    detail = entry.get("detail")
    if entry["status"] == "ok" and name == "offload" and isinstance(detail, list):
        return format_offload_verify(detail)
    if entry["status"] != "ok" or not isinstance(detail, dict):
        return None
    if name == "nixl":
        return format_nixl_detail(detail)
    if name == "nixl-scale":
        return format_scale_detail(detail)
    if name == "nixl-cost":
        return format_cost_detail(detail)
    if name == "mooncake":
        from kvbridge.tools.bench.mooncake import format_report

        return str(format_report(detail))
    return None


def plot(report: dict[str, Any], path: str) -> None:
    """Throughput (GB/s) against block size, one line per path and op; raw dashed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError("--plot needs matplotlib: pip install 'kvbridge[plot]' "
                          "(or pip install matplotlib)") from None
    series: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in report["rows"]:
        if r["unit"] == "GB/s" and r["block_bytes"]:
            series.setdefault((r["path"], r["op"]), []).append(r)
    fig, ax = plt.subplots(figsize=(8, 5))
    limit_points: dict[int, float] = {}
    for (name, op), rows in sorted(series.items()):
        rows = sorted(rows, key=lambda x: x["block_bytes"])
        xs = [x["block_bytes"] for x in rows]
        line = ax.plot(xs, [x["kvbridge"] for x in rows], marker="o",
                       label=f"{name} {op} (kvbridge)")[0]
        ax.plot(xs, [x["raw"] for x in rows], marker="x", linestyle="--",
                color=line.get_color(), label=f"{name} {op} ({rows[0]['raw_name']})")
        for x in rows:
            if x["limit"] is not None:
                limit_points[x["block_bytes"]] = max(limit_points.get(x["block_bytes"], 0.0),
                                                     x["limit"])
    if limit_points:
        xs = sorted(limit_points)
        ax.plot(xs, [limit_points[x] for x in xs], linestyle=":", color="black",
                label="memcpy (same bytes)")
    ax.set_xscale("log", base=2)
    sizes = sorted({x["block_bytes"] for rows in series.values() for x in rows})
    if sizes:
        ax.set_xticks(sizes, [size_label(n) for n in sizes])
    ax.set_xlabel("block size (bytes)")
    ax.set_ylabel("GB/s")
    ax.set_title("kvbridge vs raw library, same bytes, same run")
    ax.grid(True, which="both", alpha=0.3)
    if series:
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_json(payload: Any, dest: str) -> None:
    """A bench's ``--json [FILE]``: the report to ``dest``, or to stdout for ``-``."""
    text = json.dumps(payload, indent=2)
    if dest == "-":
        print(text)  # noqa: T201 (the report is the command's output)
        return
    with open(dest, "w") as fh:
        fh.write(text + "\n")
