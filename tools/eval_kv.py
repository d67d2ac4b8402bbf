"""Quality of KV-cache eviction on a real model: perplexity, agreement with the full cache, and
passkey retrieval, per policy and budget, all through the engine with the policy active.

    python tools/eval_kv.py smol.plan.bin -o bench/kv_eval.json          (~20 min on 2 cores)
    python tools/eval_kv.py tiny.plan.bin --quick -o out.json             (seconds; the test's mode)

The plan needs a KV cache of at least --tokens + --greedy-k slots (the "full" row: nothing
evicted) and a CPU (or reference) back end. Each budget B is the policy's budget, the slots an
eviction keeps (--protected-prefix + --eviction-window); the cache the engine drives has B +
--headroom slots, as a plan compiled with --max-seq-len B + headroom would (a larger plan is
driven with a smaller n_past: the kernels attend over n_past, never over the plan's length).
sliding and h2o evict after every step that goes over B, snapkv when the cache is full (every
--headroom tokens) with its last min(32, B/4) queries voting.

(a) perplexity: --tokens tokens of --text teacher-forced one at a time through decode steps,
    the cache evicting as in generation; the negative log-likelihood of every token at position
    >= --score-from (every budget evicts by then), so each row scores the same tokens. The
    top-1 agreement is how often the row's argmax equals the full cache's on those positions.
(b) greedy agreement: at --forks points of that same pass the cache is saved, --greedy-k
    greedy tokens are generated and the cache restored; the fraction of those tokens equal,
    position by position, to what the full cache generates from the same point.
(c) passkey: a 5-digit key early in a long filler prompt (longer than every budget), asked for
    at its end as a raw completion ("... What is the pass key? The pass key is"), which the
    full cache answers; a trial passes when the greedy answer contains the key. "passkey": the
    cache of B + --headroom slots, evicting while the prompt is prefilled (the question comes
    after the key is gone); "passkey_fit": a cache that holds the whole prompt (its length + 16
    slots), evicting to B as the policy does with a whole prompt (sliding and h2o after each
    prefill chunk over B, snapkv once after the prompt, its last queries voting).

Progress goes to stderr; the JSON (settings, machine, date, one row per policy and budget) to -o.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

from llmrs.cliutil import OneLineParser
from llmrs.compiler.outputs import write_output
from llmrs.runtime.engine import Engine, EngineError
from llmrs.runtime.kv import CacheManager, make_policy
from llmrs.runtime.model import Model
from llmrs.runtime.plan import PlanError

TEXT = Path("/usr/share/common-licenses/GPL-3")
TEXT_START = "TERMS AND CONDITIONS"      # the GPL's preamble is skipped: its body is the held-out text
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
POLICIES = {   # label -> (policy, protected prefix)
    "sliding+4sinks": ("sliding", 4),
    "sliding": ("sliding", 0),
    "snapkv": ("snapkv", 4),
    "h2o": ("h2o", 4),
}


@dataclasses.dataclass
class Settings:
    tokens: int = 768
    score_from: int = 256
    budgets: tuple[int, ...] = (32, 64, 128, 256)
    headroom: int = 32
    forks: int = 4
    greedy_k: int = 32
    passkey_trials: int = 5
    passkey_tokens: int = 480
    sinks: int = 4


QUICK = Settings(tokens=72, score_from=24, budgets=(8, 16), headroom=8, forks=2, greedy_k=6,
                 passkey_trials=1, passkey_tokens=48, sinks=2)


class SmallerCache:
    """A back end's KV store seen as holding only its first `slots` slots."""

    def __init__(self, inner, slots: int):
        self.inner, self.slots = inner, slots

    def __getattr__(self, name):      # everything but the slot count is the store's own
        return getattr(self.inner, name)


def log(msg: str) -> None:
    print(f"eval_kv: {msg}", file=sys.stderr, flush=True)


def make_engine(model: Model, label: str | None, budget: int | None, st: Settings,
                slots: int | None = None) -> Engine:
    m = model.plan.manifest
    chunk, stops = int(m["prefill_chunk"]), tuple(m.get("stop_ids", ()))
    if label is None:
        return Engine(model.backend, chunk, model.max_seq_len, stops)
    name, prefix = POLICIES[label]
    prefix = min(prefix, st.sinks)
    slots = slots or budget + st.headroom
    policy = make_policy(name, budget - prefix, prefix, snapkv_window=max(1, min(32, budget // 4)), snapkv_kernel=7)
    cache = CacheManager(policy, SmallerCache(model.backend.kv_store(), slots))
    return Engine(model.backend, chunk, slots, stops, cache=cache)


class Saved:
    """The engine's whole cache state (KV, scores, score control, positions), to fork from."""

    def __init__(self, engine: Engine):
        self.arrays = {n: a.copy() for n, a in engine.backend.kv_store().arrays.items()}
        self.pos = (engine.n_past, engine.start_pos)
        c = engine.cache
        self.cache = None if c is None else (c.positions.copy(), c._start_pos, c._scoring, len(c.events))

    def restore(self, engine: Engine) -> None:
        for n, a in engine.backend.kv_store().arrays.items():
            a[...] = self.arrays[n]
        engine.n_past, engine.start_pos = self.pos
        if self.cache is not None:
            c = engine.cache
            c.positions[...], c._start_pos, c._scoring, n_events = self.cache
            del c.events[n_events:]


def greedy(engine: Engine, logits: np.ndarray, k: int) -> list[int]:
    out = []
    for i in range(k):
        out.append(int(np.argmax(logits)))
        if i + 1 < k:
            logits = engine.decode_one_token(out[-1])
    return out


def log_softmax_at(logits: np.ndarray, token: int) -> float:
    x = np.asarray(logits, np.float64)
    mx = x.max()
    return float(x[token] - mx - np.log(np.exp(x - mx).sum()))


def teacher_forced(engine: Engine, ids: list[int], st: Settings) -> dict:
    """NLL and argmax at every scored position, and the greedy continuations at the forks."""
    engine.reset()
    forks = set(fork_points(st))
    nll, top1, cont = [], [], {}
    logits = engine.prefill(ids[:1])
    for i in range(1, len(ids)):
        if i in forks:                 # the first i tokens are cached; logits predict token i
            saved = Saved(engine)
            cont[i] = greedy(engine, logits, st.greedy_k)
            saved.restore(engine)
        if i >= st.score_from:
            nll.append(-log_softmax_at(logits, ids[i]))
            top1.append(int(np.argmax(logits)))
        logits = engine.decode_one_token(ids[i])
    return {"nll": np.array(nll), "top1": np.array(top1), "greedy": cont}


def fork_points(st: Settings) -> list[int]:
    """Where the greedy continuations start: evenly over the scored positions."""
    step = (st.tokens - st.score_from) // st.forks
    return [st.score_from + step * j for j in range(st.forks)]


def passkey_prompts(model: Model, st: Settings) -> list[tuple[str, list[int]]]:
    """(key, prompt ids): the key after 1..3 filler sentences, filler after it up to the length."""
    rng = np.random.default_rng(12345)
    head = "There is an important piece of information hidden inside a lot of irrelevant text. Find it and memorize it.\n"
    out = []
    for t in range(st.passkey_trials):
        key = str(rng.integers(10000, 100000))
        before = FILLER * (1 + t % 3)
        needle = f"The pass key is {key}. Remember it. {key} is the pass key. "
        tail = "\nWhat is the pass key? The pass key is"
        n_after = 0
        while True:
            text = head + before + needle + FILLER * n_after + tail
            ids = model.tokenize(text, add_special_tokens=False)
            if len(ids) >= st.passkey_tokens:
                break
            n_after += 1
        out.append((key, ids))
    return out


def passkey(engine: Engine, model: Model, prompts) -> tuple[int, list[str]]:
    hits, answers = 0, []
    for key, ids in prompts:
        engine.reset()
        ans = model.detokenize(greedy(engine, engine.prefill(ids), 8), skip_special_tokens=True)
        hits += key in ans
        answers.append(ans)
    return hits, answers


def held_out(model: Model, path: Path, n: int) -> list[int]:
    text = path.read_text(errors="replace")
    at = text.find(TEXT_START)
    ids = model.tokenize(text[max(at, 0):], add_special_tokens=False)
    if len(ids) < n:
        raise ValueError(f"{path} has {len(ids)} tokens, --tokens asks for {n}")
    return ids[:n]


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} CPUs, {platform.system()} {platform.release()}"


def evaluate(model: Model, text: Path, st: Settings, backend: str, threads: int) -> dict:
    ids = held_out(model, text, st.tokens)
    prompts = passkey_prompts(model, st)
    fit_slots = max(len(p) for _, p in prompts) + 16
    need = max(st.tokens + st.greedy_k, fit_slots, max(st.budgets) + st.headroom)
    if model.max_seq_len < need:
        raise ValueError(f"the plan's KV cache has {model.max_seq_len} slots; "
                         f"recompile with --max-seq-len {need} or more")
    if not st.sinks < min(st.budgets) // 2:
        raise ValueError("every budget must be more than twice the sinks")
    t_all = time.perf_counter()
    rows = []
    configs = [(None, None)] + [(label, b) for b in st.budgets for label in POLICIES]
    for n, (label, budget) in enumerate(configs, 1):
        t0 = time.perf_counter()
        engine = make_engine(model, label, budget, st)
        tf = teacher_forced(engine, ids, st)
        events = len(engine.cache.events) if engine.cache else 0
        hits, answers = passkey(engine, model, prompts)
        # the same prompts in a cache that holds them whole: evicted down to the budget as the
        # policy does it with the whole prompt seen (snapkv: once, the question voting)
        fit = hits if label is None else passkey(make_engine(model, label, budget, st, fit_slots), model, prompts)[0]
        row = {"policy": label or "full", "budget": budget, "cache_slots": budget + st.headroom if budget else None,
               "ppl": float(np.exp(tf["nll"].mean())), "nll": float(tf["nll"].mean()),
               "evictions": events, "passkey": hits / len(prompts), "passkey_answers": answers,
               "passkey_fit": fit / len(prompts),
               "_top1": tf["top1"], "_greedy": tf["greedy"]}
        rows.append(row)
        row["seconds"] = round(time.perf_counter() - t0, 1)
        log(f"[{n}/{len(configs)}] {row['policy']:<15} budget {budget or 'full':>4}: ppl {row['ppl']:.3f}, "
            f"passkey {hits}/{len(prompts)} ({fit}/{len(prompts)} in a cache of {fit_slots}), {events} evictions, {row['seconds']:.0f} s "
            f"({time.perf_counter() - t_all:.0f} s in all)")
    ref_top1, ref_greedy = rows[0]["_top1"], rows[0]["_greedy"]
    for row in rows:
        row["top1_agreement"] = float(np.mean(row.pop("_top1") == ref_top1))
        g = row.pop("_greedy")
        row["greedy_agreement"] = float(np.mean([np.mean(np.array(g[p]) == np.array(ref_greedy[p])) for p in sorted(g)]))
    return {
        "compile_command": model.plan.manifest.get("compile_command"),
        "text": str(text), "text_from": TEXT_START, "backend": backend, "threads": threads,
        "machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "seconds": round(time.perf_counter() - t_all, 1),
        "settings": {**dataclasses.asdict(st), "scored_tokens": st.tokens - st.score_from,
                     "fork_points": fork_points(st), "passkey_prompt_tokens": [len(p[1]) for p in prompts],
                     "snapkv_window": "min(32, budget // 4)", "h2o_recent": "half the eviction window",
                     "sinks": {k: min(v[1], st.sinks) for k, v in POLICIES.items()}},
        "rows": rows,
    }


def parser() -> argparse.ArgumentParser:
    ap = OneLineParser(prog="eval_kv.py", description=__doc__.split("\n\n")[0],
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    ap.add_argument("plan", type=Path, help="plan file (KV cache >= --tokens + --greedy-k slots)")
    ap.add_argument("-o", "--output", type=Path, required=True, help="JSON file to write")
    ap.add_argument("--text", type=Path, default=TEXT, help=f"held-out English text (default {TEXT})")
    ap.add_argument("--backend", choices=("cpu", "reference"), default="cpu", help="cpu (default) or reference")
    ap.add_argument("--threads", type=int, default=2, help="CPU threads (default 2)")
    ap.add_argument("--quick", action="store_true", help="tiny sizes (budgets 8, 16; 72 tokens): for tests")
    d = Settings()
    ap.add_argument("--tokens", type=int, help=f"teacher-forced tokens (default {d.tokens})")
    ap.add_argument("--score-from", type=int, help=f"first scored position (default {d.score_from})")
    ap.add_argument("--budgets", help=f"comma-separated budgets in slots (default {','.join(map(str, d.budgets))})")
    ap.add_argument("--passkey-trials", type=int, help=f"passkey prompts (default {d.passkey_trials})")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    st = dataclasses.replace(QUICK if args.quick else Settings())
    for name in ("tokens", "score_from", "passkey_trials"):
        if getattr(args, name) is not None:
            setattr(st, name, getattr(args, name))
    if args.budgets:
        try:
            st.budgets = tuple(int(b) for b in args.budgets.split(","))
        except ValueError:
            parser().error(f"--budgets {args.budgets!r}: give numbers separated by commas")
    if not 0 < st.score_from < st.tokens or st.passkey_trials < 1:
        parser().error("need 0 < --score-from < --tokens and --passkey-trials >= 1")
    if not args.text.is_file():
        parser().error(f"--text {args.text}: no such file")
    model = Model.load(args.plan, args.backend, threads=args.threads if args.backend == "cpu" else None)
    log(f"{args.plan}: {len(st.budgets) * len(POLICIES) + 1} runs of {st.tokens} tokens + "
        f"{st.passkey_trials} passkey prompts each")
    result = evaluate(model, args.text, st, args.backend, args.threads)
    result["plan"] = str(args.plan)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    write_output(args.output, json.dumps(result, indent=1) + "\n", "-o")
    log(f"wrote {args.output} ({result['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (PlanError, EngineError, ValueError, OSError) as e:   # bad input: one line, exit 2
        print(f"eval_kv.py: error: {e}", file=sys.stderr)
        sys.exit(2)
