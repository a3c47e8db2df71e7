"""Output throughput and TTFT against concurrency, from `pagoda bench serve` reports.

One figure with two panels; each series (a system, a model) is a list of
reports at several `--max-concurrency` values. Needs matplotlib, which
`pagoda[bench]` installs; the Agg backend needs no display.
"""

from __future__ import annotations

from typing import Any


def plot_concurrency(series: dict[str, list[dict[str, Any]]], path: str) -> None:
    """Draw every series' output tok/s and median / p99 TTFT against concurrency; save as `path`."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install 'pagoda[bench]'") from None

    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.5))
    ticks: set[int] = set()
    for i, (label, reports) in enumerate(series.items()):
        rows = sorted(reports, key=lambda r: r["max_concurrency"])
        x = [r["max_concurrency"] for r in rows]
        ticks.update(x)
        color = f"C{i}"
        left.plot(x, [r["output_throughput"] for r in rows], "o-", color=color, label=label)
        median = [r["median_ttft_ms"] for r in rows]
        right.plot(x, median, "o-", color=color, label=f"{label} median")
        right.plot(x, [r["p99_ttft_ms"] for r in rows], "x--", color=color, label=f"{label} p99")
    for axis, ylabel, title in (
        (left, "output tokens / s", "Output throughput"),
        (right, "TTFT (ms)", "Time to first token"),
    ):
        axis.set_xscale("log", base=2)
        axis.set_xticks(sorted(ticks), [str(t) for t in sorted(ticks)])
        axis.minorticks_off()
        axis.set_xlabel("max concurrency")
        axis.set_ylabel(ylabel)
        axis.set_title(title)
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
