"""Engine-level offload speed on the GPU (no server): decode tok/s at batch 1 and 4 and a prefill
chunk, for resident and the offload backends at several cache sizes, on one checkpoint.

    python benchmarks/offload_engine.py --model DIR [--out DIR] [--backends ...]

Baseline in the same run: the resident backend (every expert on the device). The physical bound
of an offload configuration: bytes fetched per decoded token (measured) over the pinned
host->device bandwidth (measured here), i.e. tokens/s <= H2D bandwidth / bytes per token.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_prefill import ours_decode, ours_prefill  # noqa: E402

from moeferry import LLM  # noqa: E402

CONFIGS = {
    "resident": dict(moe_backend="resident"),
    "offload-100%": dict(moe_backend="offload", moe_cache_rate=1.0),
    "offload-50%": dict(moe_backend="offload", moe_cache_rate=0.5),
    "offload-40%": dict(moe_backend="offload", moe_cache_rate=0.4),
    "offload-25%": dict(moe_backend="offload", moe_cache_rate=0.25),
    "hybrid-25%": dict(moe_backend="hybrid", moe_cache_rate=0.25),
    "cpu-25%": dict(moe_backend="cpu", moe_cache_rate=0.25),
    "offload-25%-cpu-layers-2": dict(moe_backend="offload", moe_cache_rate=0.25, moe_cpu_layers="2"),
}


def h2d_bandwidth() -> float:
    src = torch.empty(256 * 2**20, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty_like(src, device="cuda")
    dst.copy_(src)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(5):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    return 5 * src.numel() / (time.perf_counter() - t)


def profile_decode(eng, name: str, top: int = 14) -> None:
    """Host and device time of 3 batch-1 decode steps, by op (where a slow path spends it)."""
    from torch.profiler import ProfilerActivity, profile
    prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
    ours_decode(eng, 1, 64, 3, torch.Generator().manual_seed(1), 2, prof)
    ev = prof.key_averages()
    bank = next(iter(getattr(eng.experts, "banks", {}).values()), None)
    print(f"== {name}: profile of 3 decode steps (banks pinned: "
          f"{bank.gate_up.w.is_pinned() if bank is not None else '-'})")
    for key, label in (("self_cpu_time_total", "host"), ("self_device_time_total", "device")):
        print(f"  by {label} time:")
        for e in sorted(ev, key=lambda e: -getattr(e, key))[:top]:
            print(f"    {getattr(e, key) / 3:9.1f} us/step  x{e.count // 3:5d}  {e.key[:80]}")


def run(name: str, model: str, prefill: int, steps: int, profile: bool = False) -> dict:
    t0 = time.perf_counter()
    llm = LLM(model, device="cuda", num_tokens=prefill + 1024, max_extend_tokens=prefill, **CONFIGS[name])
    boot = time.perf_counter() - t0
    eng, gen = llm.engine, torch.Generator().manual_seed(0)
    row = {"config": name, "boot_s": round(boot, 1), "expert_slots": eng.sizes.expert_slots}
    row["prefill_tok_s"] = round(ours_prefill(eng, prefill, gen))
    for batch in (1, 4):
        before = eng.experts.stats()
        rate, _, _ = ours_decode(eng, batch, 64, steps, gen)
        after = eng.experts.stats()
        fetched = after.get("bytes_fetched", 0) - before.get("bytes_fetched", 0)
        decoded = batch * (steps + 3) + batch  # warm-up + timed steps + the prompt's last token
        row[f"decode_b{batch}_tok_s"] = round(rate, 1)
        row[f"bytes_per_token_b{batch}"] = fetched // max(decoded, 1)
        hits, misses = after.get("hits", 0) - before.get("hits", 0), after.get("misses", 0) - before.get("misses", 0)
        row[f"hit_rate_b{batch}"] = round(hits / (hits + misses), 3) if hits + misses else None
    if profile:
        profile_decode(eng, name)
    del llm, eng
    torch.cuda.empty_cache()
    return row


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--out", default=".")
    p.add_argument("--backends", nargs="*", default=list(CONFIGS))
    p.add_argument("--prefill", type=int, default=4096)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--profile", action="store_true", help="print a host + device profile of decode per config")
    a = p.parse_args()
    bw = h2d_bandwidth()
    rows = []
    for name in a.backends:
        try:
            rows.append(run(name, a.model, a.prefill, a.steps, a.profile))
        except Exception as e:  # one configuration's failure is a row, not the end of the run
            rows.append({"config": name, "error": f"{type(e).__name__}: {str(e)[:300]}"})
        print(json.dumps(rows[-1]), flush=True)
    base = next((r for r in rows if r["config"] == "resident" and "error" not in r), None)
    lines = [f"H2D pinned bandwidth: {bw / 1e9:.1f} GB/s", "",
             "| config | slots | boot s | prefill tok/s | b1 tok/s | b4 tok/s | b1 vs resident | hit rate b1 | "
             "bytes/token b1 | PCIe bound b1 tok/s |", "|---" * 10 + "|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['config']} | error: {r['error']} |")
            continue
        bound = bw / r["bytes_per_token_b1"] if r["bytes_per_token_b1"] else float("inf")
        ratio = r["decode_b1_tok_s"] / base["decode_b1_tok_s"] if base else float("nan")
        lines.append(f"| {r['config']} | {r['expert_slots']} | {r['boot_s']} | {r['prefill_tok_s']} | "
                     f"{r['decode_b1_tok_s']} | {r['decode_b4_tok_s']} | {ratio:.2f} | {r['hit_rate_b1']} | "
                     f"{r['bytes_per_token_b1']} | {bound:.0f} |")
    table = "\n".join(lines)
    Path(a.out, "offload_engine.md").write_text(table + "\n")
    Path(a.out, "offload_engine.json").write_text(json.dumps(dict(h2d_Bps=bw, rows=rows), indent=1))
    print(table)


if __name__ == "__main__":
    main()
