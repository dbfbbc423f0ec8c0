"""The scheduler's status lines: what the steps did, for whoever watches a server's log.

Every step with prompt tokens logs a prefill line. Every `interval` steps with decode tokens
log one decode line (FreeToken's `--decode-log-interval`): the tokens those steps generated
per second of their time, and with an expert cache its hit rate over them.

A decode step's time runs from the end of the step before to its own end (with overlapped steps,
the device's step time). A step with decode tokens always follows a step (its requests ran in
it, and the worker only waits for requests when the scheduler has no work), so idle time never
counts.
"""
from __future__ import annotations

import logging
import time
from typing import Callable

log = logging.getLogger("moeferry.scheduler")


class StatusLog:
    def __init__(self, interval: int, clock: Callable[[], float] = time.perf_counter):
        self.interval, self.clock = interval, clock
        self._left = 0.0  # when the last step returned
        self._ran: tuple[int, int, int] | None = None  # this step's (prompt sequences, prompt tokens, decode tokens)
        self._steps = self._tokens = 0
        self._seconds = 0.0
        self._experts: tuple[int, int] | None = None  # expert cache (hits, misses) at the window's start (None:
        #                                               to be read when the next window opens)
        self._reused = 0  # prefix-cache tokens matched at admissions, as of the last prefill line

    def opening(self, sched, decodes: bool) -> None:
        """A step is about to be launched: a decode step may open a window, whose expert
        counters are read now (before its forward). Steps without decode tokens read nothing."""
        if decodes and self._steps == 0 and self._experts is None and log.isEnabledFor(logging.INFO):
            self._experts = _expert_counts(sched)

    def ran(self, prompt_seqs: int, prompt_tokens: int, decode_tokens: int) -> None:
        self._ran = (prompt_seqs, prompt_tokens, decode_tokens)

    def done(self, sched) -> None:
        """The step has returned (`ran` said what it computed, if it computed anything)."""
        began, now = self._left, self.clock()
        self._left = now
        ran, self._ran = self._ran, None
        if ran is None or not log.isEnabledFor(logging.INFO):
            return
        seqs, prompt, decode = ran
        if not decode and self._steps == 0:
            self._experts = None  # the counts moved outside a window: read them again when one opens
        if prompt:
            self._prefill_line(seqs, prompt, sched)
        if decode:
            self._steps += 1
            self._tokens += decode
            self._seconds += now - began
            if self._steps >= self.interval:
                self._decode_line(sched)

    def _prefill_line(self, seqs: int, tokens: int, sched) -> None:
        reused = sched.cache.hit_tokens
        cached, self._reused = reused - self._reused, reused
        from_cache = f" ({cached} more from the prefix cache)" if cached else ""
        log.info("prefill: %d sequence%s, %d prompt tokens%s; %s", seqs, "" if seqs == 1 else "s", tokens,
                 from_cache, _occupancy(sched))

    def _decode_line(self, sched) -> None:
        rate = self._tokens / self._seconds if self._seconds > 0 else float("inf")
        hit = ""
        before, after = self._experts, _expert_counts(sched)
        if before is not None and after is not None:
            hits, misses = after[0] - before[0], after[1] - before[1]
            if hits + misses:
                hit = f"; expert cache hit rate {hits / (hits + misses):.3f} ({misses} misses)"
        log.info("decode: %d steps, %.1f tokens/s; %s%s", self._steps, rate, _occupancy(sched), hit)
        self._experts = after  # the next window's start, if the next step decodes (one read a window)
        self._steps = self._tokens = 0
        self._seconds = 0.0


def _occupancy(sched) -> str:
    kv = sched.cache.stats()
    used, total = kv["kv_tokens_used"], kv["kv_tokens_total"]
    return (f"{len(sched.running)} running, {len(sched.waiting)} queued; KV {100 * used / max(total, 1):.0f}% "
            f"({used} of {total} tokens)")


def _expert_counts(sched) -> tuple[int, int] | None:
    """The expert cache's (hits, misses) so far; None without a cache (experts resident), or
    when they cannot be read (a status line never fails a step: the line goes without them)."""
    try:
        experts = sched.engine.stats().get("experts", {})
    except Exception:  # noqa: BLE001
        log.warning("the expert counters could not be read for the status line", exc_info=True)
        return None
    if "hits" not in experts:
        return None
    return experts["hits"], experts["misses"]
