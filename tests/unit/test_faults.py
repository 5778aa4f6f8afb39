"""A pending fault (protocol.faults.pending) holds the input's end back (master.sources.HeldEnd) until it fires:
points a run reaches while its input comes, a slave's sink commit among them, never the master's end commit."""

from __future__ import annotations

import pytest

from protocol import faults


@pytest.mark.parametrize(
    "spec,held",
    [
        ("1:batch-after-checkpoint:6", True),
        ("0:checkpoint:4", True),
        ("2:sink-commit:1", True),  # a slave's transaction comes at a checkpoint once it has result files
        ("0:sink-commit:1", False),  # the master's comes at the end: holding the end back would never reach it
        ("0:move:1", False),
    ],
)
def test_a_fault_is_pending_at_points_of_the_input_until_its_marker_exists(tmp_path, monkeypatch, spec, held):
    marker = tmp_path / "fired"
    monkeypatch.setenv("STREAMJOIN_FAULT", f"{spec}:{marker}")
    assert faults.pending() is held
    marker.touch()
    assert faults.pending() is False
