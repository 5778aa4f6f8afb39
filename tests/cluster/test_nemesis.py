"""The nemesis soak's short form (tests/nemesis.py; `make soak` runs it for an hour): one unbounded run on three
namespace hosts, Kafka in and out, under the supervisor, meeting the faults its seed schedules for 90 s -- each
once the run is well again, so a slow machine fires fewer, never none --; then the sink topic read with
read_committed and the result files each equal the reference join of what the topics hold, once, every exit
code seen is documented, and every resource sampled stayed under its bound (tests/resources.py)."""

from __future__ import annotations

import pytest

from deploy.broker import BrokerUnavailable
from deploy.testbed import TestBedError
from tests import nemesis

SEED = 99  #: the broker SIGKILLed, a slave frozen, the dispatcher killed, the master killed, a slave killed


def test_ninety_seconds_under_a_nemesis_leave_every_output_the_reference_join_once():
    try:
        report = nemesis.run(1.5, SEED)
    except (TestBedError, BrokerUnavailable) as e:
        pytest.skip(f"no test bed or broker here: {e}")
    table = report.table()
    print(table)  # shown with -s, or beside a failure
    assert report.fired["kill-broker"] == 1 and sum(report.fired.values()) >= 2 and report.restarts >= 1, table
    assert report.ok, table
