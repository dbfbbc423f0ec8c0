"""What each part of a T = 1 MoE decode call costs (issue 13, item 3): the call timed with parts removed.

    python benchmarks/moe_decode_parts.py [--out DIR] [--forms fp4]

The 4-bit decode call (`moe_decode.py`: gate_up, then down) is timed as the tree is and with
parts of its work taken out one after another, each removal on top of the ones before (but
"no unit math", which is timed on its own first): the results are wrong, only their times
count. Each variant is a copy of `moeferry` with its source patched (the patch table below;
a patch that no longer matches the source stops the run) and timed by
`moe_decode_sweep.py --variants` in its own process: whole calls over 16 routings at T = 1
and 4, each kernel's device time at T = 1, and the same with one routing (weights in L2).
An empty kernel and a kernel that only reads the routing chain (ids, then the slot table)
give the floor of two launches of these grids. Prints a table; writes moe_decode_parts.md.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NIB = "moeferry/ops/triton/nibble_gemv.py"
DEC = "moeferry/ops/triton/moe_decode.py"

# part -> (file, source text, its replacement)
PATCHES = {
    "weight loads": (NIB, """    w = tl.load(wp + slot * N * kw + offs_n[:, None] * kw + offs_w[None, :],
                mask=mn[:, None] & (offs_w < kw)[None, :], other=0)""",
                     """    w = (offs_n[:, None] * 40503 + offs_w[None, :] * 2654435 + slot.to(tl.int32)).to(tl.int32)
    w = w ^ (w << 13)"""),
    "unit math": (NIB, """        if FP4:
            return tl.inline_asm_elementwise(_FP4_UNIT,""",
                  """        if True:
            return ((w0 ^ w1 ^ x00[None, :] ^ x13[None, :]) & 0xFFFF).to(tl.float32)
        if FP4:
            return tl.inline_asm_elementwise(_FP4_UNIT,"""),
    "scale loads": (NIB, """    sc = tl.load(s_ptr + slot * N * ks + offs_n[:, None] * ks + offs_s[None, :],
                 mask=mn[:, None] & (offs_s < ks)[None, :], other=0)""",
                    """    sc = ((offs_n[:, None] + offs_s[None, :] + slot.to(tl.int32)) & 0x3F).to(tl.uint8)"""),
    "gate_up's x preparation": (NIB, """            c = RANGE / tl.maximum(tl.max(tl.abs(xv)), 1e-30)
            return _units(w0, w1, _x_pairs(xv * c, BK), FP4), _unit_sums(xv, BK), 1.0 / c""",
                                """            xq = tl.reshape((tl.arange(0, BK // 2) * 3 + k0).to(tl.int32), (BK // 16, 8))
            return _units(w0, w1, _operands(xq, BK), FP4), tl.zeros((BK // 16,), tl.float32), 1.0"""),
    "down's last-arrival sum": (DEC, "        if ARRIVE:  # the row block's last chunk",
                                "        if False:  # the row block's last chunk"),
}
# variant -> the parts it removes
VARIANTS = {"entry": [], "no weight loads": ["weight loads"], "no unit math": ["unit math"]}
_stack = ["weight loads", "unit math"]
VARIANTS["neither"] = list(_stack)
for _part in ("scale loads", "gate_up's x preparation", "down's last-arrival sum"):
    _stack.append(_part)
    VARIANTS[f"... nor {_part}"] = list(_stack)


def make_tree(dst: Path, parts: list[str]) -> Path:
    """A copy of moeferry and benchmarks under dst with `parts` patched out."""
    shutil.copytree(ROOT / "moeferry", dst / "moeferry")
    shutil.copytree(ROOT / "benchmarks", dst / "benchmarks")
    for part in parts:
        path, old, new = PATCHES[part]
        f = dst / path
        src = f.read_text()
        if old not in src:
            raise SystemExit(f"moe_decode_parts: the patch for {part!r} no longer matches {path}")
        f.write_text(src.replace(old, new))
    return dst


def time_tree(tree: Path, form: str, out: Path) -> dict:
    """`moe_decode_sweep.py --variants` of a tree, in its own process: its JSON for `form`."""
    subprocess.run([sys.executable, str(tree / "benchmarks" / "moe_decode_sweep.py"), "--variants", "--forms", form,
                    "--out", str(out)], check=True, stdout=subprocess.DEVNULL)
    return json.loads((out / "moe_decode_variants.json").read_text())["forms"][0]


def launch_floor() -> dict[str, float]:
    """Microseconds a call of two launches (grids 288 and 576, 4 warps) takes when they do nothing, and
    when each program only reads the routing chain (whole calls in a graph of 16)."""
    import torch
    import triton
    import triton.language as tl

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import moe_kernels as MK

    @triton.jit
    def _empty(p, N: tl.constexpr):
        if tl.program_id(0) == N:  # never: keeps the argument
            tl.store(p, 1)

    @triton.jit
    def _chain(ids, table, out):
        e = tl.load(ids + tl.program_id(0) % 8)
        tl.store(out + tl.program_id(0), tl.load(table + e))

    buf = torch.zeros(1024, dtype=torch.int32, device="cuda")
    ids = torch.randint(0, 256, (8,), dtype=torch.int32, device="cuda")
    table = torch.arange(256, dtype=torch.int32, device="cuda")

    def empty():
        _empty[(288,)](buf, N=1 << 20, num_warps=4)
        _empty[(576,)](buf, N=1 << 20, num_warps=4)

    def chain():
        _chain[(288,)](ids, table, buf, num_warps=4)
        _chain[(576,)](ids, table, buf, num_warps=4)

    return {"two empty launches": MK.graph_time([empty] * 16) * 1e6,
            "two launches reading the routing chain": MK.graph_time([chain] * 16) * 1e6}


def _us(kernels: dict[str, float], name: str) -> float:
    return sum(v for k, v in kernels.items() if name in k) * 1e6


def _row(name: str, r: dict) -> str:
    k, hot = r["kernels"]["current"], r["kernels"]["current, L2-hot"]
    whole = {w["T"]: w["t_current"] * 1e6 for w in r["rows"]}
    return (f"| {name} | {whole[1]:.1f} | {whole[4]:.1f} | {_us(k, 'gate_up'):.1f} | {_us(k, 'down'):.1f} | "
            f"{_us(hot, 'gate_up'):.1f} | {_us(hot, 'down'):.1f} |")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--forms", default="fp4", help="only fp4: the unit-math patch takes out fp4's unit")
    args = ap.parse_args()
    if set(args.forms.split(",")) != {"fp4"}:
        ap.error("--forms: only fp4 is patched (the unit-math patch takes out fp4's unit, not int4's)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    md = []
    for form in args.forms.split(","):
        md += [f"{form}: T = 1 / 4 whole calls over 16 routings, each kernel at T = 1 (and with one routing: L2)",
               "", "| variant | T = 1 us | T = 4 us | gate_up us | down us | gate_up, L2 | down, L2 |",
               "|---|---|---|---|---|---|---|"]
        with tempfile.TemporaryDirectory() as tmp:
            for i, (name, parts) in enumerate(VARIANTS.items()):
                tree = make_tree(Path(tmp) / f"v{i}", parts) if parts else ROOT
                md.append(_row(name, time_tree(tree, form, Path(tmp) / f"out{i}")))
                print(md[-1], flush=True)
        md.append("")
    md += [f"{k}: {v:.1f} us a call" for k, v in launch_floor().items()]
    text = "\n".join(md) + "\n"
    (out / "moe_decode_parts.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
