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

from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, StrictInt, ValidationError,
                      field_validator)
from pydantic_core import PydanticCustomError

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


def lone_surrogate(payload: Any) -> ApiError | None:
    """The first string in a parsed JSON body (keys included) holding a lone surrogate, as a 400 naming its field.

    JSON may escape one (``"\\ud800"`` is valid JSON) and Python keeps it in the ``str``, but it is not Unicode text:
    the tokenizer raises a TypeError on it and no response containing it can be encoded as UTF-8. Walked without
    recursion: a body nested as deep as the JSON parser allows cannot overflow the stack here."""
    stack: list[tuple[str, Any]] = [("", payload)]
    while stack:
        where, value = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as exc:
                where = where or "body"
                return ApiError(400, f"{where}: contains a lone surrogate (\\u{ord(value[exc.start]):04x}); text must "
                                     "be valid Unicode", param=where)
        elif isinstance(value, dict):
            items = [(f"{where}.{_printable(k)}" if where else _printable(k), v) for k, v in value.items()]
            stack.extend(reversed(items))  # in document order: the first bad field is named
            stack.extend((where or "body", k) for k in reversed(list(value)))  # keys first
        elif isinstance(value, list):
            stack.extend(reversed([(f"{where}.{i}" if where else str(i), v) for i, v in enumerate(value)]))
    return None


def _printable(text: str) -> str:
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


_IMAGE_PARTS = {"image_url", "input_image", "image"}
_TEXT_ONLY = "(this server serves a text-only model); send text parts only"


def _content_part(value: Any) -> Any:
    """A content part other than text is refused in one line (pydantic would only say the content is no string)."""
    kind = value.get("type") if isinstance(value, dict) else None
    if kind in _IMAGE_PARTS:
        raise PydanticCustomError("part_unsupported", f"image parts are not supported {_TEXT_ONLY}")
    if isinstance(kind, str) and kind != "text":
        raise PydanticCustomError("part_unsupported", "'{kind}' parts are not supported " + _TEXT_ONLY,
                                  {"kind": kind if len(kind) <= 40 else kind[:40] + "..."})
    return value


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


ContentPart = Annotated[TextPart, BeforeValidator(_content_part)]


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # a string or a list of text parts; one type, not a union, so a bad part is named by its index
    # ("messages.0.content.1: ...") instead of pydantic's "content.str: Input should be a valid string"
    content: list[ContentPart] | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _string_or_parts(cls, value):
        if isinstance(value, str):
            return [{"type": "text", "text": value}]
        if value is not None and not isinstance(value, list):
            raise PydanticCustomError("content_type", "content must be a string or a list of content parts")
        return value

    def text(self) -> str:
        return "".join(part.text for part in self.content or ())


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
