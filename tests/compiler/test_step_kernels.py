"""A step graph's CPU kernels (RoPE at per-row positions, the KV store at per-row slots, the fused
QKV matmul's RoPE + KV-store epilogue at both, paged attention through block tables, the gather of
the logit rows), JIT-compiled for this host and,
on a VNNI machine, for AVX2, against the interpreter on random non-zero data; and the batch
invariance a step needs: a row's matmul result is the same bits alone and among 8 rows."""
from __future__ import annotations

import multiprocessing

import numpy as np
import pytest

from llmrs.compiler.interpret import Step

from .kernel_cases import matmul_case
from .step_cases import Paged, gather_case, kv_store_case, paged_attention_case, rope_case
from .test_llvm_kernels import TARGETS, check, run_case

TARGET_NAMES = sorted(TARGETS)


@pytest.mark.parametrize("target", TARGET_NAMES)
@pytest.mark.parametrize("hd,folded", [(32, True), (100, True), (64, False)])
def test_rope_rotates_each_row_by_its_own_position(target, hd, folded):
    case = rope_case(T=7, n=6, hd=hd, folded=folded)
    check(case, run_case(case, TARGETS[target], nth=2)[0])


@pytest.mark.parametrize("dtype,hd", [("f32", 32), ("f16", 100), ("q8_0", 64), ("q4_0", 64)])
def test_kv_store_writes_each_row_at_its_slot(dtype, hd):
    case = kv_store_case(T=7, n=5, dtype=dtype, hd=hd)
    arrays = run_case(case, TARGETS["host"], nth=2)[0]
    check(case, arrays)
    untouched = np.setdiff1d(np.arange(24), case.arrays["slots"][:5])
    np.testing.assert_array_equal(arrays["kc"][untouched], case.arrays["kc"][untouched])


def test_kv_store_writes_nothing_for_a_slot_outside_the_cache():
    """The back ends refuse such a step; the kernel itself never writes outside the cache."""
    slots = [3, -1, 24, 1 << 30, 7]
    case = kv_store_case(T=5, n=5, dtype="f16", slots=slots)
    arrays = run_case(case, TARGETS["host"], nth=2)[0]
    want = case.arrays["kc"].copy()
    for t in (0, 4):
        want[slots[t]] = case.arrays["src"][t].reshape(2, 32).astype(np.float16)
    np.testing.assert_array_equal(arrays["kc"], want)


# (sequence, entries attended) of each row: ctx lengths 1, a block's end and the next block's
# start, several blocks, the whole table; sequences in no order
ROWS = [(1, 1), (0, 16), (2, 17), (0, 33), (1, 47), (2, 64), (0, 5)]
# (n_heads, n_kv_heads, head_dim, KV dtype): GQA, MQA, a group of 3, head_dim 100 (no multiple of
# the vector width, nor of q8_0's / q4_0's 32-value blocks)
HEADS = [(h, k, d, t) for h, k, d in ((4, 2, 32), (4, 1, 64), (6, 2, 32)) for t in ("f32", "f16", "q8_0", "q4_0")] \
    + [(2, 2, 100, "f32"), (2, 2, 100, "f16")]


@pytest.mark.parametrize("target", TARGET_NAMES)
@pytest.mark.parametrize("h,kvh,hd,kv_dtype", HEADS, ids=[f"{h}.{k}x{d}-{t}" for h, k, d, t in HEADS])
@pytest.mark.parametrize("bs", [16, 4], ids=["block16", "block4"])
def test_paged_attention_through_shuffled_block_tables_matches_interpreter(target, h, kvh, hd, kv_dtype, bs):
    rows = ROWS if bs == 16 else [(s, min(c, 16)) for s, c in ROWS]   # 4 blocks of 4 per sequence
    case = paged_attention_case(T=9, rows=rows, kv_dtype=kv_dtype, h=h, kvh=kvh, hd=hd, bs=bs,
                                n_blocks=12, n_seqs=3, seed=hd + bs)
    check(case, run_case(case, TARGETS[target], nth=3)[0])


# each row's first scoring KV index: rows 0, 2, 3 and 5 score (index ctx_len - 1 >= it), rows 1,
# 4 and 6 do not (a KV index too early, never); sequence 2's rows 2 and 5 add to the same
# slots in step order
SCORE_FROM = [0, 16, 10, 0, 2**31 - 1, 63, 5]


@pytest.mark.parametrize("target", TARGET_NAMES)
@pytest.mark.parametrize("h,kvh,hd,kv_dtype", [(4, 2, 32, "f32"), (6, 2, 32, "q8_0"), (2, 2, 100, "f16"),
                                                (4, 1, 64, "q4_0")], ids=["4.2x32-f32", "6.2x32-q8_0",
                                                                         "2.2x100-f16", "4.1x64-q4_0"])
def test_paged_attention_adds_each_scoring_rows_weights_at_its_physical_slots(target, h, kvh, hd, kv_dtype):
    case = paged_attention_case(T=9, rows=ROWS, kv_dtype=kv_dtype, h=h, kvh=kvh, hd=hd, bs=16, n_blocks=12,
                                n_seqs=3, seed=hd + 5, score_from=SCORE_FROM)
    got = run_case(case, TARGETS[target], nth=2)[0]
    check(case, got)
    changed = got["sc"] != case.arrays["sc"]
    assert changed.any() and not changed.all()     # scoring rows' entries only


@pytest.mark.parametrize("kv_dtype", ["f32", "f16", "q8_0", "q4_0"])
def test_one_sequence_through_the_identity_table_is_the_contiguous_kernel_bit_for_bit(kv_dtype):
    """Rows 0..5 of a prefill chunk after 37 cached tokens: the paged kernel reads the same slots
    in the same order as the causal kernel, so a sequence alone loses nothing to paging."""
    n_past, n = 37, 6
    pool = Paged(16, 4, np.arange(4, dtype=np.int32)[None])
    paged = paged_attention_case(T=8, rows=[(0, n_past + t + 1) for t in range(n)], kv_dtype=kv_dtype, pool=pool)
    got_paged = run_case(paged, TARGETS["host"], nth=2)[0]["o"][:n]
    causal = paged_attention_case(T=8, rows=[(0, 1)] * n, kv_dtype=kv_dtype, pool=pool)
    op = causal.op
    op.inputs[3:] = []
    del op.attrs["block_size"]
    causal.step = Step(n, n_past, n_past)
    got_causal = run_case(causal, TARGETS["host"], nth=2)[0]["o"][:n]
    np.testing.assert_array_equal(got_paged, got_causal)


def _run_absurd_indices(queue) -> None:
    case = paged_attention_case(T=4, rows=[(0, 5), (1, 9), (2, 3), (0, 2)], kv_dtype="f16")
    case.arrays["row_seq"][:] = [1 << 30, -5, 2, 0]
    case.arrays["ctx_len"][:] = [1 << 30, 9, 3, 2]
    case.arrays["block_tables"][2, 0] = (1 << 31) - 1
    case.arrays["block_tables"][0, 0] = -7
    out = run_case(case, TARGETS["host"], nth=2)[0]["o"]
    queue.put(bool(np.isfinite(out).all()))


def test_paged_attention_never_reads_outside_the_table_or_the_cache():
    """Indices the back ends would refuse (a sequence past the table, a block past the cache, more
    entries than a table holds): the kernel clamps them and stays inside its buffers."""
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_run_absurd_indices, args=(queue,))
    child.start()
    child.join(120)
    assert child.exitcode == 0, f"the kernel died (exit code {child.exitcode}): a read outside its buffers"
    assert queue.get(timeout=5) is True


@pytest.mark.parametrize("picked", [[4, 0, 8, 4], [2]], ids=["four", "one"])
def test_gather_copies_the_picked_rows(picked):
    case = gather_case(T=11, n=9, picked=picked)
    check(case, run_case(case, TARGETS["host"], nth=2)[0])


def test_gather_reads_row_0_for_an_index_past_the_rows():
    case = gather_case(T=6, n=6, picked=[5, 1 << 30, -1])
    out = run_case(case, TARGETS["host"], nth=2)[0]["y"]
    np.testing.assert_array_equal(out, case.arrays["x"][[5, 0, 0]])


# -- batch invariance ---------------------------------------------------------------------------

MATMULS = [(w, pro, epi) for w in ("q4_0", "q4_1", "q8_0", "f16", "f32")
           for pro, epi in ((False, None), (True, "silu_mul"), (False, "add"))]


@pytest.mark.parametrize("target", TARGET_NAMES)
@pytest.mark.parametrize("wdtype,prologue,epilogue", MATMULS, ids=[f"{w}-{p}-{e}" for w, p, e in MATMULS])
def test_a_rows_matmul_result_is_the_same_bits_alone_and_among_8_rows(target, wdtype, prologue, epilogue):
    """A prefill-shaped kernel (T = 16) takes a step's tokens 4 at a time and the rest one at a
    time: every row sums in one order either way, so a row of an 8-row step (two whole tiles)
    is the same bits as that row alone, or first of a 3-row step (both one-token tails)."""
    case = matmul_case(wdtype, 16, 8, prologue, epilogue, K=576, N=48, seed=7)
    batch = run_case(case, TARGETS[target], nth=2)[0]["y"][:8].copy()
    for row, n in ((6, 1), (7, 3)):
        alone = matmul_case(wdtype, 16, n, prologue, epilogue, K=576, N=48, seed=7)
        alone.arrays["x"][0] = case.arrays["x"][row]
        if epilogue == "add":
            alone.arrays["res"][0] = case.arrays["res"][row]
        got = run_case(alone, TARGETS[target], nth=2)[0]["y"][0]
        np.testing.assert_array_equal(got, batch[row], err_msg=f"row {row} alone vs in 8 rows")


# -- the fused QKV matmul of a step graph (fused_matmul rope_kv_store, attr step_rows) ------------

# (weights, cache, heads, qk_norm, bias): Llama's, a q8_0 and a q4_0 cache, head_dim 100 (RoPE halves of 50),
# Qwen3's per-head norms, Qwen2's biases
FUSED_STEP = [("q4_0", "f32", (4, 2, 32), False, False), ("q8_0", "q8_0", (4, 1, 64), False, False),
              ("f16", "f16", (2, 2, 100), False, False), ("q4_1", "f16", (4, 2, 48), True, False),
              ("f32", "f32", (3, 1, 32), False, True), ("q4_0", "f16", (4, 2, 48), True, True),
              ("q4_1", "q4_0", (4, 2, 64), False, False)]
FUSED_IDS = [f"{w}-{c}-{h}.{k}x{d}" + "-qknorm" * n + "-bias" * b for w, c, (h, k, d), n, b in FUSED_STEP]


@pytest.mark.parametrize("target", TARGET_NAMES)
@pytest.mark.parametrize("wdtype,cache_dtype,heads,qk_norm,bias", FUSED_STEP, ids=FUSED_IDS)
@pytest.mark.parametrize("T,n_tokens", [(9, 9), (9, 6), (16, 1)])
def test_fused_qkv_epilogue_ropes_and_stores_each_row_at_its_own_position_and_slot(
        target, wdtype, cache_dtype, heads, qk_norm, bias, T, n_tokens):
    case = matmul_case(wdtype, T, n_tokens, True, "rope_kv_store", cache_dtype=cache_dtype, heads=heads,
                       qk_norm=qk_norm, bias=bias, step_rows=True, seed=T + n_tokens)
    arrays = run_case(case, TARGETS[target], nth=2)[0]
    check(case, arrays)
    untouched = np.setdiff1d(np.arange(case.graph.values["kc"].shape[0]), case.arrays["slots"][:n_tokens])
    for c in ("kc", "vc"):
        np.testing.assert_array_equal(arrays[c][untouched], case.arrays[c][untouched])


def test_fused_qkv_epilogue_stores_nothing_for_a_slot_outside_the_cache():
    """As the step graph's kv_store: the back ends refuse such a step, and the kernel never writes
    outside the cache whatever it is given; q is roped all the same."""
    case = matmul_case("q8_0", 5, 5, True, "rope_kv_store", cache_dtype="f16", step_rows=True, seed=3)
    good = matmul_case("q8_0", 5, 5, True, "rope_kv_store", cache_dtype="f16", step_rows=True, seed=3)
    case.arrays["slots"][:] = [3, -1, 16, 1 << 30, 7]
    good.arrays["slots"][:] = [3, 0, 1, 2, 7]
    got, want = run_case(case, TARGETS["host"], nth=2)[0], good.expected()
    np.testing.assert_allclose(got["y"][:5], want["y"], rtol=1e-4, atol=1e-5)
    for c, out in (("kc", "kc2"), ("vc", "vc2")):
        expect = case.arrays[c].copy()
        expect[[3, 7]] = want[out][[3, 7]]
        np.testing.assert_allclose(got[c].astype(np.float32), expect.astype(np.float32), rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("target", TARGET_NAMES)
@pytest.mark.parametrize("wdtype", ["q4_0", "q4_1", "q8_0", "f16", "f32"])
def test_a_rows_fused_qkv_result_is_the_same_bits_alone_and_among_8_rows(target, wdtype):
    """The fused QKV of a step graph keeps the prefill kernel's batch invariance: q, and the k / v
    it stores at the row's slot, are the same bits alone (decode's tiles) and among 8 rows."""
    case = matmul_case(wdtype, 16, 8, True, "rope_kv_store", K=576, heads=(4, 2, 32), step_rows=True, seed=5)
    batch = run_case(case, TARGETS[target], nth=2)[0]
    for row, n in ((6, 1), (7, 3)):
        alone = matmul_case(wdtype, 16, n, True, "rope_kv_store", K=576, heads=(4, 2, 32), step_rows=True, seed=5)
        alone.arrays["x"][0] = case.arrays["x"][row]
        alone.arrays["positions"][0] = case.arrays["positions"][row]
        alone.arrays["slots"][0] = slot = case.arrays["slots"][row]
        got = run_case(alone, TARGETS[target], nth=2)[0]
        np.testing.assert_array_equal(got["y"][0], batch["y"][row], err_msg=f"q of row {row}")
        for c in ("kc", "vc"):
            np.testing.assert_array_equal(got[c][slot], batch[c][slot], err_msg=f"{c} of row {row}")
