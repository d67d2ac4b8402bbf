"""The step graph's OpenCL kernels (compiler/ir.py "Step graphs") against the interpreter, on
PoCL, on random non-zero data: paged attention through shuffled block tables (its rows kernel
and its tiles kernel, which must give a row the same bits), RoPE at per-row positions, the KV
store at per-row slots, and the gather of the logit rows."""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import replace

import numpy as np
import pytest

from llmrs.compiler.codegen.opencl import (generate, lower_graph, matvec_tokens, paged_heads, paged_splits,
                                           paged_tiles)
from llmrs.compiler.codegen.opencl_tuning import DeviceKind, OpenCLTuning, tuning_for
from llmrs.compiler.interpret import OPS, Interpreter, Step
from llmrs.compiler.ir import Graph
from llmrs.compiler.pipeline import CompileOptions, run_passes
from llmrs.compiler.rope import rope_inv_freq
from llmrs.models.step import step_graph

from .test_opencl_kernels import OneOp, _close, _close_qkv, _emulate_mma, _qkv, _rand, _storage

cl = pytest.importorskip("pyopencl")
from llmrs.runtime.backends.opencl import OpenCLBackend  # noqa: E402

pytestmark = pytest.mark.usefixtures("opencl_device")
TUNING = OpenCLTuning()

# the ctx_len of each sequence's rows in the step, in step order: a run of two at the start, a
# prompt chunk crossing block boundaries, a decode row deep in the cache (several groups, so
# partials fold through the ticket), a run deep in the cache, a lone row, a prompt's start
SEQS = [[5, 6], list(range(40, 49)), [700], list(range(300, 304)), [33], list(range(1, 9))]


class PagedAttention:
    """One paged attention op on the device, its caches and block tables written once; each
    run() is a step of other rows."""

    def __init__(self, h: int, kvh: int, hd: int, kv: str, bs: int, tuning: OpenCLTuning = TUNING,
                 T: int = 40, seed: int = 0, seqs: list[list[int]] = SEQS,
                 tables: list[list[int]] | None = None, slots: int = 1600, scores: bool = False):
        """seqs: each sequence's rows' ctx_len, in step order; tables: their blocks (else drawn
        from a shuffled pool); slots: the cache's entries; scores: the op adds eviction scores
        (from random non-zero ones) for the rows run() is given a score_from of."""
        rng = np.random.default_rng(seed)
        self.rng, self.T, self.h, self.hd, self.seqs = rng, T, h, hd, seqs
        slots = bs * math.ceil(slots / bs)
        blocks = slots // bs
        # each sequence's blocks drawn from a shuffled pool; entries past them are garbage the
        # kernels must never follow
        free = list(rng.permutation(blocks))
        self.tables = np.full((len(seqs) + 1, blocks), 1 << 30, np.int32)
        for i, lens in enumerate(seqs):
            need = math.ceil(max(lens) / bs)
            self.tables[i, :need] = tables[i][:need] if tables else [free.pop() for _ in range(need)]
        g = self.g = Graph("step", T, meta={})
        for name, shape in (("q", (T, h * hd)), ("row_seq", (T,)), ("ctx_len", (T,)),
                            ("block_tables", self.tables.shape)):
            g.add_value(name, shape, "f32" if name == "q" else "i32", kind="input")
        self.caches = {}
        for name in ("kc", "vc"):
            g.add_value(name, (slots, kvh, hd), kv, kind="state")
            self.caches[name] = _storage(_rand(rng, slots, kvh, hd), kv)
        g.add_value("o", (T, h * hd), "f32")
        inputs, outputs = ["q", "kc", "vc", "row_seq", "ctx_len", "block_tables"], ["o"]
        if scores:
            g.add_value("sc", (kvh, slots), "f32", kind="state")
            g.add_value("score_from", (T,), "i32", kind="input")
            g.add_value("sc2", (kvh, slots), "f32", alias="sc")
            inputs, outputs = inputs + ["sc", "score_from"], outputs + ["sc2"]
            self.caches["sc"] = rng.uniform(0.5, 2.0, (kvh, slots)).astype(np.float32)
        self.op = g.add_op("attention", inputs, outputs, n_heads=h,
                           n_kv_heads=kvh, head_dim=hd, scale=1.0 / math.sqrt(hd), block_size=bs)
        g.outputs = ["o"]
        g.verify()
        program = generate({"step": g}, tuning)
        self.splits = paged_splits(tuning, T, h, hd, slots)
        self.be = OpenCLBackend.from_graphs({"step": g}, program)
        self.kernels = [b.kernel.function_name for b in self.be.launches["step"]]
        for name, arr in self.caches.items():
            self.be.write_value("step", name, arr)
        self.be.write_value("step", "block_tables", self.tables)

    def rows(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """q, row_seq, ctx_len of a step of every sequence's rows (self.seqs)."""
        row_seq = np.array([i for i, lens in enumerate(self.seqs) for _ in lens], np.int32)
        ctx_len = np.array([n for lens in self.seqs for n in lens], np.int32)
        return _rand(self.rng, len(row_seq), self.h * self.hd, scale=0.5), row_seq, ctx_len

    def run(self, q: np.ndarray, row_seq: np.ndarray, ctx_len: np.ndarray,
            score_from: np.ndarray | None = None) -> np.ndarray:
        n = len(row_seq)
        named = [("q", q), ("row_seq", row_seq), ("ctx_len", ctx_len)]
        self.be.scoring = score_from is not None
        for name, arr in named + ([("score_from", score_from)] if score_from is not None else []):
            full = np.zeros((self.T, *arr.shape[1:]), arr.dtype)
            full[:n] = arr
            self.be.write_value("step", name, full)
        self.be.enqueue("step", np.zeros(n, np.int32), 0, 0)
        return self.be.read_value("step", "o", rows=n)

    def want(self, q: np.ndarray, row_seq: np.ndarray, ctx_len: np.ndarray) -> np.ndarray:
        it = Interpreter(self.g)
        (o,) = OPS["attention"](it, self.op, Step(len(q), 0, 0), q, self.caches["kc"], self.caches["vc"],
                                row_seq, ctx_len, self.tables)
        return o

    def want_scores(self, q: np.ndarray, row_seq: np.ndarray, ctx_len: np.ndarray,
                    score_from: np.ndarray) -> np.ndarray:
        it = Interpreter(self.g)
        _, sc = OPS["attention"](it, self.op, Step(len(q), 0, 0), q, self.caches["kc"], self.caches["vc"],
                                 row_seq, ctx_len, self.tables, self.caches["sc"].copy(), score_from)
        return sc


# (n_heads, n_kv_heads, head_dim, KV type, block size): GQA, MQA and MHA; f16, f32, q8_0 and q4_0
# caches; blocks of a chunk's 32 entries or fewer, more, or neither (12); head_dim 16 and 100
# (the golden models': no multiple of 32) and 256 (past the tiles kernel's local memory)
CASES = [(8, 2, 64, "f16", 16), (4, 1, 128, "f32", 64), (6, 6, 32, "q8_0", 8), (4, 2, 16, "f32", 12),
         (8, 1, 100, "f16", 16), (2, 1, 256, "f16", 32), (8, 2, 64, "q4_0", 16)]
IDS = [f"{h}.{k}x{d}-{t}-b{b}" for h, k, d, t, b in CASES]


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_paged_attention_through_shuffled_block_tables_matches_interpreter(case):
    pa = PagedAttention(*case)
    q, row_seq, ctx_len = pa.rows()
    _close(pa.run(q, row_seq, ctx_len), pa.want(q, row_seq, ctx_len), 1e-4)
    tiles = case[2] <= 128
    assert pa.kernels == ["attention_paged_rows"] + ["attention_paged_tiles"] * tiles


@pytest.mark.parametrize("case", [CASES[0], CASES[2], CASES[4]], ids=[IDS[0], IDS[2], IDS[4]])
def test_a_row_alone_gets_the_bits_it_gets_among_other_rows_from_either_kernel(case):
    """Each row of a mixed step run again alone (the rows kernel, where the run rows had the
    tiles kernel), and the step again with its sequences in reverse order: bit for bit."""
    pa = PagedAttention(*case)
    q, row_seq, ctx_len = pa.rows()
    batch = pa.run(q, row_seq, ctx_len)
    for t in range(len(q)):
        alone = pa.run(q[t:t + 1], row_seq[t:t + 1], ctx_len[t:t + 1])
        np.testing.assert_array_equal(alone[0], batch[t], err_msg=f"row {t} (ctx_len {ctx_len[t]})")
    order = np.concatenate([np.flatnonzero(row_seq == s) for s in reversed(range(len(SEQS)))])
    np.testing.assert_array_equal(pa.run(q[order], row_seq[order], ctx_len[order]), batch[order])


@pytest.mark.slow   # an opt-in variant; its builds take PoCL a minute a case
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_the_rows_kernel_taking_a_kv_heads_query_heads_together_changes_no_bits(case):
    """att_paged_gqa: a group of attention_paged_rows takes the query heads of one KV head
    (ATT_HPG, as many as local memory holds), reading each K and V row once for them; every
    head's arithmetic stays in its order, so a row run alone (the rows kernel, heads together)
    gets the bits it gets in a step where its run of rows took the tiles kernel (a head a
    group), with one group a row and with two (their partials folded by the last), and the
    interpreter's output."""
    h, kvh, hd = case[:3]
    gqa = replace(TUNING, att_paged_gqa=True)
    hpg = paged_heads(gqa, h, kvh, hd)
    assert hpg == max(n for n in range(1, h // kvh + 1) if (h // kvh) % n == 0 and 4 * n * 4 * (hd + 2) <= 16 << 10)
    assert paged_heads(TUNING, h, kvh, hd) == 1 and (hpg > 1 or h == kvh)
    for tuning in (gqa, replace(gqa, att_dec_max_splits=2)):
        pa = PagedAttention(*case, tuning=tuning)
        q, row_seq, ctx_len = pa.rows()
        batch = pa.run(q, row_seq, ctx_len)
        _close(batch, pa.want(q, row_seq, ctx_len), 1e-4)
        for t in range(len(q)):
            alone = pa.run(q[t:t + 1], row_seq[t:t + 1], ctx_len[t:t + 1])
            np.testing.assert_array_equal(alone[0], batch[t], err_msg=f"row {t} (ctx_len {ctx_len[t]})")


def test_paged_attention_with_several_chunks_a_slot_matches_interpreter_and_keeps_its_bits():
    """Two groups a row at most: a slot takes several chunks, so the tiles kernel folds slots
    and groups mid-run (the 300-entry run: 10 chunks, 2 a slot, 2 groups)."""
    pa = PagedAttention(8, 2, 64, "f16", 16, tuning=replace(TUNING, att_dec_max_splits=2))
    assert pa.splits == 2
    q, row_seq, ctx_len = pa.rows()
    batch = pa.run(q, row_seq, ctx_len)
    _close(batch, pa.want(q, row_seq, ctx_len), 1e-4)
    for t in np.flatnonzero(ctx_len >= 300):
        np.testing.assert_array_equal(pa.run(q[t:t + 1], row_seq[t:t + 1], ctx_len[t:t + 1])[0], batch[t])


# steps whose prompt chunk reaches a tiles group's last row of warps (16 rows a group: rows 12..15)
# with head_dim 16 (lanes 16..31 own no dims): on PoCL its lanes and warps past the run wrote rows
# that were not theirs (attention_paged_tiles.cl). The first is the step that broke golden-b's
# batch as the scheduler built it (a decode row at ctx_len 25, then a 15-row prompt chunk of
# another sequence), the second a 14-row chunk before two decode rows.
BROKE = [([[25], list(range(1, 16))], [[0, 6, 4, 1], [2, 3]]),
         ([list(range(1, 15)), [30], [7]], None)]


@pytest.mark.parametrize("seqs,tables", BROKE, ids=["decode-then-chunk15", "chunk14-then-decodes"])
def test_a_prompt_chunk_filling_a_tiles_group_writes_its_own_rows_alone_and_keeps_their_bits(seqs, tables):
    """golden-b's attention (8 heads, 2 KV heads, head_dim 16, f32 cache of 64 entries in blocks
    of 8) over 16 rows of a 20-row graph: every row as the interpreter's, rows 16..19 of o
    untouched, and each row alone (the rows kernel) the same bits."""
    pa = PagedAttention(8, 2, 16, "f32", 8, T=20, seqs=seqs, tables=tables, slots=64)
    assert pa.kernels == ["attention_paged_rows", "attention_paged_tiles"]
    q, row_seq, ctx_len = pa.rows()
    n = len(q)
    untouched = np.full((pa.T, 8 * 16), -7.5, np.float32)
    pa.be.write_value("step", "o", untouched)
    batch = pa.run(q, row_seq, ctx_len)
    _close(batch, pa.want(q, row_seq, ctx_len), 1e-4)
    np.testing.assert_array_equal(pa.be.read_value("step", "o")[n:], untouched[n:])
    for t in range(n):
        alone = pa.run(q[t:t + 1], row_seq[t:t + 1], ctx_len[t:t + 1])
        np.testing.assert_array_equal(alone[0], batch[t], err_msg=f"row {t} (ctx_len {ctx_len[t]})")


@pytest.mark.parametrize("case", [CASES[0], CASES[3], CASES[6]], ids=[IDS[0], IDS[3], IDS[6]])
def test_paged_scores_add_each_scoring_rows_weights_at_its_physical_slots_only_while_scoring(case):
    """Each sequence's rows from a KV index of their own (the 40..48 chunk from its 4th row, the
    300..303 run from its 2nd, the 5, 6 pair and the lone 700 row never): the scores as the
    interpreter's; a step that is not scoring leaves them alone."""
    pa = PagedAttention(*case, scores=True)
    q, row_seq, ctx_len = pa.rows()
    never = np.iinfo(np.int32).max
    first = {0: never, 1: 42, 2: never, 3: 300, 4: 0, 5: 3}
    score_from = np.array([first[s] for s in row_seq], np.int32)
    pa.run(q, row_seq, ctx_len)
    np.testing.assert_array_equal(pa.be.read_value("step", "sc"), pa.caches["sc"])
    pa.run(q, row_seq, ctx_len, score_from)
    got, want = pa.be.read_value("step", "sc"), pa.want_scores(q, row_seq, ctx_len, score_from)
    assert "attention_scores_paged" in pa.kernels and (want != pa.caches["sc"]).any()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_paged_splits_halve_to_keep_the_partials_of_a_step_within_the_budget():
    assert paged_splits(TUNING, 16, 8, 64, 2048) == 16                     # a group per 128 entries
    assert paged_splits(TUNING, 16, 8, 64, 1 << 20) == TUNING.att_dec_max_splits
    big = paged_splits(TUNING, 512, 32, 128, 1 << 20)                       # 1B-sized prefill chunk
    assert 4 * 512 * 32 * big * 130 <= TUNING.att_paged_scratch_bytes < 4 * 512 * 32 * 2 * big * 130


def test_the_tiles_kernel_takes_the_heads_whose_staged_chunk_fits_the_devices_local_memory():
    # NVIDIA's 48 KB: head_dim 128 (41 KB), not 256; a 32 KB device (Adreno): 64 (21 KB), not 128
    assert paged_tiles(TUNING, 16, 128) and not paged_tiles(TUNING, 16, 256)
    small = tuning_for(DeviceKind((0, 0), local_mem_bytes=32 << 10))
    assert paged_tiles(small, 16, 64) and not paged_tiles(small, 16, 128)
    assert not paged_tiles(TUNING, 1, 64)                 # a step of one row: the rows kernel alone


# the generated rows a matvec group takes (MV_TOKS) in each layer matmul of the 1B step graph at
# the default tuning (measured: quantized weights a row a group, float 4); and where quantized
# ones may take up to 16: a Q8_0 copy of x a token within 40 KB of local memory (K 2048: 2.5 KB,
# 16 of them; down_proj's K 8192: 10 KB, 4) (a layer's matmuls in launch order: qkv, o_proj,
# gate_up, down_proj)
TOKS_1B = {"q4_0": [1, 1, 1, 1], "f16": [4, 4, 4, 4]}   # with the pairs off (mv_sx_from=0)
TOKS_MMA = [16, 16, 16, 16]   # f16 weights on the tensor-core matvec (the default)
TOKS_1B_16 = [16, 16, 16, 4]
MANY_TOKS = replace(TUNING, mv_toks_quant=16, mv_toks_float=8, mv_sx_from=0)


@pytest.mark.parametrize("local_kb,k,want", [(48, 2048, 16), (48, 8192, 4), (48, 32768, 1), (32, 2048, 9),
                                             (32, 8192, 2), (32, 1024, 16)])
def test_the_generated_rows_matvec_takes_as_many_tokens_as_their_q8_0_copies_of_x_fit_in_local_memory(local_kb, k,
                                                                                                    want):
    """T tokens of K values keep T * (K + K / 32 * 8) bytes of Q8_0 blocks, scales and sums in
    local memory beside the matvec's other arrays (8 KB): the most that fit, 16 at most; float
    weights take 8; a variant of a token a group (QK_SPLIT, ROPE_HEADS) and a step of fewer rows
    take fewer."""
    tuning = replace(tuning_for(DeviceKind((9, 0), local_mem_bytes=local_kb << 10)), mv_toks_quant=16,
                     mv_toks_float=8)
    t = matvec_tokens(tuning, 128, k, True, False)
    assert t == want
    assert t * (k + k // 32 * 8) <= (local_kb - 8) << 10 and (t == 16 or (t + 1) * (k + k // 32 * 8) > (local_kb - 8) << 10)
    assert matvec_tokens(tuning, 128, k, False, False) == 8
    assert matvec_tokens(tuning, 128, k, True, True) == matvec_tokens(tuning, 128, k, False, True) == 1
    assert matvec_tokens(tuning, 3, 2048, True, False) == 3


def _check_sx_twins(launches: list, quantized: bool) -> None:
    """Every one-token matvec of the generated rows (and the head) of a step graph runs below
    mv_sx_from rows a step; from there on its twin runs. Quantized weights: MV_SX, mv_sx_toks rows
    a group, after a matvec_stage built with the one-token matvec's threads (they order its RMS
    sum, so the twin's x and every row's bits are the one-token matvec's). Float weights:
    mv_toks_float rows a group, x read per row, with the one-token matvec's shape (its K split
    orders the sums)."""
    one = [launch for launch in launches if launch.kernel == "matvec" and launch.part in ("rest", "logits")
           and not launch.rows_from]
    assert one
    at = {id(launch): i for i, launch in enumerate(launches)}
    for launch in one:
        assert launch.rows_below == TUNING.mv_sx_from and launch.row_tile == 1
        assert not any(o.startswith("-DMV_TOKS=") for o in launch.options)
        twins = [other for other in launches if other.op == launch.op and other.rows_from]
        if not quantized:
            twin, = twins
            assert twin.kernel == "matvec" and twin.row_tile == TUNING.mv_toks_float and not twin.rows_below
            assert twin.options == [o for o in launch.options if o != "-DMV_TOKS_INNER"] + \
                [f"-DMV_TOKS={TUNING.mv_toks_float}", "-DMV_TOKS_INNER"]
            continue
        stage, twin = twins
        assert at[id(stage)] + 1 == at[id(twin)] and stage.kernel == "matvec_stage" and twin.kernel == "matvec"
        assert stage.rows_from == twin.rows_from == TUNING.mv_sx_from and not stage.rows_below
        assert stage.part == twin.part == launch.part and twin.row_tile == TUNING.mv_sx_toks
        assert "-DMV_SX" in twin.options and "-DMV_SX_STAGE" in stage.options
        assert f"-DMV_WG={launch.local}" in stage.options and stage.local == launch.local
        assert f"-DMV_WG={TUNING.mv_sx_wg}" in twin.options
    assert any(launch.kernel == "matvec_stage" for launch in launches) == quantized


def _check_mma_rows(launches: list) -> None:
    """f16 weights on the tensor-core matvec: the generated rows' and the head's one launch each,
    16 rows a group at every row count (no twin, no stage: each lane reads x itself)."""
    rows = [launch for launch in launches if launch.kernel == "matvec" and launch.part in ("rest", "logits")]
    assert rows and {launch.part for launch in rows} == {"rest", "logits"}
    for launch in rows:
        assert "-DMV_MMA" in launch.options and "-DMV_TOKS=16" in launch.options and launch.row_tile == 16
        assert not launch.rows_from and not launch.rows_below
        assert not any(o.startswith(("-DMV_MMA_KC=", "-DMV_RMS_LATE")) for o in launch.options)
    assert not any(launch.kernel in ("matvec_stage",) or "-DSTAGE_REST" in launch.options for launch in launches)


@pytest.mark.parametrize("weights,mma", [("q4_0", False), ("f16", True), ("f16", False)],
                         ids=["q4_0", "f16", "f16-on-cuda-cores"])
def test_a_1b_step_graph_splits_each_layer_matmul_by_row_kind_and_pages_every_attention(llama_1b_graphs, weights,
                                                                                         mma):
    """Row invariance starts with the kernels chosen: by a row's own kind, never by what shares
    its step. A layer's matmuls run their prompt rows in matmul_tiled (part "lead") and their
    generated rows in the decode matvec (part "rest"), both built with ROW_SPLIT, the matvec
    taking several generated rows a group (MV_TOKS, its row_tile); attention is the paged pair
    (not the contiguous kernels). Quantized weights add, for steps of mv_sx_from generated rows
    or more, each matvec's MV_SX twin and its matvec_stage, and run their head as a matvec; f16
    weights run their generated rows and head on the tensor-core matvec (mv_mma_f16), or with it
    off a twin of mv_toks_float rows a group and a tiled head."""
    prefill, decode = llama_1b_graphs
    g = run_passes(step_graph(prefill, max_seqs=16, block_size=16), CompileOptions(weights=weights))
    tuning = replace(TUNING, mv_mma_f16=mma)
    launches = lower_graph(g, tuning)
    q = weights == "q4_0"
    if mma:
        _check_mma_rows(launches)
    else:
        _check_sx_twins(launches, q)
    launches = [launch for launch in launches if not launch.rows_from]   # the one-token matvecs
    # without the pairs, each matmul's generated rows run one matvec, as many rows a group as measured
    rest = [launch for launch in lower_graph(g, replace(tuning, mv_sx_from=0)) if launch.part == "rest"]
    assert [launch.row_tile for launch in rest] == (TOKS_MMA if mma else TOKS_1B[weights]) * 16
    assert all((f"-DMV_TOKS={launch.row_tile}" in launch.options) if launch.row_tile > 1
               else not any(o.startswith("-DMV_TOKS=") for o in launch.options) for launch in rest)   # T 1: today's kernel
    # each walks its groups token-fastest (several token groups: 16 rows over row_tile)
    assert all("-DMV_TOKS_INNER" in launch.options for launch in rest if launch.row_tile < 16)
    if weights == "q4_0":   # as many as local memory holds, where the tuning allows 16
        many = [launch.row_tile for launch in lower_graph(g, MANY_TOKS) if launch.part == "rest"]
        assert many == TOKS_1B_16 * 16
    # decode keeps a token a group, built as before
    dec = [launch for launch in lower_graph(run_passes(decode, CompileOptions(weights=weights)))
           if launch.kernel == "matvec"]
    assert dec and all(launch.row_tile == 1 and not any("MV_TOKS" in o for o in launch.options) for launch in dec)
    kernels = Counter(launch.kernel for launch in launches)
    layers = 16
    # the head: a matvec for every logit row, sized by them; f16 off the tensor cores tiled
    mv_head = q or mma
    assert kernels["matmul_tiled"] == 4 * layers + (not mv_head) and kernels["matvec"] == 4 * layers + mv_head
    parts = Counter((launch.kernel, launch.part) for launch in launches if launch.family in ("matmul", "matvec"))
    assert parts[("matmul_tiled", "lead")] == parts[("stage_x", "lead")] == parts[("matvec", "rest")] == 4 * layers
    assert parts[("matvec", "logits")] == mv_head
    assert parts[("matmul_tiled", "")] == parts[("stage_x", "")] == (not mv_head)
    assert all(("-DROW_SPLIT" in launch.options) == (launch.part in ("lead", "rest")) for launch in launches)
    assert kernels["attention_paged_rows"] == kernels["attention_paged_tiles"] == layers
    assert kernels["attention_tiled"] == kernels["attention_decode"] == kernels["attention_split"] == 0


@pytest.mark.parametrize("weights", ["q4_0", "f16"])
def test_a_1b_step_graph_launches_the_prefill_graphs_kernels_a_layer_but_for_paged_attention(llama_1b_graphs,
                                                                                              weights):
    """The step graph fused as the prefill graph: a layer's launches are the prefill graph's
    (QKV with RoPE and the KV store in its epilogue, o, gate_up, down: a staging and a tiled
    matmul each) and a matvec each for the generated rows; its attention the paged pair and the
    paged eviction scores instead of the prefill's two kernels. Unfused, a layer took 19."""
    prefill, _ = llama_1b_graphs
    opts = CompileOptions(weights=weights)
    # the launches a step of few generated rows makes (its MV_SX twins: test above)
    step = Counter(launch.kernel for launch in lower_graph(run_passes(step_graph(prefill, max_seqs=16,
                                                                                 block_size=16), opts))
                   if not launch.rows_from)
    pre = Counter(launch.kernel for launch in lower_graph(run_passes(prefill, opts)))
    layers, paged = 16, ("attention_paged_rows", "attention_paged_tiles", "attention_scores_paged")
    prefill_attention = ("attention_tiled", "attention_scores")
    per_layer = {k: n / layers for k, n in step.items() if k not in ("embedding", "gather_rows")}
    head = Counter(matvec=1)   # a matvec (as the prefill's on its last row); f16's on tensor cores
    assert per_layer == {"stage_x": 4, "matmul_tiled": 4, "matvec": 4 + 1 / layers, "attention_paged_rows": 1,
                         "attention_paged_tiles": 1, "attention_scores_paged": 1}   # only while a policy scores
    # less attention, the generated rows' matvecs, the embedding and the head
    assert step - Counter({k: step[k] for k in paged}) - Counter(matvec=4 * layers) \
        - Counter(embedding=1, gather_rows=1) - head \
        == pre - Counter({k: pre[k] for k in prefill_attention}) - Counter(embedding=1, last_row=1, matvec=1)
    assert sum(step.values()) - 2 - sum(head.values()) == (12 + len(paged)) * layers   # embedding, gather, the head


def test_rope_at_per_row_positions_matches_interpreter():
    rng = np.random.default_rng(31)
    h, hd, T = 3, 32, 7
    b = OneOp(T, name="step")
    x = b.act("x", _rand(rng, T, h * hd))
    inv = b.param("inv_freq", rope_inv_freq(hd, 10000.0, None), "f32", kind="const")
    positions = b.act("positions", np.array([4000, 3, 17, 0, 999, 2, 5]), "i32")
    y = b.out("y", (T, h * hd))
    got, want = b.run("rope", [x, inv, positions], [y], 6, n_heads=h, head_dim=hd, theta=10000.0, scaling=None)
    _close(got[0], want[0], 1e-4)


@pytest.mark.parametrize("kv_dtype", ["f32", "f16", "q8_0", "q4_0"])
def test_kv_store_at_per_row_slots_matches_interpreter(kv_dtype):
    rng = np.random.default_rng(32)
    kvh, hd, s, T = 2, 32, 24, 6
    b = OneOp(T, name="step")
    src = b.act("src", _rand(rng, T, kvh * hd))
    cache = b.state("cache", _rand(rng, s, kvh, hd), kv_dtype)
    slots = b.act("slots", np.array([17, 3, 22, 9, 0, 1]), "i32")
    c2 = b.out("cache2", (s, kvh, hd), kv_dtype, alias="cache")
    got, want = b.run("kv_store", [src, cache, slots], [c2], 5)
    np.testing.assert_array_equal(got[0], want[0])


@pytest.mark.parametrize("kv_dtype", ["f32", "q8_0", "q4_0"])
def test_kv_store_drops_a_slot_outside_the_cache_and_writes_nothing_beside_it(kv_dtype):
    """The runtime refuses such slots; a kernel given one anyway writes neither the cache nor
    the state after it (slot S would be its first row), nor before it (slot -1)."""
    rng = np.random.default_rng(33)
    kvh, hd, s = 1, 32, 8
    b = OneOp(4, name="step")
    src = b.act("src", _rand(rng, 4, kvh * hd))
    b.state("guard_lo", _rand(rng, s, kvh, hd), kv_dtype)
    cache = b.state("cache", _rand(rng, s, kvh, hd), kv_dtype)
    b.state("guard_hi", _rand(rng, s, kvh, hd), kv_dtype)
    slots = b.act("slots", np.array([s, 2, -1, 1 << 20]), "i32")
    c2 = b.out("cache2", (s, kvh, hd), kv_dtype, alias="cache")
    b.g.add_op("kv_store", [src, cache, slots], [c2])
    b.g.inputs, b.g.outputs = [], [c2]
    b.g.verify()
    be = OpenCLBackend.from_graphs({"step": b.g}, generate({"step": b.g}, TUNING))
    for name, arr in b.data.items():
        be.write_value("step", name, arr)
    be.enqueue("step", np.zeros(4, np.int32), 0, 0)
    want = b.data["cache"].copy()
    want[2] = _storage(b.data["src"][1].reshape(kvh, hd), kv_dtype)
    np.testing.assert_array_equal(be.read_value("step", "cache"), want)
    for guard in ("guard_lo", "guard_hi"):
        np.testing.assert_array_equal(be.read_value("step", guard), b.data[guard])


def test_gather_of_the_logit_rows_matches_interpreter():
    rng = np.random.default_rng(34)
    b = OneOp(9, name="step")
    x = b.act("x", _rand(rng, 9, 70))
    rows = b.act("logit_rows", np.array([8, 0, 3, 3]), "i32")
    y = b.out("y", (4, 70))
    got, want = b.run("gather", [x, rows], [y], 9)
    np.testing.assert_array_equal(got[0], want[0])


# -- the fused QKV of a step graph (fused_matmul rope_kv_store, attr step_rows: STEP_ROWS) ---------

# (weights, cache, heads, qk_norm, bias): Llama's (pairs over 128-row tiles), a q8_0 cache (blocks
# by epilogue_chunk), head_dim 96 into q8_0 (a group per head: the matvec, a token a group row),
# Qwen3's norms (whole heads a tile), Qwen2's biases, heads wider than a tile (the matvec, heads
# split over groups by tickets)
STEP_QKV = [("q4_0", "f16", (4, 2, 64), False, False), ("f16", "q8_0", (4, 2, 64), False, False),
            ("q8_0", "q8_0", (3, 1, 96), True, False), ("q4_1", "f32", (4, 2, 128), True, True),
            ("f16", "f16", (6, 1, 64), False, True), ("q8_0", "f16", (2, 1, 256), True, True),
            ("q4_1", "q4_0", (4, 2, 64), False, False), ("q4_0", "q4_0", (3, 1, 96), True, False)]
STEP_QKV_IDS = [f"{w}-{k}-{h}.{g}x{d}" + "-qknorm" * n + "-bias" * b for w, k, (h, g, d), n, b in STEP_QKV]


@pytest.mark.parametrize("wdt,kv,heads,qk_norm,bias", STEP_QKV, ids=STEP_QKV_IDS)
@pytest.mark.parametrize("rows,n_tokens", [(70, 67), (9, 1)])
def test_fused_qkv_ropes_and_stores_each_row_at_its_own_position_and_slot(wdt, kv, heads, qk_norm, bias, rows,
                                                                          n_tokens):
    slots = np.random.default_rng(rows).permutation(rows + 8)[:rows].astype(np.int32)
    b, got, want = _qkv(wdt, kv, heads, rows, n_tokens, n_past=3, start_pos=11, qk_norm=qk_norm, bias=bias,
                        slots=slots, again=True)
    assert all("-DSTEP_ROWS" in launch["options"] for launch in b.launches if launch["kernel"] != "stage_x")
    _close_qkv(got, want, wdt, kv)
    untouched = np.setdiff1d(np.arange(rows + 8), slots[:n_tokens])
    for cache in ("kc", "vc"):   # rows no step row writes keep their bytes
        np.testing.assert_array_equal(b.data[cache][untouched], got[1 if cache == "kc" else 2][untouched])


@pytest.mark.parametrize("kv,heads", [("f32", (4, 2, 64)), ("q8_0", (4, 2, 64)), ("q8_0", (3, 1, 96)),
                                     ("q4_0", (4, 2, 64))])
def test_fused_qkv_stores_nothing_for_a_slot_outside_the_cache(kv, heads):
    """As the step graph's kv_store: the runtime refuses such a step; the kernel given one anyway
    writes no cache row for it (nor next to the cache), and ropes its q all the same."""
    rows = 6
    bad = np.array([2, -1, rows + 8, 1 << 20, 5, 0], np.int32)
    b, got, _ = _qkv("q4_0", kv, heads, rows, rows, qk_norm=False, slots=bad, oracle=False)
    good = bad.copy()
    good[[1, 2, 3]] = [1, 3, 4]
    _, _, want = _qkv("q4_0", kv, heads, rows, rows, qk_norm=False, slots=good)
    _close_qkv(got[:1], want[:1], "q4_0", kv)
    for i, cache in ((1, "kc"), (2, "vc")):
        expect = b.data[cache].copy()
        expect[[2, 5, 0]] = want[i][[2, 5, 0]]
        _close_qkv([got[0], got[i]], [want[0], expect], "q4_0", kv)


@pytest.mark.parametrize("wdt,kv,heads,qk_norm", [("q4_0", "f16", (4, 2, 64), False), ("f16", "q8_0", (4, 2, 128), True),
                                                  ("q8_0", "q8_0", (3, 1, 96), False), ("f16", "q4_0", (4, 2, 64), False)])
def test_a_rows_fused_qkv_is_the_same_bits_alone_and_among_other_rows(wdt, kv, heads, qk_norm):
    """Row invariance of the fused QKV: a row's q and the k / v it stores are the same bits in a
    step of one row as among 67 (the kernel is chosen by the graph's rows, a row sums alone)."""
    rows, row = 70, 40
    slots = np.random.default_rng(1).permutation(rows + 8)[:rows].astype(np.int32)
    x = _rand(np.random.default_rng(2), rows, 64)
    b, many, _ = _qkv(wdt, kv, heads, rows, 67, qk_norm=qk_norm, slots=slots, x=x)
    positions = b.data["positions"].copy()
    alone_x, alone_slots, alone_pos = x.copy(), slots.copy(), positions.copy()
    alone_x[0], alone_slots[0], alone_pos[0] = x[row], slots[row], positions[row]
    _, one, _ = _qkv(wdt, kv, heads, rows, 1, qk_norm=qk_norm, slots=alone_slots, x=alone_x, positions=alone_pos)
    np.testing.assert_array_equal(one[0][0], many[0][row])
    for i in (1, 2):
        np.testing.assert_array_equal(one[i][slots[row]], many[i][slots[row]])


def test_fused_qkv_on_the_tensor_core_body_ropes_and_stores_at_the_rows_slots(monkeypatch):
    _emulate_mma(monkeypatch)
    monkeypatch.setenv("LLMRS_OPENCL_NO_WGMMA", "1")
    slots = np.random.default_rng(5).permutation(139)[:131].astype(np.int32)
    b, got, want = _qkv("q4_0", "f16", (4, 2, 128), 131, 130, qk_norm=True, bias=True, d=512, slots=slots, seed=47)
    assert "-DUSE_NV_MMA" in b.build_options
    _close_qkv(got, want, "q4_0", "f16")
