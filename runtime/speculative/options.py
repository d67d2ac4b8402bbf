"""SpeculativeOptions: how tokens are drafted for a verify step; Model.load's keywords, llmrs-run's
and llmrs-serve's flags (the seed's --speculative, --draft-model (also --draft), --num-speculative-tokens)."""
from __future__ import annotations

from dataclasses import dataclass

from ...options import OptionError, OptionTypeError, option, whole

DRAFTERS = ("lookup", "draft")
TITLE = ("speculative decoding (greedy: the same tokens as without it; sampling: the same distribution; "
         "a plan with a step graph)")


@dataclass(frozen=True)
class SpeculativeOptions:
    speculative: str | None = option(None, "draft tokens and verify them in one step: lookup (n-grams of the "
                                           "prompt and the text so far) or draft (a smaller plan, --draft PLAN); "
                                           "default off", choices=DRAFTERS, type=str)
    draft: str | None = option(None, "the draft plan of --speculative draft (same tokenizer and vocabulary)",
                               metavar="PLAN", type=str, aliases=("--draft-model",))
    draft_backend: str | None = option(None, "back end the draft plan runs on (default: the target's)",
                                       metavar="BACKEND", type=str)
    num_speculative_tokens: int | None = option(None, "tokens drafted per verify step (default: adaptive, growing "
                                                      "while drafts are kept, up to the plan's --max-draft-tokens)",
                                                metavar="K", type=int)
    lookup_ngram: int = option(3, "lookup: the longest n-gram matched (default 3; shorter ones down to 2 are "
                                  "tried after)", metavar="N")

    @property
    def enabled(self) -> bool:
        return self.speculative is not None

    def check(self) -> "SpeculativeOptions":
        if self.speculative is not None and self.speculative not in DRAFTERS:
            raise OptionError(f"{{0}} {self.speculative!r}: choose one of {', '.join(DRAFTERS)}", "speculative")
        k = self.num_speculative_tokens
        if k is not None and not whole(k):
            raise OptionTypeError(f"{{0}} must be a whole number >= 1 or None, got {k!r}", "num_speculative_tokens")
        if k is not None and k < 1:
            raise OptionError(f"{{0}} must be at least 1, got {k}", "num_speculative_tokens")
        if not whole(self.lookup_ngram) or self.lookup_ngram < 1:
            raise OptionError(f"{{0}} must be a whole number >= 1, got {self.lookup_ngram!r}", "lookup_ngram")
        if self.speculative == "draft" and not self.draft:
            raise OptionError("{0} draft needs {1} PLAN (a smaller plan with the same tokenizer)", "speculative",
                              "draft")
        if self.draft and self.speculative != "draft":
            raise OptionError("{0} is only read with {1} draft", "draft", "speculative")
        return self


__all__ = ["DRAFTERS", "SpeculativeOptions", "TITLE"]
