"""The engine worker: a spawned process that owns the Engine and the Scheduler and loops step().

It talks to the API process only through the typed messages of `messages.py` over one duplex
Pipe. A reader thread moves incoming messages into a local queue so a long step never blocks
the pipe; the main thread admits, aborts and steps. Failures stay as small as they can:

- a Submit the scheduler refuses (e.g. prompt over the context) -> `Rejected` for that request;
- any other exception while admitting or aborting one request -> that request fails alone;
- an exception escaping `step()` (which batches every running request) fails the requests that
  were in that batch and the loop goes on; if the scheduler keeps failing with nothing left to
  fail, the worker exits and the supervisor starts a fresh one.
"""
from __future__ import annotations

import importlib
import logging
import os
import queue
import signal
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection

from moeferry.server import faults
from moeferry.server.messages import (Abort, Accepted, BootFailed, Events, Heartbeat, Progress, Ready, Rejected,
                                      Shutdown, StatsUpdate, Submit, WorkerSpec)

log = logging.getLogger("moeferry.worker")

STATS_INTERVAL_S = 0.25
HEARTBEAT_S = 0.5  # while busy; the supervisor's watchdog counts silence from here
IDLE_WAIT_S = 1.0
MAX_EMPTY_FAILURES = 3  # step() failures in a row with no request left to blame


def build_scheduler(spec: WorkerSpec, progress):
    """The real factory: build the engine from the spec's EngineConfig and wrap it in a Scheduler."""
    from moeferry.engine.engine import Engine
    from moeferry.scheduler.scheduler import Scheduler

    engine = Engine.build(spec.engine, progress=progress)
    progress("starting the scheduler", 0.98)
    info = dict(vocab_size=engine.spec.vocab_size, sizes=engine.sizes, eos_token_ids=tuple(engine.spec.eos_token_ids),
                details={"architecture": engine.spec.architecture, "layers": engine.spec.num_layers,
                         "experts": f"{engine.spec.num_experts} (top {engine.spec.top_k})",
                         "engine": engine.describe(), "moe_backend": engine.cfg.moe_backend},
                plan=engine.plan.to_dict() if engine.plan else None,
                plan_table=engine.plan.table() if engine.plan else None)
    return Scheduler(engine), info


def _load_factory(path: str):
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def main(conn: Connection, spec: WorkerSpec, log_level: str = "info") -> None:
    """Entry point of the spawned process."""
    # Ctrl-C (and a group-wide SIGTERM) reach us too; the API process decides when we stop (Shutdown,
    # or EOF on the pipe when it is gone), so its graceful shutdown is not mistaken for a worker death.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s")
    from tqdm import tqdm

    # The loading bar's lock need not be a cross-process semaphore (a SIGKILLed worker would leak it).
    tqdm.set_lock(threading.RLock())
    send = _Sender(conn)
    try:
        factory = _load_factory(spec.factory)
        scheduler, info = factory(spec, lambda phase, fraction: send(Progress(phase, fraction)))
        faults.install_from_env(scheduler)  # tests only: off unless MOEFERRY_FAULT_INJECT is set
    except BaseException as e:  # noqa: BLE001 - anything at boot is reported, then we exit
        log.error("worker boot failed:\n%s", traceback.format_exc())
        send(BootFailed(f"{type(e).__name__}: {e}", permanent=_permanent(e)))
        sys.exit(1)
    send(Ready(pid=os.getpid(), **info))
    log.info("worker %d ready", os.getpid())
    Loop(scheduler, conn, send).run()


def _permanent(e: BaseException) -> bool:
    """A boot failure a restart cannot fix: a memory plan that cannot fit, host RAM too small for
    the expert banks, a broken checkpoint."""
    from moeferry.checkpoint.reader import CheckpointError
    from moeferry.memory.plan import PlanRefused
    from moeferry.moe.bank import HostRamError

    return isinstance(e, (PlanRefused, HostRamError, CheckpointError))


class _Sender:
    """Sends from the loop thread; a dead parent ends the worker."""

    def __init__(self, conn: Connection):
        self.conn = conn

    def __call__(self, msg) -> None:
        try:
            self.conn.send(msg)
        except (BrokenPipeError, EOFError, OSError):
            log.warning("API process is gone; worker exits")
            os._exit(0)


class Loop:
    def __init__(self, scheduler, conn: Connection, send):
        self.scheduler = scheduler
        self.send = send
        self.inbox: queue.Queue = queue.Queue()
        self.live: set[str] = set()  # admitted and not yet finished
        self.last_stats = 0.0
        self.sent_stats: dict | None = None
        self.empty_failures = 0
        self.steps = 0
        self.last_beat = 0.0
        threading.Thread(target=self._read, args=(conn,), name="worker-inbox", daemon=True).start()

    def _read(self, conn: Connection) -> None:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                self.inbox.put(Shutdown())  # the API process is gone
                return
            self.inbox.put(msg)

    def run(self) -> None:
        while True:
            if not self._drain(block=not self.scheduler.has_work):
                return
            if self.scheduler.has_work:
                self._step()
                self._heartbeat()
            self._report_stats()

    def _drain(self, block: bool) -> bool:
        """Handle every waiting message (waiting up to IDLE_WAIT_S for one if idle); False on Shutdown."""
        try:
            msg = self.inbox.get(timeout=IDLE_WAIT_S) if block else self.inbox.get_nowait()
        except queue.Empty:
            return True
        while True:
            if isinstance(msg, Shutdown):
                return False
            if isinstance(msg, Submit):
                self._admit(msg.request)
            elif isinstance(msg, Abort):
                self._abort(msg.request_id)
            else:
                log.error("unexpected message %r", type(msg).__name__)
            try:
                msg = self.inbox.get_nowait()
            except queue.Empty:
                return True

    def _admit(self, request) -> None:
        from moeferry.scheduler.scheduler import RequestRejected

        rid = request.request_id
        try:
            self.scheduler.add(request)
        except RequestRejected as e:
            self.send(Rejected(rid, e.code, str(e), e.param))
            return
        except Exception as e:  # noqa: BLE001 - one request's failure stays with it
            log.exception("admitting request %s failed", rid)
            self.send(Rejected(rid, "internal_error", f"the engine could not admit the request "
                                                      f"({type(e).__name__}); the details are in the server log"))
            return
        self.live.add(rid)
        self.send(Accepted(rid))

    def _abort(self, rid: str) -> None:
        if rid not in self.live:
            return
        self.live.discard(rid)
        try:
            self.scheduler.abort(rid)
        except Exception:  # noqa: BLE001
            log.exception("aborting request %s failed", rid)

    def _step(self) -> None:
        try:
            events = self.scheduler.step()
        except Exception as e:  # noqa: BLE001 - the batch fails, the worker lives
            log.exception("engine step failed; failing the %d request(s) in it", len(self.live))
            from moeferry.scheduler.scheduler import step_failure

            self._fail_live(step_failure(e))
            return
        self.empty_failures = 0
        events = [ev for ev in events if ev.request_id in self.live]
        for ev in events:
            if ev.finished:
                self.live.discard(ev.request_id)
        if events:
            self.send(Events(events))

    def _heartbeat(self) -> None:
        self.steps += 1
        now = time.monotonic()
        if now - self.last_beat >= HEARTBEAT_S:
            self.last_beat = now
            self.send(Heartbeat(self.steps))

    def _fail_live(self, message: str) -> None:
        from moeferry.scheduler.request import TokenEvent

        if not self.live:
            self.empty_failures += 1
            if self.empty_failures >= MAX_EMPTY_FAILURES:
                log.error("the scheduler keeps failing with no request running; exiting for a fresh worker")
                sys.exit(3)
            return
        failed = sorted(self.live)
        for rid in failed:
            self._abort(rid)
        self.send(Events([TokenEvent(request_id=rid, token_ids=[], logprobs=None, finished=True,
                                     finish_reason="error", prompt_tokens=0, cached_tokens=0, error=message)
                          for rid in failed]))

    def _report_stats(self) -> None:
        now = time.monotonic()
        if now - self.last_stats < STATS_INTERVAL_S:
            return
        self.last_stats = now
        try:
            stats = dict(self.scheduler.stats())
        except Exception:  # noqa: BLE001 - stats are best effort, never fatal
            log.exception("scheduler.stats() failed")
            return
        if stats != self.sent_stats:
            self.sent_stats = stats
            self.send(StatsUpdate(stats))
