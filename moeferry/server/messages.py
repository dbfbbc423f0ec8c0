"""Typed messages between the API process and the engine worker (pickled over one duplex Pipe).

API -> worker: Submit, Abort, Shutdown.
Worker -> API: Progress (while loading), Ready (once, with what the engine resolved),
Accepted / Rejected (an answer to every Submit), Events (token events from one step),
StatsUpdate (scheduler counters, at most a few times a second), BootFailed (then it exits),
Heartbeat (while it has work, between steps: the supervisor's watchdog).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from moeferry.engine.config import EngineConfig, EngineSizes
from moeferry.scheduler.request import Request, TokenEvent


@dataclass(frozen=True)
class Submit:
    request: Request


@dataclass(frozen=True)
class Abort:
    request_id: str


@dataclass(frozen=True)
class Shutdown:
    pass


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker builds; picklable, so it crosses the spawn boundary."""
    engine: EngineConfig
    # "module:function" returning the scheduler to drive; tests point it at a fake engine.
    factory: str = "moeferry.server.worker:build_scheduler"


@dataclass(frozen=True)
class Progress:
    phase: str
    fraction: float  # 0..1 over the whole boot


@dataclass(frozen=True)
class Ready:
    """The engine is built: what it resolved (the frontend takes its limits from here)."""
    pid: int
    vocab_size: int
    sizes: EngineSizes
    eos_token_ids: tuple[int, ...]
    details: dict = field(default_factory=dict)  # printed in the boot log
    plan: dict | None = None  # the memory plan (MemoryPlan.to_dict()), served at /v1/cache/status
    plan_table: str | None = None  # ... and as the boot table

    @property
    def max_seq_len(self) -> int:
        return self.sizes.max_seq_len


@dataclass(frozen=True)
class BootFailed:
    reason: str
    permanent: bool = False  # the same configuration would fail the same way: do not restart


@dataclass(frozen=True)
class Accepted:
    request_id: str


@dataclass(frozen=True)
class Rejected:
    request_id: str
    code: str
    message: str
    param: str | None = None


@dataclass(frozen=True)
class Events:
    events: list[TokenEvent]


@dataclass(frozen=True)
class StatsUpdate:
    stats: dict


@dataclass(frozen=True)
class Heartbeat:
    """Sent between steps while the worker has work, at least every HEARTBEAT_S; `steps` counts them."""
    steps: int
