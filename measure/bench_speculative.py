"""llmrs-bench --speculative lookup|draft: decode tok/s with and without speculative decoding on
each prompt type of measure/spec_prompts.py (greedy; the two models' runs interleaved, medians of
--repeats), with the acceptance rate and tokens per verify step; beside llama.cpp on the same GGUF
and prompts in the same run: llama-lookup (prompt lookup) or llama-speculative (a draft GGUF), and
llama-bench's decode at the same depth as llama.cpp's speed without speculation.

  speedup    llmrs with speculation / llmrs without, decode tok/s (the median of per-repeat ratios)
  accepted   kept drafts / drafted tokens
  per step   tokens a verify step yields (kept drafts + 1)
"""
from __future__ import annotations

import re
import statistics
import subprocess
from typing import Any, Callable

from ..runtime.backends import BackendOptions
from ..runtime.model import Model
from ..runtime.speculative import SpeculativeOptions
from .spec_prompts import PROMPTS


def prompt_ids(model: Model, text: str) -> list[int]:
    if model.chat_template is None:
        return model.tokenize(text)
    return model.tokenize(model.render_chat([{"role": "user", "content": text}]), add_special_tokens=False)


def _one(model: Model, ids: list[int], n: int) -> tuple[float, list[int], Any]:
    c = model.generate(ids, max_tokens=n)
    for _ in c:
        pass
    return c.stats.decode_tok_s, c.tokens, c.stats.speculative


def bench_speculative(plan: str, backend: str, options: BackendOptions, spec: SpeculativeOptions, decode: int,
                      repeats: int, say: Callable[[str], None]
                      ) -> tuple[list[dict[str, Any]], str | None, dict[str, str]]:
    """A row per prompt type, the OpenCL device's name (None on the CPU), and each prompt as the
    model is fed it (chat template applied: what llama.cpp's runs are given)."""
    rows, texts = [], {}
    with Model.open(plan, backend, options) as plain, Model.open(plan, backend, options, spec=spec) as fast:
        device = plain.backend.device_name or None
        for name, text in PROMPTS.items():
            ids = prompt_ids(plain, text)
            texts[name] = plain.detokenize(ids)
            _one(plain, ids, 4)         # warm: page in the weights, fill the caches
            _one(fast, ids, 4)
            base, sped, ratios, stats, same = [], [], [], [], True
            for r in range(repeats):
                say(f"llmrs-bench: {name}, repeat {r + 1}/{repeats}")
                p_tok_s, p_tokens, _ = _one(plain, ids, decode)
                s_tok_s, s_tokens, st = _one(fast, ids, decode)
                base.append(p_tok_s)
                sped.append(s_tok_s)
                ratios.append(s_tok_s / p_tok_s)
                stats.append(st)
                same &= s_tokens == p_tokens
            last = stats[-1]
            rows.append({"prompt": name, "prompt_tokens": len(ids), "tokens": len(p_tokens),
                         "plain_tok_s": round(statistics.median(base), 2),
                         "speculative_tok_s": round(statistics.median(sped), 2),
                         "speedup": round(statistics.median(ratios), 3),
                         "drafted": last.drafted, "accepted": last.accepted,
                         "acceptance_rate": round(last.acceptance, 3),
                         "tokens_per_verify_step": round(last.tokens_per_step, 3),
                         "verify_steps": last.steps, "plain_steps": last.plain, "same_tokens": same})
    return rows, device, texts


# -- llama.cpp ------------------------------------------------------------------------------------

_DECODED = re.compile(r"decoded\s+(\d+)\s+tokens in\s+([\d.]+)\s+seconds, speed:\s+([\d.]+) t/s")
_COUNT = re.compile(r"\b(n_drafted|n_accept)\s*=\s*(\d+)")


def run_llama_spec(binary: str, gguf: str, draft_gguf: str | None, text: str, threads: int, decode: int,
                   k: int, repeats: int, ngl: int | None = None) -> dict[str, Any]:
    """llama-lookup (draft_gguf None) or llama-speculative on one rendered prompt, greedy: its
    decode tok/s (median of repeats), drafted and accepted tokens. ngl: layers on the GPU (both
    models')."""
    gpu = [] if ngl is None else ["-ngl", str(ngl), *(["-ngld", str(ngl)] if draft_gguf else [])]
    cmd = [binary, "-m", gguf, *(["-md", draft_gguf] if draft_gguf else []), "-p", text, "-n", str(decode),
           "-t", str(threads), "--temp", "0", "--spec-draft-n-max", str(k), *gpu]
    speeds, counts = [], {}
    for _ in range(repeats):
        proc = subprocess.run(cmd, capture_output=True, text=True)
        out = proc.stdout + proc.stderr
        m = _DECODED.search(out)
        if proc.returncode != 0 or m is None:
            last = (out.strip().splitlines() or ["(no output)"])[-1]
            raise ValueError(f"{binary} failed: {last}")
        speeds.append(float(m[3]))
        counts = {k_: int(v) for k_, v in _COUNT.findall(out)}
    drafted, accepted = counts.get("n_drafted", 0), counts.get("n_accept", 0)
    return {"command": _shown(cmd),
            "tok_s": round(statistics.median(speeds), 2), "drafted": drafted, "accepted": accepted,
            "acceptance_rate": round(accepted / drafted, 3) if drafted else 0.0}


def _shown(cmd: list[str]) -> str:
    """The command with the prompt elided (it is the rendered prompt of the row)."""
    return " ".join("PROMPT" if i and cmd[i - 1] == "-p" else c for i, c in enumerate(cmd))


def llama_plain_decode(binary: str, gguf: str, threads: int, depth: int, decode: int, repeats: int,
                       ngl: int | None = None) -> float:
    """llama-bench's decode tok/s after `depth` tokens of context: llama.cpp without speculation."""
    import json
    cmd = [binary, "-m", gguf, "-p", "0", "-n", str(decode), "-d", str(depth), "-t", str(threads),
           "-r", str(repeats), "-o", "json", *([] if ngl is None else ["-ngl", str(ngl)])]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise ValueError(f"{binary} failed: {(proc.stderr.strip().splitlines() or ['?'])[-1]}")
    return round(next(r for r in json.loads(proc.stdout) if r["n_gen"] > 0)["avg_ts"], 2)


def report_speculative(rows: list[dict[str, Any]], lcpp: list[dict[str, Any]] | None) -> list[str]:
    head = f"{'prompt':8} {'tokens':>6} {'plain':>9} {'spec':>9} {'speedup':>8} {'accepted':>9} {'per step':>8}"
    if lcpp:
        head += f" | {'llama.cpp':>9} {'spec':>9} {'speedup':>8} {'accepted':>9}"
    lines = [head]
    for i, r in enumerate(rows):
        line = (f"{r['prompt']:8} {r['prompt_tokens']:>6} {r['plain_tok_s']:>9.1f} {r['speculative_tok_s']:>9.1f} "
                f"{r['speedup']:>7.2f}x {100 * r['acceptance_rate']:>8.1f}% {r['tokens_per_verify_step']:>8.2f}"
                + ("" if r["same_tokens"] else "  (tokens differ!)"))
        if lcpp:
            c = lcpp[i]
            line += (f" | {c['plain_tok_s']:>9.1f} {c['tok_s']:>9.1f} {c['tok_s'] / c['plain_tok_s']:>7.2f}x "
                     f"{100 * c['acceptance_rate']:>8.1f}%")
        lines.append(line)
    lines.append("decode tok/s, medians; speedup: with / without speculation")
    return lines


__all__ = ["bench_speculative", "llama_plain_decode", "prompt_ids", "report_speculative", "run_llama_spec"]
