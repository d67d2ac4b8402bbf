"""Hugging Face folders -> GGUF files as llama.cpp's convert_hf_to_gguf.py writes a Llama, for tests:
its metadata keys, tensor names, Q/K rows permuted for llama.cpp's RoPE, Llama 3 scaling as
rope_freqs.weight, and the tokenizer as token list, token types and "a b" merges. Written with
gguf.GGUFWriter; quantized with gguf.quants, so the bytes come from outside llmrs."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Callable

import numpy as np

import gguf
from gguf import GGMLQuantizationType as GT
from gguf import TokenType

from llmrs.models.safetensors_io import open_folder

_LAYER = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
          "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}


def to_gguf_name(name: str) -> str:
    if name in _GLOBAL:
        return _GLOBAL[name]
    parts = name.split(".")  # model.layers.N.<module>.weight
    return f"blk.{parts[2]}.{_LAYER['.'.join(parts[3:-1])]}.weight"


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf's LlamaModel.permute: each head's rows [2, hd/2] -> [hd/2, 2]."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_weights(model_dir: Path) -> dict[str, np.ndarray]:
    """The folder's tensors as float32 (bf16 widened)."""
    out = {}
    for name, ref in open_folder(model_dir).items():
        a = np.asarray(ref.load())
        out[name] = (a.astype(np.uint32) << 16).view(np.float32) if ref.dtype == "bf16" else a.astype(np.float32)
    return out


def encode(x: np.ndarray, kind: GT) -> np.ndarray:
    """x in GGML type `kind` as GGUF stores it (quantized types as uint8 blocks)."""
    if kind == GT.F32:
        return x.astype(np.float32)
    if kind == GT.F16:
        return x.astype(np.float16)
    return gguf.quants.quantize(x.astype(np.float32), kind)


def gguf_values(data: np.ndarray, kind: GT) -> np.ndarray:
    """The float values a GGUF tensor's stored data means (gguf's own decoder)."""
    return np.asarray(gguf.quants.dequantize(data, kind), dtype=np.float32)


def rope_factors(cfg: dict[str, Any]) -> np.ndarray:
    """convert_hf_to_gguf's rope_freqs.weight for Llama 3 scaling (python floats, as it computes them)."""
    rs, dim = cfg["rope_scaling"], cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    factor, lo, hi, old = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"], \
        rs["original_max_position_embeddings"]
    out = []
    for i in range(0, dim, 2):
        wavelen = 2 * math.pi * cfg["rope_theta"] ** (i / dim)
        if wavelen < old / hi:
            out.append(1.0)
        elif wavelen > old / lo:
            out.append(factor)
        else:
            smooth = (old / wavelen - lo) / (hi - lo)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def tokenizer_metadata(model_dir: Path, vocab_size: int, pre: str, add_bos: bool) -> dict[str, Any]:
    """tokenizer.ggml.* from tokenizer.json as convert's get_vocab_base does: every id up to
    vocab_size, added tokens as CONTROL (special) or USER_DEFINED, holes as UNUSED [PADn]."""
    spec = json.loads((model_dir / "tokenizer.json").read_text())
    tok_cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    by_id = {i: (t, TokenType.NORMAL) for t, i in spec["model"]["vocab"].items()}
    for a in spec["added_tokens"]:
        by_id[a["id"]] = (a["content"], TokenType.CONTROL if a["special"] else TokenType.USER_DEFINED)
    tokens = [by_id.get(i, (f"[PAD{i}]", TokenType.UNUSED)) for i in range(vocab_size)]
    ids = {t: i for i, (t, _) in enumerate(tokens)}
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    return {
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": [t for t, _ in tokens], "tokenizer.ggml.token_type": [int(k) for _, k in tokens],
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": ids[tok_cfg["bos_token"]], "tokenizer.ggml.eos_token_id": ids[tok_cfg["eos_token"]],
        "tokenizer.ggml.add_bos_token": add_bos,
    }


def write_gguf(out: Path, meta: dict[str, Any], tensors: dict[str, tuple[np.ndarray, GT]]) -> Path:
    """meta: key -> python value (int -> UINT32, float -> FLOAT32, list of str / int arrays);
    tensors: GGUF name -> (stored data, GGML type)."""
    w = gguf.GGUFWriter(str(out), meta.get("general.architecture", "llama"))
    for key, v in meta.items():
        if key == "general.architecture":
            continue
        if isinstance(v, bool):
            w.add_bool(key, v)
        elif isinstance(v, int):
            w.add_uint32(key, v)
        elif isinstance(v, float):
            w.add_float32(key, v)
        elif isinstance(v, str):
            w.add_string(key, v)
        else:
            w.add_array(key, v)
    for name, (data, kind) in tensors.items():
        w.add_tensor(name, data, raw_dtype=kind if data.dtype == np.uint8 else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def hf_to_gguf(model_dir: Path, out: Path, kind: Callable[[str, tuple[int, ...]], GT] = lambda n, s: GT.F32, *,
               pre: str = "gpt-2", add_bos: bool = True, edit: Callable[[dict, dict], None] | None = None) -> Path:
    """A GGUF of the folder's model; kind(hf_name, shape) picks each 2-D tensor's GGML type (1-D
    ones are F32, as convert writes norms). edit(meta, tensors) may change either before writing."""
    cfg = json.loads((model_dir / "config.json").read_text())
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    meta: dict[str, Any] = {
        "general.architecture": "llama", "general.name": model_dir.name,
        "llama.block_count": cfg["num_hidden_layers"], "llama.context_length": cfg["max_position_embeddings"],
        "llama.embedding_length": cfg["hidden_size"], "llama.feed_forward_length": cfg["intermediate_size"],
        "llama.attention.head_count": heads, "llama.attention.head_count_kv": kv_heads,
        "llama.rope.freq_base": float(cfg["rope_theta"]),
        "llama.attention.layer_norm_rms_epsilon": float(cfg["rms_norm_eps"]),
        "llama.attention.key_length": cfg["head_dim"], "llama.attention.value_length": cfg["head_dim"],
        "llama.vocab_size": cfg["vocab_size"], "llama.rope.dimension_count": cfg["head_dim"],
        **tokenizer_metadata(model_dir, cfg["vocab_size"], pre, add_bos),
        "tokenizer.chat_template": "{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>"
                                   "\n\n{{ m['content'] }}<|eot_id|>{% endfor %}",
    }
    tensors: dict[str, tuple[np.ndarray, GT]] = {}
    for name, w in hf_weights(model_dir).items():
        if name.endswith("q_proj.weight"):
            w = permute(w, heads)
        elif name.endswith("k_proj.weight"):
            w = permute(w, kv_heads)
        t = kind(name, w.shape) if w.ndim == 2 else GT.F32
        tensors[to_gguf_name(name)] = (encode(w, t), t)
    if (cfg.get("rope_scaling") or {}).get("rope_type") == "llama3":
        tensors["rope_freqs.weight"] = (rope_factors(cfg), GT.F32)
    if edit is not None:
        edit(meta, tensors)
    return write_gguf(out, meta, tensors)


def value_span(path: Path, key: str) -> tuple[int, int]:
    """(file offset, bytes) of a metadata key's value (a scalar's bytes; an array's last part), or of
    a tensor's data offset when `key` is a tensor name: where to damage one field in place."""
    reader = gguf.GGUFReader(path)
    field = reader.fields.get(key) or next(t.field for t in reader.tensors if t.name == key)
    return field.offset + sum(int(p.nbytes) for p in field.parts[:-1]), int(field.parts[-1].nbytes)


def patch(path: Path, key: str, fmt: str, value: Any, out: Path | None = None) -> Path:
    """A copy of the GGUF (at out, default: in place) with one field's value packed as struct fmt."""
    import struct

    at, size = value_span(path, key)
    assert struct.calcsize(fmt) == size, (key, fmt, size)
    raw = bytearray(path.read_bytes())
    struct.pack_into(fmt, raw, at, value)
    out = out or path
    out.write_bytes(bytes(raw))
    return out


def rewrite_gguf(src: Path, out: Path, edit: Callable[[dict, dict], None]) -> Path:
    """A copy of a GGUF (a converter's) through write_gguf, after edit(meta, tensors) changed it:
    metadata as python values, tensors as (stored data, GGML type) by GGUF name."""
    reader = gguf.GGUFReader(src)
    meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    tensors = {t.name: (np.array(t.data), t.tensor_type) for t in reader.tensors}
    edit(meta, tensors)
    return write_gguf(out, meta, tensors)
