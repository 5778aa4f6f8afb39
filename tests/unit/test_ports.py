"""Free ports: drawn in the range a process is given, never next to one it drew last."""

from __future__ import annotations

from deploy.ports import SPREAD, free_port


def test_ports_come_from_the_given_range_and_stay_apart_for_several_dispatchers(monkeypatch):
    monkeypatch.setenv("STREAMJOIN_PORTS", "12000-12400")
    drawn = [free_port(consecutive=2) for _ in range(20)]
    assert all(12000 <= p and p + 1 < 12400 for p in drawn)
    # dispatcher i binds port + i: two draws, however many dispatchers use them, never meet
    gaps = [b - a for a, b in zip(sorted(drawn), sorted(drawn)[1:])]
    assert min(gaps) > SPREAD + 1, sorted(drawn)
