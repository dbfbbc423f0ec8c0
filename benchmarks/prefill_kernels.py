"""Prefill kernels of Qwen3.6-35B-A3B's mixers on the GPU: attention and Gated DeltaNet.

    python benchmarks/prefill_kernels.py [--out DIR] [--tokens 8192] [--no-sweep]

attention (16 q heads, 2 kv heads, head_dim 256, bf16), one whole prompt of T tokens and a
chunk of T after --prefix cached tokens: the paged Triton flash kernel
(`triton.attention.paged_attention_prefill`, what every chunk used before) against SDPA flash
(`ops.attention.chunk_attention`: the prompt's own k/v, or the context gathered from its pages).
FLOPs = 4 * T * (prefix + T / 2) * H_q * D (causal); ceiling: the bf16 matmul rate measured in
this run.

Gated DeltaNet (16 k heads, 32 v heads, 128 x 128 state, bf16 in, fp32 state): the chunked
prefill (`triton.gdn.gdn_prefill`) under each `PrefillTuning` (best of 3 interleaved rounds);
the baseline is the kernels as they were (q k^T in the scan, 32 state columns per scan program,
8 warps, 1 stage). Every variant's output and final state are checked against the baseline's
(relative error), and the default one against the fp32 PyTorch reference on the first 1024
tokens. Bound: the bytes the layer must move (q, k, v in, output out, the fp32
W/U workspace written and read once) at the copy bandwidth measured in this run.
Writes prefill_kernels.md / .json under --out.
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
from dataclasses import asdict, replace
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import moe_kernels as MK  # noqa: E402  (timing helpers, ceilings, logger)
from moeferry.ops import gdn as ref_gdn  # noqa: E402
from moeferry.ops.attention import chunk_attention  # noqa: E402
from moeferry.ops.triton import attention as ta  # noqa: E402
from moeferry.ops.triton import gdn as tg  # noqa: E402

DEV = MK.DEV
HQ, HKV, D = 16, 2, 256
HK, HV, DK, DV = 16, 32, 128, 128
BASELINE = tg.PrefillTuning(attn_in_prep=False, prep_precision="tf32x3", scan_bv=32, scan_warps=8, scan_stages=1)


def rel(a, b) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def attention_rows(t: int, prefix: int, mm: float) -> list[dict]:
    """A chunk of t new tokens after `prefix` cached ones."""
    g = torch.Generator(device=DEV).manual_seed(0)
    total, ps = prefix + t, 16
    q = torch.randn(t, HQ, D, generator=g, device=DEV).bfloat16()
    kc, vc = (torch.randn(total, HKV, D, generator=g, device=DEV).bfloat16() for _ in range(2))
    table = torch.arange(-(-total // ps), dtype=torch.int32, device=DEV)[None]
    kc, vc = (F.pad(x, (0, 0, 0, 0, 0, table.numel() * ps - total)) for x in (kc, vc))
    k, v = kc[prefix:total], vc[prefix:total]
    cu = torch.tensor([0, t], dtype=torch.int32, device=DEV)
    kvl = torch.tensor([total], dtype=torch.int32, device=DEV)
    flops = 4 * t * (prefix + t / 2) * HQ * D
    paged = lambda: ta.paged_attention_prefill(q, kc, vc, cu, kvl, table, ps, D ** -0.5, t)  # noqa: E731
    flash = lambda: chunk_attention(q, k, v, kc, vc, [0, t], [total], table, ps, D ** -0.5)  # noqa: E731
    err = rel(flash(), paged())
    rows = []
    for name, fn in (("paged Triton (baseline)", paged), ("SDPA flash", flash)):
        s = MK.ev_time(fn, iters=10)
        rows.append(dict(kernel="attention", variant=f"{name}, prefix {prefix}", tokens=t, prefix=prefix,
                         ms=s * 1e3, tflops=flops / s / 1e12, pct_matmul=100 * flops / s / mm,
                         err_vs_baseline=err if "flash" in name else 0.0))
    return rows


def gdn_inputs(t: int):
    g = torch.Generator(device=DEV).manual_seed(1)
    q, k = (torch.randn(t, HK, DK, generator=g, device=DEV).bfloat16() for _ in range(2))
    v = torch.randn(t, HV, DV, generator=g, device=DEV).bfloat16()
    a, b = (torch.randn(t, HV, generator=g, device=DEV).bfloat16() for _ in range(2))
    a_log, dt_bias = torch.rand(HV, generator=g, device=DEV).log(), torch.randn(HV, generator=g, device=DEV)
    gg, beta = ref_gdn.gdn_gates(a, b, a_log, dt_bias)
    pool = torch.randn(2, HV, DK, DV, generator=g, device=DEV) * 0.1
    return q, k, v, gg, beta, pool


def gdn_run(inputs, t, tuning):
    q, k, v, gg, beta, pool = inputs
    state = pool.clone()
    out = tg.gdn_prefill(q, k, v, gg, beta, state, [0, t], [1], t, tuning=tuning)
    return out, state


def gdn_variants(sweep: bool) -> list[tg.PrefillTuning]:
    if not sweep:
        return [BASELINE, tg.PrefillTuning()]
    out = [BASELINE, tg.PrefillTuning()]
    for attn, warps, stages in itertools.product((False, True), (4, 8), (1, 2)):
        out.append(tg.PrefillTuning(attn_in_prep=attn, scan_bv=32, scan_warps=warps, scan_stages=stages))
    out += [replace(tg.PrefillTuning(), scan_bv=16), replace(tg.PrefillTuning(), scan_bv=64),
            replace(tg.PrefillTuning(), prep_precision="tf32x3")]
    return list(dict.fromkeys(out))


def gdn_rows(t: int, bw: float, sweep: bool, log, rounds: int = 3) -> list[dict]:
    """Each variant timed in `rounds` interleaved rounds (the GPU's clocks drift between
    variants timed far apart); its best round's median."""
    inputs = gdn_inputs(t)
    base_out, base_state = gdn_run(inputs, t, BASELINE)
    moved = t * (2 * HK * DK * 2 + 2 * HV * DV * 2 + 2 * HV * (DK + DV) * 4)
    errs, times = {}, {}
    for tuning in gdn_variants(sweep):
        try:
            out, state = gdn_run(inputs, t, tuning)
        except Exception as e:  # a variant that does not compile or fit (registers, shared memory)
            log(f"gdn {tuning}: {type(e).__name__}: {str(e).splitlines()[0]}")
            continue
        errs[tuning] = max(rel(out, base_out), rel(state, base_state))
    for _ in range(rounds):
        for tuning in errs:
            s = MK.ev_time(lambda: gdn_run(inputs, t, tuning), iters=10)
            times[tuning] = min(times.get(tuning, s), s)
    rows = []
    for tuning, s in times.items():
        rows.append(dict(kernel="gdn", variant=str(asdict(tuning)), tokens=t, ms=s * 1e3,
                         bound_ms=moved / bw * 1e3, err_vs_baseline=errs[tuning], tuning=asdict(tuning)))
        log(f"gdn {asdict(tuning)}: {s * 1e3:.3f} ms, err vs baseline {errs[tuning]:.2e}")
    return rows


def reference_error(tuning) -> float:
    """The default tuning against the fp32 PyTorch recurrence on 1024 tokens."""
    t = 1024
    q, k, v, gg, beta, pool = gdn_inputs(t)
    out, state = gdn_run((q, k, v, gg, beta, pool), t, tuning)
    ref_pool = pool.clone()
    ref = ref_gdn.gdn_prefill_ref(q.float(), k.float(), v.float(), gg, beta.float(), ref_pool, [0, t], [1])
    return max(rel(out, ref), rel(state[1], ref_pool[1]))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("/tmp/prefill_kernels"))
    ap.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--prefix", type=int, default=57344, help="cached tokens before the attention case's last chunk "
                    "(default: the 8th 8192-token chunk of a 64k prompt)")
    ap.add_argument("--no-sweep", dest="sweep", action="store_false")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    log = MK.logger(args.out / "prefill_kernels.log")
    bw, mm = MK.hbm_bandwidth(), MK.bf16_matmul_rate()
    log(f"{torch.cuda.get_device_name()}: HBM copy {bw / 1e12:.2f} TB/s, bf16 matmul {mm / 1e12:.0f} TFLOP/s")
    rows = []
    for t in args.tokens:
        rows += attention_rows(t, 0, mm)
    rows += attention_rows(max(args.tokens), args.prefix, mm)
    for t in args.tokens:
        rows += gdn_rows(t, bw, args.sweep and t == max(args.tokens), log)
    ref_err = reference_error(tg.PrefillTuning())
    md = [f"Device: {torch.cuda.get_device_name()}; HBM copy {bw / 1e12:.2f} TB/s, bf16 matmul {mm / 1e12:.0f} TFLOP/s.",
          "", "| kernel | variant | T | ms | TFLOP/s (attention) or bound ms (gdn) | % of ceiling | x baseline | "
          "rel err vs baseline |",
          "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        base = next(b for b in rows if b["kernel"] == r["kernel"] and b["tokens"] == r["tokens"]
                    and b.get("prefix") == r.get("prefix"))
        perf = (f"{r['tflops']:.0f} | {r['pct_matmul']:.0f}%" if r["kernel"] == "attention"
                else f"{r['bound_ms']:.3f} | {100 * r['bound_ms'] / r['ms']:.0f}%")
        md.append(f"| {r['kernel']} | {r['variant']} | {r['tokens']} | {r['ms']:.3f} | {perf} | "
                  f"{base['ms'] / r['ms']:.2f} | {r['err_vs_baseline']:.1e} |")
    md.append(f"\nGDN default tuning against the fp32 reference (1024 tokens): rel err {ref_err:.1e}.")
    (args.out / "prefill_kernels.md").write_text("\n".join(md) + "\n")
    (args.out / "prefill_kernels.json").write_text(json.dumps(dict(rows=rows, ref_err=ref_err), indent=1))
    log("\n".join(md))


if __name__ == "__main__":
    main()
