"""Many streams at once: continuous batching in which each stream runs the single-stream loop unchanged.

Every stream is an :class:`~kangaroo_core.engine.Engine` of its own (a forked drafter, a copy of the policy and
tree shaper, its verifier and seed) on a :meth:`~kangaroo_core.interfaces.Backend.stream_view` of the backend (a KV
slot), decoding in a greenlet of its own. Its backend calls and draft steps wait until every running stream waits,
then run merged — all pending M[:l] passes as one (:meth:`Backend.shallow_many`), else all draft steps as one
(:meth:`SelfDrafter.advance_many`), or, once no stream drafts, all verify passes of M[l:] as one
(:meth:`Backend.deep_many`). A stream joins (its prompt prefilled alone) or leaves between passes.

Lossless by construction: each stream executes exactly the single-stream algorithm, and a backend whose merged
pass computes every row as that stream's own pass would (the torch backend on CPU: see
:mod:`kangaroo_backends.ragged`) makes its tokens identical to decoding the prompt alone, whatever shares its
passes and whenever it joined. Greenlets, not threads: every stream's work and every pass runs on the thread that
drives the batch, one at a time, so streams never compete for the cores and torch keeps one OpenMP team (idle
teams of other threads slowed each pass by half, measured). Drive a batch from one thread.

Each stream's engine is made by :meth:`Engine.for_stream <kangaroo_core.engine.Engine.for_stream>`, as building an
engine binds its pieces: a stateful policy or tree shaper decides for its own stream only. An engine that cannot
decode several streams at once (its backend has no stream views, or its drafter cannot fork) still runs in a batch:
one stream at a time, on the engine's own caches (:attr:`Batch.alone` says why).
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any, Callable

import attrs
import greenlet
import torch

from kangaroo_core.config import ConfigError, SamplingConfig
from kangaroo_core.machine import host_threads
from kangaroo_core.results import Emitted, GenerationResult
from kangaroo_core.text_pieces import TextPieces


class Cancelled(Exception):
    """Raised inside a stream's thread when its consumer cancelled it."""


@attrs.define
class _Request:
    kind: str  # "shallow", "draft" or "deep"
    part: tuple
    result: Any = None
    error: BaseException | None = None


class _Waiting:
    """A stream's backend (its stream view) or drafter (its fork): the calls a subclass names wait for the batch's
    next merged pass of their kind; everything else is the stream's own object's."""

    def __init__(self, own, batch: "Batch", stream: "Stream"):
        self._own, self._batch, self._stream = own, batch, stream

    def __getattr__(self, name: str):
        return getattr(self._own, name)


class _StreamBackend(_Waiting):
    @property
    def streams(self) -> int:
        """The streams decoding in this batch now (whose passes this stream's are merged with)."""
        return max(1, self._batch.running)

    def shallow(self, token_ids, start, tree=None):
        return self._batch._submit(self._stream, "shallow", (self._own, list(token_ids), start, tree))

    def deep(self, hidden, start, rows=None, tree=None):
        return self._batch._submit(self._stream, "deep", (self._own, hidden, start, rows, tree))


class _StreamDrafter(_Waiting):
    def advance(self, token_ids, hidden):  # merged by SelfDrafter.advance_many
        return self._batch._submit(self._stream, "draft", (self._own, token_ids, hidden))


class Stream(Iterator[str]):
    """One prompt decoding in a :class:`Batch`: iterate for its text pieces (iterating drives the batch), or
    :meth:`wait` for its :class:`GenerationResult`. ``on_tokens`` (given to :meth:`Batch.submit`) is called with
    each round's :class:`Emitted` tokens (on the thread that drives the batch); :meth:`cancel` stops it before its
    next pass."""

    def __init__(self, batch: "Batch", prompt_ids: list[int], max_new_tokens: int, sampling: SamplingConfig | None,
                 on_tokens: Callable[[Emitted], None] | None, key: Any):
        self.batch, self.prompt_ids, self.max_new_tokens = batch, prompt_ids, max_new_tokens
        self.sampling, self.on_tokens, self.key = sampling, on_tokens, key
        self.result: GenerationResult | None = None
        self.error: BaseException | None = None
        self.cancelled = False
        self.finished = threading.Event()
        self.started_at: float | None = None
        self._tokens: list[int] = []  # emitted so far; turned into text only when the stream is iterated
        self._read = 0
        self._pieces = TextPieces(batch.engine.backend.tokenizer)

    def cancel(self) -> None:
        """Stop before its next pass (any thread may cancel)."""
        self.cancelled = True

    def _emit(self, emitted: Emitted) -> None:
        if self.on_tokens is not None:
            self.on_tokens(emitted)
        self._tokens.extend(emitted)

    def wait(self) -> GenerationResult:
        """Drive the batch until this stream ends; its result (raises its error, :class:`Cancelled` if cancelled)."""
        while not self.finished.is_set():
            self.batch.step()
        if self.error is not None:
            raise self.error
        return self.result

    def __next__(self) -> str:
        while True:
            if self._read < len(self._tokens):
                new, self._read = self._tokens[self._read:], len(self._tokens)
                piece = self._pieces.add(new)
                if piece:
                    return piece
            elif self.finished.is_set():
                if self.error is not None:
                    raise self.error
                tail = self._pieces.finish(self.result.text)
                if tail:
                    return tail
                raise StopIteration
            else:
                self.batch.step()


class Batch:
    """Up to ``max_batch`` streams of ``engine`` decoding together; more wait in line (first come, first served).

    ``submit`` adds a stream (a prompt, a token budget, its own sampling settings and seed; any thread may submit);
    ``step`` runs the streams up to their next backend call and then one merged pass (drive it from one thread: a
    stream's iteration and :meth:`Stream.wait` do); ``generate`` is the blocking form. ``passes`` counts merged
    passes (draft steps too; by kind in ``kinds``), ``streams_per_pass`` the stream passes they held, ``sizes`` the
    streams in each. An engine that cannot decode several streams at once (no stream views, or a drafter without
    fork) runs one stream at a time on its own caches: :attr:`alone` says why and ``max_batch`` is 1.
    """

    def __init__(self, engine, max_batch: int = 4):
        if max_batch < 1:
            raise ConfigError(f"max_batch must be >= 1, got {max_batch}")
        self.engine = engine
        self._lock = threading.Lock()  # guards the line (submit may come from other threads)
        self._line: collections.deque[Stream] = collections.deque()
        self._running: dict[Stream, greenlet.greenlet] = {}
        self._ready: list[Stream] = []  # streams to resume (new ones, and those whose pass has run)
        self._pending: list[tuple[Stream, _Request]] = []
        #: why this engine's streams take turns on its own caches (None: they decode together)
        self.alone: str | None = None
        self._views: list = []  # stream views (KV slots) of finished streams, reused
        try:  # the first view made now, so that an engine that cannot fork is known before any stream runs
            self._views.append(engine.backend.stream_view())
            if engine.drafter is not None:
                engine.drafter.fork(self._views[0])
        except NotImplementedError as exc:
            self.alone, self._views = str(exc) or type(exc).__name__, [engine.backend]
        self.max_batch = 1 if self.alone else max_batch
        self._hub: greenlet.greenlet | None = None
        self.passes = self.streams_per_pass = 0
        self.sizes: list[int] = []
        self.kinds: collections.Counter[str] = collections.Counter()  # merged passes by kind: shallow, draft, deep

    # -- streams ------------------------------------------------------------------------------------------------------
    def submit(self, prompt, *, chat: bool = True, max_new_tokens: int | None = None,
               sampling: SamplingConfig | None = None, on_tokens: Callable[[Emitted], None] | None = None,
               key: Any = None) -> Stream:
        """Queue a prompt (text, chat messages, or token ids as a list of ints); returns its :class:`Stream`.
        A prompt that does not fit, or sampling settings the engine refuses, raise here."""
        ids = list(prompt) if _is_ids(prompt) else self.engine.encode(prompt, chat=chat)
        budget = self.engine.token_budget(max_new_tokens)
        self.engine.check_fits(len(ids), budget)
        if sampling is not None:
            self.engine.with_sampling(sampling)  # settings its engine would refuse are refused here, in one line
        stream = Stream(self, ids, budget, sampling, on_tokens, key)
        with self._lock:
            self._line.append(stream)
        return stream

    def generate(self, prompts: Sequence, **options: Any) -> list[GenerationResult]:
        """Decode every prompt (up to ``max_batch`` at once); results in input order."""
        return [stream.wait() for stream in [self.submit(p, **options) for p in prompts]]

    @property
    def running(self) -> int:
        """Streams decoding now (what a stream's passes are merged with: the cost policy reads it)."""
        return len(self._running)

    def _engine_for(self, stream: Stream, view):
        """The stream's engine, on ``view`` behind a wrapper that hands its passes to the batch."""
        base, drafter = self.engine, self.engine.drafter  # taking turns on the engine's own caches: its own drafter
        if drafter is not None and not self.alone:
            drafter = _StreamDrafter(drafter.fork(view), self, stream)
        return base.for_stream(_StreamBackend(view, self, stream), stream.sampling, drafter=drafter)

    def _admit(self) -> None:
        """Start queued streams while there is room."""
        with self._lock:
            while self._line and len(self._running) < self.max_batch:
                stream = self._line.popleft()
                if stream.cancelled:
                    stream.error = Cancelled()
                    stream.finished.set()
                    continue
                view = self._views.pop() if self._views else self.engine.backend.stream_view()
                self._running[stream] = greenlet.greenlet(lambda s=stream, v=view: self._run(s, v))
                self._ready.append(stream)

    def _run(self, stream: Stream, view) -> None:
        loop = None
        try:
            stream.started_at = time.perf_counter()
            loop = self._engine_for(stream, view).decode(stream.prompt_ids, stream.max_new_tokens)
            while True:
                try:
                    emitted = next(loop)
                except StopIteration as stop:
                    stream.result = stop.value
                    break
                stream._emit(emitted)
                if stream.cancelled:
                    raise Cancelled()
        except BaseException as exc:  # the stream's error is its consumer's; the batch goes on
            stream.error = exc
        finally:
            if loop is not None:
                loop.close()
            del self._running[stream]
            self._views.append(view)
            stream.finished.set()

    def _submit(self, stream: Stream, kind: str, part: tuple):
        """Called inside a stream's greenlet: hand over to the batch until the merged pass that runs this request."""
        if stream.cancelled:
            raise Cancelled()
        request = _Request(kind, part)
        self._pending.append((stream, request))
        self._hub.switch()
        if request.error is not None:
            raise request.error
        return request.result

    # -- passes ---------------------------------------------------------------------------------------------------------
    def step(self) -> bool:
        """Admit waiting streams, run every stream up to its next backend call, then one merged pass. False when
        nothing is running or waiting."""
        with host_threads(self.engine.backend):
            return self._step()

    def _step(self) -> bool:
        self._hub = greenlet.getcurrent()
        self._admit()
        while self._ready:
            ready, self._ready = self._ready, []
            for stream in ready:
                self._running[stream].switch()  # back here at its next backend call, or when it ends
            self._admit()  # finished streams made room
        if not self._pending:
            return bool(self._running or self._line)
        # verify passes wait for every stream to finish drafting: a stream's next call after M[:l] is its draft step
        kind = next(k for k in ("shallow", "draft", "deep") if any(r.kind == k for _, r in self._pending))
        chosen = [(s, r) for s, r in self._pending if r.kind == kind]
        self._pending = [p for p in self._pending if p not in chosen]
        cancelled = [(s, r) for s, r in chosen if s.cancelled]
        for _, request in cancelled:
            request.error = Cancelled()
        chosen = [c for c in chosen if c not in cancelled]
        if chosen:
            self._run_pass([r for _, r in chosen])
        self._ready.extend(s for s, _ in cancelled + chosen)
        return True

    def _run_pass(self, requests: list[_Request]) -> None:
        kind, backend = requests[0].kind, self.engine.backend
        try:
            run = {"shallow": backend.shallow_many, "deep": backend.deep_many}.get(kind) or self.engine.drafter.advance_many
            with torch.inference_mode():
                results = run([r.part for r in requests])
            for request, result in zip(requests, results, strict=True):  # a plugin's short list: every stream errs
                request.result = result
        except Exception as exc:  # e.g. out of memory: every stream of the pass gets the error
            for request in requests:
                request.error = exc
        self.passes += 1
        self.streams_per_pass += len(requests)
        self.sizes.append(len(requests))
        self.kinds[kind] += 1


def _is_ids(prompt) -> bool:
    return isinstance(prompt, (list, tuple)) and bool(prompt) and all(isinstance(t, int) for t in prompt)
