"""The app behind llmrs-serve: one plan behind OpenAI's HTTP API (/v1/models, /v1/completions, /v1/chat/completions,
streaming as server-sent events ending in `data: [DONE]`), on loopback unless told otherwise.
It serves one plan, so a request's `model` may name anything: answers carry the plan's own id.

Built on starlette (routing, requests, responses) and uvicorn (the HTTP server): a small, widely used
pair, and the one FastAPI itself stands on; both are the optional extra `llmrs[serve]`.

A plan with a step graph serves many requests at once: each request joins the model's batch
(runtime/batch.py: continuous batching over a paged KV cache whose prefix cache lets a request that
repeats another's prompt prefix, a system prompt, skip its prefill), a background thread steps the
batch, and each request's pieces reach its response as they decode. A plan without one (or a model
that evicts, which works on one sequence) runs one generation at a time: requests, once read, wait
their turn in order on an asyncio lock, and each generation runs one piece at a time on a worker
thread while the event loop keeps reading sockets. Everything else that costs CPU (parsing a body, rendering a chat, tokenizing)
runs on a worker thread too, so a big prompt never stalls the requests behind it; a body is read
with a running count and refused (413) the moment it passes the limit, however it is sent. A client
that goes away stops its generation after the current token (in a batch its KV blocks are freed at
once). The cache is kept between requests, so a client that re-sends a growing conversation
prefills only the new turn. Every error is OpenAI's
JSON shape: {"error": {"message", "type", "param", "code"}}.

Loopback keeps other machines out but not web pages: any page the user opens may POST to 127.0.0.1
(a "simple" cross-origin request runs without asking) and, by rebinding its own name to 127.0.0.1,
read the answers. So a request's Host must name this server, a browser's Origin must be allowed
(this machine's names unless widened), and an API key may be required (Guard, below).

Defaults are OpenAI's, not llmrs-run's: temperature 1; a completion is 16 tokens, a chat reply runs
until it ends or the cache is full. A model that evicts (llmrs-serve --eviction-policy) takes prompts
and replies longer than its cache, and a chat reply then runs at most a cache's worth. Besides OpenAI's fields a request may set top_k and
repetition_penalty (as vLLM and llama.cpp's server take them), and vLLM's ignore_eos (a reply runs
to max_tokens past stop tokens, as throughput benchmarks ask); fields llmrs cannot honour (n > 1,
logprobs, tools, penalties on frequency or presence, ...) are refused by name rather than ignored.
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import json
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Iterable
from urllib.parse import urlsplit

import anyio
from starlette.applications import Starlette
from starlette.datastructures import Headers, MutableHeaders
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..options import OptionError
from .chat import ChatTemplateError
from .engine import EngineError
from .batch import Request as BatchRequest
from .model import Completion, GenerationOptions, Model

MAX_BODY_BYTES = 8 << 20    # the default limit on a request body: no prompt that fits a cache is near it


class APIError(Exception):
    """A request the server refuses; becomes OpenAI's error body with this status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers={**(self.headers or {}), **(headers or {})})


# -- who may use the server ---------------------------------------------------------------------------
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
ANY_ADDRESS = frozenset({"0.0.0.0", "::", ""})      # a bind to every interface: the user serves the LAN


def host_name(value: str) -> str:
    """The name in a Host header or a bind address, without port, brackets or a final dot:
    '[::1]:8080' -> '::1', 'LocalHost.:80' -> 'localhost'."""
    value = value.strip().lower()
    if value.startswith("["):
        value = value[1:].partition("]")[0]
    elif value.count(":") == 1:
        value = value.partition(":")[0]
    return value.rstrip(".")


def _is_loopback(name: str) -> bool:
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return name in LOOPBACK_NAMES


@dataclass(frozen=True)
class Access:
    """Who may use the server: the names a Host header may give (None: any), the web origins pages
    may come from (host names, which allow any scheme and port, or exact origins such as
    'https://app.example:3000'; '*' allows any), and the API key every request must bear (None: none)."""
    hosts: frozenset[str] | None
    origins: frozenset[str]
    api_key: str | None = None

    @classmethod
    def serving(cls, bound: str = "127.0.0.1", allowed_hosts: Iterable[str] = (),
                allowed_origins: Iterable[str] = (), api_key: str | None = None) -> "Access":
        """This machine's names and the bound address, widened by llmrs-serve's --allowed-hosts and
        --allowed-origins. Bound to every interface, any Host is taken (the LAN has names this machine
        cannot know), but web origins stay this machine's unless allowed."""
        bound = host_name(bound)
        own = LOOPBACK_NAMES if bound in ANY_ADDRESS else LOOPBACK_NAMES | {bound}
        extra_hosts = {host_name(h) for h in allowed_hosts}
        hosts = None if bound in ANY_ADDRESS or "*" in extra_hosts else frozenset(own | extra_hosts)
        origins = frozenset(own | {o.strip().lower().rstrip("/") for o in allowed_origins})
        return cls(hosts, origins, api_key or None)

    def host_allowed(self, host: str | None) -> bool:
        # no Host at all is HTTP/1.0 from a program: browsers always send one
        if host is None or self.hosts is None:
            return True
        name = host_name(host)
        return name in self.hosts or _is_loopback(name)

    def origin_allowed(self, origin: str) -> bool:
        origin = origin.strip().lower().rstrip("/")
        if "*" in self.origins or origin in self.origins:
            return True
        parts = urlsplit(origin)
        try:
            name = parts.hostname
        except ValueError:
            return False
        return parts.scheme in ("http", "https") and bool(name) and (name in self.origins or _is_loopback(name))

    def key_accepted(self, authorization: str | None) -> bool:
        if self.api_key is None:
            return True
        scheme, _, key = (authorization or "").partition(" ")
        # constant time: how much of a guess matched must not show in how long the refusal took
        return scheme.lower() == "bearer" and hmac.compare_digest(key.strip().encode(), self.api_key.encode())


class Guard:
    """ASGI middleware that applies an Access to every HTTP request: a foreign Host or Origin gets 403,
    a missing or wrong API key 401 (all in OpenAI's error shape); an allowed Origin gets CORS headers,
    and its preflight (OPTIONS) an answer, which asks for no key since browsers send none with it."""

    def __init__(self, app, access: Access):
        self.app, self.access = app, access

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = Headers(scope=scope)
        host, origin = headers.get("host"), headers.get("origin")
        if not self.access.host_allowed(host):
            name = host_name(host or "")
            refusal = APIError(403, f"the Host header {host!r} is not a name of this server; if it is, start "
                                    f"llmrs-serve with --allowed-hosts {name}", code="host_not_allowed")
            return await refusal.response()(scope, receive, send)
        cors: dict[str, str] = {}
        if origin is not None:
            if not self.access.origin_allowed(origin):
                refusal = APIError(403, f"requests from web pages at {origin} are not allowed; to allow them, "
                                        f"start llmrs-serve with --allowed-origins {origin}", code="origin_not_allowed")
                return await refusal.response()(scope, receive, send)
            cors = {"Access-Control-Allow-Origin": origin, "Vary": "Origin"}
            if scope["method"] == "OPTIONS" and "access-control-request-method" in headers:
                asked = headers.get("access-control-request-headers", "authorization, content-type")
                preflight = Response(status_code=204, headers={
                    **cors, "Access-Control-Allow-Methods": "GET, POST, OPTIONS",
                    "Access-Control-Allow-Headers": asked, "Access-Control-Max-Age": "600"})
                return await preflight(scope, receive, send)
        if not self.access.key_accepted(headers.get("authorization")):
            refusal = APIError(401, "this server needs its API key: send the header 'Authorization: Bearer KEY' "
                                    "with the key llmrs-serve was given (--api-key or LLMRS_API_KEY)",
                               code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
            return await refusal.response(cors)(scope, receive, send)
        if not cors:
            return await self.app(scope, receive, send)

        async def send_with_cors(message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message).update(cors)
            await send(message)
        await self.app(scope, receive, send_with_cors)


# -- request fields -> GenerationOptions -----------------------------------------------------------
def _number(body: dict, name: str, default: float | None, integer: bool = False) -> Any:
    value = body.get(name)
    if value is None:
        return default
    ok = type(value) is int if integer else type(value) in (int, float)
    if not ok:
        raise APIError(400, f"'{name}' must be {'an integer' if integer else 'a number'}, got {value!r}", name)
    return value


# fields that change what OpenAI returns, which llmrs cannot do: refused unless left at their default
UNSUPPORTED = {"n": 1, "best_of": 1, "echo": False, "suffix": None, "logprobs": None, "top_logprobs": None,
               "logit_bias": None, "frequency_penalty": 0, "presence_penalty": 0, "tools": None,
               "tool_choice": None, "functions": None, "function_call": None}


def _options(body: dict, prompt_tokens: int, max_seq_len: int, default_max: int | None,
             evicts: bool = False) -> GenerationOptions:
    """The request's generation options. Without eviction the prompt and max_tokens must fit the
    cache; with it (llmrs-serve --eviction-policy) any length goes on, evicting as it must, and a
    reply without max_tokens is bounded by a cache's worth of tokens."""
    for name, default in UNSUPPORTED.items():
        value = body.get(name)
        if value not in (None, default) and not (name == "logprobs" and value is False) \
                and not (name == "logit_bias" and value == {}):
            raise APIError(400, f"'{name}' = {value!r} is not supported by llmrs-serve", name, "unsupported_parameter")
    fmt = body.get("response_format")
    if fmt not in (None, {"type": "text"}):
        raise APIError(400, f"'response_format' = {fmt!r} is not supported by llmrs-serve (text only)",
                       "response_format", "unsupported_parameter")
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    room = max_seq_len - prompt_tokens
    max_tokens = _number(body, name, None, integer=True)
    if max_tokens is not None and max_tokens < 1:
        raise APIError(400, f"'{name}' must be at least 1, got {max_tokens}", name)
    if evicts:
        max_tokens = max_tokens or default_max or max_seq_len
    elif prompt_tokens > max_seq_len:
        raise APIError(400, f"the prompt has {prompt_tokens} tokens but the KV cache holds {max_seq_len}; shorten "
                            "it, or start llmrs-serve with --eviction-policy sliding, snapkv or h2o",
                       None, "context_length_exceeded")
    elif room < 1 or (max_tokens or 0) > room:
        raise APIError(400, f"this model's context is {max_seq_len} tokens: the prompt has {prompt_tokens} and "
                            f"{name} asks for {max_tokens or 1} more; shorten the prompt or lower {name}, or start "
                            "llmrs-serve with --eviction-policy sliding, snapkv or h2o",
                       name if room >= 1 else None, "context_length_exceeded")
    elif max_tokens is None:
        max_tokens = room if default_max is None else min(default_max, room)
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and (not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop)
                             or len(stop) > 4):
        raise APIError(400, f"'stop' must be a string or a list of up to 4 non-empty strings, got {stop!r}", "stop")
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise APIError(400, f"'ignore_eos' must be true or false, got {ignore_eos!r}", "ignore_eos")
    values = dict(max_tokens=max_tokens, stop=tuple(stop or ()), ignore_eos=ignore_eos,
                  temperature=_number(body, "temperature", 1.0), top_p=_number(body, "top_p", 1.0),
                  top_k=_number(body, "top_k", 0, integer=True),
                  repetition_penalty=_number(body, "repetition_penalty", 1.0),
                  seed=_number(body, "seed", None, integer=True))
    try:
        return GenerationOptions(**values).check()
    except OptionError as e:
        raise APIError(400, str(e), e.names[0] if e.names else None) from None


def _message_text(i: int, message: Any) -> dict[str, str]:
    """OpenAI's message: content is a string or a list of text parts."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise APIError(400, f"messages[{i}] must be an object with a string 'role'", f"messages[{i}]")
    content = message.get("content")
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   for p in content):
            raise APIError(400, f"messages[{i}].content: only text parts are supported", f"messages[{i}].content")
        content = "".join(p["text"] for p in content)
    if content is None:
        content = ""
    if not isinstance(content, str):
        raise APIError(400, f"messages[{i}].content must be a string or a list of text parts",
                       f"messages[{i}].content")
    return {"role": message["role"], "content": content}


def _invalid_unicode(body: Any) -> str | None:
    """The field of a parsed body holding a string that is not valid Unicode (a lone surrogate, which
    JSON's \\ud800-\\udfff escapes can spell and which no text can hold), e.g. 'messages[1].content'.
    A loop, not recursion: json nests deeper than Python's recursion limit allows twice over."""
    fields: list[tuple[str, Any]] = [("", body)]
    while fields:
        path, value = fields.pop()
        if isinstance(value, str):
            if not value.isascii():
                try:
                    value.encode()
                except UnicodeEncodeError:
                    return path or "body"
        elif isinstance(value, (dict, list)):
            named = ((f"{path}.{k}" if path else str(k), v) for k, v in value.items()) if isinstance(value, dict) \
                else ((f"{path}[{i}]", v) for i, v in enumerate(value) if isinstance(v, (str, dict, list)))
            fields.extend(reversed(list(named)))    # reversed: the first bad field is found first
    return None


@dataclass
class Server:
    model: Model
    model_id: str
    created: int
    max_body_bytes: int = MAX_BODY_BYTES

    def __post_init__(self):
        self.lock = asyncio.Lock()   # FIFO: requests are served in the order they asked
        # speculative decoding verifies one sequence's drafts a step: requests take turns
        self.batching = self.model.can_batch and self.model.speculator is None

    def start(self, ids: list[int], opts: GenerationOptions) -> Completion | BatchRequest:
        """A generation of ids: a request of the batch where the plan runs many, else a Completion."""
        if not self.batching:
            return Completion(self.model, ids, opts)
        fields = {f: getattr(opts, f) for f in ("max_tokens", "temperature", "top_k", "top_p",
                                                "repetition_penalty", "repetition_window", "seed", "stop",
                                                "ignore_eos")}
        try:
            req = self.model.add_request(ids, **fields)
        except EngineError as e:
            raise APIError(400, str(e), "messages", "context_length_exceeded") from None
        self.model.batch.start()
        return req

    # -- the one way a request reaches the model ----------------------------------------------------
    async def pieces(self, completion: Completion | BatchRequest) -> AsyncIterator[str]:
        """The completion's text, one item per token ("" while text is held back), computed on a
        worker thread while this request holds the model. However the caller stops (end, disconnect, error), the completion is closed and the
        model freed; the thread call is not abandoned on cancellation, so a step never outlives it."""
        if isinstance(completion, BatchRequest):
            async for piece in self._batch_pieces(completion):
                yield piece
            return
        steps = completion.steps()
        async with self.lock:
            try:
                while (piece := await anyio.to_thread.run_sync(next, steps, None)) is not None:
                    yield piece
            finally:
                completion.close()

    async def _batch_pieces(self, req: BatchRequest) -> AsyncIterator[str]:
        """A batch request's pieces as the batch's thread produces them; however the caller stops,
        the request is closed (an unfinished one leaves the batch and frees its blocks)."""
        loop = asyncio.get_running_loop()
        ready = asyncio.Event()

        def wake() -> None:     # on the batch's thread
            with contextlib.suppress(RuntimeError):     # the loop is closed: nobody waits
                loop.call_soon_threadsafe(ready.set)
        req.listen(wake)
        try:
            while True:
                await ready.wait()
                ready.clear()
                pieces, done = req.take()
                for piece in pieces:
                    yield piece
                if done:
                    if req.error is not None:
                        raise EngineError(req.error)
                    return
        finally:
            req.close()

    # -- request parsing ---------------------------------------------------------------------------
    async def read_body(self, request: Request) -> bytes:
        """The body, counted as it arrives: past the limit the request is refused without reading
        further, whether it declared its length or was sent in chunks."""
        limit = self.max_body_bytes
        size_text = f"{limit / (1 << 20):g} MiB" if limit % 1024 == 0 else f"{limit} bytes"
        too_large = APIError(413, f"the request body is over the limit of {size_text} (llmrs-serve's --max-body-mb)",
                             code="request_too_large",
                             headers={"Connection": "close"})   # the rest of the body is never read
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise too_large
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large
            chunks.append(chunk)
        return b"".join(chunks)

    def parse(self, raw: bytes) -> dict[str, Any]:
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise APIError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
        except RecursionError:
            raise APIError(400, "the request body nests too deeply to be a request", code="invalid_json") from None
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object", code="invalid_json")
        bad = _invalid_unicode(body)
        if bad is not None:
            raise APIError(400, f"'{bad}' is not valid Unicode: it has a lone surrogate (a \\ud800-\\udfff escape "
                                "without its pair); send text as UTF-8", bad, "invalid_unicode")
        # one plan is served, so whatever a client calls it is that plan (as llama.cpp's server does)
        if not isinstance(body.get("model", ""), str):
            raise APIError(400, f"'model' must be a string, got {body['model']!r}", "model")
        if not isinstance(body.get("stream", False), bool):
            raise APIError(400, "'stream' must be true or false", "stream")
        return body

    def tokenize(self, text: str, add_special_tokens: bool) -> list[int]:
        """Model.tokenize's ids; encode_batch rather than encode because encode holds the GIL to the
        end, which for megabytes of text would stall the event loop though it runs on another thread."""
        return self.model.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def prompt_ids(self, prompt: Any) -> list[int]:
        """OpenAI's prompt: a string, token ids, or a list of one of either (no batches here)."""
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str) and prompt:
            return self.tokenize(prompt, add_special_tokens=True)
        if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
            if not all(0 <= t < self.model.vocab_size for t in prompt):
                raise APIError(400, f"'prompt' has token ids outside 0..{self.model.vocab_size - 1}", "prompt")
            return prompt
        raise APIError(400, "'prompt' must be a non-empty string or token ids (one prompt per request)", "prompt")

    def chat_ids(self, messages: Any, template_kwargs: Any = None) -> list[int]:
        if self.model.chat_template is None:
            raise APIError(400, f"the model '{self.model_id}' has no chat template (a base model); "
                                "use /v1/completions", "messages", "no_chat_template")
        if not isinstance(messages, list) or not messages:
            raise APIError(400, "'messages' must be a non-empty list", "messages")
        msgs = [_message_text(i, m) for i, m in enumerate(messages)]
        # vLLM's field for a template's own switches (Qwen3's {"enable_thinking": false})
        if template_kwargs is not None and not isinstance(template_kwargs, dict):
            raise APIError(400, "'chat_template_kwargs' must be an object", "chat_template_kwargs")
        try:
            text = self.model.render_chat(msgs, chat_template_kwargs=template_kwargs)
        except ChatTemplateError as e:
            raise APIError(400, str(e), "messages") from None

        return self.tokenize(text, add_special_tokens=False)

    def prepare(self, raw: bytes, chat: bool) -> tuple[dict[str, Any], list[int], GenerationOptions]:
        """A request's body, prompt ids and options: the CPU-bound part, run on a worker thread."""
        body = self.parse(raw)
        if chat:
            ids, default_max = self.chat_ids(body.get("messages"), body.get("chat_template_kwargs")), None  # default: the rest of the cache
        else:
            ids, default_max = self.prompt_ids(body.get("prompt")), 16      # OpenAI's default: 16 tokens
        return body, ids, _options(body, len(ids), self.model.max_seq_len, default_max, self.model.evicts)

    # -- responses -----------------------------------------------------------------------------
    async def respond(self, request: Request, chat: bool) -> Response:
        raw = await self.read_body(request)
        body, ids, opts = await anyio.to_thread.run_sync(self.prepare, raw, chat)
        completion = await anyio.to_thread.run_sync(self.start, ids, opts)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        kind = "chat.completion" if chat else "text_completion"
        head = {"id": rid, "object": kind, "created": int(time.time()), "model": self.model_id}

        def usage() -> dict[str, Any]:
            return {"prompt_tokens": completion.prompt_tokens, "completion_tokens": completion.completion_tokens,
                    "total_tokens": completion.prompt_tokens + completion.completion_tokens,
                    "prompt_tokens_details": {"cached_tokens": completion.cached_tokens}}

        if body.get("stream"):
            stream_options = body.get("stream_options") or {}
            if not isinstance(stream_options, dict):
                raise APIError(400, "'stream_options' must be an object", "stream_options")
            include_usage = bool(stream_options.get("include_usage"))
            return EventStream(self._events(completion, {**head, "object": kind + (".chunk" if chat else "")},
                                             chat, include_usage, usage))

        async with contextlib.aclosing(self.pieces(completion)) as pieces:
            async for _ in pieces:
                if await request.is_disconnected():     # nobody reads the answer: stop computing it
                    break
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": completion.text},
                      "logprobs": None, "finish_reason": completion.finish_reason}
        else:
            choice = {"index": 0, "text": completion.text, "logprobs": None,
                      "finish_reason": completion.finish_reason}
        return JSONResponse({**head, "choices": [choice], "usage": usage()})

    async def _events(self, completion: Completion, head: dict, chat: bool, include_usage: bool,
                      usage: Callable[[], dict]) -> AsyncIterator[bytes]:
        def event(delta: str | None, finish: str | None = None) -> bytes:
            if chat:
                choice = {"index": 0, "delta": {} if delta is None else {"content": delta},
                          "logprobs": None, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": delta or "", "logprobs": None, "finish_reason": finish}
            return _sse({**head, "choices": [choice]})

        if chat:    # OpenAI opens a chat stream with the role
            yield _sse({**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                              "logprobs": None, "finish_reason": None}]})
        try:
            async with contextlib.aclosing(self.pieces(completion)) as pieces:
                async for piece in pieces:
                    if piece:
                        yield event(piece)
        except (EngineError, RuntimeError, ValueError) as e:  # after the 200 went out: an error event
            yield _sse(APIError(500, str(e), kind="server_error").body())
            yield b"data: [DONE]\n\n"
            return
        yield event(None, completion.finish_reason)
        if include_usage:
            yield _sse({**head, "choices": [], "usage": usage()})
        yield b"data: [DONE]\n\n"


def _sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


class EventStream(StreamingResponse):
    """Server-sent events whose source is closed however the response ends: a disconnect cancels
    the send, and closing the source frees the model at once (not whenever it is collected)."""
    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes]):
        super().__init__(events, headers={"Cache-Control": "no-cache"})

    async def stream_response(self, send) -> None:
        async with contextlib.aclosing(self.body_iterator):
            await super().stream_response(send)


def make_app(model: Model, model_id: str, access: Access | None = None, max_body_bytes: int = MAX_BODY_BYTES):
    """The ASGI app serving `model` as `model_id` to those `access` lets in (default: this machine)."""
    server = Server(model, model_id, int(Path(model.plan.path).stat().st_mtime), max_body_bytes)

    def model_card() -> dict[str, Any]:
        return {"id": model_id, "object": "model", "created": server.created, "owned_by": "llmrs"}

    async def models(request):
        return JSONResponse({"object": "list", "data": [model_card()]})

    async def one_model(request):
        name = request.path_params["name"]
        if name != model_id:
            raise APIError(404, f"the model '{name}' does not exist; this server has '{model_id}'",
                           "model", "model_not_found")
        return JSONResponse(model_card())

    async def completions(request):
        return await server.respond(request, chat=False)

    async def chat_completions(request):
        return await server.respond(request, chat=True)

    async def api_error(request, exc: APIError):
        return exc.response()

    async def http_error(request, exc: HTTPException):
        return JSONResponse(APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                                     code="not_found" if exc.status_code == 404 else None).body(),
                            status_code=exc.status_code, headers=getattr(exc, "headers", None))

    async def server_error(request, exc: Exception):
        return JSONResponse(APIError(500, f"{type(exc).__name__}: {exc}", kind="server_error").body(),
                            status_code=500)

    routes = [Route("/v1/models", models), Route("/v1/models/{name:path}", one_model),
              Route("/v1/completions", completions, methods=["POST"]),
              Route("/v1/chat/completions", chat_completions, methods=["POST"])]
    app = Starlette(routes=routes, middleware=[Middleware(Guard, access=access or Access.serving())],
                    exception_handlers={APIError: api_error, HTTPException: http_error, Exception: server_error})
    app.state.llmrs = server    # for whoever embeds the app: the model, its lock
    return app
