"""Chained launches: a run of dependent decode kernels as one launch, its work-groups ordered by
tickets and synchronised by counters in global memory, so no group waits on one that has not
started.

Why: on NVIDIA's OpenCL driver every launch boundary costs the device about 6 us even when the
host is out of the way (tools/profile_decode_gpu.py: 400 empty kernels queued behind a user event,
then released, ran at 5.4-6.8 us each on the H200), and a decode step is 82 (Llama-3.2-1B) to 142
(Qwen3-0.6B) launches: the boundaries, not the kernels' bytes, set its pace (a Qwen3-0.6B q4_0
step took 855 us on the device, 142 x 6.0). A layer's matvecs (o_proj, gate_up, down, then the
next layer's QKV) are consecutive launches of one work-group size; chained, a layer is two
launches (that chain and the attention) instead of five.

How. The kernels' variants are pasted into one program as the persistent kernel pastes them
(opencl_persistent.py variant_source: each a function of its virtual group id). A chain's grid is
every group of its launches together. A group's first act is to take a ticket (an atomic counter):
tickets map in order onto the launches' groups, so the groups of launch i hold lower tickets than
any of launch i + 1. A group of launch i > 0 waits until launch i - 1's done counter reaches its
group count, runs its virtual group, and adds itself to launch i's counter. A group waits only
on groups with lower tickets, each of which has started (it took its ticket) and waits in turn
only on lower ones: every wait ends with no assumption about how many groups are resident at
once, unlike a grid barrier (the persistent kernel's, which needs them all). Launch i + 1 starts
after launch i has wholly finished, as in the in-order queue, so what one launch reads or writes
is ordered against every other as before: the same bits.

A group takes ticket after ticket until none is left, the next one taken while it works on the
current (its round trip off the critical path), and waits for a launch's predecessor once, at its
first ticket of that launch. So the grid may have any number of groups: one a virtual group (the
default), or fewer (LLMRS_OPENCL_CHAIN_GROUPS=N), each then paying its preamble once for many
virtual groups; a group that holds a ticket it has not started still waits only on lower ones,
so the lowest unfinished ticket can always run.

The watchdog: a wait is bounded (SPIN_LIMIT reads); a group that gives up sets an abort word
shared by the step's chains, every later group sees it and returns, and the back end reruns the
step launch by launch and stops chaining (runtime/backends/opencl.py). A chain's last group out
zeroes its counters for the next step (every other group has taken its last ticket).

Measured (BENCHMARKS.md round 22, H100): the same bits and tokens as the launches everywhere, but
no gain. The 1B f16 plan's 83 launches a step became 35, yet ran 0.57x their speed; as 83 chains
of one launch each (LLMRS_OPENCL_CHAIN_MAX=1: the launch count unchanged) 0.56x, so a chain's
groups themselves are slower, not the chaining: each pays a serial preamble (a ticket's round
trip to L2, the table's reads, a fence) before its first weight load, where a plain launch's
group starts loading at once. Register bounds did not help (-cl-nv-maxrregcount=64 / 96: 1476 /
552 B of spill stores, 0.47x / 0.62x). The q4_0 / q4_1 plans' 512-thread matvecs do not chain: the
driver reports the chain kernel takes at most 256 threads a group even where ptxas gives it 112-128
registers, and launched at 512 anyway it faulted (OUT_OF_RESOURCES at the next read), as the
persistent kernel's 256-thread q4_0 groups did in round 20. So it is off unless asked; what it
needs before it can win is a preamble hidden behind weight loads. The ticket loop above (a group
takes its next ticket during its current one, and fewer groups than tickets pay the preamble
once) was written after those measurements and is checked on PoCL only: the next card run
measures it (`LLMRS_OPENCL_CHAIN_GROUPS=N`, N about the groups the device keeps resident).

    LLMRS_OPENCL_CHAIN=1          chain wherever it builds
    LLMRS_OPENCL_CHAIN_REGS=N     NVIDIA: -cl-nv-maxrregcount=N (default 65536 / group threads)
    LLMRS_OPENCL_CHAIN_MAX=N      at most N launches a chain (1: each its own, to measure a chain's cost)
    LLMRS_OPENCL_CHAIN_GROUPS=N   at most N groups a chain, each taking ticket after ticket
    LLMRS_OPENCL_CHAIN_DUMP=FILE  the generated program's text, to read
"""
from __future__ import annotations

import os
import re
from typing import Any

import numpy as np

from .opencl_device import OpenCLError, _cl
from .opencl_persistent import (_PRELUDE, SPIN_LIMIT, PersistentError, Variant, _arg_words, _items, _variant_key,
                                call_args, gather, program_parts)

CHAINABLE = frozenset({"matvec"})     # kernels a chain joins (their bodies end without early returns
                                      # around barriers, and they read no group-size queries but those
                                      # variant_source redefines)
Launch = tuple[Any, tuple[int, int], tuple[int, int]]


class ChainError(PersistentError):
    """The launch list cannot be chained here (the caller keeps launching kernel by kernel)."""


def chain_runs(launches: list[Launch], group: int, longest: int = 0) -> list[tuple[int, int]]:
    """(start, stop) of each run of two or more consecutive chainable launches of `group`
    threads a group, cut into runs of at most `longest` launches where it is given (1: every
    chainable launch a chain of its own, for measuring what a chain's groups cost)."""
    runs, start = [], None
    for i, (k, _, lsize) in enumerate([*launches, (None, (0, 0), (0, 0))]):
        ok = k is not None and k.function_name in CHAINABLE and lsize[0] == group
        if ok and start is None:
            start = i
        elif not ok and start is not None:
            if i - start >= min(2, longest or 2):
                step = longest or i - start
                runs += [(a, min(a + step, i)) for a in range(start, i, step)]
            start = None
    return runs


# between two reads of a counter: fewer reads of one L2 line while its launch's groups count
_PAUSE = {True: '#define PK_PAUSE() asm volatile("nanosleep.u32 64;")\n', False: "#define PK_PAUSE()\n"}
# a chain orders one group's writes before its count and another's reads after seeing it:
# release / acquire at GPU scope, cheaper than membar.gl's sequential consistency
_FENCE = {True: 'inline void pk_cfence(void) { asm volatile("fence.acq_rel.gpu;" ::: "memory"); }\n',
          False: "inline void pk_cfence(void) { mem_fence(CLK_GLOBAL_MEM_FENCE); }\n"}


def chain_source(variants: list[Variant], kinds: list[list[str]], group: int, pool: int, n_buffers: int,
                 nvidia: bool) -> tuple[str, int]:
    """The program text: prelude, variants, the chain dispatcher; and the table's record stride."""
    # inlined variants: the group size is then fixed for all of their code, so NVIDIA's compiler
    # keeps their registers to what `group` threads may have (as noinline functions, the kernel
    # took at most 256 threads a group on the H100: q4_0 plans' 512-thread matvecs could not chain)
    prelude = _PRELUDE + "#undef PK_NOINLINE\n#define PK_NOINLINE\n" + _PAUSE[nvidia] + _FENCE[nvidia]
    parts, fns, stride, bufs = program_parts(prelude, variants, kinds, group, n_buffers, named_barriers=False)
    # each call in a loop of one trip whose bounds PoCL cannot see through, a barrier closing
    # it: the form of the persistent dispatcher, which PoCL compiles right (a plain call in a
    # switch of several variants gave every group but the first wrong results there)
    cases = "\n".join(f"        case {i}: for (int v = vg; v < n_vg; v += n_vg) {{ {fn}(pk_pool, v % r[1], v / r[1], "
                      f"r[1], r[2], {', '.join(call_args(ks, n_buffers))}); PK_ITER_BARRIER }} break;"
                      for i, (ks, fn) in enumerate(zip(kinds, fns)))
    # (decided here: the variants' texts undefine every option they were built with, USE_NV_PTX too)
    # no reqd_work_group_size: with it NVIDIA's driver ignored -cl-nv-maxrregcount (the registers
    # stayed 176 at =64; H100, round 22)
    head = "__kernel"
    parts.append(f"""
// table: [launches, virtual groups in all], then per launch [variant, groups dim 0, groups dim 1,
// arguments]. sync: [tickets, groups out, done[launch]...]; abort: one word shared by a step's
// chains (an aborted step leaves its counters for the host to zero: ChainedStep.reset_sync)
{head}
void pk_chain({bufs}, __global const int* pk_table, __global volatile int* pk_sync,
              __global volatile int* pk_abort, int pk_spin) {{
    __local uchar pk_pool[{pool}] __attribute__((aligned(16)));
    __local int pk_at[2];
    int n_ops = pk_table[0], total = pk_table[1];
    int lid = get_local_id(0), waited = 0, t = 0, nt = 0;   // lid 0's: the launch waited for, tickets
    if (lid == 0) t = atomic_inc(pk_sync);
    for (;;) {{
        if (lid == 0) {{
            // ticket t as (launch, virtual group): -2 past the last (this group leaves), -1 aborted
            int op = -2, first = 0;
            if (t < total) {{
                for (op = 0; op < n_ops - 1; op++) {{
                    __global const int* q = pk_table + 2 + op * {stride};
                    if (t < first + q[1] * q[2]) break;
                    first += q[1] * q[2];
                }}
                if (pk_abort[0]) op = -1;
                if (op > 0 && op != waited) {{   // once a launch: the next tickets are later ones
                    __global const int* p = pk_table + 2 + (op - 1) * {stride};
                    int need = p[1] * p[2];
                    for (int spins = 0; PK_ARRIVED(pk_sync + 1 + op) < need; spins++) {{
                        PK_PAUSE();
                        if (pk_abort[0] || spins > pk_spin) {{
                            atomic_xchg(pk_abort, 1);   // every later group skips its tickets
                            op = -1;
                            break;
                        }}
                    }}
                    pk_cfence();        // the previous launch's writes before this group reads them
                    if (op > 0) waited = op;
                }}
            }}
            pk_at[0] = op;
            pk_at[1] = t - first;
        }}
        barrier(CLK_LOCAL_MEM_FENCE | CLK_GLOBAL_MEM_FENCE);
        int op = pk_at[0], vg = pk_at[1];
        if (op == -2) break;            // the same in every thread: read after the barrier
        // the next ticket, taken now so that its round trip overlaps this one's work (a group
        // holding a ticket it has not started waits on none but lower ones: still no deadlock)
        if (lid == 0) nt = atomic_inc(pk_sync);
        // no branch around the switch and barrier (PoCL compiles barriers under a branch it cannot
        // prove uniform wrongly): an aborted ticket's switch matches no case
        __global const int* r = pk_table + 2 + (op < 0 ? 0 : op) * {stride};
        int n_vg = op < 0 ? 0 : r[1] * r[2];
        switch (op < 0 ? -1 : r[0]) {{
{cases}
        }}
        barrier(CLK_LOCAL_MEM_FENCE | CLK_GLOBAL_MEM_FENCE);
        if (lid == 0) {{
            if (op >= 0) {{
                pk_cfence();            // this group's writes before its count
                atomic_inc(pk_sync + 2 + op);
            }}
            t = nt;
        }}
    }}
    // the last group out zeroes the counters: every other group has taken its last ticket
    if (lid == 0 && atomic_inc(pk_sync + 1) == (int)get_num_groups(0) - 1)
        for (int i = 0; i < n_ops + 2; i++) pk_sync[i] = 0;
}}
""")
    return "\n".join(parts), stride


class ChainProgram:
    """The chain dispatcher for every chainable variant of `launches` (the union of the decode
    launch lists it will run) whose groups are `group` threads, built once."""

    def __init__(self, ctx: Any, device: Any, launches: list[Launch], bound: dict[int, Any],
                 sources: dict[str, str], device_opts: list[str], group: int):
        from .opencl_program import build_program
        cl = _cl()
        self.ctx, self.device, self.group = ctx, device, group
        items = _items([x for x in launches if x[0].function_name in CHAINABLE and x[2][0] == group], bound)
        if not items:
            raise ChainError("chained decode: no chainable launches")
        self.buffers, self.index, self.variants, vlist, kinds, pool = gather(items, sources, device, group)
        if pool > device.local_mem_size:
            raise ChainError(f"chained decode: {pool} B of local memory a group; the device has {device.local_mem_size}")
        self.spin = int(os.environ.get("LLMRS_OPENCL_PERSISTENT_SPIN", "0") or 0) or (
            SPIN_LIMIT if device.type & cl.device_type.GPU else SPIN_LIMIT << 6)
        source, self.stride = chain_source(vlist, kinds, group, pool, len(self.buffers), "-DUSE_NV_PTX" in device_opts)
        if os.environ.get("LLMRS_OPENCL_CHAIN_DUMP"):
            with open(os.environ["LLMRS_OPENCL_CHAIN_DUMP"], "w") as f:
                f.write(source)
        opts = list(device_opts)
        if "-DUSE_NV_PTX" in device_opts:
            # the registers `group` threads a multiprocessor may have: the dispatcher's union of
            # variants takes more unbounded, and then fits only smaller groups
            regs = int(os.environ.get("LLMRS_OPENCL_CHAIN_REGS", "0") or 0) or min(255, 65536 // group)
            opts += [f"-cl-nv-maxrregcount={regs}", "-cl-nv-verbose"]   # the log tells its registers
        try:
            self.program = build_program(ctx, device, source, opts, "chained decode")
        except OpenCLError as err:
            raise ChainError(str(err)) from None
        # ptxas's report ("Used N registers, M bytes spill stores"), where the build ran now (not
        # from a cache: ours, pyopencl's or the driver's, CUDA_CACHE_DISABLE=1)
        log = self.program.get_build_info(device, cl.program_build_info.LOG) or ""
        self.registers = [int(x) for x in re.findall(r"Used (\d+) registers", log)]
        self.spills = [int(x) for x in re.findall(r"(\d+) bytes spill stores", log)]
        probe = cl.Kernel(self.program, "pk_chain")
        self.max_group = int(probe.get_work_group_info(cl.kernel_work_group_info.WORK_GROUP_SIZE, device))
        self.private_bytes = int(probe.get_work_group_info(cl.kernel_work_group_info.PRIVATE_MEM_SIZE, device))
        # the driver's word, even where ptxas reported 112-128 registers a thread (which 512 threads
        # may have): launched anyway, those chains faulted at the next read (H100, round 22)
        if self.max_group < group:
            raise ChainError(f"chained decode: the kernel takes at most {self.max_group} threads a group here, not "
                             f"{group} (registers {self.registers[:4]}, spill stores {self.spills[:4]})")


class ChainedStep:
    """A decode launch list with each run of chainable launches replaced by one chain launch:
    `launches` is what a step enqueues; after the step's blocking read, aborted() says whether
    a chain gave up waiting (read_status enqueued the read)."""

    def __init__(self, program: ChainProgram, queue: Any, launches: list[Launch], bound: dict[int, Any],
                 abort: Any):
        cl = _cl()
        p = program
        self.queue, self.abort = queue, abort
        self.syncs: list[Any] = []
        self.kernels: list[Any] = []
        out: list[Launch] = []
        at = 0
        for start, stop in chain_runs(launches, p.group, int(os.environ.get("LLMRS_OPENCL_CHAIN_MAX", "0") or 0)):
            out += launches[at:start]
            items = _items(launches[start:stop], bound)
            table = np.zeros(2 + p.stride * len(items), np.int32)
            table[0] = len(items)
            table[1] = sum(g0 * g1 for _, _, g0, g1, _ in items)
            for i, (b, name, g0, g1, local) in enumerate(items):
                key = _variant_key(b, name, local)
                if key not in p.variants:
                    raise ChainError(f"chained decode: {name} is not in the built program")
                words = [w for _, ws in _arg_words(list(b.args), p.index) for w in ws]
                table[2 + i * p.stride: 2 + i * p.stride + 3 + len(words)] = [p.variants[key], g0, g1, *words]
            mf = cl.mem_flags
            tbuf = cl.Buffer(p.ctx, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=table)
            sync = cl.Buffer(p.ctx, mf.READ_WRITE | mf.COPY_HOST_PTR, hostbuf=np.zeros(2 + len(items), np.int32))
            k = cl.Kernel(p.program, "pk_chain")
            k.set_args(*p.buffers, tbuf, sync, abort, np.int32(p.spin))
            self.syncs.append((sync, 2 + len(items), tbuf))
            self.kernels.append(k)
            # groups: one a virtual group, or at most LLMRS_OPENCL_CHAIN_GROUPS, each then taking
            # ticket after ticket (any count is deadlock-free: tickets order the waits)
            cap = int(os.environ.get("LLMRS_OPENCL_CHAIN_GROUPS", "0") or 0)
            groups = min(int(table[1]), cap) if cap > 0 else int(table[1])
            out.append((k, (groups * p.group, 1), (p.group, 1)))
            at = stop
        out += launches[at:]
        if not self.kernels:
            raise ChainError("chained decode: no run of two or more chainable launches")
        self.launches = out
        self._status = np.zeros(1, np.int32)
        self.probe([x for x in out if x[0] in self.kernels])

    def probe(self, chains: list[Launch]) -> None:
        """Launch every chain once with the abort word set (its groups skip every ticket), read
        the word back, then zero the counters: a launch the device refuses is a
        ChainError here, not a failed step. (NVIDIA's driver reports a group too large for the
        kernel's registers only at the next read, and its context may not survive it: the
        program's largest group is checked before this.)"""
        cl = _cl()
        self.reset_sync(abort=True)
        try:
            for k, gsize, lsize in chains:
                cl.enqueue_nd_range_kernel(self.queue, k, gsize, lsize)
            cl.enqueue_copy(self.queue, self._status, self.abort, is_blocking=True)
        except cl.Error as err:
            raise ChainError(f"chained decode: the device refuses the chain's launch ({err})") from None
        self.reset_sync()

    def read_status(self) -> None:
        """Enqueue the read of the abort word (the step's own blocking read that follows waits
        for it)."""
        _cl().enqueue_copy(self.queue, self._status, self.abort, is_blocking=False)

    def aborted(self) -> bool:
        return bool(self._status[0])

    def reset_sync(self, abort: bool = False) -> None:
        """Zero the abort word and every chain's counters (abort=True: set the word instead, so
        the next step's chains return at once: tests of the fallback)."""
        cl = _cl()
        for sync, n, _ in self.syncs:
            cl.enqueue_copy(self.queue, sync, np.zeros(n, np.int32), is_blocking=True)
        cl.enqueue_copy(self.queue, self.abort, np.array([int(abort)], np.int32), is_blocking=True)
