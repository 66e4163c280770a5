"""Token ids → text, piece by piece, as a generation emits them (a stream, the CLI, a batch's streams)."""

from __future__ import annotations

from collections.abc import Sequence


class TextPieces:
    """Token ids → text pieces, never splitting a multi-byte character (its piece waits for the next tokens)."""

    def __init__(self, tokenizer):
        self._tokenizer, self._tokens, self.text = tokenizer, [], ""

    def add(self, tokens: Sequence[int]) -> str:
        """The text these tokens complete ("" while a character is unfinished)."""
        self._tokens.extend(tokens)
        text = self._tokenizer.decode(self._tokens, skip_special_tokens=True)
        if text.endswith("\ufffd") or not text.startswith(self.text):
            return ""
        piece, self.text = text[len(self.text):], text
        return piece

    def finish(self, final_text: str | None = None) -> str:
        """What the generation's final text (default: every token's text, an unfinished last character too) adds
        to the pieces given so far."""
        if final_text is None:
            final_text = self._tokenizer.decode(self._tokens, skip_special_tokens=True)
        tail = final_text[len(self.text):] if final_text.startswith(self.text) else ""
        self.text += tail
        return tail
