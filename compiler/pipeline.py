"""The compiler as one list of passes: a model (folder or GGUF) -> the plan's graphs ready for codegen.

    verify ▸ quantize ▸ fold ▸ fuse ▸ schedule ▸ plan_memory

Every pass is Graph -> Graph; each runs on every phase (prefill, decode, and the step graph that
serves many sequences at once, models/step.py), and the graph is checked after each so a broken
rewrite is reported under the pass that made it.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Callable

from ..models.llama import LlamaModel, build_graphs, load_model
from ..models.step import step_graph
from ..options import OptionError, option, whole
from .outputs import write_output
from .ir import QK, Graph, IRError
from .passes.fold import fold
from .passes.fuse import RULE_NAMES, check_rule_names, fuse
from .passes.plan_memory import plan_memory
from .passes.quantize import NATIVE, NATIVE_FALLBACK, WEIGHT_DTYPES, Conversion, quantize
from .passes.schedule import schedule
from .passes.verify import verify

RULES = RULE_NAMES  # fusion rules, each switchable by name
KV_TYPES = ("f32", "f16", "q8_0", "q4_0")


WEIGHT_CHOICES = WEIGHT_DTYPES + (NATIVE,)
TARGETS = ("cpu", "opencl")
MAX_POSITIONS = (1 << 31) - 1   # token positions are int32 in every kernel


def parse_targets(text: str) -> tuple[str, ...]:
    """"cpu,opencl" -> ("cpu", "opencl"): --target's text, or the API's string."""
    return tuple(t.strip() for t in text.split(",") if t.strip())


def _as_tuple(value: Any) -> Any:
    return (value,) if isinstance(value, str) else tuple(value) if isinstance(value, (list, tuple)) else value


@dataclass(frozen=True)
class CompileOptions:
    """How to compile a model: llmrs-compile's flags and llmrs.compile()'s keywords, by one name
    each (`lm_head` <-> `--lm-head`); compile_plan (compiler/build.py) and the passes read them."""
    weights: str | None = option(
        None, "matmul weight format; 'native' keeps each tensor's stored format where llmrs has it (Q4_0 Q4_1 "
        f"Q8_0 F16 BF16 F32, bytes unchanged) and makes others (K-quants) {NATIVE_FALLBACK}. Default: native "
        "for a .gguf file, q4_0 for a folder", choices=WEIGHT_CHOICES, type=str)
    embedding: str | None = option(None, "token embedding format (default: --weights)", choices=WEIGHT_CHOICES,
                                   type=str)
    lm_head: str | None = option(None, "output head format (default: --weights)", choices=WEIGHT_CHOICES, type=str)
    kv_type: str = option("f16", "KV cache format: q8_0 and q4_0 take 34 and 18 bytes per 32 values (head_dim "
                          "a multiple of 32) (default f16)", choices=KV_TYPES)
    max_seq_len: int | None = option(2048, "KV cache length in tokens (default 2048)", metavar="N", type=int)
    prefill_chunk: int = option(512, "most tokens a prefill step takes: the prefill and step graphs' rows (a "
                                "step may run fewer; the CPU feeds at most 128; default 512, llama.cpp's "
                                "ubatch)", metavar="T")
    max_num_seqs: int = option(8, "sequences one step of the plan's step graph serves (continuous batching; "
                               "at most --prefill-chunk, the rows of a step); 0 leaves the step graph out "
                               "(default 8)", metavar="N")
    max_draft_tokens: int = option(8, "drafted tokens one speculative verify step checks (llmrs-run "
                                   "--speculative): the step graph returns logits for this many + 1 rows "
                                   "(default 8)", metavar="K")
    block_size: int | None = option(None, "KV-cache block in tokens, the step graph's unit of paged attention; "
                                    "must divide --max-seq-len (default: 16, or the largest power of 2 below 16 "
                                    "that divides it)", metavar="TOKENS", type=int)
    target: tuple[str, ...] = option(TARGETS, "back ends to generate code for: cpu, opencl or both, "
                                     "comma-separated (default both)", metavar="TARGETS", type=parse_targets)
    triple: tuple[str, ...] = option((), "LLVM target triple for prebuilt CPU code, repeatable (default: this "
                                     "host), e.g. aarch64-linux-android", metavar="TRIPLE", repeat=True)
    no_fuse: tuple[str, ...] = option((), "switch a fusion rule off (repeatable)", metavar="RULE", repeat=True)
    dump_ir: Path | None = option(None, "write each graph after every pass into DIR", metavar="DIR", type=Path)
    # told of every weight converted from a format llmrs has no kernels for, as its data is made
    on_convert: Callable[[Conversion], None] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        # the API's spellings: target="cpu,opencl", triple="aarch64-linux-android", no_fuse=[...], dump_ir="ir/"
        if isinstance(self.target, str):
            object.__setattr__(self, "target", parse_targets(self.target))
        for name in ("target", "triple", "no_fuse"):
            object.__setattr__(self, name, _as_tuple(getattr(self, name)))
        if isinstance(self.dump_ir, str):
            object.__setattr__(self, "dump_ir", Path(self.dump_ir))

    def check(self) -> "CompileOptions":
        """Raises OptionError naming the first bad option."""
        for name in ("weights", "embedding", "lm_head"):
            dt = getattr(self, name)
            if dt is not None and dt not in WEIGHT_CHOICES:
                raise OptionError(f"{{0}} {dt!r}: choose one of {', '.join(WEIGHT_CHOICES)}", name)
        if self.kv_type not in KV_TYPES:
            raise OptionError(f"{{0}} {self.kv_type!r}: choose one of {', '.join(KV_TYPES)}", "kv_type")
        for name in ("max_seq_len", "prefill_chunk", "block_size"):
            value = getattr(self, name)
            if value is None and name != "prefill_chunk":
                continue
            if not whole(value) or not 1 <= value <= MAX_POSITIONS:
                raise OptionError(f"{{0}} must be a whole number from 1 to {MAX_POSITIONS} (positions are 32-bit), "
                                  f"got {value!r}", name)
        if not whole(self.max_draft_tokens) or not 0 <= self.max_draft_tokens <= MAX_POSITIONS:
            raise OptionError(f"{{0}} must be a whole number >= 0, got {self.max_draft_tokens!r}", "max_draft_tokens")
        if not whole(self.max_num_seqs) or not 0 <= self.max_num_seqs <= MAX_POSITIONS:
            raise OptionError(f"{{0}} must be a whole number from 0 (no step graph) to {MAX_POSITIONS}, "
                              f"got {self.max_num_seqs!r}", "max_num_seqs")
        bad = [t for t in self.target if t not in TARGETS]
        if bad or not self.target or not all(isinstance(t, str) for t in self.target):
            raise OptionError(f"{{0}} {','.join(map(str, self.target))!r}: choose from {', '.join(TARGETS)} "
                              "(comma-separated)", "target")
        if not all(isinstance(t, str) and t for t in self.triple):
            raise OptionError(f"{{0}} must be target triples, got {list(self.triple)!r}", "triple")
        check_rule_names(self.no_fuse)
        return self

    def to_json(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "on_convert"}
        for name in ("target", "triple", "no_fuse"):
            d[name] = list(d[name])
        d["dump_ir"] = str(self.dump_ir) if self.dump_ir is not None else None
        return d


Pass = Callable[[Graph, CompileOptions], Graph]

PASSES: list[tuple[str, Pass]] = [
    ("verify", lambda g, o: verify(g)),
    ("quantize", lambda g, o: quantize(g, o.weights or "q4_0", o.embedding, o.lm_head, o.on_convert)),  # None: a folder's default
    ("fold", lambda g, o: fold(g)),
    ("fuse", lambda g, o: fuse(g, o.no_fuse)),
    ("schedule", lambda g, o: schedule(g)),
    ("plan_memory", lambda g, o: plan_memory(g)),
]


def _dump(opts: CompileOptions, g: Graph, step: int, label: str) -> None:
    if opts.dump_ir is not None:
        path = Path(opts.dump_ir)
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
    graphs = compile_phases(model, replace(opts, max_num_seqs=0))
    return graphs["prefill"], graphs["decode"]


DEFAULT_BLOCK = 16
VERIFY = "verify"       # the OpenCL verify graph's name (runtime/speculative)
# OpenCL's prefill graph for prompts (and a long prompt's tail) of up to SHORT_CHUNK tokens, where
# --prefill-chunk is larger: its matmuls are tiled for its own few rows. H200, one process: a 32-
# or 128-token prompt ran 13-17 % faster on a 1B f16 plan of 128-token chunks than of 512 (q4_0
# and SmolLM2 1-2 %), and 512 tokens 2.2-3.6x slower (BENCHMARKS.md round 21)
PREFILL_SHORT = "prefill_short"
SHORT_CHUNK = 128
OPENCL_ONLY = (VERIFY, PREFILL_SHORT)   # graphs only the OpenCL code holds


def _block_size(opts: CompileOptions, slots: int) -> int:
    """opts.block_size, which must divide the cache; by default DEFAULT_BLOCK, or the largest power
    of 2 below it dividing the cache (a 40-token cache: 8), so no cache length needs the option."""
    if opts.block_size is None:
        return next(b for b in (16, 8, 4, 2, 1) if b <= DEFAULT_BLOCK and slots % b == 0)
    if slots % opts.block_size:
        raise OptionError(f"{{0}} {opts.block_size} does not divide the KV cache's {slots} slots ({{1}}); give "
                          f"{{1}} a multiple of {opts.block_size}, another {{0}}, or {{2}} 0 for a plan without "
                          "a step graph", "block_size", "max_seq_len", "max_num_seqs")
    return opts.block_size


def check_kv_head_dim(kv_type: str, head_dim: int) -> None:
    """A q8_0 / q4_0 cache stores each head's row as whole 32-value blocks: IRError otherwise."""
    if kv_type in ("q8_0", "q4_0") and head_dim % QK:
        raise IRError(f"--kv-type {kv_type} stores each head's row in {QK}-value blocks, but head_dim is "
                      f"{head_dim}; use --kv-type f16")


def compile_phases(model: LlamaModel | str | Path, opts: CompileOptions = CompileOptions()) -> dict[str, Graph]:
    """The plan's graphs after every pass: prefill, decode and, unless opts.max_num_seqs is 0, the
    step graph (for up to min(max_num_seqs, prefill_chunk) sequences a step, made from the built
    prefill graph); for OpenCL, the verify graph and a short prefill graph (PREFILL_SHORT). All of
    them share one KV-cache layout."""
    opts.check()
    if not isinstance(model, LlamaModel):
        model = load_model(model)
    check_kv_head_dim(opts.kv_type, model.config.head_dim)
    prefill, decode = build_graphs(model, opts.prefill_chunk, opts.max_seq_len, opts.kv_type)
    built = {"prefill": prefill, "decode": decode}
    if "opencl" in opts.target and opts.prefill_chunk > SHORT_CHUNK:
        short, _ = build_graphs(model, SHORT_CHUNK, opts.max_seq_len, opts.kv_type)
        short.name = PREFILL_SHORT
        built[PREFILL_SHORT] = short
    if opts.max_num_seqs:
        built["step"] = step_graph(prefill, min(opts.max_num_seqs, prefill.T), _block_size(opts, prefill.kv_slots),
                                   logit_rows=opts.max_draft_tokens + 1)
        if opts.max_draft_tokens and "opencl" in opts.target:
            # OpenCL's speculative verify step: the prefill graph for K + 1 rows, every row through
            # the head, lowered to decode's kernels (codegen/opencl.py VERIFY), so each row sums as a
            # decode step does; the CPU verifies through the step graph, whose rows already do
            verify, _ = build_graphs(model, opts.max_draft_tokens + 1, opts.max_seq_len, opts.kv_type)
            verify.name = VERIFY
            built[VERIFY] = verify
    no_slice = replace(opts, no_fuse=tuple(opts.no_fuse) + ("last_token_logits",))
    graphs = {name: run_passes(g, no_slice if name == VERIFY else opts) for name, g in built.items()}
    kv = {name: g.meta.get("layout", {}).get("kv") for name, g in graphs.items()}
    for name, layout in kv.items():
        if layout != kv["decode"]:
            raise IRError(f"plan_memory gave {name} and decode different KV-cache offsets; they must share one "
                          "KV region")
    return graphs
