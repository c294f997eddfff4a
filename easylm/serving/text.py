"""Generated token ids -> text, one token at a time, with stop strings.

Decoding token by token is not decoding the whole: a multi-byte character
can span tokens, and SentencePiece drops a leading space when a slice starts
mid-word. So each step decodes a short window that starts a few tokens back
and keeps only what the new token added, waiting while the window ends in an
incomplete character (U+FFFD).
"""

from typing import Sequence


class TextStream:
    def __init__(self, tokenizer, stop: Sequence[str] = ()):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self._longest = max((len(s) for s in self.stop), default=1)
        self.ids: list[int] = []
        self.text = ""
        self._prefix = 0  # window start: decoding restarts here
        self._read = 0  # tokens already turned into text
        self._checked = 0  # text already searched for stop strings
        self._emitted = 0  # text already handed out by `take`
        self.stopped = False  # a stop string appeared; the text ends before it

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, token: int) -> bool:
        """Append one token; True when a stop string appeared (the text is cut before it)."""
        return self.extend([token])

    def extend(self, tokens: list[int]) -> bool:
        """Append tokens with one decode; stop strings are found, but only `add` tells
        which token completed one."""
        self.ids.extend(tokens)
        before = self._decode(self.ids[self._prefix:self._read])
        after = self._decode(self.ids[self._prefix:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.text += after[len(before):]
            self._prefix, self._read = self._read, len(self.ids)
        return self._find_stop()

    def finish(self) -> None:
        """Flush what is left at the end, incomplete characters included."""
        if self.stopped:
            return
        before = self._decode(self.ids[self._prefix:self._read])
        self.text += self._decode(self.ids[self._prefix:])[len(before):]
        self._read = len(self.ids)
        self._find_stop()

    def _find_stop(self) -> bool:
        if not self.stop:
            return False
        start = max(0, self._checked - self._longest + 1)
        hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        if hits:
            self.text = self.text[:min(hits)]
            self._checked = len(self.text)
            self.stopped = True
            return True
        self._checked = len(self.text)
        return False

    def take(self, final: bool = False) -> str:
        """Text not handed out yet. Until `final`, holds back a tail that could be
        the start of a stop string, so a stream never shows a stop string's prefix."""
        end = len(self.text) if final else max(self._emitted, len(self.text) - self._longest + 1)
        out = self.text[self._emitted:end]
        self._emitted = end
        return out
