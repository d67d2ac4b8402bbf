"""The back-end contract: what the engine, the model, the CLIs and the KV manager may ask of any
back end (cpu, opencl, reference, hybrid). Every back end implements all of it; callers never
probe for a method, and no back end reads another's private state.

A back end holds one plan's graphs ("prefill", "decode") bound to its memory and keeps the KV
cache between steps. Positions belong to the caller (runtime/engine.py): `n_past` is the cache
slots in use, `start_pos` the RoPE position of the step's first token.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from ...compiler.ir import Graph
    from ..kv.manager import KVStore


@dataclass(frozen=True)
class StepRows:
    """One step of the plan's "step" graph (compiler/ir.py "Step graphs"): n rows, each a token
    of some sequence, all int32. The scheduler (runtime/scheduler.py) fills it."""
    tokens: np.ndarray          # [n]
    positions: np.ndarray       # [n] RoPE position of each row
    slots: np.ndarray           # [n] the KV-cache row each writes
    row_seq: np.ndarray         # [n] its sequence's row of block_tables
    ctx_len: np.ndarray         # [n] KV entries each attends (its own included)
    block_tables: np.ndarray    # [b, M] physical blocks of each sequence (b <= the graph's B)
    logit_rows: np.ndarray      # [r] rows whose logits come back (r <= B)


class Backend(ABC):
    name: str                    # what --stats prints ("cpu", "opencl", "reference", "hybrid (...)")
    device_name: str             # the OpenCL device's name; "" where everything runs on the host
    graphs: dict[str, Graph]     # the plan's graphs by phase
    device_argmax: bool          # run_argmax reads back a token per row, not the logits: greedy callers prefer it

    @abstractmethod
    def run(self, phase: str, tokens: np.ndarray, n_past: int, start_pos: int) -> np.ndarray:
        """One step of `phase` ("prefill" | "decode") on `tokens` (int32 [n]); f32 [rows, vocab]."""

    @abstractmethod
    def run_argmax(self, phase: str, tokens: np.ndarray, n_past: int, start_pos: int) -> np.ndarray:
        """The same step; int32 [rows], each row's argmax (the first of equal maxima, as numpy)."""

    @abstractmethod
    def reset(self) -> None:
        """Forget the KV cache (zeroed; eviction scores off)."""

    @abstractmethod
    def kv_store(self) -> KVStore:
        """The KV caches as eviction sees them (runtime/kv/manager.py's KVStore)."""

    @abstractmethod
    def report_lines(self) -> list[str]:
        """Lines --stats adds after the engine's (hybrid: its switches); none for most back ends."""

    @abstractmethod
    def close(self) -> None:
        """Release threads and device resources; calling it again does nothing."""


__all__ = ["Backend"]
