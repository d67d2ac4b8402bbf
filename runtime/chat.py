"""Chat templates: a model's own Jinja template rendered as `transformers` renders it
(apply_chat_template), so a prompt reaches the model in the format it was trained on."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The plan's chat template cannot be rendered; one line naming why."""


def _raise(message: str) -> None:
    raise ChatTemplateError(f"the chat template refused the messages: {message}")


@dataclass(frozen=True)
class ChatTemplate:
    source: str
    bos_token: str = ""
    eos_token: str = ""

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               variables: Mapping[str, Any] | None = None) -> str:
        """variables: more names the template reads, as apply_chat_template's keyword arguments
        (Qwen3's `enable_thinking`: False writes an empty think block, so the model answers directly)."""
        given = dict(variables or {})
        taken = sorted(set(given) & {"messages", "add_generation_prompt", "bos_token", "eos_token", "raise_exception"})
        if taken:
            raise ChatTemplateError(f"chat template variable {taken[0]!r} is set by llmrs itself; "
                                    "pass only the template's own switches (e.g. enable_thinking)")
        # the same environment settings as transformers: templates are written against them
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[jinja2.ext.loopcontrols])
        env.globals["raise_exception"] = _raise
        try:
            template = env.from_string(self.source)
            return template.render(**given, messages=messages, add_generation_prompt=add_generation_prompt,
                                   bos_token=self.bos_token, eos_token=self.eos_token)
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"the chat template does not render: {e}") from None


def from_manifest(manifest: dict[str, Any]) -> ChatTemplate | None:
    """The plan's chat template, or None when the model has none (a base model)."""
    source = manifest.get("chat_template")
    if not source:
        return None
    return ChatTemplate(source, manifest.get("bos_token") or "", manifest.get("eos_token") or "")
