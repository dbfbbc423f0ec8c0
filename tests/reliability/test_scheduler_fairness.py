"""Scheduler fairness under many streams (issue 15, item 5) and its counters.

With a fake engine (random logits; the real pools and prefix cache) the scheduling itself runs
thousands of steps in seconds: requests that run to the end of the context must not keep the
queue from getting tokens (bounded waiting), and a request preempted while the step is being
planned must not run in it. With the real tiny model: prefix-cache hit counters agree with what
clients were told, preemptions included.
"""
from __future__ import annotations

import argparse

from benchmarks.scheduler_load import run
from moeferry import LLM
from moeferry.scheduler.sampling import SamplingParams
from moeferry.engine.config import EngineConfig
from tests.test_generate import PROMPTS


def load(**overrides) -> dict:
    """8 streams, 4 places, a KV pool of one context: half the requests set no max_tokens and run
    to the end of the context (~1450 tokens), the others want 64 tokens."""
    args = dict(streams=8, kv_tokens=1536, context=1536, max_running=4, max_extend_tokens=512,
                max_tokens=[None, 64], prompt_min=10, prompt_max=100, seed=3, max_steps=2000,
                max_wait_steps=EngineConfig.max_wait_steps, overlap_schedule=EngineConfig.overlap_schedule)
    args.update(overrides)
    return run(argparse.Namespace(**args))


def test_no_stream_goes_without_tokens_for_long_while_others_run():
    wait = EngineConfig.max_wait_steps
    bounded, fifo = load(), load(max_wait_steps=0)
    # first come, first served to the end: a request preempted for KV waits ~1000 steps for a token
    assert fifo["longest_gap_max"] > 3 * wait, fifo
    assert bounded["longest_gap_max"] <= 2.5 * wait, bounded
    assert bounded["first_token_step_max"] <= 2 * wait, bounded


def test_prefix_cache_hits_count_what_clients_are_told(checkpoint):
    """prefix_cache_hit_tokens (/v1/stats) == the sum of usage cached_tokens, also when preempted
    requests are re-admitted from the cache (those re-admissions are prefix_cache_reused_tokens)."""
    llm = LLM(str(checkpoint("qwen3_5_moe")), dtype="float32", max_running_requests=3, max_extend_tokens=16,
              num_tokens=110)
    greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    outs = llm.generate(PROMPTS[1:5], greedy)
    again = llm.generate(PROMPTS[4:5], greedy)  # seen before: a hit the client is told of, if still cached
    stats = llm.scheduler.stats()
    assert llm.scheduler.num_preemptions > 0
    told = sum(o.cached_tokens for o in outs + again)
    assert stats["prefix_cache_hit_tokens"] == told
    assert stats["prefix_cache_reused_tokens"] > told  # re-admissions after preemption reused cached KV
