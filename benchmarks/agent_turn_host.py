"""The worker's host time for an agent's next turn at long context, without a model.

An agent's turn is its whole conversation again plus a little: the prefix cache resumes most of
it, and the engine computes the tail. The worker's step loop, which every running stream waits
on, does the bookkeeping in Python: admission (checking the ids, matching the prefix tree) and,
when the request ends, giving its pages to the tree. This times one such turn through the real
Scheduler and CacheManager (a fake engine returns random logits), with the prefix tree's
comparison as it is and, as the baseline in the same run, as it was: a Python scan page by page.

    PYTHONPATH=. python benchmarks/agent_turn_host.py --tokens 25000 100000
"""
from __future__ import annotations

import argparse
import random
import time
from contextlib import contextmanager

from benchmarks.scheduler_load import VOCAB, FakeEngine
from moeferry.cache.prefix_cache import PrefixCache
from moeferry.engine.config import EngineConfig
from moeferry.scheduler.request import Request
from moeferry.scheduler.sampling import SamplingParams
from moeferry.scheduler.scheduler import Scheduler


def scan_common(self, key, tokens, start, limit):
    """The baseline: the prefix tree's comparison before, page by page in Python."""
    n, ps = 0, self.page_size
    while n + ps <= len(key) and start + n + ps <= limit and key[n:n + ps] == tuple(tokens[start + n:start + n + ps]):
        n += ps
    return n


@contextmanager
def comparison(baseline: bool):
    current = PrefixCache._common
    if baseline:
        PrefixCache._common = scan_common
    try:
        yield
    finally:
        PrefixCache._common = current


def turn_seconds(tokens: int, chunk: int, running: int, seed: int) -> tuple[float, float, int]:
    """(first turn's host seconds, next turn's, tokens the next turn resumed from the cache)."""
    cfg = EngineConfig("(fake)", num_tokens=tokens + 4096, max_running_requests=running, max_extend_tokens=chunk,
                       max_seq_len=tokens + 4096)
    sched = Scheduler(FakeEngine(cfg))
    rng = random.Random(seed)
    conversation = [rng.randrange(VOCAB - 1) for _ in range(tokens)]
    params = SamplingParams(temperature=0.0, max_tokens=2)

    def run(prompt: list[int], rid: str) -> tuple[float, Request]:
        req = Request(rid, prompt, params)
        start = time.perf_counter()
        sched.add(req)
        while sched.has_work:
            sched.step()
        return time.perf_counter() - start, req

    first, _ = run(conversation, "turn-1")
    second, req = run(conversation + [rng.randrange(VOCAB - 1) for _ in range(200)], "turn-2")
    return first, second, req.cached_tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[25000, 100000])
    ap.add_argument("--chunk", type=int, default=8192, help="prefill chunk (max_extend_tokens)")
    ap.add_argument("--running", type=int, default=1, help="max_running_requests (the users' line: 1)")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each; the fastest is kept")
    args = ap.parse_args()
    print(f"max_running_requests {args.running}, prefill chunk {args.chunk}; the next turn adds 200 tokens")
    print("| conversation tokens | turn | baseline (page scan) ms | now ms | baseline / now | resumed tokens |")
    print("|---|---|---|---|---|---|")
    for n in args.tokens:
        runs = {}
        for baseline in (True, False):
            with comparison(baseline):
                results = [turn_seconds(n, args.chunk, args.running, seed) for seed in range(args.repeats)]
            runs[baseline] = (min(r[0] for r in results), min(r[1] for r in results), results[0][2])
        for i, name in ((0, "first"), (1, "next")):
            old, new = runs[True][i] * 1e3, runs[False][i] * 1e3
            print(f"| {n} | {name} | {old:.1f} | {new:.1f} | {old / new:.1f} | "
                  f"{runs[False][2] if i else '-'} |")


if __name__ == "__main__":
    main()
