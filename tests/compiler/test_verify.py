"""verify pass: a well-formed graph passes through untouched; a broken one is refused naming the op."""

from dataclasses import replace

import numpy as np
import pytest

from llmrs.compiler.ir import IRError
from llmrs.compiler.passes.fuse import fuse
from llmrs.compiler.passes.verify import verify
from llmrs.models.llama import build_graphs, load_model

from ..conftest import rel_err, run_steps
from .qwen_graphs import QWEN3, build_graphs as build_qwen


def _graphs(model_dir):
    return build_graphs(load_model(model_dir), prefill_T=8, max_seq_len=64)


def test_verify_returns_the_graph_and_outputs_do_not_change(golden):
    model_dir, _ = golden
    prefill, decode = _graphs(model_dir)
    rng = np.random.default_rng(1)
    vocab = prefill.values["logits"].shape[1]
    prompt, steps = rng.integers(0, vocab, 13, dtype=np.int32), rng.integers(0, vocab, 3, dtype=np.int32)
    ref_p, ref_d = run_steps(prefill, decode, prompt, steps)
    vp, vd = verify(prefill), verify(decode)
    assert vp is prefill and vd is decode
    out_p, out_d = run_steps(vp, vd, prompt, steps)
    assert rel_err(out_p, ref_p) == 0 and rel_err(np.stack(out_d), np.stack(ref_d)) == 0


def test_ops_out_of_order_are_refused_naming_the_reader(golden):
    _, decode = _graphs(golden[0])
    decode.ops[1], decode.ops[2] = decode.ops[2], decode.ops[1]   # q matmul before its rms_norm
    with pytest.raises(IRError, match=r"op matmul_2 \(matmul\): input 'l0.attn_norm' is used before it is produced"):
        verify(decode)


def test_a_wrong_shape_is_refused_naming_the_op(golden):
    _, decode = _graphs(golden[0])
    decode.values["l0.q"].shape = (1, 7)
    with pytest.raises(IRError, match=r"op matmul_2 \(matmul\): output 'l0.q'"):
        verify(decode)


def test_a_value_with_two_producers_is_refused(golden):
    _, decode = _graphs(golden[0])
    decode.ops[3].outputs = ["l0.q"]     # k's matmul now also writes q
    with pytest.raises(IRError, match=r"value 'l0.q' has more than one producer"):
        verify(decode)


def _fused_qkv(**change):
    """Qwen3's fused QKV op (qk_norm, and a bias) from the fuse pass, its inputs / attrs changed."""
    d = fuse(build_qwen(replace(QWEN3, bias=True), T=4, max_seq_len=16)[1])
    op = next(op for op in d.ops if op.attrs.get("epilogue") == "rope_kv_store")
    for key, value in change.items():
        if key == "inputs":
            op.inputs = value(op.inputs)
        else:
            op.attrs[key] = value
    return d, op


def test_a_fused_qkv_op_with_qk_norm_and_bias_verifies():
    d, op = _fused_qkv()
    assert op.attrs["qk_norm"] and op.attrs["bias"] and verify(d) is d


@pytest.mark.parametrize("change,message", [
    ({"inputs": lambda ins: ins[:-1]}, r"bias 'model.layers.0.self_attn.k_norm.weight' must be f32\[384\], got bf16\[48\]"),
    ({"inputs": lambda ins: ins[:-3] + ins[-2:]}, r"extra inputs: inv_freq, k_cache, v_cache, q_norm_w, k_norm_w"),
    ({"inputs": lambda ins: ins[:-3] + ["model.norm.weight"] + ins[-2:]},
     r"per-head norm weight 'model.norm.weight' must be a float \[48\], got bf16\[64\]"),
    ({"epilogue": None}, r"attr qk_norm needs the rope_kv_store epilogue"),
])
def test_a_malformed_fused_qkv_op_is_refused_naming_what_is_wrong(change, message):
    d, op = _fused_qkv(**change)
    with pytest.raises(IRError, match=rf"op {op.name} \(fused_matmul\): {message}"):
        verify(d)
