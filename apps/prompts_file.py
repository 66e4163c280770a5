"""``kangaroo generate --prompts FILE.jsonl --batch N``: answer a file of prompts, N streams decoding together.

The file holds one ``{"id", "prompt"}`` object per line (the format of the training prompts). Answers come out in
input order, each as soon as it and every answer before it are done (an interrupted run loses only what had not
finished), with a progress bar on stderr.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import click

from kangaroo_core.errors import KangarooError


def read_prompts(path: str | Path) -> list[tuple[str, str]]:
    """(id, prompt) of every line; a malformed line is refused in one line naming it (nothing is decoded)."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise KangarooError(f"cannot read prompts file {path}: {exc}") from None
    prompts: list[tuple[str, str]] = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except ValueError as exc:
            raise KangarooError(f"{path}:{number}: not a JSON object ({exc})") from None
        if not isinstance(item, dict) or not isinstance(item.get("prompt"), str) or not item["prompt"].strip():
            raise KangarooError(f'{path}:{number}: expected {{"id": ..., "prompt": "<non-empty text>"}}')
        prompts.append((str(item.get("id", number)), item["prompt"]))
    if not prompts:
        raise KangarooError(f"{path} holds no prompts")
    return prompts


def answer_file(engine, prompts: list[tuple[str, str]], *, batch: int, chat: bool, as_json: bool,
                progress: bool = True) -> dict:
    """Decode every ``(id, prompt)`` of :func:`read_prompts` (read before the engine is built, so a bad file costs no
    model load), ``batch`` at a time; print answers in input order. Returns the totals."""
    from tqdm import tqdm

    runner = engine.batch(batch)
    streams = [runner.submit(prompt, chat=chat, key=key) for key, prompt in prompts]  # checked before any decoding
    start, printed, tokens = time.perf_counter(), 0, 0
    with tqdm(total=len(streams), desc=f"{len(streams)} prompts, {batch} at once", unit="answer", file=sys.stderr,
              disable=not progress, dynamic_ncols=True) as bar:
        while printed < len(streams):
            runner.step()
            done = sum(s.finished.is_set() for s in streams)
            bar.update(done - bar.n)
            while printed < len(streams) and streams[printed].finished.is_set():
                tokens += _print(streams[printed], as_json)
                printed += 1
    seconds = time.perf_counter() - start
    return {"answers": len(streams), "new_tokens": tokens, "seconds": seconds,
            "tokens_per_second": tokens / seconds if seconds > 0 else 0.0,
            "streams_per_pass": runner.streams_per_pass / max(1, runner.passes)}


def _print(stream, as_json: bool) -> int:
    result = stream.wait()  # finished: returns at once (or raises its error)
    if as_json:
        click.echo(json.dumps({"id": stream.key, "text": result.text, "token_ids": result.token_ids,
                               "new_tokens": result.new_tokens, "cr": result.mean_accepted_tokens,
                               "seconds": result.seconds}))
    else:
        click.echo(f"### {stream.key}\n{result.text}\n")
    return result.new_tokens
