"""Memory-mapped safetensors reading and writing, bf16 included (numpy has no bf16: raw uint16).

Format: u64 little-endian header length, a JSON header {name: {dtype, shape, data_offsets}},
then the data; offsets are relative to the end of the header.
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .config import ModelError
from .finite import all_finite

_DTYPES = {"F32": ("f32", np.float32), "F16": ("f16", np.float16), "BF16": ("bf16", np.uint16)}
_NAMES = {"f32": "F32", "f16": "F16", "bf16": "BF16"}


@dataclass(frozen=True)
class TensorRef:
    """Where one tensor's bytes lie; `load()` maps them without reading the file."""
    path: Path
    name: str
    dtype: str                  # f32 | f16 | bf16
    shape: tuple[int, ...]
    offset: int                 # absolute byte offset in the file

    def load(self) -> np.ndarray:
        """The mapped tensor; a ModelError if a value is NaN or infinite (every logit would be)."""
        np_dtype = _DTYPES[_NAMES[self.dtype]][1]
        out = np.memmap(self.path, dtype=np_dtype, mode="r", offset=self.offset, shape=self.shape)
        if not all_finite(out, self.dtype):
            raise ModelError(f"{self.path}: tensor {self.name!r} holds values that are not finite numbers "
                             "(NaN or infinity): the file is damaged; download or copy it again")
        return out


def read_header(path: Path) -> dict[str, TensorRef]:
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ModelError(f"{path}: truncated safetensors file ({size} bytes)")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8 or n > 100 << 20:
            raise ModelError(f"{path}: not a safetensors file (header length {n} for a {size}-byte file)")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
            raise ModelError(f"{path}: not a safetensors file (header is not JSON)") from None
    if not isinstance(header, dict):
        raise ModelError(f"{path}: not a safetensors file (header is not a JSON object)")
    refs = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        info = info if isinstance(info, dict) else {}
        if info.get("dtype") not in _DTYPES:
            raise ModelError(f"{path}: tensor {name!r} has dtype {info.get('dtype')}; llmrs reads BF16, F16 and F32")
        dtype, np_dtype = _DTYPES[info["dtype"]]
        shape, offsets = info.get("shape"), info.get("data_offsets")
        if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)
                and isinstance(offsets, list) and len(offsets) == 2 and all(type(x) is int for x in offsets)):
            raise ModelError(f"{path}: tensor {name!r} has a malformed shape or data_offsets in the header")
        shape = tuple(shape)
        start, end = offsets
        want = int(np.prod(shape, dtype=np.int64)) * np.dtype(np_dtype).itemsize
        if end - start != want or start < 0 or 8 + n + end > size:
            raise ModelError(f"{path}: tensor {name!r} lies outside the file or has the wrong size (truncated?)")
        refs[name] = TensorRef(path, name, dtype, shape, 8 + n + start)
    return refs


def open_folder(model_dir: Path) -> dict[str, TensorRef]:
    """All tensors of a model folder: one file, or shards listed in model.safetensors.index.json."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_bytes())["weight_map"]
            if not (isinstance(weight_map, dict) and all(isinstance(f, str) for f in weight_map.values())):
                raise TypeError
        except (ValueError, KeyError, TypeError, RecursionError):
            raise ModelError(f"{index}: not a safetensors index (no weight_map of tensor names to files)") from None
        files = sorted(set(weight_map.values()))
        for f in files:
            if not (model_dir / f).is_file():
                raise ModelError(f"{index}: shard {f} is missing")
    else:
        files = sorted(p.name for p in model_dir.glob("*.safetensors"))
        if not files:
            raise ModelError(f"{model_dir}: no *.safetensors weights")
    refs: dict[str, TensorRef] = {}
    for f in files:
        for name, ref in read_header(model_dir / f).items():
            if name in refs:
                raise ModelError(f"{model_dir / f}: tensor {name!r} also appears in {refs[name].path.name}")
            refs[name] = ref
    return refs


def write(path: Path, tensors: dict[str, tuple[np.ndarray, str]], metadata: dict[str, str] | None = None) -> None:
    """tensors: name -> (array, dtype) with bf16 given as uint16 bits. Streams arrays to disk."""
    header: dict = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    for name, (arr, dtype) in tensors.items():
        header[name] = {"dtype": _NAMES[dtype], "shape": list(arr.shape),
                        "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # keeps the data 8-byte aligned, as the reference writer does
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for arr, _ in tensors.values():
            np.ascontiguousarray(arr).tofile(f)


def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even float32 -> bf16 bits (uint16), as torch's .to(bfloat16)."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))
    return (rounded >> 16).astype(np.uint16)
