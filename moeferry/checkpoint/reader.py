"""Read a Hugging Face model directory lazily (memory-mapped safetensors).

Tensor names are canonicalised: the multimodal prefix `model.language_model.` becomes
`model.`, and `model.visual.*` / `mtp.*` tensors are skipped (a text server never reads them).
"""
from __future__ import annotations

import json
import mmap
import os
import struct
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors import safe_open

SKIPPED_PREFIXES = ("model.visual.", "visual.", "mtp.", "model.mtp.")
MULTIMODAL_PREFIX = "model.language_model."


class CheckpointError(ValueError):
    """A checkpoint is missing, malformed or does not match the model's expectations."""


def canonical_name(name: str) -> str | None:
    """The name a text model reads, or None for tensors a text server skips."""
    if name.startswith(SKIPPED_PREFIXES):
        return None
    if name.startswith(MULTIMODAL_PREFIX):
        return "model." + name[len(MULTIMODAL_PREFIX):]
    return name


def _read_header(path: Path) -> tuple[dict, int]:
    """Parse and validate a safetensors header; catch truncated files before any read.
    Returns the header and the file offset where the data starts."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise CheckpointError(f"{path}: truncated safetensors file (no header)")
        (header_len,) = struct.unpack("<Q", raw)
        if 8 + header_len > size:
            raise CheckpointError(f"{path}: truncated safetensors file (header says {header_len} bytes, file has {size})")
        try:
            header = json.loads(f.read(header_len))
        except ValueError as e:
            raise CheckpointError(f"{path}: corrupt safetensors header ({e})") from None
    data_end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + header_len + data_end > size:
        raise CheckpointError(
            f"{path}: truncated safetensors file ({size} bytes, tensors need {8 + header_len + data_end})"
        )
    return header, 8 + header_len


# safetensors dtype names -> torch dtypes (the ones a checkpoint of ours may hold)
DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


class TensorInfo(NamedTuple):  # (a tuple: a full-depth checkpoint indexes ~93k of them at every boot)
    file: Path
    raw_name: str
    shape: tuple[int, ...]
    dtype: str
    start: int = 0  # byte range of the data in the file
    end: int = 0


class CheckpointReader:
    """Config + lazily read tensors of one HF model directory."""

    def __init__(self, model_dir: str | os.PathLike):
        self.dir = Path(model_dir)
        if not (self.dir / "config.json").is_file():
            raise CheckpointError(f"{self.dir}: no config.json (not a Hugging Face model directory)")
        self.config = json.loads((self.dir / "config.json").read_text())
        self.generation_config = self._optional_json("generation_config.json")
        self.hf_quant_config = self._optional_json("hf_quant_config.json")
        self.tensors = self._index()
        self._handles: dict[Path, object] = {}
        self._maps: dict[Path, torch.Tensor] = {}

    def _optional_json(self, name: str) -> dict:
        path = self.dir / name
        return json.loads(path.read_text()) if path.is_file() else {}

    @property
    def text_config(self) -> dict:
        """The language-model part of the config (`text_config` of multimodal checkpoints)."""
        text = self.config.get("text_config")
        return {**text} if isinstance(text, dict) else self.config

    def _files(self) -> list[Path]:
        index = self.dir / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text()).get("weight_map", {})
            return sorted({self.dir / f for f in weight_map.values()})
        single = self.dir / "model.safetensors"
        if single.is_file():
            return [single]
        files = sorted(self.dir.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{self.dir}: no safetensors weights found")
        return files

    def _index(self) -> dict[str, TensorInfo]:
        found: dict[str, TensorInfo] = {}
        for path in self._files():
            if not path.is_file():
                raise CheckpointError(f"{path}: listed in model.safetensors.index.json but missing")
            header, base = _read_header(path)
            for raw, meta in header.items():
                name = canonical_name(raw) if raw != "__metadata__" else None
                if name is not None:
                    a, b = meta["data_offsets"]
                    found[name] = TensorInfo(path, raw, tuple(meta["shape"]), meta["dtype"], base + a, base + b)
        return found

    def has(self, name: str) -> bool:
        return name in self.tensors

    def info(self, name: str) -> TensorInfo:
        if name not in self.tensors:
            raise CheckpointError(f"missing tensor '{name}' in {self.dir}")
        return self.tensors[name]

    def _checked(self, name: str, shape: tuple[int, ...] | None) -> TensorInfo:
        if name not in self.tensors:
            want = f" (expected shape {list(shape)})" if shape is not None else ""
            raise CheckpointError(f"missing tensor '{name}'{want} in {self.dir}")
        info = self.tensors[name]
        if shape is not None and tuple(info.shape) != tuple(shape):
            raise CheckpointError(
                f"tensor '{name}' in {info.file.name} has shape {list(info.shape)}, expected {list(shape)}"
            )
        return info

    def view(self, name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """One tensor as a zero-copy view of the memory-mapped file (a private mapping: writes to
        it never reach the file); a copy only where the data is not aligned for its dtype. For
        data that is copied on at once (expert banks, device slots): no read buffer in between."""
        info = self._checked(name, shape)
        dtype = DTYPES.get(info.dtype)
        if dtype is None:
            return self.get(name, shape)
        data = self.mapped_file(info.file)[info.start:info.end]
        if info.start % dtype.itemsize:
            data = data.clone()
        return data.view(dtype).view(info.shape)

    def mapped_file(self, path: Path, create: bool = True) -> torch.Tensor | None:
        """One weight file as a uint8 tensor over its private memory mapping (made on first use;
        `create=False`: None until then). `view`'s tensors are slices of it."""
        data = self._maps.get(path)
        if data is None and create:
            with open(path, "rb") as f:
                mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
            data = self._maps[path] = torch.frombuffer(mapped, dtype=torch.uint8)
        return data

    def get(self, name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """Read one tensor; `shape`, when given, is checked and named in the error."""
        info = self._checked(name, shape)
        handle = self._handles.get(info.file)
        if handle is None:
            handle = self._handles[info.file] = safe_open(str(info.file), framework="pt")
        return handle.get_tensor(info.raw_name)

    def names_with_prefix(self, prefix: str) -> list[str]:
        return [n for n in self.tensors if n.startswith(prefix)]
