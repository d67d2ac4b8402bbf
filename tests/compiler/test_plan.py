"""Graph serialization and the plan writer: exact round trips, byte layout, atomic writes."""
import json
import os
import struct
import weakref
import zlib
from pathlib import Path

import numpy as np
import pytest

from llmrs.compiler import quant
from llmrs.compiler.ir import Graph, IRError, LazyTensor
from llmrs.compiler.plan import (ALIGN, FORMAT_VERSION, HEADER, MAGIC, PlanWriteError, write_graph_plan,
                                 write_plan)
from llmrs.compiler.serialize import graph_from_json, graph_to_json
from llmrs.models.llama import build_graphs, load_model
from llmrs.runtime.plan import Plan

from ..conftest import DATA, run_steps


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMRS_CACHE_DIR", str(tmp_path / "cache"))


def _graphs(name: str, T: int = 8, S: int = 32) -> tuple[Graph, Graph]:
    return build_graphs(load_model(DATA / name), prefill_T=T, max_seq_len=S)


def _rt(g: Graph) -> Graph:
    """graph -> JSON text -> graph, as a plan stores it."""
    return graph_from_json(json.loads(json.dumps(graph_to_json(g))), g.weights)


def _same_graph(a: Graph, b: Graph) -> None:
    assert (a.name, a.T, a.inputs, a.outputs) == (b.name, b.T, b.inputs, b.outputs)
    assert a.values == b.values and list(a.values) == list(b.values)
    assert a.ops == b.ops
    assert a.meta == b.meta
    assert set(a.weights) == set(b.weights)


@pytest.mark.parametrize("name", ["golden-a", "golden-b"])
def test_graph_json_round_trip_is_exact(name):
    for g in _graphs(name):
        _same_graph(_rt(g), g)


def test_round_trip_keeps_tuples_numpy_scalars_and_layout_meta():
    g, _ = _graphs("golden-a")
    g.ops[3].attrs.update(tile=(4, 8), nested={"a": [1, (2.5, None)]}, n=np.int64(7), flag=np.bool_(True))
    g.meta["layout"] = {"alignment": 64, "arena": {"x.embed": 0, "logits": 4096}, "arena_bytes": 8192}
    back = _rt(g)
    assert back.ops[3].attrs["tile"] == (4, 8)
    assert back.ops[3].attrs["nested"] == {"a": [1, (2.5, None)]}
    assert type(back.ops[3].attrs["n"]) is int and back.ops[3].attrs["flag"] is True
    assert back.meta["layout"] == g.meta["layout"]
    assert graph_to_json(back) == graph_to_json(g)


def test_serializing_a_non_json_attr_names_the_op():
    g, _ = _graphs("golden-a")
    g.ops[2].attrs["bad"] = object()
    with pytest.raises(IRError, match=f"graph prefill op {g.ops[2].name} attrs"):
        graph_to_json(g)


def test_deserializing_without_a_weight_names_the_tensor():
    g, _ = _graphs("golden-a")
    weights = dict(g.weights)
    del weights["model.norm.weight"]
    with pytest.raises(IRError, match="'model.norm.weight' has no weight data"):
        graph_from_json(graph_to_json(g), weights)


@pytest.mark.parametrize("name", ["golden-a", "golden-b"])
def test_plan_graphs_give_the_same_logits_as_the_originals(tmp_path, name):
    prefill, decode = _graphs(name)
    write_graph_plan(tmp_path / "p.bin", {"prefill": prefill, "decode": decode})
    got = Plan.open(tmp_path / "p.bin").graphs()
    rng = np.random.default_rng(3)
    prompt = rng.integers(0, 300, size=11).astype(np.int32)  # two prefill chunks of T=8
    steps = rng.integers(0, 300, size=3).astype(np.int32)
    want_p, want_d = run_steps(prefill, decode, prompt, steps)
    got_p, got_d = run_steps(got["prefill"], got["decode"], prompt, steps)
    np.testing.assert_array_equal(got_p, want_p)
    np.testing.assert_array_equal(np.stack(got_d), np.stack(want_d))


def _regions(path) -> tuple[bytes, dict, list[tuple[int, int]]]:
    raw = path.read_bytes()
    _, _, _, file_bytes, m_off, m_size, m_crc, _, _ = HEADER.unpack(raw[:HEADER.size])
    manifest = json.loads(raw[m_off:m_off + m_size])
    spans = [(0, HEADER.size), (m_off, m_size)] + [(s["offset"], s["size"]) for s in manifest["sections"].values()]
    return raw, manifest, sorted(spans)


def test_plan_layout_is_aligned_checksummed_and_zero_padded(tmp_path):
    rng = np.random.default_rng(0)
    weights = {"a": LazyTensor.of(rng.standard_normal((3, 5)).astype(np.float32), "f32"),
               "q": LazyTensor.of(quant.quantize(rng.standard_normal((4, 64)), "q4_0"), "q4_0"),
               "b": LazyTensor.of(rng.integers(1, 60000, size=7).astype(np.uint16), "bf16")}
    info = write_plan(tmp_path / "p.bin", {"model": "x", "compile_command": "llmrs-compile m -o p.bin"},
                      {"opencl": "__kernel void k() {}", "llvm.x86_64-unknown-linux-gnu": b"\x7fELF\x01\x02"},
                      weights)
    raw, manifest, spans = _regions(tmp_path / "p.bin")
    magic, version, hsize, file_bytes, m_off, m_size, m_crc, reserved, h_crc = HEADER.unpack(raw[:HEADER.size])
    assert (magic, version, hsize, file_bytes) == (MAGIC, FORMAT_VERSION, HEADER.size, len(raw))
    assert reserved == bytes(16) and h_crc == zlib.crc32(raw[:HEADER.size - 4])
    assert m_crc == zlib.crc32(raw[m_off:m_off + m_size]) and info.file_bytes == len(raw)
    assert manifest["model"] == "x" and manifest["compile_command"].startswith("llmrs-compile")
    for name, s in manifest["sections"].items():
        assert s["offset"] % ALIGN == 0
        assert s["crc32"] == f"{zlib.crc32(raw[s['offset']:s['offset'] + s['size']]):08x}", name
    assert raw[manifest["sections"]["opencl"]["offset"]:][:20] == b"__kernel void k() {}"
    base = manifest["sections"]["weights"]["offset"]
    covered = np.zeros(len(raw), bool)
    for off, size in spans:
        covered[off:off + size] = True
    for name, t in manifest["tensors"].items():
        assert t["offset"] % ALIGN == 0
        data = raw[base + t["offset"]:base + t["offset"] + t["nbytes"]]
        assert data == weights[name].load().tobytes(), name
        covered[base + t["offset"]:base + t["offset"] + t["nbytes"]] = True
    assert manifest["tensors"]["q"] == {"dtype": "q4_0", "shape": [4, 64], "offset": 64, "nbytes": 4 * 2 * 18}
    # everything that is neither header, manifest, section nor tensor is zero padding
    assert not np.frombuffer(raw, np.uint8)[~covered].any()


def test_quantized_weights_come_back_byte_identical(tmp_path):
    rng = np.random.default_rng(5)
    w = {"w8": LazyTensor.of(quant.quantize(rng.standard_normal((6, 96)), "q8_0"), "q8_0"),
         "w16": LazyTensor.of(rng.standard_normal((2, 33)).astype(np.float16), "f16")}
    write_plan(tmp_path / "p.bin", {}, {}, w)
    plan = Plan.open(tmp_path / "p.bin")
    for name, lt in w.items():
        got = plan.weight(name)
        assert isinstance(got, np.memmap) and got.dtype == lt.load().dtype
        np.testing.assert_array_equal(got, lt.load())


def test_writer_holds_one_tensor_in_memory_at_a_time(tmp_path):
    alive: list[weakref.ref] = []
    peak = []

    def maker(seed: int):
        def make():
            peak.append(sum(r() is not None for r in alive))  # tensors alive when the next is made
            arr = np.random.default_rng(seed).standard_normal((64, 32)).astype(np.float32)
            alive.append(weakref.ref(arr))
            return arr
        return make

    weights = {f"t{i}": LazyTensor((64, 32), "f32", maker(i)) for i in range(6)}
    write_plan(tmp_path / "p.bin", {}, {}, weights)
    assert peak == [0] * 6


def test_failed_write_keeps_the_old_plan_and_leaves_no_temp_file(tmp_path):
    good = {"a": LazyTensor.of(np.arange(1, 9, dtype=np.float32), "f32")}
    write_plan(tmp_path / "p.bin", {"v": 1}, {}, good)
    before = (tmp_path / "p.bin").read_bytes()

    def boom():
        raise RuntimeError("quantizer failed")

    with pytest.raises(RuntimeError, match="quantizer failed"):
        write_plan(tmp_path / "p.bin", {"v": 2}, {}, {**good, "b": LazyTensor((4,), "f32", boom)})
    assert (tmp_path / "p.bin").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "cache") == ["p.bin"]


def test_a_write_the_system_refuses_names_the_plan_not_its_temp_file(tmp_path):
    target = tmp_path / "p.bin"
    target.mkdir()
    (target / "keep").write_text("x")   # os.replace cannot put a file over a non-empty folder
    w = {"a": LazyTensor.of(np.ones(4, np.float32), "f32")}
    with pytest.raises(PlanWriteError) as e:
        write_plan(target, {}, {}, w)
    assert str(e.value).startswith(f"plan {target} is a folder") and ".tmp" not in str(e.value)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "cache") == ["p.bin"]
    # a folder the system will not write in (root ignores permission bits; sysfs refuses everyone)
    folder = Path("/sys") if os.geteuid() == 0 else tmp_path / "ro"
    if folder != Path("/sys"):
        folder.mkdir()
        folder.chmod(0o500)
    with pytest.raises(PlanWriteError) as e:
        write_plan(folder / "p.bin", {}, {}, w)
    assert str(e.value).startswith(f"{folder / 'p.bin'}: cannot write the plan (") and ".tmp" not in str(e.value)


def test_writer_refuses_reserved_keys_sections_and_wrong_sized_data(tmp_path):
    w = {"a": LazyTensor.of(np.ones(4, np.float32), "f32")}
    with pytest.raises(PlanWriteError, match="'tensors' is filled in by write_plan"):
        write_plan(tmp_path / "p.bin", {"tensors": {}}, {}, w)
    with pytest.raises(PlanWriteError, match="'weights' is reserved"):
        write_plan(tmp_path / "p.bin", {}, {"weights": b"x"}, w)
    with pytest.raises(PlanWriteError, match="not JSON-serializable"):
        write_plan(tmp_path / "p.bin", {"x": object()}, {}, w)
    lying = {"a": LazyTensor((4,), "f32", lambda: np.ones(4, np.float32)),
             "b": LazyTensor((4, 32), "q8_0", lambda: np.ones(4 * 34, np.uint8))}
    with pytest.raises(IRError, match="expected uint8"):
        write_plan(tmp_path / "p.bin", {}, {}, lying)
    assert not (tmp_path / "p.bin").exists()


def test_graph_plan_stores_each_shared_weight_once(tmp_path):
    prefill, decode = _graphs("golden-b")
    info = write_graph_plan(tmp_path / "p.bin", {"prefill": prefill, "decode": decode},
                            {"compile_command": "c", "prefill_chunk": prefill.T, "max_seq_len": decode.kv_slots})
    assert info.n_tensors == len(prefill.weights) == len(decode.weights)
    plan = Plan.open(tmp_path / "p.bin")
    assert set(plan.manifest["graphs"]) == {"prefill", "decode"}
    assert plan.manifest["compile_command"] == "c"
    assert struct.unpack("<I", (tmp_path / "p.bin").read_bytes()[8:12]) == (FORMAT_VERSION,)


def test_compiled_graphs_round_trip_through_a_plan(tmp_path):
    """Fused ops, folded consts, quantized weights and the arena layout survive the plan."""
    from llmrs.compiler.pipeline import CompileOptions, compile_graphs
    prefill, decode = compile_graphs(DATA / "golden-b", CompileOptions(prefill_chunk=8, max_seq_len=32))
    write_graph_plan(tmp_path / "p.bin", {"prefill": prefill, "decode": decode})
    got = Plan.open(tmp_path / "p.bin").graphs()
    for want in (prefill, decode):
        _same_graph(got[want.name], want)
        for name, lt in want.weights.items():
            np.testing.assert_array_equal(got[want.name].weights[name].load(), lt.load())
    prompt = np.random.default_rng(4).integers(0, 300, size=10).astype(np.int32)
    want_p, want_d = run_steps(prefill, decode, prompt, prompt[:2])
    got_p, got_d = run_steps(got["prefill"], got["decode"], prompt, prompt[:2])
    np.testing.assert_array_equal(got_p, want_p)
    np.testing.assert_array_equal(np.stack(got_d), np.stack(want_d))
