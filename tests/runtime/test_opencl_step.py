"""The OpenCL back end's run_step on PoCL: a golden model's step graph (models/step.py, through
every compiler pass) with several sequences sharing each step, against the interpreter running
the same graph; a sequence's greedy tokens and its logits' bits whatever shares its steps; and
every bad index of a step refused in one line before the device runs."""
from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from llmrs.compiler.codegen.opencl import generate
from llmrs.compiler.codegen.opencl_tuning import OpenCLTuning
from llmrs.compiler.interpret import Interpreter
from llmrs.compiler.pipeline import CompileOptions, run_passes
from llmrs.models.llama import build_graphs, load_model
from llmrs.models.step import step_graph
from llmrs.runtime.backends.base import StepRows, StepRowsError
from llmrs.runtime.backends.opencl_step import StepShape, check_step, input_runs

from ..conftest import DATA, rel_err

cl = pytest.importorskip("pyopencl")
from llmrs.runtime.backends.opencl import OpenCLBackend, OpenCLError  # noqa: E402

pytestmark = pytest.mark.usefixtures("opencl_device")
BS = 4   # tokens a block


def _compiled(model: str, weights: str, kv: str, T: int, seqs: int, with_prefill: bool = False,
              max_seq_len: int = 64) -> dict[str, Any]:
    """The model's graphs after every pass: "step" (and "prefill", "decode" if asked), sharing one
    KV layout."""
    prefill, decode = build_graphs(load_model(DATA / model), prefill_T=T, max_seq_len=max_seq_len, kv_dtype=kv)
    opts = CompileOptions(weights=weights, kv_type=kv)
    graphs = {"step": run_passes(step_graph(prefill, max_seqs=seqs, block_size=BS), opts)}
    if with_prefill:
        graphs.update(prefill=run_passes(prefill, opts), decode=run_passes(decode, opts))
    return graphs


def _backend(graphs: dict[str, Any], **tuning: Any) -> OpenCLBackend:
    return OpenCLBackend.from_graphs(graphs, generate(graphs, replace(OpenCLTuning(), **tuning)))


class Pool:
    """A naive paged layout, as a scheduler keeps one: each sequence takes blocks from a
    shuffled list as it grows."""

    def __init__(self, n_blocks: int, rng: np.random.Generator, prompt_lens: dict[int, int] | None = None):
        """prompt_lens: each sequence's prompt length, so rows past it are marked generated (the
        back end's row split); None: no row is."""
        self.free = [int(b) for b in rng.permutation(n_blocks)]
        self.tables: dict[int, list[int]] = {}
        self.length: dict[int, int] = {}
        self.prompt_lens = prompt_lens

    def rows(self, rows: list[tuple[int, int]], seqs: list[int], logit_rows: list[int]) -> StepRows:
        """rows: (sequence, token) in step order, each sequence's rows its next positions;
        seqs: the sequences in block-table order."""
        pos, slots = [], []
        for seq, _ in rows:
            p = self.length.get(seq, 0)
            self.length[seq] = p + 1
            table = self.tables.setdefault(seq, [])
            while len(table) <= p // BS:
                table.append(self.free.pop())
            pos.append(p)
            slots.append(table[p // BS] * BS + p % BS)
        width = max(len(self.tables[s]) for s in seqs)     # narrower than the graph's: padded
        tables = np.full((len(seqs), width), -1, np.int32)  # entries no row reads: anything
        for i, s in enumerate(seqs):
            tables[i, :len(self.tables[s])] = self.tables[s]
        i32 = lambda a: np.array(a, np.int32)   # noqa: E731
        generated = None
        if self.prompt_lens is not None:
            generated = i32([p >= self.prompt_lens[seq] for (seq, _), p in zip(rows, pos)])
        return StepRows(tokens=i32([t for _, t in rows]), positions=i32(pos), slots=i32(slots),
                        row_seq=i32([seqs.index(s) for s, _ in rows]), ctx_len=i32([p + 1 for p in pos]),
                        block_tables=tables, logit_rows=i32(logit_rows), generated=generated)


def _interpret(ip: Interpreter, state: dict, rows: StepRows) -> np.ndarray:
    inputs = check_step(rows, StepShape.of(ip.graph))   # the arrays the device gets
    inputs.pop("generated", None)                         # a kernel choice; the interpreter has one
    return ip.run(inputs, state, n_past=0)[ip.graph.outputs[0]][:len(rows.logit_rows)]


# (model, weights, KV type): head_dim 16 with GQA; q4_0 weights (their activations quantized per
# row) with an f16 cache; head_dim 100 with MQA
# and the generated rows on tensor cores (MV_MMA) for q4_0, q8_0 and f16 weights: summed
# directly, as a device without tensor cores runs them, or "emulated" (mma.sync's fragments);
# "lx": the quantized ones with their lanes quantizing x (mv_mma_lx), q4_1 too. q4_1 runs on
# golden-c: on golden-a a prompt row's SwiGLU output (down_proj's input) lies an ulp from a Q8_1
# half step (code 70, 7.6e-6 off), where the kernel's SiLU, an ulp off numpy's, picks the other
# code (7e-3 on the logits with every variant; golden-b's q4_1 misses too where its prompt rows
# take the prefill matmul's tensor-core body, not traced)
MODELS = [("golden-a", "f32", "f32", False), ("golden-b", "q4_0", "f16", False), ("golden-c", "f32", "f32", False),
          ("golden-b", "q4_0", "f16", True), ("golden-a", "q8_0", "f32", True), ("golden-a", "f16", "f32", False),
          ("golden-a", "f16", "f32", True), ("golden-a", "f16", "f32", "emulated"),
          ("golden-a", "q8_0", "f32", "emulated"), ("golden-b", "q4_0", "f16", "lx"),
          ("golden-b", "q4_0", "f16", "lx-emulated"), ("golden-a", "q8_0", "f32", "lx-emulated"),
          ("golden-c", "q4_1", "f32", "lx"), ("golden-c", "q4_1", "f32", "lx-emulated")]


def _tol(weights: str, mma: bool | str, be: OpenCLBackend) -> float:
    """The step's error against the interpreter: f16 weights on the tensor-core matvec multiply x
    rounded to f16 (2^-11 of a value), not f32 x; so do the prompt rows on a device whose prefill
    matmul runs its tensor-core body (-DUSE_NV_MMA: a card, or emulated), whatever `mma` says."""
    tensor_rows = mma or "-DUSE_NV_MMA" in be.build_options
    return 1e-3 if weights == "f16" and tensor_rows else 1e-4


@pytest.mark.parametrize("model,weights,kv,mma", MODELS)
def test_interleaved_sequences_match_the_interpreter_and_their_greedy_tokens_a_run_alone(model, weights, kv, mma,
                                                                                          monkeypatch):
    """Three prompts of 7, 3 and 10 tokens: the second joins in the first's step, the third
    mid-run; prompt chunks beside decode rows, rows in another order than the tables."""
    if str(mma).endswith("emulated"):
        monkeypatch.setenv("LLMRS_OPENCL_EMULATE_MMA", "1")
    graphs = _compiled(model, weights, kv, T=16, seqs=4)
    plan = generate(graphs, replace(OpenCLTuning(), mv_mma=bool(mma), mv_mma_f16=bool(mma),
                                    mv_mma_lx=str(mma).startswith("lx"), mv_mma_chunk=64))
    assert any("-DMV_MMA" in launch["options"] for launch in plan["graphs"]["step"]) == bool(mma)
    be, ip = OpenCLBackend.from_graphs(graphs, plan), Interpreter(graphs["step"])
    state = ip.new_state()
    rng = np.random.default_rng(41)
    vocab = graphs["step"].values[graphs["step"].outputs[0]].shape[1]
    prompts = [rng.integers(0, vocab, n).tolist() for n in (7, 3, 10)]
    lens = {s: len(p) for s, p in enumerate(prompts)}      # sampled tokens run as generated rows
    pool, made = Pool(16, rng, lens), {0: [], 1: [], 2: []}

    def step(rows: list[tuple[int, int]], seqs: list[int], logits_of: list[int]) -> None:
        """One step on both; the rows in logits_of (each a sequence's last) get a token."""
        sr = pool.rows(rows, seqs, logits_of)
        got, want = be.run_step(sr), _interpret(ip, state, sr)
        assert got.shape == want.shape == (len(logits_of), vocab)
        assert rel_err(got, want) <= _tol(weights, mma, be)
        for r, logits in zip(logits_of, got):
            assert int(np.argmax(logits)) == int(np.argmax(want[logits_of.index(r)]))
            made[rows[r][0]].append(int(np.argmax(logits)))

    step([(0, t) for t in prompts[0]] + [(1, t) for t in prompts[1][:2]], [0, 1], [6])
    step([(0, made[0][-1]), (1, prompts[1][2])] + [(2, t) for t in prompts[2][:5]], [0, 1, 2], [0, 1])
    step([(2, t) for t in prompts[2][5:]] + [(1, made[1][-1]), (0, made[0][-1])], [0, 1, 2], [4, 5, 6])
    for order in ([2, 0, 1], [1, 2, 0], [0, 1, 2]):
        step([(s, made[s][-1]) for s in order], [0, 2, 1], [0, 1, 2])

    for s, prompt in enumerate(prompts):   # each alone: its prompt in one step, then its tokens
        be.reset()
        alone, want = Pool(16, np.random.default_rng(s), {0: len(prompt)}), made[s]
        logits = be.run_step(alone.rows([(0, t) for t in prompt], [0], [len(prompt) - 1]))
        tokens = [int(np.argmax(logits[0]))]
        for tok in want[:-1]:
            tokens.append(int(np.argmax(be.run_step(alone.rows([(0, tok)], [0], [0]))[0])))
        assert tokens == want, f"sequence {s}"


@pytest.mark.parametrize("weights,split,matvec,mma", [("q4_0", True, True, False), ("q4_0", True, True, True),
                                                     pytest.param("q4_0", True, True, "lx", marks=pytest.mark.slow),
                                                     ("f16", True, True, True), ("q4_0", False, True, False),
                                                     ("q4_0", True, False, False)],
                         ids=["generated-rows-in-matvec", "generated-rows-on-tensor-cores",
                              "generated-rows-on-tensor-cores-lanes-quantize-x",
                              "f16-generated-rows-on-tensor-cores", "every-row-tiled",
                              "generated-rows-tiled-by-the-plan"])
def test_a_sequences_logits_are_bit_identical_alone_and_in_a_batch_of_8(weights, split, matvec, mma):
    """8 sequences (prompts of 1 to 5 tokens) decode 3 tokens in steps of all of them; each
    again alone: the same bits every step, whether its prompt runs in one step (as in the
    batch) or a token a step (its rows then in the rows kernel, not the tiles kernel, and a
    lone prompt row still in the tiled matmul). Split: sampled tokens are generated rows (the
    decode matvec, unless the plan's tuning sends them through the tiles: matvec False, or 16 a
    group on tensor cores: mma); else every row runs tiled."""
    graphs = _compiled("golden-b", weights, "f16", T=32, seqs=8)
    plan = generate(graphs, replace(OpenCLTuning(), mv_generated_rows=matvec, mv_mma=bool(mma), mv_mma_f16=bool(mma),
                                    mv_mma_lx=mma == "lx"))
    assert any("-DMV_MMA" in launch["options"] for launch in plan["graphs"]["step"]) == bool(mma)
    parts = {launch["part"] for launch in plan["graphs"]["step"]}
    assert ("rest" in parts) == matvec   # without the split no launch runs the generated rows apart
    be = OpenCLBackend.from_graphs(graphs, plan)
    rng = np.random.default_rng(42)
    vocab = graphs["step"].values["logits"].shape[1]
    prompts = [rng.integers(0, vocab, n).tolist() for n in (3, 1, 5, 2, 4, 5, 1, 3)]
    lens = (lambda seqs: {s: len(prompts[q]) for s, q in seqs.items()}) if split else (lambda seqs: None)
    pool = Pool(16, rng, lens({s: s for s in range(8)}))
    rows = [(s, t) for s, p in enumerate(prompts) for t in p]
    last = np.cumsum([len(p) for p in prompts]) - 1
    batch = [be.run_step(pool.rows(rows, list(range(8)), last.tolist()))]
    for _ in range(3):
        tokens = [int(np.argmax(x)) for x in batch[-1]]
        batch.append(be.run_step(pool.rows([(s, tokens[s]) for s in range(8)], list(range(8)), list(range(8)))))
    for s, prompt in enumerate(prompts):
        be.reset()
        alone = Pool(16, np.random.default_rng(100 + s), lens({0: s}))   # other blocks, the same entries
        if s % 2:
            for t in prompt:
                got = [be.run_step(alone.rows([(0, t)], [0], [0]))[0]]
        else:
            got = [be.run_step(alone.rows([(0, t) for t in prompt], [0], [len(prompt) - 1]))[0]]
        for k in range(3):
            got.append(be.run_step(alone.rows([(0, int(np.argmax(batch[k][s])))], [0], [0]))[0])
        for k, logits in enumerate(got):
            np.testing.assert_array_equal(logits, batch[k][s], err_msg=f"sequence {s}, step {k}")


@pytest.mark.parametrize("model,weights,kv,mma,sx", [("golden-b", "q4_0", "f16", False, True),
                                                     ("golden-b", "q4_0", "f16", False, False),
                                                     ("golden-c", "q8_0", "f32", False, True),
                                                     ("golden-a", "f32", "f32", False, True),
                                                     ("golden-b", "q4_0", "f16", True, True),
                                                     ("golden-c", "q8_0", "f32", True, True),
                                                     ("golden-b", "q4_0", "f16", "lx", True),
                                                     ("golden-c", "q8_0", "f32", "lx", True),
                                                     ("golden-a", "f16", "f32", True, True)])
def test_a_generated_row_has_the_same_bits_at_any_place_in_a_matvec_group_of_any_size(model, weights, kv, mma, sx):
    """The generated rows' matvec takes T rows a group (MV_TOKS): S sequences of one prompt and
    the same tokens (S = 1..T + 1, so groups of 1 to T valid rows and a row alone in a second
    group) give every row, at every place in its group, the bits one sequence alone gets. sx:
    steps of mv_sx_from rows or more run the twin (quantized weights: MV_SX, x staged once a row,
    T = mv_sx_toks; float: T = mv_toks_float), fewer the one-token matvec, so S crosses from one
    to the other; else quantized weights' T rows a group keep their Q8_0 copies of x in local
    memory. mma: the tensor-core matvec (MV_MMA;
    emulated or summed directly here), K in chunks of 64."""
    graphs = _compiled(model, weights, kv, T=40, seqs=20, max_seq_len=128)
    # as many rows a group as local memory allows (the default tuning measured 1 best for
    # quantized weights on an H100, opencl_tuning.py), so groups of many rows are what is tested
    plan = generate(graphs, replace(OpenCLTuning(), mv_toks_quant=16, mv_toks_float=8, mv_mma=bool(mma),
                                    mv_mma_f16=bool(mma), mv_mma_lx=mma == "lx", mv_mma_chunk=64,
                                    **({} if sx else {"mv_sx_from": 0})))
    T = max(launch["row_tile"] for launch in plan["graphs"]["step"] if launch.get("part") == "rest")
    assert T > 1
    assert any("-DMV_MMA" in launch["options"] for launch in plan["graphs"]["step"]) == bool(mma)
    # the lanes quantize x: no stage_x before the generated rows' launches
    assert any("-DMV_MMA_LX" in launch["options"] for launch in plan["graphs"]["step"]) == (mma == "lx")
    assert not (mma == "lx" and any(launch["kernel"] == "stage_x" and launch.get("part") == "rest"
                                    for launch in plan["graphs"]["step"]))
    twins = any("-DMV_SX" in launch["options"] for launch in plan["graphs"]["step"])
    assert twins == (sx and weights != "f32" and not mma)
    # float weights' pair: the one-token matvec below mv_sx_from rows, T a group from there
    assert any(launch["rows_from"] for launch in plan["graphs"]["step"]) == (sx and not mma)
    if sx and not mma:   # the steps cross from the one-token matvec to the twin
        assert OpenCLTuning().mv_sx_from <= T
    be = OpenCLBackend.from_graphs(graphs, plan)
    rng = np.random.default_rng(43)
    vocab = graphs["step"].values["logits"].shape[1]
    prompt, tokens = rng.integers(0, vocab, 2).tolist(), rng.integers(0, vocab, 2).tolist()
    first = None
    for n_seqs in (1, 2, T - 1, T, T + 1):
        be.reset()
        pool = Pool(32, np.random.default_rng(n_seqs), {s: len(prompt) for s in range(n_seqs)})
        seqs = list(range(n_seqs))
        got = [be.run_step(pool.rows([(s, t) for s in seqs for t in prompt], seqs,
                                     [len(prompt) * s + len(prompt) - 1 for s in seqs]))]
        for tok in tokens:
            got.append(be.run_step(pool.rows([(s, tok) for s in seqs], seqs, seqs)))
        first = first or [step[0] for step in got]
        for k, step in enumerate(got):
            for s in seqs:
                np.testing.assert_array_equal(step[s], first[k], err_msg=f"{n_seqs} sequences, row {s}, step {k}")


@pytest.mark.parametrize("variants", [("16", "wide"), pytest.param(("32", "64"), marks=pytest.mark.slow)])
def test_f16_tensor_core_matvec_rows_a_warp_change_no_bits(variants):
    """mv_mma_f16_rpw: 16, 32 or 64 weight rows a warp (MMA columns sharing each lane's x values),
    or 32 for the wide matrices alone (mv_mma_f16_wide: here the 384-row gate/up and head), sum
    every (token, row) in the order 8 rows a warp does (its K slice's blocks in order, then the
    slices in order), so a step's logits are the same bits under each, and the interpreter's."""
    graphs = _compiled("golden-a", "f16", "f32", T=16, seqs=4)
    ip = Interpreter(graphs["step"])
    every = {str(rpw): ({rpw}, dict(mv_mma_f16_rpw=rpw, mv_mma_f16_wide=0)) for rpw in (8, 16, 32, 64)}
    every["wide"] = ({16, 32}, dict(mv_mma_f16_rpw=16, mv_mma_f16_rpw_wide=32, mv_mma_f16_wide=256))
    got = {}
    for name in ("8", *variants):   # each against 8 rows a warp
        rows_a_warp, tuning = every[name]
        plan = generate(graphs, replace(OpenCLTuning(), **tuning))
        assert {f"-DMV_ROWS={rpw}" for rpw in rows_a_warp} == {
            o for launch in plan["graphs"]["step"] if "-DMV_MMA" in launch["options"]
            for o in launch["options"] if o.startswith("-DMV_ROWS=")}
        be, state = OpenCLBackend.from_graphs(graphs, plan), ip.new_state()
        rng = np.random.default_rng(47)
        vocab = graphs["step"].values["logits"].shape[1]
        prompts = [rng.integers(0, vocab, n).tolist() for n in (5, 3)]
        pool = Pool(16, rng, {0: 5, 1: 3})
        rows = pool.rows([(0, t) for t in prompts[0]] + [(1, t) for t in prompts[1]], [0, 1], [4, 7])
        steps = [be.run_step(rows)]
        assert rel_err(steps[0], _interpret(ip, state, rows)) <= _tol("f16", True, be)
        for _ in range(3):
            tokens = [int(np.argmax(x)) for x in steps[-1]]
            rows = pool.rows([(0, tokens[0]), (1, tokens[1])], [0, 1], [0, 1])
            steps.append(be.run_step(rows))
            assert rel_err(steps[-1], _interpret(ip, state, rows)) <= _tol("f16", True, be)
        got[name] = steps
    for name in variants:
        for k, (a, b) in enumerate(zip(got["8"], got[name])):
            np.testing.assert_array_equal(a, b, err_msg=f"{name} rows a warp, step {k}")


def test_the_device_argmax_of_a_step_is_the_argmax_of_its_logits_in_the_rows_order():
    """run_step_argmax (a batch whose samplers are all greedy): the plan's argmax kernel after the
    head gives each chosen row's token, in logit_rows' order, through the row split's reordering."""
    graphs = _compiled("golden-b", "q4_0", "f16", T=16, seqs=4)
    be = _backend(graphs)
    assert "step" in be.greedy
    rng = np.random.default_rng(44)
    vocab = graphs["step"].values["logits"].shape[1]
    prompts = [rng.integers(0, vocab, n).tolist() for n in (4, 6, 3)]
    pool = Pool(16, rng, {s: len(p) for s, p in enumerate(prompts)})
    first = pool.rows([(s, t) for s, p in enumerate(prompts) for t in p], [0, 1, 2], [12, 3, 9])
    tokens = be.run_step_argmax(first)
    np.testing.assert_array_equal(tokens, np.argmax(be.run_step(first), axis=-1))   # the same rows again
    # generated rows before a prompt row, logits asked in another order
    pool.prompt_lens[3] = 5
    rows = [(1, int(tokens[2])), (3, 7), (0, int(tokens[1])), (2, int(tokens[0]))]
    mixed = pool.rows(rows, [0, 1, 2, 3], [3, 0, 2])
    got = be.run_step_argmax(mixed)
    assert got.dtype == np.int32 and got.shape == (3,)
    pool.length = {s: n - 1 for s, n in pool.length.items() if s != 3} | {3: 0}   # write the same slots again
    np.testing.assert_array_equal(got, np.argmax(be.run_step(pool.rows(rows, [0, 1, 2, 3], [3, 0, 2])), axis=-1))


def test_a_sequence_alone_with_the_identity_table_continues_the_prefill_graphs_cache():
    """The step graph reads the KV states the prefill and decode graphs write: a sequence whose
    table is [0, 1, 2, ...] continues where prefill left it, as the decode graph does."""
    graphs = _compiled("golden-b", "q4_0", "f16", T=8, seqs=2, with_prefill=True)
    be = _backend(graphs)
    prompt = np.array([3, 17, 250, 9, 42, 7, 101], np.int32)
    be.run("prefill", prompt, 0, 0)
    want = be.run("decode", np.array([5], np.int32), len(prompt), len(prompt))
    n = len(prompt)
    identity = np.arange(64 // BS, dtype=np.int32)[None, :]
    one = lambda a: np.array([a], np.int32)   # noqa: E731
    got = be.run_step(StepRows(tokens=one(5), positions=one(n), slots=one(n), row_seq=one(0), ctx_len=one(n + 1),
                               block_tables=identity, logit_rows=one(0)))
    assert rel_err(got, want) <= 1e-4


@pytest.fixture(scope="module")
def small_step() -> tuple[OpenCLBackend, StepRows]:
    graphs = _compiled("golden-a", "f32", "f32", T=8, seqs=2)
    pool = Pool(16, np.random.default_rng(43))
    return _backend(graphs), pool.rows([(0, 5), (0, 6), (1, 7)], [0, 1], [1, 2])


# one bad value a case: (field, value, what the message says); S = 64 slots, 16 blocks of 4, 2
# sequences of the step, 3 rows, a vocabulary of 384. OpenCL's step runs through the check every
# back end shares (base.py check_step_rows; tests/runtime/test_step_backends.py has the CPU's)
BAD = [("tokens", [5, 384, 7], r"tokens\[1\] = 384 is outside 0..383 \(the vocabulary\)"),
       ("positions", [0, -3, 0], r"positions\[1\] = -3 is outside 0..2147483647"),
       ("slots", [1, 64, 2], r"slots\[1\] = 64 is outside 0..63 \(the KV cache's slots\)"),
       ("slots", [1, 2, 1], r"two rows write the same KV slot; give each row its own slot"),
       ("row_seq", [0, 0, 2], r"row_seq\[2\] = 2 is outside 0..1 \(rows of block_tables\)"),
       ("ctx_len", [1, 0, 1], r"ctx_len\[1\] = 0 is outside 1..4"),
       ("ctx_len", [1, 2, 5], r"ctx_len\[2\] = 5 is outside 1..4 \(KV entries a row attends\)"),   # 1 block of 4
       ("block_tables", [[3], [16]], r"block_tables\[1, 0\] = 16 is outside 0..15 \(the cache's blocks\)"),
       ("logit_rows", [1, 3], r"logit_rows\[1\] = 3 is outside 0..2 \(the step's rows\)"),
       ("logit_rows", [0, 1, 2], r"logit_rows has 3 entries; give 1..2"),
       ("slots", [1, 2], r"slots has 2 entries for 3 tokens"),
       ("positions", [0, 1 << 40, 2], r"positions\[1\] = 1099511627776 is outside 0..2147483647"),
       ("block_tables", np.zeros((3, 1), np.int32), r"block_tables is \[3, 1\]; give \[1..2, 1..16\]"),
       ("ctx_len", [1.0, 2.0, 1.0], r"ctx_len must be a 1-d array of integers, got float64\[3\]"),
       ("score_from", [0, 1], r"score_from has 2 entries for 3 tokens")]


@pytest.mark.parametrize("field,value,message", BAD, ids=[f"{f}-{i}" for i, (f, _, _) in enumerate(BAD)])
def test_a_step_with_a_bad_index_is_refused_in_one_line(small_step, field, value, message):
    be, good = small_step
    with pytest.raises(StepRowsError, match="^step rows: " + message) as e:
        be.run_step(replace(good, **{field: np.asarray(value)}))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("tokens,message", [([1, 2], "tokens has 2 entries for 3 tokens"),
                                            ([1, 2, 384], r"tokens\[2\] = 384 is outside 0\.\.383 \(the vocabulary\)"),
                                            ([1.5, 2.5, 3.5], r"tokens must be a 1-d array of integers")])
def test_a_prepared_steps_late_tokens_are_checked_as_its_rows_were(small_step, tokens, message):
    """A step prepared while the last one runs gets its sampled tokens at launch
    (launch_step): the same one-line refusal as a bad step's rows, before anything runs; the
    prepared step then still launches with good tokens."""
    be, good = small_step
    prepared = be.prepare_step(good, False)
    with pytest.raises(StepRowsError, match="^step rows: " + message):
        be.launch_step(prepared, np.asarray(tokens))
    np.testing.assert_array_equal(be.collect_step(be.launch_step(prepared, np.asarray(good.tokens))),
                                  be.run_step(good))


def test_too_many_rows_and_a_plan_without_a_step_graph_are_refused(small_step):
    be, good = small_step
    nine = np.arange(9, dtype=np.int32)
    with pytest.raises(StepRowsError, match="a step takes 1..8 rows, got 9"):
        be.run_step(replace(good, tokens=nine))
    graphs = _compiled("golden-a", "f32", "f32", T=8, seqs=2, with_prefill=True)
    del graphs["step"]
    with pytest.raises(OpenCLError, match="this plan has no step graph"):
        _backend(graphs).run_step(good)


def test_inputs_end_to_end_in_one_buffer_go_as_one_copy_and_a_gap_or_another_buffer_splits_them():
    a, b = object(), object()
    places = [("slots", a, 128, 16), ("tokens", a, 0, 32), ("positions", a, 96, 32), ("ctx_len", a, 160, 8),
              ("row_seq", b, 0, 8), ("block_tables", a, 320, 64), ("score_from", a, 64, 24)]
    runs = input_runs(places, 32)
    # in offset order within a buffer (the buffers' own order is not defined)
    assert sorted(((buf is a, off, n, members) for buf, off, n, members in runs), key=lambda r: (not r[0], r[1])) == [
        (True, 0, 32, [("tokens", 0)]),                       # a gap of 32 bytes after it
        # end to end but for the padding up to each next 32-byte boundary
        (True, 64, 104, [("score_from", 0), ("positions", 32), ("slots", 64), ("ctx_len", 96)]),
        (True, 320, 64, [("block_tables", 0)]),               # 128 bytes of gap before it
        (False, 0, 8, [("row_seq", 0)])]
    # every input in exactly one run, at its own offset
    at = {name: off + rel for _, off, _, members in runs for name, rel in members}
    assert at == {name: off for name, _, off, _ in places}


def test_a_steps_inputs_take_few_copies(small_step):
    """The memory plan puts a step graph's row inputs side by side (each 64-byte aligned), so a
    step writes them in a few copies rather than one each."""
    be, good = small_step
    be.run_step(good)
    (key, runs), = be._input_runs.items()
    assert sum(len(m) for *_, m in runs) == len(key[1]) >= 8
    assert len(runs) <= 3, runs


@pytest.fixture(scope="module")
def hd32(tmp_path_factory):
    """A tiny random Llama whose head_dim (32) a quantized KV cache takes."""
    from llmrs.models.tiny import make_model
    return str(make_model(tmp_path_factory.mktemp("hd32") / "m", head_dim=32, dtype="f32"))


@pytest.fixture(scope="module")
def hd64(tmp_path_factory):
    """And one of head_dim 64: its q / k rows store whole blocks of a head from the qkv matvec (64
    rows a group), not one head a group as head_dim 32's."""
    from llmrs.models.tiny import make_model
    return str(make_model(tmp_path_factory.mktemp("hd64") / "m", head_dim=64, dtype="f32"))


@pytest.mark.parametrize("model,weights,kv,max_seq_len", [
    ("golden-a", "f32", "f32", 256), ("golden-a", "f32", "f32", 512), ("golden-b", "q4_0", "f16", 256),
    ("golden-c", "f32", "f32", 256), ("hd32", "f32", "q8_0", 256), ("hd32", "q8_0", "q4_0", 512),
    ("hd64", "f16", "q8_0", 256), ("hd32", "f16", "q4_0", 256)])
def test_a_cache_of_several_attention_splits_matches_the_interpreter_in_prompt_and_decode_steps(model, weights, kv,
                                                                                                 max_seq_len, request):
    """A plan whose cache holds more entries than one paged-attention split (ATT_SPLITS > 1, as
    every serving plan's does): a 150-token prompt in 16-row runs (attention_paged_tiles, a group
    a head) beside a short one, then decode rows of 10 and 151+ entries side by side
    (attention_paged_rows: one split and two, folded) against the interpreter. The tiles
    kernel's grid was once cut to the rows kernel's splits, leaving heads uncomputed (errors of
    0.4-1.0). A quantized cache may round a code of K or V, and quantized weights a code of a
    row's Q8_0 input, otherwise than numpy does near a tie (one step's logits off by ~1e-2, the
    next ones exact again), hence their looser bounds. f16 weights: the generated rows' tensor-core
    matvec (64 rows a group where the store takes whole blocks of a head) with x rounded to f16."""

    name = model
    if model in ("hd32", "hd64"):
        model = request.getfixturevalue(model)
    graphs = _compiled(model, weights, kv, T=16, seqs=4, max_seq_len=max_seq_len)
    plan = generate(graphs, OpenCLTuning())
    if weights == "f16":   # the generated rows on the tensor-core matvec; head_dim 64's K and V store too
        mma = [launch["options"] for launch in plan["graphs"]["step"] if "-DMV_MMA" in launch["options"]]
        assert mma and any("-DKV_BLOCKS" in options for options in mma) == (name == "hd64")
    be, ip = OpenCLBackend.from_graphs(graphs, plan), Interpreter(graphs["step"])
    assert any(b.splits > 1 for b in be.launches["step"] if b.kernel.function_name == "attention_paged_rows")
    tol = 3e-2 if weights != "f32" else {"f32": 1e-4, "f16": 1e-3}.get(kv, 3e-3)
    state = ip.new_state()
    rng = np.random.default_rng(5)
    vocab = graphs["step"].values[graphs["step"].outputs[0]].shape[1]
    long, short = rng.integers(0, vocab, 150).tolist(), rng.integers(0, vocab, 9).tolist()
    pool = Pool(StepShape.of(graphs["step"]).n_blocks, rng, {0: 150, 1: 9})

    def step(rows: list[tuple[int, int]], logit_rows: list[int]) -> list[int]:
        sr = pool.rows(rows, [0, 1], logit_rows)
        got, want = be.run_step(sr), _interpret(ip, state, sr)
        assert rel_err(got, want) <= tol
        return [int(np.argmax(w)) for w in want]

    tokens = step([(1, t) for t in short] + [(0, t) for t in long[:7]], [8, 15])
    for c in range(7, 150, 16):                      # the long prompt's runs of 16 rows
        chunk = long[c:c + 16]
        last = step([(0, t) for t in chunk], [len(chunk) - 1])
    tokens = [last[0], tokens[0]]
    for _ in range(3):                               # rows of 151.. and 10.. entries in one step
        tokens = step([(0, tokens[0]), (1, tokens[1])], [0, 1])


def test_paged_attention_launches_only_the_splits_its_longest_row_needs():
    """attention_paged_rows built with ATT_GRID_BY_ROWS: a row of L entries folds ceil(L / ATT_WG)
    splits (the rest of its groups returned at once), so a step launches that many for its longest
    row, never more than the plan's ATT_SPLITS; without a length, the whole cache's."""
    from llmrs.runtime.backends.opencl_launch import Bound
    b = Bound("att", None, local=128, groups=32 * 32, rows=16, row_tile=1, splits=32)
    assert b.global_size(16, longest=80) == (32 * 1 * 128, 16)
    assert b.global_size(16, longest=129) == (32 * 2 * 128, 16)
    assert b.global_size(16, longest=128 * 32) == b.global_size(16, longest=10 ** 6) == (32 * 32 * 128, 16)
    assert b.global_size(16) == (32 * 32 * 128, 16)
    fixed = Bound("att", None, local=128, groups=32 * 32, rows=16, row_tile=1)   # a plan built before
    assert fixed.global_size(16, longest=80) == (32 * 32 * 128, 16)
