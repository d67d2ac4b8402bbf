"""Convert weights to the compile target's dtypes (GGML Q4_0 / Q4_1 / Q8_0, f16, f32), lazily."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from .. import quant
from ..ir import QK, Graph, IRError, LazyTensor, storage_shape

WEIGHT_DTYPES = ("q4_0", "q4_1", "q8_0", "f16", "f32")
NATIVE = "native"         # each weight keeps the format it is stored in, where llmrs has kernels for it
NATIVE_FALLBACK = "q8_0"  # ... and one stored in another format (a GGUF's K-quants) becomes this
_CHUNK_VALUES = 1 << 22  # rows are converted in pieces of ~4M values: ~16 MB of f32 at a time
_FLAG = {"weights": "--weights", "embedding": "--embedding", "lm_head": "--lm-head"}


@dataclass(frozen=True)
class Conversion:
    """A weight stored in a format llmrs has no kernels for, converted when the plan was written."""
    tensor: str             # the graph's weight name
    source: str             # its stored format (GGML type name, e.g. Q6_K)
    dtype: str              # what it became
    max_rel_err: float      # max |converted - stored| / max |stored|, over the decoded values


def decode_rows(raw: np.ndarray, dtype: str) -> np.ndarray:
    """Stored rows of any weight dtype -> float32 rows."""
    if dtype == "bf16":  # raw bf16 bits are the high half of an f32
        return (raw.astype(np.uint32) << 16).view(np.float32)
    if dtype in quant.BLOCK_BYTES:
        return quant.dequantize(raw, dtype)
    return raw.astype(np.float32)


def encode_rows(x: np.ndarray, dtype: str) -> np.ndarray:
    if dtype in quant.BLOCK_BYTES:
        return quant.quantize(x, dtype)
    return x.astype({"f32": np.float32, "f16": np.float16}[dtype])


def converted(src: LazyTensor, dtype: str, on_error: Callable[[float], None] | None = None) -> LazyTensor:
    """src as dtype, made on load from src's bytes row block by row block (never the whole
    model in f32 at once); src itself when it already has that dtype and nobody measures.
    on_error gets max |converted - src| / max |src| once the data is made."""
    if src.dtype == dtype and on_error is None:
        return src
    shape = src.shape

    def make() -> np.ndarray:
        raw = src.load()
        out_shape, out_dtype = storage_shape(shape, dtype)
        out = np.empty(out_shape, out_dtype)
        rows_in, rows_out = raw.reshape(-1, raw.shape[-1]), out.reshape(-1, out.shape[-1])
        step = max(1, _CHUNK_VALUES // shape[-1])
        err = amax = 0.0
        for s in range(0, rows_in.shape[0], step):
            x = decode_rows(rows_in[s:s + step], src.dtype)
            rows_out[s:s + step] = encode_rows(x, dtype)
            if on_error is not None:
                err = max(err, float(np.max(np.abs(decode_rows(rows_out[s:s + step], dtype) - x))))
                amax = max(amax, float(np.max(np.abs(x))))
        if on_error is not None:
            on_error(err / amax if amax else 0.0)
        return out

    return LazyTensor(shape, dtype, make)


def _uses(g: Graph, weights: str, embedding: str, lm_head: str) -> list[tuple[int, int, str, str]]:
    """(op index, input index, wanted dtype, role) for every weight operand of the graph."""
    heads = {i for i, op in enumerate(g.ops) if set(op.outputs) & set(g.outputs)}
    uses = []
    for i, op in enumerate(g.ops):
        if op.kind == "embedding":
            uses.append((i, 0, embedding, "embedding"))
        elif op.kind in ("matmul", "fused_matmul"):
            uses.append((i, 1, lm_head, "lm_head") if i in heads else (i, 1, weights, "weights"))
    return [u for u in uses if g.values[g.ops[u[0]].inputs[u[1]]].kind in ("param", "const")]


def quantize(g: Graph, weights: str = "q4_0", embedding: str | None = None, lm_head: str | None = None,
             on_convert: Callable[[Conversion], None] | None = None) -> Graph:
    """Matmul weights become `weights`, the embedding table `embedding`, the output head
    `lm_head` (both default to `weights`), 1-D params f32. `native` keeps each weight's stored
    dtype and makes one stored in a format llmrs has no kernels for NATIVE_FALLBACK; every
    conversion of such a weight is measured and reported to on_convert when its data is made.
    A tensor wanted in two dtypes (a tied embedding and head) keeps the first and gives the other
    uses their own const copy."""
    embedding, lm_head = embedding or weights, lm_head or weights
    for flag, dt in (("weights", weights), ("embedding", embedding), ("lm_head", lm_head)):
        if dt not in WEIGHT_DTYPES + (NATIVE,):
            raise IRError(f"{_FLAG[flag]} {dt!r}: choose one of {', '.join(WEIGHT_DTYPES + (NATIVE,))}")
    g = g.copy()
    sources = dict(g.weights)  # the unconverted data every copy is made from

    def convert(name: str, dtype: str) -> LazyTensor:
        src = sources[name]
        if src.source_format is None or on_convert is None:
            return converted(src, dtype)
        return converted(src, dtype, lambda err: on_convert(Conversion(name, src.source_format, dtype, err)))

    kept: dict[str, str] = {}  # weight name -> the dtype it keeps under its own name
    copies: dict[tuple[str, str], str] = {}
    for op_i, in_i, wanted, role in _uses(g, weights, embedding, lm_head):
        op = g.ops[op_i]
        name = op.inputs[in_i]
        v = g.values[name]
        src = sources[name]
        dtype = wanted if wanted != NATIVE else NATIVE_FALLBACK if src.source_format else src.dtype
        if dtype in quant.BLOCK_BYTES and v.shape[-1] % QK:
            raise IRError(f"weight {name!r} {list(v.shape)} (op {op.name}): rows of {v.shape[-1]} values "
                          f"cannot be {dtype} ({QK}-value blocks); choose f16 or f32 with {_FLAG[role]}")
        if kept.setdefault(name, dtype) == dtype:
            continue
        if (name, dtype) not in copies:
            copy = "lm_head.weight" if role == "lm_head" and "lm_head.weight" not in g.values \
                else f"{name}.{dtype}"
            g.add_value(copy, v.shape, dtype, kind="const")
            g.weights[copy] = convert(name, dtype)
            copies[(name, dtype)] = copy
        op.inputs[in_i] = copies[(name, dtype)]
    for name, dtype in kept.items():
        g.values[name].dtype = dtype
        g.weights[name] = convert(name, dtype)
    for v in g.values.values():
        if v.kind == "param" and len(v.shape) == 1 and v.name not in kept:
            v.dtype = "f32"
            g.weights[v.name] = converted(sources[v.name], "f32")
    return g
