"""GGUF input: metadata -> LlamaConfig, tensors un-permuted and byte-identical, the tokenizer against
the Hugging Face tokenizer.json it was converted from (and llama.cpp's own token ids)."""
import os
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

import gguf
from gguf import GGMLQuantizationType as GT
from gguf import TokenType

from llmrs.models.config import ModelError
from llmrs.models.gguf_io import llama3_scaling_from_factors, unpermute_rows
from llmrs.models.llama import load_model

from ..conftest import DATA
from .gguf_files import hf_to_gguf, hf_weights, permute, rope_factors, to_gguf_name

TEXTS = ["Hello, world!", " Hello World", "Once upon a time, in a small town by the sea,",
         "they're here: it's 12345 o'clock", "tabs\tand  double  spaces   \n\n\nnew lines\r\n",
         "héllo naïve café", "日本語のテキスト", "emoji 🦙🦙 and ∑ math", "<|begin_of_text|>Hi<|eot_id|>",
         "a<|start_header_id|>user<|end_header_id|>\n\nx<|eot_id|>", "   ", ""]


@pytest.fixture(params=["golden-a", "golden-b"])
def golden_gguf(request, tmp_path) -> tuple[Path, Path]:
    """(HF folder, the same model as an F32 GGUF written the way llama.cpp converts it)."""
    folder = DATA / request.param
    return folder, hf_to_gguf(folder, tmp_path / f"{request.param}.gguf")


def test_gguf_config_equals_the_folders_config(golden_gguf):
    folder, path = golden_gguf
    got, want = load_model(path).config, load_model(folder).config
    assert {**got.to_json(), "torch_dtype": None} == {**want.to_json(), "torch_dtype": None}


def test_gguf_tensors_load_as_the_hf_tensors_with_q_and_k_rows_unpermuted(golden_gguf):
    folder, path = golden_gguf
    model, ref = load_model(path), hf_weights(folder)
    assert set(model.tensors) == set(ref)
    for name, t in model.tensors.items():
        assert t.dtype == "f32" and t.shape == ref[name].shape
        np.testing.assert_array_equal(np.asarray(t.load()), ref[name], err_msg=name)


def test_unpermute_rows_inverts_llama_cpp_permute_on_quantized_rows():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((6 * 16, 64), dtype=np.float32)
    blocks = gguf.quants.quantize(permute(w, 6), GT.Q4_1)              # as the converter stores Q
    assert np.array_equal(unpermute_rows(blocks, 6), gguf.quants.quantize(w, GT.Q4_1))
    assert not np.array_equal(blocks, gguf.quants.quantize(w, GT.Q4_1))


def test_native_formats_load_byte_identical(tmp_path):
    kinds = {"q_proj": GT.Q4_1, "k_proj": GT.Q4_0, "v_proj": GT.Q8_0, "o_proj": GT.F16, "gate_proj": GT.BF16,
             "up_proj": GT.F32, "down_proj": GT.Q4_1, "embed_tokens": GT.Q8_0}
    kind = lambda name, shape: kinds[name.split(".")[-2]]  # noqa: E731
    path = hf_to_gguf(DATA / "golden-a", tmp_path / "mixed.gguf", kind)
    stored = {t.name: t for t in gguf.GGUFReader(path).tensors}
    model = load_model(path)
    for name, t in model.tensors.items():
        raw = stored[to_gguf_name(name)]
        assert t.ggml_type == raw.tensor_type.name and t.source_format is None
        data = np.asarray(t.load())
        heads = 4 if "q_proj" in name else 2 if "k_proj" in name else 0
        back = permute(data, heads) if heads else data        # the converter's order again
        assert back.tobytes() == np.asarray(raw.data).tobytes(), name


def test_llama3_scaling_is_recovered_from_rope_freqs_or_refused():
    cfg = {"head_dim": 64, "rope_theta": 500000.0, "rope_scaling": dict(
        factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)}
    assert llama3_scaling_from_factors(rope_factors(cfg), 64, 500000.0, "x") == cfg["rope_scaling"]
    odd = {**cfg, "rope_scaling": dict(factor=4.0, low_freq_factor=2.0, high_freq_factor=16.0,
                                       original_max_position_embeddings=4096)}
    got = llama3_scaling_from_factors(rope_factors(odd), 64, 500000.0, "x")
    assert got["factor"] == 4.0 and got["original_max_position_embeddings"] * 1.0 / got["high_freq_factor"] == \
        pytest.approx(4096 / 16.0) and got["original_max_position_embeddings"] / got["low_freq_factor"] == \
        pytest.approx(4096 / 2.0)
    with pytest.raises(ModelError, match="rope_freqs.weight holds frequency factors that are not Llama 3's"):
        llama3_scaling_from_factors(np.linspace(1.0, 3.0, 32, dtype=np.float32)[::-1], 64, 500000.0, "x")


def test_tokenizer_gives_the_hf_tokenizers_ids_and_round_trips(golden_gguf):
    folder, path = golden_gguf
    model = load_model(path)
    ours, hf = Tokenizer.from_str(model.tokenizer_json), Tokenizer.from_file(str(folder / "tokenizer.json"))
    for text in TEXTS:
        ids = ours.encode(text).ids
        assert ids == hf.encode(text).ids, text
        assert ids[0] == model.config.bos_token_id                    # add_bos_token, as HF's post-processor
        assert ours.decode(ids, skip_special_tokens=False) == hf.decode(ids, skip_special_tokens=False)
        assert ours.decode(ids) == text.replace("<|begin_of_text|>", "").replace("<|eot_id|>", "") \
            .replace("<|start_header_id|>", "").replace("<|end_header_id|>", "")
    eot = ours.encode("<|eot_id|>", add_special_tokens=False).ids
    assert eot == [hf.token_to_id("<|eot_id|>")] and eot[0] in model.config.eos_token_ids


def test_plan_metadata_carries_template_and_special_token_strings(golden_gguf):
    _, path = golden_gguf
    model = load_model(path)
    assert "<|start_header_id|>" in model.chat_template
    assert (model.bos_token, model.eos_token) == ("<|begin_of_text|>", "<|end_of_text|>")
    ours = Tokenizer.from_str(model.tokenizer_json)
    assert set(model.config.eos_token_ids) == {ours.token_to_id(t) for t in ("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>")}


def test_folder_chat_template_comes_from_tokenizer_config_or_jinja_file(tmp_path):
    import json
    import shutil
    folder = tmp_path / "m"
    shutil.copytree(DATA / "golden-a", folder)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": "{{ bos_token }}A"}))
    model = load_model(folder)
    assert (model.chat_template, model.bos_token, model.eos_token) == \
        ("{{ bos_token }}A", "<|begin_of_text|>", "<|end_of_text|>")
    (folder / "chat_template.jinja").write_text("{{ bos_token }}B")
    assert load_model(folder).chat_template == "{{ bos_token }}B"
    assert load_model(DATA / "golden-a").chat_template is None


LLAMA_CPP_MODELS = os.environ.get("LLMRS_LLAMA_CPP_MODELS")


@pytest.mark.skipif(not LLAMA_CPP_MODELS, reason="set LLMRS_LLAMA_CPP_MODELS to llama.cpp's models/ folder "
                                                  "(vocab-only GGUFs with .inp/.out token ids made by HF tokenizers)")
@pytest.mark.parametrize("name", ["llama-bpe", "gpt-2", "qwen2", "starcoder", "command-r", "refact", "mpt",
                                  "llama-spm", "phi-3"])
def test_llama_cpp_vocab_files_tokenize_to_their_expected_ids(name):
    from llmrs.models.gguf_io import Metadata, open_reader
    from llmrs.models.gguf_vocab import read_vocab

    base = Path(LLAMA_CPP_MODELS) / f"ggml-vocab-{name}.gguf"
    tok = Tokenizer.from_str(read_vocab(Metadata(open_reader(base), base)).tokenizer_json)
    texts = Path(f"{base}.inp").read_text().split("\n__ggml_vocab_test__\n")
    ids = Path(f"{base}.out").read_text().split("\n")
    for text, want in zip(texts, ids):
        got = tok.encode(text, add_special_tokens=False).ids
        assert got == [int(x) for x in want.split()], text
        assert tok.decode(got, skip_special_tokens=False) == text


def test_smollm2_loads_with_its_config_and_tokenizer(smollm2_gguf):
    model = load_model(smollm2_gguf)
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.head_dim, cfg.intermediate_size, cfg.vocab_size) == (30, 576, 9, 3, 64, 1536, 49152)
    assert (cfg.rope_theta, cfg.rms_norm_eps, cfg.rope_scaling, cfg.tie_word_embeddings) == (100000.0, 1e-5, None, True)
    assert cfg.bos_token_id == 1 and cfg.eos_token_ids[0] == 2 and set(cfg.eos_token_ids) == {2, 0}
    kinds = [t.ggml_type for t in model.tensors.values()]
    assert kinds.count("Q4_1") == 210 and model.tensors["model.embed_tokens.weight"].ggml_type == "Q8_0"
    assert "<|im_start|>" in model.chat_template and model.eos_token == "<|im_end|>"
    tok = Tokenizer.from_str(model.tokenizer_json)
    # llama.cpp's llama-tokenize on this file gives these ids (add_bos_token is false)
    assert tok.encode("Hello, world!").ids == [19556, 28, 905, 17]
    chat = "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode(chat).ids
    assert ids == [1, 4093, 198, 1780, 314, 216, 34, 27, 34, 47, 2, 198, 1, 520, 9531, 198]
    assert tok.decode(ids, skip_special_tokens=False) == chat
    assert tok.decode(ids) == "user\nWhat is 2+2?\nassistant\n"


def test_sentencepiece_vocab_tokenizes_as_sentencepiece(tmp_path):
    """tokenizer.ggml.model 'llama' (Llama 2's SentencePiece BPE) against sentencepiece itself, on a
    vocabulary trained here and stored as llama.cpp's converter stores one (pieces, scores, types)."""
    import io

    spm = pytest.importorskip("sentencepiece")
    from llmrs.models.tiny import _corpus
    from .gguf_files import write_gguf

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter([line for doc in _corpus() for line in doc.splitlines() if line.strip()]),
        model_writer=buf, vocab_size=600, model_type="bpe", byte_fallback=True, split_digits=True,
        normalization_rule_name="identity", remove_extra_whitespaces=False, add_dummy_prefix=True, minloglevel=2)
    sp = spm.SentencePieceProcessor(model_proto=buf.getvalue())
    n = sp.get_piece_size()
    kind = [TokenType.UNKNOWN if sp.is_unknown(i) else TokenType.CONTROL if sp.is_control(i) else
            TokenType.BYTE if sp.is_byte(i) else TokenType.NORMAL for i in range(n)]
    meta = {"general.architecture": "llama", "tokenizer.ggml.model": "llama",
            "tokenizer.ggml.tokens": [sp.id_to_piece(i) for i in range(n)],
            "tokenizer.ggml.scores": [float(sp.get_score(i)) for i in range(n)],
            "tokenizer.ggml.token_type": [int(k) for k in kind],
            "tokenizer.ggml.bos_token_id": sp.bos_id(), "tokenizer.ggml.eos_token_id": sp.eos_id(),
            "tokenizer.ggml.unknown_token_id": sp.unk_id(), "tokenizer.ggml.add_bos_token": True}
    path = write_gguf(tmp_path / "spm.gguf", meta, {})
    from llmrs.models.gguf_io import Metadata, open_reader
    from llmrs.models.gguf_vocab import read_vocab

    vocab = read_vocab(Metadata(open_reader(path), path))
    tok = Tokenizer.from_str(vocab.tokenizer_json)
    for text in TEXTS[:8] + ["x", " leading space", "trailing  ", "1234567 digits", "\u00e9\u00e8 \u2603 bytes"]:
        ids = tok.encode(text).ids
        assert ids == [sp.bos_id()] + sp.encode(text), text
        assert tok.decode(ids) == sp.decode(sp.encode(text)) == text
    assert vocab.stop_ids == (sp.eos_id(),) and vocab.bos_token == "<s>"


def test_missing_pre_tokenizer_falls_back_to_llama_cpp_default_with_a_notice(tmp_path):
    path = hf_to_gguf(DATA / "golden-a", tmp_path / "m.gguf", edit=lambda meta, t: meta.pop("tokenizer.ggml.pre"))
    model = load_model(path)
    assert len(model.notices) == 1 and "tokenizer.ggml.pre is missing" in model.notices[0]
    tok = Tokenizer.from_str(model.tokenizer_json)
    # llama.cpp's 'default' cuts punctuation runs out before the GPT-2 regex sees them
    assert tok.encode("ab, cd", add_special_tokens=False).tokens[:2] == ["ab", ","]
