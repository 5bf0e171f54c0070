#!/usr/bin/env python3
"""Draws docs/nftables-figures.png from the figures quoted in docs/nftables.md.

The numbers are copied by hand from the outputs of `cargo bench --bench dataplane` and
`cargo bench --bench nft_sync` (see docs/nftables.md); this script only draws them.
Needs matplotlib (`pip install matplotlib`); not part of the tests.
"""
import pathlib

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

# First-packet latency, accept() server, p50 in µs.
SERVICES = [1000, 10000, 30000]
IPTABLES_P50 = [30.9, 141.7, 396.6]
NFTABLES_P50 = [16.7, 16.7, 16.6]
BASELINE_P50 = 13.4

# One endpoint change made live, p50 in ms: (size, netlink, nft -f).
CHANGE = [
    ("10k × 10", 71.2, 900.1),
    ("44k × 1", 103.7, 734.2),
    ("5k × 50", 137.2, 4484.8),
]
# Cold full sync in s: (size, netlink, nft -f on the same transactions).
COLD = [
    ("10k × 10", 11.0, 22.7),
    ("44k × 1", 2.5, 11.2),
    ("5k × 50", 9.3, 96.4),
]


def bars(ax, rows, title, unit):
    labels = [r[0] for r in rows]
    x = range(len(rows))
    ours = [r[1] for r in rows]
    nft = [r[2] or 0 for r in rows]
    ax.bar([i - 0.2 for i in x], ours, 0.4, label="netlink (ours)")
    ax.bar([i + 0.2 for i in x], nft, 0.4, label="nft -f")
    for i, (o, n) in enumerate(zip(ours, nft)):
        ax.text(i - 0.2, o, f"{o:g}", ha="center", va="bottom", fontsize=7)
        if n:
            ax.text(i + 0.2, n, f"{n:g}", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(list(x))
    ax.set_xticklabels(labels)
    ax.set_ylabel(unit)
    ax.set_title(title)
    ax.legend(fontsize=8)


fig, (a, b, c) = plt.subplots(1, 3, figsize=(14, 4.2))
a.plot(SERVICES, IPTABLES_P50, "o-", label="iptables")
a.plot(SERVICES, NFTABLES_P50, "s-", label="nftables")
a.axhline(BASELINE_P50, color="grey", ls=":", label="no rules")
a.set_xscale("log")
a.set_xlabel("Services")
a.set_ylabel("TCP connect p50 (µs)")
a.set_title("First packet to the last Service")
a.legend(fontsize=8)
bars(b, COLD, "Cold full sync", "s")
bars(c, CHANGE, "One endpoint change live, p50", "ms")
fig.tight_layout()
out = pathlib.Path(__file__).with_name("nftables-figures.png")
fig.savefig(out, dpi=100)
print(out)
