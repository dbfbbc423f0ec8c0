"""The overlapped scheduler with a counting model (no weights): each token's successor is the token
plus one, so a wrong feed, a dropped token or a token read twice shows in the outputs. The real
cache manager holds the pools; the model reads its decode tokens from `feed` where a chunk is fed."""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from benchmarks.scheduler_load import VOCAB, FakeEngine
from moeferry.engine.config import EngineConfig
from moeferry.scheduler.request import Request
from moeferry.scheduler.sampling import SamplingParams
from moeferry.scheduler.scheduler import Scheduler

EOS = VOCAB - 1


@dataclass
class CountingEngine(FakeEngine):
    fail_at: int = 0  # the forward call (1-based) that raises; 0: none
    calls: int = 0
    fed: int = 0  # decode tokens taken from `feed`

    def forward(self, chunks, feed=None):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("injected step failure")
        last = []
        for c in chunks:
            if c.fed >= 0:
                self.fed += 1
                last.append(int(feed[c.fed]))
            else:
                last.append(c.tokens[-1])
        logits = torch.zeros(len(chunks), VOCAB)
        logits[torch.arange(len(chunks)), (torch.tensor(last) + 1) % VOCAB] = 1.0
        return logits


def run(overlap: bool, work: list[tuple[list[int], SamplingParams]], fail_at: int = 0, abort_after: dict | None = None):
    """Steps until done; returns (tokens and finish of each request, errors, the engine).
    `abort_after`: {request index: aborted once it has this many tokens}."""
    engine = CountingEngine(EngineConfig("(counting)", num_tokens=256, max_running_requests=4, prefix_cache=False,
                                         overlap_schedule=overlap), fail_at=fail_at)
    sched = Scheduler(engine)
    reqs = [Request(f"r{i}", prompt, params) for i, (prompt, params) in enumerate(work)]
    for r in reqs:
        sched.add(r)
    tokens = {r.request_id: [] for r in reqs}
    ends, errors = {}, {}
    while sched.has_work:
        for ev in sched.step():
            assert ev.request_id not in ends, f"an event after {ev.request_id} finished"
            tokens[ev.request_id] += ev.token_ids
            if ev.finished:
                ends[ev.request_id] = ev.finish_reason
                if ev.error:
                    errors[ev.request_id] = ev.error
        for i, n in (abort_after or {}).items():
            if len(tokens[f"r{i}"]) >= n and f"r{i}" not in ends:
                sched.abort(f"r{i}")
    assert engine.cache.stats()["kv_tokens_used"] == 0
    return [(tokens[r.request_id], ends.get(r.request_id)) for r in reqs], errors, engine


GREEDY = SamplingParams(temperature=0.0, max_tokens=6)
WORK = [([5, 6, 7], GREEDY), ([EOS - 3], GREEDY), ([100, 101], GREEDY.replace(max_tokens=1)),
        ([40] * 9, GREEDY.replace(max_tokens=3, logprobs=1))]


def test_overlapped_steps_count_on():
    """Every request's tokens continue its count through fed steps; EOS (found a step late),
    max_tokens 1 and logprobs end as when every step is read first, with at most one more step."""
    runs = {overlap: run(overlap, WORK) for overlap in (True, False)}
    outs, _, engine = runs[True]
    assert outs == runs[False][0]
    assert outs[0] == ([8, 9, 10, 11, 12, 13], "length")
    assert outs[1] == ([EOS - 2, EOS - 1, EOS], "stop")
    assert outs[2] == ([102], "length") and outs[3] == ([41, 42, 43], "length")
    assert engine.fed >= 8 and runs[False][2].fed == 0
    assert engine.calls <= runs[False][2].calls + 1


def test_abort_while_a_token_is_on_its_way():
    """An abort between steps, with the request's newest token still on the device: no token
    of it is emitted after, and the others go on counting."""
    outs, _, _ = run(True, WORK[:2], abort_after={0: 2})
    assert outs[0] == ([8, 9], "abort")
    assert outs[1] == ([EOS - 2, EOS - 1, EOS], "stop")


@pytest.mark.parametrize("overlap", [True, False])
def test_a_failed_step_fails_its_requests_only(overlap):
    """A step fails while the step before's tokens are on their way: those are still emitted
    (the failed step's request gets its token, then the error; another, whose last token it was
    and so is not in the failed step, finishes by length)."""
    work = [([5], GREEDY.replace(max_tokens=2)), ([50], GREEDY.replace(max_tokens=9))]
    outs, errors, _ = run(overlap, work, fail_at=3)
    assert outs[0] == ([6, 7], "length")
    assert outs[1] == ([51, 52], "error")
    assert set(errors) == {"r1"}
