"""When a run started and what a rank weighs before data: the start-up numbers of the summary and the bench.

Start and shutdown can weigh more than the join (a 10M-tuple file joined in 2.9 s inside a 6.6 s process),
so the summary reports them beside the in-run rate: from the launch (deploy.launch puts its clock in
STREAMJOIN_LAUNCHED; under a bare mpirun, the start of the rank's parent, Open MPI's prterun) to all ranks
ready, to the first tuple ingested and to the last result written.  PSS (proportional set size) counts the
shared libraries once across the ranks, where RSS counts them in each: it is what 17 ranks really cost.
"""

from __future__ import annotations

import json
import os
import sys

import psutil

LAUNCHED = "STREAMJOIN_LAUNCHED"
PLACED_HOSTS = "STREAMJOIN_PLACED_HOSTS"  #: set by deploy.launch: the number of hosts its placement uses
RESTARTS = "STREAMJOIN_RESTARTS"  #: set by control.supervise: its restarts so far, as JSON (the summary's)
LAUNCHERS = ("prterun", "mpirun", "mpiexec", "orterun")
#: Open MPI's byte transfer layers: loopback, shared memory, TCP between hosts.  Left to choose, MPI_Init also
#: probes every other component (libfabric's), which waits about a second in each rank where there is no such
#: fabric.  deploy.launch sets it for mpirun, the ranks for themselves under a bare mpirun; a value the user
#: exported, or mpirun's `--mca btl`, wins.
BTL = "self,sm,tcp"


class _NoPandas:
    """An import finder that says pandas is not installed (`without_pandas`)."""

    @staticmethod
    def find_spec(name: str, path=None, target=None):
        if name.partition(".")[0] == "pandas":
            raise ModuleNotFoundError("the ranks do not use pandas (protocol.startup.without_pandas)", name=name)
        return None


def without_pandas() -> None:
    """No rank uses pandas, but pyarrow imports it at its first conversion of a numpy array, only to ask whether
    that is a pandas object: 0.3 s of CPU in each rank's first batch (17 ranks on 2 cores: seconds).  Told that
    pandas is absent, pyarrow knows it is not.  A process that has pandas already keeps it."""
    if "pandas" not in sys.modules and _NoPandas not in sys.meta_path:
        sys.meta_path.insert(0, _NoPandas)


def whole_lines() -> None:
    """A rank's stderr line leaves in one write, not as print's text and then its newline: Open MPI forwards a
    rank's stderr in the pieces it reads and sends its own abort message another way, which could land between
    the two (an error line cut by MPI_ABORT's banner)."""
    sys.stderr.reconfigure(write_through=False)


def early_importers(ranks: int, cores: int) -> int:
    """How many ranks import the slave's modules beside rank 0 (the last ones: slaves, since the config leaves at
    least one); the others wait for its first batch, so that it reads on a core of its own.  As many as the cores
    it leaves idle -- or all, if the slaves are no more than the cores: the last would otherwise import alone
    while a core has nothing to do."""
    return ranks - 1 if ranks - 1 <= cores else cores - 1


def launched_at() -> float:
    """Unix time the job was launched."""
    if LAUNCHED in os.environ:
        return float(os.environ[LAUNCHED])
    me = psutil.Process()
    parent = me.parent()
    return parent.create_time() if parent is not None and parent.name() in LAUNCHERS else me.create_time()


def restarts() -> list[dict]:
    """The supervisor's restarts before this run (each: after which exit code, the hosts and slaves used)."""
    return json.loads(os.environ.get(RESTARTS) or "[]")


def pss_bytes() -> int:
    """This process's proportional set size (0 where the kernel does not report it)."""
    return int(getattr(psutil.Process().memory_full_info(), "pss", 0))
