"""The numpy interpreter as a backend: slow, exact, for debugging numerics (`--backend reference`)."""
from __future__ import annotations

import numpy as np

from ...compiler.interpret import Interpreter
from ...compiler.ir import Graph
from ..plan import STEP, STEP_INPUTS, StepShape
from .base import Backend, StepRows, check_step_rows


class ReferenceBackend(Backend):
    name = "reference"
    device_name = ""
    device_argmax = False      # run_argmax is the argmax of run's logits

    def __init__(self, graphs: dict[str, Graph]):
        self.graphs = graphs
        self.interpreters = {phase: Interpreter(g) for phase, g in graphs.items()}
        self.state = self.interpreters["decode"].new_state()  # both phases share the KV caches

    def run(self, phase: str, tokens: np.ndarray, n_past: int, start_pos: int) -> np.ndarray:
        it = self.interpreters[phase]
        out = it.run({"tokens": tokens}, self.state, n_past=n_past, start_pos=start_pos)
        return np.asarray(out[it.graph.outputs[0]], dtype=np.float32)

    def run_step(self, rows: StepRows) -> np.ndarray:
        it = self.interpreters.get(STEP)
        if it is None:
            raise ValueError("the plan has no step graph (compiled with max_num_seqs 0, or by an older llmrs); "
                             "recompile it to run many sequences")
        rows = check_step_rows(rows, StepShape.of(it.graph))
        out = it.run({name: getattr(rows, name) for name in STEP_INPUTS}, self.state, n_past=0)
        return np.asarray(out[it.graph.outputs[0]], dtype=np.float32)

    def run_argmax(self, phase: str, tokens: np.ndarray, n_past: int, start_pos: int) -> np.ndarray:
        return np.argmax(self.run(phase, tokens, n_past, start_pos), axis=-1).astype(np.int32)

    def reset(self) -> None:
        for arr in self.state.values():
            arr[...] = 0

    def kv_store(self):
        """The caches for eviction (runtime/kv): the interpreter's state arrays themselves."""
        from ..kv.store import HostKV
        return HostKV(self.interpreters["decode"].graph, self.state)

    def report_lines(self) -> list[str]:
        return []

    def close(self) -> None:
        pass    # nothing held but numpy arrays
