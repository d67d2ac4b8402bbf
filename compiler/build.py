"""compile_plan: a model (a Hugging Face folder or a GGUF file) -> one plan file. The library call
behind llmrs-compile, llmrs.compile() and the built-in model: each of those only maps its inputs to
CompileOptions (compiler/pipeline.py) and shows the notices and the summary its own way."""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from ..models.config import LlamaConfig
from ..models.llama import input_files, load_model
from ..options import OptionError
from .outputs import check_output_dir, check_output_file
from .passes.quantize import Conversion
from .pipeline import CompileOptions, check_kv_head_dim, compile_phases
from .plan import write_graph_plan
from .summary import fmt_bytes, summarize

TARGET_LABELS = {"cpu": "CPU", "opencl": "OpenCL"}


@dataclass(frozen=True)
class CompiledPlan:
    path: Path
    summary: str                 # what llmrs-compile prints: kernels, arena, KV cache, time
    notices: tuple[str, ...]     # what the user should know (converted weights, a back end left out)


def _cpu_sections(graphs, triples: tuple[str, ...]) -> dict[str, bytes | str]:
    from .codegen import llvm
    from .codegen.llvm_target import host_target, parse_target
    sections: dict[str, bytes | str] = {}
    from .pipeline import OPENCL_ONLY
    graphs = {name: g for name, g in graphs.items() if name not in OPENCL_ONLY}
    for target in [parse_target(t) for t in triples] if triples else [host_target()]:
        ir_text, obj = llvm.generate(graphs, target)
        sections.setdefault("llvm-ir", ir_text)  # the first target's IR, for JIT fallback
        sections[f"llvm.{target.triple}"] = obj
    return sections


def _opencl_sections(graphs, triples: tuple[str, ...]) -> dict[str, bytes | str]:
    from .codegen import opencl
    from .codegen.opencl_tuning import OpenCLTuning, tuning_from_env
    return {"opencl": json.dumps(opencl.generate(graphs, tuning_from_env(OpenCLTuning())))}


def code_sections(graphs, targets: tuple[str, ...],
                  triples: tuple[str, ...]) -> tuple[dict[str, bytes | str], dict[str, str]]:
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
    return f"no {TARGET_LABELS[target]} code: {why}; the plan runs on {', '.join(kept)}"


def conversion_notices(conversions: dict[str, Conversion]) -> list[str]:
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
        raise OptionError(f"{{0}} {max_seq_len}: the KV cache would take {fmt_bytes(per_token * max_seq_len)}, "
                          f"more than this machine's {fmt_bytes(memory)} of memory; at most {memory // per_token} "
                          "tokens fit (give a smaller {0})", "max_seq_len")


def compile_plan(model: str | os.PathLike, out: str | os.PathLike, options: CompileOptions = CompileOptions(), *,
                 notice: Callable[[str], None] = lambda line: None,
                 progress: Callable[[str, int, int], None] | None = None,
                 command: str | None = None) -> CompiledPlan:
    """Compile `model` into the plan file `out` (written whole or not at all; never over a device,
    a pipe or one of the model's own files) and return what was made. notice(line) hears each
    notice as it happens; progress(tensor, i, n) each weight as it is written; `command` is how
    the plan was asked for (kept in its manifest). Raises OptionError, ModelError, IRError,
    PlanWriteError or OSError with a one-line message."""
    t0 = time.perf_counter()
    opts = options.check()
    model_path, out = Path(model), Path(out)
    reads = input_files(model_path)
    check_output_file(out, "out", reads)   # before minutes of compiling, not after
    if opts.dump_ir is not None:
        check_output_dir(opts.dump_ir, "dump_ir")
    loaded = load_model(model_path)
    check_kv_head_dim(opts.kv_type, loaded.config.head_dim)   # before the memory check sizes its rows
    if opts.max_seq_len is not None:
        check_kv_memory(loaded.config, opts.max_seq_len, opts.kv_type)
    notices: list[str] = []

    def tell(line: str) -> None:
        notices.append(line)
        notice(line)

    for note in loaded.notices:
        tell(note)
    conversions: dict[str, Conversion] = {}
    opts = replace(opts, weights=opts.weights or ("q4_0" if loaded.path.is_dir() else "native"),
                   on_convert=lambda c: conversions.__setitem__(c.tensor, c))
    graphs = compile_phases(loaded, opts)
    decode = graphs["decode"]
    sections, left_out = code_sections(graphs, opts.target, opts.triple)
    kept = [t for t in opts.target if t not in left_out]
    for target, why in left_out.items():
        tell(left_out_notice(target, why, kept))
    if loaded.tokenizer_json is not None:
        sections["tokenizer.json"] = loaded.tokenizer_json
    cfg = loaded.config
    manifest = {
        "model": cfg.to_json(),
        "compile_options": {**opts.to_json(), "targets": kept, "left_out": left_out},
        "compile_command": command or f"llmrs.compile({str(model_path)!r})",
        "stop_ids": list(cfg.eos_token_ids),
        "bos_id": cfg.bos_token_id,
        "chat_template": loaded.chat_template,
        "bos_token": loaded.bos_token,
        "eos_token": loaded.eos_token,
        "prefill_chunk": opts.prefill_chunk,
        "max_seq_len": decode.meta["max_seq_len"],
    }
    info = write_graph_plan(out, graphs, manifest, sections, progress=progress, reads=reads)
    for line in conversion_notices(conversions):
        tell(line)
    return CompiledPlan(out, summarize(cfg, graphs, info, time.perf_counter() - t0), tuple(notices))


__all__ = ["CompiledPlan", "TARGET_LABELS", "compile_plan"]
