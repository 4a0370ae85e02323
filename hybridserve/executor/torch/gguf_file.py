"""A small GGUF reader: metadata and tensor views from a memory map.

`gguf.GGUFReader` builds an object per array element, which takes most of a minute for a
262k-token vocabulary; this reads the same layout (GGUF v2/v3, little endian) directly and leaves
dequantisation to `gguf.dequantize`.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hybridserve.core.errors import ConfigError

_SCALARS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_STRING, _ARRAY = 8, 9
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?",
          10: "<u8", 11: "<i8", 12: "<f8"}  # fmt: skip


@dataclass(frozen=True, slots=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # numpy order (rows first)
    ggml_type: int
    data: np.ndarray  # raw bytes (quantised) or values, a view of the memory map


class GGUFFile:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._buf = np.memmap(path, dtype=np.uint8, mode="r")
        self._pos = 0
        if bytes(self._buf[:4]) != b"GGUF":
            raise ConfigError("model", str(path), "the file is not GGUF (bad magic)")
        self._pos = 4
        version = self._scalar("<I")
        if version not in (2, 3):
            raise ConfigError("model", str(path), f"GGUF version {version}; use version 2 or 3")
        num_tensors, num_fields = self._scalar("<Q"), self._scalar("<Q")
        self.fields: dict[str, Any] = {}
        for _ in range(num_fields):
            key = self._string()
            self.fields[key] = self._value(self._scalar("<I"))
        infos = []
        for _ in range(num_tensors):
            name = self._string()
            dims = [self._scalar("<Q") for _ in range(self._scalar("<I"))]
            infos.append((name, tuple(reversed(dims)), self._scalar("<I"), self._scalar("<Q")))
        alignment = int(self.fields.get("general.alignment", 32))
        start = -(-self._pos // alignment) * alignment
        self.tensors = [self._tensor(start, *info) for info in infos]

    def _scalar(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        (value,) = struct.unpack_from(fmt, self._buf.data, self._pos)
        self._pos += size
        return value

    def _string(self) -> str:
        length = self._scalar("<Q")
        text = bytes(self._buf[self._pos : self._pos + length]).decode("utf-8", errors="replace")
        self._pos += length
        return text

    def _value(self, kind: int) -> Any:
        if kind == _STRING:
            return self._string()
        if kind == _ARRAY:
            item_kind, count = self._scalar("<I"), self._scalar("<Q")
            if item_kind in _NUMPY:
                dtype = np.dtype(_NUMPY[item_kind])
                end = self._pos + count * dtype.itemsize
                values = np.frombuffer(self._buf[self._pos : end].tobytes(), dtype=dtype)
                self._pos = end
                return values.tolist()
            return [self._value(item_kind) for _ in range(count)]
        return self._scalar(_SCALARS[kind])

    def _tensor(
        self, start: int, name: str, shape: tuple[int, ...], ggml_type: int, offset: int
    ) -> GGUFTensor:
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
        row_bytes = shape[-1] // block * type_size
        rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
        data = self._buf[start + offset : start + offset + rows * row_bytes]
        return GGUFTensor(name, shape, ggml_type, data.reshape(rows, row_bytes))

    def dequantized(self, tensor: GGUFTensor) -> np.ndarray:
        """Float32 values of `tensor` in its numpy shape."""
        from gguf import dequantize
        from gguf.constants import GGMLQuantizationType

        kind = GGMLQuantizationType(tensor.ggml_type)
        if kind is GGMLQuantizationType.F32:
            values = np.asarray(tensor.data).view(np.float32)
        elif kind is GGMLQuantizationType.F16:
            values = np.asarray(tensor.data).view(np.float16)
        else:
            values = dequantize(np.asarray(tensor.data), kind)
        return values.astype(np.float32).reshape(tensor.shape)
