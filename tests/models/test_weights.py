"""Safetensors loading: single and sharded files, bf16/f16/f32, memory-mapped, checked against config."""
import json
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from llmrs.compiler.interpret import Interpreter
from llmrs.models.config import ModelError
from llmrs.models.llama import build_graphs, load_model
from llmrs.models.safetensors_io import f32_to_bf16, read_header, write
from llmrs.models.tiny import make_model

from ..conftest import DATA, rel_err


def _copy_model(tmp_path, name="golden-a"):
    dst = tmp_path / name
    shutil.copytree(DATA / name, dst)
    return dst


def _tensors(path):
    model = load_model(path)
    # copies: the tests rewrite the file these would otherwise map
    return {n: np.array(r.load()) for n, r in model.tensors.items()}


def test_weights_are_memory_mapped_not_read():
    model = load_model(DATA / "golden-a")
    arr = model.tensors["model.embed_tokens.weight"].load()
    assert isinstance(arr, np.memmap) and arr.shape == (384, 64)


def test_our_writer_agrees_with_the_safetensors_library(tmp_path):
    rng = np.random.default_rng(0)
    a = rng.standard_normal((5, 64)).astype(np.float32)
    b = rng.standard_normal((3,)).astype(np.float16)
    write(tmp_path / "m.safetensors", {"a": (a, "f32"), "b": (b, "f16")})
    back = load_file(tmp_path / "m.safetensors")
    np.testing.assert_array_equal(back["a"], a)
    np.testing.assert_array_equal(back["b"], b)
    save_file({"a": a}, tmp_path / "lib.safetensors")
    ref = read_header(tmp_path / "lib.safetensors")["a"]
    np.testing.assert_array_equal(ref.load(), a)


def test_bf16_rounding_matches_round_to_nearest_even():
    x = np.array([1.0, 1.00390625, 1.01171875, -3.14159, 1e-40, 3.0e38], np.float32)
    bits = f32_to_bf16(x)
    back = (bits.astype(np.uint32) << 16).view(np.float32)
    # 1 + 2^-8 is a tie between 1 and 1 + 2^-7: even mantissa wins (1.0)
    assert back[0] == 1.0 and back[1] == 1.0 and back[2] == 1.015625
    normal = np.abs(x) > 1e-37  # bf16 keeps f32's exponent range; denormals lose precision
    assert np.all(np.abs(back - x)[normal] <= np.abs(x)[normal] * 2.0 ** -8)


@pytest.mark.parametrize("dtype, tol", [("f32", 0.0), ("f16", 1e-3), ("bf16", 8e-3)])
def test_each_stored_dtype_loads_to_the_same_model(tmp_path, dtype, tol):
    make_model(tmp_path / "f32", "golden-a", seed=3, dtype="f32")
    make_model(tmp_path / dtype, "golden-a", seed=3, dtype=dtype)
    ref_pre, _ = build_graphs(load_model(tmp_path / "f32"), 8, 16)
    pre, _ = build_graphs(load_model(tmp_path / dtype), 8, 16)
    tokens = np.array([5, 17, 200, 3], np.int32)
    ref = Interpreter(ref_pre).run({"tokens": tokens}, Interpreter(ref_pre).new_state(), 0)["logits"]
    got = Interpreter(pre).run({"tokens": tokens}, Interpreter(pre).new_state(), 0)["logits"]
    assert rel_err(got, ref) <= max(tol * 10, 1e-6)


def test_sharded_checkpoint_loads_like_the_single_file(tmp_path):
    src = _tensors(DATA / "golden-b")
    dst = _copy_model(tmp_path, "golden-b")
    (dst / "model.safetensors").unlink()
    names = sorted(src)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    for fname, part in shards.items():
        write(dst / fname, {n: (src[n], "bf16") for n in part})
    index = {"metadata": {}, "weight_map": {n: f for f, part in shards.items() for n in part}}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    got = _tensors(dst)
    assert got.keys() == src.keys()
    for n in src:
        np.testing.assert_array_equal(got[n], src[n])


def test_missing_tensor_is_named(tmp_path):
    dst = _copy_model(tmp_path)
    t = _tensors(dst)
    del t["model.layers.1.mlp.up_proj.weight"]
    write(dst / "model.safetensors", {n: (a, "f32") for n, a in t.items()})
    with pytest.raises(ModelError, match="tensor 'model.layers.1.mlp.up_proj.weight' is missing"):
        load_model(dst)


def test_wrong_shape_is_named(tmp_path):
    dst = _copy_model(tmp_path)
    t = _tensors(dst)
    t["model.layers.0.self_attn.k_proj.weight"] = np.ones((16, 64), np.float32)
    write(dst / "model.safetensors", {n: (a, "f32") for n, a in t.items()})
    with pytest.raises(ModelError, match=r"k_proj.weight' has shape \[16, 64\], config.json implies \[32, 64\]"):
        load_model(dst)


def test_extra_tensor_is_named(tmp_path):
    dst = _copy_model(tmp_path)
    t = _tensors(dst)
    t["model.layers.0.self_attn.q_proj.bias"] = np.ones((64,), np.float32)
    write(dst / "model.safetensors", {n: (a, "f32") for n, a in t.items()})
    with pytest.raises(ModelError, match="unexpected tensor 'model.layers.0.self_attn.q_proj.bias'"):
        load_model(dst)


def test_truncated_weights_file_is_refused(tmp_path):
    dst = _copy_model(tmp_path)
    f = dst / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(ModelError, match="outside the file"):
        load_model(dst)


def test_missing_shard_is_named(tmp_path):
    dst = _copy_model(tmp_path)
    (dst / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "model-1.safetensors"}}))
    with pytest.raises(ModelError, match="shard model-1.safetensors is missing"):
        load_model(dst)


def test_unsupported_tensor_dtype_is_named(tmp_path):
    dst = _copy_model(tmp_path)
    t = load_file(dst / "model.safetensors")
    t["model.norm.weight"] = t["model.norm.weight"].astype(np.int32)
    save_file(t, dst / "model.safetensors")
    with pytest.raises(ModelError, match="'model.norm.weight' has dtype I32"):
        load_model(dst)
