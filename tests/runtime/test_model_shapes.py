"""Llama shapes beyond head_dim 64 / 128, end to end: tiny random models with head_dim 48, 80, 96
and 100 (OpenLLaMA-3B's), each as MHA and MQA, 9 heads of 100 on 3 KV heads, and SmolLM2-135M's
layer (9 query heads of 64 on 3 KV heads, hidden 576), compiled by llmrs-compile for its default
targets and run on the CPU (LLVM)
and on OpenCL (PoCL here), logits against the interpreter running the plan's own graphs:
a prefill of two chunks, then decode steps."""
from __future__ import annotations

import numpy as np
import pytest

from llmrs.compiler.cli import main as compile_main
from llmrs.compiler.interpret import Interpreter
from llmrs.models.tiny import make_model
from llmrs.runtime.plan import Plan

from ..conftest import rel_err, require_opencl

CHUNK, SEQ, VOCAB = 8, 32, 320
PROMPT = np.array([3, 17, 250, 9, 42, 7, 101, 64, 5, 300, 11], np.int32)   # chunks of 8 + 3
DECODE = np.array([12, 199, 4, 310, 77], np.int32)                           # fed, not sampled
SHAPES = {  # name: (n_heads, n_kv_heads, head_dim, hidden, intermediate)
    "hd48-mha": (4, 4, 48, 128, 128),
    "hd48-mqa": (4, 1, 48, 128, 128),
    "hd80-mha": (2, 2, 80, 128, 128),
    "hd80-mqa": (4, 1, 80, 128, 128),
    "hd96-mha": (3, 3, 96, 128, 128),
    "hd96-mqa": (3, 1, 96, 128, 128),
    "hd100-mha": (8, 8, 100, 128, 128),
    "hd100-mqa": (8, 1, 100, 128, 128),
    "hd100-gqa9.3": (9, 3, 100, 128, 128),     # attention width 900: no multiple of 32 (or of 8)
    "smollm2-gqa9.3": (9, 3, 64, 576, 1536),
}


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    """name -> (plan, stderr of its compile), made on first use."""
    made: dict[str, tuple[Plan, str]] = {}

    def get(name: str, capfd) -> tuple[Plan, str]:
        if name not in made:
            h, kvh, hd, hidden, inter = SHAPES[name]
            root = tmp_path_factory.mktemp(name)
            model = make_model(root / "model", "tiny", seed=hd + kvh, num_hidden_layers=1, vocab_size=VOCAB,
                               hidden_size=hidden, intermediate_size=inter, num_attention_heads=h,
                               num_key_value_heads=kvh, head_dim=hd)
            capfd.readouterr()
            assert compile_main([str(model), "-o", str(root / "plan.bin"), "--weights", "f32", "--kv-type", "f32",
                                 "--prefill-chunk", str(CHUNK), "--max-seq-len", str(SEQ), "-q"]) == 0
            made[name] = Plan.open(root / "plan.bin"), capfd.readouterr().err
        return made[name]
    return get


def _interpreter_logits(plan: Plan) -> list[np.ndarray]:
    graphs = plan.graphs()
    pre, dec = Interpreter(graphs["prefill"]), Interpreter(graphs["decode"])
    state = pre.new_state()
    out = [pre.run({"tokens": PROMPT[s:s + CHUNK]}, state, s)["logits"] for s in range(0, len(PROMPT), CHUNK)]
    n = len(PROMPT)
    return out + [dec.run({"tokens": DECODE[i:i + 1]}, state, n + i)["logits"] for i in range(len(DECODE))]


def _backend_logits(be) -> list[np.ndarray]:
    out = [be.run("prefill", PROMPT[s:s + CHUNK], s, s) for s in range(0, len(PROMPT), CHUNK)]
    n = len(PROMPT)
    return out + [be.run("decode", DECODE[i:i + 1], n + i, n + i) for i in range(len(DECODE))]


def _backend(name: str, plan: Plan):
    if name == "cpu":
        from llmrs.runtime.backends.cpu import CpuBackend
        return CpuBackend(plan, threads=2)
    require_opencl()   # a machine with only pip's PoCL, which cannot build for a newer CPU, skips
    from llmrs.runtime.backends.opencl import OpenCLBackend
    return OpenCLBackend(plan)


@pytest.mark.parametrize("backend", ["cpu", "opencl"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_shape_compiles_for_both_targets_and_its_logits_match_the_interpreter(plans, capfd, shape, backend):
    plan, compile_err = plans(shape, capfd)
    assert "notice" not in compile_err
    assert plan.manifest["compile_options"]["targets"] == ["cpu", "opencl"]
    want = _interpreter_logits(plan)
    got = _backend_logits(_backend(backend, plan))
    assert len(got) == len(want) == 2 + len(DECODE)
    for step, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape
        assert rel_err(g, w) <= 1e-4, f"step {step}"
