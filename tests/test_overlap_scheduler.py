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


@dataclass
class LoggedEngine(CountingEngine):
    """Records each forward's (prompt chunks, prompt tokens, decode rows, expert hits, misses): a
    prompt chunk starts at position 0 (no prefix cache, no preemption here); a decode row hits
    the expert cache when its position is even."""
    steps: list = None
    hits: int = 0
    misses: int = 0

    def forward(self, chunks, feed=None):
        prompt = [len(c.tokens) for c in chunks if c.start == 0]
        hits = sum(1 for c in chunks if c.start and c.start % 2 == 0)
        misses = len(chunks) - len(prompt) - hits
        self.steps = (self.steps or []) + [(len(prompt), sum(prompt), len(chunks) - len(prompt), hits, misses)]
        self.hits, self.misses = self.hits + hits, self.misses + misses
        return super().forward(chunks, feed)

    def stats(self) -> dict:
        return {"experts": {"hits": self.hits, "misses": self.misses}}


def test_status_lines_say_what_the_steps_did(caplog):
    """A prefill line per step with prompt tokens; a decode line per 2 decode steps (the interval)
    with their tokens over their time (a clock that ticks 1 s a reading, one reading a step) and
    the expert cache's hit rate over them. Idle waits never count."""
    engine = LoggedEngine(EngineConfig("(counting)", num_tokens=256, max_running_requests=4, prefix_cache=False,
                                       decode_log_interval=2, overlap_schedule=False))
    sched = Scheduler(engine)
    ticks = iter(range(10**6))
    sched.status.clock = lambda: float(next(ticks))
    work = [([5, 6, 7], GREEDY), ([50, 51], GREEDY.replace(max_tokens=3)), ([9], GREEDY.replace(max_tokens=2))]
    for i, (prompt, params) in enumerate(work):
        sched.add(Request(f"r{i}", prompt, params))
    with caplog.at_level("INFO", logger="moeferry.scheduler"):
        while sched.has_work:
            sched.step()
    lines = [r.getMessage() for r in caplog.records]
    assert [ln.split(";")[0] for ln in lines if ln.startswith("prefill")] == ["prefill: 3 sequences, 6 prompt tokens"]
    assert lines[0].endswith("; 3 running, 0 queued; KV 2% (6 of 256 tokens)")
    decode = [s[2:] for s in engine.steps if s[2]]
    expected = []
    for (d1, h1, m1), (d2, h2, m2) in zip(decode[::2], decode[1::2]):
        rate = f"{(h1 + h2) / (h1 + h2 + m1 + m2):.3f} ({m1 + m2} misses)"
        expected.append((f"decode: 2 steps, {(d1 + d2) / 2:.1f} tokens/s", f"expert cache hit rate {rate}"))
    got = [(ln.split(";")[0], ln.split("; ")[-1]) for ln in lines if ln.startswith("decode")]
    assert got == expected and len(got) == len(decode) // 2 >= 2
    assert {m for *_, m in decode} != {0} and {h for _, h, _ in decode} != {0}  # both kinds counted

    caplog.clear()  # idle: the next step starts from its own start, not from the last step's end
    idle_until = next(ticks) + 1000
    sched.status.clock = lambda: float(idle_until + next(ticks))
    sched.add(Request("late", [7], GREEDY.replace(max_tokens=3)))
    with caplog.at_level("INFO", logger="moeferry.scheduler"):
        while sched.has_work:
            sched.step()
    got = [r.getMessage() for r in caplog.records if r.getMessage().startswith("decode")]
    assert got and float(got[0].split()[3]) >= 1.0  # 1 token a step, 1 s a step (with the 1000 s idle: 0.002)


def test_a_status_line_never_fails_a_step(caplog):
    """Expert counters that cannot be read leave the decode line without a hit rate; the
    requests run on."""
    engine = LoggedEngine(EngineConfig("(counting)", num_tokens=256, max_running_requests=4, prefix_cache=False,
                                       decode_log_interval=1))

    def broken():
        raise RuntimeError("counters unreadable")

    engine.stats = broken
    sched = Scheduler(engine)
    sched.add(Request("r0", [5, 6], GREEDY))
    with caplog.at_level("INFO", logger="moeferry.scheduler"):
        events = [ev for _ in range(40) if sched.has_work for ev in sched.step()]
    assert [t for ev in events for t in ev.token_ids] == [7, 8, 9, 10, 11, 12] and events[-1].finished
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("decode")]
    assert lines and not any("hit rate" in ln for ln in lines)


def test_a_request_failed_on_a_token_in_flight_saves_no_state_for_its_tokens(monkeypatch):
    """Overlapped: a request whose grammar fails on the token just read ends before that token
    joins its outputs, while the step in flight takes it in, so its state is one token past the
    tokens it gives the prefix cache. That state is not saved as theirs (a later prompt resuming
    there would continue from the wrong state); the KV of those tokens is kept."""
    import moeferry.scheduler.scheduler as sched_mod

    fails_on = 3  # the request's third output token is read when its grammar fails
    monkeypatch.setattr(sched_mod, "grammar_failure",
                        lambda req: "no" if req.request_id == "g" and len(req.output_ids) == fails_on - 1 else None)
    engine = CountingEngine(EngineConfig("(counting)", num_tokens=256, max_running_requests=2))
    sched = Scheduler(engine)
    prompt = [5, 6, 7, 8]
    sched.add(Request("g", prompt, GREEDY))
    ends = {}
    while sched.has_work:
        for ev in sched.step():
            if ev.finished:
                ends[ev.request_id] = ev.finish_reason
    assert ends == {"g": "invalid"}
    saved = sorted(n.depth_end for n in engine.cache.prefix.nodes() if n.snapshot is not None)
    kept = len(prompt) + fails_on - 1  # tokens given to the cache: the prompt and two outputs (the state took in 3)
    assert kept not in saved and len(prompt) in saved
    assert engine.cache.prefix.match(prompt + [9, 10, 11, 99]).length == len(prompt)  # resumes at the prompt's end
    engine.cache.check()
