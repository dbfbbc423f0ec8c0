"""The first engine worker, started as `moeferry serve` begins, before its spec is known.

A worker is a spawned process: it imports torch, Triton and the engine before it can build
anything (~2 s on the GPU host), and the API process needs about as long to import them and
resolve its configuration (the model's config, the tokenizer) before it knows what to build.
`FirstWorker` starts the process first thing, so its imports run beside the API process's; the
supervisor then hands it the spec (`hand_over`) instead of spawning its first worker. Restarts
spawn as always. This module imports nothing heavy: the command line reaches it before torch.
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import signal
from multiprocessing.connection import Connection

# seconds to wait for a killed worker to be reaped: SIGKILL always ends it, but on a loaded host
# (a 2-core CI box running other tests) the exit can take longer than the graceful stop's 5 s
KILLED_S = 30.0

log = logging.getLogger("moeferry.supervisor")


def _wait_for_spec(conn: Connection) -> None:
    """The process's entry: import what every boot imports, then boot from the spec it is sent
    (the API process ended first, a configuration error say: exit quietly)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # as the worker's own main: the API process decides
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:  # the imports of a boot, while the API process starts
        import moeferry.engine.engine  # noqa: F401
        import moeferry.scheduler.scheduler  # noqa: F401
    except Exception:  # noqa: BLE001 - the boot imports them again, and reports a failure to the supervisor
        pass
    from moeferry.server import worker
    try:
        spec, log_level = conn.recv()
    except (EOFError, OSError):
        return
    worker.main(conn, spec, log_level)


def spawn(target, args: tuple, name: str) -> tuple[Connection, mp.process.BaseProcess]:
    """A spawned daemon process running target(its pipe end, *args); (our pipe end, the process).
    Our copy of its end is closed, so its death shows as EOF on ours."""
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe(duplex=True)
    process = ctx.Process(target=target, args=(child, *args), name=name, daemon=True)
    process.start()
    child.close()
    return conn, process


class FirstWorker:
    """A worker process importing while the API process starts; `hand_over` gives it its spec."""

    def __init__(self):
        self.conn, self.process = spawn(_wait_for_spec, (), "moeferry-worker-0")

    def hand_over(self, spec, log_level: str) -> tuple[Connection, mp.process.BaseProcess] | None:
        """Send the spec; the worker's (pipe, process), or None if it is gone (spawn another)."""
        try:
            self.conn.send((spec, log_level))
            return self.conn, self.process
        except (BrokenPipeError, EOFError, OSError):
            log.warning("the first worker (pid %s) died before its spec was sent; starting another",
                        self.process.pid)
            self.cancel()
            return None

    def cancel(self) -> None:
        """End the process unused (it has only imported)."""
        self.conn.close()
        self.process.kill()
        self.process.join(KILLED_S)
