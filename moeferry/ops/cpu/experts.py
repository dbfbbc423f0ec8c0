"""SwiGLU experts computed on the CPU straight from a bank's slot form (`experts.c`).

The C source is built once per machine (`moeferry.native`) with `-O3 -march=native -fopenmp`,
falling back to fewer flags where the compiler refuses one. ctypes calls it (and releases the
GIL meanwhile). Without a compiler, or with MOEFERRY_CPU_KERNEL=0, `kernel()` is None and
callers keep the PyTorch reference (`SlotBuffer.run_reference`); the log says which one runs
and why.
"""
from __future__ import annotations

import ctypes
import functools
import logging
import os
import weakref
from pathlib import Path

import torch

from moeferry.native import library

log = logging.getLogger("moeferry.cpu_kernel")

SOURCE = Path(__file__).with_name("experts.c")
FORMS = {"dense": 0, "fp8_row": 1, "fp8_block": 2, "fp4": 3, "int4": 4}
DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# tried in order: the first set the compiler accepts is kept
FLAG_SETS = (["-O3", "-march=native", "-fopenmp"], ["-O3", "-fopenmp"], ["-O3", "-march=native"], ["-O3"])


class _Matrix(ctypes.Structure):
    """experts.c's matrix_t: one SlotMatrix's pointers, geometry and per-slot byte strides."""

    _fields_ = [(name, ctypes.c_int32) for name in ("form", "dtype", "n", "k", "part", "group", "group_n", "s_cols")] + \
               [(name, ctypes.c_void_p) for name in ("w", "s", "z", "rs")] + \
               [(name, ctypes.c_int64) for name in ("w_slot", "s_slot", "z_slot", "rs_slot")]


def _matrix(m) -> _Matrix:
    """The C view of a SlotMatrix (its tensors must stay alive while the view is used)."""
    def ptr(t):
        return None if t is None else t.data_ptr()

    def stride(t):
        return 0 if t is None else t[0].numel() * t.element_size()

    for name, t in m.tensors().items():
        if not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError(f"CPU expert kernel: slot tensor {name} must be contiguous on the host")
    dtype = m.w.dtype if m.kernel.name == "dense" else (m.s.dtype if m.kernel.name == "int4" else torch.float32)
    if dtype not in DTYPES:
        raise ValueError(f"CPU expert kernel: no path for {m.kernel.name} weights in {dtype}")
    return _Matrix(FORMS[m.kernel.name], DTYPES[dtype], m.n, m.k, m.part, min(m.group, m.k), m.group_n,
                   m.s.shape[-1] if m.s is not None else 0, ptr(m.w), ptr(m.s), ptr(m.z), ptr(m.rs),
                   stride(m.w), stride(m.s), stride(m.z), stride(m.rs))


class CpuExperts:
    """The loaded kernel: `run` computes a bank's experts for their tokens on the host."""

    def __init__(self, lib: ctypes.CDLL, path: Path, flags: list[str]):
        self.lib, self.path, self.flags = lib, path, flags
        lib.moe_cpu_experts.restype = ctypes.c_int
        lib.moe_cpu_experts.argtypes = [ctypes.POINTER(_Matrix), ctypes.POINTER(_Matrix), ctypes.c_void_p,
                                        ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                        ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
        features = lib.moe_cpu_features()
        self.simd, self.openmp, self.avx512 = bool(features & 1), bool(features & 2), bool(features & 4)
        self._views: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # bank -> its matrices' C views

    def describe(self) -> str:
        simd = "AVX-512 + AVX2/F16C" if self.avx512 else "AVX2/F16C" if self.simd else "portable loops"
        return f"C kernel ({simd}, {'OpenMP' if self.openmp else 'one thread'})"

    def views(self, bank) -> tuple[_Matrix, _Matrix]:
        """The C views of a host bank's gate_up and down matrices (made once per bank)."""
        if bank not in self._views:
            self._views[bank] = (_matrix(bank.gate_up), _matrix(bank.down))
        return self._views[bank]

    def run(self, bank, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, table_row: torch.Tensor,
            threads: int) -> torch.Tensor:
        """fp32 [T, H]: `run_reference`'s contract on the host. The pairs of ids / weights [T, k]
        whose expert has a bank slot in `table_row` ([experts] int32, -1 = none) are computed
        and summed per token. The pairs are grouped in C: a step's host time is one call."""
        x = x.float().contiguous()
        ids, weights = ids.long().contiguous(), weights.float().contiguous()
        table_row = table_row.to(torch.int32).contiguous()
        out = torch.zeros(x.shape, dtype=torch.float32)
        gu, dn = self.views(bank)
        rc = self.lib.moe_cpu_experts(ctypes.byref(gu), ctypes.byref(dn), x.data_ptr(), x.shape[0], ids.shape[-1],
                                      ids.data_ptr(), weights.data_ptr(), table_row.data_ptr(), table_row.numel(),
                                      out.data_ptr(), threads)
        if rc != 0:
            raise MemoryError("CPU expert kernel: could not allocate its buffers")
        return out


def load(path: Path, flags: list[str]) -> CpuExperts:
    """A built kernel, loaded (OSError when it cannot be)."""
    return CpuExperts(ctypes.CDLL(str(path)), path, flags)


@functools.cache
def kernel() -> CpuExperts | None:
    """The built kernel, or None (the reason is logged once): MOEFERRY_CPU_KERNEL=0, or no
    compiler. Built in the user cache directory, or in the temporary directory when that one is
    not writable."""
    if os.environ.get("MOEFERRY_CPU_KERNEL", "1") == "0":
        log.info("CPU experts: PyTorch reference (MOEFERRY_CPU_KERNEL=0)")
        return None
    try:
        found = library(SOURCE, FLAG_SETS, ["-lm"], load)
    except OSError as e:
        log.warning("CPU experts: the C kernel could not be built (%s); the PyTorch reference computes them, "
                    "several times slower", e)
        return None
    log.info("CPU experts: %s, %s", found.describe(), found.path)
    return found
