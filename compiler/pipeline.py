"""The compiler as one list of passes: a model (folder or GGUF) -> prefill and decode graphs ready for codegen.

    verify ▸ quantize ▸ fold ▸ fuse ▸ schedule ▸ plan_memory

Every pass is Graph -> Graph; each runs on both phases, and the graph is checked after each so a
broken rewrite is reported under the pass that made it.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable

from ..models.llama import LlamaModel, build_graphs, load_model
from .cliutil import write_output
from .ir import QK, Graph, IRError
from .passes.fold import fold
from .passes.fuse import RULE_NAMES, check_rule_names, fuse
from .passes.plan_memory import plan_memory
from .passes.quantize import NATIVE, WEIGHT_DTYPES, Conversion, quantize
from .passes.schedule import schedule
from .passes.verify import verify

RULES = RULE_NAMES  # fusion rules, each switchable by name
KV_TYPES = ("f32", "f16", "q8_0")


@dataclass(frozen=True)
class CompileOptions:
    weights: str = "q4_0"                  # matmul weights: q4_0 | q4_1 | q8_0 | f16 | f32 | native
    embedding: str | None = None           # token embedding table; None: as weights
    lm_head: str | None = None             # output head; None: as weights
    kv_type: str = "f16"                   # KV cache: f32 | f16 | q8_0
    max_seq_len: int | None = None         # KV cache slots; None: the model's, at most 2048
    prefill_chunk: int = 128               # T of the prefill graph
    disabled_rules: tuple[str, ...] = ()   # fusion rules switched off
    dump_ir_dir: Path | None = None        # write each graph after every pass here
    # told of every weight converted from a format llmrs has no kernels for, as its data is made
    on_convert: Callable[[Conversion], None] | None = field(default=None, compare=False, repr=False)

    def check(self) -> None:
        for flag, dt in (("--weights", self.weights), ("--embedding", self.embedding), ("--lm-head", self.lm_head)):
            if dt is not None and dt not in WEIGHT_DTYPES + (NATIVE,):
                raise ValueError(f"{flag} {dt!r}: choose one of {', '.join(WEIGHT_DTYPES + (NATIVE,))}")
        if self.kv_type not in KV_TYPES:
            raise ValueError(f"--kv-type {self.kv_type!r}: choose one of {', '.join(KV_TYPES)}")
        check_rule_names(self.disabled_rules)

    def to_json(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "on_convert"}
        d["disabled_rules"] = list(self.disabled_rules)
        d["dump_ir_dir"] = str(self.dump_ir_dir) if self.dump_ir_dir is not None else None
        return d


Pass = Callable[[Graph, CompileOptions], Graph]

PASSES: list[tuple[str, Pass]] = [
    ("verify", lambda g, o: verify(g)),
    ("quantize", lambda g, o: quantize(g, o.weights, o.embedding, o.lm_head, o.on_convert)),
    ("fold", lambda g, o: fold(g)),
    ("fuse", lambda g, o: fuse(g, o.disabled_rules)),
    ("schedule", lambda g, o: schedule(g)),
    ("plan_memory", lambda g, o: plan_memory(g)),
]


def _dump(opts: CompileOptions, g: Graph, step: int, label: str) -> None:
    if opts.dump_ir_dir is not None:
        path = Path(opts.dump_ir_dir)
        path.mkdir(parents=True, exist_ok=True)
        write_output(path / f"{g.name}.{step:02d}-{label}.txt", str(g) + "\n", "--dump-ir")


def run_passes(g: Graph, opts: CompileOptions) -> Graph:
    """Every pass of PASSES on one graph, in order; the built graph is dumped as step 00."""
    _dump(opts, g, 0, "build")
    for step, (name, run) in enumerate(PASSES, 1):
        try:
            g = run(g, opts).verify()
        except IRError as e:
            raise IRError(f"pass {name} on graph {g.name}: {e}") from None
        _dump(opts, g, step, name)
    return g


def compile_graphs(model: LlamaModel | str | Path, opts: CompileOptions = CompileOptions()) -> tuple[Graph, Graph]:
    """(prefill, decode) after every pass; the two phases share the KV-cache layout."""
    opts.check()
    if not isinstance(model, LlamaModel):
        model = load_model(model)
    hd = model.config.head_dim
    if opts.kv_type == "q8_0" and hd % QK:
        raise IRError(f"--kv-type q8_0 stores each head's row in {QK}-value blocks, but head_dim is {hd}; "
                      "use --kv-type f16")
    built = build_graphs(model, opts.prefill_chunk, opts.max_seq_len, opts.kv_type)
    prefill, decode = (run_passes(g, opts) for g in built)
    kv = [g.meta.get("layout", {}).get("kv") for g in (prefill, decode)]
    if kv[0] != kv[1]:
        raise IRError("plan_memory gave prefill and decode different KV-cache offsets; they must share one KV region")
    return prefill, decode
