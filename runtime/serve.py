"""llmrs-serve: a plan behind OpenAI's HTTP API on this machine (runtime/server.py is the app).

Kept apart from the app so that a missing optional extra is a one-line error, not a traceback.
"""
from __future__ import annotations

import argparse
import ipaddress
import os
import socket
import sys
from pathlib import Path

from ..cliutil import OneLineParser, add_option_flags, error_line, options_from
from .backends import BACKENDS, BackendOptions
from .backends.options import KIND_OPTIONS
from .batch import BatchOptions
from .speculative import TITLE as SPEC_TITLE
from .speculative import SpeculativeOptions
from .engine import EngineError
from .kv.options import TITLE as KV_TITLE
from .kv.options import KVOptions
from .plan import PlanError

MISSING = "starlette and uvicorn are missing: pip install 'llmrs[serve]'"


def parser() -> argparse.ArgumentParser:
    ap = OneLineParser(
        prog="llmrs-serve", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Serve a plan over OpenAI's HTTP API: /v1/models, /v1/completions and\n"
                    "/v1/chat/completions, streamed (server-sent events) or not. Up to --max-num-seqs requests\n"
                    "run at once (continuous batching over a paged KV cache, the plan's step graph); the others\n"
                    "wait in arrival order. Equal prompt prefixes share their KV, so a client that re-sends a\n"
                    "growing conversation, or a shared system prompt, prefills only what is new. A plan without a\n"
                    "step graph, or --eviction-policy, answers one request at a time.",
        epilog="examples:\n"
               "  llmrs-serve plan.bin                          http://127.0.0.1:8080/v1\n"
               "  llmrs-serve plan.bin --port 9000 --backend opencl\n"
               "  LLMRS_API_KEY=secret llmrs-serve plan.bin --host 0.0.0.0     the LAN, with a key\n"
               "  llmrs-serve plan.bin --allowed-origins http://localhost:5173,https://app.example\n"
               "  curl http://127.0.0.1:8080/v1/chat/completions -H 'Content-Type: application/json' \\\n"
               "       -d '{\"messages\": [{\"role\": \"user\", \"content\": \"Hi\"}], \"stream\": true}'\n")
    ap.add_argument("plan", nargs="?", type=Path, help="plan file (default: llmrs-run's built-in model)")
    ap.add_argument("--host", default="127.0.0.1",
                    help="address to listen on (default 127.0.0.1: this machine only; 0.0.0.0: every interface, "
                         "which takes requests under any host name)")
    ap.add_argument("--port", type=int, default=8080, help="TCP port (default 8080; 0 picks a free one)")
    ap.add_argument("--model-name", help="the model's id in the API (default: the plan's file name)")
    ap.add_argument("--backend", choices=BACKENDS, default="cpu",
                    help="cpu (default), opencl, reference (numpy), hybrid (CPU prefill, OpenCL decode) or auto "
                         "(whichever measured faster per phase)")
    add_option_flags(ap, BackendOptions, ("threads", "device"))
    ap.add_argument("--api-key", metavar="KEY", default=None,
                    help="require 'Authorization: Bearer KEY' on every request (default: the environment's "
                         "LLMRS_API_KEY, which other users cannot read in the process list; none if unset)")
    ap.add_argument("--allowed-hosts", metavar="NAMES", type=_names, action="extend", default=[],
                    help="host names, comma-separated, that requests may be addressed to besides localhost, "
                         "127.0.0.1, ::1 and --host ('*': any); others get 403, which stops DNS rebinding")
    ap.add_argument("--allowed-origins", metavar="ORIGINS", type=_names, action="extend", default=[],
                    help="web pages, comma-separated, that may call the server from a browser besides this "
                         "machine's: origins (https://app.example:3000) or host names (any scheme and port); "
                         "'*': any. Pages from other origins get 403")
    ap.add_argument("--max-body-mb", metavar="MIB", type=_positive_mib, default=MAX_BODY_MIB,
                    help=f"largest request body in MiB, chunked or not (default {MAX_BODY_MIB}); larger ones get 413")
    add_option_flags(ap, KVOptions, title=KV_TITLE + "; for every request: one whose prompt and max_tokens "
                                                     "outgrow the cache evicts instead of failing")
    add_option_flags(ap, BatchOptions, title="many requests at once (a plan with a step graph; not with eviction)")
    add_option_flags(ap, SpeculativeOptions, title=SPEC_TITLE + "; requests then take turns")
    add_option_flags(ap, BackendOptions, KIND_OPTIONS, "hybrid (--backend hybrid: one back end, then the other)")
    return ap


MAX_BODY_MIB = 8


def _names(text: str) -> list[str]:
    return [name.strip() for name in text.split(",") if name.strip()]


def _positive_mib(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of MiB, got {text!r}")
    return value


def api_key_of(args: argparse.Namespace, environ: dict[str, str] = os.environ) -> str | None:
    """--api-key, else LLMRS_API_KEY, else None (no key asked for)."""
    if args.api_key is not None and not args.api_key.strip():
        raise ValueError("--api-key is empty; give the key clients must send, or leave the flag out")
    return args.api_key or environ.get("LLMRS_API_KEY") or None


def exposure_notice(host: str, api_key: str | None) -> str | None:
    """The one line for a user whose server other machines can reach without a key."""
    from .server import ANY_ADDRESS, host_name
    name = host_name(host)
    try:
        loopback = ipaddress.ip_address(name).is_loopback
    except ValueError:
        loopback = name == "localhost"
    if loopback or api_key:
        return None
    where = "every interface" if name in ANY_ADDRESS else host
    return (f"llmrs-serve: note: listening on {where}: any machine that reaches it may use the model; "
            "add --api-key KEY (or set LLMRS_API_KEY) to require a key")


def many_at_once(model) -> str:
    """How many requests run at once, for the start line."""
    if not model.can_batch:
        return "one request at a time: the plan has no step graph"
    if model.speculator is not None:
        return (f"one request at a time, each with {model.speculator.drafter.name} speculative decoding (a verify "
                "step holds one sequence's drafts)")
    n = model.batch_options.max_num_seqs or model.plan.step_shape().seqs
    return f"up to {n} requests at once"


def model_id_of(plan: Path) -> str:
    """plans/smollm2.plan.bin -> smollm2"""
    name = plan.name
    for suffix in (".bin", ".plan"):
        name = name.removesuffix(suffix)
    return name or "llmrs"


def listen(host: str, port: int) -> socket.socket:
    """A bound, listening socket: a taken port is a one-line error before the server starts."""
    try:
        family = socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    except ValueError:
        family = socket.AF_INET     # a host name, resolved by bind
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e} (choose another --port or --host)") from None
    sock.listen(128)
    return sock


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        import uvicorn
        from .server import Access, make_app
    except ImportError:
        print(f"llmrs-serve: error: {MISSING}", file=sys.stderr)
        return 2
    from ..builtin import default_plan
    from .model import Model, check_threads

    try:
        if not 0 <= args.port < 65536:
            raise ValueError(f"--port must be in 0..65535, got {args.port}")
        access = Access.serving(args.host, args.allowed_hosts, args.allowed_origins, api_key_of(args))
        args.threads = check_threads(args.threads, "--threads")
        backend_options = options_from(args, BackendOptions).check_for(args.backend)
        kv = options_from(args, KVOptions).check()
        batch = options_from(args, BatchOptions).check()
        spec = options_from(args, SpeculativeOptions).check()
        plan = args.plan or default_plan()
        model = Model.open(plan, args.backend, backend_options, kv, batch, spec)
        sock = listen(args.host, args.port)
    except (PlanError, EngineError, ValueError, OSError, RuntimeError) as e:
        print(f"llmrs-serve: error: {error_line(e)}", file=sys.stderr)
        return 2
    model_id = args.model_name or model_id_of(Path(plan))
    host, port = sock.getsockname()[:2]
    print(f"llmrs-serve: {model_id} at http://{f'[{host}]' if ':' in host else host}:{port}/v1 "
          f"({args.backend}, {model.max_seq_len}-token cache{f', {kv.eviction_policy} eviction' if kv.evicts else ''}, "
          f"{many_at_once(model)}); Ctrl-C stops",
          file=sys.stderr, flush=True)
    notice = exposure_notice(args.host, access.api_key)
    if notice:
        print(notice, file=sys.stderr)
    app = make_app(model, model_id, access, int(args.max_body_mb * (1 << 20)))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        pass
    finally:
        model.close()
        sock.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
