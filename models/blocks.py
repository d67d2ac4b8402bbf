"""The blocks every family's graph is made of, op for op as transformers' modeling_llama.py (Qwen2
and Qwen3 reuse Llama's decoder layer, MLP and norms): a family differs only in how its attention
projects q, k and v (`Projection`), which its own module supplies.

Two graphs come from one builder: prefill of up to T tokens and 1-token decode, sharing parameter
names (their safetensors names) and KV-cache state names.
"""
from __future__ import annotations

import math
from typing import Callable

import numpy as np

from ..compiler import quant
from ..compiler.ir import Graph, LazyTensor
from .config import ModelConfig

# (graph, cfg, layer prefix "model.layers.N.", activation prefix "lN.", normed input) -> (q, k, v):
# q [T, H*hd] and k [T, KVH*hd] ready for RoPE, v [T, KVH*hd]
Projection = Callable[[Graph, ModelConfig, str, str, str], tuple[str, str, str]]


def _as_f32(lt: LazyTensor) -> LazyTensor:
    """A weight as f32 on load (the IR takes a matmul bias in f32 whatever the checkpoint stores)."""
    if lt.dtype == "f32":
        return lt

    def make() -> np.ndarray:
        raw = lt.load()
        if lt.dtype == "bf16":
            return (raw.astype(np.uint32) << 16).view(np.float32)
        if lt.dtype in quant.BLOCK_BYTES:
            return quant.dequantize(raw, lt.dtype).astype(np.float32)
        return raw.astype(np.float32)
    return LazyTensor(lt.shape, "f32", make, lt.source_format)


def act(g: Graph, name: str, *shape: int) -> str:
    """An f32 activation [*shape]."""
    return g.add_value(name, shape, "f32")


def rms_norm(g: Graph, cfg: ModelConfig, x: str, weight: str, out: str) -> str:
    """RMSNorm of x with weight [G]: the whole row (G = D) or each head (G = head_dim)."""
    act(g, out, *g.values[x].shape)
    g.add_op("rms_norm", [x, weight], [out], eps=cfg.rms_norm_eps)
    return out


def linear(g: Graph, x: str, weight: str, out: str, bias: str | None = None) -> str:
    """nn.Linear: x @ weight.T (+ bias)."""
    act(g, out, g.values[x].shape[0], g.values[weight].shape[0])
    g.add_op("matmul", [x, weight] + ([bias] if bias else []), [out])
    return out


def project_qkv(g: Graph, cfg: ModelConfig, p: str, a: str, xn: str, bias: bool = False) -> tuple[str, str, str]:
    """q_proj, k_proj, v_proj (with their biases where the family has them)."""
    return tuple(linear(g, xn, f"{p}self_attn.{n}_proj.weight", a + n, f"{p}self_attn.{n}_proj.bias" if bias else None)
                 for n in ("q", "k", "v"))


def self_attention(g: Graph, cfg: ModelConfig, i: int, xn: str, project: Projection, max_seq_len: int,
                   kv_dtype: str, score_ctl: str) -> str:
    """The attention block after its input norm: q/k/v, RoPE, the KV-cache store, causal
    attention over the cache, o_proj. Returns o_proj's output [T, D]."""
    d, hd = cfg.hidden_size, cfg.head_dim
    h, kvh, T = cfg.num_attention_heads, cfg.num_key_value_heads, g.T
    p, a = f"model.layers.{i}.", f"l{i}."
    q, k, v = project(g, cfg, p, a, xn)
    # query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
    rope_attrs = dict(n_heads=h, head_dim=hd, theta=cfg.rope_theta, scaling=cfg.rope_scaling)
    qr, kr = act(g, a + "q_rope", T, h * hd), act(g, a + "k_rope", T, kvh * hd)
    g.add_op("rope", [q], [qr], **rope_attrs)
    g.add_op("rope", [k], [kr], **{**rope_attrs, "n_heads": kvh})
    # key_states, value_states = past_key_values.update(key_states, value_states, ...)
    k_cache, v_cache = f"cache.k.{i}", f"cache.v.{i}"
    kc = g.add_value(a + "k_cache", (max_seq_len, kvh, hd), kv_dtype, alias=k_cache)
    vc = g.add_value(a + "v_cache", (max_seq_len, kvh, hd), kv_dtype, alias=v_cache)
    g.add_op("kv_store", [kr, k_cache], [kc])
    g.add_op("kv_store", [v, v_cache], [vc])
    o = act(g, a + "attn", T, h * hd)
    scores_out = g.add_value(a + "scores", (kvh, max_seq_len), "f32", alias=f"cache.scores.{i}")
    g.add_op("attention", [qr, kc, vc, f"cache.scores.{i}", score_ctl], [o, scores_out], n_heads=h,
             n_kv_heads=kvh, head_dim=hd, scale=1.0 / math.sqrt(hd))
    return linear(g, o, p + "self_attn.o_proj.weight", a + "o_proj")


def mlp(g: Graph, cfg: ModelConfig, i: int, xn: str) -> str:
    """down_proj(act_fn(gate_proj(x)) * up_proj(x)) -> [T, D]."""
    p, a = f"model.layers.{i}.", f"l{i}."
    gate = linear(g, xn, p + "mlp.gate_proj.weight", a + "gate")
    up = linear(g, xn, p + "mlp.up_proj.weight", a + "up")
    hmid = act(g, a + "swiglu", g.T, cfg.intermediate_size)
    g.add_op("silu_mul", [gate, up], [hmid])
    return linear(g, hmid, p + "mlp.down_proj.weight", a + "down")


def decoder_layer(g: Graph, cfg: ModelConfig, i: int, x: str, project: Projection, max_seq_len: int,
                  kv_dtype: str, score_ctl: str) -> str:
    """One decoder layer (LlamaDecoderLayer.forward): x [T, D] -> x [T, D]."""
    p, a = f"model.layers.{i}.", f"l{i}."
    for name in ("k", "v"):
        g.add_value(f"cache.{name}.{i}", (max_seq_len, cfg.num_key_value_heads, cfg.head_dim), kv_dtype, kind="state")
    g.add_value(f"cache.scores.{i}", (cfg.num_key_value_heads, max_seq_len), "f32", kind="state")
    # hidden_states = self.input_layernorm(hidden_states)
    xn = rms_norm(g, cfg, x, p + "input_layernorm.weight", a + "attn_norm")
    o_proj = self_attention(g, cfg, i, xn, project, max_seq_len, kv_dtype, score_ctl)
    # hidden_states = residual + hidden_states
    x_attn = act(g, a + "x_attn", g.T, cfg.hidden_size)
    g.add_op("add", [x, o_proj], [x_attn])
    # hidden_states = self.post_attention_layernorm(hidden_states)
    xn2 = rms_norm(g, cfg, x_attn, p + "post_attention_layernorm.weight", a + "mlp_norm")
    down = mlp(g, cfg, i, xn2)
    x_out = act(g, a + "x_out", g.T, cfg.hidden_size)
    g.add_op("add", [x_attn, down], [x_out])
    return x_out


def decoder_graph(cfg: ModelConfig, weights: dict[str, LazyTensor], T: int, max_seq_len: int, name: str,
                  kv_dtype: str, project: Projection) -> Graph:
    """The forward pass for up to T tokens, writing K/V at n_past and attending causally."""
    weights = {n: _as_f32(lt) if n.endswith(".bias") else lt for n, lt in weights.items()}
    g = Graph(name, T, weights=dict(weights), meta={"config": cfg.to_json(), "max_seq_len": max_seq_len})
    for pname, lt in weights.items():
        g.add_value(pname, lt.shape, lt.dtype, kind="param")
    g.inputs = [g.add_value("tokens", (T,), "i32", kind="input")]
    x = act(g, "x.embed", T, cfg.hidden_size)
    g.add_op("embedding", ["model.embed_tokens.weight", "tokens"], [x])
    # attention scores for KV-cache eviction (runtime/kv): which rows add to them, shared by all
    # layers and set by the runtime; zero (the reset state) means none
    score_ctl = g.add_value("cache.score_ctl", (2,), "i32", kind="state")
    for i in range(cfg.num_hidden_layers):
        x = decoder_layer(g, cfg, i, x, project, max_seq_len, kv_dtype, score_ctl)
    xf = rms_norm(g, cfg, x, "model.norm.weight", "x.final_norm")
    head = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
    g.outputs = [linear(g, xf, head, "logits")]
    return g
