"""Mutated plan files through the plan reader: the header, the manifest's bytes, its section and
tensor tables, its graphs, memory plans and run keys, and section bytes; with the checksums left
as they were (every such mutant must be refused) and re-sealed (so that mutations reach what the
manifest means). Each mutant is a one-line PlanError naming the file, or a plan that runs: the
tokenizer reads, and a short generation on the reference back end gives finite logits (or a
one-line EngineError). Anything else, a traceback or a hang (a per-case alarm), fails, printing
the case's seed and mutation.

The weights section's bytes are left alone when re-sealing: a weights section rewritten with a
matching checksum is another model, not a damaged plan; the run's check of its logits covers it.
"""
from __future__ import annotations

import copy
import hashlib
import json
import math
import random
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from llmrs.compiler.pipeline import CompileOptions, compile_graphs
from llmrs.compiler.plan import HEADER, write_graph_plan
from llmrs.models.llama import load_model
from llmrs.runtime.backends.reference import ReferenceBackend
from llmrs.runtime.engine import Engine, EngineError
from llmrs.runtime.plan import Plan, PlanError
from llmrs.runtime.sampler import Sampler, SamplerConfig

from ..compiler.test_fuzz_gguf import deadline
from ..conftest import DATA
from .test_plan_reader import header_fields, manifest_of, restamp, with_manifest

SEED = 20261128
OPEN_SECONDS = 5
RUN_SECONDS = 60
HEADER_FIELDS = ["magic", "version", "header_bytes", "file_bytes", "manifest_offset", "manifest_bytes",
                 "manifest_crc32", "reserved", "crc"]


def base_plan(path: Path) -> Path:
    """golden-a compiled by every pass (fused ops, folded RoPE tables, q8_0 weights, a memory
    plan) with the manifest llmrs-compile writes, a tokenizer and no code: small and quick to open."""
    model = load_model(DATA / "golden-a")
    prefill, decode = compile_graphs(model, CompileOptions(weights="q8_0", kv_type="f32", max_seq_len=16,
                                                           prefill_chunk=4))
    cfg = model.config
    manifest = {"model": cfg.to_json(), "compile_options": {"weights": "q8_0", "targets": []},
                "compile_command": "llmrs-compile golden-a -o p.bin", "stop_ids": list(cfg.eos_token_ids),
                "bos_id": cfg.bos_token_id, "chat_template": model.chat_template, "bos_token": model.bos_token,
                "eos_token": model.eos_token, "prefill_chunk": 4, "max_seq_len": 16}
    write_graph_plan(path, {"prefill": prefill, "decode": decode}, manifest, {"tokenizer.json": model.tokenizer_json})
    return path


def code_plan(path: Path) -> Path:
    """base_plan's model with this host's CPU object code (no LLVM IR text): what the CPU back end
    runs, for mutants of the manifest that compiled kernels then read."""
    from llmrs.compiler.codegen import llvm
    from llmrs.compiler.codegen.llvm_target import host_target

    model = load_model(DATA / "golden-a")
    prefill, decode = compile_graphs(model, CompileOptions(weights="q8_0", kv_type="f32", max_seq_len=16,
                                                           prefill_chunk=4))
    graphs = {"prefill": prefill, "decode": decode}
    target = host_target()
    _, obj = llvm.generate(graphs, target)
    manifest = {**manifest_of(base_plan(path).read_bytes()), "compile_options": {"targets": ["cpu"]}}
    for key in ("sections", "tensors", "graphs"):
        del manifest[key]
    write_graph_plan(path, graphs, manifest, {f"llvm.{target.triple}": obj, "tokenizer.json": model.tokenizer_json})
    return path


# llmrs-run's path on the CPU back end, in a child: a kernel that writes outside its buffer kills
# the child, not the test run
_CPU_RUN = r"""
import sys
import numpy as np
from llmrs.runtime.backends.cpu import CpuBackend
from llmrs.runtime.engine import Engine, EngineError
from llmrs.runtime.plan import Plan, PlanError
from llmrs.runtime.sampler import Sampler, SamplerConfig
try:
    plan = Plan.open(sys.argv[1], verify="always")
    m = plan.manifest
    backend = CpuBackend(plan, threads=1)
    engine = Engine(backend, m["prefill_chunk"], m["max_seq_len"], tuple(m.get("stop_ids", ())))
    gen = engine.generate(plan.tokenizer().encode("Once upon a time").ids, 3, Sampler(SamplerConfig()),
                          keep_logits=True)
except (PlanError, EngineError) as e:
    assert "\n" not in str(e)
    print("refused")
else:
    print("finite" if all(np.isfinite(r).all() for r in gen.logits) else "NOT FINITE")
"""


def _cpu_run_in_child(path: Path, where: str) -> str:
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _CPU_RUN, str(path)], capture_output=True, text=True,
                          timeout=RUN_SECONDS)
    out = done.stdout.strip()
    assert done.returncode == 0 and out in ("finite", "refused"), \
        f"{where}: the CPU back end's run ended with code {done.returncode}: {out} {done.stderr[-800:]}"
    return out


def leaves(value: Any, path: tuple = ()) -> list[tuple]:
    """The path of every JSON value inside `value` (containers too, so they can be emptied)."""
    out = [path] if path else []
    if isinstance(value, dict):
        for k, v in value.items():
            out += leaves(v, path + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += leaves(v, path + (i,))
    return out


def _other(rng: random.Random, v: Any) -> Any:
    """A value like v but wrong in a way a broken writer could make it."""
    if isinstance(v, bool):
        return rng.choice([not v, 0, None, "true"])
    if isinstance(v, int):
        return rng.choice([v + 1, v - 1, v * 2, v // 2, 0, -1, -v, v + 64, v - 64, 1 << 40, 1 << 62, float(v) + 0.5,
                           str(v), None, [v], True])
    if isinstance(v, float):
        return rng.choice([math.nan, math.inf, -math.inf, 0.0, -v, v * 1e30, v * 1e-30, v * 2, 1, str(v), None])
    if isinstance(v, str):
        return rng.choice(["", v + "x", v[:-1], "f32", "q8_0", "decode", "model.norm.weight", "logits", "tokens",
                           v.upper(), 7, None, "\u0000", "ffffffff"])
    if isinstance(v, list):
        choice = rng.randrange(5)
        if choice == 0 or not v:
            return []
        if choice == 1:
            return v[:-1]
        if choice == 2:
            return v + v[-1:]
        if choice == 3:
            return list(reversed(v))
        return {"0": v[0]}
    if isinstance(v, dict):
        keys = list(v)
        if keys and rng.random() < 0.6:
            return {k: x for k, x in v.items() if k != rng.choice(keys)}
        return {**v, rng.choice(["x", "extra", "offset", "size"]): rng.choice([0, -1, "x", None])}
    return rng.choice([0, "", [], {}])


def _set(manifest: Any, path: tuple, value: Any, delete: bool) -> None:
    parent = manifest
    for k in path[:-1]:
        parent = parent[k]
    if delete and isinstance(parent, dict):
        del parent[path[-1]]
    else:
        parent[path[-1]] = value


def _pick_path(rng: random.Random, by_region: dict[str, list[tuple]]) -> tuple:
    region = rng.choices(list(by_region), weights=[35, 15, 10, 15, 25])[0]
    return rng.choice(by_region[region])


def _regions(manifest: dict) -> dict[str, list[tuple]]:
    paths = leaves(manifest)
    layout = [p for p in paths if len(p) > 3 and p[0] == "graphs" and p[2:4] == ("meta", "layout")]
    graphs = [p for p in paths if p[:1] == ("graphs",) and p not in set(layout)]
    return {"graphs": graphs, "tensors": [p for p in paths if p[:1] == ("tensors",)],
            "sections": [p for p in paths if p[:1] == ("sections",)], "layout": layout,
            "top": [p for p in paths if p[:1] not in (("graphs",), ("tensors",), ("sections",))]}


def _sealed_manifest_bytes(raw: bytes, rng: random.Random) -> tuple[bytes, str]:
    """Bytes of the manifest's text changed, its checksum and the header's made right again."""
    f = header_fields(raw)
    body = bytearray(raw)
    where = [f[4] + rng.randrange(f[5]) for _ in range(rng.randint(1, 3))]
    for at in where:
        body[at] = rng.choice([ord(c) for c in '0123456789-.eE"{}[],:nul '] + [rng.randrange(256)])
    text = bytes(body[f[4]:f[4] + f[5]])
    return restamp(bytes(body), manifest_crc32=zlib.crc32(text)), f"manifest bytes at {where}, re-sealed"


def _sealed_section(raw: bytes, rng: random.Random) -> tuple[bytes, str]:
    """The tokenizer section's bytes changed and its checksum in the manifest made right again."""
    sec = manifest_of(raw)["sections"]["tokenizer.json"]
    body = bytearray(raw)
    where = [sec["offset"] + rng.randrange(sec["size"]) for _ in range(rng.randint(1, 4))]
    for at in where:
        body[at] = rng.choice([ord(c) for c in '"{}[],:\\ 0'] + [rng.randrange(256)])
    crc = zlib.crc32(bytes(body[sec["offset"]:sec["offset"] + sec["size"]]))

    def reseal(m):
        m["sections"]["tokenizer.json"]["crc32"] = f"{crc:08x}"
    return with_manifest(bytes(body), reseal), f"tokenizer.json bytes at {where}, re-sealed"


def _mutant(raw: bytes, manifest: dict, by_region: dict[str, list[tuple]], seed: int) -> tuple[bytes, str, bool]:
    """(mutated file, what was done, whether the checksums were made to match again)."""
    rng = random.Random(seed)
    kind = rng.choices(["flip", "truncate", "header", "manifest-bytes", "leaf", "leaves", "section"],
                       weights=[15, 5, 10, 10, 45, 10, 5])[0]
    if kind == "flip":
        body = bytearray(raw)
        f = header_fields(raw)
        end = max(f[4] + f[5], manifest["sections"]["weights"]["offset"] + 512)
        where = [rng.randrange(min(end, len(raw))) for _ in range(rng.randint(1, 3))]
        for at in where:
            body[at] ^= rng.randrange(1, 256)
        return bytes(body), f"flipped bytes at {where}", False
    if kind == "truncate":
        cut = rng.randrange(len(raw))
        return raw[:cut], f"truncated to {cut} bytes", False
    if kind == "header":
        name = rng.choice(HEADER_FIELDS[1:7])
        old = header_fields(raw)[HEADER_FIELDS.index(name)]
        new = rng.choice([0, 1, 2, old + 1, old - 1, old + 64, old * 2, (1 << 32) - 1, 64, 4096]) % (1 << 32)
        return restamp(raw, **{name: new}), f"header {name} {old} -> {new}, re-sealed", True
    if kind == "manifest-bytes":
        return (*_sealed_manifest_bytes(raw, rng), True)
    if kind == "section":
        return (*_sealed_section(raw, rng), True)
    changes = []

    def change(m):
        for _ in range(1 + (kind == "leaves")):
            path = _pick_path(rng, by_region)
            delete = rng.random() < 0.1
            try:
                old = m
                for k in path:
                    old = old[k]
            except (KeyError, IndexError, TypeError):   # a first change moved it
                continue
            new = None if delete else _other(rng, old)
            _set(m, path, new, delete)
            changes.append(f"{'/'.join(map(str, path))}: " + ("deleted" if delete else f"{str(old)[:40]} -> {str(new)[:40]}"))

    return with_manifest(raw, change), "; ".join(changes) + ", re-sealed", True


def _short_run(plan: Plan) -> None:
    """What llmrs-run does with a plan: its tokenizer, then prefill and decode; finite logits."""
    m = plan.manifest
    ids = plan.tokenizer().encode("Once upon a time").ids
    engine = Engine(ReferenceBackend(plan.graphs()), m["prefill_chunk"], m["max_seq_len"], tuple(m.get("stop_ids", ())))
    gen = engine.generate(ids, 3, Sampler(SamplerConfig()), keep_logits=True)
    assert gen.logits and all(np.isfinite(row).all() for row in gen.logits), "non-finite logits"


def fuzz(tmp: Path, cases: int, runs: int, cpu_runs: int = 0) -> dict[str, int]:
    """`cases` mutants; the first `runs` distinct ones that open are run on the reference back
    end. With cpu_runs, the mutants are of a plan with CPU code, and that many of those that open
    also run on the CPU back end (in a child process)."""
    raw = (code_plan if cpu_runs else base_plan)(tmp / "good.plan.bin").read_bytes()
    manifest = manifest_of(raw)
    by_region = _regions(manifest)
    path = tmp / "mutant.plan.bin"
    seen: set[bytes] = set()
    counts = {"refused": 0, "opened": 0, "run": 0, "run refused": 0, "cpu run": 0}
    for case in range(cases):
        data, what, sealed = _mutant(raw, copy.deepcopy(manifest), by_region, SEED + case)
        where = f"case {case} (seed {SEED + case}): {what}"
        path.write_bytes(data)
        try:
            with deadline(OPEN_SECONDS):
                plan = Plan.open(path, verify="always")
        except PlanError as e:
            msg = str(e)
            assert "\n" not in msg and msg.startswith(str(path)), f"{where}: not one line naming the file: {msg!r}"
            counts["refused"] += 1
            continue
        except Exception as e:   # noqa: BLE001  (anything else is the failure being looked for)
            pytest.fail(f"{where}: {type(e).__name__}: {e}", pytrace=True)
        assert sealed or data == raw, f"{where}: damage with stale checksums went unnoticed"
        counts["opened"] += 1
        digest = hashlib.sha1(data).digest()
        if digest in seen or counts["run"] >= runs:
            continue
        seen.add(digest)
        counts["run"] += 1
        try:
            with deadline(RUN_SECONDS):
                _short_run(plan)
        except (PlanError, EngineError) as e:
            assert "\n" not in str(e), f"{where}: {e!r}"
            counts["run refused"] += 1
        except Exception as e:   # noqa: BLE001
            pytest.fail(f"{where}: opened, then {type(e).__name__}: {e}", pytrace=True)
        if counts["cpu run"] < cpu_runs and data != raw:
            _cpu_run_in_child(path, where)
            counts["cpu run"] += 1
    return counts


def test_the_base_plan_opens_and_runs(tmp_path):
    plan = Plan.open(base_plan(tmp_path / "p.bin"), verify="always")
    _short_run(plan)
    assert plan.graphs()["decode"].kernel_count() < len(load_model(DATA / "golden-a").tensors)


def test_sealed_mutants_keep_valid_checksums(tmp_path):
    """A re-sealed mutant fails for what it means, not for its checksums."""
    raw = base_plan(tmp_path / "p.bin").read_bytes()
    manifest = manifest_of(raw)

    def retitle(m):
        m["compile_command"] = "llmrs-compile elsewhere -o p.bin"
    path = tmp_path / "sealed.bin"
    path.write_bytes(with_manifest(raw, retitle))
    assert Plan.open(path, verify="always").manifest["compile_command"] == "llmrs-compile elsewhere -o p.bin"
    data, what, sealed = _mutant(raw, copy.deepcopy(manifest), _regions(manifest), 11)
    assert sealed == ("re-sealed" in what) and len(data) >= HEADER.size


def test_300_mutated_plans_are_refused_in_one_line_or_run_finite(tmp_path):
    counts = fuzz(tmp_path, 300, runs=6)
    assert counts["refused"] + counts["opened"] == 300 and counts["refused"] > 150 and counts["run"] >= 3


@pytest.mark.slow
def test_10000_mutated_plans_are_refused_in_one_line_or_run_finite(tmp_path):
    counts = fuzz(tmp_path, 10_000, runs=40)
    assert counts["refused"] + counts["opened"] == 10_000 and counts["run"] >= 20


@pytest.mark.slow
def test_mutated_plans_with_cpu_code_are_refused_or_run_finite_on_the_cpu_back_end(tmp_path):
    counts = fuzz(tmp_path, 600, runs=10, cpu_runs=6)
    assert counts["cpu run"] == 6
