"""fold pass: rope ops read one shared const inv_freq (Llama 3 scaling applied), outputs unchanged."""

import numpy as np

from llmrs.compiler.passes.fold import INV_FREQ, fold
from llmrs.models.llama import build_graphs, load_model
from llmrs.compiler.rope import rope_inv_freq

from ..conftest import rel_err, run_steps


def _graphs(model_dir):
    return build_graphs(load_model(model_dir), prefill_T=8, max_seq_len=64)


def test_folded_graphs_give_identical_logits(golden):
    p, d = _graphs(golden[0])
    rng = np.random.default_rng(3)
    vocab = p.values["logits"].shape[1]
    prompt, steps = rng.integers(0, vocab, 19, dtype=np.int32), rng.integers(0, vocab, 4, dtype=np.int32)
    ref_p, ref_d = run_steps(p, d, prompt, steps)
    out_p, out_d = run_steps(fold(p).verify(), fold(d).verify(), prompt, steps)
    assert rel_err(out_p, ref_p) == 0 and rel_err(np.stack(out_d), np.stack(ref_d)) == 0


def test_every_rope_reads_one_const_holding_the_scaled_inv_freq(golden):
    model = load_model(golden[0])
    cfg = model.config
    g = fold(build_graphs(model, 8, 64)[1])
    ropes = [op for op in g.ops if op.kind == "rope"]
    assert len(ropes) == 2 * cfg.num_hidden_layers and all(op.inputs[1:] == [INV_FREQ] for op in ropes)
    v = g.values[INV_FREQ]
    assert (v.kind, v.dtype, v.shape) == ("const", "f32", (cfg.head_dim // 2,))
    want = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    got = g.weights[INV_FREQ].load()
    assert got.dtype == np.float32 and np.array_equal(got, want)
    if cfg.rope_scaling:    # golden-b: llama3 scaling really changed the low frequencies
        assert not np.allclose(got, rope_inv_freq(cfg.head_dim, cfg.rope_theta, None))


def test_folding_twice_changes_nothing_more(golden):
    once = fold(_graphs(golden[0])[1])
    twice = fold(once)
    assert [op.inputs for op in twice.ops] == [op.inputs for op in once.ops]
    assert [n for n in twice.values if n.startswith(INV_FREQ)] == [INV_FREQ]


def test_fold_leaves_its_input_graph_untouched(golden):
    g = _graphs(golden[0])[1]
    fold(g)
    assert INV_FREQ not in g.values and all(len(op.inputs) == 1 for op in g.ops if op.kind == "rope")
