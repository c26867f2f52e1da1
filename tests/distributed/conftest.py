"""The ``processes`` fixture: real processes, killed whatever the test's outcome."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from jax_processes import Processes  # noqa: E402


@pytest.fixture
def processes(tmp_path):
    procs = Processes(tmp_path)
    try:
        yield procs
    finally:
        procs.kill_all()
