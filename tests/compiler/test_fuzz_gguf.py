"""Mutated GGUF files through the model reader and its checks: header, metadata values and types,
the tensor table, truncations and shifted bytes. Each mutant is either a one-line ModelError
naming the file, or a model that compiles and runs to finite logits; any other exception, a
traceback or a hang (a per-case alarm) fails, printing the case's seed and mutation.

A seeded mutator (random.Random(seed + case)) rather than hypothesis: 10 000 cases must run in
minutes, and a failure must name a case that reruns alone (`_mutant(good, slots, SEED + case)`).
"""
from __future__ import annotations

import hashlib
import math
import random
import signal
import struct
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

import gguf
from gguf import GGMLQuantizationType as GT

from llmrs.compiler.cli import main as compile_main
from llmrs.compiler.pipeline import CompileOptions, compile_graphs
from llmrs.models.config import ModelError, check_ranges
from llmrs.models.llama import load_model
from llmrs.runtime.backends.cpu import CpuBackend
from llmrs.runtime.backends.reference import ReferenceBackend
from llmrs.runtime.engine import Engine
from llmrs.runtime.plan import Plan
from llmrs.runtime.sampler import Sampler, SamplerConfig

from ..models.gguf_files import encode, write_gguf

SEED = 20261127
PARSE_SECONDS = 5       # one mutant's read; a hang is 100x a normal case
RUN_SECONDS = 120       # one compile and short run

# 64 tokens: two specials, letters, digits and two merged pairs (byte-level BPE, "gpt2")
TOKENS = (["<|bos|>", "<|eos|>"] + [chr(c) for c in range(ord("a"), ord("z") + 1)]
          + [chr(c) for c in range(ord("A"), ord("Z") + 1)] + [str(d) for d in range(8)] + ["ab", "th"])


class Hang(Exception):
    pass


@contextmanager
def deadline(seconds: int):
    """Raise Hang in this thread after `seconds` of wall time."""
    def ring(*_):
        raise Hang(f"no answer in {seconds} s")
    old = signal.signal(signal.SIGALRM, ring)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def tiny_gguf(path: Path) -> Path:
    """A 2-layer Llama (hidden 32, 2 heads of 16, 1 KV head, 64 tokens) in four GGML types: small
    enough that a mutant reads in a millisecond or two, with every structure a real file has."""
    rng = np.random.default_rng(7)
    d, f, hd, heads, kvh, vocab = 32, 64, 16, 2, 1, len(TOKENS)
    meta = {
        "general.architecture": "llama", "general.name": "fuzz",
        "llama.block_count": 2, "llama.context_length": 256, "llama.embedding_length": d,
        "llama.feed_forward_length": f, "llama.attention.head_count": heads, "llama.attention.head_count_kv": kvh,
        "llama.rope.freq_base": 10000.0, "llama.attention.layer_norm_rms_epsilon": 1e-5,
        "llama.attention.key_length": hd, "llama.attention.value_length": hd, "llama.vocab_size": vocab,
        "llama.rope.dimension_count": hd,
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-2", "tokenizer.ggml.tokens": TOKENS,
        "tokenizer.ggml.token_type": [3, 3] + [1] * (vocab - 2), "tokenizer.ggml.merges": ["a b", "t h"],
        "tokenizer.ggml.bos_token_id": 0, "tokenizer.ggml.eos_token_id": 1, "tokenizer.ggml.add_bos_token": True,
        "tokenizer.chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}",
    }

    def w(*shape: int) -> np.ndarray:
        return rng.normal(0, 1 / math.sqrt(shape[-1]), size=shape).astype(np.float32)

    tensors = {"token_embd.weight": (encode(w(vocab, d), GT.F16), GT.F16),
               "output_norm.weight": (1 + 0.1 * w(d), GT.F32)}
    for i in range(2):
        kinds = {"attn_q": ((heads * hd, d), GT.Q8_0), "attn_k": ((kvh * hd, d), GT.Q4_0),
                 "attn_v": ((kvh * hd, d), GT.Q4_1), "attn_output": ((d, heads * hd), GT.Q8_0),
                 "ffn_gate": ((f, d), GT.Q8_0), "ffn_up": ((f, d), GT.F16), "ffn_down": ((d, f), GT.F32)}
        for name, (shape, kind) in kinds.items():
            tensors[f"blk.{i}.{name}.weight"] = (encode(w(*shape), kind), kind)
        for name in ("attn_norm", "ffn_norm"):
            tensors[f"blk.{i}.{name}.weight"] = (1 + 0.1 * w(d), GT.F32)
    return write_gguf(path, meta, tensors)


@dataclass(frozen=True)
class Slot:
    at: int            # byte offset in the file
    dtype: np.dtype    # what the bytes hold
    count: int         # how many of them
    label: str         # the field or tensor, and which part


def slots(path: Path) -> tuple[list[list[Slot]], int]:
    """Every part of every metadata field and tensor-table entry as gguf's reader splits them,
    grouped by field (so that a 64-token list is picked as often as one hyper-parameter); and where
    the tensor data starts."""
    r = gguf.GGUFReader(path)
    base = r.data.ctypes.data
    parts = ["key length", "key", "type"]
    out = []
    for name, field in list(r.fields.items()) + [(t.name, t.field) for t in r.tensors]:
        group = []
        for i, p in enumerate(field.parts):
            label = f"{name}: {parts[i] if i < 3 and name in r.fields and not name.startswith('GGUF.') else f'part {i}'}"
            group.append(Slot(p.ctypes.data - base, p.dtype, p.size, label))
        out.append(group)
    data_offset = r.data_offset
    del r
    return out, data_offset


def _interesting(rng: random.Random, dtype: np.dtype, old: float | int) -> float | int:
    if dtype.kind == "f":
        info = np.finfo(dtype)
        return rng.choice([math.nan, math.inf, -math.inf, 0.0, -0.0, -old, old * 1e30, old * 1e-30, float(info.tiny),
                           float(info.max), old * 2, old / 2, rng.uniform(-1e6, 1e6), 1.0, 0.5])
    if dtype.kind == "b":
        return rng.choice([0, 1, 2, 255])
    info = np.iinfo(dtype)
    pick = rng.choice([0, 1, 2, info.max, info.max - 1, info.min, old + 1, old - 1, old * 2, old // 2, old + 32,
                       old - 32, 1 << 31, 1 << 32, rng.randrange(info.min, info.max)])
    return min(max(pick, info.min), info.max)


def _set_value(raw: bytearray, slot: Slot, rng: random.Random) -> str:
    k = rng.randrange(slot.count)
    at = slot.at + k * slot.dtype.itemsize
    if slot.dtype == np.uint8 and slot.count > 1:          # a string's bytes
        new = rng.choice([0x00, 0xFF, 0x80, 0x20, rng.randrange(256)])
        raw[at] = new
        return f"{slot.label} byte {k} = {new:#x}"
    old = np.frombuffer(raw, slot.dtype, 1, at)[0].item()
    new = _interesting(rng, slot.dtype, old)
    with np.errstate(over="ignore", invalid="ignore"):
        raw[at:at + slot.dtype.itemsize] = np.array([new], dtype=slot.dtype).tobytes()
    return f"{slot.label}[{k}] {old!r} -> {new!r}"


def _mutant(good: bytes, all_slots: list[list[Slot]], data_offset: int, seed: int) -> tuple[bytes, str]:
    """One mutated file and what was done to it, from the seed alone."""
    rng = random.Random(seed)
    raw = bytearray(good)
    kind = rng.choices(["value", "values", "flip", "truncate", "splice"], weights=[50, 10, 20, 10, 10])[0]
    if kind in ("value", "values"):
        what = "; ".join(_set_value(raw, rng.choice(rng.choice(all_slots)), rng) for _ in range(1 + (kind == "values")))
        return bytes(raw), what
    if kind == "flip":
        where = [rng.randrange(data_offset) for _ in range(rng.randint(1, 3))]
        for at in where:
            raw[at] ^= rng.randrange(1, 256)
        return bytes(raw), f"flipped bytes at {where}"
    if kind == "truncate":
        cut = rng.randrange(data_offset + 256)
        return bytes(raw[:cut]), f"truncated to {cut} bytes"
    at, n = rng.randrange(data_offset), rng.randint(1, 16)
    if rng.random() < 0.5:
        return bytes(raw[:at] + bytes(rng.randrange(256) for _ in range(n)) + raw[at:]), f"inserted {n} bytes at {at}"
    return bytes(raw[:at] + raw[at + n:]), f"deleted {n} bytes at {at}"


def _finite_run(model, native: bool) -> None:
    """Compile the model's graphs (every pass) and generate from them; the logits must be finite."""
    prefill, decode = compile_graphs(model, CompileOptions(weights="native" if native else "q8_0", max_seq_len=16,
                                                           prefill_chunk=4, kv_type="f32"))
    engine = Engine(ReferenceBackend({"prefill": prefill, "decode": decode}), 4, 16)
    gen = engine.generate([0, 5, 9, 30, 41, 2], 3, Sampler(SamplerConfig()), keep_logits=True)
    assert all(np.isfinite(row).all() for row in gen.logits)


def _compiled_run(path: Path, tmp: Path) -> None:
    """llmrs-compile's whole path (LLVM code included) and the CPU back end; finite logits."""
    plan = tmp / "mutant.plan.bin"
    assert compile_main([str(path), "-o", str(plan), "--target", "cpu", "--max-seq-len", "16",
                         "--prefill-chunk", "4", "-q"]) == 0
    opened = Plan.open(plan, verify="always")
    backend = CpuBackend(opened, threads=1)
    try:
        gen = Engine(backend, 4, 16).generate([0, 5, 9, 30, 41], 3, Sampler(SamplerConfig()), keep_logits=True)
    finally:
        backend.close()
    assert all(np.isfinite(row).all() for row in gen.logits)


def fuzz(tmp: Path, cases: int, runs: int, compiled_runs: int) -> dict[str, int]:
    """Run `cases` mutants; the first `runs` distinct ones that load are compiled and run (the first
    `compiled_runs` of those through llmrs-compile and the CPU back end too). Returns counts."""
    good_path = tiny_gguf(tmp / "good.gguf")
    good = good_path.read_bytes()
    all_slots, data_offset = slots(good_path)
    path = tmp / "mutant.gguf"
    seen: set[bytes] = set()
    counts = {"refused": 0, "loaded": 0, "run": 0}
    for case in range(cases):
        data, what = _mutant(good, all_slots, data_offset, SEED + case)
        path.write_bytes(data)
        where = f"case {case} (seed {SEED + case}): {what}"
        try:
            with deadline(PARSE_SECONDS):
                model = load_model(path)
        except ModelError as e:
            msg = str(e)
            assert "\n" not in msg and str(path) in msg, f"{where}: error is not one line naming the file: {msg!r}"
            counts["refused"] += 1
            continue
        except Exception as e:   # noqa: BLE001  (anything else is the failure being looked for)
            pytest.fail(f"{where}: {type(e).__name__}: {e}", pytrace=True)
        counts["loaded"] += 1
        check_ranges(model.config, str(path))
        digest = hashlib.sha1(data).digest()
        if digest in seen or counts["run"] >= runs:
            continue
        seen.add(digest)
        try:
            with deadline(RUN_SECONDS):
                _finite_run(model, native=counts["run"] % 2 == 0)
                if counts["run"] < compiled_runs:
                    _compiled_run(path, tmp)
        except ModelError as e:   # a check that needs the data (a weight that is not a number)
            assert "\n" not in str(e), f"{where}: {e!r}"
        except Exception as e:   # noqa: BLE001
            pytest.fail(f"{where}: loaded, then {type(e).__name__}: {e}", pytrace=True)
        counts["run"] += 1
    return counts


def test_the_tiny_gguf_loads_and_runs_unmutated(tmp_path):
    model = load_model(tiny_gguf(tmp_path / "good.gguf"))
    assert model.config.num_hidden_layers == 2 and model.config.vocab_size == len(TOKENS)
    _finite_run(model, native=True)


def test_mutants_decode_to_their_mutation(tmp_path):
    """The mutator changes what it says it changed, and each seed gives one mutant."""
    good_path = tiny_gguf(tmp_path / "good.gguf")
    good = good_path.read_bytes()
    all_slots, data_offset = slots(good_path)
    theta = next(s for g in all_slots for s in g if s.label.startswith("llama.rope.freq_base") and s.dtype == np.float32)
    assert np.frombuffer(good, np.float32, 1, theta.at)[0] == 10000.0
    assert _mutant(good, all_slots, data_offset, 5) == _mutant(good, all_slots, data_offset, 5)
    assert len({_mutant(good, all_slots, data_offset, s)[0] for s in range(50)}) > 40


def test_300_mutated_ggufs_are_refused_in_one_line_or_run_finite(tmp_path):
    counts = fuzz(tmp_path, 300, runs=2, compiled_runs=0)
    assert counts["refused"] + counts["loaded"] == 300 and counts["refused"] > 150 and counts["run"] >= 1


@pytest.mark.slow
def test_10000_mutated_ggufs_are_refused_in_one_line_or_run_finite(tmp_path):
    counts = fuzz(tmp_path, 10_000, runs=12, compiled_runs=2)
    assert counts["refused"] + counts["loaded"] == 10_000 and counts["run"] >= 4
