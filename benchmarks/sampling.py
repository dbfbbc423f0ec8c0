"""Sampling one token per row at Qwen3.6's vocabulary: the general path (sort the vocabulary,
filter, draw) against the short one (the model's default sampling: every row has a top-k, no
penalty, so `topk` and a draw among the few), the draw on the host (a step read at once) and on
the device (an overlapped step: its tokens stay there), in the same run.

    python benchmarks/sampling.py [--device cpu|cuda] [--vocab 248320]

Prints a table: batch, each path's time per call (the device draw's including the host's wait
for it, as the host draw's is), the general path over the host draw, and the bound (the logits
read once at the device's copy rate, measured here with a device-to-device copy of the same size).
"""
from __future__ import annotations

import argparse
import dataclasses
import time

import torch

from moeferry.ops.sampler import sample
from moeferry.scheduler.batch_sampler import build_sampling_batch
from moeferry.scheduler.request import Request
from moeferry.scheduler.sampling import SamplingParams

DEFAULTS = dict(temperature=0.7, top_p=0.8, top_k=20)  # Qwen3.6's generation_config


def timed(fn, device, iters=30) -> float:
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t) / iters


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--vocab", type=int, default=248320)
    args = ap.parse_args()
    device = torch.device(args.device)
    print(f"sampling, vocab {args.vocab}, {device} (params {DEFAULTS})\n")
    print("| batch | general path us | short path, host draw us | short path, device draw us | general / host draw "
          "| bound us (read the logits once) |")
    print("|---|---|---|---|---|---|")
    for b in (1, 4, 16):
        reqs = [Request(f"r{i}", [1, 2, 3], SamplingParams(seed=i, **DEFAULTS)) for i in range(b)]
        logits = torch.randn(b, args.vocab, device=device)
        short = build_sampling_batch(reqs, args.vocab, {0}, device)
        general = dataclasses.replace(short, top_k_max=0)
        on_device = build_sampling_batch(reqs, args.vocab, {0}, device, host_draws=False)
        t_gen, t_short = timed(lambda: sample(logits, general), device), timed(lambda: sample(logits, short), device)
        t_dev = timed(lambda: sample(logits, on_device), device)
        copy = torch.empty_like(logits)
        t_read = timed(lambda: copy.copy_(logits), device) / 2  # a copy reads and writes the bytes once each
        print(f"| {b} | {t_gen * 1e6:.0f} | {t_short * 1e6:.0f} | {t_dev * 1e6:.0f} | {t_gen / t_short:.1f} "
              f"| {t_read * 1e6:.1f} |")


if __name__ == "__main__":
    main()
