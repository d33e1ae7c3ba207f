"""A request's final text as its commits arrive: detokenised, cut at the first stop string.

Committed tokens never change (:class:`~refusion.core.loop.Commit`), so the text they decode to is final
except for its end: a partial UTF-8 character (decoded as U+FFFD) and a tail that may be the beginning of a
stop string are held back until the next commit settles them. The text sent, concatenated, is the offline
decode's text cut before the first stop string (OpenAI's ``stop`` semantics: the stop string is not sent).
"""

from __future__ import annotations


class FinalText:
    """Text deltas of one request (see the module docstring); ``stopped`` once a stop string was found."""

    def __init__(self, tokenizer, stop: list[str]) -> None:
        self.tokenizer, self.stop = tokenizer, list(stop)
        self.ids: list[int] = []  # committed tokens
        self.sent = ""  # text handed out so far
        self.stopped = False

    def add(self, token_ids: list[int]) -> str:
        """Take newly committed tokens; -> the text that became final (possibly empty)."""
        if self.stopped:
            return ""
        self.ids += token_ids
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        cut = self._stop_at(text)
        if cut is not None:
            self.stopped = True
            return self._send(text[:cut])
        if text.endswith("\ufffd"):  # a partial character: wait for the rest of its bytes
            text = text.rstrip("\ufffd")
        hold = max((k for s in self.stop for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
        return self._send(text[: len(text) - hold])

    def finish(self) -> str:
        """The decode ended: -> the rest of the text (held-back tails included), unless stopped."""
        if self.stopped:
            return ""
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        cut = self._stop_at(text)
        if cut is not None:
            self.stopped = True
            text = text[:cut]
        return self._send(text)

    def _stop_at(self, text: str) -> int | None:
        """Where the first stop string starts in ``text`` (searching only where a new one can be), or None."""
        start = max(0, len(self.sent) - max((len(s) for s in self.stop), default=0))
        found = [i for i in (text.find(s, start) for s in self.stop) if i >= 0]
        return min(found) if found else None

    def _send(self, text: str) -> str:
        if len(text) <= len(self.sent) or not text.startswith(self.sent):
            return ""
        new = text[len(self.sent):]
        self.sent = text
        return new
