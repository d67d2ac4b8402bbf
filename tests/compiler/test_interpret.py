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
