"""SwiGLU experts computed on the CPU straight from a bank's slot form (`experts.c`).

The C source is built once per machine with the system C compiler (`$CC`, else `cc`) with
`-O3 -march=native -fopenmp`, falling back to fewer flags where the compiler refuses one, into
the user cache directory (the temporary directory when that cannot be written) under a name that
hashes the source, the flags and the CPU. ctypes
calls it (and releases the GIL meanwhile). Without a compiler, or with MOEFERRY_CPU_KERNEL=0,
`kernel()` is None and callers keep the PyTorch reference (`SlotBuffer.run_reference`); the
log says which one runs and why.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import weakref
from pathlib import Path

import torch

from moeferry.paths import cache_dir

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

    def run(self, bank, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, table_row: torch.Tensor,
            threads: int) -> torch.Tensor:
        """fp32 [T, H]: `run_reference`'s contract on the host. The pairs of ids / weights [T, k]
        whose expert has a bank slot in `table_row` ([experts] int32, -1 = none) are computed
        and summed per token. The pairs are grouped in C: a step's host time is one call."""
        x = x.float().contiguous()
        ids, weights = ids.long().contiguous(), weights.float().contiguous()
        table_row = table_row.to(torch.int32).contiguous()
        out = torch.zeros(x.shape, dtype=torch.float32)
        if bank not in self._views:
            self._views[bank] = (_matrix(bank.gate_up), _matrix(bank.down))
        gu, dn = self._views[bank]
        rc = self.lib.moe_cpu_experts(ctypes.byref(gu), ctypes.byref(dn), x.data_ptr(), x.shape[0], ids.shape[-1],
                                      ids.data_ptr(), weights.data_ptr(), table_row.data_ptr(), table_row.numel(),
                                      out.data_ptr(), threads)
        if rc != 0:
            raise MemoryError("CPU expert kernel: could not allocate its buffers")
        return out


def build(out: Path, flag_sets=FLAG_SETS) -> list[str]:
    """Compile SOURCE into `out` with the first flag set the compiler accepts; returns it.
    Raises OSError with the compiler's words when none works."""
    cc = os.environ.get("CC", "cc")
    if shutil.which(cc) is None:
        raise OSError(f"no C compiler ({cc!r} not found; set CC)")
    errors = []
    for flags in flag_sets:
        with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
            target = Path(tmp) / out.name
            r = subprocess.run([cc, *flags, "-shared", "-fPIC", "-o", str(target), str(SOURCE), "-lm"],
                               capture_output=True, text=True)
            if r.returncode == 0:
                os.replace(target, out)  # atomic: a concurrent build never loads half a file
                return flags
            errors.append(f"{' '.join(flags)}: {(r.stderr.strip().splitlines() or [r.returncode])[-1]}")
    raise OSError("the C compiler refused every flag set: " + "; ".join(errors))


def load(path: Path, flags: list[str]) -> CpuExperts:
    """A built kernel, loaded (OSError when it cannot be)."""
    return CpuExperts(ctypes.CDLL(str(path)), path, flags)


def _cpu_id() -> str:
    """What -march=native depends on: the machine and, on Linux, the CPU's feature flags."""
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = platform.processor()
    return platform.machine() + flags


def _found_or_built(path: Path) -> CpuExperts:
    """The kernel at `path`, built there first if missing (OSError when neither works)."""
    flags_file = path.with_suffix(".flags")
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        flags_file.write_text(" ".join(build(path)))
    return load(path, flags_file.read_text().split() if flags_file.is_file() else [])


@functools.cache
def kernel() -> CpuExperts | None:
    """The built kernel, or None (the reason is logged once): MOEFERRY_CPU_KERNEL=0, or no
    compiler. Built in the user cache directory, or in the temporary directory when that one is
    not writable."""
    if os.environ.get("MOEFERRY_CPU_KERNEL", "1") == "0":
        log.info("CPU experts: PyTorch reference (MOEFERRY_CPU_KERNEL=0)")
        return None
    digest = hashlib.sha256(SOURCE.read_bytes() + repr(FLAG_SETS).encode() + _cpu_id().encode()).hexdigest()[:16]
    name = f"experts-{digest}.so"
    uid = os.getuid() if hasattr(os, "getuid") else 0
    places = (cache_dir() / "cpu_kernels", Path(tempfile.gettempdir()) / f"moeferry-cpu-kernels-{uid}")
    errors = []
    for place in places:
        try:
            found = _found_or_built(place / name)
        except OSError as e:
            errors.append(f"{place}: {e}")
            if "compiler" in str(e):  # no compiler, or it refused every flag set: another place will not help
                break
            continue
        log.info("CPU experts: %s, %s", found.describe(), found.path)
        return found
    log.warning("CPU experts: the C kernel could not be built (%s); the PyTorch reference computes them, "
                "several times slower", "; ".join(errors))
    return None
