"""fuse pass: fewer kernels, the same logits (max |a - b| / max |b| < 1e-5 in float32), each rule
switchable on its own, and a Llama-3.2-1B decode layer in 5 kernels."""

import time
from dataclasses import replace

import numpy as np
import pytest

from llmrs.compiler import quant
from llmrs.compiler.interpret import Interpreter
from llmrs.compiler.ir import Graph, LazyTensor
from llmrs.compiler.passes.fold import INV_FREQ, fold
from llmrs.compiler.passes.fuse import RULE_NAMES, fuse
from llmrs.compiler.passes.quantize import quantize
from llmrs.models.config import parse_config
from llmrs.models.llama import build_graph, build_graphs, load_model
from llmrs.models.step import step_graph
from llmrs.models.tiny import make_config
from llmrs.runtime.kv.store import NEVER

from ..conftest import rel_err, run_steps, unloadable_weights
from .qwen_graphs import QWEN2, QWEN3, build_graphs as build_qwen

T, S = 8, 64   # prefill chunk, KV slots


def _graphs(model_dir):
    return build_graphs(load_model(model_dir), prefill_T=T, max_seq_len=S)


def _check_same_logits(p, d, fp, fd, tol=1e-5):
    """Prefill 19 random tokens in chunks of T, then 4 decode steps, on both pairs of graphs.
    A graph with last-token logits outputs one row per chunk: the chunk's last row."""
    rng = np.random.default_rng(4)
    vocab = p.values["logits"].shape[1]
    prompt, steps = rng.integers(0, vocab, 19, dtype=np.int32), rng.integers(0, vocab, 4, dtype=np.int32)
    ref_p, ref_d = run_steps(p, d, prompt, steps)
    out_p, out_d = run_steps(fp.verify(), fd.verify(), prompt, steps)
    if out_p.shape[0] != ref_p.shape[0]:
        ref_p = ref_p[[min(s + T, len(prompt)) - 1 for s in range(0, len(prompt), T)]]
    assert rel_err(out_p, ref_p) < tol
    assert rel_err(np.stack(out_d), np.stack(ref_d)) < tol


def test_fused_graphs_give_the_same_logits(golden):
    p, d = _graphs(golden[0])
    _check_same_logits(p, d, fuse(p), fuse(d))


@pytest.mark.parametrize("wdtype", ["q4_0", "q4_1"])
def test_fusing_folded_quantized_graphs_gives_the_same_logits(golden, wdtype):
    """Stacked q4 weights are their blocks stacked; norm_weight_fold leaves GGML's bytes alone."""
    p, d = (fold(quantize(g, wdtype)) for g in _graphs(golden[0]))
    fp, fd = fuse(p), fuse(d)
    stacked = [op.inputs[1] for op in fd.ops if op.attrs.get("epilogue") in ("rope_kv_store", "silu_mul")]
    assert stacked and all(fd.values[w].dtype == wdtype for w in stacked)
    assert not _folded(fd)
    _check_same_logits(p, d, fp, fd)


@pytest.mark.parametrize("rule", RULE_NAMES)
def test_each_rule_switched_off_still_gives_the_same_logits(golden, rule):
    p, d = _graphs(golden[0])
    fp, fd = fuse(p, disabled=[rule]), fuse(d, disabled=[rule])
    if rule == "norm_weight_fold":      # a fold, not a fusion: same kernels, no folded weights
        foldable = {v.dtype for v in d.values.values() if v.kind == "param"} <= {"f32", "f16"}   # not bf16
        assert not _folded(fd) and bool(_folded(fuse(d))) == foldable
    else:
        assert fd.kernel_count() > fuse(d).kernel_count() or rule == "last_token_logits"
    _check_same_logits(p, d, fp, fd)


def _folded(g):
    return [op.inputs[1] for op in g.ops if op.attrs.get("norm_folded")]


@pytest.mark.parametrize("rule", RULE_NAMES)
def test_each_rule_alone_gives_the_same_logits(golden, rule):
    p, d = _graphs(golden[0])
    others = [r for r in RULE_NAMES if r != rule]
    fp, fd = fuse(p, disabled=others), fuse(d, disabled=others)
    if rule == "last_token_logits":     # the slice is no kernel: the head reads one row
        assert fp.values["logits"].shape[0] == 1
    elif rule == "norm_weight_fold":    # needs norm_prologue's fused ops: alone it changes nothing
        assert not _folded(fd) and fd.kernel_count() == d.kernel_count()
    else:
        assert fp.kernel_count() < p.kernel_count()
    _check_same_logits(p, d, fp, fd)


def test_a_decode_layer_is_the_five_kernels_of_the_contract():
    d = fuse(fold(_graphs("tests/data/golden-b")[1]))
    layer = d.ops[1:6]
    assert [(op.kind, op.attrs.get("prologue"), op.attrs.get("epilogue")) for op in layer] == [
        ("fused_matmul", "rms_norm", "rope_kv_store"), ("attention", None, None),
        ("fused_matmul", None, "add"), ("fused_matmul", "rms_norm", "silu_mul"),
        ("fused_matmul", None, "add")]
    qkv = layer[0]
    assert qkv.inputs == ["x.embed", "model.layers.0.self_attn.qkv_proj.weight",
                          "model.layers.0.input_layernorm.weight", INV_FREQ, "cache.k.0", "cache.v.0"]
    assert qkv.outputs == ["l0.q_rope", "l0.k_cache", "l0.v_cache"]
    assert (qkv.attrs["n_heads"], qkv.attrs["n_kv_heads"], qkv.attrs["head_dim"]) == (8, 2, 16)
    assert layer[2].inputs == ["l0.attn", "model.layers.0.self_attn.o_proj.weight", "x.embed"]
    assert layer[4].inputs == ["l0.swiglu", "model.layers.0.mlp.down_proj.weight", "l0.x_attn"]
    assert d.kernel_count() == 1 + 2 * 5 + 1
    assert [op.name for op in d.ops] == [f"{op.kind}_{i}" for i, op in enumerate(d.ops)]


def test_prefill_runs_the_final_norm_and_head_on_the_last_row_only():
    p = fuse(_graphs("tests/data/golden-a")[0])
    sl, head = p.ops[-2], p.ops[-1]
    assert sl.kind == "slice" and sl.attrs == {"rows": "last"} and head.inputs[0] == sl.outputs[0]
    assert head.attrs["prologue"] == "rms_norm" and p.values["logits"].shape == (1, 384)
    assert fuse(_graphs("tests/data/golden-a")[1]).values["logits"].shape == (1, 384)


@pytest.mark.parametrize("fmt", ["bf16", "q4_0"])
def test_stacked_weights_are_the_sources_rows_in_order(fmt):
    d = _graphs("tests/data/golden-b")[1]
    if fmt != "bf16":
        d = quantize(d, fmt)
    f = fuse(d)
    for stacked, parts in (("self_attn.qkv_proj", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
                           ("mlp.gate_up_proj", ("mlp.gate_proj", "mlp.up_proj"))):
        name = f"model.layers.1.{stacked}.weight"
        srcs = [d.weights[f"model.layers.1.{p}.weight"].load() for p in parts]
        assert f.values[name].kind == "const" and f.values[name].dtype == fmt
        assert np.array_equal(f.weights[name].load(), np.concatenate(srcs))
        for p in parts:                                  # the unstacked weights are gone
            assert f"model.layers.1.{p}.weight" not in f.values
    if fmt == "q4_0":   # stacking blocks is quantizing the stacked matrix
        tensors = load_model("tests/data/golden-b").tensors
        bf16 = np.concatenate([tensors[f"model.layers.0.self_attn.{x}_proj.weight"].load() for x in "qkv"])
        floats = (bf16.astype(np.uint32) << 16).view(np.float32)
        assert np.array_equal(f.weights["model.layers.0.self_attn.qkv_proj.weight"].load(),
                              quant.quantize(floats, "q4_0"))


def test_fuse_leaves_its_input_graph_untouched(golden):
    d = _graphs(golden[0])[1]
    before = str(d)
    fuse(d)
    assert str(d) == before


def test_an_unknown_rule_is_a_one_line_error_listing_the_rules(golden):
    with pytest.raises(ValueError, match=r"^unknown fusion rule 'qkv'; the rules are qkv_rope_kv, "
                                         r"gate_up_silu, residual_epilogue, last_token_logits, norm_prologue, norm_weight_fold$"):
        fuse(_graphs(golden[0])[1], disabled=["qkv"])


def test_llama_1b_graphs_build_in_under_a_second_and_decode_in_5_kernels_a_layer():
    cfg_json = make_config("llama-3.2-1b")
    cfg, weights = parse_config(cfg_json), unloadable_weights(cfg_json)
    t0 = time.perf_counter()
    prefill, decode = (build_graph(cfg, weights, t, 2048, name) for t, name in ((128, "prefill"), (1, "decode")))
    assert time.perf_counter() - t0 < 1.0
    for g in (prefill, decode):
        f = fuse(fold(quantize(g, "q4_0"))).verify()     # no weight is loaded on the way
        per_layer = (f.kernel_count() - 2) / cfg.num_hidden_layers   # less embedding and head
        assert per_layer <= 5, f"{g.name}: {per_layer} kernels per layer"
    assert f.kernel_count() == 16 * 5 + 2


@pytest.mark.parametrize("fmt", ["f16", "f32"])
def test_norm_weights_fold_into_float_weights_but_not_into_a_tied_head_or_quantized_ones(golden, fmt):
    # a head tied to the embedding keeps its norm weight; f16 rounds w * nw once more
    p, d = (quantize(g, fmt) for g in _graphs(golden[0]))
    fp, fd = fuse(p), fuse(d)
    cfg = fd.meta["config"]
    folded = _folded(fd)
    assert len(folded) == 2 * cfg["num_hidden_layers"] + (not cfg["tie_word_embeddings"])
    assert all(n.endswith(".normed") for n in folded)
    head = [op for op in fd.ops if op.outputs == ["logits"]][0]
    assert head.attrs.get("prologue") == "rms_norm"
    assert bool(head.attrs.get("norm_folded")) != cfg["tie_word_embeddings"]
    _check_same_logits(p, d, fp, fd, tol=1e-5 if fmt == "f32" else 2e-3)
    assert not _folded(fuse(quantize(_graphs(golden[0])[1], "q4_0")))


# -- Qwen: per-head q/k norms (Qwen3) and q/k/v biases (Qwen2) ----------------------------------

QWEN = {"qwen3": QWEN3, "qwen2": QWEN2, "qwen3+bias": replace(QWEN3, bias=True, head_dim=32, kv_heads=1)}


def _qwen(name):
    return build_qwen(QWEN[name], T=T, max_seq_len=S)


LAYER = [("fused_matmul", "rms_norm", "rope_kv_store"), ("attention", None, None), ("fused_matmul", None, "add"),
         ("fused_matmul", "rms_norm", "silu_mul"), ("fused_matmul", None, "add")]


@pytest.mark.parametrize("name", sorted(QWEN))
def test_qwen_decode_layer_is_llamas_five_kernels_with_the_same_logits(name):
    s = QWEN[name]
    p, d = _qwen(name)
    fp, fd = fuse(fold(p)), fuse(fold(d))
    assert fd.kernel_count() == 1 + 5 * s.layers + 1
    layer = fd.ops[1:6]
    assert [(op.kind, op.attrs.get("prologue"), op.attrs.get("epilogue")) for op in layer] == LAYER
    qkv = layer[0]
    assert bool(qkv.attrs.get("qk_norm")) == s.qk_norm and bool(qkv.attrs.get("bias")) == s.bias
    assert [bool(op.attrs.get("bias")) for op in layer[2:]] == [False, False, False]
    pre = "model.layers.0.self_attn."
    norms = [pre + "q_norm.weight", pre + "k_norm.weight"] if s.qk_norm else []
    assert qkv.inputs[:3] == ["x.embed", pre + "qkv_proj.weight", "model.layers.0.input_layernorm.weight"]
    assert qkv.inputs[3:] == [INV_FREQ, "cache.k.0", "cache.v.0", *norms] + ([pre + "qkv_proj.bias"] if s.bias else [])
    if s.qk_norm:
        assert qkv.attrs["qk_eps"] == s.eps
    if s.bias:   # the biases stacked as the weights are: q's, then k's, then v's
        stacked = fd.weights[pre + "qkv_proj.bias"].load()
        parts = [d.weights[f"{pre}{x}_proj.bias"].load() for x in "qkv"]
        assert fd.values[pre + "qkv_proj.bias"].dtype == "f32" and np.array_equal(stacked, np.concatenate(parts))
    assert (qkv.attrs["n_heads"], qkv.attrs["n_kv_heads"], qkv.attrs["head_dim"]) == (s.heads, s.kv_heads, s.head_dim)
    assert fp.kernel_count() == 1 + 5 * s.layers + 1   # prefill: the head's slice is no kernel
    _check_same_logits(p, d, fp, fd)


@pytest.mark.parametrize("name", sorted(QWEN))
@pytest.mark.parametrize("wdtype", ["q4_0", "f16"])
def test_fusing_quantized_qwen_graphs_gives_the_same_logits(name, wdtype):
    p, d = (fold(quantize(g, wdtype)) for g in _qwen(name))
    fp, fd = fuse(p), fuse(d)
    assert fd.kernel_count() == 1 + 5 * QWEN[name].layers + 1
    _check_same_logits(p, d, fp, fd, tol=1e-5 if wdtype == "q4_0" else 2e-3)


@pytest.mark.parametrize("name", sorted(QWEN))
@pytest.mark.parametrize("rule", RULE_NAMES)
def test_each_rule_switched_off_or_alone_keeps_qwens_logits(name, rule):
    p, d = _qwen(name)
    others = [r for r in RULE_NAMES if r != rule]
    for disabled in ([rule], others):
        fp, fd = fuse(p, disabled=disabled), fuse(d, disabled=disabled)
        _check_same_logits(p, d, fp, fd)
    alone = fuse(d, disabled=others)
    if rule == "qkv_rope_kv":
        assert [op.attrs.get("epilogue") for op in alone.ops if op.kind == "fused_matmul"] == ["rope_kv_store"] * 2
    if rule == "norm_prologue":   # the per-head norms are no prologue: they feed RoPE, not a matmul
        s = QWEN[name]
        per_head = [op for op in alone.ops if op.kind == "rms_norm" and alone.values[op.inputs[1]].shape == (s.head_dim,)]
        assert len(per_head) == 2 * s.layers * s.qk_norm
        assert {alone.values[op.inputs[2]].shape for op in alone.ops if op.attrs.get("prologue")} == {(s.hidden,)}
    if rule == "norm_weight_fold":   # bf16 weights are not folded
        assert not _folded(alone)


def _biased_mlp(wdtype: str) -> Graph:
    """embedding -> rms_norm -> x@w_o + b (+ x) -> rms_norm -> silu(x@w_gate + b) * (x@w_up)
    -> x@w_down + b (+ x) -> rms_norm -> x@head + b: a bias in the place of every rule's matmul."""
    rng = np.random.default_rng(9)
    T, D, F, V = 5, 64, 96, 80
    g = Graph("prefill", T)

    def param(name, *shape, dtype="f32", scale=None):
        arr = rng.standard_normal(shape).astype(np.float32) * (scale or (1 / np.sqrt(shape[-1]) if len(shape) == 2 else 0.5))
        if len(shape) == 1 and not name.endswith("b"):
            arr = 1.0 + 0.2 * arr
        arr = arr.astype(np.float16 if dtype == "f16" else np.float32)
        g.add_value(name, shape, dtype, kind="param")
        g.weights[name] = LazyTensor.of(arr, dtype)
        return name

    act = lambda n, *shape: g.add_value(n, shape, "f32")  # noqa: E731
    g.inputs = [g.add_value("tokens", (T,), "i32", kind="input")]
    x = act("x", T, D)
    g.add_op("embedding", [param("emb", V, D, scale=1.0), "tokens"], [x])
    xn, o, x1 = act("xn", T, D), act("o", T, D), act("x1", T, D)
    g.add_op("rms_norm", [x, param("n1", D)], [xn], eps=1e-5)
    g.add_op("matmul", [xn, param("w_o", D, D, dtype=wdtype), param("w_o.b", D)], [o])
    g.add_op("add", [x, o], [x1])
    xn2, gate, up, h = act("xn2", T, D), act("gate", T, F), act("up", T, F), act("h", T, F)
    g.add_op("rms_norm", [x1, param("n2", D)], [xn2], eps=1e-5)
    g.add_op("matmul", [xn2, param("w_gate", F, D, dtype=wdtype), param("w_gate.b", F)], [gate])
    g.add_op("matmul", [xn2, param("w_up", F, D, dtype=wdtype)], [up])
    g.add_op("silu_mul", [gate, up], [h])
    down, x2 = act("down", T, D), act("x2", T, D)
    g.add_op("matmul", [h, param("w_down", D, F, dtype=wdtype), param("w_down.b", D)], [down])
    g.add_op("add", [down, x1], [x2])
    xf, logits = act("xf", T, D), act("logits", T, V)
    g.add_op("rms_norm", [x2, param("nf", D)], [xf], eps=1e-5)
    g.add_op("matmul", [xf, param("head", V, D, dtype=wdtype), param("head.b", V)], [logits])
    g.outputs = [logits]
    return g.verify()


@pytest.mark.parametrize("wdtype", ["f32", "q8_0"])
def test_biased_matmuls_keep_their_bias_through_every_rule(wdtype):
    """Every rule that takes a matmul carries its bias along (the last input, attr bias), the
    norm-weight fold included: a rule that dropped one would change the logits."""
    g = _biased_mlp("f32")
    if wdtype != "f32":
        g = quantize(g, wdtype)
    f = fuse(g).verify()
    assert [(op.kind, op.attrs.get("prologue"), op.attrs.get("epilogue"), op.attrs.get("bias")) for op in f.ops] == [
        ("embedding", None, None, None), ("fused_matmul", "rms_norm", "add", True),
        ("fused_matmul", "rms_norm", "silu_mul", True), ("fused_matmul", None, "add", True),
        ("slice", None, None, None), ("fused_matmul", "rms_norm", None, True)]
    assert [op.inputs[-1] for op in f.ops if op.kind == "fused_matmul"] == ["w_o.b", "gate_up_proj.bias",
                                                                            "w_down.b", "head.b"]
    gate_up_bias = f.weights[f.ops[2].inputs[-1]].load()   # up had none: zeros after the gate's
    assert np.array_equal(gate_up_bias, np.concatenate([g.weights["w_gate.b"].load(), np.zeros(96, np.float32)]))
    assert bool(_folded(f)) == (wdtype == "f32")
    tokens = np.array([3, 1, 4, 1, 5], np.int32)
    want = Interpreter(g).run({"tokens": tokens}, {}, 0)["logits"][-1:]
    assert rel_err(Interpreter(f).run({"tokens": tokens}, {}, 0)["logits"], want) < 1e-5
    for rule in RULE_NAMES:
        one = fuse(g, disabled=[r for r in RULE_NAMES if r != rule]).verify()
        got = Interpreter(one).run({"tokens": tokens}, {}, 0)["logits"][-1:]
        assert rel_err(got, want) < 1e-5, rule


# -- step graphs (compiler/ir.py "Step graphs"): fused as the prefill graph is ---------------------

STEP_SEQS, STEP_BS = 3, 4


def _step(prefill: Graph) -> Graph:
    return fold(step_graph(prefill, max_seqs=STEP_SEQS, block_size=STEP_BS))


def _step_inputs(g: Graph, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """A full step of rows from 3 sequences, out of order: positions far apart and shuffled, each
    row's KV slot a different one of the pool's, block tables shuffled blocks, every row's
    context within what earlier steps stored (the pool starts as random non-zero state)."""
    T, S = g.T, g.kv_slots
    vocab = g.values["logits"].shape[1]
    seqs = rng.integers(0, STEP_SEQS, T)
    return {"tokens": rng.integers(0, vocab, T).astype(np.int32),
            "positions": rng.permutation(np.arange(0, 50 * T, 50))[:T] + rng.integers(0, 50, T),
            "slots": rng.permutation(S)[:T], "row_seq": seqs, "ctx_len": rng.integers(1, S + 1, T),
            "block_tables": np.stack([rng.permutation(S // STEP_BS) for _ in range(STEP_SEQS)]),
            "logit_rows": rng.permutation(T)[:STEP_SEQS],
            # half the rows add eviction scores (from a random KV index on), half none
            "score_from": np.where(rng.random(T) < 0.5, NEVER, rng.integers(0, S, T)).astype(np.int32)}


def _check_same_step(g: Graph, f: Graph, tol: float = 1e-5) -> None:
    """Two steps with the same inputs on both graphs: the same logits and the same KV pool."""
    rng = np.random.default_rng(9)
    ig, if_ = Interpreter(g), Interpreter(f.verify())
    state = {k: (rng.standard_normal(v.shape) + 0.1).astype(v.dtype) if v.dtype == np.float32 else v
             for k, v in ig.new_state().items()}
    state_f = {k: v.copy() for k, v in state.items()}
    for _ in range(2):
        inputs = _step_inputs(g, rng)
        want = ig.run(inputs, state, n_past=0)["logits"]
        got = if_.run(inputs, state_f, n_past=0)["logits"]
        assert rel_err(got, want) < tol
    for k in state:
        np.testing.assert_allclose(state_f[k], state[k], rtol=tol, atol=tol, err_msg=k)


STEP_LAYER = [("fused_matmul", "rms_norm", "rope_kv_store"), ("attention", None, None),
              ("fused_matmul", None, "add"), ("fused_matmul", "rms_norm", "silu_mul"), ("fused_matmul", None, "add")]


@pytest.mark.parametrize("name", ["golden-a", "golden-b", *sorted(QWEN)])
def test_a_step_graph_fuses_into_the_prefill_graphs_five_kernels_a_layer_with_the_same_logits(name):
    p = _graphs(f"tests/data/{name}")[0] if name.startswith("golden") else _qwen(name)[0]
    s = _step(p)
    f = fuse(s)
    layers = f.meta["config"]["num_hidden_layers"]
    # embedding, 5 a layer, the gather of the logit rows and the head (its norm fused): the
    # prefill graph's kernels, its last-row slice (no kernel) become the gather (a kernel)
    assert f.kernel_count() == 1 + 5 * layers + 2 == fuse(fold(p)).kernel_count() + 1
    assert [(op.kind, op.attrs.get("prologue"), op.attrs.get("epilogue")) for op in f.ops[1:6]] == STEP_LAYER
    qkv = f.ops[1]
    assert qkv.attrs["step_rows"] is True and qkv.inputs[-2 - bool(qkv.attrs.get("bias")):][:2] == ["positions", "slots"]
    assert f.ops[2].attrs["block_size"] == STEP_BS and f.ops[2].inputs[3:6] == ["row_seq", "ctx_len", "block_tables"]
    assert f.ops[2].inputs[-1] == "score_from"
    # the head stays on the gathered rows: last_token_logits does not fire on them
    assert [op.kind for op in f.ops[-2:]] == ["gather", "fused_matmul"] and f.values["logits"].shape[0] == STEP_SEQS
    _check_same_step(s, f)


@pytest.mark.parametrize("name", ["golden-b", "qwen3", "qwen2"])
@pytest.mark.parametrize("wdtype", ["q4_0", "f16"])
def test_a_fused_quantized_step_graph_gives_the_same_logits(name, wdtype):
    p = _graphs(f"tests/data/{name}")[0] if name.startswith("golden") else _qwen(name)[0]
    s = fold(step_graph(quantize(p, wdtype), max_seqs=STEP_SEQS, block_size=STEP_BS))
    _check_same_step(s, fuse(s), tol=1e-5 if wdtype == "q4_0" else 2e-3)


@pytest.mark.parametrize("rule", RULE_NAMES)
def test_each_rule_switched_off_or_alone_keeps_a_step_graphs_logits(rule):
    s = _step(_qwen("qwen3+bias")[0])
    others = [r for r in RULE_NAMES if r != rule]
    for disabled in ([rule], others):
        _check_same_step(s, fuse(s, disabled=disabled))
    if rule == "last_token_logits":   # alone it changes nothing in a step graph
        assert fuse(s, disabled=others).kernel_count() == s.kernel_count()


def test_a_rope_and_store_at_other_rows_than_their_neighbours_are_left_unfused():
    """q and k roped at different positions, or k and v stored at different slots, are no one
    epilogue: the rule declines and the graph keeps its meaning."""
    p = _graphs("tests/data/golden-b")[0]
    for which, extra in (("rope", "positions2"), ("kv_store", "slots2")):
        s = step_graph(p, max_seqs=STEP_SEQS, block_size=STEP_BS)
        s.inputs.append(s.add_value(extra, (s.T,), "i32", kind="input"))
        first = next(op for op in s.ops if op.kind == which)
        first.inputs[-1] = extra
        s = fold(s.verify())
        f = fuse(s)
        assert sum(op.attrs.get("epilogue") == "rope_kv_store" for op in f.ops) == f.meta["config"]["num_hidden_layers"] - 1
        rng = np.random.default_rng(2)
        ig, if_ = Interpreter(s), Interpreter(f.verify())
        inputs = {**_step_inputs(s, rng), extra: rng.permutation(s.kv_slots)[:s.T]}
        st, st_f = ig.new_state(), if_.new_state()
        assert rel_err(if_.run(inputs, st_f, 0)["logits"], ig.run(inputs, st, 0)["logits"]) < 1e-5
