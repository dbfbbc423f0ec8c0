"""Quantized dense layers (QuantLinear -> Triton kernel of the format's device form) against
the CPU reference: the registry's dequantization, then an fp32 matmul.

Interpreter cases (every registry format; decode M=1/5 with split-K, the fp8 GEMV at M=1/3, weights stacked from parts with their own scales,
prefill M=40; N not a multiple of the tile; K not a multiple of the k-step; fp8 block edges; int4 with and without zero points) run in one worker
subprocess with TRITON_INTERPRET=1 (tests/interpreter_workers.py), each reported as a test.
GPU cases (`-m gpu`) run the compiled kernels at Qwen3.6 shapes and skip without CUDA.
"""
from __future__ import annotations

import functools
import sys

import pytest
import torch

from tests.interpreter_workers import assert_case_passed, report_cases, run_workers

pytest.importorskip("triton")

from moeferry.checkpoint.formats import FORMATS, QuantParams  # noqa: E402
from moeferry.model.linear import QuantLinear  # noqa: E402

WORKERS = 1


def _rel(out, ref):
    assert torch.isfinite(out).all(), "non-finite output"
    return ((out.float() - ref).norm() / ref.norm()).item()


def check_linear(fmt, m, n, k, device="cpu", params=None, dtype=torch.bfloat16, tol=1e-2, seed=0, parts=1):
    """QuantLinear(x) vs x @ dequantize(W)^T in fp32; returns the relative error. `parts` > 1:
    W is that many projections quantized apart (each its own scales) and stacked by rows."""
    gen = torch.Generator().manual_seed(seed)
    f = FORMATS[fmt]
    params = QuantParams(**params) if params else None

    def one(rows, scale):
        w = torch.randn(rows, k, generator=gen) * scale
        return f.packed(f.quantize(w.bfloat16() if fmt == "bf16" else w, params), params)

    weights = [one(n // parts, 0.05 * (1 + i)) for i in range(parts)]
    packed = weights[0] if parts == 1 else type(weights[0]).stack_rows(weights)
    lin = QuantLinear(packed.to(device), fmt)
    x = torch.randn(m, k, generator=gen).to(dtype)
    ref = x.float() @ packed.dequantize(torch.float32).t()
    out = lin(x.to(device))
    assert out.shape == (m, n) and out.dtype == dtype
    if lin._operands:  # split-K counters are re-armed: a second call gives the same result
        assert not lin._operands.counters.any(), "split-K counters left armed"
        assert torch.equal(lin(x.to(device)), out), "second call differs"
    err = _rel(out.cpu(), ref)
    assert err < tol, f"{fmt} m={m} n={n} k={k}: rel err {err:.3g} >= {tol}"
    return err


# name -> (format, m, n, k, params)
CASES = {}
for _fmt in FORMATS:
    CASES[f"{_fmt}-decode"] = (_fmt, 1, 72, 256, None)
    CASES[f"{_fmt}-prefill"] = (_fmt, 40, 48, 128, None)
CASES["fp8_tensor-batch5-perrow"] = ("fp8_tensor", 5, 40, 96, {"per_channel": True})
CASES["fp8_tensor-gemv-batch3"] = ("fp8_tensor", 3, 40, 200, None)
CASES["fp8_block-edges"] = ("fp8_block", 3, 200, 320, {"block_size": (128, 128)})
CASES["int4_ct-asym-g64"] = ("int4_ct", 2, 64, 256, {"group_size": 64, "symmetric": False})
CASES["int4_awq-g32-prefill"] = ("int4_awq", 20, 40, 128, {"group_size": 32, "symmetric": False})
CASES["nvfp4-k32"] = ("nvfp4", 3, 24, 32, None)
# the one-row GEMV (DenseConfig(row=True)): name -> (format, n, k, params, bn, bk)
ROWS = {f"{_fmt}-row": (_fmt, 72, 256, None, 16, 64) for _fmt in FORMATS}
ROWS["nvfp4-row-k-edge"] = ("nvfp4", 40, 96, None, 8, 64)
ROWS["int4_awq-row-g32"] = ("int4_awq", 24, 128, {"group_size": 32, "symmetric": False}, 4, 64)
ROWS["fp8_block-row-edges"] = ("fp8_block", 200, 320, {"block_size": (128, 128)}, 32, 256)
STACKED = {f"{_fmt}-stacked-{kind}": (_fmt, m, 96, 128, None)
           for _fmt in ("fp8_tensor", "nvfp4", "int4_awq") for kind, m in (("decode", 1), ("prefill", 40))}


def check_row(fmt, n, k, params, bn, bk, device="cpu", seed=0, tol=1e-2):
    """quant_linear with the one-row GEMV config (M = 1) vs x @ dequantize(W)^T in fp32."""
    from moeferry.ops.triton.quant_linear import DenseConfig, dense_operands, quant_linear
    gen = torch.Generator().manual_seed(seed)
    f = FORMATS[fmt]
    params = QuantParams(**params) if params else None
    w = torch.randn(n, k, generator=gen) * 0.05
    packed = f.packed(f.quantize(w.bfloat16() if fmt == "bf16" else w, params), params)
    x = torch.randn(1, k, generator=gen).bfloat16()
    ref = x.float() @ packed.dequantize(torch.float32).t()
    out = quant_linear(x.to(device), dense_operands(packed.to(device), f.device_form),
                       DenseConfig(1, bn, bk, row=True))
    err = _rel(out.cpu(), ref)
    assert err < tol, f"{fmt} row GEMV n={n} k={k} bn={bn} bk={bk}: rel err {err:.3g} >= {tol}"
    return err


def _worker(shard: int, nshards: int) -> None:
    def run(name):
        if name in ROWS:
            return check_row(*ROWS[name], seed=hash(name) % 1000)
        fmt, m, n, k, params = CASES.get(name) or STACKED[name]
        return check_linear(fmt, m, n, k, params=params, seed=hash(name) % 1000, parts=3 if name in STACKED else 1)
    report_cases(list(CASES) + list(STACKED) + list(ROWS), run, shard, nshards)


@pytest.fixture(scope="module")
def interpreted():
    return run_workers(__file__, WORKERS, MOEFERRY_TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")


@pytest.mark.parametrize("case", sorted(CASES) + sorted(STACKED) + sorted(ROWS))
def test_interpreted(interpreted, case):
    assert_case_passed(interpreted, case)


def test_cpu_uses_reference(monkeypatch):
    """On CPU tensors without the interpreter switch, QuantLinear never builds kernel operands."""
    monkeypatch.delenv("MOEFERRY_TRITON_INTERPRET", raising=False)
    check_linear("nvfp4", 3, 32, 64, tol=1e-2)
    f = FORMATS["int4_awq"]
    lin = QuantLinear(f.packed(f.quantize(torch.randn(16, 128))), "int4_awq")
    lin(torch.randn(2, 128, dtype=torch.bfloat16))
    assert lin._operands is None


def test_device_forms_have_kernels():
    from moeferry.ops.triton.quant_linear import DENSE_KERNELS
    for name, f in FORMATS.items():
        assert f.device_form in DENSE_KERNELS, name


# -- GPU: compiled kernels at real shapes ------------------------------------------------------
@functools.lru_cache(maxsize=4)
def _gpu_weight(fmt, n, k):
    f = FORMATS[fmt]
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n + k)) * 0.05
    return f.packed(f.quantize(w.bfloat16() if fmt == "bf16" else w))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("n,k", [(2048, 4096), (1000, 2048)])
def test_gpu_real_shapes(fmt, n, k):
    """Decode (split-K) and prefill shapes at Qwen3.6 sizes: bf16 activations and weight
    tiles, fp32 accumulation, against the fp32 reference."""
    packed = _gpu_weight(fmt, n, k)
    lin = QuantLinear(packed.to("cuda"), fmt)
    ref_w = packed.dequantize(torch.float32)
    for m in (1, 4, 16, 300):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).bfloat16()
        out = lin(x.cuda())
        err = _rel(out.cpu(), x.float() @ ref_w.t())
        assert err < 1e-2, f"{fmt} m={m} n={n} k={k}: rel err {err:.3g}"
        assert not lin._operands.counters.any(), "split-K counters left armed"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_gpu_row_gemv(fmt):
    """The one-row GEMV compiled at Qwen3.6 shapes (o_proj; N not a multiple of BN) for a few tiles."""
    for n, k in ((2048, 4096), (1000, 2048)):
        for bn, bk in ((4, 2048), (16, 512), (2, 1024)):
            check_row(fmt, n, k, None, bn, bk, device="cuda", seed=n + bk)


if __name__ == "__main__" and len(sys.argv) == 4 and sys.argv[1] == "--worker":
    _worker(int(sys.argv[2]), int(sys.argv[3]))


def test_linears_fuse_plain_projections_only(monkeypatch):
    """`Linears`: plain projections become one GEMM (outputs equal the separate ones); a
    quantized part keeps every projection separate, with the same outputs."""
    from moeferry.model.linear import Linear, Linears
    monkeypatch.delenv("MOEFERRY_TRITON_INTERPRET", raising=False)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 64, generator=g)
    a, b = Linear(torch.randn(8, 64, generator=g)), Linear(torch.randn(1, 64, generator=g))
    fused = Linears(a, b)
    assert fused.fused is not None and fused.fused.weight.shape == (9, 64)
    ya, yb = fused(x)
    assert torch.allclose(ya, a(x), atol=1e-5) and torch.allclose(yb, b(x), atol=1e-5)
    assert torch.allclose(fused.first(x), a(x), atol=1e-5)
    f = FORMATS["int4_awq"]
    q = QuantLinear(f.packed(f.quantize(torch.randn(16, 64, generator=g))), "int4_awq")
    mixed = Linears(a, q)
    assert mixed.fused is None
    ya, yq = mixed(x)
    assert torch.equal(ya, a(x)) and torch.equal(yq, q(x)) and torch.equal(mixed.first(x), a(x))
