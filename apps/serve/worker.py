"""One engine, one thread, a bounded queue: requests are decoded in arrival order, one at a time.

The HTTP side (asyncio) never touches the engine: it puts a :class:`Job` on the queue (a full queue is refused at
once) and reads the job's events — :class:`Delta` per verify round, then :class:`Finished` or :class:`Failed` —
which the worker thread hands over with ``loop.call_soon_threadsafe``. A job whose client went away is cancelled:
the worker stops it between two rounds (or skips it if it has not started).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Sequence

import attrs

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


class EngineWorker:
    """Decodes queued jobs on one thread with one engine (``queue_size`` jobs may wait behind the running one)."""

    def __init__(self, engine, metrics: ServerMetrics, queue_size: int = 16):
        self.engine, self.metrics = engine, metrics
        self.queue: queue.Queue[Job | None] = queue.Queue(maxsize=queue_size)
        self.running: Job | None = None
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
        """Jobs waiting plus the one running."""
        return self.queue.qsize() + (self.running is not None)

    def submit(self, job: Job) -> None:
        """Queue ``job``, or refuse at once with 429 when the queue is full."""
        if not self.alive or self.stopping:
            raise ApiError(503, "the engine is not running", type="server_error", code="engine_down")
        try:
            self.queue.put_nowait(job)
        except queue.Full:
            raise ApiError(429, f"the server is busy: {self.queue.maxsize} requests are already waiting; retry "
                                "later", type="rate_limit_error", code="queue_full", headers={"Retry-After": "1"}) from None

    # -- the thread ------------------------------------------------------------------------------------------------
    def _run(self) -> None:
        while (job := self.queue.get()) is not None:
            if job.cancelled.is_set():
                self.metrics.cancelled.inc()
                continue
            self.running = job
            try:
                self._serve(job)
            except Exception as exc:  # a bug or a runtime failure: this request fails, the server goes on
                log.exception("generation failed")
                job.emit(Failed(ApiError(500, f"generation failed: {type(exc).__name__}: {exc}", type="server_error")))
            finally:
                self.running = None

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
