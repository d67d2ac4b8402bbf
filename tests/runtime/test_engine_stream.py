"""Engine.stream (generate, one token at a time) and Engine.rewind, on the reference backend."""
import numpy as np
import pytest

from llmrs.models.llama import build_graphs, load_model
from llmrs.runtime.backends.reference import ReferenceBackend
from llmrs.runtime.engine import Engine, EngineError, Generation
from llmrs.runtime.sampler import Sampler, SamplerConfig

from ..conftest import DATA


@pytest.fixture(scope="module")
def graphs():
    prefill, decode = build_graphs(load_model(DATA / "golden-a"), 8, 48)
    return {"prefill": prefill, "decode": decode}


def _engine(graphs):
    return Engine(ReferenceBackend(graphs), 8, 48)


def test_stream_yields_generate_tokens_and_a_closed_stream_keeps_positions(graphs):
    gd = np.load(DATA / "golden-a.npz")
    prompt = gd["prompt_tokens"][:20].tolist()
    whole = _engine(graphs).generate(prompt, 9, Sampler(SamplerConfig()))
    engine, gen = _engine(graphs), Generation(tokens=[])
    stream = engine.stream(prompt, 9, Sampler(SamplerConfig()), gen)
    first = [next(stream) for _ in range(4)]
    stream.close()
    assert first == gen.tokens == whole.tokens[:4]
    # fed: the prompt and every token but the last one drawn (its decode step never ran)
    assert engine.n_past == engine.start_pos == 20 + 3
    assert gen.stats.decode_tokens == 3 and gen.stats.decode_s > 0 and gen.stats.prompt_tokens == 20


def test_rewind_then_continue_is_a_fresh_run(graphs):
    gd = np.load(DATA / "golden-a.npz")
    prompt = gd["prompt_tokens"][:20].tolist()
    engine = _engine(graphs)
    engine.generate(prompt, 6, Sampler(SamplerConfig()))
    engine.rewind(12)
    other = [70, 71, 72, 73]
    gen = Generation(tokens=[])
    tokens = list(engine.stream(other, 5, Sampler(SamplerConfig()), gen, context=prompt[:12]))
    assert tokens == _engine(graphs).generate(prompt[:12] + other, 5, Sampler(SamplerConfig())).tokens
    assert engine.n_past == engine.start_pos == 12 + 4 + 4


def test_rewind_is_refused_once_slots_and_positions_differ(graphs):
    engine = _engine(graphs)
    engine.generate([5, 6, 7, 8], 3, Sampler(SamplerConfig()))
    with pytest.raises(EngineError, match="cannot rewind the KV cache to 9 tokens: it holds 6 of the 6 fed"):
        engine.rewind(9)
    engine.n_past -= 2      # what eviction does: fewer slots than positions
    with pytest.raises(EngineError, match="it holds 4 of the 6 fed"):
        engine.rewind(2)
