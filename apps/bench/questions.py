"""Spec-Bench question files: JSONL, one ``{"question_id", "category", "turns", "subtask"?}`` object per line."""

from __future__ import annotations

import json
from collections import OrderedDict
from pathlib import Path

import attrs

from kangaroo_core.errors import BenchError, UsageError

#: Spec-Bench's subtasks, in its leaderboard's order.
SUBTASKS = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")


@attrs.frozen
class Question:
    question_id: str
    subtask: str
    turns: tuple[str, ...]


def _parse(line: str) -> Question:
    try:
        item = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON ({exc.msg})") from None
    if not isinstance(item, dict):
        raise ValueError("not a JSON object")
    turns = item.get("turns")
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
        raise ValueError('"turns" must be a non-empty list of non-empty strings')
    subtask = item.get("subtask")
    if subtask is None:  # original Spec-Bench files: MT-bench items carry MT-bench categories (writing, roleplay...)
        category = item.get("category")
        subtask = category if category in SUBTASKS else "mt_bench"
    if not isinstance(subtask, str) or not subtask:
        raise ValueError('"subtask" must be a non-empty string')
    return Question(str(item.get("question_id", "")), subtask, tuple(turns))


def load_questions(path: str | Path, limit_per_subtask: int | None = None) -> list[Question]:
    """Read a Spec-Bench JSONL file (blank lines skipped); a :class:`BenchError` lists every malformed line."""
    path = Path(path)
    if not path.is_file():
        raise BenchError(f"questions file not found: {path} (pass --questions FILE)")
    questions: list[Question] = []
    bad: list[tuple[int, str]] = []
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, start=1):
            try:
                line = raw.decode("utf-8")  # invalid UTF-8 is a malformed line, reported with its number
                if not line.strip():
                    continue
                question = _parse(line)
            except ValueError as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
                bad.append((number, str(exc)))
                continue
            if not question.question_id:
                question = attrs.evolve(question, question_id=f"line{number}")
            questions.append(question)
    if bad:
        numbers = ", ".join(str(n) for n, _ in bad)
        raise BenchError(f"{path}: malformed line(s) {numbers} (line {bad[0][0]}: {bad[0][1]})")
    if not questions:
        raise BenchError(f"{path} has no questions")
    if limit_per_subtask is not None:
        if limit_per_subtask < 1:
            raise UsageError(f"--limit-per-subtask must be >= 1, got {limit_per_subtask}")
        counts: dict[str, int] = {}
        kept = []
        for q in questions:
            counts[q.subtask] = counts.get(q.subtask, 0) + 1
            if counts[q.subtask] <= limit_per_subtask:
                kept.append(q)
        questions = kept
    return questions


def subtasks_in_order(questions: list[Question]) -> list[str]:
    """Subtasks present, Spec-Bench's order first, then others in file order."""
    present = list(OrderedDict.fromkeys(q.subtask for q in questions))
    return [s for s in SUBTASKS if s in present] + [s for s in present if s not in SUBTASKS]


def demo_questions(path: str | Path, prompt: str | None = None) -> list[Question]:
    """``kangaroo demo``'s questions: your prompt as one question, else the first question of every subtask in
    ``path`` (first turn only)."""
    if prompt is not None:
        return [Question("prompt", "your prompt", (prompt,))]
    return [attrs.evolve(q, turns=q.turns[:1]) for q in load_questions(path, limit_per_subtask=1)]
