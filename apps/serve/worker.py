"""One engine, one thread, a bounded queue: requests are taken in arrival order and decoded one at a time, or up to
``max_batch`` together (``kangaroo serve --max-batch N``).

The HTTP side (asyncio) never touches the engine: it puts a :class:`Job` on the queue (a full queue is refused at
once) and reads the job's events — :class:`Delta` per verify round, then :class:`Finished` or :class:`Failed` —
which the worker thread hands over with ``loop.call_soon_threadsafe``. A job whose client went away is cancelled:
the worker stops it between two rounds (or skips it if it has not started).

With ``max_batch > 1`` the worker thread drives a :class:`~kangaroo_core.batching.Batch` of the engine: it takes
jobs off the queue while fewer than ``max_batch`` decode (the queue bound counts waiting jobs only), each a stream
with its own sampling settings, and runs the batch's merged passes. Each stream decodes exactly what its prompt
decodes alone, and its rounds become the same events as unbatched (stream threads call :meth:`EngineWorker._round`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import queue
import threading
import time
from collections.abc import Sequence

import attrs

from kangaroo_core.batching import Cancelled
from kangaroo_core.config import SamplingConfig
from kangaroo_core.errors import KangarooError
from kangaroo_apps.serve.metrics import ServerMetrics
from kangaroo_apps.serve.protocol import ApiError

log = logging.getLogger("kangaroo.serve")


@attrs.frozen
class Delta:
    """Text that became final in one round: ``segments`` are (text, from_draft) runs; counters so far."""

    segments: tuple[tuple[str, bool], ...]
    stats: dict


@attrs.frozen
class Finished:
    text: str
    finish_reason: str  # "stop" (EOS or a stop string) or "length"
    prompt_tokens: int
    completion_tokens: int
    stats: dict


@attrs.frozen
class Failed:
    error: ApiError


@attrs.define(eq=False)
class Job:
    """One request's work. ``events`` lives on the HTTP side's event loop; the worker only calls :meth:`emit`."""

    prompt_ids: list[int]
    max_new_tokens: int
    sampling: SamplingConfig
    stops: Sequence[str]
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = attrs.field(factory=asyncio.Queue)
    cancelled: threading.Event = attrs.field(factory=threading.Event)
    enqueued: float = attrs.field(factory=time.perf_counter)

    def emit(self, event) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop is closed (server shutting down): nobody is listening
            self.cancelled.set()

    def cancel(self) -> None:
        self.cancelled.set()


class TextAssembler:
    """Token ids → text segments tagged "from an accepted draft" or "the target's own token".

    Text is released only once final: an unfinished multi-byte character waits for its next token, and text that
    could still turn into a stop string is held back until it cannot (the stop string itself is never sent).
    """

    def __init__(self, tokenizer, stops: Sequence[str]):
        self.tokenizer, self.stops = tokenizer, [s for s in stops if s]
        self.tokens: list[int] = []
        self.text = ""
        self.flags: list[bool] = []  # per character of self.text: came from an accepted draft
        self.sent = 0  # characters of self.text already released
        self.stopped = False

    def add(self, tokens: Sequence[int], from_drafts: int) -> list[tuple[str, bool]]:
        """Feed one round's tokens (the first ``from_drafts`` are accepted drafts); return the text now final."""
        for i, token in enumerate(tokens):
            self.tokens.append(int(token))
            text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
            if text.endswith("\ufffd") or not text.startswith(self.text):
                continue  # an incomplete character: its text comes with a later token
            self.flags.extend([i < from_drafts] * (len(text) - len(self.text)))
            self.text = text
        end = self._final_end()
        return self._release(end)

    def flush(self) -> list[tuple[str, bool]]:
        """The generation ended: everything not cut by a stop string is final (a last incomplete character too)."""
        if self.stopped:
            return []
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        if text.startswith(self.text) and len(text) > len(self.text):
            self.flags.extend([False] * (len(text) - len(self.text)))
            self.text = text
            end = self._final_end()  # a stop string may sit in the late characters
            if self.stopped:
                return self._release(end)
        return self._release(len(self.text))

    @property
    def final_text(self) -> str:
        return self.text[: self.sent]

    def _final_end(self) -> int:
        if not self.stops:
            return len(self.text)
        start = max(0, self.sent - max(map(len, self.stops)))
        hits = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            return max(min(hits), self.sent)
        held = max((k for s in self.stops for k in range(1, len(s)) if self.text.endswith(s[:k])), default=0)
        return max(len(self.text) - held, self.sent)

    def _release(self, end: int) -> list[tuple[str, bool]]:
        segments: list[tuple[str, bool]] = []
        for i in range(self.sent, end):
            if segments and segments[-1][1] == self.flags[i]:
                segments[-1] = (segments[-1][0] + self.text[i], self.flags[i])
            else:
                segments.append((self.text[i], self.flags[i]))
        self.sent = max(self.sent, end)
        return segments


def batching_unsupported(engine) -> str | None:
    """Why ``engine`` cannot decode several streams at once (its backend has no stream views, its drafter cannot
    fork onto one), or None when it can. Tried on a throwaway stream view (an empty KV cache)."""
    try:
        view = engine.backend.stream_view()
        if engine.drafter is not None:
            engine.drafter.fork(view)
    except NotImplementedError as exc:
        return str(exc) or f"{type(exc).__name__}"
    return None


@attrs.define(eq=False)
class _Running:
    """A job decoding in the batch: its stream, its text so far and its counters."""

    job: Job
    text: TextAssembler
    stats: dict
    stream: object = None  # its kangaroo_core.batching.Stream
    stopped: bool = False  # a stop string completed: its stream was cancelled for it


class EngineWorker:
    """Decodes queued jobs on one thread with one engine: one at a time (``max_batch=1``) or up to ``max_batch``
    together; ``queue_size`` jobs may wait behind the running ones."""

    def __init__(self, engine, metrics: ServerMetrics, queue_size: int = 16, max_batch: int = 1):
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if max_batch > 1 and (why := batching_unsupported(engine)):
            log.warning("kangaroo serve: decoding one request at a time (--max-batch %d ignored): %s", max_batch, why)
            max_batch = 1
        self.engine, self.metrics, self.max_batch = engine, metrics, max_batch
        self.queue_size = queue_size  # jobs that may wait; batched, the queue also holds jobs bound for free slots
        self.queue: queue.Queue[Job | None] = queue.Queue(maxsize=queue_size + (max_batch if max_batch > 1 else 0))
        self.running: Job | None = None  # max_batch=1: the job decoding
        self.active: dict[Job, _Running] = {}  # max_batch>1: the jobs decoding in the batch
        self.stopping = False
        self.thread = threading.Thread(target=self._run, name="kangaroo-engine", daemon=True)
        metrics.queue_depth.set_function(self.depth)

    def start(self) -> None:
        self.thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Cancel what waits and what runs (their clients get a 503 event), and end the thread."""
        self.stopping = True  # submit refuses from now on, so the queue only shrinks
        if self.running is not None:
            self.running.cancel()
        for job in list(self.active):
            job.cancel()
        while True:
            try:
                job = self.queue.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.cancel()
                job.emit(Failed(ApiError(503, "the server is shutting down", type="server_error", code="shutdown")))
        self.queue.put(None, timeout=timeout)
        self.thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self.thread.is_alive()

    def depth(self) -> int:
        """Jobs waiting plus those running."""
        return self.queue.qsize() + (self.running is not None) + len(self.active)

    def submit(self, job: Job) -> None:
        """Queue ``job``, or refuse at once with 429 when the queue is full."""
        if not self.alive or self.stopping:
            raise ApiError(503, "the engine is not running", type="server_error", code="engine_down")
        try:
            # batched: a job queued while a slot is free is about to decode, not waiting (the engine thread takes
            # jobs between two merged passes). Only the HTTP side's thread submits; a job the engine thread is
            # taking at this very moment may let one more in.
            if self.max_batch > 1 and self.queue.qsize() >= self.queue_size + self.max_batch - len(self.active):
                raise queue.Full
            self.queue.put_nowait(job)
        except queue.Full:
            # metrics hook: queue depth x mean seconds per request / requests decoding at once
            wait = self.metrics.retry_after(self.depth(), parallel=self.max_batch)
            raise ApiError(429, f"the server is busy: {self.queue_size} requests are already waiting; retry "
                                "later", type="rate_limit_error", code="queue_full", headers={"Retry-After": wait}) from None

    # -- the thread ------------------------------------------------------------------------------------------------
    def _run(self) -> None:
        if self.max_batch > 1:
            return self._run_batched()
        while (job := self.queue.get()) is not None:
            if job.cancelled.is_set():
                self.metrics.cancelled.inc()
                continue
            self.running = job
            self.metrics.request_started(time.perf_counter() - job.enqueued)  # metrics hook: queue wait, service clock
            try:
                self._serve(job)
            except Exception as exc:  # a bug or a runtime failure: this request fails, the server goes on
                log.exception("generation failed")
                job.emit(Failed(ApiError(500, f"generation failed: {type(exc).__name__}: {exc}", type="server_error")))
            finally:
                self.running = None
                self.metrics.request_done()  # metrics hook: service time → the mean behind Retry-After

    def _serve(self, job: Job) -> None:
        try:
            engine = self.engine.with_sampling(job.sampling)
        except KangarooError as exc:
            job.emit(Failed(ApiError(400, str(exc))))
            return
        text = TextAssembler(engine.backend.tokenizer, job.stops)
        loop = engine.decode(job.prompt_ids, job.max_new_tokens)
        stats = {"new_tokens": 0, "verify_passes": 0, "drafted": 0, "accepted_drafts": 0, "engine_seconds": 0.0,
                 "queue_seconds": time.perf_counter() - job.enqueued}
        result = None
        while True:
            started = time.perf_counter()
            try:
                emitted = next(loop)
            except StopIteration as done:
                result = done.value
                break
            finally:
                stats["engine_seconds"] += time.perf_counter() - started
            self.metrics.observe_batch(1)  # metrics hooks: one request per pass until batching; the first token
            if stats["new_tokens"] == 0:
                self.metrics.first_token(time.perf_counter() - job.enqueued)
            if job.cancelled.is_set():  # the client went away (or the server stops): stop between two rounds
                loop.close()
                self.metrics.cancelled.inc()
                if self.stopping:
                    job.emit(Failed(ApiError(503, "the server is shutting down", type="server_error",
                                             code="shutdown")))
                return
            self._count(stats, emitted)
            segments = text.add(emitted, emitted.from_drafts)
            if segments:
                job.emit(Delta(tuple(segments), _summary(stats)))
            if text.stopped:
                loop.close()
                break
        tail = text.flush()
        if tail:
            job.emit(Delta(tuple(tail), _summary(stats)))
        finish = "stop" if text.stopped or (result is not None and result.stopped_on_eos) else "length"
        summary = _summary(stats)
        self.metrics.finished(len(job.prompt_ids), stats["new_tokens"], summary["tokens_per_second"])
        job.emit(Finished(text.final_text, finish, len(job.prompt_ids), stats["new_tokens"], summary))

    # -- batched: the thread drives a Batch; stream threads report rounds ----------------------------------------
    def _run_batched(self) -> None:
        batch = self.engine.batch(self.max_batch)
        ending = False  # the stop sentinel was taken: finish the running jobs, take no more
        while not ending or self.active:
            while not ending and len(self.active) < self.max_batch:  # block for a job only when none decodes
                try:
                    job = self.queue.get(block=not self.active)
                except queue.Empty:
                    break
                if job is None:
                    ending = True
                else:
                    self._start(batch, job)
            if not self.active:
                continue
            seen = len(batch.sizes)
            try:
                batch.step()
            except Exception as exc:  # a bug in the batch: its jobs fail, the server goes on with a fresh batch
                log.exception("a merged pass failed")
                for run in list(self.active.values()):
                    run.job.cancel()  # its stream's thread, if it still runs, sends nothing more
                    run.stream.cancel()
                    self._fail(run, exc)
                batch = self.engine.batch(self.max_batch)
                continue
            for size in batch.sizes[seen:]:
                self.metrics.observe_batch(size)  # metrics hook: streams in each merged pass
            for run in list(self.active.values()):
                if self.stopping:
                    run.job.cancel()
                if run.job.cancelled.is_set() and not run.stream.cancelled:
                    run.stream.cancel()  # the client went away: the stream stops before its next pass
                if run.stream.finished.is_set():
                    self._end(run)

    def _start(self, batch, job: Job) -> None:
        """Submit ``job`` to the batch as a stream (or skip it: cancelled, shutting down, bad sampling)."""
        if job.cancelled.is_set() or self.stopping:
            self.metrics.cancelled.inc()
            if self.stopping:
                job.cancel()
                job.emit(Failed(ApiError(503, "the server is shutting down", type="server_error", code="shutdown")))
            return
        self.metrics.request_started(time.perf_counter() - job.enqueued, key=job)  # metrics hook: queue wait
        try:
            engine = self.engine.with_sampling(job.sampling)  # refused settings: a 400, as unbatched
        except KangarooError as exc:
            job.emit(Failed(ApiError(400, str(exc))))
            self.metrics.request_done(key=job)
            return
        stats = {"new_tokens": 0, "verify_passes": 0, "drafted": 0, "accepted_drafts": 0, "engine_seconds": 0.0,
                 "queue_seconds": time.perf_counter() - job.enqueued}
        run = _Running(job, TextAssembler(engine.backend.tokenizer, job.stops), stats)
        try:
            run.stream = batch.submit(job.prompt_ids, max_new_tokens=job.max_new_tokens, sampling=job.sampling,
                                      on_tokens=functools.partial(self._round, run), key=id(job))
        except Exception as exc:
            log.exception("generation failed")
            self._fail(run, exc)
            return
        self.active[job] = run

    def _round(self, run: _Running, emitted) -> None:
        """A stream's round (called from its thread): the same counters, metrics and events as unbatched."""
        job, stats = run.job, run.stats
        stats["engine_seconds"] = time.perf_counter() - run.stream.started_at  # wall time in the batch so far
        if stats["new_tokens"] == 0:
            self.metrics.first_token(time.perf_counter() - job.enqueued)
        if job.cancelled.is_set():  # the client went away (or the server stops): stop between two rounds
            run.stream.cancel()
            return
        self._count(stats, emitted)
        segments = run.text.add(emitted, emitted.from_drafts)
        if segments:
            job.emit(Delta(tuple(segments), _summary(stats)))
        if run.text.stopped:  # a stop string completed: this stream ends here, the others go on
            run.stopped = True
            run.stream.cancel()

    def _end(self, run: _Running) -> None:
        """The stream of ``run`` ended (finished, stopped by a stop string, cancelled or failed): its last events."""
        job, stream, text = run.job, run.stream, run.text
        self.active.pop(job, None)
        try:
            if stream.error is None or (run.stopped and isinstance(stream.error, Cancelled)):
                tail = text.flush()
                if tail:
                    job.emit(Delta(tuple(tail), _summary(run.stats)))
                eos = stream.result is not None and stream.result.stopped_on_eos
                finish = "stop" if text.stopped or eos else "length"
                summary = _summary(run.stats)
                self.metrics.finished(len(job.prompt_ids), run.stats["new_tokens"], summary["tokens_per_second"])
                job.emit(Finished(text.final_text, finish, len(job.prompt_ids), run.stats["new_tokens"], summary))
            elif isinstance(stream.error, Cancelled):
                self.metrics.cancelled.inc()
                if self.stopping:
                    job.emit(Failed(ApiError(503, "the server is shutting down", type="server_error",
                                             code="shutdown")))
            else:
                log.error("generation failed", exc_info=stream.error)
                self._fail(run, stream.error, done=False)
        finally:
            self.metrics.request_done(key=job)  # metrics hook: service time → the mean behind Retry-After

    def _fail(self, run: _Running, exc: BaseException, done: bool = True) -> None:
        self.active.pop(run.job, None)
        run.job.emit(Failed(ApiError(500, f"generation failed: {type(exc).__name__}: {exc}", type="server_error")))
        if done:
            self.metrics.request_done(key=run.job)

    def _count(self, stats: dict, emitted) -> None:
        stats["new_tokens"] += len(emitted)
        if stats["new_tokens"] == len(emitted):
            return  # the prefill's token is not a verify pass
        stats["verify_passes"] += 1
        stats["drafted"] += emitted.drafted
        stats["accepted_drafts"] += emitted.from_drafts
        self.metrics.round(len(emitted), emitted.drafted, emitted.from_drafts)


def _summary(stats: dict) -> dict:
    """Kangaroo's counters for a response: CR = tokens per verify pass (the prefill's token not counted)."""
    passes, new = stats["verify_passes"], stats["new_tokens"]
    seconds = stats["engine_seconds"]
    return {
        "new_tokens": new,
        "verify_passes": passes,
        "drafted": stats["drafted"],
        "accepted_drafts": stats["accepted_drafts"],
        "mean_accepted_tokens": round((new - 1) / passes, 4) if passes else 0.0,
        "engine_seconds": round(seconds, 6),
        "queue_seconds": round(stats["queue_seconds"], 6),
        "tokens_per_second": round(new / seconds, 3) if seconds > 0 else 0.0,
    }
