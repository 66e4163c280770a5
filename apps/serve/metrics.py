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
    kangaroo_tokens_per_second                   engine tokens/s of the last finished generation (new tokens / seconds
                                                 from its first pass to its last round, shared passes included)
    kangaroo_queue_depth                         requests waiting + those running
    kangaroo_running_requests                    requests decoding now (at most --max-batch)
    kangaroo_request_seconds                     histogram of request wall time (HTTP side), by endpoint
    kangaroo_time_to_first_token_seconds         histogram: queued → the first token generated (queue wait + prefill)
    kangaroo_queue_wait_seconds                  histogram: queued → the engine takes the request
    kangaroo_request_tokens_per_second           histogram: engine tokens/s of each finished generation
    kangaroo_batch_size                          histogram: requests decoded together, one observation per pass of the
                                                 model (M[:l] while drafting, the drafter's step, M[l:] to verify, a
                                                 prefill's two): the streams it held (always 1 with --max-batch 1)
    kangaroo_batch_passes_total                  passes observed by kangaroo_batch_size
    kangaroo_batch_stream_passes_total           stream passes those passes held (the rows of the merged passes)
    kangaroo_streams_per_pass                    stream passes / passes over all passes so far (1.0 unbatched)

The worker also feeds a moving mean of seconds per request (taken off the queue → done), which sizes the
``Retry-After`` of a refusal: :meth:`ServerMetrics.retry_after` (divided by the requests decoding at once).
"""

from __future__ import annotations

import math
import time

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
        self.queue_depth = Gauge("kangaroo_queue_depth", "Requests waiting plus those running", registry=registry)
        self.running = Gauge("kangaroo_running_requests", "Requests decoding now", registry=registry)
        self.request_seconds = Histogram("kangaroo_request_seconds", "Request wall time", ["endpoint"],
                                         registry=registry, buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120))
        self.time_to_first_token = Histogram(
            "kangaroo_time_to_first_token_seconds", "Queued to the first token generated (queue wait + prefill)",
            registry=registry, buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
        self.queue_wait = Histogram(
            "kangaroo_queue_wait_seconds", "Queued to taken by the engine", registry=registry,
            buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120))
        self.request_tokens_per_second = Histogram(
            "kangaroo_request_tokens_per_second", "Engine tokens/s of each finished generation", registry=registry,
            buckets=(1, 2.5, 5, 10, 20, 35, 50, 75, 100, 150, 200, 300, 500, 1000))
        self.batch_size = Histogram(
            "kangaroo_batch_size", "Requests decoded together in one pass", registry=registry,
            buckets=(1, 2, 4, 8, 16, 32, 64, 128))
        self.batch_passes = Counter("kangaroo_batch_passes", "Passes observed by kangaroo_batch_size",
                                    registry=registry)
        self.batch_stream_passes = Counter("kangaroo_batch_stream_passes",
                                           "Stream passes (rows) held by those passes", registry=registry)
        self.streams_per_pass = Gauge("kangaroo_streams_per_pass", "Stream passes per pass over all passes so far",
                                      registry=registry)
        self.streams_per_pass.set_function(self._streams_per_pass)
        self.mean_service_seconds: float | None = None  # moving mean of seconds per request (None: none done yet)
        self._began: dict = {}  # when each running request was taken, by its key

    _passes = 0  # plain copies for the CR gauge (only the engine thread writes them)
    _emitted = 0

    _batch_passes = 0  # plain copies for the streams-per-pass gauge (only the engine thread writes them)
    _batch_rows = 0

    def _cr(self) -> float:
        return self._emitted / self._passes if self._passes else 0.0

    def _streams_per_pass(self) -> float:
        return self._batch_rows / self._batch_passes if self._batch_passes else 0.0

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
        self.request_tokens_per_second.observe(tokens_per_second)

    # -- hooks the worker calls (engine thread) --------------------------------------------------------------------
    #: weight of the newest request in the moving mean of service time
    SERVICE_SMOOTHING = 0.25

    def observe_batch(self, size: int) -> None:
        """One pass of the engine decoded ``size`` requests together (unbatched: the prefill or a verify pass of the
        one request; batched: a merged pass holding ``size`` streams)."""
        self.batch_size.observe(size)
        self._batch_passes += 1
        self._batch_rows += size
        self.batch_passes.inc()
        self.batch_stream_passes.inc(size)

    def first_token(self, seconds_since_queued: float) -> None:
        self.time_to_first_token.observe(seconds_since_queued)

    def request_started(self, seconds_queued: float, key) -> None:
        """The engine took a request off the queue (after waiting ``seconds_queued``); its service clock starts.
        ``key`` tells requests running at once apart (the same key to :meth:`request_done`)."""
        self.queue_wait.observe(seconds_queued)
        self._began[key] = time.perf_counter()
        self.running.set(len(self._began))

    def request_done(self, key) -> None:
        """A running request is done (finished, failed or cancelled): its service time enters the mean."""
        began = self._began.pop(key, None)
        self.running.set(len(self._began))
        if began is not None:
            self.observe_service(time.perf_counter() - began)

    @property
    def _service_began(self) -> float | None:
        """When the oldest running request was taken (None: none running)."""
        return min(list(self._began.values()), default=None)

    def observe_service(self, seconds: float) -> None:
        mean = self.mean_service_seconds
        self.mean_service_seconds = seconds if mean is None else mean + self.SERVICE_SMOOTHING * (seconds - mean)

    def retry_after(self, depth: int, parallel: int = 1) -> str:
        """``Retry-After`` for a refused request: ``depth`` requests ahead (waiting + running) × the mean seconds per
        request ÷ ``parallel`` (the requests decoded at once), rounded up, at least 1 s. Before any request is done,
        the oldest running one's time so far stands in for the mean of the waiting ones (the running ones'
        remainders unknown, counted as nothing)."""
        mean, began = self.mean_service_seconds, self._service_began
        parallel = max(1, parallel)
        if mean is not None:
            seconds = depth * mean / parallel
        else:
            elapsed = time.perf_counter() - began if began is not None else 0.0
            seconds = max(0, depth - parallel) * elapsed / parallel
        return str(max(1, math.ceil(seconds)))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
