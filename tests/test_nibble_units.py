"""The inline PTX of nibble_gemv's 16-value units, run on the CPU by a small emulator of the
instructions they use (fp16 lanes rounded as the GPU rounds them), against the exact sum of the
decoded values times x: the GPU runs this assembly only on a GPU, the interpreter its plain
replacement, so without this a wrong shift, mask or constant would show only there."""
from __future__ import annotations

import numpy as np
import pytest

from moeferry.ops.triton.nibble_gemv import _FP4_UNIT, _INT4_UNIT

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _half(bits: int) -> float:
    return float(np.array([bits & 0xFFFF], dtype=np.uint16).view(np.float16)[0])


def _bits(v: float) -> int:
    return int(np.array([v], dtype=np.float16).view(np.uint16)[0])


def _lanes(fn, *words: int) -> int:
    """A fp16x2 operation: fn on each 16-bit lane (as floats), each result rounded to fp16."""
    return sum(_bits(fn(*(_half(w >> h) for w in words))) << h for h in (0, 16))


OPS = {
    "mov.b32": lambda a: a,
    "shl.b32": lambda a, n: (a << n) & 0xFFFFFFFF,
    "shr.b32": lambda a, n: a >> n,
    "and.b32": lambda a, b: a & b,
    "xor.b32": lambda a, b: a ^ b,
    "lop3.b32": lambda a, b, c, lut: {0xEA: (a & b) | c}[lut],  # the one truth table the units use
    "sub.rn.f16x2": lambda a, b: _lanes(lambda p, q: p - q, a, b),
    "fma.rn.f16x2": lambda a, b, c: _lanes(lambda p, q, r: p * q + r, a, b, c),
}


def run_unit(asm: str, words: tuple[int, int], xs: list[int]) -> float:
    """The unit's fp32 result for words $1, $2 and fp16x2 x operands $3..$10."""
    regs = {"$1": words[0], "$2": words[1], **{f"${3 + i}": x for i, x in enumerate(xs)}}
    for line in asm.replace(";", ";\n").splitlines():
        line = line.strip().rstrip(";").strip()
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        if op == "mov.b32" and rest.startswith("{"):  # the two lanes of the sum, added below
            continue
        if op in ("add.rn.f16", "cvt.f32.f16"):
            continue
        dst, *args = [a.strip() for a in rest.split(",")]
        regs[dst] = OPS[op](*(regs[a] if a in regs else int(a, 0) for a in args))
    return float(np.float16(_half(regs["a"]) + _half(regs["a"] >> 16)))


@pytest.mark.parametrize("form", ["fp4", "int4"])
def test_unit_asm_sums_the_decoded_nibbles_exactly(form):
    """Operand (word a, pair j) holds x[8a + j] (low lane) and x[8a + j + 4] (high); nibble i of
    word a is weight k = 8a + i. Small integer x: every fp16 step is exact, so the result must be."""
    asm, value = ((_FP4_UNIT.value, lambda q: (-1 if q & 8 else 1) * E2M1[q & 7] / 2**14) if form == "fp4"
                  else (_INT4_UNIT.value, lambda q: q - 8))
    rng = np.random.default_rng(7)
    for _ in range(200):
        words = tuple(int(w) for w in rng.integers(0, 2**32, 2, dtype=np.uint64))
        x = rng.integers(-8, 8, 16)
        xs = [_bits(x[8 * a + j]) | _bits(x[8 * a + j + 4]) << 16 for a in range(2) for j in range(4)]
        q = [(words[k // 8] >> 4 * (k % 8)) & 0xF for k in range(16)]
        want = sum(value(q[k]) * float(x[k]) for k in range(16))
        assert run_unit(asm, words, xs) == pytest.approx(want, abs=1e-12), (words, x.tolist())
