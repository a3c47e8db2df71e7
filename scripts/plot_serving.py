"""Plot output throughput and median TTFT against concurrency from bench JSONs.

    python scripts/plot_serving.py docs/bench/serving_c1.json docs/bench/serving_c16.json \\
        docs/bench/serving_c64.json -o docs/bench/serving.png

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

    rows = sorted((json.load(open(p)) for p in args.reports), key=lambda r: r["max_concurrency"])
    conc = [r["max_concurrency"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.5))
    a.plot(conc, [r["output_throughput"] for r in rows], "o-")
    a.set_xscale("log", base=2)
    a.set_xlabel("max concurrency")
    a.set_ylabel("output tokens / s")
    a.set_title("Output throughput (128 -> 128)")
    b.plot(conc, [r["ttft_ms"]["median"] for r in rows], "o-", color="tab:red")
    b.set_xscale("log", base=2)
    b.set_xlabel("max concurrency")
    b.set_ylabel("median TTFT (ms)")
    b.set_title("Time to first token")
    fig.tight_layout()
    fig.savefig(args.output, dpi=110)


if __name__ == "__main__":
    main()
