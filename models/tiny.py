"""Random Hugging Face-format Llama folders of any shape, for tests, demos and benchmarks.

A matrix with K inputs is N(0, 1/K): 0.022 for Llama-3.2-1B's 2048, HF's initializer_range,
and at any smaller width it keeps activations at the scale they have in the real model (a
fixed 0.02 would leave a tiny model's layers adding almost nothing to the embedding, and a
tied head would just repeat the last token). The embedding and lm_head are N(0, 4/hidden), so
logits have std ~2 as a trained model's do. Norm weights are 1 + N(0, 0.1): none all equal.
"""
from __future__ import annotations

import json
import math
import pydoc
from pathlib import Path
from typing import Any, Callable

import numpy as np

from .safetensors_io import f32_to_bf16, write

# Llama 3's special tokens in id order after the byte-level BPE vocabulary (begin at 128000).
_SPECIAL_HEAD = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                 "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>",
                 "<|reserved_special_token_2|>", "<|start_header_id|>", "<|end_header_id|>",
                 "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"]

PRESETS: dict[str, dict[str, Any]] = {
    # the README's default: small enough to make in a second, big enough to say something
    "tiny": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
                 num_key_value_heads=4, vocab_size=1024, tie_word_embeddings=True, rope_theta=500000.0),
    # golden (a): tied, plain RoPE, GQA 4:2
    "golden-a": dict(hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=384, tie_word_embeddings=True, rope_theta=10000.0,
                     max_position_embeddings=512),
    # golden (b): untied, llama3 scaling, GQA 8:2, explicit head_dim, sizes 3x32, 5x32, 11x32
    "golden-b": dict(hidden_size=96, intermediate_size=160, num_hidden_layers=2, num_attention_heads=8,
                     num_key_value_heads=2, head_dim=16, vocab_size=352, tie_word_embeddings=False,
                     rope_theta=10000.0, max_position_embeddings=1024,
                     rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                       high_freq_factor=4.0, original_max_position_embeddings=64)),
    # golden (c): OpenLLaMA-3B's head_dim 100 (no multiple of 8: vector tails on every back end),
    # MQA 8:1, an attention width (800) apart from the hidden size (32); committed with --seed 1,
    # whose greedy steps keep a top-2 margin of 6% of the logit range
    "golden-c": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=8,
                     num_key_value_heads=1, head_dim=100, vocab_size=320, tie_word_embeddings=True,
                     rope_theta=500000.0, max_position_embeddings=512),
    # the exact shape of meta-llama/Llama-3.2-1B
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
                         tie_word_embeddings=True, rope_theta=500000.0, max_position_embeddings=131072,
                         rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0,
                                           high_freq_factor=4.0, original_max_position_embeddings=8192)),
}


def make_config(preset: str = "tiny", **overrides: Any) -> dict[str, Any]:
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r} (one of {', '.join(PRESETS)})")
    cfg: dict[str, Any] = dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu",
        attention_bias=False, mlp_bias=False, rms_norm_eps=1e-5, initializer_range=0.02,
        max_position_embeddings=2048, rope_scaling=None, torch_dtype="bfloat16",
    )
    cfg.update(PRESETS[preset])
    cfg.update({k: v for k, v in overrides.items() if v is not None})
    cfg.setdefault("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    n_special = n_special_tokens(cfg["vocab_size"])
    base = cfg["vocab_size"] - n_special
    cfg["bos_token_id"] = base
    cfg["eos_token_id"] = [base + 1, base + 8, base + 9]  # end_of_text, eom_id, eot_id
    return cfg


def n_special_tokens(vocab_size: int) -> int:
    return 256 if vocab_size >= 4096 else 16


def _corpus() -> list[str]:
    """Local English text for BPE training: the standard library's own documentation."""
    import collections, json as _json, pathlib, re, statistics, string, textwrap  # noqa: E401
    return [pydoc.render_doc(m, renderer=pydoc.plaintext) for m in
            (collections, _json, pathlib, re, statistics, string, textwrap)]


def make_tokenizer(vocab_size: int) -> str:
    """A byte-level BPE in tokenizer.json form whose special tokens sit where Llama 3's do."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    n_special = n_special_tokens(vocab_size)
    n_base = vocab_size - n_special
    if n_base < 256 + 16:
        raise ValueError(f"vocab_size {vocab_size} is too small for a byte-level BPE (need >= {256 + 16 + n_special})")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=n_base, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_corpus(), trainer)
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for i in range(len(vocab), n_base):  # a small corpus learns fewer merges than asked for
        vocab[f"<|unused_{i}|>"] = i
    specials = (_SPECIAL_HEAD + [f"<|reserved_special_token_{i}|>" for i in range(3, n_special)])[:n_special]
    spec["added_tokens"] = [dict(id=n_base + i, content=s, single_word=False, lstrip=False, rstrip=False,
                                 normalized=False, special=True) for i, s in enumerate(specials)]
    tok = Tokenizer.from_str(json.dumps(spec))
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A $B",
        special_tokens=[("<|begin_of_text|>", n_base)])
    return tok.to_str()


def _tensor_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    from .config import expected_tensors, parse_config
    return expected_tensors(parse_config(cfg))


def make_model(out_dir: str | Path, preset: str = "tiny", seed: int = 0, dtype: str = "bf16",
               progress: Callable[[str, int, int], None] | None = None, **overrides: Any) -> Path:
    """Write config.json, generation_config.json, model.safetensors and tokenizer.json."""
    if dtype not in ("bf16", "f16", "f32"):
        raise ValueError(f"dtype {dtype!r}: choose bf16, f16 or f32")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = make_config(preset, **overrides)
    cfg["torch_dtype"] = {"bf16": "bfloat16", "f16": "float16", "f32": "float32"}[dtype]
    rng = np.random.default_rng(seed)
    logit_std = 2.0 / math.sqrt(cfg["hidden_size"])
    tensors = {}
    shapes = _tensor_shapes(cfg)
    for i, (name, shape) in enumerate(shapes.items()):
        if progress:
            progress(name, i, len(shapes))
        if len(shape) == 1:
            w = 1.0 + 0.1 * rng.standard_normal(shape, dtype=np.float32)
        else:
            std = logit_std if name in ("model.embed_tokens.weight", "lm_head.weight") else 1 / math.sqrt(shape[1])
            w = rng.standard_normal(shape, dtype=np.float32)
            w *= np.float32(std)
        if dtype == "bf16":
            tensors[name] = (f32_to_bf16(w), "bf16")
        else:
            tensors[name] = (w.astype(np.float16 if dtype == "f16" else np.float32), dtype)
        del w
    write(out / "model.safetensors", tensors)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    gen = dict(bos_token_id=cfg["bos_token_id"], eos_token_id=cfg["eos_token_id"], do_sample=False)
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    (out / "tokenizer.json").write_text(make_tokenizer(cfg["vocab_size"]))
    (out / "tokenizer_config.json").write_text(json.dumps(dict(
        tokenizer_class="PreTrainedTokenizerFast", bos_token="<|begin_of_text|>",
        eos_token="<|end_of_text|>", model_max_length=cfg["max_position_embeddings"]), indent=2) + "\n")
    return out
