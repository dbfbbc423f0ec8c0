"""Helpers of the reliability suite: memory sampling, bounded waiting, the idle-pool check."""
from __future__ import annotations

import threading
import time

FUZZ_NAME = "tiny-fuzz"  # the model name fuzz_server serves


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


class PeakRss:
    """Samples a process's resident memory every `interval` s in a thread; `.peak` in MiB."""

    def __init__(self, pid: int, interval: float = 0.1):
        self.pid, self.interval = pid, interval
        self.peak = rss_mib(pid)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.wait(self.interval):
            try:
                self.peak = max(self.peak, rss_mib(self.pid))
            except (OSError, AssertionError):
                return

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(5)


def wait_for(predicate, timeout: float, interval: float = 0.05):
    """predicate()'s first truthy value within timeout s, else AssertionError."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"condition not reached within {timeout} s")


def idle_pools(server, timeout: float = 30.0) -> dict:
    """/v1/stats once nothing is in flight and the KV pool holds only the prefix cache's pages."""
    def idle():
        s = server.stats()
        sch = s["scheduler"]
        ok = (s["in_flight"] == 0 and sch.get("running") == 0 and sch.get("waiting") == 0
              and s["kv"]["tokens_used"] == sch.get("prefix_cache_tokens"))
        return s if ok else None
    return wait_for(idle, timeout, 0.2)

