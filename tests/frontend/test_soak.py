"""A short soak (about 30 s) under cancellations: nothing leaks, nothing fails.

scripts/soak.py is the long version; this runs the same code against the
session server with fewer requests.
"""

from __future__ import annotations

import asyncio

from scripts.soak import SoakConfig, print_report, soak
from tests.frontend.conftest import Server


def test_short_soak_under_cancellation(server: Server) -> None:
    cfg = SoakConfig(
        base_url=server.base_url,
        pids=[p.pid for p in server.procs.procs],
        requests=100,
        duration_s=30.0,
        concurrency=8,
        warmup_requests=16,
        # The RSS bound needs a long run to mean anything; a short one only
        # catches gross growth (see docs/reliability.md for the long figures).
        rss_tolerance=0.25,
    )
    report = asyncio.run(soak(cfg))
    print_report(report)
    assert report.requests >= 10
    assert report.cancelled > 0
    assert report.ok, report.failures
