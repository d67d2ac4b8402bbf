"""The Speculator a Model's options ask for: checks that the plan can verify drafts, opens the
draft plan where there is one, and refuses a pair that cannot work in one line naming the fix."""
from __future__ import annotations

from typing import TYPE_CHECKING

from ...options import OptionError
from ..engine import Engine
from ..plan import Plan
from . import Speculator
from .drafters import DraftModel, PromptLookup
from .options import SpeculativeOptions

if TYPE_CHECKING:
    from ..backends import BackendOptions


def _same_vocab(target: Plan, draft: Plan) -> str | None:
    """Why draft cannot draft for target, or None: the token ids must mean the same text."""
    tv, dv = int(target.manifest["model"]["vocab_size"]), int(draft.manifest["model"]["vocab_size"])
    if tv != dv:
        return f"its vocabulary has {dv} tokens and the target's {tv}"
    if target.tokenizer().get_vocab() != draft.tokenizer().get_vocab():
        return "its tokenizer maps tokens to other ids than the target's"
    return None


def make_speculator(opts: SpeculativeOptions, plan: Plan, backend: str,
                    backend_options: "BackendOptions") -> Speculator | None:
    from ..backends import BACKENDS, open_backend     # the back ends import the engine's contract, not this
    opts.check()
    if not opts.enabled:
        return None
    if opts.draft_backend is not None and opts.draft_backend not in BACKENDS:
        raise OptionError(f"{{0}} {opts.draft_backend!r}: choose one of {', '.join(BACKENDS)}", "draft_backend")
    shape = plan.step_shape()
    if shape is None:
        raise OptionError(f"{plan.path}: {{0}} verifies drafts with the plan's step graph, which this plan lacks; "
                          "recompile it without --max-num-seqs 0", "speculative")
    k_max = min(shape.logits, shape.rows) - 1
    k = opts.num_speculative_tokens
    if k_max < 1 or (k is not None and k > k_max):
        raise OptionError(f"{{0}} {k if k is not None else 1} is more than {plan.path}'s verify step checks "
                          f"({k_max}); recompile it with --max-draft-tokens {k if k is not None else 1}",
                          "num_speculative_tokens")
    if opts.speculative == "lookup":
        drafter = PromptLookup(opts.lookup_ngram)
    else:
        draft = Plan.open(opts.draft)
        why = _same_vocab(plan, draft)
        if why:
            raise OptionError(f"{{0}} {opts.draft}: {why}; draft with a plan of the same tokenizer "
                              "(or use {1} lookup)", "draft", "speculative")
        kind = opts.draft_backend or backend
        if kind != backend:     # the target's kind-specific options (hybrid's switches) are not the draft's
            backend_options = type(backend_options)(threads=backend_options.threads, device=backend_options.device)
        be = open_backend(draft, kind, backend_options)
        m = draft.manifest
        drafter = DraftModel(Engine(be, int(m["prefill_chunk"]), int(m["max_seq_len"])))
    return Speculator(drafter, k_max, k)


__all__ = ["make_speculator"]
