"""The tensor index of a GGUF file, read without keeping the file mapped or its metadata parsed.

gguf-py's ``GGUFReader`` parses every metadata field into numpy views of a mapping of the whole
file: a tokenizer of 49k tokens and 49k merges becomes ~200k small arrays. An engine only needs
the tensors, and what the parse leaves behind stays resident in the process (Python's allocator
rarely returns it), as do the mapped pages that were read. Here the header is walked once (the
metadata skipped, keeping only ``general.alignment``) and each tensor's bytes are read from the
file on demand into memory of its own.

The objects look like gguf-py's ``ReaderTensor`` where the loader reads them (``name``,
``tensor_type``, ``shape`` fastest dimension first, ``data``), so one decoder serves both.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from gguf import GGMLQuantizationType

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
# Fixed-size metadata value types (gguf's GGUFValueType): their size in bytes.
_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GgufTensor:
    path: Path
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF order: the fastest dimension first
    offset: int  # from the start of the file
    nbytes: int

    @property
    def data(self) -> np.ndarray:
        """The tensor's bytes, flat (``uint8``), read into an array of their own."""
        out = np.empty(self.nbytes, dtype=np.uint8)
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            if f.readinto(out.data) != self.nbytes:
                raise ValueError(f"{self.path}: tensor {self.name!r} runs past the end of the file")
        return out


class _Cursor:
    def __init__(self, buf: mmap.mmap, path: Path) -> None:
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, fmt: str) -> int:
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise ValueError(f"{self.path}: the GGUF header runs past the end of the file")
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return int(value)

    def string(self) -> str:
        n = self.take("<Q")
        raw = self.buf[self.pos : self.pos + n]
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def skip_value(self, kind: int) -> None:
        if kind in _SCALAR_SIZES:
            self.pos += _SCALAR_SIZES[kind]
        elif kind == _STRING:
            n = self.take("<Q")
            self.pos += n
        elif kind == _ARRAY:
            item, count = self.take("<I"), self.take("<Q")
            if item in _SCALAR_SIZES:
                self.pos += _SCALAR_SIZES[item] * count
            else:
                for _ in range(count):
                    self.skip_value(item)
        else:
            raise ValueError(f"{self.path}: unknown GGUF value type {kind}")


def read_tensor_index(path: Path) -> list[GgufTensor]:
    """Every tensor of the GGUF file at ``path``: name, type, shape and where its bytes lie."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    path = Path(path)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != MAGIC:
            raise ValueError(f"{path} is not a GGUF file (no GGUF magic)")
        cur = _Cursor(buf, path)
        cur.pos = 4
        version = cur.take("<I")
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version} (little-endian 2 or 3 are read)")
        num_tensors, num_fields = cur.take("<Q"), cur.take("<Q")
        alignment = DEFAULT_ALIGNMENT
        for _ in range(num_fields):
            key, kind = cur.string(), cur.take("<I")
            if key == "general.alignment" and kind == 4:
                alignment = cur.take("<I")
            else:
                cur.skip_value(kind)
        infos = []
        for _ in range(num_tensors):
            name = cur.string()
            dims = tuple(cur.take("<Q") for _ in range(cur.take("<I")))
            kind, offset = cur.take("<I"), cur.take("<Q")
            infos.append((name, dims, kind, offset))
        data_start = -(-cur.pos // alignment) * alignment
        size = len(buf)
    tensors = []
    for name, dims, kind, offset in infos:
        try:
            qtype = GGMLQuantizationType(kind)
        except ValueError:
            raise ValueError(f"GGUF tensor {name!r} has an unknown type id {kind}") from None
        block, type_size = GGML_QUANT_SIZES[qtype]
        nbytes = int(np.prod(dims, dtype=np.int64)) // block * type_size
        start = data_start + offset
        if start + nbytes > size:
            raise ValueError(f"{path}: tensor {name!r} runs past the end of the file")
        tensors.append(GgufTensor(path, name, qtype, dims, start, nbytes))
    return tensors
