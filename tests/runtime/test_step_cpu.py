"""The step graph compiled into a plan and run on the CPU back end: sequences of different prompt
lengths joining mid-run, their prompts in chunks beside other sequences' decode rows, each with
its KV in blocks scattered over the pool, give each sequence the greedy tokens it gets alone
through the prefill and decode graphs, and the interpreter's logits; a row's logits are the same
bits alone and among 8 rows."""
from __future__ import annotations

from typing import Callable

import numpy as np
import pytest

from llmrs.compiler.cli import main as compile_main
from llmrs.runtime.backends.base import StepRows
from llmrs.runtime.backends.cpu import CpuBackend
from llmrs.runtime.backends.reference import ReferenceBackend
from llmrs.runtime.plan import Plan

from ..conftest import DATA, GOLDEN, rel_err
from .step_driver import Blocks

TOL = 1e-4
N_NEW = 5


def _compile(out, model, *flags: str) -> Plan:
    assert compile_main([str(model), "-o", str(out), "--target", "cpu", "--prefill-chunk", "16", "-q", *flags]) == 0
    return Plan.open(out)


@pytest.fixture(scope="module", params=[(g, "f32", "f32") for g in GOLDEN] + [("golden-b", "q8_0", "f16")],
                ids=[f"{g}-f32" for g in GOLDEN] + ["golden-b-q8_0-f16"])
def plan(request, tmp_path_factory) -> Plan:
    """A 64-slot cache in 16 blocks of 4, up to 4 sequences a step."""
    name, weights, kv = request.param
    return _compile(tmp_path_factory.mktemp("step") / f"{name}-{weights}.plan.bin", DATA / name, "--weights", weights,
                    "--kv-type", kv, "--max-seq-len", "64", "--block-size", "4", "--max-num-seqs", "4")


def greedy_alone(be: CpuBackend, prompt: np.ndarray, n_new: int, chunk: int) -> list[int]:
    """The prompt through the prefill graph in chunks, then greedy tokens through the decode graph."""
    be.reset()
    for s in range(0, len(prompt), chunk):
        logits = be.run("prefill", prompt[s:s + chunk], s, s)
    out = [int(np.argmax(logits[-1]))]
    for i in range(n_new - 1):
        n = len(prompt) + i
        out.append(int(np.argmax(be.run("decode", np.array(out[-1:], np.int32), n, n)[-1])))
    return out


def interleaved(be, blocks: Blocks, prompts: list[np.ndarray], joins: list[int], chunks: list[int],
                n_new: int, seen: Callable[[StepRows, np.ndarray], None] = lambda rows, logits: None
                ) -> list[list[int]]:
    """Greedy tokens of every sequence through the step graph: sequence s joins at step joins[s]
    and feeds its prompt chunks[s] tokens a step, beside the others' decode rows. seen(rows,
    logits) hears every step."""
    fed = [0] * len(prompts)                    # prompt tokens fed so far
    made: list[list[int]] = [[] for _ in prompts]
    step = 0
    while any(len(m) < n_new for m in made):
        rows, want, owner = [], [], []
        for s, prompt in enumerate(prompts):
            if step < joins[s] or len(made[s]) == n_new:
                continue
            if fed[s] < len(prompt):
                take = prompt[fed[s]:fed[s] + chunks[s]]
                rows += [(s, int(t)) for t in take]
                fed[s] += len(take)
                if fed[s] < len(prompt):
                    continue                    # a prompt chunk short of the end gives no token
            else:
                rows.append((s, made[s][-1]))
            want.append(len(rows) - 1)
            owner.append(s)
        step_rows = blocks.rows(rows, want)
        got = be.run_step(step_rows)
        seen(step_rows, got)
        for s, logits in zip(owner, got):
            made[s].append(int(np.argmax(logits)))
        step += 1
    return made


def test_sequences_joining_mid_run_get_their_greedy_tokens_alone(plan):
    """Three prompts (11, 4 and 9 tokens): the first whole in step 0, the second 2 tokens a step
    from step 0, the third 5 a step from step 1; then one decode row each per step."""
    shape = plan.step_shape()
    rng = np.random.default_rng(17)
    prompts = [rng.integers(3, shape.vocab, n).astype(np.int32) for n in (11, 4, 9)]
    oracle, errors = ReferenceBackend(plan.graphs()), []
    be = CpuBackend(plan, threads=2)
    try:
        alone = [greedy_alone(be, p, N_NEW, plan.manifest["prefill_chunk"]) for p in prompts]
        be.reset()
        made = interleaved(be, Blocks(shape, rng), prompts, joins=[0, 0, 1], chunks=[11, 2, 5], n_new=N_NEW,
                           seen=lambda rows, logits: errors.append(rel_err(logits, oracle.run_step(rows))))
    finally:
        be.close()
    assert made == alone
    assert len(errors) == 7 and max(errors) <= TOL


def _prefilled(be, blocks: Blocks, prompts: list[np.ndarray]) -> None:
    """Each prompt but its last token, one sequence a step."""
    for s, prompt in enumerate(prompts):
        be.run_step(blocks.rows([(s, int(t)) for t in prompt[:-1]], [len(prompt) - 2]))


def _alone_and_in_8(plan: Plan, threads: int) -> tuple[np.ndarray, list[np.ndarray]]:
    """Eight sequences (prompts of 2..16 tokens): every one's last prompt token in one step of
    8 rows, then rows 0, 3 and 7 again alone (their KV slots rewritten with the same bits)."""
    shape = plan.step_shape()
    rng = np.random.default_rng(29)
    prompts = [rng.integers(3, shape.vocab, n).astype(np.int32) for n in (5, 2, 16, 9, 3, 12, 7, 4)]
    be = CpuBackend(plan, threads=threads)
    try:
        blocks = Blocks(shape, rng)
        _prefilled(be, blocks, prompts)
        last = [(s, int(p[-1])) for s, p in enumerate(prompts)]
        together = be.run_step(blocks.rows(last, list(range(8))))
        alone = []
        for s in (0, 3, 7):
            blocks.length[s] -= 1               # the same position and slot again
            alone.append(be.run_step(blocks.rows([last[s]], [0]))[0])
    finally:
        be.close()
    return together, alone


@pytest.fixture(scope="module")
def q4_plan(tmp_path_factory) -> Plan:
    """32 blocks of 4 slots, up to 8 sequences a step (the default)."""
    return _compile(tmp_path_factory.mktemp("step-q4") / "golden-c-q4_0.plan.bin", DATA / "golden-c",
                    "--weights", "q4_0", "--kv-type", "f16", "--max-seq-len", "128", "--block-size", "4")


@pytest.mark.parametrize("threads", [1, 3])
def test_a_rows_logits_are_the_same_bits_alone_and_among_8_rows(q4_plan, threads):
    together, alone = _alone_and_in_8(q4_plan, threads)
    for row, logits in zip((0, 3, 7), alone):
        np.testing.assert_array_equal(logits, together[row], err_msg=f"row {row}")


def test_smollm2_rows_are_the_same_bits_alone_and_among_8_rows(smollm2_plan):
    """The real model, its own Q4_1 / Q8_0 weights: the grouped q4_1 and q8_0 matmul paths."""
    together, alone = _alone_and_in_8(Plan.open(smollm2_plan), threads=2)
    for row, logits in zip((0, 3, 7), alone):
        np.testing.assert_array_equal(logits, together[row], err_msg=f"row {row}")


def test_smollm2_sequences_joining_mid_run_get_their_greedy_tokens_alone(smollm2_plan):
    plan = Plan.open(smollm2_plan)
    shape = plan.step_shape()
    rng = np.random.default_rng(31)
    prompts = [rng.integers(100, 20000, n).astype(np.int32) for n in (13, 6, 21)]
    be = CpuBackend(plan, threads=2)
    try:
        alone = [greedy_alone(be, p, 4, plan.manifest["prefill_chunk"]) for p in prompts]
        be.reset()
        made = interleaved(be, Blocks(shape, rng), prompts, joins=[0, 1, 1], chunks=[13, 3, 8], n_new=4)
    finally:
        be.close()
    assert made == alone
