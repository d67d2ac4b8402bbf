"""Qwen3 (modeling_qwen3.py): Llama's decoder with an RMSNorm over each head of q and k, after
the projection and before RoPE (q_norm, k_norm: one weight [head_dim] shared by all heads), and a
head_dim of its own (not hidden_size / heads)."""
from __future__ import annotations

from ..compiler.ir import Graph, LazyTensor
from .blocks import decoder_graph, project_qkv, rms_norm
from .config import ModelConfig


def project_qkv_normed(g: Graph, cfg: ModelConfig, p: str, a: str, xn: str) -> tuple[str, str, str]:
    q, k, v = project_qkv(g, cfg, p, a, xn)
    # query_states = self.q_norm(self.q_proj(hidden_states).view(hidden_shape))
    qn = rms_norm(g, cfg, q, p + "self_attn.q_norm.weight", a + "q_norm")
    # key_states = self.k_norm(self.k_proj(hidden_states).view(hidden_shape))
    kn = rms_norm(g, cfg, k, p + "self_attn.k_norm.weight", a + "k_norm")
    return qn, kn, v


def build_graph(cfg: ModelConfig, weights: dict[str, LazyTensor], T: int, max_seq_len: int, name: str,
                kv_dtype: str = "f32") -> Graph:
    return decoder_graph(cfg, weights, T, max_seq_len, name, kv_dtype, project_qkv_normed)
