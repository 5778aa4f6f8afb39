"""Resources sampled while a soak runs (tests.nemesis), and whether each stayed flat.

A sampler thread takes, every EVERY seconds, whatever its `take` gives: the resident memory and open files of
every rank alive then (keyed by rank: ranks restart after faults, a sample sees the ones running), the
supervisor's, the tuples in the master's mini-buffers, the checkpoints and the payload log on disk.  At the end
each series is judged against its kind's LIMITS: under an absolute bound that does not grow with the run's
length, and -- in a run long enough to tell (GROWTH_SPAN) -- not growing: its peak over the run's last third at
most GROWTH times its peak over the first two thirds (plus its kind's slack, for small values).  The first two
thirds hold the warm-up and many restarts, so a peak there is the run's ordinary worst; a resource that keeps
growing (a leak, files never removed) ends higher.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

MiB = 2**20
EVERY = 3.0  #: seconds between two samples


@dataclass(frozen=True)
class Limit:
    bound: float  #: the most a series of this kind may reach, whatever the run's length
    slack: float  #: what its last third's peak may exceed GROWTH times the first two thirds' by
    unit: str  #: how it is shown ("MiB": bytes shown in MiB)
    why: str  #: where the bound comes from


#: per kind of series (the first word of its name); None: shown, not judged (it grows with the input by design)
LIMITS: dict[str, Limit | None] = {
    "rss": Limit(768 * MiB, 48 * MiB, "MiB", "peaks of 6-minute soaks: master 264, dispatcher 249, slaves 170 MiB"),
    "fds": Limit(256, 16, "", "peaks of 6-minute soaks: master 50, dispatcher 40, slaves 29, supervisor 4"),
    "buffered": Limit(20_000, 4_000, "tuples", "peaks of 6-minute soaks 1,000-1,900 (a paused broker's catch-up)"),
    "held": Limit(64 * MiB, 8 * MiB, "MiB", "a result stream's: output.subscriber_buffer_bytes, the default 64 MiB"),
    "checkpoints": Limit(32 * MiB, 2 * MiB, "MiB", "peaks of 6-minute soaks 5-6.5 MiB: 2 kept and one being written"),
    "payload": Limit(32 * MiB, 4 * MiB, "MiB", "peak of a 6-minute soak 2.2 MiB (8.7 and growing before its fix)"),
    "output": None,  # results, late rows, the archive, metrics: the run's product, as long as its input
}
GROWTH = 1.2  #: the last third's peak over the first two thirds'
GROWTH_SPAN = 300.0  #: seconds a run must span for the growth rule (a shorter one's thirds hold a few faults)


def kind(name: str) -> str:
    return name.split()[0]


class Sampler(threading.Thread):
    """`take()` every EVERY seconds until `stop()`: it returns {series name: value} (a failing take skips its
    sample); the series, [(seconds since the start, value)] by name, in `series`."""

    def __init__(self, take: Callable[[], dict[str, float]], every: float = EVERY):
        super().__init__(daemon=True)
        self.take, self.every = take, every
        self.series: dict[str, list[tuple[float, float]]] = {}
        self.started = time.monotonic()
        self.ended: float | None = None
        self.errors = 0
        self.last_error = ""
        self._halt = threading.Event()
        self.start()

    def run(self) -> None:
        while not self._halt.wait(self.every):
            try:
                got = self.take()
            except Exception as e:  # a process gone or a folder removed between two looks: the next sample
                self.errors, self.last_error = self.errors + 1, repr(e)
                continue
            at = time.monotonic() - self.started
            for name, value in got.items():
                self.series.setdefault(name, []).append((at, float(value)))

    def stop(self) -> float:
        """Stop sampling; the span sampled (seconds)."""
        self._halt.set()
        self.join(30)
        self.ended = time.monotonic() - self.started
        return self.ended


def folder_bytes(path: Path) -> int:
    """Bytes of the files under `path` (0: none); files removed meanwhile do not count."""
    total = 0
    for f in path.rglob("*") if path.exists() else ():
        try:
            if f.is_file():
                total += f.stat().st_size
        except OSError:
            pass
    return total


@dataclass
class Verdict:
    name: str
    thirds: list[float | None]  #: the series' peak in each third of the run (None: no sample there)
    peak: float
    failure: str | None  #: why it is not flat (None: it is, or it is not judged)

    def row(self) -> tuple[str, str]:
        limit = LIMITS.get(kind(self.name))
        shown = lambda v: "-" if v is None else show(v, limit)
        bound = "not judged: grows with the input" if limit is None else f"bound {show(limit.bound, limit)}"
        unit = f" ({limit.unit})" if limit and limit.unit else " (MiB)" * (limit is None)
        return f"{self.name}{unit}", (
            f"peaks by thirds {' / '.join(shown(v) for v in self.thirds)}; {bound}"
            + (f": FAIL, {self.failure}" if self.failure else "")
        )


def show(value: float, limit: Limit | None) -> str:
    return f"{value / MiB:.1f}" if limit is None or limit.unit == "MiB" else f"{value:,.0f}"


def flatness(series: dict[str, list[tuple[float, float]]], span: float) -> list[Verdict]:
    """Each series against its kind's limit over a run of `span` seconds (see the module's docstring)."""
    out = []
    for name, points in sorted(series.items()):
        limit = LIMITS.get(kind(name))
        thirds: list[float | None] = []
        for k in range(3):
            inside = [v for t, v in points if k * span / 3 <= t < (k + 1) * span / 3 or (k == 2 and t >= span)]
            thirds.append(max(inside) if inside else None)
        peak = max(v for _, v in points)
        failure = None
        early = max((v for v in thirds[:2] if v is not None), default=None)
        if limit is None:
            pass
        elif peak > limit.bound:
            failure = f"peak {show(peak, limit)} above the bound {show(limit.bound, limit)}"
        elif span >= GROWTH_SPAN and early is not None and thirds[2] is not None:
            allowed = max(early * GROWTH, early + limit.slack)
            if thirds[2] > allowed:
                failure = (
                    f"grows: the last third's peak {show(thirds[2], limit)} is above {GROWTH:g}x the first two "
                    f"thirds' {show(early, limit)} (and their peak + {show(limit.slack, limit)})"
                )
        out.append(Verdict(name, thirds, peak, failure))
    return out
