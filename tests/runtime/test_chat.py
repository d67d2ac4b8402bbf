"""Chat templates render as transformers' apply_chat_template does, and fail in one line."""
from __future__ import annotations

import pytest

from llmrs.runtime.chat import ChatTemplate, ChatTemplateError, from_manifest

# SmolLM2-135M-Instruct's template, as its GGUF stores it
CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
          "<|im_end|>\\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
          "{% endif %}")


def test_chatml_template_adds_the_default_system_turn_and_the_generation_prompt():
    text = ChatTemplate(CHATML).render([{"role": "user", "content": "Hi there"}])
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                    "<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n")


def test_a_given_system_turn_replaces_the_default_and_no_generation_prompt_when_asked():
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4"}]
    text = ChatTemplate(CHATML).render(msgs, add_generation_prompt=False)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n"
                    "<|im_start|>assistant\n4<|im_end|>\n")


def test_bos_token_and_trim_blocks_follow_transformers():
    tpl = "{{ bos_token }}{% for m in messages %}\n  {{ m['content'] }}\n{% endfor %}"
    assert ChatTemplate(tpl, bos_token="<s>").render([{"role": "user", "content": "x"}]) == "<s>  x\n"


def test_raise_exception_and_syntax_errors_are_one_line_errors():
    tpl = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first turn must be the user') }}{% endif %}"
    with pytest.raises(ChatTemplateError, match="first turn must be the user"):
        ChatTemplate(tpl).render([{"role": "assistant", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="does not render") as e:
        ChatTemplate("{% for %}").render([])
    assert "\n" not in str(e.value)


def test_sandbox_refuses_attribute_escapes():
    with pytest.raises(ChatTemplateError):
        ChatTemplate("{{ messages.__class__.__mro__[1].__subclasses__() }}").render([])


def test_manifest_without_a_template_has_none():
    assert from_manifest({}) is None
    assert from_manifest({"chat_template": CHATML, "bos_token": "<s>"}).bos_token == "<s>"
