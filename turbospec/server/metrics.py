"""The server's Prometheus metrics (`GET /metrics`, vLLM-style `turbospec:` names): HTTP requests, finished
generations by reason, errors by type, token counts, latency histograms, queue gauges and speculative-decoding
acceptance per draft position. Each app has its own registry."""

from __future__ import annotations

import time

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

PREFIX = "turbospec:"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")


def endpoint_label(path: str) -> str:
    """The `endpoint` label of a request path: a known route, else "other" (bounded label values)."""
    return path if path in ENDPOINTS else "other"


class Metrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        p = PREFIX
        lat, tok = LATENCY_BUCKETS, TOKEN_BUCKETS
        self.requests = Counter(p + "http_requests", "HTTP requests by endpoint and status code",
                                ["endpoint", "code"], registry=r)
        self.success = Counter(p + "request_success", "Finished generations by finish reason",
                               ["finished_reason"], registry=r)
        self.errors = Counter(p + "request_errors", "Requests answered with an error, by error type",
                              ["type"], registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens processed", registry=r)
        self.gen_tokens = Counter(p + "generation_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram(p + "time_to_first_token_seconds",
                              "Request arrival to first token (incl. queue)", buckets=lat, registry=r)
        self.latency = Histogram(p + "e2e_request_latency_seconds", "Request arrival to last token",
                                 buckets=lat, registry=r)
        self.queue_time = Histogram(p + "request_queue_time_seconds", "Time spent waiting in the queue",
                                    buckets=lat, registry=r)
        self.tpot = Histogram(p + "time_per_output_token_seconds", "Decode time per output token",
                              buckets=tok, registry=r)
        self.waiting = Gauge(p + "num_requests_waiting", "Requests waiting in the queue", registry=r)
        self.running = Gauge(p + "num_requests_running", "Requests being generated", registry=r)
        self.kv_usage = Gauge(p + "kv_cache_usage_perc", "Share of the paged KV pool's blocks in use (--parallel)",
                              registry=r)
        self.preemptions = Counter(p + "num_preemptions", "Sequences preempted for KV blocks (--parallel)",
                                   registry=r)
        self.prefix_queries = Counter(p + "prefix_cache_queries", "Prompt tokens looked up in the prefix cache "
                                      "(--parallel)", registry=r)
        self.prefix_hits = Counter(p + "prefix_cache_hits", "Prompt tokens found in the prefix cache (--parallel)",
                                   registry=r)
        self.spec_drafts = Counter(p + "spec_decode_num_drafts", "Verification steps that carried a draft",
                                   registry=r)
        self.spec_draft_tokens = Counter(p + "spec_decode_num_draft_tokens", "Draft tokens proposed",
                                         registry=r)
        self.spec_accepted = Counter(p + "spec_decode_num_accepted_tokens", "Draft tokens accepted",
                                     registry=r)
        self.spec_accepted_pos = Counter(p + "spec_decode_num_accepted_tokens_per_pos",
                                         "Draft tokens accepted at each draft position", ["position"],
                                         registry=r)
        self.spec_drafted_pos = Counter(p + "spec_decode_num_draft_tokens_per_pos",
                                        "Drafts reaching each draft position", ["position"], registry=r)

    def record(self, stats, t_arrival: float, t_first: float | None, reason: str) -> None:
        """A finished generation: its reason, latencies, token counts and speculation counts."""
        now = time.perf_counter()
        self.success.labels(reason).inc()
        self.latency.observe(now - t_arrival)
        if stats is None:
            return
        self.prompt_tokens.inc(stats.prompt_tokens)
        self.gen_tokens.inc(stats.gen_tokens)
        if t_first is not None:
            self.ttft.observe(t_first - t_arrival)
        if stats.gen_tokens > 1 and stats.decode_s > 0:
            self.tpot.observe(stats.decode_s / (stats.gen_tokens - 1))
        spec = stats.spec
        if spec is not None:
            self._record_spec(spec)

    def _record_spec(self, spec) -> None:
        self.spec_drafts.inc(spec.drafts)
        self.spec_draft_tokens.inc(spec.draft_tokens)
        self.spec_accepted.inc(spec.accepted)
        for i, (d, a) in enumerate(zip(spec.per_pos_drafted, spec.per_pos_accepted)):
            self.spec_drafted_pos.labels(str(i)).inc(d)
            self.spec_accepted_pos.labels(str(i)).inc(a)

    def render(self) -> tuple[bytes, str]:
        """The Prometheus text exposition and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
