"""Supervisor: starts the engine worker (spawn), routes its messages, and restarts it when it dies.

One monitor thread per supervisor reads the worker's pipe and watches its process. When the
worker dies (any cause, `kill -9` included) every in-flight request is ended at once with a
`WorkerDied` item saying so, the state becomes `restarting`, and a new worker is started after
a backoff. More than `max_restarts_per_minute` deaths within a minute put the supervisor in the
terminal `error` state (with the reason) instead of restarting forever. The API process never
exits because of any of this.

Consumers register a *sink* per request: a callable that receives, from the monitor thread,
`Accepted`, `Rejected`, every `TokenEvent` of the request, or `WorkerDied`.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import multiprocessing as mp
import queue
import signal
import threading
import time
from dataclasses import dataclass
from typing import Callable

from moeferry.server import worker
from moeferry.server.messages import (Abort, Accepted, BootFailed, Events, Progress, Ready, Rejected, Shutdown,
                                      StatsUpdate, Submit, WorkerSpec)

log = logging.getLogger("moeferry.supervisor")

LOADING, OK, RESTARTING, ERROR, STOPPED = "loading", "ok", "restarting", "error", "stopped"


@dataclass(frozen=True)
class WorkerDied:
    message: str


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

    def __init__(self, spec: WorkerSpec, log_level: str, generation: int):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe(duplex=True)
        self.process = ctx.Process(target=worker.main, args=(child, spec, log_level),
                                   name=f"moeferry-worker-{generation}", daemon=True)
        self.process.start()
        child.close()  # our copy; the worker's death now shows as EOF on self.conn
        self.outbox: queue.Queue = queue.Queue()
        self.boot_failure: str | None = None
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
                 backoff_s: float = 0.5, max_backoff_s: float = 10.0, on_ready: Callable[[Ready], None] | None = None):
        self.spec = spec
        self.log_level = log_level
        self.max_restarts_per_minute = max_restarts_per_minute
        self.backoff_s, self.max_backoff_s = backoff_s, max_backoff_s
        self.on_ready = on_ready
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
            self._sinks[request.request_id] = sink
            self._worker.send(Submit(request))

    def abort(self, request_id: str) -> None:
        """Stop a request (client gone, stop string matched). Idempotent; no more items reach its sink."""
        with self._lock:
            if self._sinks.pop(request_id, None) is not None and self._worker is not None:
                self._worker.send(Abort(request_id))

    def stop(self, timeout: float = 5.0) -> None:
        """Shut the worker down (gracefully, then by force)."""
        self._stop.set()
        with self._lock:
            self.state = STOPPED
            w, self._worker = self._worker, None
        if w is None:
            return
        w.send(Shutdown())
        w.close()
        w.process.join(timeout)
        if w.process.is_alive():
            log.warning("worker %s did not stop in %.0f s; killing it", w.pid, timeout)
            w.process.kill()
            w.process.join(timeout)
        self._fail_all(WorkerDied("the server is shutting down"))

    # ------------------------------------------------------------ monitor thread

    def _unavailable_message(self) -> str:
        if self.state == LOADING:
            p = self.progress
            return "the model is loading" + (f" ({p.phase}, {p.fraction:.0%})" if p else "") + "; retry shortly"
        if self.state == RESTARTING:
            return f"the engine worker is restarting ({self.reason}); retry shortly"
        if self.state == ERROR:
            return f"the engine worker failed and is not restarting: {self.reason}"
        return "the server is shutting down"

    def _monitor(self) -> None:
        generation = 0
        while not self._stop.is_set():
            w = _Worker(self.spec, self.log_level, generation)
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
            cause = w.boot_failure or describe_exit(w.process.exitcode)
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
                    continue
                msg = w.conn.recv()
            except (EOFError, OSError):
                return
            except Exception:  # noqa: BLE001 - an unreadable message must not kill the monitor
                log.exception("could not read a message from worker %s", w.pid)
                continue
            try:
                self._dispatch(w, msg)
            except Exception:  # noqa: BLE001
                log.exception("dispatching %s failed", type(msg).__name__)

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
        elif isinstance(msg, BootFailed):
            w.boot_failure = f"boot failed: {msg.reason}"
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
            if recent > self.max_restarts_per_minute:
                self.state = ERROR
                self.reason = (f"worker pid {w.pid} died ({cause}); {recent} deaths within a minute, "
                               f"more than the limit of {self.max_restarts_per_minute}: not restarting")
                text = f"the engine worker died ({cause}) and is not restarting: too many deaths in a minute"
            else:
                self.state = RESTARTING
                self.reason = f"worker pid {w.pid} died ({cause})"
                text = f"the engine worker died ({cause}) and is restarting; retry the request"
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
