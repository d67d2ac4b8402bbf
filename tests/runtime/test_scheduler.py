"""Continuous batching (runtime/scheduler.py) driven by a fake model that reads its KV cache.

The fake model: a pool of rows that hold (token, position); a step does the plan's block copies,
stores every row at its slot, then for each logits row reads the sequence's KV through its block
table (ctx_len entries) and returns a hash of the tokens read. A sequence run alone gets
next = hash(its history), so a batched run matches it token for token only if every row landed
at the right slot, every shared or copied block held the right tokens and no output was lost to
a preemption.
"""
from __future__ import annotations

import hashlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmrs.options import OptionError
from llmrs.runtime.scheduler import (FinishReason, Scheduler, SchedulerConfig, SchedulerError, SeqState, Sequence)

VOCAB = 11


def next_token(history) -> int:
    return int.from_bytes(hashlib.blake2b(np.asarray(history, np.int64).tobytes(), digest_size=8).digest(),
                          "little") % VOCAB


def run_alone(prompt, max_tokens, stop_token_ids=()) -> list[int]:
    history, out = list(prompt), []
    for _ in range(max_tokens):
        out.append(next_token(history))
        history.append(out[-1])
        if out[-1] in stop_token_ids:
            break
    return out


class FakeModel:
    def __init__(self, config: SchedulerConfig):
        rows = config.num_blocks * config.block_size
        self.bs = config.block_size
        self.token = np.full(rows, -1, np.int64)
        self.pos = np.full(rows, -1, np.int64)

    def step(self, plan) -> dict:
        batch = plan.flat()
        for src, dst in plan.copies:
            for a in (self.token, self.pos):
                a[dst * self.bs:(dst + 1) * self.bs] = a[src * self.bs:(src + 1) * self.bs]
        self.token[batch.slots] = batch.tokens
        self.pos[batch.slots] = batch.positions
        sampled = {}
        for r, sid in zip(batch.logit_rows, batch.logit_seq_ids):
            table, n = batch.block_tables[batch.row_seq[r]], batch.ctx_len[r]
            kv = np.arange(n)
            slots = table[kv // self.bs] * self.bs + kv % self.bs
            assert (self.pos[slots] == kv).all(), f"sequence {sid} reads a wrong or unwritten row"
            sampled[sid] = next_token(self.token[slots])
        return sampled


def _arrive(sched: Scheduler, step: int, arrivals: list, aborts: list) -> list:
    """The sequences arriving and aborted at this step; the arrivals still to come."""
    for s in [s for t, s in arrivals if t <= step]:
        sched.add(s)
    for sid in [sid for t, sid in aborts if t == step]:
        sched.abort(sid)
    return [(t, s) for t, s in arrivals if t > step]


def drive(sched: Scheduler, model: FakeModel, arrivals=(), aborts=(), max_steps=5000) -> list:
    """Run steps until every sequence is done; arrivals: (step, Sequence), aborts: (step, seq_id)."""
    arrivals, aborts, plans = list(arrivals), list(aborts), []
    cfg = sched.config
    for step in range(max_steps):
        arrivals = _arrive(sched, step, arrivals, aborts)
        if not sched.has_unfinished() and not arrivals:
            return plans
        plan = sched.schedule()
        assert plan.num_tokens <= cfg.max_batched_tokens
        assert len(plan.seqs) <= cfg.max_num_seqs and sched.num_running <= cfg.max_num_seqs
        assert len({s.seq_id for s in plan.seqs}) == len(plan.seqs)
        if sched.has_unfinished():
            assert plan.num_tokens > 0, f"step {step}: nothing scheduled with work waiting (livelock)"
        sched.update(plan, model.step(plan))
        sched.kv.check()
        plans.append(plan)
    raise AssertionError(f"not finished after {max_steps} steps")


def drive_ahead(sched: Scheduler, model: FakeModel, arrivals=(), aborts=(), max_steps=5000) -> int:
    """drive() as runtime/batch.py steps an async back end: step N + 1 is planned after N is
    committed and before N's tokens are in (its pending rows filled once they are, then run).
    Returns how many steps were planned ahead."""
    arrivals, aborts, cur, ahead = list(arrivals), list(aborts), None, 0
    for step in range(max_steps):
        arrivals = _arrive(sched, step, arrivals, aborts)
        if cur is None:
            if not sched.has_unfinished():
                if not arrivals:
                    return ahead
                continue
            plan = sched.schedule()
            cur = (plan, model.step(plan))
            sched.commit(plan)
        nxt = sched.schedule() if sched.has_unfinished() else None
        if nxt is not None and not nxt.seqs:
            sched.commit(nxt)
            nxt = None
        plan, sampled = cur
        # the batcher's requests: an aborted sequence's token is dropped
        sched.finish(plan, {sid: t for sid, t in sampled.items() if sched.get(sid) is not None})
        sched.kv.check()
        cur = None
        if nxt is not None:
            ahead += 1
            for s in nxt.seqs:
                p0, n = int(s.positions[0]), s.num_tokens
                if s.seq.state is SeqState.RUNNING and not s.seq.pending:
                    s.token_ids[:] = s.seq.tokens(p0, p0 + n)
            cur = (nxt, model.step(nxt))
            sched.commit(nxt)
    raise AssertionError(f"not finished after {max_steps} steps")


def _config(**kw) -> SchedulerConfig:
    base = dict(max_num_seqs=8, max_batched_tokens=32, block_size=4, num_blocks=64)
    return SchedulerConfig(**{**base, **kw})


def _prompt(rng, n) -> list[int]:
    return [int(t) for t in rng.integers(0, VOCAB, n)]


def test_sequence_states_allow_only_their_transitions():
    seq = Sequence(1, [1, 2], 4)
    seq.set_state(SeqState.RUNNING)
    seq.set_state(SeqState.WAITING)            # preempted for recompute
    seq.set_state(SeqState.RUNNING)
    seq.set_state(SeqState.SWAPPED)
    with pytest.raises(SchedulerError, match="swapped -> swapped"):
        seq.set_state(SeqState.SWAPPED)
    seq.set_state(SeqState.FINISHED)
    with pytest.raises(SchedulerError, match="finished -> running"):
        seq.set_state(SeqState.RUNNING)
    with pytest.raises(SchedulerError, match="waiting -> swapped"):
        Sequence(2, [1], 1).set_state(SeqState.SWAPPED)


def test_config_names_the_bad_option():
    with pytest.raises(OptionError, match="^max_batched_tokens must be a whole number of at least 1, got 0$"):
        _config(max_batched_tokens=0)
    with pytest.raises(OptionError, match="num_blocks .* got 2.5"):
        _config(num_blocks=2.5)
    with pytest.raises(OptionError, match="^preemption 'swap' is not supported; use recompute$"):
        _config(preemption="swap")


def test_a_request_that_can_never_fit_the_pool_is_refused_in_one_line():
    sched = Scheduler(_config(num_blocks=10, block_size=4))
    with pytest.raises(ValueError) as e:
        sched.add(Sequence("r", list(range(30)), 11))
    msg = str(e.value)
    assert "\n" not in msg and "41 tokens" in msg and "40 (10 blocks of 4)" in msg
    assert "--num-blocks" in msg and "--block-size" in msg
    sched.add(Sequence("ok", list(range(30)), 10))
    for bad, match in ((Sequence("ok", [1], 1), "already queued"), (Sequence("e", [], 1), "non-empty"),
                       (Sequence("m", [1], 0), "max_tokens"), (Sequence("n", [1, -2], 1), "token ids")):
        with pytest.raises(ValueError, match=match):
            sched.add(bad)


def test_a_long_prompt_is_prefilled_in_chunks_and_only_its_last_row_has_logits():
    rng = np.random.default_rng(1)
    cfg = _config(max_batched_tokens=16)
    sched, model = Scheduler(cfg), FakeModel(cfg)
    prompt = _prompt(rng, 40)
    sched.add(Sequence("a", prompt, 3))
    plans = drive(sched, model)
    assert [p.num_tokens for p in plans] == [16, 16, 8, 1, 1]
    assert [p.seqs[0].phase for p in plans] == ["prefill"] * 3 + ["decode"] * 2
    assert [p.seqs[0].positions[0] for p in plans] == [0, 16, 32, 40, 41]
    assert [p.flat().logit_rows.tolist() for p in plans] == [[], [], [7], [0], [0]]
    seq = plans[0].seqs[0].seq
    assert seq.output == run_alone(prompt, 3) and seq.finish_reason is FinishReason.LENGTH
    assert sched.kv.stats().used == 0


def test_running_decodes_come_before_prompt_chunks_within_the_budget():
    rng = np.random.default_rng(2)
    cfg = _config(max_batched_tokens=10)
    sched, model = Scheduler(cfg), FakeModel(cfg)
    for sid in "ab":
        sched.add(Sequence(sid, _prompt(rng, 4), 20))
    sched.update(p := sched.schedule(), model.step(p))           # both prompts in one step
    sched.add(Sequence("c", _prompt(rng, 30), 2))
    plan = sched.schedule()
    assert [(s.seq_id, s.phase, s.num_tokens) for s in plan.seqs] == [("a", "decode", 1), ("b", "decode", 1),
                                                                      ("c", "prefill", 8)]
    flat = plan.flat()
    assert flat.row_seq.tolist() == [0, 1] + [2] * 8
    assert flat.logit_rows.tolist() == [0, 1] and flat.logit_seq_ids == ["a", "b"]
    assert flat.ctx_len.tolist() == [5, 5] + list(range(1, 9))
    assert flat.positions.tolist() == [4, 4] + list(range(8))
    for b, s in enumerate(plan.seqs):
        table = flat.block_tables[b]
        kv = s.kv_start + np.arange(s.num_tokens)
        assert (table[kv // 4] * 4 + kv % 4 == s.slots).all()
        assert flat.block_tables.shape == (3, 2) and (table[len(s.block_table):] == 0).all()


def test_priority_orders_admission_and_preemption_takes_the_lowest_latest_sequence():
    rng = np.random.default_rng(3)
    cfg = _config(num_blocks=8, block_size=4, max_batched_tokens=64)     # 32 rows: room for 2 of 3
    sched, model = Scheduler(cfg), FakeModel(cfg)
    seqs = {"low": Sequence("low", _prompt(rng, 10), 6, priority=0),
            "mid": Sequence("mid", _prompt(rng, 10), 6, priority=1),
            "late": Sequence("late", _prompt(rng, 10), 6, priority=1)}
    for s in seqs.values():
        sched.add(s)
    plan = sched.schedule()
    assert [s.seq_id for s in plan.seqs] == ["mid", "late", "low"]   # priority, then arrival
    sched.update(plan, model.step(plan))
    preempted = [sid for p in drive(sched, model) for sid in p.preempted]
    assert preempted and preempted[0] == "low" and "mid" not in preempted
    for s in seqs.values():
        assert s.output == run_alone(s.prompt, 6), s.seq_id
    assert seqs["low"].num_preemptions >= 1


def test_a_preempted_sequence_keeps_its_outputs_and_recomputes_them_from_the_cache():
    rng = np.random.default_rng(4)
    cfg = _config(num_blocks=6, block_size=4, max_batched_tokens=64)
    sched, model = Scheduler(cfg), FakeModel(cfg)
    first = Sequence("first", _prompt(rng, 9), 8)
    sched.add(first)
    for _ in range(4):
        sched.update(p := sched.schedule(), model.step(p))
    assert len(first.output) == 4
    sched.add(urgent := Sequence("urgent", _prompt(rng, 13), 4, priority=5))
    plan = sched.schedule()            # urgent's chunk shrinks to the 3 free blocks; first finds none
    assert [(s.seq_id, s.num_tokens) for s in plan.seqs] == [("urgent", 12)] and not plan.preempted
    sched.update(plan, model.step(plan))
    plan = sched.schedule()            # urgent's last prompt token needs a block: first goes
    assert plan.preempted == ["first"] and first.state is SeqState.WAITING and len(first.output) == 4
    sched.update(plan, model.step(plan))
    drive(sched, model)
    assert urgent.output == run_alone(urgent.prompt, 4)
    assert first.output == run_alone(first.prompt, 8)
    assert sched.kv.stats().hit_tokens > 0          # its committed blocks were still cached


def test_stop_token_and_abort_finish_a_sequence_and_free_its_blocks_at_once():
    rng = np.random.default_rng(5)
    cfg = _config()
    sched, model = Scheduler(cfg), FakeModel(cfg)
    prompt = _prompt(rng, 7)
    ref = run_alone(prompt, 50)
    stop = ref[3]
    sched.add(s := Sequence("s", prompt, 50, stop_token_ids=frozenset([stop])))
    sched.add(a := Sequence("a", _prompt(rng, 9), 50))
    plan = sched.schedule()
    assert sched.abort("a") and not sched.abort("a")
    assert a.state is SeqState.FINISHED and a.finish_reason is FinishReason.ABORT
    assert sched.kv.stats().used == 2              # only s's blocks: a's went back at once
    sched.update(plan, model.step(plan))           # a's row ran; update skips it
    drive(sched, model)
    assert s.output == ref[:ref.index(stop) + 1] and s.finish_reason is FinishReason.STOP


def test_update_refuses_a_stale_plan_and_a_missing_sample():
    cfg = _config()
    sched, model = Scheduler(cfg), FakeModel(cfg)
    sched.add(Sequence("x", [1, 2, 3], 2))
    plan = sched.schedule()
    with pytest.raises(SchedulerError, match="before update"):
        sched.schedule()
    with pytest.raises(SchedulerError, match="no logits row"):
        sched.update(plan, {"x": 1, "y": 2})
    plan2 = Scheduler(cfg)
    with pytest.raises(SchedulerError, match="last schedule"):
        plan2.update(plan, {})
    sched2 = Scheduler(cfg)
    sched2.add(Sequence("x", [1, 2, 3], 2))
    p = sched2.schedule()
    with pytest.raises(SchedulerError, match="no sampled token for sequence 'x'"):
        sched2.update(p, {})


def test_a_second_request_with_the_same_400_token_prefix_computes_only_its_tail():
    rng = np.random.default_rng(6)
    cfg = _config(block_size=16, num_blocks=64, max_batched_tokens=128)
    sched, model = Scheduler(cfg), FakeModel(cfg)
    prefix = _prompt(rng, 400)
    one = Sequence("one", prefix + _prompt(rng, 20), 4)
    two = Sequence("two", prefix + [(one.prompt[400] + 1) % VOCAB] + _prompt(rng, 30), 4)
    plans = drive(sched, model, arrivals=[(0, one), (6, two)])
    first_two = next(s for p in plans for s in p.seqs if s.seq_id == "two")
    assert first_two.kv_start >= 384 and first_two.positions[0] == first_two.kv_start == 400
    assert sum(s.num_tokens for p in plans for s in p.seqs if s.seq_id == "two") == len(two.prompt) - 400 + 3
    assert two.output == run_alone(two.prompt, 4) and one.output == run_alone(one.prompt, 4)


def test_identical_prompts_share_the_cache_and_the_whole_cached_prompt_recomputes_one_token():
    rng = np.random.default_rng(7)
    cfg = _config(block_size=4, num_blocks=32)
    sched, model = Scheduler(cfg), FakeModel(cfg)
    prompt = _prompt(rng, 12)                      # 3 full blocks
    seqs = [Sequence(i, prompt, 5) for i in range(3)]
    plans = drive(sched, model, arrivals=[(0, seqs[0]), (4, seqs[1]), (4, seqs[2])])
    later = [s for p in plans for s in p.seqs if s.seq_id in (1, 2) and s.phase == "prefill"]
    assert [(s.kv_start, s.num_tokens) for s in later] == [(11, 1), (11, 1)]
    assert any(p.copies for p in plans)            # the shared last block copied before its rewrite
    for s in seqs:
        assert s.output == run_alone(prompt, 5)


# ---- random traffic: every output equals the sequence run alone ------------------------------

@st.composite
def traffic(draw):
    """Requests from shared stems (prefix hits, whole prompts cached), random priorities, stop
    tokens, arrivals and aborts, on a pool that holds the biggest request and little more."""
    bs = draw(st.sampled_from([1, 2, 4, 8]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    stems = [_prompt(rng, 24) for _ in range(2)]
    prompts = []
    for _ in range(int(rng.integers(2, 11))):
        kind = rng.integers(4)
        if kind == 0:                                      # whole blocks of a stem: a full cache hit later
            prompts.append(stems[rng.integers(2)][:bs * int(rng.integers(1, 24 // bs + 1))])
        elif kind == 1:
            prompts.append(stems[rng.integers(2)][:rng.integers(0, 25)] + _prompt(rng, int(rng.integers(1, 6))))
        elif kind == 2 or not prompts:
            prompts.append(_prompt(rng, int(rng.integers(1, 30))))
        else:
            prompts.append(list(prompts[rng.integers(len(prompts))]))
    reqs = []
    for i, prompt in enumerate(prompts):
        stops = frozenset([int(rng.integers(VOCAB))]) if rng.integers(3) == 0 else frozenset()
        reqs.append((int(rng.integers(0, 12)), Sequence(i, prompt, int(rng.integers(1, 12)),
                                                        priority=int(rng.integers(0, 3)), stop_token_ids=stops)))
    biggest = max(len(s.prompt) + s.max_tokens for _, s in reqs)
    num_blocks = -(-biggest // bs) + draw(st.integers(0, 4))
    aborts = [(int(rng.integers(0, 20)), int(rng.integers(len(reqs)))) for _ in range(rng.integers(0, 3))]
    cfg = SchedulerConfig(max_num_seqs=int(rng.integers(1, 6)), max_batched_tokens=int(rng.integers(1, 25)),
                          block_size=bs, num_blocks=num_blocks, enable_prefix_cache=draw(st.booleans()))
    return cfg, reqs, aborts


@settings(max_examples=300, deadline=None)
@given(traffic())
def test_random_traffic_matches_each_sequence_run_alone_and_leaks_no_block(case):
    cfg, reqs, aborts = case
    sched, model = Scheduler(cfg), FakeModel(cfg)
    drive(sched, model, arrivals=reqs, aborts=aborts)
    for _, s in reqs:
        ref = run_alone(s.prompt, s.max_tokens, s.stop_token_ids)
        assert s.state is SeqState.FINISHED
        if s.finish_reason is FinishReason.ABORT:
            assert s.output == ref[:len(s.output)]
        else:
            assert s.output == ref, f"sequence {s.seq_id}"
            assert s.finish_reason is (FinishReason.STOP if ref[-1] in s.stop_token_ids else FinishReason.LENGTH)
    stats = sched.kv.stats()
    assert stats.used == 0 and stats.free + stats.cached == cfg.num_blocks
    sched.kv.check()


@given(traffic())
def test_steps_planned_before_the_last_ones_tokens_are_in_give_each_sequence_its_tokens_alone(case):
    """Planning ahead (commit, schedule, then finish): pending tokens' rows filled before they
    run, a sequence that a stop token or its length ends gets no row it needs, preemption of a
    sequence whose token is on its way keeps that token, and no block leaks."""
    cfg, reqs, aborts = case
    sched, model = Scheduler(cfg), FakeModel(cfg)
    drive_ahead(sched, model, arrivals=reqs, aborts=aborts)
    for _, s in reqs:
        ref = run_alone(s.prompt, s.max_tokens, s.stop_token_ids)
        assert s.state is SeqState.FINISHED and s.pending == 0
        if s.finish_reason is FinishReason.ABORT:
            assert s.output == ref[:len(s.output)]
        else:
            assert s.output == ref, f"sequence {s.seq_id}"
    stats = sched.kv.stats()
    assert stats.used == 0 and stats.free + stats.cached == cfg.num_blocks
    sched.kv.check()


def test_a_step_planned_ahead_has_the_pending_tokens_row_and_leaves_out_a_sequence_its_length_ends():
    cfg = _config()
    sched, model = Scheduler(cfg), FakeModel(cfg)
    sched.add(Sequence("a", [1, 2, 3], 2))
    sched.add(Sequence("b", [4, 5], 5))
    first = sched.schedule()
    sampled = model.step(first)
    sched.commit(first)
    ahead = sched.schedule()                     # both first tokens pending
    assert [(s.seq_id, s.phase, s.token_ids.tolist()) for s in ahead.seqs] == [("a", "decode", [0]),
                                                                                ("b", "decode", [0])]
    with pytest.raises(SchedulerError, match="oldest committed plan"):
        sched.commit(ahead)
        sched.finish(ahead, {})
    sched.finish(first, sampled)
    assert sched.get("a").output == [sampled["a"]] and sched.get("a").pending == 1   # ahead's row
    sched.finish(ahead, model.step(ahead))
    assert sched.get("a") is None                # two tokens: its length
    third = sched.schedule()
    assert [s.seq_id for s in third.seqs] == ["b"]
    sched.commit(third)
    fourth = sched.schedule()                    # b's third token pending: b goes on
    assert [s.seq_id for s in fourth.seqs] == ["b"]


def test_the_default_token_budget_is_the_back_ends_prefill_feed_where_that_is_fewer_than_the_graphs_rows():
    from llmrs.runtime.batch import BatchOptions, scheduler_config
    from llmrs.runtime.plan import StepShape
    shape = StepShape(rows=512, seqs=8, block_size=16, blocks_per_seq=8, n_blocks=64, vocab=100)
    assert scheduler_config(shape, BatchOptions(), 128).max_batched_tokens == 128     # the CPU
    assert scheduler_config(shape, BatchOptions(), None).max_batched_tokens == 512    # OpenCL
    assert scheduler_config(shape, BatchOptions(max_batched_tokens=300), 128).max_batched_tokens == 300
    with pytest.raises(OptionError, match="more than the plan's --prefill-chunk allows"):
        scheduler_config(shape, BatchOptions(max_batched_tokens=600), 128)
