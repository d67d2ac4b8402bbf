"""Which drafted tokens the target keeps: speculative sampling with rejection (Leviathan et al.
2023, "Fast Inference from Transformers via Speculative Decoding"; Chen et al. 2023).

Row i of a verify step's logits is the target's distribution p_i for the token after row i. Draft
i, drawn from the drafter's q_i, is kept with probability min(1, p_i(x) / q_i(x)); the first one
refused is replaced by a draw from norm(max(0, p_i - q_i)), and if every draft is kept one more
token is drawn from p_k. Each emitted token is then distributed exactly as p (the proof: the
accepted mass min(p, q) plus the residual (p - q)+ sums to p). A deterministic drafter (prompt
lookup) has q = one-hot, so a draft is kept with probability p(x). Greedy decoding keeps a
draft exactly when it is the argmax, which is the token decoding one at a time would choose.

p and q are the distributions the Sampler draws from (runtime/sampler.py: repetition penalty
over the history so far, temperature, top-k, top-p), so every option keeps its meaning.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..engine import check_finite
from ..sampler import Sampler


@dataclass
class Verdict:
    accepted: list[int]     # the drafts kept, a prefix of them
    token: int              # the token after them: the replacement of the first refused, or a bonus


def judge(sampler: Sampler, logits: np.ndarray, drafts: Sequence[int], q: Sequence[np.ndarray] | None,
          history: Sequence[int], step: int = 1) -> Verdict:
    """logits: f32 [len(drafts) + 1, vocab], row i scoring the token after drafts[:i]. q: the
    drafter's distribution for each draft, or None for a deterministic drafter. history: every
    token before the first draft (what the repetition penalty looks back over)."""
    seen = list(history)
    accepted: list[int] = []
    for i, d in enumerate(drafts):
        row = check_finite(logits[i], step + i)
        if sampler.cfg.temperature == 0:
            t = sampler.sample(row, seen)
            if t != d:
                return Verdict(accepted, t)
        else:
            p = sampler.probs(row, seen)
            qd = 1.0 if q is None else float(q[i][d])
            if not (qd > 0 and sampler.rng.random() < min(1.0, p[d] / qd)):
                return Verdict(accepted, _residual(sampler, p, d, None if q is None else q[i]))
        accepted.append(int(d))
        seen.append(int(d))
    row = check_finite(logits[len(drafts)], step + len(drafts))
    return Verdict(accepted, sampler.sample(row, seen))


def _residual(sampler: Sampler, p: np.ndarray, d: int, q: np.ndarray | None) -> int:
    """A draw from norm(max(0, p - q)): where the target wants more than the drafter gave."""
    if q is None:
        r = p.copy()
        r[d] = 0.0
    else:
        r = np.maximum(p - np.asarray(q, np.float64), 0.0)
    total = r.sum()
    if total <= 0:      # p == q (up to rounding): a refusal had probability ~0; p is the answer
        r, total = p, p.sum()
    return int(sampler.rng.choice(r.size, p=r / total))


__all__ = ["Verdict", "judge"]
