"""Llama 3.x (modeling_llama.py), the family every other one extends, and the models package's
entry point: load_model (loader.py) and build_graphs, which builds a model's two op graphs
(prefill of up to T tokens, 1-token decode) with its family's builder (BUILDERS)."""
from __future__ import annotations

from typing import Callable

from ..compiler.ir import Graph, LazyTensor
from . import qwen2, qwen3
from .blocks import decoder_graph, project_qkv
from .config import LlamaConfig, ModelConfig, ModelError, expected_tensors, load_config, read_json  # noqa: F401 (re-exported)
from .loader import (FOLDER_FILES, NO_TOKENIZER, LlamaModel, Model, check_tokenizer, check_weights,  # noqa: F401
                     input_files, load_gguf, load_hf_folder, load_model)
from .safetensors_io import TensorRef

Builder = Callable[[ModelConfig, dict[str, LazyTensor], int, int, str, str], Graph]


def build_llama_graph(cfg: ModelConfig, weights: dict[str, LazyTensor], T: int, max_seq_len: int, name: str,
                      kv_dtype: str = "f32") -> Graph:
    """Llama's q, k and v are plain projections of the normed input."""
    return decoder_graph(cfg, weights, T, max_seq_len, name, kv_dtype, project_qkv)


# ModelConfig.architecture (models/families.py) -> the family's graph builder
BUILDERS: dict[str, Builder] = {"llama": build_llama_graph, "qwen3": qwen3.build_graph, "qwen2": qwen2.build_graph}


def build_graph(cfg: ModelConfig, weights: dict[str, LazyTensor], T: int, max_seq_len: int,
                name: str, kv_dtype: str = "f32") -> Graph:
    """The forward pass of cfg's family for up to T tokens, writing K/V at n_past and attending causally."""
    return BUILDERS[cfg.architecture](cfg, weights, T, max_seq_len, name, kv_dtype)


def _weights(tensors: dict[str, TensorRef]) -> dict[str, LazyTensor]:
    # a GGUF tensor in a format llmrs has no kernels for names it (source_format); it loads as f32
    return {n: LazyTensor(r.shape, r.dtype, r.load, getattr(r, "source_format", None)) for n, r in tensors.items()}


def build_graphs(model: Model, prefill_T: int = 128, max_seq_len: int | None = None,
                 kv_dtype: str = "f32") -> tuple[Graph, Graph]:
    """(prefill, decode) sharing parameter names and KV-cache state names."""
    cfg = model.config
    max_seq_len = max_seq_len or min(cfg.max_position_embeddings, 2048)
    if prefill_T < 1 or max_seq_len < 1:
        raise ModelError(f"prefill chunk ({prefill_T}) and max sequence length ({max_seq_len}) must be positive")
    w = _weights(model.tensors)
    return (build_graph(cfg, w, prefill_T, max_seq_len, "prefill", kv_dtype),
            build_graph(cfg, w, 1, max_seq_len, "decode", kv_dtype))
