"""Speculative sampling keeps the target's distribution: with a fixed seed on a small vocabulary,
the tokens a verify step emits are distributed as the target's p (after temperature, top-k and
top-p), whatever the drafter proposed (a draft model's q, or prompt lookup's one-hot draft).
Greedy keeps a draft exactly when it is the target's argmax. Each test also runs a planted bug
(the refused draft replaced by a draw from p instead of the residual) to show it can fail."""
from __future__ import annotations

import numpy as np
import pytest

from llmrs.runtime.sampler import Sampler, SamplerConfig
from llmrs.runtime.speculative import judge
from llmrs.runtime.speculative import rejection

V = 8
TRIALS = 10000
# chi-square critical value at p = 0.001 for V - 1 = 7 degrees of freedom
CHI2_7_0001 = 24.32


def chi2(counts: np.ndarray, p: np.ndarray) -> float:
    """Pearson's statistic over the tokens the distribution gives mass (others must never occur)."""
    n = counts.sum()
    assert counts[p == 0].sum() == 0, "a token outside the target's support was emitted"
    live = p > 0
    expected = n * p[live]
    return float(((counts[live] - expected) ** 2 / expected).sum())


def _rows(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).normal(0, 1.5, size=(3, V)).astype(np.float32)


def _draw(q: np.ndarray, rng: np.random.Generator) -> int:
    return int(rng.choice(q.size, p=q))


def _emitted(cfg: SamplerConfig, logits: np.ndarray, q_logits: np.ndarray | None, trials: int = TRIALS):
    """First and second token emitted over many verify steps of 2 drafts: from a draft model with
    distribution q (softmax of q_logits through the same sampler options), or from a fixed
    lookup draft (row 0's most likely token, then row 1's second) when q_logits is None."""
    sampler = Sampler(cfg)
    draw_rng = np.random.default_rng(99)
    firsts, seconds = np.zeros(V, np.int64), np.zeros(V, np.int64)
    drafter = Sampler(cfg)
    for _ in range(trials):
        if q_logits is None:
            drafts, q = [int(np.argmax(logits[0])), int(np.argsort(logits[1])[-2])], None
        else:
            q = [drafter.probs(q_logits[i], []) for i in range(2)]
            drafts = [_draw(q[0], draw_rng), _draw(q[1], draw_rng)]
        v = judge(sampler, logits, drafts, q, [])
        out = [*v.accepted, v.token]
        firsts[out[0]] += 1
        if len(out) > 1:        # the first draft was kept: the second token is drawn from p_1
            seconds[out[1]] += 1
    return sampler, firsts, seconds


CASES = {"temperature": SamplerConfig(temperature=0.8, seed=1),
         "top_k": SamplerConfig(temperature=1.0, top_k=3, seed=2),
         "top_p": SamplerConfig(temperature=1.2, top_p=0.7, seed=3)}


@pytest.mark.parametrize("drafter", ["draft model", "lookup"])
@pytest.mark.parametrize("case", list(CASES))
def test_emitted_tokens_follow_the_targets_distribution(case, drafter):
    cfg = CASES[case]
    logits = _rows(10)
    # a drafter like the target but not equal to it (a smaller model of the same family)
    q_logits = None if drafter == "lookup" else logits + _rows(20) * 0.5
    sampler, firsts, seconds = _emitted(cfg, logits, q_logits)
    p0, p1 = (Sampler(cfg).probs(logits[i], []) for i in range(2))
    assert chi2(firsts, p0) < CHI2_7_0001
    assert seconds.sum() > TRIALS // 10
    assert chi2(seconds, p1) < CHI2_7_0001


def test_a_residual_drawn_from_p_is_caught(monkeypatch):
    """The planted bug: after a refusal, a draw from p (not max(0, p - q)) over-weights the tokens
    the drafter likes; the same statistic rejects it."""
    cfg = CASES["temperature"]

    def from_p(sampler, p, d, q):
        return int(sampler.rng.choice(p.size, p=p))

    monkeypatch.setattr(rejection, "_residual", from_p)
    logits = _rows(10)
    _, firsts, _ = _emitted(cfg, logits, logits + _rows(20) * 0.5)
    assert chi2(firsts, Sampler(cfg).probs(logits[0], [])) > 10 * CHI2_7_0001


def test_greedy_keeps_drafts_while_they_are_the_argmax():
    logits = _rows(5)
    best = [int(np.argmax(r)) for r in logits]
    sampler = Sampler(SamplerConfig())
    v = judge(sampler, logits, best[:2], None, [])
    assert v.accepted == best[:2] and v.token == best[2]
    wrong = (best[1] + 1) % V
    v = judge(sampler, logits, [best[0], wrong], None, [])
    assert v.accepted == [best[0]] and v.token == best[1]


def test_greedy_with_a_repetition_penalty_judges_each_row_after_the_kept_drafts():
    """The penalty looks back over the history and every draft kept before the row."""
    logits = np.zeros((2, V), np.float32)
    logits[0, 3], logits[1, 3], logits[1, 4] = 2.0, 2.0, 1.9
    sampler = Sampler(SamplerConfig(repetition_penalty=1.5))
    v = judge(sampler, logits, [3], None, [])
    assert v.accepted == [3] and v.token == 4        # 3 is penalised in row 1 once it is kept


def test_a_nan_row_is_refused():
    from llmrs.runtime.engine import EngineError
    logits = _rows(5)
    logits[1, 2] = np.nan
    with pytest.raises(EngineError, match="NaN"):
        judge(Sampler(SamplerConfig()), logits, [int(np.argmax(logits[0])), 0], None, [])
