"""llmrs-compile: a Hugging Face Llama folder or a GGUF file -> one plan file. A translation only:
its flags are CompileOptions' fields (compiler/pipeline.py, one flag each by the same name), and
compile_plan (compiler/build.py) does the work."""
from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from ..cliutil import OneLineParser, Progress, add_option_flags, error_line, options_from
from ..models.config import ModelError
from ..models.llama import input_files
from .build import compile_plan
from .ir import IRError
from .outputs import check_output_dir, check_output_file
from .pipeline import RULES, CompileOptions
from .plan import PlanWriteError

EPILOG = """examples:
  llmrs-compile model/ -o plan.bin                       q4_0 weights, CPU + OpenCL code
  llmrs-compile model.gguf -o plan.bin                   the GGUF's own weight formats (native)
  llmrs-compile model/ -o plan.bin --weights q8_0 --lm-head f16 --kv-type f16
  llmrs-compile model/ -o plan.bin --kv-type q4_0        a KV cache of 18 bytes per 32 values
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
    add_option_flags(ap, CompileOptions)
    ap.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parser().parse_args(argv)

    def notice(line: str) -> None:
        print(f"llmrs-compile: notice: {line}", file=sys.stderr)

    try:
        options = options_from(args, CompileOptions).check()
        check_output_file(args.output, "-o", input_files(args.model_dir))   # named by the flag, before any work
        if options.dump_ir is not None:
            check_output_dir(options.dump_ir, "--dump-ir")
        bar = Progress("weights", 1, enabled=None if not args.quiet else False)

        def progress(name: str, i: int, n: int) -> None:
            bar.total = max(n, 1)
            bar.update(i + 1, name)

        made = compile_plan(args.model_dir, args.output, options, notice=notice, progress=progress,
                            command="llmrs-compile " + shlex.join(argv))
        bar.close()
        print(made.summary)
    except (ModelError, IRError, PlanWriteError, ValueError, OSError) as e:
        print(f"llmrs-compile: error: {error_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("llmrs-compile: interrupted; no plan written", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
