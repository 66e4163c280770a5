"""The HTTP front of ``kangaroo serve --replicas N``: the single-process server's app, its one engine thread replaced
by a dispatcher to N engine replicas on Ray Serve (:class:`~kangaroo_apps.serve.replica.EngineReplica`).

What runs where: this process runs uvicorn and the FastAPI app (routes, validation, tokenizing prompts, streaming,
``/metrics``, the live page), bound to localhost unless ``--host`` says otherwise; Ray Serve's own HTTP proxy is not
started. Each replica is a Ray actor holding one engine. A request becomes one streaming call to a replica chosen by
Ray Serve (the less busy of two drawn at random); its events come back as they are made.

How it fails: a replica that dies (killed, out of memory, its node lost) fails only the requests it was decoding. A
request that had received no text yet is sent again, to a live replica (``retries`` times); one that had is ended
with a clear error (HTTP 503 for a request that is not streamed, an error event in a stream; ``code:
replica_failed``). Ray Serve replaces the dead replica; meanwhile the others serve new requests, and the server stays
up. A client that leaves cancels its replica stream, and the replica's worker stops the job between two rounds.
"""

from __future__ import annotations

import asyncio
import logging
import uuid

from kangaroo_core.errors import KangarooError, UsageError
from kangaroo_apps.serve.metrics import ServerMetrics
from kangaroo_apps.serve.protocol import ApiError
from kangaroo_apps.serve.replica import EngineFacts, EngineReplica, from_wire
from kangaroo_apps.serve.worker import Delta, Failed, Finished, Job
from kangaroo_tools.ray_cluster import failure_reason, import_ray

log = logging.getLogger("kangaroo.serve")

APP_NAME = "kangaroo"
DEPLOYMENT_NAME = "kangaroo-engine"
#: how often a request waiting on its replica checks whether its client went away
CANCEL_POLL_SECONDS = 0.2
#: the metric hooks a replica may relay (anything else is ignored: the front never calls what it does not know)
RELAYED = {"round", "finished", "observe_batch", "first_token", "request_started", "request_done", "cancelled"}


def parse_replicas(text: str) -> tuple[int, int]:
    """``--replicas N`` (a fixed count) or ``MIN-MAX`` (Ray Serve autoscales between them) → (min, max)."""
    low, sep, high = str(text).partition("-")
    try:
        bounds = (int(low), int(high) if sep else int(low))
    except ValueError:
        bounds = (0, -1)
    if bounds[0] < 1 or bounds[1] < bounds[0]:
        raise UsageError(f"--replicas takes N >= 1 or MIN-MAX with 1 <= MIN <= MAX, got {text!r}")
    return bounds


def deploy_replicas(make_engine, *, replicas: tuple[int, int], threads: int, queue_size: int, max_batch: int,
                    num_cpus: float | None = None, num_gpus: float = 0):
    """Start Ray Serve (no HTTP proxy) and the engine deployment; returns its handle once every replica has loaded
    its engine. ``replicas``: (min, max) — equal for a fixed count, else autoscaling on requests in flight."""
    ray = import_ray()
    from ray import serve

    serve.start(proxy_location="Disabled")  # the kangaroo front in this process is the only HTTP server
    low, high = replicas
    scaling = ({"num_replicas": low} if low == high else
               {"autoscaling_config": {"min_replicas": low, "max_replicas": high, "initial_replicas": low,
                                       "target_ongoing_requests": max(1, max_batch)}})
    deployment = serve.deployment(EngineReplica, name=DEPLOYMENT_NAME).options(
        ray_actor_options={"num_cpus": threads if num_cpus is None else num_cpus, "num_gpus": num_gpus},
        max_ongoing_requests=queue_size + max_batch,  # the replica's own queue bounds it; the front admits fewer
        health_check_period_s=2, health_check_timeout_s=60, graceful_shutdown_timeout_s=5,
        logging_config={"log_level": "WARNING", "enable_access_log": False},  # no log line per request
        **scaling)
    try:
        return serve.run(deployment.bind(make_engine, threads, queue_size, max_batch), name=APP_NAME,
                         route_prefix=None)
    except (RuntimeError, ray.exceptions.RayError) as exc:
        reason = _deployment_error() or failure_reason(exc)
        shutdown_replicas()
        raise KangarooError(f"the engine replicas could not start: {reason}") from None


def _deployment_error() -> str | None:
    """Why the deployment failed, from Ray Serve's status: its message ends with the constructor's own error
    ("module.Error: message"), e.g. the model that could not load."""
    from ray import serve

    try:
        deployment = serve.status().applications[APP_NAME].deployments[DEPLOYMENT_NAME]
    except Exception:  # no status to read: the caller falls back to Ray's own words
        return None
    lines = [line.strip() for line in (deployment.message or "").splitlines() if line.strip()]
    if not lines:
        return None
    name, _, message = lines[-1].partition(": ")
    return f"{name.rsplit('.', 1)[-1]}: {message}" if message and " " not in name else lines[-1]


def shutdown_replicas() -> None:
    from ray import serve

    serve.shutdown()


def describe(handle) -> EngineFacts:
    """The engine the replicas hold (asked of one of them), for the front's routes."""
    return handle.describe.remote().result()


class ReplicaDispatcher:
    """The front's worker (the interface of :class:`~kangaroo_apps.serve.worker.EngineWorker` that the app uses):
    admits up to ``queue_size`` requests beyond what the replicas decode at once, and streams each one from a
    replica into its :class:`Job`'s events."""

    def __init__(self, handle, metrics: ServerMetrics, *, replicas: int, queue_size: int = 16, max_batch: int = 1,
                 retries: int = 2):
        self.handle, self.metrics = handle, metrics
        self.replicas, self.queue_size, self.max_batch, self.retries = replicas, queue_size, max_batch, retries
        self.in_flight = 0
        self.stopping = False
        self.tasks: set[asyncio.Task] = set()
        metrics.queue_depth.set_function(self.depth)

    @property
    def capacity(self) -> int:
        return self.queue_size + self.replicas * self.max_batch

    @property
    def alive(self) -> bool:
        return not self.stopping

    def start(self) -> None:
        pass  # the replicas run already (deploy_replicas waited for them)

    def stop(self, timeout: float = 10.0) -> None:
        self.stopping = True
        for task in list(self.tasks):
            task.get_loop().call_soon_threadsafe(task.cancel)

    def depth(self) -> int:
        """Requests admitted and not finished (waiting at a replica or decoding)."""
        return self.in_flight

    def submit(self, job: Job) -> None:
        """Admit ``job`` (called on the event loop) or refuse it at once: 503 while stopping, 429 when full."""
        if self.stopping:
            raise ApiError(503, "the server is shutting down", type="server_error", code="shutdown")
        if self.in_flight >= self.capacity:
            wait = self.metrics.retry_after(self.depth(), parallel=self.replicas * self.max_batch)
            raise ApiError(429, f"the server is busy: {self.queue_size} requests are already waiting; retry later",
                           type="rate_limit_error", code="queue_full", headers={"Retry-After": wait})
        self.in_flight += 1
        task = job.loop.create_task(self._pump(job))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _pump(self, job: Job) -> None:
        ray = import_ray()
        request = {"prompt_ids": job.prompt_ids, "max_new_tokens": job.max_new_tokens, "sampling": job.sampling,
                   "stops": tuple(job.stops)}
        state = {"delivered": False, "ended": False}
        try:
            for attempt in range(self.retries + 1):
                request["key"] = uuid.uuid4().hex  # this attempt's name in the replica's metric calls
                try:
                    await self._stream(self.handle.options(stream=True).generate.remote(request), job, state)
                    return
                except ray.exceptions.RayError as exc:
                    self.metrics.request_done(key=request["key"])  # the replica cannot close its books any more
                    if state["ended"]:
                        return  # the answer was whole; only the trailing metrics were lost
                    reason = failure_reason(exc)
                    if not state["delivered"] and attempt < self.retries and not job.cancelled.is_set():
                        log.warning("kangaroo serve: a replica failed before answering (%s); trying another", reason)
                        continue
                    log.warning("kangaroo serve: a replica failed mid-answer (%s)", reason)
                    job.events.put_nowait(Failed(ApiError(
                        503, f"the engine replica serving this request failed ({reason}); retry the request",
                        type="server_error", code="replica_failed", headers={"Retry-After": "1"})))
                    return
        except asyncio.CancelledError:
            if not state["ended"]:
                job.events.put_nowait(Failed(ApiError(503, "the server is shutting down", type="server_error",
                                                      code="shutdown")))
            raise
        finally:
            self.in_flight -= 1

    async def _stream(self, stream, job: Job, state: dict) -> None:
        """Forward one replica stream's events into ``job``; cancel it when the client goes away first."""
        items = stream.__aiter__()
        pending = None
        try:
            while True:
                if pending is None:
                    pending = asyncio.ensure_future(items.__anext__())
                done, _ = await asyncio.wait({pending}, timeout=CANCEL_POLL_SECONDS)
                # after the last event the HTTP side cancels the job as a matter of course: keep reading the
                # trailing metrics; before it, the client went away and the replica stops the job
                if job.cancelled.is_set() and not state["ended"]:
                    stream.cancel()
                    return
                if not done:
                    continue
                try:
                    wire, calls = pending.result()
                except StopAsyncIteration:
                    return
                pending = None
                self._replay(calls)
                if wire is None:
                    continue
                event = from_wire(wire)
                if isinstance(event, Delta):
                    state["delivered"] = True
                state["ended"] = isinstance(event, (Finished, Failed))
                job.events.put_nowait(event)
        finally:
            if pending is not None and not pending.done():
                pending.cancel()

    def _replay(self, calls) -> None:
        for name, args in calls:
            if name not in RELAYED:
                continue
            if name == "cancelled":
                self.metrics.cancelled.inc(*args)
            elif name in ("request_started", "request_done"):
                getattr(self.metrics, name)(*args[:-1], key=args[-1])
            else:
                getattr(self.metrics, name)(*args)


def replica_app(handle, *, replicas: int, model_id: str | None = None, queue_size: int = 16, max_batch: int = 1,
                max_request_bytes: int | None = None, retries: int = 2):
    """The OpenAI-compatible app (:func:`kangaroo_apps.serve.app.create_app`) in front of deployed replicas."""
    from kangaroo_apps.serve.app import DEFAULT_MAX_REQUEST_BYTES, create_app

    def dispatcher(metrics: ServerMetrics) -> ReplicaDispatcher:
        return ReplicaDispatcher(handle, metrics, replicas=replicas, queue_size=queue_size, max_batch=max_batch,
                                 retries=retries)

    return create_app(describe(handle), model_id=model_id, queue_size=queue_size, max_batch=max_batch,
                      max_request_bytes=max_request_bytes or DEFAULT_MAX_REQUEST_BYTES, worker_factory=dispatcher)
