"""Fault injection for the crash and channel tests; does nothing unless a test sets the variables.

`STREAMJOIN_FAULT="rank:point:n:marker"` fires at the n-th time `rank` reaches
`point` (e.g. "batch", "batch-after-checkpoint" -- a slave's batches once it has
written its part of a second checkpoint, so the first is surely complete, however
few batches a loaded machine makes --, "checkpoint" -- a slave writing its part, a
dispatcher having begun one once it has taken input (the one before is complete; live producers that start
after the cluster leave the first checkpoints empty) --, "move": the rank kills itself with
SIGKILL; "hang-batch": a slave stops answering; "drop": a dispatcher silently
skips one batch send), unless the file
`marker` exists; it creates the marker first, so a restarted cluster runs
through.  `STREAMJOIN_JITTER=s` makes a dispatcher sleep a random 0..s seconds
before each send, to shake the interleaving of several dispatchers.
`STREAMJOIN_STRAGGLER="rank:s"` makes that slave sleep s seconds in each batch's
join, a straggler on a busy host whatever the machine's speed; `STREAMJOIN_SLOW_CHUNKS="rank:s"` before each
chunk of a batch's results it writes, a long batch (a hot key's) whatever the machine's speed.
`STREAMJOIN_RAISE="rank:point:n:error"` raises an exception instead (`fail`): a full disk, a failed allocation,
a library's panic.

While a fault is `pending` (set at a point the run reaches while input comes, its marker not made yet), the
master holds its input's end back (master.sources.HeldEnd): a loaded machine that joins the whole input before
the n-th checkpoint or batch still reaches it, so the test tests what it names instead of a run that never failed.
"""

from __future__ import annotations

import errno
import os
import random
import signal
import time
from collections import Counter
from pathlib import Path

_counts: Counter = Counter()


def fires(rank: int, point: str) -> bool:
    spec = os.environ.get("STREAMJOIN_FAULT")
    if not spec:
        return False
    _counts[point] += 1
    want_rank, want_point, n, marker = spec.split(":", 3)
    if int(want_rank) != rank or want_point != point or int(n) != _counts[point]:
        return False
    try:
        Path(marker).open("x").close()
    except FileExistsError:
        return False
    return True


#: the points a run reaches while its input comes (not those of its end, as the master's last sink commit; a
#: slave's "sink-commit", its transaction at a checkpoint once it has result files, is one too)
DURING_INPUT = {"batch", "batch-after-checkpoint", "checkpoint", "hang-batch", "hang-batch-after-checkpoint", "drop"}


def pending() -> bool:
    """A fault at a point of DURING_INPUT (or a slave's sink commit) is set and has not fired yet (in this run or
    a run before it)."""
    spec = os.environ.get("STREAMJOIN_FAULT")
    if not spec:
        return False
    rank, point, _, marker = spec.split(":", 3)
    during = point in DURING_INPUT or (point == "sink-commit" and int(rank) != 0)
    return during and not Path(marker).exists()


def reached(rank: int, point: str) -> None:
    """Die here if the fault names this point."""
    if fires(rank, point):
        os.kill(os.getpid(), signal.SIGKILL)


def at_batch(rank: int, after_checkpoint: bool) -> None:
    """A slave's batch: the faults of "batch", and of "batch-after-checkpoint" once it has written its part of a
    second checkpoint (so the first is complete)."""
    reached(rank, "batch")
    hangs(rank, "batch")
    if after_checkpoint:
        reached(rank, "batch-after-checkpoint")
        hangs(rank, "batch-after-checkpoint")
    fail("batch")


def hangs(rank: int, point: str) -> None:
    """Stop answering here (a rank that waits for something that never comes) if the fault names
    "hang-<point>": the master's stall watch must end the job."""
    if fires(rank, f"hang-{point}"):
        time.sleep(3600)


def jitter() -> None:
    most = float(os.environ.get("STREAMJOIN_JITTER") or 0)
    if most:
        time.sleep(random.uniform(0, most))


def straggle(rank: int, variable: str = "STREAMJOIN_STRAGGLER") -> None:
    spec = os.environ.get(variable)
    if spec:
        want_rank, seconds = spec.split(":")
        if int(want_rank) == rank:
            time.sleep(float(seconds))


_raised: Counter = Counter()


class Panic(BaseException):
    """What a compiled library's panic raises into Python: pyo3's PanicException (polars) is no Exception."""


def fail(point: str) -> None:
    """Raise the error `STREAMJOIN_RAISE="rank:point:n:error"` names when this rank reaches `point` the n-th
    time: `error` is MemoryError, panic (a BaseException) or an errno name (ENOSPC, EROFS, ...) raised as that
    OSError.  The rank is the MPI launcher's (OMPI_COMM_WORLD_RANK), so code with no communicator at hand (file
    writes) can fail too."""
    spec = os.environ.get("STREAMJOIN_RAISE")
    if not spec:
        return
    _raised[point] += 1
    want_rank, want_point, n, error = spec.split(":")
    if want_rank != os.environ.get("OMPI_COMM_WORLD_RANK") or want_point != point or int(n) != _raised[point]:
        return
    if error == "MemoryError":
        raise MemoryError(f"injected at {point}")
    if error == "panic":
        raise Panic(f"injected at {point}")
    code = getattr(errno, error)
    raise OSError(code, os.strerror(code))
