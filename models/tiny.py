"""Random Hugging Face-format model folders (Llama, Qwen3, Qwen2) of any shape, for tests, demos
and benchmarks.

A matrix with K inputs is N(0, 1/K): 0.022 for Llama-3.2-1B's 2048, HF's initializer_range,
and at any smaller width it keeps activations at the scale they have in the real model (a
fixed 0.02 would leave a tiny model's layers adding almost nothing to the embedding, and a
tied head would just repeat the last token). The embedding and lm_head are N(0, 4/hidden), so
logits have std ~2 as a trained model's do. Norm weights (Qwen3's per-head q/k norms too) are
1 + N(0, 0.1): none all equal; Qwen2's q/k/v biases are N(0, 0.25), on the scale of the
projections they are added to.

A Qwen folder carries a Qwen-style tokenizer (byte-level BPE split by Qwen's regex, NFC, no BOS,
<|endoftext|> <|im_start|> <|im_end|> ... after the learned vocabulary, the rows past them unused
as in Qwen's padded embedding) and its family's real chat template.
"""
from __future__ import annotations

import json
import math
import pydoc
from pathlib import Path
from typing import Any, Callable

import numpy as np

from .qwen_templates import QWEN3_CHAT_TEMPLATE, QWEN25_CHAT_TEMPLATE
from .safetensors_io import f32_to_bf16, write

FAMILIES = ("llama", "qwen3", "qwen2")

# Llama 3's special tokens in id order after the byte-level BPE vocabulary (begin at 128000).
_SPECIAL_HEAD = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                 "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>",
                 "<|reserved_special_token_2|>", "<|start_header_id|>", "<|end_header_id|>",
                 "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"]
# Qwen's, in Qwen3's order (151643 on); <tool_call> and the think tags are not special there
_QWEN_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_QWEN_PLAIN = ["<tool_call>", "</tool_call>", "<think>", "</think>"]
# Qwen2's pre-tokenizer regex as its tokenizer.json has it (digits one at a time)
QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
              r"|\s+(?!\S)|\s+")

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
    # Qwen3 (a): GQA 4:2, head_dim 48 apart from hidden / heads (attention width 192 over hidden
    # 64), untied; every matmul's inputs a multiple of 32, for the q4_0 / q8_0 GGUFs made of it
    "qwen3-a": dict(family="qwen3", hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=48, vocab_size=320, tie_word_embeddings=False,
                    rope_theta=1000000.0, max_position_embeddings=512),
    # Qwen3 (b): MQA 4:1, head_dim 32 (attention width 128 over hidden 64), tied
    "qwen3-b": dict(family="qwen3", hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=1, head_dim=32, vocab_size=320, tie_word_embeddings=True,
                    rope_theta=1000000.0, max_position_embeddings=512),
    # Qwen2 (a): q/k/v biases, GQA 6:2, head_dim 16 = hidden / heads (Qwen2 writes none), untied
    "qwen2-a": dict(family="qwen2", hidden_size=96, intermediate_size=64, num_hidden_layers=2, num_attention_heads=6,
                    num_key_value_heads=2, vocab_size=288, tie_word_embeddings=False, rope_theta=1000000.0,
                    max_position_embeddings=512),
    # the exact shapes of Qwen/Qwen3-0.6B and Qwen/Qwen2.5-0.5B
    "qwen3-0.6b": dict(family="qwen3", hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                       tie_word_embeddings=True, rope_theta=1000000.0, max_position_embeddings=40960),
    "qwen2.5-0.5b": dict(family="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True,
                         rope_theta=1000000.0, max_position_embeddings=32768),
    # the exact shape of HuggingFaceTB/SmolLM2-135M (the built-in model's, for benchmarks where its
    # GGUF cannot go: a lent GPU machine)
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True, rope_theta=100000.0,
                         max_position_embeddings=8192),
    # the exact shape of meta-llama/Llama-3.2-1B
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
                         tie_word_embeddings=True, rope_theta=500000.0, max_position_embeddings=131072,
                         rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0,
                                           high_freq_factor=4.0, original_max_position_embeddings=8192)),
}


def _base_config(family: str) -> dict[str, Any]:
    """config.json's fixed keys for the family, as its published checkpoints write them."""
    if family == "llama":
        return dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu",
                    attention_bias=False, mlp_bias=False, rms_norm_eps=1e-5, initializer_range=0.02,
                    max_position_embeddings=2048, rope_scaling=None, torch_dtype="bfloat16")
    common = dict(hidden_act="silu", attention_dropout=0.0, rms_norm_eps=1e-6, initializer_range=0.02,
                  max_position_embeddings=2048, rope_scaling=None, use_cache=True, use_sliding_window=False,
                  torch_dtype="bfloat16")
    if family == "qwen3":
        return dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", attention_bias=False,
                    sliding_window=None, **common)
    if family == "qwen2":
        return dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", sliding_window=32768, **common)
    raise ValueError(f"unknown family {family!r} (one of {', '.join(FAMILIES)})")


def make_config(preset: str = "tiny", family: str | None = None, **overrides: Any) -> dict[str, Any]:
    """config.json of a preset's shape for `family` (default: the preset's own, else llama)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r} (one of {', '.join(PRESETS)})")
    shape = dict(PRESETS[preset])
    family = family or shape.pop("family", "llama")   # a preset's shape also fits another family
    shape.pop("family", None)
    cfg = _base_config(family)
    cfg.update(shape)
    cfg.update({k: v for k, v in overrides.items() if v is not None})
    if family != "qwen2":   # Qwen2 writes no head_dim: it is hidden_size / heads
        cfg.setdefault("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    if family != "llama":   # every layer attends over the whole cache (no sliding window)
        cfg["max_window_layers"] = cfg["num_hidden_layers"]
    n_special = n_special_tokens(cfg["vocab_size"])
    base = cfg["vocab_size"] - n_special
    cfg["bos_token_id"] = base   # <|begin_of_text|>; Qwen's config names <|endoftext|>, which its tokenizer never adds
    # end_of_text, eom_id, eot_id; Qwen's <|im_end|>
    cfg["eos_token_id"] = [base + 1, base + 8, base + 9] if family == "llama" else base + 2
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


def make_qwen_tokenizer(vocab_size: int) -> str:
    """A byte-level BPE in tokenizer.json form laid out as Qwen's: its split regex, NFC, no BOS,
    Qwen's special tokens right after the learned vocabulary and the rest of the embedding's rows
    holding no token (Qwen pads its embedding past the tokenizer)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    n_base = vocab_size - n_special_tokens(vocab_size)
    if n_base < 256 + 16:
        raise ValueError(f"vocab_size {vocab_size} is too small for a byte-level BPE "
                         f"(need >= {256 + 16 + n_special_tokens(vocab_size)})")
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=n_base, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_corpus(), trainer)
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for i in range(len(vocab), n_base):  # a small corpus learns fewer merges than asked for
        vocab[f"<|unused_{i}|>"] = i
    added = [(t, True) for t in _QWEN_SPECIAL] + [(t, False) for t in _QWEN_PLAIN]
    spec["added_tokens"] = [dict(id=n_base + i, content=t, single_word=False, lstrip=False, rstrip=False,
                                 normalized=False, special=special) for i, (t, special) in enumerate(added)]
    return Tokenizer.from_str(json.dumps(spec)).to_str()


def _tokenizer_files(family: str, cfg: dict[str, Any]) -> dict[str, str]:
    """tokenizer.json and tokenizer_config.json (with the family's chat template, for Qwen)."""
    if family == "llama":
        return {"tokenizer.json": make_tokenizer(cfg["vocab_size"]), "tokenizer_config.json": json.dumps(dict(
            tokenizer_class="PreTrainedTokenizerFast", bos_token="<|begin_of_text|>",
            eos_token="<|end_of_text|>", model_max_length=cfg["max_position_embeddings"]), indent=2) + "\n"}
    template = QWEN3_CHAT_TEMPLATE if family == "qwen3" else QWEN25_CHAT_TEMPLATE
    return {"tokenizer.json": make_qwen_tokenizer(cfg["vocab_size"]), "tokenizer_config.json": json.dumps(dict(
        tokenizer_class="PreTrainedTokenizerFast", bos_token=None, eos_token="<|im_end|>",
        pad_token="<|endoftext|>", add_bos_token=False, chat_template=template,
        model_max_length=cfg["max_position_embeddings"]), indent=2) + "\n"}


def family_of(cfg: dict[str, Any]) -> str:
    """The family a config.json make_config wrote is of."""
    return {"LlamaForCausalLM": "llama", "Qwen3ForCausalLM": "qwen3", "Qwen2ForCausalLM": "qwen2"}[cfg["architectures"][0]]


def _tensor_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    from .config import expected_tensors, parse_config
    return expected_tensors(parse_config(cfg))


def make_model(out_dir: str | Path, preset: str = "tiny", seed: int = 0, dtype: str = "bf16",
               progress: Callable[[str, int, int], None] | None = None, **overrides: Any) -> Path:
    """Write config.json, generation_config.json, model.safetensors, tokenizer.json and
    tokenizer_config.json; `family` (llama, qwen3, qwen2) among the overrides picks the family,
    else the preset's."""
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
        if name.endswith(".bias"):
            w = 0.25 * rng.standard_normal(shape, dtype=np.float32)
        elif len(shape) == 1:
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
    family = family_of(cfg)
    eos = cfg["eos_token_id"] if family == "llama" else [cfg["eos_token_id"], cfg["bos_token_id"]]  # + <|endoftext|>
    gen = dict(bos_token_id=cfg["bos_token_id"], eos_token_id=eos, do_sample=False)
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    for name, text in _tokenizer_files(family, cfg).items():
        (out / name).write_text(text)
    return out
