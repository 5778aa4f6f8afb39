"""Shared fixtures: one real Spark session (local[*]) for every test that needs Spark (it takes ~10 s to start).

tests/unit/ is pure logic in-process (no MPI job, no Spark, under a minute: `pytest tests/unit` or `-m unit`);
tests/cluster/ runs the real cluster under mpirun, Spark, ZeroMQ sockets and namespace hosts (`-m cluster`);
tests/mpi/ runs inside an MPI job (pytest-mpi; `make test` starts it first).

`make test` runs the suite on two pytest-xdist workers (most tests wait on clusters of processes, so two at a
time fill the machine's cores) that steal work from each other (`--dist worksteal`): each worker starts one JVM
for the Spark tests it runs, so at most two serve them all, and no worker waits on a group of Spark tests kept
for the other.
"""

from __future__ import annotations

import pytest


#: the JVMs the tests start (their Spark session's, and the Spark commands' they run) compile with C1 only and
#: collect with one thread: on the tests' tiny data the C2 compiler's and G1's threads cost more CPU than they
#: save (test_audit_outer and test_spark_control: 138-159 CPU-seconds with Java's defaults, 105 with these); the
#: session's heap is 2 GiB, not Spark's 1 GiB: one JVM runs half the suite's audits, and a full run's saw an
#: aggregation find no memory (AGGREGATE_OUT_OF_MEMORY, test_audit_outer) after a dozen audits before it
TEST_JVM = "--driver-memory 2g --driver-java-options '-XX:TieredStopAtLevel=1 -XX:+UseSerialGC' pyspark-shell"


def pytest_configure(config):
    """Each xdist worker draws its free ports from a range of its own (deploy.ports), so that two tests that run
    at the same time never draw the same port between one's check and its cluster's bind; and the JVMs it starts
    are set for tiny data (TEST_JVM)."""
    import os

    from deploy.ports import port_range

    os.environ.setdefault("PYSPARK_SUBMIT_ARGS", TEST_JVM)

    worker, count = os.environ.get("PYTEST_XDIST_WORKER"), os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if worker and count and "STREAMJOIN_PORTS" not in os.environ:
        low, high = port_range()
        share = (high - low) // int(count)
        first = low + share * int(worker.removeprefix("gw"))
        os.environ["STREAMJOIN_PORTS"] = f"{first}-{first + share}"


def pytest_collection_modifyitems(items):
    for item in items:
        room = item.path.parent.name
        if room in ("unit", "cluster"):
            item.add_marker(getattr(pytest.mark, room))


#: the tests' data is tiny (thousands of rows): a query's planning, its code generation and a job per adaptive
#: stage cost more than its rows, so the tests' session plans once, interprets and shuffles into two partitions
#: (about a sixth less of the JVM's CPU in the audits); the commands' own sessions keep Spark's defaults
TINY_DATA = {
    "spark.sql.adaptive.enabled": "false",
    "spark.sql.codegen.wholeStage": "false",
    "spark.sql.shuffle.partitions": "2",
}


@pytest.fixture(scope="session")
def spark():
    from control.spark import session

    s = session(app="streamjoin-tests", settings=TINY_DATA)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def broker(tmp_path_factory):
    """A Kafka-protocol broker for a test module (tests/kafka.py), its bootstrap address: one per module, since
    noida-db rewrites its one data file every second, a cost that grows with every record a test leaves."""
    from tests.kafka import start_broker

    yield from start_broker(tmp_path_factory)


def _cpu_now():
    """Wall time, CPU seconds of this process and its reaped children, and of its live descendants by (pid, start
    time): a Spark session's JVM or a running mpirun is no reaped child until it ends, so getrusage alone misses
    what they spend."""
    import resource
    import time

    import psutil

    live = {}
    for child in psutil.Process().children(recursive=True):
        try:
            times = child.cpu_times()
            live[(child.pid, child.create_time())] = times.user + times.system
        except psutil.Error:
            pass
    own, reaped = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.monotonic(), own.ru_utime + own.ru_stime, reaped.ru_utime + reaped.ru_stime, live


def _measured(item, phase):
    """With STREAMJOIN_TEST_CPU=path, one JSON line per test phase appended to path.<worker>: its wall time and
    the CPU of the test process and its descendants, so idle = wall - CPU shows a test that waits."""
    import json
    import os

    path = os.environ.get("STREAMJOIN_TEST_CPU")
    if not path:
        yield
        return
    wall, own, reaped, live = _cpu_now()
    yield
    wall2, own2, reaped2, live2 = _cpu_now()
    ended = sum(cpu for key, cpu in live.items() if key not in live2)  # in reaped2 in full once it ends
    grown = sum(cpu - live.get(key, 0.0) for key, cpu in live2.items())
    row = {"test": item.nodeid, "phase": phase, "wall": wall2 - wall, "self": own2 - own}
    row.update(children=reaped2 - reaped - ended, live=grown, load=os.getloadavg()[0])
    with open(f"{path}.{os.environ.get('PYTEST_XDIST_WORKER', 'main')}", "a") as out:
        out.write(json.dumps(row) + "\n")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    yield from _measured(item, "setup")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    yield from _measured(item, "call")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item):
    yield from _measured(item, "teardown")
