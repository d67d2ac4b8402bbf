"""A step of a plan's "step" graph (compiler/ir.py "Step graphs") on OpenCL: its rows checked
against the graph (base.py check_step_rows, every back end's one check), then laid out as the
graph's inputs for the arena: int32 arrays, logit_rows padded to the graph's logit rows, and the
rows in the order of the row split (split_rows).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..plan import StepShape
from .base import StepRows, check_step_rows

# int32 [n] each, beside tokens [n]; score_from None is NEVER for every row (base.py)
ROW_FIELDS = ("positions", "slots", "row_seq", "ctx_len", "score_from")


def check_step(rows: StepRows, shape: StepShape) -> dict[str, np.ndarray]:
    """The step's inputs as the graph holds them: int32, block_tables [b, M] (columns past the
    given ones 0), logit_rows padded with 0 to the graph's logit rows, and "generated" where the
    rows say (not an input: split_rows takes it). Raises StepRowsError on the first bad value."""
    checked = check_step_rows(rows, shape)
    out = {"tokens": checked.tokens, **{name: getattr(checked, name) for name in ROW_FIELDS},
           "block_tables": checked.block_tables}
    out["logit_rows"] = np.zeros(shape.logits, np.int32)
    out["logit_rows"][:len(checked.logit_rows)] = checked.logit_rows
    if checked.generated is not None:
        out["generated"] = checked.generated
    return out


def split_rows(inputs: dict[str, np.ndarray], n_picked: int) -> tuple[int, np.ndarray | None]:
    """Reorder a checked step's rows so its prompt rows come first and its generated rows after
    them, each kind in step order (matmul_common.cl ROW_SPLIT); logit_rows follow their rows, so
    the logits still come back in the order asked. Returns the split (the number of prompt rows)
    and the order (arena row i is the step's row order[i]; None: the step's own order)."""
    generated = inputs.pop("generated", None)
    n = len(inputs["tokens"])
    if generated is None or not generated.any():
        return n, None
    order = np.argsort(generated, kind="stable")
    for name in ("tokens", *ROW_FIELDS):
        inputs[name] = np.ascontiguousarray(inputs[name][order])
    where = np.empty(n, np.int32)
    where[order] = np.arange(n, dtype=np.int32)
    inputs["logit_rows"][:n_picked] = where[inputs["logit_rows"][:n_picked]]
    return n - int(generated.sum()), order


@dataclass
class PreparedStep:
    """A step as OpenCLBackend.launch_step takes it: all the host does before the launch, done."""
    key: tuple                          # its launch list's key (recorded lists, CUDA graphs)
    launches: list                      # (kernel, global size, local size)
    picked: int                         # logit rows
    read: str                           # what collect_step reads: argmax | logits | logits argmax
    head: np.ndarray                    # the step buffer's int32 [4]
    copies: list[tuple[Any, int, np.ndarray]]   # (buffer, byte offset, bytes) of its inputs
    tokens_at: tuple[np.ndarray, int]   # the bytes holding the token ids, and their offset there
    order: np.ndarray | None            # arena row i is the step's row order[i] (split_rows)


# (buffer, byte offset, bytes, [(input name, its offset in the run)]): inputs written as one copy
InputRun = tuple[Any, int, int, list[tuple[str, int]]]


def input_runs(places: list[tuple[str, Any, int, int]], align: int) -> list[InputRun]:
    """(name, buffer, offset, bytes) of each input merged into runs of values that lie end to end
    in one buffer, in offset order. Every value starts on an `align`-byte boundary, so the padding
    between one value's end and the next boundary belongs to no value and a run may cover it;
    any wider gap (it may hold a live value) or another buffer starts a new run."""
    runs: list[InputRun] = []
    for name, buf, off, nbytes in sorted(places, key=lambda p: (id(p[1]), p[2])):
        last = runs[-1] if runs else None
        if last is not None and last[0] is buf and -(-(last[1] + last[2]) // align) * align == off:
            runs[-1] = (buf, last[1], off + nbytes - last[1], last[3] + [(name, off - last[1])])
        else:
            runs.append((buf, off, nbytes, [(name, 0)]))
    return runs


__all__ = ["ROW_FIELDS", "InputRun", "PreparedStep", "StepShape", "check_step", "input_runs", "split_rows"]
