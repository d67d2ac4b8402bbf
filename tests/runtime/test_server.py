"""llmrs-serve through the official openai client and raw HTTP, on a loopback port of its own: the same
tokens as the Python API, streamed and not; OpenAI-shaped 4xx errors; a client that goes away stops
its generation; requests at once are served one after another; the server keeps serving after each."""
from __future__ import annotations

import http.client
import json
import socket
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import numpy as np
import pytest

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from llmrs.child import python_argv  # noqa: E402
from llmrs.runtime.model import Model  # noqa: E402
from llmrs.runtime.serve import listen  # noqa: E402
from llmrs.runtime.server import make_app  # noqa: E402

from ..conftest import DATA  # noqa: E402
from .chat_plans import CHAT_KEYS, compile_tiny  # noqa: E402

QUESTION = [{"role": "user", "content": "What is the value of self?"}]


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    d = tmp_path_factory.mktemp("plans")
    # no stop tokens: a long reply runs to its max_tokens unless something stops it
    return {"chat": compile_tiny(d / "tiny.plan.bin", max_seq_len=4096, prefill_chunk=64, stop_ids=[], **CHAT_KEYS),
            "base": compile_tiny(d / "base.plan.bin")}


class Running(SimpleNamespace):
    def client(self) -> "openai.OpenAI":
        return openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="unused", max_retries=0,
                             timeout=60)

    def raw(self, method: str, path: str, body: bytes | str | None = None) -> tuple[int, dict | str]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        conn.request(method, path, body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        text = resp.read().decode()
        conn.close()
        return resp.status, json.loads(text) if resp.getheader("content-type", "").startswith("application/json") else text

    def idle(self, timeout: float = 30) -> None:
        """Wait until no request holds the model."""
        end = time.monotonic() + timeout
        while self.app.state.llmrs.lock.locked():
            assert time.monotonic() < end, "the model stayed busy"
            time.sleep(0.01)


def _serve(plan, model_id: str):
    model = Model.load(plan, threads=2)
    app = make_app(model, model_id)
    sock = listen("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    end = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < end, "the server did not start"
        time.sleep(0.01)
    running = Running(port=sock.getsockname()[1], model=model, app=app)
    return running, lambda: (setattr(server, "should_exit", True), thread.join(10), sock.close())


@pytest.fixture(scope="module")
def srv(plans):
    running, stop = _serve(plans["chat"], "tiny")
    yield running
    stop()


def _fresh(plans) -> Model:
    return Model.load(plans["chat"], threads=2)


def test_models_are_listed_and_unknown_ones_are_404(srv):
    client = srv.client()
    assert [m.id for m in client.models.list()] == ["tiny"]
    assert client.models.retrieve("tiny").owned_by == "llmrs"
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-4")
    assert e.value.body["code"] == "model_not_found"


def test_completion_gives_transformers_greedy_tokens_streamed_or_not(srv):
    gd = np.load(DATA / "golden-a.npz")
    expected = srv.model.detokenize(gd["generated"].tolist(), skip_special_tokens=True)
    client = srv.client()
    r = client.completions.create(model="tiny", prompt=gd["prompt_tokens"].tolist(), max_tokens=9, temperature=0)
    assert r.choices[0].text == expected and r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (30, 9, 39)
    chunks = list(client.completions.create(model="tiny", prompt=gd["prompt_tokens"].tolist(), max_tokens=9,
                                            temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1]) and len(chunks) >= 3


def test_chat_turns_stream_and_reuse_the_cache(srv, plans):
    client = srv.client()
    r = client.chat.completions.create(model="tiny", messages=QUESTION, max_tokens=6, temperature=0)
    reply = r.choices[0].message.content
    assert reply == "".join(_fresh(plans).chat(QUESTION, max_tokens=6)) == "an" * 6
    assert r.choices[0].message.role == "assistant" and r.object == "chat.completion"
    convo = QUESTION + [{"role": "assistant", "content": reply}, {"role": "user", "content": "And?"}]
    stream = client.chat.completions.create(model="tiny", messages=convo, max_tokens=8, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "".join(_fresh(plans).chat(convo, max_tokens=8))
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.completion_tokens == 8
    # the first turn's prompt and reply were still cached: only the new turn was prefilled
    assert usage.prompt_tokens_details.cached_tokens == r.usage.prompt_tokens + 5
    model = srv.model
    assert usage.prompt_tokens == len(model.tokenize(model.render_chat(convo), add_special_tokens=False))


def test_sse_stream_ends_with_done(srv):
    status, text = srv.raw("POST", "/v1/chat/completions",
                           json.dumps({"messages": QUESTION, "max_tokens": 3, "stream": True, "temperature": 0}))
    events = [e for e in text.split("\n\n") if e]
    assert status == 200 and all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    last = json.loads(events[-2][6:])
    assert last["object"] == "chat.completion.chunk" and last["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("request_body, status, param, code", [
    (b'{"messages": [', 400, None, "invalid_json"),
    (b'["not", "an", "object"]', 400, None, "invalid_json"),
    ({"model": "gpt-4", "messages": QUESTION}, 404, "model", "model_not_found"),
    ({"messages": QUESTION, "max_tokens": 10 ** 6}, 400, "max_tokens", "context_length_exceeded"),
    ({"messages": QUESTION, "max_tokens": 0}, 400, "max_tokens", None),
    ({"messages": QUESTION, "max_tokens": "many"}, 400, "max_tokens", None),
    ({"messages": QUESTION, "temperature": -1}, 400, "temperature", None),
    ({"messages": QUESTION, "n": 2}, 400, "n", "unsupported_parameter"),
    ({"messages": QUESTION, "stop": ["a", 3]}, 400, "stop", None),
    ({"messages": []}, 400, "messages", None),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages[0].content", None),
    ({"messages": QUESTION, "stream": "yes"}, 400, "stream", None),
])
def test_bad_requests_get_openai_errors_and_the_server_goes_on(srv, request_body, status, param, code):
    body = request_body if isinstance(request_body, bytes) else json.dumps(request_body)
    got, reply = srv.raw("POST", "/v1/chat/completions", body)
    assert got == status and set(reply) == {"error"}
    error = reply["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert (error["param"], error["code"]) == (param, code) and "\n" not in error["message"]
    ok = srv.client().chat.completions.create(model="tiny", messages=QUESTION, max_tokens=2, temperature=0)
    assert ok.choices[0].message.content == "anan"


def test_errors_through_the_openai_client(srv):
    client = srv.client()
    with pytest.raises(openai.BadRequestError, match="context is 4096 tokens"):
        client.completions.create(model="tiny", prompt="hi", max_tokens=5000)
    with pytest.raises(openai.NotFoundError, match="the model 'gpt-4' does not exist; this server has 'tiny'"):
        client.chat.completions.create(model="gpt-4", messages=QUESTION)
    with pytest.raises(openai.BadRequestError, match="'prompt' must be a non-empty string or token ids"):
        client.completions.create(model="tiny", prompt="")
    with pytest.raises(openai.BadRequestError, match=r"'prompt' has token ids outside 0..383"):
        client.completions.create(model="tiny", prompt=[1, 2, 999])


def test_unknown_paths_and_methods_are_json_errors(srv):
    status, reply = srv.raw("GET", "/v1/engines")
    assert status == 404 and reply["error"]["code"] == "not_found"
    status, reply = srv.raw("GET", "/v1/chat/completions")
    assert status == 405 and "Method Not Allowed" in reply["error"]["message"]


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_disconnects_stops_its_generation(srv, stream):
    srv.idle()
    body = json.dumps({"prompt": "What is the value of self?", "max_tokens": 3000, "temperature": 0,
                       "stream": stream}).encode()
    sock = socket.create_connection(("127.0.0.1", srv.port), timeout=30)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(body) + body)
    if stream:
        seen = b""
        while b"data: " not in seen:      # the stream has begun
            seen += sock.recv(65536)
    else:
        end = time.monotonic() + 30
        while not srv.app.state.llmrs.lock.locked():     # the generation has begun
            assert time.monotonic() < end
            time.sleep(0.005)
    start = time.monotonic()
    sock.close()
    srv.idle()
    stopped_after = time.monotonic() - start
    # 3000 tokens take seconds here (and hold the model all along); it ended soon after the disconnect
    fed = srv.model.engine.start_pos
    assert fed < 1500 and stopped_after < 2, (fed, stopped_after)
    ok = srv.client().completions.create(model="tiny", prompt="What is the value of self?", max_tokens=4,
                                         temperature=0)
    assert ok.choices[0].finish_reason == "length" and ok.usage.completion_tokens == 4


def test_requests_at_once_are_served_one_at_a_time_with_the_right_answers(srv, plans):
    prompts = ["What is the value of self?", "Return the path", "def __init__(self, value):", "for a in b"]
    expected = ["".join(_fresh(plans).generate(p, max_tokens=12)) for p in prompts]
    client = srv.client()

    def ask(i: int) -> str:     # half of them streamed
        if i % 2:
            return client.completions.create(model="tiny", prompt=prompts[i], max_tokens=12,
                                             temperature=0).choices[0].text
        return "".join(c.choices[0].text for c in client.completions.create(
            model="tiny", prompt=prompts[i], max_tokens=12, temperature=0, stream=True))

    with ThreadPoolExecutor(4) as pool:     # a shared cache used by two at once would garble them
        got = list(pool.map(ask, range(4)))
    assert got == expected


def test_chat_on_a_model_without_a_template_is_a_400(plans):
    running, stop = _serve(plans["base"], "base")
    try:
        client = running.client()
        with pytest.raises(openai.BadRequestError, match="has no chat template") as e:
            client.chat.completions.create(model="base", messages=QUESTION)
        assert e.value.body["code"] == "no_chat_template"
        # and the server still serves: two tokens, or fewer where this random model picks its end token
        done = client.completions.create(model="base", prompt="hi", max_tokens=2)
        n, why = done.usage.completion_tokens, done.choices[0].finish_reason
        assert (n, why) == (2, "length") or (n <= 2 and why == "stop"), (n, why)
    finally:
        stop()


def test_llmrs_serve_command_binds_loopback_and_refuses_a_taken_port(plans):
    taken = listen("127.0.0.1", 0)
    try:
        port = taken.getsockname()[1]
        done = subprocess.run(python_argv("from llmrs.runtime.serve import main; sys.exit(main())",
                                          str(plans["base"]), "--port", str(port)),
                              capture_output=True, text=True, timeout=120)
    finally:
        taken.close()
    assert done.returncode == 2 and done.stderr.count("\n") == 1
    assert f"llmrs-serve: error: cannot listen on 127.0.0.1:{port}" in done.stderr
    assert "(choose another --port or --host)" in done.stderr


def test_help_says_requests_queue_and_the_default_is_loopback():
    from llmrs.runtime.serve import parser
    text = " ".join(parser().format_help().split())
    assert "One model answers one request at a time: the others wait in arrival order." in text
    assert "(default 127.0.0.1: this machine only; there is no authentication)" in text


def test_without_the_serve_extra_the_command_says_what_to_install(monkeypatch, capsys):
    import sys
    from llmrs.runtime import serve
    monkeypatch.setitem(sys.modules, "uvicorn", None)   # what a missing package looks like to import
    assert serve.main(["plan.bin"]) == 2
    err = capsys.readouterr().err
    assert err == "llmrs-serve: error: starlette and uvicorn are missing: pip install 'llmrs[serve]'\n"
