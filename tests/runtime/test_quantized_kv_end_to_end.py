"""A tiny Llama (head_dim 32: one 32-value block a head row) compiled with each block-quantized KV
type (--kv-type q8_0, q4_0) runs prefill, decode and the step graph on the CPU and on OpenCL
(PoCL): its logits stay within the format's error of the same model's f32-KV plan, and its step
graph gives the interpreter's logits on the same plan; the cache takes 34 / 18 bytes a 32 values."""
from __future__ import annotations

from typing import Any, Callable

import numpy as np
import pytest

from llmrs.compiler.cli import main as compile_main
from llmrs.models.tiny import make_model
from llmrs.runtime.backends.cpu import CpuBackend
from llmrs.runtime.backends.reference import ReferenceBackend
from llmrs.runtime.plan import Plan

from ..conftest import rel_err
from .step_driver import Blocks
from .test_step_cpu import interleaved

KV = ("q8_0", "q4_0")
# The largest logit error against the f32-KV plan, of the f32 plan's largest |logit|. Measured on
# this model, the CPU and PoCL alike: prefill + 12 greedy decode steps q8_0 0.0089, q4_0 0.113; the
# step graph's 7 steps q8_0 0.0135, q4_0 0.155. A cached value is off by at most half a code step:
# 1/254 of its block's largest value for q8_0, 1/16 for q4_0 (codes reach -8 d but only +7 d), so
# q4_0's error is ~16x q8_0's (11.5-12.7x measured); the bounds leave ~2x room over the
# measurements, and the floors show the cache is really quantized.
BOUND = {"q8_0": 3e-2, "q4_0": 0.3}
FLOOR = {"q8_0": 1e-3, "q4_0": 2e-2}
# the step graph against the interpreter on the same plan (measured <= 1.4e-4): a key the kernels
# compute 1 ulp off the interpreter's may land on the neighbouring code (a step of 1/127 or 1/8
# of its block's largest value), rarely
STEP_TOL = {"q8_0": 1e-3, "q4_0": 1e-2}
PROMPT = np.random.default_rng(7).integers(3, 300, 19).astype(np.int32)
N_NEW = 12
CHUNK = 16


@pytest.fixture(scope="module")
def plans(tmp_path_factory) -> dict[str, Plan]:
    """kv type -> plan of the same model (f32 weights: only the cache differs), 16 blocks of 4."""
    tmp = tmp_path_factory.mktemp("quantized-kv")
    src = make_model(tmp / "tiny", "tiny", seed=4, num_hidden_layers=2, intermediate_size=256, vocab_size=512)
    out = {}
    for kv in ("f32", *KV):
        path = tmp / f"{kv}.plan.bin"
        assert compile_main([str(src), "-o", str(path), "--weights", "f32", "--kv-type", kv, "--max-seq-len", "64",
                             "--prefill-chunk", str(CHUNK), "--block-size", "4", "--max-num-seqs", "4", "-q"]) == 0
        out[kv] = Plan.open(path)
    return out


def _opencl(plan: Plan) -> Any:
    from llmrs.runtime.backends.opencl import OpenCLBackend
    return OpenCLBackend(plan)


BACKENDS: dict[str, Callable[[Plan], Any]] = {"cpu": lambda plan: CpuBackend(plan, threads=2), "opencl": _opencl}


@pytest.fixture(params=sorted(BACKENDS))
def open_backend(request) -> Callable[[Plan], Any]:
    if request.param == "opencl":
        pytest.importorskip("pyopencl")
        request.getfixturevalue("opencl_device")
    return BACKENDS[request.param]


def _greedy(be, n_new: int = N_NEW) -> np.ndarray:
    """The prompt in chunks, then greedy decode steps: the logits of each token chosen."""
    for s in range(0, len(PROMPT), CHUNK):
        logits = be.run("prefill", PROMPT[s:s + CHUNK], s, s)[-1]
    out = [logits]
    for i in range(n_new):
        n = len(PROMPT) + i
        out.append(be.run("decode", np.array([np.argmax(out[-1])], np.int32), n, n)[-1])
    return np.stack(out)


def _stepped(be, plan: Plan, seen: Callable) -> list[list[int]]:
    """Three sequences joining mid-run through the step graph, as test_step_cpu's."""
    shape = plan.step_shape()
    rng = np.random.default_rng(17)
    prompts = [rng.integers(3, shape.vocab, n).astype(np.int32) for n in (11, 4, 9)]
    return interleaved(be, Blocks(shape, rng), prompts, joins=[0, 0, 1], chunks=[11, 2, 5], n_new=5, seen=seen)


@pytest.mark.parametrize("kv", KV)
def test_prefill_and_decode_logits_stay_within_the_kv_formats_error_of_an_f32_cache(plans, open_backend, kv):
    got, ref = _greedy(open_backend(plans[kv])), _greedy(open_backend(plans["f32"]))
    err = rel_err(got, ref)
    assert FLOOR[kv] < err <= BOUND[kv], f"{kv}: {err:.4f} of the logit range"


@pytest.mark.parametrize("kv", KV)
def test_step_graph_gives_the_interpreters_logits_within_the_f32_caches_bound(plans, open_backend, kv):
    """The step graph on the kv plan against the interpreter on it, and the same steps (rows
    replayed: the greedy tokens of a q4_0 cache may part from an f32 cache's) on the f32 plan."""
    oracle, steps, to_oracle = ReferenceBackend(plans[kv].graphs()), [], []

    def seen(rows, logits):
        steps.append((rows, logits))
        to_oracle.append(rel_err(logits, oracle.run_step(rows)))
    _stepped(open_backend(plans[kv]), plans[kv], seen)
    assert len(to_oracle) == 7 and max(to_oracle) <= STEP_TOL[kv], to_oracle
    exact = open_backend(plans["f32"])
    err = max(rel_err(logits, exact.run_step(rows)) for rows, logits in steps)
    assert FLOOR[kv] < err <= BOUND[kv], f"{kv}: {err:.4f} of the logit range"


def test_a_token_of_q4_0_cache_takes_18_34ths_of_q8_0s_bytes(plans):
    """Per token: layers x (K, V) x KV heads x head_dim / 32 blocks of 18 (q4_0) / 34 (q8_0) bytes."""
    cfg = plans["q4_0"].manifest["model"]
    per_token = {}
    for kv in KV:
        g = plans[kv].graphs()["decode"]
        caches = [v for v in g.values.values() if v.kind == "state" and len(v.shape) == 3]
        per_token[kv] = sum(v.nbytes // v.shape[0] for v in caches)
    assert per_token["q4_0"] == cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * cfg["head_dim"] // 32 * 18
    assert per_token["q4_0"] * 34 == per_token["q8_0"] * 18
