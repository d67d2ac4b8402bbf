"""runtime/model.py, the object behind llmrs.load, llmrs-run --chat and llmrs-serve: transformers'
numbers through it, text that streams whole characters, stop strings, and a KV cache kept between
calls that gives the same tokens and logits as a fresh one."""
from __future__ import annotations

import os
import threading
import warnings

import numpy as np
import pytest

from llmrs.runtime.backends.cpu import CpuBackendError
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


def test_load_refuses_unknown_backends_and_options_naming_those_it_takes(plans):
    with pytest.raises(ValueError, match="backend 'tpu': choose one of cpu, opencl, reference"):
        Model.load(plans["a"], backend="tpu")
    with pytest.raises(TypeError) as e:
        Model.load(plans["a"], eviction="sliding")
    assert str(e.value).startswith("unknown option 'eviction' (Model.load takes: backend, threads, device, "
                                   "hybrid_start, ")
    assert "eviction_policy, eviction_window, protected_prefix, memory_threshold_mb" in str(e.value)


def _in_thread(fn, timeout: float = 60):
    """fn() on another thread; its result or exception. A hang fails the test instead of the suite."""
    out = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 (handed back to the test)
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"{fn} hung"
    if "error" in out:
        raise out["error"]
    return out.get("value")


def test_a_closed_model_refuses_every_use_in_one_line_instead_of_hanging(plans):
    """Before, generate after close() (or after a `with` block) waited forever at the closed CPU
    thread team's barrier."""
    gd = np.load(DATA / "golden-a.npz")
    prompt = gd["prompt_tokens"].tolist()
    with _load(plans) as model:
        assert _tokens(model.generate(prompt, max_tokens=3)) == gd["generated"][:3].tolist()
        unfinished = model.generate(prompt, max_tokens=9)
        next(unfinished)
    assert unfinished.finish_reason == "cancelled" and list(unfinished) == []
    message = f"{plans['a']}: the model is closed; llmrs.load the plan again to use it"
    for use in (lambda: list(model.generate(prompt, max_tokens=3)), lambda: model.chat(QUESTION),
                lambda: model.logits(prompt), model.reset, lambda: model.tokenize("hi"),
                lambda: model.detokenize([5]), lambda: model.render_chat(QUESTION)):
        with pytest.raises(EngineError) as e:
            _in_thread(use)
        assert str(e.value) == message
    model.close()   # a second close does nothing
    with pytest.raises(CpuBackendError, match="^the CPU back end is closed; load the plan again$"):
        _in_thread(lambda: model.backend.run("decode", np.array([5]), 0, 0))


def test_text_that_is_not_unicode_is_repaired_with_one_warning(plans):
    """Before, a lone surrogate reached the tokenizer: TypeError: TextInputSequence must be str."""
    from llmrs.runtime.model import TextRepairWarning, clean_text

    model = _load(plans)
    with pytest.warns(TextRepairWarning) as caught:
        ids = model.tokenize("hi \udcff there \ud800")
    assert [str(w.message) for w in caught] == [
        "the text is not valid Unicode: 2 lone surrogates (U+DCFF from byte 0xFF, U+D800) replaced by U+FFFD"]
    assert ids == model.tokenize("hi \ufffd there \ufffd")
    with pytest.warns(TextRepairWarning, match="1 lone surrogate"):
        c = model.generate("Once upon \udcff", max_tokens=4)
    assert c.prompt == model.tokenize("Once upon \ufffd") and len(_tokens(c)) == 4
    with pytest.warns(TextRepairWarning):
        model.chat([{"role": "user", "content": "\udce9t\udce9"}], max_tokens=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # valid text, and a surrogate pair, pass without a word
        assert clean_text("ok \ud83d\ude00 \U0001f600") == "ok \U0001f600 \U0001f600"
        assert model.detokenize(model.tokenize("Grüße \U0001f600", add_special_tokens=False)) == "Grüße \U0001f600"


@pytest.mark.parametrize("call, error, message", [
    (lambda m: m.generate(b"hello"), TypeError,
     "prompt must be str or token ids, got bytes: decode it first (prompt.decode())"),
    (lambda m: m.generate(123), TypeError, "prompt must be str or a list of token ids, got int"),
    (lambda m: m.generate([1, "2"]), TypeError, "prompt must be whole numbers (token ids), got '2'"),
    (lambda m: m.generate("hi", temperature="hot"), TypeError, "temperature must be a number >= 0, got 'hot'"),
    (lambda m: m.generate("hi", seed="x"), TypeError, "seed must be a whole number >= 0 or None, got 'x'"),
    (lambda m: m.generate("hi", top_k=2.5), TypeError, "top_k must be a whole number >= 0, got 2.5"),
    (lambda m: m.generate("hi", max_tokens=True), TypeError, "max_tokens must be a whole number >= 1 or None, got True"),
    (lambda m: m.generate("hi", stop=5), TypeError, "stop must be a string or a list of strings, got 5"),
    (lambda m: m.detokenize([10**9]), ValueError, "token id 1000000000 is not in 0..383"),
    (lambda m: m.detokenize([-1]), ValueError, "token id -1 is not in 0..383"),
    (lambda m: m.detokenize("hi"), TypeError, "tokens must be a sequence of token ids, got str"),
    (lambda m: m.tokenize(b"hi"), TypeError, "text must be str, got bytes"),
    (lambda m: m.logits([3, 4.0]), TypeError, "tokens must be whole numbers (token ids), got 4.0"),
])
def test_bad_api_arguments_are_one_line_errors_naming_the_argument(plans, call, error, message):
    """Before: bytes were token ids, detokenize([10**9]) was "", and the rest were internal TypeErrors."""
    with pytest.raises(error) as e:
        call(_load(plans))
    assert str(e.value) == message


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(threads="2"), TypeError, "threads must be a whole number >= 1, got '2'"),
    (dict(threads=0), ValueError, "threads must be a whole number >= 1, got 0"),
    (dict(device=1.5), TypeError, "device must be an OpenCL device index or name, got 1.5"),
])
def test_bad_load_arguments_are_one_line_errors(plans, kwargs, error, message):
    with pytest.raises(error) as e:
        Model.load(plans["a"], **kwargs)
    assert str(e.value) == message
    with pytest.raises(TypeError, match=r"^plan must be a path to a plan file, got \['a.plan'\]$"):
        Model.load(["a.plan"])


def test_more_threads_than_cpus_are_capped_with_a_warning(plans):
    cpus = len(os.sched_getaffinity(0))
    with pytest.warns(UserWarning) as caught:
        model = Model.load(plans["a"], threads=1000)
    assert [str(w.message) for w in caught] == [
        f"threads 1000 is more than the {cpus} CPUs this process may use: using {cpus}"]
    assert model.backend.threads == cpus


def test_a_second_thread_is_refused_while_another_threads_generation_is_unfinished(plans):
    """One generation at a time: before, the second thread's generate broke the first with
    'generator already executing'. Now it gets one line and the first runs to its end."""
    gd = np.load(DATA / "golden-a.npz")
    prompt = gd["prompt_tokens"].tolist()
    model = _load(plans)
    first = model.generate(prompt, max_tokens=9)
    pieces = [next(first)]
    busy = ("the model is busy: a generation another thread started is unfinished (one at a time per Model; "
            "finish or close() it first, or llmrs.load a second Model)")
    for use in (lambda: model.generate("hi"), lambda: model.logits([5]), model.reset):
        with pytest.raises(EngineError) as e:
            _in_thread(use)
        assert str(e.value) == busy
    # its steps may be taken on any thread (llmrs-serve steps on worker threads)
    pieces += _in_thread(lambda: list(first))
    assert first.tokens == gd["generated"].tolist() and "".join(pieces) == first.text
    # finished: the other thread's turn
    assert _in_thread(lambda: _tokens(model.generate(prompt, max_tokens=9))) == first.tokens


def test_a_generation_streaming_on_one_thread_is_closed_from_another_between_two_steps(plans):
    model = _load(plans)
    c = model.generate(np.load(DATA / "golden-a.npz")["prompt_tokens"].tolist(), max_tokens=200)
    steps, started, seen = c.steps(), threading.Event(), []

    def stream():
        for piece in steps:
            seen.append(piece)
            started.set()

    t = threading.Thread(target=stream)
    t.start()
    assert started.wait(60)
    c.close()           # before, "generator already executing" if it landed mid-step
    t.join(60)
    assert not t.is_alive() and c.finish_reason == "cancelled" and 1 <= len(seen) < 200
    assert _tokens(model.generate([5, 6], max_tokens=2)) == _tokens(_load(plans).generate([5, 6], max_tokens=2))
