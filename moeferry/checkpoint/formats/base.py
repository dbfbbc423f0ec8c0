"""What every quantization format entry provides, and the errors the registry raises.

A format entry knows one on-disk layout of a linear weight `[out_features, in_features]`:
which tensors sit next to the module prefix (their *suffixes*), their shapes and dtypes,
how many bytes the device copy takes, a CPU reference dequantization, the real
quantizer's math (for synthetic checkpoints and round-trip tests) and how to turn the
checkpoint tensors into the `PackedWeight` the GPU kernels read.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import ClassVar, Mapping

import torch

Shape = tuple[int, ...]
FP8_MAX = 448.0  # largest finite float8_e4m3fn


class QuantTensorError(ValueError):
    """A quantized module's tensors are missing, mis-shaped or of the wrong dtype."""


class UnsupportedQuantization(ValueError):
    """The checkpoint's quantization method or variant is not one moeferry implements."""


@dataclass(frozen=True)
class QuantParams:
    """Per-layer knobs a format needs beyond the tensor shapes.

    group_size: int4 / nvfp4 group along the input dim (None: one group per row, i.e.
    per-channel). symmetric: int4 without zero points. block_size: fp8 block (rows, cols).
    per_channel: fp8_tensor quantizes per output row instead of per tensor.
    """

    group_size: int | None = None
    symmetric: bool = True
    block_size: tuple[int, int] | None = None
    per_channel: bool = False


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def shape_str(shape: Shape) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


@dataclass(frozen=True, eq=False)
class PackedWeight:
    """Device representation of one quantized linear weight: the tensors a kernel reads.

    Subclasses add tensor fields. `dequantize` is the CPU reference the kernels are
    tested against; `to(device)` moves every tensor field.
    """

    out_features: int
    in_features: int
    row_fields: ClassVar[tuple[str, ...]] = ()  # the tensor fields indexed by output row

    @classmethod
    def stack_rows(cls, parts: list["PackedWeight"]) -> "PackedWeight | None":
        """One weight holding `parts`' output rows in order (projections of one input computed
        as one GEMM), or None where they cannot share one: another class or input size, other
        form parameters (group size, block size, zero points or none)."""
        first = parts[0]
        if not cls.row_fields or any(type(p) is not cls for p in parts) or not cls.can_stack(parts):
            return None
        rest = [f.name for f in dataclasses.fields(cls) if f.name not in cls.row_fields and f.name != "out_features"]
        if any(_differ(getattr(p, n), getattr(first, n)) for p in parts for n in rest):
            return None
        rows = {}
        for name in cls.row_fields:
            got = [p.rows_of(name) for p in parts]
            if any(g is None for g in got):
                if not all(g is None for g in got):
                    return None
                rows[name] = None
            else:
                rows[name] = torch.cat(got)
        return dataclasses.replace(first, out_features=sum(p.out_features for p in parts), **rows)

    @classmethod
    def can_stack(cls, parts: list["PackedWeight"]) -> bool:
        return True

    def rows_of(self, name: str) -> torch.Tensor | None:
        """Row field `name` with one entry per output row (a form may broadcast a scalar)."""
        return getattr(self, name)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if isinstance(getattr(self, f.name), torch.Tensor)}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def to(self, device: torch.device | str) -> "PackedWeight":
        return dataclasses.replace(self, **{k: v.to(device) for k, v in self.tensors().items()})

    def dequantize(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        raise NotImplementedError


class QuantFormat:
    """One registry entry. Subclasses fill in the class attributes and the methods.

    `tensor_suffixes` lists every tensor the format may read for a module prefix
    (`f"{prefix}.{suffix}"`); `optional_suffixes` the subset that may be absent.
    `suffix_aliases` maps other names found in the wild to the canonical suffix.
    `device_form` names the layout its weights take in an expert slot and the kernels that read
    it (`moeferry.ops.triton.moe_formats`): `moe_kernel()` returns that kernel, looked up on use
    (nothing is registered at import).
    """

    name: ClassVar[str]
    device_form: ClassVar[str]  # kernel layout of `packed(...)`: dense, fp8_row, fp8_block, fp4, int4
    tensor_suffixes: ClassVar[tuple[str, ...]]
    optional_suffixes: ClassVar[tuple[str, ...]] = ()
    suffix_aliases: ClassVar[Mapping[str, str]] = {}
    default_params: ClassVar[QuantParams] = QuantParams()
    repacks: ClassVar[bool] = False  # `packed(...)` computes a new layout (tensor work: readers in parallel help)

    def moe_kernel(self):
        """The fused-MoE kernel (and slot layout) of this format's device form."""
        from moeferry.ops.triton.moe_formats import KERNELS

        return KERNELS[self.device_form]

    def __repr__(self) -> str:
        return f"<QuantFormat {self.name}>"

    # -- shapes -------------------------------------------------------------------------
    def shape_options(self, out_features: int, in_features: int,
                      params: QuantParams | None = None) -> dict[str, list[Shape]]:
        """Every accepted shape per suffix (first = canonical), optional suffixes included."""
        raise NotImplementedError

    def required_suffixes(self, params: QuantParams | None = None) -> tuple[str, ...]:
        return tuple(s for s in self.tensor_suffixes if s not in self.optional_suffixes)

    def expected_shapes(self, out_features: int, in_features: int,
                        params: QuantParams | None = None) -> dict[str, Shape]:
        """Canonical shape of every tensor that must be present."""
        opts = self.shape_options(out_features, in_features, params)
        return {s: opts[s][0] for s in self.required_suffixes(params)}

    def dtype_ok(self, suffix: str, dtype: torch.dtype) -> bool:
        return True

    def expected_dtype(self, suffix: str) -> str:
        return "any"

    # -- sizes, math, device form -------------------------------------------------------
    def bytes_for(self, out_features: int, in_features: int,
                  params: QuantParams | None = None) -> int:
        """Bytes of the device representation (`packed(...)`) of one weight."""
        raise NotImplementedError

    def dequantize(self, tensors: Mapping[str, torch.Tensor], out_features: int,
                   in_features: int, dtype: torch.dtype = torch.bfloat16,
                   params: QuantParams | None = None) -> torch.Tensor:
        raise NotImplementedError

    def quantize(self, weight: torch.Tensor,
                 params: QuantParams | None = None) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def packed(self, tensors: Mapping[str, torch.Tensor],
               params: QuantParams | None = None) -> PackedWeight:
        raise NotImplementedError

    # -- helpers ------------------------------------------------------------------------
    def canonical(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Rename aliased suffixes (e.g. HF's per-tensor `weight_scale_inv`) to canonical ones."""
        out = dict(tensors)
        for alias, canon in self.suffix_aliases.items():
            if alias in out and canon not in out:
                out[canon] = out.pop(alias)
        return out

    def params(self, params: QuantParams | None) -> QuantParams:
        return params if params is not None else self.default_params


def check_tensors(module: str, fmt: "QuantFormat | str", tensors: Mapping[str, torch.Tensor],
                  out_features: int, in_features: int,
                  params: QuantParams | None = None) -> None:
    """Raise a one-line QuantTensorError naming module, format and the offending tensor.

    `tensors` is keyed by suffix (`weight`, `weight_scale`, ...). Shapes are compared with
    every accepted layout; scalars accept `[]` and `[1]` alike.
    """
    if isinstance(fmt, str):
        from . import get_format
        fmt = get_format(fmt)
    tensors = fmt.canonical(tensors)
    options = fmt.shape_options(out_features, in_features, params)
    for suffix in fmt.required_suffixes(params):
        if suffix not in tensors:
            want = " or ".join(shape_str(s) for s in options[suffix])
            raise QuantTensorError(
                f"{module}: format {fmt.name} needs tensor {module}.{suffix} "
                f"(shape {want}) but the checkpoint has none")
    for suffix, t in tensors.items():
        if suffix not in options:
            continue
        shape = tuple(t.shape)
        if not any(_same_shape(shape, s) for s in options[suffix]):
            want = " or ".join(shape_str(s) for s in options[suffix])
            raise QuantTensorError(
                f"{module}: format {fmt.name} tensor {module}.{suffix} has shape "
                f"{shape_str(shape)}, expected {want} for a [{out_features}, {in_features}] weight")
        if not fmt.dtype_ok(suffix, t.dtype):
            raise QuantTensorError(
                f"{module}: format {fmt.name} tensor {module}.{suffix} has dtype "
                f"{t.dtype}, expected {fmt.expected_dtype(suffix)}")


def _same_shape(shape: Shape, want: Shape) -> bool:
    if math.prod(want) == 1 and len(want) <= 1:  # a scalar: [] and [1] are the same thing
        return len(shape) <= 1 and math.prod(shape) == 1
    return shape == want


def _differ(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
                    and torch.equal(a, b))
    return a != b


def as_scalar(t: torch.Tensor) -> torch.Tensor:
    """A 0-d float32 view of a scalar stored as [] or [1]."""
    return t.reshape(()).float()
