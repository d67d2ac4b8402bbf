"""GGUF files (llama.cpp's format), read with the `gguf` package: a model's hyper-parameters (the
`<arch>.*` keys of its family: llama, qwen3, qwen2) and its tensors, which stay in the
memory-mapped file until a pass loads them.

Tensors in a format llmrs has (F32 F16 BF16 Q4_0 Q4_1 Q8_0) keep their bytes. Others (K-quants,
Q5_0, IQ*) are decoded to f32 by `gguf.quants` on load and carry their GGML type in
`source_format`, so the quantize pass converts them once and says so.

For a Llama, llama.cpp's converter reorders the rows of Q and K for its RoPE, which rotates
adjacent pairs (2i, 2i+1) where Hugging Face's rotate_half (what the graph computes) pairs
(i, i + hd/2): each head's rows, seen as [2, hd/2], were transposed to [hd/2, 2]. load()
transposes them back. A row is whole quantization blocks, so its bytes are unchanged; only the
order of rows is. Qwen's rows are stored as Hugging Face has them (llama.cpp runs its NEOX RoPE,
which is rotate_half), and so are its per-head norms and biases.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

import gguf
from gguf import GGMLQuantizationType as GT

from ..compiler.rope import rope_inv_freq
from .config import ModelConfig, ModelError, check_float, check_ranges, expected_tensors
from .families import ALL_LAYER_TENSORS, FAMILIES, GLOBAL_TENSORS, Family, gguf_names
from .finite import all_finite

NATIVE = {GT.F32: "f32", GT.F16: "f16", GT.BF16: "bf16", GT.Q4_0: "q4_0", GT.Q4_1: "q4_1", GT.Q8_0: "q8_0"}

_GLOBAL = {g: h for h, g in GLOBAL_TENSORS}
_LAYER = {g: h for h, g in ALL_LAYER_TENSORS}        # GGUF suffix -> Hugging Face suffix
_LAYER_HF = {h: g for h, g in ALL_LAYER_TENSORS}
ROPE_FREQS = "rope_freqs.weight"  # Llama 3's RoPE frequency divisors, written by convert_hf_to_gguf
_MISSING = object()


def hf_name(name: str) -> str | None:
    """The graph's (Hugging Face) name of a GGUF tensor, or None for one no family has."""
    if name in _GLOBAL:
        return _GLOBAL[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER:
        return f"model.layers.{parts[1]}.{_LAYER[parts[2]]}"
    return None


def gguf_name(name: str) -> str:
    """The GGUF name of a graph weight (for messages); other names come back as they are."""
    for g, h in _GLOBAL.items():
        if h == name:
            return g
    parts = name.split(".", 3)
    if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[3] in _LAYER_HF:
        return f"blk.{parts[2]}.{_LAYER_HF[parts[3]]}"
    return name


def unpermute_rows(rows: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row order: rows[n_heads * hd, ...] from [h, hd/2, 2] back to [h, 2, hd/2]."""
    n = rows.shape[0]
    return rows.reshape(n_heads, n // n_heads // 2, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


@dataclass(frozen=True, eq=False)
class GGUFTensor:
    """One GGUF tensor as the graph sees it; `load()` gives its bytes in the dtype's storage layout."""
    name: str                   # its GGUF name, e.g. blk.0.attn_q.weight
    ggml_type: str              # GGML type name: Q4_1, Q6_K, F32, ...
    dtype: str                  # llmrs dtype load() gives: the tensor's own, or f32 for a decoded type
    shape: tuple[int, ...]      # [out, in] as Hugging Face has it (GGUF lists dimensions innermost first)
    data: np.ndarray            # the mapped bytes as gguf's reader exposes them
    n_heads: int = 0            # Q / K: heads whose rows llama.cpp interleaved; 0 for other tensors
    path: str = ""              # the file, for messages

    @property
    def source_format(self) -> str | None:
        """The GGML type when llmrs has no such format (the data is decoded to f32 on load)."""
        return None if GT[self.ggml_type] in NATIVE else self.ggml_type

    def load(self) -> np.ndarray:
        """The tensor's values in its storage layout; a ModelError if one is not a finite number
        (a damaged file, or a type field that no longer says how its bytes are laid out)."""
        raw = unpermute_rows(self.data, self.n_heads) if self.n_heads else self.data
        if self.source_format:
            with np.errstate(all="ignore"):   # damaged scales: all_finite below names the tensor
                out = np.asarray(gguf.quants.dequantize(raw, GT[self.ggml_type]), np.float32).reshape(self.shape)
        elif self.dtype == "bf16":  # the reader exposes BF16 as bytes
            out = raw.view(np.uint16)
        else:
            out = raw
        if not all_finite(out, "f32" if self.source_format else self.dtype):
            raise ModelError(f"{self.path}: tensor {self.name!r} holds values that are not finite numbers (NaN or infinity), "
                             f"read as {self.ggml_type}: the file is damaged; download or convert it again")
        return out


class Metadata:
    """Typed reads of a GGUF's key/value metadata; a missing or mistyped value is a one-line ModelError."""

    def __init__(self, reader: Any, path: Path):
        self.fields, self.path = reader.fields, path

    def has(self, key: str) -> bool:
        return key in self.fields

    def get(self, key: str, kind: type, default: Any = _MISSING, why: str = "") -> Any:
        field = self.fields.get(key)
        if field is None:
            if default is _MISSING:
                raise ModelError(f"{self.path}: metadata {key} is missing{why}")
            return default
        try:
            value = field.contents()
        except (UnicodeDecodeError, ValueError, IndexError) as e:
            raise ModelError(f"{self.path}: metadata {key} cannot be read ({e})") from None
        numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
        ok = {int: numeric and isinstance(value, int), float: numeric, bool: isinstance(value, bool),
              str: isinstance(value, str), list: isinstance(value, list)}[kind]
        if not ok:
            shown = f"a list of {len(value)}" if isinstance(value, list) else repr(value)[:40]
            raise ModelError(f"{self.path}: metadata {key} is {shown}, expected {kind.__name__}")
        if kind is float and field.types == [gguf.GGUFValueType.FLOAT32]:
            # the shortest decimal that is this f32: the value the converter was given (1e-05, not 9.99e-06)
            return float(str(np.float32(value)))
        return float(value) if kind is float else value

    def positive(self, key: str, default: Any = _MISSING, why: str = "") -> int:
        value = self.get(key, int, default, why)
        if value is not None and value < 1:
            raise ModelError(f"{self.path}: metadata {key} is {value}; it must be positive")
        return value


class _StrictReader(gguf.GGUFReader):
    """gguf's reader, except that a read past the end of the file fails. gguf's own returns fewer
    items than asked, and an array of scalars whose count was damaged then loops without moving
    forward: a hang, not an error."""

    def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> Any:
        arr = super()._get(offset, dtype, count, override_order)
        if len(arr) != int(count):
            raise ValueError(f"a read of {int(count)} x {np.dtype(dtype).name} at byte {offset} runs past the end")
        return arr


def open_reader(path: Path) -> Any:
    """gguf.GGUFReader over the file, its failures (bad magic, truncation, garbage) as one line."""
    if not path.is_file():
        raise ModelError(f"{path}: no such GGUF file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ModelError(f"{path}: not a GGUF file (starts with {magic!r}, expected b'GGUF'); "
                         "give a .gguf file or a Hugging Face model folder")
    try:
        with np.errstate(all="ignore"):   # a damaged offset overflows inside gguf: the error below says so
            reader = _StrictReader(path)
    except (ValueError, KeyError, IndexError, OverflowError, TypeError, UnicodeDecodeError, MemoryError) as e:
        detail = " ".join(str(e).split())[:120]
        raise ModelError(f"{path}: truncated or corrupt GGUF file ({type(e).__name__}: {detail}); "
                         "download or convert it again") from None
    check_tensor_table(reader, path)
    return reader


def check_tensor_table(reader: Any, path: Path) -> None:
    """Every tensor at an offset that is a multiple of the file's alignment, inside the file, and
    clear of every other tensor. gguf's reader takes offsets as written, so a table damaged by one
    byte would hand out another tensor's bytes, shifted: weights of garbage, NaN logits."""
    align, base, size = int(reader.alignment), int(reader.data_offset), int(reader.data.size)
    spans = []
    for t in reader.tensors:
        rel = int(t.data_offset) - base
        if rel % align:
            raise ModelError(f"{path}: tensor {t.name!r} starts at data offset {rel}, not a multiple of the "
                             f"file's alignment {align}: its tensor table is damaged; download or convert it again")
        block, type_bytes = gguf.GGML_QUANT_SIZES[t.tensor_type]
        n = math.prod(int(d) for d in t.shape)
        if n % block:
            raise ModelError(f"{path}: tensor {t.name!r} has {n} values, not whole {t.tensor_type.name} blocks "
                             f"of {block}: its tensor table is damaged")
        nbytes = n // block * type_bytes
        if base + rel + nbytes > size:
            raise ModelError(f"{path}: tensor {t.name!r} ({nbytes} bytes at data offset {rel}) runs past the end "
                             "of the file: it is truncated or damaged; download or convert it again")
        spans.append((rel, nbytes, t.name))
    spans.sort()
    for (a_off, a_size, a), (b_off, _, b) in zip(spans, spans[1:]):
        if a_off + a_size > b_off:
            raise ModelError(f"{path}: tensors {a!r} and {b!r} overlap in the file: its tensor table is damaged; "
                             "download or convert it again")


def _rope_scaling(meta: Metadata, arch: str, freqs: np.ndarray | None, head_dim: int,
                  theta: float) -> dict[str, Any] | None:
    """None or llama3 parameters. GGUF keeps Llama 3's scaling as rope_freqs.weight (a divisor per
    frequency); linear / YaRN / LongRoPE, which llmrs does not run, are named in the metadata."""
    p = meta.path
    kind = meta.get(f"{arch}.rope.scaling.type", str, "none")
    factor = meta.get(f"{arch}.rope.scaling.factor", float, 1.0)
    if kind != "none" and not (kind == "linear" and factor == 1.0):
        raise ModelError(f"{p}: {arch}.rope.scaling.type {kind!r} (factor {factor:g}) is not supported "
                         "(llmrs runs Llama 3's frequency scaling, rope_freqs.weight, and plain RoPE)")
    if meta.get(f"{arch}.rope.scale_linear", float, 1.0) != 1.0:
        raise ModelError(f"{p}: {arch}.rope.scale_linear is not supported (llmrs runs plain RoPE and Llama 3's scaling)")
    if freqs is None or np.all(freqs == 1.0):
        return None
    return llama3_scaling_from_factors(freqs, head_dim, theta, p)


def llama3_scaling_from_factors(freqs: np.ndarray, head_dim: int, theta: float, where: Any) -> dict[str, Any]:
    """Llama 3's scaling parameters that give these per-frequency divisors, checked by recomputing them.

    The divisor is 1 for short wavelengths, `factor` for long ones and 1 / ((1 - s)/factor + s)
    between, where s = (L / wavelen - lo) / (hi - lo) is linear in 1/wavelen: with lo = 1 (only
    L/lo and L/hi are determined), a line fitted through the blended band gives L and hi."""
    rf = np.asarray(freqs, dtype=np.float64)
    factor = float(rf.max())
    inv = rope_inv_freq(head_dim, theta, None).astype(np.float64)
    want = (rope_inv_freq(head_dim, theta, None) / np.asarray(freqs, np.float32)).astype(np.float32)
    candidates = [dict(factor=factor, low_freq_factor=1.0, high_freq_factor=4.0,
                       original_max_position_embeddings=8192)]        # every Llama 3.x release
    band = (rf > 1.0 + 1e-6) & (rf < factor * (1.0 - 1e-6))
    if band.sum() >= 2 and factor > 1.0:
        s = (1.0 / rf[band] - 1.0 / factor) / (1.0 - 1.0 / factor)
        slope, intercept = np.polyfit(inv[band] / (2 * math.pi), s, 1)   # s = slope / wavelen + intercept
        if intercept < 0 and slope > 0:
            b = -intercept
            candidates.append(dict(factor=factor, low_freq_factor=1.0, high_freq_factor=round(float(1.0 + 1.0 / b), 4),
                                   original_max_position_embeddings=int(round(slope / b))))
    for cand in candidates:
        if np.allclose(rope_inv_freq(head_dim, theta, cand), want, rtol=1e-5, atol=0):
            return cand
    raise ModelError(f"{where}: {ROPE_FREQS} holds frequency factors that are not Llama 3's RoPE scaling; "
                     "llmrs cannot run this model's RoPE")


def _family(meta: Metadata) -> Family:
    arch = meta.get("general.architecture", str)
    family = FAMILIES.get(arch)
    if family is None:
        raise ModelError(f"{meta.path}: general.architecture is {arch!r}; llmrs runs {gguf_names()}")
    return family


def read_config(meta: Metadata, tensors: dict[str, Any]) -> ModelConfig:
    """ModelConfig from the `<arch>.*` metadata of the file's family; tensors (by GGUF name) give
    the vocabulary size, tying and the RoPE frequency factors."""
    p = meta.path
    family = _family(meta)
    arch = family.name
    if meta.get(f"{arch}.expert_count", int, 0) > 0:
        raise ModelError(f"{p}: {arch}.expert_count is {meta.get(f'{arch}.expert_count', int)}; "
                         "mixture-of-experts models are not supported")
    need = " (llmrs needs it to build the graph)"
    heads = meta.positive(f"{arch}.attention.head_count", why=need)
    kv_heads = meta.positive(f"{arch}.attention.head_count_kv", heads)
    hidden = meta.positive(f"{arch}.embedding_length", why=need)
    head_dim = meta.positive(f"{arch}.attention.key_length", None) or \
        meta.positive(f"{arch}.rope.dimension_count", None) or hidden // heads
    v_dim = meta.positive(f"{arch}.attention.value_length", head_dim)
    rot_dim = meta.positive(f"{arch}.rope.dimension_count", head_dim)
    if v_dim != head_dim or rot_dim != head_dim:
        raise ModelError(f"{p}: key length {head_dim}, value length {v_dim} and rope.dimension_count {rot_dim} "
                         "differ; llmrs rotates and attends over whole heads of one size")
    if heads % kv_heads:
        raise ModelError(f"{p}: {arch}.attention.head_count {heads} is not a multiple of head_count_kv {kv_heads}")
    if head_dim % 2:
        raise ModelError(f"{p}: head dimension {head_dim} must be even for RoPE")
    embd = tensors.get("token_embd.weight")
    if embd is None:
        raise ModelError(f"{p}: tensor 'token_embd.weight' is missing (every {family.label} has a token embedding)")
    vocab = int(embd.shape[-1])
    if meta.get(f"{arch}.vocab_size", int, vocab) != vocab:
        raise ModelError(f"{p}: {arch}.vocab_size {meta.get(f'{arch}.vocab_size', int)} differs from "
                         f"token_embd.weight's {vocab} rows")
    # checked before the RoPE scaling is fitted to it
    theta = check_float("rope_theta", meta.get(f"{arch}.rope.freq_base", float, 10000.0), str(p),
                        f"{arch}.rope.freq_base", family.label)
    rf = tensors.get(ROPE_FREQS) if family.name == "llama" else None   # another family's is an unexpected tensor
    if rf is not None and tuple(int(d) for d in rf.shape) != (head_dim // 2,):
        raise ModelError(f"{p}: tensor {ROPE_FREQS!r} has shape {list(rf.shape)}, expected [{head_dim // 2}]")
    freqs = None if rf is None else _rope_freqs(rf, p)
    counts = Counter(t.tensor_type.name.lower() for t in tensors.values() if len(t.shape) == 2)
    return check_ranges(ModelConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=meta.positive(f"{arch}.feed_forward_length", why=need),
        num_hidden_layers=meta.positive(f"{arch}.block_count", why=need),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=meta.get(f"{arch}.attention.layer_norm_rms_epsilon", float, why=need),
        rope_theta=theta,
        rope_scaling=_rope_scaling(meta, arch, freqs, head_dim, theta),
        max_position_embeddings=meta.positive(f"{arch}.context_length", why=need),
        tie_word_embeddings="output.weight" not in tensors,
        torch_dtype=counts.most_common(1)[0][0] if counts else "f32",
        architecture=arch,
        qk_norm=family.qk_norm,
        attention_bias=family.qkv_bias,
    ), str(p), gguf_keys(arch))


def gguf_keys(arch: str) -> dict[str, str]:
    """The GGUF key of each ModelConfig field, for check_ranges' messages."""
    return {"vocab_size": "token_embd.weight's row count", "hidden_size": f"{arch}.embedding_length",
            "intermediate_size": f"{arch}.feed_forward_length", "num_hidden_layers": f"{arch}.block_count",
            "num_attention_heads": f"{arch}.attention.head_count",
            "num_key_value_heads": f"{arch}.attention.head_count_kv", "head_dim": f"{arch}.attention.key_length",
            "max_position_embeddings": f"{arch}.context_length",
            "rms_norm_eps": f"{arch}.attention.layer_norm_rms_epsilon", "rope_theta": f"{arch}.rope.freq_base",
            "rope_scaling": "rope_freqs.weight's scaling", "bos_token_id": "tokenizer.ggml.bos_token_id",
            "eos_token_id": "tokenizer.ggml.eos_token_id"}


def _rope_freqs(rf: Any, path: Path) -> np.ndarray:
    """rope_freqs.weight's divisors: finite and positive, or the file is damaged."""
    try:
        freqs = np.asarray(gguf.quants.dequantize(rf.data, rf.tensor_type), np.float32).reshape(-1)
    except (NotImplementedError, ValueError, KeyError) as e:
        raise ModelError(f"{path}: tensor {ROPE_FREQS!r} cannot be read ({e})") from None
    if not (np.all(np.isfinite(freqs)) and np.all(freqs > 0)):
        raise ModelError(f"{path}: tensor {ROPE_FREQS!r} holds a value that is not a positive number "
                         "(the file is damaged)")
    return freqs


def read_tensors(cfg: ModelConfig, reader: Any, path: Path) -> dict[str, GGUFTensor]:
    """Every tensor the graph needs, by its graph name, checked against cfg; one-line errors name
    the GGUF tensor."""
    by_name = {t.name: t for t in reader.tensors}
    want = expected_tensors(cfg)
    family = cfg.family
    extra = sorted(n for n in by_name if not (n == ROPE_FREQS and family.name == "llama") and hf_name(n) not in want)
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise ModelError(f"{path}: unexpected tensor {extra[0]!r}{more}: not part of a {family.label} "
                         f"(general.architecture {family.name!r}) with this metadata")
    out = {}
    for name, shape in want.items():
        g = gguf_name(name)
        t = by_name.get(g)
        if t is None:
            raise ModelError(f"{path}: tensor {g!r} is missing (a {family.label} with this metadata has it, "
                             f"shape {list(shape)})")
        got = tuple(int(d) for d in reversed(t.shape.tolist()))
        if got != shape:
            raise ModelError(f"{path}: tensor {g!r} has shape {list(got)}, the metadata implies {list(shape)}")
        kind = t.tensor_type
        if kind not in NATIVE:
            try:  # gguf dequantizes what it knows; a probe block tells
                gguf.quants.dequantize(np.zeros((1, gguf.GGML_QUANT_SIZES[kind][1]), np.uint8), kind)
            except (NotImplementedError, KeyError, ValueError):
                raise ModelError(f"{path}: tensor {g!r} is GGML type {kind.name}, which llmrs cannot read "
                                 "(gguf cannot dequantize it); re-quantize the model to Q8_0, Q4_0 or F16") from None
        heads = 0 if not family.gguf_qk_interleaved else cfg.num_attention_heads if name.endswith("q_proj.weight") \
            else cfg.num_key_value_heads if name.endswith("k_proj.weight") else 0
        out[name] = GGUFTensor(g, kind.name, NATIVE.get(kind, "f32"), shape, t.data, heads, str(path))
    return out
