"""runtime/model.py, the object behind llmrs.load, llmrs-run --chat and llmrs-serve: transformers'
numbers through it, text that streams whole characters, stop strings, and a KV cache kept between
calls that gives the same tokens and logits as a fresh one."""
from __future__ import annotations

import numpy as np
import pytest

from llmrs.runtime.chat import ChatTemplateError
from llmrs.runtime.engine import EngineError
from llmrs.runtime.model import Detokenizer, Model, StopScan

from ..conftest import DATA, rel_err
from .chat_plans import CHAT_KEYS, compile_tiny

QUESTION = [{"role": "user", "content": "What is the value of self?"}]  # golden-a answers "anan..."


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    d = tmp_path_factory.mktemp("plans")
    return {"a": compile_tiny(d / "a.plan.bin", **CHAT_KEYS), "b": compile_tiny(d / "b.plan.bin", "golden-b"),
            "a-base": compile_tiny(d / "a-base.plan.bin")}


def _load(plans, name="a", backend="cpu"):
    return Model.load(plans[name], backend=backend, threads=2 if backend == "cpu" else None)


def _tokens(completion) -> list[int]:
    """Run a completion to its end; its generated token ids."""
    for _ in completion:
        pass
    return completion.tokens


@pytest.mark.parametrize("name", ["a", "b"])
def test_generate_streams_transformers_greedy_tokens(plans, name):
    gd = np.load(DATA / f"golden-{name}.npz")
    model = _load(plans, name)
    c = model.generate(gd["prompt_tokens"].tolist(), max_tokens=len(gd["generated"]))
    pieces = list(c)
    assert c.tokens == gd["generated"].tolist() and c.finish_reason == "length"
    assert "".join(pieces) == c.text == model.detokenize(c.tokens, skip_special_tokens=True)
    assert c.prompt_tokens == len(gd["prompt_tokens"]) == (30 if name == "a" else 40)
    assert c.completion_tokens == 9 and c.stats.decode_tokens == 8


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_logits_rows_match_transformers(plans, backend):
    gd = np.load(DATA / "golden-a.npz")
    model = _load(plans, backend=backend)
    prompt = gd["prompt_tokens"].tolist()
    rows = model.logits(prompt)
    assert rows.shape == (30, 384) and rows.dtype == np.float32
    assert rel_err(rows, gd["prefill_logits"]) <= 1e-4
    # the generated tokens' rows continue the same sequence
    more = model.logits(prompt + gd["generated"][:-1].tolist())
    assert rel_err(more[30:], gd["decode_logits"]) <= 1e-4
    last = model.logits(prompt, last=True)
    assert last.shape == (384,) and rel_err(last, gd["prefill_logits"][-1]) <= 1e-4


def test_a_longer_prompt_reuses_the_cache_and_matches_a_fresh_model(plans):
    gd = np.load(DATA / "golden-a.npz")
    prompt = gd["prompt_tokens"].tolist()
    cached, fresh = _load(plans), _load(plans)
    opts = dict(max_tokens=10, temperature=0.9, top_k=40, repetition_penalty=1.3, seed=7)
    first = cached.generate(prompt[:20], **opts)
    list(first)
    assert first.cached_tokens == 0 and first.prefilled_tokens == 20
    again = cached.generate(prompt, **opts)
    text = "".join(again)
    assert again.cached_tokens == 20 and again.prefilled_tokens == 10
    ref = fresh.generate(prompt, **opts)
    assert "".join(ref) == text and ref.tokens == again.tokens  # the penalty saw the cached prefix too
    assert np.array_equal(cached.logits(prompt, last=True), fresh.logits(prompt, last=True))


def test_a_diverging_prompt_rewinds_to_the_common_prefix(plans):
    gd = np.load(DATA / "golden-a.npz")
    prompt = gd["prompt_tokens"].tolist()
    model, fresh = _load(plans), _load(plans)
    list(model.generate(prompt, max_tokens=5))
    other = prompt[:12] + [70, 71, 72]
    c = model.generate(other, max_tokens=6)
    tokens = _tokens(c)
    assert c.cached_tokens == 12 and c.prefilled_tokens == 3
    assert tokens == _tokens(fresh.generate(other, max_tokens=6))
    # the same prompt again: all but its last token are cached (its logits start the reply)
    same = model.generate(other, max_tokens=6)
    assert _tokens(same) == tokens and same.cached_tokens == 14


def test_a_second_chat_turn_prefills_only_itself(plans):
    model = _load(plans)
    first = model.chat(QUESTION, max_tokens=6)
    reply = "".join(first)
    assert reply == "an" * 6 and first.finish_reason == "length"
    convo = QUESTION + [{"role": "assistant", "content": reply}, {"role": "user", "content": "And?"}]
    ids1 = model.tokenize(model.render_chat(QUESTION), add_special_tokens=False)
    ids2 = model.tokenize(model.render_chat(convo), add_special_tokens=False)
    assert ids1[0] == 368 and ids1.count(368) == 1  # the template's BOS, and no second one from the tokenizer
    second = model.chat(convo, max_tokens=6)
    text = "".join(second)
    # cached: the first prompt and the reply tokens that were fed back (all but the last one drawn)
    assert second.cached_tokens == len(ids1) + 5 and second.prompt_tokens == len(ids2)
    assert second.prefilled_tokens == len(ids2) - len(ids1) - 5 < len(ids2) // 2
    fresh = _load(plans).chat(convo, max_tokens=6)
    assert "".join(fresh) == text and fresh.tokens == second.tokens


def test_stop_strings_end_the_reply_and_are_never_shown(plans):
    model = _load(plans)
    c = model.chat(QUESTION, max_tokens=20, stop=["nana", "zz"])
    assert list(c) == ["a"] and c.finish_reason == "stop" and c.completion_tokens == 3
    c = model.chat(QUESTION, max_tokens=20, stop="nan")
    assert "".join(c) == "a" and c.finish_reason == "stop"
    c = model.chat(QUESTION, max_tokens=4, stop=["anx"])  # held back, then let out at the end
    assert list(c)[-1].endswith("an") and c.text == "an" * 4 and c.finish_reason == "length"


def test_stop_scan_holds_back_a_possible_stop_string():
    scan = StopScan(["</s>", "END"])
    out = [scan.push(p) for p in ["Hello <", "/", "x", " E", "N", "D and more"]]
    assert out == [("Hello ", False), ("", False), ("</x", False), (" ", False), ("", False), ("", True)]
    assert StopScan(["ab"]).finish("xa") == ("xa", False)


def test_detokenizer_never_splits_a_character(plans):
    model = _load(plans)
    text = "Grüße, 日本語 and ü"
    ids = model.tokenize(text, add_special_tokens=False)
    assert len(ids) > len(text) // 2  # byte-level: the CJK characters take several tokens each
    detok = Detokenizer(model.tokenizer)
    pieces = [detok.push(t) for t in ids] + [detok.flush()]
    assert "".join(pieces) == text and not any("\ufffd" in p for p in pieces)
    assert sum(1 for p in pieces if p) > 5  # it streams, not one piece at the end


def test_starting_a_generation_closes_the_unfinished_one(plans):
    model = _load(plans)
    gd = np.load(DATA / "golden-a.npz")
    prompt = gd["prompt_tokens"].tolist()
    first = model.generate(prompt, max_tokens=30)
    next(first)
    second = model.generate(prompt, max_tokens=9)
    assert _tokens(second) == gd["generated"].tolist()
    assert first.finish_reason == "cancelled" and list(first) == []
    assert second.cached_tokens == 29


def test_bad_options_and_prompts_are_one_line_errors(plans):
    model = _load(plans)
    cases = [(dict(top_p=0), ValueError, r"top_p must be in \(0, 1\], got 0"),
             (dict(max_tokens=0), ValueError, "max_tokens must be a whole number of at least 1, got 0"),
             (dict(temperature=-1), ValueError, "temperature must be >= 0"),
             (dict(stop=["ok", ""]), ValueError, "stop must be non-empty strings")]
    for kwargs, error, message in cases:
        with pytest.raises(error, match=message):
            model.generate("hi", **kwargs)
    with pytest.raises(EngineError, match="the prompt has 300 tokens but the KV cache holds 256"):
        model.generate([5] * 300)
    with pytest.raises(ValueError, match=r"token id 384 is not in 0..383"):
        model.logits([1, 384])
    with pytest.raises(EngineError, match="the prompt is empty"):
        model.generate([])
    with pytest.raises(ValueError, match="message 0 must have a string 'role' and a string 'content'"):
        model.chat([{"role": "user"}])
    with pytest.raises(ChatTemplateError, match="the plan has no chat template"):
        _load(plans, "a-base").chat(QUESTION)


def test_load_refuses_unknown_backends_and_engine_options(plans):
    with pytest.raises(ValueError, match="backend 'tpu': choose one of cpu, opencl, reference"):
        Model.load(plans["a"], backend="tpu")
    with pytest.raises(TypeError, match=r"unknown engine option 'eviction' \(this engine takes: cache\)"):
        Model.load(plans["a"], eviction="sliding")
