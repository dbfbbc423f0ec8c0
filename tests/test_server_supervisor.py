"""The worker loop and supervisor with a fake scheduler (the real worker process, the real messages):
one request's failure stays with it, a failing step fails its batch and the worker goes on, and a
worker that keeps dying puts the supervisor in `error` with the reason instead of looping."""
from __future__ import annotations

import argparse
import threading
import time

import openai
import pytest

from moeferry.config import ServeConfig, add_serve_arguments
from moeferry.engine.config import derive_sizes
from moeferry.scheduler.request import TokenEvent
from moeferry.scheduler.scheduler import RequestRejected
from moeferry.server.app import build_server, worker_spec
from moeferry.server.first_worker import FirstWorker
from moeferry.server.supervisor import ERROR, OK, Supervisor
from scripted_model import FakeSchedulerBase, serve_in_thread

ADD_FAILS, PROCESSING_FAILS, STEP_FAILS = 7, 13, 17  # prompt tokens that trigger each failure


class FakeScheduler(FakeSchedulerBase):
    """Echoes each prompt back one token per step. A prompt holding ADD_FAILS makes add() raise,
    PROCESSING_FAILS makes its own processing fail (an error event, as the real scheduler reports a
    per-request failure), STEP_FAILS makes the whole step() raise."""

    def __init__(self, max_seq_len: int):
        super().__init__()
        self.max_seq_len = max_seq_len

    def add(self, req) -> None:
        if ADD_FAILS in req.prompt_ids:
            raise RuntimeError("fake add failure")
        if len(req.prompt_ids) >= self.max_seq_len // 2:
            raise RequestRejected("fake limit: prompt too long", "context_length_exceeded", "prompt")
        self.reqs[req.request_id] = [req, 0]

    def step(self) -> list[TokenEvent]:
        time.sleep(0.02)
        if any(STEP_FAILS in r.prompt_ids for r, _ in self.reqs.values()):
            self.reqs.clear()
            raise RuntimeError("fake step failure")
        events = []
        for rid, entry in list(self.reqs.items()):
            req, n = entry
            if PROCESSING_FAILS in req.prompt_ids:
                del self.reqs[rid]
                events.append(TokenEvent(rid, [], None, True, "error", len(req.prompt_ids), 0, "fake request failure"))
                continue
            entry[1] = n + 1
            done = entry[1] >= (req.params.max_tokens or 4)
            if done:
                del self.reqs[rid]
            events.append(TokenEvent(rid, [req.prompt_ids[n % len(req.prompt_ids)]], None, done,
                                     "length" if done else None, len(req.prompt_ids), 0))
        return events


def fake_factory(spec, progress):
    progress("fake loading", 0.5)
    sizes = derive_sizes(spec.engine, 4096)
    return FakeScheduler(sizes.max_seq_len), dict(vocab_size=4096, sizes=sizes, eos_token_ids=())


def dies_at_boot(spec, progress):
    raise RuntimeError("fake checkpoint is corrupt")


def _config(model: str) -> ServeConfig:
    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    return ServeConfig.from_args(p.parse_args(["--model", model, "--device", "cpu", "--served-model-name", "fake",
                                               "--max-seq-len-override", "64"]))


@pytest.fixture(scope="module")
def fake_server(checkpoint):
    """The real app in this process (uvicorn in a thread) over a worker running FakeScheduler."""
    server = build_server(_config(str(checkpoint("qwen3_5_moe"))), factory=f"{__name__}:fake_factory")
    url, stop = serve_in_thread(server)
    yield server, openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
    stop()


def test_one_failing_request_fails_alone(fake_server):
    server, client = fake_server
    pid = server.supervisor.pid
    results: dict[str, object] = {}

    def run(name, prompt, max_tokens=30):
        try:
            results[name] = client.completions.create(model="fake", prompt=prompt, max_tokens=max_tokens)
        except openai.APIError as e:
            results[name] = e

    healthy = threading.Thread(target=run, args=("healthy", [100, 200, 300]))
    healthy.start()
    time.sleep(0.2)  # the healthy request is running in the worker while the others fail
    run("add", [1, ADD_FAILS])
    run("processing", [1, PROCESSING_FAILS])
    healthy.join(60)
    for name in ("add", "processing"):
        assert isinstance(results[name], openai.InternalServerError), results[name]
        assert results[name].status_code == 500
    # The client learns what failed, not the exception's text (the log has that).
    assert "could not admit the request (RuntimeError)" in str(results["add"])
    assert "fake add failure" not in str(results["add"])
    assert "fake request failure" in str(results["processing"])
    ok = results["healthy"]
    assert ok.choices[0].finish_reason == "length" and ok.usage.completion_tokens == 30
    assert server.supervisor.pid == pid and server.supervisor.restarts == 0


def test_a_failing_step_fails_its_batch_and_the_worker_goes_on(fake_server):
    server, client = fake_server
    pid = server.supervisor.pid
    with pytest.raises(openai.InternalServerError, match=r"the engine step failed \(RuntimeError\)"):
        client.completions.create(model="fake", prompt=[1, STEP_FAILS], max_tokens=3)
    out = client.completions.create(model="fake", prompt=[100, 200], max_tokens=3)
    assert out.usage.completion_tokens == 3
    assert server.supervisor.pid == pid and server.supervisor.state == OK


def test_scheduler_rejection_is_a_400(fake_server):
    server, client = fake_server
    # 40 tokens pass the API's own check (context 64); the fake scheduler refuses >= 32.
    with pytest.raises(openai.BadRequestError, match="fake limit") as e:
        client.completions.create(model="fake", prompt=list(range(100, 140)), max_tokens=1)
    assert e.value.body["code"] == "context_length_exceeded" and e.value.body["param"] == "prompt"


def _wait_for(sup: Supervisor, state: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while sup.state != state and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sup.state == state, (sup.state, sup.reason)


def test_restart_limit_ends_in_error_with_the_reason(checkpoint):
    spec = worker_spec(_config(str(checkpoint("qwen3_5_moe"))), factory=f"{__name__}:dies_at_boot")
    sup = Supervisor(spec, "warning", max_restarts_per_minute=1, backoff_s=0.05)
    sup.start()
    try:
        _wait_for(sup, ERROR)
        assert sup.state == ERROR
        assert sup.restarts == 1  # started twice, then gave up
        assert "fake checkpoint is corrupt" in sup.reason and "not restarting" in sup.reason
    finally:
        sup.stop()


def test_the_first_worker_started_before_its_spec_boots_the_engine(checkpoint):
    """`moeferry serve` starts its first worker before it knows what to build (`FirstWorker`: its
    imports run while the API process starts); the supervisor hands that process the spec, spawns
    another if it died before then, and ends one it never handed a spec."""
    spec = worker_spec(_config(str(checkpoint("qwen3_5_moe"))), factory=f"{__name__}:fake_factory")
    first = FirstWorker()
    sup = Supervisor(spec, "warning", first_worker=first)
    sup.start()
    try:
        _wait_for(sup, OK)
        assert sup.ready.pid == sup.pid == first.process.pid
    finally:
        sup.stop()
    assert not first.process.is_alive()

    dead = FirstWorker()
    dead.process.kill()
    dead.process.join()
    sup = Supervisor(spec, "warning", first_worker=dead)
    sup.start()
    try:
        _wait_for(sup, OK)
        assert sup.ready.pid == sup.pid != dead.process.pid
    finally:
        sup.stop()

    unused = FirstWorker()
    Supervisor(spec, "warning", first_worker=unused).stop()  # stopped before it started a worker
    assert not unused.process.is_alive()


def refused_plan_at_boot(spec, progress):
    from moeferry.memory.plan import PlanRefused
    raise PlanRefused("the pools do not fit: kv 2.50 GiB + experts 7.00 GiB > usable 8.00 GiB")


def test_a_refused_plan_is_not_restarted(checkpoint):
    """A boot failure no restart can fix (here a memory plan that does not fit) ends in error at
    once, with the plan's numbers in the reason."""
    spec = worker_spec(_config(str(checkpoint("qwen3_5_moe"))), factory=f"{__name__}:refused_plan_at_boot")
    sup = Supervisor(spec, "warning", max_restarts_per_minute=5, backoff_s=0.05)
    sup.start()
    try:
        _wait_for(sup, ERROR)
        assert sup.state == ERROR and sup.restarts == 0
        assert "usable 8.00 GiB" in sup.reason and "not restarting" in sup.reason
    finally:
        sup.stop()


def test_a_plan_that_cannot_fit_is_refused_at_boot_with_its_numbers(checkpoint):
    """The real worker: an offload engine with a 1 MiB budget (CPU mode: --gpu-memory-limit is the
    host budget) cannot even hold its weights; the plan is refused with every term and the server
    reports it instead of restarting."""
    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    cfg = ServeConfig.from_args(p.parse_args(["--model", str(checkpoint("qwen3_5_moe")), "--device", "cpu",
                                              "--moe-backend", "offload", "--moe-cache-size", "4",
                                              "--gpu-memory-limit", "1MiB"]))
    sup = Supervisor(worker_spec(cfg), "warning", backoff_s=0.05)
    sup.start()
    try:
        _wait_for(sup, ERROR)
        assert sup.state == ERROR and sup.restarts == 0, sup.reason
        assert "PlanRefused" in sup.reason and "usable" in sup.reason and "weights" in sup.reason
        assert "1.00 MiB" in sup.reason and "not restarting" in sup.reason
    finally:
        sup.stop()
