"""The OpenAI-compatible HTTP server (FastAPI on uvicorn): routes, body parsing, streaming, errors.

Routes::

    POST /v1/chat/completions   chat (chat template applied); "stream": true answers server-sent events
    POST /v1/completions        raw-text completion; streaming likewise
    GET  /v1/models             the one served model
    GET  /health                200 {"status": "ok", ...} while the engine thread runs, else 503
    GET  /metrics               Prometheus text format (see :mod:`kangaroo_apps.serve.metrics`)
    GET  /                      the live page: type a prompt, watch accepted drafts and target tokens arrive

Every error is ``{"error": {"message", "type", "param", "code"}}`` with the status OpenAI uses; nothing a client
sends can stop the server (a failing generation fails its own request only).
"""

from __future__ import annotations

import asyncio
import copy
import json
import time
from importlib import resources
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from kangaroo_core.config import ConfigError, SamplingConfig
from kangaroo_core.engine import encode_prompt
from kangaroo_core.errors import KangarooError
from kangaroo_apps.serve import protocol
from kangaroo_apps.serve.metrics import CONTENT_TYPE_LATEST, ServerMetrics
from kangaroo_apps.serve.protocol import ApiError, ChatRequest, CompletionRequest
from kangaroo_apps.serve.worker import Delta, EngineWorker, Failed, Finished, Job

#: Request bodies larger than this are refused with 413 before they are parsed.
DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024
#: How often a non-streaming request checks whether its client is still there.
DISCONNECT_POLL_SECONDS = 0.2


def served_name(model_name: str) -> str:
    """The model id clients use: the model file's or directory's name without a .gguf suffix."""
    name = Path(str(model_name)).name or str(model_name)
    return name[:-5] if name.lower().endswith(".gguf") else name


def create_app(engine, *, model_id: str | None = None, queue_size: int = 16, default_max_tokens: int | None = None,
               max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, max_batch: int = 1,
               worker_factory=None) -> FastAPI:
    """An app serving ``engine`` (``max_batch`` requests decoding together, 1: one at a time; ``queue_size``
    waiting). Sampling defaults are the engine's config; ``default_max_tokens`` (default: the engine's
    ``max_new_tokens``) caps answers that set no ``max_tokens``.

    ``worker_factory(metrics)`` makes the worker that decodes (default: an :class:`EngineWorker` over ``engine``);
    ``kangaroo serve --replicas`` passes a dispatcher to engine replicas, and ``engine`` is then only the engine's
    description (:class:`kangaroo_apps.serve.replica.EngineFacts`)."""
    model_id = model_id or served_name(engine.backend.model_name)
    defaults = engine.config
    default_max_tokens = default_max_tokens or defaults.max_new_tokens
    context = engine.backend.max_context
    front_tokenizer = copy.deepcopy(engine.backend.tokenizer)  # the engine thread decodes with the original
    metrics = ServerMetrics(defaults.gamma)
    worker = (EngineWorker(engine, metrics, queue_size=queue_size, max_batch=max_batch) if worker_factory is None
              else worker_factory(metrics))
    started = time.time()

    async def lifespan(_app):
        worker.start()
        yield
        await run_in_threadpool(worker.stop)

    app = FastAPI(title="kangaroo", summary="Lossless self-speculative decoding behind the OpenAI API",
                  lifespan=lifespan)
    app.state.worker, app.state.metrics, app.state.model_id = worker, metrics, model_id

    # -- errors: all OpenAI-shaped -----------------------------------------------------------------------------
    @app.exception_handler(ApiError)
    async def _api_error(_request, exc: ApiError):
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(ApiError(exc.status_code, str(exc.detail), type=kind).body(), status_code=exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request, exc: RequestValidationError):
        return JSONResponse(ApiError(400, str(exc.errors()[0].get("msg", "invalid request"))).body(), status_code=400)

    @app.exception_handler(Exception)
    async def _server_error(_request, exc: Exception):
        error = ApiError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error")
        return JSONResponse(error.body(), status_code=500)

    app.add_middleware(RequestMetrics, metrics=metrics)

    # -- the two generation routes -----------------------------------------------------------------------------
    async def admit(request: Request, kind: type):
        """Body → validated request → prompt ids → a queued :class:`Job` (or an ApiError)."""
        body = await read_body(request, max_request_bytes)
        try:
            payload = json.loads(body)
        except (UnicodeDecodeError, ValueError) as exc:
            raise ApiError(400, f"the body is not valid JSON: {type(exc).__name__}: {exc}".splitlines()[0]) from None
        except RecursionError:
            raise ApiError(400, "the body is nested too deeply") from None
        if not isinstance(payload, dict):
            raise ApiError(400, "the body must be a JSON object")
        if surrogate := protocol.lone_surrogate(payload):  # before anything can reach the tokenizer (or a response)
            raise surrogate
        try:
            req = kind.model_validate(payload)
        except ValidationError as exc:
            raise protocol.validation_error(exc) from None
        if req.model != model_id:
            raise ApiError(404, f"the model '{req.model}' does not exist; this server serves '{model_id}'",
                           type="not_found_error", param="model", code="model_not_found")
        req.check_supported()
        prompt, chat = (req.conversation(), True) if isinstance(req, ChatRequest) else (req.text(), False)
        try:
            ids = await run_in_threadpool(encode_prompt, front_tokenizer, prompt, chat=chat)
        except KangarooError as exc:
            raise ApiError(400, str(exc), param="messages" if chat else "prompt") from None
        budget = req.budget or min(default_max_tokens, max(1, context - len(ids)))
        if len(ids) + budget > context:
            raise ApiError(400, f"prompt ({len(ids)} tokens) + max_tokens ({budget}) exceeds the model's context of "
                                f"{context} tokens", param="max_tokens", code="context_length_exceeded")
        job = Job(ids, budget, sampling_of(req, defaults.sampling), req.stop or (), asyncio.get_running_loop())
        worker.submit(job)
        return req, job

    async def answer(request: Request, kind: type, prefix: str, chunk, respond):
        """One generation route: streamed as server-sent events, or answered whole."""
        req, job = await admit(request, kind)
        rid = protocol.new_id(prefix)
        if req.stream:
            return sse(stream_chunks(job, req, rid, model_id, chunk))
        done = await collect(job, request)
        return respond(rid, model_id, done.text, done.finish_reason,
                       protocol.usage(done.prompt_tokens, done.completion_tokens), done.stats)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await answer(request, ChatRequest, "chatcmpl", protocol.chat_chunk, protocol.chat_response)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await answer(request, CompletionRequest, "cmpl", protocol.completion_chunk,
                            protocol.completion_response)

    # -- the rest ----------------------------------------------------------------------------------------------
    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_id, "object": "model", "created": int(started),
                                             "owned_by": "kangaroo"}]}

    @app.get("/health")
    async def health():
        body = {"status": "ok" if worker.alive else "engine down", "model": model_id, "queue_depth": worker.depth(),
                "max_batch": worker.max_batch, **({"replicas": worker.replicas} if hasattr(worker, "replicas") else {}),
                "backend": engine.backend.name, "drafter": getattr(engine.drafter, "name", None) or "none",
                "uptime_seconds": round(time.time() - started, 1)}
        return JSONResponse(body, status_code=200 if worker.alive else 503)

    @app.get("/metrics")
    async def metrics_page():
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/", response_class=HTMLResponse)
    async def page():
        html = resources.files("kangaroo_apps.serve").joinpath("page.html").read_text(encoding="utf-8")
        return HTMLResponse(html.replace("{{MODEL_ID}}", model_id))

    return app


class RequestMetrics:
    """Counts requests by route and status and times them to their last body byte (a stream's end, not its first
    chunk). A plain ASGI middleware: Starlette's ``@app.middleware("http")`` wrapper would hide the client's
    disconnect from ``request.is_disconnected()``, which non-streaming requests poll to cancel their job."""

    def __init__(self, app, metrics: ServerMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        began, state = time.perf_counter(), {"status": 500, "done": False}

        def record():
            if not state["done"]:
                state["done"] = True
                endpoint = getattr(scope.get("route"), "path", "other")
                self.metrics.requests.labels(endpoint=endpoint, status=str(state["status"])).inc()
                self.metrics.request_seconds.labels(endpoint=endpoint).observe(time.perf_counter() - began)

        async def counted_send(message):
            if message["type"] == "http.response.start":
                state["status"] = message["status"]
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                record()

        try:
            await self.app(scope, receive, counted_send)
        finally:
            record()  # a stream cut by its client still counts, with the time it ran


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 as soon as it passes ``limit`` bytes (announced or streamed)."""
    announced = request.headers.get("content-length")
    if announced is not None and announced.isdigit() and int(announced) > limit:
        raise ApiError(413, f"the request body ({int(announced)} bytes) is larger than {limit} bytes",
                       code="request_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"the request body is larger than {limit} bytes", code="request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


def sampling_of(req, defaults: SamplingConfig) -> SamplingConfig:
    """The request's sampling settings over the server's defaults (one line per bad value)."""
    try:
        return defaults.replace(
            temperature=defaults.temperature if req.temperature is None else float(req.temperature),
            top_p=defaults.top_p if req.top_p is None else float(req.top_p),
            top_k=defaults.top_k if req.top_k is None else req.top_k,
            seed=req.seed if req.seed is not None else defaults.seed,
        )
    except ConfigError as exc:
        raise ApiError(400, str(exc)) from None


async def collect(job: Job, request: Request) -> Finished:
    """Wait for a non-streaming job; cancel it if the client disconnects meanwhile (checked every
    ``DISCONNECT_POLL_SECONDS``, whether or not rounds keep arriving)."""
    loop = asyncio.get_running_loop()
    next_check = loop.time() + DISCONNECT_POLL_SECONDS
    try:
        while True:
            try:
                event = await asyncio.wait_for(job.events.get(), timeout=max(0.0, next_check - loop.time()))
            except asyncio.TimeoutError:
                event = None
            if isinstance(event, Finished):
                return event
            if isinstance(event, Failed):
                raise event.error
            if loop.time() >= next_check:
                if await request.is_disconnected():
                    job.cancel()
                    raise ApiError(499, "the client closed the connection", code="client_closed")
                next_check = loop.time() + DISCONNECT_POLL_SECONDS
    finally:
        job.cancel()  # a no-op once finished; stops the work if this handler is torn down


def _extra(event: Delta) -> dict:
    return {"segments": [{"text": text, "draft": draft} for text, draft in event.segments], **event.stats}


async def stream_chunks(job: Job, req, rid: str, model: str, chunk):
    """The OpenAI chunks of one streamed generation (``chunk``: :func:`protocol.chat_chunk` or
    :func:`protocol.completion_chunk`): a chat stream opens with the assistant role; each delta carries its text and
    Kangaroo's segments; the last chunk the finish reason; ``stream_options.include_usage`` adds a usage chunk."""
    chat = chunk is protocol.chat_chunk
    if chat:
        yield chunk(rid, model, role=True, content="")
    async for event in _events(job):
        if isinstance(event, Delta):
            text = "".join(t for t, _ in event.segments)
            yield chunk(rid, model, extra=_extra(event), **({"content": text} if chat else {"text": text}))
            continue
        yield chunk(rid, model, finish=event.finish_reason, extra=event.stats)
        if req.stream_options and req.stream_options.include_usage:
            last = chunk(rid, model)
            last["choices"] = []
            last["usage"] = protocol.usage(event.prompt_tokens, event.completion_tokens)
            yield last


async def _events(job: Job):
    """Deltas, then the Finished event; a failure mid-stream raises its ApiError (sent as an error event).

    However this ends (finished, failed, or cancelled because the client disconnected), the job is cancelled: a
    no-op once it has finished, and the engine stops it between two rounds otherwise."""
    try:
        while True:
            event = await job.events.get()
            if isinstance(event, Failed):
                raise event.error
            yield event
            if isinstance(event, Finished):
                return
    finally:
        job.cancel()


def sse(chunks) -> StreamingResponse:
    """Server-sent events as OpenAI sends them: ``data: {json}`` per chunk, ``data: [DONE]`` at the end. A client that
    disconnects cancels this generator, which cancels the job (the ``finally`` of the job's consumer)."""

    async def body():
        try:
            async for chunk in chunks:
                yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
        except ApiError as exc:
            yield f"data: {json.dumps(exc.body())}\n\n"
        finally:
            await chunks.aclose()
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
