"""Request and token counters of the API process, and throughput over a sliding window."""
from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field

WINDOW_S = 10.0


@dataclass
class ServerStats:
    started: float = field(default_factory=time.monotonic)
    requests_total: int = 0  # reached the engine
    requests_finished: int = 0
    requests_failed: int = 0  # engine error or worker death
    requests_aborted: int = 0  # client gone
    requests_rejected: int = 0  # refused by the engine (e.g. its context check) or while it was unavailable (503)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    _prefill: collections.deque = field(default_factory=collections.deque)  # (time, tokens computed)
    _decode: collections.deque = field(default_factory=collections.deque)  # (time, tokens generated)

    def prefilled(self, prompt_tokens: int, cached_tokens: int) -> None:
        self.prompt_tokens += prompt_tokens
        self.cached_tokens += cached_tokens
        self._prefill.append((time.monotonic(), prompt_tokens - cached_tokens))

    def generated(self, n: int) -> None:
        if n:
            self.completion_tokens += n
            self._decode.append((time.monotonic(), n))

    @staticmethod
    def _rate(window: collections.deque, now: float) -> float:
        while window and now - window[0][0] > WINDOW_S:
            window.popleft()
        return round(sum(n for _, n in window) / WINDOW_S, 2)

    def snapshot(self) -> dict:
        now = time.monotonic()
        return {
            "uptime_s": round(now - self.started, 1),
            "requests": {"total": self.requests_total, "finished": self.requests_finished,
                         "failed": self.requests_failed, "aborted": self.requests_aborted,
                         "rejected": self.requests_rejected},
            "tokens": {"prompt": self.prompt_tokens, "cached": self.cached_tokens,
                       "completion": self.completion_tokens},
            "throughput": {"window_s": WINDOW_S, "prefill_tokens_per_s": self._rate(self._prefill, now),
                           "decode_tokens_per_s": self._rate(self._decode, now)},
        }
