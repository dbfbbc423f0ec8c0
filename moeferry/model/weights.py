"""Read one module's weights from the checkpoint in the format its quantization says."""
from __future__ import annotations

import torch

from moeferry.checkpoint.formats import (BF16, FORMATS, DenseWeight, PackedWeight, QuantTensorError,
                                         UnsupportedQuantization, check_tensors, detect_scheme)
from moeferry.checkpoint.formats.detect import LayerQuant
from moeferry.checkpoint.reader import CheckpointError, CheckpointReader
from moeferry.model.linear import Linear, QuantLinear


class WeightLoader:
    """Checks shapes, picks each module's format and moves tensors to the target device."""

    def __init__(self, reader: CheckpointReader, dtype: torch.dtype, device):
        self.reader, self.dtype, self.device = reader, dtype, device
        try:
            self.scheme = detect_scheme(reader.config, reader.hf_quant_config or None)
        except UnsupportedQuantization as e:
            raise CheckpointError(f"{reader.dir}: {e}") from None
        self._quant: dict[str, LayerQuant] = {}  # module -> its rule's resolution (768 lookups a layer)

    def layer_quant(self, module: str) -> LayerQuant:
        q = self._quant.get(module)
        if q is None:
            q = self._quant[module] = self.scheme.layer_for(module)
        return q

    def tensor(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        return self.reader.get(name, shape).to(device=self.device, dtype=self.dtype)

    def linear(self, module: str, out: int, inp: int) -> Linear | QuantLinear:
        if not self.is_quantized(module):
            return Linear(self.tensor(f"{module}.weight", (out, inp)))
        return QuantLinear(self.packed(module, out, inp).to(self.device), self.format_for(module))

    def packed(self, module: str, out: int, inp: int, mapped: bool = False) -> PackedWeight:
        """A module's weight in its format's packed form, on the host (unquantized: a
        `DenseWeight` in the model dtype). `mapped`: the tensors are views of the memory-mapped
        checkpoint where the format keeps them as stored (for weights copied on at once)."""
        fmt_name = self.format_for(module)
        read = self.reader.view if mapped else self.reader.get
        if fmt_name == BF16.format:
            return DenseWeight(out, inp, read(f"{module}.weight", (out, inp)).to(self.dtype))
        fmt, params = FORMATS[fmt_name], self.layer_quant(module).params
        suffixes = fmt.tensor_suffixes + tuple(fmt.suffix_aliases)
        tensors = {s: read(f"{module}.{s}") for s in suffixes if self.reader.has(f"{module}.{s}")}
        try:
            check_tensors(module, fmt, tensors, out, inp, params)
            return fmt.packed(fmt.canonical(tensors), params)
        except (QuantTensorError, ValueError) as e:  # one line naming the module and the format
            msg = str(e) if module in str(e) else f"{module}: format {fmt_name}: {e}"
            raise CheckpointError(f"{msg} (checkpoint {self.reader.dir})") from None

    def format_for(self, module: str) -> str:
        return self.layer_quant(module).format

    def is_quantized(self, module: str) -> bool:
        return self.format_for(module) != BF16.format
