"""Shared fixtures: one real Spark session (local[*]) for every test that needs Spark (it takes ~10 s to start)."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def spark():
    from control.spark import session

    s = session(app="streamjoin-tests")
    yield s
    s.stop()
