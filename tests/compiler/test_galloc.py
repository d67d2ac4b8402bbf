"""Galloc on plain intervals: the greedy-by-size planner against its oracle and the naive plan."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmrs.compiler.galloc import (Interval, PlanError, arena_bytes, inplace_groups, lower_bound,
                                   naive_bytes, plan_greedy_by_size, plan_naive, verify_storage_reuse)


@st.composite
def interval_sets(draw, max_size=40):
    n = draw(st.integers(1, max_size))
    ivs = []
    for k in range(n):
        start = draw(st.integers(0, 30))
        ivs.append(Interval(f"t{k}", draw(st.integers(1, 5000)), start, start + draw(st.integers(0, 10))))
    return ivs


@st.composite
def interval_sets_with_inplace(draw):
    ivs = draw(interval_sets())
    names = [iv.name for iv in ivs]
    pairs = dict(draw(st.lists(st.tuples(st.sampled_from(names), st.sampled_from(names)), max_size=20)))
    by = {iv.name: iv for iv in ivs}
    for out, src in pairs.items():  # most candidates start where their input dies, as in a graph
        if draw(st.booleans()) or draw(st.booleans()):
            o, i = by[out], by[src]
            by[out] = Interval(out, o.size, i.end, i.end + (o.end - o.start))
    return list(by.values()), pairs


@settings(max_examples=300, deadline=None)
@given(interval_sets(), st.sampled_from([16, 64, 256]))
def test_greedy_plan_passes_the_oracle_and_sits_between_lower_bound_and_naive(ivs, alignment):
    offsets = plan_greedy_by_size(ivs, alignment)
    size = arena_bytes(ivs, offsets, alignment)
    verify_storage_reuse(ivs, offsets, size, alignment)
    assert all(off % alignment == 0 and off + iv.size <= size for iv in ivs for off in [offsets[iv.name]])
    assert lower_bound(ivs) <= size <= naive_bytes(ivs, alignment)


@settings(max_examples=300, deadline=None)
@given(interval_sets_with_inplace())
def test_inplace_plan_passes_the_oracle_with_only_honoured_reuses(case):
    ivs, cands = case
    offsets = plan_greedy_by_size(ivs, 64, cands)
    grouped = inplace_groups(ivs, cands)
    size = arena_bytes(ivs, offsets)
    verify_storage_reuse(ivs, offsets, size, 64, grouped.reuses)
    by = {iv.name: iv for iv in ivs}
    for out, src in grouped.reuses.items():
        assert offsets[out] == offsets[src]
        assert by[src].end == by[out].start and by[out].size <= by[src].size
    assert len(set(grouped.reuses.values())) == len(grouped.reuses)  # an input is taken once
    assert lower_bound(grouped.groups) <= size <= naive_bytes(ivs)


@settings(max_examples=200, deadline=None)
@given(interval_sets())
def test_naive_plan_passes_the_oracle_and_is_never_smaller(ivs):
    offsets = plan_naive(ivs)
    size = arena_bytes(ivs, offsets)
    verify_storage_reuse(ivs, offsets, size)
    assert size == naive_bytes(ivs) >= arena_bytes(ivs, plan_greedy_by_size(ivs))


def test_chain_of_short_lived_tensors_needs_two_slots_not_ten():
    ivs = [Interval(f"t{k}", 1000, k, k + 1) for k in range(10)]
    offsets = plan_greedy_by_size(ivs)
    assert arena_bytes(ivs, offsets) == 2 * 1024
    assert naive_bytes(ivs) == 10 * 1024
    assert lower_bound(ivs) == 2000


def test_best_fit_takes_the_smallest_gap_that_holds_the_tensor():
    # largest first: a dies early under wall1, b dies early between wall1 and wall2
    ivs = [Interval("a", 8192, 0, 2), Interval("wall1", 4096, 0, 9), Interval("b", 2048, 0, 2),
           Interval("wall2", 1600, 0, 9), Interval("late", 1500, 5, 9)]
    offsets = plan_greedy_by_size(ivs)
    assert [offsets[n] for n in ("a", "wall1", "b", "wall2")] == [0, 8192, 12288, 14336]
    assert offsets["late"] == 12288  # b's 2048-byte hole, not a's 8192-byte one
    assert arena_bytes(ivs, offsets) == 14336 + 1600


def test_elementwise_chain_runs_in_one_slot():
    ivs = [Interval("x", 4096, 0, 1), Interval("y", 4096, 1, 2), Interval("z", 4096, 2, 3)]
    offsets = plan_greedy_by_size(ivs, inplace={"y": "x", "z": "y"})
    assert offsets == {"x": 0, "y": 0, "z": 0}
    verify_storage_reuse(ivs, offsets, 4096, inplace={"y": "x", "z": "y"})
    assert arena_bytes(ivs, plan_greedy_by_size(ivs)) == 8192  # without reuse: two slots


def test_inplace_is_refused_when_the_input_outlives_the_op_or_is_smaller():
    ivs = [Interval("x", 4096, 0, 2), Interval("y", 4096, 1, 3),
           Interval("a", 1024, 0, 1), Interval("b", 2048, 1, 3)]
    grouped = inplace_groups(ivs, {"y": "x", "b": "a"})
    assert grouped.reuses == {}
    assert len(grouped.groups) == 4


def test_oracle_refuses_tensors_sharing_bytes_while_both_live():
    ivs = [Interval("a", 256, 0, 3), Interval("b", 256, 3, 5)]
    with pytest.raises(PlanError, match="'a'.*'b'.*overlap in lifetime and storage"):
        verify_storage_reuse(ivs, {"a": 0, "b": 128}, 512)
    with pytest.raises(PlanError, match="overlap"):  # same offset but not declared in place
        verify_storage_reuse(ivs, {"a": 0, "b": 0}, 512)
    verify_storage_reuse(ivs, {"a": 0, "b": 0}, 512, inplace={"b": "a"})
    verify_storage_reuse(ivs, {"a": 0, "b": 256}, 512)


def test_oracle_refuses_misaligned_missing_and_out_of_arena_tensors():
    ivs = [Interval("a", 100, 0, 1)]
    with pytest.raises(PlanError, match="'a' at offset 32 is not 64-byte aligned"):
        verify_storage_reuse(ivs, {"a": 32}, 256)
    with pytest.raises(PlanError, match="outside the 128-byte arena"):
        verify_storage_reuse(ivs, {"a": 64}, 128)
    with pytest.raises(PlanError, match="'a' has no arena offset"):
        verify_storage_reuse(ivs, {}, 128)


def test_lower_bound_is_the_most_bytes_live_at_one_step():
    ivs = [Interval("a", 10, 0, 2), Interval("b", 20, 2, 4), Interval("c", 40, 3, 3), Interval("d", 5, 5, 6)]
    assert lower_bound(ivs) == 60  # step 3: b + c
    assert lower_bound([]) == 0
