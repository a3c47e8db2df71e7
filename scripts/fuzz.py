"""Fuzz every route of a running Pagoda server with schemathesis; print a table.

    python scripts/fuzz.py --base-url http://127.0.0.1:8000 --examples 500
    python scripts/fuzz.py --examples 500 --routes /v1/score /rerank   # some routes

Exits 1 if any route answered 5xx or an error body was out of its route's
shape. See tests/frontend/fuzzing.py for what is fuzzed and how.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.frontend.fuzzing import RouteResult, fuzz_all  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--examples", type=int, default=500, help="examples per route")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--routes", nargs="*", help="only these paths (default: every route)")
    args = parser.parse_args()
    start = time.monotonic()
    print(f"{'route':45s} {'examples':>8s} {'5xx':>5s} {'secs':>6s}  statuses", flush=True)

    def report(r: RouteResult) -> None:
        statuses = " ".join(f"{k}:{v}" for k, v in sorted(r.statuses.items()))
        line = f"{r.route:45s} {r.examples:8d} {r.server_errors:5d} {r.seconds:6.1f}  {statuses}"
        print(line, flush=True)
        for problem in r.problems[:3]:
            print(f"    {problem}", flush=True)

    results = fuzz_all(args.base_url, args.examples, report, args.routes)
    total = sum(r.examples for r in results)
    errors = sum(r.server_errors for r in results)
    problems = sum(len(r.problems) for r in results)
    elapsed = time.monotonic() - start
    print(f"{'total':45s} {total:8d} {errors:5d}  ({problems} shape problems, {elapsed:.0f} s)")
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                [
                    {
                        "route": r.route,
                        "examples": r.examples,
                        "server_errors": r.server_errors,
                        "statuses": r.statuses,
                        "problems": r.problems,
                    }
                    for r in results
                ],
                indent=1,
            )
        )
    return 1 if errors or problems else 0


if __name__ == "__main__":
    sys.exit(main())
