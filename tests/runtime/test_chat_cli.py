"""llmrs-run --chat as a user meets it: turns on standard input, replies on stdout, the KV cache kept
between turns (checked through --stats against the template rendered here), Ctrl-C and Ctrl-D."""
from __future__ import annotations

import os
import select
import signal
import subprocess
import time

import pytest

from llmrs.child import python_argv
from llmrs.runtime.model import Model

from .chat_plans import CHAT_KEYS, compile_tiny

RUN = "from llmrs.runtime.cli import main; sys.exit(main())"
STATS = r"turn (\d+): prompt (\d+) tokens \((\d+) cached, (\d+) prefilled"


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    d = tmp_path_factory.mktemp("plans")
    return {"chat": compile_tiny(d / "chat.plan.bin", **CHAT_KEYS),
            # no stop tokens: a reply runs to the end of the cache unless it is stopped
            "long": compile_tiny(d / "long.plan.bin", max_seq_len=4096, prefill_chunk=64, stop_ids=[], **CHAT_KEYS),
            "base": compile_tiny(d / "base.plan.bin")}


def _chat(plan, stdin: str, *flags: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(python_argv(RUN, str(plan), "--chat", "--threads", "2", *flags), input=stdin,
                          capture_output=True, text=True, timeout=timeout)


def _turn_stats(stderr: str) -> list[tuple[int, int, int]]:
    import re
    return [tuple(map(int, m.groups()[1:])) for m in re.finditer(STATS, stderr)]


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.mark.parametrize("system", [None, "Be brief."])
def test_two_turns_from_a_pipe_prefill_only_the_new_turn(plans, system):
    turns = ["What is the value of self?", "", "And what did I ask?"]  # a blank line is no turn
    flags = ["-n", "6", "--stats"] + (["--system", system] if system else [])
    done = _chat(plans["chat"], "\n".join(turns) + "\n", *flags)
    assert done.returncode == 0, done.stderr
    # the same conversation, rendered and generated here on fresh models (no cache to reuse)
    model = Model.load(plans["chat"], threads=2)
    convo = [{"role": "system", "content": system}] if system else []
    expected_out, expected_stats, fed = "", [], []
    for text in (turns[0], turns[2]):
        convo.append({"role": "user", "content": text})
        ids = model.tokenize(model.render_chat(convo), add_special_tokens=False)
        reply = Model.load(plans["chat"], threads=2).generate(ids, max_tokens=6)
        reply_text = "".join(reply)
        cached = min(_common(fed, ids), len(ids) - 1)
        expected_stats.append((len(ids), cached, len(ids) - cached))
        fed = ids + reply.tokens[:-1]   # the last token drawn is never fed back
        convo.append({"role": "assistant", "content": reply_text})
        expected_out += reply_text + "\n"
    assert done.stdout == expected_out
    assert _turn_stats(done.stderr) == expected_stats
    (n1, c1, p1), (n2, c2, p2) = expected_stats
    assert c1 == 0 and p1 == n1 and c2 > n1 and p2 < n2 - n1
    if system is None:  # golden-a's reply "anan..." tokenizes back to the tokens it came from
        assert c2 == n1 + 5


def test_chat_without_a_template_is_a_one_line_error(plans):
    done = _chat(plans["base"], "hi\n")
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and "the plan has no chat template (a base model); use --prompt" in done.stderr


@pytest.mark.parametrize("flags, message", [
    (["--prompt", "hi"], "--chat reads its turns from standard input: leave out --prompt, --prompts-file, --dump-logits and --profile"),
    (["-n", "0"], "-n must be at least 1, got 0"),
    (["--top-p", "2"], "--top-p must be in (0, 1], got 2.0"),
])
def test_bad_chat_flags_are_one_line_errors(plans, flags, message):
    done = _chat(plans["chat"], "hi\n", *flags)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and message in done.stderr, done.stderr


def test_a_conversation_longer_than_the_cache_stops_with_a_one_line_error(plans):
    done = _chat(plans["chat"], "What is the value of self?\n" + "word " * 300 + "\n", "-n", "4")
    assert done.returncode == 2 and done.stdout.count("\n") == 1
    assert done.stderr.count("\n") == 1 and "but the KV cache holds 256" in done.stderr


def _read_until(proc, fd: int, predicate, timeout: float = 60) -> bytes:
    out, end = b"", time.monotonic() + timeout
    while not predicate(out):
        assert time.monotonic() < end, f"waited for output; have {out[-200:]!r}"
        if select.select([fd], [], [], 0.5)[0]:
            chunk = os.read(fd, 65536)
            assert chunk, f"the session ended early; output {out[-200:]!r}, stderr {proc.stderr.read()!r}"
            out += chunk
    return out


def test_ctrl_c_stops_a_reply_and_the_session_goes_on(plans):
    # no -n: a reply would run to the end of a 4096-token cache, so only Ctrl-C ends one early
    proc = subprocess.Popen(python_argv(RUN, str(plans["long"]), "--chat", "--threads", "2", "--stats"),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    replies = []
    try:
        fd = proc.stdout.fileno()
        for turn in (b"What is the value of self?\n", b"Go on\n"):
            proc.stdin.write(turn)
            proc.stdin.flush()
            out = _read_until(proc, fd, lambda o: len(o) >= 40)    # the reply is streaming
            proc.send_signal(signal.SIGINT)
            out += _read_until(proc, fd, lambda o: o.endswith(b"\n"))  # it ends; the session waits
            replies.append(out)
        proc.stdin.close()      # end of input ends the session
        proc.wait(timeout=60)
        rest, err = proc.stdout.read(), proc.stderr.read()
    finally:
        proc.kill()
    assert proc.returncode == 0 and rest == b"", err
    assert err.count(b"finish cancelled") == 2
    (n1, c1, p1), (n2, c2, p2) = _turn_stats(err.decode())
    # turn 2 found turn 1, cut short, in the cache: what was shown stays in the conversation
    model = Model.load(plans["long"], threads=1)
    convo = [{"role": "user", "content": "What is the value of self?"},
             {"role": "assistant", "content": replies[0][:-1].decode()}, {"role": "user", "content": "Go on"}]
    assert n2 == len(model.tokenize(model.render_chat(convo), add_special_tokens=False))
    assert c1 == 0 and n1 < c2 < n2 and p2 == n2 - c2
    assert n2 - n1 < 4000   # the first reply was cut well before the cache's end


def test_a_terminal_session_prompts_and_ends_on_ctrl_d(plans):
    import pty
    leader, follower = pty.openpty()
    proc = subprocess.Popen(python_argv(RUN, str(plans["chat"]), "--chat", "--threads", "2", "-n", "4"),
                            stdin=follower, stdout=follower, stderr=subprocess.PIPE)
    os.close(follower)
    try:
        out = _read_until(proc, leader, lambda o: b">>> " in o)
        os.write(leader, b"What is the value of self?\n")
        out += _read_until(proc, leader, lambda o: b">>> " in o)
        os.write(leader, b"\x04")   # Ctrl-D at the prompt ends the session
        proc.wait(timeout=60)
    finally:
        proc.kill()
        os.close(leader)
    assert proc.returncode == 0
    assert b"anananan\r\n>>> " in out and b"Ctrl-D ends the session" in proc.stderr.read()


# -- --prompt on a plan with a chat template ---------------------------------------------------

def _prompt_ids(plan, tmp_path, *flags: str) -> tuple[int, list[int], str]:
    from llmrs.runtime.cli import main
    dump = tmp_path / "d.npz"
    import contextlib
    import io
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = main([str(plan), "-n", "2", "--dump-logits", str(dump), *flags])
    if rc:
        return rc, [], err.getvalue()
    import numpy as np
    d = np.load(dump)
    return rc, d["tokens"][:len(d["tokens"]) - len(d["logits"])].tolist(), err.getvalue()


@pytest.mark.parametrize("system", [None, "Be brief."])
def test_a_prompt_goes_through_the_chat_template_unless_raw(plans, tmp_path, system):
    model = Model.load(plans["chat"])
    sys_flags = ["--system", system] if system else []
    rc, ids, _ = _prompt_ids(plans["chat"], tmp_path, "-p", "Hello there", *sys_flags)
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": "Hello there"}]
    want = model.tokenize(model.render_chat(messages), add_special_tokens=False)
    assert rc == 0 and ids == want and want[0] == model.tokenize("<|begin_of_text|>", add_special_tokens=False)[0]
    rc, raw, _ = _prompt_ids(plans["chat"], tmp_path, "-p", "Hello there", "--raw")
    assert rc == 0 and raw == model.tokenize("Hello there") and raw != want


def test_system_without_a_template_and_raw_with_chat_are_one_line_errors(plans, tmp_path):
    rc, _, err = _prompt_ids(plans["base"], tmp_path, "-p", "Hi", "--system", "Be brief.")
    assert rc == 2 and err == "llmrs-run: error: --system needs a plan with a chat template (and no --raw)\n"
    rc, _, err = _prompt_ids(plans["chat"], tmp_path, "-p", "Hi", "--raw", "--system", "Be brief.")
    assert rc == 2 and "--system needs a plan with a chat template" in err
    got = _chat(plans["chat"], "hi\n", "--raw")
    assert got.returncode == 2 and got.stderr.strip().endswith("--raw goes with --prompt: --chat always uses the chat template (see --help)")
    assert len(got.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("locale", ["C.UTF-8", "C"])
def test_a_turn_that_is_not_utf8_is_repaired_with_a_warning(plans, locale):
    """Before, the byte 0xFF in a turn was a traceback (UnicodeDecodeError under a UTF-8 locale,
    TypeError: TextInputSequence must be str under C), where --prompt warned and went on."""
    env = {**os.environ, "LC_ALL": locale, "PYTHONIOENCODING": ""}
    done = subprocess.run(python_argv(RUN, str(plans["chat"]), "--chat", "--threads", "2", "-n", "4", "--stats"),
                          input=b"What is \xff the value?\nAnd \xc3\n", capture_output=True, env=env, timeout=120)
    err = done.stderr.decode()
    assert done.returncode == 0, err
    assert err.count("llmrs-run: warning: the chat turn is not valid Unicode: 1 lone surrogate") == 2, err
    assert "(U+DCFF from byte 0xFF) replaced by U+FFFD" in err and "(U+DCC3 from byte 0xC3)" in err
    assert "Traceback" not in err and len(_turn_stats(err)) == 2
    # the model saw U+FFFD where the byte was
    model = Model.load(plans["chat"], threads=2)
    first = model.tokenize(model.render_chat([{"role": "user", "content": "What is \ufffd the value?"}]),
                           add_special_tokens=False)
    assert _turn_stats(err)[0][0] == len(first)
