#!/usr/bin/env python3
"""Draws the soak's samples (docs/bench/soak-MODE.json, written by `cargo bench --bench soak`)
as docs/soak-MODE.svg: sync latency (each IPv4 sync's elapsedMs, and each drift check's tick:
a change until the kernel showed it), the daemon's RSS, and its CPU (and its children's) over
time, with the drift checks marked. Plain SVG from the standard library (no matplotlib here).

With `--readme README.md` it also rewrites README's soak section (between the
`<!-- bench:soak begin -->` and `<!-- bench:soak end -->` lines) from the same JSON: no figure
there is copied by hand. `--svg-dir DIR` writes the plots elsewhere (the test that checks them).

Usage: python3 benches/soak_plot.py [--readme README.md] [--svg-dir DIR] docs/bench/soak-MODE.json ...
"""
import json
import math
import pathlib
import sys

W, PANEL_H, LEFT, RIGHT, TOP, GAP = 900, 170, 70, 20, 50, 45


def esc(s):
    return str(s).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def nice_max(v):
    if v <= 0:
        return 1.0
    mag = 10 ** math.floor(math.log10(v))
    for m in (1, 2, 2.5, 5, 10):
        if v <= m * mag:
            return m * mag
    return 10 * mag


def panel(out, y0, title, unit, series, t_max, log=False):
    """series: [(label, colour, [(t, v)], 'line'|'dots')]"""
    values = [v for _, _, pts, _ in series for _, v in pts]
    v_max = nice_max(max(values) if values else 1.0)
    v_min = 0.0
    if log:
        v_min = 10 ** math.floor(math.log10(max(min([v for v in values if v > 0] or [1]), 1e-3)))
        v_max = 10 ** math.ceil(math.log10(max(values or [1])))

    def x(t):
        return LEFT + (W - LEFT - RIGHT) * t / max(t_max, 1e-9)

    def y(v):
        if log:
            v = max(v, v_min)
            f = (math.log10(v) - math.log10(v_min)) / max(math.log10(v_max) - math.log10(v_min), 1e-9)
        else:
            f = (v - v_min) / (v_max - v_min)
        return y0 + PANEL_H * (1 - f)

    out.append(f'<text x="{LEFT}" y="{y0 - 8}" font-size="13" font-weight="bold">{esc(title)}</text>')
    out.append(f'<rect x="{LEFT}" y="{y0}" width="{W - LEFT - RIGHT}" height="{PANEL_H}" fill="none" stroke="#999"/>')
    ticks = []
    if log:
        e = math.log10(v_min)
        while e <= math.log10(v_max) + 1e-9:
            ticks.append(10 ** e)
            e += 1
    else:
        ticks = [v_max * i / 4 for i in range(5)]
    for v in ticks:
        out.append(f'<line x1="{LEFT}" x2="{W - RIGHT}" y1="{y(v):.1f}" y2="{y(v):.1f}" stroke="#eee"/>')
        out.append(f'<text x="{LEFT - 5}" y="{y(v) + 4:.1f}" font-size="10" text-anchor="end">{v:g}</text>')
    out.append(
        f'<text x="15" y="{y0 + PANEL_H / 2}" font-size="11" transform="rotate(-90 15 {y0 + PANEL_H / 2})" '
        f'text-anchor="middle">{esc(unit)}</text>'
    )
    lx = LEFT + 10
    for label, colour, pts, style in series:
        if style == "line" and pts:
            d = " ".join(f"{x(t):.1f},{y(v):.1f}" for t, v in pts)
            out.append(f'<polyline points="{d}" fill="none" stroke="{colour}" stroke-width="1.2"/>')
        else:
            for t, v in pts:
                out.append(f'<circle cx="{x(t):.1f}" cy="{y(v):.1f}" r="1.6" fill="{colour}"/>')
        out.append(f'<rect x="{lx}" y="{y0 + 6}" width="10" height="10" fill="{colour}"/>')
        out.append(f'<text x="{lx + 14}" y="{y0 + 15}" font-size="11">{esc(label)}</text>')
        lx += 16 + 7 * len(label) + 20
    return x


def plot(path, svg_dir):
    r = json.loads(pathlib.Path(path).read_text())
    c, f = r["config"], r["figures"]
    syncs, samples, checks = r["syncs"], r["samples"], r["drift_checks"]
    t_max = max([s["t"] for s in samples] + [s["t"] for s in syncs] + [1.0])
    cpu = []
    for a, b in zip(samples, samples[1:]):
        dt = b["t"] - a["t"]
        if dt > 0:
            cpu.append((b["t"], 100 * (b["cpu_s"] - a["cpu_s"]) / dt, 100 * (b["children_cpu_s"] - a["children_cpu_s"]) / dt))
    height = TOP + 3 * (PANEL_H + GAP) + 30
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{height}" font-family="sans-serif">',
        f'<rect width="{W}" height="{height}" fill="white"/>',
        f'<text x="{LEFT}" y="22" font-size="15" font-weight="bold">Soak, {esc(c["mode"])} mode: '
        f'{c["services"]:,} Services x {c["endpoints"]} endpoints, {f["changes"]:,} changes in {t_max / 60:.0f} min</text>',
        f'<text x="{LEFT}" y="38" font-size="11">stable connects failed {r["stable"]["failed"]} of {r["stable"]["connects"]:,}; '
        f'drift {f["drift_differences"]} in {f["drift_checks"]} checks; landings on endpoints not ready {f["live_violations"]}; '
        f'RSS growth after warm-up {f["rss_growth_pct"] if f["rss_growth_pct"] is None else round(f["rss_growth_pct"], 2)} %</text>',
    ]
    y0 = TOP + 20
    x = panel(
        out, y0, "Sync latency (log scale)", "ms",
        [
            ("IPv4 sync elapsedMs", "#1f77b4", [(s["t"], max(s["elapsed_ms"], 0.01)) for s in syncs], "dots"),
            ("change -> in kernel (drift-check tick)", "#d62728", [(d["t"], d["tick_latency_ms"]) for d in checks], "dots"),
        ],
        t_max, log=True,
    )
    y0 += PANEL_H + GAP
    panel(out, y0, "Daemon RSS", "MiB", [("VmRSS", "#2ca02c", [(s["t"], s["rss_kib"] / 1024) for s in samples], "line")], t_max)
    y0 += PANEL_H + GAP
    panel(
        out, y0, "CPU", "% of one core",
        [
            ("daemon", "#9467bd", [(t, a) for t, a, _ in cpu], "line"),
            ("its children (iptables-restore, nft)", "#ff7f0e", [(t, b) for t, _, b in cpu], "line"),
        ],
        t_max,
    )
    for d in checks:
        colour = "#2ca02c" if d["differences"] == 0 else "#d62728"
        out.append(f'<line x1="{x(d["t"]):.1f}" x2="{x(d["t"]):.1f}" y1="{y0 + PANEL_H}" y2="{y0 + PANEL_H + 5}" stroke="{colour}"/>')
    step = nice_max(t_max / 60 / 8) if t_max > 120 else None
    if step:
        m = 0.0
        while m * 60 <= t_max:
            out.append(f'<text x="{x(m * 60):.1f}" y="{y0 + PANEL_H + 18}" font-size="10" text-anchor="middle">{m:g}</text>')
            m += step
        out.append(f'<text x="{W / 2}" y="{y0 + PANEL_H + 32}" font-size="11" text-anchor="middle">minutes since the daemon started (ticks under the CPU panel: drift checks, green = 0 differences)</text>')
    else:
        for s in range(0, int(t_max) + 1, max(int(t_max) // 8, 1)):
            out.append(f'<text x="{x(s):.1f}" y="{y0 + PANEL_H + 18}" font-size="10" text-anchor="middle">{s}</text>')
        out.append(f'<text x="{W / 2}" y="{y0 + PANEL_H + 32}" font-size="11" text-anchor="middle">seconds since the daemon started</text>')
    out.append("</svg>")
    dest = pathlib.Path(svg_dir) / f"soak-{c['mode']}.svg"
    dest.write_text("\n".join(out) + "\n")
    print(f"{dest} drawn from {path}")


def row(r):
    c, f, st, lv = r["config"], r["figures"], r["stable"], r["live"]
    growth = "n/a" if f["rss_growth_pct"] is None else f"{f['rss_growth_pct']:+.2f} %"
    minutes = (f["churn_s"] + sum(d["check_s"] for d in r["drift_checks"])) / 60
    return (
        f"| {c['mode']} | {c['services']:,} × {c['endpoints']} | {minutes:.0f} min | "
        f"{f['changes']:,} ({f['rate_churning']:.1f}/s churning, {f['rate_overall']:.1f}/s overall) | "
        f"{f['syncs']:,} ({f['full_syncs']} full) | {f['sync_p50_ms']:,.0f} / {f['sync_p99_ms']:,.0f} ms | "
        f"{f['tick_latency_p50_ms']:,.0f} / {f['tick_latency_max_ms']:,.0f} ms | "
        f"{f['drift_checks']} / **{f['drift_differences']}** | **{st['failed']}** of {st['connects']:,} | "
        f"**{lv['violations']}** of {lv['landed']:,} ({lv['refused']:,} refused) | "
        f"{live_apply(f, lv)} | "
        f"{f['rss_start_mib']:.1f} → {f['rss_end_mib']:.1f} MiB (**{growth}**), peak {f['rss_peak_mib']:.1f} | "
        f"{f['cpu_mean_pct']:.0f} % + {f['children_cpu_mean_pct']:.0f} % | {r['load_start']} → {r['load_end']} |"
    )


def live_apply(f, lv):
    """The live Services' changes seen in the kernel, and how long they took (newer JSON only)."""
    if "live_apply_p50_ms" not in f:
        return "n/a"
    return (
        f"{f['live_apply_p50_ms']:,.0f} / {f['live_apply_p99_ms']:,.0f} / {f['live_apply_max_ms']:,.0f} ms "
        f"({lv['changes_seen']:,} seen)"
    )


def readme_section(reports):
    lines = [
        "<!-- bench:soak begin -->",
        "**Soak** (`sudo benches/run soak`: `cargo bench --bench soak` per mode, then "
        "`benches/soak_plot.py`; what each check means: `src/lab/soak/mod.rs`). The release daemon "
        "on synthetic Services from `--manifests`, changed throughout (Services created and deleted, "
        "endpoints scaled, readiness flipped, ports changed; a fifth of the changes go to Services "
        "whose endpoints are the test bed's pods); real connections from the client pod to 3 stable "
        "Services (none may fail) and to 3 churning ones (each must land on an endpoint that was "
        "ready, allowing for the time until the kernel's rules, read back every 100 ms, showed the "
        "change); after every K syncs the churn pauses for a drift check: the kernel read back "
        "(over netlink / `iptables-save`) against a fresh full render of the same files, "
        "0 differences expected. Change → in kernel: a drift check's tick, from the file's rename "
        "until the kernel's read-back showed it (read time included); live: each change of a churning "
        "Service's endpoints until its rules read back showed it, p50 / p99 / max. CPU: the daemon, and its "
        "children (`iptables-restore`), in % of one core. RSS growth: the mean of the last tenth "
        "of the samples after warm-up over the first tenth. What the runs found, and what the "
        "numbers do not yet mean: [docs/soak.md](docs/soak.md).",
        "",
        "| mode | size | length | changes | syncs | sync p50 / p99 | change → in kernel p50 / max "
        "| drift checks / differences | stable connects failed | landings on endpoints not ready "
        "| live change → in kernel | daemon RSS after warm-up → end | CPU | load average |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [row(r) for r in reports]
    lines.append("")
    for r in reports:
        c = r["config"]
        lines.append(
            f"`{c['mode']}`: `MODE={c['mode']} SERVICES={c['services']} ENDPOINTS={c['endpoints']} "
            f"DURATION={c['duration_s']:g} RATE={c['rate']:g} K={c['k']} cargo bench --bench soak`, "
            f"first sync {r['figures']['first_sync_s']:.1f} s, changes {r['changes_by_kind']}"
        )
        lines.append("")
    for r in reports:
        mode = r["config"]["mode"]
        lines.append(f"![soak, {mode} mode: sync latency, RSS and CPU over time](docs/soak-{mode}.svg)")
    lines.append("<!-- bench:soak end -->")
    return "\n".join(lines)


def update_readme(path, reports):
    text = pathlib.Path(path).read_text()
    begin, end = "<!-- bench:soak begin -->", "<!-- bench:soak end -->"
    if begin not in text or end not in text:
        sys.exit(f"{path}: no {begin} ... {end} section")
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    pathlib.Path(path).write_text(head + readme_section(reports) + tail)
    print(f"{path}: soak section regenerated")


if __name__ == "__main__":
    args = sys.argv[1:]
    readme, svg_dir = None, pathlib.Path(__file__).resolve().parent.parent / "docs"
    while args and args[0].startswith("--"):
        flag, value, args = args[0], args[1], args[2:]
        if flag == "--readme":
            readme = value
        elif flag == "--svg-dir":
            svg_dir = value
        else:
            sys.exit(f"unknown flag {flag}")
    paths = args or ["docs/bench/soak-nftables.json", "docs/bench/soak-iptables.json"]
    for p in paths:
        plot(p, svg_dir)
    if readme:
        update_readme(readme, [json.loads(pathlib.Path(p).read_text()) for p in paths])
