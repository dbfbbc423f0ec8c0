"""The CPU lane's C kernel (`moeferry/ops/cpu/experts.c`) against the slot forms' PyTorch
reference (`SlotBuffer.run_reference`): every registry format, experts in scattered slots,
token counts below, at and past the kernel's token block, row lengths with and without a
scalar tail. Built three times from the source: for this CPU (`-march=native`: AVX-512 where it
has it), for AVX2/F16C alone, and with the portable loops (`-O3` alone), so every path that
this CPU can run is checked here.
"""
from __future__ import annotations

import logging
import os
import platform
import shutil
from pathlib import Path

import pytest
import torch

from moeferry.moe.slots import SlotBuffer
from moeferry import native
from moeferry.ops.cpu import experts as cpu
from tests.test_moe_kernels import _rel
from tests.test_slot_reference import CASES, _buffer

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CC", "cc")) is None, reason="no C compiler")


BUILDS = {"native": ["-O3", "-march=native", "-fopenmp"], "portable": ["-O3"]}
if platform.machine() in ("x86_64", "AMD64"):  # the AVX2 paths alone, also on a CPU with AVX-512
    BUILDS["avx2"] = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp"]


@pytest.fixture(scope="module")
def builds(tmp_path_factory) -> dict[str, cpu.CpuExperts]:
    out = {}
    for name, flags in BUILDS.items():
        path = tmp_path_factory.mktemp(name) / "experts.so"
        out[name] = cpu.load(path, native.build(cpu.SOURCE, path, [flags], ["-lm"]))
    assert not out["portable"].simd and not out["portable"].openmp
    assert "avx2" not in out or (out["avx2"].simd and not out["avx2"].avx512)
    return out


def _routing(buf, t, experts, k, gen):
    """x [t, H], ids / weights [t, k] over expert ids 0..experts-1, and a table row placing the
    experts in scattered bank slots."""
    x = torch.randn(t, buf.hidden, generator=gen)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(t)])
    w = torch.rand(t, k, generator=gen)
    row = torch.randperm(buf.num_slots, generator=gen)[:experts].to(torch.int32)
    return x, ids, w, row


def _check(kernel, buf, gen, tokens=(1, 3, 4, 9), experts=6, k=3, drop=2):
    for t in tokens:
        x, ids, w, row = _routing(buf, t, experts, k, gen)
        row[torch.randperm(experts, generator=gen)[:drop]] = -1  # experts not on this lane
        got = kernel.run(buf, x, ids, w, row, 2)
        want = buf.run_reference(x, ids, w, row)
        assert got.dtype == torch.float32 and got.shape == x.shape
        assert want.abs().max() > 0
        assert _rel(got, want) <= 1e-5, f"T={t}: relative error {_rel(got, want):.3g}"


@pytest.mark.parametrize("build", list(BUILDS))
@pytest.mark.parametrize("case", sorted(CASES))
def test_kernel_matches_reference(builds, build, case):
    buf, _, _, gen = _buffer(case, 0, 9, seed=hash(case) % 1000)
    _check(builds[build], buf, gen)


@pytest.mark.parametrize("build", list(BUILDS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dense_experts_in_every_dtype(builds, build, dtype):
    gen = torch.Generator().manual_seed(5)
    e, h, i = 7, 60, 20  # rows of 60 (a 32-wide block, a 16-wide one, a scalar tail) and 20
    buf = SlotBuffer.from_dense((torch.randn(e, 2 * i, h, generator=gen) / 4).to(dtype),
                                (torch.randn(e, h, i, generator=gen) / 4).to(dtype))
    _check(builds[build], buf, gen)


def test_fp8_held_as_raw_bytes(builds):
    buf, _, _, gen = _buffer("fp8_block-32x64", 0, 6, seed=7)
    raw = SlotBuffer(*(type(m)(**{**m.__dict__, **{k: t.view(torch.uint8) for k, t in m.tensors().items()
                                                    if t.dtype == torch.float8_e4m3fn}})
                       for m in (buf.gate_up, buf.down)))
    x, ids, w, row = _routing(buf, 3, 5, 2, gen)
    assert torch.equal(builds["native"].run(raw, x, ids, w, row, 2), builds["native"].run(buf, x, ids, w, row, 2))


def test_thread_counts_agree_bit_for_bit(builds):
    """Each output row is one thread's work whatever the count: the results are identical."""
    buf, _, _, gen = _buffer("nvfp4", 0, 8, seed=8)
    x, ids, w, row = _routing(buf, 6, 8, 4, gen)
    runs = [builds["native"].run(buf, x, ids, w, row, n) for n in (1, 2, 3)]
    assert all(torch.equal(runs[0], r) for r in runs[1:])


def test_tokens_of_other_experts_get_nothing(builds):
    """Pairs whose expert is -1 in the table, or past its end, are not computed."""
    buf, _, _, gen = _buffer("int4_awq", 0, 6, seed=9)
    x, ids, w, row = _routing(buf, 4, 6, 2, gen)
    ids[0] = torch.tensor([4, 5])  # token 0 routed only to experts this lane does not hold
    ids[1, 0] = 9  # past the table: skipped, the token's other expert still counts
    lane = torch.where(torch.arange(6) < 4, row, -1).to(torch.int32)
    out = builds["native"].run(buf, x, ids, w, lane, 2)
    assert torch.equal(out[0], torch.zeros_like(out[0])) and out[1:].abs().max() > 0
    keep = ids[1:].clone().masked_fill_(ids[1:] >= 6, 0)
    want = buf.run_reference(x[1:], keep, w[1:].masked_fill(ids[1:] >= 6, 0.0), lane)
    assert _rel(out[1:], want) <= 1e-5
    assert torch.equal(builds["native"].run(buf, x, ids, w, torch.full((6,), -1, dtype=torch.int32), 2),
                       torch.zeros_like(x))


def test_run_host_uses_the_kernel_and_falls_back(monkeypatch, tmp_path, caplog):
    buf, _, _, gen = _buffer("nvfp4", 0, 6, seed=10)
    x, ids, w, _ = _routing(buf, 3, 6, 2, gen)
    want = buf.run_reference(x, ids, w, torch.arange(6, dtype=torch.int32))
    cpu.kernel.cache_clear()
    try:
        assert cpu.kernel() is not None  # a compiler is here: the lane is the C kernel
        assert _rel(buf.run_host(x, ids, w, range(6), 2), want) <= 1e-5
        for env, value, said in (("MOEFERRY_CPU_KERNEL", "0", "PyTorch reference"),
                                 ("CC", str(tmp_path / "no-such-cc"), "could not be built")):
            cpu.kernel.cache_clear()
            monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # nothing built there yet
            monkeypatch.setenv(env, value)
            with caplog.at_level(logging.INFO, logger="moeferry.cpu_kernel"):
                assert cpu.kernel() is None
            assert said in caplog.text
            assert torch.equal(buf.run_host(x, ids, w, range(6), 2), want)
            monkeypatch.delenv(env)
        assert not list(Path(tmp_path).glob("moeferry/cpu_kernels/*.so"))
    finally:
        cpu.kernel.cache_clear()


def test_an_unusable_cache_builds_in_the_temporary_directory(monkeypatch, tmp_path):
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "moeferry").write_text("a file where the cache directory would be")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(native.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    cpu.kernel.cache_clear()
    try:
        found = cpu.kernel()
        assert found is not None and found.path.parent == tmp_path / "tmp" / f"moeferry-cpu-kernels-{os.getuid()}"
    finally:
        cpu.kernel.cache_clear()


def test_kernel_is_built_once_into_the_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cpu.kernel.cache_clear()
    try:
        first = cpu.kernel()
        made = sorted(Path(tmp_path).glob("moeferry/cpu_kernels/*"))
        assert first is not None and [p.suffix for p in made] == [".flags", ".so"] and first.path == made[1]
        assert first.flags == made[0].read_text().split() and "-O3" in first.flags
        stamp = made[1].stat().st_mtime_ns
        cpu.kernel.cache_clear()
        assert cpu.kernel().path == first.path and made[1].stat().st_mtime_ns == stamp  # found, not rebuilt
    finally:
        cpu.kernel.cache_clear()
