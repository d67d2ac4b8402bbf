"""The step graph (models/step.py) in the interpreter: several sequences in one step, their KV in
blocks scattered over the pool, give each sequence's logits as its own prefill and decode do."""
from __future__ import annotations

import numpy as np
import pytest

from llmrs.compiler.interpret import Interpreter
from llmrs.compiler.ir import IRError
from llmrs.models.llama import build_graphs, load_model
from llmrs.models.step import step_graph
from llmrs.runtime.kv.store import NEVER

from ..conftest import DATA, run_steps

BS = 4          # tokens a block


@pytest.fixture(scope="module")
def graphs():
    model = load_model(DATA / "golden-b")
    prefill, decode = build_graphs(model, prefill_T=16, max_seq_len=64)
    return prefill, decode, step_graph(prefill, max_seqs=4, block_size=BS)


class Pool:
    """A naive paged layout for the test: each sequence takes blocks from a shuffled list."""

    def __init__(self, n_blocks: int, rng: np.random.Generator):
        self.free = list(rng.permutation(n_blocks))
        self.tables: dict[int, list[int]] = {}
        self.length: dict[int, int] = {}

    def slot(self, seq: int, pos: int) -> int:
        table = self.tables.setdefault(seq, [])
        while len(table) <= pos // BS:
            table.append(int(self.free.pop()))
        return table[pos // BS] * BS + pos % BS


def run_step(ip: Interpreter, state, pool: Pool, rows: list[tuple[int, int]], seqs: list[int],
             logit_rows: list[int]) -> np.ndarray:
    """rows: (seq, token) in step order; each sequence's rows are its next positions."""
    g = ip.graph
    B, M = g.values["block_tables"].shape
    pos, slots, row_seq, ctx = [], [], [], []
    for seq, _ in rows:
        p = pool.length.get(seq, 0)
        pool.length[seq] = p + 1
        pos.append(p)
        slots.append(pool.slot(seq, p))
        row_seq.append(seqs.index(seq))
        ctx.append(p + 1)
    tables = np.zeros((B, M), np.int32)
    for i, s in enumerate(seqs):
        tables[i, :len(pool.tables[s])] = pool.tables[s]
    picked = np.zeros(B, np.int32)
    picked[:len(logit_rows)] = logit_rows
    out = ip.run({"tokens": np.array([t for _, t in rows], np.int32), "positions": pos, "slots": slots,
                  "row_seq": row_seq, "ctx_len": ctx, "block_tables": tables, "logit_rows": picked,
                  "score_from": np.full(len(rows), NEVER, np.int32)},   # no row scores
                 state, n_past=0)
    return out["logits"][:len(logit_rows)]


def test_interleaved_sequences_in_one_step_match_each_run_alone(graphs):
    prefill, decode, step = graphs
    rng = np.random.default_rng(3)
    vocab = prefill.values["logits"].shape[1]
    prompts = [rng.integers(0, vocab, n).astype(np.int32) for n in (7, 3, 10)]
    nexts = [rng.integers(0, vocab, 3).astype(np.int32) for _ in prompts]
    alone = [run_steps(prefill, decode, p, d) for p, d in zip(prompts, nexts)]

    ip = Interpreter(step)
    state, pool = ip.new_state(), Pool(16, rng)
    # step 1: sequence 0's whole prompt and the first 2 tokens of sequence 1's
    got = run_step(ip, state, pool, [(0, t) for t in prompts[0]] + [(1, t) for t in prompts[1][:2]],
                   [0, 1], [6])
    np.testing.assert_allclose(got[0], alone[0][0][6], rtol=1e-4, atol=1e-5)
    # step 2: sequence 0 decodes, sequence 1 ends its prompt, sequence 2 starts with 5 tokens
    got = run_step(ip, state, pool, [(0, nexts[0][0]), (1, prompts[1][2])] + [(2, t) for t in prompts[2][:5]],
                   [0, 1, 2], [0, 1])
    np.testing.assert_allclose(got[0], alone[0][1][0], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(got[1], alone[1][0][2], rtol=1e-4, atol=1e-5)
    # step 3: rows in another order than the sequences' table rows
    got = run_step(ip, state, pool, [(2, t) for t in prompts[2][5:]] + [(1, nexts[1][0]), (0, nexts[0][1])],
                   [0, 1, 2], [4, 5, 6])
    np.testing.assert_allclose(got[0], alone[2][0][9], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(got[1], alone[1][1][0], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(got[2], alone[0][1][1], rtol=1e-4, atol=1e-5)


def test_a_sequence_alone_with_the_identity_table_reads_the_contiguous_cache(graphs):
    """The step graph and the prefill graph share the KV states: the prefill's cache, read through
    the identity block table, continues the same sequence."""
    prefill, decode, step = graphs
    rng = np.random.default_rng(4)
    vocab = prefill.values["logits"].shape[1]
    prompt, nxt = rng.integers(0, vocab, 9).astype(np.int32), rng.integers(0, vocab, 1).astype(np.int32)
    _, ref = run_steps(prefill, decode, prompt, nxt)
    state = Interpreter(prefill).new_state()
    Interpreter(prefill).run({"tokens": prompt}, state, n_past=0)
    pool = Pool(16, rng)
    pool.tables[0], pool.length[0] = list(range(16)), len(prompt)
    got = run_step(Interpreter(step), state, pool, [(0, nxt[0])], [0], [0])
    np.testing.assert_allclose(got[0], ref[0], rtol=1e-4, atol=1e-5)


def test_step_graph_refuses_a_block_size_that_does_not_divide_the_cache(graphs):
    prefill, _, _ = graphs
    with pytest.raises(IRError, match="block size 5 must divide the KV cache's 64 slots"):
        step_graph(prefill, max_seqs=2, block_size=5)
    with pytest.raises(IRError, match="serves 1..16 sequences, not 17"):
        step_graph(prefill, max_seqs=17, block_size=4)


def test_every_pass_keeps_the_step_graphs_outputs(graphs):
    """The compiler's passes (quantize to f32 weights, fold, fuse, schedule, plan memory) leave the
    step graph computing what it did, and keep the head on the chosen rows."""
    from llmrs.compiler.pipeline import CompileOptions, run_passes

    prefill, _, step = graphs
    passed = run_passes(step, CompileOptions(weights="f32"))
    assert passed.values["logits"].shape == (4, prefill.values["logits"].shape[1])
    assert passed.meta["layout"]["kv"] == run_passes(prefill, CompileOptions(weights="f32")).meta["layout"]["kv"]
    tokens = np.random.default_rng(5).integers(0, prefill.values["logits"].shape[1], 6)
    outs = []
    for g in (step, passed):
        pool = Pool(16, np.random.default_rng(6))
        ip = Interpreter(g)
        state = ip.new_state()
        outs.append(run_step(ip, state, pool, [(0, t) for t in tokens[:4]] + [(1, t) for t in tokens[4:]],
                             [0, 1], [3, 5]))
    np.testing.assert_allclose(outs[1], outs[0], rtol=1e-5, atol=1e-5)
