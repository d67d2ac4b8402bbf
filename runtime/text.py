"""Text out of token ids as they arrive: pieces that never split a character, and stop strings cut
where they begin (one generation's, or each request's of a batch)."""
from __future__ import annotations

from typing import Sequence


class Detokenizer:
    """Text pieces from token ids as they arrive. Decodes a short window (the previous piece's tokens
    and the new ones), so a decoder that depends on the neighbouring token (a leading space) stays
    right, and each step costs the same however long the reply; holds back a piece while it ends in
    a partial UTF-8 character."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.ids: list[int] = []
        self.start = 0      # window start: the first token of the last piece shown
        self.shown = 0      # tokens whose text is out

    def _text(self, stop: int | None = None) -> str:
        return self.tok.decode(self.ids[self.start:stop], skip_special_tokens=True)

    def push(self, token: int) -> str:
        self.ids.append(token)
        before, now = self._text(self.shown), self._text()
        if len(now) <= len(before) or now.endswith("\ufffd"):
            return ""
        self.start, self.shown = self.shown, len(self.ids)
        return now[len(before):]

    def flush(self) -> str:
        """What was held back (bytes that never formed a character) goes out as it decodes."""
        before, now = self._text(self.shown), self._text()
        self.start = self.shown = len(self.ids)
        return now[len(before):]


class StopScan:
    """Cuts text at the first stop string, holding back a tail that may still become one."""

    def __init__(self, stops: Sequence[str]):
        self.stops = tuple(stops)
        self.pending = ""   # text that ends in a proper prefix of some stop string

    def push(self, piece: str) -> tuple[str, bool]:
        """(text safe to show, whether a stop string was found)"""
        if not self.stops:
            return piece, False
        # an earlier match would have been found, or held back, in an earlier push
        text = self.pending + piece
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.pending = ""
            return text[:min(hits)], True
        keep = max((n for s in self.stops for n in range(1, min(len(s) - 1, len(text)) + 1)
                    if text.endswith(s[:n])), default=0)
        self.pending = text[len(text) - keep:]
        return text[:len(text) - keep], False

    def finish(self, piece: str) -> tuple[str, bool]:
        text, hit = self.push(piece)
        if not hit:
            text, self.pending = text + self.pending, ""
        return text, hit
