"""Next-token choice from logits: greedy, or temperature / top-k / top-p with a repetition penalty."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SamplerConfig:
    temperature: float = 0.0        # 0 means greedy
    top_k: int = 0                  # 0 keeps every token
    top_p: float = 1.0              # nucleus mass kept
    repetition_penalty: float = 1.0
    repetition_window: int = 64     # how many recent tokens the penalty looks at
    seed: int | None = None

    def check(self) -> "SamplerConfig":
        bad = None
        if not self.temperature >= 0:
            bad = f"--temperature must be >= 0, got {self.temperature}"
        elif self.top_k < 0:
            bad = f"--top-k must be >= 0, got {self.top_k}"
        elif not 0 < self.top_p <= 1:
            bad = f"--top-p must be in (0, 1], got {self.top_p}"
        elif not self.repetition_penalty > 0:
            bad = f"--repetition-penalty must be > 0, got {self.repetition_penalty}"
        elif self.repetition_window < 0:
            bad = f"--repetition-window must be >= 0, got {self.repetition_window}"
        elif self.seed is not None and self.seed < 0:
            bad = f"--seed must be >= 0, got {self.seed}"
        if bad:
            raise ValueError(bad)
        return self


class Sampler:
    def __init__(self, cfg: SamplerConfig):
        self.cfg = cfg.check()
        self.rng = np.random.default_rng(cfg.seed)

    @property
    def greedy(self) -> bool:
        """The choice is the argmax of the raw logits (so a backend may take it on the device)."""
        return self.cfg.temperature == 0 and (self.cfg.repetition_penalty == 1.0 or self.cfg.repetition_window == 0)

    def penalize(self, logits: np.ndarray, history: list[int]) -> np.ndarray:
        """HF's rule: a seen token's logit is divided by the penalty if positive, else multiplied."""
        c = self.cfg
        if c.repetition_penalty == 1.0 or not history or c.repetition_window == 0:
            return logits
        seen = np.unique(np.asarray(history[-c.repetition_window:], dtype=np.int64))
        out = logits.astype(np.float32, copy=True)
        vals = out[seen]
        out[seen] = np.where(vals > 0, vals / c.repetition_penalty, vals * c.repetition_penalty)
        return out

    def probs(self, logits: np.ndarray, history: list[int]) -> np.ndarray:
        """The distribution sampled from (after penalty, temperature, top-k, top-p)."""
        c = self.cfg
        x = self.penalize(np.asarray(logits, np.float32), history).astype(np.float64)
        if c.temperature == 0:
            p = np.zeros_like(x)
            p[int(np.argmax(x))] = 1.0
            return p
        x = x / c.temperature
        if 0 < c.top_k < x.size:
            kth = np.partition(x, -c.top_k)[-c.top_k]
            x = np.where(x >= kth, x, -np.inf)
        p = np.exp(x - np.max(x))
        p /= p.sum()
        if c.top_p < 1.0:
            order = np.argsort(-p, kind="stable")
            cum = np.cumsum(p[order])
            keep = order[: int(np.searchsorted(cum, c.top_p)) + 1]  # smallest set reaching top_p
            mask = np.zeros_like(p, dtype=bool)
            mask[keep] = True
            p = np.where(mask, p, 0.0)
            p /= p.sum()
        return p

    def sample(self, logits: np.ndarray, history: list[int]) -> int:
        if self.cfg.temperature == 0:
            return int(np.argmax(self.penalize(np.asarray(logits, np.float32), history)))
        p = self.probs(logits, history)
        return int(self.rng.choice(p.size, p=p))
