"""Next-token choice from logits: greedy, or temperature / top-k / top-p with a repetition penalty."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..options import OptionError, OptionTypeError, option, real, whole


@dataclass(frozen=True)
class SamplerConfig:
    """How the next token is chosen; each field is llmrs-run's flag of the same name (--top-p)."""
    temperature: float = option(0.0, "0 = greedy (default)")
    top_k: int = option(0, "keep the K most likely tokens (0 = all)")
    top_p: float = option(1.0, "keep the smallest set with this probability mass")
    repetition_penalty: float = option(1.0, "HF-style penalty for recent tokens (1 = off)")
    repetition_window: int = option(64, "recent tokens the penalty covers (default 64)")
    seed: int | None = option(None, "random seed for sampling", type=int)

    def check(self) -> "SamplerConfig":
        """Raises OptionError (OptionTypeError for a wrong type) naming the first bad option."""
        for name, whole_number, what in _TYPES:
            value = getattr(self, name)
            if not (value is None and name == "seed") and not (whole if whole_number else real)(value):
                raise OptionTypeError(f"{{0}} must be {what}, got {value!r}", name)
        bad = None
        if not self.temperature >= 0:
            bad = f"{{0}} must be >= 0, got {self.temperature}", "temperature"
        elif self.top_k < 0:
            bad = f"{{0}} must be >= 0, got {self.top_k}", "top_k"
        elif not 0 < self.top_p <= 1:
            bad = f"{{0}} must be in (0, 1], got {self.top_p}", "top_p"
        elif not self.repetition_penalty > 0:
            bad = f"{{0}} must be > 0, got {self.repetition_penalty}", "repetition_penalty"
        elif self.repetition_window < 0:
            bad = f"{{0}} must be >= 0, got {self.repetition_window}", "repetition_window"
        elif self.seed is not None and self.seed < 0:
            bad = f"{{0}} must be >= 0, got {self.seed}", "seed"
        if bad:
            raise OptionError(*bad)
        return self


# (option, whole number?, what it must be) for the type checks
_TYPES = (("temperature", False, "a number >= 0"), ("top_k", True, "a whole number >= 0"),
          ("top_p", False, "a number in (0, 1]"), ("repetition_penalty", False, "a number > 0"),
          ("repetition_window", True, "a whole number >= 0"), ("seed", True, "a whole number >= 0 or None"))


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
