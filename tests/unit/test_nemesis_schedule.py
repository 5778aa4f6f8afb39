"""The nemesis soak's schedule (tests/nemesis.py) is the seed's alone: the same seed draws the same faults, gaps,
holds and victims, so a failing soak is replayed by its seed; each round fires every kind of fault once.  Its
reference keeps the first copy of an id a fenced producer sent again, as the engine's duplicate-id check does."""

from __future__ import annotations

import numpy as np

from tests.nemesis import FAULTS, first_copies, first_results, schedule


def test_a_seed_draws_its_schedule_again_and_each_round_has_every_fault_once():
    first = schedule(7)
    assert schedule(7) == first and schedule(8) != first
    for start in range(0, 80, len(FAULTS)):
        assert sorted(step.fault for step in first[start : start + len(FAULTS)]) == sorted(FAULTS)
    assert all(2 <= s.gap <= 12 and 3 <= s.hold <= 10 for s in first)


def test_the_first_new_result_after_a_fault_is_past_what_the_crashed_run_made():
    """Seconds from each fault to the first progress line counting more results than the dispatcher's lines
    before the restart the fault caused (the crashed run's last results and the replay do not count), or than
    before the fault if it was ridden out; None when none came."""
    line = lambda d, n: (
        (f"[dispatcher {d}] " if d else "")
        + f"[   1.0s] in 10 (1/s) | results {n:,} | late 0 | "
        + ("delay p50 0.1s p99 0.2s | buffered 3 | slaves 3/3 | moves 0")
    )
    lines = [
        (101.0, line(0, 1000)),
        (101.0, line(1, 50)),
        (106.0, line(0, 1200)),  # the fault at 105 has not ended this run yet
        (107.0, "supervise: the cluster crashed (exit code 4); restart 1 of 1000 from the newest complete checkpoint"),
        (110.0, line(0, 900)),  # counting on from the checkpoint
        (112.0, line(0, 1150)),
        (113.0, line(0, 1250)),
        (121.0, line(1, 50)),
        (122.0, line(1, 60)),
    ]
    faults = [{"at": 5.0}, {"at": 20.0}, {"at": 30.0}]
    assert first_results(lines, faults, 100.0) == [8.0, 2.0, None]


def test_the_reference_keeps_each_ids_first_copy_by_partition_and_offset():
    held = {
        "id": np.array([7, 5, 7, 9, 5]),
        "partition": np.array([1, 0, 1, 2, 0]),
        "offset": np.array([40, 12, 3, 8, 30]),
        "at": np.array([1, 2, 3, 4, 5]),
    }
    first, later = first_copies(held)
    assert sorted(zip(first["id"].tolist(), first["offset"].tolist())) == [(5, 12), (7, 3), (9, 8)]
    assert later.tolist() == [0, 4]  # rows of held: id 7 at offset 40, id 5 at offset 30
