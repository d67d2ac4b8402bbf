"""The OpenCL tuning value: what tuning_for picks per device kind, and that codegen reads the
value it is given (no module state)."""
from __future__ import annotations

import dataclasses

import pytest

from llmrs.compiler.codegen.opencl import generate
from llmrs.compiler.codegen.opencl_tuning import DEVICE_KINDS, DeviceKind, OpenCLTuning, tuning_for
from llmrs.compiler.pipeline import CompileOptions, compile_graphs

from ..conftest import DATA


def test_hopper_and_ampere_take_the_values_measured_on_h100_and_h200():
    assert tuning_for(DEVICE_KINDS["nvidia-sm90"]) == OpenCLTuning()
    assert tuning_for(DEVICE_KINDS["nvidia-sm80"]) == OpenCLTuning()


def test_devices_without_tensor_cores_keep_token_tiles_unpaired():
    for kind in ("nvidia-sm75", "pocl-cpu"):
        tuning = tuning_for(DEVICE_KINDS[kind])
        assert tuning.tile_pair_f16 is False
        assert dataclasses.replace(tuning, tile_pair_f16=True, mv_max_k=32768, mv_wg_quant=512) == OpenCLTuning()


def test_longest_quantized_decode_row_and_matvec_group_follow_the_device():
    assert tuning_for(DeviceKind((9, 0), local_mem_bytes=48 << 10)).mv_max_k == 32768
    assert tuning_for(DeviceKind((0, 0), local_mem_bytes=32 << 10)).mv_max_k == 19648   # (32 - 8) KB / 1.25
    assert tuning_for(DEVICE_KINDS["pocl-cpu"]).mv_max_k == 832288
    assert tuning_for(DeviceKind((0, 0), max_work_group_size=256)).mv_wg_quant == 256


def test_tuning_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        OpenCLTuning().mv_loads = 8


def _launches(program: dict, kernel: str) -> list[dict]:
    return [entry for table in program["graphs"].values() for entry in table if entry["kernel"] == kernel]


def test_generate_shapes_launches_by_the_tuning_it_is_given():
    # golden-b (hidden 96, q4_0): decode matvecs of 512 threads by default, 256 when told; the
    # prefill attention's query rows per group follow att_bq; the default is untouched after
    p, d = compile_graphs(DATA / "golden-b", CompileOptions(weights="q4_0", kv_type="f16", prefill_chunk=8,
                                                             max_seq_len=32))
    graphs = {"prefill": p, "decode": d}
    default = generate(graphs)
    small = generate(graphs, dataclasses.replace(OpenCLTuning(), mv_wg_quant=256, att_bq=64))
    assert {e["local"] for e in _launches(default, "matvec")} == {512}
    assert {e["local"] for e in _launches(small, "matvec")} == {256}
    assert {e["row_tile"] for e in _launches(default, "attention_tiled")} == {128}
    assert {e["row_tile"] for e in _launches(small, "attention_tiled")} == {64}
    assert generate(graphs) == default


def test_a_measurement_overrides_tuning_fields_through_the_environment(monkeypatch):
    from llmrs.compiler.codegen.opencl_tuning import OpenCLTuning, tuning_from_env
    base = OpenCLTuning()
    monkeypatch.delenv("LLMRS_OPENCL_TUNING", raising=False)
    assert tuning_from_env(base) == base
    monkeypatch.setenv("LLMRS_OPENCL_TUNING", "mv_wg_quant=256, mv_tokens_inner=0")
    got = tuning_from_env(base)
    assert (got.mv_wg_quant, got.mv_tokens_inner, got.mv_wg) == (256, False, base.mv_wg)
    for spec, message in [("mv_wgg=1", "no field 'mv_wgg'"), ("mv_wg=big", "not a whole number")]:
        monkeypatch.setenv("LLMRS_OPENCL_TUNING", spec)
        with pytest.raises(ValueError, match=message):
            tuning_from_env(base)


def test_the_tensor_core_matvecs_chunks_divide_k_and_fit_local_memory():
    """MV_MMA's chunk of x (matvec.cl MV_MMA_KC): a multiple of 32 dividing K, at most 2048 values
    (16 rows of Q8_0 codes and scales under NVIDIA's 48 KB); its groups' rows are whole 8-row MMA
    columns, 64 where a q8_0 / q4_0 KV store takes whole blocks of a head."""
    from llmrs.compiler.codegen.opencl import matvec_mma_shape, mma_chunk
    for k, want in [(2048, 2048), (8192, 2048), (3072, 1536), (96, 96), (5632, 1408), (160, 160)]:
        assert mma_chunk(k) == want
        assert k % want == 0 and want % 32 == 0
        assert 16 * (want + 16) + 16 * 4 * (want // 32) <= 48 << 10
    assert mma_chunk(2048, 64) == 64
    tuning = OpenCLTuning()
    wg, rows, split = matvec_mma_shape(tuning, None, False)
    assert (wg, rows, split) == (256, 16, 4) and rows * split // (wg // 32) % 8 == 0
    assert matvec_mma_shape(tuning, "rope_kv_store", True)[1] == 64


def test_f16_weights_take_the_tensor_core_matvec_by_default_where_rows_are_whole_blocks():
    """matvec_mma: f16 weights on MV_MMA unless mv_mma_f16 is off, K is no multiple of 32 or a
    group needs whole heads (per-head norms, RoPE by heads); quantized ones only with mv_mma; f32
    and bf16 never. Its f16 groups: 8 rows, the group's 8 warps each on a slice of K, 64 rows
    where a q8_0 / q4_0 KV store takes whole blocks of a head."""
    from dataclasses import replace
    from llmrs.compiler.codegen.opencl import matvec_mma, matvec_mma_shape
    tuning = OpenCLTuning()
    assert matvec_mma(tuning, "f16", 2048, False, False)
    assert not matvec_mma(tuning, "f16", 2040, False, False)
    assert not matvec_mma(tuning, "f16", 2048, True, False) and not matvec_mma(tuning, "f16", 2048, False, True)
    assert not matvec_mma(replace(tuning, mv_mma_f16=False), "f16", 2048, False, False)
    assert not matvec_mma(tuning, "q4_0", 2048, False, False) and matvec_mma(replace(tuning, mv_mma=True), "q4_0",
                                                                            2048, False, False)
    assert not any(matvec_mma(replace(tuning, mv_mma=True), wt, 2048, False, False) for wt in ("f32", "bf16"))
    assert matvec_mma_shape(replace(tuning, mv_mma_f16_rpw=8), None, False, "f16") == (256, 8, 8)
    assert matvec_mma_shape(tuning, "rope_kv_store", True, "f16") == (256, 64, 8)
    assert matvec_mma_shape(tuning, None, False, "f16") == (256, 16, 8)
    # 64 rows a warp from mv_mma_f16_wide rows on (the 1B's gate/up and head), never for quantized weights
    assert matvec_mma_shape(tuning, None, False, "f16", 8191) == (256, 16, 8)
    assert matvec_mma_shape(tuning, None, False, "f16", 8192) == (256, 64, 8)
    assert matvec_mma_shape(replace(tuning, mv_mma_f16_wide=0), None, False, "f16", 128256) == (256, 16, 8)
    assert matvec_mma_shape(tuning, None, False, "q4_0", 128256) == matvec_mma_shape(tuning, None, False, "q4_0")
