"""The OpenAI wire format: request bodies (validated), response objects and errors.

Requests are validated by pydantic; anything malformed becomes an OpenAI-style error body
``{"error": {"message", "type", "param", "code"}}`` with the HTTP status OpenAI uses (400 for a bad request, 404 for
an unknown model, 413 for a body over the limit, 429 for a full queue). Kangaroo's own statistics travel in an extra
top-level field, ``kangaroo``, that OpenAI clients keep as an unknown attribute.

Sampling defaults are the server's (``kangaroo serve --temperature ...``: greedy unless told otherwise), not
OpenAI's temperature 1: a request that sets nothing gets the target's own greedy answer.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, ValidationError, field_validator

Number = Annotated[float, Field(strict=False)]


class ApiError(Exception):
    """An error answered as an OpenAI error body with ``status``."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: StrictBool = False


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class _Sampled(BaseModel):
    """Fields chat and completions share."""

    model_config = ConfigDict(extra="ignore")
    model: str
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: Number | None = Field(default=None, ge=0.0, le=2.0)
    top_p: Number | None = Field(default=None, gt=0.0, le=1.0)
    top_k: StrictInt | None = Field(default=None, ge=0)  # an extension (vLLM and llama.cpp take it too)
    seed: StrictInt | None = None
    n: StrictInt = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    presence_penalty: Number = 0.0
    frequency_penalty: Number = 0.0
    logprobs: StrictBool | StrictInt | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, value):
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop takes at most 4 non-empty strings")
        return stops

    def check_supported(self) -> None:
        """What the lossless loop cannot do is refused, never silently ignored."""
        if self.n != 1:
            raise ApiError(400, f"n must be 1 (one answer per request), got {self.n}", param="n")
        if self.presence_penalty or self.frequency_penalty:
            raise ApiError(400, "presence_penalty and frequency_penalty are not supported (the output would no longer "
                                "be the target model's)", param="presence_penalty")
        if self.logprobs:
            raise ApiError(400, "logprobs are not supported", param="logprobs")


class ChatRequest(_Sampled):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)

    @property
    def budget(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def conversation(self) -> list[dict[str, str]]:
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in self.messages]


class CompletionRequest(_Sampled):
    prompt: str | list[str]
    echo: StrictBool = False
    suffix: str | None = None

    @property
    def budget(self) -> int | None:
        return self.max_tokens or 16  # the OpenAI completions default

    def text(self) -> str:
        if self.echo or self.suffix:
            raise ApiError(400, "echo and suffix are not supported", param="echo" if self.echo else "suffix")
        if isinstance(self.prompt, list):
            if len(self.prompt) != 1:
                raise ApiError(400, "one prompt per request (a list of several is a batch)", param="prompt")
            return self.prompt[0]
        return self.prompt


def validation_error(exc: ValidationError) -> ApiError:
    """The first problem pydantic found, as one line naming the field."""
    first = exc.errors()[0]
    where = ".".join(str(part) for part in first.get("loc", ())) or "body"
    return ApiError(400, f"{where}: {first.get('msg', 'invalid value')}", param=where)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def chat_response(rid: str, model: str, text: str, finish: str, use: dict, stats: dict) -> dict[str, Any]:
    return {"id": rid, "object": "chat.completion", "created": now(), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                         "finish_reason": finish}], "usage": use, "kangaroo": stats}


def completion_response(rid: str, model: str, text: str, finish: str, use: dict, stats: dict) -> dict[str, Any]:
    return {"id": rid, "object": "text_completion", "created": now(), "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}], "usage": use,
            "kangaroo": stats}


def chat_chunk(rid: str, model: str, *, content: str | None = None, role: bool = False, finish: str | None = None,
               extra: dict | None = None) -> dict[str, Any]:
    delta: dict[str, Any] = {}
    if role:
        delta["role"] = "assistant"
    if content is not None:
        delta["content"] = content
    chunk = {"id": rid, "object": "chat.completion.chunk", "created": now(), "model": model,
             "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}
    if extra:
        chunk["kangaroo"] = extra
    return chunk


def completion_chunk(rid: str, model: str, *, text: str = "", finish: str | None = None,
                     extra: dict | None = None) -> dict[str, Any]:
    chunk = {"id": rid, "object": "text_completion", "created": now(), "model": model,
             "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}
    if extra:
        chunk["kangaroo"] = extra
    return chunk
