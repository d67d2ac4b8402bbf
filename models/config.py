"""Llama 3.x `config.json`: both transformers 4.x and 5.x layouts, and refusal of what we can't run."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


class ModelError(ValueError):
    """Bad model input; str() is one line naming the file, tensor or field at fault."""


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None   # llama3 parameters, or None for plain RoPE
    max_position_embeddings: int
    tie_word_embeddings: bool
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    torch_dtype: str = "bfloat16"

    @property
    def n_params(self) -> int:
        d, f, hd = self.hidden_size, self.intermediate_size, self.head_dim
        qkvo = d * hd * (2 * self.num_attention_heads + 2 * self.num_key_value_heads)
        layer = qkvo + 3 * d * f + 2 * d
        head = 0 if self.tie_word_embeddings else self.vocab_size * d
        return self.vocab_size * d + self.num_hidden_layers * layer + d + head

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["eos_token_ids"] = list(self.eos_token_ids)
        return d

    @staticmethod
    def from_json(d: dict[str, Any]) -> "LlamaConfig":
        return LlamaConfig(**{**d, "eos_token_ids": tuple(d.get("eos_token_ids", ()))})


_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _rope(raw: dict[str, Any], where: str) -> tuple[float, dict[str, Any] | None]:
    """(theta, llama3 scaling or None) from either config layout."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict):                 # transformers 5.x
        theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
        scaling = params
    else:                                        # transformers 4.x
        theta = raw.get("rope_theta", 10000.0)
        scaling = raw.get("rope_scaling")
    if not scaling:
        return float(theta), None
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return float(theta), None
    if rope_type != "llama3":
        raise ModelError(f"{where}: rope_scaling type {rope_type!r} is not supported (llmrs runs 'llama3' and none)")
    missing = [k for k in _LLAMA3_KEYS if k not in scaling]
    if missing:
        raise ModelError(f"{where}: llama3 rope_scaling lacks {', '.join(missing)}")
    return float(theta), {k: float(scaling[k]) if k != "original_max_position_embeddings"
                          else int(scaling[k]) for k in _LLAMA3_KEYS}


def _ids(v: Any) -> tuple[int, ...]:
    if v is None:
        return ()
    return tuple(int(x) for x in (v if isinstance(v, list) else [v]))


def parse_config(raw: dict[str, Any], where: str = "config.json") -> LlamaConfig:
    archs = raw.get("architectures")
    if archs:
        if "LlamaForCausalLM" not in archs:
            raise ModelError(f"{where}: architecture {', '.join(archs)} is not supported (llmrs runs LlamaForCausalLM)")
    elif raw.get("model_type") != "llama":
        raise ModelError(f"{where}: model_type {raw.get('model_type')!r} is not supported (llmrs runs 'llama')")
    for flag in ("attention_bias", "mlp_bias"):
        if raw.get(flag):
            raise ModelError(f"{where}: {flag}=true is not supported (Llama 3 has no biases)")
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ModelError(f"{where}: hidden_act {act!r} is not supported (llmrs runs 'silu')")
    need = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    missing = [k for k in need if k not in raw]
    if missing:
        raise ModelError(f"{where}: missing {', '.join(missing)}")
    theta, scaling = _rope(raw, where)
    heads = int(raw["num_attention_heads"])
    kv_heads = int(raw.get("num_key_value_heads") or heads)
    head_dim = int(raw.get("head_dim") or raw["hidden_size"] // heads)
    if heads % kv_heads:
        raise ModelError(f"{where}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
    if head_dim % 2:
        raise ModelError(f"{where}: head_dim {head_dim} must be even for RoPE")
    return LlamaConfig(
        vocab_size=int(raw["vocab_size"]),
        hidden_size=int(raw["hidden_size"]),
        intermediate_size=int(raw["intermediate_size"]),
        num_hidden_layers=int(raw["num_hidden_layers"]),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=_ids(raw.get("eos_token_id")),
        torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "bfloat16"),
    )


def read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ModelError(f"{path}: not valid JSON ({e.msg}, line {e.lineno})") from None


def load_config(model_dir: str | Path) -> LlamaConfig:
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ModelError(f"{model_dir}: not a model folder (expected config.json, *.safetensors, tokenizer.json)")
    path = model_dir / "config.json"
    if not path.is_file():
        raise ModelError(f"{model_dir}: no config.json (is this a Hugging Face model folder?)")
    cfg = parse_config(read_json(path), str(path))
    gen = model_dir / "generation_config.json"
    if gen.is_file():  # it may name more stop tokens than config.json does
        extra = _ids(read_json(gen).get("eos_token_id"))
        cfg = LlamaConfig(**{**asdict(cfg), "eos_token_ids": tuple(dict.fromkeys(cfg.eos_token_ids + extra))})
    return cfg
