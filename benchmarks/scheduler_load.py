"""Scheduler under many concurrent streams, without a model: admission, preemption and prefix-cache
behaviour measured in steps (a fake engine returns random logits, so only scheduling is timed).

    PYTHONPATH=. python benchmarks/scheduler_load.py --streams 64 --kv-tokens 4096

Reports steps, preemptions, tokens computed (prompt + recomputation after preemption), and per
request: steps waited before the first token, the longest run of steps without a token while it
was in the system (starvation), and the finishing step. Everything is seeded.
"""
from __future__ import annotations

import argparse
import random
from dataclasses import dataclass, field

import torch

from moeferry.cache.kv_pool import KVPool
from moeferry.cache.manager import CacheManager
from moeferry.cache.state_pool import StatePool
from moeferry.engine.config import EngineConfig, derive_sizes
from moeferry.scheduler.request import Request
from moeferry.scheduler.sampling import SamplingParams
from moeferry.scheduler.scheduler import Scheduler

VOCAB = 4096


@dataclass
class FakeSpec:
    vocab_size: int = VOCAB
    eos_token_ids: tuple = (VOCAB - 1,)
    max_position_embeddings: int = 4096
    linear_layers: tuple = (0, 1, 2)  # a Qwen3.5-like model: GDN state checkpoints matter


@dataclass
class FakeEngine:
    """The real cache manager (tiny pools); forward returns seeded random logits and counts computed tokens."""
    cfg: EngineConfig
    spec: FakeSpec = field(default_factory=FakeSpec)
    computed: int = 0

    def __post_init__(self):
        self.sizes = derive_sizes(self.cfg, self.spec.max_position_embeddings)
        kv = KVPool(1, self.sizes.num_pages, 1, 1, 1, torch.float32, "cpu")
        states = StatePool(1, self.sizes.num_state_slots, 1, 2, 1, 1, 1, torch.float32, "cpu")
        self.cache = CacheManager(kv, states, needs_state=True, prefix_cache=self.cfg.prefix_cache)
        self.gen = torch.Generator().manual_seed(0)

    def forward(self, chunks, feed=None):
        self.computed += sum(len(c.tokens) for c in chunks)
        logits = torch.randn(len(chunks), VOCAB, generator=self.gen)
        logits[:, VOCAB - 1] = -1e9  # never EOS: lengths are set by max_tokens
        return logits

    def stats(self) -> dict:
        return {}


@dataclass
class Stream:
    req: Request
    submitted: int  # step at which it was added
    first_token: int | None = None
    finished: int | None = None
    last_token: int = 0
    longest_gap: int = 0


def workload(n: int, seed: int, max_tokens: list[int | None], prompt_range: tuple[int, int]) -> list[Request]:
    rng = random.Random(seed)
    shared = [rng.randrange(VOCAB - 1) for _ in range(24)]  # a common chat-template head
    reqs = []
    for i in range(n):
        prompt = shared + [rng.randrange(VOCAB - 1) for _ in range(rng.randint(*prompt_range))]
        params = SamplingParams(temperature=0.7, top_k=20, seed=i, max_tokens=rng.choice(max_tokens))
        reqs.append(Request(f"r{i}", prompt, params))
    return reqs


def run(args) -> dict:
    engine = FakeEngine(EngineConfig("(fake)", num_tokens=args.kv_tokens, max_running_requests=args.max_running,
                                     max_extend_tokens=args.max_extend_tokens, max_seq_len=args.context,
                                     prefix_cache=True, max_wait_steps=args.max_wait_steps,
                                     overlap_schedule=args.overlap_schedule))
    sched = Scheduler(engine)
    streams = {}
    for r in workload(args.streams, args.seed, args.max_tokens, (args.prompt_min, args.prompt_max)):
        sched.add(r)
        streams[r.request_id] = Stream(r, 0)
    step = 0
    while sched.has_work and step < args.max_steps:
        step += 1
        for ev in sched.step():
            s = streams[ev.request_id]
            if ev.token_ids:
                s.first_token = s.first_token if s.first_token is not None else step
                s.longest_gap = max(s.longest_gap, step - s.last_token)
                s.last_token = step
            if ev.finished:
                s.finished = step
    for s in streams.values():
        if s.finished is None:
            s.longest_gap = max(s.longest_gap, step - s.last_token)
    useful = sum(len(s.req.prompt_ids) + len(s.req.output_ids) for s in streams.values())
    waits = sorted(s.first_token if s.first_token is not None else step for s in streams.values())
    gaps = sorted(s.longest_gap for s in streams.values())
    return {"steps": step, "unfinished": sum(s.finished is None for s in streams.values()),
            "preemptions": sched.num_preemptions, "tokens_computed": engine.computed,
            "tokens_needed": useful, "recompute_ratio": round(engine.computed / max(useful, 1), 2),
            "first_token_step_p50": waits[len(waits) // 2], "first_token_step_max": waits[-1],
            "longest_gap_p50": gaps[len(gaps) // 2], "longest_gap_max": gaps[-1],
            "max_preemptions_of_one": max(s.req.num_preemptions for s in streams.values())}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--kv-tokens", type=int, default=4096)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--max-running", type=int, default=8)
    p.add_argument("--max-extend-tokens", type=int, default=8192)
    p.add_argument("--max-tokens", default="64,128,256,512", help="comma list; 'none' = rest of the context")
    p.add_argument("--prompt-min", type=int, default=10)
    p.add_argument("--prompt-max", type=int, default=800)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-wait-steps", type=int, default=EngineConfig.max_wait_steps,
                   help="0 = never make a running request yield (first come, first served to the end)")
    p.add_argument("--max-steps", type=int, default=200_000)
    p.add_argument("--disable-overlap-schedule", dest="overlap_schedule", action="store_false",
                   help="read each step's tokens before the next step (the scheduler before its overlap)")
    args = p.parse_args(argv)
    args.max_tokens = [None if x == "none" else int(x) for x in args.max_tokens.split(",")]
    for k, v in run(args).items():
        print(f"{k:24s} {v}")


if __name__ == "__main__":
    main()
