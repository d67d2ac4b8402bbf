"""Fixtures of the runtime tests."""
from __future__ import annotations

from pathlib import Path

import pytest

from .measure_plans import tiny_plan


@pytest.fixture(scope="session")
def measure_plan(tmp_path_factory) -> Path:
    """golden-a with CPU and OpenCL code, for llmrs-bench, --profile and the arena picture."""
    return tiny_plan(tmp_path_factory.mktemp("measure"), "--target", "cpu,opencl")
