"""A step of a plan's "step" graph (compiler/ir.py "Step graphs") on OpenCL: its rows checked
against the graph, then written into the arena as the graph's inputs.

The kernels read every index as given (an attention row follows its block table into the cache;
only kv_store drops a slot outside the cache), so each one is checked here first, and a bad one
is refused in one line naming the field, the row and the bound. Nothing here is OpenCL's own:
another back end can check its steps with the same function.
"""
from __future__ import annotations

import numpy as np

from ...compiler.ir import Graph, IRError
from ..plan import StepShape
from .base import StepRows, step_score_from

# int32 [n] each, beside tokens [n]; score_from None is NEVER for every row (base.py)
ROW_FIELDS = ("positions", "slots", "row_seq", "ctx_len", "score_from")


def _ints(name: str, a: np.ndarray, ndim: int) -> np.ndarray:
    a = np.asarray(a)
    if a.ndim != ndim or (a.size and not np.issubdtype(a.dtype, np.integer)):
        raise IRError(f"step: {name} must be a {ndim}-D array of integers, got {a.dtype}{list(a.shape)}")
    i32 = np.iinfo(np.int32)
    _within(name, a.reshape(-1), i32.min, i32.max, "the kernels' int32")   # before the cast can wrap
    return np.ascontiguousarray(a, dtype=np.int32)


def _within(name: str, a: np.ndarray, lo: int, hi: int, what: str) -> None:
    """Every a[i] in lo..hi, else one line naming the first that is not."""
    bad = np.flatnonzero((a < lo) | (a > hi))
    if bad.size:
        i = int(bad[0])
        raise IRError(f"step: {name}[{i}] = {int(a[i])} is outside {lo}..{hi} ({what})")


def check_step(rows: StepRows, shape: StepShape) -> dict[str, np.ndarray]:
    """The step's inputs as the graph holds them: int32, block_tables [b, M] (columns past the
    given ones 0), logit_rows padded with 0 to B. Raises IRError on the first bad value."""
    tokens = _ints("tokens", rows.tokens, 1)
    n = len(tokens)
    if not 1 <= n <= shape.rows:
        raise IRError(f"step: the step graph takes 1..{shape.rows} rows a step, got {n}")
    out = {"tokens": tokens}
    for name in ROW_FIELDS:
        given = getattr(rows, name)
        out[name] = _ints(name, step_score_from(None, n) if given is None and name == "score_from" else given, 1)
        if len(out[name]) != n:
            raise IRError(f"step: {name} has {len(out[name])} rows and tokens {n}; give one a row")
    given = _ints("block_tables", rows.block_tables, 2)
    b, m = given.shape
    if not 1 <= b <= shape.seqs or m > shape.blocks_per_seq:
        raise IRError(f"step: block_tables is [{b}, {m}]; the step graph takes 1..{shape.seqs} sequences "
                      f"of at most {shape.blocks_per_seq} blocks")
    picked = _ints("logit_rows", rows.logit_rows, 1)
    if not 1 <= len(picked) <= min(shape.logits, n):
        raise IRError(f"step: logit_rows has {len(picked)} rows; give 1..{min(shape.logits, n)} "
                      f"(the step graph's logit rows, and no more than the step's {n} rows)")
    _within("tokens", tokens, 0, shape.vocab - 1, "the vocabulary")
    _within("positions", out["positions"], 0, np.iinfo(np.int32).max, "positions count from 0")
    _within("slots", out["slots"], 0, shape.slots - 1, "the KV cache's rows")
    if n > 1 and len(np.unique(out["slots"])) != n:    # two writers of one row race on a device
        raise IRError("step: two rows write the same KV slot; give each row its own slot")
    _within("row_seq", out["row_seq"], 0, b - 1, f"the {b} rows of block_tables")
    _within("ctx_len", out["ctx_len"], 1, m * shape.block_size, f"{m} blocks of {shape.block_size}")
    _within("logit_rows", picked, 0, n - 1, "the step's rows")
    # the table entries a row reads: blocks 0 .. (ctx_len - 1) // block_size of its sequence
    used = np.arange(m)[None, :] <= ((out["ctx_len"] - 1) // shape.block_size)[:, None]
    entries = given[out["row_seq"]]
    bad = np.argwhere(used & ((entries < 0) | (entries >= shape.slots // shape.block_size)))
    if bad.size:
        t, j = (int(x) for x in bad[0])
        raise IRError(f"step: block_tables[{int(out['row_seq'][t])}, {j}] = {int(entries[t, j])}, read by row {t}, "
                      f"is outside 0..{shape.slots // shape.block_size - 1} (the cache's blocks)")
    tables = np.zeros((b, shape.blocks_per_seq), np.int32)
    tables[:, :m] = given
    out["block_tables"] = tables
    out["logit_rows"] = np.zeros(shape.logits, np.int32)
    out["logit_rows"][:len(picked)] = picked
    if rows.generated is not None:
        generated = np.asarray(rows.generated)
        generated = _ints("generated", generated.astype(np.int32) if generated.dtype == bool else generated, 1)
        if len(generated) != n:
            raise IRError(f"step: generated has {len(generated)} rows and tokens {n}; give one a row")
        _within("generated", generated, 0, 1, "1: a sampled token, 0: the prompt's")
        out["generated"] = generated
    return out


def split_rows(inputs: dict[str, np.ndarray], n_picked: int) -> int:
    """Reorder a checked step's rows so its prompt rows come first and its generated rows after
    them, each kind in step order (matmul_common.cl ROW_SPLIT); logit_rows follow their rows, so
    the logits still come back in the order asked. Returns the split: the number of prompt rows."""
    generated = inputs.pop("generated", None)
    n = len(inputs["tokens"])
    if generated is None or not generated.any():
        return n
    order = np.argsort(generated, kind="stable")
    for name in ("tokens", *ROW_FIELDS):
        inputs[name] = np.ascontiguousarray(inputs[name][order])
    where = np.empty(n, np.int32)
    where[order] = np.arange(n, dtype=np.int32)
    inputs["logit_rows"][:n_picked] = where[inputs["logit_rows"][:n_picked]]
    return n - int(generated.sum())


__all__ = ["ROW_FIELDS", "StepShape", "check_step", "split_rows"]
