"""When to look for a message expected at a known moment (pure: the MPI waiting is protocol.mpi's).

A slave knows when its next batch is due (one distribution epoch after the last from each dispatcher, at its
slot: paper 003, V-B), so it sleeps until just before and then looks often, instead of sleeping in backed-off
steps that would see the batch up to half a step late.
"""

from __future__ import annotations

import math

#: waiting for a message expected at a known moment (`soon`): poll this often from SOON_LEAD before it to
#: SOON_WINDOW after it (a message seen late would teach a later `soon`: the lead lets it come back)
SOON_PAUSE, SOON_LEAD, SOON_WINDOW = 2.5e-4, 0.003, 0.01


def sleep_for(pause: float, now: float, soon: float | None) -> float:
    """The next sleep of `_poll`: `pause`, cut short where a message is expected `soon`."""
    if soon is None or now >= soon + SOON_WINDOW:
        return pause
    return min(pause, max(soon - SOON_LEAD - now, SOON_PAUSE))


def next_arrival(came: list[float], period: float, now: float) -> float | None:
    """When the next of several periodic messages should come: each channel's last came at `came` (None: none
    yet) and comes a whole number of `period`s later; the soonest not yet SOON_WINDOW past `now`."""
    return min(
        (t + max(1, math.ceil((now - SOON_WINDOW - t) / period)) * period for t in came if t is not None), default=None
    )
