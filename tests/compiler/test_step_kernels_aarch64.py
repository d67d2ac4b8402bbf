"""A step graph's kernels cross-compiled for aarch64 (NEON; +dotprod; +dotprod+i8mm) and run under
qemu-aarch64 against the interpreter, with tests/qemu's driver; and i8mm's prefill matmul, whose
token pairs would otherwise sum a lone tail token another way, giving a row the same bits alone
and among 8 rows. Needs tests/qemu/setup.sh's packages."""
from __future__ import annotations

import subprocess
from pathlib import Path

import llvmlite.ir as ir
import numpy as np
import pytest

from llmrs.compiler.codegen.llvm_kernels import emit_op, op_scratch_bytes
from llmrs.compiler.codegen.llvm_matmul import _align
from llmrs.compiler.codegen.llvm_target import aarch64_target, emit

from ..conftest import QEMU_SETUP, system_tool
from ..qemu.test_aarch64_kernels import DRIVER, _run
from .kernel_cases import Case, matmul_case
from .step_cases import Paged, gather_case, kv_store_case, paged_attention_case, rope_case
from .test_llvm_kernels import check

ROWS = [(1, 1), (0, 16), (2, 17), (0, 33), (1, 47), (2, 64), (0, 5)]
CASES = [rope_case(T=7, n=6, hd=100),
         rope_case(T=7, n=5, hd=32, folded=False),
         kv_store_case(T=7, n=5, dtype="q8_0", hd=64),
         kv_store_case(T=7, n=5, dtype="q4_0", hd=64),
         kv_store_case(T=7, n=6, dtype="f16", hd=100),
         paged_attention_case(T=9, rows=ROWS, kv_dtype="f16"),
         paged_attention_case(T=9, rows=ROWS, kv_dtype="q8_0", h=4, kvh=1, hd=64),
         paged_attention_case(T=9, rows=ROWS, kv_dtype="q4_0", h=4, kvh=2, hd=64),
         paged_attention_case(T=9, rows=ROWS, kv_dtype="f32", h=6, kvh=2, hd=100),
         # blocks of 2 slots: fewer than a NEON vector's 4 lanes, each lane looks its block up
         paged_attention_case(T=9, rows=[(s, min(c, 8)) for s, c in ROWS], kv_dtype="f16",
                              pool=Paged.shuffled(2, 12, 3, np.random.default_rng(5))),
         # eviction scores of the rows from their score_from on, at their entries' physical slots
         paged_attention_case(T=9, rows=ROWS, kv_dtype="f16", h=6, kvh=2, hd=32,
                              score_from=[0, 16, 10, 0, 2**31 - 1, 63, 5]),
         paged_attention_case(T=9, rows=ROWS, kv_dtype="f32", h=2, kvh=2, hd=100, score_from=[0] * 7),
         gather_case(T=11, n=9, picked=[4, 0, 8, 4]),
         # the fused QKV of a step graph: each row roped at its position, stored at its slot
         matmul_case("q4_0", 9, 6, True, "rope_kv_store", cache_dtype="q8_0", heads=(4, 1, 64), step_rows=True,
                     seed=11),
         matmul_case("q8_0", 9, 9, True, "rope_kv_store", cache_dtype="f16", heads=(4, 2, 48), qk_norm=True,
                     bias=True, step_rows=True, seed=12),
         matmul_case("f16", 9, 1, True, "rope_kv_store", heads=(2, 2, 100), step_rows=True, seed=13),
         matmul_case("q4_1", 9, 7, True, "rope_kv_store", cache_dtype="q4_0", heads=(4, 2, 64), step_rows=True,
                     seed=14)]
# a row of an 8-row step (whole tiles of 4) and the same row alone (a one-token tail)
WEIGHTS = ("q4_0", "q4_1", "q8_0")
BATCH = {w: matmul_case(w, 16, 8, True, "silu_mul", K=160, N=48, seed=3) for w in WEIGHTS}


def _alone(wdtype: str, row: int) -> Case:
    case = matmul_case(wdtype, 16, 1, True, "silu_mul", K=160, N=48, seed=3)
    case.arrays["x"][0] = BATCH[wdtype].arrays["x"][row]
    return case


ALONE = {w: _alone(w, 6) for w in WEIGHTS}
# the same for the fused QKV of a step graph (q, and the k / v stored at the row's slot)
QKV_BATCH = matmul_case("q4_0", 16, 8, True, "rope_kv_store", K=160, heads=(4, 2, 32), step_rows=True, seed=3)
QKV_ALONE = matmul_case("q4_0", 16, 1, True, "rope_kv_store", K=160, heads=(4, 2, 32), step_rows=True, seed=3)
for name in ("x", "positions", "slots"):
    QKV_ALONE.arrays[name][0] = QKV_BATCH.arrays[name][6]
KERNELS = CASES + list(BATCH.values()) + list(ALONE.values()) + [QKV_BATCH, QKV_ALONE]


def _build(gcc: str, tmp: Path, dotprod: bool, i8mm: bool) -> Path:
    target = aarch64_target(dotprod, i8mm=i8mm)
    module = ir.Module("aarch64")
    module.triple = target.triple
    decls, cases = [], []
    for i, case in enumerate(KERNELS):
        emit_op(module, target, case.graph, case.op, f"kernel{i}")
        n = len(case.buffers())
        decls.append(f"void kernel{i}({', '.join(['void*'] * n)}, i64, i64, i64, i64, i64, void*);")
        cases.append(f"case {i}: kernel{i}({', '.join(f'b[{j}]' for j in range(n))}, nt, np_, sp, t, nth, s); break;")
    (tmp / "kernels.o").write_bytes(emit(str(module), target))
    (tmp / "driver.c").write_text(DRIVER % {"decls": "\n".join(decls), "cases": "\n".join(cases)})
    exe = tmp / "driver"
    subprocess.run([gcc, "-O1", "-static", "-o", str(exe), str(tmp / "driver.c"), str(tmp / "kernels.o"), "-lm"],
                   check=True, capture_output=True)
    return exe


@pytest.fixture(scope="module")
def qemu() -> str:
    return system_tool("qemu-aarch64", QEMU_SETUP)


@pytest.fixture(scope="module", params=[(False, False), (True, False), (True, True)],
                ids=["neon", "neon+dotprod", "neon+dotprod+i8mm"])
def driver(request, tmp_path_factory, qemu):
    gcc = system_tool("aarch64-linux-gnu-gcc", QEMU_SETUP)
    dotprod, i8mm = request.param
    return _build(gcc, tmp_path_factory.mktemp("step-aarch64"), dotprod, i8mm), qemu


def _run_case(driver, case: Case) -> dict[str, np.ndarray]:
    (exe, qemu), index = driver, next(i for i, c in enumerate(KERNELS) if c is case)
    arrays = {k: v.copy() for k, v in case.arrays.items()}
    names = case.buffers()
    bufs = [arrays[case.graph.values[n].alias or n] for n in names]
    st = case.step
    out = _run(qemu, exe, exe.parent, index, bufs, (st.n_tokens, st.n_past, st.start_pos), 2,
               _align(max(op_scratch_bytes(case.graph, case.op), 64)))
    for n, a in zip(names, out):
        arrays[case.graph.values[n].alias or n] = a
    return arrays


@pytest.mark.parametrize("index", range(len(CASES)), ids=[c.name for c in CASES])
def test_aarch64_step_kernel_matches_interpreter_under_qemu(driver, index):
    check(CASES[index], _run_case(driver, CASES[index]))


@pytest.mark.parametrize("wdtype", WEIGHTS)
def test_aarch64_matmul_row_is_the_same_bits_alone_and_among_8_rows_under_qemu(driver, wdtype):
    batch = _run_case(driver, BATCH[wdtype])["y"][6]
    alone = _run_case(driver, ALONE[wdtype])["y"][0]
    np.testing.assert_array_equal(alone, batch)


def test_aarch64_fused_qkv_row_is_the_same_bits_alone_and_among_8_rows_under_qemu(driver):
    batch, alone = _run_case(driver, QKV_BATCH), _run_case(driver, QKV_ALONE)
    np.testing.assert_array_equal(alone["y"][0], batch["y"][6])
    slot = QKV_BATCH.arrays["slots"][6]
    for c in ("kc", "vc"):
        np.testing.assert_array_equal(alone[c][slot], batch[c][slot])
