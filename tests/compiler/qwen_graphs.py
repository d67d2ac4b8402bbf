"""Qwen3- and Qwen2-shaped prefill / decode graphs with random weights, built op by op here (as
HF's modeling_qwen3.py / modeling_qwen2.py run them) for the compiler's tests: per-head q/k norms
before RoPE (Qwen3), q/k/v biases (Qwen2), head_dim apart from hidden / heads."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from llmrs.compiler.ir import Graph, LazyTensor
from llmrs.models.config import LlamaConfig


@dataclass(frozen=True)
class QwenShape:
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 48          # heads * head_dim != hidden
    intermediate: int = 96
    layers: int = 2
    vocab: int = 160
    qk_norm: bool = True        # Qwen3
    bias: bool = False          # Qwen2: q, k, v projections
    tied: bool = False
    eps: float = 1e-6
    theta: float = 1000000.0

    @property
    def config(self) -> LlamaConfig:
        return LlamaConfig(self.vocab, self.hidden, self.intermediate, self.layers, self.heads, self.kv_heads,
                           self.head_dim, self.eps, self.theta, None, 4096, self.tied)


QWEN3 = QwenShape()                                                    # GQA 4:2, head_dim 48
QWEN2 = QwenShape(heads=6, kv_heads=1, head_dim=32, qk_norm=False, bias=True, tied=True)   # MQA


def tensor_shapes(s: QwenShape) -> dict[str, tuple[int, ...]]:
    d, hd, f = s.hidden, s.head_dim, s.intermediate
    shapes = {"model.embed_tokens.weight": (s.vocab, d), "model.norm.weight": (d,)}
    if not s.tied:
        shapes["lm_head.weight"] = (s.vocab, d)
    for i in range(s.layers):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
                       p + "self_attn.q_proj.weight": (s.heads * hd, d),
                       p + "self_attn.k_proj.weight": (s.kv_heads * hd, d),
                       p + "self_attn.v_proj.weight": (s.kv_heads * hd, d),
                       p + "self_attn.o_proj.weight": (d, s.heads * hd),
                       p + "mlp.gate_proj.weight": (f, d), p + "mlp.up_proj.weight": (f, d),
                       p + "mlp.down_proj.weight": (d, f)})
        if s.qk_norm:
            shapes.update({p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)})
        if s.bias:
            shapes.update({p + f"self_attn.{x}_proj.bias": (n,)
                           for x, n in (("q", s.heads * hd), ("k", s.kv_heads * hd), ("v", s.kv_heads * hd))})
    return shapes


def random_weights(s: QwenShape, seed: int = 0) -> dict[str, LazyTensor]:
    """Matrices N(0, 1/K) in bf16 (as checkpoints store them), norm weights 1 + N(0, 0.2) in bf16,
    biases N(0, 0.5) in f32 (the IR's bias dtype): none zero, no norm weight all ones."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in tensor_shapes(s).items():
        if name.endswith(".bias"):
            out[name] = LazyTensor.of((0.5 * rng.standard_normal(shape)).astype(np.float32), "f32")
            continue
        if len(shape) == 1:
            w = 1.0 + 0.2 * rng.standard_normal(shape)
        else:
            std = 2.0 / math.sqrt(s.hidden) if name in ("model.embed_tokens.weight", "lm_head.weight") else 1 / math.sqrt(shape[1])
            w = std * rng.standard_normal(shape)
        bits = (w.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
        out[name] = LazyTensor.of(bits, "bf16")
    return out


def build_graph(s: QwenShape, weights: dict[str, LazyTensor], T: int, max_seq_len: int, name: str,
                kv_dtype: str = "f32") -> Graph:
    d, hd, h, kvh, f = s.hidden, s.head_dim, s.heads, s.kv_heads, s.intermediate
    g = Graph(name, T, weights=dict(weights), meta={"config": s.config.to_json(), "max_seq_len": max_seq_len})
    for pname, lt in weights.items():
        g.add_value(pname, lt.shape, lt.dtype, kind="param")
    g.inputs = [g.add_value("tokens", (T,), "i32", kind="input")]
    act = lambda n, *shape: g.add_value(n, shape, "f32")  # noqa: E731
    x = act("x.embed", T, d)
    g.add_op("embedding", ["model.embed_tokens.weight", "tokens"], [x])
    rope = dict(head_dim=hd, theta=s.theta, scaling=None)
    score_ctl = g.add_value("cache.score_ctl", (2,), "i32", kind="state")
    for i in range(s.layers):
        p, a = f"model.layers.{i}.", f"l{i}."
        k_cache = g.add_value(f"cache.k.{i}", (max_seq_len, kvh, hd), kv_dtype, kind="state")
        v_cache = g.add_value(f"cache.v.{i}", (max_seq_len, kvh, hd), kv_dtype, kind="state")
        scores = g.add_value(f"cache.scores.{i}", (kvh, max_seq_len), "f32", kind="state")
        xn = act(a + "attn_norm", T, d)
        g.add_op("rms_norm", [x, p + "input_layernorm.weight"], [xn], eps=s.eps)
        proj = {}
        for x_, n in (("q", h), ("k", kvh), ("v", kvh)):
            proj[x_] = act(a + x_, T, n * hd)
            bias = [f"{p}self_attn.{x_}_proj.bias"] if s.bias else []
            g.add_op("matmul", [xn, f"{p}self_attn.{x_}_proj.weight", *bias], [proj[x_]])
        q, k = proj["q"], proj["k"]
        if s.qk_norm:   # query_states = self.q_norm(self.q_proj(hidden_states).view(hidden_shape))
            q, k = act(a + "q_norm", T, h * hd), act(a + "k_norm", T, kvh * hd)
            g.add_op("rms_norm", [proj["q"], p + "self_attn.q_norm.weight"], [q], eps=s.eps)
            g.add_op("rms_norm", [proj["k"], p + "self_attn.k_norm.weight"], [k], eps=s.eps)
        qr, kr = act(a + "q_rope", T, h * hd), act(a + "k_rope", T, kvh * hd)
        g.add_op("rope", [q], [qr], n_heads=h, **rope)
        g.add_op("rope", [k], [kr], n_heads=kvh, **rope)
        kc = g.add_value(a + "k_cache", (max_seq_len, kvh, hd), kv_dtype, alias=k_cache)
        vc = g.add_value(a + "v_cache", (max_seq_len, kvh, hd), kv_dtype, alias=v_cache)
        g.add_op("kv_store", [kr, k_cache], [kc])
        g.add_op("kv_store", [proj["v"], v_cache], [vc])
        o = act(a + "attn", T, h * hd)
        scores_out = g.add_value(a + "scores", (kvh, max_seq_len), "f32", alias=scores)
        g.add_op("attention", [qr, kc, vc, scores, score_ctl], [o, scores_out], n_heads=h, n_kv_heads=kvh,
                 head_dim=hd, scale=1.0 / math.sqrt(hd))
        o_proj, x_attn = act(a + "o_proj", T, d), act(a + "x_attn", T, d)
        g.add_op("matmul", [o, p + "self_attn.o_proj.weight"], [o_proj])
        g.add_op("add", [x, o_proj], [x_attn])
        xn2 = act(a + "mlp_norm", T, d)
        g.add_op("rms_norm", [x_attn, p + "post_attention_layernorm.weight"], [xn2], eps=s.eps)
        gate, up, hmid = act(a + "gate", T, f), act(a + "up", T, f), act(a + "swiglu", T, f)
        g.add_op("matmul", [xn2, p + "mlp.gate_proj.weight"], [gate])
        g.add_op("matmul", [xn2, p + "mlp.up_proj.weight"], [up])
        g.add_op("silu_mul", [gate, up], [hmid])
        down, x_out = act(a + "down", T, d), act(a + "x_out", T, d)
        g.add_op("matmul", [hmid, p + "mlp.down_proj.weight"], [down])
        g.add_op("add", [x_attn, down], [x_out])
        x = x_out
    xf = act("x.final_norm", T, d)
    g.add_op("rms_norm", [x, "model.norm.weight"], [xf], eps=s.eps)
    logits = act("logits", T, s.vocab)
    g.add_op("matmul", [xf, "model.embed_tokens.weight" if s.tied else "lm_head.weight"], [logits])
    g.outputs = [logits]
    return g.verify()


def build_graphs(s: QwenShape, T: int = 8, max_seq_len: int = 64, kv_dtype: str = "f32",
                 seed: int = 0) -> tuple[Graph, Graph]:
    """(prefill of up to T tokens, decode) sharing weights and KV-cache state names."""
    w = random_weights(s, seed)
    return build_graph(s, w, T, max_seq_len, "prefill", kv_dtype), build_graph(s, w, 1, max_seq_len, "decode", kv_dtype)
