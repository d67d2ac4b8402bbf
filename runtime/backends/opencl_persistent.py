"""A decode step as one persistent kernel: every launch of the step run by one launch of resident
work-groups, with a grid barrier between the launches.

Why: on NVIDIA's OpenCL driver a decode step is paced by its launches, not by its kernels'
work: a Llama-3.2-1B step is 82 launches and a Qwen3-0.6B step 142, each costing the host 4-11 us
of driver time, while most of the kernels finish sooner (BENCHMARKS.md rounds 15 and 18). Here the
host enqueues one kernel a step.

How. The step's launch list (the kernels codegen chose for the plan, already bound with their
arguments) is turned into one program at load:
- each distinct kernel variant (its template family built with its own -D options) is pasted
  once, its options and every macro it defines undefined after it, and its functions and
  typedefs renamed with a per-variant suffix, so variants of one template live side by side;
- the variant's kernel becomes a plain function of its virtual group id: get_group_id,
  get_num_groups and get_global_id read the ids the dispatcher passes, and its __local arrays
  become slices of one pool in the dispatcher's local memory (a plain function may not declare
  __local variables). A kernel whose groups are smaller than the persistent group runs several
  virtual groups side by side in one group, each on its own named barrier (bar.sync id, n:
  NVIDIA only; elsewhere only barrier-free kernels may be smaller);
- a dispatcher kernel walks a table of launches (variant, grid, arguments as buffer index +
  offset or a scalar), runs each launch's virtual groups in a grid-stride loop, and meets the
  other groups at a grid barrier (an arrival counter in global memory) before the next launch.

A grid barrier needs every group resident at once. The grid is one group per compute unit,
and the build is refused where a group cannot be resident at all (its work-group size or local
memory over the kernel's limits); the spin of each barrier is bounded, and a group that waits
too long sets an abort word that every other group then sees, so a device that runs groups one
after another (or is shared) aborts the step instead of hanging. The back end then reruns the
step launch by launch and stops using the persistent kernel (runtime/backends/opencl.py).

Measured (BENCHMARKS.md round 20, H200): the same bits and tokens as the launches, but 0.75-0.82x
their speed on f16 plans; quantized plans are refused there (the default's 512-thread groups need
<= 128 registers a thread and the kernel takes 255; a 256-thread q4_0 plan faulted). One resident
group per SM runs a launch's virtual groups one after another, each paying its whole latency
chain. So it is off unless asked:

    LLMRS_OPENCL_PERSISTENT=1            decode steps as one persistent kernel where it builds
    LLMRS_OPENCL_PERSISTENT_GROUPS=N     N groups instead of the compute units' resident count
    LLMRS_OPENCL_PERSISTENT_SPIN=N       reads of the arrival counter before a group gives up
    LLMRS_OPENCL_PERSISTENT_OPTS="..."   extra build options (e.g. -cl-nv-verbose)
    LLMRS_OPENCL_PERSISTENT_DUMP=FILE    the generated program's text, to read
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from .opencl_device import OpenCLError, _cl

# kernels the dispatcher can run (their templates' bodies are written as the transformation
# below expects: __local declarations of plain arrays or scalars, no group-size queries other
# than those it redefines)
SUPPORTED = frozenset({"matvec", "attention_decode", "attention_split", "embedding", "argmax_split", "argmax"})
BARRIER_FREE = frozenset({"embedding"})   # may run narrower than the group without named barriers
SPIN_LIMIT = 1 << 22        # reads of the arrival counter before a group gives up (~0.5-2 s on a GPU)
PRIVATE_LIMIT = 2048       # bytes of spilled registers a thread beyond which a build is refused
SYNC_WORDS = 4              # [arrivals, exits, abort, spare] int32

_FUNC = re.compile(r"^inline\s+(?:[\w\*]+\s+)*?\**\s*(\w+)\s*\(", re.M)
_KERNEL_NAME = re.compile(r"^(?:__kernel\s+)?void\s+(\w+)\s*\(", re.M)
_TYPEDEF = re.compile(r"^typedef\s+[^;]*?(\w+)\s*;", re.M)
_MACRO = re.compile(r"^\s*#\s*define\s+(\w+)", re.M)
_LOCAL_DECL = re.compile(r"^(\s*)__local\s+((?:const\s+)?\w+)\s+([^;=]+);", re.M)


class PersistentError(OpenCLError):
    """The launch list cannot run as one persistent kernel here (the caller keeps launching)."""


def _option_defines(options: list[str]) -> tuple[list[str], list[str]]:
    """-DNAME[=VALUE] options as #define lines, and the names they define."""
    lines, names = [], []
    for o in options:
        if not o.startswith("-D"):
            continue
        name, _, value = o[2:].partition("=")
        lines.append(f"#define {name} {value if value else '1'}")
        names.append(name)
    return lines, names


def _body_span(text: str, start: int) -> tuple[int, int]:
    """(index of the '{' opening the function whose signature starts at `start`, index just past
    its matching '}'), comments skipped."""
    i, depth, open_at = start, 0, -1
    while i < len(text):
        if text.startswith("//", i):
            i = text.index("\n", i)
            continue
        if text.startswith("/*", i):
            i = text.index("*/", i) + 2
            continue
        c = text[i]
        if c == "{":
            depth += 1
            if open_at < 0:
                open_at = i
        elif c == "}":
            depth -= 1
            if depth == 0 and open_at >= 0:
                return open_at, i + 1
        i += 1
    raise PersistentError("persistent decode: a kernel body has unbalanced braces")


def _split_declarators(decl: str) -> list[str]:
    """'a[N], b[M * 2], c' -> ['a[N]', 'b[M * 2]', 'c'] (commas inside brackets kept)."""
    parts, depth, cur = [], 0, ""
    for c in decl:
        if c in "[(":
            depth += 1
        elif c in "])":
            depth -= 1
        if c == "," and depth == 0:
            parts.append(cur.strip())
            cur = ""
        else:
            cur += c
    parts.append(cur.strip())
    return parts


def _pool_locals(body: str) -> tuple[str, list[str]]:
    """The body's __local arrays and scalars as slices of the pool (pk_cur walks it, 16-byte
    aligned); returns the new body and the scalar names, each #defined as its slice's value."""
    scalars: list[str] = []

    def one(indent: str, typ: str, declarator: str) -> str:
        m = re.fullmatch(r"(\w+)\s*((?:\[[^\]]+\]\s*)*)", declarator)
        if m is None:
            raise PersistentError(f"persistent decode: cannot place __local {typ} {declarator}")
        name, dims = m.group(1), re.findall(r"\[([^\]]+)\]", m.group(2))
        size = " * ".join([f"sizeof({typ})"] + [f"({d})" for d in dims])
        if not dims:
            scalars.append(name)
            return (f"{indent}__local {typ}* pk_s_{name} = (__local {typ}*)pk_cur; pk_cur += PK_A16({size});\n"
                    f"#define {name} (*pk_s_{name})\n")
        inner = "".join(f"[{d}]" for d in dims[1:])
        ptr = f"(*{name}){inner}" if inner else f"*{name}"
        cast = f"(__local {typ} (*){inner})" if inner else f"(__local {typ}*)"
        return f"{indent}__local {typ} {ptr} = {cast}pk_cur; pk_cur += PK_A16({size});\n"

    def repl(m: re.Match) -> str:
        indent, typ, decls = m.group(1), m.group(2), m.group(3)
        return "".join(one(indent.strip("\n"), typ, d) for d in _split_declarators(decls)).rstrip("\n")

    return _LOCAL_DECL.sub(repl, body), scalars


@dataclass(frozen=True)
class Variant:
    """One kernel build of the launch list: its template family's text, options and size."""
    source: str
    options: tuple[str, ...]
    kernel: str
    local: int


def variant_source(v: Variant, tag: str, group: int, named_barriers: bool) -> tuple[str, str]:
    """The variant's text renamed by `tag` with its kernel as a device function
    pk_<tag>(pool, g0, g1, n0, n1, <the kernel's own arguments>); (text, function name)."""
    text = v.source
    kernels = list(_KERNEL_NAME.finditer(text))
    target = next((m for m in kernels if m.group(1) == v.kernel), None)
    if target is None:
        raise PersistentError(f"persistent decode: kernel {v.kernel} is not in its template")
    # the kernel's head ("__kernel [attribute]" on the line before its "void name(")
    head = target.start() if text.startswith("__kernel", target.start()) else text.rfind("__kernel", 0, target.start())
    if head < 0 or text[head:target.start()].count("\n") > 1:
        raise PersistentError(f"persistent decode: kernel {v.kernel} has no __kernel head")
    open_at, close_at = _body_span(text, target.start())
    body, scalars = _pool_locals(text[open_at + 1:close_at - 1])
    fn = f"pk_{tag}"
    signature = text[target.end():open_at]   # the kernel's own parameters, then ") "
    ids = ["#define get_group_id(d) ((d) ? pk_g1 : pk_g0)",    # only in the function: the text's other
           "#define get_num_groups(d) ((d) ? pk_n1 : pk_n0)",  # kernels stay kernels
           f"#define get_global_id(d) ((d) ? (size_t)pk_g1 : (size_t)pk_g0 * {v.local} + get_local_id(0))"]
    new = ("\n".join(ids) +
           f"\nPK_NOINLINE void {fn}(__local uchar* pk_pool, int pk_g0, int pk_g1, int pk_n0, int pk_n1, {signature}{{\n"
           f"    __local uchar* pk_cur = pk_pool;\n{body}\n}}\n"
           + "".join(f"#undef {s}\n" for s in scalars + ["get_group_id", "get_num_groups", "get_global_id"]))
    text = text[:head] + new + text[close_at:]

    names = set(_FUNC.findall(text)) | set(_TYPEDEF.findall(text)) | {m.group(1) for m in kernels if m.group(1) != v.kernel}
    macros = set(_MACRO.findall(v.source))
    opt_lines, opt_names = _option_defines(list(v.options))
    narrow = v.local < group
    lines = [f"// ---- variant {tag}: {v.kernel} {' '.join(v.options)}", *opt_lines]
    # a prefix, not a suffix: a name pasted from parts (CAT(CAT(ld_, T), _split)) is renamed
    # whichever part the paste expands first
    lines += [f"#define {n} {tag}_{n}" for n in sorted(names)]
    if narrow:   # several virtual groups a group: ids and sizes within the slice of the group
        lines += [f"#define get_local_id(d) ((d) ? 0 : (get_local_id(0) & {v.local - 1}))",
                  f"#define get_local_size(d) ((d) ? 1 : {v.local})"]
        if named_barriers:
            lines.append(f"#define barrier(f) pk_named_barrier({v.local})")
    lines.append(text)
    redefined = ["get_local_id", "get_local_size", "barrier"]
    lines += [f"#undef {n}" for n in sorted(macros | set(opt_names) | names) + redefined]
    return "\n".join(lines) + "\n", fn


def _arg_words(args: list[Any], index: dict[int, int] | None = None) -> list[tuple[str, list[int]]]:
    """A bound kernel's argument list (as set_args took it) as (kind, int32 words of its table
    record): "b" a buffer (its place among the dispatcher's buffers in `index`), "o" a byte offset
    (two words), "i" an int32, "f" a float32's bits."""
    cl = _cl()
    out = []
    for a in args:
        if isinstance(a, cl.MemoryObjectHolder):
            out.append(("b", [index[a.int_ptr] if index is not None else 0]))
        elif isinstance(a, np.uint64):
            out.append(("o", np.array([a], np.uint64).view(np.int32).tolist()))
        elif isinstance(a, np.int32):
            out.append(("i", [int(a)]))
        elif isinstance(a, np.float32):
            out.append(("f", np.array([a], np.float32).view(np.int32).tolist()))
        else:
            raise PersistentError(f"persistent decode: argument {a!r} has no table form")
    return out


_PRELUDE = r"""
#define PK_A16(n) (((n) + 15) & ~(size_t)15)
#ifdef USE_NV_PTX
// each variant a function of its own: its registers are its own (inlined, the dispatcher took the
// union of them all: 255 registers and spills on the H200), so more groups stay resident
#define PK_NOINLINE __attribute__((noinline))
#else
#define PK_NOINLINE
#endif
#ifdef USE_NV_PTX
inline void pk_named_barrier(int n) {
    // bar.sync id, n: the n threads of this virtual group meet on their own barrier (id 0 is the
    // whole group's); bar.sync orders shared memory as barrier() does
    int id = 1 + (int)(get_local_id(0) / n);
    asm volatile("bar.sync %0, %1;" : : "r"(id), "r"(n));
}
inline void pk_fence(void) { asm volatile("membar.gl;"); }
#define PK_ARRIVED(p) (*(p))               // a volatile load: L2's value, not a stale L1 line
#define PK_ITER_BARRIER
#else
#define PK_ARRIVED(p) atomic_add(p, 0)
// a barrier between a group's virtual groups: without it PoCL 5 gave a kernel whose body returns
// early (attention_decode) wrong results in every group but the first (tests/runtime/
// test_opencl_persistent.py, two groups). Only where a virtual group is the whole group: its trip
// count is then the group's, so every thread meets it
#define PK_ITER_BARRIER barrier(CLK_LOCAL_MEM_FENCE);
inline void pk_fence(void) { mem_fence(CLK_GLOBAL_MEM_FENCE); }
#endif
// every group meets here between two launches of the step (`target`: the arrivals once every
// group has finished the launches so far); false: the step was aborted
inline int pk_grid_sync(__global volatile int* sync, int target, int spin_limit, __local int* ok) {
    barrier(CLK_LOCAL_MEM_FENCE | CLK_GLOBAL_MEM_FENCE);
    if (get_local_id(0) == 0) {
        pk_fence();                       // this group's writes before its arrival
        atomic_inc(sync);
        int good = 1;
        for (int spins = 0; PK_ARRIVED(sync) < target; spins++) {
            if (sync[2] || spins > spin_limit) {
                atomic_xchg(sync + 2, 1);   // the others stop at their next wait
                good = 0;
                break;
            }
        }
        pk_fence();                       // the others' writes before this group reads them
        *ok = good;
    }
    barrier(CLK_LOCAL_MEM_FENCE | CLK_GLOBAL_MEM_FENCE);
    return *ok;
}
"""


def call_args(kinds: list[str], n_buffers: int) -> list[str]:
    """A variant's call arguments read from its table record r (words from r[3] on, as
    _arg_words wrote them)."""
    allb = ", ".join(f"pk_b{i}" for i in range(n_buffers))
    args, w = [], 3
    for k in kinds:
        if k == "b":
            args.append(f"pk_buf(r[{w}], {allb})")
            w += 1
        elif k == "o":
            args.append(f"((ulong)(uint)r[{w}] | ((ulong)(uint)r[{w + 1}] << 32))")
            w += 2
        elif k == "i":
            args.append(f"r[{w}]")
            w += 1
        else:
            args.append(f"as_float(r[{w}])")
            w += 1
    # the kernel's first argument is the step buffer (const int*)
    args[0] = f"(__global const int*){args[0]}"
    return args


def buffer_switch(n_buffers: int) -> str:
    """pk_buf(i, buffers...): the dispatcher's i-th buffer."""
    bufs = ", ".join(f"__global uchar* pk_b{i}" for i in range(n_buffers))
    pick = "\n".join(f"        case {i}: return pk_b{i};" for i in range(n_buffers))
    return f"""
inline __global uchar* pk_buf(int i, {bufs}) {{
    switch (i) {{
{pick}
    }}
    return pk_b0;
}}
"""


def program_parts(prelude: str, variants: list[Variant], kinds: list[list[str]], group: int, n_buffers: int,
                  named_barriers: bool) -> tuple[list[str], list[str], int, str]:
    """A dispatcher program's texts before its kernel: the prelude, each variant as a function,
    pk_buf; with the variants' function names, the table's record stride (3 words, then the
    longest argument record) and the kernel's buffer parameters."""
    parts, fns = [prelude], []
    for i, v in enumerate(variants):
        text, fn = variant_source(v, f"v{i}", group, named_barriers)
        parts.append(text)
        fns.append(fn)
    stride = 3 + max(sum({"b": 1, "o": 2, "i": 1, "f": 1}[k] for k in ks) for ks in kinds)
    parts.append(buffer_switch(n_buffers))
    return parts, fns, stride, ", ".join(f"__global uchar* pk_b{i}" for i in range(n_buffers))


def build_source(variants: list[Variant], kinds: list[list[str]], group: int, pool: int, n_buffers: int,
                 named_barriers: bool) -> tuple[str, int]:
    """The whole program text: prelude, variants, dispatcher; and the table's record stride."""
    parts, fns, stride, bufs = program_parts(_PRELUDE, variants, kinds, group, n_buffers, named_barriers)
    cases = []
    for i, (v, ks, fn) in enumerate(zip(variants, kinds, fns)):
        args = call_args(ks, n_buffers)
        per = group // v.local
        cases.append(f"""        case {i}: {{
            int sub = (int)get_local_id(0) / {v.local};
            __local uchar* pool = pk_pool + sub * {pool // per};
            for (int vg = gid * {per} + sub; vg < total; vg += ngroups * {per}) {{
                {fn}(pool, vg % r[1], vg / r[1], r[1], r[2], {", ".join(args)});
                {"PK_ITER_BARRIER" if per == 1 else ""}
            }}
            break;
        }}""")
    parts.append(f"""
// no reqd_work_group_size: the largest group the driver then reports for the kernel is what its
// registers allow, which bounds the groups a compute unit keeps resident
__kernel void pk_step({bufs}, __global const int* pk_table, __global volatile int* pk_sync, int pk_spin) {{
    __local uchar pk_pool[{pool}] __attribute__((aligned(16)));
    __local int pk_ok;
    int gid = get_group_id(0), ngroups = get_num_groups(0), n_ops = pk_table[0];
    if (pk_sync[2]) return;               // an earlier step aborted: the host reruns it
    for (int op = 0; op < n_ops; op++) {{
        __global const int* r = pk_table + 1 + op * {stride};
        int total = r[1] * r[2];
        switch (r[0]) {{
{chr(10).join(cases)}
        }}
        if (op + 1 < n_ops && !pk_grid_sync(pk_sync, (op + 1) * ngroups, pk_spin, &pk_ok)) return;
    }}
    // the last group out resets the counters (every other group has left its last wait)
    if (get_local_id(0) == 0 && atomic_inc(pk_sync + 1) == ngroups - 1) {{
        pk_sync[0] = 0;
        pk_sync[1] = 0;
    }}
}}
""")
    return "\n".join(parts), stride


def _items(launches: list[tuple[Any, tuple[int, int], tuple[int, int]]], bound: dict[int, Any]
           ) -> list[tuple[Any, str, int, int, int]]:
    """(Bound, kernel name, groups along dim 0, groups along dim 1, local size) per launch."""
    items = []
    for kern, gsize, lsize in launches:
        b = bound.get(kern.int_ptr)
        if b is None or not b.family:
            raise PersistentError("persistent decode: a launch has no bound arguments")
        if kern.function_name not in SUPPORTED:
            raise PersistentError(f"persistent decode: kernel {kern.function_name} is not supported")
        if gsize[0] % lsize[0]:
            raise PersistentError("persistent decode: a launch's grid is no whole number of groups")
        items.append((b, kern.function_name, gsize[0] // lsize[0], gsize[1], lsize[0]))
    return items


def _variant_key(b: Any, name: str, local: int) -> tuple[Any, ...]:
    return b.family, b.options, name, local


def gather(items: list[tuple[Any, str, int, int, int]], sources: dict[str, str], device: Any, group: int
           ) -> tuple[list[Any], dict[int, int], dict[tuple[Any, ...], int], list[Variant], list[list[str]], int]:
    """What a dispatcher program of `items` (_items) needs: its buffers (every distinct one the
    launches name) and their index by handle, its variants (index by _variant_key, the list, each
    one's argument kinds), and the local memory pool a group of `group` threads takes (each
    variant's own, times the virtual groups side by side, plus alignment for every declaration)."""
    cl = _cl()
    buffers: list[Any] = []
    index: dict[int, int] = {}
    for b, *_ in items:
        for a in b.args:
            if isinstance(a, cl.MemoryObjectHolder) and a.int_ptr not in index:
                index[a.int_ptr] = len(buffers)
                buffers.append(a)
    variants: dict[tuple[Any, ...], int] = {}
    vlist: list[Variant] = []
    kinds: list[list[str]] = []
    pool = 16
    for b, name, _, _, local in items:
        key = _variant_key(b, name, local)
        if key in variants:
            continue
        variants[key] = len(vlist)
        vlist.append(Variant(sources[b.family], b.options, name, local))
        kinds.append([kind for kind, _ in _arg_words(list(b.args))])
        used = int(b.kernel.get_work_group_info(cl.kernel_work_group_info.LOCAL_MEM_SIZE, device))
        decls = len(_LOCAL_DECL.findall(sources[b.family]))
        pool = max(pool, (group // local) * (-(-(used + 16 * (decls + 1)) // 16) * 16))
    return buffers, index, variants, vlist, kinds, pool


class PersistentProgram:
    """The dispatcher program for every kernel variant of `launches` (a union of the launch
    lists it will run: decode's, with its argmax, with the step-advancing argmax), built once."""

    def __init__(self, ctx: Any, device: Any, launches: list[tuple[Any, tuple[int, int], tuple[int, int]]],
                 bound: dict[int, Any], sources: dict[str, str], device_opts: list[str]):
        from .opencl_program import build_program
        cl = _cl()
        self.ctx, self.device = ctx, device
        items = _items(launches, bound)
        group = max(it[4] for it in items)
        named = "-DUSE_NV_PTX" in device_opts
        for b, name, _, _, local in items:
            if group % local or local & (local - 1):
                raise PersistentError(f"persistent decode: {name}'s {local} threads do not divide {group}")
            if local < group and not named and name not in BARRIER_FREE:
                raise PersistentError(f"persistent decode: {name} runs {local}-thread groups with barriers; "
                                      f"this device has no named barriers to run them inside {group}-thread ones")
        if named and any(o in b.options for b, *_ in items for o in ("-DW_Q4_0", "-DW_Q4_1", "-DW_Q8_0")):
            # a 256-thread q4_0 plan's persistent step faulted on the H200 (OUT_OF_RESOURCES at the
            # next read, in three runs; BENCHMARKS.md round 20) while its f16 ones ran bit-exact:
            # refused until that is understood
            raise PersistentError("persistent decode: quantized matvecs are not run persistently on NVIDIA "
                                  "(they faulted on the H200)")
        self.buffers, self.index, self.variants, vlist, kinds, pool = gather(items, sources, device, group)
        unit = 16 * max(1, group // 32)   # so that every virtual group's slice stays 16-byte aligned
        pool = -(-pool // unit) * unit
        if pool > device.local_mem_size:
            raise PersistentError(f"persistent decode: {pool} B of local memory a group; the device has "
                                  f"{device.local_mem_size}")
        # a GPU's spin is an L2 round trip (~1 us), a CPU's a few ns: about a second either way
        self.spin = int(os.environ.get("LLMRS_OPENCL_PERSISTENT_SPIN", "0") or 0) or (
            SPIN_LIMIT if device.type & cl.device_type.GPU else SPIN_LIMIT << 6)
        source, self.stride = build_source(vlist, kinds, group, pool, len(self.buffers), named)
        if os.environ.get("LLMRS_OPENCL_PERSISTENT_DUMP"):
            with open(os.environ["LLMRS_OPENCL_PERSISTENT_DUMP"], "w") as f:
                f.write(source)
        extra = os.environ.get("LLMRS_OPENCL_PERSISTENT_OPTS", "").split()
        try:
            self.program = build_program(ctx, device, source, list(device_opts) + extra, "persistent decode")
        except OpenCLError as err:
            raise PersistentError(str(err)) from None
        probe = cl.Kernel(self.program, "pk_step")
        wg = int(probe.get_work_group_info(cl.kernel_work_group_info.WORK_GROUP_SIZE, device))
        if wg < group:
            raise PersistentError(f"persistent decode: the kernel takes at most {wg} threads a group here, "
                                  f"not {group}")
        self.group = group
        self.private_bytes = int(probe.get_work_group_info(cl.kernel_work_group_info.PRIVATE_MEM_SIZE, device))
        if self.private_bytes > PRIVATE_LIMIT:
            raise PersistentError(f"persistent decode: the kernel keeps {self.private_bytes} B a thread in private "
                                  f"memory (register spills), over {PRIVATE_LIMIT}")
        # groups a compute unit keeps resident: NVIDIA's largest work-group for the kernel is what
        # its registers allow on one multiprocessor (65536 / registers a thread), so wg // group
        # groups fit by registers; the local memory one group may have bounds them by shared
        # memory; an SM holds 2048 threads. Elsewhere one group a unit.
        nvidia = "NVIDIA" in device.platform.vendor.upper()
        self.per_unit = max(1, min(wg // group, device.local_mem_size // pool, 2048 // group)) if nvidia else 1
        self.registers_bound = wg


class PersistentStep:
    """A launch list run as one launch of `program`'s dispatcher: `launch` is the one
    (kernel, global size, local size) a step enqueues in place of the list; after the step,
    aborted() says whether its groups gave up at a grid barrier."""

    def __init__(self, program: PersistentProgram, queue: Any, launches: list[tuple[Any, tuple[int, int], tuple[int, int]]],
                 bound: dict[int, Any], groups: int | None = None):
        cl = _cl()
        self.queue = queue
        items = _items(launches, bound)
        p = program
        stride = p.stride
        table = np.zeros(1 + stride * len(items), np.int32)
        table[0] = len(items)
        for i, (b, name, g0, g1, local) in enumerate(items):
            if _variant_key(b, name, local) not in p.variants:
                raise PersistentError(f"persistent decode: {name} is not in the built program")
            rec = table[1 + i * stride: 1 + (i + 1) * stride]
            words = [w for _, ws in _arg_words(list(b.args), p.index) for w in ws]
            rec[:3 + len(words)] = [p.variants[_variant_key(b, name, local)], g0, g1, *words]
        mf = cl.mem_flags
        self.table = cl.Buffer(p.ctx, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=table)
        self.sync = cl.Buffer(p.ctx, mf.READ_WRITE, 4 * SYNC_WORDS)
        self.reset_sync()
        self.kernel = cl.Kernel(p.program, "pk_step")
        self.kernel.set_args(*p.buffers, self.table, self.sync, np.int32(p.spin))
        self.groups = groups or p.device.max_compute_units * p.per_unit
        self.launch = (self.kernel, (self.groups * p.group, 1), (p.group, 1))
        self.n_launches = len(items)
        self._status = np.zeros(1, np.int32)

    def reset_sync(self, abort: bool = False) -> None:
        """Zero the counters (abort=True: set the abort word instead, so the next step returns at
        once and reports itself aborted: tests of the fallback)."""
        cl = _cl()
        cl.enqueue_copy(self.queue, self.sync, np.array([0, 0, int(abort), 0], np.int32), is_blocking=True)

    def read_status(self) -> None:
        """Enqueue the read of the abort word (non-blocking: the step's own blocking read that
        follows waits for it)."""
        cl = _cl()
        cl.enqueue_copy(self.queue, self._status, self.sync, src_offset=8, is_blocking=False)

    def aborted(self) -> bool:
        """After a blocking read that followed read_status: whether a step aborted."""
        return bool(self._status[0])
