"""pipeline: the passes in order on both phases, IR dumps, options checked up front."""

import numpy as np
import pytest

from llmrs.compiler import pipeline
from llmrs.compiler.ir import IRError
from llmrs.compiler.pipeline import PASSES, RULES, CompileOptions, compile_graphs, run_passes
from llmrs.models.llama import build_graphs, load_model

from ..conftest import rel_err, run_steps

SMALL = dict(max_seq_len=64, prefill_chunk=8)


def test_the_passes_run_in_the_documented_order():
    assert [name for name, _ in PASSES] == ["verify", "quantize", "fold", "fuse", "schedule", "plan_memory"]
    assert RULES == ("qkv_rope_kv", "gate_up_silu", "residual_epilogue", "last_token_logits", "norm_prologue",
                     "norm_weight_fold")


def test_compiled_f32_graphs_give_the_built_graphs_logits(golden):
    model = load_model(golden[0])
    p, d = build_graphs(model, 8, 64)
    cp, cd = compile_graphs(model, CompileOptions(weights="f32", kv_type="f32", **SMALL))
    rng = np.random.default_rng(5)
    vocab = p.values["logits"].shape[1]
    prompt, steps = rng.integers(0, vocab, 21, dtype=np.int32), rng.integers(0, vocab, 4, dtype=np.int32)
    ref_p, ref_d = run_steps(p, d, prompt, steps)
    out_p, out_d = run_steps(cp, cd, prompt, steps)
    assert rel_err(out_p, ref_p[[7, 15, 20]]) < 1e-5
    assert rel_err(np.stack(out_d), np.stack(ref_d)) < 1e-5
    assert cd.kernel_count() == 1 + 5 * model.config.num_hidden_layers + 1
    for g in (cp, cd):
        assert set(g.meta["layout"]["arena"]) and g.meta["layout"]["kv"] == cd.meta["layout"]["kv"]


def test_q8_0_weights_with_an_f16_cache_stay_close_to_float(golden):
    model = load_model(golden[0])
    p, d = build_graphs(model, 8, 64)
    cp, cd = compile_graphs(golden[0], CompileOptions(weights="q8_0", **SMALL))
    assert cd.values["model.layers.0.self_attn.qkv_proj.weight"].dtype == "q8_0"
    assert cd.values["cache.k.0"].dtype == "f16"
    rng = np.random.default_rng(6)
    prompt, steps = rng.integers(0, 300, 9, dtype=np.int32), rng.integers(0, 300, 2, dtype=np.int32)
    ref_d = run_steps(p, d, prompt, steps)[1]
    assert rel_err(np.stack(run_steps(cp, cd, prompt, steps)[1]), np.stack(ref_d)) < 6e-2


def test_dump_ir_writes_each_phase_after_every_pass(tmp_path):
    opts = CompileOptions(weights="f32", dump_ir=tmp_path / "ir", no_fuse=("norm_prologue",), **SMALL)
    compile_graphs("tests/data/golden-a", opts)
    names = ["00-build"] + [f"{i:02d}-{n}" for i, (n, _) in enumerate(PASSES, 1)]
    assert sorted(p.name for p in (tmp_path / "ir").iterdir()) == sorted(
        f"{phase}.{n}.txt" for phase in ("decode", "prefill") for n in names)
    fused = (tmp_path / "ir" / "decode.04-fuse.txt").read_text()
    assert fused.startswith("graph decode (T=1, 17 ops, 17 kernels)") and "rms_norm(" in fused
    assert "rope(" in (tmp_path / "ir" / "decode.03-fold.txt").read_text()


def test_a_disabled_rule_reaches_fuse():
    on = compile_graphs("tests/data/golden-a", CompileOptions(weights="f32", **SMALL))[1]
    off = compile_graphs("tests/data/golden-a", CompileOptions(weights="f32", no_fuse=("gate_up_silu",), **SMALL))[1]
    # per layer: gate, up and silu_mul instead of one op, and the norm before them stays its own
    assert off.kernel_count() == on.kernel_count() + 2 * 3


@pytest.mark.parametrize("opts, message", [
    (CompileOptions(no_fuse=("qkv_rope",)), r"^unknown fusion rule 'qkv_rope'; the rules are qkv_rope_kv, "),
    (CompileOptions(kv_type="q4_1"), r"^kv_type 'q4_1': choose one of f32, f16, q8_0, q4_0$"),
    (CompileOptions(embedding="bf16"), r"^embedding 'bf16': choose one of q4_0, q4_1, q8_0, f16, f32, native$"),
])
def test_bad_options_are_one_line_errors_before_any_work(opts, message):
    with pytest.raises(ValueError, match=message):
        compile_graphs("/nonexistent/model", opts)


@pytest.mark.parametrize("kv", ["q8_0", "q4_0"])
def test_a_block_cache_of_a_head_dim_not_in_32_value_blocks_is_a_one_line_error_naming_the_flag(kv):
    # golden-a's head_dim is 16: a Q8_0 / q4_0 block would span two heads
    with pytest.raises(IRError, match=rf"^--kv-type {kv} stores each head's row in 32-value blocks, but head_dim "
                                      r"is 16; use --kv-type f16$"):
        compile_graphs("tests/data/golden-a", CompileOptions(kv_type=kv, **SMALL))


def test_a_pass_that_breaks_the_graph_is_named(monkeypatch):
    p, _ = build_graphs(load_model("tests/data/golden-a"), 8, 64)

    def broken(g, o):
        g = g.copy()
        g.ops.reverse()
        return g
    monkeypatch.setattr(pipeline, "PASSES", PASSES[:2] + [("fold", broken)] + PASSES[3:])
    with pytest.raises(IRError, match=r"^pass fold on graph prefill: op "):
        run_passes(p, CompileOptions())


def test_the_1b_decode_graph_compiles_to_5_kernels_a_layer_without_loading_weights(llama_1b_graphs):
    decode = run_passes(llama_1b_graphs[1], CompileOptions())
    assert decode.kernel_count() == 16 * 5 + 2
    assert decode.meta["layout"]["arena_bytes"] > 0


@pytest.mark.parametrize("target,chunk,short", [(("cpu", "opencl"), 160, True), (("opencl",), 129, True),
                                                (("cpu",), 160, False), (("cpu", "opencl"), 128, False)])
def test_opencl_gets_a_short_prefill_graph_where_the_chunk_is_longer(target, chunk, short):
    graphs = pipeline.compile_phases("tests/data/golden-a", CompileOptions(
        weights="f32", max_seq_len=192, prefill_chunk=chunk, target=target, max_num_seqs=0, max_draft_tokens=0))
    assert (pipeline.PREFILL_SHORT in graphs) == short
    assert graphs["prefill"].T == chunk
    if short:
        g = graphs[pipeline.PREFILL_SHORT]
        assert g.T == pipeline.SHORT_CHUNK and g.name == pipeline.PREFILL_SHORT
        assert g.meta["layout"]["kv"] == graphs["decode"].meta["layout"]["kv"]
        assert g.kernel_count() == graphs["prefill"].kernel_count()
