"""LLVM kernels cross-compiled for aarch64 (NEON, with and without +dotprod, and with +i8mm's smmla),
linked with a small C driver and run under qemu-aarch64 (its default cpu, max, has both), against the
interpreter. Needs tests/qemu/setup.sh's packages."""
from __future__ import annotations

import subprocess
from pathlib import Path

import llvmlite.ir as ir
import numpy as np
import pytest

from llmrs.compiler.codegen.llvm_builder import KernelBuilder
from llmrs.compiler.codegen.llvm_kernels import emit_op, op_scratch_bytes
from llmrs.compiler.codegen.llvm_matmul import _align, emit_block_dot_probe
from llmrs.compiler.codegen.llvm_target import aarch64_target, emit
from llmrs.compiler import quant

from ..compiler.kernel_cases import attention_case, embedding_case, matmul_case, scored_attention_case, simple_case
from ..compiler.test_llvm_kernels import check
from ..conftest import QEMU_SETUP, system_tool

CASES = [matmul_case("q4_0", 6, 5, True, "rope_kv_store", cache_dtype="q8_0"),
         matmul_case("q4_1", 6, 5, True, "rope_kv_store", cache_dtype="q8_0"),
         matmul_case("q4_1", 1, 1, True, "silu_mul"),
         matmul_case("q4_1", 1, 1, False, "add", K=160, N=45),     # odd N, K = 5 blocks
         matmul_case("q4_1", 7, 6, False, None, K=160, N=45),
         matmul_case("q8_0", 1, 1, True, "silu_mul"),
         matmul_case("f16", 6, 6, False, "add"),
         matmul_case("f32", 1, 1, True, None),
         attention_case(7, 4, "f16"),
         scored_attention_case(7, 5, "q8_0", first=7),
         scored_attention_case(7, 5, "q4_0", first=0),
         attention_case(7, 4, "q4_0", h=6, kvh=2, hd=96),
         simple_case("kv_store:q4_0"),
         embedding_case("q4_0"),
         embedding_case("q4_1"),
         simple_case("rms_norm"),
         # head dims beyond 64 / 128: 100 (RoPE halves of 50 end in a 2-lane piece), 34 (rows end in
         # one), 96 into a Q8_0 cache; MQA and a GQA group of 3
         attention_case(7, 4, "f16", h=3, kvh=1, hd=100),
         attention_case(1, 1, "f32", h=9, kvh=3, hd=48),
         attention_case(6, 6, "f32", h=2, kvh=2, hd=34),
         matmul_case("q8_0", 6, 5, True, "rope_kv_store", cache_dtype="f16", heads=(2, 2, 100)),
         matmul_case("f32", 1, 1, True, "rope_kv_store", heads=(3, 1, 34)),
         matmul_case("q4_0", 1, 1, True, "rope_kv_store", cache_dtype="q8_0", heads=(3, 1, 96)),
         matmul_case("q8_0", 6, 5, True, "rope_kv_store", cache_dtype="q4_0", heads=(3, 1, 96)),
         matmul_case("f16", 6, 6, True, "add", K=900, N=24),
         # i8mm's row and token pairs: whole 4 x 4 tiles, a 2-token tail, an odd N's last row
         matmul_case("q8_0", 8, 8, True, "silu_mul"),
         matmul_case("q4_0", 10, 10, False, "add", K=160, N=45),
         # Qwen: per-head q/k norms in the QKV epilogue (head_dim 128 and 48, i8mm's pairs), biases
         # (a plain matmul's, and before each epilogue), rms_norm over each head
         matmul_case("q4_0", 8, 7, True, "rope_kv_store", cache_dtype="q8_0", heads=(4, 2, 128), qk_norm=True),
         matmul_case("q8_0", 1, 1, True, "rope_kv_store", cache_dtype="f16", heads=(3, 1, 48), qk_norm=True,
                     bias=True),
         matmul_case("q4_1", 6, 5, True, "rope_kv_store", heads=(6, 1, 64), qk_norm=True, qk_norm_dtype="f32"),
         matmul_case("f16", 1, 1, False, None, bias=True, K=160, N=45),
         matmul_case("q4_0", 7, 6, True, "silu_mul", bias=True),
         matmul_case("q8_0", 1, 1, False, "add", bias=True, K=160, N=45),
         simple_case("rms_norm:16")]
PROBE_K, PROBE_N = 128, 5
PROBES = ("q4_0", "q8_0", "q4_1")

DRIVER = r"""
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
typedef long long i64;
%(decls)s
static void *load(const char *path, long *size) {
  FILE *f = fopen(path, "rb"); fseek(f, 0, SEEK_END); *size = ftell(f); fseek(f, 0, SEEK_SET);
  void *p = aligned_alloc(64, (*size + 63) / 64 * 64); fread(p, 1, *size, f); fclose(f); return p;
}
int main(int argc, char **argv) {
  /* kernel n_tokens n_past start_pos nth scratch_bytes buffer-files... (rewritten in place) */
  int k = atoi(argv[1]); i64 nt = atoll(argv[2]), np_ = atoll(argv[3]), sp = atoll(argv[4]);
  i64 nth = atoll(argv[5]), sb = atoll(argv[6]);
  void *b[16]; long sz[16]; int nb = argc - 7;
  for (int i = 0; i < nb; i++) {  /* one file named twice (a cache and its alias) is one buffer */
    b[i] = 0;
    for (int j = 0; j < i; j++) if (!strcmp(argv[7 + i], argv[7 + j])) { b[i] = b[j]; sz[i] = sz[j]; }
    if (!b[i]) b[i] = load(argv[7 + i], &sz[i]);
  }
  char *scratch = aligned_alloc(64, sb * nth + 64);
  for (i64 t = 0; t < nth; t++) {
    void *s = scratch + t * sb;
    switch (k) {
%(cases)s
    }
  }
  for (int i = 0; i < nb; i++) { FILE *f = fopen(argv[7 + i], "wb"); fwrite(b[i], 1, sz[i], f); fclose(f); }
  return 0;
}
"""


def _build(gcc: str, tmp: Path, dotprod: bool, i8mm: bool = False) -> Path:
    target = aarch64_target(dotprod, i8mm=i8mm)
    module = ir.Module("aarch64")
    module.triple = target.triple
    decls, cases = [], []
    for i, case in enumerate(CASES):
        emit_op(module, target, case.graph, case.op, f"kernel{i}")
        n = len(case.buffers())
        decls.append(f"void kernel{i}({', '.join(['void*'] * n)}, i64, i64, i64, i64, i64, void*);")
        cases.append(f"case {i}: kernel{i}({', '.join(f'b[{j}]' for j in range(n))}, nt, np_, sp, t, nth, s); break;")
    for i, wdtype in enumerate(PROBES):
        emit_block_dot_probe(KernelBuilder(module, target, f"probe_{wdtype}", 3), wdtype, PROBE_K, PROBE_N)
        decls.append(f"void probe_{wdtype}(void*, void*, void*, i64, i64, i64, i64, i64, void*);")
        cases.append(f"case {100 + i}: probe_{wdtype}(b[0], b[1], b[2], nt, np_, sp, t, nth, s); break;")
    (tmp / "kernels.o").write_bytes(emit(str(module), target))
    (tmp / "driver.c").write_text(DRIVER % {"decls": "\n".join(decls), "cases": "\n".join(cases)})
    exe = tmp / "driver"
    subprocess.run([gcc, "-O1", "-static", "-o", str(exe), str(tmp / "driver.c"), str(tmp / "kernels.o"), "-lm"],
                   check=True, capture_output=True)
    return exe


def _run(qemu: str, exe: Path, tmp: Path, kernel: int, arrays: list[np.ndarray], scalars: tuple[int, ...], nth: int,
         scratch: int) -> list[np.ndarray]:
    paths = []
    for j, a in enumerate(arrays):
        first = next(i for i, b in enumerate(arrays) if b is a)
        p = tmp / f"buf{first}.bin"
        if first == j:
            p.write_bytes(np.ascontiguousarray(a).tobytes())
        paths.append(str(p))
    subprocess.run([qemu, "-L", "/usr/aarch64-linux-gnu", str(exe), str(kernel), *map(str, scalars), str(nth),
                    str(scratch), *paths], check=True, capture_output=True, timeout=60)
    return [np.frombuffer(Path(p).read_bytes(), a.dtype).reshape(a.shape) for p, a in zip(paths, arrays)]


@pytest.fixture(scope="module")
def qemu() -> str:
    return system_tool("qemu-aarch64", QEMU_SETUP)


@pytest.fixture(scope="module", params=[(False, False), (True, False), (True, True)],
                ids=["neon", "neon+dotprod", "neon+dotprod+i8mm"])
def driver(request, tmp_path_factory, qemu):
    gcc = system_tool("aarch64-linux-gnu-gcc", QEMU_SETUP)
    dotprod, i8mm = request.param
    tmp = tmp_path_factory.mktemp("i8mm" if i8mm else "dotprod" if dotprod else "neon")
    return _build(gcc, tmp, dotprod, i8mm), tmp


@pytest.mark.parametrize("index", range(len(CASES)), ids=[c.name for c in CASES])
def test_aarch64_kernel_matches_interpreter_under_qemu(qemu, driver, index):
    exe, tmp = driver
    case = CASES[index]
    names = case.buffers()
    arrays = {k: v.copy() for k, v in case.arrays.items()}
    bufs = [arrays[case.graph.values[n].alias or n] for n in names]
    st = case.step
    out = _run(qemu, exe, tmp, index, bufs, (st.n_tokens, st.n_past, st.start_pos), 2,
               _align(max(op_scratch_bytes(case.graph, case.op), 64)))
    for n, a in zip(names, out):
        arrays[case.graph.values[n].alias or n] = a
    check(case, arrays)


@pytest.mark.parametrize("wdtype", PROBES)
def test_aarch64_int8_block_dots_are_exact_under_qemu(qemu, driver, wdtype):
    """Integer block sums through sdot / NEON multiplies; q4_1's are of its codes 0..15."""
    exe, tmp = driver
    rng = np.random.default_rng(7)
    w = quant.quantize(rng.standard_normal((PROBE_N, PROBE_K)).astype(np.float32), wdtype)
    _, xq = quant.quantize_rows_q8_0(rng.standard_normal((1, PROBE_K)).astype(np.float32))
    _, wq = quant.split_blocks(w, wdtype)
    want = np.einsum("nbk,bk->nb", wq.astype(np.int32), xq[0].astype(np.int32))
    out = _run(qemu, exe, tmp, 100 + PROBES.index(wdtype),
               [w, xq[0].reshape(-1).copy(), np.zeros((PROBE_N, PROBE_K // 32), np.int32)], (1, 0, 0), 1, 64)
    np.testing.assert_array_equal(out[2], want)
