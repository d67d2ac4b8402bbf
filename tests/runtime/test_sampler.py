"""Sampling rules against hand-computed distributions on random logits."""
import numpy as np
import pytest

from llmrs.options import OptionError
from llmrs.runtime.sampler import Sampler, SamplerConfig


def _logits(n=50, seed=0):
    return np.random.default_rng(seed).standard_normal(n).astype(np.float32) * 3


def test_greedy_is_argmax():
    x = _logits()
    assert Sampler(SamplerConfig()).sample(x, []) == int(np.argmax(x))


def test_temperature_gives_softmax_of_scaled_logits():
    x = _logits()
    p = Sampler(SamplerConfig(temperature=0.7)).probs(x, [])
    ref = np.exp(x / 0.7 - np.max(x / 0.7))
    np.testing.assert_allclose(p, ref / ref.sum(), rtol=1e-6)


def test_top_k_keeps_exactly_k_tokens_renormalised():
    x = _logits()
    p = Sampler(SamplerConfig(temperature=1.0, top_k=5)).probs(x, [])
    top5 = np.argsort(-x)[:5]
    assert set(np.flatnonzero(p)) == set(top5)
    ref = np.exp(x[top5] - x[top5].max())
    np.testing.assert_allclose(p[top5], ref / ref.sum(), rtol=1e-6)


def test_top_p_keeps_the_smallest_set_reaching_the_mass():
    x = _logits()
    full = Sampler(SamplerConfig(temperature=1.0)).probs(x, [])
    p = Sampler(SamplerConfig(temperature=1.0, top_p=0.6)).probs(x, [])
    order = np.argsort(-full)
    n_keep = int(np.searchsorted(np.cumsum(full[order]), 0.6)) + 1
    assert set(np.flatnonzero(p)) == set(order[:n_keep])
    assert full[order[:n_keep]].sum() >= 0.6 > full[order[:n_keep - 1]].sum()


def test_repetition_penalty_follows_hf_rule_within_the_window():
    x = np.array([2.0, -2.0, 1.0, 0.5], np.float32)
    s = Sampler(SamplerConfig(repetition_penalty=2.0, repetition_window=2))
    out = s.penalize(x, [2, 0, 1])  # only the last two (0, 1) are in the window
    np.testing.assert_allclose(out, [1.0, -4.0, 1.0, 0.5])


def test_same_seed_same_samples():
    x = _logits()
    a = [Sampler(SamplerConfig(temperature=1.0, seed=7)).sample(x, []) for _ in range(3)]
    s = Sampler(SamplerConfig(temperature=1.0, seed=7))
    b = [s.sample(x, []) for _ in range(200)]
    assert a == [b[0]] * 3
    # with 200 draws the empirical frequencies follow the distribution
    p = s.probs(x, [])
    assert abs(np.mean(np.array(b) == np.argmax(p)) - p.max()) < 0.1


@pytest.mark.parametrize("kw, message", [
    (dict(temperature=-1), "{} must be >= 0, got -1"), (dict(top_k=-1), "{} must be >= 0, got -1"),
    (dict(top_p=0), "{} must be in (0, 1], got 0"), (dict(top_p=1.5), "{} must be in (0, 1], got 1.5"),
    (dict(repetition_penalty=0), "{} must be > 0, got 0"), (dict(repetition_window=-1), "{} must be >= 0, got -1"),
    (dict(seed=-3), "{} must be >= 0, got -3"), (dict(top_k=2.5), "{} must be a whole number >= 0, got 2.5")])
def test_bad_values_are_one_line_errors_by_python_name_or_flag(kw, message):
    """Python callers read the field's name; a command line words the same error with its flag."""
    (name,) = kw
    with pytest.raises(OptionError) as e:
        Sampler(SamplerConfig(**kw))
    assert str(e.value) == message.format(name)
    assert e.value.worded(lambda n: "--" + n.replace("_", "-")) == message.format("--" + name.replace("_", "-"))
