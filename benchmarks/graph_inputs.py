"""Host time of a decode step's page-table input against context length (`cuda_graph.PageRows`).

    python benchmarks/graph_inputs.py [--device cpu|cuda] [--batch 1 4] [--contexts 1024 32768 131072]

Baseline (same run): the table rebuilt from every row's whole page list each step, as the
decode graphs did before (`torch.tensor` of each list, one copy of the [batch, pages] table).
Measured: `PageRows.load`, which moves only each row's new page (page size 1: a page a token).
The bound is what a step must move: one int32 a row.
"""
from __future__ import annotations

import argparse
import time

import torch

from moeferry.engine.cuda_graph import PageRows


def rebuild(table: torch.Tensor, lists: list[list[int]]) -> None:
    width = max(len(p) for p in lists)
    host = torch.zeros(len(lists), width, dtype=torch.int32)
    for b, pages in enumerate(lists):
        host[b, :len(pages)] = torch.tensor(pages, dtype=torch.int32)
    table[:len(lists), :width].copy_(host)


def per_step_ms(load, table: torch.Tensor, batch: int, context: int, steps: int) -> float:
    lists = [list(range(b, b + context)) for b in range(batch)]
    load(table, lists)  # the rows' first load (a new sequence) is not a decode step
    sync = torch.cuda.synchronize if table.is_cuda else (lambda: None)
    sync()
    t = time.perf_counter()
    for _ in range(steps):
        for pages in lists:
            pages.append(pages[-1] + 1)
        load(table, lists)
    sync()
    return (time.perf_counter() - t) / steps * 1e3


def measure(batch: int, context: int, steps: int, device: str) -> tuple[float, float]:
    """(rebuild ms/step, PageRows ms/step) on one [batch, context + steps + 1] table."""
    table = torch.zeros(batch, context + steps + 1, dtype=torch.int32, device=device)
    base = per_step_ms(rebuild, table, batch, context, steps)
    rows = PageRows(table)
    return base, per_step_ms(lambda _t, lists: rows.load(lists), table, batch, context, steps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 8192, 32768, 131072])
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    measure(1, 64, 3, args.device)  # discarded: the first call loads the device's kernels
    print("| batch | context tokens | rebuild ms/step (baseline) | PageRows ms/step | speedup | bound: bytes moved/step |")
    print("|---|---|---|---|---|---|")
    for batch in args.batch:
        for context in args.contexts:
            base, ours = measure(batch, context, args.steps, args.device)
            print(f"| {batch} | {context} | {base:.3f} | {ours:.3f} | {base / ours:.0f}x | {4 * batch} |")


if __name__ == "__main__":
    main()
