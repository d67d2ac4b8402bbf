"""Eviction on the real model (SmolLM2-135M-Instruct, its own Q4_1 / Q8_0 bytes): with a cache of
S slots each policy generates 4 x S tokens, and until its first eviction it generates what the
cache without eviction generates; without a policy the same run stops with the one-line notice
naming the eviction flags."""
from __future__ import annotations

import functools

import numpy as np
import pytest

from llmrs.compiler.cli import main as compile_main
from llmrs.runtime.backends.cpu import CpuBackend
from llmrs.runtime.cli import main as run_main
from llmrs.runtime.engine import Engine
from llmrs.runtime.kv import CacheManager, make_policy
from llmrs.runtime.plan import Plan
from llmrs.runtime.sampler import Sampler, SamplerConfig

S = 32                      # cache slots: small, so 4 x S tokens stay quick on 2 cores
PROMPT = "Once upon a time, in a small village by the sea,"
SINKS, WINDOW = 4, 20


@pytest.fixture(scope="module")
def plan(smollm2_gguf, tmp_path_factory):
    out = tmp_path_factory.mktemp("smollm2_kv") / "smollm2.plan.bin"
    assert compile_main([str(smollm2_gguf), "-o", str(out), "--max-seq-len", str(S), "--prefill-chunk", "16",
                         "--target", "cpu", "-q"]) == 0
    return out


@pytest.fixture(scope="module")
def run(plan):
    """generate(policy, n) -> (Generation, CacheManager | None) on one CPU back end, greedy."""
    opened = Plan.open(plan)
    be = CpuBackend(opened, threads=2)
    from tokenizers import Tokenizer
    tok = Tokenizer.from_str(bytes(opened.section("tokenizer.json")).decode())
    prompt = tok.encode(PROMPT, add_special_tokens=False).ids

    @functools.lru_cache(maxsize=None)     # the run without eviction serves every test
    def generate(policy: str, n: int):
        be.reset()
        cache = None if policy == "none" else CacheManager(
            make_policy(policy, WINDOW, SINKS, snapkv_window=8), be.kv_store())
        # no stop ids: these tests are about what eviction keeps, and whether greedy decoding of
        # this prompt meets the end-of-turn token within 4 x S tokens moves with float rounding
        # (a kernel's summation order), not with the policy
        engine = Engine(be, 16, S, (), cache=cache)
        return engine.generate(prompt, n, Sampler(SamplerConfig())), cache, engine, len(prompt)

    yield generate
    be.close()


@pytest.mark.parametrize("policy", ["sliding", "snapkv", "h2o"])
def test_each_policy_generates_four_times_the_cache_on_the_real_model(run, policy):
    ref, *_ = run("none", 4 * S)                  # stops at the full cache
    gen, cache, engine, n_prompt = run(policy, 4 * S)
    assert len(gen.tokens) == 4 * S and gen.stop_reason == "length"
    assert engine.start_pos == n_prompt + 4 * S - 1 and engine.n_past <= S
    assert gen.stats.evictions and all(e.after <= SINKS + WINDOW for e in gen.stats.evictions)
    assert (cache.positions[:, :, :SINKS] == np.arange(SINKS)).all()     # the sinks survive in every head
    # before the first eviction the cache is the uncut one: the same greedy tokens
    first = gen.stats.evictions[0].start_pos - n_prompt      # tokens generated when it came
    assert first >= 1 and gen.tokens[:first] == ref.tokens[:first]


def test_without_a_policy_the_real_model_stops_at_the_full_cache_naming_the_flags(plan, run, capsys):
    gen, _, _, n_prompt = run("none", 4 * S)
    assert gen.stop_reason == "cache full" and len(gen.tokens) == S - n_prompt + 1
    assert run_main([str(plan), "--prompt", PROMPT, "--raw", "-n", str(4 * S), "--threads", "2", "--stats"]) == 0
    err = capsys.readouterr().err
    assert (f"llmrs-run: warning: stopped after {S - n_prompt + 1} of -n {4 * S} tokens: the KV cache is full ({S} slots); "
            "go on with --eviction-policy sliding|snapkv|h2o, or recompile with a larger --max-seq-len") in err
    assert "stopped by        cache full" in err
