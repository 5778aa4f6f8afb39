"""The master's desks: plain classes around the one loop of master/run.py, with no MPI of their own.

Each desk keeps one concern of the master (paper 003, Algorithm 1): ingest,
distribution per sub-group slot, moves, hot keys, the checkpoint cut.  They
share the mini-buffers, the controller, the counters and the configuration,
ask for messages, orders, lines and files as effects (channels.py) and never import each other;
where one must know another's state the loop passes it a small answer.
"""

from __future__ import annotations

from typing import Callable


def may_serve(quiet_wanted: bool, move_waits: set[int], hot_waits: bool) -> Callable[[int], bool] | None:
    """The rule for serving a slave owed a batch out of its slot (paper 003, V-B), from the desks' answers:
    nobody while a checkpoint wants quiet (None: they stay owed); else not a slave a queued move waits to find
    idle (IV-C), and none while a hot key's split or merge waits for its owner to be idle."""
    if quiet_wanted:
        return None
    return lambda rank: not hot_waits and rank not in move_waits
