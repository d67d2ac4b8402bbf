"""quantize pass: weights become the asked formats, bytes exactly GGML's, data made lazily.

Tolerances (max |a - b| / max |b| over all logits of a prefill and 3 decode steps):
  f32 weights: identical to the float graph (golden-a is stored f32, golden-b bf16: both exact)
  f16 weights: within 2e-3 of the float graph (f16 rounding of each weight)
  q8_0 / q4_0: within 5e-2 of the float graph run on weights rounded through the same format;
               what is left is the Q8_0 rounding of activations GGML's dot products add (~2%)
  q8_0 alone:  within 6e-2 of the unrounded float graph
"""

import numpy as np
import pytest

from llmrs.compiler import quant
from llmrs.compiler.ir import IRError, LazyTensor
from llmrs.compiler.passes.fuse import fuse
from llmrs.compiler.passes.quantize import quantize
from llmrs.models.config import parse_config
from llmrs.models.llama import build_graph, build_graphs, load_model
from llmrs.models.tiny import make_config

from ..conftest import rel_err, run_steps, unloadable_weights


def _graphs(model_dir):
    return build_graphs(load_model(model_dir), prefill_T=8, max_seq_len=64)


def _logits(prefill, decode, seed=2):
    rng = np.random.default_rng(seed)
    vocab = prefill.values["logits"].shape[1]
    prompt, steps = rng.integers(0, vocab, 13, dtype=np.int32), rng.integers(0, vocab, 3, dtype=np.int32)
    out_p, out_d = run_steps(prefill, decode, prompt, steps)
    return np.concatenate([out_p, np.stack(out_d)])


def _as_f32(stored: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bf16":
        return (stored.astype(np.uint32) << 16).view(np.float32)
    return stored.astype(np.float32)


def _rounded_through(g, fmt):
    """g with every 2-D weight replaced by its f32 value after a round trip through fmt."""
    g = g.copy()
    for name, v in g.values.items():
        if v.kind == "param" and len(v.shape) == 2:
            x = _as_f32(g.weights[name].load(), v.dtype)
            y = quant.dequantize(quant.quantize(x, fmt), fmt) if fmt in quant.BLOCK_BYTES \
                else x.astype(np.float16).astype(np.float32)
            g.weights[name], v.dtype = LazyTensor.of(y, "f32"), "f32"
    return g


def test_f32_weights_give_the_float_graphs_logits(golden):
    p, d = _graphs(golden[0])
    assert rel_err(_logits(quantize(p, "f32"), quantize(d, "f32")), _logits(p, d)) == 0


def test_f16_weights_are_within_2e_3_of_the_float_graph(golden):
    p, d = _graphs(golden[0])
    assert rel_err(_logits(quantize(p, "f16"), quantize(d, "f16")), _logits(p, d)) < 2e-3


def test_q8_0_weights_are_within_6e_2_of_the_float_graph(golden):
    p, d = _graphs(golden[0])
    assert rel_err(_logits(quantize(p, "q8_0"), quantize(d, "q8_0")), _logits(p, d)) < 6e-2


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
def test_block_formats_match_the_float_graph_on_rounded_weights(golden, fmt):
    p, d = _graphs(golden[0])
    got = _logits(quantize(p, fmt), quantize(d, fmt))
    assert rel_err(got, _logits(_rounded_through(p, fmt), _rounded_through(d, fmt))) < 5e-2


@pytest.mark.parametrize("fmt", ["q4_0", "q8_0", "f16"])
def test_every_weight_holds_the_bytes_of_its_source_in_the_format(golden, fmt):
    source = _graphs(golden[0])[1]
    g = quantize(source, fmt).verify()
    matmul_weights = {op.inputs[1] for op in g.ops if op.kind == "matmul"}
    assert len(matmul_weights) == 7 * 2 + 1
    for name in matmul_weights | {"model.embed_tokens.weight"}:
        v = g.values[name]
        x = _as_f32(source.weights[name].load(), source.values[name].dtype)
        want = quant.quantize(x, fmt) if fmt in quant.BLOCK_BYTES else x.astype(np.float16)
        got = g.weights[name].load()
        assert v.dtype == fmt and got.dtype == want.dtype and np.array_equal(got, want), name


def test_norm_weights_become_f32_with_the_same_values(golden):
    source = _graphs(golden[0])[1]
    g = quantize(source, "q4_0")
    norms = [n for n, v in g.values.items() if v.kind == "param" and len(v.shape) == 1]
    assert len(norms) == 2 * 2 + 1
    for name in norms:
        want = _as_f32(source.weights[name].load(), source.values[name].dtype)
        got = g.weights[name].load()
        assert g.values[name].dtype == "f32" and got.dtype == np.float32 and np.array_equal(got, want)


def test_a_tied_head_in_another_format_gets_its_own_const_copy():
    p, d = _graphs("tests/data/golden-a")             # tied: one table for embedding and head
    qp, qd = (quantize(g, "f32", embedding="f16", lm_head="q8_0").verify() for g in (p, d))
    head = qd.ops[-1]
    assert head.inputs[1] == "lm_head.weight" and qd.values["lm_head.weight"].kind == "const"
    assert qd.values["lm_head.weight"].dtype == "q8_0"
    assert qd.values["model.embed_tokens.weight"].dtype == "f16"
    table = d.weights["model.embed_tokens.weight"].load().astype(np.float32)
    assert np.array_equal(qd.weights["lm_head.weight"].load(), quant.quantize(table, "q8_0"))
    assert np.array_equal(qd.weights["model.embed_tokens.weight"].load(), table.astype(np.float16))
    assert rel_err(_logits(qp, qd), _logits(p, d)) < 6e-2


def test_a_tied_head_in_the_same_format_shares_the_table():
    g = quantize(_graphs("tests/data/golden-a")[1], "q8_0")
    assert g.ops[-1].inputs[1] == "model.embed_tokens.weight" and "lm_head.weight" not in g.values


def test_untied_embedding_and_head_take_their_own_formats():
    p, d = _graphs("tests/data/golden-b")
    qp, qd = (quantize(g, "q4_0", embedding="f32", lm_head="q8_0").verify() for g in (p, d))
    assert qd.values["model.embed_tokens.weight"].dtype == "f32"
    assert qd.values["lm_head.weight"].dtype == "q8_0"
    assert qd.values["model.layers.0.mlp.up_proj.weight"].dtype == "q4_0"
    got = _logits(qp, qd)
    assert np.all(np.isfinite(got)) and rel_err(got, _logits(p, d)) < 0.5


def test_quantize_before_or_after_fuse_gives_the_same_bytes_and_logits(golden):
    # norm_weight_fold multiplies float weights by the norm's, which would then be quantized:
    # the pipeline quantizes first, and the orders agree with that rule off
    p, d = _graphs(golden[0])
    before = [fuse(quantize(g, "q4_0"), disabled=["norm_weight_fold"]) for g in (p, d)]
    after = [quantize(fuse(g, disabled=["norm_weight_fold"]), "q4_0") for g in (p, d)]
    stacked = "model.layers.1.self_attn.qkv_proj.weight"
    assert np.array_equal(before[1].weights[stacked].load(), after[1].weights[stacked].load())
    assert rel_err(_logits(*after), _logits(*before)) < 1e-6


def test_quantizing_the_1b_graph_loads_no_weight_data(llama_1b_graphs):
    decode = llama_1b_graphs[1]
    g = quantize(decode, "q4_0").verify()     # the weights raise if anything loads them
    assert g.values["model.embed_tokens.weight"].dtype == "q4_0"
    assert g.values["model.layers.15.mlp.down_proj.weight"].dtype == "q4_0"
    assert g.values["model.norm.weight"].dtype == "f32"


def test_rows_that_are_not_whole_blocks_are_refused_naming_the_tensor_and_flag():
    cfg_json = make_config("golden-a", hidden_size=48)
    g = build_graph(parse_config(cfg_json), unloadable_weights(cfg_json), 1, 16, "decode")
    with pytest.raises(IRError, match=r"weight 'model.layers.0.self_attn.q_proj.weight' \[48, 48\].*--weights"):
        quantize(g, "q4_0", embedding="f16", lm_head="f16")
    with pytest.raises(IRError, match=r"weight 'model.embed_tokens.weight' \[384, 48\].*--embedding"):
        quantize(g, "f16", embedding="q8_0")
    assert quantize(g, "f16").values["model.layers.0.self_attn.q_proj.weight"].dtype == "f16"


def test_an_unknown_format_is_refused_naming_the_flag(golden):
    with pytest.raises(IRError, match=r"--lm-head 'q5_1': choose one of q4_0, q4_1, q8_0, f16, f32, native"):
        quantize(_graphs(golden[0])[1], "q4_0", lm_head="q5_1")
