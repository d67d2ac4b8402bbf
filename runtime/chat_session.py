"""llmrs-run --chat: a conversation through the plan's chat template, one turn per line.

Each turn sends the whole conversation to Model.chat, which prefills only what the KV cache does not
hold yet (the new user turn and the template's markup around it). Under the Model's eviction policy
the conversation outgrows the cache and goes on: the sinks and the newest slots stay, and each turn
is fed after them at positions that keep growing. From a terminal: a prompt, line
editing, Ctrl-C stops a reply (the session goes on), Ctrl-D ends it. From a pipe: one turn per line,
each reply on stdout followed by a newline; the first failed turn ends the session with exit code 2.
"""
from __future__ import annotations

import io
import signal
import sys
import threading
from dataclasses import asdict, dataclass, field
from typing import Callable, TextIO

from .chat import ChatTemplateError
from .engine import EngineError
from .model import Completion, Model, clean_text
from .sampler import SamplerConfig


@dataclass(frozen=True)
class ChatSettings:
    """A session's settings (llmrs-run --chat's --system, -n, sampling flags and --stats)."""
    system: str | None = None
    max_tokens: int | None = None       # per reply; None: until it ends (or a cache's worth)
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    stats: bool = False                 # a line on stderr per turn: prompt, cached, prefilled, generated
    template_kwargs: dict | None = None  # the template's own switches (Qwen3's enable_thinking)


class _StopOnCtrlC:
    """While a reply streams, Ctrl-C asks it to stop after the current token, so the engine is never
    interrupted half-way through its bookkeeping; a second Ctrl-C raises KeyboardInterrupt as usual."""

    def __init__(self):
        self.requested = False
        self._previous = None

    def _on_sigint(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __enter__(self) -> "_StopOnCtrlC":
        if threading.current_thread() is threading.main_thread():  # only there can a handler be set
            self._previous = signal.signal(signal.SIGINT, self._on_sigint)
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)


def _turn_stats(turn: int, c: Completion) -> str:
    st = c.stats
    return (f"turn {turn}: prompt {c.prompt_tokens} tokens ({c.cached_tokens} cached, {c.prefilled_tokens} "
            f"prefilled in {st.prefill_s * 1e3:.1f} ms), {c.completion_tokens} generated "
            f"({st.decode_tok_s:.1f} tok/s), finish {c.finish_reason}")


def _read_turn(interactive: bool, stdin: TextIO) -> str | None:
    """The next user turn; None at the end of input. Blank lines are no turn."""
    while True:
        if interactive:
            try:
                line = input(">>> ")
            except EOFError:
                print()
                return None
            except KeyboardInterrupt:
                print("\n(Ctrl-D ends the session)")
                continue
        else:
            line = stdin.readline()
            if not line:
                return None
        line = line.rstrip("\r\n")
        if line.strip():
            return clean_text(line, "the chat turn")   # once here, not again at every later turn


def chat(model: Model, settings: ChatSettings = ChatSettings(), stdin: TextIO | None = None,
         stdout: TextIO | None = None, stderr: TextIO | None = None,
         describe: Callable[[BaseException], str] = str) -> int:
    """Run the session to the end of input; 0, or 2 when a piped turn fails. describe words an
    error for the user (a command line names its flags)."""
    stdin, stdout, stderr = stdin or sys.stdin, stdout or sys.stdout, stderr or sys.stderr
    if model.chat_template is None:
        raise ChatTemplateError(f"{model.plan.path}: the plan has no chat template (a base model); "
                                "use --prompt instead of --chat")
    if isinstance(stdin, io.TextIOWrapper):    # undecodable bytes reach clean_text as lone surrogates
        stdin.reconfigure(errors="surrogateescape")
    interactive = stdin.isatty()
    if interactive:
        try:
            import readline  # noqa: F401  (line editing and history for input())
        except ImportError:
            pass
        print("llmrs chat: Ctrl-C stops a reply, Ctrl-D ends the session", file=stderr)
    messages = [{"role": "system", "content": settings.system}] if settings.system else []
    turn = 0
    while (line := _read_turn(interactive, stdin)) is not None:
        turn += 1
        messages.append({"role": "user", "content": line})
        try:
            reply = model.chat(messages, max_tokens=settings.max_tokens, chat_template_kwargs=settings.template_kwargs,
                               **asdict(settings.sampler))
            with _StopOnCtrlC() as ctrl_c:
                try:
                    for piece in reply.steps():     # per token: Ctrl-C is seen even while text is held back
                        if piece:
                            stdout.write(piece)
                            stdout.flush()
                        if ctrl_c.requested:
                            break
                except KeyboardInterrupt:
                    pass
                finally:
                    reply.close()
        except (EngineError, ValueError) as e:  # the conversation no longer fits, a template refusal
            messages.pop()
            print(f"llmrs-run: error: {describe(e)}", file=stderr)
            if not interactive:
                return 2
            continue
        stdout.write("\n")
        stdout.flush()
        # what was shown, even if cut short, is what the cache holds: it stays in the conversation
        messages.append({"role": "assistant", "content": reply.text})
        if settings.stats:
            print(_turn_stats(turn, reply), file=stderr)
    return 0
