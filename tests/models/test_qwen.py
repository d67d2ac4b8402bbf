"""Qwen3 and Qwen2 against Hugging Face transformers and llama.cpp's own tools.

The committed data (tools/make_qwen_data.sh): random folders of shapes no other test uses
(qwen3-a: GQA 4:2, head_dim 48 over hidden 64, untied; qwen3-b: MQA 4:1, head_dim 32, tied;
qwen2-a: q/k/v biases, GQA 6:2, untied; norm weights and biases random), transformers' logits for
them, GGUFs written by llama.cpp's convert_hf_to_gguf.py (f32) and quantized by llama-quantize.
Each model's graphs run in the interpreter: the oracle every back end is checked against.
"""
import json
import shutil

import numpy as np
import pytest
from tokenizers import Tokenizer

import gguf
from gguf import GGMLQuantizationType as GT

from llmrs.compiler import quant
from llmrs.compiler.build import compile_plan
from llmrs.compiler.passes.quantize import quantize
from llmrs.compiler.pipeline import CompileOptions, compile_graphs
from llmrs.compiler.plan import write_graph_plan
from llmrs.models.config import ModelConfig, ModelError, expected_tensors, parse_config
from llmrs.models.llama import build_graphs, load_model
from llmrs.models.qwen_templates import QWEN3_CHAT_TEMPLATE
from llmrs.models.safetensors_io import open_folder, write
from llmrs.models.tiny import make_config, make_model
from llmrs.runtime.backends.reference import ReferenceBackend
from llmrs.runtime.chat import ChatTemplate, ChatTemplateError
from llmrs.runtime.engine import Engine
from llmrs.runtime.model import Model
from llmrs.runtime.plan import Plan
from llmrs.runtime.sampler import Sampler, SamplerConfig

from ..conftest import DATA, GOLDEN, rel_err, run_steps
from .gguf_files import hf_weights, rewrite_gguf

QWEN = ("qwen3-a", "qwen3-b", "qwen2-a")
CONVERTED = {"qwen3-b": "qwen3-b.f32.gguf", "qwen2-a": "qwen2-a.f32.gguf"}   # by llama.cpp's converter
QUANTIZED = {"q8_0": "qwen3-a.q8_0.gguf", "q4_0": "qwen3-a.q4_0.gguf"}      # by llama-quantize


def _golden(name: str) -> dict:
    return dict(np.load(DATA / f"{name}.npz"))


def _all_logits(prefill, decode, gd) -> np.ndarray:
    """Every prompt position's logits, then each decode step's, fed the tokens transformers chose."""
    logits, steps = run_steps(prefill, decode, gd["prompt_tokens"], gd["generated"][:-1])
    return np.concatenate([logits, np.stack(steps)])


def _reference(gd) -> np.ndarray:
    return np.concatenate([gd["prefill_logits"], gd["decode_logits"]])


# -- f32 weights: the interpreter is transformers ------------------------------------------------

@pytest.mark.parametrize("name", QWEN)
def test_folder_matches_transformers_prefill_and_each_decode_step(name):
    gd = _golden(name)
    prefill, decode = build_graphs(load_model(DATA / name), prefill_T=64, max_seq_len=128)
    logits, steps = run_steps(prefill, decode, gd["prompt_tokens"], gd["generated"][:-1])
    assert rel_err(logits, gd["prefill_logits"]) <= 1e-4
    assert len(steps) == len(gd["decode_logits"]) == 8
    for got, ref in zip(steps, gd["decode_logits"]):
        assert rel_err(got, ref) <= 1e-4
    assert [int(s.argmax()) for s in steps] == list(gd["generated"][1:])


@pytest.mark.parametrize("name", sorted(CONVERTED))
def test_llama_cpp_converted_gguf_matches_transformers(name):
    gd = _golden(name)
    model = load_model(DATA / CONVERTED[name])
    assert model.config.architecture == name.split("-")[0] and model.config.torch_dtype == "f32"
    prefill, decode = build_graphs(model, prefill_T=16, max_seq_len=128)   # the prompt in 2-3 chunks
    assert rel_err(_all_logits(prefill, decode, gd), _reference(gd)) <= 1e-4


@pytest.mark.parametrize("name", sorted(CONVERTED))
def test_converter_keeps_qwen_q_and_k_rows_in_hugging_face_order(name):
    """llama.cpp permutes a Llama's Q/K rows for its RoPE, not a Qwen's (it runs NEOX RoPE, which is
    rotate_half): the GGUF rows are the folder's rows, and llmrs reads them as they are."""
    stored = {t.name: t for t in gguf.GGUFReader(DATA / CONVERTED[name]).tensors}
    hf = hf_weights(DATA / name)
    model = load_model(DATA / CONVERTED[name])
    for proj in ("q", "k"):
        hf_name = f"model.layers.1.self_attn.{proj}_proj.weight"
        assert np.array_equal(np.asarray(stored[f"blk.1.attn_{proj}.weight"].data), hf[hf_name])
        assert np.array_equal(model.tensors[hf_name].load(), hf[hf_name])


def test_prefill_in_chunks_matches_one_prefill():
    gd = _golden("qwen3-a")
    model = load_model(DATA / "qwen3-a")
    whole = _all_logits(*build_graphs(model, prefill_T=64, max_seq_len=128), gd)
    chunked = _all_logits(*build_graphs(model, prefill_T=5, max_seq_len=128), gd)
    assert rel_err(chunked, whole) <= 1e-5


def test_graphs_norm_each_head_for_qwen3_and_add_biases_for_qwen2():
    q3 = build_graphs(load_model(DATA / "qwen3-a"), prefill_T=4, max_seq_len=16)[1]
    norms = [op for op in q3.ops if op.kind == "rms_norm" and "_norm.weight" in op.inputs[1] and "self_attn" in op.inputs[1]]
    assert [(op.inputs[1].split(".")[-2], q3.values[op.inputs[0]].shape) for op in norms[:2]] == \
        [("q_norm", (1, 4 * 48)), ("k_norm", (1, 2 * 48))]
    assert len(norms) == 2 * 2 and all(q3.values[op.inputs[1]].shape == (48,) for op in norms)
    q2 = build_graphs(load_model(DATA / "qwen2-a"), prefill_T=4, max_seq_len=16)[1]
    biased = [op.inputs[2] for op in q2.ops if op.kind == "matmul" and len(op.inputs) == 3]
    assert biased == [f"model.layers.{i}.self_attn.{p}_proj.bias" for i in range(2) for p in "qkv"]
    assert all(q2.values[b].dtype == "f32" for b in biased)   # bf16 in the folder, f32 in the graph
    assert not any(len(op.inputs) == 3 for op in q3.ops if op.kind == "matmul")


def test_plan_file_generates_transformers_greedy_tokens(tmp_path):
    """Every pass, the plan format (config with its family, f32 biases and head norms) and the
    reference back end, against transformers' greedy continuation."""
    for name in ("qwen3-a", "qwen2-a"):
        gd = _golden(name)
        graphs = dict(zip(("prefill", "decode"), compile_graphs(DATA / name, CompileOptions(
            weights="f32", kv_type="f32", max_seq_len=64, prefill_chunk=16, target=("cpu",)))))
        write_graph_plan(tmp_path / f"{name}.plan.bin", graphs, {"prefill_chunk": 16, "max_seq_len": 64})
        plan = Plan.open(tmp_path / f"{name}.plan.bin")
        assert ModelConfig.from_json(plan.graphs()["decode"].meta["config"]) == load_model(DATA / name).config
        out = Engine(ReferenceBackend(plan.graphs()), 16, 64).generate(
            list(gd["prompt_tokens"]), 9, Sampler(SamplerConfig()), keep_logits=True)
        assert out.tokens == list(gd["generated"])
        assert rel_err(np.stack(out.logits[1:]), gd["decode_logits"]) <= 1e-4


# -- quantized weights -----------------------------------------------------------------------------

def _format_error(model, gd, fmt: str) -> float:
    """rel_err of the model's logits with weights in fmt (None: as stored) against transformers'."""
    prefill, decode = build_graphs(model, prefill_T=16, max_seq_len=64)
    if fmt is not None:
        prefill, decode = quantize(prefill, fmt), quantize(decode, fmt)
    return rel_err(_all_logits(prefill, decode, gd), _reference(gd))


@pytest.fixture(scope="module")
def llama_format_error() -> dict[str, float]:
    """The error each format shows on the Llama golden models (the most of the three)."""
    return {fmt: max(_format_error(load_model(DATA / g), _golden(g), fmt) for g in GOLDEN) for fmt in QUANTIZED}


@pytest.mark.parametrize("fmt", sorted(QUANTIZED))
def test_quantized_folders_are_within_the_formats_error_on_the_llama_goldens(fmt, llama_format_error):
    for name in QWEN:
        err = _format_error(load_model(DATA / name), _golden(name), fmt)
        assert 0 < err <= llama_format_error[fmt], (name, err)


@pytest.mark.parametrize("fmt", sorted(QUANTIZED))
def test_llama_quantize_gguf_is_within_the_formats_error_on_the_llama_goldens(fmt, llama_format_error):
    model = load_model(DATA / QUANTIZED[fmt])
    kinds = {n: t.ggml_type for n, t in model.tensors.items() if len(t.shape) == 2}
    # llama-quantize's Q4_0 mix keeps the head Q8_0 (its Q6_K needs rows of 256)
    assert kinds.pop("lm_head.weight") == "Q8_0" and set(kinds.values()) == {fmt.upper()}
    assert all(t.ggml_type == "F32" for t in model.tensors.values() if len(t.shape) == 1)
    err = _format_error(model, _golden("qwen3-a"), None)
    assert 0 < err <= llama_format_error[fmt]


@pytest.mark.parametrize("fmt", sorted(QUANTIZED))
def test_llama_quantize_blocks_are_llmrs_own_quantization_of_the_folder(fmt):
    """GGML's quantizer in C and llmrs's give the same bytes for every matmul weight."""
    stored = {t.name: t for t in gguf.GGUFReader(DATA / QUANTIZED[fmt]).tensors}
    hf = hf_weights(DATA / "qwen3-a")
    for gguf_name, hf_name in (("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight"),
                               ("blk.1.ffn_down.weight", "model.layers.1.mlp.down_proj.weight"),
                               ("output.weight", "lm_head.weight")):
        t = stored[gguf_name]
        assert np.asarray(t.data).tobytes() == quant.quantize(hf[hf_name], t.tensor_type.name.lower()).tobytes()


def test_quantized_gguf_plan_matches_the_interpreter_on_its_own_weights():
    """The passes (native formats kept, fusion) change no number the interpreter computes."""
    gd = _golden("qwen3-a")
    model = load_model(DATA / QUANTIZED["q4_0"])
    plain = build_graphs(model, prefill_T=16, max_seq_len=64)
    fused = compile_graphs(model, CompileOptions(weights="native", kv_type="f32", max_seq_len=64, prefill_chunk=16))
    weights = {fused[1].values[op.inputs[1]].dtype for op in fused[1].ops if op.kind in ("matmul", "fused_matmul")}
    assert weights == {"q4_0", "q8_0"} and fused[1].values["lm_head.weight"].dtype == "q8_0"
    a, b = (run_steps(p, d, gd["prompt_tokens"], gd["generated"][:-1]) for p, d in (plain, fused))
    assert rel_err(a[0][-1], b[0][-1]) <= 1e-5
    assert rel_err(np.stack(a[1]), np.stack(b[1])) <= 1e-5


# -- tokenizer, chat template, metadata ----------------------------------------------------------

TEXTS = ["Once upon a time, in a small town by the sea,", "I'll pay 12345 dollars; won't you?\n\n  indented",
         "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nFour.",
         "caf\u00e9 na\u00efve \u4f60\u597d \U0001f680 tabs\tand CRLF\r\n"]


@pytest.mark.parametrize("name", sorted(CONVERTED))
def test_gguf_tokenizer_encodes_as_the_folders_tokenizer(name):
    model = load_model(DATA / CONVERTED[name])
    ours, theirs = Tokenizer.from_str(model.tokenizer_json), Tokenizer.from_file(str(DATA / name / "tokenizer.json"))
    for text in TEXTS:
        assert ours.encode(text).ids == theirs.encode(text).ids, text
        assert ours.decode(ours.encode(text).ids, skip_special_tokens=False) == text
    base = model.config.vocab_size - 16
    assert [ours.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>")] == \
        [base, base + 1, base + 2, base + 5]
    # Qwen adds no BOS; generation ends at <|im_end|> (the file's eos) or <|endoftext|>
    assert ours.encode("Hi").ids == theirs.encode("Hi").ids and base not in ours.encode("Hi").ids
    assert model.config.eos_token_ids == (base + 2, base) and (model.bos_token, model.eos_token) == \
        ("<|endoftext|>", "<|im_end|>")


def test_gguf_and_folder_carry_the_qwen3_chat_template():
    assert load_model(DATA / "qwen3-b").chat_template == QWEN3_CHAT_TEMPLATE
    assert load_model(DATA / CONVERTED["qwen3-b"]).chat_template == QWEN3_CHAT_TEMPLATE
    assert "<|im_start|>" in load_model(DATA / CONVERTED["qwen2-a"]).chat_template


# what transformers 5.24's apply_chat_template writes for CONVERSATION with Qwen3's template: the
# earlier answer's think block dropped, and with enable_thinking=False an empty one opening the reply
CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nHello!"}, {"role": "user", "content": "2+2?"}]
RENDERED = ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
            "Hello!<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n")
NOT_THINKING = "<think>\n\n</think>\n\n"


def test_qwen3_template_renders_as_transformers_with_its_thinking_switch():
    template = ChatTemplate(QWEN3_CHAT_TEMPLATE)
    assert template.render(CONVERSATION) == RENDERED
    assert template.render(CONVERSATION, variables={"enable_thinking": True}) == RENDERED
    assert template.render(CONVERSATION, variables={"enable_thinking": False}) == RENDERED + NOT_THINKING
    with pytest.raises(ChatTemplateError, match="^chat template variable 'messages' is set by llmrs itself"):
        template.render(CONVERSATION, variables={"messages": []})


def test_model_chat_passes_the_thinking_switch_to_the_template(tmp_path):
    plan = compile_plan(DATA / "qwen3-b", tmp_path / "q.plan.bin", CompileOptions(
        weights="f32", kv_type="f32", max_seq_len=128, prefill_chunk=16, target=("opencl",))).path
    with Model.load(plan, backend="reference") as model:
        assert model.render_chat(CONVERSATION, chat_template_kwargs={"enable_thinking": False}) == RENDERED + NOT_THINKING
        reply = model.chat(CONVERSATION, max_tokens=2, chat_template_kwargs={"enable_thinking": False})
        "".join(reply)
        assert reply.prompt == model.tokenize(RENDERED + NOT_THINKING, add_special_tokens=False)
        assert reply.completion_tokens >= 1
        assert model.tokenize(NOT_THINKING, add_special_tokens=False)[0] == model.tokenize("<think>")[0] == 320 - 16 + 5


# -- config.json -----------------------------------------------------------------------------------

def test_qwen_configs_in_both_transformers_layouts_give_the_same_config():
    for preset in ("qwen3-a", "qwen2-a"):
        v4 = make_config(preset)
        v5 = {k: v for k, v in v4.items() if k not in ("rope_theta", "rope_scaling", "torch_dtype")}
        v5.update(rope_parameters={"rope_type": "default", "rope_theta": v4["rope_theta"]}, dtype=v4["torch_dtype"])
        assert parse_config(v4) == parse_config(v5)
    q3, q2 = parse_config(make_config("qwen3-a")), parse_config(make_config("qwen2-a"))
    assert (q3.architecture, q3.qk_norm, q3.attention_bias, q3.head_dim, q3.rope_theta) == ("qwen3", True, False, 48, 1e6)
    assert (q2.architecture, q2.qk_norm, q2.attention_bias, q2.head_dim) == ("qwen2", False, True, 96 // 6)


def test_head_dim_defaults_as_transformers_does():
    raw = make_config("qwen3-a")
    del raw["head_dim"]
    assert parse_config(raw).head_dim == 128             # Qwen3Config's default, whatever the hidden size
    assert "head_dim" not in make_config("qwen2.5-0.5b")
    assert parse_config(make_config("qwen2.5-0.5b")).head_dim == 896 // 14


def test_parameter_counts_are_the_published_ones():
    assert parse_config(make_config("qwen2.5-0.5b")).n_params == 494_032_768   # Qwen/Qwen2.5-0.5B
    assert parse_config(make_config("qwen3-0.6b")).n_params == 596_049_920     # Qwen/Qwen3-0.6B, head counted once
    for name in QWEN:
        cfg = load_model(DATA / name).config
        assert cfg.n_params == sum(int(np.prod(s)) for s in expected_tensors(cfg).values())


def test_a_config_written_before_qwen_reads_as_a_llama():
    cfg = load_model(DATA / "golden-b").config
    old = {k: v for k, v in cfg.to_json().items() if k not in ("architecture", "qk_norm", "attention_bias")}
    assert ModelConfig.from_json(old) == cfg and cfg.architecture == "llama"


def test_tiny_qwen_folders_have_real_norms_biases_and_a_qwen_tokenizer(tmp_path):
    out = make_model(tmp_path / "m", "tiny", family="qwen2", hidden_size=64, intermediate_size=96,
                     num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=1, vocab_size=320)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen2ForCausalLM"] and "head_dim" not in cfg
    refs = open_folder(out)
    biases = [np.asarray(refs[n].load()) for n in refs if n.endswith(".bias")]
    assert len(biases) == 3 and all(np.all(b != 0) for b in biases)
    norm = hf_weights(out)["model.layers.0.input_layernorm.weight"]
    assert np.std(norm) > 0.05 and np.mean(norm == 1.0) < 0.1
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert tok.encode("a").ids == [tok.token_to_id("a")]          # no BOS
    assert tok.token_to_id("<|im_end|>") == cfg["eos_token_id"] == 320 - 16 + 2


# -- one-line refusals -------------------------------------------------------------------------------

@pytest.mark.parametrize("change, message", [
    ({"architectures": ["Qwen3MoeForCausalLM"]}, "architecture Qwen3MoeForCausalLM is not supported (llmrs runs "
                                                 "LlamaForCausalLM, Qwen3ForCausalLM, Qwen2ForCausalLM)"),
    ({"attention_bias": True}, "attention_bias=true is not supported (Qwen3 models as released have no such biases)"),
    ({"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 1},
     "sliding-window attention (use_sliding_window / layer_types) is not supported"),
    ({"layer_types": ["full_attention", "sliding_attention"]}, "sliding-window attention"),
])
def test_unsupported_qwen_configs_are_one_line_errors(change, message):
    with pytest.raises(ModelError) as e:
        parse_config({**make_config("qwen3-a"), **change}, "m/config.json")
    assert str(e.value).startswith("m/config.json: ") and message in str(e.value) and "\n" not in str(e.value)


def test_sliding_window_switched_on_but_covering_no_layer_is_full_attention():
    raw = {**make_config("qwen2-a"), "use_sliding_window": True, "sliding_window": 64, "max_window_layers": 2}
    assert parse_config(raw).architecture == "qwen2"


def _folder_with(tmp_path, name: str, edit) -> str:
    folder = tmp_path / name
    shutil.copytree(DATA / name, folder)
    tensors = {n: (np.array(r.load()), r.dtype) for n, r in open_folder(folder).items()}   # copies: the file is rewritten
    edit(tensors)
    write(folder / "model.safetensors", tensors)
    return folder


def test_folder_missing_a_head_norm_or_bias_or_holding_a_foreign_bias_is_one_line(tmp_path):
    cases = [
        ("qwen3-a", lambda t: t.pop("model.layers.1.self_attn.q_norm.weight"),
         "tensor 'model.layers.1.self_attn.q_norm.weight' is missing (config.json expects it in a Qwen3ForCausalLM, "
         "shape [48])"),
        ("qwen2-a", lambda t: t.pop("model.layers.0.self_attn.v_proj.bias"),
         "tensor 'model.layers.0.self_attn.v_proj.bias' is missing (config.json expects it in a Qwen2ForCausalLM"),
        ("qwen3-a", lambda t: t.__setitem__("model.layers.0.self_attn.q_proj.bias", (np.ones(192, np.float32), "f32")),
         "unexpected tensor 'model.layers.0.self_attn.q_proj.bias': a Qwen3ForCausalLM as config.json describes has no "
         "such tensor"),
    ]
    for i, (name, edit, message) in enumerate(cases):
        folder = _folder_with(tmp_path / str(i), name, edit)
        with pytest.raises(ModelError) as e:
            load_model(folder)
        assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_gguf_of_an_unknown_architecture_or_wrong_tensors_is_one_line(tmp_path):
    src = DATA / CONVERTED["qwen3-b"]

    def renamed(meta, tensors):
        meta["general.architecture"] = "qwen3moe"

    def no_k_norm(meta, tensors):
        tensors.pop("blk.1.attn_k_norm.weight")

    def with_bias(meta, tensors):
        tensors["blk.0.attn_q.bias"] = (np.ones(128, np.float32), GT.F32)

    cases = [(renamed, "general.architecture is 'qwen3moe'; llmrs runs 'llama', 'qwen3', 'qwen2'"),
             (no_k_norm, "tensor 'blk.1.attn_k_norm.weight' is missing (a Qwen3 with this metadata has it, shape [32])"),
             (with_bias, "unexpected tensor 'blk.0.attn_q.bias': not part of a Qwen3 (general.architecture 'qwen3')")]
    for i, (edit, message) in enumerate(cases):
        path = rewrite_gguf(src, tmp_path / f"{i}.gguf", edit)
        with pytest.raises(ModelError) as e:
            load_model(path)
        assert message in str(e.value) and "\n" not in str(e.value), str(e.value)
