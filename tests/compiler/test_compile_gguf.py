"""llmrs-compile MODEL.gguf: plans from GGUF files against plans from the Hugging Face folders they
were converted from, native formats byte-identical, K-quant conversion, one-line errors."""
import json

import numpy as np
import pytest

import gguf
from gguf import GGMLQuantizationType as GT

from llmrs.compiler.cli import main as compile_main
from llmrs.compiler.pipeline import CompileOptions, compile_graphs
from llmrs.compiler.plan import write_graph_plan
from llmrs.models.tiny import make_model
from llmrs.runtime.backends.reference import ReferenceBackend
from llmrs.runtime.engine import Engine
from llmrs.runtime.plan import Plan
from llmrs.runtime.sampler import Sampler, SamplerConfig

from ..conftest import DATA, rel_err
from ..models.gguf_files import gguf_values, hf_to_gguf, permute, to_gguf_name, write_gguf

PROMPT = [5, 9, 17, 33, 2, 101, 7]


def _compile(src, out, *flags):
    assert compile_main([str(src), "-o", str(out), "--target", "cpu", "--max-seq-len", "64",
                         "--prefill-chunk", "16", "-q", *flags]) == 0
    return Plan.open(out)


def _generate(plan, n=6):
    m = plan.manifest
    engine = Engine(ReferenceBackend(plan.graphs()), m["prefill_chunk"], m["max_seq_len"])
    return engine.generate(list(PROMPT), n, Sampler(SamplerConfig()), keep_logits=True)


def _stored(path):
    return {t.name: t for t in gguf.GGUFReader(path).tensors}


@pytest.mark.parametrize("name", ["golden-a", "golden-b"])
def test_f32_gguf_plan_gives_the_folder_plans_logits(tmp_path, name):
    """The GGUF has Q/K rows in llama.cpp's order: equal logits prove the names and the un-permutation."""
    path = hf_to_gguf(DATA / name, tmp_path / "m.gguf")
    flags = ("--weights", "f32", "--kv-type", "f32")
    a = _generate(_compile(path, tmp_path / "gguf.plan.bin", *flags))
    b = _generate(_compile(DATA / name, tmp_path / "hf.plan.bin", *flags))
    assert a.tokens == b.tokens
    assert rel_err(np.stack(a.logits), np.stack(b.logits)) <= 1e-6


def test_native_q8_0_gguf_is_the_folder_compiled_to_q8_0(tmp_path):
    """gguf's Q8_0 quantizer and llmrs's give the same bytes, so the native plan of a Q8_0 GGUF is
    the folder's --weights q8_0 plan, tensor for tensor and logit for logit."""
    path = hf_to_gguf(DATA / "golden-b", tmp_path / "q8.gguf", lambda n, s: GT.Q8_0)
    a = _compile(path, tmp_path / "gguf.plan.bin", "--kv-type", "f32")
    b = _compile(DATA / "golden-b", tmp_path / "hf.plan.bin", "--weights", "q8_0", "--kv-type", "f32")
    assert a.manifest["compile_options"]["weights"] == "native"
    assert set(a.tensors) == set(b.tensors)
    for name in a.tensors:
        assert a.weight(name).tobytes() == b.weight(name).tobytes(), name
    ga, gb = _generate(a), _generate(b)
    assert ga.tokens == gb.tokens and np.array_equal(np.stack(ga.logits), np.stack(gb.logits))


MIXED = {"q_proj": GT.Q4_1, "k_proj": GT.Q4_0, "v_proj": GT.Q8_0, "o_proj": GT.F16, "gate_proj": GT.BF16,
         "up_proj": GT.F32, "down_proj": GT.Q4_1, "embed_tokens": GT.Q8_0}


def test_native_tensors_enter_the_plan_byte_identical(tmp_path):
    """Every stored format llmrs has, each kept as the file holds it (the CPU back end has no q4_1
    kernel on this branch, so the plan is written without code and run in the interpreter)."""
    path = hf_to_gguf(DATA / "golden-a", tmp_path / "mixed.gguf", lambda n, s: MIXED[n.split(".")[-2]])
    graphs = dict(zip(("prefill", "decode"), compile_graphs(path, CompileOptions(
        weights="native", kv_type="f32", max_seq_len=64, prefill_chunk=16))))
    write_graph_plan(tmp_path / "p.plan.bin", graphs, {"prefill_chunk": 16, "max_seq_len": 64})
    plan, stored = Plan.open(tmp_path / "p.plan.bin"), _stored(path)
    weights = [n for n in plan.tensors if n.startswith(("model.", "lm_head"))]
    assert len(weights) == 2 * 9 + 2                                  # nothing stacked or renamed
    for name in weights:
        raw = stored[to_gguf_name(name)]
        data = plan.weight(name)
        heads = 4 if "q_proj" in name else 2 if "k_proj" in name else 0
        assert plan.tensors[name].dtype == {GT.F32: "f32", GT.F16: "f16", GT.BF16: "bf16", GT.Q4_0: "q4_0",
                                            GT.Q4_1: "q4_1", GT.Q8_0: "q8_0"}[raw.tensor_type]
        assert (permute(data, heads) if heads else data).tobytes() == np.asarray(raw.data).tobytes(), name
    gd = np.load(DATA / "golden-a.npz")
    m = plan.manifest
    gen = Engine(ReferenceBackend(plan.graphs()), m["prefill_chunk"], m["max_seq_len"]).generate(
        list(gd["prompt_tokens"]), 1, Sampler(SamplerConfig()), keep_logits=True)
    assert np.corrcoef(gen.logits[0], gd["prefill_logits"][-1])[0, 1] > 0.9   # 4-bit weights, still the model


_STACKS = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
           "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


def _plan_rows(plan, name):
    """A weight's rows in the plan, also when fusion stacked it with its siblings (q k v, gate up)."""
    if name in plan.tensors:
        return np.asarray(plan.weight(name))
    module = name.split(".")[-2]
    label, pos = _STACKS[module]
    stacked = np.asarray(plan.weight(name.rsplit(".", 2)[0] + f".{label}.weight"))
    sizes = {"qkv_proj": [64, 32, 32], "gate_up_proj": [192, 192]}[label]     # golden-a's rows
    start = sum(sizes[:pos])
    return stacked[start:start + sizes[pos]]


def test_explicit_weights_requantize_every_matmul_weight(tmp_path):
    path = hf_to_gguf(DATA / "golden-a", tmp_path / "mixed.gguf", lambda n, s: MIXED[n.split(".")[-2]])
    plan = _compile(path, tmp_path / "q8.plan.bin", "--weights", "q8_0")
    assert {plan.tensors[n].dtype for n in plan.tensors if len(plan.tensors[n].shape) == 2} == {"q8_0"}
    for name, raw in _stored(path).items():
        if raw.tensor_type == GT.F32 and len(raw.shape) == 1:
            continue                                                   # norms stay f32
        hf = next(n for n in ("model.embed_tokens.weight",) + tuple(
            f"model.layers.{i}.{m}.weight" for i in (0, 1) for m in (
                "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")) if to_gguf_name(n) == name)
        want = gguf.quants.quantize(gguf_values(raw.data, raw.tensor_type), GT.Q8_0)   # in the file's row order
        rows = _plan_rows(plan, hf)
        heads = 4 if "q_proj" in hf else 2 if "k_proj" in hf else 0
        assert (permute(rows, heads) if heads else rows).tobytes() == want.tobytes(), hf


def _random_q6_k(rows: int, cols: int, rng) -> np.ndarray:
    """Valid Q6_K blocks (ql, qh, int8 scales, f16 d) with random codes: values of about +-0.1."""
    nb = rows * cols // 256
    blocks = rng.integers(0, 256, (nb, 210), dtype=np.uint8)
    blocks[:, 192:208] = rng.integers(1, 60, (nb, 16), dtype=np.int8).view(np.uint8)
    blocks[:, 208:210] = np.full(nb, 1.0 / 32 / 60, np.float16).view(np.uint8).reshape(nb, 2)
    return blocks.reshape(rows, cols // 256 * 210)


@pytest.fixture(scope="module")
def k_quant_gguf(tmp_path_factory):
    """A model whose rows are 256 wide (K-quant blocks), down_proj and the output head stored Q6_K."""
    tmp = tmp_path_factory.mktemp("kq")
    folder = make_model(tmp / "hf", "golden-a", dtype="f32", hidden_size=256, intermediate_size=256,
                        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                        vocab_size=320, tie_word_embeddings=False)
    rng = np.random.default_rng(7)

    def edit(meta, tensors):
        for name in ("blk.0.ffn_down.weight", "output.weight"):
            data, _ = tensors[name]
            tensors[name] = (_random_q6_k(data.shape[0], data.shape[1] // 34 * 32, rng), GT.Q6_K)  # Q8_0 rows
    return hf_to_gguf(folder, tmp / "kq.gguf", lambda n, s: GT.Q8_0, edit=edit)


@pytest.mark.parametrize("weights", [None, "f16"])
def test_k_quant_tensors_are_converted_with_a_measured_notice(tmp_path, capsys, k_quant_gguf, weights):
    # norm_weight_fold would multiply the final norm into an f16 head: keep the converted bytes
    flags = ("--weights", weights, "--no-fuse", "norm_weight_fold") if weights else ()
    plan = _compile(k_quant_gguf, tmp_path / "k.plan.bin", *flags)
    err = capsys.readouterr().err.strip().splitlines()
    target = weights or "q8_0"
    stored = _stored(k_quant_gguf)
    want_err = []
    for name, hf in (("blk.0.ffn_down.weight", "model.layers.0.mlp.down_proj.weight"),
                     ("output.weight", "lm_head.weight")):
        values = gguf_values(stored[name].data, GT.Q6_K)
        want = gguf.quants.quantize(values, GT.Q8_0) if target == "q8_0" else values.astype(np.float16)
        assert plan.tensors[hf].dtype == target and plan.weight(hf).tobytes() == want.tobytes(), hf
        back = gguf_values(want, GT.Q8_0) if target == "q8_0" else want.astype(np.float32)
        want_err.append(np.max(np.abs(back - values)) / np.max(np.abs(values)))
    notice = [line for line in err if "Q6_K" in line]
    assert len(notice) == 1 and notice[0].startswith("llmrs-compile: notice: 2 Q6_K tensors converted to "
                                                      f"{target} (llmrs has no Q6_K kernels)")
    assert "blk.0.ffn_down.weight" in notice[0] and "output.weight" in notice[0]
    assert f"max relative error {max(want_err):.2e}" in notice[0]
    assert 0 < max(want_err) < (1e-2 if target == "q8_0" else 1e-3)
    assert plan.tensors["model.layers.0.self_attn.o_proj.weight"].dtype == ("q8_0" if weights is None else "f16")


def _one_line_error(capsys, argv, message):
    assert compile_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("llmrs-compile: error:") and message in err, err


def _bad_gguf(tmp_path, edit, name="bad.gguf"):
    return hf_to_gguf(DATA / "golden-a", tmp_path / name, edit=edit)


def _set(key, value):
    return lambda meta, tensors: meta.__setitem__(key, value)


def _drop(key):
    return lambda meta, tensors: meta.pop(key)


def test_bad_gguf_files_are_one_line_errors(tmp_path, capsys):
    out = str(tmp_path / "x.plan.bin")
    cases = [
        (_set("general.architecture", "gemma2"), "general.architecture is 'gemma2'; llmrs runs 'llama', 'qwen3', 'qwen2'"),
        (_drop("llama.embedding_length"), "metadata llama.embedding_length is missing"),
        (_set("llama.block_count", 3), "tensor 'blk.2.attn_norm.weight' is missing"),
        (lambda m, t: t.pop("blk.1.ffn_up.weight"), "tensor 'blk.1.ffn_up.weight' is missing"),
        (lambda m, t: t.__setitem__("blk.0.attn_q.bias", (np.ones(64, np.float32), GT.F32)),
         "unexpected tensor 'blk.0.attn_q.bias'"),
        (_set("llama.feed_forward_length", 200), "tensor 'blk.0.ffn_gate.weight' has shape [192, 64], the metadata implies [200, 64]"),
        (_set("llama.attention.head_count", "four"), "metadata llama.attention.head_count is 'four', expected int"),
        (_set("tokenizer.ggml.model", "bert"), "tokenizer.ggml.model 'bert' is not supported"),
        (_set("tokenizer.ggml.model", "llama"), "metadata tokenizer.ggml.scores is missing"),
        (_set("tokenizer.ggml.pre", "foo-bpe"), "tokenizer.ggml.pre 'foo-bpe' is not supported"),
        (_set("tokenizer.ggml.eos_token_id", 999), "tokenizer.ggml.eos_token_id is 999, outside the 384-token vocabulary"),
        (_set("llama.rope.scaling.type", "yarn"), "llama.rope.scaling.type 'yarn' (factor 1) is not supported"),
        (_set("llama.expert_count", 8), "mixture-of-experts models are not supported"),
        (lambda m, t: t.__setitem__("blk.0.ffn_down.weight", (np.ones((64, 192 // 32 * 40), np.uint8), GT.Q8_1)),
         "tensor 'blk.0.ffn_down.weight' is GGML type Q8_1, which llmrs cannot read"),
    ]
    for i, (edit, message) in enumerate(cases):
        _one_line_error(capsys, [str(_bad_gguf(tmp_path, edit, f"bad{i}.gguf")), "-o", out], message)
    good = hf_to_gguf(DATA / "golden-a", tmp_path / "good.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(good[:len(good) - 1000])
    _one_line_error(capsys, [str(tmp_path / "cut.gguf"), "-o", out], "truncated or corrupt GGUF file")
    (tmp_path / "head.gguf").write_bytes(good[:300])
    _one_line_error(capsys, [str(tmp_path / "head.gguf"), "-o", out], "truncated or corrupt GGUF file")
    rng = np.random.default_rng(3)
    (tmp_path / "noise.gguf").write_bytes(b"GGUF" + rng.integers(0, 256, 4000, dtype=np.uint8).tobytes())
    _one_line_error(capsys, [str(tmp_path / "noise.gguf"), "-o", out], "noise.gguf")
    (tmp_path / "text.gguf").write_text("not a model\n")
    _one_line_error(capsys, [str(tmp_path / "text.gguf"), "-o", out], "not a GGUF file (starts with b'not ', expected b'GGUF')")
    _one_line_error(capsys, [str(tmp_path / "absent.gguf"), "-o", out], "absent.gguf: no such GGUF file")
    assert not (tmp_path / "x.plan.bin").exists()


def test_plan_from_gguf_carries_tokenizer_stop_ids_and_chat_template(tmp_path):
    path = hf_to_gguf(DATA / "golden-a", tmp_path / "m.gguf")
    m = _compile(path, tmp_path / "m.plan.bin").manifest
    hf = json.loads((DATA / "golden-a" / "config.json").read_text())
    assert set(m["stop_ids"]) == set(hf["eos_token_id"]) and m["bos_id"] == hf["bos_token_id"]
    assert "<|start_header_id|>" in m["chat_template"]
    assert (m["bos_token"], m["eos_token"]) == ("<|begin_of_text|>", "<|end_of_text|>")


def test_smollm2_compiles_and_says_paris(tmp_path, smollm2_gguf):
    """The real model (Q4_1, requantized to q8_0: this branch's CPU code has no q4_1 kernel),
    greedy, on the CPU back end."""
    from tokenizers import Tokenizer

    from llmrs.runtime.backends.cpu import CpuBackend

    plan = _compile(smollm2_gguf, tmp_path / "smol.plan.bin", "--weights", "q8_0")
    tok = Tokenizer.from_str(bytes(plan.section("tokenizer.json")).decode())
    engine = Engine(CpuBackend(plan), 16, 64, tuple(plan.manifest["stop_ids"]))
    gen = engine.generate(tok.encode("The capital of France is").ids, 4, Sampler(SamplerConfig()))
    assert "Paris" in tok.decode(gen.tokens)
