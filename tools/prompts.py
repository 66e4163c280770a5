"""Prompt files for self-distillation: JSONL of ``{"id", "prompt", "category"}`` or ShareGPT-style conversations."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import attrs

from kangaroo_core.errors import KangarooError


@attrs.frozen
class Prompt:
    id: str
    messages: tuple  # tuple of (role, content)
    category: str = ""


def read_prompts(path: str | Path, *, warn=print) -> list[Prompt]:
    """Prompts from JSONL: ``{"id", "prompt", "category"}`` lines or ShareGPT-style ``{"conversations": [...]}``.

    Malformed lines (bad JSON, invalid UTF-8, missing fields) are reported with their line number and skipped. For
    ShareGPT items only the first human turn is used (the target writes its own answer). Ids must be unique.
    """
    path = Path(path)
    if not path.is_file():
        raise KangarooError(f"prompts file not found: {path}")
    prompts: list[Prompt] = []
    seen: set[str] = set()
    with open_prompts(path) as handle:
        for number, raw in enumerate(handle, start=1):
            try:
                line = raw.decode("utf-8")
                if not line.strip():
                    continue
                prompt = _parse_prompt(json.loads(line), number)
            except (UnicodeDecodeError, json.JSONDecodeError, ValueError, TypeError, AttributeError) as exc:
                warn(f"{path}:{number}: skipped malformed line ({exc})")
                continue
            if prompt.id in seen:
                warn(f"{path}:{number}: skipped duplicate id {prompt.id!r}")
                continue
            seen.add(prompt.id)
            prompts.append(prompt)
    if not prompts:
        raise KangarooError(f"{path} holds no usable prompts")
    return prompts


def open_prompts(path: str | Path):
    """A prompts file opened for reading bytes; ``*.gz`` is decompressed on the fly (the shipped prompts are)."""
    path = Path(path)
    return gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")


def prompts_bytes(path: str | Path) -> bytes:
    """The file's content, decompressed: what a digest of the prompts must cover (the same with or without gzip)."""
    with open_prompts(path) as handle:
        return handle.read()


def _parse_prompt(item: dict, number: int) -> Prompt:
    if not isinstance(item, dict):
        raise ValueError("not a JSON object")
    if "prompt" in item:
        text = item["prompt"]
        if not isinstance(text, str) or not text.strip():
            raise ValueError("'prompt' must be a non-empty string")
        return Prompt(str(item.get("id", number)), (("user", text),), str(item.get("category", "")))
    conversation = item.get("conversations") or item.get("messages")
    if isinstance(conversation, list):
        for turn in conversation:
            role = turn.get("from") or turn.get("role")
            text = turn.get("value") or turn.get("content")
            if role in ("human", "user") and isinstance(text, str) and text.strip():
                return Prompt(str(item.get("id", number)), (("user", text),), str(item.get("category", "")))
        raise ValueError("no user turn in the conversation")
    raise ValueError("needs a 'prompt' string or a 'conversations' list")


def encode_prompt(tokenizer, prompt: Prompt) -> list[int]:
    """Token ids of a prompt exactly as the engine encodes a chat (:func:`kangaroo_core.engine.encode_prompt`: the
    template with the generation prompt, or the plain Question/Answer form for a model without one)."""
    from kangaroo_core.engine import encode_prompt as engine_encode

    return engine_encode(tokenizer, [{"role": role, "content": text} for role, text in prompt.messages])