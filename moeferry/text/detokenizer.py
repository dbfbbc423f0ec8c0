"""Incremental detokenizer: emits only complete UTF-8 text and never a stop string.

Text is decoded from a sliding window of tokens (prefix/read offsets) so a token that
completes a multi-byte character is emitted only once it is complete. Text that could be
the start of a stop string is held back until it is known not to be one.
"""
from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer, stop: tuple[str, ...] = (), skip_special_tokens: bool = True):
        self.tok, self.stop, self.skip = tokenizer, tuple(stop), skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.held = ""  # decoded but not yet emitted (possible stop-string prefix)
        self.text = ""  # everything emitted so far
        self.stopped = False
        self.stop_reason: str | None = None

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=self.skip)

    def feed(self, token_ids: list[int]) -> str:
        """Add tokens; returns the newly emittable text."""
        if self.stopped:
            return ""
        self.ids.extend(token_ids)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return ""  # incomplete character (or nothing new) — wait for more tokens
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return self._emit(full[len(prefix):])

    def _emit(self, new: str) -> str:
        pending = self.held + new
        cut = min((i for i in (pending.find(s) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            self.stop_reason = next(s for s in self.stop if pending.find(s) == cut)
            out, self.held = pending[:cut], ""
        else:
            keep = self._stop_prefix_len(pending)
            out, self.held = pending[:len(pending) - keep], pending[len(pending) - keep:]
        self.text += out
        return out

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest suffix of text that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best

    def flush(self) -> str:
        """At the end of generation: release held text (and any trailing partial char)."""
        if self.stopped:
            return ""
        rest = self._decode(self.ids[self.prefix_offset:])
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        tail = rest[len(prefix):] if len(rest) > len(prefix) else ""
        out = self.held + tail.rstrip("\ufffd")
        self.held = ""
        self.text += out
        return out
