"""Plot output throughput and median TTFT against concurrency from bench JSONs.

    python scripts/plot_serving.py docs/bench/serving_c1.json docs/bench/serving_c16.json \\
        docs/bench/serving_c64.json -o docs/bench/serving.png

A report given as LABEL=PATH joins the series LABEL, so that systems measured
side by side share the axes:

    python scripts/plot_serving.py pagoda=a_c1.json pagoda=a_c16.json vllm=b_c1.json ...

Needs matplotlib (not a Pagoda dependency: pip install matplotlib).
"""

from __future__ import annotations

import argparse
import json


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("reports", nargs="+")
    parser.add_argument("-o", "--output", default="serving.png")
    args = parser.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[str, list[dict]] = {}
    for arg in args.reports:
        label, _, path = arg.rpartition("=")
        series.setdefault(label, []).append(json.load(open(path)))
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.5))
    for label, reports in series.items():
        rows = sorted(reports, key=lambda r: r["max_concurrency"])
        conc = [r["max_concurrency"] for r in rows]
        a.plot(conc, [r["output_throughput"] for r in rows], "o-", label=label or None)
        b.plot(conc, [r["ttft_ms"]["median"] for r in rows], "o-", label=label or None)
    for axis, ylabel, title in (
        (a, "output tokens / s", "Output throughput (128 -> 128)"),
        (b, "median TTFT (ms)", "Time to first token"),
    ):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("max concurrency")
        axis.set_ylabel(ylabel)
        axis.set_title(title)
        if any(series):
            axis.legend()
    fig.tight_layout()
    fig.savefig(args.output, dpi=110)


if __name__ == "__main__":
    main()
