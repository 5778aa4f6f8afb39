"""Fault injection for the crash tests: a rank kills itself with SIGKILL at a named point, once.

`STREAMJOIN_FAULT="rank:point:n:marker"` makes `rank` die at the n-th time it
reaches `point` (e.g. "batch", "checkpoint", "move"), unless the file `marker`
exists; it creates the marker first, so the restarted cluster runs through.
Unset (always, outside tests), `reached` only counts.
"""
from __future__ import annotations

import os
import signal
from collections import Counter
from pathlib import Path

_counts: Counter = Counter()


def reached(rank: int, point: str) -> None:
    spec = os.environ.get("STREAMJOIN_FAULT")
    if not spec:
        return
    _counts[point] += 1
    want_rank, want_point, n, marker = spec.split(":", 3)
    if int(want_rank) == rank and want_point == point and int(n) == _counts[point]:
        try:
            Path(marker).open("x").close()
        except FileExistsError:
            return
        os.kill(os.getpid(), signal.SIGKILL)
