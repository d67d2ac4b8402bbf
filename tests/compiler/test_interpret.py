"""The interpreter: token-by-token decoding equals one prefill; precision modes; cache limits."""
import numpy as np
import pytest

from llmrs.compiler.interpret import Interpreter, KVCacheFull
from llmrs.models.llama import build_graphs, load_model

from ..conftest import DATA, rel_err, run_steps


@pytest.mark.parametrize("name", ["golden-a", "golden-b"])
def test_decoding_token_by_token_equals_one_prefill(name):
    prefill, decode = build_graphs(load_model(DATA / name), prefill_T=40, max_seq_len=64)
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 300, size=24).astype(np.int32)
    whole = Interpreter(prefill).run({"tokens": tokens}, Interpreter(prefill).new_state(), 0)["logits"]
    idec = Interpreter(decode)
    state = idec.new_state()
    rows = [idec.run({"tokens": tokens[i:i + 1]}, state, n_past=i)["logits"][0] for i in range(len(tokens))]
    assert rel_err(np.stack(rows), whole) <= 1e-5


def test_float64_mode_agrees_with_float32():
    prefill, decode = build_graphs(load_model(DATA / "golden-b"), prefill_T=16, max_seq_len=32)
    tokens = np.arange(5, 21, dtype=np.int32)
    l32, s32 = run_steps(prefill, decode, tokens, tokens[:3])
    l64, s64 = run_steps(prefill, decode, tokens, tokens[:3], dtype=np.float64)
    assert l64.dtype == np.float64
    assert rel_err(l32, l64) <= 1e-5
    assert rel_err(np.stack(s32), np.stack(s64)) <= 1e-5


def test_rope_position_is_independent_of_cache_slot():
    """start_pos (RoPE) and n_past (slot) differ after eviction: shifting both by the same
    amount with an empty prefix must not change attention among the new tokens."""
    prefill, _ = build_graphs(load_model(DATA / "golden-a"), prefill_T=8, max_seq_len=32)
    tokens = np.array([3, 50, 7, 99, 120], np.int32)
    ip = Interpreter(prefill)
    base = ip.run({"tokens": tokens}, ip.new_state(), n_past=0, start_pos=0)["logits"]
    moved = ip.run({"tokens": tokens}, ip.new_state(), n_past=0, start_pos=17)["logits"]
    # RoPE is relative: a common offset in every position leaves q.k unchanged
    assert rel_err(moved, base) <= 1e-4


def test_kv_cache_overflow_is_a_clear_error():
    prefill, _ = build_graphs(load_model(DATA / "golden-a"), prefill_T=8, max_seq_len=8)
    ip = Interpreter(prefill)
    state = ip.new_state()
    ip.run({"tokens": np.arange(1, 7, dtype=np.int32)}, state, n_past=0)
    with pytest.raises(KVCacheFull, match="holds 8 tokens"):
        ip.run({"tokens": np.arange(1, 7, dtype=np.int32)}, state, n_past=6)


def test_out_of_range_token_is_refused():
    prefill, _ = build_graphs(load_model(DATA / "golden-a"), prefill_T=8, max_seq_len=8)
    ip = Interpreter(prefill)
    with pytest.raises(ValueError, match="token id out of range"):
        ip.run({"tokens": np.array([1, 384], np.int32)}, ip.new_state(), n_past=0)


def _scores_by_hand(q, k, n_past, first, h, kvh, hd, base):
    """Per query row at slot >= first and per head: softmax(q . k * hd^-0.5) over the row's
    visible slots, added to its KV head's row (float64 loops)."""
    out = base.astype(np.float64)
    n, group = q.shape[0], h // kvh
    for t in range(n):
        if n_past + t < first:
            continue
        length = n_past + t + 1
        for head in range(h):
            s = np.array([q[t, head * hd:(head + 1) * hd].astype(np.float64) @ k[j, head // group] for j in range(length)])
            p = np.exp(s / np.sqrt(hd) - np.max(s / np.sqrt(hd)))
            out[head // group, :length] += p / p.sum()
    return out


@pytest.mark.parametrize("first", [0, 9, 1000])
def test_attention_adds_softmax_weights_per_kv_head_from_the_first_scored_slot(first):
    """The eviction scores of compiler/ir.py's attention: a prefill step of 6 rows after 5
    cached slots; rows at slots >= first add (none when first is past the step)."""
    prefill, _ = build_graphs(load_model(DATA / "golden-b"), prefill_T=8, max_seq_len=16)
    op = next(op for op in prefill.ops if op.kind == "attention")
    h, kvh, hd = op.attrs["n_heads"], op.attrs["n_kv_heads"], op.attrs["head_dim"]
    rng = np.random.default_rng(5)
    q = rng.standard_normal((6, h * hd)).astype(np.float32)
    k = rng.standard_normal((16, kvh, hd)).astype(np.float32)
    v = rng.standard_normal((16, kvh, hd)).astype(np.float32)
    base = rng.random((kvh, 16)).astype(np.float32) + 0.1
    ctl = np.array([1, first], np.int32)
    from llmrs.compiler.interpret import OPS, Step
    it = Interpreter(prefill)
    _, scores = OPS["attention"](it, op, Step(6, 5, 40), q, k, v, base.copy(), ctl)
    want = _scores_by_hand(q, k, 5, first, h, kvh, hd, base)
    assert rel_err(scores, want) <= 1e-6
    added = (want - base).sum(axis=0)    # every scored row adds one unit of weight per query head
    assert np.isclose(added.sum(), h * max(0, min(6, 11 - first)))
    _, off = OPS["attention"](it, op, Step(6, 5, 40), q, k, v, base.copy(), np.array([0, 0], np.int32))
    np.testing.assert_array_equal(off, base)   # control off: untouched
