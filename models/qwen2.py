"""Qwen2 / Qwen2.5 (modeling_qwen2.py): Llama's decoder with biases on the q, k and v projections
(o_proj has none)."""
from __future__ import annotations

from ..compiler.ir import Graph, LazyTensor
from .blocks import decoder_graph, project_qkv
from .config import ModelConfig


def project_qkv_biased(g: Graph, cfg: ModelConfig, p: str, a: str, xn: str) -> tuple[str, str, str]:
    # self.q_proj = nn.Linear(hidden_size, num_attention_heads * head_dim, bias=True), k and v alike
    return project_qkv(g, cfg, p, a, xn, bias=True)


def build_graph(cfg: ModelConfig, weights: dict[str, LazyTensor], T: int, max_seq_len: int, name: str,
                kv_dtype: str = "f32") -> Graph:
    return decoder_graph(cfg, weights, T, max_seq_len, name, kv_dtype, project_qkv_biased)
