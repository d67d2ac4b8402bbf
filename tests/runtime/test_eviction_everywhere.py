"""Eviction from every interface, on the real model with a 96-token cache: the Python API generates
past the cache and keeps a conversation going, llmrs-run --chat holds six turns, llmrs-serve answers
requests longer than the cache; without a policy each stops at the cache with one line naming the
limit. Option errors name Python names in the API and flags on the command lines."""
from __future__ import annotations

import contextlib
import io
import re
import select
import subprocess
import sys
import time
from typing import Iterator

import numpy as np
import pytest

import llmrs
from llmrs.child import python_argv
from llmrs.options import OptionError
from llmrs.runtime.cli import main as run_main

CACHE = 96
SLIDING = dict(eviction_policy="sliding", eviction_window=48, protected_prefix=4)
SLIDING_FLAGS = ["--eviction-policy", "sliding", "--eviction-window", "48", "--protected-prefix", "4"]
PROMPT = "Once upon a time"
# replies that run past 40 tokens (no end-of-turn token before), so every turn is 40 tokens long
TOPICS = ["the ocean", "mountains", "forests", "deserts", "rivers", "cities"]
TURNS = [f"Write a long essay about {topic}." for topic in TOPICS]
TURN_STATS = re.compile(r"turn (\d+): prompt (\d+) tokens \((\d+) cached, (\d+) prefilled .*?\), (\d+) generated")


@pytest.fixture(scope="module")
def plan(smollm2_short_plan):
    return smollm2_short_plan


def test_the_python_api_generates_300_tokens_past_a_96_token_cache(plan):
    with llmrs.load(plan, threads=2, **SLIDING) as model:
        c = model.generate(PROMPT, max_tokens=300)
        text = "".join(c)
        start_pos, n_past = model.engine.start_pos, model.engine.n_past
    assert c.completion_tokens == 300 and c.finish_reason == "length" and text.strip()
    events = c.stats.evictions
    assert events and all(e.after <= 4 + 48 for e in events) and c.stats.eviction_policy == "sliding"
    assert start_pos == c.prompt_tokens + 299 and n_past <= CACHE
    # without a policy the same prompt stops at the full cache; until the first eviction the tokens agree
    with llmrs.load(plan, threads=2) as plain:
        ref = plain.generate(PROMPT, max_tokens=300)
        list(ref)
    assert ref.generation.stop_reason == "cache full" and ref.completion_tokens == CACHE - c.prompt_tokens + 1
    first = events[0].start_pos - c.prompt_tokens     # tokens generated when it came
    assert first >= 1 and c.tokens[:first] == ref.tokens[:first]


def test_a_conversation_goes_on_past_the_cache_with_its_sinks_and_recent_window(plan):
    with llmrs.load(plan, threads=2, **SLIDING) as model:
        messages: list[dict[str, str]] = []
        for turn in TURNS[:4]:
            messages.append({"role": "user", "content": turn})
            fed = model.engine.start_pos
            reply = model.chat(messages, max_tokens=40)
            messages.append({"role": "assistant", "content": "".join(reply)})
            assert reply.completion_tokens == 40 and reply.finish_reason == "length"
            # what was fed is never fed again: only the new turn and its template markup
            assert reply.cached_tokens == fed and (fed == 0 or reply.prefilled_tokens < 25)
        engine = model.engine
        assert engine.start_pos > 2 * CACHE
        # the cache holds the sinks (positions 0..3) and then the newest tokens, in order
        n = engine.n_past
        positions = engine.cache.positions[:, :, :n]
        assert (positions[..., :4] == np.arange(4)).all()
        assert (positions[..., 4:] == np.arange(engine.start_pos - (n - 4), engine.start_pos)).all()
        # a prompt that is not the conversation starts over, prefilled whole though it outgrows the cache
        other = model.tokenize("The history of the printing press " * 20)
        assert len(other) > CACHE
        c = model.generate(other, max_tokens=8)
        assert len(list(c)) and c.cached_tokens == 0 and c.prefilled_tokens == len(other)
        assert model.engine.start_pos == len(other) + 7


def test_memory_pressure_evicts_through_the_python_api(plan):
    with open("/proc/meminfo") as f:
        total_mb = next(int(line.split()[1]) for line in f if line.startswith("MemTotal:")) // 1024
    # MemAvailable is always under the machine's memory less what the kernel holds: every step evicts
    with llmrs.load(plan, threads=2, eviction_policy="sliding", memory_threshold_mb=total_mb - 1,
                    eviction_target_ratio=0.5) as model:
        c = model.generate(PROMPT, max_tokens=8)
        list(c)
    assert c.completion_tokens == 8 and {e.trigger for e in c.stats.evictions} == {"memory"}


def _chat_cli(plan, monkeypatch, capsys, *flags: str) -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "stdin", io.StringIO("".join(t + "\n" for t in TURNS)))
    rc = run_main([str(plan), "--chat", "-n", "40", "--threads", "2", "--stats", *flags])
    out, err = capsys.readouterr()
    return rc, out, err


def test_llmrs_run_chat_holds_six_turns_of_40_tokens_with_sliding_eviction(plan, monkeypatch, capsys):
    rc, out, err = _chat_cli(plan, monkeypatch, capsys, *SLIDING_FLAGS)
    assert rc == 0, err
    turns = [tuple(map(int, m.groups())) for m in TURN_STATS.finditer(err)]
    assert [t[0] for t in turns] == [1, 2, 3, 4, 5, 6] and all(t[4] == 40 for t in turns), err
    assert len(out.splitlines()) == 6 and all(line.strip() for line in out.splitlines())
    assert turns[-1][1] > 3 * CACHE                  # the last prompt is the whole conversation
    assert all(prefilled < 25 for *_, prefilled, _ in turns[1:])    # each turn prefilled only itself
    # before: the flags were ignored and the third turn ended the session
    rc, out, err = _chat_cli(plan, monkeypatch, capsys)
    assert rc == 2 and len(out.splitlines()) < 6
    assert re.search(r"llmrs-run: error: the prompt has \d+ tokens but the KV cache holds 96 \(recompile with a "
                     r"larger --max-seq-len, or evict: --eviction-policy sliding, snapkv or h2o\)\n$", err), err


@contextlib.contextmanager
def _serving(plan, *flags: str, timeout: float = 60) -> Iterator[int]:
    """llmrs-serve PLAN FLAGS in a child process on a free loopback port; yields the port."""
    proc = subprocess.Popen(python_argv("from llmrs.runtime.serve import main; sys.exit(main())", str(plan),
                                        "--port", "0", "--threads", "2", *flags),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        end, line = time.monotonic() + timeout, ""
        while not (m := re.search(r"at http://127\.0\.0\.1:(\d+)/v1", line)):
            assert time.monotonic() < end and select.select([proc.stderr], [], [], end - time.monotonic())[0], \
                "llmrs-serve did not start"
            line = proc.stderr.readline()
            assert line, f"llmrs-serve exited with {proc.wait()}"
        yield int(m[1])
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _client(port: int):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)


def test_llmrs_serve_with_sliding_eviction_returns_a_200_token_completion(plan):
    pytest.importorskip("uvicorn")
    with _serving(plan, *SLIDING_FLAGS) as port:
        client = _client(port)
        done = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=200, temperature=0)
        long_prompt = client.completions.create(model="smollm2", prompt=list(range(1000, 1000 + 120)),
                                                max_tokens=4, temperature=0)
    assert done.usage.completion_tokens == 200 and done.choices[0].finish_reason == "length"
    with llmrs.load(plan, threads=2, **SLIDING) as model:    # the same greedy tokens as the Python API's
        assert done.choices[0].text == "".join(model.generate(PROMPT, max_tokens=200))
    assert long_prompt.usage.prompt_tokens == 120 and long_prompt.usage.completion_tokens == 4


def test_llmrs_serve_without_eviction_refuses_a_prompt_the_cache_cannot_hold(plan):
    openai = pytest.importorskip("openai")
    pytest.importorskip("uvicorn")
    with _serving(plan) as port:
        with pytest.raises(openai.BadRequestError) as e:
            _client(port).completions.create(model="smollm2", prompt=list(range(1000, 1000 + 120)), max_tokens=4)
    error = e.value.body
    assert error["code"] == "context_length_exceeded"
    assert error["message"] == ("the prompt has 120 tokens but the KV cache holds 96; shorten it, or start "
                                "llmrs-serve with --eviction-policy sliding, snapkv or h2o")


@pytest.mark.parametrize("options, error, message", [
    (dict(eviction_policy="sliding", eviction_window=0), OptionError, "eviction_window must be at least 1, got 0"),
    (dict(eviction_policy="sliding", eviction_window="48"), TypeError,
     "eviction_window must be a whole number >= 1, got '48'"),
    (dict(eviction_policy="fifo"), OptionError, "eviction_policy 'fifo': choose one of none, sliding, snapkv, h2o"),
    (dict(memory_threshold_mb=100), OptionError,
     "memory_threshold_mb needs an eviction_policy that evicts (sliding, snapkv or h2o)"),
    (dict(eviction_policy="h2o", protected_prefix=95), OptionError,
     "protected_prefix 95 leaves no room in a KV cache of 96 slots; use a smaller prefix or recompile with a "
     "larger max_seq_len"),
])
def test_option_errors_in_the_api_name_python_names(plan, options, error, message):
    with pytest.raises(error) as e:
        llmrs.load(plan, **options)
    assert str(e.value) == message


FLAG_ERRORS = [
    (["--eviction-policy", "sliding", "--eviction-window", "0"], "--eviction-window must be at least 1, got 0"),
    (["--memory-threshold-mb", "100"],
     "--memory-threshold-mb needs an --eviction-policy that evicts (sliding, snapkv or h2o)"),
    (["--eviction-policy", "h2o", "--protected-prefix", "95"],
     "--protected-prefix 95 leaves no room in a KV cache of 96 slots; use a smaller prefix or recompile with a "
     "larger --max-seq-len"),
]


@pytest.mark.parametrize("flags, message", FLAG_ERRORS + [(["--top-p", "0"], "--top-p must be in (0, 1], got 0.0")])
def test_option_errors_of_llmrs_run_name_flags(plan, monkeypatch, capsys, flags, message):
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hi\n"))
    rc = run_main([str(plan), "--chat", *flags])
    assert (rc, capsys.readouterr().err) == (2, f"llmrs-run: error: {message}\n")


@pytest.mark.parametrize("flags, message", FLAG_ERRORS)
def test_option_errors_of_llmrs_serve_name_flags(plan, capsys, flags, message):
    pytest.importorskip("uvicorn")
    from llmrs.runtime.serve import main as serve_main
    rc = serve_main([str(plan), "--port", "0", *flags])
    assert (rc, capsys.readouterr().err) == (2, f"llmrs-serve: error: {message}\n")
