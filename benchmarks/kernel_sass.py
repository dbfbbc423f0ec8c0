"""Instructions of the MoE decode kernels in sm_90 SASS, counted without a GPU.

    python benchmarks/kernel_sass.py [--form fp4] [--kernel gate_up|down] [--config BN,BK,WARPS]

Records one launch of `moe_decode.decode_gate_up` / `decode_down` at Qwen3.6's H and I (as
`tests/test_triton_compile.py` does), compiles it for sm_90 with `triton.compile` (with the
alignment the JIT specializes on: without it the fp4 tile is loaded a byte at a time) and
disassembles it with the nvdisasm Triton ships. Prints the instructions one thread issues for the
launch (all of it when the k-loop is unrolled, as at BK = K; one k-step's body otherwise), per
weight byte it reads in that code, and the most frequent opcodes. A kernel that is issue-bound (the fp4 and
int4 steps at T = 1) takes about (instructions x warps resident) / 4 issues a cycle per SM, so
this compares GEMV steps offline (a variant's count is evidence, not a timing); `moe_decode_sweep.py`
times them on the GPU.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from moe_decode_sweep import FORMS, bytes_per_weight  # noqa: E402
from moeferry.checkpoint.formats import FORMATS  # noqa: E402
from moeferry.moe.slots import SlotBuffer  # noqa: E402
from moeferry.ops.triton import moe_decode  # noqa: E402
from tests.test_triton_compile import _compile_launch, _Recorder  # noqa: E402

H, I = 2048, 512
OPCODE = re.compile(r"^[-0-9:A-Z]+\s+(?:@!?U?P\w+\s+)?([A-Z0-9]+)", re.M)


def slots(form: str) -> SlotBuffer:
    fmt, gen = FORMATS[FORMS[form]], torch.Generator().manual_seed(0)

    def packed(n, k):
        w = torch.randn(n, k, generator=gen) * 0.05
        return fmt.packed(fmt.quantize(w.bfloat16() if form == "dense" else w))
    return SlotBuffer.from_experts(FORMS[form], [(packed(I, H), packed(I, H), packed(H, I)) for _ in range(4)], "cpu")


def count(form: str, kernel: str, cfg: moe_decode.DecodeConfig) -> tuple[int, float, list]:
    """(instructions a thread, per weight byte, the 12 most frequent opcodes)."""
    buf = slots(form)
    launches = []
    name = f"_decode_{kernel}_kernel"
    real = getattr(moe_decode, name)
    setattr(moe_decode, name, _Recorder(real, launches))
    try:
        x, ids, table = torch.randn(1, H).bfloat16(), torch.tensor([[0, 2]]), torch.arange(4, dtype=torch.int32)
        route = (table, 3, torch.ones(1))
        cfg_bn = min(cfg.gate_up_bn, I)
        inter = (torch.zeros(3, I // 2 + I // 8, dtype=torch.int32) if moe_decode.packs_inter(buf.gate_up, x.dtype, cfg_bn)
                 else torch.randn(3, I).bfloat16())  # what gate_up hands down
        if kernel == "gate_up":
            moe_decode.decode_gate_up(x, ids, torch.full((1, 2), 0.5), buf.gate_up, *route, cfg)
        else:
            moe_decode.decode_down(inter, torch.empty_like(x), ids, torch.full((1, 2), 0.5), buf.down, *route, cfg)
    finally:
        setattr(moe_decode, name, real)
    fn, args, kw = launches[0]
    ops = collections.Counter(OPCODE.findall(_compile_launch(fn, args, kw).asm["sass"]))
    m = buf.gate_up if kernel == "gate_up" else buf.down
    # weights one program reads in the code counted: gate_up reads gate and up rows, over one k-step
    # when its k-loop is a loop (a body counted once), else all of H; down reads every pair's rows
    # over all of I (unrolled)
    looped = kernel == "gate_up" and not cfg.unroll and kw["BK"] < m.k
    rows = 2 * kw["BN"] if kernel == "gate_up" else kw["BN"] * kw["TOPK"]
    weight_bytes = rows * (kw["BK"] if looped else m.k) * bytes_per_weight(m)
    total = sum(ops.values())
    return total, total / (weight_bytes / (32 * kw["num_warps"])), ops.most_common(12)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--form", default="fp4", choices=FORMS)
    ap.add_argument("--kernel", default="gate_up", choices=("gate_up", "down"))
    ap.add_argument("--config", help="BN,BK,WARPS of that kernel (default: the form's DECODE_CONFIGS entry)")
    args = ap.parse_args()
    kern = FORMS[args.form]
    cfg = moe_decode.DECODE_CONFIGS.get(slots(args.form).gate_up.kernel.name, moe_decode.DecodeConfig())
    if args.config:
        bn, bk, w = map(int, args.config.split(","))
        fields = ("gate_up_bn", "gate_up_bk", "num_warps") if args.kernel == "gate_up" else ("down_bn", "down_bk",
                                                                                               "down_warps")
        cfg = dataclasses.replace(cfg, **dict(zip(fields, (bn, bk, w))))
    total, per_byte, top = count(args.form, args.kernel, cfg)
    print(f"{kern} {args.kernel} {cfg}: {total} instructions a "
          f"thread, {per_byte:.1f} per weight byte a thread reads")
    print("  " + " ".join(f"{op}:{n}" for op, n in top))


if __name__ == "__main__":
    main()
