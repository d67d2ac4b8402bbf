"""The engine on the reference backend: chunked prefill + decode reproduce transformers' greedy tokens."""
import numpy as np
import pytest

from llmrs.models.llama import build_graphs, load_model
from llmrs.runtime.backends.reference import ReferenceBackend
from llmrs.runtime.engine import Engine, EngineError
from llmrs.runtime.sampler import Sampler, SamplerConfig

from ..conftest import DATA, rel_err


def _engine(name, T=16, max_seq_len=64, stop_ids=()):
    prefill, decode = build_graphs(load_model(DATA / name), T, max_seq_len)
    return Engine(ReferenceBackend({"prefill": prefill, "decode": decode}), T, max_seq_len, stop_ids)


def test_greedy_generation_reproduces_transformers(golden):
    path, gd = golden
    engine = _engine(path.name, T=16)  # the prompt spans several prefill chunks
    gen = engine.generate(list(gd["prompt_tokens"]), 9, Sampler(SamplerConfig()), keep_logits=True)
    assert gen.tokens == list(gd["generated"])
    assert rel_err(gen.logits[0], gd["prefill_logits"][-1]) <= 1e-4
    for got, ref in zip(gen.logits[1:], gd["decode_logits"]):
        assert rel_err(got, ref) <= 1e-4
    assert gen.stats.prompt_tokens == len(gd["prompt_tokens"]) and gen.stats.decode_tokens == 8


def test_stop_token_ends_generation_and_is_not_emitted():
    gd = np.load(DATA / "golden-b.npz")
    stop = int(gd["generated"][3])
    engine = _engine("golden-b", stop_ids=(stop,))
    seen = []
    gen = engine.generate(list(gd["prompt_tokens"]), 20, Sampler(SamplerConfig()), on_token=seen.append)
    assert gen.tokens == seen == list(gd["generated"][:3]) and gen.stop_reason == "stop token"


def test_generation_stops_when_the_cache_is_full():
    engine = _engine("golden-a", T=8, max_seq_len=12)
    gen = engine.generate([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 50, Sampler(SamplerConfig()))
    assert gen.stop_reason == "cache full" and len(gen.tokens) == 3


def test_prompt_longer_than_the_cache_is_refused_before_any_work():
    engine = _engine("golden-a", T=8, max_seq_len=12)
    with pytest.raises(EngineError, match="the prompt has 13 tokens but the KV cache holds 12 more"):
        engine.generate(list(range(1, 14)), 4, Sampler(SamplerConfig()))
    assert engine.n_past == 0


def test_zero_new_tokens_is_refused():
    with pytest.raises(EngineError, match="^max_tokens must be at least 1, got 0$") as e:
        _engine("golden-a").generate([1, 2], 0, Sampler(SamplerConfig()))
    assert e.value.worded({"max_tokens": "-n"}.get) == "-n must be at least 1, got 0"    # llmrs-run's wording


def test_reset_forgets_the_cache():
    engine = _engine("golden-a")
    a = engine.generate([5, 6, 7], 4, Sampler(SamplerConfig())).tokens
    engine.reset()
    assert engine.generate([5, 6, 7], 4, Sampler(SamplerConfig())).tokens == a


class _ArgmaxCounting(ReferenceBackend):
    """A backend that offers a device-side argmax; counts which path the engine takes."""
    device_argmax = True

    def __init__(self, graphs):
        super().__init__(graphs)
        self.calls = {"run": 0, "run_argmax": 0}

    def run(self, *a):
        self.calls["run"] += 1
        return super().run(*a)

    def run_argmax(self, *a):
        self.calls["run_argmax"] += 1
        return np.argmax(super().run(*a), axis=-1).astype(np.int32)


def test_greedy_uses_the_backends_argmax_and_gives_the_same_tokens():
    gd = np.load(DATA / "golden-b.npz")
    prefill, decode = build_graphs(load_model(DATA / "golden-b"), 16, 64)
    backend = _ArgmaxCounting({"prefill": prefill, "decode": decode})
    gen = Engine(backend, 16, 64).generate(list(gd["prompt_tokens"]), 9, Sampler(SamplerConfig()))
    assert gen.tokens == list(gd["generated"])
    assert backend.calls == {"run": 0, "run_argmax": 3 + 8}  # 3 prompt chunks, 8 decode steps
    # a penalty or kept logits need the logits themselves
    backend.calls = {"run": 0, "run_argmax": 0}
    Engine(backend, 16, 64).generate(list(gd["prompt_tokens"]), 3, Sampler(SamplerConfig(repetition_penalty=1.3)))
    assert backend.calls["run_argmax"] == 0


def test_a_full_cache_without_eviction_stops_with_a_notice_naming_the_flags():
    engine = _engine("golden-a", T=8, max_seq_len=12)
    gen = engine.generate([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 50, Sampler(SamplerConfig()))
    assert gen.stop_reason == "cache full" and len(gen.tokens) == 3
    assert gen.notice == ("the KV cache is full (12 slots); go on with "
                          "--eviction-policy sliding|snapkv|h2o, or recompile with a larger --max-seq-len")


class _Pressure:
    """A SystemMonitor whose MemAvailable drops under 100 MiB on its calls number `low`."""

    def __init__(self, low: set[int]):
        self.low, self.calls = low, 0

    def mem_stats(self):
        from llmrs.runtime.kv import MemoryStats
        self.calls += 1
        avail = (50 if self.calls in self.low else 500) << 20
        return MemoryStats(1 << 33, avail, avail)


def test_memory_pressure_evicts_to_the_target_ratio_and_generation_goes_on():
    from llmrs.runtime.kv import CacheManager, make_policy
    prefill, decode = build_graphs(load_model(DATA / "golden-a"), 8, 32)
    backend = ReferenceBackend({"prefill": prefill, "decode": decode})
    monitor = _Pressure(low={6})       # checks: 2 prompt chunks, then one per decode step
    cache = CacheManager(make_policy("h2o", window=28, protected_prefix=2), backend.kv_store(), monitor,
                         threshold_mb=100, target_ratio=0.5)
    engine = Engine(backend, 8, 32, cache=cache)
    gen = engine.generate(list(range(3, 19)), 40, Sampler(SamplerConfig()))
    assert gen.stop_reason == "length" and len(gen.tokens) == 40
    events = [(e.trigger, e.before, e.after, e.start_pos) for e in gen.stats.evictions]
    # the 4th decode step left 16 + 4 slots: pressure halves them; 25 steps on, the h2o budget
    # (prefix 2 + window 28) is reached and each step after evicts one slot
    assert events[0] == ("memory", 20, 10, 20)
    assert events[1:] == [("budget", 31, 30, p) for p in range(41, 56)]
    assert engine.start_pos == 16 + 39 and engine.n_past == 30
    assert "evictions         16 (budget 15, memory 1): 25 slots freed in" in gen.stats.report()


class _Poisoned(ReferenceBackend):
    """The reference backend, except that decode step `bad` (1-based) returns a row with NaNs or infs."""

    def __init__(self, graphs, bad: int, value: float):
        super().__init__(graphs)
        self.bad, self.value, self.decodes = bad, value, 0

    def run(self, phase, *a):
        out = super().run(phase, *a)
        self.decodes += phase == "decode"
        if self.decodes == self.bad and phase == "decode":
            out[-1, 7:9] = self.value, -self.value     # inf and -inf: their sum is NaN
        return out


class _PoisonedArgmax(_Poisoned):
    """The same, choosing greedy tokens as the CPU back end does (its checked argmax)."""
    device_argmax = True

    def run_argmax(self, phase, *a):
        from llmrs.runtime.backends.cpu import _argmax_rows
        return _argmax_rows(self.run(phase, *a))


@pytest.mark.parametrize("value", [np.nan, np.inf])
@pytest.mark.parametrize("backend,sampler", [
    (_Poisoned, SamplerConfig(temperature=0.8, seed=1)),   # the host samples the logits it reads back
    (_PoisonedArgmax, SamplerConfig()),                    # greedy: the back end's argmax finds it
])
@pytest.mark.filterwarnings("error")
def test_non_finite_logits_stop_generation_naming_the_step(value, backend, sampler):
    """Before, argmax of a NaN row chose token 0 and generation went on, printing garbage."""
    gd = np.load(DATA / "golden-a.npz")
    prefill, decode = build_graphs(load_model(DATA / "golden-a"), 16, 64)
    engine = Engine(backend({"prefill": prefill, "decode": decode}, 3, value), 16, 64)
    seen = []
    with pytest.raises(EngineError) as e:
        engine.generate(list(gd["prompt_tokens"]), 9, Sampler(sampler), on_token=seen.append)
    assert str(e.value) == ("step 3: the logits are NaN/inf — the model file is corrupt or badly converted "
                            "(llmrs-check PLAN compares every kernel)")
    assert len(seen) == 3     # the prefill's token and two decode steps' went out before it


def test_finite_logits_of_any_size_pass_the_check():
    from llmrs.runtime.engine import check_finite

    rows = (np.random.default_rng(3).uniform(0.5, 1.0, (4, 384)) * 3.4e38).astype(np.float32)
    with np.errstate(over="ignore"):
        assert np.isinf(rows[0].sum()) and np.isfinite(rows).all()   # an f32 sum would overflow
    for row in rows:
        np.testing.assert_array_equal(check_finite(row, 1), row)


def test_a_back_end_that_wants_fewer_prefill_rows_gets_its_feed_with_the_same_logits():
    """Backend.prefill_rows below the graph's T: the prompt goes in steps of that many tokens (the
    CPU's 128 on a 512-row graph), and the logits are those of feeding whole chunks."""
    class Fed(ReferenceBackend):
        prefill_rows = 5

        def run(self, phase, tokens, n_past, start_pos):
            sizes.append((phase, len(tokens)))
            return super().run(phase, tokens, n_past, start_pos)

    prefill, decode = build_graphs(load_model(DATA / "golden-a"), 16, 64)
    sizes: list = []
    prompt = list(np.random.default_rng(3).integers(1, 300, 12))
    fed = Engine(Fed({"prefill": prefill, "decode": decode}), 16, 64).prefill(prompt)
    assert sizes == [("prefill", 5), ("prefill", 5), ("prefill", 2)]
    whole = Engine(ReferenceBackend({"prefill": prefill, "decode": decode}), 16, 64).prefill(prompt)
    assert rel_err(fed, whole) <= 1e-5
    assert Engine(Fed({"prefill": prefill, "decode": decode}), 4, 64).prefill_T == 4   # never above T
