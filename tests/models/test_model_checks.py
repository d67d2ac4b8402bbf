"""Damaged model files are one-line ModelErrors naming the key, the tensor or the file, before a
graph is built: GGUF tensor tables (offsets, alignment, overlap), hyper-parameters out of range in
a GGUF or a config.json, and tokenizers that the tokenizers library cannot read."""
import json
import math
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmrs.compiler.cli import main as compile_main
from llmrs.models.config import ModelError, check_ranges, parse_config
from llmrs.models.llama import load_model
from llmrs.models.tiny import make_config

from ..conftest import DATA
from .gguf_files import hf_to_gguf, patch, value_span


@pytest.fixture(scope="module")
def good_gguf(tmp_path_factory) -> Path:
    return hf_to_gguf(DATA / "golden-a", tmp_path_factory.mktemp("gguf") / "golden-a.gguf")


def _refused(path: Path, message: str) -> str:
    with pytest.raises(ModelError) as e:
        load_model(path)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(str(path)) and message in msg, msg
    return msg


def test_a_tensor_offset_moved_by_one_byte_is_refused_naming_the_tensor(good_gguf, tmp_path):
    at, _ = value_span(good_gguf, "blk.0.attn_q.weight")
    offset = struct.unpack_from("<Q", good_gguf.read_bytes(), at)[0]
    bad = patch(good_gguf, "blk.0.attn_q.weight", "<Q", offset + 1, tmp_path / "moved.gguf")
    _refused(bad, f"tensor 'blk.0.attn_q.weight' starts at data offset {offset + 1}, not a multiple of the "
                  "file's alignment 32")


def test_a_tensor_moved_onto_its_neighbour_is_refused(good_gguf, tmp_path):
    at, _ = value_span(good_gguf, "blk.0.attn_k.weight")
    offset = struct.unpack_from("<Q", good_gguf.read_bytes(), at)[0]
    bad = patch(good_gguf, "blk.0.attn_k.weight", "<Q", offset - 32, tmp_path / "overlap.gguf")
    _refused(bad, "overlap in the file: its tensor table is damaged")


def test_a_tensor_past_the_end_of_the_file_is_refused(good_gguf, tmp_path):
    bad = patch(good_gguf, "output_norm.weight", "<Q", 1 << 40, tmp_path / "far.gguf")
    _refused(bad, "truncated or corrupt GGUF file")


@pytest.mark.parametrize("key, fmt, value, message", [
    ("llama.rope.freq_base", "<f", 2.9e-34, "llama.rope.freq_base is 2.9e-34; it must be above 1 and at most 1e+12"),
    ("llama.rope.freq_base", "<f", math.nan, "llama.rope.freq_base is nan"),
    ("llama.rope.freq_base", "<f", math.inf, "llama.rope.freq_base is inf"),
    ("llama.rope.freq_base", "<f", -10000.0, "llama.rope.freq_base is -10000"),
    ("llama.attention.layer_norm_rms_epsilon", "<f", 0.0, "llama.attention.layer_norm_rms_epsilon is 0; it must be above 0"),
    ("llama.attention.layer_norm_rms_epsilon", "<f", math.nan, "llama.attention.layer_norm_rms_epsilon is nan"),
    ("llama.attention.layer_norm_rms_epsilon", "<f", 3e38, "llama.attention.layer_norm_rms_epsilon is 3e+38"),
    ("llama.block_count", "<I", 1 << 31, f"llama.block_count is {1 << 31}; a Llama's is 1 to 4096"),
    ("llama.block_count", "<I", 0, "llama.block_count is 0; it must be positive"),
    ("llama.context_length", "<I", 0, "llama.context_length is 0; it must be positive"),
    ("llama.embedding_length", "<I", 1 << 30, f"llama.embedding_length is {1 << 30}; a Llama's is 1 to 131072"),
])
def test_gguf_hyper_parameters_out_of_range_are_refused_naming_the_key(good_gguf, tmp_path, key, fmt, value, message):
    _refused(patch(good_gguf, key, fmt, value, tmp_path / "bad.gguf"), message)


def test_a_damaged_gguf_never_becomes_a_plan(good_gguf, tmp_path, capsys):
    bad = patch(good_gguf, "llama.rope.freq_base", "<f", 2.9e-34, tmp_path / "theta.gguf")
    out = tmp_path / "theta.plan.bin"
    assert compile_main([str(bad), "-o", str(out), "-q"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "llama.rope.freq_base is 2.9e-34" in err and not out.exists()


def _nan_at(tensor: str, index: int):
    """A hf_to_gguf edit that makes one value of `tensor` NaN."""
    def edit(meta, tensors):
        data, kind = tensors[tensor]
        data = data.copy()
        data[index] = math.nan
        tensors[tensor] = (data, kind)
    return edit


def test_rope_frequency_factors_that_are_not_numbers_are_refused(tmp_path):
    bad = hf_to_gguf(DATA / "golden-b", tmp_path / "nan-freqs.gguf", edit=_nan_at("rope_freqs.weight", 3))
    _refused(bad, "tensor 'rope_freqs.weight' holds a value that is not a positive number")


def test_a_gguf_tokenizer_with_more_tokens_than_embedding_rows_is_refused(tmp_path):
    def extra_token(meta, tensors):
        meta["tokenizer.ggml.tokens"] = meta["tokenizer.ggml.tokens"] + ["<|extra|>"]
        meta["tokenizer.ggml.token_type"] = meta["tokenizer.ggml.token_type"] + [1]

    bad = hf_to_gguf(DATA / "golden-a", tmp_path / "extra.gguf", edit=extra_token)
    _refused(bad, "token id 384 is outside the model's 384-row embedding")


_V4 = make_config("llama-3.2-1b")


@pytest.mark.parametrize("change, message", [
    ({"rope_theta": 2.9e-34}, "rope_theta is 2.9e-34; it must be above 1"),
    ({"rope_theta": "10000"}, 'rope_theta is "10000"; it must be a number'),
    ({"rms_norm_eps": -1e-5}, "rms_norm_eps is -1e-05; it must be above 0"),
    ({"rms_norm_eps": None, "rope_theta": 1e300}, "rope_theta is 1e+300; it must be above 1 and at most 1e+12"),
    ({"num_hidden_layers": 1 << 40}, f"num_hidden_layers is {1 << 40}; a Llama's is 1 to 4096"),
    ({"num_hidden_layers": 2.5}, "num_hidden_layers is 2.5; it must be a whole number"),
    ({"num_hidden_layers": True}, "num_hidden_layers is true; it must be a whole number"),
    ({"hidden_size": -2048}, "hidden_size is -2048; it must be positive"),
    ({"vocab_size": 0}, "vocab_size is 0; a Llama's is 1 to 16777216"),
    ({"num_key_value_heads": -8}, "num_attention_heads 32 is not a multiple of num_key_value_heads -8"),
    ({"max_position_embeddings": 1 << 40}, f"max_position_embeddings is {1 << 40}"),
    ({"eos_token_id": [128001, 200000]}, "eos_token_id 200000 is outside the 128256-token vocabulary"),
    ({"eos_token_id": "</s>"}, 'eos_token_id holds "</s>"; token ids are whole numbers from 0'),
    ({"bos_token_id": -1}, "bos_token_id holds -1; token ids are whole numbers from 0"),
    ({"rope_scaling": {**_V4["rope_scaling"], "factor": math.inf}}, "rope_scaling factor is inf"),
    ({"rope_scaling": {**_V4["rope_scaling"], "factor": 0.0}}, "rope_scaling factor is 0"),
    ({"rope_scaling": {**_V4["rope_scaling"], "high_freq_factor": 0.5}},
     "rope_scaling low_freq_factor 1 is not below high_freq_factor 0.5"),
    ({"rope_scaling": [8.0]}, "rope_scaling is [8.0]; it must be an object or null"),
])
def test_config_json_values_out_of_range_are_refused_naming_the_key(change, message):
    with pytest.raises(ModelError) as e:
        parse_config({**_V4, **change})
    assert "\n" not in str(e.value) and message in str(e.value), str(e.value)


def test_transformers_5_layout_names_rope_parameters(tmp_path):
    raw = {k: v for k, v in _V4.items() if k not in ("rope_theta", "rope_scaling")}
    raw["rope_parameters"] = {"rope_type": "default", "rope_theta": -5.0}
    with pytest.raises(ModelError, match=r"rope_parameters\.rope_theta is -5; it must be above 1"):
        parse_config(raw)


def test_config_json_that_is_not_an_object_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps([1, 2]))
    with pytest.raises(ModelError, match=f"{tmp_path / 'config.json'}: not a JSON object"):
        load_model(tmp_path)


def test_a_broken_tokenizer_json_is_refused_at_compile_time(tmp_path, capsys):
    model = tmp_path / "model"
    shutil.copytree(DATA / "golden-a", model)
    spec = json.loads((model / "tokenizer.json").read_text())
    spec["model"]["merges"] = ["a b c"]           # three parts: not a merge
    (model / "tokenizer.json").write_text(json.dumps(spec))
    out = tmp_path / "p.plan.bin"
    assert compile_main([str(model), "-o", str(out), "-q"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"{model / 'tokenizer.json'}: not a tokenizer the tokenizers library can read" in err
    assert not out.exists()
    (model / "tokenizer.json").write_bytes(b"\xff\xfe not text")
    _refused_folder(model, f"{model / 'tokenizer.json'}: not UTF-8 text")


def _refused_folder(model: Path, message: str) -> None:
    with pytest.raises(ModelError) as e:
        load_model(model)
    assert "\n" not in str(e.value) and message in str(e.value), str(e.value)


def test_a_tokenizer_with_ids_past_the_embedding_is_refused(tmp_path):
    model = tmp_path / "model"
    shutil.copytree(DATA / "golden-a", model)
    spec = json.loads((model / "tokenizer.json").read_text())
    spec["model"]["vocab"]["far-away"] = 1000
    (model / "tokenizer.json").write_text(json.dumps(spec))
    _refused_folder(model, "token id 1000 is outside the model's 384-row embedding")


def test_a_folder_without_tokenizer_compiles_with_a_notice_and_the_run_says_why(tmp_path, capsys):
    from llmrs.runtime.cli import main as run_main

    model = tmp_path / "model"
    shutil.copytree(DATA / "golden-a", model)
    (model / "tokenizer.json").unlink()
    out = tmp_path / "p.plan.bin"
    assert compile_main([str(model), "-o", str(out), "--target", "cpu", "--max-seq-len", "16",
                         "--prefill-chunk", "4", "-q"]) == 0
    err = capsys.readouterr().err
    assert f"notice: {model} has no tokenizer.json: the plan will hold no tokenizer" in err
    assert run_main([str(out), "--prompt", "hi", "-n", "2", "--backend", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "the plan holds no tokenizer (its model had no tokenizer.json)" in err
    assert "backend" not in err


def test_a_weight_that_is_not_a_number_is_refused_naming_the_tensor(tmp_path, capsys):
    """Every logit would be NaN: refused while compiling, naming the file and the tensor."""
    bad = hf_to_gguf(DATA / "golden-a", tmp_path / "nan.gguf", edit=_nan_at("blk.1.ffn_norm.weight", 5))
    out = tmp_path / "nan.plan.bin"
    assert compile_main([str(bad), "-o", str(out), "--target", "cpu", "-q"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"{bad}: tensor 'blk.1.ffn_norm.weight' holds values that are not finite" in err
    assert not out.exists()


def test_a_quantized_block_with_an_infinite_scale_is_refused(tmp_path):
    from gguf import GGMLQuantizationType as GT

    def inf_scale(meta, tensors):
        data, kind = tensors["blk.0.attn_v.weight"]
        data = data.copy()
        data[3, 34:36] = np.array([np.inf], np.float16).view(np.uint8)   # the second block's f16 scale
        tensors["blk.0.attn_v.weight"] = (data, kind)

    bad = hf_to_gguf(DATA / "golden-a", tmp_path / "inf.gguf", lambda n, s: GT.Q8_0, edit=inf_scale)
    model = load_model(bad)
    with pytest.raises(ModelError, match=r"tensor 'blk.0.attn_v.weight' holds values that are not finite .* Q8_0"):
        model.tensors["model.layers.0.self_attn.v_proj.weight"].load()


def test_a_safetensors_weight_that_is_not_a_number_is_refused(tmp_path):
    model = tmp_path / "model"
    shutil.copytree(DATA / "golden-a", model)
    ref = load_model(model).tensors["model.layers.0.mlp.up_proj.weight"]
    raw = bytearray((model / "model.safetensors").read_bytes())
    width = {"f32": 4, "f16": 2, "bf16": 2}[ref.dtype]
    nan = {"f32": np.array([np.nan], np.float32), "f16": np.array([np.nan], np.float16),
           "bf16": np.array([0x7FC0], np.uint16)}[ref.dtype].tobytes()
    raw[ref.offset + 7 * width:ref.offset + 8 * width] = nan
    (model / "model.safetensors").write_bytes(bytes(raw))
    with pytest.raises(ModelError, match="tensor 'model.layers.0.mlp.up_proj.weight' holds values that are not finite"):
        load_model(model).tensors["model.layers.0.mlp.up_proj.weight"].load()


_JSON_VALUES = st.one_of(st.none(), st.booleans(), st.integers(-(1 << 70), 1 << 70), st.integers(-3, 5000),
                         st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=6),
                         st.lists(st.integers(-5, 200000), max_size=3), st.dictionaries(st.text(max_size=4),
                                                                                         st.integers(), max_size=2))


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(sorted(_V4) + ["rope_parameters"]), _JSON_VALUES, min_size=1, max_size=3))
def test_any_config_json_values_give_a_checked_config_or_one_line(change):
    try:
        cfg = parse_config({**_V4, **change})
    except ModelError as e:
        assert "\n" not in str(e) and str(e).startswith("config.json: ")
        return
    assert check_ranges(cfg, "config.json") is cfg and cfg.head_dim % 2 == 0
