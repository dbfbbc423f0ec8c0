"""The CPU lane (`cpu` and `hybrid` backends): experts computed on the host from a bank's slot
form, the C kernel (`moeferry/ops/cpu/experts.c`) against the PyTorch reference it replaced
(`SlotBuffer.run_reference`: dequantize each expert whole, then matmul), in the same run.

    python benchmarks/cpu_experts.py [--hidden 2048 --inter 512] [--formats nvfp4,int4_awq,...]
                                     [--tokens 1,4] [--threads N] [--slots 32]

Each call computes 8 distinct experts (a decode step's top-8 misses of one layer), each for
`tokens` tokens; calls rotate over a bank of `--slots` experts (more than the last-level cache
holds) so weights come from memory, as in serving. Prints per expert: both times, the ratio, the
weights' read rate, and the bound: the slot's bytes at the host's read bandwidth, measured here
(a sum over 1 GiB with the same threads).
"""
from __future__ import annotations

import argparse
import time

import torch

from moeferry.checkpoint.formats import FORMATS
from moeferry.moe.slots import SlotBuffer
from moeferry.ops.cpu.experts import kernel

EXPERTS_PER_CALL = 8


def random_bank(fmt: str, hidden: int, inter: int, slots: int, distinct: int = 4) -> SlotBuffer:
    """`slots` slots of one format at this geometry; `distinct` random experts quantized by the
    registry, repeated to fill the slots (each slot its own bytes in memory)."""
    f, gen = FORMATS[fmt], torch.Generator().manual_seed(0)
    experts = []
    for _ in range(distinct):
        ws = [torch.randn(inter, hidden, generator=gen) * 0.05, torch.randn(inter, hidden, generator=gen) * 0.05,
              torch.randn(hidden, inter, generator=gen) * 0.05]
        experts.append(tuple(f.packed(f.quantize(w.bfloat16() if fmt == "bf16" else w, None), None) for w in ws))
    return SlotBuffer.from_experts(fmt, [experts[s % distinct] for s in range(slots)], "cpu")


def per_expert(fn, calls: int) -> float:
    """Seconds per expert of `fn(call)` (each call computes EXPERTS_PER_CALL experts), median."""
    fn(0)
    times = []
    for c in range(calls):
        t = time.perf_counter()
        fn(c + 1)
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2] / EXPERTS_PER_CALL


def read_bandwidth(threads: int) -> float:
    """Bytes per second a sum over 1 GiB reads with `threads` threads (the bound's rate)."""
    big = torch.ones(2**28)
    torch.set_num_threads(threads)
    big.sum()
    t = time.perf_counter()
    for _ in range(3):
        big.sum()
    return 3 * big.numel() * 4 / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=512, help="expert intermediate size (Qwen3.6-35B-A3B: 512)")
    ap.add_argument("--formats", default="nvfp4,int4_awq,fp8_block,bf16")
    ap.add_argument("--tokens", default="1,4")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--slots", type=int, default=32)
    ap.add_argument("--reference-calls", type=int, default=2)
    ap.add_argument("--calls", type=int, default=9)
    args = ap.parse_args()
    lane = kernel()
    if lane is None:
        raise SystemExit("the C kernel could not be built (see the log); nothing to compare")
    read_bps = read_bandwidth(args.threads)
    print(f"CPU experts, hidden {args.hidden}, inter {args.inter}, {args.threads} threads, {lane.describe()}, "
          f"host read {read_bps / 1e9:.1f} GB/s\n")
    print("| format | slot MiB | tokens | reference us/expert | kernel us/expert | reference / kernel "
          "| kernel GB/s of weights | bound us (read once) | bound / kernel |")
    print("|---|---|---|---|---|---|---|---|---|")
    for fmt in args.formats.split(","):
        bank = random_bank(fmt, args.hidden, args.inter, args.slots)
        nbytes = bank.bytes_per_slot
        for tokens in map(int, args.tokens.split(",")):
            x = torch.randn(tokens, args.hidden)
            ids = torch.arange(EXPERTS_PER_CALL).expand(tokens, EXPERTS_PER_CALL)
            w = torch.full((tokens, EXPERTS_PER_CALL), 1.0 / EXPERTS_PER_CALL)

            def experts(call):  # the call's 8 experts: a window that moves through the bank
                return [(call * EXPERTS_PER_CALL + j) % bank.num_slots for j in range(EXPERTS_PER_CALL)]

            def reference(call):
                return bank.run_reference(x, ids, w, torch.tensor(experts(call), dtype=torch.int32))

            def c_kernel(call):
                return lane.run(bank, x, ids, w, torch.tensor(experts(call), dtype=torch.int32), args.threads)

            assert ((c_kernel(3) - reference(3)).norm() / reference(3).norm()) < 1e-5
            t_ref, t_c = per_expert(reference, args.reference_calls), per_expert(c_kernel, args.calls)
            bound = nbytes / read_bps
            print(f"| {fmt} | {nbytes / 2**20:.2f} | {tokens} | {t_ref * 1e6:.0f} | {t_c * 1e6:.0f} | {t_ref / t_c:.1f} "
                  f"| {nbytes / t_c / 1e9:.1f} | {bound * 1e6:.0f} | {bound / t_c:.2f} |", flush=True)


if __name__ == "__main__":
    main()
