"""The interpreter against Hugging Face transformers' logits for the committed tiny models."""
import numpy as np

from llmrs.models.llama import build_graphs, load_model

from ..conftest import rel_err, run_steps


def test_interpreter_matches_transformers_prefill_and_each_decode_step(golden):
    path, gd = golden
    prefill, decode = build_graphs(load_model(path), prefill_T=64, max_seq_len=128)
    logits, steps = run_steps(prefill, decode, gd["prompt_tokens"], gd["generated"][:-1])
    assert rel_err(logits, gd["prefill_logits"]) <= 1e-4
    assert len(steps) == len(gd["decode_logits"]) == 8
    for got, ref in zip(steps, gd["decode_logits"]):
        assert rel_err(got, ref) <= 1e-4
    assert [int(s.argmax()) for s in steps] == list(gd["generated"][1:])


def test_prefill_in_chunks_matches_one_prefill(golden):
    path, gd = golden
    model = load_model(path)
    whole, _ = run_steps(*build_graphs(model, prefill_T=64, max_seq_len=128), gd["prompt_tokens"], gd["generated"][:1])
    chunked, _ = run_steps(*build_graphs(model, prefill_T=7, max_seq_len=128), gd["prompt_tokens"], gd["generated"][:1])
    assert rel_err(chunked, whole) <= 1e-5


def test_golden_files_record_their_transformers_version(golden):
    _, gd = golden
    assert str(gd["transformers_version"]).count(".") >= 1
    assert gd["prefill_logits"].shape == (len(gd["prompt_tokens"]), gd["decode_logits"].shape[1])
    assert np.all(np.isfinite(gd["prefill_logits"])) and np.std(gd["prefill_logits"]) > 0.1
