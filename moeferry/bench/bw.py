"""`moeferry bench bw`: the two lanes an expert-cache miss can take, measured on this machine.

For each expert format of a checkpoint (one MoE layer's experts are read into a host bank):
pinned host->device copy time and bandwidth per expert slot, and the time to compute one expert
on the CPU from its bank for 1 and 8 tokens (the hybrid backend's split is made from these at
boot). Also a plain pinned copy of 256 MiB, the PCIe ceiling, and on CUDA the gather kernel
that decode misses and prefetches take (the boot's choice of launch shape; device time on a
full grid and on the prefetch's grid, and with hits among the listed experts as a decode step
gathers them). Prints a table; `--json FILE`.
"""
from __future__ import annotations

import argparse
import json
import time

import torch


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, metavar="DIR", help="checkpoint whose expert formats are measured")
    p.add_argument("--device", default="auto", help="auto (cuda if available, else cpu), cpu, cuda, cuda:N")
    p.add_argument("--layer", type=int, default=None, help="MoE layer to read (default: the first)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads for the expert compute (default: torch's)")
    p.add_argument("--json", metavar="FILE", help="also write the numbers as JSON")


def pinned_copy_bandwidth(device: torch.device, nbytes: int = 256 * 2**20, repeats: int = 5) -> float:
    """Bytes per second of a large pinned host->device copy (memcpy on the CPU)."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst.copy_(src)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src, non_blocking=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return repeats * nbytes / (time.perf_counter() - t)


def measure(model_dir: str, device: torch.device, layer: int | None = None) -> dict:
    from moeferry.checkpoint.reader import CheckpointReader
    from moeferry.model.loader import _layer_experts
    from moeferry.model.registry import resolve_spec
    from moeferry.model.weights import WeightLoader
    from moeferry.moe.bandwidth import time_cpu_expert, time_fetch
    from moeferry.moe.bank import build_bank, pinnable

    reader = CheckpointReader(model_dir)
    spec = resolve_spec(reader)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    w = WeightLoader(reader, dtype, "cpu")
    layer = layer if layer is not None else next(i for i in range(spec.num_layers) if spec.is_moe_layer(i))
    experts = _layer_experts(w, spec, f"model.layers.{layer}.mlp.")
    bank = build_bank(experts, pinnable(device))
    fetch_s = time_fetch(bank, device)
    return {"model": model_dir, "device": str(device), "layer": layer, "format": experts.format,
            "slot_bytes": bank.bytes_per_slot, "pinned_copy_Bps": pinned_copy_bandwidth(device),
            "fetch_s_per_expert": fetch_s, "fetch_Bps": bank.bytes_per_slot / fetch_s, **gather_times(bank, device),
            "cpu_s_per_expert_1_token": time_cpu_expert(bank, 1), "cpu_s_per_expert_8_tokens": time_cpu_expert(bank, 8),
            "cpu_threads": torch.get_num_threads(), "cpu_lane": cpu_lane()}


def gather_times(bank, device: torch.device) -> dict:
    """CUDA: the gather kernel's device time per expert in the config the boot would choose, on
    a full grid (a step's own misses) and on the decode prefetch's grid."""
    if device.type != "cuda":
        return {}
    from moeferry.moe.bandwidth import choose_gather, time_gather
    from moeferry.moe.offload import prefetch_programs
    programs = prefetch_programs(device)
    choice = choose_gather(bank, device, programs)  # times every config on both grids
    if choice.config is None:
        return {}
    full, capped = choice.device_s
    # as a decode step gathers: every chosen expert listed, the hits moving nothing (a top-8 step
    # with 3 misses on a full grid; a 4-wide prefetch guess with 2 uncached on the prefetch's grid)
    step = time_gather(bank, device, choice.config, experts=8, hits=5)
    guess = time_gather(bank, device, choice.config, programs, experts=4, hits=2)
    return {"gather_config": list(choice.config), "gather_programs_prefetch": programs,
            "gather_s_per_expert": full, "gather_s_per_expert_prefetch": capped,
            "gather_s_per_expert_step": step, "gather_s_per_expert_guess": guess}


def cpu_lane() -> str:
    """What computes the CPU lane's experts: the C kernel, or the PyTorch reference."""
    from moeferry.ops.cpu.experts import kernel
    found = kernel()
    return found.describe() if found is not None else "PyTorch reference (no C kernel)"


def table(r: dict) -> str:
    gb = 1e9
    rows = [("format (layer)", f"{r['format']} ({r['layer']})"), ("expert slot", f"{r['slot_bytes'] / 2**20:.2f} MiB"),
            ("pinned copy, 256 MiB", f"{r['pinned_copy_Bps'] / gb:.1f} GB/s"),
            ("fetch one expert", f"{r['fetch_s_per_expert'] * 1e6:.0f} us ({r['fetch_Bps'] / gb:.1f} GB/s)"),
            *gather_rows(r),
            ("CPU lane", f"{r['cpu_lane']}, {r['cpu_threads']} threads"),
            ("CPU expert, 1 token", f"{r['cpu_s_per_expert_1_token'] * 1e6:.0f} us "
                                    f"({r['slot_bytes'] / r['cpu_s_per_expert_1_token'] / gb:.1f} GB/s of weights)"),
            ("CPU expert, 8 tokens", f"{r['cpu_s_per_expert_8_tokens'] * 1e6:.0f} us"),
            ("a fetch costs", f"{r['fetch_s_per_expert'] / r['cpu_s_per_expert_1_token']:.2f} CPU experts (1 token)")]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


def gather_rows(r: dict) -> list[tuple[str, str]]:
    if "gather_s_per_expert" not in r:
        return []
    slot, words, warps, vec = r["slot_bytes"], *r["gather_config"]

    def rate(s: float) -> str:
        return f"{s * 1e6:.0f} us ({slot / s / 1e9:.1f} GB/s)"
    return [(f"gather one expert ({words} words x {warps} warps{', 16-byte' if vec else ''})",
             rate(r["gather_s_per_expert"])),
            (f"  on the prefetch's {r['gather_programs_prefetch']} programs", rate(r["gather_s_per_expert_prefetch"])),
            ("  a step's 8 chosen, 3 missing, per expert moved", rate(r["gather_s_per_expert_step"])),
            ("  a guess of 4, 2 uncached, on the prefetch's grid", rate(r["gather_s_per_expert_guess"]))]


def main(args: argparse.Namespace) -> int:
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.threads:
        torch.set_num_threads(args.threads)
    result = measure(args.model, torch.device(device), args.layer)
    print(table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0
