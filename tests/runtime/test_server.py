"""llmrs-serve through the official openai client and raw HTTP, on a loopback port of its own: the same
tokens as the Python API, streamed and not; OpenAI-shaped 4xx errors; a client that goes away stops
its generation; requests at once are served one after another; the server keeps serving after each.
Who may use it: bodies over the limit (chunked too) are refused unread, a foreign Host or Origin gets
403, an API key is asked for when set; a big prompt is tokenized off the event loop; the README's
openai snippet runs as written."""
from __future__ import annotations

import contextlib
import http.client
import io
import json
import re
import select
import socket
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from llmrs.child import python_argv  # noqa: E402
from llmrs.runtime.model import Model  # noqa: E402
from llmrs.runtime.serve import api_key_of, exposure_notice, listen, parser  # noqa: E402
from llmrs.runtime.server import Access, make_app  # noqa: E402

from ..conftest import DATA  # noqa: E402
from .chat_plans import CHAT_KEYS, compile_tiny  # noqa: E402

QUESTION = [{"role": "user", "content": "What is the value of self?"}]
README = Path(__file__).resolve().parents[2] / "README.md"
LIMIT = 8 << 20     # llmrs-serve's default --max-body-mb


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

    def http(self, method: str, path: str, headers: dict[str, str], body: bytes = b"") -> tuple[int, dict, bytes]:
        """One request on a raw socket with exactly these headers (plus its length): status, headers, body."""
        head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        with socket.create_connection(("127.0.0.1", self.port), timeout=30) as sock:
            sock.sendall(f"{method} {path} HTTP/1.1\r\n{head}Content-Length: {len(body)}\r\n"
                         "Connection: close\r\n\r\n".encode() + body)
            return _response(sock)

    def busy(self) -> bool:
        """A request holds the model (one at a time) or runs in its batch."""
        batch = self.model.batch
        return self.app.state.llmrs.lock.locked() or (batch is not None and batch.busy)

    def idle(self, timeout: float = 30) -> None:
        """Wait until no request holds the model."""
        end = time.monotonic() + timeout
        while self.busy():
            assert time.monotonic() < end, "the model stayed busy"
            time.sleep(0.01)


def _response(sock: socket.socket) -> tuple[int, dict, bytes]:
    """Read one HTTP response (JSON or empty, as every refusal is) from a raw socket."""
    data = b""
    while b"\r\n\r\n" not in data and (chunk := sock.recv(65536)):
        data += chunk
    head, _, content = data.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    while len(content) < int(headers.get("content-length", 0)) and (chunk := sock.recv(65536)):
        content += chunk
    return int(lines[0].split()[1]), headers, content


def _counting(app, read: dict[str, int]):
    """The app, counting the body bytes the server has read from requests into read["bytes"]."""
    async def counted_app(scope, receive, send):
        async def counted_receive():
            message = await receive()
            read["bytes"] += len(message.get("body", b""))
            return message
        await app(scope, counted_receive, send)
    return counted_app


def _serve(plan, model_id: str, load: dict | None = None, **app_options):
    model = Model.load(plan, threads=2, **(load or {}))
    app = make_app(model, model_id, **app_options)
    read = {"bytes": 0}
    sock = listen("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(_counting(app, read), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    end = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < end, "the server did not start"
        time.sleep(0.01)
    running = Running(port=sock.getsockname()[1], model=model, app=app, read=read)
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
    # the first turn's prompt and reply were still cached (the prefix cache keeps whole blocks of
    # 16 tokens): only the new turn and the rest of the last block were prefilled
    assert usage.prompt_tokens_details.cached_tokens == (r.usage.prompt_tokens + 5) // 16 * 16 > 0
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
    ({"model": 4, "messages": QUESTION}, 400, "model", None),
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
        while not srv.busy():     # the generation has begun
            assert time.monotonic() < end
            time.sleep(0.005)
    start = time.monotonic()
    sock.close()
    srv.idle()
    stopped_after = time.monotonic() - start
    # 3000 tokens take seconds here (and hold the model all along); it ended soon after the disconnect,
    # and its KV blocks went back to the pool
    kv = srv.model.batch.scheduler.kv.stats()
    assert stopped_after < 2 and kv.used == 0, (stopped_after, kv)
    ok = srv.client().completions.create(model="tiny", prompt="What is the value of self?", max_tokens=4,
                                         temperature=0)
    assert ok.choices[0].finish_reason == "length" and ok.usage.completion_tokens == 4


def test_requests_at_once_run_together_with_the_answers_each_gets_alone(srv, plans):
    prompts = ["What is the value of self?", "Return the path", "def __init__(self, value):", "for a in b"]
    expected = ["".join(_fresh(plans).generate(p, max_tokens=12)) for p in prompts]
    client = srv.client()

    def ask(i: int) -> str:     # half of them streamed
        if i % 2:
            return client.completions.create(model="tiny", prompt=prompts[i], max_tokens=12,
                                             temperature=0).choices[0].text
        return "".join(c.choices[0].text for c in client.completions.create(
            model="tiny", prompt=prompts[i], max_tokens=12, temperature=0, stream=True))

    srv.idle()
    steps = srv.model.batch.steps if srv.model.batch else 0
    with ThreadPoolExecutor(4) as pool:     # one batch: a row that read another's KV would garble them
        got = list(pool.map(ask, range(4)))
    assert got == expected
    # they shared steps: 4 prompts of <= 10 tokens and 4 x 12 tokens one by one would take 48 steps
    assert srv.model.batch.steps - steps < 48


def test_requests_at_once_on_opencl_answer_as_each_alone_with_steps_planned_ahead(tmp_path):
    """On OpenCL the server's batch plans each step while the device runs the last (runtime/batch.py):
    concurrent requests, half streamed, get the text each gets alone, and the batch ends idle."""
    from ..conftest import require_opencl
    require_opencl()
    plan = compile_tiny(tmp_path / "cl.plan.bin", max_seq_len=256, prefill_chunk=16, target="opencl",
                        stop_ids=[], **CHAT_KEYS)
    prompts = ["What is the value of self?", "Return the path", "def __init__(self, value):", "for a in b"]
    with Model.load(plan, backend="opencl") as alone:
        expected = ["".join(alone.generate(p, max_tokens=12)) for p in prompts]
    running, stop = _serve(plan, "tiny", load={"backend": "opencl"})
    try:
        assert running.model.backend.async_steps
        client = running.client()

        def ask(i: int) -> str:
            if i % 2:
                return client.completions.create(model="tiny", prompt=prompts[i], max_tokens=12,
                                                 temperature=0).choices[0].text
            return "".join(c.choices[0].text for c in client.completions.create(
                model="tiny", prompt=prompts[i], max_tokens=12, temperature=0, stream=True))

        with ThreadPoolExecutor(4) as pool:
            assert list(pool.map(ask, range(4))) == expected
        running.idle()
    finally:
        stop()


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
    text = " ".join(parser().format_help().split())
    assert "Up to --max-num-seqs requests run at once" in text and "the others wait in arrival order" in text
    assert "(default 127.0.0.1: this machine only;" in text
    for flag in ("--api-key KEY", "--allowed-hosts NAMES", "--allowed-origins ORIGINS", "--max-body-mb MIB"):
        assert flag in text


def test_without_the_serve_extra_the_command_says_what_to_install(monkeypatch, capsys):
    import sys
    from llmrs.runtime import serve
    monkeypatch.setitem(sys.modules, "uvicorn", None)   # what a missing package looks like to import
    assert serve.main(["plan.bin"]) == 2
    err = capsys.readouterr().err
    assert err == "llmrs-serve: error: starlette and uvicorn are missing: pip install 'llmrs[serve]'\n"


# -- any model name ---------------------------------------------------------------------------------
def test_any_model_name_is_answered_by_the_one_plan_served(srv):
    client = srv.client()
    asked = client.chat.completions.create(model="gpt-4", messages=QUESTION, max_tokens=3, temperature=0)
    listed = client.chat.completions.create(model="tiny", messages=QUESTION, max_tokens=3, temperature=0)
    assert asked.model == listed.model == "tiny"     # the answer names what answered
    assert asked.choices[0].message.content == listed.choices[0].message.content == "anan" + "an"
    with pytest.raises(openai.NotFoundError, match="the model 'gpt-4' does not exist; this server has 'tiny'"):
        client.models.retrieve("gpt-4")      # a lookup by name is still a question about that name


def _readme_openai_snippet() -> str:
    section = README.read_text().split("## Python API", 1)[1]
    return re.search(r"```python\n(from openai import OpenAI\n.*?)```", section, re.S)[1]


def test_readme_openai_snippet_runs_as_written(srv, monkeypatch):
    code = _readme_openai_snippet()
    assert 'base_url="http://127.0.0.1:8080/v1"' in code   # llmrs-serve's default address, moved to this test's port
    srv.idle()
    server, started = srv.app.state.llmrs, []
    start = server.start
    monkeypatch.setattr(server, "start", lambda ids, opts: started.append(start(ids, opts)) or started[-1])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code.replace("127.0.0.1:8080", f"127.0.0.1:{srv.port}"), str(README), "exec"), {})
    model = srv.model
    prompt = model.tokenize(model.render_chat([{"role": "user", "content": "Hi"}]), add_special_tokens=False)
    (generation,) = started     # the one request the snippet made: the whole reply was printed
    assert generation.prompt == prompt and len(generation.tokens) == 64
    assert out.getvalue() == model.detokenize(generation.tokens, skip_special_tokens=True) + "\n"


# -- request bodies -----------------------------------------------------------------------------------
@pytest.mark.parametrize("chunked", [True, False])
def test_a_body_over_the_limit_is_refused_before_it_is_read(srv, chunked):
    srv.idle()
    read_before, offered = srv.read["bytes"], 3 * LIMIT
    framing = b"Transfer-Encoding: chunked" if chunked else b"Content-Length: %d" % offered
    piece = (b'{"prompt": "' + b"ab" * (1 << 19))[:1 << 20]
    sent, end = 0, time.monotonic() + 30
    with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     + framing + b"\r\n\r\n")
        # send until the server answers (a server that reads it all answers after the last byte)
        while sent < offered and not select.select([sock], [], [], 0)[0]:
            assert time.monotonic() < end, "the server neither read nor refused the body"
            try:
                sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece)
            except (BrokenPipeError, ConnectionResetError):     # it refused and hung up
                break
            sent += len(piece)
        if sent >= offered and chunked:
            sock.sendall(b"0\r\n\r\n")
        status, headers, content = _response(sock)
    read = srv.read["bytes"] - read_before
    assert status == 413 and headers["connection"] == "close"
    error = json.loads(content)["error"]
    assert error["code"] == "request_too_large" and "over the limit of 8 MiB (llmrs-serve's --max-body-mb)" \
        in error["message"]
    # a declared length is refused before a byte is read; a chunked body as soon as it passes the limit
    assert read == 0 if not chunked else LIMIT < read <= LIMIT + (1 << 20), (read, sent)
    ok = srv.client().completions.create(model="tiny", prompt="for a in b", max_tokens=2, temperature=0)
    assert ok.usage.completion_tokens == 2


def test_the_body_limit_is_a_server_option(plans):
    running, stop = _serve(plans["base"], "base", max_body_bytes=1000)
    try:
        prompt = "for a in b " * 50
        small = running.client().completions.create(model="base", prompt=prompt[:400], max_tokens=1)
        assert small.usage.prompt_tokens > 50
        with pytest.raises(openai.APIStatusError, match="over the limit of 1000 bytes") as e:
            running.client().completions.create(model="base", prompt=prompt * 2, max_tokens=1)
        assert e.value.status_code == 413
    finally:
        stop()
    with pytest.raises(SystemExit) as e:
        parser().parse_args(["--max-body-mb", "0"])
    assert e.value.code == 2


def test_models_answer_while_a_large_prompt_is_tokenized(srv):
    srv.idle()
    prompt = ("What is the value of self? def __init__(self, value): " * 20000)[:1 << 20]   # 1 MiB: seconds
    body = json.dumps({"prompt": prompt, "max_tokens": 1}).encode()
    read_before, answered = srv.read["bytes"], {}

    def post_big() -> None:
        answered["big"] = srv.http("POST", "/v1/completions", {"Host": "127.0.0.1"}, body)
        answered["big_at"] = time.monotonic()

    big = threading.Thread(target=post_big)
    big.start()
    end = time.monotonic() + 30
    while srv.read["bytes"] - read_before < len(body):      # the whole body is in: now it is tokenized
        assert time.monotonic() < end and big.is_alive()
        time.sleep(0.005)
    start = time.monotonic()
    listed = srv.client().models.list()
    models_at = time.monotonic()
    big.join(60)
    status, _, content = answered["big"]
    # the prompt was tokenized to the end (and found too long for the cache) after /v1/models answered
    assert status == 400 and json.loads(content)["error"]["code"] == "context_length_exceeded"
    assert [m.id for m in listed] == ["tiny"] and models_at - start < 1.0 and models_at < answered["big_at"]


def test_text_that_is_not_unicode_is_a_400_naming_its_field(srv):
    # "\udcff" is valid JSON but a lone surrogate: no text holds it and the tokenizer takes none
    chat = b'{"messages": [{"role": "user", "content": "Hi"}, {"role": "user", "content": "a\\udcffb"}]}'
    for path, body, field in [("/v1/completions", b'{"prompt": "ab\\udcff", "max_tokens": 2}', "prompt"),
                              ("/v1/chat/completions", chat, "messages[1].content")]:
        status, reply = srv.raw("POST", path, body)
        assert status == 400 and reply["error"]["param"] == field and reply["error"]["code"] == "invalid_unicode"
        assert reply["error"]["message"].startswith(f"'{field}' is not valid Unicode")
    # a surrogate pair is a character like any other
    ok = srv.raw("POST", "/v1/completions", b'{"prompt": "ab\\ud83d\\ude00", "max_tokens": 2, "temperature": 0}')
    assert ok[0] == 200 and ok[1]["usage"]["prompt_tokens"] == len(srv.model.tokenize("ab\U0001F600"))


# -- Host, Origin, API key ------------------------------------------------------------------------
def _error(status: int, content: bytes) -> dict:
    assert content.count(b"\n") == 0
    return {"status": status, **json.loads(content)["error"]}


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost:8080", "[::1]:8080", "LocalHost.", "127.0.0.2:1"])
def test_this_machines_names_are_served(srv, host):
    status, _, content = srv.http("GET", "/v1/models", {"Host": host})
    assert status == 200 and json.loads(content)["data"][0]["id"] == "tiny"


@pytest.mark.parametrize("host", ["evil.example", "evil.example:{port}", "127.0.0.1.evil.example", "localhost.evil"])
def test_a_foreign_host_is_refused_so_dns_rebinding_reads_nothing(srv, host):
    host = host.format(port=srv.port)
    status, headers, content = srv.http("GET", "/v1/models", {"Host": host})
    error = _error(status, content)
    assert (error["status"], error["code"]) == (403, "host_not_allowed") and host in error["message"]
    assert "--allowed-hosts" in error["message"] and "access-control-allow-origin" not in headers


def test_a_page_from_another_origin_runs_nothing_and_this_machines_pages_get_cors(srv):
    client = srv.client()
    client.completions.create(model="tiny", prompt="for a in b", max_tokens=3, temperature=0)
    fed = srv.model.engine.start_pos
    # what any web page may send without asking: a "simple" text/plain POST
    text_plain = {"Host": f"127.0.0.1:{srv.port}", "Content-Type": "text/plain"}
    body = json.dumps({"prompt": "What is the value of self?", "max_tokens": 5}).encode()
    evil = {**text_plain, "Origin": "http://evil.example"}
    status, headers, content = srv.http("POST", "/v1/completions", evil, body)
    error = _error(status, content)
    assert (error["status"], error["code"]) == (403, "origin_not_allowed") and "http://evil.example" in error["message"]
    assert "access-control-allow-origin" not in headers and srv.model.engine.start_pos == fed
    preflight = {"Host": "localhost", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    assert srv.http("OPTIONS", "/v1/completions", {**preflight, "Origin": "https://evil.example"})[0] == 403
    # a page this machine serves (a dev server on another port) may call it, and read the answer
    page = "http://localhost:5173"
    status, headers, content = srv.http("POST", "/v1/completions", {**text_plain, "Origin": page}, body)
    assert status == 200 and headers["access-control-allow-origin"] == page
    assert json.loads(content)["usage"]["completion_tokens"] == 5
    status, headers, _ = srv.http("OPTIONS", "/v1/chat/completions", {**preflight, "Origin": page})
    assert status == 204 and headers["access-control-allow-origin"] == page
    assert headers["access-control-allow-headers"] == "authorization, content-type"
    assert "POST" in headers["access-control-allow-methods"]


@pytest.fixture(scope="module")
def guarded(plans):
    access = Access.serving("127.0.0.1", allowed_hosts=["llm.lan"], allowed_origins=["https://app.example"],
                            api_key="s3cret-key")
    running, stop = _serve(plans["chat"], "tiny", access=access)
    yield running
    stop()


def test_an_api_key_is_asked_of_every_request_and_the_openai_client_sends_it(guarded):
    for key in ("unused", "s3cret-ke", "s3cret-key-and-more"):
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{guarded.port}/v1", api_key=key, max_retries=0, timeout=30)
        with pytest.raises(openai.AuthenticationError) as e:
            client.models.list()
        assert e.value.body["code"] == "invalid_api_key"
    status, headers, content = guarded.http("POST", "/v1/chat/completions", {"Host": "127.0.0.1"},
                                            json.dumps({"messages": QUESTION}).encode())
    assert _error(status, content)["status"] == 401 and headers["www-authenticate"] == "Bearer"
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{guarded.port}/v1", api_key="s3cret-key", max_retries=0,
                           timeout=30)
    reply = client.chat.completions.create(model="tiny", messages=QUESTION, max_tokens=4, temperature=0)
    assert reply.choices[0].message.content == "an" * 4


def test_allowed_hosts_and_origins_widen_access(guarded):
    key = {"Authorization": "Bearer s3cret-key"}
    assert guarded.http("GET", "/v1/models", {"Host": "llm.lan:8080", **key})[0] == 200
    assert guarded.http("GET", "/v1/models", {"Host": "other.lan", **key})[0] == 403
    status, headers, _ = guarded.http("GET", "/v1/models", {"Host": "llm.lan", "Origin": "https://app.example", **key})
    assert status == 200 and headers["access-control-allow-origin"] == "https://app.example"
    # an origin is its scheme, host and port: the same host over http is another page
    assert guarded.http("GET", "/v1/models", {"Host": "llm.lan", "Origin": "http://app.example", **key})[0] == 403
    # a browser sends no key with a preflight; the request after it carries the key
    status, headers, _ = guarded.http("OPTIONS", "/v1/models", {"Host": "llm.lan", "Origin": "https://app.example",
                                                                 "Access-Control-Request-Method": "GET"})
    assert status == 204 and headers["access-control-allow-origin"] == "https://app.example"
    status, headers, content = guarded.http("GET", "/v1/models", {"Host": "llm.lan", "Origin": "https://app.example"})
    assert _error(status, content)["status"] == 401 and headers["access-control-allow-origin"] == "https://app.example"


def test_serving_every_interface_takes_any_host_but_not_foreign_pages(plans):
    running, stop = _serve(plans["base"], "base", access=Access.serving("0.0.0.0"))   # served on loopback here
    try:
        assert running.http("GET", "/v1/models", {"Host": "my-box.lan:8080"})[0] == 200
        status, _, content = running.http("GET", "/v1/models", {"Host": "my-box.lan", "Origin": "http://evil.example"})
        assert _error(status, content)["code"] == "origin_not_allowed"
        assert running.http("GET", "/v1/models", {"Host": "my-box.lan", "Origin": "http://127.0.0.1:3000"})[0] == 200
    finally:
        stop()
    notice = exposure_notice("0.0.0.0", None)
    assert notice.startswith("llmrs-serve: note: listening on every interface") and "--api-key KEY" in notice
    assert "\n" not in notice and exposure_notice("192.168.1.5", None).startswith(
        "llmrs-serve: note: listening on 192.168.1.5")
    assert exposure_notice("0.0.0.0", "k") is None and exposure_notice("127.0.0.1", None) is None
    assert exposure_notice("localhost", None) is None and exposure_notice("::1", None) is None


def test_the_api_key_comes_from_the_flag_or_the_environment():
    assert api_key_of(parser().parse_args(["--api-key", "flag-key"]), {"LLMRS_API_KEY": "env-key"}) == "flag-key"
    assert api_key_of(parser().parse_args([]), {"LLMRS_API_KEY": "env-key"}) == "env-key"
    assert api_key_of(parser().parse_args([]), {}) is None
    assert api_key_of(parser().parse_args([]), {"LLMRS_API_KEY": ""}) is None
    with pytest.raises(ValueError, match="--api-key is empty"):
        api_key_of(parser().parse_args(["--api-key", " "]), {})


def test_a_speculating_server_answers_as_the_plain_one(srv, plans):
    """llmrs-serve --speculative lookup: requests take turns, each decoded with drafts verified a
    step at a time, and the replies are the plain server's, streamed or not."""
    prompt = "What is the value of self? What is the value of self? What is the value"
    plain = srv.client().completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0)
    running, stop = _serve(plans["chat"], "tiny", load={"speculative": "lookup"})
    try:
        from llmrs.runtime.serve import many_at_once
        assert many_at_once(running.model).startswith("one request at a time, each with lookup speculative")
        client = running.client()
        got = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0)
        streamed = "".join(c.choices[0].text for c in client.completions.create(
            model="tiny", prompt=prompt, max_tokens=24, temperature=0, stream=True))
        assert got.choices[0].text == plain.choices[0].text == streamed
        assert running.model.speculator is not None
    finally:
        stop()


def test_ignore_eos_runs_a_reply_past_its_stop_token(plans, tmp_path):
    """vLLM's ignore_eos (what serving benchmarks send): the reply runs to max_tokens with the
    stop token inside it; without it the same token ends the reply."""
    gd = np.load(DATA / "golden-a.npz")
    prompt = gd["prompt_tokens"].tolist()
    with Model.load(plans["chat"], threads=2) as m:    # no stop tokens: the whole greedy run
        c = m.generate(prompt, max_tokens=9)
        list(c)
        tokens = c.tokens
    stop = tokens[3]
    plan = compile_tiny(tmp_path / "stop.plan.bin", max_seq_len=256, prefill_chunk=64, stop_ids=[stop])
    running, shut = _serve(plan, "tiny")
    try:
        client = running.client()
        cut = client.completions.create(model="tiny", prompt=prompt, max_tokens=9, temperature=0)
        assert cut.choices[0].finish_reason == "stop" and cut.usage.completion_tokens == tokens.index(stop)
        full = client.completions.create(model="tiny", prompt=prompt, max_tokens=9, temperature=0,
                                         extra_body={"ignore_eos": True})
        assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 9
        assert full.choices[0].text == running.model.detokenize(tokens, skip_special_tokens=True)
        got, reply = running.raw("POST", "/v1/completions", json.dumps({"prompt": "a", "ignore_eos": "yes"}))
        assert got == 400 and reply["error"]["param"] == "ignore_eos"
    finally:
        shut()
