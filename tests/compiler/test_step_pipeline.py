"""The step graph in the compiler: compile_phases makes it from the built prefill graph and runs it
through the same passes, sharing the KV layout, leaving prefill and decode as they were; the
options max_num_seqs and block_size, and their one-line errors; compile_plan writes it where a
target of the plan runs it."""
from __future__ import annotations

import pytest

from llmrs.compiler.build import compile_plan
from llmrs.compiler.cli import main as compile_main
from llmrs.compiler.pipeline import CompileOptions, compile_phases
from llmrs.options import OptionError
from llmrs.runtime.plan import Plan

from ..conftest import DATA

SMALL = dict(weights="q8_0", max_seq_len=64, prefill_chunk=8)


def test_the_step_graph_shares_the_kv_layout_and_leaves_prefill_and_decode_as_they_were():
    with_step = compile_phases(DATA / "golden-a", CompileOptions(block_size=8, max_num_seqs=3, **SMALL))
    without = compile_phases(DATA / "golden-a", CompileOptions(max_num_seqs=0, **SMALL))
    assert sorted(with_step) == ["decode", "prefill", "step", "verify"] and sorted(without) == ["decode", "prefill"]
    verify = with_step["verify"]    # OpenCL's verify step: 8 drafts and the token before them, each row's logits
    assert verify.T == 9 and verify.values[verify.outputs[0]].shape == (9, 384)
    assert not any(op.kind == "slice" for op in verify.ops)
    assert verify.meta["layout"]["kv"] == with_step["decode"].meta["layout"]["kv"]
    for phase in ("prefill", "decode"):
        assert str(with_step[phase]) == str(without[phase])
        assert with_step[phase].meta["layout"] == without[phase].meta["layout"]
    step = with_step["step"]
    assert step.meta["layout"]["kv"] == with_step["decode"].meta["layout"]["kv"]
    # logits: every row of a verify step (8 drafts and the token before them), at most the step's 8 rows
    assert step.T == 8 and step.values["block_tables"].shape == (3, 8) and step.values["logits"].shape == (8, 384)
    assert {op.attrs["block_size"] for op in step.ops if op.kind == "attention"} == {8}
    # the passes ran on it: weights quantized, the MLP fused, memory planned
    assert {step.values[op.inputs[1]].dtype for op in step.ops if op.kind in ("matmul", "fused_matmul")} == {"q8_0"}
    assert any(op.attrs.get("epilogue") == "silu_mul" for op in step.ops)


def test_max_num_seqs_is_capped_at_the_rows_of_a_step():
    step = compile_phases(DATA / "golden-a", CompileOptions(**{**SMALL, "prefill_chunk": 4}))["step"]
    assert step.values["block_tables"].shape == (4, 4)      # 8 asked, 4 rows a step; 64 slots in blocks of 16


@pytest.mark.parametrize("slots,block", [(64, 16), (40, 8), (100, 4), (33, 1)])
def test_the_default_block_size_is_16_or_the_largest_power_of_2_dividing_the_cache(slots, block):
    step = compile_phases(DATA / "golden-a", CompileOptions(**{**SMALL, "max_seq_len": slots}))["step"]
    assert {op.attrs["block_size"] for op in step.ops if op.kind == "attention"} == {block}
    assert step.values["block_tables"].shape == (8, slots // block)


def test_a_block_size_that_does_not_divide_the_cache_is_one_line_naming_the_options(capsys, tmp_path):
    with pytest.raises(OptionError) as err:
        compile_phases(DATA / "golden-a", CompileOptions(**{**SMALL, "max_seq_len": 40, "block_size": 16}))
    assert str(err.value) == ("block_size 16 does not divide the KV cache's 40 slots (max_seq_len); give max_seq_len "
                              "a multiple of 16, another block_size, or max_num_seqs 0 for a plan without a step graph")
    assert compile_main([str(DATA / "golden-a"), "-o", str(tmp_path / "p.bin"), "--max-seq-len", "40",
                         "--block-size", "16", "-q"]) == 2
    err_line = capsys.readouterr().err
    assert err_line == ("llmrs-compile: error: --block-size 16 does not divide the KV cache's 40 slots "
                        "(--max-seq-len); give --max-seq-len a multiple of 16, another --block-size, or "
                        "--max-num-seqs 0 for a plan without a step graph\n")
    assert not (tmp_path / "p.bin").exists()


@pytest.mark.parametrize("values,says", [
    ({"block_size": 0}, "block_size must be a whole number from 1 to 2147483647 (positions are 32-bit), got 0"),
    ({"block_size": 4.0}, "block_size must be a whole number from 1 to 2147483647 (positions are 32-bit), got 4.0"),
    ({"max_num_seqs": -1}, "max_num_seqs must be a whole number from 0 (no step graph) to 2147483647, got -1"),
    ({"max_num_seqs": True}, "max_num_seqs must be a whole number from 0 (no step graph) to 2147483647, got True"),
])
def test_bad_step_options_are_refused_before_any_work(values, says):
    with pytest.raises(OptionError, match=f"^{says.replace('(', '[(]').replace(')', '[)]')}$"):
        CompileOptions(**values).check()


def test_a_plan_carries_the_step_graph_where_one_of_its_back_ends_runs_it(tmp_path):
    cpu = compile_plan(DATA / "golden-b", tmp_path / "cpu.bin", CompileOptions(target="cpu", block_size=4, **SMALL))
    # fused as the prefill graph (5 kernels a layer, 2 layers), its last-row slice (no kernel) the
    # gather of the logit rows (a kernel)
    assert "prefill chunk of 8 tokens 12" in cpu.summary
    assert "step graph    up to 8 sequences, 8 tokens a step, KV in blocks of 4 tokens: 13 kernels" in cpu.summary
    shape = Plan.open(cpu.path).step_shape()
    assert (shape.rows, shape.seqs, shape.block_size, shape.blocks_per_seq, shape.n_blocks) == (8, 8, 4, 16, 16)
    # OpenCL runs step graphs too: an OpenCL-only plan carries it, fused the same way; max_num_seqs 0
    # leaves it out
    opencl = compile_plan(DATA / "golden-b", tmp_path / "cl.bin", CompileOptions(target="opencl", **SMALL))
    assert "KV in blocks of 16 tokens: 13 kernels" in opencl.summary and Plan.open(opencl.path).step_shape() is not None
    none = compile_plan(DATA / "golden-b", tmp_path / "none.bin", CompileOptions(target="cpu", max_num_seqs=0, **SMALL))
    assert "step graph" not in none.summary and Plan.open(none.path).step_shape() is None
