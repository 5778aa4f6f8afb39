"""Fixtures shared by test modules: one embedded Spark session for the whole test run (it costs ~10 s to start)."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def spark():
    from control.checkpoints import spark_session
    session = spark_session("local[2]")
    yield session
    session.stop()
