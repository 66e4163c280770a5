"""One engine replica of ``kangaroo serve --replicas N``: a Ray Serve deployment holding an engine and the same
:class:`~kangaroo_apps.serve.worker.EngineWorker` a single-process server runs (its queue, batching, text assembly).

The HTTP front (the FastAPI app, in the command's process) sends each request's prompt ids, budget, sampling and stop
strings; :meth:`EngineReplica.generate` streams back the worker's events — deltas, then finished or failed — as plain
tuples (:func:`to_wire`). Ray imports nothing here: the class becomes a deployment in
:mod:`kangaroo_apps.serve.dispatch`.

Metrics: the worker's metric hooks land on a :class:`RelayMetrics`, which records the calls; each streamed item
carries the calls recorded since the last item (of any request on this replica), and the front replays them on its
own :class:`~kangaroo_apps.serve.metrics.ServerMetrics`, so ``/metrics`` counts every replica's rounds as one server's.
After a request's last event the replica waits (briefly) for the worker to close the request's books and sends one
trailing item of metric calls only.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
import uuid

import attrs

from kangaroo_apps.serve.protocol import ApiError
from kangaroo_apps.serve.worker import Delta, EngineWorker, Failed, Finished, Job

#: how long a replica waits, after a request's last event, for the worker to record the request as done
BOOKS_TIMEOUT_SECONDS = 1.0


@attrs.frozen
class BackendFacts:
    """What the HTTP front needs of the backend (it holds no model): names, context, the tokenizer."""

    name: str
    model_name: str
    max_context: int
    tokenizer: object


@attrs.frozen
class DrafterFacts:
    name: str


@attrs.frozen
class EngineFacts:
    """An engine as :func:`kangaroo_apps.serve.app.create_app` reads it, without the model (sent to the front)."""

    backend: BackendFacts
    drafter: DrafterFacts | None
    config: object  # the engine's DecodeConfig: the server's sampling defaults

    @classmethod
    def of(cls, engine) -> "EngineFacts":
        b = engine.backend
        drafter = getattr(engine.drafter, "name", None)
        return cls(BackendFacts(b.name, str(b.model_name), b.max_context, b.tokenizer),
                   None if engine.drafter is None else DrafterFacts(drafter or type(engine.drafter).__name__),
                   engine.config)


# -- the wire: events as plain tuples (an ApiError does not survive pickling: its constructor takes keywords) --------
def to_wire(event) -> tuple:
    if isinstance(event, Delta):
        return ("delta", event.segments, event.stats)
    if isinstance(event, Finished):
        return ("finished", event.text, event.finish_reason, event.prompt_tokens, event.completion_tokens, event.stats)
    e = event.error
    return ("failed", e.status, e.message, e.type, e.param, e.code, dict(e.headers))


def from_wire(item: tuple):
    kind, *rest = item
    if kind == "delta":
        return Delta(tuple(tuple(s) for s in rest[0]), rest[1])
    if kind == "finished":
        return Finished(*rest)
    status, message, type_, param, code, headers = rest
    return Failed(ApiError(status, message, type=type_, param=param, code=code, headers=headers))


class _Counted:
    """``metrics.cancelled.inc()`` recorded as a call."""

    def __init__(self, relay: "RelayMetrics", name: str):
        self.relay, self.name = relay, name

    def inc(self, amount: float = 1) -> None:
        self.relay.record(self.name, amount)


class _Unused:
    """A gauge the replica does not feed (the front's queue depth is its own count of requests in flight)."""

    def set_function(self, _function) -> None:
        pass


class RelayMetrics:
    """The :class:`~kangaroo_apps.serve.metrics.ServerMetrics` hooks the worker calls, recorded for the front.

    A request is named in the calls by the front's own key for it (:meth:`name`); the worker passes each job as
    ``key`` to ``request_started`` / ``request_done``."""

    def __init__(self):
        self.replica = uuid.uuid4().hex[:8]
        self.cancelled = _Counted(self, "cancelled")
        self.queue_depth = _Unused()
        self._calls: list[tuple] = []
        self._lock = threading.Lock()
        self._started: set[int] = set()  # ids of jobs started and not yet done
        self._names: dict[int, str] = {}  # the front's key of each job, by id

    def record(self, name: str, *args) -> None:
        with self._lock:
            self._calls.append((name, args))

    def drain(self) -> list[tuple]:
        with self._lock:
            calls, self._calls = self._calls, []
        return calls

    def round(self, emitted: int, drafted: int, accepted: int) -> None:
        self.record("round", emitted, drafted, accepted)

    def finished(self, prompt_tokens: int, new_tokens: int, tokens_per_second: float) -> None:
        self.record("finished", prompt_tokens, new_tokens, tokens_per_second)

    def observe_batch(self, size: int) -> None:
        self.record("observe_batch", size)

    def first_token(self, seconds_since_queued: float) -> None:
        self.record("first_token", seconds_since_queued)

    def name(self, job, key: str | None) -> None:
        """``job`` is ``key`` in the calls sent to the front (default: a name unique across replicas)."""
        self._names[id(job)] = key or f"{self.replica}:{id(job)}"

    def forget(self, job) -> None:
        """The request's stream ended: its name goes, unless the worker still has to record it as done (then
        :meth:`request_done` drops it, so started and done carry the same key)."""
        with self._lock:
            if id(job) not in self._started:
                self._names.pop(id(job), None)

    def key(self, job) -> str:
        return self._names.get(id(job)) or f"{self.replica}:{id(job)}"

    def request_started(self, seconds_queued: float, key) -> None:
        with self._lock:
            self._started.add(id(key))
            self._calls.append(("request_started", (seconds_queued, self.key(key))))

    def request_done(self, key) -> None:
        with self._lock:
            self._started.discard(id(key))
            self._calls.append(("request_done", (self.key(key),)))
            self._names.pop(id(key), None)

    def retry_after(self, depth: int, parallel: int = 1) -> str:
        return "1"  # the front admits no more than the replicas take; its own refusals carry its own estimate

    async def books_closed(self, job: Job) -> None:
        """Wait (at most BOOKS_TIMEOUT_SECONDS) until a started ``job`` is recorded as done."""
        deadline = time.monotonic() + BOOKS_TIMEOUT_SECONDS
        while id(job) in self._started and time.monotonic() < deadline:
            await asyncio.sleep(0.005)


class EngineReplica:
    """The deployment's class: ``make_engine()`` builds the engine (``threads`` torch threads) in the replica."""

    def __init__(self, make_engine, threads: int, queue_size: int, max_batch: int):
        import torch

        torch.set_num_threads(threads)
        self.engine = make_engine()
        self.engine.generate("Hello", max_new_tokens=4)  # warm-up before the first client, as `kangaroo serve` does
        self.relay = RelayMetrics()
        self.worker = EngineWorker(self.engine, self.relay, queue_size=queue_size, max_batch=max_batch)
        self.worker.start()

    def describe(self) -> EngineFacts:
        return EngineFacts.of(self.engine)

    def pid(self) -> int:
        return os.getpid()

    def check_health(self) -> None:
        """Ray Serve calls this periodically; a replica whose engine thread ended is replaced."""
        if not self.worker.alive:
            raise RuntimeError("the engine thread of this replica is not running")

    async def generate(self, request: dict):
        """Stream one request's events as ``(wire event or None, metric calls)`` items. ``request["key"]`` names the
        request in the metric calls (the front's own name for it: should this replica die, the front closes the
        request's books itself)."""
        job = Job(list(request["prompt_ids"]), request["max_new_tokens"], request["sampling"],
                  tuple(request.get("stops") or ()), asyncio.get_running_loop())
        self.relay.name(job, request.get("key"))
        try:
            self.worker.submit(job)
        except ApiError as exc:
            self.relay.forget(job)
            yield to_wire(Failed(exc)), self.relay.drain()
            return
        try:
            while True:
                event = await job.events.get()
                yield to_wire(event), self.relay.drain()
                if isinstance(event, (Finished, Failed)):
                    break
            await self.relay.books_closed(job)
            yield None, self.relay.drain()
        finally:
            job.cancel()  # the front went away (its client did): the worker stops the job between two rounds
            self.relay.forget(job)
