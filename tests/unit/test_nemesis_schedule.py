"""The nemesis soak's schedule (tests/nemesis.py) is the seed's alone: the same seed draws the same faults, gaps,
holds and victims, so a failing soak is replayed by its seed; each round fires every kind of fault once."""

from __future__ import annotations

from tests.nemesis import FAULTS, schedule


def test_a_seed_draws_its_schedule_again_and_each_round_has_every_fault_once():
    first = schedule(7)
    assert schedule(7) == first and schedule(8) != first
    for start in range(0, 80, len(FAULTS)):
        assert sorted(step.fault for step in first[start : start + len(FAULTS)]) == sorted(FAULTS)
    assert all(2 <= s.gap <= 12 and 3 <= s.hold <= 10 for s in first)
