"""Request and token counters of the API process, latency histograms, and throughput.

Throughput is tokens over the time actually observed working: each record spans from when its
work began (a request's submission for prefill, the previous token for decode) to when it ended,
and a rate divides the tokens of the records ending within the last WINDOW_S seconds by the
union of their spans (clipped to the window), so idle time does not dilute it. One 32-token
request decoded in one second reads 32 tok/s, not 32 / WINDOW_S; with nothing in the window
the rate is 0.
"""
from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field

from prometheus_client import Histogram

WINDOW_S = 10.0
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5)


def _histogram(name: str, doc: str, buckets) -> Histogram:
    return Histogram(name, doc, buckets=buckets, registry=None)  # collected by ServerMetrics, no global registry


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
    ttft: Histogram = field(default_factory=lambda: _histogram(
        "moeferry_time_to_first_token_seconds", "Time from submission to the first generated token", TTFT_BUCKETS))
    itl: Histogram = field(default_factory=lambda: _histogram(
        "moeferry_inter_token_latency_seconds", "Time between consecutive generated tokens of a request",
        ITL_BUCKETS))
    e2e: Histogram = field(default_factory=lambda: _histogram(
        "moeferry_request_latency_seconds", "Time from submission to the last token", TTFT_BUCKETS))
    _prefill: collections.deque = field(default_factory=collections.deque)  # (began, ended, tokens computed)
    _decode: collections.deque = field(default_factory=collections.deque)  # (began, ended, tokens generated)

    def prefilled(self, prompt_tokens: int, cached_tokens: int, began: float) -> None:
        now = time.monotonic()
        self.prompt_tokens += prompt_tokens
        self.cached_tokens += cached_tokens
        self.ttft.observe(now - began)
        self._prefill.append((began, now, prompt_tokens - cached_tokens))

    def generated(self, n: int, began: float, first: bool) -> None:
        """n tokens arrived; `began` is when the previous token of the request did (or its submission)."""
        if not n:
            return
        now = time.monotonic()
        self.completion_tokens += n
        if first:  # its wait was the prefill (TTFT), not decoding
            began = now
        else:
            for _ in range(n):
                self.itl.observe((now - began) / n)
        self._decode.append((began, now, n))

    def request_done(self, began: float) -> None:
        self.e2e.observe(time.monotonic() - began)

    @staticmethod
    def _rate(window: collections.deque, now: float) -> tuple[float, float]:
        """(tokens per second, seconds observed) over the records ending in the window."""
        while window and now - window[0][1] > WINDOW_S:
            window.popleft()
        if not window:
            return 0.0, 0.0
        busy, reach = 0.0, now - WINDOW_S
        for began, ended, _ in sorted(window):
            began = max(began, reach)
            if ended > began:
                busy += ended - began
                reach = ended
        busy = max(busy, 1e-3)
        return sum(n for _, _, n in window) / busy, busy

    def snapshot(self) -> dict:
        now = time.monotonic()
        prefill, prefill_s = self._rate(self._prefill, now)
        decode, decode_s = self._rate(self._decode, now)
        return {
            "uptime_s": round(now - self.started, 1),
            "requests": {"total": self.requests_total, "finished": self.requests_finished,
                         "failed": self.requests_failed, "aborted": self.requests_aborted,
                         "rejected": self.requests_rejected},
            "tokens": {"prompt": self.prompt_tokens, "cached": self.cached_tokens,
                       "completion": self.completion_tokens},
            "throughput": {"window_s": WINDOW_S, "prefill_tokens_per_s": round(prefill, 2),
                           "decode_tokens_per_s": round(decode, 2), "prefill_observed_s": round(prefill_s, 3),
                           "decode_observed_s": round(decode_s, 3)},
        }
