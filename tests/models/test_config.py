"""config.json in both transformers layouts, and one-line refusals of what llmrs can't run."""
import json

import pytest

from llmrs.models.config import ModelError, load_config, parse_config
from llmrs.models.tiny import make_config

LLAMA3 = dict(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)


def _v4() -> dict:
    return make_config("llama-3.2-1b")


def _v5() -> dict:
    raw = _v4()
    scaling = raw.pop("rope_scaling")
    raw["rope_parameters"] = {"rope_theta": raw.pop("rope_theta"), **scaling}
    raw["dtype"] = raw.pop("torch_dtype")
    return raw


def test_transformers_4_and_5_layouts_give_the_same_config():
    a, b = parse_config(_v4()), parse_config(_v5())
    assert a == b
    assert a.rope_theta == 500000.0 and a.rope_scaling == LLAMA3
    assert (a.head_dim, a.num_key_value_heads, a.tie_word_embeddings) == (64, 8, True)
    assert a.n_params == 1_235_814_400  # Llama-3.2-1B's published parameter count


def test_missing_architectures_falls_back_to_model_type():
    raw = _v4()
    del raw["architectures"]
    assert parse_config(raw).hidden_size == 2048


def test_default_rope_type_means_no_scaling():
    raw = _v5()
    raw["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    cfg = parse_config(raw)
    assert cfg.rope_scaling is None and cfg.rope_theta == 10000.0


def test_eos_ids_merge_config_and_generation_config(tmp_path):
    raw = _v4()
    raw["eos_token_id"] = 128001
    (tmp_path / "config.json").write_text(json.dumps(raw))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [128001, 128009]}))
    assert load_config(tmp_path).eos_token_ids == (128001, 128009)


@pytest.mark.parametrize("change, message", [
    ({"architectures": ["MistralForCausalLM"]}, "architecture MistralForCausalLM is not supported"),
    ({"architectures": None, "model_type": "gemma2"}, "model_type 'gemma2' is not supported"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling type 'yarn' is not supported"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling type 'linear' is not supported"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "llama3 rope_scaling lacks low_freq_factor"),
    ({"attention_bias": True}, "attention_bias=true is not supported"),
    ({"mlp_bias": True}, "mlp_bias=true is not supported"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ({"num_key_value_heads": 5}, "not a multiple of num_key_value_heads 5"),
])
def test_unsupported_configs_are_refused_in_one_line(change, message):
    raw = {**_v4(), **change}
    with pytest.raises(ModelError, match=message) as e:
        parse_config(raw)
    assert "\n" not in str(e.value)


def test_missing_config_json_is_named(tmp_path):
    with pytest.raises(ModelError, match="no config.json"):
        load_config(tmp_path)
    with pytest.raises(ModelError, match="not a model folder"):
        load_config(tmp_path / "nowhere")


def test_broken_json_is_named(tmp_path):
    (tmp_path / "config.json").write_text("{ hidden_size: 3")
    with pytest.raises(ModelError, match="config.json: not valid JSON"):
        load_config(tmp_path)
