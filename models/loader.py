"""Reading a model: a Hugging Face folder or a GGUF file -> Model (config, tensors left on disk,
tokenizer, chat template), every part checked, with one-line errors naming the file."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from .config import ModelConfig, ModelError, expected_tensors, load_config, read_json
from .safetensors_io import TensorRef, open_folder


def _ignorable(name: str, cfg: ModelConfig) -> bool:
    # old exports carry RoPE buffers; tied checkpoints sometimes still store the head
    return name.endswith("rotary_emb.inv_freq") or (cfg.tie_word_embeddings and name == "lm_head.weight")


def check_weights(cfg: ModelConfig, refs: dict[str, TensorRef], where: str) -> dict[str, TensorRef]:
    want = expected_tensors(cfg)
    arch = cfg.family.hf_architecture
    for name, shape in want.items():
        if name not in refs:
            raise ModelError(f"{where}: tensor {name!r} is missing (config.json expects it in a {arch}, "
                             f"shape {list(shape)})")
        if refs[name].shape != shape:
            raise ModelError(f"{where}: tensor {name!r} has shape {list(refs[name].shape)}, "
                             f"config.json implies {list(shape)}")
    extra = sorted(n for n in refs if n not in want and not _ignorable(n, cfg))
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise ModelError(f"{where}: unexpected tensor {extra[0]!r}{more}: a {arch} as config.json describes has "
                         "no such tensor; the checkpoint does not match config.json")
    return {n: refs[n] for n in want}


@dataclass
class Model:
    path: Path
    config: ModelConfig
    tensors: dict[str, TensorRef]           # graph name -> on-disk tensor (safetensors or GGUF)
    tokenizer_json: str | None = None       # Hugging Face tokenizer.json text; None: none given
    chat_template: str | None = None        # jinja2 source, for llmrs-run --chat
    bos_token: str | None = None            # the special-token strings a chat template refers to
    eos_token: str | None = None
    notices: tuple[str, ...] = ()           # things the user should know about how it was read


LlamaModel = Model   # its name before Qwen; the compiler and older callers import it


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


def load_hf_folder(model_dir: Path) -> Model:
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
    return Model(model_dir, cfg, refs, tokenizer_json, template if isinstance(template, str) else None,
                      _token_text(extra.get("bos_token")), _token_text(extra.get("eos_token")),
                      () if tokenizer_json is not None else (NO_TOKENIZER.format(where=model_dir),))


def load_gguf(path: Path) -> Model:
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
    return Model(path, cfg, tensors, vocab.tokenizer_json, vocab.chat_template,
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


def load_model(model: str | Path) -> Model:
    """A Hugging Face folder or a .gguf file, by what the path is."""
    model = Path(model)
    if model.is_dir() or (not model.exists() and model.suffix != ".gguf"):
        return load_hf_folder(model)
    return load_gguf(model)


