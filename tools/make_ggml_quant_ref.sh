#!/usr/bin/env bash
# Regenerates tests/data/ggml_quant_ref.npz: inputs chosen to hit the edge cases of GGML's
# Q4_0/Q8_0/Q4_1 quantizers (and Q8_1 activations), and the bytes/floats ggml itself produces for them.
#
# ggml comes from the llama-cpp-python sdist (it vendors llama.cpp); everything is built
# OUTSIDE this project, under $EXT (default /work/ext). Usage:
#     tools/make_ggml_quant_ref.sh [OUT.npz]
# Needs: cmake, a C compiler, python3 with numpy; network only if the sdist is not in $EXT.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
OUT="${1:-$ROOT/tests/data/ggml_quant_ref.npz}"
EXT="${EXT:-/work/ext}"
mkdir -p "$EXT"

LLAMA="${LLAMA_DIR:-}"
if [[ -z "$LLAMA" ]]; then
    SDIST="$(ls -d "$EXT"/llama_cpp_python-*/ 2>/dev/null | sort -V | tail -1 || true)"
    if [[ -z "$SDIST" ]]; then
        (cd "$EXT" && pip download --no-deps --no-binary :all: llama-cpp-python \
            && tar xzf llama_cpp_python-*.tar.gz)
        SDIST="$(ls -d "$EXT"/llama_cpp_python-*/ | sort -V | tail -1)"
    fi
    LLAMA="${SDIST%/}/vendor/llama.cpp"
fi
[[ -f "$LLAMA/ggml/include/ggml.h" ]] || { echo "make_ggml_quant_ref: no ggml in $LLAMA; set LLAMA_DIR to a llama.cpp checkout" >&2; exit 1; }

# A ggml of its own (static, CPU only) so this does not depend on how llama.cpp was configured.
BUILD="$EXT/ggml-quant-ref-build"
# (configured from llama.cpp's top level: the vendored ggml/ cannot be configured on its own)
cmake -S "$LLAMA" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
    -DGGML_NATIVE=ON -DGGML_OPENMP=OFF -DLLAMA_BUILD_COMMON=OFF -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
    -DLLAMA_BUILD_APP=OFF -DLLAMA_OPENSSL=OFF >"$BUILD.log" 2>&1 || { cat "$BUILD.log" >&2; exit 1; }
cmake --build "$BUILD" -j"$(nproc)" --target ggml-base ggml-cpu >>"$BUILD.log" 2>&1 \
    || { tail -40 "$BUILD.log" >&2; exit 1; }

BIN="$BUILD/ggml_quant_ref"
cc -O2 -std=c11 -I"$LLAMA/ggml/include" "$ROOT/tools/ggml_quant_ref.c" -o "$BIN" \
    "$BUILD/ggml/src/libggml-cpu.a" "$BUILD/ggml/src/libggml-base.a" -lstdc++ -lm -lpthread

GGML_COMMIT="$(cd "$LLAMA" && (git rev-parse --short HEAD 2>/dev/null || basename "$(dirname "$(dirname "$LLAMA")")"))"
python3 - "$BIN" "$OUT" "$GGML_COMMIT" <<'PY'
import subprocess
import sys

import numpy as np

QK = 32
rng = np.random.default_rng(20240611)


def normal(k: int, scale: float) -> np.ndarray:
    return (rng.standard_normal(k) * scale).astype(np.float32)


def with_zeros(x: np.ndarray, frac: float) -> np.ndarray:
    x = x.copy()
    x[rng.random(x.size) < frac] = 0.0
    return x


def signed_max(k: int, sign: float, twin: bool) -> np.ndarray:
    # every block's largest magnitude has the given sign; with twin, the opposite-signed value
    # of equal magnitude comes later in the block (q4_0 takes the FIRST one: the twin clamps at 15)
    x = rng.uniform(-1, 1, k).astype(np.float32)
    b = x.reshape(-1, QK)
    for row in b:
        i, j = rng.choice(QK, 2, replace=False)
        i, j = min(i, j), max(i, j)
        row[i] = sign * 1.5
        if twin:
            row[j] = -sign * 1.5
    return x


def ties(k: int) -> np.ndarray:
    # q8_0: amax = 127 makes d = 1, so x*id = x; half-integers test roundf's away-from-zero.
    # q4_0: the max -8 makes d = 1, so x + 8.5 lands exactly on integers for x = n - 0.5.
    b = np.empty((-(-k // (3 * QK)), QK), dtype=np.float32)
    for n, row in enumerate(b):
        if n % 2 == 0:
            row[:] = rng.integers(-127, 127, QK) + 0.5
            row[0] = 127.0 if n % 4 == 0 else -127.0
        else:
            row[:] = rng.integers(-7, 8, QK) - 0.5
            row[0] = -8.0
    # neighbours of the ties: one ulp either side
    up, down = b.copy(), b.copy()
    up[:, 1:] = np.nextafter(b[:, 1:], np.float32(np.inf))
    down[:, 1:] = np.nextafter(b[:, 1:], np.float32(-np.inf))
    return np.concatenate([b, up, down]).ravel()[:k].copy()


def near_ties(k: int) -> np.ndarray:
    # a scale whose reciprocal is inexact, values placed at (n + 0.5) * d and one ulp off it
    d = np.float32(0.0123)
    n = rng.integers(-126, 126, k).astype(np.float32)
    x = ((n + np.float32(0.5)) * d).astype(np.float32)
    x[::3] = np.nextafter(x[::3], np.float32(np.inf))
    x[1::3] = np.nextafter(x[1::3], np.float32(-np.inf))
    x[::QK] = 127 * d
    return x


def mixed_blocks(k: int) -> np.ndarray:
    x = normal(k, 1.0)
    b = x.reshape(-1, QK)
    b[1] = 0.0                           # a whole zero block inside live data
    b[2] = -0.0                          # negative zeros: the sign of d must match C
    b[3, ::2] = -0.0
    b[4] = 0.25                          # all equal
    return x


cases = [
    ("normal_s1_k32", normal(32, 1.0)),
    ("normal_s1_k64", normal(64, 1.0)),
    ("normal_s0.02_k4096", normal(4096, 0.02)),
    ("normal_s1_k2048", normal(2048, 1.0)),
    ("normal_s1e-3_k256", normal(256, 1e-3)),
    ("normal_s1e2_k256", normal(256, 1e2)),
    ("normal_s1e4_k128", normal(128, 1e4)),
    ("zeros30pct_k1024", with_zeros(normal(1024, 0.5), 0.3)),
    ("mixed_blocks_k256", mixed_blocks(256)),
    ("all_equal_pos_k64", np.full(64, 0.7, np.float32)),
    ("all_equal_neg_k64", np.full(64, -1.3, np.float32)),
    ("max_negative_k256", signed_max(256, -1.0, False)),
    ("max_positive_k256", signed_max(256, 1.0, False)),
    ("max_pos_then_neg_k256", signed_max(256, 1.0, True)),
    ("max_neg_then_pos_k256", signed_max(256, -1.0, True)),
    ("ties_k256", ties(256)),
    ("near_ties_k512", near_ties(512)),
    ("tiny_1e-30_k128", normal(128, 1e-30)),
    ("subnormal_1e-40_k128", normal(128, 1e-40)),
    ("subnormal_min_k64", (rng.integers(-3, 4, 64) * np.float32(1.4e-45)).astype(np.float32)),
    ("huge_6e4_k128", normal(128, 6e4).clip(-65504, 65504)),
    ("huge_5e5_k64", normal(64, 5e5)),
    ("huge_1e30_k64", normal(64, 1e30)),
]
# q4_1's own edge cases come after the others, from their own generator, so adding them left
# every earlier case (and the q4_0/q8_0 bytes made from it) as it was
rng41 = np.random.default_rng(20261124)


def offset_blocks(k: int) -> np.ndarray:
    # blocks far from zero, each with its own offset and spread: what q4_1's minimum is for
    b = rng41.standard_normal((k // QK, QK)) * rng41.uniform(0.01, 2, (k // QK, 1)) + rng41.uniform(-20, 20, (k // QK, 1))
    return b.astype(np.float32).ravel()


def q4_1_ties(k: int) -> np.ndarray:
    # min 0, max 15: d = 1, so (x - min)*id + 0.5 lands on integers for x = n - 0.5, and one
    # ulp either side of them
    b = (rng41.integers(1, 16, (k // QK, QK)) - np.float32(0.5)).astype(np.float32)
    b[:, 0], b[:, 1] = 0.0, 15.0
    b[1::3, 2:] = np.nextafter(b[1::3, 2:], np.float32(np.inf))
    b[2::3, 2:] = np.nextafter(b[2::3, 2:], np.float32(-np.inf))
    return b.ravel()


def zero_minimum_signs(k: int) -> np.ndarray:
    # the minimum is a zero: its sign (stored in m) is that of the first of the equal minima
    b = np.abs(rng41.standard_normal((k // QK, QK))).astype(np.float32) + np.float32(0.1)
    for n, row in enumerate(b):
        i, j = sorted(rng41.choice(QK, 2, replace=False))
        row[i], row[j] = (-0.0, 0.0) if n % 2 == 0 else (0.0, -0.0)
    return b.ravel()


cases += [
    ("q4_1_offset_blocks_k512", offset_blocks(512)),
    ("q4_1_ties_k192", q4_1_ties(192)),
    ("q4_1_zero_minimum_signs_k128", zero_minimum_signs(128)),
    ("q4_1_normal_s1_k576", (rng41.standard_normal(576)).astype(np.float32)),
]
for name, x in cases:
    assert x.dtype == np.float32 and x.size % QK == 0 and np.any(x != 0), name

# each weight row x gets an activation row y with the same values shuffled and sign-flipped,
# so the activation quantizer sees the same edge cases
ys = [(g.permutation(x) * np.float32(g.choice([-1, 1]))).astype(np.float32)
      for name, x in cases for g in [rng41 if name.startswith("q4_1_") else rng]]

stdin = b"".join(np.int64(x.size).tobytes() + x.tobytes() + y.tobytes() for (_, x), y in zip(cases, ys))
out = subprocess.run([sys.argv[1]], input=stdin, capture_output=True, check=True).stdout

fields = {"q4_0": (18, np.uint8), "q8_0": (34, np.uint8), "chunk_q4_0": (18, np.uint8),
          "chunk_q8_0": (34, np.uint8), "deq_q4_0": (4 * QK, np.float32),
          "deq_q8_0": (4 * QK, np.float32), "y_q8_0": (34, np.uint8), "y_q8_0_cpu": (34, np.uint8),
          "dot_q4_0": (None, np.float32), "dot_q8_0": (None, np.float32),
          "isum_q4_0": (4, np.int32), "isum_q8_0": (4, np.int32),
          "q4_1": (20, np.uint8), "chunk_q4_1": (20, np.uint8), "deq_q4_1": (4 * QK, np.float32),
          "y_q8_1": (36, np.uint8), "y_q8_1_cpu": (36, np.uint8), "dot_q4_1": (None, np.float32),
          "isum_q4_1": (4, np.int32)}
acc = {f: [] for f in fields}
pos = 0
for _, x in cases:
    nb = x.size // QK
    for f, (per_block, dt) in fields.items():
        n = 4 if per_block is None else per_block * nb
        acc[f].append(np.frombuffer(out[pos:pos + n], dtype=np.uint8).view(dt))
        pos += n
assert pos == len(out), f"ggml_quant_ref wrote {len(out)} bytes, expected {pos}"
data = {f: np.concatenate(v) for f, v in acc.items()}
# llama-quantize goes through ggml_quantize_chunk; it must agree with the _ref rows we test
assert np.array_equal(data.pop("chunk_q4_0"), data["q4_0"]), "ggml_quantize_chunk q4_0 != ref"
assert np.array_equal(data.pop("chunk_q8_0"), data["q8_0"]), "ggml_quantize_chunk q8_0 != ref"
assert np.array_equal(data.pop("chunk_q4_1"), data["q4_1"]), "ggml_quantize_chunk q4_1 != ref"
# Q8_1 is Q8_0's d and codes plus s: keep s alone (f16), once the rest is seen to be Q8_0's bytes
for src, dst in (("y_q8_1", "y_q8_0"), ("y_q8_1_cpu", "y_q8_0_cpu")):
    q81, q80 = data.pop(src).reshape(-1, 36), data[dst].reshape(-1, 34)
    assert np.array_equal(q81[:, :2], q80[:, :2]) and np.array_equal(q81[:, 4:], q80[:, 2:]), f"{src} != {dst} + s"
    data["s" + src[1:]] = q81[:, 2:4].copy().view(np.float16)[:, 0]

np.savez_compressed(
    sys.argv[2], names=np.array([n for n, _ in cases]), k=np.array([x.size for _, x in cases]),
    x=np.concatenate([x for _, x in cases]), y=np.concatenate(ys), ggml_commit=np.array(sys.argv[3]),
    **data)
print(f"wrote {sys.argv[2]}: {len(cases)} cases, {sum(x.size for _, x in cases)} values")
PY
ls -l "$OUT"
