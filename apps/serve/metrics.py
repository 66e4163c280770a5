"""Prometheus metrics of one server (``GET /metrics``, text exposition format), on a registry of its own.

Names (counters end in ``_total``)::

    kangaroo_requests_total{endpoint,status}     HTTP requests answered, by route and status code
    kangaroo_prompt_tokens_total                 prompt tokens of finished generations
    kangaroo_new_tokens_total                    tokens generated (finished generations)
    kangaroo_verify_passes_total                 verify passes of M[l:] (the prefill not counted)
    kangaroo_round_tokens_total                  tokens those passes emitted (accepted drafts + the target's token)
    kangaroo_drafted_tokens_total                drafts proposed
    kangaroo_accepted_drafts_total               drafts accepted
    kangaroo_accepted_drafts_by_position_total{position}
                                                 rounds whose draft at this position (1..gamma) was accepted: CTAR(w)
                                                 = position w / verify passes
    kangaroo_cancelled_total                     generations stopped because their client went away
    kangaroo_compression_rate                    CR over all rounds so far: round tokens / verify passes
    kangaroo_tokens_per_second                   engine tokens/s of the last finished generation
    kangaroo_queue_depth                         requests waiting + the one running
    kangaroo_request_seconds                     histogram of request wall time (HTTP side), by endpoint
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST  # noqa: F401  (re-exported for the app)
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

disable_created_metrics()  # no *_created series: a scrape shows the counters, not their creation times


class ServerMetrics:
    def __init__(self, gamma: int):
        self.registry = registry = CollectorRegistry()
        self.requests = Counter("kangaroo_requests", "HTTP requests answered", ["endpoint", "status"],
                                registry=registry)
        self.prompt_tokens = Counter("kangaroo_prompt_tokens", "Prompt tokens of finished generations",
                                     registry=registry)
        self.new_tokens = Counter("kangaroo_new_tokens", "Tokens generated", registry=registry)
        self.verify_passes = Counter("kangaroo_verify_passes", "Verify passes of the deep layers", registry=registry)
        self.round_tokens = Counter("kangaroo_round_tokens", "Tokens emitted by verify passes", registry=registry)
        self.drafted = Counter("kangaroo_drafted_tokens", "Drafts proposed", registry=registry)
        self.accepted = Counter("kangaroo_accepted_drafts", "Drafts accepted", registry=registry)
        self.accepted_at = Counter("kangaroo_accepted_drafts_by_position",
                                   "Rounds whose draft at this position was accepted", ["position"], registry=registry)
        for position in range(1, gamma + 1):  # every position present from the start, at 0
            self.accepted_at.labels(position=str(position))
        self.cancelled = Counter("kangaroo_cancelled", "Generations stopped because the client went away",
                                 registry=registry)
        self.compression_rate = Gauge("kangaroo_compression_rate", "Tokens per verify pass over all rounds",
                                      registry=registry)
        self.compression_rate.set_function(self._cr)
        self.tokens_per_second = Gauge("kangaroo_tokens_per_second", "Engine tokens/s of the last finished generation",
                                       registry=registry)
        self.queue_depth = Gauge("kangaroo_queue_depth", "Requests waiting plus the one running", registry=registry)
        self.request_seconds = Histogram("kangaroo_request_seconds", "Request wall time", ["endpoint"],
                                         registry=registry, buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120))

    _passes = 0  # plain copies for the CR gauge (only the engine thread writes them)
    _emitted = 0

    def _cr(self) -> float:
        return self._emitted / self._passes if self._passes else 0.0

    def round(self, emitted: int, drafted: int, accepted: int) -> None:
        self._passes += 1
        self._emitted += emitted
        self.verify_passes.inc()
        self.round_tokens.inc(emitted)
        self.drafted.inc(drafted)
        self.accepted.inc(accepted)
        for position in range(1, accepted + 1):
            self.accepted_at.labels(position=str(position)).inc()

    def finished(self, prompt_tokens: int, new_tokens: int, tokens_per_second: float) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        self.new_tokens.inc(new_tokens)
        self.tokens_per_second.set(tokens_per_second)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
