"""Shared fixtures: one real Spark session (local[*]) for every test that needs Spark (it takes ~10 s to start).

`make test` runs the suite on two pytest-xdist workers (most tests wait on clusters of processes, so two at a
time fill the machine's cores); every test that uses Spark goes to the same worker (`--dist loadgroup`), so
one JVM serves them all.
"""
from __future__ import annotations

import pytest


def pytest_collection_modifyitems(items):
    for item in items:
        if "spark" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group("spark"))


@pytest.fixture(scope="session")
def spark():
    from control.spark import session

    s = session(app="streamjoin-tests")
    yield s
    s.stop()
