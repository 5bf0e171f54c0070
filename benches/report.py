#!/usr/bin/env python3
"""Regenerates README's benchmark tables and draws docs/iptables-figures.svg from the JSON the
benchmarks write (`BENCH_JSON=PATH cargo bench --bench sync`, `... --bench latency`,
`... --bench restart`, `... --bench ipvs_sync`; `benches/run` does them all).

Usage: benches/report.py [--readme README.md] [--svg docs/iptables-figures.svg] JSON...

Each JSON file is one benchmark's figures, named by its "bench" field. README holds each
generated block between `<!-- bench:NAME begin -->` and `<!-- bench:NAME end -->`; a block
whose JSON is not given stays as it is. Python's standard library only.
"""
import argparse
import json
import pathlib
import sys


def thousands(v, digits=0):
    return f"{v:,.{digits}f}"


def sync_block(f):
    """README's table for the `sync` benchmark (iptables mode, one family)."""
    cold_ratio = f["cold_sync_ms"] / f["floor_ms"]
    zero_ratio = f["zero_p50_ms"] / f["change_p50_ms"]
    lines = [
        f"**Programming a node**, {thousands(f['services'])} Services × {f['endpoints']} endpoints,"
        f" `sudo benches/run` ({f['iptables']}; load average {f['load_average_start']:g} at the"
        f" start, {f['load_average_end']:g} at the end: other work on the 2 cores slows every"
        " figure):",
        "",
        "| step | time | peak RSS |",
        "|---|---|---|",
        f"| full render (model → restore input) | {thousands(f['render_ms'])} ms | |",
        f"| cold full sync by the daemon's proxier, fresh namespace (median of {f['reps']})"
        f" | {thousands(f['cold_sync_ms'])} ms ({cold_ratio:.2f}× the floor)"
        f" | largest child {f['child_peak_mib']} MiB |",
        f"| periodic full re-sync on the loaded tables | {thousands(f['full_resync_ms'])} ms | |",
        f"| one endpoint change made live by a partial sync, p50 / p99 of {f['changes']}"
        f" | {thousands(f['change_p50_ms'])} ms / {thousands(f['change_p99_ms'])} ms | |",
        f"| a Service to zero endpoints or back, p50 / p99 of {f['zero_changes']}"
        f" | {thousands(f['zero_p50_ms'])} ms / {thousands(f['zero_p99_ms'])} ms"
        f" ({zero_ratio:.2f}× an endpoint change) | |",
        f"| `iptables-restore` alone on the whole input in one flush-mode run, fresh namespace"
        f" (the floor; median of {f['reps']}) | {thousands(f['floor_ms'])} ms"
        f" | {f['floor_peak_mib']} MiB |",
        "",
        "![iptables mode: cold sync, changes and peak memory](docs/iptables-figures.svg)",
    ]
    return "\n".join(lines)


def latency_block(f):
    """README's table for the `latency` benchmark (an endpoint change, end to end)."""
    lines = [
        f"**An endpoint change live, end to end**, `sudo benches/run` (`cargo bench --bench latency`):"
        f" a Service's single endpoint flipped {f['flips']} times between two real pods,"
        f" {f['spacing_ms']} ms apart, beside the other Services; from the change (the"
        " EndpointSlice written to the API server, or the manifest renamed into place) to the"
        f" first connection answered by the new pod (a connect every {f['probe_interval_us']} µs)."
        " The parts are medians, from the daemon's log: the source (its watch event, or the"
        " file re-read), the loop (to building the state), building the state, the proxier, and"
        " the rest (kernel and prober). Load average"
        f" {f['load_average_start']:g} at the start, {f['load_average_end']:g} at the end:",
        "",
        "| mode | Services × endpoints | source | p50 | p99 | target (p99) | source / loop / build / proxier / rest | first sync | load |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c in f["cases"]:
        p = c["parts_p50_ms"]
        verdict = "met" if c["p99_ms"] <= c["target_p99_ms"] else "**missed**"
        parts = " / ".join(f"{p[k]:.1f}" for k in ("source", "loop", "build", "proxier", "traffic"))
        lines.append(
            f"| {c['mode']} | {thousands(c['services'])} × {c['endpoints']} | {c['source']}"
            f" | {c['p50_ms']:.1f} ms | {c['p99_ms']:.1f} ms | ≤ {c['target_p99_ms']:g} ms: {verdict}"
            f" | {parts} ms | {c['first_sync_s']:.1f} s | {c['load_average']:g} |"
        )
    bad = sum(c["stale"] + c["errors"] for c in f["cases"])
    lines += ["", f"Connects that failed or reached the old pod after the new one answered: {bad}."]
    return "\n".join(lines)


def restart_block(f):
    """README's table for the `restart` benchmark (restarts under traffic)."""
    lines = [
        "**Restarts under traffic**, `sudo BENCHES=restart benches/run` (`cargo bench --bench"
        " restart`): the release daemon synced with the cluster below plus three Services on two"
        " real pods (first, in the middle and last of the sync order), stopped and started"
        f" again {f['restarts']} times (SIGKILL, then SIGTERM, alternately) while the client pod"
        f" opens a connection to each of the three every {f['probe_interval_us']} µs and keeps"
        " one connection open, a line echoed every 20 ms. Per restart: the time from the stop to"
        " the new daemon's first sync of every Service; the connects to the three Services from"
        f" the stop until {f['after_sync_ms']} ms after that sync, how many failed, and the"
        " longest time between two answered connects to any of them. Load average"
        f" {f['load_average_start']:g} at the start, {f['load_average_end']:g} at the end:",
        "",
        "| mode | Services × endpoints | source | restart | stop → first sync | connects | failed | longest gap | open connection |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c in f["cases"]:
        st = c["stream"]
        stream = f"{thousands(st['echoed'])} of {thousands(st['sent'])} lines echoed"
        if st["error"]:
            stream += f" ({st['error']})"
        for i, r in enumerate(c["restarts"], 1):
            connects = sum(s["connects"] for s in r["services"])
            failed = sum(s["failed"] for s in r["services"])
            gap = max(s["max_gap_ms"] for s in r["services"])
            lines.append(
                f"| {c['mode']} | {thousands(c['services'])} × {c['endpoints']} | {c['source']}"
                f" | {i} ({r['signal']}) | {r['to_first_sync_s']:.1f} s | {thousands(connects)}"
                f" | **{failed}** | {gap:.1f} ms | {stream if i == 1 else '″'} |"
            )
    failed = sum(s["failed"] for c in f["cases"] for r in c["restarts"] for s in r["services"])
    lines += ["", f"Connects that failed during a restart: {failed}."]
    return "\n".join(lines)


def ipvs_block(f):
    """README's table for the `ipvs_sync` benchmark (IPVS mode in the test VM)."""
    ratio = lambda v: f"{v / f['floor_ms']:.2f}×"
    calls = f["change_calls"]
    lines = [
        f"**IPVS mode at scale**, {thousands(f['services'])} Services × {f['endpoints']} endpoints"
        f" ({thousands(f['virtual_servers'])} virtual servers, {thousands(f['ipset_entries'])} ipset"
        " entries), `sudo BENCHES=ipvs_sync benches/run` (`cargo bench --bench ipvs_sync`), in the"
        f" test VM (kernel {f['kernel']} under qemu's TCG: no nested KVM, so every time is many"
        " times what the host would take; the ratios compare like with like). Load average"
        f" {f['load_average_start']:g} at the start, {f['load_average_end']:g} at the end:",
        "",
        "| step | time |",
        "|---|---|",
        f"| cold sync by the proxier, fresh namespace (median of {f['reps']})"
        f" | {thousands(f['cold_sync_ms'])} ms ({ratio(f['cold_sync_ms'])} the floor) |",
        f"| of which IPVS netlink calls | {thousands(f['cold_sync_netlink_ms'])} ms"
        f" ({ratio(f['cold_sync_netlink_ms'])} the floor) |",
        f"| of which `ip`, `ipset restore` and sysctls | {thousands(f['cold_sync_tools_ms'])} ms |",
        f"| rendering alone | {thousands(f['render_ms'])} ms |",
        f"| `ipvsadm --restore` of the same virtual and real servers ({thousands(f['saved_lines'])}"
        f" lines of `ipvsadm -Sn`), fresh namespace (the floor; median of {f['reps']})"
        f" | {thousands(f['floor_ms'])} ms |",
        f"| one endpoint of a Service replaced, p50 / p99 of {f['changes']}"
        f" | {thousands(f['change_p50_ms'], 1)} ms / {thousands(f['change_p99_ms'], 1)} ms |",
    ]
    if "explain_all_ms" in f:
        lines += [
            f"| `kube-proxy explain` for one Service, the cluster from manifests (median of {f['reps']})"
            f" | {thousands(f['explain_one_ms'])} ms |",
            f"| `kube-proxy explain --all` ({thousands(f['explain_all_lines'])} lines), the cluster from"
            f" manifests (median of {f['reps']}) | {thousands(f['explain_all_ms'])} ms |",
            f"| `ipvsadm -Ln` of the same namespace, for comparison | {thousands(f['ipvsadm_list_ms'])} ms |",
        ]
    lines += [
        "",
        f"IPVS calls of the {f['changes']} changes, all asserted per change (the Service's virtual"
        " servers only): " + ", ".join(f"`{k}` {v}" for k, v in calls.items()) + "; nothing else.",
    ]
    return "\n".join(lines)


BLOCKS = {
    "sync": sync_block,
    "latency": latency_block,
    "restart": restart_block,
    "ipvs_sync": ipvs_block,
}


def replace_block(text, name, body):
    begin, end = f"<!-- bench:{name} begin -->", f"<!-- bench:{name} end -->"
    try:
        start = text.index(begin) + len(begin)
        stop = text.index(end, start)
    except ValueError:
        sys.exit(f"README has no {begin} … {end} block")
    return text[:start] + "\n" + body + "\n" + text[stop:]


def bar_panel(x0, title, unit, bars):
    """One panel of the SVG: `bars` is [(label, value, colour)], scaled to the largest."""
    width, height, top = 260, 170, 40
    top_value = max(v for _, v, _ in bars) or 1
    out = [
        f'<text x="{x0 + width / 2}" y="20" text-anchor="middle" font-size="13">{title}</text>',
        f'<line x1="{x0 + 30}" y1="{top + height}" x2="{x0 + width}" y2="{top + height}" stroke="#333"/>',
        f'<text x="{x0 + 8}" y="{top + height / 2}" font-size="10" '
        f'transform="rotate(-90 {x0 + 8} {top + height / 2})" text-anchor="middle">{unit}</text>',
    ]
    slot = (width - 40) / len(bars)
    for i, (label, value, colour) in enumerate(bars):
        h = height * value / top_value
        x = x0 + 40 + i * slot
        out.append(
            f'<rect x="{x:.1f}" y="{top + height - h:.1f}" width="{slot * 0.7:.1f}" height="{h:.1f}" fill="{colour}"/>'
        )
        out.append(
            f'<text x="{x + slot * 0.35:.1f}" y="{top + height - h - 4:.1f}" font-size="10" '
            f'text-anchor="middle">{value:,.0f}</text>'
        )
        out.append(
            f'<text x="{x + slot * 0.35:.1f}" y="{top + height + 14}" font-size="10" '
            f'text-anchor="middle">{label}</text>'
        )
    return out


def sync_svg(f):
    ours, tool = "#3b7dd8", "#999999"
    panels = [
        ("full sync", "s", [
            ("cold", f["cold_sync_ms"] / 1000, ours),
            ("re-sync", f["full_resync_ms"] / 1000, ours),
            ("floor", f["floor_ms"] / 1000, tool),
        ]),
        ("changes (p50 / p99)", "ms", [
            ("ep p50", f["change_p50_ms"], ours),
            ("ep p99", f["change_p99_ms"], ours),
            ("zero p50", f["zero_p50_ms"], ours),
            ("zero p99", f["zero_p99_ms"], ours),
        ]),
        ("peak RSS of a child", "MiB", [
            ("ours", f["child_peak_mib"], ours),
            ("floor", f["floor_peak_mib"], tool),
        ]),
    ]
    body = []
    for i, (title, unit, bars) in enumerate(panels):
        body += bar_panel(10 + i * 280, title, unit, bars)
    caption = (
        f"iptables mode, {f['services']:,} Services × {f['endpoints']} endpoints"
        f" (benches/run; grey: iptables-restore alone)"
    )
    body.append(f'<text x="430" y="250" text-anchor="middle" font-size="11">{caption}</text>')
    return (
        '<svg xmlns="http://www.w3.org/2000/svg" width="860" height="262" '
        'font-family="sans-serif">\n<rect width="860" height="262" fill="white"/>\n'
        + "\n".join(body)
        + "\n</svg>\n"
    )


def main():
    args = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args.add_argument("--readme", default="README.md")
    args.add_argument("--svg", default="docs/iptables-figures.svg")
    args.add_argument("json", nargs="+")
    opts = args.parse_args()
    readme = pathlib.Path(opts.readme)
    text = readme.read_text()
    for path in opts.json:
        figures = json.loads(pathlib.Path(path).read_text())
        name = figures.get("bench")
        if name not in BLOCKS:
            sys.exit(f"{path}: no README block for bench {name!r}")
        text = replace_block(text, name, BLOCKS[name](figures))
        if name == "sync":
            pathlib.Path(opts.svg).write_text(sync_svg(figures))
    readme.write_text(text)


if __name__ == "__main__":
    main()
