"""Llama 3.x as two op graphs (prefill of up to T tokens, 1-token decode), op for op as HF's
modeling_llama.py; parameters keep their safetensors names."""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

from ..compiler.ir import Graph, LazyTensor
from .config import LlamaConfig, ModelError, expected_tensors, load_config, read_json  # noqa: F401 (re-exported)
from .safetensors_io import TensorRef, open_folder


def _ignorable(name: str, cfg: LlamaConfig) -> bool:
    # old exports carry RoPE buffers; tied checkpoints sometimes still store the head
    return name.endswith("rotary_emb.inv_freq") or (cfg.tie_word_embeddings and name == "lm_head.weight")


def check_weights(cfg: LlamaConfig, refs: dict[str, TensorRef], where: str) -> dict[str, TensorRef]:
    want = expected_tensors(cfg)
    for name, shape in want.items():
        if name not in refs:
            raise ModelError(f"{where}: tensor {name!r} is missing (config.json expects it, shape {list(shape)})")
        if refs[name].shape != shape:
            raise ModelError(f"{where}: tensor {name!r} has shape {list(refs[name].shape)}, "
                             f"config.json implies {list(shape)}")
    extra = sorted(n for n in refs if n not in want and not _ignorable(n, cfg))
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise ModelError(f"{where}: unexpected tensor {extra[0]!r}{more}: the checkpoint does not match config.json")
    return {n: refs[n] for n in want}


@dataclass
class LlamaModel:
    path: Path
    config: LlamaConfig
    tensors: dict[str, TensorRef]           # graph name -> on-disk tensor (safetensors or GGUF)
    tokenizer_json: str | None = None       # Hugging Face tokenizer.json text; None: none given
    chat_template: str | None = None        # jinja2 source, for llmrs-run --chat
    bos_token: str | None = None            # the special-token strings a chat template refers to
    eos_token: str | None = None
    notices: tuple[str, ...] = ()           # things the user should know about how it was read


def _token_text(v: object) -> str | None:
    # tokenizer_config.json gives a special token as its text or as an AddedToken dict
    return v.get("content") if isinstance(v, dict) else v if isinstance(v, str) else None


def check_tokenizer(text: str, where: str, vocab_size: int) -> str:
    """text, if `tokenizers` reads it as a tokenizer whose ids all index the embedding; else a
    one-line ModelError (llmrs-run would otherwise fail at its first prompt, or read past the
    embedding table)."""
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_str(text)
    except Exception as e:   # tokenizers raises its own exception types
        detail = " ".join(str(e).split())[:120]
        raise ModelError(f"{where}: not a tokenizer the tokenizers library can read ({detail}); "
                         "copy the model's tokenizer.json again") from None
    top = max(tok.get_vocab(with_added_tokens=True).values(), default=-1)
    if top >= vocab_size:
        raise ModelError(f"{where}: token id {top} is outside the model's {vocab_size}-row embedding; "
                         "the tokenizer belongs to another model")
    return text


def _read_tokenizer(path: Path, vocab_size: int) -> str | None:
    if not path.is_file():
        return None
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        raise ModelError(f"{path}: not UTF-8 text; copy the model's tokenizer.json again") from None
    return check_tokenizer(text, str(path), vocab_size)


NO_TOKENIZER = ("{where} has no tokenizer.json: the plan will hold no tokenizer, so llmrs-run cannot turn "
                "text into tokens (add the model's tokenizer.json and compile again)")


def load_hf_folder(model_dir: Path) -> LlamaModel:
    """Parse and check a Hugging Face folder; weights stay on disk (memory-mapped on use)."""
    cfg = load_config(model_dir)
    refs = check_weights(cfg, open_folder(model_dir), str(model_dir))
    tok = model_dir / "tokenizer.json"
    tokenizer_json = _read_tokenizer(tok, cfg.vocab_size)
    tok_cfg = model_dir / "tokenizer_config.json"
    extra = read_json(tok_cfg) if tok_cfg.is_file() else {}
    template = extra.get("chat_template")
    if isinstance(template, list):  # named templates: [{name, template}]; "default" is the chat one
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    jinja = model_dir / "chat_template.jinja"  # newer transformers save the template beside it
    if jinja.is_file():
        try:
            template = jinja.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            raise ModelError(f"{jinja}: not UTF-8 text") from None
    return LlamaModel(model_dir, cfg, refs, tokenizer_json, template if isinstance(template, str) else None,
                      _token_text(extra.get("bos_token")), _token_text(extra.get("eos_token")),
                      () if tokenizer_json is not None else (NO_TOKENIZER.format(where=model_dir),))


def load_gguf(path: Path) -> LlamaModel:
    """Parse and check a GGUF file; tensors stay in the mapped file."""
    from .gguf_io import Metadata, open_reader, read_config, read_tensors
    from .gguf_vocab import read_vocab

    reader = open_reader(path)
    meta = Metadata(reader, path)
    cfg = read_config(meta, {t.name: t for t in reader.tensors})
    tensors = read_tensors(cfg, reader, path)
    vocab = read_vocab(meta)
    check_tokenizer(vocab.tokenizer_json, f"{path}: tokenizer.ggml.*", cfg.vocab_size)
    cfg = dataclasses.replace(cfg, bos_token_id=vocab.bos_id, eos_token_ids=vocab.stop_ids)
    return LlamaModel(path, cfg, tensors, vocab.tokenizer_json, vocab.chat_template,
                      vocab.bos_token, vocab.eos_token, vocab.notices)


# what load_hf_folder reads besides the safetensors files
FOLDER_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "chat_template.jinja", "model.safetensors.index.json")


def input_files(model: str | Path) -> list[Path]:
    """Every file load_model(model) reads, so that a writer can refuse to replace one of them."""
    model = Path(model)
    if not model.is_dir():
        return [model]
    files = [model / n for n in FOLDER_FILES] + sorted(model.glob("*.safetensors"))
    try:   # shards named by an index may sit in sub-folders
        shards = json.loads((model / "model.safetensors.index.json").read_text())["weight_map"].values()
        files += [model / str(s) for s in set(shards)]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    return files


def load_model(model: str | Path) -> LlamaModel:
    """A Hugging Face folder or a .gguf file, by what the path is."""
    model = Path(model)
    if model.is_dir() or (not model.exists() and model.suffix != ".gguf"):
        return load_hf_folder(model)
    return load_gguf(model)


def _weights(tensors: dict[str, TensorRef]) -> dict[str, LazyTensor]:
    # a GGUF tensor in a format llmrs has no kernels for names it (source_format); it loads as f32
    return {n: LazyTensor(r.shape, r.dtype, r.load, getattr(r, "source_format", None)) for n, r in tensors.items()}


def build_graph(cfg: LlamaConfig, weights: dict[str, LazyTensor], T: int, max_seq_len: int,
                name: str, kv_dtype: str = "f32") -> Graph:
    """The forward pass for up to T tokens, writing K/V at n_past and attending causally."""
    d, hd = cfg.hidden_size, cfg.head_dim
    h, kvh, f = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size
    g = Graph(name, T, weights=dict(weights), meta={"config": cfg.to_json(), "max_seq_len": max_seq_len})
    for pname, lt in weights.items():
        g.add_value(pname, lt.shape, lt.dtype, kind="param")
    g.inputs = [g.add_value("tokens", (T,), "i32", kind="input")]
    act = lambda n, *shape: g.add_value(n, shape, "f32")  # noqa: E731

    x = act("x.embed", T, d)
    g.add_op("embedding", ["model.embed_tokens.weight", "tokens"], [x])
    rope_attrs = dict(n_heads=h, head_dim=hd, theta=cfg.rope_theta, scaling=cfg.rope_scaling)
    # attention scores for KV-cache eviction (runtime/kv): which rows add to them, shared by all
    # layers and set by the runtime; zero (the reset state) means none
    score_ctl = g.add_value("cache.score_ctl", (2,), "i32", kind="state")
    for i in range(cfg.num_hidden_layers):
        p, a = f"model.layers.{i}.", f"l{i}."
        k_cache = g.add_value(f"cache.k.{i}", (max_seq_len, kvh, hd), kv_dtype, kind="state")
        v_cache = g.add_value(f"cache.v.{i}", (max_seq_len, kvh, hd), kv_dtype, kind="state")
        scores = g.add_value(f"cache.scores.{i}", (kvh, max_seq_len), "f32", kind="state")
        # hidden_states = self.input_layernorm(hidden_states)
        xn = act(a + "attn_norm", T, d)
        g.add_op("rms_norm", [x, p + "input_layernorm.weight"], [xn], eps=cfg.rms_norm_eps)
        q, k, v = act(a + "q", T, h * hd), act(a + "k", T, kvh * hd), act(a + "v", T, kvh * hd)
        for proj, out in (("q", q), ("k", k), ("v", v)):
            g.add_op("matmul", [xn, f"{p}self_attn.{proj}_proj.weight"], [out])
        # query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
        qr, kr = act(a + "q_rope", T, h * hd), act(a + "k_rope", T, kvh * hd)
        g.add_op("rope", [q], [qr], **rope_attrs)
        g.add_op("rope", [k], [kr], **{**rope_attrs, "n_heads": kvh})
        # key_states, value_states = past_key_values.update(key_states, value_states, ...)
        kc = g.add_value(a + "k_cache", (max_seq_len, kvh, hd), kv_dtype, alias=k_cache)
        vc = g.add_value(a + "v_cache", (max_seq_len, kvh, hd), kv_dtype, alias=v_cache)
        g.add_op("kv_store", [kr, k_cache], [kc])
        g.add_op("kv_store", [v, v_cache], [vc])
        o = act(a + "attn", T, h * hd)
        scores_out = g.add_value(a + "scores", (kvh, max_seq_len), "f32", alias=scores)
        g.add_op("attention", [qr, kc, vc, scores, score_ctl], [o, scores_out], n_heads=h, n_kv_heads=kvh,
                 head_dim=hd, scale=1.0 / math.sqrt(hd))
        o_proj = act(a + "o_proj", T, d)
        g.add_op("matmul", [o, p + "self_attn.o_proj.weight"], [o_proj])
        # hidden_states = residual + hidden_states
        x_attn = act(a + "x_attn", T, d)
        g.add_op("add", [x, o_proj], [x_attn])
        # hidden_states = self.post_attention_layernorm(hidden_states)
        xn2 = act(a + "mlp_norm", T, d)
        g.add_op("rms_norm", [x_attn, p + "post_attention_layernorm.weight"], [xn2], eps=cfg.rms_norm_eps)
        # down_proj(act_fn(gate_proj(x)) * up_proj(x))
        gate, up = act(a + "gate", T, f), act(a + "up", T, f)
        g.add_op("matmul", [xn2, p + "mlp.gate_proj.weight"], [gate])
        g.add_op("matmul", [xn2, p + "mlp.up_proj.weight"], [up])
        hmid = act(a + "swiglu", T, f)
        g.add_op("silu_mul", [gate, up], [hmid])
        down = act(a + "down", T, d)
        g.add_op("matmul", [hmid, p + "mlp.down_proj.weight"], [down])
        x_out = act(a + "x_out", T, d)
        g.add_op("add", [x_attn, down], [x_out])
        x = x_out
    xf = act("x.final_norm", T, d)
    g.add_op("rms_norm", [x, "model.norm.weight"], [xf], eps=cfg.rms_norm_eps)
    head = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
    logits = act("logits", T, cfg.vocab_size)
    g.add_op("matmul", [xf, head], [logits])
    g.outputs = [logits]
    return g


def build_graphs(model: LlamaModel, prefill_T: int = 128, max_seq_len: int | None = None,
                 kv_dtype: str = "f32") -> tuple[Graph, Graph]:
    """(prefill, decode) sharing parameter names and KV-cache state names."""
    cfg = model.config
    max_seq_len = max_seq_len or min(cfg.max_position_embeddings, 2048)
    if prefill_T < 1 or max_seq_len < 1:
        raise ModelError(f"prefill chunk ({prefill_T}) and max sequence length ({max_seq_len}) must be positive")
    w = _weights(model.tensors)
    return (build_graph(cfg, w, prefill_T, max_seq_len, "prefill", kv_dtype),
            build_graph(cfg, w, 1, max_seq_len, "decode", kv_dtype))
