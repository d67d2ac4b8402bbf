"""IR: verify() names the faulty op; nx() mirrors the data flow; str() reads like a listing."""

import networkx as nx
import numpy as np
import pytest

from llmrs.compiler.ir import Graph, IRError, LazyTensor, nbytes
from llmrs.models.llama import build_graphs, load_model

from ..conftest import DATA


def _small() -> Graph:
    g = Graph("t", T=4)
    g.weights["w"] = LazyTensor.of(np.ones((6, 8), np.float32), "f32")
    g.add_value("w", (6, 8), "f32", kind="param")
    g.inputs = [g.add_value("x", (4, 8), "f32", kind="input")]
    g.add_value("y", (4, 6), "f32")
    g.add_value("z", (4, 6), "f32")
    g.add_op("matmul", ["x", "w"], ["y"])
    g.add_op("silu", ["y"], ["z"])
    g.outputs = ["z"]
    return g


def test_a_well_formed_graph_verifies():
    assert _small().verify() is not None


def test_wrong_output_shape_names_the_op():
    g = _small()
    g.values["y"].shape = (4, 7)
    with pytest.raises(IRError, match=r"op matmul_0 \(matmul\): output 'y' is f32\[4, 7\] but the inputs give f32\[4, 6\]"):
        g.verify()


def test_inner_dimension_mismatch_names_the_weight():
    g = _small()
    g.values["x"].shape = (4, 9)
    with pytest.raises(IRError, match=r"matmul_0 \(matmul\): 'x' has 9 columns but weight 'w'"):
        g.verify()


def test_use_before_definition_is_reported_as_a_cycle_or_misorder():
    g = _small()
    g.ops.reverse()
    with pytest.raises(IRError, match=r"op silu_1 \(silu\): input 'y' is used before it is produced"):
        g.verify()


def test_two_producers_are_refused():
    g = _small()
    g.add_op("silu", ["y"], ["z"])
    with pytest.raises(IRError, match="value 'z' has more than one producer"):
        g.verify()


def test_unknown_kind_and_dtype_are_refused():
    g = _small()
    g.ops[1].kind = "gelu"
    with pytest.raises(IRError, match="unknown kind 'gelu'"):
        g.verify()
    with pytest.raises(IRError, match="unknown dtype 'f8'"):
        g.add_value("q", (1,), "f8")


def test_param_without_data_is_refused():
    g = _small()
    del g.weights["w"]
    with pytest.raises(IRError, match="param 'w' has no weight data"):
        g.verify()


def test_quantized_sizes_follow_ggml_blocks():
    assert nbytes((10, 64), "q4_0") == 10 * 2 * 18
    assert nbytes((10, 64), "q8_0") == 10 * 2 * 34
    assert nbytes((3, 5), "bf16") == 30
    with pytest.raises(IRError, match="multiple of 32"):
        nbytes((4, 48), "q4_0")


def test_nx_view_has_one_edge_per_passed_value():
    prefill, _ = build_graphs(load_model(DATA / "golden-a"), 8, 16)
    g = prefill.nx()
    assert isinstance(g, nx.DiGraph) and nx.is_directed_acyclic_graph(g)
    assert g.number_of_nodes() == len(prefill.ops)
    order = list(nx.topological_sort(g))
    assert order[0] == prefill.ops[0].name  # the embedding feeds everything
    attn = next(op for op in prefill.ops if op.kind == "attention")
    produced = {v for v in attn.inputs if prefill.values[v].kind != "state"}   # states come from no op
    assert {d["value"] for _, _, d in g.in_edges(attn.name, data=True)} == produced == set(attn.inputs[:3])


def test_str_lists_one_op_per_line_with_types():
    prefill, decode = build_graphs(load_model(DATA / "golden-b"), 8, 16)
    text = str(decode)
    lines = text.splitlines()
    assert lines[0].startswith("graph decode (T=1, ")
    assert "%l0.q: f32[1,128] = matmul(%l0.attn_norm, %model.layers.0.self_attn.q_proj.weight)" in text
    assert "%l1.k_cache: f32[16,2,16] = kv_store(%l1.k_rope, %cache.k.1)" in text
    assert sum(1 for ln in lines if " = " in ln) == len(decode.ops)


def test_llama_1b_graphs_build_fast_and_verify(llama_1b_graphs):
    prefill, decode = llama_1b_graphs
    for g in (prefill, decode):
        g.verify()
        # per layer K, V and eviction scores, and one score control
        assert len(g.by_kind("state")) == 16 * 3 + 1 and len(g.by_kind("param")) == 146
    assert decode.values["logits"].shape == (1, 128256)
    assert prefill.values["l15.gate"].shape == (128, 8192)
    text = str(decode)
    assert "scaling={factor:32,low_freq_factor:1,high_freq_factor:4,original_max_position_embeddings:8192}" in text
