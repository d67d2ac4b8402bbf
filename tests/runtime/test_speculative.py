"""Speculative decoding end to end: greedy tokens are those of decoding one token at a time, for
both drafters, K = 1..8, on the CPU, OpenCL (PoCL) and hybrid back ends, with sliding and SnapKV
eviction active across the cache's end; after a run with rejected drafts, the KV cache, the slots'
positions and the eviction scores equal those of a run that never drafted. Plans that cannot
speculate are refused in one line naming the fix."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import llmrs
from llmrs.compiler.cli import main as compile_main
from llmrs.options import OptionError
from llmrs.runtime.speculative import AdaptiveK, PromptLookup

from ..conftest import DATA

N_NEW = 40


def _compile(out, model, *flags: str) -> str:
    assert compile_main([str(model), "-o", str(out), "--target", "cpu", "--prefill-chunk", "16", "-q", *flags]) == 0
    return str(out)


@pytest.fixture(scope="module")
def plans(tmp_path_factory) -> dict[str, str]:
    """golden-b (f32 target, q4_0 draft, a plan verifying 8 drafts) in a 64-slot cache, and golden-a."""
    d = tmp_path_factory.mktemp("spec")
    b = DATA / "golden-b"
    return {"target": _compile(d / "b-f32.plan", b, "--weights", "f32", "--max-seq-len", "64"),
            "draft": _compile(d / "b-q4_0.plan", b, "--weights", "q4_0", "--max-seq-len", "64"),
            "other": _compile(d / "a.plan", DATA / "golden-a", "--weights", "f32", "--max-seq-len", "64"),
            "no_step": _compile(d / "b-nostep.plan", b, "--weights", "f32", "--max-seq-len", "64",
                                "--max-num-seqs", "0"),
            "k3": _compile(d / "b-k3.plan", b, "--weights", "f32", "--max-seq-len", "64", "--max-draft-tokens", "3",
                          "--max-num-seqs", "2")}


def _prompt(seed: int = 0, block: int = 7, times: int = 3) -> list[int]:
    """A block of random tokens said again and again: text that quotes itself, for lookup to draft."""
    base = [int(t) for t in np.random.default_rng(seed).integers(3, 250, block)]
    return base * times


def _greedy(model, prompt: list[int], n: int = N_NEW):
    c = model.generate(prompt, max_tokens=n)
    list(c)
    return c


# -- drafters ------------------------------------------------------------------------------------

def test_lookup_drafts_what_followed_the_latest_occurrence_of_the_longest_match():
    d = PromptLookup(ngram=3)
    h = [1, 2, 3, 9, 9, 5, 2, 3, 7, 8, 1, 2, 3]
    assert d.propose(h, 2).tokens == [9, 9]          # [1 2 3] before a later [2 3]: the longest wins
    assert d.propose([1, 2, 4, 1, 2, 5, 1, 2], 2).tokens == [5, 1]   # of two [1 2], the latest
    assert d.propose([4, 5, 6, 5, 6, 1], 3).tokens == []   # nothing before ends like "... 6 1"
    assert d.propose([4, 5, 6, 7, 5], 3).tokens == []      # a lone token's match is not enough
    assert PromptLookup(ngram=1).propose([4, 5, 6, 7, 5], 3).tokens == [6, 7, 5]   # unless asked for
    assert d.propose([5], 3).tokens == []


def _scan(h: list[int], ngram: int, k: int) -> list[int]:
    """The lookup from scratch: for n = ngram .. 2 (1 if ngram is 1), the latest earlier start of
    h's last n tokens that a token follows, and up to k tokens from after it."""
    for n in range(min(ngram, len(h) - 1), min(2, ngram) - 1, -1):
        starts = [i for i in range(len(h) - n) if h[i:i + n] == h[len(h) - n:]]
        if starts:
            return h[starts[-1] + n:starts[-1] + n + k]
    return []


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 4), st.lists(st.tuples(st.sampled_from(["grow", "cut", "new"]),
                                             st.lists(st.integers(0, 5), max_size=12)), min_size=1, max_size=12))
def test_lookups_index_kept_across_proposals_answers_as_a_fresh_scan(ngram, edits):
    """PromptLookup indexes the text once and adds what each proposal's history adds; a history
    that is not an extension (a rollback, another generation) starts the index again."""
    d, h = PromptLookup(ngram), []
    for kind, tokens in edits:
        h = h + tokens if kind == "grow" else h[:len(h) // 2] + tokens if kind == "cut" else list(tokens)
        for k in (1, 3):
            assert d.propose(h, k).tokens == _scan(h, ngram, k), (kind, h)


def test_adaptive_k_grows_while_drafts_are_kept_and_pauses_after_misses():
    k = AdaptiveK(8, start=2)
    assert k.next() == 2
    k.update(2, 2)
    assert k.next() == 3
    k.update(3, 1)
    assert k.next() == 2
    k.update(2, 0)
    k.update(1, 0)       # two proposals in a row with nothing kept: one plain step, then two
    assert [k.next() for _ in range(2)] == [0, 1]
    k.update(1, 0)
    k.update(1, 0)
    assert [k.next() for _ in range(3)] == [0, 0, 1]
    fixed = AdaptiveK(8, fixed=5)
    fixed.update(5, 0)
    fixed.update(5, 0)
    assert fixed.next() == 5


# -- greedy: the same tokens -----------------------------------------------------------------------

@pytest.mark.parametrize("k", [1, 2, 3, 5, 8, None])
@pytest.mark.parametrize("drafter", ["lookup", "draft"])
def test_greedy_tokens_are_those_of_plain_decoding(plans, drafter, k):
    prompt = _prompt()
    with llmrs.load(plans["target"]) as plain:
        want = _greedy(plain, prompt).tokens
    extra = {"draft": plans["draft"]} if drafter == "draft" else {}
    with llmrs.load(plans["target"], speculative=drafter, num_speculative_tokens=k, **extra) as m:
        got = _greedy(m, prompt)
    assert got.tokens == want
    st = got.stats.speculative
    assert st.steps > 0 and st.accepted > 0, st.line()
    assert len(want) == N_NEW


@pytest.mark.parametrize("policy", ["sliding", "snapkv"])
def test_greedy_tokens_with_eviction_across_the_caches_end(plans, policy):
    """120 tokens through a 64-slot cache: evictions happen, and never inside a verify step."""
    kv = dict(eviction_policy=policy, eviction_window=40, protected_prefix=4, snapkv_window=8)
    prompt = _prompt(1, block=5, times=4)
    with llmrs.load(plans["target"], **kv) as plain:
        want = _greedy(plain, prompt, 120)
    with llmrs.load(plans["target"], speculative="lookup", **kv) as m:
        got = _greedy(m, prompt, 120)
    assert got.tokens == want.tokens and len(want.tokens) == 120
    assert got.stats.speculative.steps > 0
    assert [(e.trigger, e.before, e.after, e.start_pos) for e in got.stats.evictions] == \
        [(e.trigger, e.before, e.after, e.start_pos) for e in want.stats.evictions] != []


def _state(model) -> dict[str, np.ndarray]:
    eng = model.engine
    store = model.backend.kv_store()
    n = eng.n_past
    out = {"n_past": np.array([n, eng.start_pos])}
    for layer in range(store.n_layers):
        for which in ("k", "v"):
            out[f"{which}{layer}"] = store.cache(layer, which)[:n].copy()
    out["scores"] = store.scores(n)
    if eng.cache is not None:       # the slots' RoPE positions, where a policy keeps them
        out["positions"] = eng.cache.positions[:, :, :n].copy()
    return out


@pytest.mark.parametrize("drafter", ["lookup", "draft"])
@pytest.mark.parametrize("policy", ["none", "h2o", "snapkv"])
def test_after_rejections_the_cache_positions_and_scores_are_a_plain_runs(plans, policy, drafter):
    """Drafts the target refuses now and then (lookup on text that stops repeating itself; golden-b
    q4_0 drafting for f32); what the cache holds afterwards, byte for byte, is what decoding one
    at a time left."""
    kv = {} if policy == "none" else dict(eviction_policy=policy, eviction_window=30, protected_prefix=2,
                                          snapkv_window=6)
    prompt = _prompt(2, block=9, times=2)
    with llmrs.load(plans["target"], **kv) as plain:
        want = _greedy(plain, prompt, 30)
        ref = _state(plain)
    extra = {"draft": plans["draft"]} if drafter == "draft" else {}
    with llmrs.load(plans["target"], speculative=drafter, num_speculative_tokens=4, **extra, **kv) as m:
        got = _greedy(m, prompt, 30)
        st = got.stats.speculative
        state = _state(m)
    assert got.tokens == want.tokens
    if policy != "h2o":     # h2o scores every row, so nothing is drafted (a verify step would score drafts)
        assert st.steps > 0
    assert st.drafted > st.accepted or policy == "h2o", "no draft was refused: the test proves nothing"
    assert state.keys() == ref.keys()
    for name in ref:
        np.testing.assert_array_equal(state[name], ref[name], err_msg=name)


def test_a_conversation_goes_on_from_what_was_kept(plans):
    """The second turn extends the first: its cached prefix is what the speculative turn emitted."""
    prompt = _prompt(3)
    with llmrs.load(plans["target"]) as plain:
        a = _greedy(plain, prompt, 12).tokens
        b = _greedy(plain, prompt + a + prompt[:5], 12).tokens
    with llmrs.load(plans["target"], speculative="lookup") as m:
        assert _greedy(m, prompt, 12).tokens == a
        c = m.generate(prompt + a + prompt[:5], max_tokens=12)
        list(c)
        assert c.tokens == b and c.cached_tokens == len(prompt) + len(a) - 1


def test_sampling_with_a_draft_is_reproducible_and_keeps_to_top_k(plans):
    """Sampling end to end: a seed gives the same tokens again, every token is one of the target's
    top-k at its step (the drafter's own choices outside them are refused), and drafts are kept."""
    prompt = _prompt(5)
    runs = []
    with llmrs.load(plans["target"], speculative="draft", draft=plans["draft"]) as m:
        for _ in range(2):
            c = m.generate(prompt, max_tokens=30, temperature=0.7, top_k=3, seed=11, keep_logits=True)
            list(c)
            runs.append(c)
    assert runs[0].tokens == runs[1].tokens and len(runs[0].tokens) == 30
    for token, row in zip(runs[0].tokens, runs[0].generation.logits):
        assert token in np.argsort(row)[-3:]
    assert runs[0].stats.speculative.accepted > 0


# -- refusals --------------------------------------------------------------------------------------

def test_a_plan_without_a_step_graph_is_refused_naming_the_fix(plans):
    with pytest.raises(OptionError, match="recompile it without --max-num-seqs 0"):
        llmrs.load(plans["no_step"], speculative="lookup")


def test_a_draft_with_another_vocabulary_is_refused(plans):
    with pytest.raises(OptionError, match="draft .*a.plan: its vocabulary has"):
        llmrs.load(plans["target"], speculative="draft", draft=plans["other"])


def test_more_drafts_than_the_verify_step_checks_is_refused(plans):
    with pytest.raises(OptionError, match="recompile it with --max-draft-tokens 5"):
        llmrs.load(plans["k3"], speculative="lookup", num_speculative_tokens=5)
    with llmrs.load(plans["k3"], speculative="lookup") as m:
        assert m.speculator.k_max == 3


def test_bad_options_are_one_line_errors(plans):
    for kwargs, msg in [({"speculative": "medusa"}, "choose one of lookup, draft"),
                        ({"speculative": "draft"}, "speculative draft needs draft PLAN"),
                        ({"speculative": "lookup", "num_speculative_tokens": 0}, "at least 1"),
                        ({"draft": plans["draft"]}, "draft is only read with speculative draft")]:
        with pytest.raises(OptionError, match=msg):
            llmrs.load(plans["target"], **kwargs)


# -- the command line ------------------------------------------------------------------------------

def test_llmrs_run_speculates_and_reports_it(plans):
    prompt = " ".join(["the cat sat on the mat"] * 3)
    run = lambda *flags: subprocess.run(  # noqa: E731
        [sys.executable, "-m", "llmrs.runtime.cli", plans["target"], "--raw", "--prompt", prompt, "-n", "24",
         "--stats", *flags], capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    plain, spec = run(), run("--speculative", "lookup", "--num-speculative-tokens", "3")
    assert plain.returncode == 0 and spec.returncode == 0, spec.stderr
    assert spec.stdout == plain.stdout
    drafted = run("--speculative", "draft", "--draft-model", plans["draft"])    # the seed's spelling of --draft
    assert drafted.returncode == 0 and drafted.stdout == plain.stdout, drafted.stderr
    line = next(x for x in spec.stderr.splitlines() if x.startswith("speculative"))
    assert "lookup:" in line and "accepted" in line and "tokens per verify step" in line
    bad = run("--speculative", "draft")
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0
    assert "--speculative draft needs --draft PLAN" in bad.stderr


# -- every back end ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def both(tmp_path_factory) -> dict[str, str]:
    """golden-b f32 target and q4_0 draft for the CPU and OpenCL."""
    d = tmp_path_factory.mktemp("spec-cl")
    flags = ("--target", "cpu,opencl", "--max-seq-len", "64")
    return {"target": _compile(d / "b.plan", DATA / "golden-b", "--weights", "f32", *flags),
            "draft": _compile(d / "b-q4.plan", DATA / "golden-b", "--weights", "q4_0", *flags)}


@pytest.mark.parametrize("weights", ["f32", "q4_0"])
def test_opencl_verify_rows_are_the_decode_steps_bits(tmp_path, opencl_device, weights):
    """OpenCL verifies through the plan's verify graph (decode's matvec and attention kernels over
    K + 1 rows): each row's logits are the bits decode steps of the same tokens give."""
    from llmrs.runtime.backends import BackendOptions, open_backend
    from llmrs.runtime.plan import Plan, cpu_graphs
    path = _compile(tmp_path / "v.plan", DATA / "golden-b", "--weights", weights, "--target", "cpu,opencl",
                    "--max-seq-len", "64")
    plan = Plan.open(path)
    assert "verify" in plan.graphs() and "verify" not in cpu_graphs(plan.graphs())
    be = open_backend(plan, "opencl", BackendOptions())
    try:
        assert be.verify_graph
        rng = np.random.default_rng(6)
        be.run("prefill", rng.integers(0, 300, 16).astype(np.int32), 0, 0)
        tokens = rng.integers(0, 300, 9).astype(np.int32)
        decoded = np.stack([be.run("decode", tokens[i:i + 1], 16 + i, 16 + i)[-1] for i in range(9)])
        np.testing.assert_array_equal(be.run("verify", tokens, 16, 16), decoded)
    finally:
        be.close()


@pytest.mark.parametrize("backend,kv", [("opencl", {}), ("hybrid", {}),
                                        ("opencl", dict(eviction_policy="sliding", eviction_window=40)),
                                        ("opencl", dict(eviction_policy="snapkv", eviction_window=40,
                                                        snapkv_window=8))],
                         ids=["opencl", "hybrid", "opencl-sliding", "opencl-snapkv"])
def test_greedy_tokens_on_opencl_and_hybrid(both, opencl_device, backend, kv):
    """OpenCL's verify step runs the step graph's kernels, its decode step the matvec ones: their
    sums differ in the last bits, and the tokens do not. Hybrid starts on the CPU and moves to
    OpenCL after 12 tokens; the draft runs on the CPU."""
    prompt = _prompt(0, block=6, times=3)
    opts = dict(hybrid_start="cpu", switch_threshold=12) if backend == "hybrid" else {}
    with llmrs.load(both["target"], backend=backend, threads=2, **opts, **kv) as plain:
        want = _greedy(plain, prompt, 90)
    for drafter in ("lookup", "draft"):
        extra = {"draft": both["draft"], "draft_backend": "cpu"} if drafter == "draft" else {}
        with llmrs.load(both["target"], backend=backend, threads=2, speculative=drafter, **extra, **opts,
                        **kv) as m:
            got = _greedy(m, prompt, 90)
        assert got.tokens == want.tokens, drafter
        assert got.stats.speculative.steps > 0
