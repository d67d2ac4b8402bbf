"""The model families llmrs runs, as data: how each is named in a Hugging Face config.json and in
a GGUF file, what its attention adds to Llama's, and its tensors' names in both.

A family's graph builder is its own module (models/llama.py, qwen3.py, qwen2.py: BUILDERS in
models/llama.py); everything that reads a file (config.py, gguf_io.py) looks the family up here.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    name: str                  # ModelConfig.architecture, GGUF general.architecture and its key prefix
    label: str                 # for messages: "a Qwen3's head_dim is ..."
    hf_architecture: str       # config.json "architectures"
    model_type: str            # config.json "model_type" (read when "architectures" is absent)
    qk_norm: bool              # RMSNorm over each head of q and k after the projection, before RoPE
    qkv_bias: bool             # biases on the q, k and v projections (o has none)
    default_head_dim: int | None   # head_dim when config.json has none; None: hidden_size / heads
    gguf_qk_interleaved: bool  # llama.cpp's converter reordered Q/K rows for its RoPE (gguf_io.py)
    bias_flags: tuple[str, ...]    # config.json switches transformers honours for it that llmrs refuses
    examples: str              # what the family covers, for messages


LLAMA = Family("llama", "Llama", "LlamaForCausalLM", "llama", qk_norm=False, qkv_bias=False,
               default_head_dim=None, gguf_qk_interleaved=True, bias_flags=("attention_bias", "mlp_bias"),
               examples="Llama 2/3, SmolLM2, Mistral-style dense models")
# transformers' Qwen3Config defaults head_dim to 128 whatever the hidden size
QWEN3 = Family("qwen3", "Qwen3", "Qwen3ForCausalLM", "qwen3", qk_norm=True, qkv_bias=False,
               default_head_dim=128, gguf_qk_interleaved=False, bias_flags=("attention_bias",),
               examples="Qwen3 dense models")
# Qwen2's q/k/v biases are built into its attention, not a switch; its MLP ignores mlp_bias
QWEN2 = Family("qwen2", "Qwen2", "Qwen2ForCausalLM", "qwen2", qk_norm=False, qkv_bias=True,
               default_head_dim=None, gguf_qk_interleaved=False, bias_flags=(), examples="Qwen2, Qwen2.5")

FAMILIES: dict[str, Family] = {f.name: f for f in (LLAMA, QWEN3, QWEN2)}
BY_HF_ARCHITECTURE: dict[str, Family] = {f.hf_architecture: f for f in FAMILIES.values()}
BY_MODEL_TYPE: dict[str, Family] = {f.model_type: f for f in FAMILIES.values()}


def hf_names() -> str:
    """'LlamaForCausalLM, Qwen3ForCausalLM, Qwen2ForCausalLM': for messages."""
    return ", ".join(BY_HF_ARCHITECTURE)


def gguf_names() -> str:
    """"'llama', 'qwen3', 'qwen2' (Llama 2/3, ...; Qwen3 dense models; Qwen2, Qwen2.5)": for messages."""
    return f"{', '.join(repr(n) for n in FAMILIES)} ({'; '.join(f.examples for f in FAMILIES.values())})"


# Tensors, as (Hugging Face name, GGUF name). Every family has the global ones (the head only
# when untied) and the per-layer ones; the rest only where the family's flags say.
GLOBAL_TENSORS = (("model.embed_tokens.weight", "token_embd.weight"), ("model.norm.weight", "output_norm.weight"),
                  ("lm_head.weight", "output.weight"))
LAYER_TENSORS = (("input_layernorm.weight", "attn_norm.weight"), ("self_attn.q_proj.weight", "attn_q.weight"),
                 ("self_attn.k_proj.weight", "attn_k.weight"), ("self_attn.v_proj.weight", "attn_v.weight"),
                 ("self_attn.o_proj.weight", "attn_output.weight"),
                 ("post_attention_layernorm.weight", "ffn_norm.weight"), ("mlp.gate_proj.weight", "ffn_gate.weight"),
                 ("mlp.up_proj.weight", "ffn_up.weight"), ("mlp.down_proj.weight", "ffn_down.weight"))
QK_NORM_TENSORS = (("self_attn.q_norm.weight", "attn_q_norm.weight"), ("self_attn.k_norm.weight", "attn_k_norm.weight"))
QKV_BIAS_TENSORS = (("self_attn.q_proj.bias", "attn_q.bias"), ("self_attn.k_proj.bias", "attn_k.bias"),
                    ("self_attn.v_proj.bias", "attn_v.bias"))
# every per-layer tensor any family has: a name outside this set is no family's
ALL_LAYER_TENSORS = LAYER_TENSORS + QK_NORM_TENSORS + QKV_BIAS_TENSORS
