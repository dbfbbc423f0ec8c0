"""Typed messages between the API process and the engine worker (pickled over one duplex Pipe).

API -> worker: Submit, Abort, Shutdown.
Worker -> API: Progress (while loading), Ready (once, with what the engine resolved),
Accepted / Rejected (an answer to every Submit), Events (token events from one step),
StatsUpdate (scheduler counters, at most a few times a second), BootFailed (then it exits),
Heartbeat (while it has work, between steps: the supervisor's watchdog).
"""
from __future__ import annotations

from dataclasses import dataclass, field

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
    model_dir: str
    device: str
    dtype: str
    num_pages: int
    page_size: int
    num_state_slots: int
    max_running_requests: int
    max_extend_tokens: int
    max_seq_len: int
    prefix_cache: bool
    # "module:function" returning the scheduler to drive; tests point it at a fake engine.
    factory: str = "moeferry.server.worker:build_scheduler"


@dataclass(frozen=True)
class Progress:
    phase: str
    fraction: float  # 0..1 over the whole boot


@dataclass(frozen=True)
class Ready:
    pid: int
    vocab_size: int
    max_seq_len: int
    eos_token_ids: tuple[int, ...]
    details: dict = field(default_factory=dict)  # printed in the boot table


@dataclass(frozen=True)
class BootFailed:
    reason: str


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
