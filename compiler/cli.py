"""llmrs-compile: a Hugging Face Llama folder or a GGUF file -> one plan file."""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path

from ..models.config import LlamaConfig, ModelError
from ..models.llama import input_files, load_model
from .ir import IRError
from .passes.quantize import NATIVE_FALLBACK, Conversion
from .pipeline import RULES, CompileOptions, compile_graphs
from .plan import PlanWriteError, write_graph_plan
from .cliutil import OneLineParser, Progress, check_output_dir, check_output_file
from .summary import fmt_bytes, summarize

WEIGHT_TYPES = ("q4_0", "q4_1", "q8_0", "f16", "f32", "native")
TARGETS = ("cpu", "opencl")

EPILOG = """examples:
  llmrs-compile model/ -o plan.bin                       q4_0 weights, CPU + OpenCL code
  llmrs-compile model.gguf -o plan.bin                   the GGUF's own weight formats (native)
  llmrs-compile model/ -o plan.bin --weights q8_0 --lm-head f16 --kv-type f16
  llmrs-compile model/ -o plan.bin --no-fuse norm_prologue --dump-ir ir/   measure one fusion

fusion rules (--no-fuse): {rules}
"""


def parser() -> argparse.ArgumentParser:
    ap = OneLineParser(
        prog="llmrs-compile", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Compile a Llama model, a Hugging Face folder (config.json, *.safetensors, tokenizer.json) "
                    "or a GGUF file (llama.cpp's format), into one plan file: fused op graphs, a static "
                    "activation arena, kernels and weights.",
        epilog=EPILOG.format(rules=", ".join(RULES)))
    ap.add_argument("model_dir", type=Path, metavar="MODEL", help="Hugging Face model folder or .gguf file")
    ap.add_argument("-o", "--output", type=Path, required=True, help="plan file to write")
    ap.add_argument("--weights", choices=WEIGHT_TYPES, default=None,
                    help="matmul weight format; 'native' keeps each tensor's stored format where llmrs has it "
                         "(Q4_0 Q4_1 Q8_0 F16 BF16 F32, bytes unchanged) and makes others (K-quants) "
                         f"{NATIVE_FALLBACK}. Default: native for a .gguf file, q4_0 for a folder")
    ap.add_argument("--embedding", choices=WEIGHT_TYPES, help="token embedding format (default: --weights)")
    ap.add_argument("--lm-head", choices=WEIGHT_TYPES, help="output head format (default: --weights)")
    ap.add_argument("--kv-type", choices=("f32", "f16", "q8_0"), default="f16", help="KV cache format (default f16)")
    ap.add_argument("--max-seq-len", type=int, default=2048, metavar="N", help="KV cache length in tokens (default 2048)")
    ap.add_argument("--prefill-chunk", type=int, default=128, metavar="T", help="tokens per prefill step (default 128)")
    ap.add_argument("--target", default="cpu,opencl", help="back ends to generate code for: cpu, opencl or both (default)")
    ap.add_argument("--triple", action="append", default=None, metavar="TRIPLE",
                    help="LLVM target triple for prebuilt CPU code, repeatable (default: this host), "
                         "e.g. aarch64-linux-android")
    ap.add_argument("--no-fuse", action="append", default=[], metavar="RULE", help="switch a fusion rule off (repeatable)")
    ap.add_argument("--dump-ir", type=Path, metavar="DIR", help="write each graph after every pass into DIR")
    ap.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    return ap


def _targets(text: str) -> tuple[str, ...]:
    targets = tuple(t.strip() for t in text.split(",") if t.strip())
    bad = [t for t in targets if t not in TARGETS]
    if bad or not targets:
        raise ValueError(f"--target {text!r}: choose from {', '.join(TARGETS)} (comma-separated)")
    return targets


TARGET_LABELS = {"cpu": "CPU", "opencl": "OpenCL"}


def _cpu_sections(graphs, triples: list[str] | None) -> dict[str, bytes | str]:
    from .codegen import llvm
    from .codegen.llvm_target import host_target, parse_target
    sections: dict[str, bytes | str] = {}
    for target in [parse_target(t) for t in triples] if triples else [host_target()]:
        ir_text, obj = llvm.generate(graphs, target)
        sections.setdefault("llvm-ir", ir_text)  # the first target's IR, for JIT fallback
        sections[f"llvm.{target.triple}"] = obj
    return sections


def _opencl_sections(graphs, triples: list[str] | None) -> dict[str, bytes | str]:
    from .codegen import opencl
    return {"opencl": json.dumps(opencl.generate(graphs))}


def _code_sections(graphs, targets: tuple[str, ...],
                   triples: list[str] | None) -> tuple[dict[str, bytes | str], dict[str, str]]:
    """(sections, {target: why it was left out}). A back end whose kernels cannot serve the
    model (a CodegenError) is left out while another one can, so the plan still runs there."""
    from .codegen.llvm_kernels import CodegenError as CpuCodegenError
    from .codegen.opencl import CodegenError as OpenCLCodegenError
    make = {"cpu": _cpu_sections, "opencl": _opencl_sections}
    sections: dict[str, bytes | str] = {}
    left_out: dict[str, str] = {}
    errors: list[Exception] = []
    for target in targets:
        try:
            sections.update(make[target](graphs, triples))
        except (CpuCodegenError, OpenCLCodegenError) as e:
            left_out[target] = str(e)
            errors.append(e)
    if len(left_out) == len(targets):
        raise errors[0]
    return sections, left_out


def left_out_notice(target: str, why: str, kept: list[str]) -> str:
    return f"llmrs-compile: notice: no {TARGET_LABELS[target]} code: {why}; the plan runs on {', '.join(kept)}"


def _conversion_notices(conversions: dict[str, Conversion]) -> list[str]:
    """One line per (stored format, new dtype): which tensors, and the worst measured error."""
    if not conversions:
        return []
    from ..models.gguf_io import gguf_name  # only GGUF files hold formats llmrs converts

    groups: dict[tuple[str, str], list[Conversion]] = {}
    for c in conversions.values():
        groups.setdefault((c.source, c.dtype), []).append(c)
    lines = []
    for (source, dtype), cs in sorted(groups.items()):
        names = [gguf_name(c.tensor) for c in cs]
        shown = ", ".join(names if len(names) <= 4 else names[:3] + [f"and {len(names) - 3} more"])
        worst = max(cs, key=lambda c: c.max_rel_err)
        lines.append(f"{len(cs)} {source} tensor{'s' * (len(cs) > 1)} converted to {dtype} (llmrs has no "
                     f"{source} kernels): {shown}; max relative error {worst.max_rel_err:.2e} "
                     f"({gguf_name(worst.tensor)})")
    return lines


MAX_POSITIONS = (1 << 31) - 1   # token positions are int32 in every kernel


def physical_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):   # not every system says
        return None


def check_kv_memory(cfg: LlamaConfig, max_seq_len: int, kv_type: str) -> None:
    """Refuse a KV cache larger than this machine's memory, before compiling: its run would only
    end in an allocation error."""
    from .ir import nbytes

    per_token = cfg.num_hidden_layers * (2 * nbytes((1, cfg.num_key_value_heads, cfg.head_dim), kv_type)
                                         + 4 * cfg.num_key_value_heads)   # K, V, eviction scores
    memory = physical_memory()
    if memory and per_token * max_seq_len > memory:
        raise ValueError(f"--max-seq-len {max_seq_len}: the KV cache would take {fmt_bytes(per_token * max_seq_len)}, "
                         f"more than this machine's {fmt_bytes(memory)} of memory; at most {memory // per_token} "
                         "tokens fit (give a smaller --max-seq-len)")


def compile_model(args: argparse.Namespace, argv: list[str]) -> str:
    t0 = time.perf_counter()
    model = load_model(args.model_dir)
    check_kv_memory(model.config, args.max_seq_len, args.kv_type)
    for note in model.notices:
        print(f"llmrs-compile: notice: {note}", file=sys.stderr)
    conversions: dict[str, Conversion] = {}
    weights = args.weights or ("q4_0" if model.path.is_dir() else "native")
    opts = CompileOptions(weights=weights, embedding=args.embedding, lm_head=args.lm_head,
                          kv_type=args.kv_type, max_seq_len=args.max_seq_len,
                          prefill_chunk=args.prefill_chunk, disabled_rules=tuple(args.no_fuse),
                          dump_ir_dir=args.dump_ir, on_convert=lambda c: conversions.__setitem__(c.tensor, c))
    prefill, decode = compile_graphs(model, opts)
    graphs = {"prefill": prefill, "decode": decode}
    targets = _targets(args.target)
    sections, left_out = _code_sections(graphs, targets, args.triple)
    kept = [t for t in targets if t not in left_out]
    for target, why in left_out.items():
        print(left_out_notice(target, why, kept), file=sys.stderr)
    if model.tokenizer_json is not None:
        sections["tokenizer.json"] = model.tokenizer_json
    cfg = model.config
    manifest = {
        "model": cfg.to_json(),
        "compile_options": {**opts.to_json(), "targets": kept, "left_out": left_out},
        "compile_command": "llmrs-compile " + shlex.join(argv),
        "stop_ids": list(cfg.eos_token_ids),
        "bos_id": cfg.bos_token_id,
        "chat_template": model.chat_template,
        "bos_token": model.bos_token,
        "eos_token": model.eos_token,
        "prefill_chunk": args.prefill_chunk,
        "max_seq_len": args.max_seq_len,
    }
    n_tensors = len({n for g in graphs.values() for n in g.by_kind("param") + g.by_kind("const")})
    bar = Progress("weights", n_tensors, enabled=None if not args.quiet else False)
    info = write_graph_plan(args.output, graphs, manifest, sections,
                            progress=lambda name, i, n: bar.update(i + 1, name), reads=input_files(args.model_dir))
    bar.close()
    for line in _conversion_notices(conversions):
        print(f"llmrs-compile: notice: {line}", file=sys.stderr)
    return summarize(cfg, graphs, info, time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parser().parse_args(argv)
    try:
        if args.max_seq_len < 1 or args.prefill_chunk < 1:
            raise ValueError("--max-seq-len and --prefill-chunk must be positive")
        if args.max_seq_len > MAX_POSITIONS or args.prefill_chunk > MAX_POSITIONS:
            raise ValueError(f"--max-seq-len and --prefill-chunk must be at most {MAX_POSITIONS} (positions are 32-bit)")
        check_output_file(args.output, "-o", input_files(args.model_dir))   # before minutes of compiling
        if args.dump_ir:
            check_output_dir(args.dump_ir, "--dump-ir")
        print(compile_model(args, argv))
    except (ModelError, IRError, PlanWriteError, ValueError, OSError) as e:
        print(f"llmrs-compile: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("llmrs-compile: interrupted; no plan written", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
