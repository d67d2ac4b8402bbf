"""A GGUF's tokenizer (`tokenizer.ggml.*` metadata) as a Hugging Face `tokenizers` tokenizer.json,
the form a plan carries and llmrs-run reads, plus its special ids and chat template.

Byte-level BPE (`tokenizer.ggml.model` = "gpt2": Llama 3, SmolLM2, Qwen2 ...): vocabulary and
merges as stored; `tokenizer.ggml.pre` names llama.cpp's pre-tokenizer, a list of regexes applied
in turn, each splitting the pieces the previous one left and keeping unmatched text as pieces of
its own (src/llama-vocab.cpp, unicode.cpp). A chain of `Split(regex, "isolated")` does exactly
that. SentencePiece BPE ("llama": Llama 2) is rebuilt as BPE from the piece scores.
Control and unknown-type tokens become special added tokens, user-defined ones plain added
tokens (llama.cpp stores both as raw text, matched before BPE). The post-processor adds BOS (EOS)
when `tokenizer.ggml.add_bos_token` (add_eos_token) says so.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gguf import TokenType

from .config import ModelError
from .gguf_io import Metadata

# llama.cpp's regexes (C++ literals unescaped); its adaptations of case-insensitive groups are kept
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_TEKKEN = (r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+"
           r"((?=[\p{L}])([^A-Z]))*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")


@dataclass(frozen=True)
class PreTokenizer:
    regexes: tuple[str, ...]
    ignore_merges: bool = False      # a word that is itself in the vocabulary is one token
    add_bos: bool = False            # llama.cpp's default when the file does not say


_LLAMA3_PRE = PreTokenizer((_LLAMA3,), ignore_merges=True, add_bos=True)
_SMOLLM_PRE = PreTokenizer((r"\p{N}", _GPT2))
_GPT2_PRE = PreTokenizer((_GPT2,))
_QWEN2_PRE = PreTokenizer((_QWEN2,))
PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    "default": PreTokenizer((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")),
    "llama3": _LLAMA3_PRE, "llama-v3": _LLAMA3_PRE, "llama-bpe": _LLAMA3_PRE,
    "dbrx": PreTokenizer((_LLAMA3,)), "smaug-bpe": PreTokenizer((_LLAMA3,)),
    "smollm": _SMOLLM_PRE, "starcoder": _SMOLLM_PRE, "refact": _SMOLLM_PRE, "codeshell": _SMOLLM_PRE,
    "command-r": _SMOLLM_PRE,
    "gpt-2": _GPT2_PRE, "phi-2": _GPT2_PRE, "mpt": _GPT2_PRE, "olmo": _GPT2_PRE,
    "qwen2": _QWEN2_PRE, "deepseek-r1-qwen": _QWEN2_PRE, "stablelm2": _QWEN2_PRE, "megrez": _QWEN2_PRE,
    "tekken": PreTokenizer((_TEKKEN,), ignore_merges=True, add_bos=True),
}

# control tokens llama.cpp also ends generation on, found by their text (its vocab loader does the
# same), so an instruct model stops at its end-of-turn token though the file names only eos
_END_TEXTS = ("<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "<|im_end|>", "<|endoftext|>", "<|end|>",
              "<end_of_turn>", "</s>")
_SPECIAL_TYPES = (TokenType.CONTROL, TokenType.UNKNOWN)


@dataclass(frozen=True)
class Vocab:
    tokenizer_json: str
    bos_id: int | None
    stop_ids: tuple[int, ...]                # eos, eot, eom, then other end-of-turn control tokens
    bos_token: str | None                    # the strings a chat template refers to
    eos_token: str | None
    chat_template: str | None
    notices: tuple[str, ...] = field(default_factory=tuple)


def _special_id(meta: Metadata, key: str, n_tokens: int) -> int | None:
    tid = meta.get(key, int, None)
    if tid is not None and not 0 <= tid < n_tokens:
        raise ModelError(f"{meta.path}: metadata {key} is {tid}, outside the {n_tokens}-token vocabulary")
    return tid


def _merge_pairs(meta: Metadata, merges: list[str]) -> list[tuple[str, str]]:
    pairs = []
    for i, m in enumerate(merges):
        cut = m.find(" ", 1)  # as llama.cpp splits them: a first part may itself start with a space
        if cut < 0:
            raise ModelError(f"{meta.path}: tokenizer.ggml.merges[{i}] {m[:40]!r} is not two tokens separated by a space")
        pairs.append((m[:cut], m[cut + 1:]))
    return pairs


def _byte_level_bpe(meta: Metadata, vocab: dict[str, int], notices: list[str]) -> tuple[Any, bool]:
    """(tokenizer, llama.cpp's default add_bos) for tokenizer.ggml.model 'gpt2'."""
    from tokenizers import Tokenizer, Regex, decoders, models, pre_tokenizers

    if meta.has("tokenizer.ggml.pre"):
        pre_name = meta.get("tokenizer.ggml.pre", str)
    else:
        pre_name = "default"
        notices.append("tokenizer.ggml.pre is missing: using llama.cpp's 'default' pre-tokenizer, as llama.cpp "
                       "does; text may split differently from the original tokenizer")
    pre = PRE_TOKENIZERS.get(pre_name)
    if pre is None:
        raise ModelError(f"{meta.path}: tokenizer.ggml.pre {pre_name!r} is not supported "
                         f"(llmrs knows {', '.join(sorted(PRE_TOKENIZERS))})")
    merges = _merge_pairs(meta, meta.get("tokenizer.ggml.merges", list, why=" (a byte-level BPE needs its merges)"))
    try:
        tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=pre.ignore_merges))
    except Exception as e:  # tokenizers raises its own exception types
        raise ModelError(f"{meta.path}: tokenizer.ggml.merges do not fit tokenizer.ggml.tokens ({e})") from None
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre.regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    return tok, pre.add_bos


def _sentencepiece_bpe(meta: Metadata, vocab: dict[str, int], unk: str | None) -> tuple[Any, bool]:
    """(tokenizer, default add_bos) for tokenizer.ggml.model 'llama' (Llama 2, Mistral 7B).

    llama.cpp merges the adjacent pair whose joined piece has the highest score, falls back to
    <0xXX> byte tokens, and writes spaces as U+2581 with one in front of the text and after each
    special token (add_space_prefix). As BPE: every split of a piece into two pieces is a merge,
    ranked by the joined piece's score; Prepend + Replace normalise (per segment, as llama.cpp)."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    scores = meta.get("tokenizer.ggml.scores", list, why=" (a SentencePiece vocabulary is ranked by them)")
    if len(scores) != len(vocab):
        raise ModelError(f"{meta.path}: tokenizer.ggml.scores has {len(scores)} entries for {len(vocab)} tokens")
    ranked = []
    for piece, i in vocab.items():
        pairs = [(piece[:k], piece[k:]) for k in range(1, len(piece)) if piece[:k] in vocab and piece[k:] in vocab]
        ranked += [(-scores[i], vocab[a], vocab[b], a, b) for a, b in pairs]
    merges = [(a, b) for *_, a, b in sorted(ranked)]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    prefix = meta.get("tokenizer.ggml.add_space_prefix", bool, True)
    spaces = [normalizers.Replace(" ", "\u2581")]
    tok.normalizer = normalizers.Sequence(([normalizers.Prepend("\u2581")] if prefix else []) + spaces)
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
                                    + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    return tok, True


def read_vocab(meta: Metadata) -> Vocab:
    """The tokenizer, special ids and chat template from a GGUF's metadata; one-line errors."""
    from tokenizers import AddedToken, processors

    p = meta.path
    model = meta.get("tokenizer.ggml.model", str, why=" (llmrs takes the tokenizer from the GGUF file)")
    if model not in ("gpt2", "llama"):
        raise ModelError(f"{p}: tokenizer.ggml.model {model!r} is not supported; llmrs reads byte-level BPE "
                         "('gpt2': Llama 3, SmolLM2, Qwen2) and SentencePiece BPE ('llama': Llama 2) vocabularies")
    tokens = meta.get("tokenizer.ggml.tokens", list)
    n = len(tokens)
    types = meta.get("tokenizer.ggml.token_type", list, None) or [TokenType.NORMAL] * n
    if len(types) != n:
        raise ModelError(f"{p}: tokenizer.ggml.token_type has {len(types)} entries for {n} tokens")
    ids = {k: _special_id(meta, f"tokenizer.ggml.{k}_token_id", n) for k in ("bos", "eos", "eot", "eom", "unknown")}
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        if vocab.setdefault(t, i) != i:  # llama.cpp refuses such a vocabulary too
            raise ModelError(f"{p}: tokenizer.ggml.tokens has {t[:40]!r} twice (ids {vocab[t]} and {i})")
    notices: list[str] = []
    if model == "gpt2":
        tok, default_bos = _byte_level_bpe(meta, vocab, notices)
    else:
        tok, default_bos = _sentencepiece_bpe(meta, vocab, tokens[ids["unknown"]] if ids["unknown"] is not None else None)
    add_bos = meta.get("tokenizer.ggml.add_bos_token", bool, default_bos)
    add_eos = meta.get("tokenizer.ggml.add_eos_token", bool, False)
    for flag, key in ((add_bos, "bos"), (add_eos, "eos")):
        if flag and ids[key] is None:
            raise ModelError(f"{p}: tokenizer.ggml.add_{key}_token is true but tokenizer.ggml.{key}_token_id is missing")
    special = {i for i, t in enumerate(types) if t in _SPECIAL_TYPES} | {i for i in ids.values() if i is not None}
    user = {i for i, t in enumerate(types) if t == TokenType.USER_DEFINED} - special
    # the vocabulary already maps these texts, so they keep their ids
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in sorted(special)])
    tok.add_tokens([AddedToken(tokens[i], special=False, normalized=False) for i in sorted(user)])
    if add_bos or add_eos:
        def template(seq: str, type_id: int) -> list[str]:  # list form: token texts may hold spaces
            return ([f"{tokens[ids['bos']]}:{type_id}"] if add_bos else []) + [f"${seq}:{type_id}"] + \
                ([f"{tokens[ids['eos']]}:{type_id}"] if add_eos else [])
        tok.post_processor = processors.TemplateProcessing(
            single=template("A", 0), pair=template("A", 0) + template("B", 1),
            special_tokens=[(tokens[ids[k]], ids[k]) for k, on in (("bos", add_bos), ("eos", add_eos)) if on])
    stop = [ids[k] for k in ("eos", "eot", "eom") if ids[k] is not None]
    stop += [i for i in sorted(special) if tokens[i] in _END_TEXTS]
    return Vocab(
        tokenizer_json=tok.to_str(),
        bos_id=ids["bos"],
        stop_ids=tuple(dict.fromkeys(stop)),
        bos_token=tokens[ids["bos"]] if ids["bos"] is not None else None,
        eos_token=tokens[ids["eos"]] if ids["eos"] is not None else None,
        chat_template=meta.get("tokenizer.chat_template", str, None),
        notices=tuple(notices),
    )
