"""Continuous batching: every step builds one batch of prefill chunks and decode tokens.

Limits per step: at most `max_running_requests` sequences, at most `max_extend_tokens` prompt
tokens (long prompts are chunked across steps), and only KV pages / state slots that are
actually free. KV grows with the sequence; when pages run out the youngest running request
is preempted (its computed tokens go to the prefix cache, it is re-queued and recomputed).

Overlap (`EngineConfig.overlap_schedule`, on by default): a step's tokens are sampled on the
device and read on the host only after the next step's forward is launched, fed from them on the
device (`SeqChunk.fed`), so the host's work between steps (reading tokens, events, scheduling,
the next step's inputs) runs while the device computes. The read comes before the next step's
sampling is launched, so grammars, penalties and min_tokens see every earlier token, and a
request that ended on the token just read (EOS, a stop token) is not sampled again: its one
extra forward row is dropped. A request is not admitted while a token of it is on its way.

Fairness (docs/reliability.md has the measurements behind it):
- admission is first come, first served;
- waiting is bounded: when the head of the queue has waited `max_wait_steps` steps, the request
  that has run longest since its admission (at least `max_wait_steps` steps) yields its place and
  goes to the back of the queue; its KV and state stay in the prefix cache, so it resumes cheaply.
  Without this, requests that run to the end of the context hold the pool for thousands of steps
  while the queue gets no token at all.
"""
from __future__ import annotations

import itertools
import logging
from collections import deque

import torch

from moeferry.model.batch import SeqChunk
from moeferry.scheduler.batch_sampler import SampledStep, launch_sampling
from moeferry.scheduler.grammar import grammar_failure
from moeferry.scheduler.request import Request, RequestState, TokenEvent
from moeferry.scheduler.status import StatusLog

log = logging.getLogger("moeferry.scheduler")


class RequestRejected(ValueError):
    """A request that can never run (e.g. its prompt exceeds the context)."""

    def __init__(self, message: str, code: str, param: str | None = None):
        super().__init__(message)
        self.code, self.param = code, param


def step_failure(e: BaseException) -> str:
    """What a client is told when its step failed: the kind of failure, not the exception's text
    (which can hold paths and internals; the log has it)."""
    if isinstance(e, torch.OutOfMemoryError):
        return "the engine ran out of device memory in this step (OutOfMemoryError); retry the request"
    return f"the engine step failed ({type(e).__name__}); the details are in the server log"


class Scheduler:
    """Drives `engine` (its config's scheduler limits, its resolved sizes, its cache manager)."""

    def __init__(self, engine):
        self.engine, self.cfg = engine, engine.cfg
        self.cache = engine.cache
        self.eos_ids = set(engine.spec.eos_token_ids)
        self.max_seq_len = engine.sizes.max_seq_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._events: list[TokenEvent] = []
        self._sampled: SampledStep | None = None  # the last step's tokens, not read on the host yet
        self._arrivals = itertools.count()
        self.num_preemptions = 0
        self.num_steps = 0
        self.cached_prompt_tokens = 0  # prompt tokens clients were told came from the cache
        self.status = StatusLog(self.cfg.decode_log_interval)

    # --- public API ---------------------------------------------------------------------
    def add(self, req: Request) -> None:
        req.params.validate()
        n = len(req.prompt_ids)
        if n >= self.max_seq_len:
            raise RequestRejected(
                f"prompt has {n} tokens but the context is {self.max_seq_len} tokens "
                f"(at least one must remain for output)", "context_length_exceeded", "messages")
        vocab = self.engine.spec.vocab_size
        if n and not (0 <= min(req.prompt_ids) and max(req.prompt_ids) < vocab):
            raise RequestRejected(f"prompt token ids must be in [0, {vocab})", "invalid_prompt", "prompt")
        room = self.max_seq_len - n
        if req.max_new_tokens is None or req.max_new_tokens > room:
            req.max_new_tokens, req.clamped = room, True
        req.arrival = next(self._arrivals)
        req.queued_at = self.num_steps
        self.waiting.append(req)

    def abort(self, request_id: str) -> None:
        for req in list(self.waiting) + self.running:
            if req.request_id == request_id:
                self._finish(req, "abort")
                self._events.append(self._event(req, [], None))

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._events or self._sampled)

    def step(self) -> list[TokenEvent]:
        """Run one step; returns the events of the tokens read in it (with overlap: the previous
        step's, read once this one's forward is launched)."""
        events = self._step()
        self.status.done(self)
        return events

    def _step(self) -> list[TokenEvent]:
        events, self._events = self._events, []
        plan = self._schedule()
        if not plan:
            return events + self._read()
        self.num_steps += 1
        computed = self._computed(plan)
        self.status.opening(self, decodes=computed[2] > 0)
        feed = self._sampled.tokens if self._sampled is not None else None
        try:
            logits = self.engine.forward([self._chunk(r, n) for r, n in plan], feed)
        except Exception as e:  # a failed step fails its requests, never the scheduler
            log.exception("step failed for %d requests", len(plan))
            events += self._read()  # the last step's tokens: computed before this failure
            for r, _ in plan:
                if not r.finished:
                    self._finish(r, "error")
                    events.append(self._event(r, [], None, error=step_failure(e)))
            return events
        self.status.ran(*computed)
        ready = []
        for i, (r, n) in enumerate(plan):
            r.num_computed += n
            if r.pending > 0 or r.num_computed == len(r.prompt_ids):
                self._checkpoint(r)  # chunk boundary or prompt end
            if r.pending == 0:
                ready.append((r, i))
        events += self._read()  # the last step's tokens, while the device runs this step's forward
        self._save_after_special_tokens(plan)
        ready = [(r, i) for r, i in ready if not r.finished]  # (ended on a token just read)
        self._sampled = self._launch(ready, logits) if ready else None
        for row, r in enumerate(self._sampled.reqs if self._sampled else ()):
            r.fed = row
        if not self.cfg.overlap_schedule:
            events += self._read()
        return events

    @staticmethod
    def _computed(plan: list[tuple[Request, int]]) -> tuple[int, int, int]:
        """For the status log: (prompt chunks, their tokens, decode tokens) of a step. A prompt
        chunk has more than one token or lies within the prompt (so a preempted request's
        recomputed outputs count)."""
        prompt = [n for r, n in plan if n > 1 or r.num_computed < len(r.prompt_ids)]
        return len(prompt), sum(prompt), len(plan) - len(prompt)

    def stats(self) -> dict:
        return {"running": len(self.running), "waiting": len(self.waiting), **self.cache.stats(),
                # what clients are told (usage.prompt_tokens_details.cached_tokens, counted at the first
                # token, as /v1/stats tokens.cached is); reused also counts re-admissions after preemption
                "prefix_cache_hit_tokens": self.cached_prompt_tokens,
                "preemptions": self.num_preemptions, "steps": self.num_steps, **self.engine.stats()}

    # --- scheduling ---------------------------------------------------------------------
    def _schedule(self) -> list[tuple[Request, int]]:
        self._bound_waiting()
        budget = self.cfg.max_extend_tokens
        plan: list[tuple[Request, int]] = []
        for req in list(self.running):
            if req.state is not RequestState.RUNNING:
                continue  # preempted while making room for an older request
            prefill = req.pending > 1
            if (prefill and budget <= 0) or self._ends_on_its_way(req):
                continue
            n = min(req.pending, budget) if prefill else 1
            if not self._reserve_or_preempt(req, req.num_computed + n):
                continue
            budget -= n if prefill else 0
            plan.append((req, n))
        # A request planned above can be the victim of a later one's preemption: it is not in this step.
        plan = [(r, n) for r, n in plan if r.state is RequestState.RUNNING]
        while self.waiting and len(self.running) < self.cfg.max_running_requests and budget > 0:
            req = self.waiting[0]
            if req.fed >= 0 or not self._admit(req):  # (a preempted request's token is still on its way)
                break
            n = min(req.pending, budget)
            if not self._reserve(req, req.num_computed + n):
                self._release(req, keep_in_cache=False)
                break
            self.waiting.popleft()
            req.state = RequestState.RUNNING
            req.admitted_at = self.num_steps
            self.running.append(req)
            budget -= n
            plan.append((req, n))
        return plan

    @staticmethod
    def _ends_on_its_way(req: Request) -> bool:
        """The token on its way from the device is the request's last (max_new_tokens)."""
        return req.fed >= 0 and len(req.output_ids) + 1 >= req.max_new_tokens

    def _chunk(self, req: Request, n: int) -> SeqChunk:
        """The request's next n tokens as a chunk; a token still on the device is fed from there."""
        start, blocks = req.num_computed, req.blocks
        if req.fed >= 0:  # a decode token (n == 1) sampled by the step before
            return SeqChunk([0], start, blocks.pages, blocks.state_slot, fed=req.fed)
        return SeqChunk(req.ids_between(start, start + n), start, blocks.pages, blocks.state_slot)

    def _reserve(self, req: Request, total_tokens: int) -> bool:
        return self.cache.grow(req.blocks, total_tokens)

    def _reserve_or_preempt(self, req: Request, total_tokens: int) -> bool:
        while not self._reserve(req, total_tokens):
            victim = max(self.running, key=lambda r: r.arrival)
            self._preempt(victim)
            if victim is req:
                return False
        return True

    def _bound_waiting(self) -> None:
        """The head of the queue has waited max_wait_steps: the request running longest since its
        admission (for at least as long) yields its place and goes to the back of the queue."""
        wait = self.cfg.max_wait_steps
        if not wait or not self.waiting or self.num_steps - self.waiting[0].queued_at < wait:
            return
        served = [r for r in self.running if self.num_steps - r.admitted_at >= wait]
        if served:
            self._preempt(min(served, key=lambda r: r.admitted_at), to_back=True)

    def _preempt(self, req: Request, to_back: bool = False) -> None:
        why = "to let a long-waiting request run" if to_back else "to free KV pages"
        log.info("preempting request %s (%d tokens computed) %s", req.request_id, req.num_computed, why)
        self._release(req, keep_in_cache=True)
        self.running.remove(req)
        req.state = RequestState.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        req.queued_at = self.num_steps
        if to_back:
            self.waiting.append(req)
        else:
            self.waiting.appendleft(req)

    def _admit(self, req: Request) -> bool:
        """Give req a state slot and whatever prefix the cache holds for it."""
        blocks = self.cache.admit(req.all_ids)
        if blocks is None:
            return False
        req.blocks, req.num_computed = blocks, blocks.matched
        if req.num_preemptions == 0:
            req.cached_tokens = min(blocks.matched, len(req.prompt_ids))
        return True

    def _checkpoint(self, req: Request) -> None:
        """Save the GDN state at a prefill chunk boundary or the prompt end, keeping one state
        slot per open running place for admissions."""
        keep_free = self.cfg.max_running_requests - len(self.running)
        self.cache.checkpoint(req.blocks, req.num_computed, keep_free)

    def _save_after_special_tokens(self, plan: list[tuple[Request, int]]) -> None:
        """A decode row whose input was a checkpoint token (`checkpoint_token_ids`: the tool-call
        opener) saves the state after it, queued behind the step's forward. The next turn of an
        agent repeats the conversation through that token (the call's arguments, re-rendered,
        may differ after it), so the prefix cache resumes there instead of at the prompt's end.
        With overlap the input is the token just read, hence after `_read`."""
        special = self.cfg.checkpoint_token_ids
        for r, n in plan if special else ():
            at = r.num_computed - 1 - len(r.prompt_ids)  # the row's input, as an output index
            if n == 1 and not r.finished and 0 <= at < len(r.output_ids) and r.output_ids[at] in special:
                self._checkpoint(r)

    def _release(self, req: Request, keep_in_cache: bool) -> None:
        """Return a request's pages / slots (its computed tokens to the prefix cache when kept). A
        request ended while reading a token that the step in flight takes in (a failed grammar)
        has computed one token more than it holds: its state is not saved as theirs."""
        if req.blocks is not None:
            self.cache.release(req.blocks, req.all_ids[:req.num_computed] if keep_in_cache else None,
                               state_position=req.num_computed)
        req.blocks, req.num_computed = None, 0

    # --- sampling and finishing -----------------------------------------------------------
    def _launch(self, ready: list[tuple[Request, int]], logits: torch.Tensor) -> SampledStep:
        """Sample the ready requests from their rows of the step's logits (all of them, in
        order, as a decode step has it: no copy); the tokens are read by `_read`."""
        reqs = [r for r, _ in ready]
        rows = [i for _, i in ready]
        if rows != list(range(len(logits))):
            logits = torch.stack([logits[i] for i in rows])
        return launch_sampling(reqs, logits, self.eos_ids, on_device=self.cfg.overlap_schedule)

    def _read(self) -> list[TokenEvent]:
        """Read the last step's tokens on the host: outputs, finishes and events (a request that
        ended while its token was on the way, e.g. aborted, drops it)."""
        sampled, self._sampled = self._sampled, None
        if sampled is None:
            return []
        tokens, logprobs = sampled.read()
        events = []
        for req, tok, lp in zip(sampled.reqs, tokens, logprobs):
            req.fed = -1
            if req.finished:
                continue
            failure = grammar_failure(req)
            if failure is not None:  # the request's own schema, not the engine: "invalid" (a 400)
                self._finish(req, "invalid")
                events.append(self._event(req, [], None, error=failure))
                continue
            req.output_ids.append(tok)
            if len(req.output_ids) == 1:
                self.cached_prompt_tokens += req.cached_tokens
            reason = self._finish_reason(req, tok)
            if reason is not None:
                self._finish(req, reason)
            events.append(self._event(req, [tok], None if lp is None else [lp]))
        return events

    def _finish_reason(self, req: Request, tok: int) -> str | None:
        p = req.params
        if (not p.ignore_eos and tok in self.eos_ids) or tok in p.stop_token_ids:
            return "stop"
        if len(req.output_ids) >= req.max_new_tokens:
            return "length"
        return None

    def _finish(self, req: Request, reason: str) -> None:
        if req.finished:
            return
        if req.state is RequestState.RUNNING:
            self.running.remove(req)
            self._release(req, keep_in_cache=reason != "error")
        elif req in self.waiting:
            self.waiting.remove(req)
        req.state, req.finish_reason = RequestState.FINISHED, reason

    @staticmethod
    def _event(req: Request, tokens: list[int], logprobs, error: str | None = None) -> TokenEvent:
        return TokenEvent(req.request_id, tokens, logprobs, req.finished, req.finish_reason,
                          len(req.prompt_ids), req.cached_tokens, error)
