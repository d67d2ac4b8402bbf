"""Prompt lookup's drafting policy, measured without the clock's noise: the greedy text of each
bench prompt (measure/spec_prompts.py) is recorded once, then the shipped drafter and K rule
(runtime/speculative: PromptLookup, AdaptiveK) are replayed over it token by token: which drafts
the target would keep is known exactly (greedy), and each step costs what a verify step of its
rows costs, measured on this plan in the same run. The predicted speedup is tokens / cost in
decode steps; llmrs-bench --speculative lookup times the real thing.

    python tools/spec_policy.py PLAN [--threads 2] [--tokens 128,256] [--repeats 15]

Why: on 2 shared cores one timed run of a prompt spreads 0.85-1.13x with nothing drafted at all,
so two policies a few percent apart are told apart here first, then timed.
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from llmrs.measure.bench_speculative import prompt_ids
from llmrs.measure.spec_prompts import PROMPTS
from llmrs.runtime.model import Model
from llmrs.runtime.speculative import AdaptiveK, PromptLookup, SpeculativeOptions


def verify_costs(model: Model, rows_max: int, repeats: int, ids: list[int]) -> list[float]:
    """cost[r] = a verify step of r rows / a decode step, medians of interleaved repeats after
    `ids` as a prompt (r = 1 is the decode step itself: 1.0)."""
    eng = model.engine
    times: dict[int, list[float]] = {r: [] for r in range(1, rows_max + 1)}
    for _ in range(repeats):
        for r in range(1, rows_max + 1):
            eng.reset()
            eng.prefill(ids)
            t0 = time.perf_counter()
            if r == 1:     # as greedy runs them: each row's token from the back end's argmax
                eng.decode_one_token(ids[-1], eng.backend.device_argmax)
            else:
                eng.verify(ids[-r:], argmax=eng.backend.device_argmax)
            times[r].append(time.perf_counter() - t0)
    one = statistics.median(times[1])
    return [0.0] + [statistics.median(times[r]) / one for r in range(1, rows_max + 1)]


def replay(prompt: list[int], text: list[int], cost: list[float], k_max: int, ngram: int) -> dict:
    """The drafts the shipped policy makes over `text` (the target's greedy continuation of
    `prompt`), the tokens each verify step keeps, and the cost in decode steps."""
    drafter, k_rule = PromptLookup(ngram), AdaptiveK(k_max)
    history = list(prompt) + text[:1]      # the first token comes from the prompt's prefill
    done, spent, drafted, kept, steps = 1, 0.0, 0, 0, 0
    while done < len(text):
        k = min(k_rule.next(), len(text) - done - 1, len(cost) - 2)
        draft = drafter.propose(history, k).tokens if k > 0 else []
        if not draft:
            spent += 1.0
            history.append(text[done])
            done += 1
            continue
        truth = text[done:done + len(draft)]
        n_ok = 0
        while n_ok < len(draft) and draft[n_ok] == truth[n_ok]:
            n_ok += 1
        k_rule.update(len(draft), n_ok)
        gain = min(n_ok + 1, len(text) - done)
        history += text[done:done + gain]
        done += gain
        spent += cost[len(draft) + 1]
        drafted, kept, steps = drafted + len(draft), kept + n_ok, steps + 1
    return {"speedup": (len(text) - 1) / spent, "drafted": drafted, "kept": kept, "steps": steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("plan")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", default="128,256", help="greedy tokens a prompt (comma-separated)")
    ap.add_argument("--repeats", type=int, default=15, help="repeats of each verify width's timing")
    ap.add_argument("--k-max", type=int, help="most drafts a step (default: the plan's --max-draft-tokens)")
    ap.add_argument("--ngram", type=int, default=SpeculativeOptions().lookup_ngram)
    a = ap.parse_args()
    counts = [int(n) for n in a.tokens.split(",")]
    with Model.load(a.plan, threads=a.threads, speculative="lookup") as model:
        texts = {}
        for name, p in PROMPTS.items():
            ids = prompt_ids(model, p)
            c = model.generate(ids, max_tokens=max(counts))
            for _ in c:
                pass
            texts[name] = (ids, c.tokens)
        k_max = a.k_max or model.engine.speculator.k_max
        cost = verify_costs(model, k_max + 1, a.repeats, texts["chat"][0])
    print("verify step of r rows, in decode steps: "
          + ", ".join(f"{r} {c:.2f}" for r, c in enumerate(cost) if r))
    for n in counts:
        print(f"\n{n} tokens   predicted speedup   kept / drafted   tokens per verify step")
        for name, (ids, text) in texts.items():
            r = replay(ids, text[:n], cost, k_max, a.ngram)
            per = (r["kept"] + r["steps"]) / r["steps"] if r["steps"] else 0.0
            print(f"  {name:<6} {r['speedup']:>10.2f}x   {r['kept']:>5} / {r['drafted']:<5}      {per:.2f}")


if __name__ == "__main__":
    main()
