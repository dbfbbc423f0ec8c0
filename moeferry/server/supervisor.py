"""Supervisor: starts the engine worker (spawn), routes its messages, and restarts it when it dies.

One monitor thread per supervisor reads the worker's pipe and watches its process. When the
worker dies (any cause, `kill -9` included) every in-flight request is ended at once with a
`WorkerDied` item saying so, the state becomes `restarting`, and a new worker is started after
a backoff. More than `max_restarts_per_minute` deaths within a minute put the supervisor in the
terminal `error` state (with the reason) instead of restarting forever. The API process never
exits because of any of this.

A watchdog guards against a worker that is alive but makes no progress (stopped with SIGSTOP,
stuck in a step): while requests are in flight the worker sends a `Heartbeat` between steps. After
`stall_report_s` without any message the state becomes `stalled` (on /health, new requests get a
503); after `stall_timeout_s` the worker is killed, its requests fail with a message saying why,
and a new one starts as after any death. A worker that speaks again before that is `ok` again.

`drain` (on a shutdown signal) stops taking requests, lets the running ones finish for a moment
and then ends the rest with a clear "shutting down" error, so no client is left with a cut
connection.

Consumers register a *sink* per request: a callable that receives, from the monitor thread,
`Accepted`, `Rejected`, every `TokenEvent` of the request, or `WorkerDied`.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import queue
import signal
import threading
import time
from dataclasses import dataclass
from typing import Callable

from moeferry.server import worker
from moeferry.server.first_worker import KILLED_S, FirstWorker, spawn
from moeferry.server.messages import (Abort, Accepted, BootFailed, Events, Heartbeat, Progress, Ready, Rejected,
                                      Shutdown, StatsUpdate, Submit, WorkerSpec)

log = logging.getLogger("moeferry.supervisor")

LOADING, OK, STALLED, RESTARTING, ERROR = "loading", "ok", "stalled", "restarting", "error"
STOPPING, STOPPED = "stopping", "stopped"
STALL_REPORT_S = 5.0  # silence (with requests in flight) before /health says stalled


@dataclass(frozen=True)
class WorkerDied:
    """The end of every request in flight when its worker is gone (or the server shuts down)."""
    message: str
    code: str = "worker_died"


class Unavailable(Exception):
    """No worker is ready to take requests (loading, restarting, error or stopped)."""

    def __init__(self, state: str, message: str):
        super().__init__(message)
        self.state = state


def smaller_plan(spec: WorkerSpec, last_stats: dict) -> WorkerSpec:
    """The spec for the next worker: if the dead one's OOM guard had shrunk its expert cache,
    start with that smaller cache (an explicit size) instead of planning the same one again."""
    memory, experts = last_stats.get("memory") or {}, last_stats.get("experts") or {}
    slots = experts.get("slots")
    if not memory.get("cache_shrinks") or not slots or not spec.engine.offloads_experts:
        return spec
    log.warning("the dead worker's expert cache had shrunk to %d slots after out-of-memory errors; the next "
                "worker starts with that many", slots)
    engine = dataclasses.replace(spec.engine, moe_cache_size=slots, moe_cache_rate=None, moe_cache_auto=False)
    return dataclasses.replace(spec, engine=engine)


def describe_exit(code: int | None) -> str:
    if code is None:
        return "exit status unknown"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class _Worker:
    """One worker process, its pipe end and the thread that sends to it."""

    def __init__(self, spec: WorkerSpec, log_level: str, generation: int, first: FirstWorker | None = None):
        handed = first.hand_over(spec, log_level) if first is not None else None
        if handed is not None:  # the process started with the command, its imports done meanwhile
            self.conn, self.process = handed
        else:
            self.conn, self.process = spawn(worker.main, (spec, log_level), f"moeferry-worker-{generation}")
        self.outbox: queue.Queue = queue.Queue()
        self.boot_failure: str | None = None
        self.boot_permanent = False  # the failure does not go away with a restart
        self.stall: str | None = None  # why the watchdog killed it
        self.last_heard = time.monotonic()
        threading.Thread(target=self._send_loop, name=f"worker-{generation}-outbox", daemon=True).start()

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def send(self, msg) -> None:
        self.outbox.put(msg)

    def _send_loop(self) -> None:
        while True:
            msg = self.outbox.get()
            if msg is None:
                return
            try:
                self.conn.send(msg)
            except (BrokenPipeError, EOFError, OSError):
                return  # the monitor sees the death and handles it

    def close(self) -> None:
        self.outbox.put(None)


class Supervisor:
    def __init__(self, spec: WorkerSpec, log_level: str = "info", max_restarts_per_minute: int = 5,
                 backoff_s: float = 0.5, max_backoff_s: float = 10.0, on_ready: Callable[[Ready], None] | None = None,
                 stall_timeout_s: float = 60.0, first_worker: FirstWorker | None = None):
        self.spec = spec
        self.first_worker = first_worker  # the process to boot first, started before the spec was known
        self.log_level = log_level
        self.max_restarts_per_minute = max_restarts_per_minute
        self.backoff_s, self.max_backoff_s = backoff_s, max_backoff_s
        self.on_ready = on_ready
        self.stall_timeout_s = stall_timeout_s
        self.stall_report_s = min(STALL_REPORT_S, stall_timeout_s / 2)
        self._busy_since = time.monotonic()  # when the first of the requests in flight arrived
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._sinks: dict[str, Callable] = {}
        self._worker: _Worker | None = None
        self._deaths: collections.deque[float] = collections.deque()
        self._thread: threading.Thread | None = None
        self.state = LOADING
        self.reason: str | None = None  # why the state is restarting/error
        self.progress: Progress | None = None
        self.ready: Ready | None = None
        self.worker_stats: dict = {}
        self.restarts = 0

    # ------------------------------------------------------------ public API (any thread)

    @property
    def pid(self) -> int | None:
        w = self._worker
        return w.pid if w is not None else None

    @property
    def in_flight(self) -> int:
        return len(self._sinks)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._monitor, name="supervisor", daemon=True)
        self._thread.start()

    def submit(self, request, sink: Callable) -> None:
        """Send a request to the worker; raises Unavailable unless it is ready."""
        with self._lock:
            if self.state != OK:
                raise Unavailable(self.state, self._unavailable_message())
            if not self._sinks:
                self._busy_since = time.monotonic()
            self._sinks[request.request_id] = sink
            self._worker.send(Submit(request))

    def abort(self, request_id: str) -> None:
        """Stop a request (client gone, stop string matched). Idempotent; no more items reach its sink."""
        with self._lock:
            if self._sinks.pop(request_id, None) is not None and self._worker is not None:
                self._worker.send(Abort(request_id))

    def drain(self, timeout: float) -> int:
        """Stop taking requests; wait up to `timeout` for those in flight, then end the rest with a
        "shutting down" error. Returns how many were ended."""
        with self._lock:
            if self.state in (STOPPING, STOPPED):
                return 0
            self.state = STOPPING
        deadline = time.monotonic() + timeout
        while self._sinks and time.monotonic() < deadline:
            time.sleep(0.05)
        failed = self._fail_all(WorkerDied("the server is shutting down; retry the request", "server_shutting_down"))
        if failed:
            log.warning("shutting down: %d request(s) still running were ended", failed)
        return failed

    def stop(self, timeout: float = 5.0) -> None:
        """Shut the worker down (gracefully, then by force)."""
        self._stop.set()
        with self._lock:
            self.state = STOPPED
            w, self._worker = self._worker, None
            first, self.first_worker = self.first_worker, None
        if first is not None:  # never handed a spec (stopped before its monitor started)
            first.cancel()
        if w is None:
            return
        w.send(Shutdown())
        w.close()
        # only one thread may wait for the process: of two waiting, one reaps it and the other is told
        # it has no such child, and sees it alive until the first records the exit. So the monitor
        # (which returns once the worker exits or falls quiet) ends first, then this thread waits.
        deadline = time.monotonic() + timeout
        self._join_monitor(timeout)
        if not self._monitor_running():
            w.process.join(max(0.0, deadline - time.monotonic()))
        if self._monitor_running() or w.process.is_alive():
            log.warning("worker %s did not stop in %.0f s; killing it", w.pid, timeout)
            w.process.kill()
            self._join_monitor(KILLED_S)
            w.process.join(KILLED_S)
        self._fail_all(WorkerDied("the server is shutting down; retry the request", "server_shutting_down"))

    # ------------------------------------------------------------ monitor thread

    def _monitor_running(self) -> bool:
        """Whether the monitor thread runs (False when asked from that thread)."""
        t = self._thread
        return t is not None and t is not threading.current_thread() and t.is_alive()

    def _join_monitor(self, timeout: float) -> None:
        if self._monitor_running():
            self._thread.join(timeout)

    def _unavailable_message(self) -> str:
        if self.state == LOADING:
            p = self.progress
            return "the model is loading" + (f" ({p.phase}, {p.fraction:.0%})" if p else "") + "; retry shortly"
        if self.state == RESTARTING:
            return f"the engine worker is restarting ({self.reason}); retry shortly"
        if self.state == ERROR:
            return f"the engine worker failed and is not restarting: {self.reason}"
        if self.state == STALLED:
            return f"the engine worker is not responding ({self.reason}); retry shortly"
        return "the server is shutting down"

    def _monitor(self) -> None:
        generation = 0
        while not self._stop.is_set():
            with self._lock:
                first, self.first_worker = self.first_worker, None
            w = _Worker(self.spec, self.log_level, generation, first)
            with self._lock:
                if self._stop.is_set():
                    w.process.kill()
                    return
                self._worker = w
            log.info("started engine worker pid %d%s", w.pid, f" (restart {generation})" if generation else "")
            self._pump(w)
            w.process.join(0.5)
            if w.process.is_alive() and not self._stop.is_set():  # its pipe is gone: it can serve no one
                log.error("worker %s lost its pipe but is still running; killing it", w.pid)
                w.process.kill()
                w.process.join(5.0)
            w.close()
            if self._stop.is_set():
                return
            cause = w.boot_failure or w.stall or describe_exit(w.process.exitcode)
            self.spec = smaller_plan(self.spec, self.worker_stats)
            delay = self._on_death(w, cause)
            if delay is None or self._stop.wait(delay):
                return
            generation += 1
            with self._lock:
                self.restarts += 1

    def _pump(self, w: _Worker) -> None:
        """Dispatch the worker's messages until it dies."""
        while True:
            try:
                if not w.conn.poll(0.2):
                    if not w.process.is_alive() or self._stop.is_set():
                        return
                    self._watch(w)
                    continue
                msg = w.conn.recv()
                self._heard(w)
            except (EOFError, OSError):
                return
            except Exception:  # noqa: BLE001 - an unreadable message must not kill the monitor
                log.exception("could not read a message from worker %s", w.pid)
                continue
            try:
                self._dispatch(w, msg)
            except Exception:  # noqa: BLE001
                log.exception("dispatching %s failed", type(msg).__name__)

    def _heard(self, w: _Worker) -> None:
        w.last_heard = time.monotonic()
        if self.state == STALLED:
            with self._lock:
                if self.state == STALLED:
                    self.state, self.reason = OK, None
            log.warning("worker %s is responding again", w.pid)

    def _watch(self, w: _Worker) -> None:
        """The watchdog: a worker silent while requests are in flight is stalled, then replaced."""
        if not self._sinks or self.state not in (OK, STALLED) or w.stall is not None:
            return
        silent = time.monotonic() - max(w.last_heard, self._busy_since)
        if silent >= self.stall_timeout_s:
            w.stall = (f"no progress for {silent:.0f} s with {len(self._sinks)} request(s) in flight "
                       f"(--worker-stall-timeout {self.stall_timeout_s:g})")
            log.error("worker %s is stalled: %s; killing it", w.pid, w.stall)
            w.process.kill()  # a stopped (SIGSTOP) process dies of SIGKILL too
        elif silent >= self.stall_report_s and self.state == OK:
            with self._lock:
                self.state = STALLED
                self.reason = f"worker pid {w.pid} made no progress for {silent:.0f} s with requests in flight"
            log.warning("%s", self.reason)

    def _dispatch(self, w: _Worker, msg) -> None:
        if isinstance(msg, Events):
            for ev in msg.events:
                with self._lock:
                    sink = self._sinks.pop(ev.request_id) if ev.finished else self._sinks.get(ev.request_id)
                if sink is not None:
                    sink(ev)
        elif isinstance(msg, Accepted):
            sink = self._sinks.get(msg.request_id)
            if sink is not None:
                sink(msg)
        elif isinstance(msg, Rejected):
            with self._lock:
                sink = self._sinks.pop(msg.request_id, None)
            if sink is not None:
                sink(msg)
        elif isinstance(msg, StatsUpdate):
            self.worker_stats = msg.stats
        elif isinstance(msg, Progress):
            self.progress = msg
            log.info("worker %s: %s (%.0f%%)", w.pid, msg.phase, 100 * msg.fraction)
        elif isinstance(msg, Ready):
            with self._lock:
                self.ready, self.state, self.reason, self.progress = msg, OK, None, None
            log.info("engine worker pid %d is ready", msg.pid)
            if self.on_ready is not None:
                self.on_ready(msg)
        elif isinstance(msg, Heartbeat):
            pass  # its arrival is the point (see _heard)
        elif isinstance(msg, BootFailed):
            w.boot_failure = f"boot failed: {msg.reason}"
            w.boot_permanent = msg.permanent
        else:
            log.error("unexpected message %r from worker %s", type(msg).__name__, w.pid)

    def _on_death(self, w: _Worker, cause: str) -> float | None:
        """Fail everything in flight; pick the next state. Returns the delay before a restart, or None."""
        now = time.monotonic()
        with self._lock:
            self._deaths.append(now)
            while self._deaths and now - self._deaths[0] > 60.0:
                self._deaths.popleft()
            recent = len(self._deaths)
            self._worker = None
            self.worker_stats = {}
            self.progress = None
            if w.boot_permanent:
                self.state = ERROR
                self.reason = (f"worker pid {w.pid} {cause}; not restarting: the same configuration would fail "
                               "the same way")
                text = f"the engine cannot start ({cause})"
            elif recent > self.max_restarts_per_minute:
                self.state = ERROR
                self.reason = (f"worker pid {w.pid} died ({cause}); {recent} deaths within a minute, "
                               f"more than the limit of {self.max_restarts_per_minute}: not restarting")
                text = f"the engine worker died ({cause}) and is not restarting: too many deaths in a minute"
            else:
                self.state = RESTARTING
                self.reason = f"worker pid {w.pid} died ({cause})"
                text = f"the engine worker died ({cause}) and is restarting; retry the request"
                if w.stall is not None:
                    self.reason = f"worker pid {w.pid} was stalled and is being replaced ({w.stall})"
                    text = (f"the engine worker stopped making progress ({w.stall}); it is being replaced, "
                            "retry the request")
        failed = self._fail_all(WorkerDied(text))
        if self.state == ERROR:
            log.error("%s; %d in-flight request(s) failed", self.reason, failed)
            return None
        delay = min(self.backoff_s * 2 ** (recent - 1), self.max_backoff_s)
        log.error("%s; %d in-flight request(s) failed; restarting in %.1f s", self.reason, failed, delay)
        return delay

    def _fail_all(self, item: WorkerDied) -> int:
        with self._lock:
            sinks, self._sinks = list(self._sinks.values()), {}
        for sink in sinks:
            try:
                sink(item)
            except Exception:  # noqa: BLE001
                log.exception("failing a request's sink raised")
        return len(sinks)
