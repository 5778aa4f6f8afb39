"""Shared fixtures: one real Spark session (local[*]) for every test that needs Spark (it takes ~10 s to start).

tests/unit/ is pure logic in-process (no MPI job, no Spark, under a minute: `pytest tests/unit` or `-m unit`);
tests/cluster/ runs the real cluster under mpirun, Spark, ZeroMQ sockets and namespace hosts (`-m cluster`);
tests/mpi/ runs inside an MPI job (pytest-mpi; `make test` starts it first).

`make test` runs the suite on two pytest-xdist workers (most tests wait on clusters of processes, so two at a
time fill the machine's cores); the tests that use Spark go to two groups (`--dist loadgroup`): the audits'
and the others', each on one worker, so two JVMs serve them all.
"""

from __future__ import annotations

import pytest


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own, which reads the groups (else it sees none)
def pytest_collection_modifyitems(items):
    for item in items:
        room = item.path.parent.name
        if room in ("unit", "cluster"):
            item.add_marker(getattr(pytest.mark, room))
        if "spark" in getattr(item, "fixturenames", ()):  # the audits' Spark tests apart: two JVMs share the load
            group = "spark-audit" if item.path.name.startswith("test_audit") else "spark"
            item.add_marker(pytest.mark.xdist_group(group))


@pytest.fixture(scope="session")
def spark():
    from control.spark import session

    s = session(app="streamjoin-tests")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def broker(tmp_path_factory):
    """A Kafka-protocol broker for a test module (tests/kafka.py), its bootstrap address: one per module, since
    noida-db rewrites its one data file every second, a cost that grows with every record a test leaves."""
    from tests.kafka import start_broker

    yield from start_broker(tmp_path_factory)
