"""verify pass: a well-formed graph passes through untouched; a broken one is refused naming the op."""

import numpy as np
import pytest

from llmrs.compiler.ir import IRError
from llmrs.compiler.passes.verify import verify
from llmrs.models.llama import build_graphs, load_model

from ..conftest import rel_err, run_steps


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
