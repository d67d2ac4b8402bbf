"""Damaged plans, generated: every truncation, byte flip, garbage file or absurd manifest is a
PlanError, never another exception and never a plan that loads with different bytes."""
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmrs.compiler.plan import MAGIC
from llmrs.runtime.plan import Plan, PlanError

from .test_plan_reader import make_plan, restamp, with_manifest

FUZZ = settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """(scratch file path, the good plan's bytes, its tensors' bytes)."""
    with pytest.MonkeyPatch.context() as mp:
        d = tmp_path_factory.mktemp("fuzz")
        mp.setenv("LLMRS_CACHE_DIR", str(d / "cache"))
        raw = make_plan(d / "good.bin").read_bytes()
        plan = Plan.open(d / "good.bin", verify="always")
        tensors = {n: plan.weight(n).tobytes() for n in plan.tensors}
        yield d / "scratch.bin", raw, tensors


def _refused(path, data: bytes, verify: str = "always") -> None:
    path.write_bytes(data)
    with pytest.raises(PlanError) as e:
        Plan.open(path, verify=verify).check_weights()   # damaged weights: refused at first use
    assert str(e.value).startswith(str(path)) and "\n" not in str(e.value)


def _refused_or_same(path, data: bytes, tensors: dict[str, bytes]) -> None:
    """A plan that still opens must hold exactly the original tensors."""
    path.write_bytes(data)
    try:
        plan = Plan.open(path, verify="always")
    except PlanError as e:
        assert str(e).startswith(str(path)) and "\n" not in str(e)
        return
    assert {n: plan.weight(n).tobytes() for n in plan.tensors} == tensors
    plan.graphs()


@FUZZ
@given(st.data())
def test_any_truncation_is_refused(good, data):
    path, raw, _ = good
    _refused(path, raw[:data.draw(st.integers(0, len(raw) - 1))])


@FUZZ
@given(st.data())
def test_any_byte_flip_is_refused(good, data):
    path, raw, _ = good
    body = bytearray(raw)
    for at in data.draw(st.sets(st.integers(0, len(raw) - 1), min_size=1, max_size=3)):
        body[at] ^= data.draw(st.integers(1, 255))
    _refused(path, bytes(body))


@FUZZ
@given(st.binary(max_size=3000), st.booleans())
def test_garbage_files_are_refused(good, junk, with_magic):
    path, _, _ = good
    _refused(path, (MAGIC + junk) if with_magic else junk, verify="auto")


_NAMES = st.sampled_from(["model.norm.weight", "model.embed_tokens.weight", "model.layers.1.mlp.up_proj.weight"])
_ABSURD = st.one_of(st.integers(-(1 << 70), 1 << 70), st.integers(-64, 1 << 20), st.floats(), st.text(max_size=5),
                    st.none(), st.booleans(), st.lists(st.integers(-(1 << 40), 1 << 40), max_size=4))


@FUZZ
@given(st.data())
def test_absurd_manifest_entries_are_refused(good, data):
    path, raw, tensors = good
    table = data.draw(st.sampled_from(["tensors", "sections"]))
    if table == "tensors":
        name = data.draw(_NAMES)
        field = data.draw(st.sampled_from(["dtype", "shape", "offset", "nbytes"]))
    else:
        name = data.draw(st.sampled_from(["opencl", "tokenizer.json", "weights"]))
        field = data.draw(st.sampled_from(["offset", "size", "crc32"]))
    value = data.draw(_ABSURD)

    def change(m):
        m[table][name][field] = value

    _refused_or_same(path, with_manifest(raw, change), tensors)


_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                     lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4),
                     max_leaves=20)


@FUZZ
@given(_JSON, st.sampled_from(["whole", "sections", "tensors", "graphs", "prefill"]))
def test_random_json_in_the_manifest_is_refused(good, value, where):
    path, raw, tensors = good

    def change(m):
        if where == "whole":
            m.clear()
            m["x"] = value
        elif where == "prefill":
            m["graphs"]["prefill"] = value
        else:
            m[where] = value

    _refused_or_same(path, with_manifest(raw, change), tensors)


def test_fuzz_helpers_leave_a_good_plan_good(good):
    path, raw, tensors = good
    path.write_bytes(with_manifest(raw, lambda m: None))
    assert {n: Plan.open(path, verify="always").weight(n).tobytes() for n in tensors} == tensors
    assert restamp(raw) == raw
