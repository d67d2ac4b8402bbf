"""A naive driver of a plan's step graph for tests: sequences take KV blocks from a shuffled free
list, and each step's rows are (sequence, token) pairs, each the sequence's next position."""
from __future__ import annotations

import numpy as np

from llmrs.runtime.backends.base import StepRows
from llmrs.runtime.plan import StepShape


class Blocks:
    def __init__(self, shape: StepShape, rng: np.random.Generator):
        self.shape = shape
        self.free = [int(b) for b in rng.permutation(shape.n_blocks)]
        self.tables: dict[int, list[int]] = {}
        self.length: dict[int, int] = {}

    def slot(self, seq: int, pos: int) -> int:
        bs = self.shape.block_size
        table = self.tables.setdefault(seq, [])
        while len(table) <= pos // bs:
            table.append(self.free.pop())
        return table[pos // bs] * bs + pos % bs

    def rows(self, rows: list[tuple[int, int]], want: list[int]) -> StepRows:
        """The step of `rows` ((sequence, token) in step order); logits of the rows in `want`.
        Sequences take block-table rows in the order they first appear."""
        seqs = list(dict.fromkeys(s for s, _ in rows))
        pos, slots, ctx = [], [], []
        for seq, _ in rows:
            p = self.length.get(seq, 0)
            self.length[seq] = p + 1
            pos.append(p)
            slots.append(self.slot(seq, p))
            ctx.append(p + 1)
        tables = np.zeros((len(seqs), self.shape.blocks_per_seq), np.int32)
        for i, s in enumerate(seqs):
            tables[i, :len(self.tables[s])] = self.tables[s]
        return StepRows(np.array([t for _, t in rows], np.int32), np.array(pos, np.int32),
                        np.array(slots, np.int32), np.array([seqs.index(s) for s, _ in rows], np.int32),
                        np.array(ctx, np.int32), tables, np.array(want, np.int32))
