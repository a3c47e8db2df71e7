"""Prometheus metrics with vLLM's names, so dashboards and gateways carry over.

Request metrics (TTFT, inter-token latency, end-to-end latency, token
counts, successes by finish reason) are observed in the API server, where
tokens arrive. Engine figures (running / waiting requests, KV cache usage,
preemptions, prefix-cache queries and hits) come from the statistics the
engine core sends with every output and heartbeat. With several API server
processes (`pagoda serve --api-server-count N`) prometheus-client's
multiprocess mode sums the request metrics over all of them.

Speech to text adds two of its own (vLLM has none): `pagoda:audio_seconds`
(seconds of audio transcribed or translated, realtime utterances included) and
`pagoda:audio_real_time_factor` (per request: the time from the upload read
to the answer's end, over the audio's duration; below 1 is faster than
real time).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pagoda.protocol.messages import RequestTimings, SchedulerStats

if TYPE_CHECKING:
    from pagoda.frontend.dp_client import DPClient
    from pagoda.frontend.engine_client import AsyncMPClient

_LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)
_REAL_TIME_FACTOR_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)


def _kv_transfer_counters(stats: SchedulerStats) -> list[tuple[str, str, float]]:
    """The PeerConnector's counters (--kv-transfer-config)."""
    return [
        (
            "pagoda:kv_transfers",
            "Requests whose KV was pulled from a prefill engine.",
            stats.kv_transfers,
        ),
        (
            "pagoda:kv_transfer_tokens",
            "Prompt tokens whose KV was pulled.",
            stats.kv_transfer_tokens,
        ),
        ("pagoda:kv_transfer_bytes", "Bytes of KV pulled.", stats.kv_transfer_bytes),
        (
            "pagoda:kv_transfer_seconds",
            "Time spent taking and pulling KV.",
            stats.kv_transfer_seconds,
        ),
        (
            "pagoda:kv_recomputed",
            "Remote-prefill requests whose prompt was computed here "
            "after all (producer gone or slow, KV expired, another prompt).",
            stats.kv_recomputed,
        ),
        (
            "pagoda:kv_served",
            "Requests whose KV a decode engine pulled from here.",
            stats.kv_served,
        ),
        (
            "pagoda:kv_expired",
            "Held KV freed unread after the connector's timeout.",
            stats.kv_expired,
        ),
    ]


def _spec_decode_counters(stats: SchedulerStats) -> list[tuple[str, str, float]]:
    """Speculative decoding's counters (--speculative-config)."""
    return [
        (
            "vllm:spec_decode_num_drafts",
            "Request-steps that verified draft tokens.",
            stats.spec_decode_num_drafts,
        ),
        (
            "vllm:spec_decode_num_draft_tokens",
            "Draft tokens verified.",
            stats.spec_decode_num_draft_tokens,
        ),
        (
            "vllm:spec_decode_num_accepted_tokens",
            "Draft tokens accepted.",
            stats.spec_decode_num_accepted_tokens,
        ),
    ]


class EngineStatsCollector(Collector):
    """Engine gauges and counters read from the latest stats the engine sent."""

    def __init__(
        self, client: AsyncMPClient | DPClient, model_name: str, block_size: int, num_blocks: int
    ) -> None:
        self.client = client
        self.model_name = model_name
        self.block_size = block_size
        self.num_blocks = num_blocks

    def collect(self) -> Iterator[Metric]:
        stats = self.client.stats
        labels = ["model_name"]
        values = [self.model_name]
        for name, doc, value in (
            ("vllm:num_requests_running", "Requests in the running batch.", stats.num_running),
            ("vllm:num_requests_waiting", "Requests waiting to be scheduled.", stats.num_waiting),
            (
                "vllm:kv_cache_usage_perc",
                "Fraction of KV cache blocks in use (0-1).",
                stats.kv_cache_usage,
            ),
        ):
            gauge = GaugeMetricFamily(name, doc, labels=labels)
            gauge.add_metric(values, value)
            yield gauge
        for name, doc, value in (
            ("vllm:num_preemptions", "Preemptions since start.", stats.num_preemptions),
            (
                "vllm:prefix_cache_queries",
                "Prompt tokens looked up in the prefix cache.",
                stats.prefix_cache_queries,
            ),
            (
                "vllm:prefix_cache_hits",
                "Prompt tokens found in the prefix cache.",
                stats.prefix_cache_hits,
            ),
            (
                "pagoda:prompt_tokens_computed",
                "Prompt tokens run through the model (not found cached, not transferred).",
                stats.prompt_tokens_computed,
            ),
            *_kv_transfer_counters(stats),
            *_spec_decode_counters(stats),
        ):
            counter = CounterMetricFamily(name, doc, labels=labels)
            counter.add_metric(values, value)
            yield counter
        per_pos = CounterMetricFamily(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Accepted draft tokens, by position in the draft.",
            labels=[*labels, "position"],
        )
        for pos, value in enumerate(stats.spec_decode_num_accepted_tokens_per_pos):
            per_pos.add_metric([*values, str(pos)], value)
        yield per_pos
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "KV cache configuration.",
            labels=["block_size", "num_gpu_blocks", "enable_prefix_caching"],
        )
        info.add_metric([str(self.block_size), str(self.num_blocks), "True"], 1.0)
        yield info


class FrontendMetrics:
    """Request metrics of one API server (summed across processes when multiprocess)."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.multiprocess_dir = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        # In multiprocess mode values live in files; the registry here only serves.
        register = None if self.multiprocess_dir else self.registry
        labels = ["model_name"]
        self.model_name = model_name
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Time to first token.",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=register,
        )
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds",
            "Time between tokens.",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=register,
        )
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Request latency.",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=register,
        )
        self.prompt_tokens_hist = Histogram(
            "vllm:request_prompt_tokens",
            "Prompt tokens.",
            labels,
            buckets=_TOKEN_BUCKETS,
            registry=register,
        )
        self.gen_tokens_hist = Histogram(
            "vllm:request_generation_tokens",
            "Generated tokens.",
            labels,
            buckets=_TOKEN_BUCKETS,
            registry=register,
        )
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Prompt tokens processed.", labels, registry=register
        )
        self.gen_tokens = Counter(
            "vllm:generation_tokens", "Tokens generated.", labels, registry=register
        )
        self.success = Counter(
            "vllm:request_success",
            "Finished requests.",
            [*labels, "finished_reason"],
            registry=register,
        )
        # Per-request engine phases, from the timings on each finished request.
        self.phases = {
            phase: Histogram(
                f"vllm:request_{phase}_time_seconds",
                f"Time in the {phase} phase.",
                labels,
                buckets=_LATENCY_BUCKETS,
                registry=register,
            )
            for phase in ("queue", "prefill", "decode", "inference")
        }
        self.audio_seconds = Counter(
            "pagoda:audio_seconds", "Seconds of audio transcribed.", labels, registry=register
        )
        self.real_time_factor = Histogram(
            "pagoda:audio_real_time_factor",
            "Processing time over audio duration, per speech-to-text request.",
            labels,
            buckets=_REAL_TIME_FACTOR_BUCKETS,
            registry=register,
        )
        self._ttft = self.ttft.labels(model_name)
        self._itl = self.itl.labels(model_name)
        if self.multiprocess_dir:
            from prometheus_client import multiprocess

            multiprocess.MultiProcessCollector(self.registry)

    @classmethod
    def of_engine(cls, client: AsyncMPClient | DPClient, model_name: str) -> FrontendMetrics:
        """Request metrics, and the gauges read from `client`'s latest engine stats."""
        assert client.ready is not None
        metrics = cls(model_name)
        metrics.add_engine_collector(
            EngineStatsCollector(
                client, model_name, client.ready.block_size, client.ready.num_kv_blocks
            )
        )
        return metrics

    def add_engine_collector(self, collector: Collector) -> None:
        self.registry.register(collector)

    def observe_engine_timings(self, timings: RequestTimings) -> None:
        m = self.model_name
        self.phases["queue"].labels(m).observe(timings.queue_s)
        self.phases["prefill"].labels(m).observe(timings.prefill_s)
        self.phases["decode"].labels(m).observe(timings.decode_s)
        self.phases["inference"].labels(m).observe(timings.prefill_s + timings.decode_s)

    def observe_first_token(self, seconds: float) -> None:
        self._ttft.observe(seconds)

    def observe_inter_token(self, seconds: float) -> None:
        self._itl.observe(seconds)  # once per streamed token: the child bound once

    def observe_finished(
        self, seconds: float, num_prompt: int, num_generated: int, finish_reasons: list[str]
    ) -> None:
        m = self.model_name
        self.e2e.labels(m).observe(seconds)
        self.prompt_tokens_hist.labels(m).observe(num_prompt)
        self.gen_tokens_hist.labels(m).observe(num_generated)
        self.prompt_tokens.labels(m).inc(num_prompt)
        self.gen_tokens.labels(m).inc(num_generated)
        for reason in finish_reasons:
            self.success.labels(m, reason).inc()

    def observe_audio(self, audio_seconds: float, wall_seconds: float | None) -> None:
        """A finished speech-to-text request: its audio's duration and how long it
        took (None for a realtime utterance, whose audio came as it was spoken)."""
        m = self.model_name
        self.audio_seconds.labels(m).inc(audio_seconds)
        if audio_seconds > 0 and wall_seconds is not None:
            self.real_time_factor.labels(m).observe(wall_seconds / audio_seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
