"""Quantization format registry: one entry per on-disk weight format.

    FORMATS["nvfp4"].expected_shapes(out, in)      -> {"weight": (out, in/2), ...}
    FORMATS["nvfp4"].dequantize(tensors, out, in)  -> bf16 [out, in] (CPU reference)
    FORMATS["nvfp4"].packed(tensors)               -> Fp4Weight (what the kernels read)
    detect_scheme(config, hf_quant_config).format_for("model.layers.0.mlp.experts.3.up_proj")

Tensor suffixes per format (module prefix + "." + suffix; `?` = optional):
    bf16        weight
    fp8_tensor  weight, weight_scale, input_scale?       (alias weight_scale_inv)
    fp8_block   weight, weight_scale_inv
    nvfp4       weight, weight_scale, weight_scale_2, input_scale?
    nvfp4_ct    weight_packed, weight_scale, weight_global_scale, input_global_scale?
    int4_awq    qweight, qzeros, scales
    int4_ct     weight_packed, weight_scale, weight_shape, weight_zero_point (asymmetric only)
Each format module's docstring gives the exact layouts.
"""
from __future__ import annotations

from .base import (PackedWeight, QuantFormat, QuantParams, QuantTensorError,
                   UnsupportedQuantization, check_tensors)
from .dense import Bf16Format, DenseWeight
from .detect import (BF16, SUPPORTED_METHODS, LayerQuant, QuantScheme, Rule, canonical_module, detect_scheme,
                     name_aliases, never_quantized)
from .fp4 import Fp4Weight, Nvfp4CtFormat, Nvfp4Format
from .fp8 import Fp8BlockFormat, Fp8BlockWeight, Fp8TensorFormat, Fp8Weight
from .int4 import AWQ_ORDER, AWQ_REVERSE_ORDER, Int4AwqFormat, Int4CtFormat, Int4Weight

FORMATS: dict[str, QuantFormat] = {f.name: f for f in (
    Bf16Format(), Fp8TensorFormat(), Fp8BlockFormat(), Nvfp4Format(), Nvfp4CtFormat(),
    Int4AwqFormat(), Int4CtFormat())}


def get_format(name: str) -> QuantFormat:
    try:
        return FORMATS[name]
    except KeyError:
        raise KeyError(f"unknown quantization format {name!r}; known: {', '.join(FORMATS)}") from None


from .presets import PRESETS, quantize_module, synthetic_quant_config  # noqa: E402

__all__ = [
    "AWQ_ORDER", "AWQ_REVERSE_ORDER", "BF16", "FORMATS", "PRESETS", "SUPPORTED_METHODS",
    "DenseWeight", "Fp4Weight", "Fp8BlockWeight", "Fp8Weight", "Int4Weight", "LayerQuant",
    "PackedWeight", "QuantFormat", "QuantParams", "QuantScheme", "QuantTensorError", "Rule",
    "UnsupportedQuantization", "canonical_module", "check_tensors", "detect_scheme", "get_format", "name_aliases",
    "never_quantized", "quantize_module", "synthetic_quant_config",
]
