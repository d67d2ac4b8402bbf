"""A model's `config.json` (Llama 3.x, Qwen3, Qwen2/2.5; transformers 4.x and 5.x layouts), its
hyper-parameters checked, and refusal of what we can't run."""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .families import (BY_HF_ARCHITECTURE, BY_MODEL_TYPE, FAMILIES, LAYER_TENSORS, QK_NORM_TENSORS, QKV_BIAS_TENSORS,
                       Family, hf_names)


class ModelError(ValueError):
    """Bad model input; str() is one line naming the file, tensor or field at fault."""


@dataclass(frozen=True)
class ModelConfig:
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
    # defaults keep configs written before Qwen (a plan's meta) reading as the Llama they are
    architecture: str = "llama"        # the family (models/families.py FAMILIES)
    qk_norm: bool = False              # Qwen3: RMSNorm over each q and k head before RoPE
    attention_bias: bool = False       # Qwen2: biases on the q, k and v projections

    @property
    def family(self) -> Family:
        return FAMILIES[self.architecture]

    @property
    def n_params(self) -> int:
        d, f, hd = self.hidden_size, self.intermediate_size, self.head_dim
        qkv_rows = hd * (self.num_attention_heads + 2 * self.num_key_value_heads)
        qkvo = d * hd * (2 * self.num_attention_heads + 2 * self.num_key_value_heads)
        layer = qkvo + 3 * d * f + 2 * d + (2 * hd if self.qk_norm else 0) + (qkv_rows if self.attention_bias else 0)
        head = 0 if self.tie_word_embeddings else self.vocab_size * d
        return self.vocab_size * d + self.num_hidden_layers * layer + d + head

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["eos_token_ids"] = list(self.eos_token_ids)
        return d

    @staticmethod
    def from_json(d: dict[str, Any]) -> "ModelConfig":
        return ModelConfig(**{**d, "eos_token_ids": tuple(d.get("eos_token_ids", ()))})


LlamaConfig = ModelConfig   # its name before Qwen; the compiler and older callers import it


_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")

# The range each hyper-parameter of a model takes (inclusive; rms_norm_eps and rope_theta exclude
# their lower end). Far past any published model, so a value outside is a damaged or foreign file,
# never a real one: caught here, it cannot become a graph of absurd size or a NaN in every logit.
INT_LIMITS = {
    "vocab_size": (1, 1 << 24), "hidden_size": (1, 1 << 17), "intermediate_size": (1, 1 << 19),
    "num_hidden_layers": (1, 4096), "num_attention_heads": (1, 4096), "num_key_value_heads": (1, 4096),
    "head_dim": (2, 4096), "max_position_embeddings": (1, (1 << 31) - 1),
}
FLOAT_LIMITS = {"rms_norm_eps": (0.0, 0.5), "rope_theta": (1.0, 1e12)}
SCALING_LIMITS = {"factor": (1.0, 1e6), "low_freq_factor": (0.0, 1e6), "high_freq_factor": (0.0, 1e6),
                  "original_max_position_embeddings": (1, (1 << 31) - 1)}


# where the 5.x layout keeps what check_ranges names
_ROPE_KEYS = {"rope_theta": "rope_parameters.rope_theta", "rope_scaling": "rope_parameters"}


def _rope(raw: dict[str, Any], where: str) -> tuple[float, dict[str, Any] | None]:
    """(theta, llama3 scaling or None) from either config layout."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict):                 # transformers 5.x
        theta = _raw_float(params, "rope_theta", _raw_float(raw, "rope_theta", 10000.0, where), where)
        scaling, name = params, "rope_parameters"
    else:                                        # transformers 4.x
        theta = _raw_float(raw, "rope_theta", 10000.0, where)
        scaling, name = raw.get("rope_scaling"), "rope_scaling"
    if not scaling:
        return theta, None
    if not isinstance(scaling, dict):
        raise ModelError(f"{where}: {name} is {json.dumps(scaling)[:40]}; it must be an object or null")
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise ModelError(f"{where}: rope_scaling type {rope_type!r} is not supported (llmrs runs 'llama3' and none)")
    missing = [k for k in _LLAMA3_KEYS if k not in scaling]
    if missing:
        raise ModelError(f"{where}: llama3 rope_scaling lacks {', '.join(missing)}")
    return theta, {k: _raw_float(scaling, k, 0.0, f"{where}: {name}") if k != "original_max_position_embeddings"
                   else _raw_int(scaling, k, 0, f"{where}: {name}") for k in _LLAMA3_KEYS}


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_whole(v: Any) -> bool:
    """An int, or a float with no fraction (JSON writers give 2048.0): not a bool, NaN or string."""
    return _is_number(v) and (isinstance(v, int) or math.isfinite(v) and v.is_integer())


def _raw_int(raw: dict[str, Any], key: str, default: Any, where: str) -> Any:
    """raw[key] as an int (2048 or 2048.0, not "2048", true or 2048.5); default when absent or null."""
    v = raw.get(key)
    if v is None:
        return default
    if not _is_whole(v):
        raise ModelError(f"{where}: {key} is {json.dumps(v)[:40]}; it must be a whole number")
    return int(v)


def _raw_float(raw: dict[str, Any], key: str, default: float, where: str) -> float:
    v = raw.get(key)
    if v is None:
        return default
    if not _is_number(v):
        raise ModelError(f"{where}: {key} is {json.dumps(v)[:40]}; it must be a number")
    try:
        return float(v)
    except OverflowError:     # an int past any float: the range check names it
        return math.inf if v > 0 else -math.inf


def _shown(v: float) -> str:
    text = f"{v:g}" if isinstance(v, float) else str(v)
    return text if len(text) <= 24 else f"{text[:12]}... ({len(text)} digits)"


def _ids(v: Any, key: str = "eos_token_id", where: str = "config.json") -> tuple[int, ...]:
    if v is None:
        return ()
    out = []
    for x in (v if isinstance(v, list) else [v]):
        if not (_is_whole(x) and x >= 0):
            raise ModelError(f"{where}: {key} holds {json.dumps(x)[:40]}; token ids are whole numbers from 0")
        out.append(int(x))
    return tuple(out)


def check_float(field: str, value: float, where: str, key: str, label: str = "Llama") -> float:
    """value, if finite and inside FLOAT_LIMITS[field]; else a ModelError naming `key`."""
    lo, hi = FLOAT_LIMITS[field]
    if not (math.isfinite(value) and lo < value <= hi):
        raise ModelError(f"{where}: {key} is {value:g}; it must be above {lo:g} and at most {hi:g} "
                         f"(the file is damaged, or not a {label}'s)")
    return value


def check_ranges(cfg: ModelConfig, where: str, keys: dict[str, str] | None = None) -> ModelConfig:
    """cfg, if every hyper-parameter is in its range (INT_LIMITS, FLOAT_LIMITS: finite, positive,
    not absurd) and every special token id inside the vocabulary; else a ModelError naming the
    key as the file spells it (keys: field -> key; config.json's names by default)."""
    keys = keys or {}
    label = cfg.family.label
    for name, (lo, hi) in INT_LIMITS.items():
        v = getattr(cfg, name)
        if not lo <= v <= hi:
            raise ModelError(f"{where}: {keys.get(name, name)} is {_shown(v)}; a {label}'s is {lo} to {hi} "
                             f"(the file is damaged, or not a {label}'s)")
    for name in FLOAT_LIMITS:
        check_float(name, getattr(cfg, name), where, keys.get(name, name), label)
    for name, v in (cfg.rope_scaling or {}).items():
        lo, hi = SCALING_LIMITS[name]
        if not (lo <= v <= hi and v > 0):    # NaN fails every comparison
            raise ModelError(f"{where}: {keys.get('rope_scaling', 'rope_scaling')} {name} is {_shown(v)}; it must be "
                             f"positive and between {lo:g} and {hi:g}")
    if cfg.rope_scaling and not cfg.rope_scaling["low_freq_factor"] < cfg.rope_scaling["high_freq_factor"]:
        raise ModelError(f"{where}: {keys.get('rope_scaling', 'rope_scaling')} low_freq_factor "
                         f"{cfg.rope_scaling['low_freq_factor']:g} is not below high_freq_factor "
                         f"{cfg.rope_scaling['high_freq_factor']:g}")
    for name, ids in (("bos_token_id", [cfg.bos_token_id] if cfg.bos_token_id is not None else []),
                      ("eos_token_id", cfg.eos_token_ids)):
        bad = [i for i in ids if not 0 <= i < cfg.vocab_size]
        if bad:
            raise ModelError(f"{where}: {keys.get(name, name)} {_shown(bad[0])} is outside the {cfg.vocab_size}-token "
                             "vocabulary")
    return cfg


def _family(raw: dict[str, Any], where: str) -> Family:
    """The family config.json names by "architectures" (or, lacking it, "model_type")."""
    archs = raw.get("architectures")
    if archs:
        archs = [str(a) for a in archs] if isinstance(archs, list) else [str(archs)]
        known = [BY_HF_ARCHITECTURE[a] for a in archs if a in BY_HF_ARCHITECTURE]
        if not known:
            raise ModelError(f"{where}: architecture {', '.join(archs)} is not supported (llmrs runs {hf_names()})")
        return known[0]
    model_type = raw.get("model_type")
    family = BY_MODEL_TYPE.get(model_type) if isinstance(model_type, str) else None
    if family is None:
        raise ModelError(f"{where}: model_type {raw.get('model_type')!r} is not supported "
                         f"(llmrs runs {', '.join(repr(t) for t in BY_MODEL_TYPE)})")
    return family


def _refuse_extras(raw: dict[str, Any], family: Family, where: str) -> None:
    """What transformers would run for this family but llmrs's graph does not have."""
    for flag in family.bias_flags:
        if raw.get(flag):
            raise ModelError(f"{where}: {flag}=true is not supported ({family.label} models as released have "
                             "no such biases)")
    layer_types = raw.get("layer_types") if isinstance(raw.get("layer_types"), list) else []
    window = raw.get("use_sliding_window") and raw.get("sliding_window") is not None and \
        _raw_int(raw, "max_window_layers", 28, where) < _raw_int(raw, "num_hidden_layers", 0, where)
    if window or "sliding_attention" in layer_types:
        raise ModelError(f"{where}: sliding-window attention (use_sliding_window / layer_types) is not supported; "
                         "llmrs attends over the whole cache in every layer")


def parse_config(raw: dict[str, Any], where: str = "config.json") -> ModelConfig:
    if not isinstance(raw, dict):
        raise ModelError(f"{where}: not a JSON object")
    family = _family(raw, where)
    _refuse_extras(raw, family, where)
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ModelError(f"{where}: hidden_act {act!r} is not supported (llmrs runs 'silu')")
    need = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    missing = [k for k in need if raw.get(k) is None]
    if missing:
        raise ModelError(f"{where}: missing {', '.join(missing)}")
    theta, scaling = _rope(raw, where)
    n = {k: _raw_int(raw, k, None, where) for k in need + ("num_key_value_heads", "head_dim")}
    for k in ("num_attention_heads", "hidden_size"):
        if n[k] < 1:
            raise ModelError(f"{where}: {k} is {n[k]}; it must be positive")
    heads = n["num_attention_heads"]
    kv_heads = n["num_key_value_heads"] or heads
    head_dim = n["head_dim"] or family.default_head_dim or n["hidden_size"] // heads
    if kv_heads < 1 or heads % kv_heads:
        raise ModelError(f"{where}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
    if head_dim % 2:
        raise ModelError(f"{where}: head_dim {head_dim} must be even for RoPE")
    bos = _ids(raw.get("bos_token_id"), "bos_token_id", where)
    return check_ranges(ModelConfig(
        vocab_size=n["vocab_size"],
        hidden_size=n["hidden_size"],
        intermediate_size=n["intermediate_size"],
        num_hidden_layers=n["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=_raw_float(raw, "rms_norm_eps", 1e-6, where),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=_raw_int(raw, "max_position_embeddings", 2048, where),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        bos_token_id=bos[0] if bos else None,
        eos_token_ids=_ids(raw.get("eos_token_id"), "eos_token_id", where),
        torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "bfloat16"),
        architecture=family.name,
        qk_norm=family.qk_norm,
        attention_bias=family.qkv_bias,
    ), where, _ROPE_KEYS if "rope_parameters" in raw else None)


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object file; anything else is a one-line ModelError naming it."""
    try:
        value = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError:
        raise ModelError(f"{path}: not UTF-8 text") from None
    except json.JSONDecodeError as e:
        raise ModelError(f"{path}: not valid JSON ({e.msg}, line {e.lineno})") from None
    except RecursionError:
        raise ModelError(f"{path}: JSON nested too deeply") from None
    if not isinstance(value, dict):
        raise ModelError(f"{path}: not a JSON object")
    return value


def load_config(model_dir: str | Path) -> ModelConfig:
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ModelError(f"{model_dir}: not a model folder (expected config.json, *.safetensors, tokenizer.json)")
    path = model_dir / "config.json"
    if not path.is_file():
        raise ModelError(f"{model_dir}: no config.json (is this a Hugging Face model folder?)")
    cfg = parse_config(read_json(path), str(path))
    gen = model_dir / "generation_config.json"
    if gen.is_file():  # it may name more stop tokens than config.json does
        extra = _ids(read_json(gen).get("eos_token_id"), "eos_token_id", str(gen))
        cfg = check_ranges(ModelConfig(**{**asdict(cfg), "eos_token_ids": tuple(dict.fromkeys(cfg.eos_token_ids + extra))}),
                           str(gen))
    return cfg


def layer_tensors(cfg: ModelConfig) -> tuple[tuple[str, str], ...]:
    """(Hugging Face suffix, GGUF suffix) of every per-layer tensor cfg's family has."""
    return LAYER_TENSORS + (QK_NORM_TENSORS if cfg.qk_norm else ()) + (QKV_BIAS_TENSORS if cfg.attention_bias else ())


def expected_tensors(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of cfg's family holds, with its [out, in] (or [n]) shape."""
    d, f, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    per_layer = {"input_layernorm.weight": (d,), "self_attn.q_proj.weight": (q, d), "self_attn.k_proj.weight": (kv, d),
                 "self_attn.v_proj.weight": (kv, d), "self_attn.o_proj.weight": (d, q),
                 "post_attention_layernorm.weight": (d,), "mlp.gate_proj.weight": (f, d), "mlp.up_proj.weight": (f, d),
                 "mlp.down_proj.weight": (d, f), "self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,),
                 "self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,)}
    names = [hf for hf, _ in layer_tensors(cfg)]
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, d), "model.norm.weight": (d,)}
    for i in range(cfg.num_hidden_layers):
        shapes.update({f"model.layers.{i}.{n}": per_layer[n] for n in names})
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, d)
    return shapes
