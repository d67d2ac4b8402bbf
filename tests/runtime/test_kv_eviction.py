"""Eviction on every back end: each step, on the cache entries that survived, gives the logits
and scores the interpreter gives on a copy of those same entries; compaction moves whole rows per
head; generation runs far past the cache; the CLI's flags and messages."""
from __future__ import annotations

import numpy as np
import pytest

from llmrs.compiler.cli import main as compile_main
from llmrs.compiler.interpret import Interpreter
from llmrs.models.tiny import make_model
from llmrs.runtime.backends.cpu import CpuBackend
from llmrs.runtime.backends.reference import ReferenceBackend
from llmrs.runtime.cli import main as run_main
from llmrs.runtime.engine import Engine
from llmrs.runtime.kv import CacheManager, make_policy
from llmrs.runtime.plan import Plan
from llmrs.runtime.sampler import Sampler, SamplerConfig

from ..conftest import DATA, rel_err, require_opencl

S, CHUNK = 32, 8
POLICIES = ("sliding", "snapkv", "h2o")


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    """golden-a (head_dim 16, GQA 4:2) and a random model with head_dim 64 (GQA 4:2: OpenCL's
    one-key-per-lane decode attention, and q8_0 / q4_0 caches), compiled for both back ends."""
    root = tmp_path_factory.mktemp("kv")
    hd64 = make_model(root / "hd64", "golden-a", seed=7, hidden_size=256, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=192)
    out = {}
    for name, model, kv in (("a-f32", DATA / "golden-a", "f32"), ("r-f32", hd64, "f32"),
                            ("r-f16", hd64, "f16"), ("r-q8_0", hd64, "q8_0"), ("r-q4_0", hd64, "q4_0")):
        out[name] = root / f"{name}.plan.bin"
        assert compile_main([str(model), "-o", str(out[name]), "--target", "cpu,opencl", "--weights", "f32",
                             "--kv-type", kv, "--max-seq-len", str(S), "--prefill-chunk", str(CHUNK), "-q"]) == 0
    return out


def _backend(kind: str, plan: Plan):
    if kind == "cpu":
        return CpuBackend(plan, threads=2)
    if kind == "opencl":
        require_opencl()
        from llmrs.runtime.backends.opencl import OpenCLBackend
        return OpenCLBackend(plan)
    return ReferenceBackend(plan.graphs())


def _read_state(be) -> dict[str, np.ndarray]:
    """Every state value (K, V, scores, score control) as the back end holds it, copied."""
    g = be.graphs["decode"] if hasattr(be, "graphs") else be.interpreters["decode"].graph
    if hasattr(be, "read_value"):
        return {n: be.read_value("decode", n) for n in g.state}
    arrays = be.kv_store().arrays
    return {n: arrays[n].copy() for n in g.state}


class Lockstep:
    """A back end that, before each step, copies the back end's whole KV state (the entries
    that survived every eviction so far, and the score control) into the interpreter and runs
    the same step there; it keeps both logits and both updated scores."""
    device_argmax = False     # the engine takes the greedy token from run's logits
    prefill_rows = None       # the prompt in the graph's chunks

    def __init__(self, be, graphs):
        self.be, self.name = be, "lockstep"
        self.interp = {p: Interpreter(g) for p, g in graphs.items()}
        self.scores = [n for n in graphs["decode"].state if n.startswith("cache.scores.")]
        self.steps: list[tuple[str, np.ndarray, np.ndarray, dict, dict]] = []

    def run(self, phase, tokens, n_past, start_pos):
        state = _read_state(self.be)
        want = self.interp[phase].run({"tokens": tokens}, state, n_past=n_past, start_pos=start_pos)
        got = self.be.run(phase, tokens, n_past, start_pos)
        after = _read_state(self.be)
        self.steps.append((phase, got[-1], want[self.interp[phase].graph.outputs[0]][-1],
                           {n: after[n] for n in self.scores}, {n: state[n] for n in self.scores}))
        return got

    def reset(self):
        self.be.reset()


class Recording:
    """A back end's KV store that checks every compaction against numpy: per layer and KV head,
    slot j holds old slot keep[layer, head, j], byte for byte (q8_0: whole 34-byte blocks)."""

    def __init__(self, be):
        self.be, self.inner = be, be.kv_store()
        self.n_layers, self.n_kv_heads, self.slots = self.inner.n_layers, self.inner.n_kv_heads, self.inner.slots
        self.compactions = 0

    def scores(self, n):
        return self.inner.scores(n)

    def clear_scores(self):
        self.inner.clear_scores()

    def set_score_from(self, first):
        self.inner.set_score_from(first)

    def compact(self, keep):
        before = _read_state(self.be)
        self.inner.compact(keep)
        after = _read_state(self.be)
        k = keep.shape[-1]
        for i, layer in enumerate(self.inner.layers):
            for h in range(self.n_kv_heads):
                for name in (layer.k, layer.v):
                    np.testing.assert_array_equal(after[name][:k, h], before[name][keep[i, h], h])
                np.testing.assert_array_equal(after[layer.scores][h, :k], before[layer.scores][h, keep[i, h]])
                assert not after[layer.scores][h, k:].any()
        self.compactions += 1


def _lockstep_run(plan_path, backend, policy, n_new, prompt_len=20):
    plan = Plan.open(plan_path)
    be = _backend(backend, plan)
    lock = Lockstep(be, plan.graphs())
    store = Recording(be)
    cache = CacheManager(make_policy(policy, window=12, protected_prefix=2, snapkv_window=4, snapkv_kernel=3), store)
    engine = Engine(lock, CHUNK, S, cache=cache)
    gen = engine.generate(list(range(3, 3 + prompt_len)), n_new, Sampler(SamplerConfig()))
    return gen, lock, store, cache


@pytest.mark.parametrize("backend", ["cpu", "opencl"])
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("model", ["a-f32", "r-f32"])
def test_decoding_with_eviction_matches_the_interpreter_on_the_surviving_cache(plans, backend, policy, model):
    gen, lock, store, cache = _lockstep_run(plans[model], backend, policy, n_new=40)
    assert len(gen.tokens) == 40 and gen.stop_reason == "length"
    assert store.compactions == len(cache.events) >= 3
    assert {e.trigger for e in cache.events} == ({"budget", "full"} if policy == "snapkv" else {"budget"})
    assert len(lock.steps) == 3 + 39                   # 3 prompt chunks, 39 decode steps
    for phase, got, want, scores, ref_scores in lock.steps:
        assert rel_err(got, want) <= 1e-4, phase
        for name, s in scores.items():
            if np.any(ref_scores[name]):
                assert rel_err(s, ref_scores[name]) <= 1e-4, (phase, name)
    if policy != "sliding":   # the interpreter's scores were the scored ones: some rows did vote
        assert any(np.any(ref) for *_, ref in lock.steps for ref in ref.values())
    # RoPE positions only grow and each kept slot keeps its own; the prefix stays in every head
    pos = cache.positions[:, :, :14]
    assert (pos[..., :2] == [0, 1]).all() and (np.diff(pos, axis=-1) > 0).all() and pos.max() <= 58


@pytest.mark.parametrize("backend", ["cpu", "opencl"])
@pytest.mark.parametrize("model", ["r-f16", "r-q8_0", "r-q4_0"])
def test_compaction_moves_whole_head_rows_of_f16_q8_0_and_q4_0_caches(plans, backend, model):
    gen, lock, store, cache = _lockstep_run(plans[model], backend, "h2o", n_new=24)
    assert store.compactions == len(cache.events) > 0
    # h2o chose different slots for the two KV heads somewhere: rows really moved per head
    assert not np.array_equal(cache.positions[:, 0, :14], cache.positions[:, 1, :14])
    # f16 / q8_0 / q4_0 rows stored by each side's own kernels: a key 1 ulp off the interpreter's
    # may take the neighbouring code, 1/8 of its block's largest value apart in q4_0
    tol = 1e-2 if model == "r-q4_0" else 1e-3
    for phase, got, want, *_ in lock.steps:
        assert rel_err(got, want) <= tol, phase


@pytest.mark.parametrize("backend", ["cpu", "opencl"])
@pytest.mark.parametrize("policy", POLICIES)
def test_a_random_model_generates_four_times_the_cache_length(plans, backend, policy):
    plan = Plan.open(plans["r-f32"])
    be = _backend(backend, plan)
    cache = CacheManager(make_policy(policy, window=20, protected_prefix=4, snapkv_window=8), be.kv_store())
    engine = Engine(be, CHUNK, S, cache=cache)
    prompt = list(range(3, 3 + 40))                     # longer than the cache itself
    gen = engine.generate(prompt, 4 * S, Sampler(SamplerConfig(temperature=0.9, seed=1)))
    assert len(gen.tokens) == 4 * S and gen.stop_reason == "length"
    assert engine.start_pos == 40 + 4 * S - 1 and engine.n_past <= S
    assert len(gen.stats.evictions) > 0 and all(e.after <= 24 for e in gen.stats.evictions)
    assert (cache.positions[:, :, :4] == np.arange(4)).all()


@pytest.fixture(scope="module")
def cli_plan(plans):
    return plans["a-f32"]


def test_without_eviction_a_full_cache_stops_with_one_line_naming_the_flags(cli_plan, capsys):
    assert run_main([str(cli_plan), "--prompt", "Once upon a time", "-n", "100", "--stats"]) == 0
    err = capsys.readouterr().err
    assert ("llmrs-run: warning: stopped after 20 of -n 100 tokens: the KV cache is full (32 slots); go on with "
            "--eviction-policy sliding|snapkv|h2o, or recompile with a larger --max-seq-len\n") in err
    assert "stopped by        cache full" in err


@pytest.mark.parametrize("policy", POLICIES)
def test_the_cli_evicts_past_the_cache_and_reports_the_evictions(cli_plan, capsys, policy):
    assert run_main([str(cli_plan), "--prompt", "Once upon a time", "-n", str(4 * S), "--stats", "--log-evictions",
                     "--eviction-policy", policy, "--eviction-window", "12", "--protected-prefix", "2",
                     "--snapkv-window", "4"]) == 0
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if "evicted KV cache" in ln]
    assert lines and all(f"({policy}, " in ln for ln in lines)
    assert f"evictions         {len(lines)} (" in err and f"[{policy}]" in err and "stopped by        length" in err


def _total_mb() -> int:
    with open("/proc/meminfo") as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith("MemTotal:")) // 1024


def test_memory_pressure_evicts_for_real_above_the_machines_free_memory(cli_plan, capsys):
    assert run_main([str(cli_plan), "--prompt", "Once upon a time", "-n", "24", "--stats",
                     "--eviction-policy", "sliding", "--eviction-window", "28",
                     "--memory-threshold-mb", str(_total_mb() - 1), "--eviction-target-ratio", "0.5"]) == 0
    err = capsys.readouterr().err
    # MemAvailable is always under the machine's memory less what the kernel and this process hold:
    # every step halves the cache
    assert "evictions         " in err and "(memory " in err and "budget" not in err.split("evictions")[1]


@pytest.mark.parametrize("over", [0, 1, 10**6])
def test_a_memory_threshold_not_under_the_machines_memory_is_refused(cli_plan, capsys, over):
    """Before, it was taken: every step evicted, down to a cache too short for sense, without a word."""
    total = _total_mb()
    assert run_main([str(cli_plan), "--prompt", "Hi", "--eviction-policy", "sliding",
                     "--memory-threshold-mb", str(total + over)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"llmrs-run: error: --memory-threshold-mb {total + over} is not under this machine's "
                          "memory (") and "every step would evict; give less, e.g. " in err and err.count("\n") == 1


@pytest.mark.parametrize("argv, message", [
    (["--eviction-policy", "sliding", "--eviction-window", "0"], "--eviction-window must be at least 1, got 0"),
    (["--memory-threshold-mb", "100"], "--memory-threshold-mb needs an --eviction-policy that evicts"),
    (["--eviction-policy", "h2o", "--protected-prefix", "40"], "--protected-prefix 40 leaves no room in a KV cache of 32"),
    (["--eviction-policy", "snapkv", "--snapkv-kernel", "6"], "--snapkv-kernel must be an odd number >= 1, got 6"),
    (["--eviction-policy", "sliding", "--eviction-target-ratio", "0"], "--eviction-target-ratio must be between 0 and 1"),
])
def test_bad_eviction_flags_are_one_line_errors(cli_plan, capsys, argv, message):
    assert run_main([str(cli_plan), "--prompt", "Hi", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("llmrs-run: error:") and message in err, err
