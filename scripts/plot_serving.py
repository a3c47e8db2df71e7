"""Plot saved `pagoda bench serve` (or `vllm bench serve`) reports side by side.

`pagoda bench serve --max-concurrency 1,4,16 --plot out.png` plots one run
as it goes; this script plots reports saved earlier, several systems on the
same axes. A report given as LABEL=PATH joins the series LABEL:

    python scripts/plot_serving.py pagoda=a_c1.json pagoda=a_c16.json vllm=b_c1.json ...

Reports of the older client (nested `ttft_ms`) are read too.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from pagoda.frontend.bench.plot import plot_concurrency


def load_report(path: str) -> dict[str, Any]:
    report: dict[str, Any] = json.load(open(path))
    if "ttft_ms" in report:  # the older client's layout
        report["median_ttft_ms"] = report["ttft_ms"]["median"]
        report["p99_ttft_ms"] = report["ttft_ms"]["p99"]
    return report


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("reports", nargs="+")
    parser.add_argument("-o", "--output", default="serving.png")
    args = parser.parse_args()
    series: dict[str, list[dict[str, Any]]] = {}
    for arg in args.reports:
        label, _, path = arg.rpartition("=")
        series.setdefault(label or "pagoda", []).append(load_report(path))
    plot_concurrency(series, args.output)


if __name__ == "__main__":
    main()
