"""One engine, one thread, a bounded queue: requests are taken in arrival order and decoded up to ``max_batch``
together (``kangaroo serve --max-batch N``; 1: one at a time).

The HTTP side (asyncio) never touches the engine: it puts a :class:`Job` on the queue (a full queue is refused at
once) and reads the job's events — :class:`Delta` per verify round, then :class:`Finished` or :class:`Failed` —
which the worker thread hands over with ``loop.call_soon_threadsafe``. A job whose client went away is cancelled:
the worker stops it between two passes (or skips it if it has not started).

One path serves every request: the worker thread drives a :class:`~kangaroo_core.batching.Batch` of the engine,
taking jobs off the queue while fewer than ``max_batch`` decode (the queue bound counts waiting jobs only), each a
stream with its own sampling settings, and runs the batch's passes. Each stream decodes exactly what its prompt
decodes alone; its rounds become events in :meth:`EngineWorker._round`. An engine that cannot decode several
streams at once is a batch whose streams take turns.
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

from kangaroo_core.batching import Batch, Cancelled
from kangaroo_core.config import SamplingConfig
from kangaroo_core.errors import KangarooError
from kangaroo_core.text_pieces import TextPieces
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
        self.stops = [s for s in stops if s]
        self.pieces = TextPieces(tokenizer)
        self.text = ""
        self.flags: list[bool] = []  # per character of self.text: came from an accepted draft
        self.sent = 0  # characters of self.text already released
        self.stopped = False

    def add(self, tokens: Sequence[int], from_drafts: int) -> list[tuple[str, bool]]:
        """Feed one round's tokens (the first ``from_drafts`` are accepted drafts); return the text now final."""
        for i, token in enumerate(tokens):  # an unfinished character's text comes with a later token
            self.flags.extend([i < from_drafts] * len(self.pieces.add([int(token)])))
        self.text = self.pieces.text
        return self._release(self._final_end())

    def flush(self) -> list[tuple[str, bool]]:
        """The generation ended: everything not cut by a stop string is final (a last incomplete character too)."""
        if self.stopped:
            return []
        tail = self.pieces.finish()
        if tail:
            self.flags.extend([False] * len(tail))
            self.text = self.pieces.text
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


@attrs.define(eq=False)
class _Running:
    """A job decoding in the batch: its stream, its text so far and its counters."""

    job: Job
    text: TextAssembler
    stats: dict
    stream: object = None  # its kangaroo_core.batching.Stream
    stopped: bool = False  # a stop string completed: its stream was cancelled for it


class EngineWorker:
    """Decodes queued jobs on one thread with one engine, up to ``max_batch`` together (a batch of one with
    ``max_batch=1``; one at a time whatever ``max_batch`` for an engine that cannot decode several streams at
    once); ``queue_size`` jobs may wait behind the running ones."""

    def __init__(self, engine, metrics: ServerMetrics, queue_size: int = 16, max_batch: int = 1):
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.engine, self.metrics = engine, metrics
        self.batch = Batch(engine, max_batch)
        if max_batch > 1 and self.batch.alone:
            log.warning("kangaroo serve: decoding one request at a time (--max-batch %d ignored): %s", max_batch,
                        self.batch.alone)
        self.max_batch = self.batch.max_batch
        self.queue_size = queue_size  # jobs that may wait; the queue also holds jobs bound for free slots
        self.queue: queue.Queue[Job | None] = queue.Queue(maxsize=queue_size + self.max_batch)
        self.active: dict[Job, _Running] = {}  # the jobs decoding in the batch
        self.stopping = False
        self.thread = threading.Thread(target=self._run, name="kangaroo-engine", daemon=True)
        metrics.queue_depth.set_function(self.depth)

    def start(self) -> None:
        self.thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Cancel what waits and what runs (their clients get a 503 event), and end the thread."""
        self.stopping = True  # submit refuses from now on, so the queue only shrinks
        for job in list(self.active):
            job.cancel()
        while True:
            try:
                job = self.queue.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.cancel()
                _shutting_down(job)
        self.queue.put(None, timeout=timeout)
        self.thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self.thread.is_alive()

    def depth(self) -> int:
        """Jobs waiting plus those running."""
        return self.queue.qsize() + len(self.active)

    def submit(self, job: Job) -> None:
        """Queue ``job``, or refuse at once with 429 when the queue is full."""
        if not self.alive or self.stopping:
            raise ApiError(503, "the engine is not running", type="server_error", code="engine_down")
        try:
            # a job queued while a slot is free is about to decode, not waiting (the engine thread takes jobs
            # between two passes). Only the HTTP side's thread submits; a job the engine thread is taking at this
            # very moment may let one more in.
            if self.queue.qsize() >= self.queue_size + self.max_batch - len(self.active):
                raise queue.Full
            self.queue.put_nowait(job)
        except queue.Full:
            # metrics hook: queue depth x mean seconds per request / requests decoding at once
            wait = self.metrics.retry_after(self.depth(), parallel=self.max_batch)
            raise ApiError(429, f"the server is busy: {self.queue_size} requests are already waiting; retry "
                                "later", type="rate_limit_error", code="queue_full", headers={"Retry-After": wait}) from None

    # -- the thread: it drives the batch; the streams report their rounds ----------------------------------------
    def _run(self) -> None:
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
                    self._start(job)
            if not self.active:
                continue
            seen = len(self.batch.sizes)
            try:
                self.batch.step()
            except Exception as exc:  # a bug in the batch: its jobs fail, the server goes on with a fresh batch
                log.exception("a pass failed")
                for run in list(self.active.values()):
                    run.job.cancel()  # its stream, if it still runs, sends nothing more
                    run.stream.cancel()
                    self._fail(run, exc)
                self.batch = Batch(self.engine, self.max_batch)
                continue
            for size in self.batch.sizes[seen:]:
                self.metrics.observe_batch(size)  # metrics hook: streams in each pass
            for run in list(self.active.values()):
                if self.stopping:
                    run.job.cancel()
                if run.job.cancelled.is_set() and not run.stream.cancelled:
                    run.stream.cancel()  # the client went away: the stream stops before its next pass
                if run.stream.finished.is_set():
                    self._end(run)

    def _start(self, job: Job) -> None:
        """Submit ``job`` to the batch as a stream (or skip it: cancelled, shutting down, bad sampling)."""
        if job.cancelled.is_set() or self.stopping:
            self.metrics.cancelled.inc()
            if self.stopping:
                job.cancel()
                _shutting_down(job)
            return
        self.metrics.request_started(time.perf_counter() - job.enqueued, key=job)  # metrics hook: queue wait
        stats = {"new_tokens": 0, "verify_passes": 0, "drafted": 0, "accepted_drafts": 0, "engine_seconds": 0.0,
                 "queue_seconds": time.perf_counter() - job.enqueued}
        run = _Running(job, TextAssembler(self.engine.backend.tokenizer, job.stops), stats)
        try:
            run.stream = self.batch.submit(job.prompt_ids, max_new_tokens=job.max_new_tokens, sampling=job.sampling,
                                           on_tokens=functools.partial(self._round, run), key=id(job))
        except KangarooError as exc:  # refused sampling settings: a 400 before any decoding
            job.emit(Failed(ApiError(400, str(exc))))
            self.metrics.request_done(key=job)
            return
        except Exception as exc:
            log.exception("generation failed")
            self._fail(run, exc)
            return
        self.active[job] = run

    def _round(self, run: _Running, emitted) -> None:
        """A stream's round (called on the engine thread, inside the stream): counters, metrics and events."""
        job, stats = run.job, run.stats
        stats["engine_seconds"] = time.perf_counter() - run.stream.started_at
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
                    _shutting_down(job)
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


def _shutting_down(job: Job) -> None:
    job.emit(Failed(ApiError(503, "the server is shutting down", type="server_error", code="shutdown")))


def _summary(stats: dict) -> dict:
    """Kangaroo's counters for a response: CR = tokens per verify pass (the prefill's token not counted);
    ``engine_seconds``: from the request's first pass to its latest round (the wall time it decoded, passes shared
    with other requests included; ``queue_seconds`` before it)."""
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
